"""Whole tensors: one, or many in bulk (views of raw maps made shard by shard, compressed
entries decoded in one parallel batch), and whole tensors decoded straight into targets."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from itertools import groupby
from typing import Any

import numpy as np

from ...shards.files import READ_CHUNK
from ...shards.raw import ShardSource
from ...values.dtypes import PACKED, numpy_dtype
from .boxes import get_slice
from .jobs import ReadJob, bytes_of, read_jobs, run_reads, whole_entry
from .shards import ShardSet


def get_tensors(shards: ShardSet, keys: Sequence[str] | None, rows: np.ndarray | None = None
                ) -> dict[str, np.ndarray]:
    """The whole tensors `keys` (None: every tensor and alias; `rows`: their index rows, when
    the caller has them), each key once, in the order first asked. Keys of one stored tensor
    (an alias and the tensor it names) get the one array read for it, as they were one memory
    when saved. Tensors of a `PACKED` dtype are new arrays, unpacked (`get_one`)."""
    index = shards.index
    if not index.has_packed():
        return _get_tensors(shards, keys, rows)
    keys = index.all_keys() if keys is None else list(dict.fromkeys(keys))
    rows = shards.rows_of(keys)
    dtypes = index.dtypes
    packed = [dtypes[r] in PACKED for r in rows.tolist()]
    got = _get_tensors(shards, [k for k, p in zip(keys, packed) if not p],
                       rows[~np.asarray(packed, bool)])
    by_row: dict[int, np.ndarray] = {}
    for key, row, p in zip(keys, rows.tolist(), packed):
        if p:
            got[key] = by_row[row] if row in by_row else by_row.setdefault(
                row, get_one(shards, key))
    return {k: got[k] for k in keys}


def _get_tensors(shards: ShardSet, keys: Sequence[str] | None, rows: np.ndarray | None = None
                 ) -> dict[str, np.ndarray]:
    """`get_tensors` of tensors of no `PACKED` dtype."""
    index = shards.index
    if keys is None:
        got = _get_distinct(shards, None, None)
        if index.aliases:
            got.update(zip(index.aliases, map(got.__getitem__, index.aliases.values())))
        return got
    keys = list(keys)
    if rows is None:
        try:
            rows = np.fromiter(map(index.rows().__getitem__, keys), np.intp, len(keys))
        except (KeyError, TypeError):
            for key in keys:
                shards.tensor(key)  # raises KeyNotFoundError, with a hint
            raise
    if not len(rows) or np.bincount(rows).max() == 1:
        return _get_distinct(shards, keys, rows)
    first = np.sort(np.unique(rows, return_index=True)[1])  # each row read once
    got = _get_distinct(shards, [keys[i] for i in first.tolist()], rows[first])
    by_row = dict(zip(rows[first].tolist(), got.values()))
    return dict(zip(keys, map(by_row.__getitem__, rows.tolist())))


def _get_distinct(shards: ShardSet, keys: list[str] | None, picked: np.ndarray | None
                  ) -> dict[str, np.ndarray]:
    """`get_tensors` of `keys` of distinct index rows `picked` (None: every stored tensor)."""
    index = shards.index
    views = _get_whole(shards, keys, picked)
    if views is not None:
        return views
    if keys is None or picked is None:
        keys = index.keys
        picked = np.arange(len(keys))
    shards.check_open()
    results: list[Any] = [None] * len(keys)
    counts = index.slice_counts()[picked].tolist()
    firsts = index.first_slice()[picked].tolist()
    in_shard = list(map(index.slice_shard.__getitem__, firsts))
    whole = [i for i, c in enumerate(counts) if c == 1]
    whole.sort(key=in_shard.__getitem__)  # stable: by shard, then in the order asked
    dtype_names = list(map(index.dtypes.__getitem__, picked.tolist()))
    dtypes = {name: numpy_dtype(name) for name in set(dtype_names)}
    entry_names = index.entry_names()
    slice_shapes = index.slice_shapes()
    jobs: list[ReadJob] = []
    for shard, group in groupby(whole, key=in_shard.__getitem__):
        idx = list(group)
        src = shards.source_for(keys[idx[0]], shard)
        slice_ids = list(map(firsts.__getitem__, idx))
        dts = list(map(dtypes.__getitem__, map(dtype_names.__getitem__, idx)))
        shapes = list(map(slice_shapes.__getitem__, slice_ids))
        arrays = src.whole_arrays(_begins(shards, src, shard, slice_ids), dts, shapes,
                                  partial(run_reads, shards))
        if arrays is not None:
            for i, a in zip(idx, arrays):
                results[i] = a
            continue
        for i, j, dtype, shape in zip(idx, slice_ids, dts, shapes):  # decoded: in one batch
            entry = src.entries[entry_names[j]]  # checked on open
            results[i] = a = np.empty(shape, dtype)
            if entry.nbytes:
                jobs.append((src, entry, 0, entry.nbytes, bytes_of(a)))
    read_jobs(shards, jobs)
    for i, c in enumerate(counts):
        if c > 1:
            results[i] = get_one(shards, keys[i])
    return dict(zip(keys, results))


def _get_whole(shards: ShardSet, keys: list[str] | None, rows: np.ndarray | None
               ) -> dict[str, np.ndarray] | None:
    """The tensors `keys` (distinct, at index `rows`; None: every tensor), when every
    tensor is stored whole in a raw shard: views of the maps (or arrays read in runs, with
    ``mmap=False``) made shard by shard, in data-region order, straight from the index
    columns; the dict is in the order asked. None otherwise (the general path decides)."""
    index = shards.index
    if len(index.slice_tensor) != len(index.keys) or any(index.slice_spec):
        return None
    shards.check_open()
    numbers = range(len(index.shards))
    if rows is None:
        keys, slice_rows, at = index.keys, index.slice_tensor, index.slice_tensor
        ids: Sequence[int] = range(len(slice_rows))  # the slices read, shard by shard
        ends = [index.shard_range(shard).stop for shard in numbers]
    else:
        assert keys is not None
        firsts = index.first_slice()[rows]  # a tensor's one stored slice
        order = np.argsort(firsts, kind="stable")
        sorted_ids = firsts[order]
        ends = np.searchsorted(sorted_ids, [index.shard_range(s).stop for s in numbers]
                               ).tolist()
        ids, slice_rows, at = sorted_ids.tolist(), rows[order].tolist(), order.tolist()
    results: list[Any] = [None] * len(keys)
    dtypes = {name: numpy_dtype(name) for name in set(index.dtypes)}
    slice_shapes = index.slice_shapes()

    lo = 0
    for shard, hi in zip(numbers, ends):
        if lo == hi:
            continue
        part = slice_rows[lo:hi]  # the tensor rows read from this shard
        src = shards.source_for(index.keys[part[0]], shard)
        begins = _begins(shards, src, shard, ids[lo:hi])
        dts = ([*dtypes.values()] * len(part) if len(dtypes) == 1
               else list(map(dtypes.__getitem__, map(index.dtypes.__getitem__, part))))
        shapes = (slice_shapes[lo:hi] if rows is None
                  else list(map(slice_shapes.__getitem__, ids[lo:hi])))
        views = src.whole_arrays(begins, dts, shapes, partial(run_reads, shards))
        if views is None:  # a decoded shard: the general path reads every shard in one batch
            return None
        where = at[lo:hi]  # the views' places in `results`
        if where[0] == lo and where[-1] == hi - 1 and where == list(range(lo, hi)):
            results[lo:hi] = views
        else:
            for i, view in zip(where, views):
                results[i] = view
        lo = hi
    return dict(zip(keys, results))


def _begins(shards: ShardSet, src: ShardSource, shard: int, slice_ids: Sequence[int]
            ) -> list[int]:
    """Where the entries of stored slices `slice_ids` (all in `shard`) start."""
    if src.begins is not None:  # the header matched the index: offsets by position
        lo = shards.index.shard_range(shard).start
        if isinstance(slice_ids, range) and slice_ids == range(lo, lo + len(src.begins)):
            return src.begins
        if lo:
            slice_ids = [j - lo for j in slice_ids]
        return list(map(src.begins.__getitem__, slice_ids))
    names = shards.index.entry_names()
    return [src.entries[names[j]].begin for j in slice_ids]


def get_one(shards: ShardSet, key: str) -> np.ndarray:
    """The whole tensor `key`, assembled from its stored slices."""
    t = shards.tensor(key)
    dtype = numpy_dtype(t.dtype)
    if t.dtype in PACKED:  # two elements a byte: unpacked into a new array, also from a map
        return get_slice(shards, key, ())
    if len(t.slices) == 1:  # spec "" or a box covering the whole tensor (tiling checked)
        src, entry = shards.entry(key, t.slices[0])
        return whole_entry(shards, src, entry, dtype, t.shape)
    out = np.empty(t.shape, dtype)
    jobs: list[ReadJob] = []
    later: list[tuple[Any, Any, np.ndarray, tuple[int, ...]]] = []
    for s, spec in zip(t.slices, shards.slice_specs(key, t)):
        src, entry = shards.entry(key, s)
        if entry.nbytes == 0:
            continue
        target = out[spec.to_index()]
        if target.flags.c_contiguous:  # e.g. split along axis 0: straight into `out`
            jobs.append((src, entry, 0, entry.nbytes, bytes_of(target)))
            continue
        view = src.view(entry, 0, entry.nbytes)
        if view is not None:
            target[...] = np.frombuffer(view, dtype).reshape(spec.shape)
        else:
            later.append((src, entry, target, spec.shape))
    read_jobs(shards, jobs)
    for src, entry, target, shape in later:
        # staged through one buffer of about READ_CHUNK bytes (whole rows of the stored
        # slice, contiguous in the entry), never a copy of the whole slice
        row = entry.nbytes // shape[0]
        step = max(1, READ_CHUNK // row)
        tmp = np.empty((min(step, shape[0]), *shape[1:]), dtype)
        for r0 in range(0, shape[0], step):
            r1 = min(shape[0], r0 + step)
            part = tmp[: r1 - r0]
            read_jobs(shards, [(src, entry, r0 * row, r1 * row, bytes_of(part))])
            target[r0:r1] = part
    return out


def read_direct(shards: ShardSet, targets: Sequence[tuple[str, np.ndarray]]) -> set[str]:
    """Decode or read whole tensors of shards that are not mapped (compressed, read by pread
    or from a store) straight into their target arrays (C-contiguous, writable, the stored
    dtype), in one parallel batch; returns those keys. The other keys are left to the caller
    (a mapped shard's view is copied)."""
    done: set[str] = set()
    jobs: list[ReadJob] = []
    for key, target in targets:
        t = shards.tensor(key)
        if (len(t.slices) > 1 or t.dtype in PACKED or not target.flags.c_contiguous
                or not target.flags.writeable or target.dtype != numpy_dtype(t.dtype)):
            continue
        src, entry = shards.entry(key, t.slices[0])
        if src.view(entry, 0, entry.nbytes) is not None:
            continue  # a map: its view is copied by the caller
        if entry.nbytes:
            jobs.append((src, entry, 0, entry.nbytes, bytes_of(target)))
        done.add(key)
    read_jobs(shards, jobs)
    return done
