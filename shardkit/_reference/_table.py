"""Pure-Python twin of shardkit._kernels._table: same functions, same results, same errors."""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
from json.encoder import encode_basestring
from typing import Any

import numpy as np

_INT64_MAX = 2**63 - 1
# Printable ASCII except '"' and '\': what JSON copies unescaped.
_PLAIN_ASCII = re.compile(r'[ !#-\[\]-~]*')
_nbytes = operator.attrgetter("nbytes")


def _list(value: Any, label: str) -> list:
    if not isinstance(value, list):
        raise TypeError(
            f"Argument '{label}' has incorrect type (expected list, got {type(value).__name__})"
        )
    return value


def _int64s(buf: Any, label: str) -> list[int]:
    if buf is None:
        raise TypeError(f"Argument '{label}' must not be None")
    view = memoryview(buf)  # TypeError for a non-buffer
    if view.ndim != 1 or view.itemsize != 8 or view.format.lstrip("@=<") not in ("q", "l"):
        raise ValueError(f"{label} must be a 1-d int64 buffer, got format {view.format!r}")
    if not view.c_contiguous:
        raise ValueError("ndarray is not C-contiguous")
    return view.cast("B").cast("q").tolist()


def _dim(d: Any, i: int, name: str) -> int:
    if type(d) is not int:
        try:
            if isinstance(d, bool):
                raise TypeError
            d = operator.index(d)
        except TypeError:
            raise TypeError(
                f"entry {i} ({name!r}): shape dims must be ints, got {type(d).__name__} {d!r}"
            ) from None
    if not 0 <= d <= _INT64_MAX:
        raise ValueError(f"entry {i} ({name!r}): shape dim {int(d)} is outside 0..2**63-1")
    return int(d)


def encode_header_entries(
    names: list[str], dtype_names: list[str], shapes: list[tuple[int, ...]],
    begins: Any, ends: Any,
) -> bytes:
    """``,"name":{"dtype":"F32","shape":[2,3],"data_offsets":[b,e]}`` for every entry, as UTF-8."""
    _list(names, "names")
    _list(dtype_names, "dtype_names")
    _list(shapes, "shapes")
    begin_list = _int64s(begins, "begins")
    end_list = _int64s(ends, "ends")
    n = len(names)
    if not (len(dtype_names) == len(shapes) == len(begin_list) == len(end_list) == n):
        raise ValueError(
            f"names, dtype_names, shapes, begins and ends must have equal lengths, got {n}, "
            f"{len(dtype_names)}, {len(shapes)}, {len(begin_list)}, {len(end_list)}"
        )
    parts = []
    for i, (name, dtype, shape, begin, end) in enumerate(
        zip(names, dtype_names, shapes, begin_list, end_list)
    ):
        if not isinstance(name, str):
            raise TypeError(f"entry {i}: names must be str, got {type(name).__name__}")
        name.encode("utf-8")  # UnicodeEncodeError at the position in the name, not its escape
        if not isinstance(dtype, str):
            raise TypeError(
                f"entry {i} ({name!r}): dtype names must be str, got {type(dtype).__name__}"
            )
        if not _PLAIN_ASCII.fullmatch(dtype):
            raise ValueError(
                f"entry {i} ({name!r}): dtype name {dtype!r} is not printable ASCII "
                "without quotes or backslashes"
            )
        if not isinstance(shape, (tuple, list)):
            raise TypeError(
                f"entry {i} ({name!r}): shape must be a tuple or list of ints, got "
                f"{type(shape).__name__}"
            )
        dims = ",".join(str(_dim(d, i, name)) for d in shape)
        parts.append(
            f',{encode_basestring(name)}:{{"dtype":"{dtype}","shape":[{dims}],'
            f'"data_offsets":[{begin},{end}]}}'
        )
    return "".join(parts).encode("utf-8")


def array_nbytes(arrays: list) -> np.ndarray:
    """``arrays[i].nbytes`` for every array, as an int64 numpy array."""
    _list(arrays, "arrays")
    return np.fromiter(map(_nbytes, arrays), dtype=np.int64, count=len(arrays))


def array_addresses(arrays: list) -> np.ndarray:
    """The address of each numpy array's first byte, as an int64 numpy array; 0 for an empty
    array. TypeError for a value that is not a numpy array."""
    _list(arrays, "arrays")
    out = np.zeros(len(arrays), dtype=np.int64)
    for i, a in enumerate(arrays):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"arrays[{i}] is a {type(a).__name__}, not a numpy array")
        if a.size:
            out[i] = a.__array_interface__["data"][0]
    return out


def describe_arrays(
    values: list, storable: Any
) -> tuple[list[np.dtype], np.ndarray, list[tuple[int, ...]]] | None:
    """``(dtypes, nbytes, shapes)`` of `values` in one pass, when every value is exactly a
    numpy array whose dtype is in `storable`; None as soon as one is not."""
    _list(values, "values")
    if not all(type(a) is np.ndarray and a.dtype in storable for a in values):
        return None
    return ([a.dtype for a in values], array_nbytes(values), [a.shape for a in values])


def flatten_plain(state: Any, sep: str) -> tuple[list[str], list[Any]] | None:
    """``(keys, leaves)`` of a state made of dicts with str keys, lists and tuples, as
    shardkit.sharding.tensors.flatten would give them; None when the state needs that Python walk
    (another kind of mapping or key, or very deep nesting)."""
    if not isinstance(sep, str):
        raise TypeError(f"sep must be a str, got {type(sep).__name__}")
    if type(state) is not dict:
        return None
    keys: list[str] = []
    values: list[Any] = []

    def walk(node: Any, base: str, depth: int) -> bool:
        if depth > _MAX_DEPTH:
            return False
        items = node.items() if type(node) is dict else enumerate(node)
        for k, v in items:
            if type(node) is dict and type(k) is not str:
                return False
            key = base + (k if type(k) is str else str(k))
            if type(v) is np.ndarray:
                keys.append(key)
                values.append(v)
            elif type(v) is dict or isinstance(v, (list, tuple)):
                if not walk(v, key + sep, depth + 1):
                    return False
            elif isinstance(v, Mapping):
                return False
            else:
                keys.append(key)
                values.append(v)
        return True

    return (keys, values) if walk(state, "", 0) else None


_MAX_DEPTH = 200  # deeper states take the Python walk
