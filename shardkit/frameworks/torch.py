"""numpy arrays -> torch tensors, without a copy on the CPU.

``torch.from_numpy`` shares the array's memory (for a mapped shard: the writable copy-on-write
map, so in-place ops never reach the file). bfloat16 and float8, which numpy holds as ml_dtypes
and torch cannot take from numpy, go through an integer array of the same width and
``Tensor.view(dtype)``: still the same memory. Only arrays torch cannot share (negative strides
from a reversed `get_slice`, read-only arrays) are copied first. Another device is one
``Tensor.to(device)`` copy; "meta" is refused (it holds no data).
"""

from __future__ import annotations

import functools
from typing import Any

import ml_dtypes
import numpy as np
import torch

from ..errors import InvalidArgumentError, InvalidArgumentTypeError

# numpy (ml_dtypes) dtypes torch.from_numpy refuses -> integer carrier, torch dtype
_REINTERPRET: dict[np.dtype, tuple[np.dtype, torch.dtype]] = {
    np.dtype(ml_dtypes.bfloat16): (np.dtype(np.int16), torch.bfloat16),
    np.dtype(ml_dtypes.float8_e4m3fn): (np.dtype(np.uint8), torch.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e5m2): (np.dtype(np.uint8), torch.float8_e5m2),
}


def from_numpy(array: np.ndarray, key: str = "") -> torch.Tensor:
    """A CPU tensor over `array`'s memory (a copy only when torch cannot share it: read-only
    memory, negative strides). `key` is unused (the converter signature)."""
    if not array.flags.writeable:
        array = array.copy()
    special = _REINTERPRET.get(array.dtype)
    try:
        if special is None:
            return _from_numpy(array)
        return _from_numpy(array.view(special[0])).view(special[1])
    except ValueError:  # "At least one stride in the given numpy array is negative"
        if array.ndim and min(array.strides) < 0:
            return from_numpy(array.copy())
        raise


_from_numpy = torch.from_numpy


def converter(device: Any = None) -> Any:
    """The array -> tensor function for `device` (None, "cpu", a str or a torch.device)."""
    target = _device(device)
    if target is None:
        return from_numpy  # per tensor: one call, no wrapper

    def on_device(array: np.ndarray, key: str = "") -> torch.Tensor:
        return from_numpy(array).to(target)

    return on_device


def _device(device: Any) -> torch.device | None:
    """`device` as a torch.device, None for the CPU (no copy); checked to hold data."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise InvalidArgumentTypeError(
            f"device must be a str or a torch.device for framework='torch', got "
            f"{type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidArgumentError(f"device={device!r} is not a torch device: {e}") from e
    if dev.type == "meta":
        raise InvalidArgumentError(
            f"device={device!r}: a meta tensor has no data, so a loaded tensor cannot be one; "
            "load to 'cpu' (the default) or another device, or read shapes and dtypes with "
            "CheckpointReader.info")
    if dev.type == "cpu":
        return None
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as e:
        raise InvalidArgumentError(f"device={device!r} is not available to torch: {e}") from e
    return dev


@functools.lru_cache(maxsize=1)
def _dtensor_api() -> tuple[Any, Any, Any]:
    """Replicate, Shard and torch's local shape / global offset helper (imported once)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return Replicate, Shard, compute_local_shape_and_global_offset


def dtensor_box(value: Any, key: str, cache: dict[Any, Any] | None = None
                ) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """The local tensor of DTensor `value` (its own memory: writing to it writes the DTensor),
    and the global offset and shape of the box of the global tensor it holds on this rank.

    Shard(d) (even or not) and Replicate placements, on meshes of any dimension; a rank outside
    the mesh holds an empty box. Partial (pending reductions) and strided shards, whose local
    tensor is not one box of the global tensor, are refused (RestoreMismatchError). `cache`
    (a dict the caller keeps for one restore) remembers the box per global shape, mesh and
    placements, which many tensors of a model share."""
    from ..errors import RestoreMismatchError

    replicate, shard, local_box = _dtensor_api()
    placements = tuple(value.placements)
    mesh = value.device_mesh
    ident = (tuple(value.shape), id(mesh), placements)
    got = None if cache is None else cache.get(ident)
    if got is None:
        for p in placements:
            if type(p) is not replicate and type(p) is not shard:
                raise RestoreMismatchError(
                    f"cannot restore key {key!r} into a DTensor with placement "
                    f"{type(p).__name__} ({p}): only Shard(d) and Replicate placements hold a "
                    "box of the global tensor; restore into a Shard or Replicate DTensor and "
                    "redistribute it"
                )
        shape, offset = local_box(value.shape, mesh, placements)
        got = tuple(int(o) for o in offset), tuple(int(n) for n in shape)
        if cache is not None:
            cache[ident] = got
    with torch.no_grad():
        local = value.to_local()
    if tuple(local.shape) != got[1]:
        raise RestoreMismatchError(
            f"cannot restore key {key!r}: the DTensor's local tensor has shape "
            f"{list(local.shape)}, its placements {list(placements)} on mesh {mesh} give "
            f"{list(got[1])}"
        )
    return local, got[0], got[1]
