"""Stub of the compiled kernel module shardkit._kernels._views (csrc/_views.pyx)."""

from typing import Any

import numpy as np
import numpy.typing as npt

def make_views(
    base: npt.NDArray[np.uint8],
    start: int,
    begins: list[int],
    dtypes: list[np.dtype[Any]],
    shapes: list[tuple[int, ...]],
) -> list[npt.NDArray[Any]]:
    """Arrays ``dtypes[i]`` of ``shapes[i]`` over the bytes of the 1-d uint8 array `base` from
    ``start + begins[i]``, C order; writable only if `base` is. ValueError for a range outside
    `base`, a negative dimension or lists of unequal lengths."""
