"""TensorFlow's ``checkpoint`` state file: the CheckpointState text proto a TensorFlow
``tf.train.CheckpointManager`` keeps in its directory, read and written as TensorFlow's
``checkpoint_management.update_checkpoint_state_internal`` writes it (paths relative to the
directory, the newest last; the file replaced atomically), and a prefix's files deleted.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...errors import CheckpointNotFoundError, CorruptIndexError
from ...format.common import shown
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
    target = state_path(directory)
    temp = f"{target}.tmp{uuid.uuid4().hex}"
    try:
        with open(temp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    if durable:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
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


__all__ = ["CheckpointState", "is_committed", "read_state", "remove_prefix", "state_path",
           "write_state"]
