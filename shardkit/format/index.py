"""The manifest's content (``model.safetensors.index.json``; ``index.json`` before 2.2) as
objects: ShardInfo, SliceInfo, TensorInfo and the column-wise CheckpointIndex (docs/FORMAT.md
section 2). `index_encoding` writes it, `index_decoding` reads and checks it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from ..sharding.tensors import columns_constructor
from ..values.dtypes import PACKED, entry_sizes, nbytes
from ..values.slices import WHOLE, parse_slice_spec
from .common import FORMAT_VERSION, entry_name, shown
from .header import _first


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One shard file: plain file name, device task, codec ("raw" / "zstd"), size in bytes,
    and the checkpoint generation its header must record (the manifest's ``shardkit.generation``;
    None for an index without one, format 2.0: then nothing is checked)."""

    file: str
    task: int
    codec: str
    bytes: int
    generation: str | None = None


@dataclass(frozen=True, slots=True)
class SliceInfo:
    """Where one slice of a tensor is stored: shard number, entry name, xxh3-64 hex or None."""

    spec: str
    shard: int
    entry: str
    xxh3: str | None


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor of the checkpoint: safetensors dtype name, full shape, device, its slices."""

    dtype: str
    shape: tuple[int, ...]
    device: str
    slices: list[SliceInfo]

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)

    @property
    def is_split(self) -> bool:
        """More than one stored slice (one slice always covers the whole tensor)."""
        return len(self.slices) > 1


_new_slice_infos = columns_constructor(SliceInfo)
_new_tensor_infos = columns_constructor(TensorInfo)


@dataclass(slots=True, eq=False)
class CheckpointIndex:
    """The content of the manifest, column-wise (docs/FORMAT.md section 2).

    Tensors, in save order: `keys`, `dtypes` (safetensors names), full `shapes`, `devices`.
    Stored slices, shard by shard and within a shard in data-region order: `slice_tensor` (the
    row of their tensor), `slice_spec` (``""`` = whole), `slice_shard`, `slice_xxh3`.
    Per-tensor objects (`tensors`) are built only when asked for: a 50,000-tensor load never
    needs them.
    """

    callback: str
    shards: list[ShardInfo]
    keys: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    devices: list[str]
    slice_tensor: list[int]
    slice_spec: list[str]
    slice_shard: list[int]
    slice_xxh3: Sequence[str | None]  # a list, or a column made on first use (TensorBundle)
    user_metadata: dict[str, Any] = field(default_factory=dict)
    version: str = FORMAT_VERSION
    generation: str | None = None  # shardkit.generation (format 2.1); every shard records it
    strings: Any = None  # the string tensors (a strings.StringTensors, format 2.3), or None
    # per stored slice, the algorithm of its `slice_xxh3` value (docs/FORMAT.md, "Checksum
    # kinds"); None: all "xxh3" (shardkit's own format)
    slice_checksum_kind: list[str] | None = None
    # the structure record of the saved state (shardkit.sharding.structure), or None
    structure: list[Any] | None = None
    # names of stored tensors (tied weights): alias key -> stored key (section 2.5), or None
    aliases: dict[str, str] | None = None
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CheckpointIndex):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in _INDEX_FIELDS)

    __hash__ = None  # type: ignore[assignment]

    @classmethod
    def from_tensors(
        cls, callback: str, shards: list[ShardInfo], tensors: Mapping[str, TensorInfo],
        user_metadata: dict[str, Any] | None = None, generation: str | None = None,
    ) -> CheckpointIndex:
        """An index from per-tensor objects; slices are listed shard by shard, in tensor order
        (the order of a writer that lays out one item size per shard)."""
        keys = list(tensors)
        infos = list(tensors.values())
        rows = [(s.shard, row, s) for row, t in enumerate(infos) for s in t.slices]
        rows.sort(key=_first)  # stable: tensor order within a shard
        for _, row, s in rows:
            if s.entry != entry_name(keys[row], s.spec):
                raise ValueError(f"entry of {shown(keys[row])} slice {shown(s.spec)} must be "
                                 f"{shown(entry_name(keys[row], s.spec))}, got {shown(s.entry)}")
        return cls(
            callback, list(shards), keys, [t.dtype for t in infos],
            [tuple(t.shape) for t in infos], [t.device for t in infos],
            [r for _, r, _ in rows], [s.spec for _, _, s in rows],
            [s.shard for _, _, s in rows], [s.xxh3 for _, _, s in rows],
            dict(user_metadata or {}), FORMAT_VERSION, generation,
        )

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """checkpoint key -> TensorInfo, in save order (built on first use)."""
        got = self._cache.get("tensors")
        if got is None:
            per_tensor: list[list[SliceInfo]] = [[] for _ in self.keys]
            made = _new_slice_infos(self.slice_spec, self.slice_shard, self.entry_names(),
                                    self.slice_xxh3)
            for row, info in zip(self.slice_tensor, made):
                per_tensor[row].append(info)
            got = self._cache["tensors"] = dict(zip(self.keys, _new_tensor_infos(
                self.dtypes, self.shapes, self.devices, per_tensor)))
        return got

    def files(self) -> list[str]:
        """The files this index names (besides the manifest): its shards, then its string
        file."""
        names = [s.file for s in self.shards]
        if self.strings is not None and getattr(self.strings, "file", None):
            names.append(self.strings.file)
        return names

    def set_checksums(self, xxh3: list[str | None]) -> None:
        """Fill in the slices' checksums (a writer knows them only once the data is written)."""
        if len(xxh3) != len(self.slice_tensor):
            raise ValueError(f"{len(xxh3)} checksums for {len(self.slice_tensor)} slices")
        self.slice_xxh3 = xxh3
        self._cache.pop("tensors", None)

    def set_total_size(self, total: int) -> None:
        """Record the bytes of all tensors when the caller knows them already."""
        self._cache["total_size"] = int(total)

    def tensor_info(self, key: str) -> TensorInfo:
        """The TensorInfo of `key` alone (KeyError if absent)."""
        got = self._cache.get("tensors")
        if got is not None:
            return got[self.aliases.get(key, key) if self.aliases else key]
        row = self.row(key)
        names = self.entry_names()
        slices = [SliceInfo(self.slice_spec[j], self.slice_shard[j], names[j], self.slice_xxh3[j])
                  for j in self.slices_of()[row]]
        return TensorInfo(self.dtypes[row], self.shapes[row], self.devices[row], slices)

    def slices_of(self) -> list[list[int]]:
        """The stored slices of each tensor row."""
        got = self._cache.get("slices_of")
        if got is None:
            got = [[] for _ in self.keys]
            for j, row in enumerate(self.slice_tensor):
                got[row].append(j)
            self._cache["slices_of"] = got
        return got

    def first_slice(self) -> np.ndarray:
        """For each tensor row, the number of its first stored slice."""
        got = self._cache.get("first")
        if got is None:
            got = np.empty(len(self.keys), np.int64)
            tensor = np.asarray(self.slice_tensor, np.int64)
            got[tensor[::-1]] = np.arange(len(tensor) - 1, -1, -1)  # the last write wins
            self._cache["first"] = got
        return got

    def shard_range(self, shard: int) -> range:
        """The stored slices of `shard` (slices are listed shard by shard)."""
        got = self._cache.get("bounds")
        if got is None:
            got = self._cache["bounds"] = np.searchsorted(
                np.asarray(self.slice_shard, np.int64), np.arange(len(self.shards) + 1))
        return range(int(got[shard]), int(got[shard + 1]))

    def row(self, key: str) -> int:
        """The row of `key` (KeyError if absent)."""
        return self.rows()[key]

    def rows(self) -> dict[str, int]:
        """checkpoint key -> row; an alias -> the row of the tensor it names."""
        rows = self._cache.get("rows")
        if rows is None:
            rows = self._cache["rows"] = dict(zip(self.keys, range(len(self.keys))))
            if self.aliases:
                rows.update(zip(self.aliases, map(rows.__getitem__, self.aliases.values())))
        return rows

    def all_keys(self) -> list[str]:
        """The stored keys in save order, then the aliases."""
        return [*self.keys, *self.aliases] if self.aliases else list(self.keys)

    def entry_names(self) -> list[str]:
        """Entry name of every stored slice (section 4: the key, or ``key:spec``)."""
        got = self._cache.get("entries")
        if got is None:
            names = list(map(self.keys.__getitem__, self.slice_tensor))
            got = self._cache["entries"] = [
                n if s == WHOLE else f"{n}:{s}" for n, s in zip(names, self.slice_spec)
            ] if any(self.slice_spec) else names
        return got

    def has_packed(self) -> bool:
        """Whether a tensor has a `values.dtypes.PACKED` dtype (F4: two elements a byte)."""
        got = self._cache.get("packed")
        if got is None:
            got = self._cache["packed"] = bool(PACKED.intersection(self.dtypes))
        return bool(got)

    def slice_counts(self) -> np.ndarray:
        """How many stored slices each tensor has."""
        got = self._cache.get("counts")
        if got is None:
            got = self._cache["counts"] = np.bincount(
                np.asarray(self.slice_tensor, dtype=np.int64), minlength=len(self.keys))
        return got

    def slice_shapes(self) -> list[tuple[int, ...]]:
        """Shape of every stored slice (the tensor's for a whole one)."""
        got = self._cache.get("slice_shapes")
        if got is None:
            shapes = list(map(self.shapes.__getitem__, self.slice_tensor))
            if any(self.slice_spec):
                for j, spec in enumerate(self.slice_spec):
                    if spec != WHOLE:
                        shapes[j] = parse_slice_spec(spec, shapes[j]).shape
            got = self._cache["slice_shapes"] = shapes
        return got

    def total_size(self) -> int:
        """Bytes of all tensors (HuggingFace's metadata.total_size)."""
        known = self._cache.get("total_size")
        if known is not None:
            return int(known)
        return sum(entry_sizes(self.dtypes, self.shapes))


_INDEX_FIELDS: Final = tuple(f for f in CheckpointIndex.__slots__ if f != "_cache")
