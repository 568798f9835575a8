"""The adapter interface (see `shardkit.formats`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..files import CheckpointDirectory
from ..format import CheckpointIndex, EntryLayout


@dataclass(frozen=True, slots=True)
class ParsedHeader:
    """A shard header an adapter parsed (and checked) to build the table, with the `stamp` of
    the file it came from (`CheckpointFile.stamp`): the reader takes it instead of parsing the
    header again when the file it opens for the shard has the same stamp."""

    entries: dict[str, EntryLayout]
    metadata: dict[str, str]
    data_start: int
    stamp: tuple[int, int, int, int]


class FormatAdapter:
    """Turns one on-disk layout into the reader's entry table.

    `name`: short name ("shardkit", "huggingface", "safetensors"); `description`: what
    ``shardkit inspect`` calls it; `checksums`: whether the layout can store checksums (the
    table's ``slice_xxh3`` is all None when it cannot). `read_index` decodes the layout whose
    table comes from file `name` of `directory` (a manifest, whose bytes are `data`, or a
    single safetensors file, `data` None), opening any other file through `directory`. Every
    failure is a ShardkitError subclass naming the file (and key). An adapter that parses shard
    headers on the way puts them in `headers` (shard number -> ParsedHeader) when given one.
    """

    name: str = ""
    description: str = ""
    checksums: bool = False

    def read_index(self, directory: CheckpointDirectory, name: str, data: bytes | None,
                   headers: dict[int, ParsedHeader] | None = None) -> CheckpointIndex:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<format adapter {self.name}>"
