"""The sharding-callback contract (TensorFlow's ``ShardingCallback``) and its validation."""

from __future__ import annotations

import abc
import math
import operator
from collections.abc import Mapping, MutableMapping, Sequence
from itertools import accumulate, chain, repeat
from typing import Any, cast

import numpy as np

from ..errors import ShardingValidationError, ShardkitError, SliceSpecError
from ..frameworks import loaded
from ..values.devices import DeviceSpec
from ..values.dtypes import packed_name
from ..values.slices import SliceSpec, check_tiling, parse_slice_spec
from .tensors import ShardableTensor, gc_paused

# checkpoint key -> slice spec -> tensor
Shard = MutableMapping[str, MutableMapping[str, Any]]


class ShardingCallback(abc.ABC):
    """Decides how tensors are split into shards. Same contract as TensorFlow's.

    Subclasses take their parameters in ``__init__``, describe themselves in `description`, and
    map a list of ShardableTensors (all of one device task) to a list of shards, each a mapping
    ``checkpoint_key -> slice_spec -> tensor``. A callback may split a tensor into slices; the
    slices must tile the original exactly. Whatever it returns is checked by `validate_shards`.
    """

    @property
    @abc.abstractmethod
    def description(self) -> str:
        """A human-readable description of the policy, stored in the checkpoint."""

    @abc.abstractmethod
    def __call__(self, shardable_tensors: Sequence[ShardableTensor]) -> Sequence[Shard]:
        """Return the shards for `shardable_tensors`."""

    def __hash__(self) -> int:
        attrs = [
            (name, _hashable(value))
            for name, value in sorted(vars(self).items())
            if not callable(value)
        ]
        return hash((self.description, tuple(attrs)))


def _hashable(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


TaskShard = tuple[int, dict[str, dict[str, Any]]]


# TensorFlow's wording of each rule (its sharding_util.validate_shards), so that a test written
# against TensorFlow's messages matches shardkit's too
_TF_WORDING: dict[str, str] = {
    "no tensor duplicated": "multiple tensors with the same checkpoint key and slice spec were "
                            "found",
    "no tensor added": "a tensor not originally in the object graph was found in the "
                       "checkpoint shards",
    "no shape change": "a tensor was found with an altered shape",
    "no dtype change": "a tensor was found with an altered dtype",
    "no task change": "a tensor was found with an altered task",
    "all tensors of a shard from one task": "tensors with different tasks were found in the "
                                            "same shard",
    "no tensor removed": "tensors in the object graph were not found in the checkpoint shards",
}


def _fail(rule: str, description: str, key: str, spec: str, expected: str, found: str) -> None:
    tf_words = _TF_WORDING.get(rule)
    said = ("" if tf_words is None else
            f" (After executing the checkpoint sharding callback, {tf_words})")
    raise ShardingValidationError(
        f"sharding callback broke the rule {rule!r}{said}.\n"
        f"  callback: {description}\n"
        f"  key: {key!r}, slice spec: {spec!r}\n"
        f"  expected: {expected}\n"
        f"  found: {found}"
    )


def _task_of(value: Any) -> int | None:
    """The task a returned value claims to live on, if it carries a device (None for arrays)."""
    device = getattr(value, "device", None)
    if isinstance(device, DeviceSpec):
        return device.task or 0
    if isinstance(device, str):
        try:
            return DeviceSpec.from_string(device).task or 0
        except ShardkitError:
            return None
    return None


def _as_array(value: Any) -> Any:
    """Arrays pass through; records with a `.tensor` (ShardableTensor, TensorSaveSpec) unwrap."""
    if type(value) is np.ndarray:
        return value
    inner = getattr(value, "tensor", None)
    return value if inner is None else inner


def _same_data(value: Any, original: np.ndarray, region: tuple[slice, ...] | None) -> bool:
    """True if `value` holds `original[region]`: cheaply as a view of it, else by bytes."""
    if value is original and region is None:
        return True
    if not isinstance(value, np.ndarray):
        return False
    expected = original if region is None else original[region]
    ai, bi = value.__array_interface__, expected.__array_interface__
    if ai["data"][0] == bi["data"][0] and ai["strides"] == bi["strides"]:
        return True
    if expected.size == 0:
        return True
    got, want = (np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in (value, expected))
    return bool(np.array_equal(got, want))


def validate_shards(
    shards: Sequence[Shard], shardable_tensors: Sequence[ShardableTensor], description: str
) -> None:
    """Check a callback's shards against its input.

    Rules: no tensor removed, none added, no (key, slice) twice, no shape or dtype change, no task
    change, all tensors of one shard from one task; a tensor split into slices must be tiled
    exactly by them, and every slice must hold the original's data.

    Args:
        shards: what the callback returned.
        shardable_tensors: what it was given.
        description: the callback's description, for the error message.
    Raises:
        ShardingValidationError: a rule is broken; names the rule, key, slice and values.
    """
    with gc_paused():
        if not _all_whole_as_given(shards, shardable_tensors):
            _validate(shards, shardable_tensors, description)


def _all_whole_as_given(shards: Sequence[Any], shardable_tensors: Sequence[ShardableTensor]
                        ) -> bool:
    """True if `shards` are plain dicts that hand back every input (all whole tensors, distinct
    keys) exactly once, as the very array it was given, each shard from one task.

    That is the common case, which `_validate` accepts on its own fast path; this checks it in
    bulk with C-level maps. False means "not sure": `_validate` then decides.
    """
    n = len(shardable_tensors)
    if not all(type(s) is dict for s in shards):
        return False
    keys = list(chain.from_iterable(shards))
    if len(keys) != n or len(set(keys)) != n:
        return False
    if not n:
        return True
    by_key = dict(zip(map(_key_of, shardable_tensors), shardable_tensors))
    if len(by_key) != n or set(map(_spec_of, shardable_tensors)) != {""}:
        return False
    inner = list(chain.from_iterable(map(dict.values, shards)))
    if set(map(type, inner)) != {dict} or set(map(len, inner)) != {1}:
        return False
    if set(chain.from_iterable(inner)) != {""}:
        return False
    originals = list(map(by_key.get, keys))
    if any(map(operator.is_, originals, repeat(None))):
        return False
    values = map(operator.itemgetter(""), inner)
    if not all(map(operator.is_, values, map(_tensor_of, originals))):
        return False
    tasks = [task or 0 for task in map(_device_task_of, originals)]
    if len(set(tasks)) > 1:  # all one task is the usual case; else one task per shard
        ends = list(accumulate(map(len, shards)))
        for begin, end in zip([0, *ends[:-1]], ends):
            if len(set(tasks[begin:end])) > 1:
                return False
    return True


def _take_whole_as_given(
    shard: dict[str, Any], whole: dict[str, ShardableTensor], seen_whole: set[str]
) -> tuple[int | None, Any]:
    """Accept in bulk the entries of `shard` that are whole tensors handed back as the very
    arrays given, all of one task and none seen before; record them in `seen_whole`.

    Returns that task (None if nothing was accepted) and the entries left to check one by one.
    """
    keys = list(shard)
    inner = list(shard.values())
    if not keys or set(map(type, inner)) != {dict}:
        return None, shard.items()
    originals = list(map(whole.get, keys))
    given = map(getattr, originals, repeat("tensor"), repeat(None))
    returned = map(dict.get, inner, repeat(""))
    fast = [r is g and g is not None and n == 1
            for r, g, n in zip(returned, given, map(len, inner))]
    accepted = [k for k, f in zip(keys, fast) if f]
    if not accepted or not seen_whole.isdisjoint(accepted):
        return None, shard.items()  # the entry-by-entry check names the duplicate
    tasks = {o.device.task or 0 for o, f in zip(originals, fast) if f and o is not None}
    if len(tasks) != 1:
        return None, shard.items()
    seen_whole.update(accepted)
    return tasks.pop(), [(k, d) for k, d, f in zip(keys, inner, fast) if not f]


_key_of = operator.attrgetter("checkpoint_key")
_spec_of = operator.attrgetter("slice_spec")
_tensor_of = operator.attrgetter("tensor")
_device_task_of = operator.attrgetter("device.task")


def _validate(
    shards: Sequence[Shard], shardable_tensors: Sequence[ShardableTensor], description: str
) -> None:
    whole: dict[str, ShardableTensor] = {}  # inputs given whole, by key
    sliced: dict[tuple[str, str], ShardableTensor] = {}  # inputs that are themselves slices
    sliced_by_key: dict[str, list[ShardableTensor]] = {}
    for t in shardable_tensors:
        if t.slice_spec == "":
            whole[t.checkpoint_key] = t
        else:
            sliced[(t.checkpoint_key, t.slice_spec)] = t
            sliced_by_key.setdefault(t.checkpoint_key, []).append(t)
    seen_whole: set[str] = set()  # keys returned whole (slice spec "")
    seen: set[tuple[str, str]] = set()  # (key, spec) returned under any other slice spec
    pieces: dict[tuple[str, str], list[tuple[str, SliceSpec]]] = {}
    for shard_index, shard in enumerate(shards):
        if not isinstance(shard, Mapping):
            _fail("each shard is a mapping", description, f"<shard {shard_index}>", "",
                  "a mapping checkpoint_key -> slice_spec -> tensor", type(shard).__name__)
        shard_task: int | None = None
        items: Any = shard.items()
        if type(shard) is dict:
            shard_task, items = _take_whole_as_given(shard, whole, seen_whole)
        for key, slices in items:
            if type(slices) is not dict and not isinstance(slices, Mapping):
                _fail("each shard is a mapping", description, key, "",
                      "a mapping slice_spec -> tensor", type(slices).__name__)
            for spec, value in slices.items():
                pair = (key, spec)
                if (spec == "" and key in seen_whole) or pair in seen:
                    _fail("no tensor duplicated", description, key, spec,
                          "each (key, slice) in exactly one shard",
                          f"a second copy in shard {shard_index}")
                if spec == "":
                    seen_whole.add(key)  # the one record of whole entries, whichever path
                else:
                    seen.add(pair)
                original = whole.get(key) if spec == "" else sliced.get(pair)
                box = None
                if original is None:
                    candidates = sliced_by_key.get(key, [])
                    if key in whole:
                        candidates = [whole[key], *candidates]
                    original, box = _split_parent(candidates, key, spec, description)
                    pieces.setdefault((key, original.slice_spec), []).append((spec, box))
                task = original.device.task or 0
                claimed = _task_of(value)
                if claimed is not None and claimed != task:
                    _fail("no task change", description, key, spec,
                          f"task {task}", f"task {claimed}")
                if shard_task is None:
                    shard_task = task
                elif task != shard_task:
                    _fail("all tensors of a shard from one task", description, key, spec,
                          f"task {shard_task} (of the shard's first tensor)",
                          f"task {task} in shard {shard_index}")
                array = _as_array(value)
                if array is not original.tensor:
                    _check_entry(array, original, spec, box, description)
    for (key, parent_spec), parts in pieces.items():
        if (key, parent_spec) in seen or (parent_spec == "" and key in seen_whole):
            _fail("no tensor duplicated", description, key, parts[0][0],
                  "a tensor either whole or split into slices",
                  f"both whole (slice spec {parent_spec!r}) and as slices")
        parent = whole[key] if parent_spec == "" else sliced[(key, parent_spec)]
        _check_tiling(parent, parts, description)
    accounted = len(seen_whole) + len(seen) - sum(map(len, pieces.values())) + len(pieces)
    if accounted == len(whole) + len(sliced):
        return  # every input accounted for (duplicates and additions were rejected above)
    for key, spec in chain(((k, "") for k in whole), sliced):
        if (key, spec) in seen or (key, spec) in pieces or (spec == "" and key in seen_whole):
            continue
        _fail("no tensor removed", description, key, spec,
              "the tensor in one shard (whole or as slices)", "it is in no shard")


def _split_parent(
    candidates: list[ShardableTensor], key: str, spec: str, description: str
) -> tuple[ShardableTensor, SliceSpec]:
    """The input tensor (among those of `key`) that slice `spec` was cut from, or raise."""
    if not candidates:
        _fail("no tensor added", description, key, spec,
              "only keys given to the callback", "a key the callback was not given")
    try:
        box = parse_slice_spec(spec)
    except SliceSpecError as e:
        _fail("slice specs are well formed", description, key, spec,
              "TensorFlow slice spec text, e.g. '4 6 2,2:0,6'", str(e))
    for t in candidates:
        region = _region(t)
        if region.full_shape == box.full_shape and (region == box or region.intersect(box) == box):
            return t, box
    full = _region(candidates[0]).full_shape
    _fail("no tensor added", description, key, spec,
          f"slices inside the given tensor of full shape {list(full)}",
          f"a slice of full shape {list(box.full_shape)} that lies outside every given slice")
    raise AssertionError  # unreachable; _fail raises


def _region(t: ShardableTensor) -> SliceSpec:
    return SliceSpec.whole(t.shape) if t.slice_spec == "" else parse_slice_spec(t.slice_spec)


def _check_entry(
    array: Any, original: ShardableTensor, spec: str, box: SliceSpec | None, description: str
) -> None:
    """Shape, dtype and data of one returned entry; `box` is set when it is a slice of a split."""
    key = original.checkpoint_key
    want_shape = tuple(original.shape) if box is None else box.lengths
    shape = getattr(array, "shape", None)
    if shape is None or tuple(shape) != want_shape:
        _fail("no shape change", description, key, spec, f"shape {list(want_shape)}",
              f"shape {None if shape is None else list(shape)}")
    dtype = getattr(array, "dtype", None)
    if dtype != original.dtype:
        _fail("no dtype change", description, key, spec, f"dtype {original.dtype}",
              f"dtype {dtype}")
    if box is not None and math.prod(box.lengths) % 2 and packed_name(original.dtype):
        _fail("slices of a packed tensor hold an even count of elements", description, key,
              spec, f"an even element count: {original.dtype} is stored two elements a byte",
              f"shape {list(box.lengths)}, {math.prod(box.lengths)} elements")
    index = None
    if box is not None:
        origin = _region(original).offsets
        index = tuple(
            slice(o - r, o - r + n) for o, r, n in zip(box.offsets, origin, box.lengths)
        )
    if not _same_data(array, original.tensor, index):
        _fail("slices hold the original's data", description, key, spec,
              "the original's values in that region (a view of it, or an equal copy)",
              "different values")


def _check_tiling(
    parent: ShardableTensor, parts: list[tuple[str, SliceSpec]], description: str
) -> None:
    """The slices of a split tensor tile its region exactly: in bounds, no overlap, no gap."""
    region = _region(parent)
    relative = [
        SliceSpec(region.lengths, tuple(o - r for o, r in zip(b.offsets, region.offsets)),
                  b.lengths)
        for _, b in parts
    ]
    try:
        check_tiling(region.lengths, relative)
    except SliceSpecError as e:
        _fail("split tensors tile the original exactly", description, parent.checkpoint_key,
              ", ".join(spec for spec, _ in parts),
              f"slices covering shape {list(region.lengths)} exactly once", str(e))


def shard_tensors(
    callback: ShardingCallback, shardable_tensors: Sequence[ShardableTensor]
) -> list[TaskShard]:
    """Run `callback` once per device task and validate its shards before anything is written.

    Args:
        callback: a `ShardingCallback` (or TensorFlow's, or any object with its contract).
        shardable_tensors: the tensors to shard, of one or more tasks.
    Returns:
        ``(task, shard)`` pairs in task order of first appearance, then callback order, with
        values unwrapped to arrays and empty shards dropped.
    Raises:
        ShardingValidationError: the callback has no str description or broke the contract.
    """
    groups: dict[int, list[ShardableTensor]] = {}
    for t in shardable_tensors:
        groups.setdefault(t.device.task or 0, []).append(t)
    description = callback_description(callback)
    run = _runner(callback)
    out: list[TaskShard] = []
    for task, group in groups.items():
        shards = run(group)
        if isinstance(shards, Mapping) or not isinstance(shards, Sequence):
            raise ShardingValidationError(
                f"sharding callback broke the rule 'returns a sequence of shards'.\n"
                f"  callback: {description}\n"
                f"  expected: a list of mappings checkpoint_key -> slice_spec -> tensor\n"
                f"  found: {type(shards).__name__}"
            )
        with gc_paused():
            as_given = _all_whole_as_given(shards, group)
        if as_given:  # plain dicts of the very arrays given: nothing to unwrap or copy
            out.extend((task, cast(dict[str, dict[str, Any]], shard)) for shard in shards if shard)
            continue
        with gc_paused():
            _validate(shards, group, description)  # the bulk check above already said no
        for shard in shards:
            if shard:
                out.append((task, {
                    key: {spec: _as_array(v) for spec, v in slices.items()}
                    for key, slices in shard.items()
                }))
    return out


def is_sharding_callback(callback: Any) -> bool:
    """Whether `callback` honours the contract: a shardkit `ShardingCallback`, a TensorFlow
    ``tf.train.experimental.ShardingCallback``, or any object with a `description` and
    ``__call__(shardable_tensors)``."""
    if isinstance(callback, ShardingCallback):
        return True
    return (callable(callback) and not isinstance(callback, type)
            and (hasattr(type(callback), "description") or hasattr(callback, "description")))


def _runner(callback: Any) -> Any:
    """How to call `callback` on shardkit's ShardableTensors: directly, or, for TensorFlow's
    callbacks, on TensorFlow's own ShardableTensors with the result brought back to the host
    (`frameworks.tf_sharding`)."""
    if not isinstance(callback, ShardingCallback) and loaded("tensorflow") is not None:
        from . import tf_sharding

        if tf_sharding.is_tensorflow_callback(callback):
            return lambda group: tf_sharding.run_tensorflow_callback(callback, group)
    return callback


def callback_description(callback: ShardingCallback) -> str:
    """`callback.description`, checked to be a str (ShardingValidationError otherwise)."""
    try:
        description = callback.description
    except Exception as e:
        raise ShardingValidationError(
            f"sharding callback {type(callback).__name__} has no usable description: {e}"
        ) from e
    if not isinstance(description, str):
        raise ShardingValidationError(
            f"sharding callback {type(callback).__name__}: description must be a str, "
            f"got {type(description).__name__}"
        )
    return description
