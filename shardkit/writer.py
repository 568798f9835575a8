"""Write validated shards as shard files, in parallel, with per-entry xxh3-64 checksums.

How the bytes move (DESIGN.md section 5):

- Large entries are written straight from the caller's memory with ``os.pwrite`` in chunks; the
  xxh3 of a chunk is updated just before the chunk is written, while it is still in cache. A
  non-contiguous input is copied to C order first, one tensor at a time (the only copy).
- Small entries are gathered by the native kernel into a per-thread buffer of a few MiB and
  written with one syscall per buffer, so 50,000 tiny tensors cost a few dozen syscalls.
- A pool of threads writes separate shard files at once; a shard much larger than the others is
  cut at entry boundaries into regions written by several threads. Every write, hash and gather
  releases the GIL. The first failure stops the other threads, and the caller (shardkit.api)
  removes the temp directory, so nothing partial survives.

Memory: one gather buffer per thread (kept between saves) plus, for non-contiguous inputs, one
tensor copy per thread. Compressed shards (``compression="zstd"``) are written one after the
other by shardkit.compression, which compresses each shard's chunks on `threads` threads.
"""

from __future__ import annotations

import operator
import os
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from . import format as fmt
from ._kernels import _gather
from .callback import TaskShard
from .dtypes import safetensors_name
from .errors import ShardkitError
from .slices import parse_slice_spec
from .tensors import ShardableTensor, _columns_constructor

SMALL_ENTRY = 256 * 1024  # entries below this are gathered into a buffer
GATHER_BUFFER = 4 * 1024 * 1024  # bytes per gather buffer (per thread)
HASH_CHUNK = 8 * 1024 * 1024  # large entries: hash + write per chunk (two chunks fit in L3)
RAW_CHUNK = 64 * 1024 * 1024  # ...or of this size without checksums
MIN_REGION = 64 * 1024 * 1024  # a shard is cut into regions for several threads above this


class _BufferPool:
    """Gather buffers kept between saves: touching fresh memory costs more than writing it on
    some VMs (first-touch page faults), and every save would otherwise fault in new buffers."""

    def __init__(self, keep: int = 8) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._keep = keep

    def acquire(self) -> np.ndarray:
        with self._lock:
            while self._free:
                buf = self._free.pop()
                if len(buf) == GATHER_BUFFER:
                    return buf
        return np.empty(GATHER_BUFFER, dtype=np.uint8)

    def release(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(buf) != GATHER_BUFFER:  # the size was changed meanwhile
                self._free.clear()
            elif len(self._free) < self._keep:
                self._free.append(buf)


_buffers = _BufferPool()


def default_threads() -> int:
    """Writer threads when none are asked for: one per core, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


@dataclass(slots=True)
class _Entry:
    """One (key, slice) of one shard, in its on-disk position."""

    key: str
    spec: str
    array: np.ndarray
    offset: int  # absolute file offset
    nbytes: int
    xxh3: str | None = None


_new_entries = _columns_constructor(_Entry)


@dataclass(slots=True)
class _ShardPlan:
    path: Path
    file: str
    task: int
    header: bytes
    entries: list[_Entry]
    layouts: list[fmt.EntryLayout]
    size: int
    fd: int = -1
    pending: int = 0  # regions not yet written
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(slots=True)
class _Region:
    """A run of consecutive entries of one shard, written by one thread."""

    shard: _ShardPlan
    entries: list[_Entry]
    nbytes: int
    with_header: bool


def write_shards(
    directory: str | os.PathLike[str],
    task_shards: Sequence[TaskShard],
    tensors: Sequence[ShardableTensor],
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
) -> fmt.CheckpointIndex:
    """Write `task_shards` (validated callback output) into `directory` as shard files.

    Raw safetensors shards, or zstd shards (``.skz``, shardkit.compression) when `compression`
    is ``"zstd"``. Returns the checkpoint index describing them; writing ``index.json`` and
    publishing the directory is the caller's job (shardkit.commit). `tensors` gives the order
    and devices of the saved tensors. With `durable`, each shard file is fsynced once complete.
    """
    if compression not in (None, "zstd"):
        raise ValueError(f"unknown compression {compression!r}; use None or 'zstd'")
    codec = "raw" if compression is None else "zstd"
    threads = threads or default_threads()
    plans = _plan(Path(directory), task_shards, codec)
    total = sum(p.size for p in plans)  # for zstd: the uncompressed bytes
    bar = _progress_bar(total, progress)
    try:
        if codec == "raw":
            _run(plans, _regions(plans, threads), threads, durable, checksum, bar)
        else:
            _run_zstd(plans, threads, durable, checksum, bar,
                      level=level, shuffle=shuffle, chunk_size=chunk_size)
    finally:
        if bar is not None:
            bar.close()
    return _index(plans, tensors, description, checksum, user_metadata or {}, codec)


def _plan(directory: Path, task_shards: Sequence[TaskShard], codec: str) -> list[_ShardPlan]:
    count = len(task_shards)
    plans = []
    ndarray = np.ndarray
    for i, (task, shard) in enumerate(task_shards):
        keys: list[str] = []
        specs: list[str] = []
        arrays: list[np.ndarray] = []
        for key, slices in shard.items():
            for spec, value in slices.items():
                keys.append(key)
                specs.append(spec)
                arrays.append(value if type(value) is ndarray else np.asarray(value))
        names = list(map(fmt.entry_name, keys, specs))
        described = list(zip(names, map(_dtype_of, arrays), map(_shape_of, arrays)))
        layouts = fmt.layout_entries(described)
        header = fmt.encode_safetensors_header(layouts) if codec == "raw" else b""
        start = len(header)
        order = list(map(_order_of, layouts))
        entries = _new_entries(
            map(keys.__getitem__, order),
            map(specs.__getitem__, order),
            map(arrays.__getitem__, order),
            [start + lay.begin for lay in layouts],
            [lay.end - lay.begin for lay in layouts],
            repeat(None, len(layouts)),
        )
        name = fmt.shard_file_name(i, count, codec)
        plans.append(
            _ShardPlan(directory / name, name, task, header, entries, layouts,
                       start + fmt.data_size(layouts))
        )
    return plans


_dtype_of = operator.attrgetter("dtype")
_shape_of = operator.attrgetter("shape")
_order_of = operator.attrgetter("order_index")
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
        target = p.size / parts
        made = 0
        current: list[_Entry] = []
        nbytes = len(p.header)
        for e in p.entries:
            if current and made < parts - 1 and nbytes + e.nbytes / 2 > target:
                out.append(_Region(p, current, nbytes, made == 0))
                made += 1
                current, nbytes = [], 0
            current.append(e)
            nbytes += e.nbytes
        out.append(_Region(p, current, nbytes, made == 0))
        p.pending = made + 1
    out.sort(key=lambda r: -r.nbytes)
    return out


def _open_all(plans: list[_ShardPlan]) -> None:
    for p in plans:
        try:
            p.fd = os.open(p.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as e:
            raise _io_error(e, "creating", p.path) from e


def _close_all(plans: list[_ShardPlan]) -> None:
    for p in plans:
        if p.fd >= 0:
            os.close(p.fd)
            p.fd = -1


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
        _open_all(plans)
        for p in plans:
            arrays = [_as_bytes(e.array) for e in p.entries]
            try:
                # the entry checksums are computed on the compression threads, in parallel
                stats = write_zstd_shard(p.fd, str(p.path), p.layouts, arrays, threads=threads,
                                         checksum=checksum, **zstd_options)
                if durable:
                    os.fsync(p.fd)
            except OSError as e:
                raise _io_error(e, "writing", p.path) from e
            if checksum:
                for entry, digest in zip(p.entries, stats.xxh3):
                    entry.xxh3 = digest
            if bar is not None:
                bar.update(p.size)
            p.size = stats.file_size
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
) -> None:
    stop = threading.Event()
    try:
        _open_all(plans)

        def work(region: _Region) -> None:
            if stop.is_set():
                return
            buf = _buffers.acquire()
            try:
                _write_region(region, buf, checksum, stop, bar)
                shard = region.shard
                with shard.lock:
                    shard.pending -= 1
                    last = shard.pending == 0
                if last and durable:
                    try:
                        os.fsync(shard.fd)
                    except OSError as e:
                        raise _io_error(e, "syncing", shard.path) from e
            except BaseException:
                stop.set()
                raise
            finally:
                _buffers.release(buf)

        if threads <= 1 or len(regions) <= 1:
            for r in regions:
                work(r)
        else:
            with ThreadPoolExecutor(min(threads, len(regions)), "shardkit-writer") as pool:
                futures = [pool.submit(work, r) for r in regions]
                try:
                    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                except BaseException:  # e.g. KeyboardInterrupt: stop the workers early
                    stop.set()
                    raise
                failed = [f for f in done if f.exception() is not None]
                if failed:
                    stop.set()
                    for f in futures:
                        f.cancel()
                    raise failed[0].exception()  # type: ignore[misc]
    finally:
        _close_all(plans)


def _write_region(
    region: _Region, buf: np.ndarray, checksum: bool, stop: threading.Event, bar: Any
) -> None:
    shard = region.shard
    fd = shard.fd
    try:
        if region.with_header:
            _pwrite_all(fd, shard.header, 0)
            if bar is not None:
                bar.update(len(shard.header))
        # Gather runs of small entries; write large ones in place.
        group: list[_Entry] = []
        group_bytes = 0
        for e in region.entries:
            if e.nbytes < SMALL_ENTRY:
                if group and group_bytes + e.nbytes > len(buf):
                    _flush_group(fd, group, buf, checksum, bar)
                    group, group_bytes = [], 0
                    if stop.is_set():
                        return
                group.append(e)
                group_bytes += e.nbytes
            else:
                if group:
                    _flush_group(fd, group, buf, checksum, bar)
                    group, group_bytes = [], 0
                _write_large(fd, e, checksum, stop, bar)
                if stop.is_set():
                    return
        if group:
            _flush_group(fd, group, buf, checksum, bar)
    except OSError as e:
        raise _io_error(e, "writing", shard.path) from e


def _as_bytes(array: np.ndarray) -> np.ndarray:
    """A flat uint8 view of `array` (copied to C order first if it is not contiguous)."""
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array.reshape(-1).view(np.uint8)


def _flush_group(
    fd: int, group: list[_Entry], buf: np.ndarray, checksum: bool, bar: Any
) -> None:
    """Gather the consecutive small entries of `group` into `buf` and write them at once."""
    arrays = [e.array for e in group]
    start = group[0].offset
    offsets = np.fromiter((e.offset for e in group), dtype=np.int64, count=len(group))
    offsets -= start
    try:
        n = _gather.gather_buffers(arrays, offsets, buf)
    except ValueError:  # a non-contiguous array (rare): copy those to C order and retry
        arrays = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in arrays]
        n = _gather.gather_buffers(arrays, offsets, buf)
    if checksum:
        digest: Any = xxhash.xxh3_64_hexdigest  # numpy arrays are buffers; the stubs disagree
        for e, a in zip(group, arrays):
            e.xxh3 = digest(a)
    _pwrite_all(fd, buf[:n], start)
    if bar is not None:
        bar.update(n)


def _write_large(fd: int, e: _Entry, checksum: bool, stop: threading.Event, bar: Any) -> None:
    data = _as_bytes(e.array)
    step = HASH_CHUNK if checksum else RAW_CHUNK
    hasher = xxhash.xxh3_64() if checksum else None
    for begin in range(0, e.nbytes, step):
        chunk = data[begin : begin + step]
        if hasher is not None:
            hasher.update(chunk)  # type: ignore[arg-type]
        _pwrite_all(fd, chunk, e.offset + begin)
        if bar is not None:
            bar.update(len(chunk))
        if stop.is_set():
            return
    if hasher is not None:
        e.xxh3 = hasher.hexdigest()


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(0, "pwrite wrote nothing")
        view = view[n:]
        offset += n


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
    tensors: Sequence[ShardableTensor],
    description: str,
    checksum: bool,
    user_metadata: dict[str, Any],
    codec: str,
) -> fmt.CheckpointIndex:
    slices: dict[str, list[fmt.SliceInfo]] = {}
    for number, p in enumerate(plans):
        keys = [e.key for e in p.entries]
        specs = [e.spec for e in p.entries]
        names = list(map(fmt.entry_name, keys, specs))
        hashes = [e.xxh3 for e in p.entries] if checksum else repeat(None, len(keys))
        made = fmt._new_slice_infos(specs, repeat(number, len(keys)), names, hashes)
        for key, info in zip(keys, made):
            have = slices.get(key)
            if have is None:
                slices[key] = [info]
            else:
                have.append(info)
    keys = list(map(_key_of, tensors))
    found: list[list[fmt.SliceInfo] | None] = [slices.get(key) for key in keys]
    if any(map(operator.is_, found, repeat(None))):
        key = keys[found.index(None)]
        raise ShardkitError(f"tensor {key!r} was not written to any shard")
    if len(set(keys)) != len(keys):  # slices of one key given as several inputs: first wins
        first = dict(zip(reversed(keys), reversed(range(len(keys)))))
        picked = sorted(first.values())
        tensors = [tensors[i] for i in picked]
        keys = [keys[i] for i in picked]
        found = [found[i] for i in picked]
    dtypes = list(map(_dtype_of, tensors))
    dtype_names = {d: safetensors_name(d) for d in set(dtypes)}
    devices = list(map(_device_of, tensors))
    device_names = {i: d.to_string() for i, d in dict(zip(map(id, devices), devices)).items()}
    shapes = [_full_shape(t) for t in tensors]
    infos = dict(zip(keys, fmt._new_tensor_infos(
        list(map(dtype_names.__getitem__, dtypes)),
        shapes,
        list(map(device_names.__getitem__, map(id, devices))),
        found,
    )))
    shards = [fmt.ShardInfo(p.file, p.task, codec, p.size) for p in plans]
    return fmt.CheckpointIndex(description, shards, infos, user_metadata)


def _full_shape(t: ShardableTensor) -> tuple[int, ...]:
    if t.slice_spec == "":
        return t.shape
    return parse_slice_spec(t.slice_spec).full_shape

