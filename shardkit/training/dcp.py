"""shardkit as a storage backend of PyTorch's distributed checkpoint (DCP).

`StorageWriter` and `StorageReader` implement ``torch.distributed.checkpoint``'s storage
interfaces, so ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` (and the ``state_dict`` helpers
around them) write and read ordinary shardkit checkpoints. DCP's planners decide what each rank
writes and reads (de-duplication, resharding); shardkit does the rest with its own one save
flow (`shardkit.save`, collectively over the process group) and its own reader.

Writing: a rank's write items become a state in DCP's nesting (its ``mappings``), whose tensors
are this rank's chunks (`LocalShard` for a slice of a global tensor) and whose other values are
the planner's own objects (typed in the manifest, never pickled); the save is committed inside
``write_data``, so ``finish`` has nothing left to do. Reading: the checkpoint's state, walked
with DCP's own traversal, gives the fully qualified names DCP's planner asks for; tensor items
are read as boxes straight into the planner's targets, other values are handed to the planner
the way it takes them (``torch.save`` bytes of values shardkit rebuilt).
"""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import StorageReader as _DCPReader
from torch.distributed.checkpoint import StorageWriter as _DCPWriter
from torch.distributed.checkpoint._traverse import set_element, traverse_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..distributed.save import LocalShard
from ..errors import InvalidArgumentError
from ..frameworks import restore_target
from ..frameworks.torch import from_host, torch_dtype
from ..io.options import CheckpointOptions
from ..io.reader import CheckpointReader
from ..io.save import save
from ..sharding.structure import nested_state
from ..values.slices import parse_slice_spec


class StorageWriter(_DCPWriter):
    """Write ``dcp.save``'s state as a shardkit checkpoint at `path` (a directory or URL).

    Args:
        path: the checkpoint; ``dcp.save(..., checkpoint_id=...)`` replaces it.
        options: how to write (`CheckpointOptions`: policy, compression, durability, ...).
        metadata: JSON-serialisable user metadata for the manifest.
        overwrite: replace an existing checkpoint at the path atomically.
        process_group: the group ``dcp.save`` runs over (None: the default group when
            torch.distributed is initialised, else a process alone); pass the same group to
            both.
        timeout: seconds the collective save waits for the other ranks at each step.
    """

    def __init__(self, path: str | os.PathLike[str], *, options: CheckpointOptions | None = None,
                 metadata: Mapping[str, Any] | None = None, overwrite: bool = False,
                 process_group: Any = None, timeout: float | None = None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.options, self.metadata, self.overwrite = options, metadata, overwrite
        self.process_group, self.timeout = process_group, timeout
        self.rank: int | None = None
        self.use_collectives = True

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank")
        self.use_collectives = bool(kwargs.get("use_collectives", True))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=uuid.uuid4().hex)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Save this rank's items of `plan` with shardkit's save flow (collectively when
        torch.distributed runs with more than one rank); the checkpoint is committed when
        every rank's future completes."""
        state, results = rank_state(plan, planner)
        group = self._group()
        save(self.path, state, options=self.options, metadata=self.metadata,
             overwrite=self.overwrite, process_group=group, timeout=self.timeout)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing: `write_data`'s save committed the checkpoint (one manifest, shardkit's)."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def _group(self) -> Any:
        """The process group of a collective save, or None for a process alone."""
        if not (dist.is_available() and dist.is_initialized()) or not self.use_collectives:
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if self.rank is not None and dist.get_rank(group) != self.rank:
            raise InvalidArgumentError(
                f"{self.path}: dcp.save runs this process as rank {self.rank}, but it is rank "
                f"{dist.get_rank(group)} of the StorageWriter's process group: give the "
                "StorageWriter the process_group given to dcp.save")
        return group if dist.get_world_size(group) > 1 else None


def rank_state(plan: SavePlan, planner: SavePlanner) -> tuple[dict[str, Any], list[WriteResult]]:
    """This rank's items of `plan` as a state for `shardkit.save` (in DCP's nesting when the
    planner flattened it) and their write results.

    Raises:
        InvalidArgumentError: a rank holds two chunks of one tensor, or the planner gives only
            pickled bytes for a value (shardkit never stores pickles).
    """
    mappings = getattr(planner, "mappings", None) if getattr(planner, "flatten_state_dict",
                                                             False) else None
    state: dict[str, Any] = {}
    results = []
    seen: set[str] = set()
    for item in plan.items:
        fqn = item.index.fqn
        if fqn in seen:
            raise InvalidArgumentError(
                f"{fqn!r}: this rank holds two chunks of it; shardkit's collective save takes "
                "one slice of a tensor per rank")
        seen.add(fqn)
        if item.type == WriteItemType.BYTE_IO:
            lookup = getattr(planner, "lookup_object", None)
            if lookup is None:
                raise InvalidArgumentError(
                    f"{fqn!r}: the planner gives this value as pickled bytes only, and shardkit "
                    "never stores pickles; use DCP's DefaultSavePlanner (or one with "
                    "lookup_object)")
            value, nbytes = lookup(item.index), 0
        else:
            tensor = cast(torch.Tensor, planner.resolve_data(item))
            data = item.tensor_data
            assert data is not None
            shape, offsets = tuple(data.size), tuple(data.chunk.offsets)
            value = (tensor if tuple(tensor.shape) == shape else
                     LocalShard(tensor, shape, offsets))
            nbytes = tensor.numel() * tensor.element_size()
        if mappings is not None and fqn in mappings:
            set_element(state, mappings[fqn], value)
        else:
            state[fqn] = value
        results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=None))
    return state, results


class StoredTensor:
    """A tensor of the checkpoint, by `key`, where the state DCP walks holds one. `item` (a
    stored 0-d tensor given back as a Python number) reads it."""

    __slots__ = ("dtype", "key", "reader")

    def __init__(self, key: str, reader: CheckpointReader) -> None:
        self.key, self.reader = key, reader
        self.dtype: np.dtype | None = None  # set by `read_metadata`

    def item(self) -> Any:
        return self.reader.get(self.key).item()


class StorageReader(_DCPReader):
    """Read a shardkit checkpoint (or any layout shardkit opens) with ``dcp.load``.

    Args:
        path: the checkpoint (directory, file or URL); ``dcp.load(..., checkpoint_id=...)``
            replaces it.
        verify: check the checksums of every stored slice a rank reads, before reading.
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = False) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.verify = verify
        self._reader: CheckpointReader | None = None
        self._items: dict[str, Any] = {}  # fqn -> StoredTensor, or the value DCP reads as bytes

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.close()
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata of the checkpoint: per fully qualified name its dtype, global shape
        and stored chunks, or (for values that are not tensors) a bytes entry."""
        self.close()
        reader = self._reader = CheckpointReader(self.path)
        self._items = dcp_items(reader)
        described: dict[str, Any] = {}
        for fqn, value in self._items.items():
            if not isinstance(value, StoredTensor):
                described[fqn] = BytesStorageMetadata()
                continue
            info = reader.info(value.key)
            value.dtype = info.dtype
            chunks = [parse_slice_spec(s.spec, info.shape) for s in info.slices]
            described[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=torch_dtype(info.dtype, value.key)),
                torch.Size(info.shape),
                [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.lengths))
                 for c in chunks])
        return Metadata(described, storage_meta=StorageMeta(checkpoint_id=self.path))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if self._reader is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's items of `plan`: every tensor box straight into the planner's
        target (one batch, in parallel), then the other values."""
        reader = self._reader
        assert reader is not None, "read_metadata runs first"
        boxes, after = [], []
        for item in plan.items:
            value = self._items[item.storage_index.fqn]
            if item.type == LoadItemType.BYTE_IO:
                data = io.BytesIO()
                torch.save(_with_tensors(value), data)
                data.seek(0)
                planner.load_bytes(item, data)
                continue
            chunk = item.storage_index.offset or ()
            begin = [int(a) + int(b) for a, b in zip(chunk, item.storage_offsets)]
            target = planner.resolve_tensor(item).detach()
            placed = restore_target(target, value.key)
            assert placed is not None  # a torch tensor always has one
            host, writeback = placed
            if host.dtype != value.dtype:  # converted, as DCP's own reader does (`copy_`)
                host, writeback = np.empty(host.shape, value.dtype), target
            boxes.append((value.key, begin, host))
            after.append((item, target, host, writeback))
        if self.verify and boxes:
            reader._verify_boxes([(k, b, h.shape) for k, b, h in boxes])
        reader._read_boxes_into(boxes)
        for item, target, host, writeback in after:
            if writeback is not None:
                with torch.no_grad():
                    writeback.copy_(from_host(host))
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def close(self) -> None:
        """Close the checkpoint opened by `read_metadata`."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def dcp_items(reader: CheckpointReader) -> dict[str, Any]:
    """The checkpoint's state as DCP's planner names it: fully qualified name (the path of
    each leaf DCP's traversal visits, joined with ``.``) -> `StoredTensor`, or the value DCP
    reads as bytes (which may hold StoredTensors)."""
    stored = {key: StoredTensor(key, reader) for key in reader.keys()}
    state = nested_state(reader.index.structure, stored, reader.path)
    items: dict[str, Any] = {}

    def visit(path: tuple[Any, ...], value: Any) -> None:
        items[".".join(map(str, path))] = value

    traverse_state_dict(state, visit, lambda v: isinstance(v, (torch.Tensor, StoredTensor)))
    return items


def _with_tensors(value: Any) -> Any:
    """`value` with each StoredTensor read as a torch tensor (a value DCP reads as bytes may
    hold tensors: a tuple of them)."""
    if isinstance(value, StoredTensor):
        return from_host(value.reader.get(value.key))
    if isinstance(value, Mapping):
        return {k: _with_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(map(_with_tensors, value))
    if isinstance(value, tuple):  # a NamedTuple
        return type(value)(*map(_with_tensors, value))
    return value
