"""jax arrays <-> host numpy arrays. To the host: ``np.asarray`` (a view where jax allows it).
From the host: always a copy, as jax arrays are immutable and live on a device (nor can they be
restored in place).

``jax.device_put(..., may_alias=False)`` copies each array to the target device (jax's default
device when none is given), never aliasing the map. jax holds bfloat16 and float8 as the same
ml_dtypes numpy does, so every dtype passes as it is. 64-bit dtypes need jax's 64-bit mode;
without it jax would silently store them as 32 bits, so they are refused instead
(UnsupportedDTypeError naming the key).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from ..errors import InvalidArgumentError, InvalidArgumentTypeError, UnsupportedDTypeError
from ..values.devices import DeviceSpec


def owns(value: Any) -> bool:
    return isinstance(value, jax.Array)


def host_dtype(dtype: Any) -> np.dtype:
    return np.dtype(dtype)


def to_host(a: Any) -> tuple[np.ndarray, DeviceSpec]:
    """A host array of jax array `a` and the device it lives on (its first)."""
    devices = list(a.devices())
    d = devices[0] if devices else None
    kind = "CPU" if d is None or d.platform == "cpu" else d.platform.upper()
    return np.asarray(a), DeviceSpec("localhost", 0, 0, kind, getattr(d, "id", 0) or 0)


def from_host(array: np.ndarray, key: str = "", device: Any = None) -> jax.Array:
    """A copy of `array` on `device` (a checked one: `converter`; None: jax's default)."""
    dtype = array.dtype
    canonical = jax.dtypes.canonicalize_dtype(dtype)
    if canonical != dtype:
        raise UnsupportedDTypeError(
            f"{key!r}: dtype {dtype} needs jax's 64-bit mode, or jax stores it as "
            f"{np.dtype(canonical)}: enable it (jax.config.update('jax_enable_x64', True)) "
            "or load it with framework='numpy'")
    return jax.device_put(array, device, may_alias=False)  # never the map itself


def converter(device: Any = None) -> Any:
    """The array -> jax.Array function for `device` (None, a platform string such as "cpu" or
    "cpu:1", a jax Device or a jax Sharding)."""
    return functools.partial(from_host, device=_device(device))


def new_like(array: np.ndarray, like: Any) -> jax.Array:
    """A new array of `array`'s values placed as `like` (its sharding, when it has one)."""
    sharding = getattr(like, "sharding", None)
    return jax.device_put(array, sharding) if sharding is not None else jax.numpy.asarray(array)


def holds_arrays(tree: Any) -> bool:
    """Whether pytree `tree` has a jax array among its leaves."""
    return any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(tree))


def host_twin(tree: Any) -> Any:
    """`tree` with each jax array replaced by an empty host array of its shape and dtype (the
    buffers a restore fills), the other leaves as they are."""
    return jax.tree.map(
        lambda x: np.empty(x.shape, x.dtype) if isinstance(x, jax.Array) else x, tree)


def rebuild_like(tree: Any, twin: Any, kept: set[int]) -> Any:
    """`tree` with each jax array replaced by its `host_twin` buffer, placed as it was; an
    array whose buffer is in `kept` (by id: not restored) stays as it is."""
    return jax.tree.map(
        lambda x, h: x if id(h) in kept else new_like(h, x) if isinstance(x, jax.Array) else h,
        tree, twin)


def _device(device: Any) -> Any:
    if device is None or isinstance(device, (jax.Device, jax.sharding.Sharding)):
        return device
    if not isinstance(device, str):
        raise InvalidArgumentTypeError(
            "device must be a jax Device, a jax Sharding or a platform string like 'cpu' for "
            f"framework='jax', got {type(device).__name__}")
    platform, _, number = device.partition(":")
    try:
        devices = jax.devices(platform)
    except RuntimeError as e:
        have = sorted({d.platform for d in jax.devices()})
        raise InvalidArgumentError(
            f"device={device!r}: jax has no {platform!r} devices (it has {', '.join(have)}): "
            f"{e}") from e
    if not number:
        return devices[0]
    if not number.isdigit() or int(number) >= len(devices):
        raise InvalidArgumentError(
            f"device={device!r}: jax has {len(devices)} {platform!r} device(s), numbered 0 to "
            f"{len(devices) - 1}")
    return devices[int(number)]
