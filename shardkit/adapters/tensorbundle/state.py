"""TensorFlow's ``checkpoint`` state file: the CheckpointState text proto a TensorFlow
``tf.train.CheckpointManager`` keeps in its directory, read and written as TensorFlow's
``checkpoint_management.update_checkpoint_state_internal`` writes it (paths relative to the
directory, the newest last; the file replaced atomically), a prefix's files deleted, and the
retention record (`write_removals`) that lets a manager finish deletions a kill interrupted.

Both files are written in a locked temp directory (``.<file>.shardkit-tmp-<random>``) and
renamed into place, so a process killed while writing one leaves a stale temp directory, which
the next save in the directory removes (``storage.commit.cleanup_stale``), never a stray file.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import CheckpointNotFoundError, CorruptIndexError
from ...format.common import shown
from ...storage import commit
from .names import INDEX_SUFFIX, STATE_FILE


@dataclass
class CheckpointState:
    """What a state file holds: the newest prefix, every managed prefix with its timestamp
    (seconds since the epoch), oldest first, and the last preserved checkpoint's timestamp.
    Prefixes are file names inside the directory."""

    latest: str | None = None
    paths: list[str] = field(default_factory=list)
    timestamps: list[float] = field(default_factory=list)
    last_preserved: float = 0.0


def state_path(directory: str) -> str:
    return os.path.join(directory, STATE_FILE)


def _inside(directory: str, path: str, where: str) -> str:
    """`path` (relative to `directory`, or absolute inside it) as a name in `directory`."""
    if os.path.isabs(path):
        parent, name = os.path.split(path)
        try:
            same = os.path.samefile(parent, directory)
        except OSError:
            same = False
        if not same:
            raise CheckpointNotFoundError(
                f"{where}: checkpoint {shown(path)} is outside {directory}")
        path = name
    if "/" in path or path in ("", ".", ".."):
        raise CheckpointNotFoundError(f"{where}: checkpoint {shown(path)} is not in {directory}")
    return path


def parse_state_proto(data: bytes, path: str) -> Any:
    """The CheckpointState message of a state file's bytes, or CorruptIndexError naming `path`."""
    from .protos import CheckpointState as Proto
    from .protos import text_format

    proto = Proto()
    try:
        text_format.Parse(data.decode("utf-8"), proto)
    except (text_format.ParseError, UnicodeDecodeError) as e:
        raise CorruptIndexError(
            f"{path}: not a text-format CheckpointState (TensorFlow's checkpoint state file): "
            f"{e}") from None
    return proto


def read_state(directory: str) -> CheckpointState | None:
    """The state file of `directory`, or None when there is none.

    Raises:
        CorruptIndexError: the file is not a text-format CheckpointState, or its timestamps do
            not match its paths.
        CheckpointNotFoundError: it names a checkpoint outside `directory`.
    """
    path = state_path(directory)
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except FileNotFoundError:
        return None
    proto = parse_state_proto(data, path)
    paths = [_inside(directory, p, path) for p in proto.all_model_checkpoint_paths]
    stamps = list(proto.all_model_checkpoint_timestamps)
    if stamps and len(stamps) != len(paths):
        raise CorruptIndexError(
            f"{path}: {len(stamps)} timestamps for {len(paths)} checkpoint paths")
    latest = (_inside(directory, proto.model_checkpoint_path, path)
              if proto.model_checkpoint_path else None)
    return CheckpointState(latest, paths, stamps, proto.last_preserved_timestamp)


def write_state(directory: str, state: CheckpointState, durable: bool = True) -> None:
    """Replace the state file of `directory` atomically with `state` (its `latest` appended to
    the paths when it is not their last, as TensorFlow's ``generate_checkpoint_state_proto``
    does)."""
    from .protos import CheckpointState as Proto
    from .protos import text_format

    paths = list(state.paths)
    if state.latest is not None and (not paths or paths[-1] != state.latest):
        paths.append(state.latest)
    proto = Proto(model_checkpoint_path=state.latest or "", all_model_checkpoint_paths=paths,
                  all_model_checkpoint_timestamps=state.timestamps,
                  last_preserved_timestamp=state.last_preserved)
    data = text_format.MessageToString(proto).encode("utf-8")
    _replace(state_path(directory), data, durable)


REMOVALS_FILE = ".checkpoint.shardkit-removing"
"""The prefixes a manager's retention is about to delete, one a line, written before the state
file leaves them out and removed once they are deleted."""


def read_removals(directory: str) -> list[str]:
    """The prefixes an interrupted retention in `directory` had still to delete (none when it
    finished or never started)."""
    try:
        with open(os.path.join(directory, REMOVALS_FILE), "rb") as f:
            data = f.read(1 << 20)
    except FileNotFoundError:
        return []
    names = data.decode("utf-8", "replace").splitlines()
    return [n for n in names if n and "/" not in n and n not in (".", "..")]


def write_removals(directory: str, names: list[str], durable: bool = True) -> None:
    """Record `names` (prefixes in `directory`) as to be deleted, atomically; an empty list
    removes the record."""
    target = os.path.join(directory, REMOVALS_FILE)
    if names:
        _replace(target, "".join(f"{n}\n" for n in names).encode("utf-8"), durable)
        return
    try:
        os.unlink(target)
    except FileNotFoundError:
        return
    if durable:
        commit.fsync_dir(directory)


def _replace(target: str, data: bytes, durable: bool) -> None:
    """Replace the file `target` with `data` atomically: written in a locked temp directory
    next to it, renamed over it, the temp directory removed."""
    tmp, fd = commit.locked_tmp(Path(target))
    try:
        staged = tmp / os.path.basename(target)
        commit.write_new(staged, [data], durable)
        os.replace(staged, target)
        if durable:
            commit.fsync_dir(os.path.dirname(target) or ".")
        with contextlib.suppress(OSError):
            os.rmdir(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            commit.remove_tree(tmp)
        raise
    finally:
        os.close(fd)


def is_committed(directory: str, name: str) -> bool:
    """Whether the prefix `name` in `directory` has its ``.index`` (written last)."""
    return os.path.isfile(os.path.join(directory, name + INDEX_SUFFIX))


def remove_prefix(directory: str, name: str) -> None:
    """Delete the files of the prefix `name` in `directory`: its ``.index`` first (so it no
    longer counts as committed), then its data files."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, name + INDEX_SUFFIX))
    lead = name + ".data-"
    for entry in os.listdir(directory):
        if entry.startswith(lead) and _is_data_suffix(entry[len(lead):]):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, entry))


def _is_data_suffix(rest: str) -> bool:
    """``00000-of-00001``: TensorFlow's ``.data-?????-of-?????``."""
    return (len(rest) == 14 and rest[5:9] == "-of-" and rest[:5].isdigit()
            and rest[9:].isdigit())


__all__ = ["REMOVALS_FILE", "CheckpointState", "is_committed", "read_removals", "read_state",
           "remove_prefix", "state_path", "write_removals", "write_state"]
