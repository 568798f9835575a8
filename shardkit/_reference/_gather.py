"""Pure-Python twin of shardkit._kernels._gather: same functions, same results, same errors."""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Any

import numpy as np


def _typed(buf: Any, dtype: type, name: str) -> np.ndarray:
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    if arr.dtype != np.dtype(dtype) or arr.ndim != 1 or not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be a 1-d C-contiguous {np.dtype(dtype)} buffer")
    return arr


def _bytes(buf: Any, writable: bool) -> np.ndarray:
    view = memoryview(buf)
    if writable and view.readonly:
        raise ValueError("buffer source array is read-only")
    if view.format not in ("B", "<B", "=B") or view.ndim != 1:
        raise ValueError(
            f"Buffer dtype mismatch, expected a 1-d 'unsigned char' buffer but got format "
            f"{view.format!r} with {view.ndim} dimensions"
        )
    if not view.c_contiguous:
        raise ValueError("ndarray is not C-contiguous")
    return np.frombuffer(view, dtype=np.uint8)


def _check(addresses: Any, lengths: Any, offsets: Any, size: int, what: str) -> tuple:
    addresses = _typed(addresses, np.uint64, "addresses")
    lengths = _typed(lengths, np.int64, "lengths")
    offsets = _typed(offsets, np.int64, "offsets")
    if not (len(addresses) == len(lengths) == len(offsets)):
        raise ValueError(
            f"addresses, lengths and offsets must have equal lengths, got "
            f"{len(addresses)}, {len(lengths)}, {len(offsets)}"
        )
    for i, (off, n) in enumerate(zip(offsets.tolist(), lengths.tolist())):
        if off < 0 or n < 0 or off > size or n > size - off:
            raise ValueError(
                f"range {i} (offset {off}, length {n}) lies outside the {size}-byte {what} buffer"
            )
    return addresses.tolist(), lengths.tolist(), offsets.tolist()


def gather(addresses: Any, lengths: Any, offsets: Any, out: Any) -> None:
    """Copy ``lengths[i]`` bytes from address ``addresses[i]`` to ``out[offsets[i]:]``."""
    dest = _bytes(out, writable=True)
    addrs, lens, offs = _check(addresses, lengths, offsets, len(dest), "destination")
    base = dest.ctypes.data
    for a, n, o in zip(addrs, lens, offs):
        if n:
            ctypes.memmove(base + o, a, n)


def scatter(src: Any, offsets: Any, lengths: Any, addresses: Any) -> None:
    """Copy ``src[offsets[i]:offsets[i] + lengths[i]]`` to address ``addresses[i]``, for all i."""
    source = _bytes(src, writable=False)
    addrs, lens, offs = _check(addresses, lengths, offsets, len(source), "source")
    base = source.ctypes.data
    for a, n, o in zip(addrs, lens, offs):
        if n:
            ctypes.memmove(a, base + o, n)


def gather_buffers(sources: list, offsets: Any, out: Any) -> int:
    """Copy the bytes of each C-contiguous buffer ``sources[i]`` to ``out[offsets[i]:]``."""
    if not isinstance(sources, list):
        raise TypeError(f"Argument 'sources' has incorrect type (expected list, got "
                        f"{type(sources).__name__})")
    dest = _bytes(out, writable=True)
    offs = _typed(offsets, np.int64, "offsets").tolist()
    if len(offs) != len(sources):
        raise ValueError(
            f"sources and offsets must have equal lengths, got {len(sources)} and {len(offs)}"
        )
    size = len(dest)
    data = [np.frombuffer(s, dtype=np.uint8) for s in sources]  # ValueError if not contiguous
    for i, (d, off) in enumerate(zip(data, offs)):
        if off < 0 or off > size or len(d) > size - off:
            raise ValueError(
                f"source {i} ({len(d)} bytes at offset {off}) does not fit in the {size}-byte "
                "destination buffer"
            )
    for d, off in zip(data, offs):
        dest[off : off + len(d)] = d
    return sum(len(d) for d in data)


IOV_LIMIT = 1024  # most arrays one write_arrays call takes


def write_arrays(fd: int, arrays: list, offset: int) -> int:
    """Write the bytes of `arrays` (exactly C-contiguous numpy arrays) back to back at `offset`
    of file `fd`; returns the bytes written (short writes continued)."""
    if not isinstance(arrays, list):
        raise TypeError(f"arrays must be a list, got {type(arrays).__name__}")
    if len(arrays) > IOV_LIMIT:
        raise ValueError(f"{len(arrays)} arrays in one call; at most {IOV_LIMIT}")
    for i, a in enumerate(arrays):
        if type(a) is not np.ndarray:
            raise TypeError(f"array {i} is a {type(a).__name__}, not a numpy array")
        if not a.flags.c_contiguous:
            raise ValueError(f"array {i} is not C-contiguous")
    views = [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays]
    total = sum(len(v) for v in views)
    done = 0
    while done < total:
        got = os.pwritev(fd, views, offset + done)
        if got == 0:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        done += got
        while views and got >= len(views[0]):  # drop the finished buffers
            got -= len(views[0])
            views.pop(0)
        if views and got:
            views[0] = views[0][got:]
    return total
