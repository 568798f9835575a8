"""The zstd codec of .skz shards: save()'s compression options, per-thread compressors and
decompressors, the reused chunk buffers and the compression pool, byte planes of shuffled pieces
(`_Planes`), and `run_tasks`."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Executor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from ..._threads import WorkerPool
from ...errors import (
    InvalidArgumentError,
    InvalidArgumentTypeError,
    PolicyError,
)
from ...optional import lazy_import
from ...sharding.policies import parse_size
from .container import DEFAULT_CHUNK_SIZE, KIND_RAW, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, SkzHeader

if TYPE_CHECKING:
    import zstandard
else:
    zstandard = lazy_import("zstandard", "zstd (.skz) shards")
# Measured by bench/bench_compression.py on trained weights (levels 1..9): level 1 gives both
# the best ratio (bf16 1.450 vs at most 1.427 for levels 2..9; f32 1.201 vs at most 1.195) and
# the fastest compression, so it is the default.
DEFAULT_LEVEL: Final = 1
ZSTD_LEVELS: Final = range(-7, 23)
INFLIGHT_PER_THREAD: Final = 2  # chunks being gathered/compressed/written per thread
KEEP_BUFFERS: Final = 8  # chunk buffers kept between saves (first touch of memory is slow)
KEEP_DECODE_BUFFER: Final = 16 * 1024 * 1024  # largest chunk a thread keeps a buffer for
# Chunks above KEEP_DECODE_BUFFER are never decoded whole to serve a small read or a verify:
# they are streamed in blocks of STREAM_BLOCK bytes (per byte plane of a shuffled piece).
STREAM_BLOCK: Final = 1024 * 1024


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
    """The process's pool of `threads` compression threads, kept between saves (not started
    and joined for every shard)."""
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
