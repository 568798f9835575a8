"""TensorFlow's table (``tsl/lib/io/table*``, LevelDB's SSTable): the ``.index`` file.

The layout (blocks with restart points, 5-byte trailers with a masked crc32c, the index block,
the 48-byte footer), as ``table_builder.cc`` / ``block_builder.cc`` / ``format.cc`` write it, is
docs/FORMAT.md section 12. TensorFlow writes bundles uncompressed; a snappy block is refused.
Keys are compared bytewise. Every structural error raises CorruptIndexError naming the file.
"""

from __future__ import annotations

import itertools
import operator
import struct
from collections.abc import Iterable, Iterator
from typing import Any, Final

from ..._kernels import _sstable
from ...errors import CorruptIndexError
from .crc import crc32c, mask

MAGIC: Final = 0xDB4775248B80FB57
FOOTER_SIZE: Final = 48
TRAILER_SIZE: Final = 5
BLOCK_SIZE: Final = 262144  # tsl table::Options::block_size
RESTART_INTERVAL: Final = 16  # tsl table::Options::block_restart_interval
NO_COMPRESSION: Final = 0
_U32 = struct.Struct("<I")


# --- varints ---------------------------------------------------------------------------------


def put_varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def get_varint(data: bytes | memoryview, pos: int, limit: int, bits: int = 64) -> tuple[int, int]:
    """(value, next position) of the varint at `pos`; ValueError if it runs past `limit` or
    has more than `bits` bits."""
    result = shift = 0
    while pos < limit:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            if result >> bits:
                raise ValueError(f"varint{bits} out of range")
            return result, pos
        shift += 7
        if shift >= bits + 7:
            break
    raise ValueError(f"truncated or overlong varint{bits}")


# --- writing ---------------------------------------------------------------------------------


class _Block:
    def __init__(self, restart_interval: int) -> None:
        self.interval = restart_interval
        self.buf = bytearray()
        self.restarts = [0]
        self.counter = 0
        self.last = b""

    def add(self, key: bytes, value: bytes) -> None:
        shared = 0
        if self.counter < self.interval:
            n = min(len(self.last), len(key))
            while shared < n and self.last[shared] == key[shared]:
                shared += 1
        else:
            self.restarts.append(len(self.buf))
            self.counter = 0
        put_varint(self.buf, shared)
        put_varint(self.buf, len(key) - shared)
        put_varint(self.buf, len(value))
        self.buf += key[shared:]
        self.buf += value
        self.last = key
        self.counter += 1

    def size_estimate(self) -> int:
        return len(self.buf) + 4 * len(self.restarts) + 4

    def finish(self) -> bytes:
        out = self.buf
        for r in self.restarts:
            out += _U32.pack(r)
        out += _U32.pack(len(self.restarts))
        return bytes(out)

    @property
    def empty(self) -> bool:
        return not self.buf


def _separator(start: bytes, limit: bytes) -> bytes:
    """table_builder.cc's FindShortestSeparator."""
    n = min(len(start), len(limit))
    i = 0
    while i < n and start[i] == limit[i]:
        i += 1
    if i < n:
        b = start[i]
        if b < 0xFF and b + 1 < limit[i]:
            return start[:i] + bytes([b + 1])
    return start


def _successor(key: bytes) -> bytes:
    """table_builder.cc's FindShortSuccessor."""
    for i, b in enumerate(key):
        if b != 0xFF:
            return key[:i] + bytes([b + 1])
    return key


def _handle(offset: int, size: int) -> bytes:
    out = bytearray()
    put_varint(out, offset)
    put_varint(out, size)
    return bytes(out)


def build_table(items: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The table of `items` (key, value), keys strictly increasing bytewise, as TensorFlow's
    TableBuilder writes it (uncompressed)."""
    out = bytearray()
    data = _Block(RESTART_INTERVAL)
    index = _Block(1)
    last: bytes | None = None
    pending: tuple[int, int] | None = None

    def write_block(block: _Block) -> tuple[int, int]:
        raw = block.finish()
        offset = len(out)
        out.extend(raw)
        out.append(NO_COMPRESSION)
        out.extend(_U32.pack(mask(crc32c(raw + bytes([NO_COMPRESSION])))))
        return offset, len(raw)

    for key, value in items:
        if last is not None:
            if key <= last:
                raise ValueError(f"table keys must increase: {key!r} after {last!r}")
            if len(key) + len(value) >= 2 * BLOCK_SIZE and not data.empty:
                pending = write_block(data)
                data = _Block(RESTART_INTERVAL)
        if pending is not None:
            index.add(_separator(last or b"", key), _handle(*pending))
            pending = None
        last = key
        data.add(key, value)
        if data.size_estimate() >= BLOCK_SIZE:
            pending = write_block(data)
            data = _Block(RESTART_INTERVAL)
    if not data.empty:
        pending = write_block(data)
    meta = write_block(_Block(RESTART_INTERVAL))
    if pending is not None:
        index.add(_successor(last or b""), _handle(*pending))
    idx = write_block(index)
    footer = bytearray(_handle(*meta) + _handle(*idx))
    footer += bytes(40 - len(footer))
    footer += _U32.pack(MAGIC & 0xFFFFFFFF) + _U32.pack(MAGIC >> 32)
    out += footer
    return bytes(out)


# --- reading ---------------------------------------------------------------------------------


def _read_handle(data: bytes, pos: int, limit: int, path: str, what: str) -> tuple[int, int, int]:
    try:
        offset, pos = get_varint(data, pos, limit)
        size, pos = get_varint(data, pos, limit)
    except ValueError as e:
        raise CorruptIndexError(f"{path}: bad block handle in {what} ({e})") from None
    return offset, size, pos


def _block(data: bytes, offset: int, size: int, path: str, what: str) -> memoryview:
    """The contents of the block at (`offset`, `size`), its trailer checked."""
    end = offset + size + TRAILER_SIZE
    if end > len(data) - FOOTER_SIZE:
        raise CorruptIndexError(
            f"{path}: {what} at bytes [{offset}, {end}) runs past the table's data region "
            f"({len(data) - FOOTER_SIZE} bytes): truncated or corrupt")
    raw = memoryview(data)[offset : offset + size + 1]
    kind = data[offset + size]
    (stored,) = _U32.unpack_from(data, offset + size + 1)
    if mask(crc32c(raw)) != stored:
        raise CorruptIndexError(f"{path}: {what} at byte {offset}: block checksum mismatch "
                                f"(crc32c {mask(crc32c(raw)):#010x}, trailer {stored:#010x})")
    if kind != NO_COMPRESSION:
        name = "snappy" if kind == 1 else f"unknown type {kind}"
        raise CorruptIndexError(
            f"{path}: {what} at byte {offset} is compressed ({name}); TensorFlow writes "
            "bundles uncompressed and shardkit reads only uncompressed tables")
    return raw[:size]


def _entries(block: memoryview, path: str, what: str,
             framed: tuple[bytes, bytearray, list[int]] | None = None) -> list[Any]:
    """The (key, value) pairs of `block`; with `framed` (prefix, out, lengths) its keys, the
    values appended to out after the prefix (`_sstable.block_framed`)."""
    n = len(block)
    if n < 4:
        raise CorruptIndexError(f"{path}: {what} is {n} bytes, too short for a block")
    (count,) = _U32.unpack_from(block, n - 4)
    if count == 0 or 4 * (count + 1) > n:
        raise CorruptIndexError(f"{path}: {what} records {count} restart points, impossible "
                                f"in {n} bytes")
    limit = n - 4 * (count + 1)
    restarts = struct.unpack_from(f"<{count}I", block, limit)
    if restarts[0] != 0 or any(r >= max(limit, 1) for r in restarts[1:]) or list(
            restarts) != sorted(restarts):
        raise CorruptIndexError(f"{path}: {what} has bad restart points {list(restarts)[:8]}")
    try:
        if framed is not None:
            return _sstable.block_framed(block, limit, restarts, *framed)  # type: ignore[no-any-return]
        keys, values = _sstable.block_entries(block, limit, restarts)
    except ValueError as e:
        raise CorruptIndexError(f"{path}: {what}: {e}") from None
    return list(zip(keys, values))


def read_table(data: bytes, path: str) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of the table `data` (file `path`), in key order; the footer, every
    block trailer (masked crc32c) and the key order are checked."""
    items: list[tuple[bytes, bytes]] = list(itertools.chain.from_iterable(
        _data_blocks(data, path, None)))
    _check_order([k for k, _ in items], path)
    return items


def read_table_framed(data: bytes, path: str, prefix: bytes
                      ) -> tuple[list[bytes], bytearray, list[int]]:
    """`read_table`, the same checks, with the values in one buffer: the keys in key order,
    every value after `prefix` in one bytearray, and the values' lengths; so that protobuf
    decodes all the values in one call (`protos.parse_columns`)."""
    out = bytearray()
    lengths: list[int] = []
    keys = list(itertools.chain.from_iterable(_data_blocks(data, path, (prefix, out, lengths))))
    _check_order(keys, path)
    return keys, out, lengths


def _check_order(keys: list[bytes], path: str) -> None:
    if any(map(operator.ge, keys, keys[1:])):
        a, b = next((a, b) for a, b in itertools.pairwise(keys) if b <= a)
        raise CorruptIndexError(f"{path}: keys out of order or repeated: {b!r} after {a!r}")


def _data_blocks(data: bytes, path: str, framed: tuple[bytes, bytearray, list[int]] | None
                 ) -> Iterator[list[Any]]:
    """The data blocks of the table `data` in order, each as `_entries` gives it; the footer,
    the index block and every block trailer checked, and each block's last key against its
    index key."""
    if len(data) < FOOTER_SIZE:
        raise CorruptIndexError(f"{path}: {len(data)} bytes, too short for a TensorFlow table "
                                f"(its footer alone is {FOOTER_SIZE})")
    start = len(data) - FOOTER_SIZE
    lo, hi = struct.unpack_from("<II", data, len(data) - 8)
    if (hi << 32) | lo != MAGIC:
        raise CorruptIndexError(f"{path}: not a TensorFlow table (bad magic number "
                                f"{(hi << 32) | lo:#018x}, expected {MAGIC:#018x})")
    _, _, pos = _read_handle(data, start, start + 40, path, "the footer")  # metaindex: unused
    offset, size, _ = _read_handle(data, pos, start + 40, path, "the footer")
    index = _entries(_block(data, offset, size, path, "index block"), path, "index block")
    previous_end = 0
    for i, (sep, value) in enumerate(index):
        b_off, b_size, used = _read_handle(value, 0, len(value), path, f"index entry {i}")
        if used != len(value) or b_off < previous_end:
            raise CorruptIndexError(f"{path}: index entry {i}: bad block handle")
        previous_end = b_off + b_size + TRAILER_SIZE
        what = f"data block {i}"
        block = _entries(_block(data, b_off, b_size, path, what), path, what, framed)
        last = (block[-1] if framed is not None else block[-1][0]) if block else None
        if last is not None and last > sep:  # keys increase (checked later): the last is enough
            raise CorruptIndexError(f"{path}: {what}: key {last!r} is past its index key")
        yield block
