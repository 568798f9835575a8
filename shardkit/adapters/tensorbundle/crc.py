"""crc32c (Castagnoli) from the ``google-crc32c`` package (or ``crc32c``), and LevelDB's mask.

google-crc32c takes only ``bytes``: larger buffers are fed in 1 MiB copies, which stay in
cache. Imported on first use, so that ``import shardkit`` needs neither.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ...optional import missing

_STEP = 1 << 20


@functools.cache
def _extender() -> Callable[[int, Any], int]:
    """google-crc32c's extend (fed `_STEP` bytes at a time), else the crc32c package's."""
    try:
        from google_crc32c import cext
    except ImportError as e:
        try:
            import crc32c as pkg  # type: ignore[import-not-found]
        except ImportError:
            raise missing("google_crc32c", "reading or writing a TensorFlow checkpoint "
                          "(TensorBundle, its crc32c checksums)", e) from None
        return lambda crc, data: int(pkg.crc32c(memoryview(data).cast("B"), crc))

    def extend(crc: int, data: Any) -> int:
        if isinstance(data, bytes):
            return int(cext.extend(crc, data))
        mv = memoryview(data).cast("B")
        for i in range(0, len(mv), _STEP):
            crc = int(cext.extend(crc, bytes(mv[i : i + _STEP])))
        return crc

    return extend


def crc32c_extend(crc: int, data: Any) -> int:
    """crc32c of (the bytes whose crc32c is `crc`) + `data` (any C-contiguous buffer)."""
    return _extender()(crc, data)


def crc32c(data: Any) -> int:
    """crc32c of the bytes of `data`."""
    return crc32c_extend(0, data)


_DELTA = 0xA282EAD8


def mask(crc: int) -> int:
    """LevelDB's masked crc (rotate right by 15, add a constant), as TensorFlow stores it."""
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _DELTA) & 0xFFFFFFFF


def unmask(masked: int) -> int:
    rot = (masked - _DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF
