"""DT_STRING tensors in a TensorBundle data file (tensor_bundle.cc WriteStringTensor /
ReadStringTensor).

On disk: a varint64 length per element, then the masked crc32c of the lengths (fixed32), then
the elements' bytes back to back. The entry's crc32c covers the lengths as little-endian uint32
(uint64 for a length over 2**32 - 1, not the varint bytes), then the 4 bytes of the length
checksum as stored, then the bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from ...errors import ChecksumError, CorruptHeaderError
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
    if count == 0:
        if len(data):
            raise CorruptHeaderError(f"{where}: {len(data)} bytes for an empty string tensor")
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
