"""ShardableTensor, and turning a nested state (dicts of arrays) into ShardableTensors.

Framework tensors become host numpy views through `shardkit.frameworks.to_host` (without a copy
where the framework allows it; device tensors are copied to the host). No framework is imported
here; a tensor of one can only exist if the caller already imported it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np

from .._kernels import _table
from ..errors import (
    InvalidArgumentTypeError,
    InvalidKeyError,
    InvalidKeyTypeError,
    UnsupportedDTypeError,
)
from ..frameworks import gc_paused, kind_of, memory_key, module, string_to_host, to_host
from ..values.devices import DeviceSpec
from ..values.dtypes import nbytes as dtype_nbytes
from ..values.dtypes import packed_name, packed_problem, storable, stored_nbytes
from ..values.keys import check_keys, key_problem
from ..values.sharing import shared_rows
from ..values.slices import WHOLE

SEPARATOR = "/"
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
"""Where TensorFlow (and shardkit, for TensorFlow objects) stores the object graph proto."""
DEFAULT_DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"


@dataclass(frozen=True, slots=True)
class TensorSaveSpec:
    """What TensorFlow callbacks read as ``shardable_tensor.tensor_save_spec``."""

    tensor: np.ndarray
    name: str
    slice_spec: str
    dtype: np.dtype
    device: DeviceSpec


@dataclass(frozen=True, slots=True)
class ShardableTensor:
    """One tensor (or one slice of a tensor) handed to a sharding callback.

    `tensor` is a host numpy array (ml_dtypes for bfloat16 / float8); `shape` is the shape of
    `tensor`; `slice_spec` is ``""`` for a whole tensor.
    """

    tensor: np.ndarray
    dtype: np.dtype
    device: DeviceSpec
    name: str
    shape: tuple[int, ...]
    slice_spec: str
    checkpoint_key: str

    @property
    def tensor_save_spec(self) -> TensorSaveSpec:
        """The same tensor as TensorFlow's callbacks read it (`TensorSaveSpec`)."""
        return TensorSaveSpec(self.tensor, self.name, self.slice_spec, self.dtype, self.device)

    @property
    def task(self) -> int:
        """The device task, 0 when the device names none."""
        return self.device.task or 0

    @property
    def nbytes(self) -> int:
        """The bytes of `tensor` where it is stored (half its array's for float4_e2m1fn)."""
        return stored_nbytes(self.tensor)


DeviceArg = str | DeviceSpec | Callable[[str], "str | DeviceSpec"] | None


def shardable_tensors(state: Mapping[str, Any], device: DeviceArg = None,
                      strings: Any = None, aliases: dict[str, str] | None = None
                      ) -> list[ShardableTensor]:
    """Flatten `state` into ShardableTensors, one per leaf, keys joined with ``/``.

    Args:
        state: nested dicts / lists of arrays.
        device: overrides every tensor's device: a device string, a DeviceSpec, or a callable
            from checkpoint key to either (default: where it lives; task 0, CPU for numpy).
        strings: a `values.strings.StringColumns` that takes the string tensors (numpy bytes /
            str / object arrays, tf.string) out of the result; without it they are refused.
        aliases: when given, a tensor that is exactly the memory of an earlier one (tied
            weights: `values.sharing`) is left out of the result and recorded here, its key
            -> the earlier one's.
    Returns:
        The ShardableTensors, in the state's order.
    Raises:
        InvalidKeyError: a key breaks a rule (InvalidKeyTypeError: not a str or int).
        UnsupportedDTypeError: a value that cannot be a tensor.
        InvalidArgumentTypeError, DeviceSpecError: a `device` that is not a device.
    """
    with gc_paused():
        c = host_columns(state, device, strings, aliases)
        return list(map(_new_shardable, c.arrays, c.dtypes, c.devices, c.keys, c.shapes,
                        repeat(WHOLE), c.keys))


class HostColumns(NamedTuple):
    """The leaves of a state, column-wise, as host arrays: key, array, device, and the
    array's dtype, size in bytes and shape; and the distinct device objects among `devices`
    (by identity, in order of first use)."""

    keys: list[str]
    arrays: list[np.ndarray]
    devices: list[DeviceSpec]
    dtypes: list[np.dtype]
    nbytes: np.ndarray
    shapes: list[tuple[int, ...]]
    distinct_devices: list[DeviceSpec]


def host_columns(state: Mapping[str, Any], device: DeviceArg = None,
                 strings: Any = None, aliases: dict[str, str] | None = None) -> HostColumns:
    """`shardable_tensors` column-wise, without building a ShardableTensor each (the default
    policy does not need them); `strings` and `aliases` as there."""
    default = DeviceSpec.from_string(DEFAULT_DEVICE)
    fixed = None if device is None or callable(device) else _as_device(device)
    keys, arrays = flatten_columns(state)
    devices: list[DeviceSpec] = [default] * len(keys)
    moved = False  # a leaf came from a device of its own
    stored = storable()  # the set itself: it gains ml_dtypes' dtypes when they are imported
    described = _table.describe_arrays(arrays, stored)  # one pass over plain numpy leaves
    if described is None:  # framework tensors, other types or byte orders: convert those
        ndarray = np.ndarray
        taken: list[int] = []
        tf_rows: list[int] = []  # TensorFlow values: converted in one batch
        first_of: dict[tuple[Any, ...], int] = {}  # `memory_key` -> its first row
        again: dict[int, int] = {}  # a row holding the memory of an earlier row (`memory_key`)
        for i, (key, value) in enumerate(zip(keys, list(arrays))):
            if not (type(value) is ndarray and value.dtype in stored):
                same = None if aliases is None else memory_key(value)
                if same is not None:  # one memory, on any device: converted once
                    j = first_of.setdefault(same, i)
                    if j != i:
                        again[i] = j
                        continue
                if kind_of(value) == "tensorflow":  # strings among them too: sorted in the batch
                    tf_rows.append(i)
                    continue
                if strings is not None and _string_leaf(value, key, strings, device):
                    taken.append(i)
                    continue
                arrays[i], dev = to_host(value, key)
                if dev is not None:
                    devices[i] = dev
                    moved = True
        if tf_rows:
            hosts = module("tensorflow").host_arrays(
                [arrays[i] for i in tf_rows], [keys[i] for i in tf_rows],
                strings=strings is not None)
            for i, got in zip(tf_rows, hosts):
                if got is None:  # a tf.string value
                    _string_leaf(arrays[i], keys[i], strings, device)
                    taken.append(i)
                else:
                    arrays[i], devices[i] = got
            taken.sort()
            moved = True
        if again:  # the host array of the first row: `shared_rows` below finds them
            firsts_taken = set(taken).intersection(again.values())
            for i, j in again.items():
                if j in firsts_taken:  # a string tensor: to the string file, as the first
                    _string_leaf(arrays[i], keys[i], strings, device)
                    taken.append(i)
                else:
                    arrays[i], devices[i] = arrays[j], devices[j]
            taken.sort()
        if taken:  # string tensors went to `strings`: the columns without them
            gone = set(taken)
            keep = [i for i in range(len(keys)) if i not in gone]
            keys = [keys[i] for i in keep]
            arrays = [arrays[i] for i in keep]
            devices = [devices[i] for i in keep]
        described = _table.describe_arrays(arrays, storable()) or (
            list(map(_dtype_of, arrays)), _table.array_nbytes(arrays),
            list(map(_shape_of, arrays)))
    if aliases is not None:
        shared = shared_rows(arrays)
        if shared:
            aliases.update((keys[i], keys[j]) for i, j in shared.items())
            keep = [i for i in range(len(keys)) if i not in shared]
            dtypes, nbytes, shapes = described
            keys = [keys[i] for i in keep]
            arrays = [arrays[i] for i in keep]
            devices = [devices[i] for i in keep]
            described = [dtypes[i] for i in keep], nbytes[keep], [shapes[i] for i in keep]
    described = _packed_sizes(keys, *described)
    if fixed is not None:
        devices = [fixed] * len(keys)
    elif device is not None:
        devices = [_as_device(device(key)) for key in keys]  # type: ignore[operator]
    if fixed is not None or (device is None and not moved):
        distinct = devices[:1]  # all the same object
    else:
        distinct = list(dict(zip(map(id, devices), devices)).values())
    return HostColumns(keys, arrays, devices, *described, distinct)


_dtype_of = operator.attrgetter("dtype")
_shape_of = operator.attrgetter("shape")


def _packed_sizes(keys: list[str], dtypes: list[np.dtype], nbytes: np.ndarray,
                  shapes: list[tuple[int, ...]]
                  ) -> tuple[list[np.dtype], np.ndarray, list[tuple[int, ...]]]:
    """The columns with the stored size of tensors of a `PACKED` dtype (float4_e2m1fn: two
    elements a byte, half their arrays' bytes); UnsupportedDTypeError naming the key of one
    with an odd element count, which has no whole number of bytes."""
    names = {d: name for d in set(dtypes) if (name := packed_name(d)) is not None}
    if not names:
        return dtypes, nbytes, shapes
    nbytes = nbytes.copy()
    for i, dt in enumerate(dtypes):
        name = names.get(dt)
        if name is not None:
            problem = packed_problem(name, shapes[i])
            if problem:
                raise UnsupportedDTypeError(f"{keys[i]!r}{problem}")
            nbytes[i] = dtype_nbytes(name, shapes[i])
    return dtypes, nbytes, shapes


def _string_leaf(value: Any, key: str, strings: Any, device: DeviceArg) -> bool:
    """Put `value` in `strings` if it is a string tensor; whether it was one."""
    got = string_to_host(value)
    if got is None:
        return False
    array, dev = got
    if device is not None:
        dev = _as_device(device(key) if callable(device) else device)
    strings.add(key, np.asarray(array), (dev.to_string() if dev is not None
                                         else DEFAULT_DEVICE))
    return True


def fast_constructor(cls: type) -> Callable[..., Any]:
    """Build a frozen-slots-dataclass instance without its __init__ (same result, less work).

    Frozen dataclasses set each field through object.__setattr__; calling the slot descriptors
    directly skips that lookup. The source is generated so the loop over fields is unrolled.
    """
    names = cls.__slots__  # type: ignore[attr-defined]
    env = {f"set_{n}": getattr(cls, n).__set__ for n in names}
    env.update(cls=cls, new=object.__new__)
    body = "".join(f"    set_{n}(obj, {n})\n" for n in names)
    exec(f"def make({', '.join(names)}):\n    obj = new(cls)\n{body}    return obj\n", env)
    return env["make"]


def columns_constructor(cls: type) -> Callable[..., list[Any]]:
    """Build many frozen-slots-dataclass instances from columns (one iterable per field, in
    field order, all of the same length); less work again than `fast_constructor`.

    Every loop is a C-level ``map`` over the slot descriptors' setters, no Python frame per item.
    """
    names: tuple[str, ...] = cls.__slots__  # type: ignore[attr-defined]
    setters = [getattr(cls, n).__set__ for n in names]
    new = object.__new__

    def make_many(*columns: Any) -> list[Any]:
        cols = [c if isinstance(c, (list, tuple)) else list(c) for c in columns]
        if len(cols) != len(setters) or len({len(c) for c in cols}) > 1:
            raise ValueError(f"{cls.__name__}: need {len(setters)} columns of one length")
        objs: list[Any] = list(map(new, repeat(cls, len(cols[0]) if cols else 0)))
        for set_field, col in zip(setters, cols):
            any(map(set_field, objs, col))  # every __set__ returns None: consumes the map
        return objs

    return make_many


_new_shardable = fast_constructor(ShardableTensor)


def _as_device(device: str | DeviceSpec) -> DeviceSpec:
    return device if isinstance(device, DeviceSpec) else DeviceSpec.from_string(device)


def flatten_columns(state: Mapping[str, Any]) -> tuple[list[str], list[Any]]:
    """`flatten` as two lists, joined keys and leaves; native for plain dicts, lists and
    tuples. The keys are checked (shardkit.values.keys): InvalidKeyError names the offending key and
    where in `state` it came from, for either walk alike."""
    got = _table.flatten_plain(state, SEPARATOR)
    if got is None:
        leaves = flatten(state)
        got = [k for k, _ in leaves], [v for _, v in leaves]
    keys = got[0]
    if key_problem(keys) is not None:  # a few set operations; the wording only on failure
        paths: list[tuple[str | int, ...]] = []
        check_keys(keys, origin=lambda i: state_path(_leaf_paths(state, paths)[i]))
    return got


def state_path(path: tuple[str | int, ...]) -> str:
    """How a caller spells the leaf at `path` (``state['a'][0]``)."""
    return "state" + "".join(f"[{k!r}]" for k in path)


def _leaf_paths(state: Mapping[str, Any], cache: list[tuple[str | int, ...]]
                ) -> list[tuple[str | int, ...]]:
    """The path (the keys as given, str or int) of every leaf, in `flatten`'s order."""
    if not cache:
        flatten(state, paths=cache)
    return cache


def flatten(state: Mapping[str, Any], prefix: str = "",
            paths: list[tuple[str | int, ...]] | None = None) -> list[tuple[str, Any]]:
    """``(joined_key, leaf)`` pairs depth-first; lists and tuples are indexed ``0, 1, ...``.

    Keys are str or int (not bool); a subclass of either is stored as its value (``str.__str__``
    / decimal digits), whatever its own ``__str__`` says. Another key type raises
    InvalidKeyTypeError naming its place in `state`. `paths`, when given, receives each leaf's
    path (its keys as str or int)."""
    out: list[tuple[str, Any]] = []
    append = out.append
    ndarray = np.ndarray
    stack: list[tuple[str, Iterator[tuple[Any, Any]], tuple[str | int, ...]]] = [
        (prefix, _items(state, prefix or "<root>"), ())]
    while stack:
        base, items, path = stack.pop()
        for k, v in items:
            part = k
            if type(k) is not str:
                part = _key_part(k, path)
                k = part if type(part) is str else str(part)
            key = base + k
            tv = type(v)
            if tv is ndarray or not (tv is dict or isinstance(v, (Mapping, list, tuple))):
                append((key, v))
                if paths is not None:
                    paths.append((*path, part))
            else:
                # Depth-first in insertion order: park the rest of this level, descend.
                stack.append((base, items, path))
                stack.append((key + SEPARATOR, _items(v, key), (*path, part)))
                break
    return out


def _key_part(k: Any, path: tuple[str | int, ...]) -> str | int:
    """`k` as the str or int a reader sees, or InvalidKeyTypeError."""
    if type(k) is str or type(k) is int:
        return k
    if isinstance(k, str):
        return str.__str__(k)
    if isinstance(k, int) and not isinstance(k, bool):
        return int(int.__repr__(k))
    raise InvalidKeyTypeError(
        f"state key {k!r} at {state_path((*path, k))} is not a str or int (it is a "
        f"{type(k).__name__}); checkpoint keys are strings, and list indices and int keys are "
        "stored as their decimal digits"
    )


def _items(node: Any, where: str) -> Iterator[tuple[Any, Any]]:
    if isinstance(node, Mapping):
        return iter(node.items())
    if isinstance(node, (list, tuple)):
        return iter(enumerate(node))
    raise InvalidArgumentTypeError(
        f"state at {where!r} must be a mapping of arrays, got {type(node).__name__}")


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Rebuild nested dicts from ``/``-joined keys (the inverse of flatten, lists become dicts).

    A key that is a tensor and also the prefix of another key (``a`` and ``a/b``, which a
    checkpoint may hold) cannot be nested: InvalidKeyError names both."""
    root: dict[str, Any] = {}
    for key, value in flat.items():
        node = root
        *parents, leaf = key.split(SEPARATOR)
        for depth, p in enumerate(parents):
            node = node.setdefault(p, {})
            if type(node) is not dict:
                prefix = SEPARATOR.join(parents[: depth + 1])
                raise InvalidKeyError(
                    f"cannot nest key {key!r}: {prefix!r} is a tensor and also the prefix of "
                    f"{key!r}; use the flat dict")
        if type(node.get(leaf)) is dict:
            other = next(k for k in flat if k.startswith(key + SEPARATOR))
            raise InvalidKeyError(
                f"cannot nest key {other!r}: {key!r} is a tensor and also the prefix of "
                f"{other!r}; use the flat dict")
        node[leaf] = value
    return root
