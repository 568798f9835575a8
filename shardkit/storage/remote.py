"""Reading a checkpoint from a store: the reader's directory and shard sources for URLs.

`RemoteDirectory` stands in for `files.CheckpointDirectory` (the manifest is one GET, with its
tag); shard objects are named by the manifest's generation (`layout.object_name`), so a reader
never sees another save's objects. `RemoteFile` is a shard object as a `files.ByteSource`
(every read a ranged GET, no map): the `.skz` reader (`compression.SkzShard`) reads it as it
reads a local file. `RemoteRawShard` is the raw shard source (`view` is None): its
`read_tasks` turns a batch of reads into pieces of at most PIECE bytes, coalesces adjacent
pieces into GETs of at most `base.MAX_COALESCED` bytes, and groups those into tasks whose
GETs run concurrently, so a whole-checkpoint load keeps several requests in flight while a
one-row `get_slice` fetches only that row. A `.skz` shard fetches each chunk's frame on the
thread that decompresses it: fetches and decompression overlap across the reader's pool.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from ..errors import (
    CheckpointReplacedError,
    MissingShardError,
    ShardkitError,
)
from ..format import (
    MANIFEST_FILE,
    MAX_INDEX_BYTES,
    EntryLayout,
    ShardInfo,
    check_generation,
    read_safetensors_header,
)
from ..shards import skz
from ..shards.raw import ShardSource, check_shard_size
from .base import MAX_COALESCED, Storage, coalesce
from .layout import object_name

PIECE = 16 * 1024 * 1024  # a large read is cut into GETs of this size
TASK_BYTES = 64 * 1024 * 1024  # GETs grouped into one task (run concurrently) up to this
VERIFY_WINDOW = 3  # batches of TASK_BYTES a verify keeps in flight per shard


class RemoteFile:
    """A shard object opened by a reader (a `files.ByteSource`): its store, object name, URL
    and size; every read a ranged GET."""

    def __init__(self, store: Storage, name: str, path: str) -> None:
        self.store, self.name, self.path = store, name, path
        try:
            self.size = store.size(name)
        except FileNotFoundError:
            raise MissingShardError(f"{path}: shard object listed in the manifest is missing "
                                    "from the store") from None

    def read(self, start: int, end: int) -> bytes:
        try:
            return self.store.read_range(self.name, start, end)
        except FileNotFoundError:
            raise CheckpointReplacedError(
                f"{self.path}: the shard object was deleted while it was being read (the "
                "checkpoint was overwritten); open the checkpoint again") from None

    def take_map(self) -> None:
        """A store's object is never mapped (`files.ByteSource`): its readers read on."""
        return None

    def close(self) -> None:
        pass


class LocalCopy:
    """A small object fetched whole, offered as `files.CheckpointFile` offers a small file
    (the string file): `size` and `read_all`."""

    def __init__(self, data: bytes) -> None:
        self.size = len(data)
        self._data = data

    def read_all(self) -> bytes:
        return self._data

    def close(self) -> None:
        pass


class RemoteDirectory:
    """The checkpoint at a URL as `formats.detect` and the reader see a directory."""

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
        return opener(codec, path)

    def open_shard_file(self, path: str, file: str, generation: str | None) -> RemoteFile:
        return self.open_file(file, generation)

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
                                "URLs (a HuggingFace or single-file layout needs a local copy)")
        obj = object_name(name, self.generation)
        found = self.store.fetch(obj, 1 << 62)
        if found is None:
            raise MissingShardError(f"{self.store.join(obj)}: listed in "
                                    f"{listed_in or 'the manifest'} but missing from the store")
        return LocalCopy(found.data)

    def shard_object(self, file: str, generation: str | None) -> str:
        return object_name(file, generation)

    def open_file(self, file: str, generation: str | None) -> RemoteFile:
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


def opener(codec: str, path: str) -> Callable[..., ShardSource]:
    """The remote counterpart of `sources.shard_opener`: `(path, info, *, mmap, file)`."""
    if codec == "raw":
        return open_raw
    if codec == "zstd":
        return open_skz
    from ..shards.raw import shard_opener

    shard_opener(codec, path)  # raises UnknownCodecError for an unknown codec
    raise ShardkitError(f"{path}: codec {codec!r} cannot be read from a URL")


def open_raw(path: str, info: ShardInfo, *, mmap: bool = True, file: RemoteFile) -> ShardSource:
    return RemoteRawShard(path, info, file)


def open_skz(path: str, info: ShardInfo, *, mmap: bool = True, file: RemoteFile) -> Any:
    return skz.SkzShard(path, info, mmap=False, file=file)


class RemoteRawShard(ShardSource):
    """A raw (safetensors) shard object, read by ranged GETs."""

    read_granularity = PIECE
    matches_index = False

    def __init__(self, path: str, info: ShardInfo, file: RemoteFile) -> None:
        self.path, self.info, self._file = path, info, file
        size = file.size
        check_shard_size(path, size, info)
        self.entries, self.metadata, self.data_start = read_safetensors_header(
            file.read, size, path)
        check_generation(self.metadata, info.generation, path)

    def read_into(self, entry: EntryLayout, begin: int, end: int, dest: memoryview) -> None:
        self.run(self.read_tasks([(entry, begin, end, dest)]))

    def read_tasks(self, requests: Sequence[tuple[EntryLayout, int, int, Any]]
                   ) -> list[Callable[[], None]]:
        pieces: list[tuple[int, int]] = []
        dests: list[memoryview] = []
        for entry, begin, end, dest in requests:
            out = memoryview(dest).cast("B")
            at = self.data_start + entry.begin
            pos = begin
            while pos < end:
                nxt = min(end, pos + PIECE)
                pieces.append((at + pos, at + nxt))
                dests.append(out[pos - begin : nxt - begin])
                pos = nxt
        groups = coalesce(pieces, limit=MAX_COALESCED)
        tasks: list[Callable[[], None]] = []
        batch: list[tuple[int, int, list[int]]] = []
        size = 0
        for g in groups:
            batch.append(g)
            size += g[1] - g[0]
            if size >= TASK_BYTES:
                tasks.append(partial(self._fetch, batch, pieces, dests))
                batch, size = [], 0
        if batch:
            tasks.append(partial(self._fetch, batch, pieces, dests))
        return tasks

    def _fetch(self, groups: list[tuple[int, int, list[int]]], pieces: list[tuple[int, int]],
               dests: list[memoryview]) -> None:
        try:
            got = self._file.store.read_ranges(self._file.name, [(a, b) for a, b, _ in groups])
        except FileNotFoundError:
            raise CheckpointReplacedError(
                f"{self.path}: the shard object was deleted while it was being read (the "
                "checkpoint was overwritten); open the checkpoint again") from None
        for (start, _, members), data in zip(groups, got):
            view = memoryview(data)
            for i in members:
                a, b = pieces[i]
                dests[i][:] = view[a - start : b - start]

    def hash_entries(self, entries: Sequence[EntryLayout], pool: Any) -> dict[str, str]:
        """The xxh3-64 (hex) of each entry, for `verify`: the bytes fetched in batches of
        about TASK_BYTES, VERIFY_WINDOW batches in flight on `pool` (each batch's GETs
        concurrent), hashed in order on this thread; memory stays at the batches in flight."""
        import xxhash

        batches: list[list[tuple[EntryLayout, int, int]]] = []
        batch: list[tuple[EntryLayout, int, int]] = []
        size = 0
        for e in entries:
            pos, n = 0, e.nbytes
            while True:
                take = min(n - pos, TASK_BYTES - size)
                batch.append((e, pos, pos + take))
                size += take
                pos += take
                if size >= TASK_BYTES:
                    batches.append(batch)
                    batch, size = [], 0
                if pos >= n:
                    break
        if batch:
            batches.append(batch)

        def fetch(batch: list[tuple[EntryLayout, int, int]]) -> memoryview:
            out = memoryview(bytearray(sum(b - a for _, a, b in batch)))
            requests, at = [], 0
            for e, a, b in batch:
                if b > a:
                    requests.append((e, a, b, out[at : at + b - a]))
                at += b - a
            self.run(self.read_tasks(requests))
            return out

        digests: dict[str, str] = {}
        running: dict[str, Any] = {}
        pending: deque[tuple[list[tuple[EntryLayout, int, int]], Any]] = deque()
        todo = iter(batches)
        try:
            while True:
                while len(pending) < VERIFY_WINDOW and (nxt := next(todo, None)) is not None:
                    pending.append((nxt, pool.submit(fetch, nxt)))
                if not pending:
                    return digests
                done, future = pending.popleft()
                data, at = future.result(), 0
                for e, a, b in done:
                    h = running.get(e.name)
                    if h is None:
                        h = running[e.name] = xxhash.xxh3_64()
                    h.update(data[at : at + b - a])
                    at += b - a
                    if b == e.nbytes:
                        digests[e.name] = running.pop(e.name).hexdigest()
        finally:
            for _, f in pending:
                f.cancel()
            for _, f in pending:
                if not f.cancelled():
                    try:
                        f.result()
                    except Exception:
                        pass

    @staticmethod
    def run(tasks: Sequence[Callable[[], None]]) -> None:
        for t in tasks:
            t()

    def close(self) -> None:
        self._file.close()


__all__ = ["RemoteDirectory", "RemoteFile", "RemoteRawShard", "opener"]
