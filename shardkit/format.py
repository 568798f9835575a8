"""Checkpoint format v2: pure encode/decode of shard headers and the manifest, with every limit.

A raw shard is a safetensors file: ``u64`` little-endian header length N, N bytes of UTF-8 JSON
padded with spaces so that ``8 + N`` is a multiple of 8, then the data region. Entries are laid out
by descending item size (stable), contiguous, so each starts aligned to its item size.
``docs/FORMAT.md`` is the full specification. Nothing here writes files; decoders read only the
bytes they were given (``read_safetensors_header`` reads the header from an open file).
"""

from __future__ import annotations

import json
import math
import operator
import os
import re
import reprlib
import struct
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain, repeat
from typing import Any, BinaryIO, Final

import numpy as np
import orjson

from ._kernels import _table
from .dtypes import SAFETENSORS_NAMES, itemsize, safetensors_name
from .errors import (
    CheckpointFormatError,
    CorruptHeaderError,
    CorruptIndexError,
    EntryLayoutError,
    GenerationMismatchError,
    ShardPathError,
    SliceSpecError,
    TruncatedShardError,
    UnsupportedVersionError,
)
from .keys import check_keys
from .slices import WHOLE, SliceSpec, check_tiling, parse_slice_spec
from .tensors import _columns_constructor, _gc_paused

FORMAT_NAME: Final = "shardkit"
FORMAT_VERSION: Final = "2.2"
STRINGS_VERSION: Final = "2.3"  # recorded instead when there are string tensors (section 2.3)
STRINGS_MINOR: Final = int(STRINGS_VERSION.rpartition(".")[2])
FORMAT_MAJOR: Final = 2
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
_INT_DIGITS: Final = 4300  # Python's int-string conversion limit (sys.int_info)
METADATA_KEY: Final = "__metadata__"
GENERATION_KEY: Final = "generation"  # in the manifest's shardkit section and in __metadata__

_ITEMSIZE: Final[dict[str, int]] = {name: itemsize(name) for name in SAFETENSORS_NAMES}
_XXH3_RE: Final = re.compile(r"[0-9a-f]{16}")
_GENERATION_RE: Final = re.compile(r"[0-9A-Za-z_.-]{1,64}")
_LEN = struct.Struct("<Q")


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


def _shown(value: Any, limit: int = 80) -> str:
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
    shown = "none" if found is None else _shown(found)
    raise GenerationMismatchError(
        f"{path}: shard belongs to another checkpoint: the manifest is of generation "
        f"{expected}, the shard header records generation {shown} (the directory mixes files "
        "of different saves, or was partially replaced); a reader reads one generation only"
    )


# --- shard header -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EntryLayout:
    """One entry of a shard: where its bytes are, relative to the start of the data region.

    `order_index` is the entry's position in the input of `layout_entries` (writer side) or in the
    header (reader side).
    """

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    begin: int
    end: int
    order_index: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


_new_entry_layouts = _columns_constructor(EntryLayout)


def layout_entries(entries: Sequence[tuple[str, np.dtype, Sequence[int]]]) -> list[EntryLayout]:
    """Order `entries` (name, dtype, shape) by descending item size, stably, with offsets.

    Offsets are contiguous from 0. Item sizes are powers of two, so every entry starts at a
    multiple of its own item size (and the data region itself starts at a multiple of 8).
    """
    return _new_entry_layouts(*_layout_columns(entries))


_Columns = tuple[list[str], list[str], list[tuple[int, ...]], list[int], list[int], Sequence[int]]


def _layout_columns(entries: Sequence[tuple[str, np.dtype, Sequence[int]]]) -> _Columns:
    """`layout_entries` as columns: names, dtype names, shapes, begins, ends, input positions."""
    if not entries:
        return [], [], [], [], [], []
    # Column-wise, so that the per-entry work runs in C (map/sorted/accumulate).
    names = list(map(str, map(_first, entries)))
    raw_dtypes = list(map(_second, entries))
    raw_shapes = list(map(_third, entries))
    kinds: dict[Any, tuple[str, int]] = {}
    for raw in set(raw_dtypes):
        dt = np.dtype(raw)
        kinds[raw] = (safetensors_name(dt), dt.itemsize)
    dtype_names = [kinds[raw][0] for raw in raw_dtypes] if len(kinds) > 1 else (
        [next(iter(kinds.values()))[0]] * len(names))
    sizes = [kinds[raw][1] for raw in raw_dtypes] if len(kinds) > 1 else (
        [next(iter(kinds.values()))[1]] * len(names))
    if set(map(type, raw_shapes)) == {tuple} and set(
        map(type, chain.from_iterable(raw_shapes))
    ) <= _INT_ONLY:
        shapes = raw_shapes  # e.g. ndarray.shape: already tuples of ints
    else:
        shapes = [tuple(map(int, s)) for s in raw_shapes]
    if min(chain.from_iterable(shapes), default=0) < 0:
        name, dims = next((n, d) for n, d in zip(names, shapes) if any(x < 0 for x in d))
        raise ValueError(f"entry {name!r}: negative dimension in shape {list(dims)}")
    if len(set(names)) != len(names):
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise ValueError(f"entry name {name!r} appears twice in one shard")
            seen.add(name)
    nbytes = list(map(operator.mul, map(math.prod, shapes), sizes))
    if len(set(sizes)) == 1:  # one item size: the order is the input order
        order: Sequence[int] = range(len(names))
    else:
        order = sorted(range(len(names)), key=[-z for z in sizes].__getitem__)  # stable
        names, dtype_names, shapes, nbytes = (
            [column[i] for i in order] for column in (names, dtype_names, shapes, nbytes)
        )
    ends = list(accumulate(nbytes))
    return names, dtype_names, shapes, [0, *ends[:-1]], ends, order


_first = operator.itemgetter(0)
_second = operator.itemgetter(1)
_third = operator.itemgetter(2)


def entry_layouts(names: list[str], dtype_names: list[str], shapes: list[tuple[int, ...]],
                  begins: list[int], ends: list[int]) -> list[EntryLayout]:
    """EntryLayouts from columns, numbered in the order given."""
    return _new_entry_layouts(names, dtype_names, shapes, begins, ends, range(len(names)))


def entries_at(names: list[str], dtype_names: list[str], shapes: list[tuple[int, ...]],
               begins: list[int]) -> dict[str, EntryLayout]:
    """Entries by name, from columns: each starts at its begin and is as long as its dtype
    and shape make it."""
    sizes = map(operator.mul, map(math.prod, shapes), map(_ITEMSIZE.__getitem__, dtype_names))
    ends = list(map(operator.add, begins, sizes))
    return dict(zip(names, entry_layouts(names, dtype_names, shapes, begins, ends)))


def data_size(layouts: Sequence[EntryLayout]) -> int:
    """Bytes of the data region covered by `layouts`."""
    return max((e.end for e in layouts), default=0)


def encode_safetensors_header(
    layouts: Sequence[EntryLayout], metadata: Mapping[str, str] | None = None
) -> bytes:
    """The 8-byte length prefix plus the space-padded JSON header; data starts at len(result).

    `metadata` (str -> str, as safetensors requires) is merged into ``__metadata__`` after
    ``"format": "pt", "shardkit": "2.2"``. Entries appear in the order given (use
    `layout_entries`).
    """
    meta: dict[str, str] = shard_metadata(None)
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"shard metadata must map str to str, got {k!r}: {v!r}")
        meta[k] = v
    return encode_header_columns([e.name for e in layouts], [e.dtype_name for e in layouts],
                                 [e.shape for e in layouts], [e.begin for e in layouts],
                                 [e.end for e in layouts], meta)


def encode_header_columns(
    names: list[str], dtype_names: list[str], shapes: list[tuple[int, ...]],
    begins: Sequence[int] | np.ndarray, ends: Sequence[int] | np.ndarray,
    meta: Mapping[str, str] | None = None,
) -> bytes:
    """`encode_safetensors_header` of entries given column-wise (in header order)."""
    return b"".join(header_parts(names, dtype_names, shapes, begins, ends, meta))


def header_parts(
    names: list[str], dtype_names: list[str], shapes: list[tuple[int, ...]],
    begins: Sequence[int] | np.ndarray, ends: Sequence[int] | np.ndarray,
    meta: Mapping[str, str] | None = None,
) -> list[bytes]:
    """`encode_header_columns` in pieces that are written as they are (no joined copy of a
    header of megabytes)."""
    unique = set(names)
    if len(unique) != len(names) or METADATA_KEY in unique:
        seen = {METADATA_KEY}
        for name in names:
            if name in seen:
                raise ValueError(f"entry name {name!r} is reserved or appears twice")
            seen.add(name)
    try:
        text = _header_text(names, dtype_names, shapes, begins, ends,
                            meta if meta is not None else shard_metadata(None))
    except UnicodeEncodeError as err:
        raise ValueError(f"an entry name cannot be encoded as UTF-8: {err}") from None
    size = sum(map(len, text))
    if size > MAX_HEADER_BYTES:
        raise ValueError(
            f"shard header would be {size} bytes, over the {MAX_HEADER_BYTES}-byte limit; "
            "use more, smaller shards"
        )
    return [_LEN.pack(size), *text]


def _header_text(
    names: list[str], dtype_names: list[str], shapes: list[tuple[int, ...]],
    begins: Sequence[int] | np.ndarray, ends: Sequence[int] | np.ndarray,
    meta: Mapping[str, str],
) -> list[bytes]:
    """The pieces of the space-padded JSON header, which joined are byte-identical to
    ``json.dumps(header, separators=(",", ":"), ensure_ascii=False)``; the entries are encoded
    by the native kernel (~0.07 us each). UnicodeEncodeError for a name that is not valid
    UTF-8 text."""
    head = f'{{"{METADATA_KEY}":{json.dumps(meta, separators=(",", ":"), ensure_ascii=False)}'
    text = [head.encode("utf-8"),
            _table.encode_header_entries(names, dtype_names, shapes,
                                         np.asarray(begins, np.int64), np.asarray(ends, np.int64))]
    size = sum(map(len, text)) + 1
    return [*text, b"}" + b" " * (-(size + 8) % HEADER_ALIGNMENT)]


def header_length(prefix: bytes | bytearray | memoryview, file_size: int, path: str) -> int:
    """Check and return N from the first 8 bytes of a shard of `file_size` bytes."""
    if file_size < 8 or len(prefix) < 8:
        raise TruncatedShardError(
            f"{path}: file is {file_size} bytes, shorter than the 8-byte header length prefix"
        )
    (n,) = _LEN.unpack_from(prefix, 0)
    if n > MAX_HEADER_BYTES:
        raise CorruptHeaderError(
            f"{path}: header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes "
            "(not a shardkit/safetensors shard, or corrupt)"
        )
    if 8 + n > file_size:
        raise TruncatedShardError(
            f"{path}: header length {n} runs past the end of the file "
            f"(8 + {n} bytes needed, file has {file_size})"
        )
    return n


def _parse_object(
    data: bytes, path: str, error: type[CheckpointFormatError], what: str
) -> tuple[Any, ...]:
    """A UTF-8 JSON object as `_loads_pairs` gives it; any failure is `error` naming `path`.
    `what` ("header " or "" for a whole file) starts the messages."""
    subject = f"{what}is " if what else ""
    try:
        parsed = _loads_pairs(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        # the position only: a message never quotes the file's bytes
        raise error(f"{path}: {subject}not UTF-8 (invalid byte at position {e.start})") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: {subject}not valid JSON ({e})") from None
    except ValueError:  # json's int conversion: more digits than Python converts
        raise error(f"{path}: {subject}not valid: an integer with more than {_INT_DIGITS} digits"
                    ) from None
    except RecursionError:
        raise error(_too_deep(path, what)) from None
    if type(parsed) is not tuple:
        raise error(f"{path}: {what}must be a JSON object, found {type(parsed).__name__}")
    return parsed


def _too_deep(path: str, what: str = "") -> str:
    return (f"{path}: {what}JSON is nested more than {MAX_DEPTH} levels deep (the limit; the "
            "top-level object is level 1)")


def nesting_within(value: Any, levels: int) -> bool:
    """True if `value` (decoded JSON: dicts and lists) has at most `levels` levels of containers
    (a scalar has 0, ``[]`` 1, ``[[]]`` 2). Level by level, never recursing; a flat container
    costs one C-level pass over its values."""
    level = [value] if type(value) in _DOC_CONTAINERS else []
    for _ in range(levels):
        if not level:
            return True
        nxt = []
        for v in level:
            values = v.values() if type(v) is dict else v
            if not _DOC_CONTAINERS.isdisjoint(map(type, values)):
                nxt += [c for c in values if type(c) in _DOC_CONTAINERS]
        level = nxt
    return not level


_DOC_CONTAINERS: Final = frozenset({dict, list})


def _loads_pairs(text: str) -> Any:
    """json.loads, but every JSON object becomes a tuple of its (key, value) pairs.

    Duplicate keys must be detected, and a Python object_pairs_hook costs ~1 us per object. With
    the C-level `tuple` as hook, objects stay distinguishable from arrays (lists) and the decoders
    below turn them into dicts (`_object`, `_plain`), checking for duplicates as they go; the hot
    per-tensor / per-entry objects are matched against their fixed key sequence instead.
    """
    return json.loads(text, object_pairs_hook=tuple)


def _object(pairs: tuple[tuple[str, Any], ...], what: str, path: str, error: type) -> dict:
    """A dict of the (key, value) `pairs` of one JSON object; `error` on a repeated key."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise error(f"{path}: {what} has the key {_shown(k)} twice")
            seen.add(k)
    return out


def _plain(x: Any, what: str, path: str, error: type, level: int = 1) -> Any:
    """`x` from `_loads_pairs` with every nested object turned into a dict (duplicates checked).
    `x` sits at nesting `level` of its document; `error` if it nests deeper than MAX_DEPTH."""
    t = type(x)
    if t is not tuple and t is not list:
        return x
    if level > MAX_DEPTH:
        raise error(_too_deep(path))
    if t is tuple:
        d = _object(x, what, path, error)
        if not _CONTAINERS.isdisjoint(map(type, d.values())):  # else nothing to convert
            for k, v in d.items():
                if type(v) is tuple or type(v) is list:
                    d[k] = _plain(v, what, path, error, level + 1)
        return d
    if _CONTAINERS.isdisjoint(map(type, x)):
        return x
    return [_plain(v, what, path, error, level + 1) if type(v) in _CONTAINERS else v for v in x]


_CONTAINERS: Final = frozenset({tuple, list})


class _Slow(Exception):
    """Internal: input the fast path does not handle; the fully checked path decides."""


def _is_int(x: Any) -> bool:
    return type(x) is int


_INT_ONLY: Final = frozenset({int})


def decode_safetensors_header(
    buf: bytes | bytearray | memoryview, file_size: int, path: str
) -> tuple[dict[str, EntryLayout], dict[str, str], int]:
    """Parse and validate a raw shard header from its first bytes (at least ``8 + N``).

    Returns (entries by name, in header order; ``__metadata__``; data_start). Checks the length
    prefix, JSON, every entry's dtype / shape / data_offsets, that entries tile the data region
    ``[0, file_size - data_start)`` exactly (no overlap, no hole, nothing out of range).
    """
    with _gc_paused():  # one GC pass at the end instead of many during the decode
        return _decode_safetensors_header(buf, file_size, path)


def _decode_safetensors_header(
    buf: bytes | bytearray | memoryview, file_size: int, path: str
) -> tuple[dict[str, EntryLayout], dict[str, str], int]:
    n = header_length(buf, file_size, path)
    if len(buf) < 8 + n:
        raise TruncatedShardError(f"{path}: got {len(buf)} bytes, the header needs {8 + n}")
    pairs = _parse_object(bytes(buf[8 : 8 + n]), path, CorruptHeaderError, "header ")
    header = _object(pairs, "header", path, CorruptHeaderError)
    data_start = 8 + n
    region = file_size - data_start
    metadata = _plain(header.pop(METADATA_KEY, ()), "header", path, CorruptHeaderError, 2)
    if not isinstance(metadata, dict) or not all(
        isinstance(v, str) for v in metadata.values()
    ):
        raise CorruptHeaderError(
            f"{path}: {METADATA_KEY} must map str to str, got {_shown(metadata, 120)}")
    try:
        entries = _decode_entries_fast(header, region)
    except _Slow:
        entries = {}
        for i, (name, value) in enumerate(header.items()):
            value = _plain(value, "header", path, CorruptHeaderError, 2)
            entries[name] = _decode_entry_checked(name, value, i, path)
        _check_tiling(entries, region, path)
    return entries, metadata, data_start


_ENTRY_KEYS: Final = ("dtype", "shape", "data_offsets")


def _decode_entries_fast(header: dict[str, Any], region: int) -> dict[str, EntryLayout]:
    """Decode the entries of a header whose every entry is well formed and laid out correctly.

    Column-wise, checks in bulk (C loops and numpy); raises _Slow on anything unusual, and the
    per-entry checked path then decides (and words the error). Each entry must be a JSON object
    with exactly the keys dtype, shape, data_offsets in that order (as every writer of the format
    emits them), so it cannot hold a duplicate key.
    """
    if not header:
        if region:
            raise _Slow
        return {}
    names = list(header)
    values = list(header.values())
    try:
        if set(map(type, values)) != {tuple}:
            raise _Slow
        # each object value is a tuple of (key, value) pairs (see _loads_pairs)
        k1, dtypes, k2, shapes, k3, offsets = zip(
            *[(a, dt, b, sh, c, of) for (a, dt), (b, sh), (c, of) in values]
        )
        if set(zip(k1, k2, k3)) != {_ENTRY_KEYS} or not set(dtypes) <= _ITEMSIZE.keys():
            raise _Slow
        if set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list}:
            raise _Slow
        if set(map(len, offsets)) != {2}:
            raise _Slow
        dims = list(chain.from_iterable(shapes))
        if not set(map(type, dims)) <= _INT_ONLY or min(dims, default=0) < 0:
            raise _Slow
        if max(dims, default=0) >= 2**31 or max(map(len, shapes)) > MAX_NDIM:
            raise _Slow  # perhaps no array can have it: the checked path decides
        begins, ends = zip(*offsets)
        if not set(map(type, begins)) | set(map(type, ends)) <= _INT_ONLY or min(begins) < 0:
            raise _Slow
        sizes = list(map(operator.mul, map(math.prod, shapes), map(_ITEMSIZE.__getitem__, dtypes)))
        if list(map(operator.sub, ends, begins)) != sizes:
            raise _Slow
        b = np.array(begins, dtype=np.int64)
        e = np.array(ends, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise _Slow from None
    # Tiling: sorted by (begin, end), the non-empty entries must chain from 0 to the end of the
    # region; an empty entry may sit at any boundary between them (as _check_tiling accepts).
    order = np.lexsort((e, b))
    b, e = b[order], e[order]
    full = e > b
    fb, fe = b[full], e[full]
    bounds = np.concatenate(([0], fe))
    if fb.size:
        ok = fb[0] == 0 and fe[-1] == region and np.array_equal(fb[1:], fe[:-1])
    else:
        ok = region == 0
    if not ok or not np.isin(b[~full], bounds).all():
        raise _Slow
    layouts = _new_entry_layouts(names, dtypes, map(tuple, shapes), begins, ends, range(len(names)))
    return dict(zip(names, layouts))


def _decode_entry_checked(name: str, e: Any, i: int, path: str) -> EntryLayout:
    where = f"{path}: entry {_shown(name)}"
    if not isinstance(e, dict):
        raise CorruptHeaderError(f"{where} must be a JSON object, found {type(e).__name__}")
    missing = {"dtype", "shape", "data_offsets"} - e.keys()
    if missing:
        raise CorruptHeaderError(f"{where} lacks the field(s) {sorted(missing)}")
    dtype = e["dtype"]
    if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
        raise CorruptHeaderError(
            f"{where} has unknown dtype {_shown(dtype)}; known: {', '.join(SAFETENSORS_NAMES)}"
        )
    shape = e["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CorruptHeaderError(
            f"{where}: shape must be a list of non-negative integers, found {_shown(shape)}"
        )
    problem = _shape_problem(shape, _ITEMSIZE[dtype])
    if problem:
        raise CorruptHeaderError(f"{where}{problem}")
    offs = e["data_offsets"]
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)):
        raise CorruptHeaderError(
            f"{where}: data_offsets must be 2 integers, found {_shown(offs)}")
    begin, end = offs
    if begin < 0 or end < begin:
        raise EntryLayoutError(f"{where}: data_offsets [{_shown(begin)}, {_shown(end)}] are not 0 "
                               f"<= begin <= end")
    expected = math.prod(shape) * _ITEMSIZE[dtype]
    if end - begin != expected:
        raise EntryLayoutError(
            f"{where}: data_offsets [{_shown(begin)}, {_shown(end)}] span {_shown(end - begin)} "
            f"bytes, but dtype {dtype} "
            f"and shape {shape} need {expected}"
        )
    return EntryLayout(name, dtype, tuple(shape), begin, end, i)


def _shape_problem(shape: Sequence[int], item: int) -> str:
    """What no array can have about `shape` (non-negative ints) of `item`-byte items, worded
    after "tensor 'k'" / "entry 'e'"; "" if nothing."""
    if len(shape) > MAX_NDIM:
        return f" has {len(shape)} dimensions, more than the limit of {MAX_NDIM}"
    if math.prod(d for d in shape if d) * item > MAX_NBYTES:
        return f": shape {_shown(list(shape), 200)} has more than 2**63 - 1 bytes (not counting " \
               "zero dimensions), more than any array"
    return ""


def _check_tiling(entries: Mapping[str, EntryLayout], region: int, path: str) -> None:
    pos = 0
    prev: EntryLayout | None = None
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.end > region:
            raise EntryLayoutError(
                f"{path}: entry {_shown(e.name)} data_offsets [{e.begin}, {e.end}] run past the "
                f"end of "
                f"the data region ({region} bytes)"
            )
        if e.begin < pos:
            assert prev is not None
            raise EntryLayoutError(
                f"{path}: entries {_shown(prev.name)} [{prev.begin}, {prev.end}] and "
                f"{_shown(e.name)} "
                f"[{e.begin}, {e.end}] overlap"
            )
        if e.begin > pos:
            after = f"after entry {_shown(prev.name)}" if prev is not None else "at the start"
            raise EntryLayoutError(
                f"{path}: hole of {e.begin - pos} bytes {after} (bytes {pos}..{e.begin}) "
                f"before entry {_shown(e.name)}"
            )
        if e.nbytes:  # empty entries may sit anywhere inside the covered range
            pos, prev = e.end, e
    if pos != region:
        raise EntryLayoutError(
            f"{path}: {region - pos} bytes after the last entry are not covered by any entry "
            f"(data region is {region} bytes, entries end at {pos})"
        )


def read_safetensors_header(
    f: BinaryIO | int, file_size: int, path: str
) -> tuple[dict[str, EntryLayout], dict[str, str], int]:
    """Read and decode the header of an open shard (file object or descriptor) of `file_size`.

    Reads 8 bytes, checks N against the limit and the file size, then reads exactly N bytes.
    """
    prefix = _pread(f, 8, 0)
    n = header_length(prefix, file_size, path)
    body = _pread(f, n, 8)
    if len(body) < n:
        raise TruncatedShardError(f"{path}: header cut short: read {len(body)} of {n} bytes")
    return decode_safetensors_header(prefix + body, file_size, path)


def read_expected_safetensors_header(
    f: BinaryIO | int, file_size: int, path: str,
    names: list[str], dtype_names: list[str], shapes: list[tuple[int, ...]],
    generation: str | None = None,
) -> tuple[dict[str, EntryLayout] | None, dict[str, str], int, list[int] | None]:
    """`read_safetensors_header`, except when the header is exactly what the writer makes of
    the entries `names` / `dtype_names` / `shapes` (in data-region order, no extra metadata
    but the checkpoint's `generation`, see `shard_metadata`).

    Then nothing needs parsing: the bytes equal the canonical encoding of a layout that is
    valid by construction (unique names, contiguous entries), every entry has the expected
    dtype and shape, and the result is ``(None, metadata, data_start, begins)`` with the
    entries' offsets. Otherwise the header is decoded and checked as usual: ``(entries,
    metadata, data_start, None)``.
    """
    prefix = _pread(f, 8, 0)
    n = header_length(prefix, file_size, path)
    body = _pread(f, n, 8)
    if len(body) < n:
        raise TruncatedShardError(f"{path}: header cut short: read {len(body)} of {n} bytes")
    meta = (legacy_shard_metadata(generation) if body.startswith(_LEGACY_HEAD)
            else shard_metadata(generation))
    begins = _match_header(body, file_size - 8 - n, names, dtype_names, shapes, meta)
    if begins is not None:
        return None, meta, 8 + n, begins
    return (*decode_safetensors_header(prefix + body, file_size, path), None)


def _match_header(
    body: bytes, region: int, names: list[str], dtype_names: list[str],
    shapes: list[tuple[int, ...]], meta: Mapping[str, str],
) -> list[int] | None:
    """The entries' begin offsets if `body` is the writer's header for them (with ``__metadata__``
    `meta`), else None."""
    sizes = list(map(_ITEMSIZE.__getitem__, dtype_names))
    if any(map(operator.lt, sizes, sizes[1:])):  # not in layout order: decode instead
        return None
    unique = set(names)
    if len(unique) != len(names) or METADATA_KEY in unique:
        return None
    ends = list(accumulate(map(operator.mul, map(math.prod, shapes), sizes)))
    if region != (ends[-1] if ends else 0):
        return None
    begins = [0, *ends[:-1]] if ends else []
    try:
        head, entries, tail = _header_text(names, dtype_names, shapes, begins, ends, meta)
    except (ValueError, TypeError, UnicodeEncodeError):  # bad names: decode instead
        return None
    same = (len(body) == len(head) + len(entries) + len(tail) and body.startswith(head)
            and body.endswith(tail)
            and memoryview(body)[len(head) : len(body) - len(tail)] == entries)  # no copy
    return begins if same else None


def _pread(f: BinaryIO | int, n: int, offset: int) -> bytes:
    fd = f if isinstance(f, int) else f.fileno()
    chunks = []
    while n > 0:
        b = os.pread(fd, n, offset)
        if not b:
            break
        chunks.append(b)
        n -= len(b)
        offset += len(b)
    return b"".join(chunks)


# --- the manifest (model.safetensors.index.json; index.json before 2.2) -----------------------


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One shard file: plain file name, device task, codec ("raw" / "zstd"), size in bytes,
    and the checkpoint generation its header must record (the manifest's ``shardkit.generation``;
    None for an index without one, format 2.0: then nothing is checked)."""

    file: str
    task: int
    codec: str
    bytes: int
    generation: str | None = None


@dataclass(frozen=True, slots=True)
class SliceInfo:
    """Where one slice of a tensor is stored: shard number, entry name, xxh3-64 hex or None."""

    spec: str
    shard: int
    entry: str
    xxh3: str | None


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor of the checkpoint: safetensors dtype name, full shape, device, its slices."""

    dtype: str
    shape: tuple[int, ...]
    device: str
    slices: list[SliceInfo]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]

    @property
    def is_split(self) -> bool:
        """More than one stored slice (one slice always covers the whole tensor)."""
        return len(self.slices) > 1


_new_slice_infos = _columns_constructor(SliceInfo)
_new_tensor_infos = _columns_constructor(TensorInfo)


@dataclass(slots=True, eq=False)
class CheckpointIndex:
    """The content of the manifest, column-wise (docs/FORMAT.md section 2).

    Tensors, in save order: `keys`, `dtypes` (safetensors names), full `shapes`, `devices`.
    Stored slices, shard by shard and within a shard in data-region order: `slice_tensor` (the
    row of their tensor), `slice_spec` (``""`` = whole), `slice_shard`, `slice_xxh3`.
    Per-tensor objects (`tensors`) are built only when asked for: a 50,000-tensor load never
    needs them.
    """

    callback: str
    shards: list[ShardInfo]
    keys: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    devices: list[str]
    slice_tensor: list[int]
    slice_spec: list[str]
    slice_shard: list[int]
    slice_xxh3: Sequence[str | None]  # a list, or a column made on first use (TensorBundle)
    user_metadata: dict[str, Any] = field(default_factory=dict)
    version: str = FORMAT_VERSION
    generation: str | None = None  # shardkit.generation (format 2.1); every shard records it
    strings: Any = None  # the string tensors (a strings.StringTensors, format 2.3), or None
    # per stored slice, the algorithm of its `slice_xxh3` value (docs/FORMAT.md, "Checksum
    # kinds"); None: all "xxh3" (shardkit's own format)
    slice_checksum_kind: list[str] | None = None
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CheckpointIndex):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in _INDEX_FIELDS)

    __hash__ = None  # type: ignore[assignment]

    @classmethod
    def from_tensors(
        cls, callback: str, shards: list[ShardInfo], tensors: Mapping[str, TensorInfo],
        user_metadata: dict[str, Any] | None = None, generation: str | None = None,
    ) -> CheckpointIndex:
        """An index from per-tensor objects; slices are listed shard by shard, in tensor order
        (the order of a writer that lays out one item size per shard)."""
        keys = list(tensors)
        infos = list(tensors.values())
        rows = [(shard, row, s) for row, t in enumerate(infos) for s in t.slices
                for shard in (s.shard,)]
        rows.sort(key=_first)  # stable: tensor order within a shard
        for _, row, s in rows:
            if s.entry != entry_name(keys[row], s.spec):
                raise ValueError(f"entry of {_shown(keys[row])} slice {_shown(s.spec)} must be "
                                 f"{_shown(entry_name(keys[row], s.spec))}, got {_shown(s.entry)}")
        return cls(
            callback, list(shards), keys, [t.dtype for t in infos],
            [tuple(t.shape) for t in infos], [t.device for t in infos],
            [r for _, r, _ in rows], [s.spec for _, _, s in rows],
            [s.shard for _, _, s in rows], [s.xxh3 for _, _, s in rows],
            dict(user_metadata or {}), FORMAT_VERSION, generation,
        )

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """checkpoint key -> TensorInfo, in save order (built on first use)."""
        got = self._cache.get("tensors")
        if got is None:
            per_tensor: list[list[SliceInfo]] = [[] for _ in self.keys]
            made = _new_slice_infos(self.slice_spec, self.slice_shard, self.entry_names(),
                                    self.slice_xxh3)
            for row, info in zip(self.slice_tensor, made):
                per_tensor[row].append(info)
            got = self._cache["tensors"] = dict(zip(self.keys, _new_tensor_infos(
                self.dtypes, self.shapes, self.devices, per_tensor)))
        return got

    def set_checksums(self, xxh3: list[str | None]) -> None:
        """Fill in the slices' checksums (a writer knows them only once the data is written)."""
        if len(xxh3) != len(self.slice_tensor):
            raise ValueError(f"{len(xxh3)} checksums for {len(self.slice_tensor)} slices")
        self.slice_xxh3 = xxh3
        self._cache.pop("tensors", None)

    def set_total_size(self, total: int) -> None:
        """Record the bytes of all tensors when the caller knows them already."""
        self._cache["total_size"] = int(total)

    def tensor_info(self, key: str) -> TensorInfo:
        """The TensorInfo of `key` alone (KeyError if absent)."""
        got = self._cache.get("tensors")
        if got is not None:
            return got[key]
        row = self.row(key)
        names = self.entry_names()
        slices = [SliceInfo(self.slice_spec[j], self.slice_shard[j], names[j], self.slice_xxh3[j])
                  for j in self.slices_of()[row]]
        return TensorInfo(self.dtypes[row], self.shapes[row], self.devices[row], slices)

    def slices_of(self) -> list[list[int]]:
        """The stored slices of each tensor row."""
        got = self._cache.get("slices_of")
        if got is None:
            got = [[] for _ in self.keys]
            for j, row in enumerate(self.slice_tensor):
                got[row].append(j)
            self._cache["slices_of"] = got
        return got

    def first_slice(self) -> np.ndarray:
        """For each tensor row, the number of its first stored slice."""
        got = self._cache.get("first")
        if got is None:
            got = np.empty(len(self.keys), np.int64)
            tensor = np.asarray(self.slice_tensor, np.int64)
            got[tensor[::-1]] = np.arange(len(tensor) - 1, -1, -1)  # the last write wins
            self._cache["first"] = got
        return got

    def shard_range(self, shard: int) -> range:
        """The stored slices of `shard` (slices are listed shard by shard)."""
        got = self._cache.get("bounds")
        if got is None:
            got = self._cache["bounds"] = np.searchsorted(
                np.asarray(self.slice_shard, np.int64), np.arange(len(self.shards) + 1))
        return range(int(got[shard]), int(got[shard + 1]))

    def row(self, key: str) -> int:
        """The row of `key` (KeyError if absent)."""
        return self.rows()[key]

    def rows(self) -> dict[str, int]:
        """checkpoint key -> row."""
        rows = self._cache.get("rows")
        if rows is None:
            rows = self._cache["rows"] = dict(zip(self.keys, range(len(self.keys))))
        return rows

    def entry_names(self) -> list[str]:
        """Entry name of every stored slice (section 4: the key, or ``key:spec``)."""
        got = self._cache.get("entries")
        if got is None:
            names = list(map(self.keys.__getitem__, self.slice_tensor))
            got = self._cache["entries"] = [
                n if s == WHOLE else f"{n}:{s}" for n, s in zip(names, self.slice_spec)
            ] if any(self.slice_spec) else names
        return got

    def slice_counts(self) -> np.ndarray:
        """How many stored slices each tensor has."""
        got = self._cache.get("counts")
        if got is None:
            got = self._cache["counts"] = np.bincount(
                np.asarray(self.slice_tensor, dtype=np.int64), minlength=len(self.keys))
        return got

    def slice_shapes(self) -> list[tuple[int, ...]]:
        """Shape of every stored slice (the tensor's for a whole one)."""
        got = self._cache.get("slice_shapes")
        if got is None:
            shapes = list(map(self.shapes.__getitem__, self.slice_tensor))
            if any(self.slice_spec):
                for j, spec in enumerate(self.slice_spec):
                    if spec != WHOLE:
                        shapes[j] = parse_slice_spec(spec, shapes[j]).shape
            got = self._cache["slice_shapes"] = shapes
        return got

    def total_size(self) -> int:
        """Bytes of all tensors (HuggingFace's metadata.total_size)."""
        known = self._cache.get("total_size")
        if known is not None:
            return int(known)
        return sum(map(operator.mul, map(math.prod, self.shapes),
                       map(_ITEMSIZE.__getitem__, self.dtypes)))


_INDEX_FIELDS: Final = tuple(f for f in CheckpointIndex.__slots__ if f != "_cache")


def encode_index(index: CheckpointIndex) -> bytes:
    """The manifest's bytes: compact UTF-8 JSON (as ``json.dumps(doc, separators=(",", ":"),
    ensure_ascii=False)``) and a newline. Column-wise, encoded by orjson (byte-identical to
    that json.dumps for these values, about 10x faster on 50,000 tensors).
    """
    return b"".join(index_chunks(index))


def index_chunks(
    index: CheckpointIndex, parts: tuple[list[bytes], list[bytes]] | None = None
) -> list[bytes]:
    """`encode_index` as the pieces that, joined, are its bytes (a writer writes them as they
    are). `parts`: what `encode_index_parts` gave for this index, if it was called already."""
    head, tail = parts or encode_index_parts(index)
    return [*head, orjson.dumps(index.slice_xxh3, default=list), *tail]  # list: any Sequence


def encode_index_parts(index: CheckpointIndex) -> tuple[list[bytes], list[bytes]]:
    """`index_chunks` without the checksum column: the pieces before it and after it, so that
    a writer can encode the rest while the checksums are still being computed."""
    try:
        user_metadata = _dumps(index.user_metadata).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint metadata is not JSON-serialisable: {e}") from None
    n_tensors = len(index.keys)
    devices = list(dict.fromkeys(index.devices))
    device_ids = ([0] * n_tensors if len(devices) == 1 else
                  list(map({d: i for i, d in enumerate(devices)}.__getitem__, index.devices)))
    files = [s.file for s in index.shards]
    tensor = np.asarray(index.slice_tensor, np.int64)
    if (len(tensor) == n_tensors and not any(index.slice_spec)
            and np.array_equal(tensor, np.arange(n_tensors))):
        # every tensor whole, listed in save order: the shard files, shard by shard
        weight_map = dict(zip(index.keys, chain.from_iterable(
            repeat(f, len(index.shard_range(i))) for i, f in enumerate(files))))
    else:  # HuggingFace-style: the tensors stored whole (one slice, spec ""), in save order
        counts = index.slice_counts()
        whole = [j for j, (row, spec) in enumerate(zip(index.slice_tensor, index.slice_spec))
                 if spec == WHOLE and counts[row] == 1]
        whole.sort(key=index.slice_tensor.__getitem__)
        weight_map = {index.keys[index.slice_tensor[j]]: files[index.slice_shard[j]]
                      for j in whole}
    shard_list = [{"file": s.file, "task": s.task, "codec": s.codec, "bytes": s.bytes}
                  for s in index.shards]
    try:
        shapes = orjson.dumps(index.shapes)
    except TypeError:  # numpy integers in a shape
        shapes = orjson.dumps([list(map(int, s)) for s in index.shapes])
    dumps = orjson.dumps
    return [
        b'{"format":', dumps(FORMAT_NAME), b',"format_version":', dumps(index.version),
        b',"metadata":{"total_size":', str(index.total_size()).encode(),
        b'},"weight_map":', dumps(weight_map),
        b',"shardkit":{"callback":', dumps(index.callback),
        *((b',"generation":', dumps(index.generation)) if index.generation is not None else ()),
        b',"devices":', dumps(devices),
        b',"shards":', dumps(shard_list),
        b',"tensors":{"key":', dumps(index.keys), b',"dtype":', dumps(index.dtypes),
        b',"shape":', shapes, b',"device":', dumps(device_ids),
        b'},"slices":{"tensor":', dumps(index.slice_tensor), b',"spec":', dumps(index.slice_spec),
        b',"shard":', dumps(index.slice_shard), b',"xxh3":',
    ], [b'}', *((b',"strings":', dumps(index.strings.section()))
                 if index.strings is not None else ()),
        b',"user_metadata":', user_metadata, b"}}\n"]


def _dumps(value: Any) -> str:
    # compact: with indent, json falls back to its pure-Python encoder (20x slower)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def parse_version(version: Any, path: str) -> tuple[int, int]:
    """(major, minor) of a "MAJOR.MINOR" version; refuses majors newer than this reader's."""
    m = re.fullmatch(r"(\d+)\.(\d+)", version) if isinstance(version, str) else None
    if m is None:
        raise CorruptIndexError(
            f"{path}: format_version must be a string like \"2.0\", found {_shown(version)}"
        )
    major, minor = int(m.group(1)), int(m.group(2))
    if major > FORMAT_MAJOR:
        raise UnsupportedVersionError(
            f"{path}: checkpoint format version {version} is newer than this shardkit reads "
            f"(up to {FORMAT_MAJOR}.x); upgrade shardkit to read it"
        )
    if major < FORMAT_MAJOR:
        raise UnsupportedVersionError(
            f"{path}: checkpoint format version {version} is a pre-release layout this shardkit "
            f"no longer reads (it reads {FORMAT_MAJOR}.x); load it with the shardkit that wrote "
            "it and save it again"
        )
    return major, minor


def check_shard_file_name(name: Any, path: str) -> str:
    """`name` if it is a plain file name inside the checkpoint directory, else ShardPathError."""
    if not isinstance(name, str) or not name:
        raise CorruptIndexError(f"{path}: shard file name must be a non-empty string, got "
                                f"{_shown(name)}")
    if (
        "/" in name
        or "\\" in name
        or "\0" in name
        or name in (".", "..")
        or name.startswith("..")
        or os.path.isabs(name)
        or (len(name) > 1 and name[1] == ":")  # Windows drive
        or name in MANIFEST_FILES
    ):
        raise ShardPathError(
            f"{path}: shard file name {_shown(name)} is not a plain file name inside the "
            f"checkpoint "
            f"directory (no '/', '\\', '..', absolute paths, drive letters, NUL, "
            f"{MANIFEST_FILE} or {LEGACY_MANIFEST_FILE})"
        )
    return name


def decode_index(data: bytes, path: str) -> CheckpointIndex:
    """Parse and validate a manifest; every error is a CorruptIndexError (or subclass)
    naming `path` and the field, except other majors: UnsupportedVersionError."""
    with _gc_paused():  # one GC pass at the end instead of many during the decode
        return _decode_index(data, path)


def _decode_index(data: bytes, path: str) -> CheckpointIndex:
    doc = _canonical_document(bytes(data))
    if doc is None:  # another writer's spelling, or something wrong: parse and check it all
        raw = _parse_object(bytes(data), path, CorruptIndexError, "")
        doc = _index_objects(raw, path)
    elif not _document_within_depth(doc):
        raise CorruptIndexError(_too_deep(path))
    if doc.get("format") != FORMAT_NAME:
        raise CorruptIndexError(
            f"{path}: \"format\" must be {_shown(FORMAT_NAME)}, found {_shown(doc.get('format'))} "
            "(not a shardkit checkpoint index)"
        )
    version = doc.get("format_version")
    _, minor = parse_version(version, path)
    assert isinstance(version, str)  # parse_version checked it
    sk = _field(doc, "shardkit", dict, path, "")
    for name in ("metadata", "weight_map"):
        if name not in doc:
            raise CorruptIndexError(f"{path}: missing field {name}")
        if not isinstance(doc[name], dict):
            raise CorruptIndexError(f"{path}: {_shown(name)} must be a JSON object")
    callback = _field(sk, "callback", str, path, "shardkit.")
    generation = sk.get(GENERATION_KEY)
    if generation is not None and not (
            type(generation) is str and _GENERATION_RE.fullmatch(generation)):
        raise CorruptIndexError(
            f"{path}: field shardkit.{GENERATION_KEY} must be a string of 1 to 64 letters, "
            f"digits, '_', '.' or '-', found {_shown(generation)}")
    user_metadata = _field(sk, "user_metadata", dict, path, "shardkit.")
    shards = _decode_shards(_field(sk, "shards", list, path, "shardkit."), path, generation)
    device_names = _str_list(sk, "devices", path, "shardkit.")
    if len(set(device_names)) != len(device_names):
        dup = next(d for d, c in Counter(device_names).items() if c > 1)
        raise CorruptIndexError(f"{path}: device {_shown(dup)} is listed twice in shardkit.devices")
    tensors = _field(sk, "tensors", dict, path, "shardkit.")
    where = "shardkit.tensors."
    keys = _str_list(tensors, "key", path, where)
    n = len(keys)
    dtypes = _column(tensors, "dtype", n, path, where)
    shapes = _column(tensors, "shape", n, path, where)
    device_ids = _column(tensors, "device", n, path, where)
    slices = _field(sk, "slices", dict, path, "shardkit.")
    where = "shardkit.slices."
    slice_tensor = _column(slices, "tensor", None, path, where)
    m = len(slice_tensor)
    slice_spec = _column(slices, "spec", m, path, where)
    slice_shard = _column(slices, "shard", m, path, where)
    slice_xxh3 = _column(slices, "xxh3", m, path, where)

    check_keys(keys, error=CorruptIndexError, where=f"{path}: shardkit.tensors.key: ")
    if not _all_in(dtypes, _ITEMSIZE.keys()):
        bad = next(d for d in dtypes if not isinstance(d, str) or d not in _ITEMSIZE)
        raise CorruptIndexError(
            f"{path}: tensor {_shown(keys[dtypes.index(bad)])} has unknown dtype {_shown(bad)}; "
            f"known: "
            + ", ".join(SAFETENSORS_NAMES)
        )
    dims = list(chain.from_iterable(shapes)) if set(map(type, shapes)) <= {list} else None
    if dims is None or not (set(map(type, dims)) <= _INT_ONLY and min(dims, default=0) >= 0):
        bad_row = next(i for i, s in enumerate(shapes) if not (
            isinstance(s, list) and _nonneg_ints(s)))
        raise CorruptIndexError(
            f"{path}: tensor {_shown(keys[bad_row])} shape must be a list of non-negative "
            f"integers, found {_shown(shapes[bad_row])}"
        )
    if max(dims, default=0) >= 2**31 or max(map(len, shapes), default=0) > MAX_NDIM:  # rare
        for key, dtype, shape in zip(keys, dtypes, shapes):
            problem = _shape_problem(shape, _ITEMSIZE[dtype])
            if problem:
                raise CorruptIndexError(f"{path}: tensor {_shown(key)}{problem}")
    _check_ids(device_ids, len(device_names), keys, "device", path, "shardkit.devices")
    _check_ids(slice_tensor, n, None, "tensor", path, "shardkit.tensors.key")
    _check_ids(slice_shard, len(shards), None, "shard", path, "shardkit.shards")
    if any(map(operator.gt, slice_shard, slice_shard[1:])):
        raise CorruptIndexError(f"{path}: shardkit.slices must be listed shard by shard "
                                "(shard numbers never decreasing)")
    if not set(map(type, slice_spec)) <= {str}:
        raise CorruptIndexError(f"{path}: shardkit.slices.spec must hold strings")
    hashes = [x for x in slice_xxh3 if x is not None]
    if hashes and not (set(map(type, hashes)) == {str} and set(map(len, hashes)) == {16}
                       and _HEX_RUN.fullmatch("".join(hashes))):
        j, bad_hash = next((j, x) for j, x in enumerate(slice_xxh3) if x is not None and not (
            isinstance(x, str) and _XXH3_RE.fullmatch(x)))
        raise CorruptIndexError(
            f"{path}: tensor {_shown(keys[slice_tensor[j]])} slice {_shown(slice_spec[j])}: xxh3 "
            f"must be 16 "
            f"lowercase hex digits or null, found {_shown(bad_hash)}"
        )
    strings = None
    # 2.3 is written exactly when there are string tensors: without this, a manifest that lost
    # its strings section would read as a checkpoint without them (tensors silently missing)
    if minor == STRINGS_MINOR and "strings" not in sk:
        raise CorruptIndexError(f"{path}: format_version 2.3 records string tensors, but the "
                                "shardkit.strings section is missing")
    if minor < STRINGS_MINOR and "strings" in sk:
        raise CorruptIndexError(f"{path}: shardkit.strings (string tensors) needs format_version "
                                f"2.3, found {_shown(version)}")
    if "strings" in sk:  # format 2.3: string tensors (shardkit.strings)
        from .strings import decode_section

        strings = decode_section(sk["strings"], path, generation)
        both = set(strings.keys).intersection(keys)
        if both:
            raise CorruptIndexError(f"{path}: key {_shown(min(both))} is both a tensor and a "
                                    "string tensor")
        if strings.file in {s.file for s in shards}:
            raise CorruptIndexError(f"{path}: file {_shown(strings.file)} is listed as a shard "
                                    "and as the string file")
    index = CheckpointIndex(
        callback, shards, keys, dtypes, list(map(tuple, shapes)),
        list(map(device_names.__getitem__, device_ids)), slice_tensor, slice_spec, slice_shard,
        slice_xxh3, user_metadata, version, generation, strings,
    )
    _check_slices(index, path)
    return index


def _document_within_depth(doc: dict[str, Any]) -> bool:
    """The index document nests at most MAX_DEPTH levels, the known columns of
    ``shardkit.tensors`` / ``shardkit.slices`` aside (their type checks allow only flat values,
    and are not walked: 50,000 shapes)."""
    sk = doc.get("shardkit")
    if type(sk) is not dict:
        return nesting_within(doc, MAX_DEPTH)
    for k, v in doc.items():
        if k != "shardkit" and not nesting_within(v, MAX_DEPTH - 1):
            return False
    for name, value in sk.items():
        if name in _COLUMNS and type(value) is dict:
            for column, cells in value.items():
                if column not in _COLUMNS[name] and not nesting_within(cells, MAX_DEPTH - 3):
                    return False
        elif not nesting_within(value, MAX_DEPTH - 2):
            return False
    return True


def _canonical_document(data: bytes) -> dict[str, Any] | None:
    """The index document when `data` is exactly the compact encoding shardkit writes, else
    None. orjson parses ~3x faster than json but keeps the last of repeated keys; re-encoding
    the result and comparing proves there were none (a dropped duplicate makes it shorter)."""
    try:
        doc = orjson.loads(data)
    except (orjson.JSONDecodeError, RecursionError):
        return None
    if type(doc) is not dict or not data.endswith(b"\n"):
        return None
    try:
        same = orjson.dumps(doc) == data[:-1]
    except (TypeError, orjson.JSONEncodeError):
        return None
    return doc if same else None


_COLUMNS: Final = {"tensors": ("key", "dtype", "shape", "device"),
                   "slices": ("tensor", "spec", "shard", "xxh3")}


def _index_objects(raw: tuple[tuple[str, Any], ...], path: str) -> dict[str, Any]:
    """The index document from `_loads_pairs` as dicts, duplicates checked everywhere; the
    columns of ``shardkit.tensors`` and ``shardkit.slices`` stay as parsed (their checks reject
    anything but the documented value types, JSON objects included)."""
    what, err = "manifest", CorruptIndexError
    doc = _object(raw, what, path, err)
    for k, v in doc.items():
        if k == "shardkit" and type(v) is tuple:
            sk = doc[k] = _object(v, what, path, err)
            for name, value in sk.items():
                if name in _COLUMNS and type(value) is tuple:
                    section = sk[name] = _object(value, what, path, err)
                    for column, cells in section.items():
                        if column not in _COLUMNS[name]:  # a later minor's: checked as JSON
                            section[column] = _plain(cells, what, path, err, 4)
                else:
                    sk[name] = _plain(value, what, path, err, 3)
        else:
            doc[k] = _plain(v, what, path, err, 2)
    return doc


def _decode_shards(raw_shards: list[Any], path: str, generation: str | None
                   ) -> list[ShardInfo]:
    shards: list[ShardInfo] = []
    seen_files: set[str] = set()
    for i, s in enumerate(raw_shards):
        where = f"shardkit.shards[{i}]."
        if not isinstance(s, dict):
            raise CorruptIndexError(f"{path}: shardkit.shards[{i}] must be a JSON object")
        file = check_shard_file_name(_field(s, "file", str, path, where), path)
        if file in seen_files:
            raise CorruptIndexError(f"{path}: shard file {_shown(file)} is listed twice")
        seen_files.add(file)
        task = _nonneg_int(s, "task", path, where)
        codec = _field(s, "codec", str, path, where)
        nbytes = _nonneg_int(s, "bytes", path, where)
        shards.append(ShardInfo(file, task, codec, nbytes, generation))
    return shards


def _check_slices(index: CheckpointIndex, path: str) -> None:
    """Every tensor is stored: once whole, or as slices that tile it; entry names are unique
    within a shard."""
    keys, counts = index.keys, index.slice_counts()
    if len(keys) and counts.min() == 0:
        key = keys[int(np.argmin(counts))]
        raise CorruptIndexError(f"{path}: tensor {_shown(key)} has no slices")
    if any(index.slice_spec) or len(index.slice_tensor) != len(keys):
        by_tensor: list[list[int]] = [[] for _ in keys]
        for j, row in enumerate(index.slice_tensor):
            by_tensor[row].append(j)
        for row in np.flatnonzero(counts > 1).tolist() + [
            r for r, sl in enumerate(by_tensor) if len(sl) == 1 and index.slice_spec[sl[0]]
        ]:
            key, shape = keys[row], index.shapes[row]
            specs: list[SliceSpec] = []
            for j in by_tensor[row]:
                try:
                    specs.append(parse_slice_spec(index.slice_spec[j], shape))
                except SliceSpecError as e:
                    raise CorruptIndexError(f"{path}: tensor {_shown(key)}: {e}") from None
            try:
                check_tiling(shape, specs)
            except SliceSpecError as e:
                raise CorruptIndexError(
                    f"{path}: the slices of tensor {_shown(key)} do not tile its shape "
                    f"{list(shape)}: "
                    f"{e}"
                ) from None
    names = index.entry_names()
    if len(set(names)) != len(names):
        owner: dict[tuple[int, str], str] = {}
        for j, (shard, name) in enumerate(zip(index.slice_shard, names)):
            key = keys[index.slice_tensor[j]]
            other = owner.setdefault((shard, name), key)
            if other is not key:
                raise CorruptIndexError(
                    f"{path}: entry {_shown(name)} of shard {_shown(index.shards[shard].file)} is "
                    f"claimed "
                    f"by more than one slice (tensors {_shown(other)} and {_shown(key)})"
                )


def _field(d: dict[str, Any], name: str, kind: type, path: str, where: str) -> Any:
    if name not in d:
        raise CorruptIndexError(f"{path}: missing field {where}{name}")
    v = d[name]
    if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
        raise CorruptIndexError(
            f"{path}: field {where}{name} must be {kind.__name__}, found {type(v).__name__} "
            f"{_shown(v)}"
        )
    return v


def _nonneg_int(d: dict[str, Any], name: str, path: str, where: str) -> int:
    v = _field(d, name, int, path, where)
    if v < 0:
        raise CorruptIndexError(f"{path}: field {where}{name} must be >= 0, found {_shown(v)}")
    return int(v)


def _column(d: dict[str, Any], name: str, n: int | None, path: str, where: str) -> list[Any]:
    col: list[Any] = _field(d, name, list, path, where)
    if n is not None and len(col) != n:
        raise CorruptIndexError(
            f"{path}: field {where}{name} has {len(col)} values, expected {n} (one per row)"
        )
    return col


def _str_list(d: dict[str, Any], name: str, path: str, where: str) -> list[str]:
    col = _column(d, name, None, path, where)
    if not set(map(type, col)) <= {str}:
        raise CorruptIndexError(f"{path}: field {where}{name} must be a list of strings")
    return col


def _all_in(values: list[Any], allowed: Any) -> bool:
    try:
        return set(values) <= allowed
    except TypeError:  # an unhashable value
        return False


def _nonneg_ints(values: Any) -> bool:
    values = list(values)
    return set(map(type, values)) <= _INT_ONLY and min(values, default=0) >= 0


def _check_ids(ids: list[Any], n: int, keys: list[str] | None, name: str, path: str,
               target: str) -> None:
    if _nonneg_ints(ids) and max(ids, default=-1) < n:
        return
    bad_at, bad = next((i, x) for i, x in enumerate(ids) if not (type(x) is int and 0 <= x < n))
    what = f"tensor {_shown(keys[bad_at])}" if keys is not None else f"slice {bad_at}"
    raise CorruptIndexError(
        f"{path}: {what}: {name} {_shown(bad)} is not an index into {target} ({n} entries)"
    )


_HEX_RUN: Final = re.compile(r"[0-9a-f]*")
