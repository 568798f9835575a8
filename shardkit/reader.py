"""CheckpointReader: lazy, zero-copy reading of a shardkit checkpoint directory.

The reader owns the shard maps. A whole tensor of a raw shard comes back as a read-only numpy view
of a memory map; each view holds a buffer export on its map, so the map cannot be unmapped while a
view is alive: ``close()`` drops the reader's reference (``mmap.close()`` raises BufferError while
views exist; that is caught) and the map is unmapped when its last view dies. With ``mmap=False``
every read is a set of large ``os.preadv`` calls on a thread pool into owned, writable arrays.

Shard files are opened and their headers parsed and checked against the index on first use. A
shard's codec selects its `ShardSource` implementation: ``"raw"`` here, others registered with
`register_codec` or imported lazily (see `_LAZY_CODECS`).
"""

from __future__ import annotations

import difflib
import math
import mmap as _mmap
import operator
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from importlib import import_module
from itertools import groupby, repeat
from typing import Any

import numpy as np
import xxhash

from ._kernels import _gather, _table, _views
from ._threads import WorkerPool
from .dtypes import numpy_dtype, safetensors_name
from .errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    ChecksumError,
    CorruptHeaderError,
    CorruptIndexError,
    KeyNotFoundError,
    MissingShardError,
    ReaderClosedError,
    RestoreMismatchError,
    SliceIndexError,
    TruncatedShardError,
    UnknownCodecError,
    UnsupportedDTypeError,
)
from .format import (
    INDEX_FILE,
    MAX_INDEX_BYTES,
    CheckpointIndex,
    EntryLayout,
    ShardInfo,
    SliceInfo,
    TensorInfo,
    decode_index,
    entries_at,
    read_expected_safetensors_header,
    read_safetensors_header,
)
from .slices import SliceSpec, parse_slice_spec
from .tensors import _gc_paused, flatten, to_host

READ_CHUNK = 8 * 1024 * 1024  # bytes per pread job; big enough that syscall cost vanishes
_PARALLEL_MIN = 2 * READ_CHUNK
_PARALLEL_MIN_ENTRY = 256 * 1024  # mean entry size from which whole-entry reads go in parallel


# --- shard sources ------------------------------------------------------------------------------


class ShardSource:
    """Byte access to the entries of one opened shard file (the codec extension point).

    `entries` maps entry name -> EntryLayout (offsets relative to the logical data region).
    `read_into` copies bytes ``[begin, end)`` of an entry (relative to the entry's start) into the
    writable byte buffer `dest`; it must be safe to call from several threads at once.
    `view` returns a zero-copy read-only buffer of those bytes, or None if the codec cannot.
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
                 expected: tuple[list[str], list[str], list[tuple[int, ...]]] | None = None
                 ) -> None:
        """`expected`: the entries (names, dtype names, shapes, in data-region order) the index
        says the shard holds; when the header is exactly the writer's encoding of them it is
        taken without parsing, `begins` holds their offsets and `matches_index` is True (see
        read_expected_safetensors_header)."""
        self.path = path
        self.info = info
        self.begins: list[int] | None = None
        self._entries: dict[str, EntryLayout] | None = None
        self._expected = expected
        self._map: _mmap.mmap | None = None
        self._fd = _open_shard_fd(path)
        try:
            size = os.fstat(self._fd).st_size
            check_shard_size(path, size, info)
            if expected is None:
                self._entries, self.metadata, self.data_start = read_safetensors_header(
                    self._fd, size, path
                )
            else:
                self._entries, self.metadata, self.data_start, self.begins = (
                    read_expected_safetensors_header(self._fd, size, path, *expected)
                )
            if mmap:  # the file holds at least the 8-byte prefix, so the map is never empty
                self._map = _mmap.mmap(self._fd, size, access=_mmap.ACCESS_READ)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise
        if self._map is not None:
            os.close(self._fd)
            self._fd = -1
        self._size = size

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
        """The whole entries at `begins` (data-region offsets): read-only views of the map, or
        without one new arrays, filled by vectored reads of about READ_CHUNK bytes over runs of
        adjacent entries; `run` executes those reads (default: one after the other)."""
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
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(arrays)]):
            run_arrays = [arrays[j] for j in order[lo:hi].tolist()]
            for bufs, at, want in _read_pieces(run_arrays, self.data_start + int(starts[lo]),
                                               READ_CHUNK):
                reads.append(partial(self._read_arrays, bufs, at, want))
        # Many small arrays are bound by per-array work under the GIL: threads do not help them.
        if run is None or int(nbytes.sum()) < len(arrays) * _PARALLEL_MIN_ENTRY:
            run = _run_each
        run(reads)
        return arrays

    def _read_arrays(self, bufs: list[np.ndarray], at: int, want: int) -> None:
        got = _gather.read_arrays(self._fd, bufs, at)
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
        pread_into(self._fd, dest[: end - begin], start + begin, self.path)

    def __del__(self) -> None:  # a reader dropped without close() must not leak descriptors
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # views are alive: the map is unmapped when the last one dies
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


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


def _run_each(calls: Sequence[Callable[[], None]]) -> None:
    for call in calls:
        call()


def _open_shard_fd(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise MissingShardError(
            f"{path}: shard file listed in {INDEX_FILE} is missing from the checkpoint"
        ) from None
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot open shard file: {e.strerror}") from None


def check_shard_size(path: str, size: int, info: ShardInfo) -> None:
    """The shard file must be exactly as long as index.json recorded."""
    if size < info.bytes:
        raise TruncatedShardError(
            f"{path}: shard is truncated: file has {size} bytes, {INDEX_FILE} records {info.bytes}"
        )
    if size > info.bytes:
        raise CheckpointFormatError(
            f"{path}: shard file has {size} bytes, but {INDEX_FILE} records {info.bytes} "
            "(replaced or appended to after the checkpoint was written)"
        )


def pread_into(fd: int, dest: memoryview, offset: int, path: str) -> None:
    """Fill `dest` from `fd` at `offset` (os.preadv releases the GIL); short file -> error."""
    done, n = 0, len(dest)
    while done < n:
        got = os.preadv(fd, [dest[done:]], offset + done)
        if got == 0:
            raise TruncatedShardError(
                f"{path}: unexpected end of file at byte {offset + done} "
                f"(needed {n - done} more bytes)"
            )
        done += got


Opener = Callable[..., ShardSource]
_OPENERS: dict[str, Opener] = {"raw": RawShard}
# codec -> (module, function) imported on first use; the function has the Opener signature
_LAZY_CODECS: dict[str, tuple[str, str]] = {"zstd": ("shardkit.compression", "open_zstd_shard")}
_codec_lock = threading.Lock()


def register_codec(codec: str, opener: Opener) -> None:
    """Make `opener(path, info, *, mmap)` -> ShardSource read shards stored with `codec`."""
    with _codec_lock:
        _OPENERS[codec] = opener


def _opener(codec: str, path: str) -> Opener:
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


# --- the reader ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SlicePlacement:
    """Where one stored slice of a tensor lives."""

    spec: str
    shard: int
    file: str
    entry: str
    xxh3: str | None


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """What `CheckpointReader.info` reports about one tensor."""

    key: str
    dtype: np.dtype
    dtype_name: str
    shape: tuple[int, ...]
    device: str
    nbytes: int
    slices: tuple[SlicePlacement, ...]

    @property
    def is_split(self) -> bool:
        return len(self.slices) > 1


class CheckpointReader:
    """Read a checkpoint directory lazily; use as a context manager.

    ``reader[key]`` / `get` return the whole tensor (a read-only view of the map when it is one
    raw entry and `mmap` is on; otherwise a new array). `get_slice` reads a numpy basic index of
    the full tensor, touching only the bytes it needs. `verify` checks every checksum.
    """

    def __init__(self, path: str | os.PathLike[str], *, mmap: bool = True,
                 verify: bool = False) -> None:
        self.path = os.fspath(path)
        self._mmap = bool(mmap)
        self.index: CheckpointIndex = _read_index(self.path)
        self._shard_paths = [os.path.join(self.path, s.file) for s in self.index.shards]
        self._sources: dict[int, ShardSource] = {}
        self._specs: dict[str, list[SliceSpec]] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0  # reads in flight; close() waits for them before releasing files
        self._pool: WorkerPool | None = None
        self._closed = False
        if verify:
            try:
                self.verify()
            except BaseException:
                self.close()
                raise

    # -- mapping-like API

    @property
    def metadata(self) -> dict[str, Any]:
        """The user metadata saved with the checkpoint."""
        return self.index.user_metadata

    def keys(self) -> list[str]:
        """Checkpoint keys in the order they were saved."""
        return list(self.index.keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self.index.keys)

    def __len__(self) -> int:
        return len(self.index.keys)

    def __contains__(self, key: object) -> bool:
        try:
            self.index.row(key)  # type: ignore[arg-type]
        except (KeyError, TypeError):
            return False
        return True

    def __getitem__(self, key: str) -> np.ndarray:
        return self.get(key)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self)} tensors"
        return f"CheckpointReader({self.path!r}, {state})"

    def info(self, key: str) -> KeyInfo:
        """dtype, full shape, device and stored slices (with shard file names) of `key`."""
        t = self._tensor(key)
        shards = self.index.shards
        return KeyInfo(
            key, numpy_dtype(t.dtype), t.dtype, t.shape, t.device, t.nbytes,
            tuple(SlicePlacement(s.spec, s.shard, shards[s.shard].file, s.entry, s.xxh3)
                  for s in t.slices),
        )

    # -- reading

    def get(self, key: str) -> np.ndarray:
        """The whole tensor `key` (ml_dtypes arrays for bfloat16 / float8)."""
        self._begin_read()
        try:
            return self._get(key)
        finally:
            self._end_read()

    def _get_many(self, keys: Sequence[str] | None) -> dict[str, np.ndarray]:
        """`get` of each key, in bulk: whole tensors of a raw mapped shard become views in one
        pass per shard; whole tensors stored in compressed shards are read in one batch, so
        that every chunk is decoded once and the chunks are decoded in parallel."""
        self._begin_read()
        try:
            with _gc_paused():  # one GC pass at the end, not one per ~700 new arrays
                return self._get_many_unlocked(keys)
        finally:
            self._end_read()

    def _get_many_unlocked(self, keys: Sequence[str] | None) -> dict[str, np.ndarray]:
        index = self.index
        if keys is None:
            everything = self._get_everything()
            if everything is not None:
                return everything
            keys = index.keys
        keys = list(dict.fromkeys(keys))
        try:
            rows = list(map(index.rows().__getitem__, keys))
        except (KeyError, TypeError):
            for key in keys:
                self._tensor(key)  # raises KeyNotFoundError, with a hint
            raise
        self._check_open()
        results: list[Any] = [None] * len(keys)
        counts = index.slice_counts()[rows].tolist()
        firsts = index.first_slice()[rows].tolist()
        shards = list(map(index.slice_shard.__getitem__, firsts))
        whole = [i for i, c in enumerate(counts) if c == 1]
        whole.sort(key=shards.__getitem__)  # stable: by shard, then in the order asked
        dtype_names = list(map(index.dtypes.__getitem__, rows))
        dtypes = {name: numpy_dtype(name) for name in set(dtype_names)}
        entry_names = index.entry_names()
        slice_shapes = index.slice_shapes()
        jobs: list[tuple[ShardSource, EntryLayout, int, int, memoryview]] = []
        for shard, group in groupby(whole, key=shards.__getitem__):
            idx = list(group)
            src = self._shard_for(keys[idx[0]], shard)
            slice_ids = list(map(firsts.__getitem__, idx))
            dts = list(map(dtypes.__getitem__, map(dtype_names.__getitem__, idx)))
            shapes = list(map(slice_shapes.__getitem__, slice_ids))
            if isinstance(src, RawShard):  # codec sources (duck-typed) decode instead
                for i, a in zip(idx, src.whole_arrays(self._begins(src, shard, slice_ids), dts,
                                                      shapes, self._run_reads)):
                    results[i] = a
                continue
            for i, j, dtype, shape in zip(idx, slice_ids, dts, shapes):
                entry = src.entries[entry_names[j]]  # checked on open
                if hasattr(src, "read_tasks"):
                    results[i] = a = np.empty(shape, dtype)
                    if entry.nbytes:
                        jobs.append((src, entry, 0, entry.nbytes, _bytes_of(a)))
                else:
                    results[i] = self._whole_entry(src, entry, dtype, shape)
        self._read_jobs(jobs)
        for i, c in enumerate(counts):
            if c > 1:
                results[i] = self._get(keys[i])
        return dict(zip(keys, results))

    def _get_everything(self) -> dict[str, np.ndarray] | None:
        """Every tensor, when each is stored whole in a raw shard: views of the maps (or arrays
        read in runs, with ``mmap=False``) made shard by shard straight from the index columns.
        None otherwise (the general path decides)."""
        index = self.index
        if len(index.slice_tensor) != len(index.keys) or any(index.slice_spec):
            return None
        self._check_open()
        results: list[Any] = [None] * len(index.keys)
        dtypes = {name: numpy_dtype(name) for name in set(index.dtypes)}
        slice_shapes = index.slice_shapes()
        for shard in range(len(index.shards)):
            r = index.shard_range(shard)
            if not r:
                continue
            rows = index.slice_tensor[r.start : r.stop]
            src = self._shard_for(index.keys[rows[0]], shard)
            if not isinstance(src, RawShard):
                return None
            begins = self._begins(src, shard, r)
            names = list(map(index.dtypes.__getitem__, rows))
            dts = ([dtypes[names[0]]] * len(names) if len(dtypes) == 1
                   else list(map(dtypes.__getitem__, names)))
            views = src.whole_arrays(begins, dts, slice_shapes[r.start : r.stop],
                                     self._run_reads)
            if rows[0] == r.start and rows[-1] == r.stop - 1 and rows == list(r):
                results[r.start : r.stop] = views
            else:
                for row, view in zip(rows, views):
                    results[row] = view
        return dict(zip(index.keys, results))

    def _begins(self, src: RawShard, shard: int, slice_ids: Sequence[int]) -> list[int]:
        """Where the entries of stored slices `slice_ids` (all in `shard`) start."""
        if src.begins is not None:  # the header matched the index: offsets by position
            lo = self.index.shard_range(shard).start
            if isinstance(slice_ids, range) and slice_ids == range(lo, lo + len(src.begins)):
                return src.begins
            return [src.begins[j - lo] for j in slice_ids]
        names = self.index.entry_names()
        return [src.entries[names[j]].begin for j in slice_ids]

    def _read_direct(self, targets: Sequence[tuple[str, np.ndarray]]) -> set[str]:
        """Decode whole tensors stored in compressed shards straight into their target arrays
        (C-contiguous, writable, the stored dtype), in one parallel batch; returns those keys.
        The other keys are left to `get` (a raw shard is a map: nothing to decode)."""
        self._begin_read()
        try:
            done: set[str] = set()
            jobs: list[tuple[ShardSource, EntryLayout, int, int, memoryview]] = []
            for key, target in targets:
                t = self._tensor(key)
                if (len(t.slices) > 1 or not target.flags.c_contiguous
                        or not target.flags.writeable or target.dtype != numpy_dtype(t.dtype)):
                    continue
                src, entry = self._entry(key, t.slices[0])
                if not hasattr(src, "read_tasks"):
                    continue
                if entry.nbytes:
                    jobs.append((src, entry, 0, entry.nbytes, _bytes_of(target)))
                done.add(key)
            self._read_jobs(jobs)
            return done
        finally:
            self._end_read()

    def _get(self, key: str) -> np.ndarray:
        t = self._tensor(key)
        dtype = numpy_dtype(t.dtype)
        if len(t.slices) == 1:  # spec "" or a box covering the whole tensor (tiling checked)
            src, entry = self._entry(key, t.slices[0])
            return self._whole_entry(src, entry, dtype, t.shape)
        out = np.empty(t.shape, dtype)
        jobs: list[tuple[ShardSource, EntryLayout, int, int, memoryview]] = []
        later: list[tuple[np.ndarray, np.ndarray]] = []
        for s, spec in zip(t.slices, self._slice_specs(key, t)):
            src, entry = self._entry(key, s)
            if entry.nbytes == 0:
                continue
            target = out[spec.to_index()]
            if target.flags.c_contiguous:  # e.g. split along axis 0: straight into `out`
                jobs.append((src, entry, 0, entry.nbytes, _bytes_of(target)))
                continue
            view = src.view(entry, 0, entry.nbytes)
            if view is not None:
                target[...] = np.frombuffer(view, dtype).reshape(spec.shape)
            else:
                tmp = np.empty(spec.shape, dtype)
                jobs.append((src, entry, 0, entry.nbytes, _bytes_of(tmp)))
                later.append((target, tmp))
        self._read_jobs(jobs)
        for target, tmp in later:
            target[...] = tmp
        return out

    def get_slice(self, key: str, index: Any) -> np.ndarray:
        """``full_tensor[index]`` for a numpy basic index (ints, slices with steps, ``...``,
        None), reading only the needed bytes of the stored slices that intersect it.

        The result is a read-only view of the map when it comes from one raw entry and `mmap` is
        on, else a new array.
        """
        self._begin_read()
        try:
            return self._get_slice(key, index)
        finally:
            self._end_read()

    def _get_slice(self, key: str, index: Any) -> np.ndarray:
        t = self._tensor(key)
        dtype = numpy_dtype(t.dtype)
        ranges, final_shape = _normalize_index(index, t.shape, key)
        box_shape = tuple(len(r) for r in ranges)
        if math.prod(box_shape) == 0:
            return np.empty(final_shape, dtype)
        item = dtype.itemsize
        pieces: list[tuple[tuple[slice, ...], np.ndarray, bool]] = []
        jobs: list[tuple[ShardSource, EntryLayout, int, int, memoryview]] = []
        for s, spec in zip(t.slices, self._slice_specs(key, t)):
            plan = _plan_piece(ranges, spec)
            if plan is None:
                continue
            strides = _c_strides(spec.shape, item)
            src, entry = self._entry(key, s)
            out_index, lo, hi, local = plan
            b0, b1 = _byte_span(lo, hi, strides, item)
            view = src.view(entry, b0, b1)
            if view is not None:  # mapped: only the pages touched are ever read
                box = np.ndarray(_span_shape(lo, hi), dtype, buffer=view, strides=strides)
                pieces.append((out_index, box[local], True))
                continue
            for out_index, lo, hi, local in _refine(plan, strides, item, [_MAX_PIECES]):
                b0, b1 = _byte_span(lo, hi, strides, item)
                buf = np.empty(b1 - b0, np.uint8)
                jobs.append((src, entry, b0, b1, buf.data))
                box = np.ndarray(_span_shape(lo, hi), dtype, buffer=buf, strides=strides)
                pieces.append((out_index, box[local], False))
        self._read_jobs(jobs)
        if len(pieces) == 1 and pieces[0][2] and pieces[0][1].shape == box_shape:
            return pieces[0][1].reshape(final_shape)
        out = np.empty(box_shape, dtype)
        for out_index, piece, _ in pieces:
            out[out_index] = piece
        return out.reshape(final_shape)

    def verify(self, keys: Sequence[str] | None = None) -> int:
        """Open every shard (checks headers against the index) and compare the xxh3-64 of every
        stored entry of `keys` (default: all) with the index. Returns the number of entries
        whose checksum was compared (entries saved without a checksum are skipped)."""
        self._begin_read()
        try:
            return self._verify(keys)
        finally:
            self._end_read()

    def _verify(self, keys: Sequence[str] | None) -> int:
        if keys is None:
            for i in range(len(self.index.shards)):
                src = self._source(i)
                if hasattr(src, "verify_frames"):  # compressed: every frame, even unlisted bytes
                    src.verify_frames(self._get_pool())
            keys = self.keys()
        checked = 0
        for key in keys:
            t = self._tensor(key)
            for s in t.slices:
                src, entry = self._entry(key, s)  # structure checked even without a checksum
                if s.xxh3 is None:
                    continue
                found = _xxh3_of(src, entry)
                if found != s.xxh3:
                    raise ChecksumError(
                        f"{src.path}: checksum mismatch for key {key!r} slice {s.spec!r} "
                        f"(entry {entry.name!r}): {INDEX_FILE} records xxh3 {s.xxh3}, the stored "
                        f"bytes hash to {found}"
                    )
                checked += 1
        return checked

    def close(self) -> None:
        """Release files and maps. Arrays already returned stay valid (they keep their map)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._active:  # never pull a file from under a read in another thread
                self._idle.wait()
            sources, self._sources = self._sources, {}
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        for src in sources.values():
            src.close()

    # -- internals

    def _begin_read(self) -> None:
        with self._lock:
            self._check_open()
            self._active += 1

    def _end_read(self) -> None:
        with self._lock:
            self._active -= 1
            if not self._active:
                self._idle.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise ReaderClosedError(f"checkpoint reader for {self.path} is closed")

    def _tensor(self, key: str) -> TensorInfo:
        self._check_open()
        try:
            return self.index.tensor_info(key)
        except (KeyError, TypeError):
            pass
        close = difflib.get_close_matches(str(key), self.index.keys, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise KeyNotFoundError(
            f"key {key!r} is not in checkpoint {self.path} ({len(self)} tensors){hint}"
        )

    def _slice_specs(self, key: str, t: TensorInfo) -> list[SliceSpec]:
        specs = self._specs.get(key)
        if specs is None:
            specs = self._specs[key] = [parse_slice_spec(s.spec, t.shape) for s in t.slices]
        return specs

    def _entry(self, key: str, s: SliceInfo) -> tuple[ShardSource, EntryLayout]:
        src = self._shard_for(key, s.shard)
        return src, src.entries[s.entry]  # presence checked when the shard was opened

    def _shard_for(self, key: str, shard: int) -> ShardSource:
        """`_source`, with the key being read named in an error."""
        try:
            return self._source(shard)
        except CheckpointFormatError as e:
            if f"key {key!r}" in str(e):
                raise
            # same error class, plus the key the caller asked for
            raise type(e)(f"{e} (while reading key {key!r})") from None

    def _source(self, i: int) -> ShardSource:
        src = self._sources.get(i)
        if src is not None:
            return src
        with self._lock:
            self._check_open()
            src = self._sources.get(i)
            if src is None:
                info = self.index.shards[i]
                path = self._shard_paths[i]
                opener = _opener(info.codec, path)
                if opener is RawShard:
                    src = RawShard(path, info, mmap=self._mmap, expected=self._expected(i))
                else:
                    src = opener(path, info, mmap=self._mmap)
                try:
                    if not getattr(src, "matches_index", False):
                        self._check_against_index(i, src)
                except BaseException:
                    src.close()
                    raise
                self._sources[i] = src
            return src

    def _expected(self, i: int) -> tuple[list[str], list[str], list[tuple[int, ...]]]:
        """What the index says shard `i` holds: entry names, dtype names and shapes, in
        data-region order."""
        index = self.index
        r = index.shard_range(i)
        names = index.entry_names()[r.start : r.stop]
        dtype_names = list(map(index.dtypes.__getitem__, index.slice_tensor[r.start : r.stop]))
        return names, dtype_names, index.slice_shapes()[r.start : r.stop]

    def _check_against_index(self, i: int, src: ShardSource) -> None:
        """Every slice the index puts in shard `i` must be an entry of it, same dtype and shape.

        Compared column-wise first (C-level maps); on any mismatch the per-slice check finds
        the first offender and words the message.
        """
        names, dtype_names, shapes = self._expected(i)
        entries = src.entries
        found = list(map(entries.get, names))
        if (
            not any(map(operator.is_, found, repeat(None)))
            and list(map(_dtype_name_of, found)) == dtype_names
            and list(map(_shape_of, found)) == shapes
        ):
            return
        index = self.index
        for j, name, dtype_name, shape, entry in zip(
            index.shard_range(i), names, dtype_names, shapes, found
        ):
            if entry is not None and entry.dtype_name == dtype_name and entry.shape == shape:
                continue
            key, spec = index.keys[index.slice_tensor[j]], index.slice_spec[j]
            where = f"{src.path}: entry {name!r} (key {key!r}, slice {spec!r})"
            if entry is None:
                raise CorruptHeaderError(f"{where} is listed in {INDEX_FILE} but not in the shard")
            raise CorruptHeaderError(
                f"{where} does not match {INDEX_FILE}: expected dtype {dtype_name} shape "
                f"{list(shape)}, the shard has dtype {entry.dtype_name} shape "
                f"{list(entry.shape)}"
            )

    def _whole_entry(
        self, src: ShardSource, entry: EntryLayout, dtype: np.dtype, shape: tuple[int, ...]
    ) -> np.ndarray:
        n = entry.nbytes
        view = src.view(entry, 0, n) if n else None
        if view is not None:
            return np.frombuffer(view, dtype).reshape(shape)
        out = np.empty(shape, dtype)
        if n:
            self._read_jobs([(src, entry, 0, n, _bytes_of(out))])
        elif self._mmap:
            out.flags.writeable = False  # same contract as a mapped view
        return out

    def _read_jobs(self, jobs: Sequence[tuple[ShardSource, EntryLayout, int, int, memoryview]]
                   ) -> None:
        """Run reads, cut into pieces at each source's granularity, on the pool when large.

        Reads from a source with ``read_tasks`` (compressed shards) go to it in one batch per
        source, which turns them into one task per chunk (each chunk is decoded once); the tasks
        of all sources run together on the pool.
        """
        batches: dict[int, tuple[Any, list[tuple[EntryLayout, int, int, memoryview]]]] = {}
        plain = []
        for job in jobs:
            if hasattr(job[0], "read_tasks"):
                batches.setdefault(id(job[0]), (job[0], []))[1].append(job[1:])
            else:
                plain.append(job)
        if batches:
            from .compression import run_tasks

            tasks = [t for src, batch in batches.values() for t in src.read_tasks(batch)]
            run_tasks(tasks, self._get_pool() if len(tasks) > 1 else None)
        jobs = plain
        if not jobs:
            return
        total = sum(end - begin for _, _, begin, end, _ in jobs)
        if total < _PARALLEL_MIN:
            for src, entry, begin, end, dest in jobs:
                src.read_into(entry, begin, end, dest)
            return
        pieces = []
        for src, entry, begin, end, dest in jobs:
            # cut at multiples of the granularity in data-region coordinates (codec chunks)
            step = max(1, src.read_granularity)
            base = entry.begin
            pos = begin
            while pos < end:
                nxt = min(end, ((base + pos) // step + 1) * step - base)
                pieces.append((src, entry, pos, nxt, dest[pos - begin : nxt - begin]))
                pos = nxt
        pool = self._get_pool()
        futures = [pool.submit(src.read_into, e, b, n, d) for src, e, b, n, d in pieces]
        for f in futures:
            f.result()

    def _run_reads(self, reads: Sequence[Callable[[], None]]) -> None:
        """Run independent reads, on the pool when there are several (they release the GIL)."""
        if len(reads) < 2:
            _run_each(reads)
            return
        pool = self._get_pool()
        for f in [pool.submit(read) for read in reads]:
            f.result()

    def _get_pool(self) -> WorkerPool:
        with self._lock:
            self._check_open()
            if self._pool is None:
                workers = max(2, min(8, os.cpu_count() or 1))
                self._pool = WorkerPool(workers, "shardkit-read")
                weakref.finalize(self, self._pool.shutdown, wait=False)
            return self._pool


def _read_index(path: str) -> CheckpointIndex:
    index_path = os.path.join(path, INDEX_FILE)
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the path {what}")
    try:
        with open(index_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_INDEX_BYTES:
                raise CorruptIndexError(
                    f"{index_path}: {size} bytes, over the {MAX_INDEX_BYTES}-byte limit"
                )
            data = f.read()
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"no checkpoint at {path}: {INDEX_FILE} is missing (an unfinished save leaves no "
            "index; the directory is not a complete shardkit checkpoint)"
        ) from None
    except IsADirectoryError:
        raise CorruptIndexError(f"{index_path} is a directory, not a file") from None
    return decode_index(data, index_path)


_dtype_name_of = operator.attrgetter("dtype_name")
_dtype_of = operator.attrgetter("dtype")
_shape_of = operator.attrgetter("shape")


def _bytes_of(a: np.ndarray) -> memoryview:
    """A writable byte view of a C-contiguous array (any dtype, 0-d included)."""
    return a.reshape(-1).view(np.uint8).data


def _c_strides(shape: tuple[int, ...], item: int) -> tuple[int, ...]:
    strides = []
    acc = item
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _xxh3_of(src: ShardSource, entry: EntryLayout) -> str:
    n = entry.nbytes
    view = src.view(entry, 0, n) if n else None
    if view is not None or n == 0:
        return xxhash.xxh3_64_hexdigest(view if view is not None else b"")
    h = xxhash.xxh3_64()
    buf = np.empty(min(n, READ_CHUNK), np.uint8)
    mv = buf.data
    pos = 0
    while pos < n:
        k = min(len(mv), n - pos)
        src.read_into(entry, pos, pos + k, mv[:k])
        h.update(mv[:k])
        pos += k
    return h.hexdigest()


# --- index arithmetic for get_slice -------------------------------------------------------------


def _normalize_index(
    index: Any, shape: tuple[int, ...], key: str
) -> tuple[list[range], tuple[int, ...]]:
    """Per-axis ranges of a basic index and the shape of the result."""
    items = list(index) if isinstance(index, tuple) else [index]
    n_ellipsis = sum(1 for it in items if it is Ellipsis)
    if n_ellipsis > 1:
        raise SliceIndexError(f"{key!r}: an index can only have a single ellipsis ('...')")
    n_axes = sum(1 for it in items if it is not None and it is not Ellipsis)
    if n_axes > len(shape):
        raise SliceIndexError(
            f"{key!r}: too many indices: {n_axes} for a tensor of shape {list(shape)}"
        )
    if n_ellipsis == 0:
        items.append(Ellipsis)
    ranges: list[range] = []
    final: list[int] = []
    axis = 0
    for it in items:
        if it is None:
            final.append(1)
        elif it is Ellipsis:
            for _ in range(len(shape) - n_axes):
                ranges.append(range(shape[axis]))
                final.append(shape[axis])
                axis += 1
        elif isinstance(it, slice):
            r = range(*it.indices(shape[axis]))
            ranges.append(r)
            final.append(len(r))
            axis += 1
        elif isinstance(it, (int, np.integer)) and not isinstance(it, (bool, np.bool_)):
            dim, i = shape[axis], int(it)
            if not -dim <= i < dim:
                raise SliceIndexError(
                    f"{key!r}: index {i} is out of bounds for axis {axis} with size {dim}"
                )
            i %= dim
            ranges.append(range(i, i + 1))
            axis += 1
        else:
            raise SliceIndexError(
                f"{key!r}: get_slice takes basic indices only (ints, slices, ..., None), "
                f"got {type(it).__name__} {it!r}"
            )
    return ranges, tuple(final)


def _positions(r: range, lo: int, hi: int) -> tuple[int, int]:
    """The positions p (an interval) of `r` whose values r[p] lie in [lo, hi)."""
    n, start, step = len(r), r.start, r.step
    if step > 0:
        p0 = -((start - lo) // step)  # ceil((lo - start) / step)
        p1 = -((start - hi) // step)
    else:
        s = -step
        p0 = (start - hi) // s + 1
        p1 = (start - lo) // s + 1
    return max(0, p0), min(n, p1)


Plan = tuple[tuple[slice, ...], list[int], list[int], tuple[slice, ...]]
_MAX_PIECES = 4096  # most separate reads one get_slice call makes to avoid reading gaps
_GAP_MIN = 1024 * 1024  # spans up to this size are read whole, gaps and all


def _byte_span(lo: list[int], hi: list[int], strides: tuple[int, ...], item: int
               ) -> tuple[int, int]:
    """Byte range, relative to the entry, from element `lo` to element `hi` inclusive."""
    b0 = sum(i * st for i, st in zip(lo, strides))
    return b0, sum(i * st for i, st in zip(hi, strides)) + item


def _span_shape(lo: list[int], hi: list[int]) -> tuple[int, ...]:
    return tuple(h - low + 1 for low, h in zip(lo, hi))


def _refine(plan: Plan, strides: tuple[int, ...], item: int, budget: list[int]) -> list[Plan]:
    """Split a piece along its outermost axis with several selected indices when its byte span
    is mostly gaps (more than 8x the needed bytes and over 1 MiB), one read per index, within
    a budget of reads; applied recursively to the parts."""
    out_index, lo, hi, local = plan
    b0, b1 = _byte_span(lo, hi, strides, item)
    counts = [len(range(*sl.indices(h - low + 1))) for sl, low, h in zip(local, lo, hi)]
    needed = math.prod(counts) * item
    if b1 - b0 <= max(_GAP_MIN, 8 * needed):
        return [plan]
    axis = next((k for k, c in enumerate(counts) if c > 1), None)
    if axis is None or counts[axis] > budget[0]:
        return [plan]
    budget[0] -= counts[axis]
    sl = local[axis]
    start, step = sl.indices(hi[axis] - lo[axis] + 1)[0], sl.step or 1
    out_start = out_index[axis].start
    parts: list[Plan] = []
    for i in range(counts[axis]):
        at = lo[axis] + start + i * step  # element index along `axis` in the stored slice
        o, l2, h2, loc = list(out_index), list(lo), list(hi), list(local)
        o[axis] = slice(out_start + i, out_start + i + 1)
        l2[axis] = h2[axis] = at
        loc[axis] = slice(0, 1)
        parts.extend(_refine((tuple(o), l2, h2, tuple(loc)), strides, item, budget))
    return parts


def _plan_piece(ranges: list[range], spec: SliceSpec) -> Plan | None:
    """How one stored slice contributes: (index into the output box, lowest and highest local
    element touched per axis, index into the dense local span box), or None if disjoint."""
    out_index, lo, hi, local = [], [], [], []
    for r, off, length in zip(ranges, spec.offsets, spec.lengths):
        p0, p1 = _positions(r, off, off + length)
        if p0 >= p1:
            return None
        sub = r[p0:p1]
        first, last = sub[0] - off, sub[-1] - off
        low, high = min(first, last), max(first, last)
        out_index.append(slice(p0, p1))
        lo.append(low)
        hi.append(high)
        start = first - low
        stop = start + (len(sub) - 1) * sub.step + (1 if sub.step > 0 else -1)
        local.append(slice(start, stop if stop >= 0 else None, sub.step))
    return tuple(out_index), lo, hi, tuple(local)


# --- functional front door ----------------------------------------------------------------------


def open_checkpoint(path: str | os.PathLike[str], *, mmap: bool = True) -> CheckpointReader:
    """Open a checkpoint for lazy reading (a CheckpointReader; close it or use ``with``)."""
    return CheckpointReader(path, mmap=mmap)


def load(
    path: str | os.PathLike[str],
    keys: Sequence[str] | None = None,
    *,
    verify: bool = False,
    mmap: bool = True,
) -> dict[str, np.ndarray]:
    """Read `keys` (default: all, in saved order) into a flat dict key -> array.

    With `mmap` whole raw tensors are read-only views of the shard maps (they stay valid after
    this returns). `verify` checks the checksums of the loaded entries first. A single str
    `keys` is one key.
    """
    with CheckpointReader(path, mmap=mmap) as reader:
        if isinstance(keys, str):
            keys = [keys]
        if keys is not None:
            keys = list(keys)
            for key in keys:
                reader._tensor(key)  # fail on a missing key before reading anything
        if verify:
            reader.verify(keys)
        return reader._get_many(keys)


def restore_into(path: str | os.PathLike[str], state: Mapping[str, Any], *,
                 verify: bool = False) -> list[str]:
    """Copy the stored value of every leaf of `state` (numpy arrays, torch tensors) into it, in
    place. Every leaf is checked (key present, shape, dtype) before anything is copied.
    Returns the restored keys."""
    leaves = flatten(state)
    with CheckpointReader(path) as reader:
        plans = []
        for key, leaf in leaves:
            t = reader._tensor(key)
            target, writeback = _restore_target(leaf, key)
            expected = numpy_dtype(t.dtype)
            found = target.dtype
            if found.byteorder == ">":
                found = found.newbyteorder("<")
            if tuple(target.shape) != t.shape or found != expected:
                raise RestoreMismatchError(
                    f"cannot restore key {key!r} from {reader.path}: the checkpoint has "
                    f"shape {list(t.shape)} dtype {_dtype_label(expected)}, the target has "
                    f"shape {list(target.shape)} dtype {_dtype_label(target.dtype)}"
                )
            if writeback is None and not target.flags.writeable:
                raise RestoreMismatchError(
                    f"cannot restore key {key!r}: the target array is read-only"
                )
            plans.append((key, target, writeback))
        if verify:
            reader.verify([key for key, _, _ in plans])
        direct = reader._read_direct([(key, target) for key, target, _ in plans])
        for key, target, writeback in plans:
            if key in direct:
                if writeback is not None:
                    _torch_copy_back(writeback, target)
                continue
            stored = reader.get(key)
            if target.dtype.byteorder == ">":
                np.copyto(target, stored, casting="equiv")
            else:
                np.copyto(target, stored, casting="no")
            if writeback is not None:
                _torch_copy_back(writeback, target)
    return [key for key, _, _ in plans]


def _dtype_label(dt: np.dtype) -> str:
    try:
        return f"{safetensors_name(dt)} ({dt})"
    except UnsupportedDTypeError:
        return str(dt)


def _restore_target(leaf: Any, key: str) -> tuple[np.ndarray, Any]:
    """A numpy array sharing memory with `leaf`, and the torch tensor to copy back into when
    the leaf does not live in host memory (else None)."""
    if isinstance(leaf, np.ndarray):
        return leaf, None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(leaf, torch.Tensor):
        if leaf.device.type == "cpu" and not (leaf.is_conj() or leaf.is_neg()):
            array, _ = to_host(leaf, key)  # a view of the tensor's memory on CPU
            return array, None
        array, _ = to_host(leaf, key)
        return np.array(array), leaf
    raise RestoreMismatchError(
        f"cannot restore key {key!r} in place into a {type(leaf).__name__}: only numpy arrays "
        "and torch tensors can be restored in place (use load() for a new dict)"
    )


def _torch_copy_back(tensor: Any, host: np.ndarray) -> None:
    import torch

    if tensor.dtype in (torch.bfloat16, getattr(torch, "float8_e4m3fn", None),
                        getattr(torch, "float8_e5m2", None)):
        carrier = np.int16 if host.dtype.itemsize == 2 else np.uint8
        src = torch.from_numpy(host.view(carrier)).view(tensor.dtype)
    else:
        src = torch.from_numpy(host)
    with torch.no_grad():
        tensor.copy_(src)
