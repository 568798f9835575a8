"""Which save a state takes, for `io.save.save` and `Checkpoint`: `coordinator_for` (a collective
save's coordinator, or None for one process) and the DTensors' local parts an async snapshot
copies (`local_parts`, `as_local_shards`). It sits with the front door, above the seam
(docs/ARCHITECTURE.md)."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgumentError, InvalidArgumentTypeError
from ..frameworks import dtensor_type
from ..sharding.tensors import flatten_columns
from .base import DEFAULT_TIMEOUT, Coordinator
from .save import LocalShard


def coordinator_for(state: Any, process_group: Any = None,
                    timeout: float | None = None) -> Coordinator | None:
    """The coordinator of a save of `state`: for `process_group` (a torch.distributed process
    group, or a `Coordinator`), else for the process group of the state's DTensors; None for
    a single-process save (no DTensor in the state, or torch.distributed.tensor not loaded, in
    which case nothing is imported and the state is not walked)."""
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise InvalidArgumentTypeError(f"timeout must be a number of seconds, got "
                                           f"{timeout!r}")
        if not timeout > 0:
            raise InvalidArgumentError(f"timeout must be positive, got {timeout!r}")
    if isinstance(process_group, Coordinator):
        return process_group.with_timeout(timeout)
    if process_group is None:
        dtensor = dtensor_type()
        if dtensor is None:
            return None
        dtensors = [v for v in flatten_columns(state)[1] if isinstance(v, dtensor)]
        if not dtensors:
            return None
        from .dtensor import mesh_group

        process_group = mesh_group(dtensors)
    from .torch import TorchCoordinator

    return TorchCoordinator(process_group, DEFAULT_TIMEOUT if timeout is None else timeout)


def local_parts(tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`tensors` with each DTensor replaced by its local tensor, and key -> (global shape,
    offset) of those: what an async save snapshots (`as_local_shards` puts them back)."""
    from .dtensor import local_slice

    dtensor = dtensor_type()
    if dtensor is None:
        return tensors, {}
    out, where = {}, {}
    for key, value in tensors.items():
        if isinstance(value, dtensor):
            local, shape, offset = local_slice(value, key)
            out[key] = local
            where[key] = (shape, offset)
        else:
            out[key] = value
    return out, where


def as_local_shards(snapshot: dict[str, Any], where: dict[str, Any]) -> dict[str, Any]:
    """The snapshot of `local_parts`' tensors, the local ones as `save.LocalShard`s."""
    if not where:
        return snapshot
    return {k: LocalShard(v, *where[k]) if k in where else v for k, v in snapshot.items()}
