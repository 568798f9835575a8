"""Pure-Python twin of shardkit._kernels._gather: same functions, same results, same errors."""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from typing import Any

import numpy as np
import xxhash

IOV_LIMIT = 1024  # most buffers in one pwritev
WRITE_BATCH = 4 * 1024 * 1024  # bytes per write call (a larger array leaves in chunks of this)


def write_arrays(fd: int, arrays: list, offset: int, digests: Any = None) -> int:
    """Write the bytes of `arrays` back to back at `offset` of file `fd`; with `digests`, the
    xxh3-64 of array i into ``digests[i]``. Stops before the first element that is not a
    C-contiguous numpy array; returns how many arrays it wrote."""
    if not isinstance(arrays, list):
        raise TypeError(f"arrays must be a list, got {type(arrays).__name__}")
    if digests is not None and len(digests) < len(arrays):
        raise ValueError(f"digests holds {len(digests)} values, {len(arrays)} arrays given")
    count = 0
    for a in arrays:
        if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
            break
        count += 1
    views = [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays[:count]]
    if digests is not None:
        for i, v in enumerate(views):
            digests[i] = xxhash.xxh3_64_intdigest(v)
    for start in range(0, len(views), IOV_LIMIT):
        batch = views[start : start + IOV_LIMIT]
        left = sum(len(v) for v in batch)
        while left:
            got = os.pwritev(fd, batch, offset)
            if got == 0:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            offset += got
            left -= got
            while batch and got >= len(batch[0]):  # drop the finished buffers
                got -= len(batch[0])
                batch.pop(0)
            if batch and got:
                batch[0] = batch[0][got:]
    return count


def hex_digests(values: Any) -> list[str]:
    """Each value as 16 lowercase hex digits (xxhash's ``hexdigest`` spelling), as a list."""
    return [f"{v:016x}" for v in np.asarray(values, dtype=np.uint64).tolist()]


def preallocate(fd: int, size: int) -> bool:
    """Reserve the first `size` bytes of file `fd` on disk (Linux ``fallocate``); False
    (nothing done) where the file system or OS cannot; OSError otherwise (e.g. ENOSPC)."""
    if size <= 0 or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if libc.fallocate(fd, 0, 0, size) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Start writing bytes `offset` to `offset + length` of file `fd` to disk without waiting
    (Linux ``sync_file_range``); a hint: False where it was not taken, never raises."""
    if length <= 0 or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_uint]
    return libc.sync_file_range(fd, offset, length, 2) == 0  # SYNC_FILE_RANGE_WRITE


def read_arrays(fd: int, arrays: list, offset: int) -> int:
    """Fill `arrays` (writable C-contiguous numpy arrays) back to back from `offset` of file
    `fd`; returns the bytes read, less than their total only when the file ends first."""
    if not isinstance(arrays, list):
        raise TypeError(f"arrays must be a list, got {type(arrays).__name__}")
    for i, a in enumerate(arrays):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"array {i} is a {type(a).__name__}, not a numpy array")
        if not (a.flags.c_contiguous and a.flags.writeable):
            raise ValueError(f"array {i} is not a writable C-contiguous array")
    views = [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays if a.nbytes]
    done = 0
    while views:
        got = os.preadv(fd, views[:IOV_LIMIT], offset + done)
        if got == 0:
            break
        done += got
        while views and got >= len(views[0]):
            got -= len(views[0])
            views.pop(0)
        if views and got:
            views[0] = views[0][got:]
    return done
