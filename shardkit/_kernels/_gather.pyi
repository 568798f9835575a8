"""Stub of the compiled kernel module shardkit._kernels._gather (csrc/_gather.pyx)."""

import sys
from typing import Any

if sys.version_info >= (3, 12):
    from collections.abc import Buffer
else:
    from typing_extensions import Buffer

def gather(addresses: Buffer, lengths: Buffer, offsets: Buffer, out: Buffer) -> None:
    """Copy ``lengths[i]`` bytes from address ``addresses[i]`` to ``out[offsets[i]:]``.

    `addresses` is a C-contiguous uint64 buffer, `lengths` and `offsets` int64; `out` is a
    writable contiguous byte buffer. Raises ValueError if a range falls outside `out`.
    """

def scatter(src: Buffer, offsets: Buffer, lengths: Buffer, addresses: Buffer) -> None:
    """Copy ``src[offsets[i]:offsets[i] + lengths[i]]`` to address ``addresses[i]``.

    `src` may be read-only. Raises ValueError if a range falls outside `src`.
    """

def gather_buffers(sources: list[Buffer], offsets: Buffer, out: Buffer) -> int:
    """Copy each C-contiguous buffer ``sources[i]`` to ``out[offsets[i]:]``; returns the bytes
    copied. `offsets` is an int64 buffer. Raises ValueError (nothing copied) if a source is not
    C-contiguous or does not fit.
    """

IOV_LIMIT: int  # most arrays one write_arrays call takes

def write_arrays(fd: int, arrays: list[Any], offset: int) -> int:
    """Write the bytes of `arrays` (exactly C-contiguous numpy arrays, at most 1024) back to
    back at `offset` of file `fd` with pwritev, the GIL released; returns the bytes written.
    TypeError / ValueError before anything is written for a bad array; OSError on failure.
    """
