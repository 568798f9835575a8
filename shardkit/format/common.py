"""Shared by the format's modules: the constants and limits of format v2, values as error
messages show them (`shown`), file and entry names, the manifest's lookup, checkpoint
generations."""

from __future__ import annotations

import os
import reprlib
import uuid
from collections.abc import Mapping
from typing import Any, Final

from ..errors import CorruptIndexError, GenerationMismatchError, ShardPathError
from ..values.dtypes import SAFETENSORS_NAMES, itemsize
from ..values.slices import WHOLE

FORMAT_NAME: Final = "shardkit"
FORMAT_VERSION: Final = "2.2"
STRINGS_VERSION: Final = "2.3"  # recorded instead when there are string tensors (section 2.3)
STRINGS_MINOR: Final = int(STRINGS_VERSION.rpartition(".")[2])
FORMAT_MAJOR: Final = 2
GENERATION_MINOR: Final = 1  # from format 2.1 on, every manifest records its generation (2.1)
# The manifest: HuggingFace's name for a sharded checkpoint's index (format 2.2 on), then the
# name of formats 2.0 and 2.1. `find_manifest` is the one lookup; writers write MANIFEST_FILE.
MANIFEST_FILE: Final = "model.safetensors.index.json"
LEGACY_MANIFEST_FILE: Final = "index.json"
MANIFEST_FILES: Final = (MANIFEST_FILE, LEGACY_MANIFEST_FILE)
INDEX_FILE: Final = MANIFEST_FILE  # the manifest a save writes (alias kept for callers)
HEADER_FORMAT: Final = "pt"  # __metadata__.format of a shard: what HuggingFace loaders accept
SHARDKIT_KEY: Final = "shardkit"  # __metadata__.shardkit: the format version of the writer
MAX_HEADER_BYTES: Final = 100 * 1024 * 1024
MAX_INDEX_BYTES: Final = 1024 * 1024 * 1024
RAW_SUFFIX: Final = ".safetensors"
ZSTD_SUFFIX: Final = ".skz"
CODEC_SUFFIXES: Final[dict[str, str]] = {"raw": RAW_SUFFIX, "zstd": ZSTD_SUFFIX}
HEADER_ALIGNMENT: Final = 8
MAX_DEPTH: Final = 64  # JSON nesting levels in the manifest and headers (the top object is 1)
MAX_NDIM: Final = 64  # dimensions of a tensor (numpy 2's limit)
MAX_NBYTES: Final = 2**63 - 1  # bytes of a tensor, zero dimensions left out (numpy's limit)
MAX_FILE_NAME_BYTES: Final = 255  # a file name named by a manifest, UTF-8 (NAME_MAX)
_INT_DIGITS: Final = 4300  # Python's int-string conversion limit (sys.int_info)
METADATA_KEY: Final = "__metadata__"
GENERATION_KEY: Final = "generation"  # in the manifest's shardkit section and in __metadata__

_ITEMSIZE: Final[dict[str, int]] = {name: itemsize(name) for name in SAFETENSORS_NAMES}


class _Shown(reprlib.Repr):
    """repr() for values read from a file: bounded depth, items and length, safe for ints of
    any size (repr of a 5,000-digit int raises ValueError) and for any nesting."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 4
        self.maxtuple = self.maxlist = self.maxdict = self.maxset = 4
        self.maxstring, self.maxlong, self.maxother = 60, 40, 60

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:
            return f"<integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHOWN: Final = _Shown()


def shown(value: Any, limit: int = 80) -> str:
    """`value` as an error message shows it: its repr, truncated to about `limit` characters
    (a hostile file may hold megabytes in one string, or deep nesting)."""
    try:
        text = _SHOWN.repr(value)
    except Exception:  # a repr that fails must not hide the real error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def find_manifest(directory: str | os.PathLike[str] | int) -> str | None:
    """The name of the manifest of the checkpoint `directory` (a path, or an open directory
    descriptor): the first of `MANIFEST_FILES` present in it (a symbolic link counts as
    present; opening it decides), or None when there is none. Read-only: one ``lstat`` each."""
    for name in MANIFEST_FILES:
        try:
            if isinstance(directory, int):
                os.stat(name, dir_fd=directory, follow_symlinks=False)
            else:
                os.lstat(os.path.join(directory, name))
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:  # present but not statable (permissions): opening it words the error
            return name
        return name
    return None


def shard_file_name(index: int, count: int, codec: str = "raw") -> str:
    """HuggingFace's name for shard `index` (0-based) of `count`, numbered from 1:
    ``model-00001-of-00003.safetensors`` (``.skz`` for codec ``"zstd"``). Checkpoints of
    format 2.0 / 2.1 named them ``shard-00000-of-00003.safetensors``; readers take the names
    the manifest lists."""
    try:
        suffix = CODEC_SUFFIXES[codec]
    except KeyError:
        raise ValueError(f"unknown codec {codec!r}; known: {', '.join(CODEC_SUFFIXES)}") from None
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} is outside 0..{count - 1}")
    return f"model-{index + 1:05d}-of-{count:05d}{suffix}"


def entry_name(key: str, slice_spec: str = WHOLE) -> str:
    """The entry name in a shard: the key for a whole tensor, ``"key:spec"`` for a slice."""
    return key if slice_spec == WHOLE else f"{key}:{slice_spec}"


def new_generation() -> str:
    """A fresh checkpoint generation: 32 random lowercase hex digits (a UUID4), one per save."""
    return uuid.uuid4().hex


def shard_metadata(generation: str | None) -> dict[str, str]:
    """The ``__metadata__`` a writer puts in a shard header of a checkpoint of `generation`:
    ``{"format": "pt", "shardkit": "2.2", "generation": ...}`` (format 2.2; "pt" is what
    HuggingFace's loaders require, "shardkit" names the format version that wrote it)."""
    if generation is None:
        return {"format": HEADER_FORMAT, SHARDKIT_KEY: FORMAT_VERSION}
    return {"format": HEADER_FORMAT, SHARDKIT_KEY: FORMAT_VERSION, GENERATION_KEY: generation}


def legacy_shard_metadata(generation: str | None) -> dict[str, str]:
    """The ``__metadata__`` of a shard written by format 2.0 / 2.1: ``{"format": "shardkit"}``
    (2.0), then the generation (2.1)."""
    if generation is None:
        return {"format": FORMAT_NAME}
    return {"format": FORMAT_NAME, GENERATION_KEY: generation}


_LEGACY_HEAD: Final = b'{"__metadata__":{"format":"shardkit"'


def check_generation(metadata: Mapping[str, Any], expected: str | None, path: str) -> None:
    """The shard at `path`, whose header has `metadata`, must be of generation `expected`
    (the manifest's); None (a 2.0 index, which records none) checks nothing.

    GenerationMismatchError otherwise: the shard belongs to another checkpoint."""
    if expected is None:
        return
    found = metadata.get(GENERATION_KEY)
    if found == expected:
        return
    found_text = "none" if found is None else shown(found)
    raise GenerationMismatchError(
        f"{path}: shard belongs to another checkpoint: the manifest is of generation "
        f"{expected}, the shard header records generation {found_text} (the directory mixes files "
        "of different saves, or was partially replaced); a reader reads one generation only"
    )


def check_shard_file_name(name: Any, path: str) -> str:
    """`name` if it is a plain file name inside the checkpoint directory, else ShardPathError."""
    if not isinstance(name, str) or not name:
        raise CorruptIndexError(f"{path}: shard file name must be a non-empty string, got "
                                f"{shown(name)}")
    if (
        "/" in name
        or "\\" in name
        or "\0" in name
        or name in (".", "..")
        or name.startswith("..")
        or os.path.isabs(name)
        or (len(name) > 1 and name[1] == ":")  # Windows drive
        or name in MANIFEST_FILES
        or len(name.encode("utf-8", "surrogatepass")) > MAX_FILE_NAME_BYTES
        or not _encodable(name)
    ):
        raise ShardPathError(
            f"{path}: shard file name {shown(name)} is not a plain file name inside the "
            f"checkpoint "
            f"directory (no '/', '\\', '..', absolute paths, drive letters, NUL, lone "
            f"surrogates, {MANIFEST_FILE} or {LEGACY_MANIFEST_FILE}; at most "
            f"{MAX_FILE_NAME_BYTES} bytes of UTF-8)"
        )
    return name


def _encodable(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no file name can hold one
        return False
    return True
