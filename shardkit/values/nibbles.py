"""Packed 4-bit tensors (the `PACKED` dtypes of `values.dtypes`: float4_e2m1fn, safetensors
"F4"): numpy holds one 4-bit code a byte, the stored form two, element 0 in the low nibble of
each byte, as safetensors and torch's ``float4_e2m1fn_x2`` store them."""

from __future__ import annotations

import numpy as np


def pack(array: np.ndarray) -> np.ndarray:
    """The stored bytes of `array` (one 4-bit code a byte: ml_dtypes' float4_e2m1fn), its
    elements in C order two a byte, the first in the low nibble.

    Args:
        array: an array of an even element count, any layout.
    Returns:
        A new 1-D uint8 array of half the element count.
    Raises:
        ValueError: the element count is odd.
    """
    if array.size % 2:
        raise ValueError(f"{array.size} elements cannot be packed two a byte (an odd count)")
    codes = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return (codes[0::2] & 0x0F) | ((codes[1::2] & 0x0F) << 4)


def unpack(data: np.ndarray | memoryview | bytes, dtype: np.dtype, shape: tuple[int, ...],
           first: int = 0) -> np.ndarray:
    """Elements of packed bytes as a new array of one code a byte.

    Args:
        data: packed bytes (element 2k in the low nibble of byte k).
        dtype: the array's dtype (ml_dtypes.float4_e2m1fn).
        shape: the result's shape; its element count, from element `first` on, must lie
            within `data`.
        first: the element of `data` the result starts at (0 or 1: where a read begins).
    Returns:
        A new C-contiguous array of `dtype` and `shape`.
    """
    raw = np.frombuffer(data, np.uint8)
    count = int(np.prod(shape, dtype=np.int64))
    codes = np.empty(2 * raw.size, np.uint8)
    codes[0::2] = raw & 0x0F
    codes[1::2] = raw >> 4
    return codes[first : first + count].view(dtype).reshape(shape)
