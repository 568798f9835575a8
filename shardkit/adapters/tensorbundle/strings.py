"""DT_STRING tensors in a TensorBundle data file (tensor_bundle.cc WriteStringTensor /
ReadStringTensor).

On disk: a varint64 length per element, then the masked crc32c of the lengths (fixed32), then
the elements' bytes back to back. The entry's crc32c covers the lengths as little-endian uint32
(uint64 for a length over 2**32 - 1, not the varint bytes), then the 4 bytes of the length
checksum as stored, then the bytes.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import (
    CheckpointFormatError,
    ChecksumError,
    CorruptHeaderError,
    Problem,
    TruncatedShardError,
)
from ...values.strings import StringTensors, decode_elements
from .crc import crc32c_extend, mask, unmask
from .table import get_varint, put_varint

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def _length_bytes(n: int) -> bytes:
    return _U32.pack(n) if n <= 0xFFFFFFFF else _U64.pack(n)


def as_bytes_list(array: np.ndarray) -> list[bytes]:
    """The elements of a string array (object array of bytes / str, numpy ``S`` or ``U``), in C
    order, as bytes (str encoded as UTF-8, as TensorFlow does)."""
    out: list[bytes] = []
    for x in array.reshape(-1).tolist():
        if isinstance(x, bytes):
            out.append(x)
        elif isinstance(x, str):
            out.append(x.encode("utf-8"))
        elif isinstance(x, (bytearray, memoryview, np.bytes_)):
            out.append(bytes(x))
        else:
            raise TypeError(f"a string tensor holds a {type(x).__name__}, not bytes or str")
    return out


def encode_strings(values: Sequence[bytes]) -> tuple[bytes, int]:
    """(the stored bytes, the entry's masked crc32c) of string elements `values`."""
    lengths = bytearray()
    crc = 0
    for v in values:
        put_varint(lengths, len(v))
        crc = crc32c_extend(crc, _length_bytes(len(v)))
    check = _U32.pack(mask(crc))
    crc = crc32c_extend(crc, check)
    body = b"".join(values)
    crc = crc32c_extend(crc, body)
    return bytes(lengths) + check + body, mask(crc)


def decode_strings(data: bytes | memoryview, count: int, where: str) -> tuple[list[bytes], int]:
    """(the `count` elements, the entry's masked crc32c as computed) of stored bytes `data`;
    CorruptHeaderError / ChecksumError naming `where` when they do not parse or the length
    checksum does not match."""
    if not len(data) and count == 0:  # ReadStringTensor accepts no bytes for no strings
        return [], 0
    lengths: list[int] = []
    pos = 0
    crc = 0
    n = len(data)
    for i in range(count):
        try:
            length, pos = get_varint(data, pos, n)
        except ValueError as e:
            raise CorruptHeaderError(f"{where}: string length {i} is malformed ({e})") from None
        lengths.append(length)
        crc = crc32c_extend(crc, _length_bytes(length))
    if pos + 4 > n:
        raise CorruptHeaderError(f"{where}: the string lengths run past the entry's "
                                 f"{n} bytes")
    (stored,) = _U32.unpack_from(data, pos)
    if unmask(stored) != crc:
        raise ChecksumError(f"{where}: the string length checksum does not match (stored "
                            f"{unmask(stored):08x}, computed {crc:08x})")
    crc = crc32c_extend(crc, bytes(data[pos : pos + 4]))
    pos += 4
    if pos + sum(lengths) != n:
        raise CorruptHeaderError(f"{where}: the string lengths add up to {sum(lengths)} bytes, "
                                 f"the entry holds {n - pos} after them")
    body = bytes(data[pos:])
    crc = crc32c_extend(crc, body)
    out = []
    at = 0
    for length in lengths:
        out.append(body[at : at + length])
        at += length
    return out, mask(crc)


@dataclass(eq=False)
class BundleStrings(StringTensors):
    """The DT_STRING tensors of a TensorBundle (`CheckpointIndex.strings`): each is one entry
    of a data file; read as object arrays of bytes (kind ``"bytes"``, what ``.numpy()`` of a
    ``tf.string`` tensor gives), checked against the entry's crc32c by `verify`."""

    files: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    crcs: list[int] = field(default_factory=list)  # masked, as the BundleEntryProto holds it
    _kept: dict[int, tuple[bytes, str]] = field(default_factory=dict, repr=False)
    """Rows read already (a reader opens its shards, string tensors included, right after the
    index, and reads them from here later); `verify` reads afresh."""

    def nbytes(self, row: int) -> int:
        return self.sizes[row]

    def file_of(self, row: int) -> str:
        return self.files[row]

    def xxh3_of(self, row: int) -> str | None:
        return f"{self.crcs[row]:08x}"  # the entry's checksum (crc32c, not xxh3)

    def _stored(self, directory: Any, row: int) -> tuple[bytes, str]:
        name = self.files[row]
        path = directory.join(name)
        with closing(directory.open_shard(name)) as f, f as fd:
            data = os.pread(fd, self.sizes[row], self.offsets[row])
        if len(data) != self.sizes[row]:
            raise TruncatedShardError(
                f"{path}: string tensor {self.keys[row]!r}: bytes [{self.offsets[row]}, "
                f"{self.offsets[row] + self.sizes[row]}) are past the end of the file")
        return data, f"{path}: string tensor {self.keys[row]!r}"

    def read(self, directory: Any, row: int) -> np.ndarray:
        got = self._kept.get(row)
        if got is None:
            got = self._kept.setdefault(row, self._stored(directory, row))
        data, where = got
        items, _ = decode_strings(data, math.prod(self.shapes[row]), where)
        return decode_elements("bytes", self.shapes[row], items, where)

    def verify(self, directory: Any, rows: Sequence[int]) -> tuple[int, list[Problem]]:
        problems: list[Problem] = []
        checked = 0
        for row in rows:
            key, path = self.keys[row], directory.join(self.files[row])
            try:
                data, where = self._stored(directory, row)
                _, crc = decode_strings(data, math.prod(self.shapes[row]), where)
            except CheckpointFormatError as e:
                problems.append(Problem(path, key, "string tensor", "a valid entry",
                                              str(e).replace(f"{path}: ", ""), type(e)))
                continue
            checked += 1
            if crc != self.crcs[row]:
                problems.append(Problem(path, key, "checksum of string tensor",
                                              f"crc32c {self.crcs[row]:08x}", f"{crc:08x}",
                                              ChecksumError))
        return checked, problems
