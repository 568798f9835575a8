"""The storage seam: one small interface for where a checkpoint's bytes live.

A `Storage` is rooted at one checkpoint location (a directory, or a prefix of an object store)
and names everything under it by a relative name with ``/`` separators. Its two levels: bytes
(write from buffers, ranged reads, list, delete, publish the manifest) and checkpoints, what
the writer, the reader and the manager ask for (`stage`, `write_shards`, `write_strings`,
`open_checkpoint`, `children`, `commit_time`, `remove_checkpoint`).
"""

from __future__ import annotations

import errno
import random
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from ..errors import StorageError
from ..format import EntryLayout

_T = TypeVar("_T")

RETRIES = 6  # attempts of one request before a transient error is given up on
BACKOFF = 0.05  # seconds before the first retry, doubled each time (plus jitter)
BACKOFF_MAX = 2.0
COALESCE_GAP = 0  # ranges at most this many bytes apart are fetched as one
MAX_COALESCED = 32 * 1024 * 1024  # adjacent ranges merge into GETs of at most this many bytes


@dataclass(frozen=True, slots=True)
class Stored:
    """An object as listed: its name (relative to the storage root), size in bytes and last
    modification time (seconds since the epoch; 0.0 where the store does not say)."""

    name: str
    size: int
    mtime: float = 0.0


@dataclass(frozen=True, slots=True)
class Fetched:
    """A whole small object and the tag a conditional publish compares (S3's ETag; None where
    the store has no such tag)."""

    data: bytes
    tag: str | None


@dataclass(slots=True)
class ShardFile:
    """A shard file as the writer planned it, in its on-disk order: entry i is ``keys[i]`` /
    ``specs[i]`` / ``arrays[i]`` at absolute file offsets ``offsets[i]`` to ``ends[i]``, after
    the header pieces; a raw shard's writers put the entry's xxh3-64 in ``digests[i]``. `path`
    is where the storage writes it (set by `Storage.write_shards`, for messages too)."""

    path: Path
    file: str
    task: int
    header: list[bytes]  # pieces, written back to back
    keys: list[str]
    specs: list[str]
    arrays: list[np.ndarray]
    offsets: np.ndarray  # int64
    ends: np.ndarray  # int64
    layouts: list[EntryLayout] | None  # only for compressed shards
    size: int
    digests: np.ndarray  # uint64
    rows: range | list[int] | None  # the entries' rows in SavedTensors, when known
    xxh3: list[str | None] | None = None  # compressed shards: the entry checksums, in hex
    fd: int = -1
    pending: int = 0  # regions not yet written
    lock: threading.Lock = field(default_factory=threading.Lock)


class Staging(Protocol):
    """A save in progress (`Storage.stage`): `store` is where its files go (a local temp
    directory, or the store itself), every file carries `generation`; `commit` publishes the
    manifest atomically, `abort` removes what was written (nothing once committed). The save
    flow (`io.flow.Steps`) aborts one left uncommitted."""

    store: Storage
    generation: str
    target: Any
    committed: bool

    def commit(self, index_bytes: bytes | Sequence[bytes]) -> None: ...

    def abort(self) -> None: ...


class Storage(ABC):
    """Where one checkpoint's bytes live; every name is relative to `url`."""

    url: str
    conditional: bool = False  # publish(if_absent / if_tag) is atomic on this store

    def join(self, name: str) -> str:
        """The full URL (or path) of `name`, for messages."""
        return f"{self.url.rstrip('/')}/{name}" if name else self.url

    # -- checkpoints

    def shard_name(self, file: str, generation: str | None) -> str:
        """The name here of file `file` of the save of `generation` (locally: `file`)."""
        return file

    @abstractmethod
    def check_target(self, overwrite: bool) -> None:
        """Raise CheckpointExistsError now (before any work) when a save here cannot succeed;
        a store that learns it only in `stage` may do nothing."""

    @abstractmethod
    def stage(self, *, overwrite: bool, durable: bool) -> Staging:
        """Start a save of a checkpoint here (`Staging`)."""

    @abstractmethod
    def write_shards(self, files: list[ShardFile], *, generation: str, compressed: bool,
                     threads: int, durable: bool, checksum: bool, bar: Any,
                     zstd_options: dict[str, Any], meanwhile: Callable[[], _T]) -> _T:
        """Write the planned `files` (raw safetensors shards, or `.skz` ones when
        `compressed`) of the save of `generation`, each entry's xxh3-64 into the plan when
        `checksum`; a compressed file's size is set once written. Returns what `meanwhile`
        returns, which runs on this thread while the files are written where the store can
        (otherwise after)."""

    @abstractmethod
    def write_strings(self, strings: Any, generation: str, checksum: bool,
                      durable: bool) -> Any:
        """Write the string file (`shardkit.strings`) of the save of `generation`; returns its
        `StringFile`."""

    @abstractmethod
    def open_checkpoint(self, *, follow_symlinks: bool, pool: Any) -> Any:
        """The checkpoint here as the reader and the format adapters see it (a
        `shards.files.CheckpointDirectory`-like object that also opens shard byte sources:
        ``single``, ``shard_path``, ``opener``, ``open_shard_file``, ``replaced``, ``close``)."""

    @abstractmethod
    def children(self) -> list[tuple[str, str]]:
        """The committed shardkit checkpoints directly under this location: (name, path)."""

    @abstractmethod
    def commit_time(self) -> float:
        """When the checkpoint here was committed (its manifest's mtime; now when unknown)."""

    @abstractmethod
    def remove_checkpoint(self) -> None:
        """Delete the checkpoint here, so that no half-deleted one is ever visible."""

    def interrupted_removals(self) -> list[str]:
        """The paths of the children here whose `remove_checkpoint` was killed halfway (no
        checkpoint any more, but files of one left), for retention to finish. None here:
        at a URL, `shardkit gc` removes what a killed removal left."""
        return []

    # -- bytes

    @abstractmethod
    def write_file(self, name: str, buffers: Iterable[Any]) -> int:
        """Create `name` from `buffers` (bytes-like, written back to back); returns the bytes
        written. Large files leave in parts, a few at a time: memory stays bounded."""

    @abstractmethod
    def upload_file(self, name: str, local_path: str) -> None:
        """Create `name` from the local file `local_path`."""

    @abstractmethod
    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of `name`."""

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """`read_range` of each range, coalescing adjacent ones (default: one by one)."""
        return [self.read_range(name, a, b) for a, b in ranges]

    @abstractmethod
    def size(self, name: str) -> int:
        """The size of `name` in bytes; FileNotFoundError when there is none."""

    @abstractmethod
    def fetch(self, name: str, limit: int) -> Fetched | None:
        """The whole object `name` (at most `limit` bytes, else StorageError) and its tag;
        None when there is none."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[Stored]:
        """Every file or object whose name starts with `prefix`, at any depth."""

    @abstractmethod
    def delete(self, names: Sequence[str]) -> None:
        """Remove `names` (missing ones are ignored)."""

    def unfinished_uploads(self) -> Sequence[tuple[str, str, float]]:
        """(name, upload id, seconds since it started) of each multipart upload under here
        neither completed nor aborted (none on a store without such uploads)."""
        return []

    def abort_upload(self, name: str, upload_id: str) -> None:
        """Abort the unfinished multipart upload `upload_id` of `name` (a store without such
        uploads lists none, so is never asked)."""
        raise StorageError(errno.ENOENT, f"{self.join(name)}: no multipart upload {upload_id}")

    @abstractmethod
    def publish(self, name: str, data: bytes, *, if_absent: bool = False,
                if_tag: str | None = None) -> bool:
        """Write the small object `name` (the manifest) in one request. With `if_absent`, only
        if there is none; with `if_tag`, only if the one there still has that tag. Returns
        False when the condition failed (another writer got there first). On a store without
        conditional writes the condition is checked just before, not atomically."""


def coalesce(ranges: Sequence[tuple[int, int]], gap: int = COALESCE_GAP,
             limit: int | None = None) -> list[tuple[int, int, list[int]]]:
    """Merge ranges whose gap is at most `gap` (sorted by start; none larger than `limit`):
    ``(start, end, indices of the ranges inside)``."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    out: list[tuple[int, int, list[int]]] = []
    for i in order:
        a, b = ranges[i]
        if out:
            s, e, members = out[-1]
            if a <= e + gap and (limit is None or max(e, b) - s <= limit):
                out[-1] = (s, max(e, b), [*members, i])
                continue
        out.append((a, b, [i]))
    return out


_TRANSIENT_ERRNO = {errno.EAGAIN, errno.EBUSY, errno.ECONNRESET, errno.ECONNABORTED,
                    errno.ETIMEDOUT, errno.EPIPE, errno.ECONNREFUSED}
_TRANSIENT_WORDS = ("slowdown", "slow down", "throttl", "503", "500 ", "internalerror",
                    "serviceunavailable", "service unavailable", "requesttimeout",
                    "reduce your request rate", "connection reset", "too many requests")


def is_transient(e: BaseException) -> bool:
    """Whether `e` is worth retrying: throttling (503 SlowDown), a server's internal error, a
    reset or timed-out connection."""
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if isinstance(e, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError,
                      NotADirectoryError)):
        return False
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNO:
        return True
    code = getattr(e, "response", None)
    if isinstance(code, dict):
        err = code.get("Error", {}).get("Code", "")
        status = code.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if err in ("SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                   "ServiceUnavailable", "InternalError") or status in (500, 503):
            return True
    text = f"{type(e).__name__} {e}".lower()
    return any(w in text for w in _TRANSIENT_WORDS)


def with_retries(call: Callable[[], _T], what: str, url: str, *, retries: int = RETRIES,
                 sleep: Callable[[float], None] = time.sleep) -> _T:
    """`call()`, retried with exponential backoff (and jitter) on transient errors; a
    permanent error, or a transient one that outlives the retries, raises StorageError naming
    `url` and what was being done. FileNotFoundError passes through (callers word it)."""
    delay = BACKOFF
    for attempt in range(1, retries + 1):
        try:
            return call()
        except FileNotFoundError:
            raise
        except Exception as e:
            if is_transient(e) and attempt < retries:
                sleep(delay * (1 + random.random() / 2))
                delay = min(BACKOFF_MAX, delay * 2)
                continue
            why = "still failing after retries" if is_transient(e) else "refused"
            code = e.errno if isinstance(e, OSError) and e.errno else errno.EIO
            raise StorageError(code, f"{url}: {what} {why}: {type(e).__name__}: {e}") from e
    raise AssertionError("unreachable")
