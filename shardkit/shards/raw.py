"""Shard sources: byte access to the entries of one opened shard file.

A shard's codec selects its `ShardSource` implementation: ``"raw"`` (a safetensors shard over
a `shards.files.ByteSource`: a file mapped or read with ``os.preadv``, or a store's object) here,
others registered with `register_codec` or imported lazily (see `_LAZY_CODECS`).
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Executor, wait
from functools import partial
from importlib import import_module
from typing import Any

import numpy as np
import xxhash

from .._kernels import _table, _views
from ..errors import CheckpointFormatError, ChecksumError, TruncatedShardError, UnknownCodecError
from ..format import (
    EntryLayout,
    ShardInfo,
    check_generation,
    entries_at,
    read_expected_safetensors_header,
    read_safetensors_header,
)
from .files import READ_CHUNK, ByteSource, open_shard_file, pool_tasks, run_each

_VERIFY_WINDOW = 3  # batches a verify keeps in flight per shard

Request = tuple[EntryLayout, int, int, Any]  # bytes [begin, end) of an entry into a buffer


class ShardSource:
    """Byte access to the entries of one opened shard (the codec extension point): the one
    interface every shard source offers, whatever its codec (`RawShard` here,
    `shards.skz.SkzShard`, which has the same members) and wherever its bytes are (a
    `shards.files.ByteSource`: a local file or a store's object).

    `entries` maps entry name -> EntryLayout (offsets relative to the data region); `read_into`
    copies bytes ``[begin, end)`` of an entry into the writable buffer `dest`, `read_tasks` many
    such requests as tasks for the read pool (a codec decodes each chunk once), both thread-safe,
    ranges of whole items (`packed`: how an F4 entry holds its elements). `view` is a
    zero-copy (private, writable) buffer or None;
    `whole_arrays` whole entries by offset, or None when only `read_tasks` reads them;
    `verify_entries` hashes entries (and checks a codec's frames); `matches_index`: the header
    was recognised as the index's (not checked again).
    """

    path: str
    info: ShardInfo
    entries: dict[str, EntryLayout]
    begins: list[int] | None = None
    matches_index = False
    # entries of a `values.dtypes.PACKED` dtype (F4) hold two elements a byte, as safetensors
    # stores them; False: one a byte, as TensorFlow's bundle does
    packed = True

    def read_into(self, entry: EntryLayout, begin: int, end: int, dest: Any) -> None:
        raise NotImplementedError

    def read_tasks(self, requests: Sequence[Request]) -> list[Callable[[], None]]:
        return [partial(self.read_into, *r) for r in requests]

    def view(self, entry: EntryLayout, begin: int, end: int) -> memoryview | None:
        return None

    def whole_arrays(self, *args: Any) -> list[np.ndarray] | None:
        return None  # see RawShard.whole_arrays

    batch_bytes = READ_CHUNK  # bytes a verify reads in one task (`verify_entries`)

    def verify_entries(self, names: Collection[str] | None, pool: Executor | None = None,
                       every_frame: bool = False
                       ) -> tuple[dict[str, str], list[tuple[int, ChecksumError]]]:
        """The xxh3-64 (hex) of the entries `names` (None: all), and the corrupt frames as
        (frame number, error) (`every_frame`: every frame of the shard is checked, also where
        no entry is asked for); an entry with bytes in a corrupt frame gets no digest.

        Here: a view hashed where there is one, else the bytes read in batches of about
        `batch_bytes` (`read_tasks`), _VERIFY_WINDOW batches in flight on `pool`, hashed in
        order on this thread; memory stays at the batches in flight."""
        digests: dict[str, str] = {}
        Piece = tuple[EntryLayout, int, int, int]  # bytes [a, b) of an entry of n bytes
        batches: list[list[Piece]] = [[]]
        size, step = 0, self.batch_bytes
        wanted = [self.entries[n] for n in (self.entries if names is None else names)]
        for e in sorted(wanted, key=lambda e: e.begin):  # in file order: reads join in runs
            n = e.nbytes
            if (view := self.view(e, 0, n)) is not None:
                digests[e.name] = xxhash.xxh3_64_hexdigest(view)
                continue
            pos = -1  # a piece for each part of the entry in a batch, one if it is empty
            while pos < n:
                take = min(n - max(pos, 0), step - size)
                pos = max(pos, 0)
                batches[-1].append((e, pos, pos + take, n))
                size, pos = (0, pos + take) if size + take >= step else (size + take, pos + take)
                if not size:
                    batches.append([])

        def fetch(batch: list[Piece]) -> memoryview:
            out = memoryview(bytearray(sum(b - a for _, a, b, _ in batch)))
            requests, at = [], 0
            for e, a, b, _ in batch:
                requests.append((e, a, b, out[at : at + b - a]))
                at += b - a
            run_each(self.read_tasks(requests))
            return out

        running: dict[str, Any] = {}
        pending: deque[tuple[list[Piece], Any]] = deque()
        todo = iter(b for b in batches if b)
        try:
            while True:
                while len(pending) < _VERIFY_WINDOW and (nxt := next(todo, None)) is not None:
                    pending.append((nxt, pool.submit(fetch, nxt) if pool is not None
                                    else partial(fetch, nxt)))
                if not pending:
                    return digests, []
                done, job = pending.popleft()
                data, at = job.result() if pool is not None else job(), 0
                for e, a, b, n in done:
                    if a == 0 and b == n:  # the whole entry in this batch: one call
                        digests[e.name] = xxhash.xxh3_64_hexdigest(data[at : at + n])
                        at += n
                        continue
                    h = running.get(e.name)
                    if h is None:
                        h = running[e.name] = xxhash.xxh3_64()
                    h.update(data[at : at + b - a])
                    at += b - a
                    if b == n:
                        digests[e.name] = running.pop(e.name).hexdigest()
        finally:
            if pool is not None:
                for _, f in pending:
                    f.cancel()
                wait([f for _, f in pending])

    def close(self) -> None:
        pass


class RawShard(ShardSource):
    """A raw (safetensors) shard over a `shards.files.ByteSource`: memory-mapped (`mmap=True`, when
    the source maps), else read through the source (a file's preadv, a store's GETs)."""

    def __init__(self, path: str, info: ShardInfo, *, mmap: bool = True,
                 expected: tuple[list[str], list[str], list[tuple[int, ...]]] | None = None,
                 file: ByteSource | None = None, follow_symlinks: bool = False,
                 header: tuple[dict[str, EntryLayout], dict[str, str], int] | None = None
                 ) -> None:
        """`expected`: the entries (names, dtype names, shapes, in data-region order) the index
        says the shard holds; when the header is exactly the writer's encoding of them it is
        taken without parsing, `begins` holds their offsets and `matches_index` is True (see
        read_expected_safetensors_header). `file`: the shard's byte source, already opened
        through the checkpoint's storage (else `path` is opened, see `shardkit.shards.files`).
        `header`: (entries, metadata, data_start) of this very file, already parsed and checked
        (a foreign layout's adapter did, `adapters.ParsedHeader`): not read again.

        A mapped shard is mapped copy-on-write and keeps no descriptor: views of it are
        writable, writing to them never reaches the file, and the map lives as long as they do.
        """
        self.path = path
        self.info = info
        self.begins: list[int] | None = None
        self._entries: dict[str, EntryLayout] | None = None
        self._expected = expected
        self._map: Any = None
        self._file: ByteSource = (file if file is not None
                                  else open_shard_file(path, follow_symlinks))
        try:
            size = self._file.size
            check_shard_size(path, size, info)
            if header is not None:
                self._entries, self.metadata, self.data_start = header
            elif expected is None:
                self._entries, self.metadata, self.data_start = read_safetensors_header(
                    self._file.read, size, path)
            else:
                self._entries, self.metadata, self.data_start, self.begins = (
                    read_expected_safetensors_header(self._file.read, size, path, *expected,
                                                     generation=info.generation))
            check_generation(self.metadata, info.generation, path)
            if mmap:  # the file holds at least the 8-byte prefix, so the map is never empty
                self._map = self._file.take_map()
        except BaseException:
            self._file.close()
            raise

    @property
    def matches_index(self) -> bool:  # type: ignore[override]
        return self.begins is not None

    @property
    def entries(self) -> dict[str, EntryLayout]:  # type: ignore[override]
        if self._entries is None:  # matched the index: built from it on first use
            assert self._expected is not None and self.begins is not None
            self._entries = entries_at(*self._expected, self.begins)
        return self._entries

    def view(self, entry: EntryLayout, begin: int, end: int) -> memoryview | None:
        if self._map is None:
            return None
        start = self.data_start + entry.begin
        return memoryview(self._map)[start + begin : start + end]

    def whole_arrays(self, begins: Sequence[int], dtypes: Sequence[np.dtype],
                     shapes: Sequence[tuple[int, ...]],
                     run: Callable[[Sequence[Callable[[], None]]], None] | None = None
                     ) -> list[np.ndarray]:
        """The whole entries at `begins` (data-region offsets): writable views of the private
        map, or without one new arrays, filled by the source's `read_tasks` over runs of
        adjacent entries; `run` executes those tasks (default: one after the other)."""
        if self._map is not None:
            base = np.frombuffer(self._map, np.uint8)  # one buffer export for all the views
            return _views.make_views(base, self.data_start, list(begins), list(dtypes),
                                     list(shapes))
        arrays = list(map(np.empty, shapes, dtypes))
        if not arrays:
            return arrays
        nbytes = _table.array_nbytes(arrays)
        starts = np.asarray(begins, np.int64)
        order = np.argsort(starts, kind="stable")
        starts = starts[order]
        ends = starts + nbytes[order]
        cuts = np.flatnonzero(starts[1:] != ends[:-1]) + 1  # a run ends where a gap begins
        runs = [(self.data_start + int(starts[lo]), [arrays[j] for j in order[lo:hi].tolist()])
                for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(arrays)])]
        (run or run_each)(self._file.read_tasks(runs))
        return arrays

    @property
    def batch_bytes(self) -> int:  # type: ignore[override]
        return self._file.task_bytes  # a store's: a task of concurrent GETs

    def read_into(self, entry: EntryLayout, begin: int, end: int, dest: Any) -> None:
        start = self.data_start + entry.begin
        if self._map is not None:  # numpy's copy releases the GIL, so pool threads run in parallel
            n = end - begin
            np.copyto(np.frombuffer(dest, np.uint8, n),
                      np.frombuffer(self._map, np.uint8, n, start + begin))
            return
        self._file.readinto(start + begin, memoryview(dest)[: end - begin])

    def read_tasks(self, requests: Sequence[Request]) -> list[Callable[[], None]]:
        """Copies from the map, else the source's reads (`shards.files.ByteSource.read_tasks`), cut
        into tasks of about READ_CHUNK bytes; one task when they are small."""
        if self._map is None:  # a request that starts where the last ends joins its run
            runs: list[tuple[int, list[np.ndarray]]] = []
            end_of_run = -1
            for e, b, n, d in requests:
                if n > b:
                    at = self.data_start + e.begin + b
                    if at != end_of_run:
                        runs.append((at, []))
                    runs[-1][1].append(np.frombuffer(d, np.uint8, n - b))
                    end_of_run = at + n - b
            return self._file.read_tasks(runs)
        copies = []
        for entry, begin, end, dest in requests:
            for pos in range(begin, end, READ_CHUNK):
                nxt = min(end, pos + READ_CHUNK)
                copies.append((partial(self.read_into, entry, pos, nxt,
                                       memoryview(dest)[pos - begin : nxt - begin]),
                               nxt - pos, 1))
        return pool_tasks(copies)

    def close(self) -> None:
        self._map = None  # unmapped when the last view of it goes
        self._file.close()


def check_shard_size(path: str, size: int, info: ShardInfo) -> None:
    """The shard file must be exactly as long as the manifest recorded."""
    if size < info.bytes:
        raise TruncatedShardError(
            f"{path}: shard is truncated: file has {size} bytes, the manifest records {info.bytes}"
        )
    if size > info.bytes:
        raise CheckpointFormatError(
            f"{path}: shard file has {size} bytes, but the manifest records {info.bytes} "
            "(replaced or appended to after the checkpoint was written)"
        )


Opener = Callable[..., ShardSource]
_OPENERS: dict[str, Opener] = {"raw": RawShard}
# codec -> (module, function) imported on first use; the function has the Opener signature
_LAZY_CODECS: dict[str, tuple[str, str]] = {"zstd": ("shardkit.shards.skz", "open_zstd_shard")}
_codec_lock = threading.Lock()


def register_codec(codec: str, opener: Opener) -> None:
    """Make `opener(path, info, *, mmap, file)` -> ShardSource read shards stored with `codec`;
    `file` is the shard, already opened safely (a `shardkit.shards.files.CheckpointFile`): read it
    through ``with file as fd`` or map it with ``file.map()``, never by `path`."""
    with _codec_lock:
        _OPENERS[codec] = opener


def shard_opener(codec: str, path: str) -> Opener:
    with _codec_lock:
        opener = _OPENERS.get(codec)
        if opener is None and codec in _LAZY_CODECS:
            module, name = _LAZY_CODECS[codec]
            opener = _OPENERS[codec] = getattr(import_module(module), name)
    if opener is None:
        raise UnknownCodecError(
            f"{path}: shard codec {codec!r} is not supported by this shardkit "
            f"(known: {', '.join(sorted(set(_OPENERS) | set(_LAZY_CODECS)))})"
        )
    return opener
