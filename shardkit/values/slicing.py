"""Index arithmetic for get_slice: which bytes of which stored slice a numpy basic index needs.

Pure functions, no I/O: `normalize_index` turns an index into per-axis ranges, `plan_piece`
intersects them with one stored slice, `refine` cuts a mostly-gap span into several reads.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import SliceIndexError
from .slices import SliceSpec


def c_strides(shape: tuple[int, ...], item: int) -> tuple[int, ...]:
    strides = []
    acc = item
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def normalize_index(
    index: Any, shape: tuple[int, ...], key: str
) -> tuple[list[range], tuple[int, ...]]:
    """Per-axis ranges of a basic index and the shape of the result."""
    items = list(index) if isinstance(index, tuple) else [index]
    n_ellipsis = sum(1 for it in items if it is Ellipsis)
    if n_ellipsis > 1:
        raise SliceIndexError(f"{key!r}: an index can only have a single ellipsis ('...')")
    n_axes = sum(1 for it in items if it is not None and it is not Ellipsis)
    if n_axes > len(shape):
        raise SliceIndexError(
            f"{key!r}: too many indices: {n_axes} for a tensor of shape {list(shape)}"
        )
    if n_ellipsis == 0:
        items.append(Ellipsis)
    ranges: list[range] = []
    final: list[int] = []
    axis = 0
    for it in items:
        if it is None:
            final.append(1)
        elif it is Ellipsis:
            for _ in range(len(shape) - n_axes):
                ranges.append(range(shape[axis]))
                final.append(shape[axis])
                axis += 1
        elif isinstance(it, slice):
            r = range(*it.indices(shape[axis]))
            ranges.append(r)
            final.append(len(r))
            axis += 1
        elif isinstance(it, (int, np.integer)) and not isinstance(it, (bool, np.bool_)):
            dim, i = shape[axis], int(it)
            if not -dim <= i < dim:
                raise SliceIndexError(
                    f"{key!r}: index {i} is out of bounds for axis {axis} with size {dim}"
                )
            i %= dim
            ranges.append(range(i, i + 1))
            axis += 1
        else:
            raise SliceIndexError(
                f"{key!r}: get_slice takes basic indices only (ints, slices, ..., None), "
                f"got {type(it).__name__} {it!r}"
            )
    return ranges, tuple(final)


def positions(r: range, lo: int, hi: int) -> tuple[int, int]:
    """The positions p (an interval) of `r` whose values r[p] lie in [lo, hi)."""
    n, start, step = len(r), r.start, r.step
    if step > 0:
        p0 = -((start - lo) // step)  # ceil((lo - start) / step)
        p1 = -((start - hi) // step)
    else:
        s = -step
        p0 = (start - hi) // s + 1
        p1 = (start - lo) // s + 1
    return max(0, p0), min(n, p1)


Plan = tuple[tuple[slice, ...], list[int], list[int], tuple[slice, ...]]
MAX_PIECES = 4096  # most separate reads one get_slice call makes to avoid reading gaps
_GAP_MIN = 1024 * 1024  # spans up to this size are read whole, gaps and all


def byte_span(lo: list[int], hi: list[int], strides: tuple[int, ...], item: int
               ) -> tuple[int, int]:
    """Byte range, relative to the entry, from element `lo` to element `hi` inclusive."""
    b0 = sum(i * st for i, st in zip(lo, strides))
    return b0, sum(i * st for i, st in zip(hi, strides)) + item


def span_shape(lo: list[int], hi: list[int]) -> tuple[int, ...]:
    return tuple(h - low + 1 for low, h in zip(lo, hi))


def refine(plan: Plan, strides: tuple[int, ...], item: int, budget: list[int]) -> list[Plan]:
    """Split a piece along its outermost axis with several selected indices when its byte span
    is mostly gaps (more than 8x the needed bytes and over 1 MiB), one read per index, within
    a budget of reads; applied recursively to the parts."""
    out_index, lo, hi, local = plan
    b0, b1 = byte_span(lo, hi, strides, item)
    counts = [len(range(*sl.indices(h - low + 1))) for sl, low, h in zip(local, lo, hi)]
    needed = math.prod(counts) * item
    if b1 - b0 <= max(_GAP_MIN, 8 * needed):
        return [plan]
    axis = next((k for k, c in enumerate(counts) if c > 1), None)
    if axis is None or counts[axis] > budget[0]:
        return [plan]
    budget[0] -= counts[axis]
    sl = local[axis]
    start, step = sl.indices(hi[axis] - lo[axis] + 1)[0], sl.step or 1
    out_start = out_index[axis].start
    parts: list[Plan] = []
    for i in range(counts[axis]):
        at = lo[axis] + start + i * step  # element index along `axis` in the stored slice
        o, l2, h2, loc = list(out_index), list(lo), list(hi), list(local)
        o[axis] = slice(out_start + i, out_start + i + 1)
        l2[axis] = h2[axis] = at
        loc[axis] = slice(0, 1)
        parts.extend(refine((tuple(o), l2, h2, tuple(loc)), strides, item, budget))
    return parts


def plan_piece(ranges: list[range], spec: SliceSpec) -> Plan | None:
    """How one stored slice contributes: (index into the output box, lowest and highest local
    element touched per axis, index into the dense local span box), or None if disjoint."""
    out_index, lo, hi, local = [], [], [], []
    for r, off, length in zip(ranges, spec.offsets, spec.lengths):
        p0, p1 = positions(r, off, off + length)
        if p0 >= p1:
            return None
        sub = r[p0:p1]
        first, last = sub[0] - off, sub[-1] - off
        low, high = min(first, last), max(first, last)
        out_index.append(slice(p0, p1))
        lo.append(low)
        hi.append(high)
        start = first - low
        stop = start + (len(sub) - 1) * sub.step + (1 if sub.step > 0 else -1)
        local.append(slice(start, stop if stop >= 0 else None, sub.step))
    return tuple(out_index), lo, hi, tuple(local)
