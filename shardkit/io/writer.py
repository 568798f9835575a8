"""Plan validated shards as shard files and hand them to the storage to write.

`plan_shards` is the one planning function: every shard's entry order (largest items first),
header pieces, offsets and file name, the same whatever the storage. `write_shards` plans,
asks the checkpoint's `Storage` to write the planned files (`Storage.write_shards`: locally
the native write kernel of `shardkit.storage.native`, on a store multipart uploads) and
describes them: the index, its manifest bytes in pieces, the checksum column. While a local
storage writes, the calling thread builds and encodes the index (all of it but the checksums).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np

from .. import format as fmt
from .._kernels import _gather, _table
from ..errors import ShardkitError, UnsupportedDTypeError
from ..optional import require
from ..sharding.callback import TaskShard
from ..sharding.tensors import ShardableTensor
from ..storage import ShardFile, Storage, open_storage
from ..values.dtypes import PACKED, packed_problem, safetensors_name
from ..values.nibbles import pack
from ..values.slices import parse_slice_spec
from ..values.strings import StringColumns
from .options import CheckpointOptions


@dataclass(slots=True)
class ShardColumns:
    """One shard to write, column-wise: its device task and, per entry, key, slice spec and
    array (C-contiguous or not), in the order the sharding callback gave them."""

    task: int
    keys: list[str]
    specs: list[str]
    arrays: list[np.ndarray]
    # known already when a planner works on columns (None: taken from the arrays)
    dtypes: list[np.dtype] | None = None
    nbytes: np.ndarray | None = None
    shapes: list[tuple[int, ...]] | None = None
    rows: range | list[int] | None = None  # the entries' rows in SavedTensors (whole ones)


@dataclass(slots=True)
class SavedTensors:
    """What the index records of each saved tensor, in save order: key, dtype, full shape and
    device string; and the names that are one of them (`aliases`: tied weights, stored once)."""

    keys: list[str]
    dtypes: list[np.dtype]
    shapes: list[tuple[int, ...]]
    devices: list[str]
    total_size: int | None = None  # bytes of all tensors, when known
    aliases: dict[str, str] = field(default_factory=dict)  # alias key -> stored key

    @classmethod
    def of(cls, tensors: Sequence[ShardableTensor], aliases: dict[str, str] | None = None
           ) -> SavedTensors:
        devices = list(map(_device_of, tensors))
        names = {i: d.to_string() for i, d in dict(zip(map(id, devices), devices)).items()}
        return cls(list(map(_key_of, tensors)), list(map(_dtype_of, tensors)),
                   [t.shape if t.slice_spec == "" else parse_slice_spec(t.slice_spec).full_shape
                    for t in tensors],
                   list(map(names.__getitem__, map(id, devices))), aliases=aliases or {})


def shard_columns(task_shards: Sequence[TaskShard]) -> list[ShardColumns]:
    """Validated callback output ``(task, key -> spec -> array)`` as ShardColumns."""
    out = []
    ndarray = np.ndarray
    for task, shard in task_shards:
        keys: list[str] = []
        specs: list[str] = []
        arrays: list[np.ndarray] = []
        for key, slices in shard.items():
            for spec, value in slices.items():
                keys.append(key)
                specs.append(spec)
                arrays.append(value if type(value) is ndarray else np.asarray(value))
        out.append(ShardColumns(task, keys, specs, arrays))
    return out


def pick_rows(rows: Sequence[int], *columns: Sequence[Any]) -> list[list[Any]]:
    """Each of `columns` (parallel lists) reduced to the items at `rows`, in that order."""
    return [[column[i] for i in rows] for column in columns]


def default_threads(cores: int | None = None) -> int:
    """Writer threads when none are asked for: one per core (of `cores`, else of the
    machine), at least 1, at most 8."""
    return max(1, min(8, (os.cpu_count() or 1) if cores is None else cores))


def write_shards(
    directory: str | os.PathLike[str] | Storage,
    shards: Sequence[ShardColumns],
    saved: SavedTensors,
    opts: CheckpointOptions,
    *,
    description: str,
    threads: int | None = None,
    user_metadata: dict[str, Any] | None = None,
    progress: bool = False,
    generation: str | None = None,
    first_shard: int = 0,
    shard_count: int | None = None,
    strings: StringColumns | None = None,
    structure: list[Any] | None = None,
) -> tuple[fmt.CheckpointIndex, list[bytes]]:
    """Write `shards` (validated callback output) as shard files into `directory` (a
    `Storage`, or a path or URL for `storage.open_storage`: a save's `Staging.store`); returns
    their index and its manifest bytes in pieces (`format.index_chunks`), which the caller
    publishes (`Staging.commit`).

    `opts` gives the codec and its settings, `durable` and `checksum`; `saved` the order,
    dtypes, full shapes and devices of the saved tensors. `generation` is recorded in the index
    and every shard header (default: a fresh one). `first_shard` / `shard_count` number these
    shards among the whole checkpoint's (a rank of a collective save writes some of them).
    `strings`: string tensors, written to their own file (the manifest then records 2.3).
    `structure`: the state's structure record (`sharding.structure.record`), or None.
    """
    compression, durable, checksum = opts.compression, opts.durable, opts.checksum
    store = directory if isinstance(directory, Storage) else open_storage(directory)
    codec = "raw" if compression is None else "zstd"
    threads = threads or default_threads()
    generation = generation if generation is not None else fmt.new_generation()
    plans = plan_shards(shards, codec, generation, first_shard,
                        len(shards) if shard_count is None else shard_count)
    total = sum(p.size for p in plans)  # for zstd: the uncompressed bytes
    bar = None if not progress else require("tqdm.auto", "progress=True").tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="saving")

    string_file = (store.write_strings(strings, generation, checksum, durable)
                   if strings is not None and strings.keys else None)

    def describe() -> tuple[fmt.CheckpointIndex, tuple[list[bytes], list[bytes]]]:
        index = _index(plans, saved, description, user_metadata or {}, codec, generation)
        index.structure = structure
        if string_file is not None:
            index.strings = string_file
            index.version = fmt.STRINGS_VERSION
        return index, fmt.encode_index_parts(index)

    try:
        # raw: all but the checksums is described while the data is written; a compressed
        # shard's size is known once it is written, so it is described after
        index, parts = store.write_shards(
            plans, generation=generation, compressed=codec != "raw", threads=threads,
            durable=durable, checksum=checksum, bar=bar,
            zstd_options=dict(level=opts.level, shuffle=opts.shuffle, chunk_size=opts.chunk_size,
                              metadata={fmt.GENERATION_KEY: generation}),
            meanwhile=describe)
    finally:
        if bar is not None:
            bar.close()
    index.set_checksums(_checksums(plans, checksum))
    return index, fmt.index_chunks(index, parts)


def plan_shards(shards: Sequence[ShardColumns], codec: str, generation: str, first: int = 0,
                count: int | None = None) -> list[ShardFile]:
    """The shard files of `shards` as they will be on disk (`storage.ShardFile`): entries in
    layout order, header pieces (raw) or entry layouts (``codec="zstd"``), offsets, sizes and
    file names (number `first` + i of `count`, default: these are all). `path` is the file
    name until a storage places it."""
    count = len(shards) if count is None else count
    meta = fmt.shard_metadata(generation)
    plans = []
    for i, shard in enumerate(shards):
        shard = _packed(shard)
        keys, specs, arrays = shard.keys, shard.specs, shard.arrays
        names, dtype_names, shapes, begins, ends, order = _layout(shard)
        rows: range | list[int] | None = shard.rows
        if order is not None:
            keys, specs, arrays = pick_rows(order, keys, specs, arrays)
            if rows is not None:
                rows = [rows[j] for j in order]
        layouts = None
        if codec == "raw":
            header = fmt.header_parts(names, dtype_names, shapes, begins, ends, meta)
        else:
            header = []
            layouts = fmt.entry_layouts(names, dtype_names, shapes, begins.tolist(),
                                        ends.tolist())
        start = sum(map(len, header))
        name = fmt.shard_file_name(first + i, count, codec)
        plans.append(ShardFile(
            Path(name), name, shard.task, header, keys, specs, arrays,
            begins + start, ends + start, layouts, start + (int(ends[-1]) if len(ends) else 0),
            np.zeros(len(keys), np.uint64), rows,
        ))
    return plans


def _packed(shard: ShardColumns) -> ShardColumns:
    """`shard` with the arrays of a `PACKED` dtype (float4_e2m1fn) replaced by their stored
    bytes (`values.nibbles.pack`, two elements a byte), their dtypes and element shapes kept;
    `shard` itself when it holds none.

    Raises:
        UnsupportedDTypeError: such an array has an odd element count."""
    if shard.dtypes is None:  # taken from the arrays once, for `_layout` too
        shard.dtypes = list(map(_dtype_of, shard.arrays))
    dtypes = shard.dtypes
    kinds = {d: safetensors_name(d) for d in set(dtypes)}
    if not PACKED.intersection(kinds.values()):
        return shard
    shapes = shard.shapes if shard.shapes is not None else list(map(_shape_of, shard.arrays))
    arrays = list(shard.arrays)
    for j, (d, a) in enumerate(zip(dtypes, arrays)):
        if kinds[d] in PACKED:
            problem = packed_problem(kinds[d], a.shape)
            if problem:
                raise UnsupportedDTypeError(
                    f"{fmt.entry_name(shard.keys[j], shard.specs[j])!r}{problem}")
            arrays[j] = pack(a)
    return ShardColumns(shard.task, shard.keys, shard.specs, arrays, dtypes,
                        _table.array_nbytes(arrays), shapes, shard.rows)


def _layout(shard: ShardColumns) -> tuple[
    list[str], list[str], list[tuple[int, ...]], np.ndarray, np.ndarray, list[int] | None
]:
    """`format.layout_entries` for numpy arrays, column-wise: entry names, dtype names, shapes,
    begins and ends (int64 arrays) in layout order, and the input position of each (None: the
    input order). Shapes and sizes come from the arrays themselves, so they need no checking."""
    arrays = shard.arrays
    # unique and not "__metadata__": checked when the header is encoded
    names = list(map(fmt.entry_name, shard.keys, shard.specs)) if any(shard.specs) else shard.keys
    shapes = shard.shapes if shard.shapes is not None else list(map(_shape_of, arrays))
    dtypes = shard.dtypes if shard.dtypes is not None else list(map(_dtype_of, arrays))
    kinds = {d: (safetensors_name(d), d.itemsize) for d in set(dtypes)}
    nbytes = shard.nbytes if shard.nbytes is not None else _table.array_nbytes(arrays)
    order: list[int] | None = None
    if len(kinds) == 1:
        ((dtype_name, _),) = kinds.values()
        dtype_names = [dtype_name] * len(arrays)
    else:
        sizes = np.fromiter((kinds[d][1] for d in dtypes), np.int64, len(dtypes))
        perm = np.argsort(-sizes, kind="stable")
        if (np.diff(perm) != 1).any():
            order = perm.tolist()
            dtypes, names, shapes = pick_rows(order, dtypes, names, shapes)
            nbytes = nbytes[perm]
        dtype_names = [kinds[d][0] for d in dtypes]
    ends = np.cumsum(nbytes)
    return names, dtype_names, shapes, ends - nbytes, ends, order


_dtype_of = operator.attrgetter("dtype")
_shape_of = operator.attrgetter("shape")
_key_of = operator.attrgetter("checkpoint_key")
_device_of = operator.attrgetter("device")


def _index(
    plans: list[ShardFile],
    saved: SavedTensors,
    description: str,
    user_metadata: dict[str, Any],
    codec: str,
    generation: str,
) -> fmt.CheckpointIndex:
    """The index of the shards `plans`, without checksums (see `_checksums`)."""
    keys, dtypes, shapes, devices = saved.keys, saved.dtypes, saved.shapes, saved.devices
    rows: dict[str, int] | None = None
    if not all(p.rows is not None for p in plans):  # find each entry's tensor by its key
        if len(set(keys)) != len(keys):  # slices of one key given as several inputs: first wins
            first = dict(zip(reversed(keys), reversed(range(len(keys)))))
            keys, dtypes, shapes, devices = pick_rows(sorted(first.values()), keys, dtypes, shapes,
                                                      devices)
        rows = dict(zip(keys, range(len(keys))))
    slice_tensor: list[int] = []
    slice_spec: list[str] = []
    slice_shard: list[int] = []
    for number, p in enumerate(plans):  # entries are in data-region order
        if rows is None:
            assert p.rows is not None
            slice_tensor += p.rows
        else:
            try:
                slice_tensor += map(rows.__getitem__, p.keys)
            except KeyError as e:
                raise ShardkitError(f"shard {p.file} holds {e.args[0]!r}, which is not a saved "
                                    "tensor") from None
        slice_spec += p.specs
        slice_shard += repeat(number, len(p.keys))
    stored = np.bincount(np.asarray(slice_tensor, np.int64), minlength=len(keys))
    if len(keys) and stored.min() == 0:
        key = keys[int(np.argmin(stored))]
        raise ShardkitError(f"tensor {key!r} was not written to any shard")
    names = {d: safetensors_name(d) for d in set(dtypes)}
    dtype_names = ([names[dtypes[0]]] * len(dtypes) if len(names) == 1
                   else list(map(names.__getitem__, dtypes)))
    shards = [fmt.ShardInfo(p.file, p.task, codec, p.size, generation) for p in plans]
    index = fmt.CheckpointIndex(
        description, shards, keys, dtype_names, shapes, devices,
        slice_tensor, slice_spec, slice_shard, [None] * len(slice_tensor), user_metadata,
        fmt.FORMAT_VERSION, generation,
    )
    index.aliases = saved.aliases or None
    if saved.total_size is not None:
        index.set_total_size(saved.total_size)
    return index


def _checksums(plans: list[ShardFile], checksum: bool) -> list[str | None]:
    """The index's checksum column: the xxh3-64 of every entry, shard by shard, in hex."""
    column: list[str | None] = []
    for p in plans:
        if not checksum:
            column += repeat(None, len(p.keys))
        else:
            column += p.xxh3 if p.xxh3 is not None else _gather.hex_digests(p.digests)
    return column

