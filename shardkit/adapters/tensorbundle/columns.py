"""The entries of a TensorBundle ``.index``, column-wise: per tensor its key, dtype name and
shape, per stored entry its data file, offset, size and crc32c (int64 arrays), and the DT_STRING
tensors apart, every field checked. `framed_columns` reads a bundle of whole tensors from one
protobuf decode of all its entries; `entry_columns` decodes each entry as a message of its own
(any bundle, sliced tensors reassembled from their slices' entries, and the wording of every
error). `adapter.decode_bundle` builds the `TensorBundleIndex` from these columns.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any, NamedTuple

import numpy as np

from ...errors import CorruptIndexError, UnsupportedDTypeError
from ...format import shape_problem, shown
from ...values.dtypes import itemsize
from ...values.slices import WHOLE, format_slice_spec
from .datatypes import DATA_TYPE_NAMES, DATATYPE_OF, DTYPE_OF, STRING
from .names import encode_slice_key


def _entry(key: bytes, value: bytes, path: str) -> Any:
    from .protos import BundleEntryProto, DecodeError

    entry = BundleEntryProto()
    try:
        entry.ParseFromString(value)
    except DecodeError as e:
        raise CorruptIndexError(f"{path}: entry for key {shown(key)} is not a parseable "
                                f"BundleEntryProto ({e})") from None
    return entry


def _shape(entry: Any, key: str, path: str) -> tuple[int, ...]:
    if entry.shape.unknown_rank:
        raise CorruptIndexError(f"{path}: tensor {shown(key)} has an unknown rank")
    dims = tuple(d.size for d in entry.shape.dim)
    if any(d < 0 for d in dims):
        raise CorruptIndexError(f"{path}: tensor {shown(key)} has a negative dimension in "
                                f"shape {list(dims)}")
    if math.prod(dims) >= 1 << 62:
        raise CorruptIndexError(f"{path}: tensor {shown(key)}: shape {list(dims)} is too large")
    return dims


def _no_array(key: str, dtype: str, shape: tuple[int, ...], path: str) -> None:
    """Refuse a shape no numpy array can have: more than 2**63 - 1 bytes, zero dimensions left
    out (the safetensors header checks' rule). An entry's size check covers the tensors that
    hold data; this is for those that hold none (a zero dimension) and for sliced tensors,
    whose full shape no stored size bounds."""
    problem = shape_problem(shape, np.dtype(object).itemsize if dtype == STRING
                             else itemsize(dtype))
    if problem:
        raise CorruptIndexError(f"{path}: tensor {shown(key)}{problem}")


def _dims(encoded: bytes, raw_key: bytes, value: bytes, key: str, path: str
          ) -> tuple[int, ...]:
    """The dims of an encoded TensorShapeProto; any problem is worded by `_shape`."""
    from .protos import DecodeError, TensorShapeProto

    try:
        m = TensorShapeProto.FromString(encoded)
    except DecodeError:
        m = None
    if m is not None:
        dims = tuple([d.size for d in m.dim])
        if not m.unknown_rank and (not dims or min(dims) >= 0) and math.prod(dims) < 1 << 62:
            return dims
    return _shape(_entry(raw_key, value, path), key, path)


def _dtype(entry: Any, key: str, path: str) -> str:
    name = DTYPE_OF.get(entry.dtype)
    if name is None:
        raise UnsupportedDTypeError(
            f"{path}: tensor {shown(key)} has TensorFlow dtype "
            f"{DATA_TYPE_NAMES.get(entry.dtype, entry.dtype)}, which shardkit cannot store or "
            f"read (it reads {', '.join(DATA_TYPE_NAMES[t] for t in DTYPE_OF)})")
    return name


def entry_columns(body: list[tuple[bytes, bytes]], n: int, path: str) -> _Columns:
    """The columns of the entries `body` (key, value), each entry decoded as a message of its
    own: any bundle, and the wording of every error."""
    from .protos import DecodeError, parse_entries

    try:
        # one protobuf call for all entries, their shapes left encoded (`protos`)
        parsed = list(parse_entries([v for _, v in body]))  # wrappers made once, reused
    except DecodeError:
        for k, v in body:
            _entry(k, v, path)  # the first that does not parse raises, naming its key
        raise
    encoded = [f.shape for f in parsed]
    for i in _merged_shapes([v for _, v in body]):  # protobuf merges a message field given
        encoded[i] = _entry(*body[i], path).shape.SerializeToString()  # twice: as it does
    # slice keys start with a 0 byte: in key order (checked) they come first after the header
    if (body and body[0][0][:1] == b"\x00") or any(map(operator.attrgetter("slices"), parsed)):
        return _general_columns(body, parsed, encoded, n, path)
    count = len(parsed)
    shard, offset, size, crc = (np.fromiter([getattr(f, name) for f in parsed], np.int64, count)
                                for name in ("shard_id", "offset", "size", "crc32c"))
    return _whole_columns([k for k, _ in body], [v for _, v in body].__getitem__,
                          _numbered(encoded), [f.dtype for f in parsed], shard, offset, size, crc,
                          n, path)


def _merged_shapes(values: list[bytes]) -> list[int]:
    """The entries (of encodings `values`) that hold their shape field more than once, which
    protobuf merges: their shapes are not the last one's bytes. All of them when that cannot
    be told (an entry holds a shape of one byte, which is none)."""
    from .protos import MARKS, DecodeError, parse_columns

    try:
        column = parse_columns(b"".join(chain.from_iterable(zip(repeat(MARKS), values)))).shape
    except DecodeError:
        return list(range(len(values)))
    marks = np.flatnonzero(np.fromiter(map(len, column), np.int64, len(column)) == 1)
    if len(marks) != len(values):
        return list(range(len(values)))
    return np.flatnonzero(np.diff(marks, append=len(column)) > 2).tolist()


def _marked(column: Any, count: int, dtype: Any = np.int64) -> np.ndarray | None:
    """Per entry, the last value of a field decoded by `protos.parse_columns` (each entry's
    values after its mark, a 0; none: the entry's value is 0), or None when the marks do not
    tell the entries apart (an entry stores an explicit 0, or the field twice)."""
    values = np.array(column, dtype)
    marks = np.flatnonzero(values == 0)
    if len(marks) != count:
        return None
    if count == 0:
        return values
    runs = np.diff(marks, append=len(values))
    if runs.max() > 2:
        return None
    return np.where(runs == 2, values[np.minimum(marks + 1, len(values) - 1)], 0).astype(
        np.int64)


_Numbered = tuple[list[bytes], np.ndarray]
"""Encoded shapes, each entry's as a number: (the distinct encodings, each entry's number)."""


def _numbered(encoded: list[bytes]) -> _Numbered:
    """`encoded` (one per entry) as distinct encodings and a number per entry."""
    number = {e: i for i, e in enumerate(dict.fromkeys(encoded))}
    return list(number), np.fromiter(map(number.__getitem__, encoded), np.intp, len(encoded))


def _marked_shapes(column: Any, count: int) -> tuple[_Numbered, np.ndarray, np.ndarray] | None:
    """Per entry, its encoded shape (b"" when it has none: a scalar) as a number into the
    distinct encodings, whether it has one and its length, from the shapes decoded by
    `protos.parse_columns` (each entry's after its one-byte mark); None when the marks do not
    tell the entries apart (a shape of one byte, which is no shape, or an entry with two)."""
    from .protos import SHAPE_MARK

    values = [b"", SHAPE_MARK, *column]  # numbered 0 (no shape) and 1 (the mark) first
    distinct, which = _numbered(values)
    which = which[2:]
    lengths = np.fromiter(map(len, distinct), np.int64, len(distinct))[which]
    marks = np.flatnonzero(lengths == 1)
    if len(marks) != count:
        return None
    if count == 0:
        return ([b""], np.zeros(0, np.intp)), np.zeros(0, bool), np.zeros(0, np.int64)
    runs = np.diff(marks, append=len(which))
    if runs.max() > 2:
        return None
    present = runs == 2
    at = marks + present
    distinct[1] = b""  # the mark is no entry's shape: decoded as an empty one, never used
    return ((distinct, np.where(present, which[at], 0)), present,
            np.where(present, lengths[at], 0))


def _varint_sizes(values: np.ndarray) -> np.ndarray:
    """The bytes of each value as a protobuf varint (negative values: 10, two's complement)."""
    u = values.astype(np.uint64)
    sizes = np.ones(len(values), np.int64)
    for k in range(1, 10):
        sizes += u >= np.uint64(1 << (7 * k))
    return sizes


def framed_columns(raw_keys: list[bytes], framed: bytearray, start: int, lengths: list[int],
                    n: int, path: str) -> _Columns | None:
    """The columns of a bundle of whole tensors from one protobuf decode of all its entries
    (`protos.parse_columns` of `framed` from `start`: each entry after `protos.MARKS`); None
    when the general path must read it (`entry_columns`): sliced tensors, or an entry that
    is not exactly how TensorFlow (any protobuf encoder) writes it.

    The fields decoded that way are the ones BundleEntryProto's own decode gives when each
    entry holds each field at most once, in its shortest form, and nothing else: then its
    length is the sum of its fields' encoded sizes, which is checked for every entry (an
    entry holding more than that is longer than the fields found for it)."""
    from .protos import MARKS, DecodeError, parse_columns

    count = len(raw_keys)
    if count and raw_keys[0][:1] == b"\x00":
        return None  # a slice key: they sort first
    try:
        fields = parse_columns(memoryview(framed)[start:] if count
                               else b"")
    except DecodeError:
        return None
    if len(fields.slices):
        return None
    codes = _marked(fields.dtype, count)
    shard = _marked(fields.shard_id, count)
    offset = _marked(fields.offset, count)
    size = _marked(fields.size, count)
    crc = _marked(fields.crc32c, count, np.uint32)
    if codes is None or shard is None or offset is None or size is None or crc is None:
        return None
    got = _marked_shapes(fields.shape, count)
    if got is None:
        return None
    numbered, present, shape_bytes = got
    expected = present * (1 + _varint_sizes(shape_bytes) + shape_bytes) + 5 * (crc != 0)
    for column in (codes, shard, offset, size):
        expected += (column != 0) * (1 + _varint_sizes(column))
    stored = np.array(lengths, np.int64)
    if not np.array_equal(expected, stored):
        return None
    ends = (np.cumsum(stored + len(MARKS)) + start).tolist()

    def value(i: int) -> bytes:  # entry i's bytes, for an error's wording
        return bytes(framed[ends[i] - lengths[i] : ends[i]])

    return _whole_columns(raw_keys, value, numbered, codes.tolist(), shard, offset, size, crc,
                          n, path)


class _Fields(NamedTuple):
    """An entry's scalar fields, as `_stored` reads them."""

    shard_id: int
    offset: int
    size: int
    crc32c: int


def _fields(shard: np.ndarray, offset: np.ndarray, size: np.ndarray, crc: np.ndarray, i: int
            ) -> _Fields:
    return _Fields(int(shard[i]), int(offset[i]), int(size[i]), int(crc[i]))


@dataclass(slots=True)
class _Rows:
    """The stored (non-string) entries, column-wise: shard, offset, tensor row, size, crc32c,
    position (int64 arrays), and their slice specs (empty: all whole)."""

    columns: tuple[np.ndarray, ...]
    specs: list[str]


_Text = tuple[int, int, int, int, str, tuple[int, ...]]
"""A string tensor's entry: shard, offset, crc32c, size, key, shape."""
_Columns = tuple[list[str], list[str], list[tuple[int, ...]], _Rows, list[_Text]]


def _whole_columns(raw_keys: list[bytes], value: Any, numbered: _Numbered, codes: list[int],
                   shard: np.ndarray, offset: np.ndarray, size: np.ndarray, crc: np.ndarray,
                   n: int, path: str) -> _Columns:
    """The columns of a bundle whose tensors are all stored whole (no slices), from its
    entries' keys, shapes (`numbered`) and fields (`value(i)`: entry i's bytes), checked in
    bulk; an entry failing a check is looked at alone for the error's wording."""
    try:
        all_keys = _decoded(raw_keys)
    except UnicodeDecodeError:
        raw = next(k for k in raw_keys if not _is_utf8(k))
        raise CorruptIndexError(f"{path}: key {shown(raw)} is not valid UTF-8") from None
    distinct, which = numbered
    dims = _shapes_at_once(distinct)
    if dims is None:  # one is bad: the first entry that has it raises, with the wording
        checked: dict[int, tuple[int, ...]] = {}
        for i, k in enumerate(which.tolist()):
            if k not in checked:
                checked[k] = _dims(distinct[k], raw_keys[i], value(i), all_keys[i], path)
        dims = [checked.get(k, ()) for k in range(len(distinct))]
    all_shapes = np.fromiter(dims, object, len(dims))[which].tolist()
    counts = np.fromiter(map(math.prod, dims), np.int64, len(dims))[which]
    found = list(map(DTYPE_OF.get, codes))
    if None in found:
        i = found.index(None)
        _dtype(_entry(raw_keys[i], value(i), path), all_keys[i], path)
    names: list[str] = found  # type: ignore[assignment]  # none is None: _dtype raised
    for i in np.flatnonzero(counts == 0).tolist():  # no data, so no size check: the shape
        _no_array(all_keys[i], names[i], all_shapes[i], path)
    texts: list[_Text] = []
    if STRING in names:  # a few (the object graph): taken out of the columns
        at = [i for i in range(len(names)) if names[i] == STRING] if names.count(
            STRING) > 64 else _positions(names, STRING)
        for i in at:
            t = _stored(_fields(shard, offset, size, crc, i), all_keys[i], STRING,
                        all_shapes[i], WHOLE, all_keys[i], -1, n, path, 0)
            texts.append((t[0], t[1], t[6], t[5], all_keys[i], all_shapes[i]))
        shard, offset, size, crc, counts = (np.delete(c, at)
                                            for c in (shard, offset, size, crc, counts))
        keys, dtypes, shapes = all_keys, names, all_shapes
        for i in reversed(at):
            del keys[i], dtypes[i], shapes[i]
    else:
        keys, dtypes, shapes = all_keys, names, all_shapes
    sizes = {d: itemsize(d) for d in set(dtypes)}
    if len(sizes) == 1:
        item: Any = next(iter(sizes.values()))
    else:
        item = np.fromiter(map(sizes.__getitem__, dtypes), np.int64, len(keys))
    # size == count * item size, by division: the product of values from the file can wrap
    # int64 (docs/FORMAT.md section 12), the quotient cannot
    bad = np.flatnonzero((size < 0) | (size % item != 0) | (size // item != counts)
                         | (offset < 0) | (shard < 0) | (shard >= n))
    if len(bad):
        i = int(bad[0])
        _stored(_fields(shard, offset, size, crc, i), keys[i], dtypes[i], shapes[i], WHOLE,
                keys[i], i, n, path, i)
    order = np.arange(len(keys), dtype=np.int64)
    return keys, dtypes, shapes, _Rows((shard, offset, order, size, crc, order), []), texts


def _decoded(raw_keys: list[bytes]) -> list[str]:
    """The keys as str (UTF-8, strict): decoded in one call where no key holds a newline (an
    ASCII byte, so joining changes no key's validity), else one by one."""
    keys = b"\n".join(raw_keys).decode().split("\n")
    return keys if len(keys) == len(raw_keys) else list(map(bytes.decode, raw_keys))


def _positions(items: list[Any], value: Any) -> list[int]:
    """The indexes of `value` in `items` (a few: one list.index each)."""
    out: list[int] = []
    i = -1
    try:
        while True:
            i = items.index(value, i + 1)
            out.append(i)
    except ValueError:
        return out


def _shapes_at_once(distinct: list[bytes]) -> list[tuple[int, ...]] | None:
    """The dims of each encoded TensorShapeProto, in order, decoded by one protobuf call; None
    if any
    does not decode or is not a shape shardkit reads (unknown rank, a negative or too large
    dimension)."""
    from .protos import DecodeError, parse_shapes

    try:
        messages = parse_shapes(distinct)
    except DecodeError:
        return None
    dims = [tuple([d.size for d in m.dim]) for m in messages]
    if any(m.unknown_rank for m in messages) or any(
            (d and min(d) < 0) or math.prod(d) >= 1 << 62 for d in dims):
        return None
    return dims


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _general_columns(body: list[tuple[bytes, bytes]], parsed: Any, encoded_shapes: list[bytes],
                     n: int, path: str) -> _Columns:
    """The columns of any bundle, entry by entry: sliced tensors are reassembled from the
    entries of their slices."""
    position: dict[bytes, int] | None = None  # key -> position in body, built for slices
    keys: list[str] = []
    dtypes: list[str] = []
    shapes: list[tuple[int, ...]] = []
    rows: list[_Row] = []
    texts: list[_Text] = []
    itemsizes = {name: (0 if name == STRING else itemsize(name)) for name in DATATYPE_OF}
    shape_of: dict[bytes, tuple[int, ...]] = {}  # encoded TensorShapeProto -> its dims
    claimed: set[int] = set()  # the positions of the slice entries a tensor's entry names
    for (raw_key, value), flat, encoded in zip(body, parsed, encoded_shapes):
        if raw_key[:1] == b"\x00":
            continue  # a slice, read through its tensor's entry
        try:
            key = raw_key.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptIndexError(f"{path}: key {shown(raw_key)} is not valid UTF-8") from None
        shape = shape_of.get(encoded)  # type: ignore[assignment]
        if shape is None:
            shape = shape_of[encoded] = _dims(encoded, raw_key, value, key, path)
        dtype = DTYPE_OF.get(flat.dtype) or _dtype(_entry(raw_key, value, path), key, path)
        if flat.slices or 0 in shape:  # no stored size bounds the shape: checked alone
            _no_array(key, dtype, shape, path)
        if dtype == STRING:  # string tensors: apart (`CheckpointIndex.strings`)
            if flat.slices:
                raise UnsupportedDTypeError(f"{path}: string tensor {shown(key)} is stored "
                                            "as slices, which shardkit does not read")
            t = _stored(flat, key, dtype, shape, WHOLE, key, -1, n, path, 0)
            texts.append((t[0], t[1], t[6], t[5], key, shape))
            continue
        row = len(keys)
        keys.append(key)
        dtypes.append(dtype)
        shapes.append(shape)
        if not flat.slices:
            shard, offset, size = flat.shard_id, flat.offset, flat.size
            if (size != math.prod(shape) * itemsizes[dtype] or offset < 0
                    or not 0 <= shard < n):  # the checks of _stored, words and all
                _stored(flat, key, dtype, shape, WHOLE, key, row, n, path, len(rows))
            rows.append((shard, offset, row, WHOLE, key, size, flat.crc32c, len(rows)))
            continue
        entry = _entry(raw_key, value, path)  # sliced: decoded in full
        if position is None:
            position = {k: i for i, (k, _) in enumerate(body)}
        for s in entry.slices:
            if len(s.extent) != len(shape):
                raise CorruptIndexError(
                    f"{path}: tensor {shown(key)}: a slice has {len(s.extent)} extents for a "
                    f"tensor of rank {len(shape)}")
            starts = [e.start for e in s.extent]
            lengths = [e.length if e.HasField("length") else -1 for e in s.extent]
            offsets = list(starts)
            sizes = [d if ln == -1 else ln for ln, d in zip(lengths, shape)]
            for d, (o, ln) in enumerate(zip(offsets, sizes)):
                if o < 0 or ln < 0 or o + ln > shape[d]:
                    raise CorruptIndexError(
                        f"{path}: tensor {shown(key)}: slice extent {d} (start {o}, length "
                        f"{ln}) is outside dimension {shape[d]}")
            slice_key = encode_slice_key(key, starts, lengths)
            at = position.get(slice_key)
            spec = format_slice_spec(shape, offsets, sizes)
            if at is None:
                raise CorruptIndexError(f"{path}: tensor {shown(key)}: slice {spec!r} has no "
                                        "entry of its own (its encoded key is missing)")
            claimed.add(at)
            slice_entry = _entry(slice_key, body[at][1], path)
            if slice_entry.slices:
                raise CorruptIndexError(f"{path}: tensor {shown(key)}: the entry of slice "
                                        f"{spec!r} is itself sliced")
            if slice_entry.dtype != entry.dtype:
                raise CorruptIndexError(
                    f"{path}: tensor {shown(key)}: slice {spec!r} has dtype "
                    f"{DATA_TYPE_NAMES.get(slice_entry.dtype, slice_entry.dtype)}, the tensor "
                    f"{DATA_TYPE_NAMES.get(entry.dtype, entry.dtype)}")
            got = _shape(slice_entry, key, path)
            if got != tuple(sizes):
                raise CorruptIndexError(f"{path}: tensor {shown(key)}: slice {spec!r} is "
                                        f"stored with shape {list(got)}, expected {sizes}")
            rows.append(_stored(slice_entry, key, dtype, tuple(sizes), spec, f"{key}:{spec}",
                                row, n, path, len(rows)))
    orphan = next((k for i, (k, _) in enumerate(body) if k[:1] == b"\x00" and i not in claimed),
                  None)
    if orphan is not None:  # TensorFlow's own reader refuses such a table too
        raise CorruptIndexError(f"{path}: entry {shown(orphan)} is a slice of no tensor the "
                                "table lists (its tensor's own entry is missing or names "
                                "other slices)")
    columns = tuple(np.array([r[i] for r in rows], np.int64).reshape(len(rows))
                    for i in (0, 1, 2, 5, 6, 7))
    return keys, dtypes, shapes, _Rows(columns, [r[3] for r in rows]), texts


_Row = tuple[int, int, int, str, str, int, int, int]
"""A stored entry: shard, offset, tensor row, slice spec, entry name, size, crc, order."""


def _stored(entry: Any, key: str, dtype: str, shape: tuple[int, ...], spec: str, name: str,
            row: int, n: int, path: str, order: int) -> _Row:
    where = f"tensor {shown(key)}" + (f" slice {spec!r}" if spec else "")
    if not 0 <= entry.shard_id < n:
        raise CorruptIndexError(f"{path}: {where}: shard_id {entry.shard_id} is out of range "
                                f"(the header records {n} data files)")
    if entry.offset < 0 or entry.size < 0:
        raise CorruptIndexError(f"{path}: {where}: negative offset {entry.offset} or size "
                                f"{entry.size}")
    count = math.prod(shape)
    if dtype == STRING:
        if entry.size < (count + 4 if count else 0):
            raise CorruptIndexError(f"{path}: {where}: {entry.size} bytes cannot hold {count} "
                                    "strings (a length each and the length checksum)")
    elif entry.size != count * itemsize(dtype):
        raise CorruptIndexError(f"{path}: {where}: stored size {entry.size} bytes, expected "
                                f"{count * itemsize(dtype)} for {dtype} {list(shape)}")
    return entry.shard_id, entry.offset, row, spec, name, entry.size, entry.crc32c, order


__all__ = ["entry_columns", "framed_columns"]
