"""Whole tensors from many ranks: the collective save's HuggingFace layout (docs/FORMAT.md,
section 2.2). Every tensor is one entry of a safetensors shard, as a single process
writes it, though its pieces live on several ranks, and no rank ever holds a piece it does not
own.

Every rank computes the same `Layout` from the plan (the default policy's cuts over the
tensors in index order; entries in a shard by item size, largest first, as `io.writer` orders
them). Each rank then writes its own pieces' bytes at their places in the shared files: a
piece is the rows of a C-order box, so its bytes in the entry are equal runs, one for a
``Shard(0)`` slice, one per outer row for a ``Shard(1)`` one (`runs`); rank 0 writes the
headers. Once every rank's writes are in (the ``index`` gather), rank 0 hashes each entry from
the files (`checksums`) and merges the index. The layout needs one file system under every
rank (`same_directory`); otherwise the save stores per-rank slices, as before.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import format as fmt
from .._kernels import _gather
from ..values.dtypes import entry_sizes, packed_name
from ..values.dtypes import itemsize as numpy_itemsize
from ..values.nibbles import pack
from ..values.slices import WHOLE, parse_slice_spec


@dataclass(frozen=True, slots=True)
class WholeFile:
    """One shard file of the layout: its name, the index rows of its tensors in entry order,
    and each entry's data-region `begins` / `ends` (int64 arrays)."""

    name: str
    rows: list[int]
    begins: np.ndarray
    ends: np.ndarray

    @property
    def data_size(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0


@dataclass(frozen=True, slots=True)
class Layout:
    """The shard files of a whole-tensor collective save, the same on every rank."""

    files: list[WholeFile]
    file_of: np.ndarray  # per index row: its file
    entry_of: np.ndarray  # per index row: its entry in that file

    def header(self, f: WholeFile, keys: Sequence[str], dtypes: Sequence[str],
               shapes: Sequence[tuple[int, ...]], generation: str) -> list[bytes]:
        """File `f`'s safetensors header pieces (its size is where the data region starts)."""
        return fmt.header_parts([keys[r] for r in f.rows], [dtypes[r] for r in f.rows],
                                [shapes[r] for r in f.rows], f.begins, f.ends,
                                fmt.shard_metadata(generation))


def layout(dtypes: Sequence[str], shapes: Sequence[tuple[int, ...]],
           cuts: Sequence[tuple[int, int]]) -> Layout:
    """The files of tensors (index rows, of these dtype names and global shapes) cut into
    shards at `cuts` (``(start, stop)`` of each shard over the rows)."""
    n = len(dtypes)
    sizes = np.asarray(entry_sizes(dtypes, shapes), np.int64).reshape(n)
    items = np.fromiter((max(1, numpy_itemsize(d)) for d in dtypes), np.int64, n)
    file_of = np.zeros(n, np.int64)
    entry_of = np.zeros(n, np.int64)
    files = []
    for number, (a, b) in enumerate(cuts):
        order = a + np.argsort(-items[a:b], kind="stable")  # largest items first: aligned
        ends = np.cumsum(sizes[order])
        file_of[order] = number
        entry_of[order] = np.arange(len(order))
        files.append(WholeFile(fmt.shard_file_name(number, len(cuts), "raw"), order.tolist(),
                               ends - sizes[order], ends))
    return Layout(files, file_of, entry_of)


def runs(shape: tuple[int, ...], spec: str, item: int) -> tuple[np.ndarray, int]:
    """Where the bytes of a C-order piece (slice `spec` of a tensor of `shape`) lie in the
    tensor's entry: the byte offset of each run and the run's length, the runs in the order of
    the piece's own C-order bytes."""
    box = parse_slice_spec(spec, shape) if spec != WHOLE else None
    if box is None or not shape:
        return np.zeros(1, np.int64), math.prod(shape) * item
    offsets, lengths = box.offsets, box.lengths
    j = len(shape) - 1
    while j > 0 and offsets[j] == 0 and lengths[j] == shape[j]:
        j -= 1  # the axes after j are whole: a run spans them
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    start = np.array(sum(o * s for o, s in zip(offsets, strides)), np.int64)
    for i in range(j):  # one run per index of the axes before j, in C order
        start = (start[..., None] + np.arange(lengths[i], dtype=np.int64) * strides[i])
    return start.reshape(-1) * item, lengths[j] * strides[j] * item


def write_pieces(directory: str, lay: Layout, headers: dict[int, list[bytes]],
                 starts: dict[int, int], pieces: Sequence[tuple[int, str, np.ndarray]],
                 threads: int, durable: bool) -> int:
    """Write this rank's pieces (index row, slice spec, C-order host array) and `headers`
    (file number -> header pieces: rank 0 writes every file's) into the layout's files in
    `directory`, creating them at full size; fsync them when `durable`. `starts`: each file's
    data-region start. Returns the bytes written."""
    wanted = sorted({int(lay.file_of[row]) for row, _, _ in pieces} | set(headers))
    fds: dict[int, int] = {}
    try:
        for number in wanted:
            f = lay.files[number]
            fd = fds[number] = os.open(os.path.join(directory, f.name),
                                       os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0),
                                       0o644)
            size = starts[number] + f.data_size
            if number in headers:
                _gather.preallocate(fd, size)  # ENOSPC now rather than midway
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
        jobs: list[tuple[int, int, memoryview]] = []
        for number, parts in headers.items():
            jobs.append((fds[number], 0, memoryview(b"".join(parts))))
        for row, spec, array in pieces:
            number, entry = int(lay.file_of[row]), int(lay.entry_of[row])
            f = lay.files[number]
            base = starts[number] + int(f.begins[entry])
            offsets, run = runs(_shape_of_row(array, spec), spec, array.dtype.itemsize)
            if packed_name(array.dtype) is not None:  # two elements a byte (`packed_runs`)
                offsets, run, array = offsets // 2, run // 2, pack(array)
            data = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
            jobs += [(fds[number], base + int(o), data[k * run:(k + 1) * run])
                     for k, o in enumerate(offsets.tolist())]
        if threads > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(_pwrite_all, _split(jobs, threads)))
        else:
            _pwrite_all(jobs)
        if durable:
            for fd in fds.values():
                os.fsync(fd)
        return sum(len(m) for _, _, m in jobs)
    finally:
        for fd in fds.values():
            os.close(fd)


def packed_runs(shape: tuple[int, ...], spec: str) -> bool:
    """Whether a piece of a tensor packed two elements a byte (float4) starts and ends every
    run on a byte: each run's element offset and count even."""
    offsets, run = runs(shape, spec, 1)
    return not run % 2 and not (offsets % 2).any()


def _shape_of_row(array: np.ndarray, spec: str) -> tuple[int, ...]:
    """The global shape of a piece: the slice spec's, or (whole) the array's own."""
    return tuple(array.shape) if spec == WHOLE else parse_slice_spec(spec).full_shape


def _split(jobs: list[Any], parts: int) -> list[list[Any]]:
    """`jobs` in `parts` lists of near-equal bytes."""
    out: list[list[Any]] = [[] for _ in range(parts)]
    load = [0] * parts
    for job in sorted(jobs, key=lambda j: -len(j[2])):
        i = load.index(min(load))
        out[i].append(job)
        load[i] += len(job[2])
    return out


def _pwrite_all(jobs: Sequence[tuple[int, int, memoryview]]) -> None:
    for fd, offset, data in jobs:
        while len(data):
            n = os.pwrite(fd, data, offset)
            data, offset = data[n:], offset + n


def checksums(directory: str, lay: Layout, starts: dict[int, int], threads: int
              ) -> list[list[str]]:
    """The xxh3-64 of every entry of every file (hex), read back from the files once every
    rank wrote its pieces: entries hashed in parallel on `threads` threads (rank 0 may take the
    machine's cores: the other ranks wait for it)."""
    import xxhash

    maps: list[tuple[Any, mmap.mmap | None, memoryview | None]] = []
    try:
        for number, f in enumerate(lay.files):
            fh = open(os.path.join(directory, f.name), "rb")
            size = starts[number] + f.data_size
            m = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ) if f.data_size else None
            maps.append((fh, m, memoryview(m) if m is not None else None))
        jobs = [(number, int(b) + starts[number], int(e) + starts[number])
                for number, f in enumerate(lay.files) for b, e in zip(f.begins, f.ends)]

        def digest(job: tuple[int, int, int]) -> str:
            view = maps[job[0]][2]
            return xxhash.xxh3_64_hexdigest(b"" if view is None else view[job[1]:job[2]])

        if threads > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(threads) as pool:
                flat = list(pool.map(digest, jobs))
        else:
            flat = list(map(digest, jobs))
    finally:
        for fh, m, view in maps:
            if view is not None:
                view.release()
            if m is not None:
                m.close()
            fh.close()
    out, at = [], 0
    for f in lay.files:
        out.append(flat[at:at + len(f.rows)])
        at += len(f.rows)
    return out


def directory_identity(path: str) -> tuple[int, int] | None:
    """The device and inode of the directory a checkpoint at `path` goes into (its parent), or
    None where it cannot be seen: ranks that agree on it write into one directory."""
    try:
        st = os.stat(os.path.dirname(os.path.abspath(path)) or ".")
    except OSError:
        return None
    return st.st_dev, st.st_ino
