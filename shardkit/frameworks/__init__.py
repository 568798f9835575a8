"""Stored arrays as framework tensors: ``load(path, framework="torch")``.

One core (this module) and one thin module per framework (`shardkit.frameworks.torch`,
`shardkit.frameworks.jax`), each imported only when its framework is asked for, so
``import shardkit`` imports no framework. numpy is the identity and the default.

`converter` checks the framework and the device once, before anything is read, and returns the
function that converts one array (None for numpy: the caller keeps its arrays, no per-tensor
work). torch tensors share the array's memory on the CPU (a writable view of the copy-on-write
map for a mapped shard); jax arrays are immutable and always a copy, on the target device.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, InvalidArgumentTypeError, MissingDependencyError
from ..optional import require
from ..sharding.tensors import gc_paused

FRAMEWORKS: tuple[str, ...] = ("numpy", "torch", "jax", "tensorflow")
"""The values of ``framework=``: "numpy" (the default), "torch", "jax", "tensorflow"."""

Converter = Callable[[np.ndarray, str], Any]
"""Converts one stored array (and names its key in errors) to a framework tensor."""

_OPTIONS = "'numpy' (the default), 'torch', 'jax' or 'tensorflow'"


def converter(framework: str = "numpy", device: Any = None) -> Converter | None:
    """The function that turns a loaded array into a `framework` tensor on `device`, or None
    when the arrays stay numpy arrays (framework "numpy", device None or "cpu").

    Checks everything it can before any tensor is read: an unknown framework or a device the
    framework cannot hold data on raises InvalidArgumentError, a framework that is not
    installed MissingDependencyError.
    """
    if framework == "numpy":
        if device is None or device == "cpu":
            return None
        raise InvalidArgumentError(
            f"device={device!r} with framework='numpy': numpy arrays live in host memory "
            "(use device=None or 'cpu', or framework='torch' / 'jax' for a device)")
    if not isinstance(framework, str):
        raise InvalidArgumentTypeError(
            f"framework must be a str, {_OPTIONS}; got {type(framework).__name__}")
    if framework not in FRAMEWORKS:
        raise InvalidArgumentError(f"unknown framework {framework!r}; choose {_OPTIONS}")
    try:
        require(framework, f"framework={framework!r}")
    except MissingDependencyError as e:
        raise MissingDependencyError(f"{e}; or choose another of {_OPTIONS}") from None
    module = importlib.import_module(f"{__name__}.{framework}")
    conv: Converter = module.converter(device)
    return conv


def to_framework(array: np.ndarray, framework: str = "numpy", device: Any = None,
                 key: str = "") -> Any:
    """`array` as a `framework` tensor on `device` (see `converter`); `key` names it in errors."""
    conv = converter(framework, device)
    return array if conv is None else conv(array, key)


def convert_all(arrays: Mapping[str, np.ndarray], conv: Converter | None) -> dict[str, Any]:
    """Every array of `arrays` through `conv`, in order (the same arrays when `conv` is None)."""
    if conv is None:
        return dict(arrays)
    with gc_paused():  # tens of thousands of new tensors: one GC pass at the end
        return dict(zip(arrays, map(conv, arrays.values(), arrays)))


def as_tensorflow_callback(callback: Any) -> Any:
    """`callback` as a ``tf.train.experimental.ShardingCallback`` for TensorFlow's own saver.

    ``tf.train.CheckpointOptions(experimental_sharding_callback=as_tensorflow_callback(p))``.

    Args:
        callback: a shardkit `ShardingCallback`.
    Returns:
        The wrapper (`tf_saver_callback.TensorFlowShardingCallback`).
    Raises:
        MissingDependencyError: TensorFlow is not installed.
        InvalidArgumentTypeError: `callback` is not a shardkit `ShardingCallback`.
    """
    require("tensorflow", "as_tensorflow_callback")
    from ..sharding.tf_saver_callback import as_tensorflow_callback as wrap

    return wrap(callback)


__all__ = ["FRAMEWORKS", "Converter", "as_tensorflow_callback", "convert_all", "converter",
           "to_framework"]
