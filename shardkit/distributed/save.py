"""A rank of a collective save (`CollectiveRank`): every rank writes its own shards, rank 0
merges and commits. The steps, their four collectives and the relay of a rank's error are the
save flow's (`io.flow`; docs/ARCHITECTURE.md). Each rank is the device task
``/job:worker/replica:0/task:<rank>``: it holds its pieces (`held`: a DTensor as its local
slice), every rank computes the same de-duplication and choice of writers from the gathered
columns (`plan`) and its share of its machine's cores (`writer_threads`), runs the callback on
what it writes, and sends its index columns (`part`), which rank 0 merges (`merge`). Tensor
bytes never leave their process.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain, count
from typing import Any

import numpy as np

from .. import format as fmt
from .._threads import usable_cores
from ..errors import DistributedStateError
from ..frameworks import dtensor_type, string_to_host, to_host
from ..io.flow import RankSave
from ..io.writer import SavedTensors, default_threads, shard_columns
from ..sharding.callback import callback_description, shard_tensors
from ..sharding.structure import merge_records
from ..sharding.tensors import ShardableTensor, flatten_columns
from ..storage import is_url
from ..values.devices import DeviceSpec
from ..values.dtypes import PACKED, entry_sizes, itemsize, safetensors_name, stored_nbytes
from ..values.sharing import shared_rows
from ..values.slices import WHOLE, format_slice_spec
from .whole import Layout, checksums, directory_identity, packed_runs, write_pieces
from .whole import layout as whole_layout


@dataclass(slots=True)
class Held:
    """What one rank holds, column-wise: per piece its key, slice spec of the global tensor
    (``""``: the whole tensor), safetensors dtype name, global shape and bytes. `arrays` (the
    host views) stay in the process; the rest is what the ``plan`` collective sends. A piece
    that is exactly the memory of an earlier one (tied weights) is not among them: `aliases`
    names it, key -> the earlier piece's key."""

    keys: list[str]
    specs: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    nbytes: list[int]
    arrays: list[np.ndarray]
    devices: list[DeviceSpec]
    aliases: dict[str, str] = field(default_factory=dict, kw_only=True)


@dataclass(frozen=True, slots=True)
class LocalShard:
    """A rank's part of a distributed tensor, taken apart already: `local` (an array or
    tensor) is the slice at `offset` of a tensor of global `shape`. An async save snapshots
    `local` and saves this in the background."""

    local: Any
    shape: tuple[int, ...]
    offset: tuple[int, ...]


def held(state: Any, rank: int) -> Held:
    """Flatten `state` into this rank's pieces: a DTensor as its local slice of the global
    tensor (none when the local shard is empty), anything else whole."""
    from .dtensor import local_slice

    keys, leaves = flatten_columns(state)
    dtensor = dtensor_type()
    device = DeviceSpec("worker", 0, rank, "CPU", 0)
    rows: list[tuple[Any, ...]] = []  # one per piece, in Held's field order
    boxes: dict[Any, Any] = {}
    for key, value in zip(keys, leaves):
        if (dtensor is not None and isinstance(value, dtensor)) or isinstance(value, LocalShard):
            local, shape, offset = (
                local_slice(value, key, boxes) if not isinstance(value, LocalShard)
                else (value.local, value.shape, value.offset))
            array, dev = to_host(local, key)
            if array.size == 0 and math.prod(shape) != 0:
                continue  # an empty shard of an uneven split: nothing to store
            spec = WHOLE if array.shape == shape else format_slice_spec(shape, offset,
                                                                        array.shape)
        else:
            if string_to_host(value) is not None:
                raise DistributedStateError(
                    f"{key!r} is a string tensor: a collective save stores numeric tensors "
                    "only (string tensors live in one file of the checkpoint, docs/FORMAT.md "
                    "section 2.3, written by a single process); save strings from one rank "
                    "with a save of their own, or put them in metadata=")
            array, dev = to_host(value, key)
            shape = tuple(array.shape)
            spec = WHOLE
        if dev is None or (dev.device_type == "CPU" and not dev.device_index):
            dev = device
        else:
            dev = DeviceSpec("worker", 0, rank, dev.device_type, dev.device_index)
        rows.append((key, spec, safetensors_name(array.dtype), shape, stored_nbytes(array),
                     array, dev))
    shared = shared_rows([row[5] for row in rows], [row[1] for row in rows])
    aliases = {rows[i][0]: rows[j][0] for i, j in shared.items()}
    if shared:
        rows = [row for i, row in enumerate(rows) if i not in shared]
    if not rows:
        return Held([], [], [], [], [], [], [])
    return Held(*map(list, zip(*rows)), aliases=aliases)


# What the plan sends of a rank's pieces: keys, then slice specs, dtype names, global shapes
# as Coded (the distinct values and an int32 code per piece, as bytes), the bytes of each
# piece (int64 bytes), and the device strings, Coded.
Columns = tuple[list[str], "Coded", "Coded", "Coded", bytes, "Coded"]


@dataclass(frozen=True, slots=True)
class Coded:
    """A column as its distinct `values` and, per row, the int32 code of its value."""

    values: list[Any]
    codes: bytes

    @classmethod
    def of(cls, column: list[Any]) -> Coded:
        first = _firsts(column)
        distinct = np.flatnonzero(first == np.arange(len(column)))
        compact = np.zeros(len(column), np.int32)
        compact[distinct] = np.arange(len(distinct), dtype=np.int32)
        return cls([column[i] for i in distinct.tolist()], compact[first].tobytes())


def columns(keys: list[str], specs: list[str], dtypes: list[str],
            shapes: list[tuple[int, ...]], nbytes: list[int], devices: list[str]) -> Columns:
    """A rank's pieces as the ``plan`` collective sends them (`Columns`)."""
    return (keys, Coded.of(specs), Coded.of(dtypes), Coded.of(shapes),
            np.asarray(nbytes, np.int64).tobytes(), Coded.of(devices))


class _Column:
    """The ranks' Coded parts of one column, concatenated: `ids` (equal ids, equal values)
    and `values` (the distinct values, by id)."""

    def __init__(self, parts: Sequence[Coded]) -> None:
        number: dict[Any, int] = {}
        ids = []
        for part in parts:
            remap = np.fromiter((number.setdefault(v, len(number)) for v in part.values),
                                np.int64, len(part.values))
            ids.append(remap[np.frombuffer(part.codes, np.int32)] if len(remap) else
                       np.zeros(0, np.int64))
        self.ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        self.values = list(number)

    def __getitem__(self, i: int) -> Any:
        return self.values[self.ids[i]]

    def take(self, rows: np.ndarray) -> list[Any]:
        """The values of `rows`."""
        return list(map(self.values.__getitem__, self.ids[rows].tolist()))


EXACT = 4096  # replicated pieces placed one by one (largest first); the rest round-robin


@dataclass(slots=True)
class Plan:
    """The ranks' pieces, concatenated in rank order (rank r's at ``start[r]`` on), and who
    writes what: `mine[r]`, the positions in rank r's `Held` of the pieces it writes;
    `tensor_row`, each piece's tensor in the merged index, whose rows are the keys in order
    of first appearance, `tensor_first` the first piece of each."""

    keys: list[str]
    specs: _Column
    dtypes: _Column
    shapes: _Column
    devices: _Column
    start: np.ndarray
    tensor_row: np.ndarray
    tensor_first: np.ndarray
    mine: list[list[int]]


def plan(columns: Sequence[Columns]) -> Plan:
    """Who writes which piece, the same on every rank, from the same gathered columns.

    A (key, slice spec) held by one rank is written by it; one held by several is written
    once: the largest `EXACT` such pieces each by the holder with the fewest bytes so far
    (largest first, ties to the lowest rank), any further (smaller) ones round-robin over
    their holders. Raises DistributedStateError when ranks disagree on a key's dtype or
    global shape, or when the pieces of a key do not add up to its size (a missing or
    overlapping slice). Column-wise: one dict pass per column, the rest numpy.
    """
    world = len(columns)
    counts = [len(c[0]) for c in columns]
    total = sum(counts)
    start = np.zeros(world + 1, np.int64)
    np.cumsum(counts, out=start[1:])
    keys = list(chain.from_iterable(c[0] for c in columns))
    specs, dtypes, shapes, devices = (_Column([c[k] for c in columns])  # type: ignore[misc]
                                      for k in (1, 2, 3, 5))
    empty = np.zeros(0, np.int64)
    if total == 0:
        return Plan(keys, specs, dtypes, shapes, devices, start, empty, empty,
                    [[] for _ in columns])
    rank_of = np.repeat(np.arange(world, dtype=np.int64), counts)
    pos = np.arange(total, dtype=np.int64) - start[rank_of]
    of_key = _firsts(keys)  # the first piece of the same key
    did, shid = dtypes.ids, shapes.ids
    bad = np.flatnonzero((did != did[of_key]) | (shid != shid[of_key]))
    if bad.size:
        i = int(bad[0])
        j = int(of_key[i])
        raise DistributedStateError(
            f"tensor {keys[i]!r} differs across ranks: rank {rank_of[j]} holds {dtypes[j]} "
            f"{list(shapes[j])}, rank {rank_of[i]} holds {dtypes[i]} {list(shapes[i])} (global "
            "dtype and shape); every rank must hold the same tensor under one key")
    every = np.arange(total, dtype=np.int64)
    tensor_first = np.flatnonzero(of_key == every)
    row = np.empty(total, np.int64)
    row[tensor_first] = np.arange(len(tensor_first), dtype=np.int64)
    tensor_row = row[of_key]
    pair = of_key * total + specs.ids
    order = np.argsort(pair, kind="stable")  # within a piece: its holders in rank order
    ordered = pair[order]
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    holders = np.diff(np.append(starts, total))
    firsts = order[starts]  # the first holder's element of each piece
    nbytes = np.concatenate([np.frombuffer(c[4], np.int64) for c in columns])
    covered = np.zeros(len(tensor_first), np.int64)
    np.add.at(covered, tensor_row[firsts], nbytes[firsts])
    sizes = np.fromiter(map(math.prod, shapes.values), np.int64, len(shapes.values))
    items = np.fromiter(map(itemsize, dtypes.values), np.int64, len(dtypes.values))
    expected = sizes[shid[tensor_first]] * items[did[tensor_first]]
    packed = [i for i, name in enumerate(dtypes.values) if name in PACKED]
    if packed:  # two elements a byte (`values.dtypes.nbytes`)
        expected = np.where(np.isin(did[tensor_first], packed), expected // 2, expected)
    wrong = np.flatnonzero(covered != expected)
    if wrong.size:
        k = int(wrong[0])
        j = int(tensor_first[k])
        raise DistributedStateError(
            f"the ranks' slices of tensor {keys[j]!r} (global shape {list(shapes[j])}, "
            f"{dtypes[j]}) hold {covered[k]} bytes, the tensor has {expected[k]}: a slice is "
            "missing or two overlap")
    chosen = firsts.copy()  # the element that writes each piece
    single = holders == 1
    load = np.bincount(rank_of[firsts[single]], weights=nbytes[firsts[single]],
                       minlength=world).astype(np.int64)
    shared = np.flatnonzero(~single)
    if shared.size:
        shared = shared[np.argsort(firsts[shared], kind="stable")]  # first appearance
        shared = shared[np.argsort(-nbytes[firsts[shared]], kind="stable")]  # largest first
        for g in shared[:EXACT].tolist():
            members = order[starts[g] : starts[g] + holders[g]]
            best = int(members[np.argmin(load[rank_of[members]])])
            chosen[g] = best
            load[rank_of[best]] += nbytes[best]
        rest = shared[EXACT:]
        if rest.size:
            turn = np.arange(rest.size, dtype=np.int64) % holders[rest]
            chosen[rest] = order[starts[rest] + turn]
    by_rank = rank_of[chosen]
    at = pos[chosen]
    mine = [np.sort(at[by_rank == r]).tolist() for r in range(world)]
    return Plan(keys, specs, dtypes, shapes, devices, start, tensor_row, tensor_first, mine)


def _firsts(values: list[Any]) -> np.ndarray:
    """For each value, the index of its first occurrence (one dict pass)."""
    first: dict[Any, int] = {}
    return np.fromiter(map(first.setdefault, values, count()), np.int64, len(values))


def machine() -> tuple[str, frozenset[int]]:
    """Where this process runs, as the ``plan`` collective sends it: an id of the machine
    (the kernel's boot id, shared by the containers of one host; else the host name) and the
    cores it may run on."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            host = f.read().strip()
    except OSError:
        host = ""
    if not host:
        import socket

        host = socket.gethostname()
    return host, usable_cores()


def writer_threads(machines: Sequence[tuple[str, frozenset[int]]], rank: int) -> int:
    """The writer threads of `rank` when none are asked for: `writer.default_threads` of its
    share of its cores among the ranks of its machine that may run on them too. Ranks that
    share cores and each took one thread per core would oversubscribe them
    (docs/ARCHITECTURE.md)."""
    host, cores = machines[rank]
    sharing = sum(1 for h, c in machines if h == host and c & cores)  # this rank too
    return default_threads(len(cores) // sharing)


class CollectiveRank(RankSave):
    """A rank of a collective save, in the save flow (`io.flow.run_save`): it holds its own
    pieces (`held`), every rank computes the same `plan` from the gathered columns, it runs
    the callback on the pieces it writes, and rank 0 merges the ranks' index columns."""

    layout: Layout | None = None  # the whole-tensor layout, when the save writes one
    target = ""  # the checkpoint's path or URL, as `save` was given it

    def hold(self, rank: int) -> Any:
        self.rank, mine = rank, held(self.state, rank)
        names: dict[int, str] = {}  # each device converted once
        devices = [names.get(id(d)) or names.setdefault(id(d), d.to_string()) for d in mine.devices]
        self.mine = mine
        where = None if is_url(self.target) else directory_identity(self.target)
        return columns(mine.keys, mine.specs, mine.dtypes, mine.shapes, mine.nbytes,
                       devices), machine(), where

    def assign(self, gathered: list[Any]) -> None:
        self.pieces = pieces = plan([g[0] for g in gathered])
        self.written = pieces.mine[self.rank]
        machines = [g[1] for g in gathered]
        self.threads = self.opts.threads or writer_threads(machines, self.rank)
        why = self._why_slices(machines, [g[2] for g in gathered])
        if why is None:  # every rank computes the same layout: the policy sees every tensor
            policy: Any = self.default_policy(sum(self.opts.threads or writer_threads(machines, r)
                                             for r in range(len(machines))))
            self.description = callback_description(policy)
            first = pieces.tensor_first
            dtypes, shapes = pieces.dtypes.take(first), pieces.shapes.take(first)
            sizes = entry_sizes(dtypes, shapes)  # the one size rule (float4: packed)
            self.layout = whole_layout(dtypes, shapes, policy.bounds(sizes))
        elif not self.opts.experimental_sharding_callback:
            self.split_reason = why  # the default policy, whose tensors stay whole alone

    def _why_slices(self, machines: list[tuple[str, frozenset[int]]],
                    places: list[Any]) -> str | None:
        """Why this save stores per-rank slices instead of whole tensors; None: it does not."""
        if self.opts.experimental_sharding_callback is not None:
            return "a sharding callback was given (it runs on each rank's own pieces)"
        if self.opts.compression is not None:
            return "compression is on (.skz shards are written by one rank each)"
        if is_url(self.target):
            return "the checkpoint is on object storage (each rank uploads its own shards)"
        if len({m[0] for m in machines}) > 1 or None in places or len(set(places)) > 1:
            return "the ranks do not share one file system (not one machine and directory)"
        pieces = self.pieces
        for i in (i for i, d in enumerate(pieces.dtypes.ids.tolist())
                  if pieces.dtypes.values[d] in PACKED):
            if not packed_runs(tuple(pieces.shapes[i]), pieces.specs[i]):
                return (f"a piece of {pieces.keys[i]!r} ({pieces.dtypes[i]}, two elements a "
                        "byte) does not start and end on a byte")
        return None

    def shard(self) -> int:
        """The callback (the default policy with this rank's writer threads) on this rank's
        tensors only, validated here; in the whole-tensor layout, rank 0 counts its files."""
        if self.layout is not None:
            self.saved = SavedTensors([], [], [], [])
            return len(self.layout.files) if self.rank == 0 else 0
        callback = self.callback()
        mine = self.mine
        tensors = [ShardableTensor(mine.arrays[i], mine.arrays[i].dtype, mine.devices[i],
                                   mine.keys[i], tuple(mine.arrays[i].shape), mine.specs[i],
                                   mine.keys[i]) for i in self.written]
        if tensors:
            self.shards = shard_columns(shard_tensors(callback, tensors))
        self.saved = SavedTensors.of(tensors, mine.aliases)
        self.saved.shapes = [mine.shapes[i] for i in self.written]  # global, slices or not
        if self.split_reason:
            self.split = sorted({mine.keys[i] for i in self.written if mine.specs[i] != WHOLE})
        return len(self.shards)

    def write(self, output: Any, where: Any, generation: str | None, first: int,
              count: int) -> Any:
        """This rank's shards (`RankSave.write`), or in the whole-tensor layout its pieces'
        bytes at their places in the shared files (rank 0: and every header)."""
        lay = self.layout
        if lay is None:
            return super().write(output, where, generation, first, count)
        assert generation is not None
        directory = os.fspath(where)
        pieces, mine = self.pieces, self.mine
        keys = [pieces.keys[i] for i in pieces.tensor_first.tolist()]
        dtypes = pieces.dtypes.take(pieces.tensor_first)
        shapes = pieces.shapes.take(pieces.tensor_first)
        headers = {n: lay.header(f, keys, dtypes, shapes, generation)
                   for n, f in enumerate(lay.files)}
        self.starts = {n: sum(map(len, h)) for n, h in headers.items()}
        rows = pieces.tensor_row[pieces.start[self.rank] + np.asarray(self.written, np.int64)]
        mine_pieces = [(int(r), mine.specs[i], mine.arrays[i])
                       for r, i in zip(rows.tolist(), self.written)]
        return write_pieces(directory, lay, headers if self.rank == 0 else {}, self.starts,
                            mine_pieces, self.threads, self.opts.durable)

    def part(self, written: Any) -> tuple[Any, ...]:
        if self.layout is not None:  # the layout says where everything is
            return (written, self.mine.aliases, self.structure)
        return self._slice_part(written)

    def _slice_part(self, written: Any) -> tuple[Any, ...]:
        """What the ``index`` collective sends of this rank's index: per stored slice (shard
        by shard, in data-region order) the position of its piece in the rank's `Held` and its
        shard, as int32 bytes; the slice specs only if the callback split a piece; the
        checksums; the shards; the rank's aliases; its structure record (the ranks' records
        are merged: DCP's planner, for one, gives each non-tensor value to one rank). Keys,
        dtypes and shapes rank 0 knows from the plan already."""
        index = written[0]
        local = np.asarray(self.written, np.int64)[np.asarray(index.slice_tensor, np.int64)]
        own = list(map(self.mine.specs.__getitem__, local.tolist()))
        split = None if own == index.slice_spec else index.slice_spec
        return (local.astype(np.int32).tobytes(),
                np.asarray(index.slice_shard, np.int32).tobytes(), split, index.slice_xxh3,
                [(s.file, s.task, s.codec, s.bytes) for s in index.shards], self.mine.aliases,
                self.structure)

    def merge(self, parts: list[Any], output: Any, generation: str | None
              ) -> tuple[fmt.CheckpointIndex, list[bytes]]:
        assert generation is not None
        if self.layout is not None:
            merged = self._whole_index(output, parts, generation)
        else:
            merged = merge(self.pieces, [p[:-1] for p in parts], description=self.description,
                           user_metadata=output.user_metadata, generation=generation)
        pieces = self.pieces  # a plain rank's record: the keys it holds stand for it
        keys = [pieces.keys[pieces.start[r]:pieces.start[r + 1]] + list(p[-2])
                for r, p in enumerate(parts)]
        merged.structure = merge_records([p[-1] for p in parts], keys)
        return merged, fmt.index_chunks(merged)


    def _whole_index(self, output: Any, parts: list[Any], generation: str
                     ) -> fmt.CheckpointIndex:
        """The index of the whole-tensor layout, its checksums read from the files."""
        lay, pieces = self.layout, self.pieces
        assert lay is not None
        first = pieces.tensor_first
        keys = [pieces.keys[i] for i in first.tolist()]
        dtypes, shapes = pieces.dtypes.take(first), pieces.shapes.take(first)
        directory = output.staging_directory()
        digests = (checksums(directory, lay, self.starts, len(usable_cores()))
                   if self.opts.checksum
                   else [[None] * len(f.rows) for f in lay.files])
        index = fmt.CheckpointIndex(
            self.description,
            [fmt.ShardInfo(f.name, 0, "raw", self.starts[n] + f.data_size, generation)
             for n, f in enumerate(lay.files)],
            keys, dtypes, shapes, pieces.devices.take(first),
            [r for f in lay.files for r in f.rows], [WHOLE] * len(keys),
            [n for n, f in enumerate(lay.files) for _ in f.rows],
            [d for file_digests in digests for d in file_digests],
            dict(output.user_metadata), fmt.FORMAT_VERSION, generation)
        index.set_total_size(sum(f.data_size for f in lay.files))
        index.aliases = merged_aliases(keys, [p[-2] for p in parts])
        return index


def merge(pieces: Plan, parts: Sequence[tuple[Any, ...]], *, description: str,
          user_metadata: dict[str, Any], generation: str) -> fmt.CheckpointIndex:
    """The checkpoint's index from the ranks' `part` columns (in rank order) and the plan:
    tensors in order of first appearance over the ranks (rank 0's state order first), each
    with the dtype, global shape and device of its first holder; slices and shards rank by
    rank, each rank's shards numbered after the lower ranks'; the ranks' aliases (the lowest
    rank's where they differ). Column-wise. DistributedStateError for a key one rank holds
    as an alias (tied) and another stores (not tied there): its pieces would not tile."""
    rows: list[np.ndarray] = []
    shard_of: list[np.ndarray] = []
    specs: list[str] = []
    xxh3: list[str | None] = []
    shards: list[fmt.ShardInfo] = []
    for r, (local, shard, split, digests, infos, _) in enumerate(parts):
        element = np.frombuffer(local, np.int32).astype(np.int64) + pieces.start[r]
        rows.append(pieces.tensor_row[element])
        shard_of.append(np.frombuffer(shard, np.int32).astype(np.int64) + len(shards))
        specs += split if split is not None else pieces.specs.take(element)
        xxh3 += digests
        shards += [fmt.ShardInfo(f, t, c, b, generation) for f, t, c, b in infos]
    first = pieces.tensor_first
    keys = (list(operator.itemgetter(*first.tolist())(pieces.keys)) if len(first) > 1
            else [pieces.keys[i] for i in first.tolist()])
    index = fmt.CheckpointIndex(
        description, shards, keys, pieces.dtypes.take(first), pieces.shapes.take(first),
        pieces.devices.take(first),
        np.concatenate(rows).tolist() if rows else [], specs,
        np.concatenate(shard_of).tolist() if shard_of else [], xxh3,
        dict(user_metadata), fmt.FORMAT_VERSION, generation)
    index.aliases = merged_aliases(keys, [part[5] for part in parts])
    return index


def merged_aliases(keys: list[str], named: Sequence[dict[str, str]]) -> dict[str, str] | None:
    """The ranks' aliases (alias -> stored key, in rank order; the lowest rank's where they
    differ), or None. DistributedStateError for a key one rank holds as an alias (tied) and
    the index stores as a tensor: its pieces would not tile."""
    aliases: dict[str, str] = {}
    tied_on: dict[str, int] = {}  # alias -> the first rank that holds it as one
    for r, mine in enumerate(named):
        aliases = {**mine, **aliases}
        tied_on = {**dict.fromkeys(mine, r), **tied_on}
    if not aliases:
        return None
    both = set(keys).intersection(aliases)
    if both:
        key = min(both)
        raise DistributedStateError(
            f"{key!r} is the memory of {aliases[key]!r} on rank {tied_on[key]} (tied "
            "weights, stored once) but a tensor of its own on another rank: tie it on every "
            "rank or on none")
    return aliases
