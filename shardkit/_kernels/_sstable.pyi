"""Stub of the compiled kernel module shardkit._kernels._sstable (csrc/_sstable.pyx)."""

from collections.abc import Sequence

def block_entries(block: bytes | bytearray | memoryview, limit: int, restarts: Sequence[int]
                  ) -> tuple[list[bytes], list[bytes]]:
    """(keys, values) of the entries in ``block[:limit]`` (the restart array follows `limit`;
    `restarts`, the restart offsets, sorted, the first 0). ValueError saying which entry is
    bad: a malformed varint, a key sharing more bytes than the previous key has or sharing any
    at a restart point, an entry running past `limit`."""
