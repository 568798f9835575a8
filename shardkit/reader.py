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
import operator
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import groupby, repeat
from typing import Any

import numpy as np
import xxhash

from ._threads import WorkerPool
from .dtypes import numpy_dtype
from .errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    ChecksumError,
    CorruptHeaderError,
    CorruptIndexError,
    KeyNotFoundError,
    ReaderClosedError,
)
from .format import (
    INDEX_FILE,
    MAX_INDEX_BYTES,
    CheckpointIndex,
    EntryLayout,
    SliceInfo,
    TensorInfo,
    decode_index,
)
from .slices import SliceSpec, parse_slice_spec
from .slicing import (
    MAX_PIECES,
    byte_span,
    c_strides,
    normalize_index,
    plan_piece,
    refine,
    span_shape,
)
from .sources import (
    _PARALLEL_MIN,
    READ_CHUNK,
    RawShard,
    ShardSource,
    _opener,
    _run_each,
)
from .tensors import _gc_paused


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
    def generation(self) -> str | None:
        """The checkpoint's generation (a unique id made once per save, format 2.1); every
        shard read is checked to be of it. None for a format 2.0 checkpoint, which has none."""
        return self.index.generation

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
        ranges, final_shape = normalize_index(index, t.shape, key)
        box_shape = tuple(len(r) for r in ranges)
        if math.prod(box_shape) == 0:
            return np.empty(final_shape, dtype)
        item = dtype.itemsize
        pieces: list[tuple[tuple[slice, ...], np.ndarray, bool]] = []
        jobs: list[tuple[ShardSource, EntryLayout, int, int, memoryview]] = []
        for s, spec in zip(t.slices, self._slice_specs(key, t)):
            plan = plan_piece(ranges, spec)
            if plan is None:
                continue
            strides = c_strides(spec.shape, item)
            src, entry = self._entry(key, s)
            out_index, lo, hi, local = plan
            b0, b1 = byte_span(lo, hi, strides, item)
            view = src.view(entry, b0, b1)
            if view is not None:  # mapped: only the pages touched are ever read
                box = np.ndarray(span_shape(lo, hi), dtype, buffer=view, strides=strides)
                pieces.append((out_index, box[local], True))
                continue
            for out_index, lo, hi, local in refine(plan, strides, item, [MAX_PIECES]):
                b0, b1 = byte_span(lo, hi, strides, item)
                buf = np.empty(b1 - b0, np.uint8)
                jobs.append((src, entry, b0, b1, buf.data))
                box = np.ndarray(span_shape(lo, hi), dtype, buffer=buf, strides=strides)
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
