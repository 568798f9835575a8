"""torch.distributed.tensor.DTensor values: which slice of its global tensor a rank holds.

Imported only when a state holds DTensors (torch is loaded then). The local shard's offset
and shape come from torch's own helper, so every placement torch computes (``Shard(d)`` on any
dimension, uneven shards, n-D meshes) maps to a TensorFlow slice spec of the global tensor.
"""

from __future__ import annotations

from typing import Any

from ..errors import DistributedStateError, InvalidArgumentError
from ..frameworks import module


def local_slice(value: Any, key: str, cache: dict[Any, Any] | None = None
                ) -> tuple[Any, tuple[int, ...], tuple[int, ...]]:
    """``(local tensor, global shape, global offset)`` of this rank's part of DTensor `value`
    (`frameworks.torch.dtensor_local`, whose `cache` this is); Partial placements refused."""
    from torch.distributed.tensor import Partial

    def check(placements: tuple[Any, ...]) -> None:
        if any(isinstance(p, Partial) for p in placements):
            raise DistributedStateError(
                f"{key!r}: a DTensor with a Partial placement ({placements}) holds partial "
                "sums, not slices of a tensor; call .redistribute() to Replicate or Shard "
                "before saving")

    local, offset, local_shape = module("torch").dtensor_local(value, cache, check)
    if tuple(local.shape) != local_shape:
        raise DistributedStateError(
            f"{key!r}: the DTensor's local tensor has shape {list(local.shape)}, but its "
            f"placements {tuple(value.placements)} give {list(local_shape)} at offset "
            f"{list(offset)}")
    return local, tuple(int(d) for d in value.shape), offset


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
