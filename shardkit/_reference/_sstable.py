"""Pure-Python twin of csrc/_sstable.pyx: the entries of one block of a TensorFlow table."""

from __future__ import annotations

from collections.abc import Sequence


def _varint32(data: bytes, pos: int, limit: int) -> tuple[int, int]:
    result = shift = 0
    while pos < limit:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            if result >> 32:
                raise ValueError("varint32 out of range")
            return result, pos
        shift += 7
        if shift >= 39:
            break
    raise ValueError("truncated or overlong varint32")


def block_entries(block: bytes | bytearray | memoryview, limit: int, restarts: Sequence[int]
                  ) -> tuple[list[bytes], list[bytes]]:
    """(keys, values) of the entries in ``block[:limit]`` (the restart array follows `limit`;
    `restarts`, the restart offsets, sorted, the first 0). ValueError saying which entry is
    bad: a malformed varint, a key sharing more bytes than the previous key has or sharing any
    at a restart point, an entry running past `limit`."""
    blk = bytes(block)  # slices of bytes are bytes: one copy of the block, none per entry
    if limit < 0 or limit + 3 > len(blk):
        raise ValueError(f"limit {limit} leaves no room for the restart array")
    keys: list[bytes] = []
    values: list[bytes] = []
    restart_at = set(restarts)
    pos = 0
    last = b""
    while pos < limit:
        at = pos
        shared, unshared, length = blk[pos], blk[pos + 1], blk[pos + 2]
        if shared < 0x80 and unshared < 0x80 and length < 0x80:  # one byte each: the usual
            pos += 3
        else:
            try:
                shared, pos = _varint32(blk, pos, limit)
                unshared, pos = _varint32(blk, pos, limit)
                length, pos = _varint32(blk, pos, limit)
            except ValueError as e:
                raise ValueError(f"bad entry at byte {at} ({e})") from None
        if shared and (shared > len(last) or at in restart_at):
            raise ValueError(
                f"entry at byte {at} shares {shared} bytes with the previous key of "
                f"{len(last)} bytes" + (" at a restart point" if at in restart_at else ""))
        end = pos + unshared
        stop = end + length
        if stop > limit:
            raise ValueError(f"entry at byte {at} runs past the block")
        key = last[:shared] + blk[pos:end] if shared else blk[pos:end]
        keys.append(key)
        values.append(blk[end:stop])
        pos = stop
        last = key
    return keys, values


def block_framed(block: bytes | bytearray | memoryview, limit: int, restarts: Sequence[int],
                 prefix: bytes, out: bytearray, lengths: list[int]) -> list[bytes]:
    """The keys of the entries in ``block[:limit]`` (as `block_entries`, the same checks),
    their values appended to `out`, each after `prefix` (so that one protobuf parse of `out`
    reads them all), and their lengths appended to `lengths`. After a ValueError the contents
    of `out` and `lengths` are unspecified."""
    keys, values = block_entries(block, limit, restarts)
    for v in values:
        out += prefix
        out += v
        lengths.append(len(v))
    return keys
