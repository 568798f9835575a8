"""Verifying a .skz shard (`SkzShard.verify_entries`): every frame checked and the entries'
xxh3 computed in one ordered pass over the chunks, decoded on the pool."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from concurrent.futures import Executor, wait
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import xxhash

from ..._kernels import _shuffle
from ...errors import ChecksumError
from .codec import KEEP_DECODE_BUFFER, _chunk_buffer

if TYPE_CHECKING:
    from .reader import SkzShard

VERIFY_WINDOW_PER_THREAD: Final = 2  # decoded chunks waiting to be hashed, per thread


def verify_entries(shard: SkzShard, names: Collection[str] | None,
                   pool: Executor | None = None, every_frame: bool = False
                   ) -> tuple[dict[str, str], list[tuple[int, ChecksumError]]]:
    """One pass, in chunk order, over the chunks of `shard` holding the entries `names` (None:
    every entry; `every_frame`: every chunk, so every frame is checked even where no entry is
    read): each frame is checked (its xxh3 in the frame table, zstd's content size and
    checksum) and the logical bytes of the entries are hashed incrementally, piece by piece.

    Returns the xxh3-64 hex digest of each entry of `names` (all entries for None) whose
    frames are intact, and the corrupt frames as (frame number, error); an entry with
    bytes in a corrupt frame gets no digest. Memory: a chunk buffer per thread plus
    `VERIFY_WINDOW_PER_THREAD` decoded chunks per thread; chunks larger than
    KEEP_DECODE_BUFFER are streamed in blocks instead, whatever size the header records.
    """
    plan = shard.plan
    n_entries = len(plan.order)
    name_of = [shard._names[int(k)] for k in plan.order]  # entry number -> name
    if names is None:
        wanted = np.ones(n_entries, bool)
    else:
        wanted = np.fromiter((n in names for n in name_of), bool, n_entries)
    if names is None or every_frame:
        chunks = list(range(plan.n_chunks))
    else:
        chunks = np.unique(plan.data_offset[wanted[plan.entry]] // plan.chunk_size).tolist()
    ends = np.fromiter((shard.entries[n].end for n in name_of), np.int64, n_entries)
    digests: dict[str, str] = {}
    for e in np.flatnonzero(wanted).tolist():
        if shard.entries[name_of[e]].nbytes == 0:
            digests[name_of[e]] = xxhash.xxh3_64_hexdigest(b"")
    hashers: dict[int, Any] = {}
    tainted: set[int] = set()
    bad: list[tuple[int, ChecksumError]] = []

    def feed(p: int, block: Any) -> None:
        e = int(plan.entry[p])
        if not wanted[e] or e in tainted:
            return
        h = hashers.get(e)
        if h is None:
            h = hashers[e] = xxhash.xxh3_64()
        h.update(block)

    def close_pieces(i: int) -> None:
        for p in range(int(plan.ptr[i]), int(plan.ptr[i + 1])):
            e = int(plan.entry[p])
            if (plan.data_offset[p] + plan.length[p] == ends[e] and e in hashers
                    and e not in tainted):
                digests[name_of[e]] = hashers.pop(e).hexdigest()

    def fail(i: int, e: ChecksumError) -> None:
        bad.append((i, e))
        for p in range(int(plan.ptr[i]), int(plan.ptr[i + 1])):
            k = int(plan.entry[p])
            tainted.add(k)
            hashers.pop(k, None)

    if shard.header.chunk_size > KEEP_DECODE_BUFFER:
        for i in chunks:
            c0, c1 = plan.chunk_range(i)
            try:
                for p, block in shard._stream_range(i, c0, c1, check=True):
                    feed(p, block)
            except ChecksumError as e:
                fail(i, e)
                continue
            close_pieces(i)
        return digests, bad

    threads = 1
    if pool is not None:  # a WorkerPool or a ThreadPoolExecutor
        n = getattr(pool, "_max_workers", getattr(pool, "_threads", 2))
        threads = n if isinstance(n, int) else 2
    window = max(1, VERIFY_WINDOW_PER_THREAD * threads)
    free: list[np.ndarray] = []
    pending: deque[tuple[int, np.ndarray, Any]] = deque()
    todo = deque(chunks)

    def submit() -> None:
        i = todo.popleft()
        out = free.pop() if free else np.empty(plan.chunk_size, np.uint8)
        task = partial(logical_chunk, shard, i, out)
        pending.append((i, out, pool.submit(task) if pool is not None else task))

    try:
        while todo or pending:
            while todo and len(pending) < window:
                submit()
            i, out, job = pending.popleft()
            try:
                job.result() if pool is not None else job()
            except ChecksumError as e:
                fail(i, e)
                free.append(out)
                continue
            c0 = i * plan.chunk_size
            for p in range(int(plan.ptr[i]), int(plan.ptr[i + 1])):
                at = int(plan.data_offset[p]) - c0
                feed(p, out[at : at + int(plan.length[p])])
            close_pieces(i)
            free.append(out)
    finally:
        if pool is not None:
            for _, _, job in pending:
                job.cancel()
            wait([job for _, _, job in pending])
    return digests, bad


def logical_chunk(shard: SkzShard, i: int, out: np.ndarray) -> None:
    """Chunk i's logical (unshuffled) bytes into `out`, its frame checked as in verify."""
    data = shard._decode(i, check_hash=True, into=_chunk_buffer(shard.header))
    plan = shard.plan
    lo, hi = int(plan.ptr[i]), int(plan.ptr[i + 1])
    c0, c1 = plan.chunk_range(i)
    if not shard.header.shuffle:
        out[: c1 - c0] = np.frombuffer(data, np.uint8, c1 - c0)
        return
    at = plan.data_offset[lo:hi] - c0
    n = plan.length[lo:hi] // plan.itemsize[lo:hi]
    zeros = np.zeros(hi - lo, np.int64)
    _shuffle.unshuffle_scatter(data, at, n, plan.itemsize[lo:hi], zeros, n, [out],
                               zeros, at)
