"""Pure-Python twin of csrc/_mmap.pyx: a private, writable map of a file.

``Map`` returns ``mmap.mmap(..., access=ACCESS_COPY)`` (copy-on-write) itself, since a Python
class cannot export a buffer before Python 3.12. The map is never closed explicitly, so, as with
the kernel, the pages go with the last reference. Before Python 3.13 it holds a duplicate of the
descriptor (``trackfd=False`` does not exist there).
"""

from __future__ import annotations

import errno
import mmap as _mmap
import os
import sys
from typing import Any


def Map(fd: int, size: int) -> Any:  # the kernel's class name
    """The first `size` bytes of file `fd`, mapped copy-on-write; a writable byte buffer.

    OSError (with errno) when the system refuses the map; ValueError for a negative size.
    A size of 0 maps nothing and gives an empty buffer."""
    if size < 0:
        raise ValueError(f"cannot map a negative size ({size} bytes)")
    if fd < 0:  # mmap.mmap would make an anonymous map
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))
    if size == 0:
        return bytearray()
    kwargs: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}
    return _mmap.mmap(fd, size, access=_mmap.ACCESS_COPY, **kwargs)
