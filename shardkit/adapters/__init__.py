"""Format adapters: what is on disk -> the entry table (`CheckpointIndex`) the reader reads.

One reader (`shardkit.io.reader.CheckpointReader`) reads every layout; an adapter only turns a
layout's manifest (and, when the manifest lacks them, its shard headers) into a
`CheckpointIndex`: keys, dtypes, global shapes, devices, shards (file, task, codec, bytes) and
slices (tensor, spec, shard, xxh3 or None). The reader then maps, slices and verifies as for
shardkit's own checkpoints. Adapters open files only through the `CheckpointDirectory` they are
given (`shardkit.shards.files`: the checkpoint's directory handle, regular files, no symlinks unless
asked) and name every file they open with `format.check_shard_file_name` first.

`detect` picks the adapter (`SHARDKIT`, `HUGGINGFACE`, `SAFETENSORS`, `DCP`, `TORCH_SAVE`,
`TENSORBUNDLE`) in the
order of docs/FORMAT.md section 11; a file or a TensorFlow prefix is found through its parent
directory's handle (`shards.files.locate`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from ..errors import CheckpointNotFoundError, CheckpointReplacedError
from ..format import (
    LEGACY_MANIFEST_FILE,
    MANIFEST_FILE,
    MANIFEST_FILES,
    MAX_INDEX_BYTES,
    CheckpointIndex,
)
from ..optional import lazy_import
from ..shards.files import BUNDLE_INDEX_SUFFIX, TORCH_SAVE_SUFFIXES, CheckpointDirectory
from .base import FormatAdapter, ParsedHeader
from .dcp import DCP, METADATA_FILE, RANK_METADATA_FILE, TORCH_SAVE
from .huggingface import HUGGINGFACE, SAFETENSORS
from .shardkit import SHARDKIT
from .tensorbundle.adapter import TENSORBUNDLE, state_target
from .tensorbundle.names import STATE_FILE as TF_STATE_FILE

if TYPE_CHECKING:
    import orjson
else:
    orjson = lazy_import("orjson", "a checkpoint's manifest")

HF_SINGLE_FILE: Final = "model.safetensors"
"""The one file of an unsharded ``save_pretrained`` (transformers' SAFE_WEIGHTS_NAME)."""


def detect(directory: CheckpointDirectory, single: str | None = None
           ) -> tuple[FormatAdapter, str, bytes | None]:
    """The layout of the checkpoint in `directory` (opened), or of its file `single`: the
    adapter, the file its table comes from (the manifest, or the single safetensors file), and
    the manifest's bytes (None for a single file)."""
    if single is not None:
        if single.endswith(BUNDLE_INDEX_SUFFIX):
            return TENSORBUNDLE, single, None
        if single.endswith(TORCH_SAVE_SUFFIXES):
            return TORCH_SAVE, single, None
        return SAFETENSORS, single, None
    for name in MANIFEST_FILES:
        data = directory.read_manifest(name, MAX_INDEX_BYTES)
        if data is None:
            continue
        if name == LEGACY_MANIFEST_FILE or _is_shardkit(data):
            return SHARDKIT, name, data
        return HUGGINGFACE, name, data
    if directory.has(HF_SINGLE_FILE):
        return SAFETENSORS, HF_SINGLE_FILE, None
    if directory.has(METADATA_FILE):  # torch.distributed.checkpoint's FileSystemWriter
        return DCP, METADATA_FILE, None
    if directory.has(RANK_METADATA_FILE):  # the same, saved with use_collectives=False
        return DCP, RANK_METADATA_FILE, None
    if directory.has(TF_STATE_FILE):  # tf.train.CheckpointManager's directory: its latest
        latest = state_target(directory)
        if latest is not None:
            return TENSORBUNDLE, latest, None
    # replaced since it was opened: an overwrite deletes the old directory's files before the
    # directory itself (a store's objects are never replaced, only deleted)
    if directory.replaced():
        raise CheckpointReplacedError(
            f"{directory.path}: the checkpoint was replaced while it was being opened; open it "
            "again to read the new one")
    raise CheckpointNotFoundError(
        f"no checkpoint at {directory.path}: {MANIFEST_FILE} is missing (nor is there an "
        f"{LEGACY_MANIFEST_FILE} of format 2.0/2.1, or a {HF_SINGLE_FILE}, or PyTorch DCP's "
        f"{METADATA_FILE} (or {RANK_METADATA_FILE}), or TensorFlow's {TF_STATE_FILE} state "
        "file; an unfinished save leaves no manifest; the directory is not a complete shardkit "
        "checkpoint)"
    )


def read_index(directory: CheckpointDirectory, single: str | None = None,
               headers: dict[int, ParsedHeader] | None = None
               ) -> tuple[FormatAdapter, str, CheckpointIndex]:
    """`detect`, then the adapter's table: (adapter, the file it came from, the index); the
    shard headers the adapter parsed on the way go into `headers`."""
    adapter, name, data = detect(directory, single)
    return adapter, name, adapter.read_index(directory, name, data, headers)


def _is_shardkit(data: bytes) -> bool:
    """Whether a manifest is shardkit's: it has the ``shardkit`` section (or says
    ``"format": "shardkit"``, so that a broken shardkit index is reported as one)."""
    if data.startswith(b'{"format":"shardkit"'):  # what shardkit writes: no parse needed
        return True
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return b'"shardkit"' in data  # unparseable: the adapter it names reports it
    return type(doc) is dict and ("shardkit" in doc or doc.get("format") == "shardkit")


__all__ = [
    "DCP", "HF_SINGLE_FILE", "HUGGINGFACE", "SAFETENSORS", "SHARDKIT", "TENSORBUNDLE",
    "TORCH_SAVE", "FormatAdapter", "ParsedHeader", "detect", "read_index",
]
