"""Compressed (.skz) shards: header, chunk planning, parallel zstd compression and decompression.

A .skz shard holds the same logical data region as a raw shard (same entry table, same offsets),
cut into fixed-size chunks; each chunk is byte-shuffled piece by piece (each entry's part of the
chunk by the entry's item size) and stored as one independent zstd frame with its content size
and checksum, or stored raw when compressing does not shrink it. The file layout (header,
frame table, its checksum, the frames) is docs/FORMAT.md section 6.

The frame count is known before compressing, so the table has a fixed size: the writer streams
the frames as they come out of the compressor threads and writes the table last (``pwrite`` at
its reserved place). Item sizes are powers of two up to 8 and entries start aligned to their item
size, so a chunk boundary (a multiple of 8) always splits an entry between whole items.

The modules, each importing only those before it: `container` (the layout: constants, header,
chunk plan), `codec` (zstd options, compressors, buffers, byte planes, `run_tasks`), `writer`
(`write_zstd_shard`), `reader` (`SkzShard`). The names other modules use are importable from
this package.
"""

from __future__ import annotations

from .codec import (
    DEFAULT_LEVEL,
    ZstdOptions,
    frames_decompressed,
    parse_chunk_size,
    resolve_compression,
    run_tasks,
)
from .container import (
    DEFAULT_CHUNK_SIZE,
    FRAME_DTYPE,
    KIND_RAW,
    KIND_ZSTD,
    MAGIC,
    MAX_CHUNK_SIZE,
    PREAMBLE,
    ChunkPlan,
    SkzHeader,
    check_header_room,
    check_skz_preamble,
    decode_skz_header,
    encode_skz_header,
    frame_count,
    plan_chunks,
    read_skz_header,
)
from .reader import SkzShard, open_zstd_shard
from .writer import SkzWriteStats, write_zstd_shard

__all__ = [
    "DEFAULT_CHUNK_SIZE", "DEFAULT_LEVEL", "FRAME_DTYPE", "KIND_RAW", "KIND_ZSTD", "MAGIC",
    "MAX_CHUNK_SIZE", "PREAMBLE", "ChunkPlan", "SkzHeader", "SkzShard", "SkzWriteStats",
    "ZstdOptions", "check_header_room", "check_skz_preamble", "decode_skz_header",
    "encode_skz_header", "frame_count", "frames_decompressed", "open_zstd_shard",
    "parse_chunk_size", "plan_chunks", "read_skz_header", "resolve_compression", "run_tasks",
    "write_zstd_shard",
]
