"""Stub of the compiled kernel module shardkit._kernels._gather (csrc/_gather.pyx)."""

from typing import Any

IOV_LIMIT: int  # most buffers in one pwritev
WRITE_BATCH: int  # bytes per write call (a larger array leaves in chunks of this)

def write_arrays(fd: int, arrays: list[Any], offset: int, digests: Any = None) -> int:
    """Write the bytes of `arrays` back to back at `offset` of file `fd`, the GIL released;
    with `digests` (a writable uint64 buffer), the xxh3-64 of array i into ``digests[i]``.
    Stops before the first element that is not a C-contiguous numpy array and returns how many
    arrays it wrote. OSError (with its errno) on a failed write.
    """

def hex_digests(values: Any) -> list[str]:
    """Each uint64 of `values` as 16 lowercase hex digits, as a list."""

def preallocate(fd: int, size: int) -> bool:
    """Reserve the first `size` bytes of file `fd` on disk (Linux ``fallocate``); False
    (nothing done) where the file system or OS cannot; OSError otherwise (e.g. ENOSPC)."""

def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Start writing bytes `offset` to `offset + length` of file `fd` to disk without waiting
    (Linux ``sync_file_range``); a hint: False where it was not taken, never raises."""

def read_arrays(fd: int, arrays: list[Any], offset: int) -> int:
    """Fill `arrays` (writable C-contiguous numpy arrays) back to back from `offset` of file
    `fd` with preadv, the GIL released; returns the bytes read, less than their total only when
    the file ends first. TypeError / ValueError before reading for a bad array; OSError on
    failure.
    """
