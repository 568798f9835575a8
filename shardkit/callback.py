"""The sharding-callback contract (TensorFlow's ``ShardingCallback``) and its validation."""

from __future__ import annotations

import abc
from collections.abc import MutableMapping, Sequence
from typing import Any

import numpy as np

from .tensors import ShardableTensor

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
