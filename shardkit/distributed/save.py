"""The collective save: every rank writes its own shards, rank 0 merges and commits once.

Each rank is the device task ``/job:worker/replica:0/task:<rank>``. Four collectives per save,
whatever the number of tensors (docs/ARCHITECTURE.md):

1. ``plan``: an all-gather of what each rank holds, as columns (key, slice spec, dtype, global
   shape, bytes), with rank 0's temp directory and the generation id. From it every rank
   computes the same de-duplication: a (key, slice) held by several ranks (Replicate, a plain
   tensor on every rank, the replicas of a shard on a 2-D mesh) is written once, by the holder
   with the fewest bytes so far, largest first, so that ranks write about the same bytes.
2. ``shards``: an all-gather of each rank's shard count after its callback ran on its own
   tensors and its shards were validated, for the global file numbering.
3. ``index``: a gather on rank 0 of each rank's index columns after its files are fsynced.
   Rank 0 merges them (`format.merge_indexes`) and publishes with the single-process commit.
4. ``commit``: a broadcast of the outcome.

A failure on any rank (flatten, callback, validation, write, commit) travels in the next
collective, so every rank raises the same DistributedSaveError naming the failing rank and its
cause; rank 0 removes the temp directory, and nothing becomes visible. A rank that dies makes
the others' next collective fail (DistributedTimeoutError) within the timeout. Tensor bytes
never leave their process.

This module sits with the front door (api.py calls it; it uses the writer and the commit);
the seam it talks through, `base.Coordinator`, sits low in the layers.
"""

from __future__ import annotations

import math
import os
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import commit
from .. import format as fmt
from ..callback import ShardingCallback, shard_tensors
from ..devices import DeviceSpec
from ..dtypes import itemsize, safetensors_name
from ..errors import DistributedError, DistributedSaveError, DistributedStateError
from ..options import CheckpointOptions
from ..slices import WHOLE, format_slice_spec
from ..storage import is_url
from ..tensors import ShardableTensor, flatten_columns, to_host
from ..writer import SavedTensors, shard_columns, write_shards
from .base import Coordinator

OPS = ("plan", "shards", "index", "commit")  # the collectives of one save, in order


@dataclass(slots=True)
class Held:
    """What one rank holds, column-wise: per piece its key, slice spec of the global tensor
    (``""``: the whole tensor), safetensors dtype name, global shape and bytes. `arrays` (the
    host views) stay in the process; the rest is what the ``plan`` collective sends."""

    keys: list[str]
    specs: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    nbytes: list[int]
    arrays: list[np.ndarray]
    devices: list[DeviceSpec]

    def columns(self) -> tuple[list[str], list[str], list[str], list[tuple[int, ...]], list[int]]:
        return self.keys, self.specs, self.dtypes, self.shapes, self.nbytes


def held(state: Any, rank: int) -> Held:
    """Flatten `state` into this rank's pieces: a DTensor as its local slice of the global
    tensor (none when the local shard is empty), anything else whole."""
    from .dtensor import dtensor_type, local_slice

    keys, leaves = flatten_columns(state)
    dtensor = dtensor_type()
    out = Held([], [], [], [], [], [], [])
    for key, value in zip(keys, leaves):
        if dtensor is not None and isinstance(value, dtensor):
            local, shape, offset = local_slice(value, key)
            array, dev = to_host(local, key)
            if array.size == 0 and math.prod(shape) != 0:
                continue  # an empty shard of an uneven split: nothing to store
            spec = WHOLE if array.shape == shape else format_slice_spec(shape, offset,
                                                                        array.shape)
        else:
            array, dev = to_host(value, key)
            shape = tuple(array.shape)
            spec = WHOLE
        out.keys.append(key)
        out.specs.append(spec)
        out.dtypes.append(safetensors_name(array.dtype))
        out.shapes.append(shape)
        out.nbytes.append(int(array.nbytes))
        out.arrays.append(array)
        out.devices.append(DeviceSpec("worker", 0, rank, dev.device_type if dev else "CPU",
                                      dev.device_index if dev else 0))
    return out


Columns = tuple[list[str], list[str], list[str], list[tuple[int, ...]], list[int]]


def assign(columns: Sequence[Columns]) -> list[list[int]]:
    """For each rank, the positions (in its `Held`) of the pieces it writes.

    A (key, slice spec) held by one rank is written by it; one held by several is written
    once, by the holder with the fewest bytes assigned so far (largest pieces first, ties to
    the lowest rank). The same on every rank, from the same gathered columns. Raises
    DistributedStateError when ranks disagree on a key's dtype or global shape, or when the
    pieces of a key do not add up to its size (a missing or overlapping slice).
    """
    info: dict[str, tuple[str, tuple[int, ...], int]] = {}  # key -> dtype, shape, first rank
    holders: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for r, (keys, specs, dtypes, shapes, _) in enumerate(columns):
        get = info.get
        for i, (key, spec, dtype, shape) in enumerate(zip(keys, specs, dtypes, shapes)):
            known = get(key)
            if known is None:
                info[key] = (dtype, shape, r)
            elif known[0] != dtype or known[1] != shape:
                raise DistributedStateError(
                    f"tensor {key!r} differs across ranks: rank {known[2]} holds {known[0]} "
                    f"{list(known[1])}, rank {r} holds {dtype} {list(shape)} (global dtype and "
                    "shape); every rank must hold the same tensor under one key")
            holders.setdefault((key, spec), []).append((r, i))
    load = [0] * len(columns)
    mine: list[list[int]] = [[] for _ in columns]
    shared: list[tuple[int, tuple[str, str]]] = []
    covered: dict[str, int] = {}
    for pair, where in holders.items():
        r, i = where[0]
        n = columns[r][4][i]
        covered[pair[0]] = covered.get(pair[0], 0) + n
        if len(where) == 1:
            load[r] += n
            mine[r].append(i)
        else:
            shared.append((n, pair))
    shared.sort(key=lambda item: -item[0])  # stable: first appearance among equals
    for n, pair in shared:
        r, i = min(holders[pair], key=lambda h: (load[h[0]], h[0]))
        load[r] += n
        mine[r].append(i)
    for key, n in covered.items():
        dtype, shape, _ = info[key]
        expected = math.prod(shape) * itemsize(dtype)
        if n != expected:
            raise DistributedStateError(
                f"the ranks' slices of tensor {key!r} (global shape {list(shape)}, {dtype}) "
                f"hold {n} bytes, the tensor has {expected}: a slice is missing or two overlap")
    for m in mine:
        m.sort()
    return mine


@dataclass(frozen=True, slots=True)
class Failure:
    """A rank's error, as it travels to the others."""

    rank: int
    type: str
    message: str

    @classmethod
    def of(cls, rank: int, e: BaseException) -> Failure:
        return cls(rank, type(e).__name__, str(e) or "".join(
            traceback.format_exception_only(type(e), e)).strip())


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a collective save returns on every rank."""

    path: str
    files: tuple[str, ...]
    bytes: int
    generation: str


def _raise_first(path: str, failures: Sequence[Failure | None], rank: int,
                 local: BaseException | None) -> None:
    failed = [f for f in failures if f is not None]
    if not failed:
        return
    f = failed[0]
    others = f" (and rank{'s' if len(failed) > 2 else ''} "
    others = (others + ", ".join(str(x.rank) for x in failed[1:]) + ")") if failed[1:] else ""
    error = DistributedSaveError(
        f"collective save of {path} failed on rank {f.rank}{others}: {f.type}: {f.message}; "
        "nothing was published and any earlier checkpoint there is intact",
        f.rank, f.type, f.message)
    raise error from (local if f.rank == rank else None)


def collective_save(
    coord: Coordinator,
    path: str | os.PathLike[str],
    state: Any,
    *,
    callback: ShardingCallback,
    description: str,
    opts: CheckpointOptions,
    user_metadata: dict[str, Any],
    overwrite: bool,
    progress: bool,
) -> Outcome:
    """Save `state` at `path` together with the other ranks of `coord` (module docstring)."""
    rank = coord.rank
    shown = os.fspath(path)
    staging: commit.Staging | None = None
    local: BaseException | None = None
    failure: Failure | None = None
    try:
        # 1. what this rank holds; rank 0 opens the one temp directory
        mine: Held | None = None
        setup: tuple[str, str] | None = None
        try:
            mine = held(state, rank)
            if rank == 0:
                if is_url(shown):  # an object store: shardkit.storage.save
                    from ..storage.save import RemoteStaging

                    remote = RemoteStaging(shown, overwrite=overwrite)
                    staging, setup = remote, (remote.path, remote.generation)  # type: ignore[assignment]
                else:
                    staging = commit.stage(path, overwrite=overwrite, durable=opts.durable)
                    setup = (str(staging.path), fmt.new_generation())
        except Exception as e:
            local, failure = e, Failure.of(rank, e)
        target = shown.rstrip("/") if is_url(shown) else os.path.abspath(shown)
        plan = coord.all_gather(
            (None if mine is None else mine.columns(), failure, setup, target), "plan")
        try:
            if len({p[3] for p in plan}) > 1:
                raise DistributedStateError(
                    "the ranks of a collective save must name the same path; got "
                    + ", ".join(f"rank {r}: {p[3]}" for r, p in enumerate(plan)))
            _raise_first(shown, [p[1] for p in plan], rank, local)
            assert mine is not None
            directory, generation = plan[0][2]
            written = assign([p[0] for p in plan])[rank]
        except Exception:
            _abort_together(coord, staging)
            raise

        # 2. the callback on this rank's tensors only, validated here
        shards: list[Any] = []
        saved: SavedTensors | None = None
        try:
            tensors = [ShardableTensor(mine.arrays[i], mine.arrays[i].dtype, mine.devices[i],
                                       mine.keys[i], tuple(mine.arrays[i].shape), mine.specs[i],
                                       mine.keys[i]) for i in written]
            if tensors:
                shards = shard_columns(shard_tensors(callback, tensors))
            saved = SavedTensors.of(tensors)
            saved.shapes = [mine.shapes[i] for i in written]  # global shapes, slices or not
        except Exception as e:
            local, failure = e, Failure.of(rank, e)
        counts = coord.all_gather((len(shards), failure), "shards")
        try:
            _raise_first(shown, [c[1] for c in counts], rank, local)
        except Exception:
            _abort_together(coord, staging)
            raise
        assert saved is not None
        first = sum(c[0] for c in counts[:rank])
        total = sum(c[0] for c in counts)

        # 3. this rank's shard files, fsynced, into the shared temp directory
        part: tuple[Any, ...] | None = None
        try:
            index, _ = _shard_writer(directory)(
                directory, shards, saved, description=description, threads=opts.threads,
                durable=opts.durable, checksum=opts.checksum, progress=progress,
                compression=opts.compression, level=opts.level, shuffle=opts.shuffle,
                chunk_size=opts.chunk_size, generation=generation, first_shard=first,
                shard_count=max(total, 1))
            part = (index.keys, index.dtypes, index.shapes, index.devices, index.slice_tensor,
                    index.slice_spec, index.slice_shard, index.slice_xxh3,
                    [(s.file, s.task, s.codec, s.bytes) for s in index.shards])
        except Exception as e:
            local, failure = e, Failure.of(rank, e)
        parts = coord.gather((part, failure), "index")

        # 4. rank 0 merges the index columns and publishes; everyone learns the outcome
        result: Outcome | Failure | list[Failure | None] | None = None
        if rank == 0:
            assert parts is not None and staging is not None
            failures = [p[1] for p in parts]
            if any(failures):
                result = failures
            else:
                try:
                    merged = fmt.merge_indexes(
                        [_index_of(p[0], generation) for p in parts], callback=description,
                        user_metadata=user_metadata, generation=generation)
                    chunks = fmt.index_chunks(merged)
                    staging.commit(chunks)
                    files = (*(s.file for s in merged.shards), fmt.MANIFEST_FILE)
                    nbytes = sum(s.bytes for s in merged.shards) + sum(map(len, chunks))
                    result = Outcome(str(staging.target), files, nbytes, generation)
                except Exception as e:
                    local = e
                    result = [Failure.of(rank, e)]
            if not staging.committed:
                staging.abort()  # before the others hear of the failure: no temp dir left
        result = coord.broadcast(result, "commit")
        if isinstance(result, list):
            _raise_first(shown, result, rank, local)
        assert isinstance(result, Outcome)
        return result
    finally:
        if staging is not None and not staging.committed:
            staging.abort()


def _shard_writer(directory: str) -> Any:
    """`writer.write_shards`, or for a URL its object-store twin."""
    if is_url(directory):
        from ..storage.save import upload_shards

        return upload_shards
    return write_shards


def _abort_together(coord: Coordinator, staging: commit.Staging | None) -> None:
    """Rank 0 removes the temp directory, then every rank waits for that (one barrier, on
    failure only), so that no rank returns from a failed save while the temp directory
    still exists. A rank that is gone cannot be waited for: then the error stands alone."""
    if staging is not None:
        staging.abort()
    try:
        coord.barrier("abort")
    except DistributedError:
        pass


def _index_of(part: tuple[Any, ...], generation: str) -> fmt.CheckpointIndex:
    keys, dtypes, shapes, devices, tensor, spec, shard, xxh3, shards = part
    return fmt.CheckpointIndex(
        "", [fmt.ShardInfo(f, t, c, b, generation) for f, t, c, b in shards], keys, dtypes,
        shapes, devices, tensor, spec, shard, xxh3, {}, fmt.FORMAT_VERSION, generation)
