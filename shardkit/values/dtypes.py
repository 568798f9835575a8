"""The dtypes shardkit stores: safetensors names <-> numpy / ml_dtypes types <-> the frameworks'
dtypes (torch, TensorFlow; jax uses numpy's), item sizes and the bytes of a stored tensor
(`nbytes`, `entry_sizes`: the one size rule). The one dtype table."""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from ..errors import UnsupportedDTypeError
from ..optional import lazy_import

if TYPE_CHECKING:
    import ml_dtypes
else:  # its import is slow: only a checkpoint or state that holds its dtypes needs it
    ml_dtypes = lazy_import("ml_dtypes", "bfloat16 / float8 tensors")

# Safetensors name -> numpy dtype (little-endian). Order: float, signed int, unsigned int, bool,
# complex; the ml_dtypes ones are added by `_add_ml_dtypes`.
_BY_NAME: Final[dict[str, np.dtype]] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "C64": np.dtype("<c8"),
    "C128": np.dtype("<c16"),  # shardkit's name: safetensors defines no complex128
}
_ML_DTYPES: Final[dict[str, tuple[str, int]]] = {  # name -> (ml_dtypes' type, item size)
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
    "F4": ("float4_e2m1fn", 1),  # one code a byte in numpy; stored two a byte (`PACKED`)
}
PACKED: Final[frozenset[str]] = frozenset({"F4"})
"""Dtypes stored two elements a byte (4-bit codes; element 0 in the low nibble), as safetensors
stores them: a tensor of such a dtype needs an even element count. Their numpy arrays (and
`itemsize`) hold one element a byte; `nbytes` is the stored size."""
_ML_NAMES: Final[frozenset[str]] = frozenset(attr for attr, _ in _ML_DTYPES.values())
_BY_DTYPE: Final[dict[np.dtype, str]] = {dt: name for name, dt in _BY_NAME.items()}

SAFETENSORS_NAMES: Final[tuple[str, ...]] = (*tuple(_BY_NAME)[:3], *_ML_DTYPES,
                                             *tuple(_BY_NAME)[3:])
STORABLE: Final[set[np.dtype]] = set(_BY_DTYPE)
"""The storable dtypes; bfloat16 / float8 are in it once ml_dtypes is imported (`storable`)."""
STORABLE_NAMES: Final[tuple[str, ...]] = tuple(
    _ML_DTYPES[n][0] if n in _ML_DTYPES else _BY_NAME[n].name for n in SAFETENSORS_NAMES)
"""numpy names of the storable dtypes ("float64", "float32", ..., "bfloat16", ..., "bool")."""
_ITEMSIZE: Final[dict[str, int]] = {
    **{n: dt.itemsize for n, dt in _BY_NAME.items()},
    **{n: size for n, (_, size) in _ML_DTYPES.items()}}


def _add_ml_dtypes(load: bool) -> bool:
    """Put ml_dtypes' dtypes in the tables: importing it when `load`, else only if something
    imported it already (no array of its dtypes exists before). True if they are in."""
    if "BF16" in _BY_NAME:
        return True
    if not load and "ml_dtypes" not in sys.modules:
        return False
    for name, (attr, _) in _ML_DTYPES.items():
        dt = np.dtype(getattr(ml_dtypes, attr))
        _BY_DTYPE[dt] = name
        STORABLE.add(dt)
        _BY_NAME[name] = dt  # last: its presence says the tables are complete
    return True


def storable() -> set[np.dtype]:
    """`STORABLE`, with ml_dtypes' dtypes when ml_dtypes is imported."""
    _add_ml_dtypes(False)
    return STORABLE


def is_supported(dtype: np.dtype) -> bool:
    """True if `dtype` (in any byte order) can be stored."""
    dt = np.dtype(dtype).newbyteorder("<")
    return dt in _BY_DTYPE or (_add_ml_dtypes(False) and dt in _BY_DTYPE)


def safetensors_name(dtype: np.dtype) -> str:
    """The safetensors dtype name of a numpy / ml_dtypes dtype, e.g. float32 -> "F32"."""
    dt = np.dtype(dtype)
    name = _BY_DTYPE.get(dt)
    if name is None and _add_ml_dtypes(False):
        name = _BY_DTYPE.get(dt)
    if name is None:
        if dt.newbyteorder("<") in _BY_DTYPE:
            raise UnsupportedDTypeError(
                f"dtype {dt.str} is big-endian; shardkit stores little-endian data only "
                "(convert with arr.astype(arr.dtype.newbyteorder('<')))"
            )
        raise UnsupportedDTypeError(
            f"dtype {dt} cannot be stored; supported: "
            + ", ".join(STORABLE_NAMES)
        )
    return name


def as_dtype(dtype: Any) -> np.dtype:
    """``np.dtype(dtype)``, which also knows ml_dtypes' names ("bfloat16", "float8_e5m2"...).

    Raises:
        TypeError: numpy does not know `dtype`.
    """
    if isinstance(dtype, str) and dtype in _ML_NAMES:
        _add_ml_dtypes(True)
    return np.dtype(dtype)


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a safetensors dtype name, e.g. "BF16" -> ml_dtypes.bfloat16."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        if isinstance(name, str) and name in _ML_DTYPES and _add_ml_dtypes(True):
            return _BY_NAME[name]
        raise UnsupportedDTypeError(
            f"unknown dtype name {name!r}; known: {', '.join(SAFETENSORS_NAMES)}"
        ) from None


def itemsize(name: str) -> int:
    """Item size in bytes of a safetensors dtype name (without importing ml_dtypes): the
    numpy array's (1 for the `PACKED` F4, whose stored size is `nbytes`)."""
    size = _ITEMSIZE.get(name) if isinstance(name, str) else None
    return size if size is not None else numpy_dtype(name).itemsize


def nbytes(name: str, shape: Sequence[int]) -> int:
    """The bytes a tensor takes where it is stored: ``prod(shape) * itemsize(name)``, half the
    element count for a `PACKED` dtype. The one size rule (`entry_sizes` is its bulk form).

    Args:
        name: a safetensors dtype name ("F32", "F4"...).
        shape: the tensor's shape, in elements.
    Returns:
        The size in bytes; -1 for an odd count of a packed dtype, which no stored tensor has
        (`packed_problem` says why), so that it never equals an entry's size.
    Raises:
        UnsupportedDTypeError: `name` is no dtype name.
    """
    count = math.prod(shape)
    if name in PACKED:
        return -1 if count % 2 else count // 2
    return count * itemsize(name)


def entry_sizes(names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[int]:
    """`nbytes` of every (dtype name, shape) pair, in bulk (the products run in C).

    Args:
        names: safetensors dtype names, all known.
        shapes: one shape per name.
    Returns:
        The sizes in bytes, in order (-1 for an odd count of a packed dtype, as `nbytes`).
    Raises:
        KeyError: a name is no dtype name.
    """
    sizes = list(map(operator.mul, map(math.prod, shapes), map(_ITEMSIZE.__getitem__, names)))
    if "F4" in names:  # the one packed dtype (`PACKED`)
        for i, name in enumerate(names):
            if name in PACKED:
                sizes[i] = -1 if sizes[i] % 2 else sizes[i] // 2
    return sizes


def packed_name(dtype: np.dtype) -> str | None:
    """The safetensors name of `dtype` if it is a `PACKED` one (float4_e2m1fn: "F4"), else
    None (without importing ml_dtypes: no array of its dtypes exists before)."""
    if not _add_ml_dtypes(False):
        return None
    name = _BY_DTYPE.get(dtype)
    return name if name in PACKED else None


def stored_nbytes(array: np.ndarray) -> int:
    """The bytes `array` takes stored: ``array.nbytes``, half of it for a `PACKED` dtype."""
    return array.nbytes // 2 if packed_name(array.dtype) is not None else array.nbytes


def packed_problem(name: str, shape: Sequence[int]) -> str:
    """Why a tensor of dtype `name` and `shape` cannot be stored packed, worded after "tensor
    'k'" / "entry 'e'"; "" if nothing (and for every dtype that is not `PACKED`)."""
    if name not in PACKED or not math.prod(shape) % 2:
        return ""
    return (f": {name} stores two elements a byte, so it needs an even element count; shape "
            f"{list(shape)} has {math.prod(shape)} (safetensors refuses it too)")


_FRAMEWORK_TABLES: dict[str, dict[Any, np.dtype]] = {}


def framework_dtypes(module: Any) -> dict[Any, np.dtype]:
    """A framework's dtypes that shardkit stores -> the numpy / ml_dtypes dtype of each, for
    `module` torch or tensorflow: both name their dtypes as numpy does (``torch.bfloat16``,
    ``tf.uint16``...); the ones a version lacks (TensorFlow's float8) are left out. Built once
    per framework (it imports ml_dtypes)."""
    table = _FRAMEWORK_TABLES.get(module.__name__)
    if table is None:
        table = _FRAMEWORK_TABLES[module.__name__] = {
            getattr(module, name): as_dtype(name) for name in STORABLE_NAMES
            if hasattr(module, name)}
    return table


def carrier(dtype: np.dtype) -> np.dtype | None:
    """The integer dtype of the same width that carries an ml_dtypes dtype's bytes through a
    framework that cannot take it from numpy (int16 for bfloat16, uint8 for float8); None
    for numpy's own dtypes."""
    if not (_add_ml_dtypes(False) and _BY_DTYPE.get(dtype) in _ML_DTYPES):
        return None
    return np.dtype(np.int16) if dtype.itemsize == 2 else np.dtype(np.uint8)
