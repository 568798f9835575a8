"""shardkit's own layout: the manifest is decoded by `format.decode_index` (docs/FORMAT.md)."""

from __future__ import annotations

from ..format import CheckpointIndex, decode_index
from ..shards.files import CheckpointDirectory
from .base import FormatAdapter, ParsedHeader


class ShardkitFormat(FormatAdapter):
    name = "shardkit"
    description = "shardkit checkpoint"
    checksums = True

    def read_index(self, directory: CheckpointDirectory, name: str, data: bytes | None,
                   headers: dict[int, ParsedHeader] | None = None) -> CheckpointIndex:
        assert data is not None
        return decode_index(data, directory.join(name))


SHARDKIT = ShardkitFormat()
