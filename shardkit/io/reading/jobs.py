"""Running a read's byte jobs: each source's as its tasks, on the read pool when several.

A job is (source, entry, begin, end, destination): bytes ``[begin, end)`` of the entry's data
into a writable buffer. Every read path (whole tensors, slices, boxes) ends here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...format import EntryLayout
from ...shards.files import PARALLEL_MIN, READ_CHUNK
from ...shards.raw import ShardSource
from ...shards.skz import run_tasks
from .shards import ShardSet

SMALL_PIECE = 1 << 20  # copies below this are made on the calling thread

ReadJob = tuple[ShardSource, EntryLayout, int, int, memoryview]


def read_jobs(shards: ShardSet, jobs: Sequence[ReadJob]) -> None:
    """Run reads: each source's in one batch (`ShardSource.read_tasks`: a compressed shard
    decodes each chunk once, a store's object coalesces its GETs, a local file cuts large reads
    into tasks of about READ_CHUNK bytes), the tasks of all sources together, on the pool when
    there are several."""
    batches: dict[int, tuple[ShardSource, list[tuple[EntryLayout, int, int, memoryview]]]] = {}
    for job in jobs:
        batches.setdefault(id(job[0]), (job[0], []))[1].append(job[1:])
    run_reads(shards, [t for src, batch in batches.values() for t in src.read_tasks(batch)])


def run_reads(shards: ShardSet, reads: Sequence[Callable[[], None]]) -> None:
    """Run independent reads, on the pool when there are several (they release the GIL)."""
    run_tasks(reads, shards.worker_pool() if len(reads) > 1 else None)


def copy_pieces(shards: ShardSet, copies: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """``dst[...] = src`` for each pair; large ones cut along their first axis of more than
    one element into parts of about READ_CHUNK bytes, run on the pool."""
    total = sum(dst.nbytes for dst, _ in copies)
    parts = []
    for dst, src in copies:
        if total < PARALLEL_MIN or dst.nbytes < SMALL_PIECE:
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
    pool = shards.worker_pool()
    for f in [pool.submit(np.copyto, d, s, casting="no") for d, s in parts]:
        f.result()


def whole_entry(shards: ShardSet, src: ShardSource, entry: EntryLayout, dtype: np.dtype,
                shape: tuple[int, ...]) -> np.ndarray:
    """The whole entry as an array: a view of the map when the source maps it, else read."""
    n = entry.nbytes
    view = src.view(entry, 0, n) if n else None
    if view is not None:
        return np.frombuffer(view, dtype).reshape(shape)
    out = np.empty(shape, dtype)
    if n:
        read_jobs(shards, [(src, entry, 0, n, bytes_of(out))])
    return out


def bytes_of(a: np.ndarray) -> memoryview:
    """A writable byte view of a C-contiguous array (any dtype, 0-d included)."""
    return a.reshape(-1).view(np.uint8).data


def as_view(local: tuple[slice, ...]) -> Any:
    """`local` as an index that gives a view even of a 0-d array (``a[()]`` copies a scalar)."""
    return (*local, Ellipsis)
