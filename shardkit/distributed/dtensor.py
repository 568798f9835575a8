"""torch.distributed.tensor.DTensor values: which slice of its global tensor a rank holds.

Imported only when a state holds DTensors (torch is loaded then). The local shard's offset
and shape come from torch's own helper, so every placement torch computes (``Shard(d)`` on any
dimension, uneven shards, n-D meshes) maps to a TensorFlow slice spec of the global tensor.
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import DistributedStateError, InvalidArgumentError


def dtensor_type() -> type | None:
    """The DTensor class if torch.distributed.tensor is loaded (else no value can be one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def local_slice(value: Any, key: str, cache: dict[Any, Any] | None = None
                ) -> tuple[Any, tuple[int, ...], tuple[int, ...]]:
    """``(local tensor, global shape, global offset)`` of this rank's part of DTensor `value`.
    `cache` (a dict the caller keeps for one save) remembers torch's answer per global shape,
    mesh and placements, which many tensors of a model share."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(value.placements)
    shape = tuple(int(d) for d in value.shape)
    mesh = value.device_mesh
    box = (shape, id(mesh), placements)  # the mesh outlives the cache: its id is unique
    got = cache.get(box) if cache is not None else None
    if got is None:
        if any(isinstance(p, Partial) for p in placements):
            raise DistributedStateError(
                f"{key!r}: a DTensor with a Partial placement ({placements}) holds partial "
                "sums, not slices of a tensor; call .redistribute() to Replicate or Shard "
                "before saving")
        got = compute_local_shape_and_global_offset(shape, mesh, placements)
        if cache is not None:
            cache[box] = got
    local_shape, offset = got
    local = value.to_local()
    if tuple(local.shape) != tuple(local_shape):
        raise DistributedStateError(
            f"{key!r}: the DTensor's local tensor has shape {list(local.shape)}, but its "
            f"placements {placements} give {list(local_shape)} at offset {list(offset)}")
    return local, shape, tuple(int(o) for o in offset)


def mesh_group(values: list[Any]) -> Any:
    """The process group a collective save of DTensors `values` runs over: the default group
    when their meshes cover every rank, the mesh's group for a 1-D mesh over fewer."""
    import torch.distributed as dist

    world = dist.get_world_size()
    meshes = {id(v.device_mesh): v.device_mesh for v in values}
    groups: list[Any] = []
    for mesh in meshes.values():
        if mesh.size() == world:
            groups.append(None)
        elif mesh.ndim == 1:
            groups.append(mesh.get_group())
        else:
            raise InvalidArgumentError(
                f"the state's DTensors live on a {mesh.ndim}-D mesh of {mesh.size()} of the "
                f"{world} ranks; pass process_group= (a group of the ranks that save)")
    if any(g is not groups[0] for g in groups):
        raise InvalidArgumentError(
            "the state's DTensors live on meshes over different ranks; pass process_group= "
            "(a group of the ranks that save)")
    return groups[0]
