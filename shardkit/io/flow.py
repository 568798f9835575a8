"""The save flow, one for a process alone and for many: plan, write, commit.

A save runs over a `Coordinator` (a process alone: the `LocalCoordinator`, world size 1).
`Steps.step` runs each step on every rank and is the one relay of errors (rank 0 aborts the
staging, every rank raises the same error):

1. ``plan`` (all-gather): rank 0 checks the target; every rank computes the same plan from
   what each holds (`RankSave.hold`, `assign`).
2. ``shards`` (all-gather): each rank's callback, validated (`shard`); rank 0 stages the save.
3. ``index`` (gather on rank 0): each rank writes its shards and sends what it wrote (`part`).
4. ``commit`` (broadcast): rank 0 merges the parts (`merge`) and commits.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from .. import format as fmt
from ..coordinator import Coordinator, LocalCoordinator
from ..errors import DistributedError, DistributedSaveError, DistributedStateError
from ..sharding.callback import ShardingCallback, callback_description
from ..storage import Staging, Storage
from ..values.strings import StringColumns
from .options import CheckpointOptions
from .writer import SavedTensors, ShardColumns, default_threads, write_shards

if TYPE_CHECKING:
    from ..adapters.tensorbundle.writer import BundleOutput

Outcome = tuple[str, tuple[str, ...], int, "str | None"]  # path, files, bytes, generation


class Failure(NamedTuple):
    """A rank's error, as it travels to the others."""

    rank: int
    type: str
    message: str


class RankSave:
    """One rank's side of a save; as given, a process alone's (nothing to assign or merge),
    whose `shard` (the callback on what it writes, validated; returns the shard count) a
    subclass defines. `default_policy(threads)` is the callback when the options give none."""

    shards: Sequence[ShardColumns] = ()
    saved: SavedTensors
    description = ""
    strings: StringColumns | None = None
    split: Sequence[str] = ()  # the keys the callback split (for the warning)
    split_reason = ""  # why they were stored as slices, when it was not the callback's doing

    def __init__(self, state: Any, opts: CheckpointOptions,
                 default_policy: Callable[[int], ShardingCallback], *, share: bool = True,
                 structure: list[Any] | None = None) -> None:
        self.state, self.opts, self.default_policy = state, opts, default_policy
        self.share = share  # store tensors of one memory once (`values.sharing`)
        self.structure = structure  # this rank's structure record of its state
        self.threads = opts.threads or default_threads()  # a rank of many: its share

    def callback(self) -> ShardingCallback:
        callback = self.opts.experimental_sharding_callback or self.default_policy(self.threads)
        self.description = callback_description(callback)
        return callback

    def hold(self, rank: int) -> Any:
        return None

    def assign(self, held: list[Any]) -> None:
        pass

    def shard(self) -> int:
        raise NotImplementedError

    def write(self, output: Any, where: Storage | str,
              generation: str | None, first: int, count: int) -> Any:
        """Write this rank's shards, numbered `first` on of `count`, into `where` (rank 0:
        the staging's Storage; another rank: its URL)."""
        return output.write(where, generation, self, first, count)

    def part(self, written: Any) -> Any:
        return written

    def merge(self, parts: list[Any], output: Any, generation: str | None) -> Any:
        return parts[0]


class StorageOutput:
    """shardkit's checkpoint, through its `Storage` (local directory or object store)."""

    def __init__(self, store: Storage, opts: CheckpointOptions, user_metadata: dict[str, Any],
                 progress: bool, structure: list[Any] | None = None) -> None:
        self.store, self.url = store, store.url
        self.opts, self.user_metadata, self.progress = opts, user_metadata, progress
        self.structure = structure  # the state's structure record, for the manifest

    def check_target(self, overwrite: bool) -> None:
        self.store.check_target(overwrite)

    def stage(self, overwrite: bool) -> Staging:
        self.staging = self.store.stage(overwrite=overwrite, durable=self.opts.durable)
        return self.staging

    def staging_directory(self) -> str:
        """The local directory `stage` made (rank 0, while the save is staged)."""
        return os.fspath(cast(Any, self.staging.store))  # a LocalStorage: a path

    def write(self, where: Storage | str, generation: str | None, rank: RankSave, first: int,
              count: int) -> tuple[fmt.CheckpointIndex, list[bytes]]:
        return write_shards(
            where, rank.shards, rank.saved, self.opts, description=rank.description,
            threads=rank.threads, user_metadata=self.user_metadata, progress=self.progress,
            generation=generation, first_shard=first, shard_count=max(count, 1),
            strings=rank.strings, structure=self.structure)

    def commit(self, staging: Staging, merged: tuple[fmt.CheckpointIndex, list[bytes]]
               ) -> Outcome:
        index, chunks = merged
        staging.commit(chunks)
        files = [(s.file, s.bytes) for s in index.shards]
        files += [] if index.strings is None else [(index.strings.file, index.strings.size)]
        name, generation = staging.store.shard_name, index.generation
        return (str(staging.target), (*(name(f, generation) for f, _ in files), fmt.MANIFEST_FILE),
                sum(n for _, n in files) + sum(map(len, chunks)), generation)


class Steps:
    """The steps of one save on one rank, and the one relay of errors between ranks."""

    def __init__(self, coord: Coordinator, path: str, url: str) -> None:
        self.coord, self.path, self.url = coord, path, url
        self.staging: Any = None  # rank 0's `Staging`, once staged
        self.error: Exception | None = None  # this rank's, as raised

    def step(self, op: str, work: Callable[[], Any],
             then: Callable[[list[Any]], Any] | None = None, root_op: str | None = None
             ) -> Any:
        """`work` on every rank; its results, all-gathered (`op`), given to `then` on every
        rank, or with `root_op` gathered on rank 0, `then` of them run there and its result
        broadcast (`root_op`). Any failure is raised on every rank, the staging aborted;
        first, ranks that name different paths (an all-gather sends each rank's)."""
        value, failure = self._attempt(work)
        if root_op is None:
            got = self.coord.all_gather((value, failure, self.url), op)
            try:
                if len({g[2] for g in got}) > 1:
                    raise DistributedStateError(
                        "the ranks of a collective save must name the same path; got "
                        + ", ".join(f"rank {r}: {g[2]}" for r, g in enumerate(got)))
                self._raise([g[1] for g in got])
                return [g[0] for g in got] if then is None else then([g[0] for g in got])
            except Exception:  # rank 0 aborts, every rank waits for that: no rank returns while
                self.abort()  # the temp directory exists (one barrier, on failure only)
                with contextlib.suppress(DistributedError):  # a rank gone cannot be waited for
                    self.coord.barrier("abort")
                raise
        gathered = self.coord.gather((value, failure), op)
        result: Any = None
        if gathered is not None:  # rank 0
            failures = [g[1] for g in gathered]
            if not any(failures) and then is not None:
                result, failure = self._attempt(lambda: then([g[0] for g in gathered]))
                failures = [failure]
            if any(failures):
                self.abort()  # before the others hear of the failure: no temp dir left
                result = failures
        result = self.coord.broadcast(result, root_op)
        if isinstance(result, list):
            self._raise(result)
        return result

    def abort(self) -> None:
        if self.staging is not None and not self.staging.committed:
            self.staging.abort()

    def _attempt(self, work: Callable[[], Any]) -> tuple[Any, Failure | None]:
        try:
            return work(), None
        except Exception as e:
            self.error = e
            return None, Failure(self.coord.rank, type(e).__name__, str(e) or "".join(
                traceback.format_exception_only(type(e), e)).strip())

    def _raise(self, failures: Sequence[Failure | None]) -> None:
        failed = [f for f in failures if f is not None]
        if not failed:
            return
        if isinstance(self.coord, LocalCoordinator) and self.error is not None:
            raise self.error  # a process alone: its own error, as it was raised
        f = failed[0]
        others = f" (and rank{'s' if len(failed) > 2 else ''} "
        others = (others + ", ".join(str(x.rank) for x in failed[1:]) + ")") if failed[1:] else ""
        error = DistributedSaveError(
            f"collective save of {self.path} failed on rank {f.rank}{others}: {f.type}: "
            f"{f.message}; nothing was published and any earlier checkpoint there is intact",
            f.rank, f.type, f.message)
        raise error from (self.error if f.rank == self.coord.rank else None)


def run_save(coord: Coordinator, rank: RankSave, output: StorageOutput | BundleOutput,
             path: str, overwrite: bool) -> Outcome:
    """Save over `coord` (the steps of the module docstring): `rank` is this rank's side of
    the save, `output` its format, `path` as the caller named it (for messages)."""
    steps = Steps(coord, path, output.url)
    me = coord.rank

    def hold() -> Any:
        if me == 0:
            output.check_target(overwrite)  # fail fast, before the callback runs
        return rank.hold(me)

    def shard() -> tuple[int, tuple[str, str | None] | None]:
        count = rank.shard()
        if me != 0:
            return count, None
        staging = steps.staging = output.stage(overwrite)
        return count, (staging.store.url, staging.generation)

    try:
        steps.step("plan", hold, rank.assign)
        counts = steps.step("shards", shard)
        url, generation = counts[0][1]
        where = url if steps.staging is None else steps.staging.store
        first, count = sum(c for c, _ in counts[:me]), sum(c for c, _ in counts)
        return steps.step(
            "index", lambda: rank.part(rank.write(output, where, generation, first, count)),
            lambda parts: output.commit(steps.staging, rank.merge(parts, output, generation)),
            root_op="commit")
    finally:
        steps.abort()
