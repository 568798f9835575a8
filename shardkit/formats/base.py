"""The adapter interface (see `shardkit.formats`)."""

from __future__ import annotations

from ..files import CheckpointDirectory
from ..format import CheckpointIndex


class FormatAdapter:
    """Turns one on-disk layout into the reader's entry table.

    `name`: short name ("shardkit", "huggingface", "safetensors"); `description`: what
    ``shardkit inspect`` calls it; `checksums`: whether the layout can store checksums (the
    table's ``slice_xxh3`` is all None when it cannot). `read_index` decodes the layout whose
    table comes from file `name` of `directory` (a manifest, whose bytes are `data`, or a
    single safetensors file, `data` None), opening any other file through `directory`. Every
    failure is a ShardkitError subclass naming the file (and key).
    """

    name: str = ""
    description: str = ""
    checksums: bool = False

    def read_index(self, directory: CheckpointDirectory, name: str, data: bytes | None
                   ) -> CheckpointIndex:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<format adapter {self.name}>"
