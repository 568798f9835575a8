"""CheckpointManager: numbered checkpoints of a `Checkpoint` in one directory (TensorFlow's API).

In shardkit's format each checkpoint is a directory ``<checkpoint_name>-<number>``; with
``format="tensorflow"`` each is a TensorBundle prefix ``<checkpoint_name>-<number>`` and the
directory holds TensorFlow's ``checkpoint`` state file (``adapters.tensorbundle.state``), so
TensorFlow's own ``tf.train.CheckpointManager`` and ``tf.train.latest_checkpoint`` see them.
"""

from __future__ import annotations

import math
import operator
import os
import re
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import (
    CheckpointNotFoundError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    RetentionWarning,
    ShardkitError,
)
from ..io.options import CheckpointOptions
from ..io.restore import CheckpointLoadStatus
from ..io.snapshot import SaveHandle
from ..storage import is_url, open_storage
from .tracked_state import is_tensor

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

FORMATS = ("shardkit", "tensorflow")


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

    With ``format="tensorflow"`` each checkpoint is a TensorFlow TensorBundle prefix
    (``ckpt-N.index``, ``ckpt-N.data-*``) and, after each one is committed, the directory's
    ``checkpoint`` state file is replaced atomically as TensorFlow's manager writes it (the kept
    prefixes, their timestamps, the last preserved timestamp); the listing and retention follow
    that file, so this manager and TensorFlow's read and manage the same directory.
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
        format: str = "shardkit",
    ) -> None:
        if not callable(getattr(checkpoint, "_write", None)):  # a shardkit Checkpoint
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
        if format not in FORMATS:
            raise InvalidArgumentError(
                f"format must be 'shardkit' or 'tensorflow', got {format!r}")
        if format == "tensorflow" and (process_group is not None or is_url(directory)):
            raise InvalidArgumentError(
                "format='tensorflow' is written by one process to a local directory; save "
                "shardkit's format collectively or to a URL, then `shardkit convert` it")
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
        self._format = format
        self._created = time.time()  # TensorFlow's first last_preserved_timestamp
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
    def format(self) -> str:
        """``"shardkit"`` or ``"tensorflow"``: the format the checkpoints are written in."""
        return self._format

    @property
    def latest_checkpoint(self) -> str | None:
        """The committed checkpoint with the highest number (in TensorFlow's format: the one
        the state file names), or None.

        Raises:
            CheckpointNotFoundError: TensorFlow's state file names a checkpoint whose files
                are missing.
            CorruptIndexError: the state file does not parse.
        """
        if self._format == "tensorflow":
            return self._tf_latest()
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
        if self._format == "tensorflow":
            return self._tf_listing()
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
        if self._format == "tensorflow":
            handle = self._checkpoint._write(path, options, after_commit=self._tf_record,
                                             format="tensorflow")
        else:
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

    # -- TensorFlow's format: the state file

    def _tf_state(self) -> Any:
        """The directory's state file (adapters.tensorbundle.state.CheckpointState), or one
        listing the committed ``<name>-<number>`` prefixes found when there is no state file."""
        from ..adapters.tensorbundle import state as tfstate

        found = tfstate.read_state(self._directory)
        if found is not None:
            return found
        names = []
        if os.path.isdir(self._directory):
            for entry in os.listdir(self._directory):
                stem = entry[: -len(".index")] if entry.endswith(".index") else None
                if stem is not None and (m := self._pattern.fullmatch(stem)):
                    names.append((int(m.group(1)), stem))
        names.sort()
        paths = [n for _, n in names]
        stamps = [os.stat(os.path.join(self._directory, n + ".index")).st_mtime for n in paths]
        # TensorFlow's manager manages only the checkpoints stamped after last_preserved: the
        # prefixes found (a save killed before its first state file) are older than this one
        preserved = min([self._created, *stamps]) - 1.0
        return tfstate.CheckpointState(paths[-1] if paths else None, paths, stamps, preserved)

    def _tf_listing(self) -> list[tuple[int, str]]:
        from ..adapters.tensorbundle.state import is_committed

        state = self._tf_state()
        return [(i, os.path.join(self._directory, name)) for i, name in enumerate(state.paths)
                if is_committed(self._directory, name)]

    def _tf_latest(self) -> str | None:
        from ..adapters.tensorbundle.state import is_committed, state_path

        latest = self._tf_state().latest
        if latest is None:
            return None
        if not is_committed(self._directory, latest):
            raise CheckpointNotFoundError(
                f"{state_path(self._directory)} names {latest!r} as the latest checkpoint, but "
                f"{latest}.index is missing in {self._directory}: the checkpoint was deleted "
                "or moved; remove the state file or restore that checkpoint")
        return os.path.join(self._directory, latest)

    def _tf_record(self, new_path: str) -> None:
        """After `new_path` is committed: record it in the state file (replaced atomically),
        then delete the prefixes beyond `max_to_keep`, as TensorFlow's manager does (a
        prefix kept by ``keep_checkpoint_every_n_hours`` leaves the state file but stays).

        The prefixes to delete are recorded first (`state.write_removals`) and the record
        removed once they are gone, so deletions a kill interrupted (after the state file
        left them out: nothing else names them any more) are finished by the next save."""
        from ..adapters.tensorbundle import state as tfstate

        new = os.path.basename(new_path)
        pending = tfstate.read_removals(self._directory)
        state = self._tf_state()
        kept = dict(zip(state.paths, state.timestamps or [self._created] * len(state.paths)))
        kept.pop(new, None)
        kept[new] = time.time()
        last_preserved = state.last_preserved
        doomed = []
        while self._max_to_keep is not None and len(kept) > self._max_to_keep:
            name = next(iter(kept))
            stamp = kept.pop(name)
            if self._keep_seconds is not None and stamp - self._keep_seconds >= last_preserved:
                last_preserved = stamp
                continue
            doomed.append(name)
        doomed += [n for n in pending if n not in kept and n not in doomed
                   and self._pattern.fullmatch(n)]  # left by a killed retention
        if doomed:
            tfstate.write_removals(self._directory, doomed)
        tfstate.write_state(self._directory, tfstate.CheckpointState(
            new, list(kept), list(kept.values()), last_preserved))
        failed = False
        for name in doomed:
            try:
                tfstate.remove_prefix(self._directory, name)
            except OSError as e:  # the new checkpoint is committed: keep going
                failed = True
                warnings.warn(f"{name}: not deleted by retention: {e}", RetentionWarning,
                              stacklevel=3)
        if (doomed or pending) and not failed:
            tfstate.write_removals(self._directory, [])

    @staticmethod
    def _remove(path: str) -> None:
        try:
            open_storage(path).remove_checkpoint()
        except ShardkitError as e:  # the new checkpoint is committed: keep going
            warnings.warn(f"{path}: not deleted by retention: {e}", RetentionWarning,
                          stacklevel=3)


__all__ = ["CheckpointManager"]
