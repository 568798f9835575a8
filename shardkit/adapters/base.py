"""The adapter interface (see `shardkit.adapters`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..format import CheckpointIndex, EntryLayout, ShardInfo, entries_at
from ..shards.files import CheckpointDirectory


@dataclass(slots=True, eq=False)
class PlacedIndex(CheckpointIndex):
    """A CheckpointIndex of data files without a header of their own (a TensorBundle's, DCP's):
    where each stored slice begins in its file (`begins`: per shard, offsets from the start of
    the file, in the order of the shard's slices), and per file whether every entry starts at a
    multiple of its dtype's alignment (`aligned`)."""

    begins: list[list[int]] = field(default_factory=list)
    aligned: list[bool] = field(default_factory=list)

    def layout(self, shard: int) -> tuple[list[str], list[str], list[tuple[int, ...]],
                                          list[int]]:
        """The entries of data file `shard` column-wise: names, dtype names, shapes, begins."""
        r = self.shard_range(shard)
        rows = self.slice_tensor[r.start : r.stop]
        return (self.entry_names()[r.start : r.stop], list(map(self.dtypes.__getitem__, rows)),
                self.slice_shapes()[r.start : r.stop], self.begins[shard])

    @property
    def entries(self) -> list[dict[str, EntryLayout]]:
        """Per data file, entry name -> EntryLayout (offsets from the start of the file)."""
        return [entries_at(*self.layout(i)) for i in range(len(self.shards))]


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
    table's ``slice_xxh3`` is all None when it cannot); `separator`: what joins the components
    of its keys (``prefix=`` selects whole components). `read_index` decodes the layout whose
    table comes from file `name` of `directory` (a manifest, whose bytes are `data`, or a
    single safetensors file, `data` None), opening any other file through `directory`. Every
    failure is a ShardkitError subclass naming the file (and key). An adapter that parses shard
    headers on the way puts them in `headers` (shard number -> ParsedHeader) when given one.
    """

    name: str = ""
    description: str = ""
    checksums: bool = False
    separator: str = "/"  # between a key's components, for ``prefix=``

    def read_index(self, directory: CheckpointDirectory, name: str, data: bytes | None,
                   headers: dict[int, ParsedHeader] | None = None) -> CheckpointIndex:
        raise NotImplementedError

    def open_source(self, index: CheckpointIndex, i: int, path: str, info: ShardInfo, *,
                    mmap: bool, file: Any) -> Any:
        """The shard source of shard `i` when the layout's index, not a shard header, says
        where its entries are (TensorBundle); None: the codec's source reads the header."""
        return None

    def checksum(self, kind: str, src: Any, entry: EntryLayout) -> str:
        """The checksum of kind `kind` (an `index.slice_checksum_kind` other than "xxh3") of
        `entry` of source `src`, as the index records it."""
        raise NotImplementedError(f"{self.name} records no checksums of kind {kind!r}")

    def missing(self, index: CheckpointIndex, key: str) -> str | None:
        """Why `key`, which the layout holds but the table does not (a non-tensor item), cannot
        be read; None for a key the layout does not hold."""
        return None

    def __repr__(self) -> str:
        return f"<format adapter {self.name}>"
