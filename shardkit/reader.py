"""CheckpointReader: lazy, zero-copy reading of a shardkit checkpoint directory.

A whole tensor of a raw shard comes back as a numpy view of a private (copy-on-write) map of the
shard (`shardkit._kernels._mmap`): writable, writing never reaches the file, and the map is
unmapped only when its last view goes, so arrays stay valid after ``close()``. With
``mmap=False`` every read is a set of large ``os.preadv`` calls on a thread pool into owned,
writable arrays, through a bounded set of open descriptors (`MAX_OPEN_FILES`).

One reader reads one checkpoint: it opens the checkpoint directory once and every file
(the manifest, shards) relative to that handle, safely (`shardkit.files`: regular files only,
symlinks only with ``follow_symlinks=True``). A shard that vanished because the checkpoint was
replaced raises CheckpointReplacedError; `load` then starts again, a few times.

Shard files are opened and their headers parsed and checked against the index on first use. A
shard's codec selects its `ShardSource` implementation: ``"raw"`` here, others registered with
`register_codec` or imported lazily (see `_LAZY_CODECS`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import operator
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import groupby, repeat
from typing import Any, Literal, overload

import numpy as np
import xxhash

from ._threads import WorkerPool
from .dtypes import numpy_dtype
from .errors import (
    CheckpointFormatError,
    CheckpointReplacedError,
    ChecksumError,
    CorruptHeaderError,
    CorruptIndexError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    KeyNotFoundError,
    MissingShardError,
    Problem,
    ReaderClosedError,
    ShardIOError,
    TruncatedShardError,
    UnknownCodecError,
)
from .files import (
    FilePool,
)
from .format import (
    EntryLayout,
    SliceInfo,
    TensorInfo,
)
from .formats import SHARDKIT, ParsedHeader
from .formats import read_index as read_layout
from .frameworks import convert_all, converter
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
    _run_each,
)
from .storage import open_storage
from .strings import STRING_DTYPE, StringTensors, check_string_framework, kind_dtype
from .tensors import gc_paused

MAX_OPEN_FILES = 64  # shard descriptors a reader keeps open between reads (mmap=False)
_SMALL_PIECE = 1 << 20  # box pieces below this are copied on the calling thread
_MANY_BOXES = 64  # box reads of more tensors than this build the index's TensorInfos in bulk
LOAD_ATTEMPTS = 3  # how often `load` starts again when the checkpoint is replaced under it


@dataclass(frozen=True, slots=True)
class SlicePlacement:
    """Where one stored slice of a tensor lives."""

    spec: str
    shard: int
    file: str
    entry: str
    xxh3: str | None


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What `CheckpointReader.verify_report` found: entries compared, and the problems."""

    checked: int
    problems: list[Problem]
    checksums_stored: bool = True
    """False when the checkpoint records no checksum at all (a HuggingFace or single
    safetensors layout, or a save without checksums): only its structure was checked."""

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def summary(self) -> str:
        """What was checked, in words (``shardkit verify`` prints it)."""
        if not self.checksums_stored:
            return "no checksums stored: structure checked only"
        return f"{self.checked} entries checked"

    def error(self) -> CheckpointFormatError:
        """One exception for all the problems: the first one's class, every problem a line."""
        lines = [str(p) for p in self.problems]
        head = lines[0] if len(lines) == 1 else f"{len(lines)} problems:"
        body = "" if len(lines) == 1 else "\n" + "\n".join(lines)
        e = self.problems[0].error(head + body)
        e.problems = list(self.problems)  # type: ignore[attr-defined]
        return e


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
    """Read a checkpoint lazily; use as a context manager.

    `path` is a shardkit checkpoint directory, a HuggingFace one (``model.safetensors.index.json``
    + shards, or just ``model.safetensors``) or a ``.safetensors`` file: `shardkit.formats`
    detects the layout (`format`) and its adapter builds the entry table; everything below is
    the same for all. Foreign layouts store no checksums (`verify` checks their structure).

    ``reader[key]`` / `get` return the whole tensor (a view of the private map when it is one
    raw entry and `mmap` is on; otherwise a new array). `get_slice` reads a numpy basic index of
    the full tensor, touching only the bytes it needs. `verify` checks every checksum. Every
    array returned is writable and stays valid after the reader is closed; writing to it never
    changes the checkpoint.

    The reader reads the checkpoint that was at `path` when it was opened, and no other (see the
    module docstring). Shard files and the manifest must be regular files, and symlinks are
    refused unless `follow_symlinks`.
    """

    def __init__(self, path: str | os.PathLike[str], *, mmap: bool = True,
                 verify: bool = False, follow_symlinks: bool = False,
                 prefix: str | None = None) -> None:
        self.path = os.fspath(path)
        self._mmap = bool(mmap)
        self._follow = bool(follow_symlinks)
        self._files = FilePool(MAX_OPEN_FILES)
        # shard headers a foreign layout's adapter parsed already: used on first read when the
        # file is still the one parsed (same stamp), not parsed twice
        self._headers: dict[int, ParsedHeader] = {}
        # the checkpoint's storage opens it (locally: the directory handle every file is
        # opened through; at a URL: the manifest's object and shard objects of its generation)
        directory = open_storage(self.path).open_checkpoint(follow_symlinks=self._follow,
                                                            pool=self._files)
        self._directory = directory
        self._dir_path, single = directory.path, directory.single
        self._dir_closer: Callable[[], Any] = directory.close
        try:
            self.layout, self._manifest, self.index = read_layout(directory, single, self._headers)
        except BaseException:
            self._dir_closer()
            raise
        self._manifest_path = directory.join(self._manifest)
        generation = directory.generation = self.index.generation  # its files' generation
        self._shard_paths = [directory.shard_path(s.file, generation) for s in self.index.shards]
        self._strings: StringTensors | None = self.index.strings  # string tensors, or None
        self._sources: dict[int, ShardSource] = {}
        self._specs: dict[str, list[SliceSpec]] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0  # reads in flight; close() waits for them before releasing files
        self._pool: WorkerPool | None = None
        self._closed = False
        self._prefix, self._under = "", None  # a sub-tree's prefix and its keys (`prefix`)
        try:
            if prefix is not None:
                self._prefix, self._under = self._keys_under(prefix)
            if verify:
                self.verify()
        except BaseException:
            self.close()
            raise

    # -- mapping-like API

    @property
    def format(self) -> str:
        """The layout read: "shardkit", "huggingface", "safetensors" or "tensorbundle"
        (`shardkit.formats`)."""
        return self.layout.name

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
        """Checkpoint keys in the order they were saved (string tensors last); with a `prefix`,
        the keys under it, the prefix stripped."""
        if self._under is not None:
            n = len(self._prefix)
            return [k[n:] for k in self._under]
        return self._stored_keys()

    def _stored_keys(self) -> list[str]:
        if self._strings is not None:
            return [*self.index.keys, *self._strings.keys]
        return list(self.index.keys)

    def __iter__(self) -> Iterator[str]:
        if self._strings is None and self._under is None:
            return iter(self.index.keys)
        return iter(self.keys())

    def __len__(self) -> int:
        if self._under is not None:
            return len(self._under)
        return len(self.index.keys) + (0 if self._strings is None else len(self._strings.keys))

    def _full(self, key: Any) -> Any:
        """The stored key of `key` as the caller names it (under `prefix`)."""
        return self._prefix + key if self._prefix and isinstance(key, str) else key

    def __contains__(self, key: object) -> bool:
        key = self._full(key)
        try:
            self.index.row(key)  # type: ignore[arg-type]
        except (KeyError, TypeError):
            return self._is_string(key)
        return True

    def _is_string(self, key: object) -> bool:
        """Whether `key` is a string tensor (`shardkit.strings`)."""
        return self._strings is not None and key in self._strings

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
        """dtype, full shape, device and stored slices (with shard file names) of `key`.

        A string tensor reports dtype name ``"STRING"``, the numpy dtype of its kind (object for
        bytes / str), the bytes of its block and one placement, in the string file."""
        named, key = key, self._full(key)
        if self._is_string(key):
            return dataclasses.replace(self._string_info(key), key=named)
        t = self._tensor(key)
        shards = self.index.shards
        return KeyInfo(
            named, numpy_dtype(t.dtype), t.dtype, t.shape, t.device, t.nbytes,
            tuple(SlicePlacement(s.spec, s.shard, shards[s.shard].file, s.entry, s.xxh3)
                  for s in t.slices),
        )

    # -- reading

    @overload
    def get(self, key: str, *, framework: Literal["numpy"] = ..., device: Any = ...
            ) -> np.ndarray: ...
    @overload
    def get(self, key: str, *, framework: str, device: Any = ...) -> Any: ...

    def get(self, key: str, *, framework: str = "numpy", device: Any = None) -> Any:
        """The whole tensor `key` (ml_dtypes arrays for bfloat16 / float8).

        `framework` ("numpy", "torch", "jax"; see `shardkit.frameworks`) and `device` return it
        as that framework's tensor: torch shares the array's memory on the CPU, jax copies.
        ``reader[key]`` is always a numpy array.
        """
        conv = converter(framework, device)  # checked before anything is read
        key = self._full(key)
        self._begin_read()
        try:
            if self._is_string(key):
                check_string_framework(framework, key)
                array = self._get_string(key)
            else:
                array = self._get(key)
        finally:
            self._end_read()
        return array if conv is None else conv(array, key)

    def _get_many(self, keys: Sequence[str] | None, rows: np.ndarray | None = None
                  ) -> dict[str, np.ndarray]:
        """`get` of each key, in bulk: whole tensors of a raw mapped shard become views in one
        pass per shard; whole tensors stored in compressed shards are read in one batch, so
        that every chunk is decoded once and the chunks are decoded in parallel. `rows`: the
        keys' `_rows_of`, when the caller has them."""
        self._begin_read()
        try:
            with gc_paused():  # one GC pass at the end, not one per ~700 new arrays
                return self._get_many_unlocked(keys, rows)
        finally:
            self._end_read()

    def _get_many_unlocked(self, keys: Sequence[str] | None, rows: np.ndarray | None
                           ) -> dict[str, np.ndarray]:
        strings = self._strings
        if strings is not None and keys is None:  # every tensor, then every string tensor
            every = self._get_tensors(None)
            every.update((k, self._get_string(k)) for k in strings.keys)
            return every
        if strings is not None:  # the string tensors apart, then in the order asked
            wanted = list(dict.fromkeys(self._stored_keys() if keys is None else keys))
            stored = set(strings.keys).intersection(wanted)  # not 50,000 calls of `in`
            texts = {k: self._get_string(k) for k in wanted if k in stored}
            if texts:
                rest = self._get_tensors(None if keys is None else
                                         [k for k in wanted if k not in texts])
                return {k: texts[k] if k in texts else rest[k] for k in wanted}
        return self._get_tensors(keys, rows)

    def _get_tensors(self, keys: Sequence[str] | None, rows: np.ndarray | None = None
                     ) -> dict[str, np.ndarray]:
        index = self.index
        picked: np.ndarray | None = None
        if keys is not None:
            keys = list(keys)
            if rows is None:
                try:
                    rows = np.fromiter(map(index.rows().__getitem__, keys), np.intp, len(keys))
                except (KeyError, TypeError):
                    for key in keys:
                        self._tensor(key)  # raises KeyNotFoundError, with a hint
                    raise
            picked = rows
            if len(rows) and np.bincount(rows).max() > 1:  # each key once, where first asked
                first = np.sort(np.unique(rows, return_index=True)[1])
                keys, picked = [keys[i] for i in first.tolist()], rows[first]
        views = self._get_whole(keys, picked)
        if views is not None:
            return views
        if keys is None or picked is None:
            keys = index.keys
            picked = np.arange(len(keys))
        self._check_open()
        results: list[Any] = [None] * len(keys)
        counts = index.slice_counts()[picked].tolist()
        firsts = index.first_slice()[picked].tolist()
        shards = list(map(index.slice_shard.__getitem__, firsts))
        whole = [i for i, c in enumerate(counts) if c == 1]
        whole.sort(key=shards.__getitem__)  # stable: by shard, then in the order asked
        dtype_names = list(map(index.dtypes.__getitem__, picked.tolist()))
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

    def _get_whole(self, keys: list[str] | None, rows: np.ndarray | None
                   ) -> dict[str, np.ndarray] | None:
        """The tensors `keys` (distinct, at index `rows`; None: every tensor), when every
        tensor is stored whole in a raw shard: views of the maps (or arrays read in runs, with
        ``mmap=False``) made shard by shard, in data-region order, straight from the index
        columns; the dict is in the order asked. None otherwise (the general path decides)."""
        index = self.index
        if len(index.slice_tensor) != len(index.keys) or any(index.slice_spec):
            return None
        self._check_open()
        shards = range(len(index.shards))
        if rows is None:
            keys, slice_rows, at = index.keys, index.slice_tensor, index.slice_tensor
            ids: Sequence[int] = range(len(slice_rows))  # the slices read, shard by shard
            ends = [index.shard_range(shard).stop for shard in shards]
        else:
            assert keys is not None
            firsts = index.first_slice()[rows]  # a tensor's one stored slice
            order = np.argsort(firsts, kind="stable")
            sorted_ids = firsts[order]
            ends = np.searchsorted(sorted_ids, [index.shard_range(s).stop for s in shards]
                                   ).tolist()
            ids, slice_rows, at = sorted_ids.tolist(), rows[order].tolist(), order.tolist()
        results: list[Any] = [None] * len(keys)
        dtypes = {name: numpy_dtype(name) for name in set(index.dtypes)}
        slice_shapes = index.slice_shapes()
        lo = 0
        for shard, hi in zip(shards, ends):
            if lo == hi:
                continue
            part = slice_rows[lo:hi]  # the tensor rows read from this shard
            src = self._shard_for(index.keys[part[0]], shard)
            if not isinstance(src, RawShard):
                return None
            begins = self._begins(src, shard, ids[lo:hi])
            dts = ([*dtypes.values()] * len(part) if len(dtypes) == 1
                   else list(map(dtypes.__getitem__, map(index.dtypes.__getitem__, part))))
            shapes = (slice_shapes[lo:hi] if rows is None
                      else list(map(slice_shapes.__getitem__, ids[lo:hi])))
            views = src.whole_arrays(begins, dts, shapes, self._run_reads)
            where = at[lo:hi]  # the views' places in `results`
            if where[0] == lo and where[-1] == hi - 1 and where == list(range(lo, hi)):
                results[lo:hi] = views
            else:
                for i, view in zip(where, views):
                    results[i] = view
            lo = hi
        return dict(zip(keys, results))

    def _begins(self, src: RawShard, shard: int, slice_ids: Sequence[int]) -> list[int]:
        """Where the entries of stored slices `slice_ids` (all in `shard`) start."""
        if src.begins is not None:  # the header matched the index: offsets by position
            lo = self.index.shard_range(shard).start
            if isinstance(slice_ids, range) and slice_ids == range(lo, lo + len(src.begins)):
                return src.begins
            if lo:
                slice_ids = [j - lo for j in slice_ids]
            return list(map(src.begins.__getitem__, slice_ids))
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
        later: list[tuple[ShardSource, EntryLayout, np.ndarray, tuple[int, ...]]] = []
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
                later.append((src, entry, target, spec.shape))
        self._read_jobs(jobs)
        for src, entry, target, shape in later:
            # staged through one buffer of about READ_CHUNK bytes (whole rows of the stored
            # slice, contiguous in the entry), never a copy of the whole slice
            row = entry.nbytes // shape[0]
            step = max(1, READ_CHUNK // row)
            tmp = np.empty((min(step, shape[0]), *shape[1:]), dtype)
            for r0 in range(0, shape[0], step):
                r1 = min(shape[0], r0 + step)
                part = tmp[: r1 - r0]
                self._read_jobs([(src, entry, r0 * row, r1 * row, _bytes_of(part))])
                target[r0:r1] = part
        return out

    @overload
    def get_slice(self, key: str, index: Any, *, framework: Literal["numpy"] = ...,
                  device: Any = ...) -> np.ndarray: ...
    @overload
    def get_slice(self, key: str, index: Any, *, framework: str, device: Any = ...
                  ) -> Any: ...

    def get_slice(self, key: str, index: Any, *, framework: str = "numpy",
                  device: Any = None) -> Any:
        """``full_tensor[index]`` for a numpy basic index (ints, slices with steps, ``...``,
        None), reading only the needed bytes of the stored slices that intersect it.

        The result is a (writable) view of the private map when it comes from one raw entry and
        `mmap` is on, else a new array; `framework` and `device` as for `get`.
        """
        conv = converter(framework, device)  # checked before anything is read
        key = self._full(key)
        self._begin_read()
        try:
            if self._is_string(key):
                check_string_framework(framework, key)
                whole = self._get_string(key)
                normalize_index(index, whole.shape, key)  # the same checks and errors
                array = np.array(whole[index], dtype=whole.dtype)
            else:
                array = self._get_slice(key, index)
        finally:
            self._end_read()
        return array if conv is None else conv(array, key)

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
            # always a view, also of a 0-d box: ``box[()]`` would copy a scalar out of the
            # buffer now, before the read below fills it
            if view is not None:  # mapped: only the pages touched are ever read
                box = np.ndarray(span_shape(lo, hi), dtype, buffer=view, strides=strides)
                pieces.append((out_index, box[_as_view(local)], True))
                continue
            for out_index, lo, hi, local in refine(plan, strides, item, [MAX_PIECES]):
                b0, b1 = byte_span(lo, hi, strides, item)
                buf = np.empty(b1 - b0, np.uint8)
                jobs.append((src, entry, b0, b1, buf.data))
                box = np.ndarray(span_shape(lo, hi), dtype, buffer=buf, strides=strides)
                pieces.append((out_index, box[_as_view(local)], False))
        self._read_jobs(jobs)
        if len(pieces) == 1 and pieces[0][2] and pieces[0][1].shape == box_shape:
            return pieces[0][1].reshape(final_shape)
        out = np.empty(box_shape, dtype)
        for out_index, piece, _ in pieces:
            out[out_index] = piece
        return out.reshape(final_shape)

    def _boxes_slices(self, key: str, offsets: Sequence[int], lengths: Sequence[int]
                      ) -> list[tuple[int, SliceInfo, SliceSpec, SliceSpec]]:
        """The stored slices of `key` that intersect the box (`offsets`, `lengths`) of the
        full tensor: (slice number in the index, slice, its spec, the intersection)."""
        t = self._tensor(key)
        box = SliceSpec(t.shape, tuple(offsets), tuple(lengths))
        if math.prod(box.lengths) == 0:
            return []
        ids = self.index.slices_of()[self.index.row(key)]
        out = []
        for j, s, spec in zip(ids, t.slices, self._slice_specs(key, t)):
            common = spec.intersect(box)
            if common is not None:
                out.append((j, s, spec, common))
        return out

    def _verify_boxes(self, boxes: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> None:
        """`verify` of only the stored slices that intersect the boxes (key, offsets,
        lengths); raises as `verify` does."""
        self._begin_read()
        try:
            ids = sorted({j for key, offsets, lengths in boxes
                          for j, *_ in self._boxes_slices(key, offsets, lengths)})
            opened: list[ShardSource] = []
            try:
                report = self._verify_slices(False, ids, opened)
            finally:
                for src in opened:
                    src.close()
        finally:
            self._end_read()
        if report.problems:
            raise report.error()

    def _read_boxes_into(self, boxes: Sequence[tuple[str, Sequence[int], np.ndarray]]) -> None:
        """For each (key, offsets, out): fill `out` (writable, the stored dtype) with the box of
        the full tensor `key` that starts at `offsets` and has `out`'s shape, reading only the
        stored slices that intersect it, and of each only the bytes inside the box.

        A piece that is one run of bytes in its entry and in `out` (a split along axis 0 read
        back along axis 0) is one read straight into `out` (a copy from the map, or a pread);
        any other piece of a mapped shard is one strided copy from the map. The reads and copies
        of all boxes run together, on the read pool when large (numpy's copies and preadv
        release the GIL)."""
        self._begin_read()
        try:
            jobs: list[tuple[ShardSource, EntryLayout, int, int, memoryview]] = []
            copies: list[tuple[np.ndarray, np.ndarray]] = []
            rest: list[tuple[np.ndarray, str, SliceSpec]] = []
            if len(boxes) > _MANY_BOXES:
                _ = self.index.tensors  # every TensorInfo at once, not one by one per box
            for key, offsets, out in boxes:
                self._plan_box(key, tuple(int(o) for o in offsets), out, jobs, copies, rest)
            # small pieces right here: a pool task each would cost more than the copy
            large = []
            for job in jobs:
                if job[3] - job[2] < _SMALL_PIECE and not hasattr(job[0], "read_tasks"):
                    job[0].read_into(*job[1:])
                else:
                    large.append(job)
            self._read_jobs(large)
            self._copy_pieces(copies)
            for dst, key, common in rest:  # compressed, or not mapped: get_slice's reads
                dst[...] = self._get_slice(key, common.to_index())
        finally:
            self._end_read()

    def _plan_box(self, key: str, start: tuple[int, ...], out: np.ndarray,
                  jobs: list[tuple[ShardSource, EntryLayout, int, int, memoryview]],
                  copies: list[tuple[np.ndarray, np.ndarray]],
                  rest: list[tuple[np.ndarray, str, SliceSpec]]) -> None:
        t = self._tensor(key)
        dtype = numpy_dtype(t.dtype)
        if out.dtype != dtype:
            raise InvalidArgumentError(
                f"{key!r}: a box read needs a {dtype} array, got {out.dtype}")
        if len(t.slices) == 1 and out.shape == t.shape and not any(start):
            # the usual whole tensor in one entry: no box arithmetic
            src, entry = self._entry(key, t.slices[0])
            if not entry.nbytes:
                return
            if out.flags.c_contiguous:
                jobs.append((src, entry, 0, entry.nbytes, _bytes_of(out)))
                return
            view = src.view(entry, 0, entry.nbytes)
            if view is not None:
                copies.append((out, np.frombuffer(view, dtype).reshape(t.shape)))
            else:
                rest.append((out, key, SliceSpec.whole(t.shape)))
            return
        item = dtype.itemsize
        for _, s, spec, common in self._boxes_slices(key, start, out.shape):
            dst = out[_as_view(tuple(slice(o - b, o - b + n)
                                     for o, b, n in zip(common.offsets, start, common.lengths)))]
            lo = [o - so for o, so in zip(common.offsets, spec.offsets)]
            hi = [a + n - 1 for a, n in zip(lo, common.lengths)]
            strides = c_strides(spec.shape, item)
            b0, b1 = byte_span(lo, hi, strides, item)
            src, entry = self._entry(key, s)
            if b1 - b0 == common.size * item and dst.flags.c_contiguous:
                jobs.append((src, entry, b0, b1, _bytes_of(dst)))
                continue
            view = src.view(entry, b0, b1)
            if view is not None:
                copies.append((dst, np.ndarray(common.lengths, dtype, buffer=view,
                                               strides=strides)))
            else:
                rest.append((dst, key, common))

    def _copy_pieces(self, copies: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """``dst[...] = src`` for each pair; large ones cut along their first axis of more than
        one element into parts of about READ_CHUNK bytes, run on the pool."""
        total = sum(dst.nbytes for dst, _ in copies)
        parts = []
        for dst, src in copies:
            if total < _PARALLEL_MIN or dst.nbytes < _SMALL_PIECE:
                np.copyto(dst, src, casting="no")  # a pool task would cost more
                continue
            axis = next((k for k, n in enumerate(dst.shape) if n > 1), None)
            if axis is None or dst.nbytes <= READ_CHUNK:
                parts.append((dst, src))
                continue
            step = max(1, dst.shape[axis] * READ_CHUNK // dst.nbytes)
            lead = (slice(None),) * axis
            for i in range(0, dst.shape[axis], step):
                cut = (*lead, slice(i, i + step))
                parts.append((dst[cut], src[cut]))
        pool = self._get_pool()
        for f in [pool.submit(np.copyto, d, s, casting="no") for d, s in parts]:
            f.result()

    def verify(self, keys: Sequence[str] | None = None) -> int:
        """Check the stored entries of `keys` (default: all, and then every frame of every
        compressed shard, even bytes no entry is read from) against the index: shard files and
        sizes, headers, entry dtypes and shapes, and the xxh3-64 checksums. Returns the number of
        entries whose checksum was compared (entries saved without a checksum are skipped).

        Everything is checked before anything is raised: on any problem this raises one error,
        of the class of the first problem found (ChecksumError, MissingShardError,
        CorruptIndexError...), whose message lists every problem, one per line, and whose
        ``problems`` attribute holds them (`Problem`). `verify_report` returns them instead.
        """
        report = self.verify_report(keys)
        if report.problems:
            raise report.error()
        return report.checked

    def verify_report(self, keys: Sequence[str] | None = None) -> VerifyReport:
        """What `verify` checks, returned instead of raised: every distinct problem once, in
        shard order, each blaming the file that is inconsistent (the manifest when it records
        a size, an entry, a dtype or a shape its shard does not have). Memory stays bounded:
        compressed shards are verified chunk by chunk (see `SkzShard.verify_entries`). With a
        `prefix`, `keys` are under it; without `keys` the whole checkpoint is checked."""
        if keys is not None and self._prefix:
            keys = [self._full(k) for k in ([keys] if isinstance(keys, str) else keys)]
        self._begin_read()
        try:
            return self._verify(keys)
        finally:
            self._end_read()

    def _verify(self, keys: Sequence[str] | None) -> VerifyReport:
        index = self.index
        strings = self._strings
        string_rows: list[int] = []
        if keys is None:
            slices: Sequence[int] = range(len(index.slice_tensor))
            string_rows = [] if strings is None else list(range(len(strings.keys)))
        else:
            if strings is not None:
                string_rows = [strings.row(k) for k in keys if k in strings]
                keys = [k for k in keys if k not in strings]
            for k in keys:
                self._tensor(k)  # KeyNotFoundError, with a hint
            wanted = {index.row(k) for k in keys}
            slices = [j for j, t in enumerate(index.slice_tensor) if t in wanted]
        opened: list[ShardSource] = []
        try:
            report = self._verify_slices(keys is None, slices, opened)
        finally:
            for src in opened:
                src.close()
        if not string_rows:
            return report
        assert strings is not None
        checked, found = strings.verify(self._directory, string_rows)
        problems = [*report.problems, *found]
        return VerifyReport(report.checked + checked, problems,
                            report.checksums_stored or checked > 0)

    def _verify_slices(self, everything: bool, slices: Sequence[int],
                       opened: list[ShardSource]) -> VerifyReport:
        index = self.index
        problems: dict[Problem, None] = {}
        checked = 0
        by_shard: dict[int, list[int]] = {}
        for j in slices:
            by_shard.setdefault(index.slice_shard[j], []).append(j)
        names = index.entry_names()
        shapes = index.slice_shapes()
        index_path = self._manifest_path
        manifest = self._manifest
        kinds = index.slice_checksum_kind
        for i, js in sorted(by_shard.items()):
            src = self._sources.get(i) or self._verify_source(i, index_path, problems, opened)
            if src is None:
                continue
            file = self.index.shards[i].file
            good: list[tuple[int, EntryLayout]] = []
            for j in js:
                key = index.keys[index.slice_tensor[j]]
                dtype_name = index.dtypes[index.slice_tensor[j]]
                entry = src.entries.get(names[j])
                where = f"entry {names[j]!r} in shard {file}"
                if entry is None:
                    problems[Problem(index_path, key, where, "an entry of the shard's header",
                                     "none by that name", CorruptIndexError)] = None
                elif entry.dtype_name != dtype_name:
                    problems[Problem(index_path, key, f"dtype of {where}",
                                     f"{entry.dtype_name} (the shard's)", dtype_name,
                                     CorruptIndexError)] = None
                elif entry.shape != shapes[j]:
                    problems[Problem(index_path, key, f"shape of {where}",
                                     f"{list(entry.shape)} (the shard's)", str(list(shapes[j])),
                                     CorruptIndexError)] = None
                else:
                    good.append((j, entry))
            digests: dict[str, str] = {}
            if hasattr(src, "hash_entries"):  # a store's: fetched in parallel, hashed in order
                digests = src.hash_entries(
                    [e for j, e in good if index.slice_xxh3[j] is not None
                     and (kinds is None or kinds[j] == "xxh3")], self._get_pool())
            if hasattr(src, "verify_entries"):
                got, bad = src.verify_entries(
                    None if everything else {e.name for j, e in good if index.slice_xxh3[j]},
                    self._get_pool())
                digests = got
                for _, e in bad:
                    problems[Problem(src.path, None, getattr(e, "frame", "frame"),
                                     getattr(e, "expected", "an intact frame"),
                                     getattr(e, "found", str(e)), ChecksumError)] = None
            for j, entry in good:
                recorded = index.slice_xxh3[j]
                if recorded is None:
                    continue
                if hasattr(src, "verify_entries"):
                    found = digests.get(entry.name)
                    if found is None:  # in a corrupt frame: reported once, as the frame
                        continue
                else:
                    kind = kinds[j] if kinds is not None else "xxh3"
                    found = ((digests.get(entry.name) or _xxh3_of(src, entry)) if kind == "xxh3"
                             else self.layout.checksum(kind, src, entry))
                checked += 1
                if found != recorded:
                    spec = index.slice_spec[j]
                    what = (f"checksum of slice {spec!r} (entry {entry.name!r})" if spec
                            else f"checksum of entry {entry.name!r}")
                    problems[Problem(src.path, index.keys[index.slice_tensor[j]], what,
                                     f"{kinds[j] if kinds is not None else 'xxh3'} "
                                     f"{recorded} ({manifest})", found,
                                     ChecksumError)] = None
        return VerifyReport(checked, list(problems),
                            any(x is not None for x in index.slice_xxh3))

    def _verify_source(self, i: int, index_path: str, problems: dict[Problem, None],
                       opened: list[ShardSource]) -> ShardSource | None:
        """Shard `i` opened for verification (not cached, headers parsed in full), or None
        with its problem recorded. A size that differs from the index is the index's fault
        when the file opens and is whole at its own size, else the shard's."""
        info = self.index.shards[i]
        path = self._shard_paths[i]
        try:
            opener = self._opener_for(info.codec, path)
            file = self._open_shard(i)  # the reader's directory handle, its symlink rule
        except MissingShardError:
            problems[Problem(path, None, "shard file", f"a file ({self._manifest} lists it)",
                             "no such file", MissingShardError)] = None
            return None
        except UnknownCodecError as e:
            problems[Problem(index_path, None, f"codec of shard {info.file}",
                             "a codec this shardkit reads", repr(info.codec), type(e))] = None
            return None
        except (CheckpointFormatError, ShardIOError) as e:  # not a regular file, a symlink...
            problems[Problem(path, None, "shard file", "a readable regular file",
                             _without_path(str(e), path),
                             type(e) if isinstance(e, CheckpointFormatError)
                             else CheckpointFormatError)] = None
            return None
        size = file.size
        try:
            sized = dataclasses.replace(info, bytes=size)
            src = (self.layout.open_source(self.index, i, path, sized, mmap=self._mmap, file=file)
                   or opener(path, sized, mmap=self._mmap, file=file))
        except CheckpointFormatError as e:
            file.close()
            if size != info.bytes:
                problems[Problem(path, None, "file size", f"{info.bytes} bytes ({self._manifest})",
                                 f"{size} bytes", TruncatedShardError if size < info.bytes
                                 else CheckpointFormatError)] = None
            else:
                problems[Problem(path, None, f"{info.codec} shard header",
                                 "a valid header", _without_path(str(e), path), type(e))] = None
            return None
        except BaseException:
            file.close()
            raise
        if size != info.bytes:
            problems[Problem(index_path, None, f"size of shard {info.file}",
                             f"{size} bytes (the file's)", f"{info.bytes} bytes",
                             CorruptIndexError)] = None
        opened.append(src)
        return src

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
        self._dir_closer()

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

    def _get_string(self, key: str) -> np.ndarray:
        """String tensor `key`, a new array of its kind (`shardkit.strings`)."""
        self._check_open()
        strings = self._strings
        assert strings is not None
        try:
            return strings.read(self._directory, strings.row(key))
        except MissingShardError:
            if self._replaced():
                raise CheckpointReplacedError(
                    f"{self._dir_path}: the string file is gone: the checkpoint at {self.path} "
                    "was replaced while this reader had it open; open it again to read the "
                    "new one") from None
            raise

    def _string_info(self, key: str) -> KeyInfo:
        self._check_open()
        strings = self._strings
        assert strings is not None
        row = strings.row(key)
        return KeyInfo(key, kind_dtype(strings.kinds[row], f"{self.path}: {key!r}"), STRING_DTYPE,
                       strings.shapes[row],
                       strings.devices[row], strings.nbytes(row),
                       (SlicePlacement("", -1, strings.file_of(row), key, strings.xxh3_of(row)),))

    def _rows_of(self, keys: Sequence[str]) -> np.ndarray:
        """The index row of each of `keys` (-1 for a string tensor), looked up once for the
        whole read; KeyNotFoundError (with a hint) for the first key that is neither."""
        try:
            rows = np.fromiter(map(self.index.rows().get, keys, repeat(-1)), np.intp, len(keys))
        except TypeError:  # an unhashable key: named by the per-key check
            rows = np.full(len(keys), -1, np.intp)
        for i in np.flatnonzero(rows < 0).tolist():
            if not self._is_string(keys[i]):
                self._tensor(keys[i])
        return rows

    def _keys_under(self, prefix: str) -> tuple[str, list[str]]:
        """(`prefix` ending in one "/", the keys under it, in saved order) for a ``prefix=``
        argument: "model" and "model/" both select ``model/...`` (a key component boundary:
        never ``modelx/...``, nor the key "model" itself). KeyNotFoundError, naming the prefix
        and the nearest prefixes stored, when no key is under it."""
        if not isinstance(prefix, str):
            raise InvalidArgumentTypeError(f"prefix must be a str, got {prefix!r}")
        start = prefix.rstrip("/") + "/"
        if start == "/":
            raise InvalidArgumentError(f"prefix must name a key component, got {prefix!r}")
        keys = self._stored_keys()
        under = [k for k in keys if k.startswith(start)]
        if not under:
            depth = start.count("/")
            stored = dict.fromkeys("/".join(k.split("/", depth)[:depth]) + "/"
                                   for k in keys if k.count("/") >= depth)
            close = difflib.get_close_matches(start, list(stored), n=3, cutoff=0.5)
            near = close or list(stored)[:3]
            hint = f"; prefixes stored: {', '.join(map(repr, near))}" if near else ""
            raise KeyNotFoundError(f"no key under prefix {prefix!r} in checkpoint {self.path} "
                                   f"({len(self)} tensors){hint}")
        return start, under

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
                opener = self._opener_for(info.codec, path)
                file = self._open_shard(i)
                try:
                    # a layout whose index places the entries (TensorBundle) opens its own
                    src = self.layout.open_source(self.index, i, path, info, mmap=self._mmap,
                                                  file=file)
                    if src is not None:
                        pass
                    elif opener is RawShard:
                        # a foreign layout's headers are in any order: no writer's header to
                        # recognise, parse it
                        expected = self._expected(i) if self.layout is SHARDKIT else None
                        parsed = self._headers.pop(i, None)
                        header = None
                        if parsed is not None and file.stamp() == parsed.stamp:
                            header = parsed.entries, parsed.metadata, parsed.data_start
                        src = RawShard(path, info, mmap=self._mmap, expected=expected,
                                       file=file, header=header)
                    else:
                        src = opener(path, info, mmap=self._mmap, file=file)
                except BaseException:
                    file.close()
                    raise
                try:
                    if not getattr(src, "matches_index", False):
                        self._check_against_index(i, src)
                except BaseException:
                    src.close()
                    raise
                self._sources[i] = src
            return src

    def _open_shards(self, keys: Sequence[str] | None, rows: np.ndarray | None = None) -> None:
        """Open (and map) every shard holding `keys` (default: all; `rows`: their `_rows_of`)
        now rather than on first read, so a concurrent overwrite has only this short window to
        delete them."""
        index = self.index
        strings = self._strings
        if keys is not None and rows is None:
            rows = self._rows_of(keys)
        if strings is not None and strings.keys and (
                rows is None or bool((rows < 0).any())):
            self._get_string(strings.keys[0])  # reads (and keeps) the string file now
        if rows is None:
            shards: Iterable[int] = range(len(index.shards))
        else:
            rows = rows[rows >= 0]
            if bool((index.slice_counts()[rows] == 1).all()):  # each stored whole: one slice
                slice_ids = index.first_slice()[rows]
            else:
                wanted = np.zeros(len(index.keys), bool)
                wanted[rows] = True
                slice_ids = np.flatnonzero(wanted[np.asarray(index.slice_tensor, np.intp)])
            stops = [index.shard_range(i).stop for i in range(len(index.shards))]
            shards = np.unique(np.searchsorted(stops, slice_ids, side="right")).tolist()
        for i in shards:
            self._source(i)

    def _opener_for(self, codec: str, path: str) -> Any:
        return self._directory.opener(codec, path)

    def _open_shard(self, i: int) -> Any:
        """Shard file `i`, opened through the checkpoint's directory (locally its handle)."""
        path = self._shard_paths[i]
        try:
            return self._directory.open_shard_file(path, self.index.shards[i].file,
                                                   self.index.generation)
        except MissingShardError:
            if self._replaced():
                raise CheckpointReplacedError(
                    f"{path}: shard file is gone: the checkpoint at {self.path} was replaced "
                    "while this reader had it open, and the directory it reads from was "
                    "deleted; open the checkpoint again to read the new one"
                ) from None
            raise

    def _replaced(self) -> bool:
        """Whether the directory this reader reads is no longer the one at its path."""
        return bool(self._directory.replaced())

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
                raise CorruptHeaderError(
                    f"{where} is listed in {self._manifest} but not in the shard")
            raise CorruptHeaderError(
                f"{where} does not match {self._manifest}: expected dtype {dtype_name} shape "
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



_dtype_name_of = operator.attrgetter("dtype_name")
_shape_of = operator.attrgetter("shape")


def _as_view(local: tuple[slice, ...]) -> Any:
    """`local` as an index that gives a view even of a 0-d array (``a[()]`` copies a scalar)."""
    return (*local, Ellipsis)


def _bytes_of(a: np.ndarray) -> memoryview:
    """A writable byte view of a C-contiguous array (any dtype, 0-d included)."""
    return a.reshape(-1).view(np.uint8).data


def _without_path(message: str, path: str) -> str:
    return message[len(path) + 2 :] if message.startswith(path + ": ") else message


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


def open_checkpoint(path: str | os.PathLike[str], *, mmap: bool = True,
                    follow_symlinks: bool = False, prefix: str | None = None
                    ) -> CheckpointReader:
    """Open a checkpoint for lazy reading (a CheckpointReader; close it or use ``with``);
    `prefix` shows the sub-tree under it, keys relative to it (as `load`'s)."""
    return CheckpointReader(path, mmap=mmap, follow_symlinks=follow_symlinks, prefix=prefix)


@overload
def load(path: str | os.PathLike[str], keys: Sequence[str] | None = ..., *, verify: bool = ...,
         mmap: bool = ..., follow_symlinks: bool = ..., framework: Literal["numpy"] = ...,
         device: Any = ..., prefix: str | None = ...) -> dict[str, np.ndarray]: ...
@overload
def load(path: str | os.PathLike[str], keys: Sequence[str] | None = ..., *, verify: bool = ...,
         mmap: bool = ..., follow_symlinks: bool = ..., framework: str,
         device: Any = ..., prefix: str | None = ...) -> dict[str, Any]: ...


def load(
    path: str | os.PathLike[str],
    keys: Sequence[str] | None = None,
    *,
    verify: bool = False,
    mmap: bool = True,
    follow_symlinks: bool = False,
    framework: str = "numpy",
    device: Any = None,
    prefix: str | None = None,
) -> dict[str, Any]:
    """Read `keys` (default: all, in saved order) into a flat dict key -> array.

    With `mmap` whole raw tensors are views of private (copy-on-write) maps of the shards: they
    stay valid after this returns, and writing to them never changes the files. `verify`
    checks the checksums of the loaded entries first. A single str `keys` is one key. When
    the checkpoint is replaced while it is being read, the load starts again (up to
    LOAD_ATTEMPTS times), so the result is always all of one checkpoint.

    `framework` returns each value as a tensor of that framework instead of a numpy array
    (`shardkit.frameworks.FRAMEWORKS`: "numpy", the default, "torch" or "jax"),
    on `device` (torch: a str or torch.device, "cpu" by default; jax: a jax Device, Sharding or
    platform string, jax's default device by default). torch tensors on the CPU share the
    loaded memory (writable, copy-on-write: in-place ops never reach the files); jax arrays
    are immutable copies. Framework and device are checked before anything is read.

    `prefix` takes a sub-tree: the keys under it, with the prefix stripped (``prefix="model"``
    or ``"model/"`` returns ``model/0.weight`` as ``0.weight``; a key component boundary, so
    never ``modelx/...``); `keys` are then relative to it. KeyNotFoundError names the prefix
    and the nearest stored ones when no key is under it.

    Raises:
        KeyNotFoundError: a key (or the prefix) is not in the checkpoint.
        CheckpointFormatError: the checkpoint is malformed (a subclass names the rule).
    """
    conv = converter(framework, device)  # checked before anything is read
    if isinstance(keys, str):
        keys = [keys]
    if keys is not None:
        keys = list(keys)
    for attempt in range(1, LOAD_ATTEMPTS + 1):
        try:
            with CheckpointReader(path, mmap=mmap, follow_symlinks=follow_symlinks) as reader:
                wanted = keys
                if prefix is not None:
                    start, under = reader._keys_under(prefix)
                    wanted = under if keys is None else [
                        start + k if isinstance(k, str) else k for k in keys]
                if reader._strings is None and wanted == reader.index.keys:
                    wanted = None  # every key, in saved order: the full read (one C compare)
                # rows: fail on a missing key before reading anything
                rows = None if wanted is None else reader._rows_of(wanted)
                if reader._strings is not None:
                    stored = reader._strings.keys
                    for key in stored if wanted is None else set(stored).intersection(wanted):
                        check_string_framework(framework, key)
                reader._open_shards(wanted, rows)  # right after the index: a replace's window
                if verify:
                    reader.verify(wanted)
                arrays = reader._get_many(wanted, rows)
            if prefix is not None:
                arrays = {k[len(start):]: a for k, a in arrays.items()}
            return arrays if conv is None else convert_all(arrays, conv)
        except CheckpointReplacedError:
            if attempt == LOAD_ATTEMPTS:
                raise
    raise AssertionError("unreachable")

