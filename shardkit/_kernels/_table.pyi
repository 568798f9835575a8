"""Stub of the compiled kernel module shardkit._kernels._table (csrc/_table.pyx)."""

from typing import Any

import numpy as np
import numpy.typing as npt

def encode_header_entries(
    names: list[str],
    dtype_names: list[str],
    shapes: list[tuple[int, ...]],
    begins: npt.NDArray[np.int64],
    ends: npt.NDArray[np.int64],
) -> bytes:
    """``,"name":{"dtype":"F32","shape":[2,3],"data_offsets":[b,e]}`` for every entry, as UTF-8.

    Names are escaped like ``json.encoder.encode_basestring``. Raises UnicodeEncodeError for a
    name that is not valid UTF-8 text, TypeError for a non-str name or dtype or a shape that is
    not a tuple or list of ints, ValueError for a dtype name needing escaping, a negative dim or
    inputs of unequal lengths; errors name the entry.
    """

def array_nbytes(arrays: list[Any]) -> npt.NDArray[np.int64]:
    """``arrays[i].nbytes`` for every array, as an int64 numpy array."""

def array_addresses(arrays: list[Any]) -> npt.NDArray[np.int64]:
    """The address of each numpy array's first byte, as an int64 numpy array; 0 for an empty
    array. TypeError for a value that is not a numpy array."""

def describe_arrays(
    values: list[Any], storable: Any
) -> tuple[list[np.dtype[Any]], npt.NDArray[np.int64], list[tuple[int, ...]]] | None:
    """``(dtypes, nbytes, shapes)`` of `values` in one pass, when every value is exactly a
    numpy array whose dtype is in `storable`; None as soon as one is not."""

def flatten_plain(state: Any, sep: str) -> tuple[list[str], list[Any]] | None:
    """``(keys, leaves)`` of a state made of dicts with str keys, lists and tuples, as
    shardkit.sharding.tensors.flatten would give them; None when the state needs that Python
    walk."""
