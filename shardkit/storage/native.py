"""The local file system's native write path: shard files written from the arrays' memory.

Every entry is written straight from the caller's memory by the native kernel
(`_gather.write_arrays`, GIL released, hashing each buffer with xxh3-64 just before writing
it); a non-contiguous input is copied to C order first, one tensor at a time (the only copy).
Threads write separate shard files at once, a shard much larger than the others cut at entry
boundaries into regions for several threads; the first failure stops the others. A durable
save starts each group's writeback as soon as it is written (``sync_file_range``), so the
closing fsync waits for the last group only. Compressed shards are written one after the
other, each compressed on `threads` threads (`shards.skz`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .._kernels import _gather
from .._threads import ParallelRun
from ..values.strings import STRING_FILE, StringColumns, StringFile, write_string_file
from .base import ShardFile as _ShardPlan

_T = TypeVar("_T")

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
WRITE_GROUP = 64 * 1024 * 1024  # bytes per kernel call: progress and stop requests in between
MIN_REGION = 64 * 1024 * 1024  # a shard is cut into regions for several threads above this


@dataclass(slots=True)
class _Region:
    """A run of consecutive entries ``[start, stop)`` of one shard, written by one thread."""

    shard: _ShardPlan
    start: int
    stop: int
    nbytes: int
    with_header: bool


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
    then fails before any byte is written, and the writes skip ext4's delayed allocation."""
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
    from ..shards.skz import write_zstd_shard

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

