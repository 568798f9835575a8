"""Shard sources: byte access to the entries of one opened shard file.

A shard's codec selects its `ShardSource` implementation: ``"raw"`` (a safetensors file, mapped
or read with ``os.preadv``) here, others registered with `register_codec` or imported lazily
(see `_LAZY_CODECS`).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from functools import partial
from importlib import import_module
from typing import Any

import numpy as np

from .._kernels import _gather, _table, _views
from ..errors import (
    CheckpointFormatError,
    ShardIOError,
    TruncatedShardError,
    UnknownCodecError,
)
from ..format import (
    EntryLayout,
    ShardInfo,
    check_generation,
    entries_at,
    read_expected_safetensors_header,
    read_safetensors_header,
)
from .files import CheckpointFile, open_shard_file

READ_CHUNK = 8 * 1024 * 1024  # bytes per pread job; big enough that syscall cost vanishes
PARALLEL_MIN = 2 * READ_CHUNK  # bytes of reads from which they go to a pool
_ADVISE_MIN = 64 * 1024 * 1024  # bytes of a whole-array read from which readahead is asked for
_PARALLEL_MIN_ENTRY = 256 * 1024  # mean entry size from which whole-entry reads go in parallel


class ShardSource:
    """Byte access to the entries of one opened shard file (the codec extension point).

    `entries` maps entry name -> EntryLayout (offsets relative to the logical data region).
    `read_into` copies bytes ``[begin, end)`` of an entry (relative to the entry's start) into the
    writable byte buffer `dest`; it must be safe to call from several threads at once.
    `view` returns a zero-copy buffer of those bytes (writable: a private map), or None if the
    codec cannot.
    `read_granularity`: the reader cuts large reads at multiples of it in data-region
    coordinates (e.g. a codec's chunk size). Ranges the reader asks for always hold whole items
    of the entry's dtype.
    """

    path: str
    info: ShardInfo
    entries: dict[str, EntryLayout]
    read_granularity: int = READ_CHUNK

    def read_into(self, entry: EntryLayout, begin: int, end: int, dest: memoryview) -> None:
        raise NotImplementedError

    def view(self, entry: EntryLayout, begin: int, end: int) -> memoryview | None:
        return None

    def close(self) -> None:
        pass


class RawShard(ShardSource):
    """A raw (safetensors) shard, memory-mapped (`mmap=True`) or read with ``os.preadv``."""

    def __init__(self, path: str, info: ShardInfo, *, mmap: bool = True,
                 expected: tuple[list[str], list[str], list[tuple[int, ...]]] | None = None,
                 file: CheckpointFile | None = None, follow_symlinks: bool = False,
                 header: tuple[dict[str, EntryLayout], dict[str, str], int] | None = None
                 ) -> None:
        """`expected`: the entries (names, dtype names, shapes, in data-region order) the index
        says the shard holds; when the header is exactly the writer's encoding of them it is
        taken without parsing, `begins` holds their offsets and `matches_index` is True (see
        read_expected_safetensors_header). `file`: the shard already opened through the
        checkpoint's directory handle (else `path` is opened, see `shardkit.shards.files`).
        `header`: (entries, metadata, data_start) of this very file, already parsed and checked
        (a foreign layout's adapter did, `formats.ParsedHeader`): not read again.

        A mapped shard is mapped copy-on-write and keeps no descriptor: views of it are
        writable, writing to them never reaches the file, and the map lives as long as they do.
        """
        self.path = path
        self.info = info
        self.begins: list[int] | None = None
        self._entries: dict[str, EntryLayout] | None = None
        self._expected = expected
        self._map: Any = None
        self._file = file if file is not None else open_shard_file(path, follow_symlinks)
        try:
            size = self._file.size
            check_shard_size(path, size, info)
            if header is not None:
                self._entries, self.metadata, self.data_start = header
            else:
                self._read_header(size, expected)
            check_generation(self.metadata, info.generation, path)
            if mmap:  # the file holds at least the 8-byte prefix, so the map is never empty
                self._map = self._file.take_map()
        except BaseException:
            self._file.close()
            raise
        self._size = size

    def _read_header(self, size: int,
                     expected: tuple[list[str], list[str], list[tuple[int, ...]]] | None) -> None:
        if expected is None:
            self._entries, self.metadata, self.data_start = read_safetensors_header(
                self._file.read, size, self.path
            )
        else:
            self._entries, self.metadata, self.data_start, self.begins = (
                read_expected_safetensors_header(self._file.read, size, self.path, *expected,
                                                 generation=self.info.generation)
            )

    @property
    def matches_index(self) -> bool:
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
        map, or without one new arrays, filled by vectored reads of about READ_CHUNK bytes over
        runs of adjacent entries; `run` executes those reads (default: one after the other)."""
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
        reads = []
        runs = list(zip([0, *cuts.tolist()], [*cuts.tolist(), len(arrays)]))
        self._will_need([(self.data_start + int(starts[lo]), int(ends[hi - 1] - starts[lo]))
                         for lo, hi in runs])
        for lo, hi in runs:
            run_arrays = [arrays[j] for j in order[lo:hi].tolist()]
            for bufs, at, want in _read_pieces(run_arrays, self.data_start + int(starts[lo]),
                                               READ_CHUNK):
                reads.append(partial(self._read_arrays, bufs, at, want))
        # Many small arrays are bound by per-array work under the GIL: threads do not help them.
        if run is None or int(nbytes.sum()) < len(arrays) * _PARALLEL_MIN_ENTRY:
            run = run_each
        run(reads)
        return arrays

    def _will_need(self, ranges: list[tuple[int, int]]) -> None:
        """Tell the kernel that the byte ranges (offset, length) are read next, so that it
        reads them ahead in large requests. Without it, a file not in the page cache is read
        at the pace of the default readahead window, which chunks read by two threads in turn
        keep small: a cold 1.5 GB TensorBundle read took 4-6 s here against 1.5-2.5 s with the
        advice (TensorFlow's one sequential reader: 1.9-2.7 s). About 0.1 ms when cached."""
        if not hasattr(os, "posix_fadvise") or sum(n for _, n in ranges) < _ADVISE_MIN:
            return
        with self._file as fd:
            for at, n in ranges:
                try:
                    os.posix_fadvise(fd, at, n, os.POSIX_FADV_WILLNEED)
                except OSError:  # advice only (some file systems refuse it)
                    return

    def _read_arrays(self, bufs: list[np.ndarray], at: int, want: int) -> None:
        with self._file as fd:
            try:
                got = _gather.read_arrays(fd, bufs, at)
            except OSError as e:
                raise ShardIOError(e.errno, f"{self.path}: cannot read {want} bytes at {at}: "
                                            f"{e.strerror}") from None
        if got != want:
            raise TruncatedShardError(
                f"{self.path}: unexpected end of file at byte {at + got} "
                f"(needed {want - got} more bytes)"
            )

    def read_into(self, entry: EntryLayout, begin: int, end: int, dest: memoryview) -> None:
        start = self.data_start + entry.begin
        if self._map is not None:  # numpy's copy releases the GIL, so pool threads run in parallel
            n = end - begin
            np.copyto(np.frombuffer(dest, np.uint8, n),
                      np.frombuffer(self._map, np.uint8, n, start + begin))
            return
        with self._file as fd:
            pread_into(fd, dest[: end - begin], start + begin, self.path)

    def close(self) -> None:
        self._map = None  # unmapped when the last view of it goes
        self._file.close()


def _read_pieces(arrays: list[np.ndarray], start: int, chunk: int
                 ) -> list[tuple[list[np.ndarray], int, int]]:
    """Cut adjacent arrays (the first at file offset `start`) into reads of about `chunk`
    bytes: (buffers, offset, bytes). An array that does not fit a read is cut into byte views."""
    out: list[tuple[list[np.ndarray], int, int]] = []
    bufs: list[np.ndarray] = []
    at, size = start, 0
    for a in arrays:
        n = a.nbytes
        if size + n <= chunk:  # the usual case: whole arrays, no views made
            bufs.append(a)
            size += n
            continue
        flat = a.reshape(-1).view(np.uint8)
        pos = 0
        while pos < n:
            take = min(n - pos, chunk - size)
            bufs.append(flat[pos : pos + take])
            size += take
            pos += take
            if size == chunk:
                out.append((bufs, at, size))
                at, bufs, size = at + size, [], 0
    if bufs:
        out.append((bufs, at, size))
    return out


def run_each(calls: Sequence[Callable[[], None]]) -> None:
    """Run `calls` one after the other, on this thread."""
    for call in calls:
        call()


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


def pread_into(fd: int, dest: memoryview, offset: int, path: str) -> None:
    """Fill `dest` from `fd` at `offset` (os.preadv releases the GIL); short file -> error."""
    done, n = 0, len(dest)
    while done < n:
        try:
            got = os.preadv(fd, [dest[done:]], offset + done)
        except OSError as e:
            raise ShardIOError(e.errno, f"{path}: cannot read {n - done} bytes at "
                                        f"{offset + done}: {e.strerror}") from None
        if got == 0:
            raise TruncatedShardError(
                f"{path}: unexpected end of file at byte {offset + done} "
                f"(needed {n - done} more bytes)"
            )
        done += got


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
