"""The shard header: entry layout, encoding of the safetensors header (the native kernel writes
the entries), and its decoding with every check (length prefix, JSON, dtypes, shapes, offsets
that tile the data region); `read_expected_safetensors_header` recognises the writer's own
header without parsing it."""

from __future__ import annotations

import json
import math
import operator
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Any, Final

import numpy as np

from .._kernels import _table
from ..errors import CorruptHeaderError, EntryLayoutError, TruncatedShardError
from ..sharding.tensors import columns_constructor, gc_paused
from ..values.dtypes import (
    PACKED,
    SAFETENSORS_NAMES,
    entry_sizes,
    nbytes,
    packed_problem,
    safetensors_name,
)
from .common import (
    _ITEMSIZE,
    _LEGACY_HEAD,
    HEADER_ALIGNMENT,
    MAX_HEADER_BYTES,
    MAX_NBYTES,
    MAX_NDIM,
    METADATA_KEY,
    legacy_shard_metadata,
    shard_metadata,
    shown,
)
from .strictjson import pairs_to_dict, pairs_to_plain, parse_strict_object

_LEN = struct.Struct("<Q")
HEAD_GUESS: Final = 16 * 1024  # header bytes read with the length prefix (most headers fit)
ReadRange = Callable[[int, int], bytes]  # read(start, end): bytes [start, end), fewer at the end


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


_new_entry_layouts = columns_constructor(EntryLayout)


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
    if PACKED.intersection(name for name, _ in kinds.values()):
        for name, dtype_name, shape in zip(names, dtype_names, shapes):
            problem = packed_problem(dtype_name, shape)  # no whole number of bytes
            if problem:
                raise ValueError(f"entry {name!r}{problem}")
    nbytes = entry_sizes(dtype_names, shapes)
    if len(set(sizes)) == 1:  # one item size: the order is the input order
        order: Sequence[int] = range(len(names))
    else:
        order = sorted(range(len(names)), key=[-z for z in sizes].__getitem__)  # stable
        names = [names[i] for i in order]
        dtype_names = [dtype_names[i] for i in order]
        shapes = [shapes[i] for i in order]
        nbytes = [nbytes[i] for i in order]
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
    ends = list(map(operator.add, begins, entry_sizes(dtype_names, shapes)))
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
    by the native kernel. UnicodeEncodeError for a name that is not valid UTF-8 text."""
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


class _Slow(Exception):
    """Internal: input the fast path does not handle; the fully checked path decides."""


_INT_ONLY: Final = frozenset({int})


@gc_paused()  # one GC pass at the end instead of many during the decode
def decode_safetensors_header(
    buf: bytes | bytearray | memoryview, file_size: int, path: str
) -> tuple[dict[str, EntryLayout], dict[str, str], int]:
    """Parse and validate a raw shard header from its first bytes (at least ``8 + N``).

    Returns (entries by name, in header order; ``__metadata__``; data_start). Checks the length
    prefix, JSON, every entry's dtype / shape / data_offsets, that entries tile the data region
    ``[0, file_size - data_start)`` exactly (no overlap, no hole, nothing out of range).
    """
    n = header_length(buf, file_size, path)
    if len(buf) < 8 + n:
        raise TruncatedShardError(f"{path}: got {len(buf)} bytes, the header needs {8 + n}")
    pairs = parse_strict_object(bytes(buf[8 : 8 + n]), path, CorruptHeaderError, "header ")
    header = pairs_to_dict(pairs, "header", path, CorruptHeaderError)
    data_start = 8 + n
    region = file_size - data_start
    metadata = pairs_to_plain(header.pop(METADATA_KEY, ()), "header", path, CorruptHeaderError, 2)
    if not isinstance(metadata, dict) or not all(
        isinstance(v, str) for v in metadata.values()
    ):
        raise CorruptHeaderError(
            f"{path}: {METADATA_KEY} must map str to str, got {shown(metadata, 120)}")
    try:
        entries = _decode_entries_fast(header, region)
    except _Slow:
        entries = {}
        for i, (name, value) in enumerate(header.items()):
            value = pairs_to_plain(value, "header", path, CorruptHeaderError, 2)
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
        if list(map(operator.sub, ends, begins)) != entry_sizes(dtypes, shapes):
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
    where = f"{path}: entry {shown(name)}"
    if not isinstance(e, dict):
        raise CorruptHeaderError(f"{where} must be a JSON object, found {type(e).__name__}")
    missing = {"dtype", "shape", "data_offsets"} - e.keys()
    if missing:
        raise CorruptHeaderError(f"{where} lacks the field(s) {sorted(missing)}")
    dtype = e["dtype"]
    if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
        raise CorruptHeaderError(
            f"{where} has unknown dtype {shown(dtype)}; known: {', '.join(SAFETENSORS_NAMES)}"
        )
    shape = e["shape"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CorruptHeaderError(
            f"{where}: shape must be a list of non-negative integers, found {shown(shape)}"
        )
    problem = shape_problem(shape, _ITEMSIZE[dtype]) or packed_problem(dtype, shape)
    if problem:
        raise CorruptHeaderError(f"{where}{problem}")
    offs = e["data_offsets"]
    if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)):
        raise CorruptHeaderError(
            f"{where}: data_offsets must be 2 integers, found {shown(offs)}")
    begin, end = offs
    if begin < 0 or end < begin:
        raise EntryLayoutError(f"{where}: data_offsets [{shown(begin)}, {shown(end)}] are not 0 "
                               f"<= begin <= end")
    expected = nbytes(dtype, shape)
    if end - begin != expected:
        raise EntryLayoutError(
            f"{where}: data_offsets [{shown(begin)}, {shown(end)}] span {shown(end - begin)} "
            f"bytes, but dtype {dtype} and shape {shape} need {expected}")
    return EntryLayout(name, dtype, tuple(shape), begin, end, i)


def shape_problem(shape: Sequence[int], item: int) -> str:
    """What no array can have about `shape` (non-negative ints) of `item`-byte items, worded
    after "tensor 'k'" / "entry 'e'"; "" if nothing."""
    if len(shape) > MAX_NDIM:
        return f" has {len(shape)} dimensions, more than the limit of {MAX_NDIM}"
    if math.prod(d for d in shape if d) * item > MAX_NBYTES:
        return f": shape {shown(list(shape), 200)} has more than 2**63 - 1 bytes (not counting " \
               "zero dimensions), more than any array"
    return ""


def _check_tiling(entries: Mapping[str, EntryLayout], region: int, path: str) -> None:
    pos = 0
    prev: EntryLayout | None = None
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.end > region:
            raise EntryLayoutError(
                f"{path}: entry {shown(e.name)} data_offsets [{e.begin}, {e.end}] run past the "
                f"end of the data region ({region} bytes)")
        if e.begin < pos:
            assert prev is not None
            raise EntryLayoutError(
                f"{path}: entries {shown(prev.name)} [{prev.begin}, {prev.end}] and "
                f"{shown(e.name)} [{e.begin}, {e.end}] overlap")
        if e.begin > pos:
            after = f"after entry {shown(prev.name)}" if prev is not None else "at the start"
            raise EntryLayoutError(
                f"{path}: hole of {e.begin - pos} bytes {after} (bytes {pos}..{e.begin}) "
                f"before entry {shown(e.name)}"
            )
        if e.nbytes:  # empty entries may sit anywhere inside the covered range
            pos, prev = e.end, e
    if pos != region:
        raise EntryLayoutError(
            f"{path}: {region - pos} bytes after the last entry are not covered by any entry "
            f"(data region is {region} bytes, entries end at {pos})"
        )


def read_header_bytes(read: ReadRange, file_size: int, path: str) -> bytes:
    """The 8-byte prefix and the N header bytes of a shard of `file_size` bytes, read through
    ``read(start, end)`` (a local file's pread, a store's ranged GET).

    The first read takes HEAD_GUESS bytes more than the prefix, so most headers come in one
    read; N is checked against the limit and the file size before more is read.
    """
    head = read(0, min(file_size, 8 + HEAD_GUESS))
    n = header_length(head[:8], file_size, path)
    if 8 + n > len(head):
        head += read(len(head), 8 + n)
    if len(head) < 8 + n:
        raise TruncatedShardError(f"{path}: header cut short: read {len(head) - 8} of {n} bytes")
    return head[: 8 + n]


def read_safetensors_header(
    read: ReadRange, file_size: int, path: str
) -> tuple[dict[str, EntryLayout], dict[str, str], int]:
    """Read (`read_header_bytes`) and decode the header of a shard of `file_size` bytes."""
    return decode_safetensors_header(read_header_bytes(read, file_size, path), file_size, path)


def read_expected_safetensors_header(
    read: ReadRange, file_size: int, path: str,
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
    head = read_header_bytes(read, file_size, path)
    body, n = head[8:], len(head) - 8
    meta = (legacy_shard_metadata(generation) if body.startswith(_LEGACY_HEAD)
            else shard_metadata(generation))
    begins = _match_header(body, file_size - 8 - n, names, dtype_names, shapes, meta)
    if begins is not None:
        return None, meta, 8 + n, begins
    return (*decode_safetensors_header(head, file_size, path), None)


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
    ends = list(accumulate(entry_sizes(dtype_names, shapes)))
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
