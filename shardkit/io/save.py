"""The functional front door: ``save`` (and, from the reader, ``load``, ``open``, ``restore_into``).

    info = shardkit.save("ckpt", {"model": {"w": w, "b": b}}, overwrite=True)
    state = shardkit.load("ckpt")

`save` flattens the state, runs the sharding callback once per device task, validates its shards
before writing a byte, writes the shard files in parallel into a hidden temp directory and
publishes it atomically (shardkit.storage.commit). A failed save leaves any earlier checkpoint
intact.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import operator
import os
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from .. import format as fmt
from ..coordinator import LocalCoordinator
from ..errors import (
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvalidMetadataError,
    PolicyError,
    SplitTensorsWarning,
)
from ..frameworks import dtensor_type, expand_objects, module_state
from ..optional import require
from ..sharding.callback import Shard, ShardingCallback, shard_tensors
from ..sharding.policies import get_policy, register_policy
from ..sharding.structure import record as record_structure
from ..sharding.tensors import (
    ShardableTensor,
    gc_paused,
    host_columns,
    shardable_tensors,
)
from ..storage import is_url, open_storage
from ..values.dtypes import stored_nbytes
from ..values.slices import WHOLE
from ..values.strings import StringColumns
from .flow import RankSave, StorageOutput, run_save
from .options import CheckpointOptions, check_options, check_threads
from .reader import load
from .reader import open_checkpoint as open  # shardkit.open; this module never needs the builtin
from .restore import restore_into
from .writer import SavedTensors, ShardColumns, default_threads, pick_rows, shard_columns

SINGLE_SHARD_BELOW = 64 * 1024 * 1024
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # HuggingFace's default max_shard_size ("5GB")


@dataclass(frozen=True, slots=True)
class SaveInfo:
    """What a save wrote: the checkpoint `path`, its `files` (shards, then the manifest), their
    total size in `bytes`, the wall time in `seconds`, and the checkpoint's `generation` (the
    unique id recorded in the manifest and every shard header)."""

    path: str
    files: tuple[str, ...]
    bytes: int
    seconds: float
    generation: str | None = None


class DefaultShardingPolicy(ShardingCallback):
    """shardkit's default: one shard for small states, else near-equal shards, one per thread.

    A state under 64 MiB goes into one shard (a second file costs more than it saves). A larger
    state is cut, in the order given and between whole tensors, into ``max(threads,
    ceil(total / max_shard_size))`` shards of near-equal size: the writer writes separate files
    in parallel, and shards stay under HuggingFace's 5 GB default. Tensors are never split, so
    every tensor stays readable by any safetensors or HuggingFace tool through ``weight_map``;
    a tensor larger than the cap gets its own shard.
    """

    def __init__(self, threads: int | None = None, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE):
        check_threads(threads)
        if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int):
            raise InvalidArgumentTypeError(
                f"max_shard_size must be an int, got {max_shard_size!r}")
        if max_shard_size < 1:
            raise PolicyError(f"max_shard_size must be positive, got {max_shard_size}")
        self.threads = threads or default_threads()
        self.max_shard_size = max_shard_size

    @property
    def description(self) -> str:
        return (
            f"shardkit default: near-equal shards, one per writer thread (threads={self.threads}"
            f", max_shard_size={self.max_shard_size}, one shard below {SINGLE_SHARD_BELOW} bytes)"
        )

    def __call__(self, shardable_tensors: Sequence[ShardableTensor]) -> list[Shard]:
        tensors = list(shardable_tensors)
        arrays = list(map(_tensor_of, tensors))
        bounds = self.bounds(list(map(_nbytes_of, arrays)))
        keys = list(map(_key_of, tensors))
        specs = list(map(_spec_of, tensors))
        if len(set(keys)) == len(keys):  # no key split over several inputs: one dict each
            return [
                dict(zip(keys[a:b], [{s: x} for s, x in zip(specs[a:b], arrays[a:b])]))
                for a, b in bounds
            ]
        shards: list[Shard] = []
        for a, b in bounds:
            current: Shard = {}
            for key, spec, array in zip(keys[a:b], specs[a:b], arrays[a:b]):
                current.setdefault(key, {})[spec] = array
            if current:
                shards.append(current)
        return shards

    def bounds(self, sizes: list[int] | np.ndarray) -> list[tuple[int, int]]:
        """Where this policy cuts tensors of these byte sizes into shards.

        Args:
            sizes: the stored bytes of each tensor, in the order given.
        Returns:
            ``(start, stop)`` of each shard over the tensors.
        """
        n = len(sizes)
        total = int(np.sum(sizes)) if n else 0
        if total < SINGLE_SHARD_BELOW:
            count = 1
        else:
            count = max(self.threads, math.ceil(total / self.max_shard_size))
        count = max(1, min(count, n))
        if total <= self.max_shard_size:  # no cap can bite: cuts at equal-share points only
            return self._equal_share_bounds(np.asarray(sizes, np.int64), total, count)
        sizes = list(map(int, sizes))
        # where each shard starts: the loop only does arithmetic
        starts = [0]
        filled = done = 0
        for i, size in enumerate(sizes):
            if i > starts[-1] and (
                filled + size > self.max_shard_size
                # cut when this tensor's midpoint passes the next equal-share boundary
                or (len(starts) < count and done + size / 2 > len(starts) * total / count)
            ):
                starts.append(i)
                filled = 0
            filled += size
            done += size
        return [(a, b) for a, b in zip(starts, [*starts[1:], len(sizes)]) if b > a]

    @staticmethod
    def _equal_share_bounds(sizes: np.ndarray, total: int, count: int) -> list[tuple[int, int]]:
        """The loop of `bounds` without the cap, vectorised: shard k starts at the first
        tensor after the previous start whose midpoint passes ``k * total / count``."""
        n = len(sizes)
        if n == 0:
            return []
        mids = (np.cumsum(sizes) - sizes) + sizes / 2  # float64, as the loop computes it
        starts = [0]
        for k in range(1, count):
            i = max(int(np.searchsorted(mids, k * total / count, side="right")), starts[-1] + 1)
            if i >= n:
                break
            starts.append(i)
        return list(zip(starts, [*starts[1:], n]))


register_policy("default", DefaultShardingPolicy)  # get_policy("default"), plan --policy default

_tensor_of = operator.attrgetter("tensor")
_nbytes_of = stored_nbytes  # half the array's bytes for float4_e2m1fn
_key_of = operator.attrgetter("checkpoint_key")
_spec_of = operator.attrgetter("slice_spec")


def save(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    options: CheckpointOptions | None = None,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    progress: bool = False,
    format: str = "shardkit",
    process_group: Any = None,
    timeout: float | None = None,
    **deprecated: Any,
) -> SaveInfo:
    """Save `state` (nested dicts / lists of arrays) as a sharded checkpoint directory at `path`.

    The state is flattened to ``/``-joined keys (shardkit.values.keys: non-empty, unique, valid
    UTF-8, not ``__metadata__``; dict keys str or int), the sharding callback of `options` runs
    once per device task and its shards are validated before any byte is written, and the
    shards are published with one atomic rename. With a callback that keeps tensors whole (the
    default, ShardByTaskPolicy, AllInOnePolicy) and no compression, the directory is a
    HuggingFace sharded safetensors checkpoint as it stands; when the callback splits tensors,
    the save warns once with `SplitTensorsWarning` (HuggingFace loaders cannot read them).

    Args:
        path: the checkpoint directory, or a URL (``s3://bucket/prefix``); with
            ``format="tensorflow"``, TensorFlow's file prefix.
        state: nested dicts, lists and tuples of arrays (numpy, torch, JAX, TensorFlow) and
            numbers, a TensorFlow object, or a torch ``nn.Module`` (its ``state_dict()`` is
            saved; docs/API.md lists what it may hold).
        options: how to write: the sharding callback, compression, durability, threads,
            checksums (`CheckpointOptions`; None: the defaults, `DefaultShardingPolicy`).
        metadata: a JSON-serialisable dict stored in the manifest as ``user_metadata``.
        overwrite: replace an existing checkpoint at `path` atomically; a path that is not a
            shardkit checkpoint is never replaced.
        progress: show a tqdm progress bar in bytes.
        format: ``"shardkit"``, or ``"tensorflow"`` for TensorFlow's TensorBundle
            (``<path>.index`` and ``<path>.data-0000i-of-0000n``, read by
            ``tf.train.load_checkpoint``); it refuses compression, metadata and progress.
        process_group: save collectively with the ranks of this torch.distributed group (or a
            `shardkit.distributed.Coordinator`); every rank calls `save` with the same path and
            writes its own shards (docs/TRAINING.md). A state of DTensors is saved over their
            mesh's group without it.
        timeout: seconds a collective save waits for the other ranks at each step (default
            300).
        **deprecated: the keywords `CheckpointOptions` now holds (sharding_callback, threads,
            durable, checksum, compression, level, shuffle, chunk_size) still work for one
            release, with a DeprecationWarning.
    Returns:
        A `SaveInfo`: the path, the files written, their bytes, the time taken, the generation.
    Raises:
        CheckpointExistsError: `path` exists and `overwrite` is False.
        ShardingValidationError: the callback's shards break a rule.
        InvalidKeyError: a key breaks a rule (InvalidKeyTypeError for a key's type).
        InvalidArgumentError: a bad argument (InvalidArgumentTypeError for its type).
        UnsupportedDTypeError: a value no checkpoint can hold.
        DistributedError: a collective save failed on some rank (DistributedTimeoutError when
            a rank did not answer in time).
        OSError: the disk failed or is full.

    A failure at any point leaves any earlier checkpoint at `path` intact and no temporary
    directory behind.
    """
    started = time.perf_counter()
    opts = _resolve_options(options, deprecated)
    if opts.enable_async:
        raise InvalidArgumentError(
            "enable_async=True: the functional save() is synchronous; run it in your own "
            "thread, or use a checkpoint manager"
        )
    for name, value in (("overwrite", overwrite), ("progress", progress)):
        if not isinstance(value, bool):
            raise InvalidArgumentTypeError(f"{name} must be True or False, got {value!r}")
    user_metadata = _check_metadata(metadata)
    state = module_state(state)
    state = expand_objects(state)  # TensorFlow objects: TensorFlow's keys
    if not isinstance(state, Mapping):
        raise InvalidArgumentTypeError(
            f"state must be a mapping (e.g. a dict of arrays), got {type(state).__name__}"
        )
    if format not in ("shardkit", "tensorflow"):
        raise InvalidArgumentError(f"format must be 'shardkit' or 'tensorflow', got {format!r}")
    structure, state = record_structure(state)
    coord = _coordinator(state, process_group, timeout)
    if format == "tensorflow":
        _check_tensors_only(structure)
        if coord is not None:
            raise InvalidArgumentError(
                "format='tensorflow' is written by one process: a collective save (DTensors "
                "or process_group=) writes shardkit's format; convert it afterwards with "
                "`shardkit convert`")
        if is_url(path):
            raise InvalidArgumentError(
                f"{path}: format='tensorflow' writes local files only; save shardkit's format "
                "to the URL, or write the TensorFlow checkpoint locally and upload it")
        from ..adapters.tensorbundle.writer import BundleOutput

        output: StorageOutput | BundleOutput = BundleOutput(os.fspath(path), opts,
                                                            user_metadata, progress)
    else:
        output = StorageOutput(open_storage(path), opts, user_metadata, progress, structure)
    with gc_paused():  # a save creates objects per tensor; cyclic GC passes would be wasted
        if coord is None:  # a TensorBundle has no aliases: it stores every name
            rank: RankSave = _LocalRank(state, opts, DefaultShardingPolicy,
                                        share=format == "shardkit")
            coord = LocalCoordinator()
        else:
            from ..distributed.save import CollectiveRank

            rank = CollectiveRank(state, opts, DefaultShardingPolicy, structure=structure)
            rank.target = os.fspath(path)
        target, files, nbytes, generation = run_save(coord, rank, output, os.fspath(path),
                                                     overwrite)
    opts.run_write_callbacks(target)
    info = SaveInfo(target, files, nbytes, time.perf_counter() - started, generation)
    if rank.split and format == "shardkit" and _WARN_SPLIT.get():  # weight_map lacks them
        warnings.warn(SplitTensorsWarning(_split_message(list(rank.split), info.path,
                                                         rank.split_reason)), stacklevel=2)
    return info


def _check_tensors_only(structure: list[Any] | None) -> None:
    """A TensorBundle holds tensors only: refuse the values only a structure record keeps."""
    for path, kind, *_ in structure or ():
        if kind in ("none", "str", "bigint"):
            key = "/".join(map(str, path))
            raise InvalidArgumentError(
                f"{key!r}: format='tensorflow' stores tensors only, and this {kind} is not one; "
                "save shardkit's format (which records it) or leave it out of the state")


def _coordinator(state: Mapping[str, Any], process_group: Any, timeout: float | None) -> Any:
    """The coordinator of a collective save, or None: shardkit.distributed is not even
    imported unless torch.distributed.tensor is loaded or a group is given."""
    if process_group is None and timeout is None and dtensor_type() is None:
        return None
    from ..distributed.routing import coordinator_for

    return coordinator_for(state, process_group, timeout)


_WARN_SPLIT: contextvars.ContextVar[bool] = contextvars.ContextVar("shardkit_warn_split",
                                                                   default=True)


@contextlib.contextmanager
def _no_split_warning() -> Iterator[None]:
    """`save` without SplitTensorsWarning, in this thread: for `Checkpoint`, whose keys are
    object paths that no HuggingFace loader reads anyway."""
    token = _WARN_SPLIT.set(False)
    try:
        yield
    finally:
        _WARN_SPLIT.reset(token)


def _split_message(split: list[str], path: str, reason: str = "") -> str:
    count = f"{len(split)} tensor{'s' if len(split) != 1 else ''}"
    if reason:  # a collective save that could not write them whole
        return (
            f"{path}: the collective save stored {count} as per-rank slices (e.g. "
            f"{split[0]!r}) because {reason}; HuggingFace loaders (from_pretrained, "
            f"safetensors) cannot read a tensor stored as slices (shardkit reads it as usual): "
            f"`shardkit convert {path} <new path>` writes every tensor whole")
    return (
        f"{path}: the sharding callback stored {count} as slices (e.g. {split[0]!r}); "
        f"HuggingFace loaders (from_pretrained, safetensors) cannot read a tensor stored as "
        f"slices: it is absent from weight_map in {fmt.MANIFEST_FILE} (shardkit reads it as "
        "usual). DefaultShardingPolicy, ShardByTaskPolicy and AllInOnePolicy keep tensors whole"
    )


class _LocalRank(RankSave):
    """A process alone's side of the save flow (`io.flow.RankSave`): its whole state."""

    def shard(self) -> int:
        """The validated shards of the state, the saved tensors, and the keys the callback
        split; string tensors go to `strings` instead (their own file, not the callback's)."""
        callback, strings = self.callback(), StringColumns()
        self.strings = strings
        aliases: dict[str, str] | None = {} if self.share else None
        planned = (_default_shards(callback, self.state, strings, aliases)
                   if type(callback) is DefaultShardingPolicy else None)
        if planned is None:
            tensors = shardable_tensors(self.state, strings=strings, aliases=aliases)
            self.shards = shard_columns(shard_tensors(callback, tensors))
            self.saved = SavedTensors.of(tensors, aliases)
            self.split = list(dict.fromkeys(  # stored as slices: absent from weight_map
                key for shard in self.shards if any(shard.specs)
                for key, spec in zip(shard.keys, shard.specs) if spec != WHOLE))
        else:
            self.shards, self.saved = planned
        return len(self.shards)


def _default_shards(
    policy: DefaultShardingPolicy, state: Mapping[str, Any], strings: StringColumns | None = None,
    aliases: dict[str, str] | None = None,
) -> tuple[list[ShardColumns], SavedTensors]:
    """The default policy's shards, planned on columns without building a ShardableTensor per
    tensor. Its output is valid by construction (every input once, as given, on its own
    task), which is what `shard_tensors` would check; `host_columns` has checked the keys
    (unique, among other rules: shardkit.values.keys); `aliases` as there."""
    keys, arrays, devices, dtypes, nbytes, shapes, distinct = host_columns(state, None, strings,
                                                                            aliases)
    tasks = {d.task or 0 for d in distinct}
    groups: dict[int, range | list[int]]
    if len(tasks) <= 1:  # one task (always, for numpy arrays)
        groups = {tasks.pop() if tasks else 0: range(len(keys))}
    else:
        by_task: dict[int, list[int]] = {}
        for i, d in enumerate(devices):
            by_task.setdefault(d.task or 0, []).append(i)
        groups = {**by_task}
    shards: list[ShardColumns] = []
    for task, rows in groups.items():
        if len(groups) == 1:
            k, a_, d_, n_, s_ = keys, arrays, dtypes, nbytes, shapes
        else:  # this task's tensors, in the order given
            k, a_, d_, s_ = pick_rows(rows, keys, arrays, dtypes, shapes)
            n_ = nbytes[rows]
        for a, b in policy.bounds(n_):
            shards.append(ShardColumns(
                task, k[a:b], [WHOLE] * (b - a), a_[a:b], dtypes=d_[a:b], nbytes=n_[a:b],
                shapes=s_[a:b], rows=range(a, b) if len(groups) == 1 else rows[a:b]))
    names = {id(d): d.to_string() for d in distinct}
    device_names = ([names[id(devices[0])]] * len(devices) if len(names) == 1
                    else list(map(names.__getitem__, map(id, devices))))
    saved = SavedTensors(keys, dtypes, shapes, device_names, int(nbytes.sum()), aliases or {})
    return shards, saved


_OPTION_KEYWORDS = {  # the save() keywords that moved into CheckpointOptions -> its field
    "sharding_callback": "experimental_sharding_callback", "threads": "threads",
    "durable": "durable", "checksum": "checksum", "compression": "compression",
    "level": "level", "shuffle": "shuffle", "chunk_size": "chunk_size",
}


def _resolve_options(options: CheckpointOptions | None, given: dict[str, Any]
                     ) -> CheckpointOptions:
    """The options of a save: `options`, and any deprecated keyword (warned) that agrees."""
    unknown = sorted(set(given) - set(_OPTION_KEYWORDS))
    if unknown:
        raise InvalidArgumentTypeError(f"save() got an unexpected keyword argument {unknown[0]!r}")
    if not given:
        return check_options(options)
    spelled = ", ".join(f"{_OPTION_KEYWORDS[k]}={v!r}" for k, v in given.items())
    warnings.warn(f"the save() keywords {', '.join(given)} are deprecated: pass "
                  f"options=CheckpointOptions({spelled}) (the keywords go in the next release)",
                  DeprecationWarning, stacklevel=3)
    chosen = {_OPTION_KEYWORDS[k]: v for k, v in given.items()}
    if options is None:
        return CheckpointOptions(**chosen)
    checked = check_options(options)
    defaults = {f.name: f.default for f in fields(CheckpointOptions)}
    for keyword, value in given.items():  # a keyword at its default defers to options
        name = _OPTION_KEYWORDS[keyword]
        if value is not defaults[name] and value != defaults[name] \
                and value != getattr(checked, name):
            raise InvalidArgumentError(
                f"save(..., {keyword}={value!r}) conflicts with options.{name}="
                f"{getattr(checked, name)!r}; set it in one place only")
    return checked


def _check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidArgumentTypeError(f"metadata must be a dict, got {type(metadata).__name__}")
    data = dict(metadata)
    levels = fmt.MAX_DEPTH - 2  # user_metadata is level 3 of the manifest
    try:
        if not fmt.nesting_within(json.loads(json.dumps(data, allow_nan=False)), levels):
            raise RecursionError
    except RecursionError:
        raise InvalidMetadataError(
            f"metadata is nested more than {levels} levels deep; the manifest allows "
            f"{fmt.MAX_DEPTH} levels (user_metadata is level 3)") from None
    except (TypeError, ValueError) as e:
        raise InvalidArgumentTypeError(
            f"metadata must be JSON-serialisable (str keys; str, numbers, bools, None, lists, "
            f"dicts; no NaN): {e}"
        ) from None
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise InvalidArgumentTypeError(f"metadata keys must be str, got {bad[0]!r}")
    return data


def as_tensorflow_callback(callback: Any) -> Any:
    """`callback` as a ``tf.train.experimental.ShardingCallback`` for TensorFlow's own saver.

    ``tf.train.CheckpointOptions(experimental_sharding_callback=as_tensorflow_callback(p))``.

    Args:
        callback: a shardkit `ShardingCallback`.
    Returns:
        The wrapper (`frameworks.tf_saver_callback.TensorFlowShardingCallback`).
    Raises:
        MissingDependencyError: TensorFlow is not installed.
        InvalidArgumentTypeError: `callback` is not a shardkit `ShardingCallback`.
    """
    require("tensorflow", "as_tensorflow_callback")
    from ..sharding.tf_saver_callback import as_tensorflow_callback as wrap

    return wrap(callback)


__all__ = [
    "DefaultShardingPolicy", "SaveInfo", "as_tensorflow_callback", "get_policy", "load", "open",
    "restore_into", "save",
]
