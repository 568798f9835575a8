"""The storage seam: one small interface for where a checkpoint's bytes live.

A `Storage` is rooted at one checkpoint location (a directory, or a prefix of an object store)
and names everything under it by a relative name with ``/`` separators. It writes a file or
object from a sequence of buffers (multipart with bounded memory where the store has it), reads
byte ranges (several at once, adjacent ones coalesced), lists, deletes and publishes the
manifest (conditionally where the store supports it). `shardkit.storage.local` and
`shardkit.storage.fsspec` implement it; docs/ARCHITECTURE.md ("Storage") says who uses which.
"""

from __future__ import annotations

import errno
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import StorageError

_T = TypeVar("_T")

RETRIES = 6  # attempts of one request before a transient error is given up on
BACKOFF = 0.05  # seconds before the first retry, doubled each time (plus jitter)
BACKOFF_MAX = 2.0
COALESCE_GAP = 0  # ranges at most this many bytes apart are fetched as one


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


class Storage(ABC):
    """Where one checkpoint's bytes live; every name is relative to `url`."""

    url: str
    conditional: bool = False  # publish(if_absent / if_tag) is atomic on this store

    def join(self, name: str) -> str:
        """The full URL (or path) of `name`, for messages."""
        return f"{self.url.rstrip('/')}/{name}" if name else self.url

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
