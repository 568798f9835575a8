"""Reading a .skz shard (`SkzShard`): entries read, chunks decoded in parallel, cached or
streamed, and frames and entries verified."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Executor
from functools import partial
from typing import Any, Final

import numpy as np
import xxhash

from ..._kernels import _shuffle
from ...errors import CheckpointFormatError, ChecksumError, CorruptHeaderError, TruncatedShardError
from ...format import EntryLayout, ShardInfo, check_generation
from ...values.dtypes import itemsize as dtype_itemsize
from ..files import ByteSource, open_shard_file
from . import verify
from .codec import (
    KEEP_DECODE_BUFFER,
    STREAM_BLOCK,
    _byte_memory,
    _chunk_buffer,
    _count_frame,
    _decompressor,
    _Planes,
    _writable_bytes,
    run_tasks,
    zstandard,
)
from .container import KIND_RAW, KIND_ZSTD, plan_chunks, read_skz_header

CACHE_CHUNKS: Final = 4  # decompressed chunks kept for read_into calls that share a chunk


class SkzShard:
    """An open .skz shard: decompresses the chunks a read needs, in parallel when asked.

    Has the members of the reader's ``shards.raw.ShardSource``: `entries`, `read_into`,
    `read_tasks` (a task per chunk), `view` and `whole_arrays` (always None: the bytes are
    compressed), `verify_entries` (`shards.skz.verify`), `matches_index` (False), `packed` (True),
    `close`.
    `read_many` decodes every chunk of a set of ranges once and scatters it to all of them;
    `verify_frames` checks every frame. A frame whose bytes do not match its checksum raises
    ChecksumError naming the shard file, the frame and the entries stored in it.
    """

    def __init__(self, path: str, info: ShardInfo | None = None, *, mmap: bool = True,
                 file: ByteSource | None = None, follow_symlinks: bool = False) -> None:
        """`file`: the shard's byte source (`shardkit.shards.files.ByteSource`), already opened
        through the checkpoint's storage: a local file (else `path` is opened, see
        `shardkit.shards.files`) or a store's object. A mapped shard (`mmap`, on a source that maps)
        is mapped copy-on-write and keeps no descriptor."""
        self.path = path
        self.info = info
        self._map: Any = None
        self._file: Any = file if file is not None else open_shard_file(path, follow_symlinks)
        try:
            size = self._file.size
            if info is not None and size != info.bytes:
                cls = TruncatedShardError if size < info.bytes else CheckpointFormatError
                raise cls(f"{path}: shard file has {size} bytes, the index records {info.bytes}")
            self.header = read_skz_header(self._file, size, path)
            self._frames: list[tuple[int, ...]] = self.header.frames.tolist()  # rows as ints
            self.entries = self.header.entries
            self.metadata = self.header.metadata
            if info is not None:
                check_generation(self.metadata, info.generation, path)
            try:
                self.plan = plan_chunks(list(self.entries.values()), self.header.chunk_size,
                                        self.header.shuffle, path)
            except ValueError as e:  # entries not aligned to their item size (3.3)
                raise CorruptHeaderError(str(e)) from None
            self._names = list(self.entries)
            if mmap:
                self._map = self._file.take_map()
        except BaseException:
            self._file.close()
            raise
        self._closed = False
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, Any] = OrderedDict()

    # -- ShardSource

    matches_index = False
    begins = None
    packed = True  # F4 entries hold two elements a byte, as in a raw shard

    def view(self, entry: EntryLayout, begin: int, end: int) -> memoryview | None:
        return None

    def whole_arrays(self, *args: Any) -> None:
        return None

    def read_into(self, entry: EntryLayout, begin: int, end: int, dest: Any) -> None:
        """Bytes ``[begin, end)`` of `entry` into `dest`; both ends must be whole items."""
        run_tasks(self.read_tasks([(entry, begin, end, dest)]), None)

    def read_many(self, requests: Sequence[tuple[EntryLayout, int, int, Any]],
                  pool: Executor | None = None) -> None:
        """Several `read_into` at once: each chunk is decoded once, chunks on `pool` threads."""
        run_tasks(self.read_tasks(requests), pool)

    def read_tasks(self, requests: Sequence[tuple[EntryLayout, int, int, Any]]
                   ) -> list[Callable[[], None]]:
        """The work of `read_many` as independent tasks, one per chunk, to run on any threads
        (a reader reading from several shards runs all their tasks on one pool)."""
        spans: list[tuple[int, int, Any, str]] = []
        for entry, begin, end, dest in requests:
            self._check_range(entry, begin, end)
            out = _writable_bytes(dest, end - begin)
            if end > begin:
                spans.append((entry.begin + begin, entry.begin + end, out, entry.name))
        if not spans:
            return []
        spans.sort(key=lambda s: s[0])
        if any(spans[k + 1][0] < spans[k][1] for k in range(len(spans) - 1)):
            # overlapping requests (rare): each on its own, through the chunk cache
            return [t for r in requests for t in self.read_tasks([r])]
        tasks: list[Callable[[], None]] = []
        if self.header.chunk_size > KEEP_DECODE_BUFFER:
            spans, tasks = self._streamed_spans(spans)
            if not spans:
                return tasks
        jobs = self._scatter_jobs(spans)
        if len(jobs) == 1 and not tasks:  # a small read: share the chunk with the next reads
            i, args, name = jobs[0]
            return [partial(self._cached_scatter, i, args, name)]
        # no caching: each chunk is decoded into its thread's buffer and scattered at once
        return tasks + [partial(self._decode_scatter, i, args, name) for i, args, name in jobs]

    def _streamed_spans(self, spans: list[tuple[int, int, Any, str]]
                        ) -> tuple[list[tuple[int, int, Any, str]], list[Callable[[], None]]]:
        """Of `spans` (sorted, in a shard of chunks too large to keep a decode buffer for), the
        parts that take less than half of a chunk become streaming tasks (bounded memory, no
        whole-chunk buffer); the rest is returned, to be decoded chunk by chunk."""
        c = self.header.chunk_size
        keep: list[tuple[int, int, Any, str]] = []
        tasks: list[Callable[[], None]] = []
        for a, b, dest, name in spans:
            pos = a
            while pos < b:
                i = pos // c
                nxt = min(b, (i + 1) * c)
                if 2 * (nxt - pos) < c:
                    tasks.append(partial(self._stream_copy, i, pos, nxt,
                                         _byte_memory(dest)[pos - a : nxt - a], name))
                else:
                    keep.append((pos, nxt, _byte_memory(dest)[pos - a : nxt - a], name))
                pos = nxt
        return keep, tasks

    def _stream_copy(self, i: int, a: int, b: int, dest: memoryview, reading: str) -> None:
        at = 0
        for _, block in self._stream_range(i, a, b, reading):
            n = len(block)
            dest[at : at + n] = block
            at += n

    def _cached_scatter(self, i: int, args: tuple[Any, ...], reading: str) -> None:
        _shuffle.unshuffle_scatter(self._chunk(i, reading), *args)

    def _decode_scatter(self, i: int, args: tuple[Any, ...], reading: str) -> None:
        _shuffle.unshuffle_scatter(self._decode(i, reading, into=_chunk_buffer(self.header)),
                                   *args)

    def verify_frames(self, pool: Executor | None = None) -> int:
        """Check every frame's checksum and decode it (zstd checks its content checksum); the
        first corrupt frame raises ChecksumError."""
        _, bad = self.verify_entries((), pool, every_frame=True)
        if bad:
            raise bad[0][1]
        return self.plan.n_chunks

    def verify_entries(self, names: Collection[str] | None, pool: Executor | None = None,
                       every_frame: bool = False
                       ) -> tuple[dict[str, str], list[tuple[int, ChecksumError]]]:
        """The shard source's verify (`shards.raw.ShardSource.verify_entries`): one ordered pass
        over the chunks, see `shards.skz.verify.verify_entries`."""
        return verify.verify_entries(self, names, pool, every_frame)

    def _stream_range(self, i: int, lo: int, hi: int, reading: str | None = None,
                      check: bool = False) -> Iterator[tuple[int, Any]]:
        """The logical bytes ``[lo, hi)`` of the data region, all inside chunk i, as
        (piece number, block) in order, decoded by streaming: a few blocks and zstd's window
        per byte plane are in memory, never the chunk. Each block is valid until the next.

        The frame is decoded to its end before the last block is handed out, so zstd checks
        its content size and checksum; `check` also compares the frame's xxh3 (a raw frame's
        always). A shuffled piece of items of size s is read with s decoders in step, one
        per byte plane.
        """
        data, raw, kind = self._frame(i, reading, check)
        planes = _Planes(data, kind, raw, partial(self._corrupt, i, reading))
        plan, c0 = self.plan, i * self.plan.chunk_size
        held: tuple[int, Any] | None = None  # the last block waits for the end-of-frame check
        plane_buf = out_buf = np.empty(0, np.uint8)  # allocated on the first block
        for p in range(int(plan.ptr[i]), int(plan.ptr[i + 1])):
            start, length, s = (int(plan.data_offset[p]), int(plan.length[p]),
                                int(plan.itemsize[p]))
            a, b = max(lo, start), min(hi, start + length)
            if a >= b:
                continue
            n, local = length // s, start - c0
            step = max(1, STREAM_BLOCK // s)
            for k in range((a - start) // s, (b - start) // s, step):
                m = min(step, (b - start) // s - k)
                if not len(plane_buf):
                    plane_buf = np.empty(STREAM_BLOCK + 8, np.uint8)
                    out_buf = np.empty(STREAM_BLOCK + 8, np.uint8)
                if held is not None:
                    yield held
                    held = None
                if s == 1:
                    planes.read_into(0, local + k, plane_buf[:m])
                    held = (p, plane_buf[:m])
                    plane_buf, out_buf = out_buf, plane_buf  # the held block stays intact
                    continue
                for plane in range(s):
                    planes.read_into(plane, local + plane * n + k,
                                     plane_buf[plane * m : (plane + 1) * m])
                one = np.ones(1, np.int64)
                zero = np.zeros(1, np.int64)
                _shuffle.unshuffle_scatter(plane_buf, zero, one * m, one * s, zero, one * m,
                                           [out_buf], zero, zero)
                held = (p, out_buf[: m * s])
                plane_buf, out_buf = out_buf, plane_buf
        planes.finish()
        if held is not None:
            yield held

    def close(self) -> None:
        with self._lock:
            self._cache.clear()
        self._map = None  # unmapped when the last chunk view of it goes
        self._closed = True
        self._file.close()

    def __enter__(self) -> SkzShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals

    def _check_range(self, entry: EntryLayout, begin: int, end: int) -> None:
        size = dtype_itemsize(entry.dtype_name) if self.header.shuffle else 1
        if not 0 <= begin <= end <= entry.nbytes or begin % size or end % size:
            raise ValueError(f"{self.path}: cannot read bytes [{begin}, {end}) of entry "
                             f"{entry.name!r} ({entry.nbytes} bytes of {size}-byte items)")

    def _what(self, i: int) -> str:
        lo, hi = int(self.plan.ptr[i]), int(self.plan.ptr[i + 1])
        nums = sorted({int(e) for e in self.plan.entry[lo:hi]})
        names = [repr(self._names[int(self.plan.order[e])]) for e in nums[:3]]
        more = f" and {len(nums) - 3} more" if len(nums) > 3 else ""
        return f"entr{'y' if len(nums) == 1 else 'ies'} {', '.join(names)}{more}"

    def _stored(self, offset: int, n: int) -> Any:
        if self._map is not None:
            return memoryview(self._map)[offset : offset + n]
        if self._closed:
            raise CheckpointFormatError(f"{self.path}: shard is closed")
        data = self._file.read(offset, offset + n)
        if len(data) != n:
            raise TruncatedShardError(f"{self.path}: frame at byte {offset} cut short")
        return data

    def _decode(self, i: int, reading: str | None = None, check_hash: bool = False,
                into: np.ndarray | None = None) -> Any:
        """Chunk i's (shuffled) bytes. A raw frame is checked against its xxh3 in the frame
        table; a zstd frame by zstd's own content size and checksum (and the table's xxh3 too
        when `check_hash`: it costs a few percent of a fast level's decompression time).
        A zstd frame is decoded into `into` when given (and large enough)."""
        data, raw, kind = self._frame(i, reading, check_hash)
        if kind == KIND_RAW:
            _count_frame()
            return data
        try:
            if into is not None and len(into) >= raw:
                # straight into the caller's buffer (GIL released, no fresh output memory)
                out: Any = into[:raw]
                got = _decompressor().stream_reader(data).readinto(out)
                if got != raw:
                    raise self._corrupt(i, reading, f"decoded {got} bytes, expected {raw}",
                                        f"{raw} bytes", f"{got} decoded")
            else:
                out = _decompressor().decompress(data, max_output_size=raw)
        except zstandard.ZstdError as e:
            raise self._corrupt(i, reading, f"zstd cannot decode it ({e})",
                                    "a valid zstd frame", f"zstd error: {e}") from None
        if len(out) != raw:
            raise self._corrupt(i, reading, f"decoded {len(out)} bytes, expected {raw}",
                                f"{raw} bytes", f"{len(out)} decoded")
        _count_frame()
        return out

    def _frame(self, i: int, reading: str | None, check: bool) -> tuple[Any, int, int]:
        """Frame i's stored bytes, its decoded size and kind, checked: against its xxh3 in the
        frame table when `check` (a raw frame's always), a zstd frame's declared size."""
        offset, stored, raw, kind, _, xxh3 = self._frames[i]
        data = self._stored(offset, stored)
        if (check or kind == KIND_RAW) and (found := xxhash.xxh3_64_intdigest(data)) != xxh3:
            raise self._corrupt(i, reading, f"its {stored} stored bytes hash to {found:016x}, "
                                f"the header records {xxh3:016x}",
                                f"xxh3 {xxh3:016x} (frame table)", f"{found:016x}")
        if kind == KIND_ZSTD:
            try:
                size = zstandard.frame_content_size(data)
            except zstandard.ZstdError as e:
                raise self._corrupt(i, reading, f"zstd cannot decode it ({e})",
                                    "a valid zstd frame", f"zstd error: {e}") from None
            if size != raw:
                raise self._corrupt(i, reading, f"zstd frame declares {size} bytes, "
                                    f"expected {raw}", f"{raw} bytes", f"{size} declared")
        return data, raw, kind

    def _corrupt(self, i: int, reading: str | None, why: str, expected: str, found: str
                 ) -> ChecksumError:
        """The error for a corrupt frame i; `expected` / `found` (also attributes of the
        error, with `frame`: what verify reports) say what differs."""
        c0, c1 = self.plan.chunk_range(i)
        frame = f"frame {i} (data bytes [{c0}, {c1}) holding {self._what(i)})"
        what = f"; reading entry {reading!r}" if reading is not None else ""
        e = ChecksumError(f"{self.path}: frame {i} (data bytes [{c0}, {c1}) holding "
                          f"{self._what(i)}{what}) is corrupt: {why}")
        e.frame, e.expected, e.found = frame, expected, found  # type: ignore[attr-defined]
        return e

    def _chunk(self, i: int, reading: str) -> Any:
        """`_decode` through a small cache shared by threads (one decode per chunk at a time)."""
        while True:
            with self._lock:
                hit = self._cache.get(i)
                if hit is None:
                    event = self._cache[i] = threading.Event()
                    break
                if not isinstance(hit, threading.Event):
                    self._cache.move_to_end(i)
                    return hit
            hit.wait()  # another thread is decoding it; retry (it may have failed)
        try:
            data = self._decode(i, reading)
        except BaseException:
            with self._lock:
                del self._cache[i]
            event.set()
            raise
        with self._lock:
            if len(data) > KEEP_DECODE_BUFFER:  # served, not kept: memory stays a few chunks
                del self._cache[i]
                event.set()
                return data
            self._cache[i] = data
            done = [k for k, v in self._cache.items() if not isinstance(v, threading.Event)]
            for k in done[: max(0, len(done) - CACHE_CHUNKS)]:
                del self._cache[k]
        event.set()
        return data

    def _scatter_jobs(self, spans: Sequence[tuple[int, int, Any, str]]
                      ) -> list[tuple[int, tuple[Any, ...], str]]:
        """Per chunk the spans touch: (chunk, `unshuffle_scatter` arguments after the chunk's
        bytes, name of the first entry read from it), for spans (data begin, end, dest, entry
        name) sorted by begin, not empty, not overlapping.

        Vectorised over the whole read: the pieces of the chunks covered and the spans cut the
        data region into intervals, each inside one piece and at most one span.
        """
        plan, c = self.plan, self.plan.chunk_size
        s_begin = np.fromiter((s[0] for s in spans), np.int64, len(spans))
        s_end = np.fromiter((s[1] for s in spans), np.int64, len(spans))
        p_lo = int(plan.ptr[int(s_begin[0]) // c])
        p_hi = int(plan.ptr[(int(s_end.max()) - 1) // c + 1])
        p_start = plan.data_offset[p_lo:p_hi]
        stop = p_start[-1] + plan.length[p_hi - 1]
        cuts = np.unique(np.concatenate((p_start, s_begin, s_end, [stop])))
        x, y = cuts[:-1], cuts[1:]
        span = np.searchsorted(s_begin, x, "right") - 1
        keep = (span >= 0) & (x < s_end[np.maximum(span, 0)])
        x, y, span = x[keep], y[keep], span[keep]
        piece = np.searchsorted(p_start, x, "right") - 1 + p_lo
        size = plan.itemsize[piece]
        start = plan.data_offset[piece]
        chunk = x // c
        first = np.flatnonzero(np.diff(chunk, prepend=-1))  # each chunk's first interval
        bounds = np.append(first, len(x))
        span_lo = span[first]
        local = span - np.repeat(span_lo, np.diff(bounds))  # dests: the chunk's spans only
        src_offset, n_items = start - chunk * c, plan.length[piece] // size
        item_begin, item_count, dst_offset = (x - start) // size, (y - x) // size, x - s_begin[span]
        dests = [s[2] for s in spans]
        jobs = []
        for k in range(len(first)):
            a, b = int(bounds[k]), int(bounds[k + 1])
            lo = int(span_lo[k])
            jobs.append((int(chunk[a]), (src_offset[a:b], n_items[a:b], size[a:b],
                                         item_begin[a:b], item_count[a:b],
                                         dests[lo : int(span[b - 1]) + 1], local[a:b],
                                         dst_offset[a:b]), spans[lo][3]))
        return jobs


def open_zstd_shard(path: str, info: ShardInfo, *, mmap: bool = True,
                    file: ByteSource | None = None) -> SkzShard:
    """The reader's opener for codec ``"zstd"``."""
    return SkzShard(path, info, mmap=mmap, file=file)
