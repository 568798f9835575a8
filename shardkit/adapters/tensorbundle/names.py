"""Names in a TensorBundle: file names of a prefix, and TensorFlow's encoded slice keys.

A sliced tensor's slices are stored under ``checkpoint::EncodeTensorNameSlice(name, slice)``
(``tensorflow/core/util/saved_tensor_slice_util.cc``), built from TensorFlow's OrderedCode
(``tensorflow/core/lib/strings/ordered_code.cc``): ``WriteNumIncreasing(0)``,
``WriteString(name)``, ``WriteNumIncreasing(rank)``, then per dimension
``WriteSignedNumIncreasing(start)`` and ``WriteSignedNumIncreasing(length)`` (length -1 for a
full dimension).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

INDEX_SUFFIX: Final = ".index"
STATE_FILE: Final = "checkpoint"
"""The text-format CheckpointState that tf.train.CheckpointManager keeps in its directory."""


def index_file(prefix: str) -> str:
    return prefix + INDEX_SUFFIX


def data_file(prefix: str, shard: int, count: int) -> str:
    """TensorFlow's DataFilename: ``<prefix>.data-00000-of-00001``."""
    return f"{prefix}.data-{shard:05d}-of-{count:05d}"


def _num_increasing(value: int) -> bytes:
    body = value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big") if value else b""
    return bytes([len(body)]) + body


def _string(s: bytes) -> bytes:
    return s.replace(b"\xff", b"\xff\x00").replace(b"\x00", b"\x00\xff") + b"\x00\x01"


# encoding length -> header bits of the first two bytes (ordered_code.cc kLengthToHeaderBits)
_HEADER = [(0, 0), (0x80, 0), (0xC0, 0), (0xE0, 0), (0xF0, 0), (0xF8, 0), (0xFC, 0), (0xFE, 0),
           (0xFF, 0), (0xFF, 0x80), (0xFF, 0xC0)]


def _signed_increasing(value: int) -> bytes:
    x = ~value if value < 0 else value
    if x < 64:
        return bytes([(0x80 ^ value) & 0xFF])
    bits = x.bit_length()  # Log2Floor64(x) + 1
    length = (bits + 7) // 7  # kBitsToLength: bits + 1 sign bit, 7 payload bits per byte
    buf = bytearray(value.to_bytes(10, "big", signed=True))
    begin = 10 - length
    buf[begin] ^= _HEADER[length][0]
    buf[begin + 1] ^= _HEADER[length][1]
    return bytes(buf[begin:])


def encode_slice_key(name: str, starts: Sequence[int], lengths: Sequence[int]) -> bytes:
    """The key a slice (`starts`, `lengths`; length -1 = the whole dimension) of tensor `name`
    is stored under."""
    out = [_num_increasing(0), _string(name.encode("utf-8")), _num_increasing(len(starts))]
    for start, length in zip(starts, lengths):
        out.append(_signed_increasing(int(start)))
        out.append(_signed_increasing(int(length)))
    return b"".join(out)
