"""The table-block kernel (csrc/_sstable.pyx) against its pure-Python twin."""

from __future__ import annotations

import importlib
import os
import struct

import pytest

from shardkit.adapters.tensorbundle import table

PURE_PYTHON = os.environ.get("SHARDKIT_PUREPYTHON") == "1"
twin = importlib.import_module("shardkit._reference._sstable")
kernel = None if PURE_PYTHON else importlib.import_module("shardkit._kernels._sstable")
IMPLS = [pytest.param(twin, id="twin")] + (
    [] if PURE_PYTHON else [pytest.param(kernel, id="kernel")]
)


def _block(items: list[tuple[bytes, bytes]], interval: int = 16) -> tuple[bytes, int, list[int]]:
    b = table._Block(interval)
    for k, v in items:
        b.add(k, v)
    raw = b.finish()
    count = struct.unpack_from("<I", raw, len(raw) - 4)[0]
    limit = len(raw) - 4 * (count + 1)
    return raw, limit, list(struct.unpack_from(f"<{count}I", raw, limit))


ITEMS = [(f"layer/{i:05d}/kernel".encode(), bytes([i % 251]) * (i % 300)) for i in range(100)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("interval", [1, 3, 16])
def test_entries_come_back_whole(impl, interval):
    raw, limit, restarts = _block(ITEMS, interval)  # values up to 299 bytes: 2-byte varints
    keys, values = impl.block_entries(raw, limit, restarts)
    assert list(zip(keys, values)) == ITEMS
    assert all(type(k) is bytes and type(v) is bytes for k, v in zip(keys, values))
    got = impl.block_entries(memoryview(raw), limit, restarts)  # a read-only view as well
    assert got == (keys, values)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_keys_and_values(impl):
    items = [(b"", b""), (b"a", b""), (b"ab", b"x")]
    raw, limit, restarts = _block(items)
    assert impl.block_entries(raw, limit, restarts) == ([b"", b"a", b"ab"], [b"", b"", b"x"])


def _bad_cases() -> list[tuple[str, bytes, int, list[int]]]:
    raw, limit, restarts = _block(ITEMS[:20])
    cases = []
    b = bytearray(raw)
    b[0:3] = bytes([0x80, 0x80, 0x80])  # a varint running into the next entry, then past
    cases.append(("overlong", bytes(b[:3]) + b"\x80" * 5 + bytes(b[8:]), limit, restarts))
    b = bytearray(raw)
    b[0] = 5  # the first key shares bytes with no previous key
    cases.append(("shares 5 bytes with the previous key of 0 bytes", bytes(b), limit, restarts))
    b = bytearray(raw)
    b[restarts[1]] = 2  # a restart point that shares
    cases.append(("at a restart point", bytes(b), limit, restarts))
    cases.append(("runs past the block", raw, limit - 1, restarts))  # the last entry does
    v = bytearray()
    table.put_varint(v, 1 << 33)  # a 5-byte varint with more than 32 bits
    cases.append(("out of range", b"\x00" + bytes(v) + b"\x00" * 12, 6, [0]))
    cases.append(("no room", b"\x00\x00\x00", 1, [0]))
    return cases


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(6))
def test_bad_blocks_are_refused_with_the_same_words(impl, case):
    words, raw, limit, restarts = _bad_cases()[case]
    with pytest.raises(ValueError, match=words) as got:
        impl.block_entries(raw, limit, restarts)
    with pytest.raises(ValueError) as expected:
        twin.block_entries(raw, limit, restarts)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("interval", [1, 16])
def test_framed_values_follow_their_prefix(impl, interval):
    """block_framed: the keys as block_entries gives them, the values appended to the buffer
    after the prefix (after what it held already), their lengths appended to the list."""
    raw, limit, restarts = _block(ITEMS, interval)
    out = bytearray(b"head")
    lengths = [7]
    keys = impl.block_framed(raw, limit, restarts, b"\x08\x00", out, lengths)
    assert keys == [k for k, _ in ITEMS] and all(type(k) is bytes for k in keys)
    assert bytes(out) == b"head" + b"".join(b"\x08\x00" + v for _, v in ITEMS)
    assert lengths == [7] + [len(v) for _, v in ITEMS]
    empty = bytearray()
    assert impl.block_framed(*_block([(b"", b""), (b"a", b"")])[:3], b"", empty, []) == [
        b"", b"a"] and empty == b""


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(6))
def test_framed_bad_blocks_are_refused_with_the_same_words(impl, case):
    words, raw, limit, restarts = _bad_cases()[case]
    with pytest.raises(ValueError, match=words) as got:
        impl.block_framed(raw, limit, restarts, b"\x00", bytearray(), [])
    with pytest.raises(ValueError) as expected:
        twin.block_entries(raw, limit, restarts)
    assert str(got.value) == str(expected.value)
