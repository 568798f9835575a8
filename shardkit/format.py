"""Checkpoint format v1: pure encode/decode of shard headers and index.json, with every limit.

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
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain, compress, repeat
from json.encoder import encode_basestring
from typing import Any, BinaryIO, Final

import numpy as np

from .dtypes import SAFETENSORS_NAMES, itemsize, safetensors_name
from .errors import (
    CheckpointFormatError,
    CorruptHeaderError,
    CorruptIndexError,
    EntryLayoutError,
    ShardPathError,
    SliceSpecError,
    TruncatedShardError,
    UnsupportedVersionError,
)
from .slices import WHOLE, SliceSpec, check_tiling, parse_slice_spec
from .tensors import _columns_constructor, _gc_paused

FORMAT_NAME: Final = "shardkit"
FORMAT_VERSION: Final = "1.0"
FORMAT_MAJOR: Final = 1
INDEX_FILE: Final = "index.json"
MAX_HEADER_BYTES: Final = 100 * 1024 * 1024
MAX_INDEX_BYTES: Final = 1024 * 1024 * 1024
RAW_SUFFIX: Final = ".safetensors"
ZSTD_SUFFIX: Final = ".skz"
CODEC_SUFFIXES: Final[dict[str, str]] = {"raw": RAW_SUFFIX, "zstd": ZSTD_SUFFIX}
HEADER_ALIGNMENT: Final = 8
METADATA_KEY: Final = "__metadata__"

_ITEMSIZE: Final[dict[str, int]] = {name: itemsize(name) for name in SAFETENSORS_NAMES}
_XXH3_RE: Final = re.compile(r"[0-9a-f]{16}")
_LEN = struct.Struct("<Q")


def shard_file_name(index: int, count: int, codec: str = "raw") -> str:
    """``shard-00000-of-00003.safetensors`` (``.skz`` for codec ``"zstd"``)."""
    try:
        suffix = CODEC_SUFFIXES[codec]
    except KeyError:
        raise ValueError(f"unknown codec {codec!r}; known: {', '.join(CODEC_SUFFIXES)}") from None
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} is outside 0..{count - 1}")
    return f"shard-{index:05d}-of-{count:05d}{suffix}"


def entry_name(key: str, slice_spec: str = WHOLE) -> str:
    """The entry name in a shard: the key for a whole tensor, ``"key:spec"`` for a slice."""
    return key if slice_spec == WHOLE else f"{key}:{slice_spec}"


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


def data_size(layouts: Sequence[EntryLayout]) -> int:
    """Bytes of the data region covered by `layouts`."""
    return max((e.end for e in layouts), default=0)


def encode_safetensors_header(
    layouts: Sequence[EntryLayout], metadata: Mapping[str, str] | None = None
) -> bytes:
    """The 8-byte length prefix plus the space-padded JSON header; data starts at len(result).

    `metadata` (str -> str, as safetensors requires) is merged into ``__metadata__`` after
    ``"format": "shardkit"``. Entries appear in the order given (use `layout_entries`).
    """
    meta: dict[str, str] = {"format": FORMAT_NAME}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"shard metadata must map str to str, got {k!r}: {v!r}")
        meta[k] = v
    names = [e.name for e in layouts]
    if METADATA_KEY in names or len(set(names)) != len(names):
        seen = {METADATA_KEY}
        for name in names:
            if name in seen:
                raise ValueError(f"entry name {name!r} is reserved or appears twice")
            seen.add(name)
    try:
        text = _header_text(names, [e.dtype_name for e in layouts], [e.shape for e in layouts],
                            [e.begin for e in layouts], [e.end for e in layouts], meta)
    except UnicodeEncodeError as err:
        raise ValueError(f"an entry name cannot be encoded as UTF-8: {err}") from None
    if len(text) > MAX_HEADER_BYTES:
        raise ValueError(
            f"shard header would be {len(text)} bytes, over the {MAX_HEADER_BYTES}-byte limit; "
            "use more, smaller shards"
        )
    return _LEN.pack(len(text)) + text


def _header_text(
    names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[tuple[int, ...]],
    begins: Sequence[int], ends: Sequence[int], meta: Mapping[str, str],
) -> bytes:
    """The space-padded JSON header, byte-identical to ``json.dumps(header, separators=(",",
    ":"), ensure_ascii=False)``, built from pieces: dtype names need no escaping, dims and
    offsets are ints. UnicodeEncodeError for a name that is not valid UTF-8 text."""
    parts = [f'{{"{METADATA_KEY}":{json.dumps(meta, separators=(",", ":"), ensure_ascii=False)}']
    parts += [
        f'{name}:{{"dtype":"{dtype}","shape":[{dims}],"data_offsets":[{begin},{end}]}}'
        for name, dtype, dims, begin, end in zip(
            map(encode_basestring, names), dtype_names, _int_lists(list(shapes)), begins, ends
        )
    ]
    text = (",".join(parts) + "}").encode("utf-8")
    return text + b" " * (-(len(text) + 8) % HEADER_ALIGNMENT)


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
        raise error(f"{path}: {subject}not UTF-8 ({e})") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: {subject}not valid JSON ({e})") from None
    except RecursionError:
        raise error(f"{path}: {what}JSON is nested too deeply") from None
    if type(parsed) is not tuple:
        raise error(f"{path}: {what}must be a JSON object, found {type(parsed).__name__}")
    return parsed


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
                raise error(f"{path}: {what} has the key {k!r} twice")
            seen.add(k)
    return out


def _plain(x: Any, what: str, path: str, error: type) -> Any:
    """`x` from `_loads_pairs` with every nested object turned into a dict (duplicates checked)."""
    t = type(x)
    if t is tuple:
        d = _object(x, what, path, error)
        for k, v in d.items():
            if type(v) is tuple or type(v) is list:
                d[k] = _plain(v, what, path, error)
        return d
    if t is list:
        return [_plain(v, what, path, error) if type(v) in _CONTAINERS else v for v in x]
    return x


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
    try:
        metadata = _plain(header.pop(METADATA_KEY, ()), "header", path, CorruptHeaderError)
    except RecursionError:
        raise CorruptHeaderError(f"{path}: {METADATA_KEY} is nested too deeply") from None
    if not isinstance(metadata, dict) or not all(
        isinstance(v, str) for v in metadata.values()
    ):
        raise CorruptHeaderError(f"{path}: {METADATA_KEY} must map str to str, got {metadata!r}")
    try:
        entries = _decode_entries_fast(header, region)
    except _Slow:
        entries = {}
        for i, (name, value) in enumerate(header.items()):
            value = _plain(value, "header", path, CorruptHeaderError)
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
    where = f"{path}: entry {name!r}"
    if not isinstance(e, dict):
        raise CorruptHeaderError(f"{where} must be a JSON object, found {type(e).__name__}")
    missing = {"dtype", "shape", "data_offsets"} - e.keys()
    if missing:
        raise CorruptHeaderError(f"{where} lacks the field(s) {sorted(missing)}")
    dtype = e["dtype"]
    if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
        raise CorruptHeaderError(
            f"{where} has unknown dtype {dtype!r}; known: {', '.join(SAFETENSORS_NAMES)}"
        )
    shape = e["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CorruptHeaderError(
            f"{where}: shape must be a list of non-negative integers, found {shape!r}"
        )
    offs = e["data_offsets"]
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)):
        raise CorruptHeaderError(f"{where}: data_offsets must be 2 integers, found {offs!r}")
    begin, end = offs
    if begin < 0 or end < begin:
        raise EntryLayoutError(f"{where}: data_offsets [{begin}, {end}] are not 0 <= begin <= end")
    expected = math.prod(shape) * _ITEMSIZE[dtype]
    if end - begin != expected:
        raise EntryLayoutError(
            f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes, but dtype {dtype} "
            f"and shape {shape} need {expected}"
        )
    return EntryLayout(name, dtype, tuple(shape), begin, end, i)


def _check_tiling(entries: Mapping[str, EntryLayout], region: int, path: str) -> None:
    pos = 0
    prev: EntryLayout | None = None
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.end > region:
            raise EntryLayoutError(
                f"{path}: entry {e.name!r} data_offsets [{e.begin}, {e.end}] run past the end of "
                f"the data region ({region} bytes)"
            )
        if e.begin < pos:
            assert prev is not None
            raise EntryLayoutError(
                f"{path}: entries {prev.name!r} [{prev.begin}, {prev.end}] and {e.name!r} "
                f"[{e.begin}, {e.end}] overlap"
            )
        if e.begin > pos:
            after = f"after entry {prev.name!r}" if prev is not None else "at the start"
            raise EntryLayoutError(
                f"{path}: hole of {e.begin - pos} bytes {after} (bytes {pos}..{e.begin}) "
                f"before entry {e.name!r}"
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
    expected: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
) -> tuple[dict[str, EntryLayout], dict[str, str], int, bool]:
    """`read_safetensors_header`, plus whether the header is exactly what the writer makes of
    `expected` (entry name, dtype, shape, in shard input order) with no extra metadata.

    When it is, nothing needs parsing: the bytes equal the canonical encoding of a layout that
    is valid by construction (unique names, contiguous entries), so the result is the one
    `decode_safetensors_header` would return, and every entry is known to have the expected
    dtype and shape. Otherwise the header is decoded and checked as usual (flag False).
    """
    prefix = _pread(f, 8, 0)
    n = header_length(prefix, file_size, path)
    body = _pread(f, n, 8)
    if len(body) < n:
        raise TruncatedShardError(f"{path}: header cut short: read {len(body)} of {n} bytes")
    with _gc_paused():
        found = _match_header(body, file_size - 8 - n, expected)
    if found is not None:
        return found, {"format": FORMAT_NAME}, 8 + n, True
    return (*decode_safetensors_header(prefix + body, file_size, path), False)


def _match_header(
    body: bytes, region: int, expected: Sequence[tuple[str, np.dtype, tuple[int, ...]]]
) -> dict[str, EntryLayout] | None:
    try:
        names, dtype_names, shapes, begins, ends, _ = _layout_columns(expected)
        if METADATA_KEY in names or region != (ends[-1] if ends else 0):
            return None
        text = _header_text(names, dtype_names, shapes, begins, ends, {"format": FORMAT_NAME})
    except (ValueError, TypeError, UnicodeEncodeError):  # duplicates, bad names: decode instead
        return None
    if text != body:
        return None
    layouts = _new_entry_layouts(names, dtype_names, shapes, begins, ends, range(len(names)))
    return dict(zip(names, layouts))


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


# --- index.json -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One shard file: plain file name, device task, codec ("raw" / "zstd"), size in bytes."""

    file: str
    task: int
    codec: str
    bytes: int


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


@dataclass(slots=True)
class CheckpointIndex:
    """The content of index.json. `tensors` keeps the order the tensors were saved in."""

    callback: str
    shards: list[ShardInfo]
    tensors: dict[str, TensorInfo]
    user_metadata: dict[str, Any] = field(default_factory=dict)
    version: str = FORMAT_VERSION


def encode_index(index: CheckpointIndex) -> bytes:
    """index.json bytes (compact UTF-8 JSON and a newline), with the HuggingFace-style
    metadata.total_size and weight_map (tensors stored whole, in an entry named after their key).

    The bytes equal ``json.dumps(doc, separators=(",", ":"), ensure_ascii=False)`` of the
    document described in docs/FORMAT.md; whole tensors (the bulk of a big checkpoint) are
    formatted column-wise from a template, which is ~10x faster than the json encoder.
    """
    shards = index.shards
    keys = list(index.tensors)
    infos = list(index.tensors.values())
    try:
        user_metadata = _dumps(index.user_metadata)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint metadata is not JSON-serialisable: {e}") from None
    total = sum(map(operator.mul, map(math.prod, map(_shape_of, infos)),
                    map(_ITEMSIZE.__getitem__, map(_dtype_of, infos))))
    encoded_keys = list(map(encode_basestring, keys))
    pieces = _whole_tensor_pieces(encoded_keys, infos)
    for i, t in enumerate(infos):
        if len(t.slices) != 1 or t.slices[0].spec != WHOLE:
            pieces[i] = f"{encoded_keys[i]}:{_dumps(_tensor_doc(t))}"
    # only tensors stored whole under their own key, which is what HF-style tools look up
    files = [encode_basestring(s.file) for s in shards]
    single = [len(t.slices) == 1 for t in infos]
    firsts = [t.slices[0] for t in infos]
    own_entry = map(operator.eq, map(operator.attrgetter("entry"), firsts), keys)
    in_map = list(map(operator.and_, single, own_entry))
    weight_map = ",".join(map("".join, zip(
        compress(encoded_keys, in_map),
        repeat(":"),
        map(files.__getitem__, map(operator.attrgetter("shard"), compress(firsts, in_map))),
    )))
    shard_list = _dumps([
        {"file": s.file, "task": s.task, "codec": s.codec, "bytes": s.bytes} for s in shards
    ])
    text = (
        f'{{"format":{_dumps(FORMAT_NAME)},"format_version":{_dumps(index.version)},'
        f'"metadata":{{"total_size":{total}}},"weight_map":{{{weight_map}}},'
        f'"shardkit":{{"callback":{_dumps(index.callback)},"shards":{shard_list},'
        f'"tensors":{{{",".join(pieces)}}},"user_metadata":{user_metadata}}}}}'
    )
    return text.encode("utf-8") + b"\n"


_shape_of = operator.attrgetter("shape")
_dtype_of = operator.attrgetter("dtype")


def _dumps(value: Any) -> str:
    # compact: with indent, json falls back to its pure-Python encoder (20x slower)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _whole_tensor_pieces(encoded_keys: list[str], infos: list[TensorInfo]) -> list[str]:
    """``"key":{...}`` for each tensor as if whole (split ones are redone by the caller)."""
    device_of = operator.attrgetter("device")
    devices = {d: encode_basestring(d) for d in set(map(device_of, infos))}
    first = [t.slices[0] for t in infos]
    hashes = ["null" if x is None else encode_basestring(x) for x in map(_xxh3_of, first)]
    return [
        f'{k}:{{"dtype":"{dt}","shape":[{shape}],"device":{dev},'
        f'"slices":[{{"spec":"","shard":{shard},"entry":{entry},"xxh3":{h}}}]}}'
        for k, dt, shape, dev, shard, entry, h in zip(
            encoded_keys,
            map(_dtype_of, infos),
            _int_lists(list(map(_shape_of, infos))),
            map(devices.__getitem__, map(device_of, infos)),
            map(operator.attrgetter("shard"), first),
            map(encode_basestring, map(operator.attrgetter("entry"), first)),
            hashes,
        )
    ]


def _int_lists(shapes: list[tuple[int, ...]]) -> list[str]:
    """``"2,3"`` for each shape: one C-level json.dumps, split (ints hold no brackets)."""
    if not shapes:
        return []
    try:
        text = json.dumps(shapes, separators=(",", ":"))
    except TypeError:  # numpy integers in a shape
        return [",".join(map(str, map(int, s))) for s in shapes]
    return text[2:-2].split("],[")


_xxh3_of = operator.attrgetter("xxh3")


def _tensor_doc(t: TensorInfo) -> dict[str, Any]:
    return {
        "dtype": t.dtype,
        "shape": list(t.shape),
        "device": t.device,
        "slices": [
            {"spec": s.spec, "shard": s.shard, "entry": s.entry, "xxh3": s.xxh3}
            for s in t.slices
        ],
    }


def parse_version(version: Any, path: str) -> tuple[int, int]:
    """(major, minor) of a "MAJOR.MINOR" version; refuses majors newer than this reader's."""
    m = re.fullmatch(r"(\d+)\.(\d+)", version) if isinstance(version, str) else None
    if m is None:
        raise CorruptIndexError(
            f"{path}: format_version must be a string like \"1.0\", found {version!r}"
        )
    major, minor = int(m.group(1)), int(m.group(2))
    if major > FORMAT_MAJOR:
        raise UnsupportedVersionError(
            f"{path}: checkpoint format version {version} is newer than this shardkit reads "
            f"(up to {FORMAT_MAJOR}.x); upgrade shardkit to read it"
        )
    if major < 1:
        raise CorruptIndexError(f"{path}: format_version {version!r} is not a shardkit version")
    return major, minor


def check_shard_file_name(name: Any, path: str) -> str:
    """`name` if it is a plain file name inside the checkpoint directory, else ShardPathError."""
    if not isinstance(name, str) or not name:
        raise CorruptIndexError(f"{path}: shard file name must be a non-empty string, got {name!r}")
    if (
        "/" in name
        or "\\" in name
        or "\0" in name
        or name in (".", "..")
        or name.startswith("..")
        or os.path.isabs(name)
        or (len(name) > 1 and name[1] == ":")  # Windows drive
        or name == INDEX_FILE
    ):
        raise ShardPathError(
            f"{path}: shard file name {name!r} is not a plain file name inside the checkpoint "
            "directory (no '/', '\\', '..', absolute paths, drive letters, NUL or index.json)"
        )
    return name


def decode_index(data: bytes, path: str) -> CheckpointIndex:
    """Parse and validate index.json; every error is a CorruptIndexError (or subclass)
    naming `path` and the field, except newer majors: UnsupportedVersionError."""
    with _gc_paused():  # one GC pass at the end instead of many during the decode
        return _decode_index(data, path)


def _decode_index(data: bytes, path: str) -> CheckpointIndex:
    raw = _parse_object(bytes(data), path, CorruptIndexError, "")
    try:
        doc = _index_objects(raw, path)
    except RecursionError:
        raise CorruptIndexError(f"{path}: JSON is nested too deeply") from None
    if doc.get("format") != FORMAT_NAME:
        raise CorruptIndexError(
            f"{path}: \"format\" must be {FORMAT_NAME!r}, found {doc.get('format')!r} "
            "(not a shardkit checkpoint index)"
        )
    version = doc.get("format_version")
    parse_version(version, path)
    assert isinstance(version, str)  # parse_version checked it
    sk = _field(doc, "shardkit", dict, path, "")
    for name, kind in (("metadata", dict), ("weight_map", dict)):
        if name in doc and not isinstance(doc[name], kind):
            raise CorruptIndexError(f"{path}: {name!r} must be a JSON object")
    callback = _field(sk, "callback", str, path, "shardkit.")
    user_metadata = _field(sk, "user_metadata", dict, path, "shardkit.")
    raw_shards = _field(sk, "shards", list, path, "shardkit.")
    shards: list[ShardInfo] = []
    seen_files: set[str] = set()
    for i, s in enumerate(raw_shards):
        where = f"shardkit.shards[{i}]."
        if not isinstance(s, dict):
            raise CorruptIndexError(f"{path}: shardkit.shards[{i}] must be a JSON object")
        file = check_shard_file_name(_field(s, "file", str, path, where), path)
        if file in seen_files:
            raise CorruptIndexError(f"{path}: shard file {file!r} is listed twice")
        seen_files.add(file)
        task = _nonneg_int(s, "task", path, where)
        codec = _field(s, "codec", str, path, where)
        nbytes = _nonneg_int(s, "bytes", path, where)
        shards.append(ShardInfo(file, task, codec, nbytes))
    raw_tensors = _field(sk, "tensors", dict, path, "shardkit.")
    tensors = _decode_tensors(raw_tensors, len(shards), path)
    claims = [(s.shard, s.entry) for t in tensors.values() for s in t.slices]
    if len(set(claims)) != len(claims):
        owner: dict[tuple[int, str], str] = {}
        for key, t in tensors.items():
            for s in t.slices:
                if (s.shard, s.entry) in owner:
                    other = owner[(s.shard, s.entry)]
                    raise CorruptIndexError(
                        f"{path}: entry {s.entry!r} of shard {shards[s.shard].file!r} is claimed "
                        f"by more than one slice (tensors {other!r} and {key!r})"
                    )
                owner[(s.shard, s.entry)] = key
    return CheckpointIndex(callback, shards, tensors, user_metadata, version)


def _field(d: dict[str, Any], name: str, kind: type, path: str, where: str) -> Any:
    if name not in d:
        raise CorruptIndexError(f"{path}: missing field {where}{name}")
    v = d[name]
    if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
        raise CorruptIndexError(
            f"{path}: field {where}{name} must be {kind.__name__}, found {type(v).__name__} {v!r}"
        )
    return v


def _nonneg_int(d: dict[str, Any], name: str, path: str, where: str) -> int:
    v = _field(d, name, int, path, where)
    if v < 0:
        raise CorruptIndexError(f"{path}: field {where}{name} must be >= 0, found {v}")
    return int(v)


def _index_objects(raw: tuple[tuple[str, Any], ...], path: str) -> dict[str, Any]:
    """The index document from `_loads_pairs` as dicts, duplicates checked everywhere, except
    that the values of ``shardkit.tensors`` stay pairs for `_decode_tensors`."""
    what, err = "index.json", CorruptIndexError
    doc = _object(raw, what, path, err)
    for k, v in doc.items():
        if k == "shardkit" and type(v) is tuple:
            sk = doc[k] = _object(v, what, path, err)
            for name, value in sk.items():
                if name == "tensors" and type(value) is tuple:
                    sk[name] = _object(value, what, path, err)
                else:
                    sk[name] = _plain(value, what, path, err)
        else:
            doc[k] = _plain(v, what, path, err)
    return doc


_TENSOR_KEYS: Final = ("dtype", "shape", "device", "slices", "spec", "shard", "entry", "xxh3")
_HEX_RUN: Final = re.compile(r"[0-9a-f]*")


def _decode_tensors(raw: dict[str, Any], n_shards: int, path: str) -> dict[str, TensorInfo]:
    """Decode ``shardkit.tensors`` (values as pairs, see `_index_objects`), in order.

    Whole tensors in the writer's exact key order take the fast path: unpacked in one loop,
    validated column-wise in bulk. Everything else (split tensors, other key orders, anything
    invalid) goes through `_decode_tensor_checked`, which owns the error messages.
    """
    fast, slow = _partition(raw)
    out: dict[str, TensorInfo] = {}
    if fast:
        keys, dtypes, shapes, devices, shards, entries, xxh3s = fast
        if _valid_whole_tensors(dtypes, shapes, devices, shards, entries, xxh3s, n_shards):
            slice_infos = _new_slice_infos(repeat(WHOLE, len(keys)), shards, entries, xxh3s)
            slices = map(list, zip(slice_infos))  # [[slice], ...]
            out = dict(zip(keys, _new_tensor_infos(dtypes, map(tuple, shapes), devices, slices)))
        else:
            slow = list(raw)
    if slow:
        for key in slow:
            value = _plain(raw[key], "index.json", path, CorruptIndexError)
            out[key] = _decode_tensor_checked(key, value, n_shards, path)
        out = {key: out[key] for key in raw}  # back into index order
    return out


def _partition(raw: dict[str, Any]) -> tuple[tuple[Sequence[Any], ...] | None, list[str]]:
    """Columns (keys, dtypes, shapes, devices, shards, entries, xxh3s) of the whole tensors in
    the writer's exact key order (values not checked yet), and the keys of all other tensors."""
    fast = []
    slow: list[str] = []
    for key, t in raw.items():
        try:
            (k1, dtype), (k2, shape), (k3, device), (k4, (s,)) = t
            (j1, spec), (j2, shard), (j3, entry), (j4, xxh3) = s
        except (TypeError, ValueError):
            slow.append(key)
            continue
        if (
            type(t) is tuple  # a JSON object, not an array of arrays
            and type(s) is tuple
            and (k1, k2, k3, k4, j1, j2, j3, j4) == _TENSOR_KEYS
            and spec == WHOLE
        ):
            fast.append((key, dtype, shape, device, shard, entry, xxh3))
        else:
            slow.append(key)
    return (tuple(zip(*fast)) if fast else None), slow


def _valid_whole_tensors(
    dtypes: Sequence[Any], shapes: Sequence[Any], devices: Sequence[Any], shards: Sequence[Any],
    entries: Sequence[Any], xxh3s: Sequence[Any], n_shards: int,
) -> bool:
    """Bulk form of `_decode_tensor_checked`'s checks for whole tensors (C-level loops)."""
    try:
        if not set(dtypes) <= _ITEMSIZE.keys():
            return False
    except TypeError:  # an unhashable dtype value
        return False
    if set(map(type, shapes)) != {list}:
        return False
    dims = list(chain.from_iterable(shapes))
    if not set(map(type, dims)) <= _INT_ONLY or min(dims, default=0) < 0:
        return False
    if set(map(type, devices)) != {str} or set(map(type, entries)) != {str}:
        return False
    if set(map(type, shards)) != {int} or min(shards) < 0 or max(shards) >= n_shards:
        return False
    hashes = [x for x in xxh3s if x is not None]
    return not hashes or (
        set(map(type, hashes)) == {str}
        and set(map(len, hashes)) == {16}
        and _HEX_RUN.fullmatch("".join(hashes)) is not None
    )


def _decode_tensor_checked(key: str, t: Any, n_shards: int, path: str) -> TensorInfo:
    where = f"shardkit.tensors[{key!r}]."
    if not isinstance(t, dict):
        raise CorruptIndexError(f"{path}: tensor {key!r} must be a JSON object")
    dtype = _field(t, "dtype", str, path, where)
    if dtype not in _ITEMSIZE:
        raise CorruptIndexError(
            f"{path}: tensor {key!r} has unknown dtype {dtype!r}; known: "
            + ", ".join(SAFETENSORS_NAMES)
        )
    shape = _field(t, "shape", list, path, where)
    if not all(_is_int(d) and d >= 0 for d in shape):
        raise CorruptIndexError(
            f"{path}: tensor {key!r} shape must be a list of non-negative integers, found {shape}"
        )
    shape_t = tuple(shape)
    device = _field(t, "device", str, path, where)
    raw_slices = _field(t, "slices", list, path, where)
    if not raw_slices:
        raise CorruptIndexError(f"{path}: tensor {key!r} has no slices")
    slices: list[SliceInfo] = []
    specs: list[SliceSpec] = []
    for j, s in enumerate(raw_slices):
        sw = f"{where}slices[{j}]."
        if not isinstance(s, dict):
            raise CorruptIndexError(f"{path}: {sw[:-1]} must be a JSON object")
        spec = _field(s, "spec", str, path, sw)
        shard = _nonneg_int(s, "shard", path, sw)
        if shard >= n_shards:
            raise CorruptIndexError(
                f"{path}: tensor {key!r} slice {spec!r} is in shard {shard}, but the checkpoint "
                f"has {n_shards} shard(s)"
            )
        entry = _field(s, "entry", str, path, sw)
        xxh3 = s.get("xxh3", None)
        if xxh3 is not None and not (isinstance(xxh3, str) and _XXH3_RE.fullmatch(xxh3)):
            raise CorruptIndexError(
                f"{path}: tensor {key!r} slice {spec!r}: xxh3 must be 16 lowercase hex digits "
                f"or null, found {xxh3!r}"
            )
        try:
            specs.append(parse_slice_spec(spec, shape_t))
        except SliceSpecError as e:
            raise CorruptIndexError(f"{path}: tensor {key!r}: {e}") from None
        slices.append(SliceInfo(spec, shard, entry, xxh3))
    if len(slices) > 1 or slices[0].spec != WHOLE:
        try:
            check_tiling(shape_t, specs)
        except SliceSpecError as e:
            raise CorruptIndexError(
                f"{path}: the slices of tensor {key!r} do not tile its shape {list(shape_t)}: {e}"
            ) from None
    return TensorInfo(dtype, shape_t, device, slices)
