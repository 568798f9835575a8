"""The structure record of a state: its containers and Python values, so that a load gives
back the nested state as it was saved (docs/FORMAT.md, "The structure record").

`record` walks a state once. Tensors (and Python bool / int / float, stored as 0-d tensors as
before) keep their place in the flat checkpoint; what no tensor can hold (None, str, ints beyond
64 bits) lives in the record only. The record is a list of rows in depth-first order, one per
node: ``[path, kind]`` or ``[path, kind, detail]``, `path` the keys from the root (str or int).
Kinds: ``dict``, ``list``, ``tuple``, ``namedtuple`` (detail: ``[import path, [fields]]``),
``tensor``, ``bool`` / ``int`` / ``float`` (a 0-d tensor given back as that Python type), ``none``,
``str`` (detail: the text) and ``bigint`` (detail: its decimal digits). A state of plain dicts
with str keys and tensors records nothing: unflattening its keys rebuilds it.

`rebuild` turns a record and the loaded tensors back into the state. A NamedTuple type is
looked up among the modules already imported, never imported: when it is not there (or has
other fields), a namedtuple of the recorded name and fields stands in.
"""

from __future__ import annotations

import collections
import functools
import re
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import CorruptIndexError, DistributedStateError
from .tensors import SEPARATOR, _key_part, unflatten

Row = list[Any]
_CONTAINERS = frozenset({"dict", "list", "tuple", "namedtuple"})
_STORED_SCALARS = {"bool": bool, "int": int, "float": float}  # 0-d tensors, typed
_INT_RANGE = (-(2**63), 2**64 - 1)  # int64 and uint64: an int outside is a bigint
TENSOR_KINDS = frozenset({"tensor", *_STORED_SCALARS})
"""The kinds whose value is a stored tensor at the row's path."""
_DECIMAL = re.compile(r"-?[0-9]+")
KINDS = frozenset({*_CONTAINERS, *_STORED_SCALARS, "tensor", "none", "str", "bigint"})


def record(state: Mapping[str, Any]) -> tuple[list[Row] | None, Mapping[str, Any]]:
    """The structure record of `state` and the state to flatten.

    Args:
        state: the nested state a save was given.
    Returns:
        ``(rows, tensors)``: the record (None for a state that needs none) and `state` without
        the values only the record holds (containers that held one become dicts of the rest,
        under the same keys), or `state` itself when it holds none.
    Raises:
        InvalidKeyTypeError: a key is not a str or int.
    """
    if _plain(state):
        return None, state
    rows: list[Row] = []
    plain = [True]
    pruned = _walk(state, [], (), rows, plain)
    return (None if plain[0] else rows), (state if pruned is None else pruned)


_VALUES = (Mapping, list, tuple, str, int, float)  # what a plain state's leaves are not


def _plain(state: Any) -> bool:
    """Whether `state` is non-empty dicts of str keys (without the separator) and tensors
    only: what unflattening its keys rebuilds, so that it needs no record. One quick pass: a
    large dict's keys and values are checked in C loops, a small one's item by item."""
    ndarray = np.ndarray
    stack = [state]
    while stack:
        node = stack.pop()
        if type(node) is not dict or not node:
            return False
        if len(node) > 16:
            if set(map(type, node)) != {str} or SEPARATOR in "".join(node):
                return False
            for t in set(map(type, node.values())):
                if t is dict:
                    stack.extend(v for v in node.values() if type(v) is dict)
                elif not _plain_leaf(t):
                    return False
            continue
        for k, v in node.items():
            if type(k) is not str or SEPARATOR in k:
                return False
            tv = type(v)
            if tv is dict:
                stack.append(v)
            elif tv is not ndarray and not _plain_leaf(tv):
                return False
    return True


def _plain_leaf(t: type) -> bool:
    """Whether a value of type `t` is a tensor leaf (a numpy scalar is one)."""
    return t is not type(None) and (not issubclass(t, _VALUES) or issubclass(t, np.generic))


def _walk(node: Any, path: list[Any], where: tuple[Any, ...], rows: list[Row],
          plain: list[bool]) -> Any:
    """Record `node` at `path`; None if it stays as it is, else what is left of it to flatten
    (`_GONE`: nothing, a value only the record holds)."""
    if isinstance(node, Mapping):
        rows.append([path, "dict"])
        if not node or type(node) is not dict:
            plain[0] = False
        children = []
        for k, v in node.items():
            part = _key_part(k, where)
            if type(part) is not str or SEPARATOR in part:
                plain[0] = False
            children.append((part, v))
        return _children(node, children, path, where, rows, plain)
    if isinstance(node, (list, tuple)) and not isinstance(node, np.ndarray):
        plain[0] = False
        detail = namedtuple_detail(node)
        if detail is not None:
            rows.append([path, "namedtuple", detail])
        else:
            rows.append([path, "tuple" if isinstance(node, tuple) else "list"])
        return _children(node, list(enumerate(node)), path, where, rows, plain)
    kind, detail = _leaf_kind(node)
    if kind != "tensor":
        plain[0] = False
    rows.append([path, kind] if detail is None else [path, kind, detail])
    return _GONE if record_only(node) else None


_GONE: Any = object()


def namedtuple_detail(value: Any) -> list[Any] | None:
    """A NamedTuple's record detail, ``["module:Qual.Name", [field names]]``; None for any
    other value (a plain tuple too).

    Args:
        value: any value.
    Returns:
        The detail, or None.
    """
    cls = type(value)
    fields = getattr(cls, "_fields", None)
    if not isinstance(value, tuple) or not isinstance(fields, tuple):
        return None
    return [f"{cls.__module__}:{cls.__qualname__}", list(map(str, fields))]


def _children(node: Any, children: list[tuple[Any, Any]], path: list[Any],
              where: tuple[Any, ...], rows: list[Row], plain: list[bool]) -> Any:
    kept: dict[Any, Any] | None = None
    for i, (part, v) in enumerate(children):
        got = _walk(v, [*path, part], (*where, part), rows, plain)
        if got is not None and kept is None:  # the first change: copy what came before
            kept = {p: c for p, c in children[:i]}
        if kept is not None and got is not _GONE:
            kept[part] = v if got is None else got
    return kept


def record_only(value: Any) -> bool:
    """Whether `value` is one only the record holds (None, str, an int beyond 64 bits)."""
    return _leaf_kind(value)[0] in ("none", "str", "bigint")


def _leaf_kind(value: Any) -> tuple[str, Any]:
    if isinstance(value, np.generic):  # np.float64 is a float, np.str_ a str: tensors here
        return "tensor", None
    if value is None:
        return "none", None
    if isinstance(value, str):
        return "str", str.__str__(value)
    if isinstance(value, bool):
        return "bool", None
    if isinstance(value, int):
        if _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            return "int", None
        return "bigint", int.__repr__(value)
    if isinstance(value, float):
        return "float", None
    return "tensor", None


def rebuild(rows: list[Row], values: Mapping[str, Any], where: str,
            prefix: str | None = None) -> Any:
    """The state a record describes, its tensors taken from `values`.

    Args:
        rows: the record (`record`'s rows, as the manifest holds them).
        values: checkpoint key -> loaded tensor (keys relative to `prefix`).
        where: the checkpoint, for error messages.
        prefix: rebuild only the node at this key (as `load`'s prefix), whose keys `values`
            holds relative to it.
    Returns:
        The nested state (the node at `prefix`).
    Raises:
        CorruptIndexError: the record is malformed or names a tensor that is not stored.
        KeyError: a tensor of the record is not among `values` (not read).
    """
    start = 0
    base: list[Any] = []
    if prefix is not None:
        start = next((i for i, row in enumerate(rows) if _joined(_row_path(row, where)) == prefix),
                     -1)
        if start < 0:
            raise KeyError(prefix)
        base = _row_path(rows[start], where)
    return _build(rows, start, base, values, where, len(base))[0]


def _row_path(row: Any, where: str) -> list[Any]:
    if not (isinstance(row, list) and 2 <= len(row) <= 3 and isinstance(row[0], list)
            and type(row[1]) is str and row[1] in KINDS):
        raise CorruptIndexError(f"{where}: structure record row {_shown(row)} is not "
                                "[path, kind] or [path, kind, detail] with a known kind")
    for k in row[0]:
        if type(k) is not str and type(k) is not int:
            raise CorruptIndexError(f"{where}: structure record path {_shown(row[0])} holds "
                                    f"{_shown(k)}, not a str or int key")
    return row[0]


def merge_records(records: list[list[Row] | None], keys: list[list[str]]) -> list[Row] | None:
    """One record for the states of many ranks (a collective save), each rank's `records`
    entry its record, or None for a plain state, whose `keys` (its stored tensors' keys)
    stand for it: the union of the ranks' trees, dict items in order of first appearance
    (rank 0's first), the items of sequences by position. None when no rank has a record.

    Raises:
        DistributedStateError: two ranks record different kinds at one path.
    """
    if all(r is None for r in records):
        return None
    rows: dict[tuple[Any, ...], Row] = {}
    children: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
    owner: dict[tuple[Any, ...], int] = {}
    for rank, record in enumerate(records):
        if rank and record is not None and record == records[0]:
            continue  # the usual case: every rank holds the same non-tensor values
        for row in _plain_rows(keys[rank]) if record is None else record:
            path = tuple(row[0])
            have = rows.get(path)
            if have is None:
                rows[path], owner[path] = row, rank
                if path:
                    children.setdefault(path[:-1], []).append(path)
            elif have[1:] != row[1:]:
                raise DistributedStateError(
                    f"{_joined(list(path)) or 'the state'!r} is a {have[1]} on rank "
                    f"{owner[path]} and a {row[1]} on rank {rank}: every rank must hold "
                    "the same value kind under one key")
    out: list[Row] = []
    stack: list[tuple[Any, ...]] = [()]
    while stack:
        path = stack.pop()
        row = rows[path]
        out.append(row)
        below = children.get(path, [])
        if row[1] != "dict":
            below = sorted(below, key=lambda p: p[-1])
        stack.extend(reversed(below))
    return out


def _plain_rows(keys: list[str]) -> list[Row]:
    """The record of a plain state (dicts of tensors) with these keys."""
    rows: list[Row] = [[[], "dict"]]
    seen: set[tuple[str, ...]] = set()
    for key in keys:
        parts = key.split(SEPARATOR)
        for n in range(1, len(parts)):
            if tuple(parts[:n]) not in seen:
                seen.add(tuple(parts[:n]))
                rows.append([parts[:n], "dict"])
        rows.append([parts, "tensor"])
    return rows


def tensor_keys(rows: list[Row]) -> list[str]:
    """The checkpoint keys of the stored tensors a (checked) record places."""
    return [_joined(row[0]) for row in rows if row[1] in TENSOR_KINDS]


def _joined(path: list[Any]) -> str:
    return SEPARATOR.join(map(str, path))


def _build(rows: list[Row], i: int, path: list[Any], values: Mapping[str, Any], where: str,
           strip: int) -> tuple[Any, int]:
    """The node of row `i` (whose path is `path`) and the index of the row after its subtree."""
    row = rows[i]
    kind = row[1]
    detail = row[2] if len(row) == 3 else None
    if kind not in _CONTAINERS:
        return _leaf(kind, detail, _joined(path[strip:]), values, where), i + 1
    items: list[tuple[Any, Any]] = []
    j = i + 1
    while j < len(rows):
        child = _row_path(rows[j], where)
        if len(child) <= len(path) or child[:len(path)] != path:
            break  # past this node's subtree
        if len(child) != len(path) + 1:
            raise CorruptIndexError(f"{where}: structure record row {_shown(child)} has no "
                                    "parent row before it")
        value, j = _build(rows, j, child, values, where, strip)
        items.append((child[-1], value))
    if kind == "dict":
        out = dict(items)
        if len(out) != len(items):
            raise CorruptIndexError(f"{where}: structure record: dict {_shown(path)} lists a "
                                    "key twice")
        return out, j
    positions = [k for k, _ in items]
    if positions != list(range(len(items))):
        raise CorruptIndexError(f"{where}: structure record: the items of {kind} "
                                f"{_shown(path)} are not numbered 0, 1, ... in order")
    seq = [v for _, v in items]
    if kind == "list":
        return seq, j
    if kind == "tuple":
        return tuple(seq), j
    return namedtuple_type(detail, len(seq), path, where)(*seq), j


def _leaf(kind: str, detail: Any, key: str, values: Mapping[str, Any], where: str) -> Any:
    if kind == "none":
        return None
    if kind == "str":
        if type(detail) is not str:
            raise CorruptIndexError(f"{where}: structure record: str at {key!r} has no text")
        return detail
    if kind == "bigint":
        try:
            if type(detail) is not str or not _DECIMAL.fullmatch(detail):
                raise ValueError
            return int(detail)
        except ValueError:  # also past Python's limit on the digits of an int
            raise CorruptIndexError(f"{where}: structure record: int at {key!r} must be "
                                    f"decimal digits, found {_shown(detail)}") from None
    value = values[key]  # a KeyError names a key the caller did not read
    if kind == "tensor":
        return value
    return _STORED_SCALARS[kind](_item(value))


def _item(value: Any) -> Any:
    """The Python number a 0-d tensor of any framework holds."""
    numpy = getattr(value, "numpy", None)  # TensorFlow's tensors have no .item()
    if not hasattr(value, "item") and callable(numpy):
        value = numpy()
    return value.item()


def namedtuple_type(detail: Any, n: int, path: Any, where: str) -> Any:
    """The NamedTuple type a record detail names: the type itself when its module is imported
    and its fields are the recorded ones (nothing is imported), else a namedtuple of the
    recorded name and fields.

    Args:
        detail: ``["module:Qual.Name", [field names]]`` (`namedtuple_detail`'s).
        n: the number of items the NamedTuple holds.
        path: where it is in the state, for error messages.
        where: the checkpoint, for error messages.
    Returns:
        The type.
    Raises:
        CorruptIndexError: `detail` is not of that form or names other than `n` fields.
    """
    if not (isinstance(detail, list) and len(detail) == 2 and type(detail[0]) is str
            and isinstance(detail[1], list) and all(type(f) is str for f in detail[1])
            and len(detail[1]) == n):
        raise CorruptIndexError(f"{where}: structure record: namedtuple at {_shown(path)} needs "
                                f"[import path, [{n} field names]], found {_shown(detail)}")
    return _named_type(detail[0], tuple(detail[1]))


@functools.lru_cache(maxsize=256)
def _named_type(name: str, fields: tuple[str, ...]) -> Any:
    """The NamedTuple type `name` ("module:Qual.Name") if its module is imported and its fields
    are `fields`, else a namedtuple of that name and fields (nothing is imported)."""
    module_name, _, qualname = name.partition(":")
    found: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if isinstance(found, type) and issubclass(found, tuple) and getattr(
            found, "_fields", None) == fields:
        return found
    short = qualname.rpartition(".")[2]
    return collections.namedtuple(short if short.isidentifier() else "Record", fields,
                                  rename=True)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_record(rows: Any, where: str) -> list[Row]:
    """`rows` if it is a well-formed record (each row, its kind and path checked), else
    CorruptIndexError naming the row.

    Args:
        rows: the manifest's ``shardkit.structure`` value.
        where: the checkpoint, for error messages.
    Returns:
        `rows`.
    Raises:
        CorruptIndexError: a row is malformed, or the rows do not form one tree.
    """
    if not isinstance(rows, list) or not rows:
        raise CorruptIndexError(f"{where}: shardkit.structure must be a non-empty list of rows")
    if _row_path(rows[0], where) != [] or rows[0][1] not in _CONTAINERS:
        raise CorruptIndexError(f"{where}: shardkit.structure must start with the root "
                                "container, [[], kind]")
    _, end = _build(rows, 0, [], _AnyValue(), where, 0)
    if end != len(rows):
        raise CorruptIndexError(f"{where}: shardkit.structure row {_shown(rows[end])} is "
                                "outside the root's tree")
    return rows


class _AnyValue(dict):  # type: ignore[type-arg]
    """A stand-in for the loaded tensors when a record is only checked."""

    def __getitem__(self, key: Any) -> Any:
        return np.zeros((), np.float64)


def nested_state(rows: list[Row] | None, values: Mapping[str, Any], where: str,
                 prefix: str | None = None) -> Any:
    """`load(..., nested=True)`'s result: the state `rows` records (`rebuild`), or, for a
    checkpoint without a record (or a prefix inside a key of its), `values` unflattened into
    nested dicts."""
    if rows is not None:
        try:
            return rebuild(rows, values, where, None if prefix is None else prefix.rstrip("/"))
        except KeyError:
            if prefix is None:
                raise
    return unflatten(values)
