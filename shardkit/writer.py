"""Write validated shards as shard files, in parallel, with per-entry xxh3-64 checksums.

How the bytes move (DESIGN.md section 5; docs/ARCHITECTURE.md for where this differs):

- Every entry is written straight from the caller's memory by the native kernel
  (`_gather.write_arrays`, GIL released): small entries in vectored writes of up to IOV_MAX
  buffers and a few MiB, large ones in chunks of that size, so 50,000 tiny tensors cost a few
  hundred syscalls and no copy. The kernel hashes each buffer with xxh3-64 just before writing
  it, while it is still in cache. A non-contiguous input is copied to C order first, one
  tensor at a time (the only copy).
- A pool of threads writes separate shard files at once; a shard much larger than the others is
  cut at entry boundaries into regions written by several threads. The first failure stops the
  other threads, and the caller (shardkit.api) removes the temp directory, so nothing partial
  survives.
- A durable save asks the OS to start writing each group to disk as soon as it is written
  (`_gather.start_writeback`, ``sync_file_range``), so the disk works while the next groups are
  copied in and the closing fsync waits for the last group only, not for the whole file.

Memory: for non-contiguous inputs, one tensor copy per thread. Compressed shards
(``compression="zstd"``) are written one after the other by shardkit.compression, which
compresses each shard's chunks on `threads` threads.
"""

from __future__ import annotations

import operator
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from . import format as fmt
from ._kernels import _gather, _table
from ._threads import ParallelRun
from .callback import TaskShard
from .dtypes import safetensors_name
from .errors import InvalidArgumentError, ShardkitError
from .slices import parse_slice_spec
from .strings import STRING_FILE, STRINGS_VERSION, StringColumns, StringFile, write_string_file
from .tensors import ShardableTensor

_T = TypeVar("_T")

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
WRITE_GROUP = 64 * 1024 * 1024  # bytes per kernel call: progress and stop requests in between
MIN_REGION = 64 * 1024 * 1024  # a shard is cut into regions for several threads above this


@dataclass(slots=True)
class ShardColumns:
    """One shard to write, column-wise: its device task and, per entry, key, slice spec and
    array (C-contiguous or not), in the order the sharding callback gave them."""

    task: int
    keys: list[str]
    specs: list[str]
    arrays: list[np.ndarray]
    # known already when a planner works on columns (None: taken from the arrays)
    dtypes: list[np.dtype] | None = None
    nbytes: np.ndarray | None = None
    shapes: list[tuple[int, ...]] | None = None
    rows: range | list[int] | None = None  # the entries' rows in SavedTensors (whole ones)


@dataclass(slots=True)
class SavedTensors:
    """What the index records of each saved tensor, in save order: key, dtype, full shape and
    device string."""

    keys: list[str]
    dtypes: list[np.dtype]
    shapes: list[tuple[int, ...]]
    devices: list[str]
    total_size: int | None = None  # bytes of all tensors, when known

    @classmethod
    def of(cls, tensors: Sequence[ShardableTensor]) -> SavedTensors:
        devices = list(map(_device_of, tensors))
        names = {i: d.to_string() for i, d in dict(zip(map(id, devices), devices)).items()}
        return cls(list(map(_key_of, tensors)), list(map(_dtype_of, tensors)),
                   [_full_shape(t) for t in tensors],
                   list(map(names.__getitem__, map(id, devices))))


def shard_columns(task_shards: Sequence[TaskShard]) -> list[ShardColumns]:
    """Validated callback output ``(task, key -> spec -> array)`` as ShardColumns."""
    out = []
    ndarray = np.ndarray
    for task, shard in task_shards:
        keys: list[str] = []
        specs: list[str] = []
        arrays: list[np.ndarray] = []
        for key, slices in shard.items():
            for spec, value in slices.items():
                keys.append(key)
                specs.append(spec)
                arrays.append(value if type(value) is ndarray else np.asarray(value))
        out.append(ShardColumns(task, keys, specs, arrays))
    return out


@dataclass(slots=True)
class _ShardPlan:
    """A shard in its on-disk order: entry i is ``keys[i]`` / ``specs[i]`` / ``arrays[i]`` at
    absolute file offsets ``offsets[i]`` to ``ends[i]``; a raw shard's writers put the entry's
    xxh3-64 in ``digests[i]``."""

    path: Path
    file: str
    task: int
    header: list[bytes]  # pieces, written back to back
    keys: list[str]
    specs: list[str]
    arrays: list[np.ndarray]
    offsets: np.ndarray  # int64
    ends: np.ndarray  # int64
    layouts: list[fmt.EntryLayout] | None  # only for compressed shards
    size: int
    digests: np.ndarray  # uint64
    rows: range | list[int] | None  # the entries' rows in SavedTensors, when known
    xxh3: list[str | None] | None = None  # compressed shards: the entry checksums, in hex
    fd: int = -1
    pending: int = 0  # regions not yet written
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(slots=True)
class _Region:
    """A run of consecutive entries ``[start, stop)`` of one shard, written by one thread."""

    shard: _ShardPlan
    start: int
    stop: int
    nbytes: int
    with_header: bool


def default_threads() -> int:
    """Writer threads when none are asked for: one per core, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


def write_shards(
    directory: str | os.PathLike[str],
    shards: Sequence[ShardColumns],
    saved: SavedTensors,
    *,
    description: str,
    threads: int | None = None,
    durable: bool = True,
    checksum: bool = True,
    user_metadata: dict[str, Any] | None = None,
    progress: bool = False,
    compression: str | None = None,
    level: int | None = None,
    shuffle: bool = True,
    chunk_size: int | str = "4MiB",
    generation: str | None = None,
    first_shard: int = 0,
    shard_count: int | None = None,
    strings: StringColumns | None = None,
) -> tuple[fmt.CheckpointIndex, list[bytes]]:
    """Write `shards` (validated callback output) into `directory` as shard files.

    Raw safetensors shards, or zstd shards (``.skz``, shardkit.compression) when `compression`
    is ``"zstd"``. Returns the checkpoint index describing them and its manifest bytes in
    pieces (`format.index_chunks`); writing that file and publishing the directory is the
    caller's job (shardkit.commit). `saved` gives the order, dtypes, full shapes and devices of
    the saved tensors. With `durable`, each shard file is fsynced once complete.
    `generation`: the checkpoint's unique id, recorded in the index and in every shard header
    (default: a fresh `format.new_generation`). `first_shard` / `shard_count`: the number of
    the first of these shards among `shard_count` in the whole checkpoint, for file names (a
    rank of a collective save writes some of them; default: these are all). `strings`: string
    tensors, written to their own file (`shardkit.strings`; the manifest then records format
    2.3).
    """
    if compression not in (None, "zstd"):
        raise InvalidArgumentError(f"unknown compression {compression!r}; use None or 'zstd'")
    codec = "raw" if compression is None else "zstd"
    threads = threads or default_threads()
    generation = generation if generation is not None else fmt.new_generation()
    plans = _plan(Path(directory), shards, codec, generation, first_shard,
                  len(shards) if shard_count is None else shard_count)
    total = sum(p.size for p in plans)  # for zstd: the uncompressed bytes
    bar = _progress_bar(total, progress)

    string_file = (_write_strings(Path(directory), strings, generation, checksum, durable)
                   if strings is not None and strings.keys else None)

    def describe() -> tuple[fmt.CheckpointIndex, tuple[list[bytes], list[bytes]]]:
        index = _index(plans, saved, description, user_metadata or {}, codec, generation)
        if string_file is not None:
            index.strings = string_file
            index.version = STRINGS_VERSION
        return index, fmt.encode_index_parts(index)

    try:
        if codec == "raw":  # all but the checksums is described while the data is written
            index, parts = _run(plans, _regions(plans, threads), threads, durable, checksum, bar,
                                describe)
        else:  # a compressed shard's size is known once it is written
            _run_zstd(plans, threads, durable, checksum, bar, level=level, shuffle=shuffle,
                      chunk_size=chunk_size, metadata={fmt.GENERATION_KEY: generation})
            index, parts = describe()
    finally:
        if bar is not None:
            bar.close()
    index.set_checksums(_checksums(plans, checksum))
    return index, fmt.index_chunks(index, parts)


def _write_strings(directory: Path, strings: StringColumns, generation: str, checksum: bool,
                   durable: bool) -> StringFile:
    path = directory / STRING_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o644)
    except OSError as e:
        raise _io_error(e, "creating", path) from e
    try:
        made = write_string_file(fd, strings, generation, checksum)
        if durable:
            os.fsync(fd)
    except OSError as e:
        raise _io_error(e, "writing", path) from e
    finally:
        os.close(fd)
    return made


def _plan(directory: Path, shards: Sequence[ShardColumns], codec: str, generation: str,
          first: int, count: int) -> list[_ShardPlan]:
    meta = fmt.shard_metadata(generation)
    plans = []
    for i, shard in enumerate(shards):
        keys, specs, arrays = shard.keys, shard.specs, shard.arrays
        names, dtype_names, shapes, begins, ends, order = _layout(shard)
        rows: range | list[int] | None = shard.rows
        if order is not None:
            keys = [keys[j] for j in order]
            specs = [specs[j] for j in order]
            arrays = [arrays[j] for j in order]
            if rows is not None:
                rows = [rows[j] for j in order]
        layouts = None
        if codec == "raw":
            header = fmt.header_parts(names, dtype_names, shapes, begins, ends, meta)
        else:
            header = []
            layouts = fmt.entry_layouts(names, dtype_names, shapes, begins.tolist(),
                                        ends.tolist())
        start = sum(map(len, header))
        name = fmt.shard_file_name(first + i, count, codec)
        plans.append(_ShardPlan(
            directory / name, name, shard.task, header, keys, specs, arrays,
            begins + start, ends + start, layouts, start + (int(ends[-1]) if len(ends) else 0),
            np.zeros(len(keys), np.uint64), rows,
        ))
    return plans


def _layout(shard: ShardColumns) -> tuple[
    list[str], list[str], list[tuple[int, ...]], np.ndarray, np.ndarray, list[int] | None
]:
    """`format.layout_entries` for numpy arrays, column-wise: entry names, dtype names, shapes,
    begins and ends (int64 arrays) in layout order, and the input position of each (None: the
    input order). Shapes and sizes come from the arrays themselves, so they need no checking."""
    arrays = shard.arrays
    # unique and not "__metadata__": checked when the header is encoded
    names = list(map(fmt.entry_name, shard.keys, shard.specs)) if any(shard.specs) else shard.keys
    shapes = shard.shapes if shard.shapes is not None else list(map(_shape_of, arrays))
    dtypes = shard.dtypes if shard.dtypes is not None else list(map(_dtype_of, arrays))
    kinds = {d: (safetensors_name(d), d.itemsize) for d in set(dtypes)}
    nbytes = shard.nbytes if shard.nbytes is not None else _table.array_nbytes(arrays)
    order: list[int] | None = None
    if len(kinds) == 1:
        ((dtype_name, _),) = kinds.values()
        dtype_names = [dtype_name] * len(arrays)
    else:
        sizes = np.fromiter((kinds[d][1] for d in dtypes), np.int64, len(dtypes))
        perm = np.argsort(-sizes, kind="stable")
        if (np.diff(perm) != 1).any():
            order = perm.tolist()
            dtypes = [dtypes[j] for j in order]
            names = [names[j] for j in order]
            shapes = [shapes[j] for j in order]
            nbytes = nbytes[perm]
        dtype_names = [kinds[d][0] for d in dtypes]
    ends = np.cumsum(nbytes)
    return names, dtype_names, shapes, ends - nbytes, ends, order


_dtype_of = operator.attrgetter("dtype")
_shape_of = operator.attrgetter("shape")
_key_of = operator.attrgetter("checkpoint_key")
_device_of = operator.attrgetter("device")


def _regions(plans: list[_ShardPlan], threads: int) -> list[_Region]:
    """Cut shards into regions so that `threads` threads get similar amounts of work.

    A shard is cut only when it is larger than its fair share of the total and than
    2 * MIN_REGION; cuts fall between entries. Largest regions come first (longest job first).
    """
    total = sum(p.size for p in plans)
    fair = total / max(threads, 1)
    out: list[_Region] = []
    for p in plans:
        parts = 1
        if threads > 1 and p.size > max(fair, 2 * MIN_REGION):
            parts = max(1, min(threads, p.size // MIN_REGION, round(p.size / fair)))
        if parts == 1:
            out.append(_Region(p, 0, len(p.keys), p.size, True))
            p.pending = 1
            continue
        target = p.size / parts
        made = first = 0
        nbytes = int(p.offsets[0]) if len(p.offsets) else p.size
        for i, n in enumerate((p.ends - p.offsets).tolist()):
            if i > first and made < parts - 1 and nbytes + n / 2 > target:
                out.append(_Region(p, first, i, nbytes, made == 0))
                made += 1
                first, nbytes = i, 0
            nbytes += n
        out.append(_Region(p, first, len(p.keys), nbytes, made == 0))
        p.pending = made + 1
    out.sort(key=lambda r: -r.nbytes)
    return out


def _create(p: _ShardPlan, preallocate: bool = False) -> None:
    """Create shard file `p` (when its first region is written: a writer keeps only the files
    it is writing open); with `preallocate`, reserve its final size on disk first: a full disk
    then fails before any byte is written, and the writes skip ext4's delayed allocation
    (about 15% less time for 200 MB of small tensors)."""
    try:
        p.fd = os.open(p.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o644)
    except OSError as e:
        raise _io_error(e, "creating", p.path) from e
    if preallocate:
        try:
            _gather.preallocate(p.fd, p.size)
        except OSError as e:
            raise _io_error(e, f"reserving {p.size} bytes for", p.path) from e


def _close(p: _ShardPlan) -> None:
    if p.fd >= 0:
        fd, p.fd = p.fd, -1
        os.close(fd)


def _close_all(plans: list[_ShardPlan]) -> None:
    for p in plans:
        _close(p)


def _run_zstd(
    plans: list[_ShardPlan],
    threads: int,
    durable: bool,
    checksum: bool,
    bar: Any,
    **zstd_options: Any,
) -> None:
    """Compressed shards, one after the other: each is compressed by `threads` threads."""
    from .compression import write_zstd_shard

    try:
        for p in plans:
            _create(p)
            assert p.layouts is not None
            arrays = list(map(_as_bytes, p.arrays))
            try:
                # the entry checksums are computed on the compression threads, in parallel
                stats = write_zstd_shard(p.fd, str(p.path), p.layouts, arrays, threads=threads,
                                         checksum=checksum, **zstd_options)
                if durable:
                    os.fsync(p.fd)
            except OSError as e:
                raise _io_error(e, "writing", p.path) from e
            if checksum:
                p.xxh3 = list(stats.xxh3)
            if bar is not None:
                bar.update(p.size)
            p.size = stats.file_size
            _close(p)
            del arrays
    finally:
        _close_all(plans)


def _run(
    plans: list[_ShardPlan],
    regions: list[_Region],
    threads: int,
    durable: bool,
    checksum: bool,
    bar: Any,
    meanwhile: Callable[[], _T],
) -> _T:
    """Write `regions` on `threads` threads; returns what `meanwhile` returns, which runs in
    this thread while they write."""
    stop = threading.Event()
    try:

        def work(region: _Region) -> None:
            if stop.is_set():
                return
            try:
                shard = region.shard
                with shard.lock:  # the first region of a shard creates its file
                    if shard.fd < 0:
                        _create(shard, preallocate=True)
                _write_region(region, checksum, stop, bar, durable)
                with shard.lock:
                    shard.pending -= 1
                    last = shard.pending == 0
                if last:  # the other regions are written: close the file
                    try:
                        if durable:
                            os.fsync(shard.fd)
                    except OSError as e:
                        raise _io_error(e, "syncing", shard.path) from e
                    finally:
                        _close(shard)
            except BaseException:
                stop.set()
                raise

        running = ParallelRun(work, regions, threads, stop)
        try:
            return meanwhile()
        except BaseException:
            stop.set()
            raise
        finally:
            running.wait()
    finally:
        _close_all(plans)


def _write_region(region: _Region, checksum: bool, stop: threading.Event, bar: Any,
                  durable: bool = False) -> None:
    """Write (and hash) the entries of `region` with the native kernel, in groups of about
    WRITE_GROUP bytes so that progress is reported and a failure elsewhere stops this thread.
    With `durable`, the disk starts on each group as soon as it is written (the file is
    fsynced at the end anyway): writing back overlaps the writes of the next groups instead
    of all of it waiting for the fsync."""
    shard = region.shard
    fd, arrays, offsets, ends = shard.fd, shard.arrays, shard.offsets, shard.ends
    digests = shard.digests if checksum else None
    try:
        if region.with_header:
            _gather.write_arrays(fd, [np.frombuffer(c, np.uint8) for c in shard.header], 0)
            if bar is not None:
                bar.update(sum(map(len, shard.header)))
        i, last = region.start, region.stop
        while i < last and not stop.is_set():
            j = min(last, int(np.searchsorted(ends, offsets[i] + WRITE_GROUP)) + 1)
            done = i + _gather.write_arrays(fd, arrays[i:j], offsets[i],
                                            None if digests is None else digests[i:j])
            if done < j:  # a non-contiguous array: write (and hash) a C-order copy of it
                copy = [np.ascontiguousarray(arrays[done])]
                _gather.write_arrays(fd, copy, offsets[done],
                                     None if digests is None else digests[done : done + 1])
                j = done + 1
            if durable:
                _gather.start_writeback(fd, int(offsets[i]), int(ends[j - 1] - offsets[i]))
            if bar is not None:
                bar.update(int(ends[j - 1] - offsets[i]))
            i = j
    except OSError as e:
        raise _io_error(e, "writing", shard.path) from e


def _as_bytes(array: np.ndarray) -> np.ndarray:
    """A flat uint8 view of `array` (copied to C order first if it is not contiguous)."""
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array.reshape(-1).view(np.uint8)


def _io_error(e: OSError, doing: str, path: Path) -> OSError:
    """The same OSError (errno kept, so ENOSPC stays recognisable) naming the shard file."""
    return OSError(e.errno, f"{doing} shard file: {e.strerror or e}", str(path))


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm  # type: ignore[import-untyped]

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="saving")


def _index(
    plans: list[_ShardPlan],
    saved: SavedTensors,
    description: str,
    user_metadata: dict[str, Any],
    codec: str,
    generation: str,
) -> fmt.CheckpointIndex:
    """The index of the shards `plans`, without checksums (see `_checksums`)."""
    keys, dtypes, shapes, devices = saved.keys, saved.dtypes, saved.shapes, saved.devices
    rows: dict[str, int] | None = None
    if not all(p.rows is not None for p in plans):  # find each entry's tensor by its key
        if len(set(keys)) != len(keys):  # slices of one key given as several inputs: first wins
            first = dict(zip(reversed(keys), reversed(range(len(keys)))))
            picked = sorted(first.values())
            keys = [keys[i] for i in picked]
            dtypes = [dtypes[i] for i in picked]
            shapes = [shapes[i] for i in picked]
            devices = [devices[i] for i in picked]
        rows = dict(zip(keys, range(len(keys))))
    slice_tensor: list[int] = []
    slice_spec: list[str] = []
    slice_shard: list[int] = []
    for number, p in enumerate(plans):  # entries are in data-region order
        if rows is None:
            assert p.rows is not None
            slice_tensor += p.rows
        else:
            try:
                slice_tensor += map(rows.__getitem__, p.keys)
            except KeyError as e:
                raise ShardkitError(f"shard {p.file} holds {e.args[0]!r}, which is not a saved "
                                    "tensor") from None
        slice_spec += p.specs
        slice_shard += repeat(number, len(p.keys))
    stored = np.bincount(np.asarray(slice_tensor, np.int64), minlength=len(keys))
    if len(keys) and stored.min() == 0:
        key = keys[int(np.argmin(stored))]
        raise ShardkitError(f"tensor {key!r} was not written to any shard")
    names = {d: safetensors_name(d) for d in set(dtypes)}
    dtype_names = ([names[dtypes[0]]] * len(dtypes) if len(names) == 1
                   else list(map(names.__getitem__, dtypes)))
    shards = [fmt.ShardInfo(p.file, p.task, codec, p.size, generation) for p in plans]
    index = fmt.CheckpointIndex(
        description, shards, keys, dtype_names, shapes, devices,
        slice_tensor, slice_spec, slice_shard, [None] * len(slice_tensor), user_metadata,
        fmt.FORMAT_VERSION, generation,
    )
    if saved.total_size is not None:
        index.set_total_size(saved.total_size)
    return index


def _checksums(plans: list[_ShardPlan], checksum: bool) -> list[str | None]:
    """The index's checksum column: the xxh3-64 of every entry, shard by shard, in hex."""
    column: list[str | None] = []
    for p in plans:
        if not checksum:
            column += repeat(None, len(p.keys))
        else:
            column += p.xxh3 if p.xxh3 is not None else _gather.hex_digests(p.digests)
    return column


def _full_shape(t: ShardableTensor) -> tuple[int, ...]:
    if t.slice_spec == "":
        return t.shape
    return parse_slice_spec(t.slice_spec).full_shape

