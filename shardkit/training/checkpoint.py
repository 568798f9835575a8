"""Checkpoint and CheckpointManager: a drop-in saver for training loops, in TensorFlow's terms.

    ckpt = Checkpoint(model=model, optimizer=optimizer)
    manager = CheckpointManager(ckpt, "runs/ckpt", max_to_keep=3)
    manager.restore_or_initialize()
    ...
    manager.save(checkpoint_number=step, options=CheckpointOptions(enable_async=True))

A `Checkpoint` tracks named objects: nested dicts of arrays (numpy, torch, JAX), torch modules
and optimizers, and anything with ``state_dict()`` / ``load_state_dict()``. Each tensor is stored
under ``<object name>/<path in its state>``; the structure of every state dict, with its
non-tensor values (optimizer hyperparameters, step counts, tuples, None), is stored as JSON in the
checkpoint's user metadata under ``"shardkit.checkpoint"``; the save counter is the 0-d int64
tensor ``save_counter``. Tensors that share memory (tied weights) are stored once and restored
into every alias. Restoring copies into the existing arrays and tensors in place. An async save
(``enable_async=True``) is described in docs/TRAINING.md.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import re
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import (
    InvalidArgumentError,
    InvalidArgumentTypeError,
    RestoreMismatchError,
    RetentionWarning,
    ShardkitError,
)
from ..frameworks import is_dtensor, module
from ..io import save as api
from ..io.options import CheckpointOptions, check_options
from ..io.reader import open_checkpoint
from ..io.restore import CheckpointLoadStatus, check_complete
from ..io.snapshot import AsyncWriter, HostBufferPool, SaveHandle
from ..sharding.tensors import SEPARATOR
from ..storage import open_storage
from ..values.keys import check_keys
from .tracked_state import (
    MISSING,
    StateCollector,
    StateRestorer,
    collect_tensor_keys,
    encode_skeleton,
    is_tensor,
    object_kind,
)

SAVE_COUNTER = "save_counter"
METADATA_KEY = "shardkit.checkpoint"
LAYOUT_VERSION = 1

# --- Checkpoint ---------------------------------------------------------------------------------


class Checkpoint:
    """Saves and restores named objects; TensorFlow's ``tf.train.Checkpoint`` for any framework.

    ``Checkpoint(model=model, optimizer=opt, data={"epoch": 0, "rng": rng_state})``. Objects are
    reachable as attributes (``ckpt.model``). `save` writes ``<prefix>-<save_counter>``, `write`
    writes exactly the path given; both return a `SaveHandle` (the path). `restore` / `read` copy
    the stored values into the existing arrays and tensors in place.

    Optimizers (and any object with ``state_dict()`` / ``load_state_dict()``): their existing
    state is filled in place, state not created yet (no step taken) is created from the
    checkpoint, and both go to ``load_state_dict``. JAX arrays, numpy scalars and Python values
    are immutable: they are replaced inside their containers (``ckpt.<name>`` for a top-level one).
    """

    def __init__(self, **objects: Any) -> None:
        kinds = {}
        for name, obj in objects.items():
            if name == SAVE_COUNTER:
                raise InvalidArgumentError(
                    f"{SAVE_COUNTER!r} is reserved for the checkpoint's save counter")
            if SEPARATOR in name:
                raise InvalidArgumentError(
                    f"object name {name!r} must not contain {SEPARATOR!r}")
            kinds[name] = object_kind(name, obj)
        self._objects: dict[str, Any] = dict(objects)
        self._kinds = kinds
        self._save_counter = 0
        self._pool = HostBufferPool()
        self._writer = AsyncWriter()

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects")
        if objects is not None and name in objects:
            return objects[name]
        raise AttributeError(f"Checkpoint has no object or attribute {name!r}")

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(self._objects)}; save_counter={self._save_counter})"

    @property
    def save_counter(self) -> int:
        """How many times `save` (or a manager) numbered a checkpoint; saved and restored."""
        return self._save_counter

    # -- writing

    def save(self, file_prefix: str | os.PathLike[str],
             options: CheckpointOptions | None = None, *, process_group: Any = None,
             timeout: float | None = None) -> SaveHandle:
        """Increment `save_counter` and write ``<file_prefix>-<save_counter>``.

        Args:
            file_prefix: the path before ``-<save_counter>``.
            options, process_group, timeout: as for `write`.
        Returns:
            The `SaveHandle` (the checkpoint's path).
        Raises:
            ShardkitError: what `write` raises.
        """
        self._writer.wait()
        self._save_counter += 1
        return self._write(f"{os.fspath(file_prefix)}-{self._save_counter}", options,
                           process_group=process_group, timeout=timeout)

    def write(self, file_prefix: str | os.PathLike[str],
              options: CheckpointOptions | None = None, *, process_group: Any = None,
              timeout: float | None = None) -> SaveHandle:
        """Write the checkpoint at exactly `file_prefix` (replacing one already there).

        An async collective save commits from the background over a process group of its own,
        never interleaving with the training loop's collectives.

        Args:
            file_prefix: the checkpoint's path or URL.
            options: how to write (`CheckpointOptions`; ``enable_async`` writes in the
                background after a snapshot).
            process_group: save collectively, as `shardkit.save`: every rank calls it, each
                writes its own shards (also without it when the objects hold DTensors).
            timeout: seconds a collective save waits for the other ranks at each step.
        Returns:
            The `SaveHandle` (the checkpoint's path), already durable unless async.
        Raises:
            ShardkitError: what `shardkit.save` raises (for an async save: a pending write's
                error, here or from the handle).
        """
        return self._write(os.fspath(file_prefix), options, process_group=process_group,
                           timeout=timeout)

    def sync(self) -> None:
        """Wait for a pending async save; raise its error if it failed."""
        self._writer.wait()

    wait_until_finished = sync

    def _write(self, path: str, options: CheckpointOptions | None,
               after_commit: Callable[[str], None] | None = None, *,
               process_group: Any = None, timeout: float | None = None) -> SaveHandle:
        opts = check_options(options)
        self._writer.wait()
        tensors, metadata = self._collect()
        coord = api._coordinator(tensors, process_group, timeout)  # None: this process alone

        def write(target: str, tensors: dict[str, Any], opts: CheckpointOptions) -> str:
            with api._no_split_warning():
                info = api.save(target, tensors, options=opts, metadata=metadata,
                                overwrite=True, process_group=coord)
            if after_commit is not None:
                after_commit(info.path)
            return info.path

        if not opts.enable_async:
            return SaveHandle(write(path, tensors, opts))
        check_keys(list(tensors))  # here, not in the background write
        where: dict[str, Any] = {}
        if coord is not None:
            from ..distributed.routing import as_local_shards, local_parts

            tensors, where = local_parts(tensors)  # a rank snapshots its local shards only
            coord = coord.background()
        snapshot = self._pool.snapshot(tensors.items())
        del tensors  # the write must not see later changes
        if where:
            snapshot = as_local_shards(snapshot, where)
        write_opts = dataclasses.replace(opts, enable_async=False)
        target = open_storage(path).url
        return self._writer.submit(target, lambda: write(target, snapshot, write_opts))

    def _current(self, name: str) -> Any:
        obj = self._objects[name]
        kind = self._kinds[name]
        if kind == "tensorflow":
            return module("tensorflow").object_variables(obj)  # {key: variable}
        return obj if kind in ("array", "tree") else obj.state_dict()

    def _collect(self) -> tuple[dict[str, Any], dict[str, Any]]:
        col = StateCollector()
        objects = {name: {"kind": kind, "tree": encode_skeleton(self._current(name), name, col)}
                   for name, kind in self._kinds.items()}
        col.tensor(SAVE_COUNTER, np.array(self._save_counter, np.int64))
        metadata = {METADATA_KEY: {"version": LAYOUT_VERSION, "objects": objects}}
        return col.tensors, metadata

    # -- reading

    def read(self, save_path: str | os.PathLike[str],
             options: CheckpointOptions | None = None, *,
             partial: bool = False) -> CheckpointLoadStatus:
        """Restore every tracked object (and the save counter) from `save_path`, in place.

        Everything is checked before anything is changed: keys one to one, shapes and dtypes.

        Args:
            save_path: the checkpoint's path or URL.
            options: accepted as TensorFlow's (checked, otherwise unused).
            partial: restore what matches and leave the rest (the status lists it).
        Returns:
            The `CheckpointLoadStatus`.
        Raises:
            IncompleteRestoreError: values do not match one to one and `partial` is False.
            RestoreMismatchError: a shape or dtype differs, or ``load_state_dict`` refused.
            InvalidArgumentTypeError: `partial` is not a bool.
            CheckpointNotFoundError, CheckpointFormatError: as `shardkit.load`.
        """
        check_options(options)
        if not isinstance(partial, bool):
            raise InvalidArgumentTypeError(f"partial must be True or False, got {partial!r}")
        self._writer.wait()
        path = str(os.fspath(save_path))
        with open_checkpoint(path) as reader:
            layout = reader.metadata.get(METADATA_KEY)
            stored = _stored_objects(layout, path)
            plans = []
            for name, kind in self._kinds.items():
                current = self._current(name)
                enc = stored.get(name, {}).get("tree")
                if enc is None:  # not saved by a Checkpoint: match tensors by key
                    enc = encode_skeleton(current, name, StateCollector())
                plans.append((name, kind, current, enc, kind in ("optimizer", "stateful")))
            templates = self._state_templates()
            dry = StateRestorer(reader, dry=True, templates=templates)
            for name, _, current, enc, create in plans:
                dry.value(enc, current, name, create)
            if not partial:
                dry.used.add(SAVE_COUNTER)
                check_complete(path, dry.missing, [k for k in reader.keys() if k not in dry.used])
            restorer = StateRestorer(reader, dry=False, templates=templates)
            for name, kind, current, enc, create in plans:
                restorer.changed = False
                new = restorer.value(enc, current, name, create)
                self._apply(name, kind, current, new, restorer.changed, path)
            if SAVE_COUNTER in reader:
                restorer.used.add(SAVE_COUNTER)
                self._save_counter = int(reader.get(SAVE_COUNTER))
            unexpected = [k for k in reader.keys() if k not in restorer.used]
        return CheckpointLoadStatus(path, restorer.restored, restorer.missing, unexpected)

    def _state_templates(self) -> dict[str, Any]:
        """``"<optimizer>/state/<i>/"`` -> parameter i, for every tracked torch optimizer's
        DTensor parameters: state such an optimizer has not created yet is created like its
        parameter (a DTensor of the same placements, this rank's box restored), not as a full
        tensor the optimizer could not step with."""
        out: dict[str, Any] = {}
        for name, kind in self._kinds.items():
            if kind != "optimizer":
                continue
            params = [p for g in self._objects[name].param_groups for p in g["params"]]
            for i, p in enumerate(params):  # state_dict numbers them in this order
                if is_dtensor(p):
                    out[f"{name}{SEPARATOR}state{SEPARATOR}{i}{SEPARATOR}"] = p
        return out

    def restore(self, save_path: str | os.PathLike[str] | None,
                options: CheckpointOptions | None = None, *,
                partial: bool = False) -> CheckpointLoadStatus:
        """`read`, and TensorFlow's ``restore(None)``.

        Args:
            save_path: the checkpoint's path or URL; None restores nothing and raises nothing
                (the status lists every value as missing).
            options, partial: as for `read`.
        Returns:
            The `CheckpointLoadStatus`.
        Raises:
            ShardkitError: what `read` raises.
        """
        if save_path is None:
            self._writer.wait()
            col = StateCollector()
            for name in self._objects:
                collect_tensor_keys(self._current(name), name, col)
            return CheckpointLoadStatus(None, [], list(col.tensors), [])
        return self.read(save_path, options, partial=partial)

    def _apply(self, name: str, kind: str, current: Any, new: Any, changed: bool,
               path: str) -> None:
        obj = self._objects[name]
        if kind in ("array", "tree"):
            if new is not MISSING and new is not current:
                self._objects[name] = new
            return
        if kind == "module" and not changed:
            return  # every tensor was copied into the module's own memory
        if kind == "tensorflow":
            return  # every variable was assigned in place
        try:
            obj.load_state_dict(new)
        except (KeyError, ValueError, RuntimeError, TypeError) as e:
            raise RestoreMismatchError(
                f"cannot restore {name!r} from {path}: its load_state_dict rejected the "
                f"stored state: {e}"
            ) from e


def _stored_objects(layout: Any, path: str) -> dict[str, Any]:
    if layout is None:
        return {}
    if not isinstance(layout, dict) or not isinstance(layout.get("objects"), dict):
        raise RestoreMismatchError(
            f"{path}: user metadata {METADATA_KEY!r} is not a Checkpoint layout"
        )
    version = layout.get("version")
    if not isinstance(version, int) or version > LAYOUT_VERSION:
        raise RestoreMismatchError(
            f"{path}: Checkpoint layout version {version!r} is newer than this shardkit reads "
            f"({LAYOUT_VERSION}); upgrade shardkit"
        )
    return layout["objects"]


# --- CheckpointManager --------------------------------------------------------------------------


class CheckpointManager:
    """Numbered checkpoints in one directory, the newest `max_to_keep` kept (TensorFlow's API).

    Checkpoints are ``<directory>/<checkpoint_name>-<number>``. Everything the manager reports
    (`checkpoints`, `latest_checkpoint`) is read from the directory: only committed checkpoints
    (directories holding a shardkit manifest, ``model.safetensors.index.json``, which a save
    writes last; ``index.json`` for checkpoints of format 2.0 / 2.1) count, so a crash can never
    leave the manager pointing at a half-written one. Old checkpoints are deleted only after the
    new one is committed (durable, with the default options), and only directories that match
    this manager's naming exactly.

    ``keep_checkpoint_every_n_hours`` also keeps, among the older ones, one per that many hours
    (by its manifest's modification time); those are not in `checkpoints`. With
    ``process_group=`` (on every rank) saves are collective and rank 0 numbers and deletes; the
    listing is rank 0's, broadcast, so every rank reads it at the same point (docs/API.md).
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = 5,
        keep_checkpoint_every_n_hours: float | None = None,
        checkpoint_name: str = "ckpt",
        step_counter: Any = None,
        checkpoint_interval: int | None = None,
        init_fn: Callable[[], Any] | None = None,
        *,
        process_group: Any = None,
        timeout: float | None = None,
    ) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise InvalidArgumentTypeError(
                f"checkpoint must be a Checkpoint, got {type(checkpoint).__name__}")
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise InvalidArgumentError(
                f"max_to_keep must be a positive int or None, got {max_to_keep!r}")
        hours = keep_checkpoint_every_n_hours
        if hours is not None and (
            isinstance(hours, bool) or not isinstance(hours, (int, float))
            or not math.isfinite(hours) or hours <= 0
        ):
            raise InvalidArgumentError(
                f"keep_checkpoint_every_n_hours must be a positive number, got {hours!r}"
            )
        if not isinstance(checkpoint_name, str) or not checkpoint_name or (
            checkpoint_name.startswith(".") or os.sep in checkpoint_name
            or (os.altsep and os.altsep in checkpoint_name)
        ):
            raise InvalidArgumentError(
                f"checkpoint_name must be a plain file name not starting with '.', got "
                f"{checkpoint_name!r}"
            )
        if checkpoint_interval is not None:
            if isinstance(checkpoint_interval, bool) or not isinstance(checkpoint_interval, int) \
                    or checkpoint_interval < 1:
                raise InvalidArgumentError(
                    f"checkpoint_interval must be a positive int, got {checkpoint_interval!r}"
                )
            if step_counter is None:
                raise InvalidArgumentError(
                    "checkpoint_interval needs a step_counter to count steps")
        if init_fn is not None and not callable(init_fn):
            raise InvalidArgumentTypeError(f"init_fn must be callable, got {init_fn!r}")
        self._checkpoint = checkpoint
        self._storage = open_storage(os.fspath(directory))  # the one choice of storage
        self._directory = self._storage.url
        self._max_to_keep = max_to_keep
        self._keep_seconds = None if hours is None else hours * 3600.0
        self._name = checkpoint_name
        self._pattern = re.compile(re.escape(checkpoint_name) + r"-(0|[1-9][0-9]*)")
        self._step_counter = step_counter
        self._interval = checkpoint_interval
        self._init_fn = init_fn
        self._last_step: int | None = None
        self._restore_status: CheckpointLoadStatus | None = None
        self._coord: Any = None
        if process_group is not None or timeout is not None:
            from ..distributed.routing import coordinator_for

            self._coord = coordinator_for({}, process_group, timeout)

    @property
    def checkpoint(self) -> Checkpoint:
        """The managed `Checkpoint`."""
        return self._checkpoint

    @property
    def directory(self) -> str:
        """The directory (or URL) holding the checkpoints."""
        return self._directory

    @property
    def checkpoint_interval(self) -> int | None:
        """The steps between saves (None: every `save` saves)."""
        return self._interval

    @property
    def checkpoints(self) -> list[str]:
        """Paths of the managed committed checkpoints, oldest first (at most `max_to_keep`)."""
        paths = [p for _, p in self._committed()]
        return paths if self._max_to_keep is None else paths[-self._max_to_keep :]

    @property
    def restore_status(self) -> CheckpointLoadStatus | None:
        """The status of the last `restore_or_initialize` that restored a checkpoint, or None."""
        return self._restore_status

    @property
    def latest_checkpoint(self) -> str | None:
        """The committed checkpoint with the highest number, or None."""
        committed = self._committed()
        return committed[-1][1] if committed else None

    def _committed(self) -> list[tuple[int, str]]:
        """The committed checkpoints; in a distributed manager rank 0's listing, broadcast
        (a collective: every rank asks at the same point)."""
        if self._coord is None:
            return self._listing()
        found = self._listing() if self._coord.rank == 0 else None
        return list(self._coord.broadcast(found, "checkpoint listing"))

    def _listing(self) -> list[tuple[int, str]]:
        found = [(int(m.group(1)), path) for name, path in self._storage.children()
                 if (m := self._pattern.fullmatch(name))]
        found.sort()
        return found

    def _step(self) -> int:
        value = self._step_counter
        if callable(value) and not is_tensor(value):
            value = value()
        return int(value)

    def save(self, checkpoint_number: int | None = None, check_interval: bool = True,
             options: CheckpointOptions | None = None) -> SaveHandle | None:
        """Save ``<checkpoint_name>-<number>`` and delete checkpoints beyond `max_to_keep`.

        With ``options.enable_async`` the write and the deletions run in the background.

        Args:
            checkpoint_number: the number (default: the checkpoint's incremented save counter).
            check_interval: with `checkpoint_interval`, save only if the step counter advanced
                by at least that many steps since the last save (False forces a save).
            options: how to write (`CheckpointOptions`).
        Returns:
            The `SaveHandle`, or None when the interval skipped the save.
        Raises:
            InvalidArgumentError: a negative `checkpoint_number` (InvalidArgumentTypeError: not
                an int).
            ShardkitError: what `Checkpoint.write` raises.
        """
        self._checkpoint.sync()
        step = self._step() if self._step_counter is not None else None
        if self._interval is not None and check_interval and self._last_step is not None:
            assert step is not None
            if step < self._last_step + self._interval:
                return None
        if checkpoint_number is not None:
            if isinstance(checkpoint_number, (bool, float)):
                raise InvalidArgumentTypeError(
                    f"checkpoint_number must be an int, got {checkpoint_number!r}")
            number = operator.index(checkpoint_number)
            if number < 0:
                raise InvalidArgumentError(f"checkpoint_number must be >= 0, got {number}")
        self._checkpoint._save_counter += 1
        if checkpoint_number is None:
            number = self._checkpoint.save_counter
        sweep: Callable[[str], None] | None = self._sweep
        if self._coord is not None:  # rank 0 numbers the checkpoint and deletes old ones
            number, counter = self._coord.broadcast(
                (number, self._checkpoint._save_counter), "checkpoint number")
            self._checkpoint._save_counter = counter
            sweep = self._sweep if self._coord.rank == 0 else None
        path = os.path.join(self._directory, f"{self._name}-{number}")
        handle = self._checkpoint._write(path, options, after_commit=sweep,
                                         process_group=self._coord)
        if self._interval is not None:
            self._last_step = step
        return handle

    def sync(self) -> None:
        """Wait for a pending async save (and its deletions); raise its error."""
        self._checkpoint.sync()

    wait_until_finished = sync

    def restore_or_initialize(self, *, partial: bool = False) -> str | None:
        """Restore the latest checkpoint, else call `init_fn`.

        The restore is `Checkpoint.restore`; its `CheckpointLoadStatus` is kept as
        `restore_status`.

        Args:
            partial: restore what matches and leave the rest.
        Returns:
            The restored checkpoint's path (TensorFlow's return value), or None.
        Raises:
            IncompleteRestoreError: an incomplete match (nothing changed) and `partial` is False.
            ShardkitError: what `Checkpoint.restore` raises.
        """
        latest = self.latest_checkpoint
        if latest is None:
            if self._init_fn is not None:
                self._init_fn()
            return None
        self._restore_status = self._checkpoint.restore(latest, partial=partial)
        if self._step_counter is not None:
            self._last_step = self._step()
        return latest

    def _sweep(self, new_path: str) -> None:
        """Delete committed checkpoints older than the newest `max_to_keep` (not `new_path`)."""
        if self._max_to_keep is None:
            return
        committed = self._listing()
        for path in self._storage.interrupted_removals():  # a removal killed halfway
            self._remove(path)
        newest = {p for _, p in committed[-self._max_to_keep :]}
        newest.add(open_storage(new_path).url)
        last_kept: float | None = None
        for _, path in committed:
            if path in newest:
                continue
            if self._keep_seconds is not None:
                stamp = open_storage(path).commit_time()
                if last_kept is None or stamp >= last_kept + self._keep_seconds:
                    last_kept = stamp
                    continue
            self._remove(path)

    @staticmethod
    def _remove(path: str) -> None:
        try:
            open_storage(path).remove_checkpoint()
        except ShardkitError as e:  # the new checkpoint is committed: keep going
            warnings.warn(f"{path}: not deleted by retention: {e}", RetentionWarning,
                          stacklevel=3)


__all__ = [
    "Checkpoint",
    "CheckpointLoadStatus",
    "CheckpointManager",
    "CheckpointOptions",
    "SaveHandle",
]
