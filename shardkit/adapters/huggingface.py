"""HuggingFace layouts: a sharded directory (``model.safetensors.index.json``: ``metadata`` +
``weight_map``, shards such as ``model-00001-of-00003.safetensors``, as transformers'
``save_pretrained`` and huggingface_hub's ``save_torch_state_dict`` write them) and a single
``.safetensors`` file (any: ``safetensors.*.save_file``, an unsharded ``save_pretrained``).

Neither records dtypes, shapes or checksums in a manifest: the table is built from each shard's
safetensors header (read and fully checked here, on open; the data is not read). Tensors are
listed shard by shard (shards in file-name order), each shard's in data-region order. The
weight_map and the headers must agree exactly: every key in the shard it names, no key in a
shard the weight_map does not put it in. Nothing is checksummed (``slice_xxh3`` all None).
"""

from __future__ import annotations

from contextlib import closing
from operator import attrgetter
from typing import Any

from ..errors import CorruptHeaderError, CorruptIndexError
from ..format import (
    CheckpointIndex,
    EntryLayout,
    ShardInfo,
    check_shard_file_name,
    pairs_to_dict,
    pairs_to_plain,
    parse_strict_object,
    read_safetensors_header,
    shown,
)
from ..sharding.tensors import DEFAULT_DEVICE
from ..shards.files import CheckpointDirectory
from ..values.keys import check_keys
from .base import FormatAdapter, ParsedHeader

RAW = "raw"
_data_order = attrgetter("begin", "end", "order_index")


def _shard_header(directory: CheckpointDirectory, file: str, listed_in: str
                  ) -> tuple[list[EntryLayout], int, ParsedHeader]:
    """The entries of safetensors file `file` in data-region order, its size, and the parsed
    header; the header is checked in full (`format.read_safetensors_header`)."""
    with closing(directory.open_shard(file, listed_in)) as f:
        entries, metadata, data_start = read_safetensors_header(f.read, f.size, f.path)
        stamp = f.stamp()
    ordered = sorted(entries.values(), key=_data_order)
    return ordered, f.size, ParsedHeader(entries, metadata, data_start, stamp)


def _table(files: list[str], sizes: list[int], keys: list[str], dtypes: list[str],
           shapes: list[tuple[int, ...]], shard_of: list[int], metadata: dict[str, Any],
           description: str) -> CheckpointIndex:
    n = len(keys)
    return CheckpointIndex(
        description, [ShardInfo(f, 0, RAW, b) for f, b in zip(files, sizes)], keys, dtypes,
        shapes, [DEFAULT_DEVICE] * n, list(range(n)), [""] * n, shard_of, [None] * n,
        metadata, "",
    )


class SafetensorsFile(FormatAdapter):
    """One ``.safetensors`` file: a one-shard table; user metadata = its ``__metadata__``."""

    name = "safetensors"
    description = "safetensors file"
    checksums = False

    def read_index(self, directory: CheckpointDirectory, name: str, data: bytes | None,
                   headers: dict[int, ParsedHeader] | None = None) -> CheckpointIndex:
        path = directory.join(name)
        check_shard_file_name(name, path)
        entries, size, parsed = _shard_header(directory, name, name)
        if headers is not None:
            headers[0] = parsed
        metadata = parsed.metadata
        keys = [e.name for e in entries]
        check_keys(keys, error=CorruptHeaderError, where=f"{path}: ")
        return _table([name], [size], keys, [e.dtype_name for e in entries],
                      [e.shape for e in entries], [0] * len(keys), dict(metadata),
                      "(none: a single safetensors file)")


class HuggingFaceSharded(FormatAdapter):
    """``model.safetensors.index.json`` + the shards its weight_map names; user metadata =
    the index's ``metadata`` (e.g. ``{"total_size": ...}``)."""

    name = "huggingface"
    description = "HuggingFace sharded safetensors checkpoint"
    checksums = False

    def read_index(self, directory: CheckpointDirectory, name: str, data: bytes | None,
                   headers: dict[int, ParsedHeader] | None = None) -> CheckpointIndex:
        assert data is not None
        path = directory.join(name)
        err = CorruptIndexError
        doc = pairs_to_dict(parse_strict_object(data, path, err, ""), name, path, err)
        if "weight_map" not in doc:
            raise err(f"{path}: missing field weight_map (not a HuggingFace sharded index)")
        raw_map = doc["weight_map"]
        if type(raw_map) is not tuple:
            raise err(f"{path}: field weight_map must be a JSON object (key -> shard file), "
                      f"found {shown(pairs_to_plain(raw_map, name, path, err, 2))}")
        weight_map = pairs_to_dict(raw_map, "weight_map", path, err)
        metadata = pairs_to_plain(doc.get("metadata", ()), name, path, err, 2)
        if not isinstance(metadata, dict):
            raise err(f"{path}: field metadata must be a JSON object, found {shown(metadata)}")
        bad = next((k for k, v in weight_map.items() if type(v) is not str), None)
        if bad is not None:
            found = pairs_to_plain(weight_map[bad], name, path, err, 3)
            raise err(f"{path}: weight_map: key {shown(bad)} must name a shard file (a "
                      f"string), found {shown(found)}")
        files = sorted(set(weight_map.values()))
        for file in files:
            check_shard_file_name(file, path)
            if file == name:
                raise err(f"{path}: weight_map names the index itself as a shard file")
        keys: list[str] = []
        dtypes: list[str] = []
        shapes: list[tuple[int, ...]] = []
        shard_of: list[int] = []
        sizes: list[int] = []
        for i, file in enumerate(files):
            entries, size, parsed = _shard_header(directory, file, name)
            if headers is not None:
                headers[i] = parsed
            sizes.append(size)
            for e in entries:
                owner = weight_map.get(e.name)
                if owner != file:
                    where = (f"which weight_map puts in {shown(owner)}" if owner is not None
                             else "which weight_map does not list")
                    raise err(f"{path}: shard {shown(file)} holds tensor {shown(e.name)}, "
                              f"{where} (the index and the shards disagree)")
                keys.append(e.name)
                dtypes.append(e.dtype_name)
                shapes.append(e.shape)
            shard_of += [i] * len(entries)
        if len(keys) != len(weight_map):
            seen = set(keys)
            key = next(k for k in weight_map if k not in seen)
            raise err(f"{path}: weight_map puts tensor {shown(key)} in shard "
                      f"{shown(weight_map[key])}, which has no entry by that name")
        check_keys(keys, error=err, where=f"{path}: weight_map: ")
        return _table(files, sizes, keys, dtypes, shapes, shard_of, metadata,
                      "(none: a HuggingFace sharded checkpoint)")


SAFETENSORS = SafetensorsFile()
HUGGINGFACE = HuggingFaceSharded()
__all__ = ["HUGGINGFACE", "SAFETENSORS", "HuggingFaceSharded", "SafetensorsFile"]
