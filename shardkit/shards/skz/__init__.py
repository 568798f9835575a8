"""Compressed (.skz) shards: header, chunk planning, parallel zstd compression and decompression.

A .skz shard holds the same logical data region as a raw shard, cut into fixed-size chunks, each
byte-shuffled piece by piece and stored as one independent zstd frame (or raw, when compressing
does not shrink it); the layout is docs/FORMAT.md section 6. The modules, each importing only
those before it: `container`, `codec`, `writer`, `verify`, `reader`; the names other modules use
are importable from this package.
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
