"""String tensors: numpy bytes / str arrays and TensorFlow's ``tf.string``.

Raw shards must stay plain safetensors files, which have no string dtype, so string tensors are
stored in a file of their own (docs/FORMAT.md, "String tensors"): ``strings.skstr`` beside the
shards, described by the manifest's ``shardkit.strings`` section (format 2.3), never in
``weight_map``. A string tensor is one of four *kinds*, and comes back as it: ``"bytes"`` /
``"str"`` (object arrays of them; ``tf.string`` gives bytes), ``"S<n>"`` / ``"U<n>"`` (numpy
fixed-width arrays, stored without numpy's trailing NULs); ``str`` and ``U`` as UTF-8. Object
arrays holding anything else (or a mix) are refused with UnsupportedDTypeError.

`StringTensors` is the reader-side interface: column-wise keys, kinds, shapes and devices, and
`read` / `verify` of one row. `StringFile` implements it for shardkit's ``.skstr`` file; another
layout (e.g. TensorFlow's TensorBundle) implements it over its own bytes and puts it in
`CheckpointIndex.strings`; `decode_elements` turns the elements' bytes into the array of a kind.
The manifest's ``shardkit.strings`` section is decoded by `format.decode_strings_section`,
which makes the `StringFile`: this module imports nothing of format/ (it sits below it).
"""

from __future__ import annotations

import json
import math
import re
import struct
import threading
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import xxhash

from ..errors import (
    CheckpointFormatError,
    ChecksumError,
    CorruptHeaderError,
    CorruptIndexError,
    GenerationMismatchError,
    MissingShardError,
    Problem,
    TruncatedShardError,
    UnsupportedDTypeError,
)

STRING_FILE: Final = "strings.skstr"
"""The file that holds a checkpoint's string tensors (one per checkpoint)."""
MAGIC: Final = b"SKSTRNG1"
STRING_DTYPE: Final = "STRING"
"""The dtype name `CheckpointReader.info` reports for a string tensor."""
KIND_RE: Final = re.compile(r"bytes|str|[SU][1-9][0-9]{0,8}")
"""The kinds a string tensor may have (the module docstring)."""
_U64 = struct.Struct("<Q")


STRING_FRAMEWORKS: Final = ("numpy", "tensorflow")
"""The ``framework=`` values a string tensor can be loaded as."""


def check_string_framework(framework: str, key: str) -> None:
    """UnsupportedDTypeError unless string tensor `key` can be loaded as `framework`."""
    if framework not in STRING_FRAMEWORKS:
        raise UnsupportedDTypeError(
            f"{key!r} is a string tensor, and {framework} has no string tensors; load it with "
            "framework='numpy' (the default) or 'tensorflow', or leave it out of keys=")


def string_kind(array: np.ndarray, key: str) -> str:
    """The kind of string array `array` (module docstring); UnsupportedDTypeError for an object
    array that holds anything but bytes, or anything but str."""
    dt = array.dtype
    if dt.kind in "SU":
        return f"{dt.kind}{max(dt.itemsize // (4 if dt.kind == 'U' else 1), 1)}"
    types = set(map(type, array.reshape(-1).tolist())) if array.size else {bytes}
    if types == {bytes}:
        return "bytes"
    if types == {str}:
        return "str"
    shown = ", ".join(sorted(t.__name__ for t in types))
    raise UnsupportedDTypeError(
        f"{key!r}: an object array can be stored only when it holds bytes only (tf.string's "
        f"form) or str only; this one holds {shown}")


def encode_elements(array: np.ndarray, kind: str) -> list[bytes]:
    """The elements of `array` (of `kind`) as bytes, in C order."""
    items = array.reshape(-1).tolist()
    if kind == "bytes" or kind[0] == "S":
        return items
    try:
        return [s.encode("utf-8") for s in items]
    except UnicodeEncodeError as e:  # lone surrogates
        raise UnsupportedDTypeError(f"a string element is not valid Unicode: {e}") from None


def decode_elements(kind: str, shape: tuple[int, ...], items: list[bytes], where: str
                    ) -> np.ndarray:
    """The array of `kind` and `shape` whose elements (C order) are `items`; an element of a
    ``str`` / ``U`` kind that is not UTF-8, or longer than an ``S`` / ``U`` width, is a
    CorruptHeaderError naming `where`."""
    dtype = kind_dtype(kind, where)
    values: list[Any] = items
    if kind == "str" or kind[0] == "U":
        try:
            values = [b.decode("utf-8") for b in items]
        except UnicodeDecodeError:
            raise CorruptHeaderError(f"{where}: a str element is not valid UTF-8") from None
    if kind in ("bytes", "str"):
        out = np.empty(len(values), object)
        out[:] = values
        return out.reshape(shape)
    width = int(kind[1:])
    if any(len(v) > width for v in values):
        raise CorruptHeaderError(f"{where}: an element is longer than its width {width}")
    return np.array(values, dtype=dtype).reshape(shape)


MAX_NUMPY_ITEMSIZE: Final = 2**31 - 1  # numpy refuses a wider S / U dtype


def kind_dtype(kind: str, where: str = "") -> np.dtype:
    """The numpy dtype of a kind's arrays (object for ``bytes`` / ``str``): the one place a
    dtype is made from a kind.

    Raises:
        UnsupportedDTypeError: numpy has no such dtype (a ``U<n>`` the format allows but wider
            than numpy's widest unicode dtype), naming `where`.
    """
    if kind in ("bytes", "str"):
        return np.dtype(object)
    width = int(kind[1:])
    if width * (4 if kind[0] == "U" else 1) > MAX_NUMPY_ITEMSIZE:
        widest = MAX_NUMPY_ITEMSIZE // (4 if kind[0] == "U" else 1)
        raise UnsupportedDTypeError(
            f"{where}: string kind {kind} has no numpy dtype (the widest is {kind[0]}{widest}); "
            "this checkpoint's tensor cannot be read as an array")
    return np.dtype(f"S{width}" if kind[0] == "S" else f"<U{width}")


def _descriptor(key: str, kind: str, shape: Sequence[int]) -> bytes:
    """What a block says about itself: compact JSON, padded with spaces to a multiple of 8."""
    text = json.dumps({"key": key, "kind": kind, "shape": list(shape)}, separators=(",", ":"),
                      ensure_ascii=False).encode("utf-8")
    return text + b" " * ((-len(text)) % 8)


def encode_block(key: str, kind: str, shape: Sequence[int], items: Sequence[bytes]) -> bytes:
    """One tensor's block: the u64 size D of its descriptor, the descriptor (key, kind and
    shape as JSON, space-padded to a multiple of 8), the u64 length of every element, then the
    elements back to back."""
    desc = _descriptor(key, kind, shape)
    lengths = np.fromiter(map(len, items), np.uint64, len(items))
    return _U64.pack(len(desc)) + desc + lengths.astype("<u8").tobytes() + b"".join(items)


def decode_block(data: bytes | memoryview, key: str, kind: str, shape: tuple[int, ...],
                 where: str) -> list[bytes]:
    """The elements of a block whose descriptor must say `key`, `kind` and `shape` (else the
    manifest and the file disagree: CorruptIndexError); CorruptHeaderError when the block's
    sizes do not add up."""
    view = memoryview(data)
    count = math.prod(shape)
    if len(view) < 8:
        raise CorruptHeaderError(f"{where}: block of {len(view)} bytes has no descriptor")
    (d,) = _U64.unpack_from(view, 0)
    if d % 8 or 8 + d > len(view):
        raise CorruptHeaderError(f"{where}: descriptor size {d} is out of range")
    want = _descriptor(key, kind, shape)
    if bytes(view[8 : 8 + d]) != want:
        raise CorruptIndexError(
            f"{where}: the string file's block describes another tensor than the manifest "
            f"(key {key!r}, kind {kind}, shape {list(shape)})")
    view = view[8 + d :]
    if 8 * count > len(view):
        raise CorruptHeaderError(f"{where}: block of {len(view)} bytes cannot hold {count} "
                                 "element lengths")
    lengths = np.frombuffer(view[: 8 * count], "<u8")
    if int(lengths.sum(dtype=np.uint64)) != len(view) - 8 * count or (
            count and int(lengths.max()) > len(view)):
        raise CorruptHeaderError(f"{where}: element lengths add up to more or less than the "
                                 f"{len(view) - 8 * count} bytes of the block")
    ends = np.cumsum(lengths, dtype=np.int64) + 8 * count
    starts = ends - lengths.astype(np.int64)
    raw = bytes(view)
    return [raw[a:b] for a, b in zip(starts.tolist(), ends.tolist())]


@dataclass(eq=False)
class StringTensors:
    """The string tensors of a checkpoint, column-wise: key, kind, full shape, device string.

    Subclasses implement `read` (the array of one row, its kind as described in the module
    docstring) and `verify`; `directory` is the reader's `shards.files.CheckpointDirectory`.
    """

    keys: list[str]
    kinds: list[str]
    shapes: list[tuple[int, ...]]
    devices: list[str]
    _rows: dict[str, int] = field(default_factory=dict, repr=False)

    def row(self, key: str) -> int:
        """The row of `key` (KeyError if absent)."""
        if not self._rows:
            self._rows.update(zip(self.keys, range(len(self.keys))))
        return self._rows[key]

    def __contains__(self, key: object) -> bool:
        try:
            self.row(key)  # type: ignore[arg-type]
        except (KeyError, TypeError):
            return False
        return True

    def nbytes(self, row: int) -> int:
        """Stored bytes of the row (0 when the layout does not say)."""
        return 0

    def read(self, directory: Any, row: int) -> np.ndarray:
        raise NotImplementedError

    def verify(self, directory: Any, rows: Sequence[int]) -> tuple[int, list[Problem]]:
        """(checksums compared, problems) for `rows`."""
        raise NotImplementedError

    def file_of(self, row: int) -> str:
        """The file the row is stored in (for `CheckpointReader.info`)."""
        return ""

    def xxh3_of(self, row: int) -> str | None:
        return None


@dataclass(eq=False)
class StringFile(StringTensors):
    """shardkit's ``.skstr`` file (docs/FORMAT.md, "String tensors")."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StringFile):
            return NotImplemented
        return self.section() == other.section() and self.generation == other.generation

    __hash__ = None  # type: ignore[assignment]

    file: str = STRING_FILE
    size: int = 0  # bytes of the file (the manifest's "bytes")
    offsets: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    xxh3: list[str | None] = field(default_factory=list)
    generation: str | None = None
    _data: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def nbytes(self, row: int) -> int:
        return self.lengths[row]

    def file_of(self, row: int) -> str:
        return self.file

    def xxh3_of(self, row: int) -> str | None:
        return self.xxh3[row]

    def section(self) -> dict[str, Any]:
        """The manifest's ``shardkit.strings`` object."""
        return {"file": self.file, "bytes": self.size, "key": self.keys, "kind": self.kinds,
                "shape": [list(s) for s in self.shapes], "device": self.devices,
                "offset": self.offsets, "length": self.lengths, "xxh3": self.xxh3}

    def _load(self, directory: Any) -> bytes:
        with self._lock:
            if self._data is None:
                self._data = self._read_file(directory)
            data: bytes = self._data
            return data

    def _read_file(self, directory: Any) -> bytes:
        path = directory.join(self.file)
        with closing(directory.open_shard(self.file)) as f:
            size = f.size
            if size != self.size:
                cls = TruncatedShardError if size < self.size else CheckpointFormatError
                raise cls(f"{path}: string file has {size} bytes, the manifest records "
                          f"{self.size}")
            data = f.read_all()
        check_preamble(data, path, self.generation)
        return bytes(data)

    def _block(self, data: bytes, row: int, path: str) -> memoryview:
        a, n = self.offsets[row], self.lengths[row]
        if a + n > len(data) or a < preamble_size(self.generation):
            raise CorruptIndexError(f"{path}: string tensor {self.keys[row]!r}: bytes "
                                    f"[{a}, {a + n}) are outside the data of the file")
        return memoryview(data)[a : a + n]

    def read(self, directory: Any, row: int) -> np.ndarray:
        path = directory.join(self.file)
        data = self._load(directory)
        block = self._block(data, row, path)
        where = f"{path}: string tensor {self.keys[row]!r}"
        items = decode_block(block, self.keys[row], self.kinds[row], self.shapes[row], where)
        return decode_elements(self.kinds[row], self.shapes[row], items, where)

    def verify(self, directory: Any, rows: Sequence[int]) -> tuple[int, list[Problem]]:
        path = directory.join(self.file)
        problems: list[Problem] = []
        try:
            data = self._read_file(directory)  # afresh: verify never trusts a cached read
        except MissingShardError:
            return 0, [Problem(path, None, "string file", "a file (the manifest lists "
                                     "it)", "no such file", MissingShardError)]
        except CheckpointFormatError as e:
            return 0, [Problem(path, None, "string file", "a valid string file",
                                     str(e).replace(f"{path}: ", ""), type(e))]
        checked = 0
        for row in rows:
            key = self.keys[row]
            try:
                block = self._block(data, row, path)
                recorded = self.xxh3[row]
                if recorded is not None:
                    checked += 1
                    found = xxhash.xxh3_64_hexdigest(block)
                    if found != recorded:
                        problems.append(Problem(path, key, "checksum of string tensor",
                                                      f"xxh3 {recorded}", found, ChecksumError))
                        continue
                where = f"{path}: string tensor {key!r}"
                decode_elements(self.kinds[row], self.shapes[row],
                                decode_block(block, key, self.kinds[row], self.shapes[row],
                                             where), where)
            except CheckpointFormatError as e:
                problems.append(Problem(path, key, "string tensor", "valid elements",
                                              str(e).replace(f"{path}: ", ""), type(e)))
        return checked, problems


def preamble_size(generation: str | None) -> int:
    g = len((generation or "").encode())
    return 16 + (g + 7) // 8 * 8


def encode_preamble(generation: str | None) -> bytes:
    """Magic, the generation's length (u64) and the generation, zero-padded to 8 bytes."""
    g = (generation or "").encode()
    return MAGIC + _U64.pack(len(g)) + g + b"\0" * ((-len(g)) % 8)


def check_preamble(data: bytes | memoryview, path: str, generation: str | None) -> None:
    if len(data) < 16 or bytes(data[:8]) != MAGIC:
        raise CorruptHeaderError(f"{path}: not a shardkit string file (bad magic)")
    (g,) = _U64.unpack_from(data, 8)
    if g > 64 or 16 + g > len(data):
        raise CorruptHeaderError(f"{path}: generation length {g} is out of range")
    found = bytes(data[16 : 16 + g]).decode("ascii", "replace")
    if generation is not None and found != generation:
        raise GenerationMismatchError(
            f"{path}: string file is of generation {found or 'none'}, the manifest's is "
            f"{generation} (the file belongs to another checkpoint)")


@dataclass(slots=True)
class StringColumns:
    """String tensors to write: key, array, kind, device string."""

    keys: list[str] = field(default_factory=list)
    arrays: list[np.ndarray] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)

    def add(self, key: str, array: np.ndarray, device: str) -> None:
        self.kinds.append(string_kind(array, key))
        self.keys.append(key)
        self.arrays.append(array)
        self.devices.append(device)


def write_string_file(fd: int, columns: StringColumns, generation: str | None,
                      checksum: bool = True) -> StringFile:
    """Write `columns` as a ``.skstr`` file to the open descriptor `fd`; its description."""
    import os

    parts = [encode_preamble(generation)]
    at = len(parts[0])
    offsets, lengths, hashes = [], [], []
    for key, array, kind in zip(columns.keys, columns.arrays, columns.kinds):
        try:
            block = encode_block(key, kind, array.shape, encode_elements(array, kind))
        except UnsupportedDTypeError as e:
            raise UnsupportedDTypeError(f"{key!r}: {e}") from None
        offsets.append(at)
        lengths.append(len(block))
        hashes.append(xxhash.xxh3_64_hexdigest(block) if checksum else None)
        pad = (-len(block)) % 8
        parts.append(block + b"\0" * pad)
        at += len(block) + pad
    data = b"".join(parts)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    return StringFile(list(columns.keys), list(columns.kinds),
                      [tuple(a.shape) for a in columns.arrays], list(columns.devices),
                      file=STRING_FILE, size=len(data), offsets=offsets, lengths=lengths,
                      xxh3=hashes, generation=generation)
