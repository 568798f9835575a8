"""Writing a .skz shard: arrays gathered into chunks, shuffled, compressed in parallel and
streamed to the file, the frame table written last (`write_zstd_shard`)."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..._kernels import _shuffle
from ...format import (
    EntryLayout,
)
from .codec import (
    INFLIGHT_PER_THREAD,
    _buffers,
    _compression_pool,
    _compressor,
    resolve_compression,
)
from .container import (
    DEFAULT_CHUNK_SIZE,
    FRAME_DTYPE,
    KIND_RAW,
    KIND_ZSTD,
    _seal_skz_header,
    _skz_prefix,
    plan_chunks,
)


@dataclass(frozen=True, slots=True)
class SkzWriteStats:
    """What `write_zstd_shard` wrote."""

    file_size: int
    header_size: int
    data_size: int
    frames: int
    raw_frames: int  # chunks stored raw because compressing them did not shrink them
    xxh3: tuple[str | None, ...] = ()  # per entry, in the order of the layouts given

    @property
    def ratio(self) -> float:
        stored = self.file_size - self.header_size
        return self.data_size / stored if stored else 1.0


def _byte_view(a: Any, nbytes: int, name: str) -> Any:
    if isinstance(a, np.ndarray):
        a = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        n = a.nbytes
    else:
        n = memoryview(a).nbytes
    if n != nbytes:
        raise ValueError(f"entry {name!r}: array has {n} bytes, its layout needs {nbytes}")
    return a


def write_zstd_shard(
    fd: int,
    path: str,
    layouts: Sequence[EntryLayout],
    arrays: Sequence[Any],
    *,
    level: int | None = None,
    shuffle: bool = True,
    chunk_size: int | str = DEFAULT_CHUNK_SIZE,
    threads: int = 2,
    metadata: Mapping[str, str] | None = None,
    checksum: bool = False,
) -> SkzWriteStats:
    """Write a whole .skz shard to `fd` (from offset 0; no fsync) and return what was written.

    `arrays[i]` holds the bytes of `layouts[i]` (C-contiguous). Chunks are gathered+shuffled and
    compressed on `threads` threads (each with its own compressor; the GIL is released by the
    kernel and by zstd) while this thread writes finished frames in order; at most
    ``INFLIGHT_PER_THREAD * threads`` chunks are in flight. With `checksum`, the xxh3-64 of each
    entry's bytes (for index.json) is computed on the same threads, by the task of the chunk
    that holds the entry's last byte, and returned in ``stats.xxh3``.
    """
    opts = resolve_compression("zstd", level, shuffle, chunk_size)
    assert opts is not None
    if len(arrays) != len(layouts):
        raise ValueError(f"{len(arrays)} arrays for {len(layouts)} entries")
    plan = plan_chunks(layouts, opts.chunk_size, opts.shuffle, path)
    sources = [_byte_view(arrays[int(i)], layouts[int(i)].nbytes, layouts[int(i)].name)
               for i in plan.order]
    sorted_layouts = [layouts[int(i)] for i in plan.order]
    prefix, _ = _skz_prefix(sorted_layouts, opts.chunk_size, opts.shuffle, metadata)
    header = _seal_skz_header(prefix, plan.n_chunks, None)  # frame table filled in at the end
    _pwrite_all(fd, header, 0, path)
    n = plan.n_chunks
    frames = np.zeros(n, FRAME_DTYPE)
    window = max(1, INFLIGHT_PER_THREAD * threads)
    buf_size = min(opts.chunk_size, plan.data_size)
    digests: list[str | None] = [None] * len(layouts)
    hash_ptr = np.zeros(n + 1, np.int64)
    hash_order = np.zeros(0, np.int64)
    if checksum:
        ends = np.fromiter((e.end for e in sorted_layouts), np.int64, len(layouts))
        sizes = np.fromiter((e.nbytes for e in sorted_layouts), np.int64, len(layouts))
        for k in np.flatnonzero(sizes == 0):
            digests[int(plan.order[k])] = xxhash.xxh3_64_hexdigest(b"")
        nonempty = np.flatnonzero(sizes > 0)
        last_chunk = (ends[nonempty] - 1) // opts.chunk_size
        hash_order = nonempty[np.argsort(last_chunk, kind="stable")]
        hash_ptr = np.searchsorted(np.sort(last_chunk), np.arange(n + 1), "left")

    def work(i: int) -> tuple[Any, int, int, np.ndarray | None]:
        lo, hi = int(plan.ptr[i]), int(plan.ptr[i + 1])
        c0, c1 = plan.chunk_range(i)
        e0 = int(plan.entry[lo])
        buf = _buffers.take(buf_size)
        out = buf[: c1 - c0]
        _shuffle.gather_shuffle(
            sources[e0 : int(plan.entry[hi - 1]) + 1], plan.entry[lo:hi] - e0,
            plan.entry_offset[lo:hi], plan.length[lo:hi], plan.itemsize[lo:hi], out,
            plan.data_offset[lo:hi] - c0,
        )
        for k in hash_order[hash_ptr[i] : hash_ptr[i + 1]]:
            digests[int(plan.order[k])] = xxhash.xxh3_64_hexdigest(sources[int(k)])
        packed = _compressor(opts.level).compress(out.data)
        if len(packed) < len(out):
            _buffers.give(buf)
            return packed, KIND_ZSTD, xxhash.xxh3_64_intdigest(packed), None
        return out, KIND_RAW, xxhash.xxh3_64_intdigest(out.data), buf

    pos = len(header)
    raw_frames = 0
    pool = _compression_pool(max(1, threads))
    pending: deque[Future[tuple[Any, int, int, np.ndarray | None]]] = deque()
    submitted = 0
    try:
        for i in range(n):
            while submitted < n and len(pending) < window:
                pending.append(pool.submit(work, submitted))
                submitted += 1
            stored, kind, digest, buf = pending.popleft().result()
            _pwrite_all(fd, stored, pos, path)
            if buf is not None:
                _buffers.give(buf)
                raw_frames += 1
            c0, c1 = plan.chunk_range(i)
            frames[i] = (pos, len(stored), c1 - c0, kind, 0, digest)
            pos += len(stored)
    except BaseException:
        for f in pending:
            f.cancel()
        wait(pending)  # nothing of this shard runs on after an error
        raise
    _pwrite_all(fd, _seal_skz_header(prefix, n, frames), 0, path)
    return SkzWriteStats(pos, len(header), plan.data_size, n, raw_frames,
                         tuple(digests) if checksum else ())


def _pwrite_all(fd: int, data: Any, offset: int, path: str) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        try:
            done += os.pwrite(fd, view[done:], offset + done)
        except OSError as e:
            raise OSError(e.errno, f"{path}: writing {len(view)} bytes at {offset}: "
                                   f"{e.strerror}") from None
