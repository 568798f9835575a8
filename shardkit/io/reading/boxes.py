"""Parts of tensors: `get_slice`'s numpy basic index, and boxes read into callers' arrays
(restores), each touching only the bytes of the stored slices that intersect it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import InvalidArgumentError
from ...format import SliceInfo
from ...values.dtypes import PACKED, numpy_dtype
from ...values.nibbles import unpack
from ...values.slices import SliceSpec
from ...values.slicing import (
    MAX_PIECES,
    byte_span,
    c_strides,
    normalize_index,
    plan_piece,
    refine,
    span_shape,
)
from .jobs import ReadJob, as_view, bytes_of, copy_pieces, read_jobs
from .shards import ShardSet

MANY_BOXES = 64  # box reads of more tensors than this build the index's TensorInfos in bulk


def get_slice(shards: ShardSet, key: str, index: Any) -> np.ndarray:
    """``tensor[index]`` of the stored tensor `key`: a view of the map when it comes from one
    raw entry of a mapped shard, else a new array."""
    t = shards.tensor(key)
    dtype = numpy_dtype(t.dtype)
    ranges, final_shape = normalize_index(index, t.shape, key)
    box_shape = tuple(len(r) for r in ranges)
    if math.prod(box_shape) == 0:
        return np.empty(final_shape, dtype)
    if t.dtype in PACKED:
        return _get_packed(shards, key, t, dtype, ranges, box_shape).reshape(final_shape)
    item = dtype.itemsize
    pieces: list[tuple[tuple[slice, ...], np.ndarray, bool]] = []
    jobs: list[ReadJob] = []
    for s, spec in zip(t.slices, shards.slice_specs(key, t)):
        plan = plan_piece(ranges, spec)
        if plan is None:
            continue
        strides = c_strides(spec.shape, item)
        src, entry = shards.entry(key, s)
        out_index, lo, hi, local = plan
        b0, b1 = byte_span(lo, hi, strides, item)
        view = src.view(entry, b0, b1)
        # always a view, also of a 0-d box: ``box[()]`` would copy a scalar out of the
        # buffer now, before the read below fills it
        if view is not None:  # mapped: only the pages touched are ever read
            box = np.ndarray(span_shape(lo, hi), dtype, buffer=view, strides=strides)
            pieces.append((out_index, box[as_view(local)], True))
            continue
        for out_index, lo, hi, local in refine(plan, strides, item, [MAX_PIECES]):
            b0, b1 = byte_span(lo, hi, strides, item)
            buf = np.empty(b1 - b0, np.uint8)
            jobs.append((src, entry, b0, b1, buf.data))
            box = np.ndarray(span_shape(lo, hi), dtype, buffer=buf, strides=strides)
            pieces.append((out_index, box[as_view(local)], False))
    read_jobs(shards, jobs)
    if len(pieces) == 1 and pieces[0][2] and pieces[0][1].shape == box_shape:
        return pieces[0][1].reshape(final_shape)
    out = np.empty(box_shape, dtype)
    for out_index, piece, _ in pieces:
        out[out_index] = piece
    return out.reshape(final_shape)


def _get_packed(shards: ShardSet, key: str, t: Any, dtype: np.dtype, ranges: list[range],
                box_shape: tuple[int, ...]) -> np.ndarray:
    """`get_slice` of a tensor of a `PACKED` dtype (two elements a byte): of each stored slice
    it intersects, the bytes that hold its span of elements (from the byte of the first, so a
    span that starts at an odd element starts in a high nibble), unpacked into a new array.
    A source whose entries hold one element a byte (not `packed`: TensorFlow's bundle) gives
    the span's bytes as they are."""
    out = np.empty(box_shape, dtype)
    pieces: list[tuple[tuple[slice, ...], tuple[slice, ...], Any, int, int, tuple[int, ...],
                       tuple[int, ...]]] = []
    jobs: list[ReadJob] = []
    for s, spec in zip(t.slices, shards.slice_specs(key, t)):
        plan = plan_piece(ranges, spec)
        if plan is None:
            continue
        out_index, lo, hi, local = plan
        strides = c_strides(spec.shape, 1)  # in elements (one a byte once unpacked)
        e0, e1 = byte_span(lo, hi, strides, 1)  # the elements [e0, e1) of the stored slice
        src, entry = shards.entry(key, s)
        packed = getattr(src, "packed", True)  # a codec of its own may not say
        b0, b1 = (e0 // 2, (e1 + 1) // 2) if packed else (e0, e1)
        data: Any = src.view(entry, b0, b1)
        if data is None:
            data = np.empty(b1 - b0, np.uint8)
            jobs.append((src, entry, b0, b1, data.data))
        pieces.append((out_index, local, data, e0 - 2 * b0 if packed else -1, e1 - e0,
                       span_shape(lo, hi), strides))
    read_jobs(shards, jobs)
    for out_index, local, data, first, count, shape, strides in pieces:
        run = (unpack(data, dtype, (count,), first) if first >= 0
               else np.frombuffer(data, np.uint8, count).view(dtype))
        box = np.ndarray(shape, dtype, buffer=run, strides=strides)
        out[out_index] = box[as_view(local)]
    return out


def slices_in_box(shards: ShardSet, key: str, offsets: Sequence[int], lengths: Sequence[int]
                  ) -> list[tuple[int, SliceInfo, SliceSpec, SliceSpec]]:
    """The stored slices of `key` that intersect the box (`offsets`, `lengths`) of the
    full tensor: (slice number in the index, slice, its spec, the intersection)."""
    t = shards.tensor(key)
    box = SliceSpec(t.shape, tuple(offsets), tuple(lengths))
    if math.prod(box.lengths) == 0:
        return []
    ids = shards.index.slices_of()[shards.index.row(key)]
    out = []
    for j, s, spec in zip(ids, t.slices, shards.slice_specs(key, t)):
        common = spec.intersect(box)
        if common is not None:
            out.append((j, s, spec, common))
    return out


def read_boxes_into(shards: ShardSet, boxes: Sequence[tuple[str, Sequence[int], np.ndarray]]
                    ) -> None:
    """For each (key, offsets, out): fill `out` (writable, the stored dtype) with the box of
    the full tensor `key` that starts at `offsets` and has `out`'s shape, reading only the
    stored slices that intersect it, and of each only the bytes inside the box.

    A piece that is one run of bytes in its entry and in `out` (a split along axis 0 read
    back along axis 0) is one read straight into `out` (a copy from the map, or a pread);
    any other piece of a mapped shard is one strided copy from the map. The reads and copies
    of all boxes run together, on the read pool when large (numpy's copies and preadv
    release the GIL)."""
    jobs: list[ReadJob] = []
    copies: list[tuple[np.ndarray, np.ndarray]] = []
    rest: list[tuple[np.ndarray, str, SliceSpec]] = []
    if len(boxes) > MANY_BOXES:
        _ = shards.index.tensors  # every TensorInfo at once, not one by one per box
    for key, offsets, out in boxes:
        _plan_box(shards, key, tuple(int(o) for o in offsets), out, jobs, copies, rest)
    read_jobs(shards, jobs)  # small ones as one task per source: a pool task costs more
    copy_pieces(shards, copies)
    for dst, key, common in rest:  # compressed, or not mapped: get_slice's reads
        dst[...] = get_slice(shards, key, common.to_index())


def _plan_box(shards: ShardSet, key: str, start: tuple[int, ...], out: np.ndarray,
              jobs: list[ReadJob], copies: list[tuple[np.ndarray, np.ndarray]],
              rest: list[tuple[np.ndarray, str, SliceSpec]]) -> None:
    t = shards.tensor(key)
    dtype = numpy_dtype(t.dtype)
    if out.dtype != dtype:
        raise InvalidArgumentError(
            f"{key!r}: a box read needs a {dtype} array, got {out.dtype}")
    if t.dtype in PACKED:  # no byte of a map is an element: get_slice's reads and unpacking
        rest.append((out, key, SliceSpec(t.shape, start, out.shape)))
        return
    if len(t.slices) == 1 and out.shape == t.shape and not any(start):
        # the usual whole tensor in one entry: no box arithmetic
        src, entry = shards.entry(key, t.slices[0])
        if not entry.nbytes:
            return
        if out.flags.c_contiguous:
            jobs.append((src, entry, 0, entry.nbytes, bytes_of(out)))
            return
        view = src.view(entry, 0, entry.nbytes)
        if view is not None:
            copies.append((out, np.frombuffer(view, dtype).reshape(t.shape)))
        else:
            rest.append((out, key, SliceSpec.whole(t.shape)))
        return
    item = dtype.itemsize
    for _, s, spec, common in slices_in_box(shards, key, start, out.shape):
        dst = out[as_view(tuple(slice(o - b, o - b + n)
                                for o, b, n in zip(common.offsets, start, common.lengths)))]
        lo = [o - so for o, so in zip(common.offsets, spec.offsets)]
        hi = [a + n - 1 for a, n in zip(lo, common.lengths)]
        strides = c_strides(spec.shape, item)
        b0, b1 = byte_span(lo, hi, strides, item)
        src, entry = shards.entry(key, s)
        if b1 - b0 == common.size * item and dst.flags.c_contiguous:
            jobs.append((src, entry, b0, b1, bytes_of(dst)))
            continue
        view = src.view(entry, b0, b1)
        if view is not None:
            copies.append((dst, np.ndarray(common.lengths, dtype, buffer=view,
                                           strides=strides)))
        else:
            rest.append((dst, key, common))
