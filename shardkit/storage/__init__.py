"""Where checkpoints live: the local file system, or any fsspec URL (``s3://bucket/prefix``).

`open_storage` is the one place a path becomes a `Storage`: a `LocalStorage` for a path, an
`FsspecStorage` for a URL (`is_url`: a ``scheme://`` prefix); the writer, the reader and the
manager do not know which one they have. fsspec and s3fs are imported only for URLs. A store's
options (s3fs's ``client_kwargs``, ``key``...) are registered per URL prefix with
`set_storage_options`; without any, the file system's defaults apply.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

from .base import (
    Fetched,
    ShardFile,
    Staging,
    Storage,
    Stored,
    coalesce,
    is_transient,
    with_retries,
)

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_options_lock = threading.Lock()
_OPTIONS: dict[str, dict[str, Any]] = {}


def is_url(path: Any) -> bool:
    """Whether `path` names a checkpoint by URL (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and _URL.match(path) is not None


def set_storage_options(prefix: str, **storage_options: Any) -> None:
    """Use fsspec keyword arguments for every URL under a prefix; the longest prefix wins.

    Args:
        prefix: a URL prefix, matched by scheme, bucket and whole path components
            (`prefix_matches`: ``s3://bucket`` covers ``s3://bucket/x``, never
            ``s3://bucket-other``).
        **storage_options: e.g. ``client_kwargs={"endpoint_url": url}``; none forgets `prefix`.
    Raises:
        Nothing: options are checked by the file system when a URL under `prefix` is opened.
    """
    with _options_lock:
        if storage_options:
            _OPTIONS[prefix] = dict(storage_options)
        else:
            _OPTIONS.pop(prefix, None)


def prefix_matches(prefix: str, url: str) -> bool:
    """Whether `url` is `prefix` or lies under it: the scheme, the bucket and each path
    component compared whole (a trailing ``/`` on either is ignored; ``s3://`` alone covers
    every ``s3://`` URL)."""
    head = prefix.rstrip("/")
    if head.endswith(":"):  # a bare scheme, "s3://"
        return url.startswith(prefix)
    rest = url.rstrip("/")
    return rest == head or rest.startswith(head + "/")


def storage_options_for(url: str) -> dict[str, Any]:
    """The options registered for the longest prefix `url` lies under (`prefix_matches`)."""
    with _options_lock:
        best = max((p for p in _OPTIONS if prefix_matches(p, url)),
                   key=lambda p: len(p.rstrip("/")), default=None)
        return dict(_OPTIONS[best]) if best is not None else {}


def open_storage(url: str | os.PathLike[str]) -> Storage:
    """The storage of the checkpoint at `url` (a URL: `FsspecStorage`; a path: `LocalStorage`)."""
    path = os.fspath(url)
    if not is_url(path):
        from .local import LocalStorage

        return LocalStorage(path)
    from .fsspec import FsspecStorage

    return FsspecStorage(path, storage_options_for(path))


__all__ = [
    "Fetched", "ShardFile", "Staging", "Storage", "Stored", "coalesce", "is_transient",
    "is_url", "open_storage", "prefix_matches", "set_storage_options", "storage_options_for",
    "with_retries",
]
