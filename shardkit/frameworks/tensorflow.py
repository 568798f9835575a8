"""TensorFlow values in and out: tf.Tensor / tf.Variable <-> host numpy arrays, TensorFlow
objects (tf.Module, Keras models and optimizers, tf.train.Checkpoint) flattened to the keys
TensorFlow's own checkpoints use, and ``load(..., framework="tensorflow")``.

Imported only when a TensorFlow value is passed (`frameworks.loaded` checks ``sys.modules``
first) or asked for, so ``import shardkit`` never imports TensorFlow.

Host views: ``Tensor.numpy()`` of an eager CPU tensor shares the tensor's buffer (no copy);
a variable's value is read once (``read_value``, which TensorFlow may copy). bfloat16 comes
back as ml_dtypes.bfloat16, which TensorFlow uses itself. Object flattening goes through
TensorFlow's own machinery (`ObjectGraphView` + `save_util.serialize_graph_view`), which also
gives the ``_CHECKPOINTABLE_OBJECT_GRAPH`` proto stored as a string tensor, as TensorFlow does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import tensorflow as tf  # type: ignore[import-untyped]
from tensorflow.python.eager import context, execute  # type: ignore[import-untyped]
from tensorflow.python.framework import ops  # type: ignore[import-untyped]
from tensorflow.python.framework.ops import EagerTensor  # type: ignore[import-untyped]
from tensorflow.python.ops import (  # type: ignore[import-untyped]
    gen_resource_variable_ops,
    resource_variable_ops,
)

from .._threads import WorkerPool, usable_cores
from ..errors import InvalidArgumentError, RestoreMismatchError, UnsupportedDTypeError
from ..values.devices import DeviceSpec
from ..values.dtypes import framework_dtypes
from . import gc_paused

_TO_NUMPY = framework_dtypes(tf)  # the storable TensorFlow dtypes -> numpy's
_STORABLE_ENUMS = frozenset(d.as_datatype_enum for d in _TO_NUMPY)
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
"""The key of the TrackableObjectGraph proto in a TensorFlow object-based checkpoint."""
SAVE_COUNTER_KEY = "save_counter/.ATTRIBUTES/VARIABLE_VALUE"  # tf.train.Checkpoint's counter
_CPU = "/job:localhost/replica:0/task:0/device:CPU:0"


def owns(value: Any) -> bool:
    """A tf.Tensor (eager) or a tf.Variable."""
    return isinstance(value, (tf.Tensor, tf.Variable))


def tf_is_string(value: Any) -> bool:
    return bool(value.dtype == tf.string)


_DEVICES: dict[str, DeviceSpec] = {}  # device string -> parsed (a few distinct strings)


def _device(value: Any) -> DeviceSpec:
    name = getattr(value, "device", "") or _CPU
    got = _DEVICES.get(name)
    if got is None:
        try:
            got = DeviceSpec.from_string(name)
        except Exception:  # an unusual device string: the default place
            got = DeviceSpec.from_string(_CPU)
        if len(_DEVICES) < 4096:
            _DEVICES[name] = got
    return got


def _host_array(value: Any) -> np.ndarray:
    """The value of a tensor or variable as a host array: for an eager CPU tensor a view of
    its buffer (``Tensor._numpy``; ``numpy()`` would copy), for a resource variable one read
    (``ReadVariableOp``, cheaper than ``Variable.numpy()``). The view is never written to:
    TensorFlow's copy-on-write keeps it valid when the variable is assigned later."""
    if isinstance(value, resource_variable_ops.BaseResourceVariable):
        value = gen_resource_variable_ops.read_variable_op(value.handle, value.dtype)
    elif isinstance(value, tf.Variable):
        value = value.value()
    numpy = getattr(value, "_numpy", None)
    array = numpy() if numpy is not None else value.numpy()
    return array if isinstance(array, np.ndarray) else np.asarray(array)


_PLAIN_VARIABLE_TYPES = frozenset({resource_variable_ops.ResourceVariable})
"""Variable types (exact) whose ``_dtype`` and ``_handle.device`` are what the ``dtype`` and
``device`` properties return (reading the properties costs more, per variable)."""

READ_BATCH = 1000  # variables read by one _ReadVariablesOp (TensorFlow caches its kernel per
# count and dtypes, so equal batches of one dtype reuse one kernel)


def host_arrays(values: list[Any], keys: list[str], strings: bool = False
                ) -> list[tuple[np.ndarray, DeviceSpec] | None]:
    """`to_host` of many tensors and variables (`keys` name them in errors); None for a
    tf.string value when `strings` (the caller stores it apart), else it is refused. Resource
    variables are read in batches, by device and dtype, with TensorFlow's ``_ReadVariablesOp``
    (one op for up to READ_BATCH variables, instead of one ReadVariableOp each); should that
    op fail, each is read alone. TensorFlow builds the op's kernel once per set of variable
    shapes, so the first save in a process pays for it (as single reads of fresh variables
    do)."""
    out: list[Any] = [None] * len(values)
    groups: dict[tuple[str, Any], list[int]] = {}
    base = resource_variable_ops.BaseResourceVariable
    storable = _STORABLE_ENUMS
    plain = _PLAIN_VARIABLE_TYPES
    for i, (value, key) in enumerate(zip(values, keys)):
        if type(value) in plain:  # the common case, without properties and isinstance
            dtype = value._dtype
            if dtype._type_enum in storable:
                group = (value._handle.device, dtype)
                rows = groups.get(group)
                if rows is None:
                    groups[group] = [i]
                else:
                    rows.append(i)
                continue
        dtype = value.dtype
        if dtype._type_enum not in storable:
            if strings and dtype == tf.string:
                continue
            try:
                to_host(value)
            except UnsupportedDTypeError as e:
                raise UnsupportedDTypeError(f"{key!r}: {e}") from None
        if type(value) is not tf.Tensor and isinstance(value, base):
            groups.setdefault((value.device, dtype), []).append(i)
        else:
            out[i] = (_host_array(value), _device(value))
    parts, jobs = [], []
    for (device, dtype), rows in groups.items():
        spec = _device(values[rows[0]])
        for at in range(0, len(rows), READ_BATCH):
            parts.append((rows[at : at + READ_BATCH], spec))
            jobs.append(([values[i] for i in parts[-1][0]], dtype, device))
    for (part, spec), arrays in zip(parts, _in_parallel(_read_batch, jobs)):
        for i, array in zip(part, arrays):
            out[i] = (array, spec)
    return out


_POOL: list[WorkerPool] = []  # made on first use
TF_THREADS = min(4, len(usable_cores()))
"""Threads issuing batches of TensorFlow ops (reads, assigns): TensorFlow's executor runs
each op without the GIL, so batches on two cores overlap. Sized from the cores the process
may use (as a collective save's writers are), not from how busy they were recently."""


def _in_parallel(fn: Callable[[Any], Any], jobs: list[Any]) -> list[Any]:
    """``[fn(job) for job in jobs]``, on TF_THREADS threads when there are several jobs (each
    a batch of up to READ_BATCH variables) and the process may use several cores."""
    if len(jobs) < 2 or TF_THREADS < 2:
        return [fn(job) for job in jobs]
    if not _POOL:
        _POOL.append(WorkerPool(TF_THREADS, "shardkit-tf"))
    futures = [_POOL[0].submit(fn, job) for job in jobs]
    return [f.result() for f in futures]


def _read_batch(job: tuple[list[Any], Any, str]) -> list[np.ndarray]:
    """The variables of `job` (variables, dtype, device) read by one _ReadVariablesOp."""
    variables, dtype, device = job
    try:
        with tf.device(device):
            tensors = execute.execute(
                b"_ReadVariablesOp", len(variables), inputs=[v.handle for v in variables],
                attrs=("N", len(variables), "dtypes", [dtype.as_datatype_enum] * len(variables)),
                ctx=context.context())
    except Exception:  # not in this TensorFlow, or not on this device: one read each
        return [_host_array(v) for v in variables]
    arrays = [t._numpy() for t in tensors]
    ndarray = np.ndarray
    return arrays if all(type(a) is ndarray for a in arrays) else list(map(_as_array, arrays))


def _as_array(x: Any) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else np.asarray(x)


def to_host(value: Any) -> tuple[np.ndarray, DeviceSpec]:
    """A host numpy array of `value` and the device it lives on (`_host_array`)."""
    dtype = value.dtype
    if dtype == tf.string:
        raise UnsupportedDTypeError("a tf.string tensor is a string tensor, not an array")
    if dtype in (tf.resource, tf.variant):
        raise UnsupportedDTypeError(f"TensorFlow dtype {dtype.name} cannot be stored")
    return _host_array(value), _device(value)


def string_to_host(value: Any) -> tuple[np.ndarray, DeviceSpec]:
    """A tf.string tensor or variable as an object array of bytes (TensorFlow's form)."""
    return host_copy(value), _device(value)  # a copy: object arrays of bytes are built anyway


def host_copy(value: Any) -> np.ndarray:
    """``value.numpy()`` as an array (a scalar string, bytes, in a 0-d object array)."""
    array = value.numpy()
    if not isinstance(array, np.ndarray):
        boxed = np.empty((), object)
        boxed[()] = array
        array = boxed
    return array


def host_dtype(dtype: Any) -> np.dtype:
    """The numpy (ml_dtypes) dtype of a TensorFlow dtype or its name (object for tf.string)."""
    dtype = tf.as_dtype(dtype)
    got = _TO_NUMPY.get(dtype)
    if got is not None:
        return got
    return np.dtype(object) if dtype == tf.string else np.dtype(dtype.as_numpy_dtype)


# --- objects ---------------------------------------------------------------------------------


_NOT_TRACKABLE = frozenset({np.ndarray, EagerTensor})


def _trackable_base() -> type:
    from tensorflow.python.trackable import base  # type: ignore[import-untyped]

    return base.Trackable  # type: ignore[no-any-return]


def is_trackable(obj: Any) -> bool:
    """A TensorFlow object with checkpointed state of its own (tf.Module, Keras layer / model /
    optimizer, tf.train.Checkpoint...), not a single variable."""
    if type(obj) in _PLAIN_VARIABLE_TYPES or type(obj) in _NOT_TRACKABLE:
        return False  # a state of 50,000 variables or arrays: no isinstance chain each
    return (isinstance(obj, _trackable_base()) and not isinstance(obj, tf.Variable)
            and not _assignable(obj))


def serialize(root: Any, owners: dict[str, Any] | None = None) -> tuple[dict[str, Any], bytes]:
    """TensorFlow's checkpoint keys of everything `root` tracks -> their tf values (a dict of
    slice spec -> value for a sliced variable), and the TrackableObjectGraph proto's bytes:
    what ``tf.train.Checkpoint(root=root).write`` stores, without writing. `owners`, when
    given, receives key -> the object the value came from (a variable, for in-place restore)."""
    from tensorflow.python.checkpoint import graph_view, save_util  # type: ignore[import-untyped]

    view = graph_view.ObjectGraphView(root)
    serialized, _, registered, proto = save_util.serialize_graph_view(view)
    if registered:
        raise InvalidArgumentError(
            "an object in this state uses a registered TensorFlow saver "
            f"({', '.join(sorted(map(str, registered)))}); shardkit cannot store it")
    out: dict[str, Any] = {}
    for owner, tensors in serialized.items():
        for key, value in tensors.items():
            if owners is not None:
                owners[key] = owner
            if isinstance(value, Mapping):
                value = dict(value)
                if list(value) == [""]:  # one "slice" that is the whole tensor
                    value = value[""]
            out[key] = value
    return out, proto.SerializeToString()


def _leaf(value: Any) -> Any:
    """What a serialized value becomes in the flat state: tf values as they are (the caller's
    host conversion runs later), SaveSpec-like callables called, sliced values refused."""
    from tensorflow.python.training.saving import saveable_object  # type: ignore[import-untyped]

    if isinstance(value, saveable_object.SaveSpec):  # e.g. a variable's read, deferred
        value = value.tensor
    if isinstance(value, dict):
        raise InvalidArgumentError(
            "a partitioned (sliced) TensorFlow variable cannot be saved as state yet; save "
            "its full value")
    return value


def expand(state: Any, owners: dict[str, Any] | None = None) -> Any:
    """`state` with TensorFlow objects replaced by their tensors under TensorFlow's keys.

    - A trackable passed as the whole state is the root: keys as ``tf.train.Checkpoint(root=
      obj)`` writes them (``layer_with_weights-0/kernel/.ATTRIBUTES/VARIABLE_VALUE``).
    - In a mapping, the top-level values that are trackables are the children of one
      ``tf.train.Checkpoint(**those)`` root, so the keys are those of
      ``tf.train.Checkpoint(model=m).write`` (``model/layer_with_weights-0/...``); the other
      values stay as they are, under their own keys.

    The object graph goes under ``_CHECKPOINTABLE_OBJECT_GRAPH`` as a string tensor (bytes).
    A state without TensorFlow objects is returned as it is.
    """
    if is_trackable(state):
        flat, graph = serialize(state, owners)
    elif isinstance(state, Mapping):
        objects = {k: v for k, v in state.items() if is_trackable(v)}
        if not objects:
            return state
        clash = [k for k in objects if not isinstance(k, str)]
        if clash:
            raise InvalidArgumentError(f"TensorFlow object under key {clash[0]!r}: keys of "
                                       "TensorFlow objects must be str")
        flat, graph = serialize(tf.train.Checkpoint(**objects), owners)
        rest = {k: v for k, v in state.items() if k not in objects}
        for k in rest:
            if isinstance(k, str) and (k in flat or any(f.startswith(k + "/") for f in flat)):
                raise InvalidArgumentError(
                    f"state key {k!r} collides with a TensorFlow object's checkpoint key")
        flat = {**flat, **rest}  # TensorFlow's keys first (sorted by TF), then the others
    else:
        return state
    out = {k: _leaf(v) for k, v in flat.items()}
    graph_array = np.empty((), object)
    graph_array[()] = graph
    out[OBJECT_GRAPH_KEY] = graph_array
    return out


def object_variables(obj: Any) -> dict[str, Any]:
    """The state of one trackable as ``{TensorFlow key relative to obj: its variable}`` (the
    value itself when it has no variable), without the object graph (for `shardkit.Checkpoint`)."""
    owners: dict[str, Any] = {}
    flat, _ = serialize(obj, owners)
    return {k: owners[k] if _assignable(owners.get(k)) else _leaf(v) for k, v in flat.items()}


def checkpoint_root(objects: dict[str, Any]) -> Any:
    """``tf.train.Checkpoint(**objects)`` with its save counter created, as its ``save`` and
    ``restore`` create it (lazily, on first use): the root of a TensorFlow-format save."""
    root = tf.train.Checkpoint(**objects)
    root._maybe_create_save_counter()
    return root


def create_save_counter(state: Any, keys: Any) -> None:
    """Create the save counter of a ``tf.train.Checkpoint`` restore target when the checkpoint
    (whose keys are `keys`) holds one, as ``tf.train.Checkpoint.restore`` does: TensorFlow
    creates it lazily, so a fresh root has none yet."""
    if isinstance(state, tf.train.Checkpoint) and SAVE_COUNTER_KEY in keys:
        state._maybe_create_save_counter()


def objects_only(state: Any) -> bool:
    """Whether `state` is a TensorFlow object, or a mapping of nothing else (a root
    TensorFlow's own restore can take)."""
    if is_trackable(state):
        return True
    return isinstance(state, Mapping) and bool(state) and all(
        isinstance(k, str) and is_trackable(v) for k, v in state.items())


def is_variable(obj: Any) -> bool:
    """A tf.Variable or a Keras variable (restored in place with ``assign``)."""
    return isinstance(obj, tf.Variable) or (isinstance(obj, _trackable_base())
                                            and _assignable(obj))


def _assignable(obj: Any) -> bool:
    """A variable (tf.Variable or a Keras variable): has a shape, a dtype and ``assign``."""
    return obj is not None and callable(getattr(obj, "assign", None)) and hasattr(obj, "shape")


# --- values out ------------------------------------------------------------------------------


def converter(device: Any = None) -> Any:
    """The array -> tf.Tensor function (``load(..., framework="tensorflow")``) on `device`
    (None: TensorFlow's default placement, or a device string such as "/CPU:0")."""
    if device is not None and not isinstance(device, str):
        raise InvalidArgumentError(
            f"device must be a TensorFlow device string for framework='tensorflow', got "
            f"{type(device).__name__}")
    if device is not None:
        try:
            tf.DeviceSpec.from_string(device)
            with tf.device(device):
                pass
        except (ValueError, TypeError, RuntimeError) as e:
            raise InvalidArgumentError(f"device={device!r} is not a TensorFlow device: {e}"
                                       ) from e

    def to_tf(array: np.ndarray, key: str = "") -> Any:
        with tf.device(device):
            return tf.identity(from_host(array))

    return from_host if device is None else to_tf


def from_host(array: np.ndarray, key: str = "") -> Any:
    """A tf.Tensor of `array` (TensorFlow's default placement; TensorFlow shares aligned numpy
    memory when it can); an object array (of bytes) as tf.string."""
    if array.dtype.kind == "O":
        return tf.constant(array, tf.string)
    return tf.convert_to_tensor(array)


def new_like(array: np.ndarray, like: Any) -> Any:
    return from_host(array)


# --- restoring into variables --------------------------------------------------------------


def restore_target(leaf: Any, key: str) -> tuple[np.ndarray, Any] | None:
    """For a tf.Variable leaf: a read-only stand-in of its shape and dtype (no memory: the
    restore checks it, then assigns the stored array straight into the variable, in place, the
    variable keeping its identity) and that assign function; None for other leaves. A
    tf.Tensor is immutable: RestoreMismatchError."""
    if type(leaf) in _PLAIN_VARIABLE_TYPES and leaf._dtype._type_enum in _STORABLE_ENUMS:
        return _stand_in(leaf._dtype, tuple(leaf._shape)), Assign(leaf)  # no properties
    if is_variable(leaf):
        if tf.as_dtype(leaf.dtype) == tf.string:
            return None
        return _stand_in(leaf.dtype, tuple(leaf.shape)), Assign(leaf)
    if isinstance(leaf, tf.Tensor):
        raise RestoreMismatchError(
            f"cannot restore key {key!r} in place into a tf.Tensor: tensors are immutable; "
            "pass a tf.Variable (or use load(..., framework='tensorflow'))")
    return None


_STAND_INS: dict[tuple[Any, tuple[int, ...]], np.ndarray] = {}


def _stand_in(dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only zero-stride array of `shape` and `dtype` (shared: nobody writes to it)."""
    got = _STAND_INS.get((dtype, shape))
    if got is None:
        if len(_STAND_INS) >= 1 << 16:
            _STAND_INS.clear()
        got = _STAND_INS[(dtype, shape)] = np.broadcast_to(
            np.zeros((), host_dtype(dtype)), shape)
    return got


class Assign:
    """The in-place assign of one variable; `assign_all` runs many of them in one batch."""

    __slots__ = ("variable",)

    def __init__(self, variable: Any) -> None:
        self.variable = variable

    def __call__(self, host: np.ndarray) -> None:
        assign_all([(self, host)])


def assign_all(pairs: list[tuple[Any, np.ndarray]]) -> None:
    """Run each ``(assign, host array)``: `Assign`s of plain resource variables as one eager
    ``AssignVariableOp`` each, issued straight to TensorFlow's executor (skipping
    ``Variable.assign``'s Python checks, which restore has done already: same shape, same
    dtype); the rest (Keras and other variable types, other callables) through their own
    ``assign``. The variables stay the same objects."""
    plain = _PLAIN_VARIABLE_TYPES
    by_device: dict[str, list[tuple[Any, np.ndarray]]] = {}
    for fn, host in pairs:
        variable = fn.variable if type(fn) is Assign else None
        if variable is None:
            fn(host)
        elif type(variable) not in plain:
            variable.assign(host)
        else:
            by_device.setdefault(variable._handle.device, []).append((variable, host))
    jobs = [(device, group[at : at + READ_BATCH]) for device, group in by_device.items()
            for at in range(0, len(group), READ_BATCH)]
    with gc_paused():  # a small tensor per variable: no cyclic GC passes over TensorFlow's heap
        _in_parallel(_assign_job, jobs)


def _assign_job(job: tuple[str, list[tuple[Any, np.ndarray]]]) -> None:
    device, pairs = job
    ctx = context.context()
    ctx.ensure_initialized()
    attrs: dict[Any, tuple[Any, ...]] = {}  # per dtype
    tensor = EagerTensor  # from the host array: what convert_to_tensor does, minus dispatch
    run = execute.execute
    with ops.device(device):
        name = ctx.device_name
        for variable, host in pairs:
            dtype = variable._dtype
            got = attrs.get(dtype)
            if got is None:
                got = attrs[dtype] = ("dtype", dtype.as_datatype_enum, "validate_shape", False)
            run(b"AssignVariableOp", 0, inputs=[variable._handle, tensor(host, name, got[1])],
                attrs=got, ctx=ctx)


def copy_into(variable: Any, array: np.ndarray) -> None:
    variable.assign(array)  # in place: the variable keeps its identity


def string_assign(leaf: Any) -> Any:
    """``leaf.assign`` for a tf.string variable, else None."""
    if _assignable(leaf) and tf.as_dtype(leaf.dtype) == tf.string:
        return leaf.assign
    return None


def expand_targets(state: Any) -> Any:
    """`expand` for restore targets: the same keys, the variables themselves as leaves (no
    object graph; it is checkpoint data, not a target)."""
    owners: dict[str, Any] = {}
    expanded = expand(state, owners)
    if expanded is state:
        return state
    out = {k: owners[k] if _assignable(owners.get(k)) else v for k, v in expanded.items()}
    out.pop(OBJECT_GRAPH_KEY, None)
    return out
