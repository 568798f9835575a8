"""TensorFlow's sharding callbacks run by shardkit's save.

`run_tensorflow_callback` runs a ``tf.train.experimental.ShardingCallback`` (TensorFlow's own
`MaxShardSizePolicy`, `ShardByTaskPolicy`, or a subclass). It gets TensorFlow's own
``ShardableTensor``s (``tf.Tensor``, ``tf.DType``, ``TensorShape``, ``tf.DeviceSpec``, a
``SaveSpec`` as ``_tensor_save_spec``); what it returns is turned back into host arrays (a tensor
it hands back unchanged is the caller's array again, no copy) and then validated by
`shardkit.callback` as any callback's result. The other direction, shardkit's callbacks for
TensorFlow's saver, is `tf_saver_callback` (it imports `shardkit.callback`; this module must not,
since `callback.shard_tensors` calls it).

Imported only when a TensorFlow callback is run: it imports TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf  # type: ignore[import-untyped]
from tensorflow.python.checkpoint.sharding import (  # type: ignore[import-untyped]
    sharding_util,
)
from tensorflow.python.training.saving import saveable_object  # type: ignore[import-untyped]

from ..frameworks.tensorflow import from_host
from .tensors import ShardableTensor


def is_tensorflow_callback(callback: Any) -> bool:
    return isinstance(callback, sharding_util.ShardingCallback)


class Returned(NamedTuple):
    """A value a TensorFlow callback returned, on the host: the array and the device string
    of the tensor (validation checks its task)."""

    tensor: np.ndarray
    device: str


def to_tensorflow_shardables(tensors: Sequence[ShardableTensor]
                             ) -> tuple[list[Any], dict[int, np.ndarray]]:
    """TensorFlow's ShardableTensors for shardkit's, and id(tf tensor) -> the host array it
    was made from (to recognise a tensor handed back unchanged)."""
    out = []
    given: dict[int, np.ndarray] = {}
    devices: dict[int, Any] = {}
    new = sharding_util.ShardableTensor
    for t in tensors:
        dev = devices.get(id(t.device))
        if dev is None:
            dev = devices[id(t.device)] = tf.DeviceSpec.from_string(t.device.to_string())
        value = from_host(t.tensor)
        given[id(value)] = t.tensor
        spec = saveable_object.SaveSpec(value, t.slice_spec, t.name, value.dtype,
                                        dev.to_string())
        out.append(new(_tensor_save_spec=spec, tensor=value, dtype=value.dtype, device=dev,
                       name=t.name, shape=value.shape, slice_spec=t.slice_spec,
                       checkpoint_key=t.checkpoint_key, trackable=None))
    return out, given


def run_tensorflow_callback(callback: Any, tensors: Sequence[ShardableTensor]) -> Any:
    """`callback`'s shards for `tensors`, values as host arrays (`Returned` when they carry a
    device, so the task check still sees it); the caller validates them."""
    tf_tensors, given = to_tensorflow_shardables(tensors)
    shards = callback(tf_tensors)
    if isinstance(shards, Mapping) or not isinstance(shards, Sequence):
        return shards  # the caller's check names the problem
    out: list[Any] = []
    for shard in shards:
        if not isinstance(shard, Mapping):
            out.append(shard)
            continue
        out.append({key: {str(spec).strip(): _host(v, given) for spec, v in slices.items()}
                    if isinstance(slices, Mapping) else slices for key, slices in shard.items()})
    return out


def _host(value: Any, given: dict[int, np.ndarray]) -> Any:
    """A returned value on the host: the caller's own array when it is a tensor handed back
    unchanged, else `Returned` (array, device string); a value that is not a tensor, or not
    one TensorFlow can give the bytes of, as it is (validation names the problem)."""
    original = given.get(id(value))
    if original is not None:
        return original  # handed back unchanged: the caller's own array
    device = None
    if isinstance(value, saveable_object.SaveSpec):  # its device is the one it claims
        device = value.device
        value = value.tensor
        original = given.get(id(value))
        if original is not None and not device:
            return original
    if isinstance(value, (tf.Tensor, tf.Variable)):
        try:
            array = value.numpy()
        except Exception:  # a symbolic tensor: nothing to read
            return value
        if not isinstance(array, np.ndarray):
            array = np.asarray(array, dtype=object if value.dtype == tf.string else None)
        if device is None:
            device = getattr(value, "device", "") or ""
        return Returned(array, device if isinstance(device, str) else device.to_string())
    return value
