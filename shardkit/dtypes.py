"""The dtypes shardkit stores: numpy / ml_dtypes types <-> safetensors names and item sizes."""

from __future__ import annotations

from typing import Final

import ml_dtypes
import numpy as np

from .errors import UnsupportedDTypeError

# Safetensors name -> numpy dtype (little-endian). Order: float, signed int, unsigned int, bool.
_BY_NAME: Final[dict[str, np.dtype]] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_BY_DTYPE: Final[dict[np.dtype, str]] = {dt: name for name, dt in _BY_NAME.items()}

SAFETENSORS_NAMES: Final[tuple[str, ...]] = tuple(_BY_NAME)
STORABLE: Final[frozenset[np.dtype]] = frozenset(_BY_DTYPE)
STORABLE_NAMES: Final[tuple[str, ...]] = tuple(dt.name for dt in _BY_NAME.values())
"""numpy names of the storable dtypes ("float64", "float32", ..., "bfloat16", ..., "bool")."""


def is_supported(dtype: np.dtype) -> bool:
    """True if `dtype` (in any byte order) can be stored."""
    return np.dtype(dtype).newbyteorder("<") in _BY_DTYPE


def safetensors_name(dtype: np.dtype) -> str:
    """The safetensors dtype name of a numpy / ml_dtypes dtype, e.g. float32 -> "F32"."""
    dt = np.dtype(dtype)
    name = _BY_DTYPE.get(dt)
    if name is None:
        if dt.newbyteorder("<") in _BY_DTYPE:
            raise UnsupportedDTypeError(
                f"dtype {dt.str} is big-endian; shardkit stores little-endian data only "
                "(convert with arr.astype(arr.dtype.newbyteorder('<')))"
            )
        raise UnsupportedDTypeError(
            f"dtype {dt} cannot be stored; supported: "
            + ", ".join(str(d) for d in _BY_DTYPE)
        )
    return name


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a safetensors dtype name, e.g. "BF16" -> ml_dtypes.bfloat16."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise UnsupportedDTypeError(
            f"unknown dtype name {name!r}; known: {', '.join(SAFETENSORS_NAMES)}"
        ) from None


def itemsize(name: str) -> int:
    """Item size in bytes of a safetensors dtype name."""
    return numpy_dtype(name).itemsize
