"""Pure-Python twin of csrc/_views.pyx: many numpy arrays over one buffer."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def make_views(base: np.ndarray, start: int, begins: list[int], dtypes: list[np.dtype],
               shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Arrays ``dtypes[i]`` of ``shapes[i]`` over the bytes of the 1-d uint8 array `base` from
    ``start + begins[i]``, C order; writable only if `base` is. ValueError for a range outside
    `base`, a negative dimension or lists of unequal lengths."""
    n = len(begins)
    if len(dtypes) != n or len(shapes) != n:
        raise ValueError(f"begins, dtypes and shapes differ in length: {n}, {len(dtypes)}, "
                         f"{len(shapes)}")
    if base.ndim != 1 or base.itemsize != 1 or not base.flags.c_contiguous:
        raise ValueError("base must be a contiguous 1-d array of bytes")
    size = base.nbytes
    out: list[Any] = []
    for i, (begin, dtype, shape) in enumerate(zip(begins, dtypes, shapes)):
        if not isinstance(shape, tuple):
            raise TypeError(f"view {i}: shape must be a tuple, got {type(shape).__name__}")
        if any(d < 0 for d in shape):
            raise ValueError(f"view {i}: negative dimension in shape {shape}")
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > size:
            raise ValueError(f"view {i}: shape {shape} needs more than the {size}-byte buffer")
        offset = start + begin
        if offset < 0 or offset > size - nbytes:
            raise ValueError(f"view {i}: bytes [{offset}, {offset + nbytes}) are outside the "
                             f"{size}-byte buffer")
        out.append(np.ndarray(shape, dtype, buffer=base, offset=offset))
    return out
