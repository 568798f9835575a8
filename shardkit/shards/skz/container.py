"""The .skz container (docs/FORMAT.md): its constants, the header (preamble, entry table,
frame table, checksum) encoded, decoded and checked, and the chunk plan both writer and reader
follow (docs/FORMAT.md section 6)."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import xxhash

from ...errors import (
    ChecksumError,
    CorruptHeaderError,
    TruncatedShardError,
)
from ...format import (
    HEAD_GUESS,
    HEADER_ALIGNMENT,
    EntryLayout,
    decode_safetensors_header,
    encode_safetensors_header,
    header_length,
)
from ...format import data_size as region_size
from ...values.dtypes import itemsize as dtype_itemsize

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
    _, chunk, size, n, flags = check_skz_preamble(buf, path)
    n_len = header_length(buf[PREAMBLE.size :], file_size - PREAMBLE.size, path)
    table_at = PREAMBLE.size + 8 + n_len
    end = table_at + n * FRAME_DTYPE.itemsize
    check_header_room(n, end + 8, file_size, path)
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


def check_skz_preamble(buf: Any, path: str) -> tuple[bytes, int, int, int, int]:
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


def check_header_room(n: int, header_end: int, file_size: int, path: str) -> None:
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


def read_skz_header(file: Any, file_size: int, path: str) -> SkzHeader:
    """Read and decode the header of an open .skz shard: preamble, entry table, frame table.

    `file` is the shard's byte source (`shardkit.shards.files.ByteSource`: a local file or a store's
    object): ``file.read(start, end)``. The first read takes HEAD_GUESS bytes more than the
    preamble, so most headers come in one read (one request from a store).
    """
    first_len = PREAMBLE.size + 8
    head = file.read(0, min(file_size, first_len + HEAD_GUESS))
    if len(head) < first_len:
        raise TruncatedShardError(f"{path}: file is {file_size} bytes, shorter than the "
                                  f"{first_len}-byte .skz preamble")
    _, _, _, n, _ = check_skz_preamble(head[:first_len], path)  # before anything is allocated
    n_len = header_length(head[PREAMBLE.size : first_len], file_size - PREAMBLE.size, path)
    want = first_len + n_len + n * FRAME_DTYPE.itemsize + 8
    check_header_room(n, want, file_size, path)
    if want > len(head):
        head += file.read(len(head), want)
    if len(head) < want:
        raise TruncatedShardError(f"{path}: header cut short at byte {len(head)} of {want}")
    return decode_skz_header(bytearray(head[:want]), file_size, path)


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
