"""numpy arrays -> jax arrays. Always a copy: jax arrays are immutable and live on a device.

``jax.device_put(..., may_alias=False)`` copies each array to the target device (jax's default
device when none is given), never aliasing the map. jax holds bfloat16 and float8 as the same
ml_dtypes numpy does, so every dtype passes as it is. 64-bit dtypes need jax's 64-bit mode;
without it jax would silently store them as 32 bits, so they are refused instead
(UnsupportedDTypeError naming the key).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..errors import InvalidArgumentError, InvalidArgumentTypeError, UnsupportedDTypeError


def converter(device: Any = None) -> Any:
    """The array -> jax.Array function for `device` (None, a platform string such as "cpu" or
    "cpu:1", a jax Device or a jax Sharding)."""
    target = _device(device)

    def convert(array: np.ndarray, key: str = "") -> jax.Array:
        dtype = array.dtype
        canonical = jax.dtypes.canonicalize_dtype(dtype)
        if canonical != dtype:
            raise UnsupportedDTypeError(
                f"{key!r}: dtype {dtype} needs jax's 64-bit mode, or jax stores it as "
                f"{np.dtype(canonical)}: enable it (jax.config.update('jax_enable_x64', True)) "
                "or load it with framework='numpy'")
        return jax.device_put(array, target, may_alias=False)  # never the map itself

    return convert


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
