"""shardkit's sharding callbacks as TensorFlow's: `as_tensorflow_callback` wraps a shardkit
`ShardingCallback` as a ``tf.train.experimental.ShardingCallback`` that
``tf.train.CheckpointOptions(experimental_sharding_callback=...)`` accepts.

Imported only when one is made (`shardkit.as_tensorflow_callback`, in `io.save.py`): it imports
TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf  # type: ignore[import-untyped]
from tensorflow.python.checkpoint.sharding import (  # type: ignore[import-untyped]
    sharding_util,
)

from ..errors import InvalidArgumentTypeError, ShardingValidationError
from ..frameworks.tensorflow import from_host, host_copy
from ..values.devices import DeviceSpec
from .callback import ShardingCallback, callback_description, validate_shards
from .tensors import ShardableTensor, fast_constructor

_new_shardable = fast_constructor(ShardableTensor)


class TensorFlowShardingCallback(sharding_util.ShardingCallback):  # type: ignore[misc]
    """A shardkit `ShardingCallback` wrapped for TensorFlow's saver
    (``tf.train.CheckpointOptions(experimental_sharding_callback=...)``)."""

    def __init__(self, callback: ShardingCallback) -> None:
        self.callback = callback

    @property
    def description(self) -> str:
        return callback_description(self.callback)

    def __call__(self, shardable_tensors: Sequence[Any]) -> list[dict[str, dict[str, Any]]]:
        ours: list[ShardableTensor] = []
        originals: dict[int, Any] = {}
        for t in shardable_tensors:
            value = t.tensor
            array = host_copy(value) if hasattr(value, "numpy") else np.asarray(value)
            originals[id(array)] = value
            device = DeviceSpec.from_string(
                t.device.to_string() if hasattr(t.device, "to_string") else str(t.device or ""))
            ours.append(_new_shardable(array, array.dtype, device, t.name, tuple(array.shape),
                                       t.slice_spec, t.checkpoint_key))
        shards = self.callback(ours)
        if isinstance(shards, Mapping) or not isinstance(shards, Sequence):
            raise ShardingValidationError(
                f"sharding callback {self.description!r} must return a list of shards, got "
                f"{type(shards).__name__}")
        validate_shards(shards, ours, self.description)  # shardkit's rules, its wording
        by_key = {(t.checkpoint_key, t.slice_spec): t for t in shardable_tensors}
        out = []
        for shard in shards:
            tf_shard: dict[str, dict[str, Any]] = {}
            for key, slices in shard.items():
                for spec, value in slices.items():
                    array = getattr(value, "tensor", value)
                    original = originals.get(id(array))
                    if original is None:  # a slice: a new tensor on the parent's device
                        parent = by_key.get((key, spec)) or next(
                            t for t in shardable_tensors if t.checkpoint_key == key)
                        with tf.device(parent.device):
                            original = tf.identity(from_host(np.asarray(array)))
                    tf_shard.setdefault(key, {})[spec] = original
            if tf_shard:
                out.append(tf_shard)
        return out


def as_tensorflow_callback(callback: ShardingCallback) -> TensorFlowShardingCallback:
    """`callback` as a ``tf.train.experimental.ShardingCallback``."""
    if not isinstance(callback, ShardingCallback):
        raise InvalidArgumentTypeError(
            f"as_tensorflow_callback takes a shardkit.ShardingCallback, got "
            f"{type(callback).__name__}")
    return TensorFlowShardingCallback(callback)
