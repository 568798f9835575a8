"""Reading a checkpoint from a store: the reader's directory and shard sources for URLs.

`RemoteDirectory` stands in for `shards.files.CheckpointDirectory` (the manifest is one GET,
with its tag); shard objects are named by the manifest's generation (`layout.object_name`), so
a reader never sees another save's objects. `RemoteFile` is a shard object as a
`shards.files.ByteSource` (every read a ranged GET, no map), which the raw and `.skz` readers
read as they read a local file; a `.skz` shard fetches each chunk's frame on the thread that
decompresses it, so fetches and decompression overlap across the reader's pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from ..errors import CheckpointReplacedError, MissingShardError, ShardkitError
from ..format import MANIFEST_FILE, MAX_INDEX_BYTES
from ..shards.files import Run, byte_view, run_each
from ..shards.raw import ShardSource, shard_opener
from .base import MAX_COALESCED, Storage, coalesce
from .layout import object_name

PIECE = 16 * 1024 * 1024  # a large read is cut into GETs of this size
TASK_BYTES = 64 * 1024 * 1024  # GETs grouped into one task (run concurrently) up to this


class RemoteFile:
    """A shard object opened by a reader (a `shards.files.ByteSource`): its store, object name, URL
    and size; every read a ranged GET."""

    def __init__(self, store: Storage, name: str, path: str) -> None:
        self.store, self.name, self.path = store, name, path
        self._deleted = (f"{path}: the shard object was deleted while it was being read (the "
                         "checkpoint was overwritten); open the checkpoint again")
        try:
            self.size = store.size(name)
        except FileNotFoundError:
            raise MissingShardError(f"{path}: shard object listed in the manifest is missing "
                                    "from the store") from None

    def read(self, start: int, end: int) -> bytes:
        try:
            return self.store.read_range(self.name, start, end)
        except FileNotFoundError:
            raise CheckpointReplacedError(self._deleted) from None

    @property
    def task_bytes(self) -> int:
        return TASK_BYTES

    def readinto(self, offset: int, dest: Any) -> None:
        run_each(self.read_tasks([(offset, [np.frombuffer(dest, np.uint8)])]))

    def read_tasks(self, runs: Sequence[Run]) -> list[Callable[[], None]]:
        """See `shards.files.ByteSource.read_tasks`: the reads cut into pieces of at most PIECE
        bytes, adjacent pieces coalesced into GETs of at most `base.MAX_COALESCED` bytes, grouped
        into tasks of about TASK_BYTES whose GETs run concurrently."""
        pieces: list[tuple[int, int]] = []
        dests: list[np.ndarray] = []
        for at, arrays in runs:
            for a in arrays:
                out, n = byte_view(a), a.nbytes
                for pos in range(0, n, PIECE):
                    nxt = min(n, pos + PIECE)
                    pieces.append((at + pos, at + nxt))
                    dests.append(out[pos:nxt])
                at += n
        tasks: list[Callable[[], None]] = []
        batch: list[tuple[int, int, list[int]]] = []
        size = 0
        for g in coalesce(pieces, limit=MAX_COALESCED):
            batch.append(g)
            size += g[1] - g[0]
            if size >= TASK_BYTES:
                tasks.append(partial(self._fetch, batch, pieces, dests))
                batch, size = [], 0
        if batch:
            tasks.append(partial(self._fetch, batch, pieces, dests))
        return tasks

    def _fetch(self, groups: list[tuple[int, int, list[int]]], pieces: list[tuple[int, int]],
               dests: list[np.ndarray]) -> None:
        try:
            got = self.store.read_ranges(self.name, [(a, b) for a, b, _ in groups])
        except FileNotFoundError:
            raise CheckpointReplacedError(self._deleted) from None
        for (start, _, members), data in zip(groups, got):
            view = np.frombuffer(data, np.uint8)
            for i in members:
                a, b = pieces[i]
                dests[i][:] = view[a - start : b - start]

    def take_map(self) -> None:
        """A store's object is never mapped (`shards.files.ByteSource`): its readers read on."""
        return None

    def close(self) -> None:
        pass


class LocalCopy:
    """A small object fetched whole, offered as `shards.files.CheckpointFile` offers a small file
    (the string file): `size` and `read_all`."""

    def __init__(self, data: bytes) -> None:
        self.size = len(data)
        self._data = data

    def read_all(self) -> bytes:
        return self._data

    def close(self) -> None:
        pass


class RemoteDirectory:
    """The checkpoint at a URL as `adapters.detect` and the reader see a directory."""

    dir_fd = None
    follow_symlinks = False
    pool = None

    single = None  # a store holds directories only: no single-file layout

    def __init__(self, store: Storage) -> None:
        self.store = store
        self.path = self.store.url
        self.tag: str | None = None
        self.generation: str | None = None  # the manifest's, once the reader decoded it

    def close(self) -> None:
        pass

    def shard_path(self, file: str, generation: str | None) -> str:
        return self.store.join(object_name(file, generation))

    def opener(self, codec: str, path: str) -> Callable[..., ShardSource]:
        """`shards.raw.shard_opener` for the codecs whose readers read a
        `shards.files.ByteSource` (raw, zstd): ``(path, info, *, mmap, file)``."""
        found = shard_opener(codec, path)  # raises UnknownCodecError for an unknown codec
        if codec not in ("raw", "zstd"):
            raise ShardkitError(f"{path}: codec {codec!r} cannot be read from a URL")
        return found

    def replaced(self) -> bool:
        return False  # shard objects are never replaced, only deleted (`open_file` says so)

    def join(self, name: str) -> str:
        """The URL of `name`: the manifest at the root, any other file (once the manifest is
        read) the object of its generation."""
        if self.generation is not None and name != MANIFEST_FILE:
            name = object_name(name, self.generation)
        return self.store.join(name)

    def has(self, name: str) -> bool:
        try:
            self.store.size(name)
        except FileNotFoundError:
            return False
        return True

    def read_manifest(self, name: str, limit: int) -> bytes | None:
        found = self.store.fetch(name, limit)
        if found is None:
            return None
        self.tag = found.tag
        return found.data

    def open_shard(self, name: str, listed_in: str | None = None) -> Any:
        """File `name` of this checkpoint's generation (the string file) as the readers of
        small files take it: fetched whole (`LocalCopy`)."""
        if self.generation is None:
            raise ShardkitError(f"{self.join(name)}: only shardkit checkpoints are read from "
                                "URLs (a HuggingFace, PyTorch DCP or single-file layout needs "
                                "a local copy)")
        obj = object_name(name, self.generation)
        found = self.store.fetch(obj, 1 << 62)
        if found is None:
            raise MissingShardError(f"{self.store.join(obj)}: listed in "
                                    f"{listed_in or 'the manifest'} but missing from the store")
        return LocalCopy(found.data)

    def open_shard_file(self, path: str, file: str, generation: str | None) -> RemoteFile:
        """Shard `file` of `generation`; CheckpointReplacedError when it is gone because a
        newer manifest replaced the one this reader read (its objects are deleted after)."""
        name = object_name(file, generation)
        try:
            return RemoteFile(self.store, name, self.store.join(name))
        except MissingShardError:
            now = self.store.fetch(MANIFEST_FILE, MAX_INDEX_BYTES)
            if now is not None and self.tag is not None and now.tag != self.tag:
                raise CheckpointReplacedError(
                    f"{self.store.join(name)}: shard object is gone: the checkpoint at "
                    f"{self.path} was replaced while this reader had it open; open the "
                    "checkpoint again to read the new one") from None
            raise


__all__ = ["RemoteDirectory", "RemoteFile"]
