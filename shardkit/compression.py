"""Compressed (.skz) shards: header, chunk planning, parallel zstd compression and decompression.

A .skz shard holds the same logical data region as a raw shard (same entry table, same offsets),
cut into fixed-size chunks; each chunk is byte-shuffled piece by piece (each entry's part of the
chunk by the entry's item size) and stored as one independent zstd frame with its content size
and checksum, or stored raw when compressing does not shrink it. File layout (little-endian)::

    0        8        magic b"SKZSHRD1"
    8        8        u64 chunk size C (a multiple of 8)
    16       8        u64 data size D (bytes of the logical data region)
    24       8        u64 frame count F = ceil(D / C)
    32       8        u64 flags; bit 0: chunks are shuffled
    40       8 + N    a safetensors header (u64 N, JSON entry table padded so 48 + N % 8 == 0)
    T=48+N   32 * F   frame table, per frame: u64 file offset, u32 stored size, u32 raw size,
                      u32 kind (0 raw, 1 zstd), u32 reserved (0), u64 xxh3-64 of the stored bytes
    T+32F    8        u64 xxh3-64 of bytes [0, T + 32F)
    T+32F+8  ...      the frames back to back, in chunk order; the file ends with the last one

The frame count is known before compressing, so the table has a fixed size: the writer streams
the frames as they come out of the compressor threads and writes the table last (``pwrite`` at
its reserved place). Item sizes are powers of two up to 8 and entries start aligned to their item
size, so a chunk boundary (a multiple of 8) always splits an entry between whole items.
"""

from __future__ import annotations

import os
import struct
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Executor, Future, wait
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import xxhash

from ._kernels import _shuffle
from ._threads import WorkerPool
from .dtypes import itemsize as dtype_itemsize
from .errors import (
    CheckpointFormatError,
    ChecksumError,
    CorruptHeaderError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    PolicyError,
    ShardIOError,
    TruncatedShardError,
)
from .files import CheckpointFile, open_shard_file
from .format import (
    HEADER_ALIGNMENT,
    EntryLayout,
    ShardInfo,
    check_generation,
    decode_safetensors_header,
    encode_safetensors_header,
    header_length,
)
from .format import data_size as region_size
from .optional import lazy_import
from .policies import parse_size

if TYPE_CHECKING:
    import zstandard
else:
    zstandard = lazy_import("zstandard", "zstd (.skz) shards")

MAGIC: Final = b"SKZSHRD1"
FLAG_SHUFFLE: Final = 1
KIND_RAW: Final = 0
KIND_ZSTD: Final = 1
PREAMBLE: Final = struct.Struct("<8sQQQQ")  # magic, chunk size, data size, frames, flags
FRAME_DTYPE: Final = np.dtype(
    [("offset", "<u8"), ("stored", "<u4"), ("raw", "<u4"), ("kind", "<u4"),
     ("reserved", "<u4"), ("xxh3", "<u8")]
)
_U64: Final = struct.Struct("<Q")

DEFAULT_CHUNK_SIZE: Final = 4 * 1024 * 1024
MIN_CHUNK_SIZE: Final = 64
MAX_CHUNK_SIZE: Final = 64 * 1024 * 1024  # writers and readers alike: a chunk is decoded at once
# Measured by bench/bench_compression.py on trained weights (levels 1..9): level 1 gives both
# the best ratio (bf16 1.450 vs at most 1.427 for levels 2..9; f32 1.201 vs at most 1.195) and
# the fastest compression, so it is the default.
DEFAULT_LEVEL: Final = 1
ZSTD_LEVELS: Final = range(-7, 23)
INFLIGHT_PER_THREAD: Final = 2  # chunks being gathered/compressed/written per thread
KEEP_BUFFERS: Final = 8  # chunk buffers kept between saves (first touch of memory is slow)
KEEP_DECODE_BUFFER: Final = 16 * 1024 * 1024  # largest chunk a thread keeps a buffer for
CACHE_CHUNKS: Final = 4  # decompressed chunks kept for read_into calls that share a chunk
# Chunks above KEEP_DECODE_BUFFER are never decoded whole to serve a small read or a verify:
# they are streamed in blocks of STREAM_BLOCK bytes (per byte plane of a shuffled piece).
STREAM_BLOCK: Final = 1024 * 1024
VERIFY_WINDOW_PER_THREAD: Final = 2  # decoded chunks waiting to be hashed, per thread


# --- options ------------------------------------------------------------------------------------

def parse_chunk_size(chunk_size: int | str) -> int:
    """Chunk size in bytes from an int or a string such as ``"4MiB"`` / ``"512KiB"``.

    Must be a multiple of 8 in ``MIN_CHUNK_SIZE..MAX_CHUNK_SIZE``.
    """
    if not isinstance(chunk_size, (int, str)) or isinstance(chunk_size, bool):
        raise InvalidArgumentTypeError(f"chunk_size must be an int or a size string like '4MiB', "
                        f"got {chunk_size!r}")
    try:
        size = parse_size(chunk_size, "chunk_size")
    except PolicyError as e:  # the same rules as policy sizes, reported as a bad argument
        raise InvalidArgumentError(str(e)) from None
    if not MIN_CHUNK_SIZE <= size <= MAX_CHUNK_SIZE or size % 8:
        raise InvalidArgumentError(
            f"chunk_size must be a multiple of 8 between {MIN_CHUNK_SIZE} and "
            f"{MAX_CHUNK_SIZE} bytes, got {chunk_size!r} ({size} bytes)")
    return size


@dataclass(frozen=True, slots=True)
class ZstdOptions:
    """Validated compression settings of one save."""

    level: int = DEFAULT_LEVEL
    shuffle: bool = True
    chunk_size: int = DEFAULT_CHUNK_SIZE


def resolve_compression(
    compression: str | None,
    level: int | None = None,
    shuffle: bool = True,
    chunk_size: int | str = "4MiB",
) -> ZstdOptions | None:
    """Check save()'s compression arguments; None means raw (safetensors) shards."""
    if not isinstance(shuffle, bool):
        raise InvalidArgumentTypeError(f"shuffle must be True or False, got {shuffle!r}")
    if compression is None:
        if level is not None:
            raise InvalidArgumentError(
                f"level={level!r} needs compression='zstd'; raw shards have no level")
        return None
    if compression != "zstd":
        raise InvalidArgumentError(f"compression must be None or 'zstd', got {compression!r}")
    if level is None:
        level = DEFAULT_LEVEL
    elif isinstance(level, bool) or not isinstance(level, int):
        raise InvalidArgumentTypeError(f"level must be an int or None, got {level!r}")
    elif level not in ZSTD_LEVELS or level == 0:
        raise InvalidArgumentError(f"zstd level must be in {ZSTD_LEVELS.start}..-1 or 1.."
                         f"{ZSTD_LEVELS.stop - 1}, got {level}")
    return ZstdOptions(level, shuffle, parse_chunk_size(chunk_size))


# --- header -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SkzHeader:
    """A decoded, validated .skz header."""

    chunk_size: int
    data_size: int
    shuffle: bool
    entries: dict[str, EntryLayout]
    metadata: dict[str, str]
    frames: np.ndarray  # FRAME_DTYPE, one row per chunk
    data_start: int  # file offset of the first frame


def frame_count(data_size: int, chunk_size: int) -> int:
    return -(-data_size // chunk_size)


def encode_skz_header(
    layouts: Sequence[EntryLayout],
    chunk_size: int,
    shuffle: bool,
    frames: np.ndarray | None = None,
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """The header bytes (everything before the first frame); `frames` None = zeroed table."""
    prefix, n = _skz_prefix(layouts, chunk_size, shuffle, metadata)
    return _seal_skz_header(prefix, n, frames)


def _skz_prefix(layouts: Sequence[EntryLayout], chunk_size: int, shuffle: bool,
                metadata: Mapping[str, str] | None) -> tuple[bytes, int]:
    """Preamble + entry table: the part of the header that does not depend on the frames."""
    data_size = region_size(layouts)
    n = frame_count(data_size, chunk_size)
    meta = {"codec": "zstd", **(metadata or {})}
    return (PREAMBLE.pack(MAGIC, chunk_size, data_size, n, FLAG_SHUFFLE if shuffle else 0)
            + encode_safetensors_header(layouts, meta)), n


def _seal_skz_header(prefix: bytes, n: int, frames: np.ndarray | None) -> bytes:
    """`prefix` + the frame table + the header checksum."""
    table = np.zeros(n, FRAME_DTYPE) if frames is None else np.asarray(frames, FRAME_DTYPE)
    if len(table) != n:
        raise ValueError(f"{len(table)} frames given for {n} chunks")
    head = prefix + table.tobytes()
    return head + _U64.pack(xxhash.xxh3_64_intdigest(head))


def decode_skz_header(buf: bytes | bytearray | memoryview, file_size: int,
                      path: str) -> SkzHeader:
    """Parse and validate a .skz header from the first bytes of the file (all of the header).

    Checks the magic, sizes, the header checksum, the entry table (entries tile the data region),
    and that the frames are back to back from the end of the header to the end of the file, each
    holding one chunk (raw sizes C, C, ..., the rest), with a known kind.
    """
    buf = memoryview(buf)
    if file_size < PREAMBLE.size or len(buf) < PREAMBLE.size:
        raise TruncatedShardError(f"{path}: file is {file_size} bytes, shorter than the "
                                  f"{PREAMBLE.size}-byte .skz preamble")
    _, chunk, size, n, flags = _check_preamble(buf, path)
    n_len = header_length(buf[PREAMBLE.size :], file_size - PREAMBLE.size, path)
    table_at = PREAMBLE.size + 8 + n_len
    end = table_at + n * FRAME_DTYPE.itemsize
    _check_room(n, end + 8, file_size, path)
    if len(buf) < end + 8:
        raise TruncatedShardError(f"{path}: got {len(buf)} header bytes, need {end + 8}")
    (recorded,) = _U64.unpack_from(buf, end)
    found = xxhash.xxh3_64_intdigest(buf[:end])
    if found != recorded:
        raise ChecksumError(f"{path}: .skz header checksum mismatch (header records "
                            f"{recorded:016x}, its bytes hash to {found:016x}): corrupt header")
    entries, metadata, _ = decode_safetensors_header(
        buf[PREAMBLE.size : table_at], 8 + n_len + size, path
    )
    if (table_at - PREAMBLE.size) % HEADER_ALIGNMENT:
        raise CorruptHeaderError(f"{path}: entry table is not padded to a multiple of 8")
    frames = np.frombuffer(buf[table_at:end], FRAME_DTYPE).copy()
    data_start = end + 8
    _check_frames(frames, chunk, size, data_start, file_size, path)
    return SkzHeader(chunk, size, bool(flags & FLAG_SHUFFLE), entries, metadata, frames,
                     data_start)


def _check_preamble(buf: Any, path: str) -> tuple[bytes, int, int, int, int]:
    """The preamble's fields, checked: magic, chunk size (MAX_CHUNK_SIZE), frame count against
    the data size, flags. Needs only its 40 bytes, so nothing claimed is allocated first."""
    magic, chunk, size, n, flags = PREAMBLE.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptHeaderError(f"{path}: not a .skz shard: magic is {bytes(magic)!r}, "
                                 f"expected {MAGIC!r}")
    if not MIN_CHUNK_SIZE <= chunk <= MAX_CHUNK_SIZE or chunk % 8:
        raise CorruptHeaderError(f"{path}: chunk size {chunk} is not a multiple of 8 in "
                                 f"{MIN_CHUNK_SIZE}..{MAX_CHUNK_SIZE} (the limit is "
                                 f"{MAX_CHUNK_SIZE >> 20} MiB)")
    if n != frame_count(size, chunk):
        raise CorruptHeaderError(f"{path}: {n} frames recorded, but a data region of {size} bytes "
                                 f"in chunks of {chunk} needs {frame_count(size, chunk)}")
    if flags & ~FLAG_SHUFFLE:
        raise CorruptHeaderError(f"{path}: unknown flag bits {flags:#x} in the .skz preamble")
    return magic, chunk, size, n, flags


def _check_room(n: int, header_end: int, file_size: int, path: str) -> None:
    """A header ending at `header_end` with `n` frames fits the file: every frame stores at
    least one byte after it (raw frames hold their chunk, zstd frames more than 0 bytes)."""
    if header_end + n > file_size:
        raise TruncatedShardError(
            f"{path}: header with {n} frames needs at least {header_end + n} bytes (preamble, "
            f"entry table, frame table, checksum and one byte per frame), file has {file_size}")


def _check_frames(frames: np.ndarray, chunk: int, size: int, data_start: int, file_size: int,
                  path: str) -> None:
    n = len(frames)
    raw = frames["raw"].astype(np.int64)
    stored = frames["stored"].astype(np.int64)
    offset = frames["offset"].astype(np.int64)  # u64 above 2**63 wraps negative: caught below
    expected_raw = np.full(n, chunk, np.int64)
    if n:
        expected_raw[-1] = size - (n - 1) * chunk
    bad = np.flatnonzero(raw != expected_raw)
    if bad.size:
        i = int(bad[0])
        raise CorruptHeaderError(f"{path}: frame {i} records {raw[i]} raw bytes, expected "
                                 f"{expected_raw[i]} (frames' raw sizes must add up to the "
                                 f"{size}-byte data region)")
    bad = np.flatnonzero((frames["kind"] > KIND_ZSTD) | (frames["reserved"] != 0))
    if bad.size:
        i = int(bad[0])
        raise CorruptHeaderError(f"{path}: frame {i} has unknown kind {frames['kind'][i]} "
                                 f"(reserved {frames['reserved'][i]}); expected 0 raw or 1 zstd")
    kind = frames["kind"]
    bad = np.flatnonzero(((kind == KIND_RAW) & (stored != raw))
                         | ((kind == KIND_ZSTD) & ((stored == 0) | (stored >= raw))))
    if bad.size:
        i = int(bad[0])
        raise CorruptHeaderError(f"{path}: frame {i} stores {stored[i]} bytes for {raw[i]} raw "
                                 f"bytes, impossible for a {'zstd' if kind[i] else 'raw'} frame")
    expected_off = data_start + np.concatenate(([0], np.cumsum(stored)[:-1])) if n else offset
    bad = np.flatnonzero(offset != expected_off)
    if bad.size:
        i = int(bad[0])
        raise CorruptHeaderError(f"{path}: frame {i} starts at byte {offset[i]}, expected "
                                 f"{expected_off[i]} (frames are back to back and in order "
                                 "after the header)")
    end = data_start + int(stored.sum())
    if end > file_size:
        raise TruncatedShardError(f"{path}: frames end at byte {end}, past the end of the file "
                                  f"({file_size} bytes)")
    if end < file_size:
        raise CorruptHeaderError(f"{path}: {file_size - end} bytes after the last frame "
                                 f"(frames end at {end}, file has {file_size})")


def read_skz_header(fd: int, file_size: int, path: str) -> SkzHeader:
    """Read and decode the header of an open .skz file: preamble, entry table, frame table."""
    first = os.pread(fd, PREAMBLE.size + 8, 0)
    if len(first) < PREAMBLE.size + 8:
        raise TruncatedShardError(f"{path}: file is {file_size} bytes, shorter than the "
                                  f"{PREAMBLE.size + 8}-byte .skz preamble")
    _, _, _, n, _ = _check_preamble(first, path)  # before anything claimed is allocated
    n_len = header_length(first[PREAMBLE.size :], file_size - PREAMBLE.size, path)
    want = PREAMBLE.size + 8 + n_len + n * FRAME_DTYPE.itemsize + 8
    _check_room(n, want, file_size, path)
    buf = bytearray(want)
    view = memoryview(buf)
    got = 0
    while got < want:
        k = os.preadv(fd, [view[got:]], got)
        if k == 0:
            raise TruncatedShardError(f"{path}: header cut short at byte {got} of {want}")
        got += k
    return decode_skz_header(buf, file_size, path)


# --- chunk planning -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """Pieces of the data region: each lies in one chunk and one entry, whole items only.

    Entries are numbered in data-region order (`order`: their positions in the layouts given).
    Chunk i's pieces are ``ptr[i]:ptr[i + 1]``.
    """

    chunk_size: int
    data_size: int
    order: np.ndarray  # entry number -> position in the input layouts
    ptr: np.ndarray
    entry: np.ndarray  # piece -> entry number
    entry_offset: np.ndarray  # piece start within its entry
    data_offset: np.ndarray  # piece start in the data region
    length: np.ndarray
    itemsize: np.ndarray  # the shuffle's item size (1 when not shuffling)

    @property
    def n_chunks(self) -> int:
        return len(self.ptr) - 1

    def chunk_range(self, i: int) -> tuple[int, int]:
        begin = i * self.chunk_size
        return begin, min(begin + self.chunk_size, self.data_size)


def plan_chunks(layouts: Sequence[EntryLayout], chunk_size: int, shuffle: bool,
                path: str = "<shard>") -> ChunkPlan:
    """Cut the data region of `layouts` (which tile it) into chunk pieces, vectorised."""
    n = len(layouts)
    begins = np.fromiter((e.begin for e in layouts), np.int64, n)
    ends = np.fromiter((e.end for e in layouts), np.int64, n)
    sizes = (np.fromiter((dtype_itemsize(e.dtype_name) for e in layouts), np.int64, n)
             if shuffle else np.ones(n, np.int64))
    order = np.lexsort((ends, begins))
    begins, ends, sizes = begins[order], ends[order], sizes[order]
    data_size = int(ends.max()) if n else 0
    nonempty = np.flatnonzero(ends > begins)
    starts = np.union1d(begins[nonempty], np.arange(0, data_size, chunk_size, dtype=np.int64))
    stops = np.append(starts[1:], np.int64(data_size)) if starts.size else starts
    entry = nonempty[np.searchsorted(begins[nonempty], starts, "right") - 1]
    entry_offset = starts - begins[entry]
    length = stops - starts
    piece_size = sizes[entry]
    if np.any(stops > ends[entry]) or np.any(starts < begins[entry]):
        raise ValueError(f"{path}: entries do not tile the data region [0, {data_size})")
    bad = np.flatnonzero((entry_offset % piece_size) | (length % piece_size))
    if bad.size:
        e = layouts[int(order[entry[bad[0]]])]
        raise ValueError(f"{path}: chunk size {chunk_size} splits entry {e.name!r} "
                         f"({e.dtype_name}, bytes [{e.begin}, {e.end})) inside an item")
    chunk = starts // chunk_size
    ptr = np.searchsorted(chunk, np.arange(frame_count(data_size, chunk_size) + 1), "left")
    return ChunkPlan(chunk_size, data_size, order, ptr.astype(np.int64), entry, entry_offset,
                     starts, length, piece_size)


# --- compression --------------------------------------------------------------------------------

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor (python-zstandard objects must never be shared by threads)."""
    c = getattr(_local, "cctx", None)
    if c is None or _local.level != level:
        c = _local.cctx = zstandard.ZstdCompressor(
            level=level, write_checksum=True, write_content_size=True
        )
        _local.level = level
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def _chunk_buffer(header: SkzHeader) -> np.ndarray | None:
    """This thread's buffer for decoding one chunk before it is scattered (reused: fresh memory
    costs a page fault per page), or None for chunks too large to keep a buffer for."""
    if header.chunk_size > KEEP_DECODE_BUFFER:
        return None
    buf: np.ndarray | None = getattr(_local, "chunk", None)
    if buf is None or len(buf) < header.chunk_size:
        buf = _local.chunk = np.empty(header.chunk_size, np.uint8)
    return buf


class _BufferPool:
    """Chunk buffers reused across saves: fresh memory costs a page fault per page on first use,
    which at 4 MiB per chunk is a large share of a fast compression level's time."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        with self._lock:
            for k in range(len(self._free) - 1, -1, -1):
                if len(self._free[k]) == size:
                    return self._free.pop(k)
        return np.empty(size, np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self._keep:
                del self._free[0]


_buffers = _BufferPool(KEEP_BUFFERS)
_pools: dict[int, WorkerPool] = {}
_pools_lock = threading.Lock()


def _compression_pool(threads: int) -> WorkerPool:
    """The process's pool of `threads` compression threads, kept between saves (starting and
    joining the threads of every shard measured 0.3-0.8 ms, 1-2% of a 45 MB save at level 1)."""
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = WorkerPool(threads, "shardkit-zstd")
        return pool


def _forget_pools() -> None:
    # A forked child has none of the parent's threads: it starts its own pools when it saves.
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


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


# --- decompression ------------------------------------------------------------------------------

_count_lock = threading.Lock()
_frames_decompressed = 0


def frames_decompressed() -> int:
    """How many frames (chunks) this process has decoded from .skz shards so far."""
    return _frames_decompressed


def _count_frame() -> None:
    global _frames_decompressed
    with _count_lock:
        _frames_decompressed += 1


class SkzShard:
    """An open .skz shard: decompresses the chunks a read needs, in parallel when asked.

    Duck-types the reader's ``ShardSource``: `entries`, `read_into`, `view` (always None: the
    bytes are compressed), `read_granularity` (the chunk size), `close`. `read_many` decodes
    every chunk of a set of ranges once and scatters it to all of them; `verify_frames` checks
    every frame. A frame whose bytes do not match its checksum raises ChecksumError naming the
    shard file, the frame and the entries stored in it.
    """

    def __init__(self, path: str, info: ShardInfo | None = None, *, mmap: bool = True,
                 file: CheckpointFile | None = None, follow_symlinks: bool = False) -> None:
        """`file`: the shard already opened through the checkpoint's directory handle (else
        `path` is opened, see `shardkit.files`). A mapped shard is mapped copy-on-write and
        keeps no descriptor."""
        self.path = path
        self.info = info
        self._map: Any = None
        self._file = file if file is not None else open_shard_file(path, follow_symlinks)
        try:
            size = self._file.size
            if info is not None and size != info.bytes:
                cls = TruncatedShardError if size < info.bytes else CheckpointFormatError
                raise cls(f"{path}: shard file has {size} bytes, the index records {info.bytes}")
            with self._file as fd:
                self.header = read_skz_header(fd, size, path)
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
            self._names = [n for n in self.entries]
            if mmap:
                self._map = self._file.take_map()
        except BaseException:
            self._file.close()
            raise
        self.read_granularity = self.header.chunk_size
        self._closed = False
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, Any] = OrderedDict()

    # -- ShardSource

    def view(self, entry: EntryLayout, begin: int, end: int) -> memoryview | None:
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
        _, bad = self.verify_entries(None, pool)
        if bad:
            raise bad[0][1]
        return self.plan.n_chunks

    def verify_entries(self, names: Collection[str] | None, pool: Executor | None = None
                       ) -> tuple[dict[str, str], list[tuple[int, ChecksumError]]]:
        """One pass, in chunk order, over the chunks holding the entries `names` (None: every
        chunk, so every frame is checked even where no entry is read): each frame is checked
        (its xxh3 in the frame table, zstd's content size and checksum) and the logical bytes of
        the entries are hashed incrementally, chunk piece by chunk piece.

        Returns the xxh3-64 hex digest of each entry of `names` (all entries for None) whose
        frames are intact, and the corrupt frames as (frame number, error); an entry with
        bytes in a corrupt frame gets no digest. Memory: a chunk buffer per thread plus
        `VERIFY_WINDOW_PER_THREAD` decoded chunks per thread; chunks larger than
        KEEP_DECODE_BUFFER are streamed in blocks instead, whatever size the header records.
        """
        plan = self.plan
        n_entries = len(plan.order)
        name_of = [self._names[int(k)] for k in plan.order]  # entry number -> name
        if names is None:
            wanted = np.ones(n_entries, bool)
            chunks = list(range(plan.n_chunks))
        else:
            wanted = np.fromiter((n in names for n in name_of), bool, n_entries)
            chunks = np.unique(plan.data_offset[wanted[plan.entry]] // plan.chunk_size).tolist()
        ends = np.fromiter((self.entries[n].end for n in name_of), np.int64, n_entries)
        digests: dict[str, str] = {}
        for e in np.flatnonzero(wanted).tolist():
            if self.entries[name_of[e]].nbytes == 0:
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

        if self.header.chunk_size > KEEP_DECODE_BUFFER:
            for i in chunks:
                c0, c1 = plan.chunk_range(i)
                try:
                    for p, block in self._stream_range(i, c0, c1, check=True):
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
            task = partial(self._logical_chunk, i, out)
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
            for _, _, job in pending:
                if pool is not None:
                    job.cancel()
            if pool is not None:
                wait([job for _, _, job in pending])
        return digests, bad

    def _logical_chunk(self, i: int, out: np.ndarray) -> None:
        """Chunk i's logical (unshuffled) bytes into `out`, its frame checked as in verify."""
        data = self._decode(i, check_hash=True, into=_chunk_buffer(self.header))
        plan = self.plan
        lo, hi = int(plan.ptr[i]), int(plan.ptr[i + 1])
        c0, c1 = plan.chunk_range(i)
        if not self.header.shuffle:
            out[: c1 - c0] = np.frombuffer(data, np.uint8, c1 - c0)
            return
        at = plan.data_offset[lo:hi] - c0
        n = plan.length[lo:hi] // plan.itemsize[lo:hi]
        zeros = np.zeros(hi - lo, np.int64)
        _shuffle.unshuffle_scatter(data, at, n, plan.itemsize[lo:hi], zeros, n, [out],
                                   zeros, at)

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
        with self._file as fd:
            try:
                data = os.pread(fd, n, offset)
            except OSError as e:
                raise ShardIOError(e.errno, f"{self.path}: cannot read {n} bytes at {offset}: "
                                            f"{e.strerror}") from None
        if len(data) != n:
            raise TruncatedShardError(f"{self.path}: frame at byte {offset} cut short")
        return data

    def _decode(self, i: int, reading: str | None = None, check_hash: bool = False,
                into: np.ndarray | None = None) -> Any:
        """Chunk i's (shuffled) bytes. A raw frame is checked against its xxh3 in the frame
        table; a zstd frame by zstd's own content size and checksum (and the table's xxh3 too
        when `check_hash`: it costs a few percent of a fast level's decompression time).
        A zstd frame is decoded into `into` when given (and large enough)."""
        offset, stored, raw, kind, _, xxh3 = self._frames[i]
        data = self._stored(offset, stored)
        if (check_hash or kind == KIND_RAW) and (
                found := xxhash.xxh3_64_intdigest(data)) != xxh3:
            raise self._corrupt(i, reading, f"its {stored} stored bytes hash to {found:016x}, "
                                f"the header records {xxh3:016x}",
                                f"xxh3 {xxh3:016x} (frame table)", f"{found:016x}")
        if kind == KIND_RAW:
            _count_frame()
            return data
        try:
            size = zstandard.frame_content_size(data)
            if size != raw:
                raise self._corrupt(i, reading, f"zstd frame declares {size} bytes, "
                                    f"expected {raw}", f"{raw} bytes", f"{size} declared")
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


class _Planes:
    """Reads of one frame's decoded bytes at increasing offsets, per byte plane: a zstd frame
    gets one streaming decoder per plane (each skips forward by decoding), a raw one is
    sliced."""

    def __init__(self, data: Any, kind: int, raw: int,
                 corrupt: Callable[[str, str, str], Exception]) -> None:
        self.data, self.kind, self.raw, self.corrupt = data, kind, raw, corrupt
        self.readers: dict[int, Any] = {}

    def _reader(self, plane: int) -> Any:
        r = self.readers.get(plane)
        if r is None:
            r = self.readers[plane] = zstandard.ZstdDecompressor().stream_reader(self.data)
        return r

    def read_into(self, plane: int, at: int, out: np.ndarray) -> None:
        n = len(out)
        if self.kind == KIND_RAW:
            out[:] = np.frombuffer(self.data, np.uint8, n, at)
            return
        try:
            r = self._reader(plane)
            if at > r.tell():
                r.seek(at)
            got = 0
            view = out.data
            while got < n:
                k = r.readinto(view[got:])
                if not k:
                    raise self.corrupt(f"the frame ends after {at + got} bytes, expected "
                                       f"{self.raw}", f"{self.raw} bytes", f"{at + got} decoded")
                got += k
        except zstandard.ZstdError as e:
            raise self.corrupt(f"zstd cannot decode it ({e})", "a valid zstd frame",
                               f"zstd error: {e}") from None

    def finish(self) -> None:
        """Decode the rest of the frame (plane 0's decoder): zstd checks the content checksum
        at its end; the size must be exactly the chunk's."""
        if self.kind == KIND_RAW:
            return
        buf = memoryview(bytearray(STREAM_BLOCK))
        try:
            r = self._reader(0)
            pos = r.tell()
            while k := r.readinto(buf):
                pos += k
                if pos > self.raw:
                    break
        except zstandard.ZstdError as e:
            raise self.corrupt(f"zstd cannot decode it ({e})", "a valid zstd frame",
                               f"zstd error: {e}") from None
        finally:
            for r in self.readers.values():
                r.close()
        if pos != self.raw:
            raise self.corrupt(f"decoded {pos} bytes, expected {self.raw}", f"{self.raw} bytes",
                               f"{pos} decoded")


def _byte_memory(dest: Any) -> memoryview:
    if isinstance(dest, np.ndarray):
        return dest.reshape(-1).view(np.uint8).data
    return memoryview(dest).cast("B")


def _writable_bytes(dest: Any, n: int) -> Any:
    if isinstance(dest, np.ndarray):
        flags = dest.flags
        if not flags.c_contiguous or not flags.writeable:
            raise ValueError("destination must be a writable C-contiguous array")
        size = dest.nbytes  # the kernel views any array's bytes untyped
    else:
        size = memoryview(dest).nbytes
    if size < n:
        raise ValueError(f"destination has {size} bytes, {n} are needed")
    return dest


def run_tasks(tasks: Sequence[Callable[[], None]], pool: Executor | None) -> None:
    """Run `tasks` on `pool` (inline when there is no pool or a single task); the first error
    is raised after the tasks not yet started are cancelled."""
    if pool is None or len(tasks) <= 1:
        for task in tasks:
            task()
        return
    futures = [pool.submit(task) for task in tasks]
    try:
        wait(futures, return_when=FIRST_EXCEPTION)  # one wake-up, not one per task
        for f in futures:
            f.result()
    finally:
        for f in futures:
            f.cancel()


def open_zstd_shard(path: str, info: ShardInfo, *, mmap: bool = True,
                    file: CheckpointFile | None = None) -> SkzShard:
    """The reader's opener for codec ``"zstd"``."""
    return SkzShard(path, info, mmap=mmap, file=file)


__all__ = [
    "DEFAULT_CHUNK_SIZE", "DEFAULT_LEVEL", "FRAME_DTYPE", "MAGIC", "ChunkPlan", "SkzHeader",
    "SkzShard", "SkzWriteStats", "ZstdOptions", "decode_skz_header", "encode_skz_header",
    "frame_count", "frames_decompressed", "open_zstd_shard", "parse_chunk_size", "plan_chunks",
    "read_skz_header", "resolve_compression", "write_zstd_shard",
]
