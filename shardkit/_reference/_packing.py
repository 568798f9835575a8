"""Pure-Python twin of shardkit._kernels._packing: the planning cores of the packing policies.

Every function returns int64 numpy arrays and gives results identical to the compiled kernel.

- `max_shard_fill`: TensorFlow's MaxShardSizePolicy fill (tensors in order, a tensor that does
  not fit the space left is split along the axis that needs the fewest partitions), made total:
  where TensorFlow would loop forever, the stuck part is cut into thinner slabs (see the function).
- `first_fit`: first fit in a given order (first-fit-decreasing when the order sorts by size).
- `next_fit`: sequential fill without splitting, the baseline packing.
- `lpt`: longest-processing-time-first onto the lightest of k bins.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from ._sizes import _INT64_MAX
from ._sizes import check_csr as _check_csr


def _check_sizes(sizes: np.ndarray) -> None:
    for i in range(sizes.shape[0]):
        if sizes[i] < 0:
            raise ValueError(f"item {i}: negative size {int(sizes[i])}")


def _check_order(order: np.ndarray, n: int) -> None:
    if order.shape[0] != n:
        raise ValueError(f"order must have one entry per item ({n}), got {order.shape[0]}")
    seen = bytearray(n)
    for p in range(n):
        j = int(order[p])
        if j < 0 or j >= n or seen[j]:
            raise ValueError(
                f"order is not a permutation of 0..{n - 1}: entry {j} at position {p}"
            )
        seen[j] = 1


def first_fit(sizes: np.ndarray, order: np.ndarray, capacity: int) -> np.ndarray:
    """Bin id per item: each item, in `order`, goes into the lowest-numbered bin it fits.

    Bins hold `capacity` bytes. Items larger than `capacity` get a bin of their own each, numbered
    after all the others in the order they are met. Bin ids are dense: 0..bins-1, none empty.
    """
    n = sizes.shape[0]
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    _check_sizes(sizes)
    _check_order(order, n)
    # Max-tree over the free space of n bins (a bin not yet opened has `capacity` free): the
    # lowest bin with room for s is found by walking down from the root, always left if it can.
    leaves = 1
    while leaves < max(n, 1):
        leaves *= 2
    tree = [capacity] * (2 * leaves)
    out = np.empty(n, dtype=np.int64)
    bins = 0
    oversized: list[int] = []
    for p in range(n):
        j = int(order[p])
        s = int(sizes[j])
        if s > capacity:
            oversized.append(j)
            continue
        node = 1
        while node < leaves:
            node = 2 * node if tree[2 * node] >= s else 2 * node + 1
        b = node - leaves
        tree[node] -= s
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
        out[j] = b
        bins = max(bins, b + 1)
    for k, j in enumerate(oversized):
        out[j] = bins + k
    return out


def next_fit(sizes: np.ndarray, order: np.ndarray, capacity: int) -> np.ndarray:
    """Bin id per item: items in `order` fill the current bin; one that does not fit opens the next.

    Items larger than `capacity` get a bin of their own each, numbered after all the others.
    """
    n = sizes.shape[0]
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    _check_sizes(sizes)
    _check_order(order, n)
    out = np.empty(n, dtype=np.int64)
    current, free, used = 0, capacity, False
    oversized: list[int] = []
    for p in range(n):
        j = int(order[p])
        s = int(sizes[j])
        if s > capacity:
            oversized.append(j)
            continue
        if s > free:
            current += 1
            free = capacity
        out[j] = current
        free -= s
        used = True
    bins = current + 1 if used else 0
    for k, j in enumerate(oversized):
        out[j] = bins + k
    return out


def lpt(sizes: np.ndarray, order: np.ndarray, num_bins: int) -> np.ndarray:
    """Bin id per item: the first min(num_bins, n) items in `order` open bins 0, 1, ...; every
    later item goes onto the bin with the smallest load (ties: lowest bin id).

    With `order` sorting by decreasing size this is Graham's LPT rule. Every bin used is non-empty.
    """
    n = sizes.shape[0]
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    _check_sizes(sizes)
    _check_order(order, n)
    total = 0
    for i in range(n):
        total += int(sizes[i])
        if total > _INT64_MAX:
            raise OverflowError(f"item {i}: the running total of sizes overflows int64")
    out = np.empty(n, dtype=np.int64)
    m = min(num_bins, n)
    heap = []
    for p in range(m):
        j = int(order[p])
        out[j] = p
        heap.append((int(sizes[j]), p))
    heapq.heapify(heap)
    for p in range(m, n):
        j = int(order[p])
        load, b = heap[0]
        out[j] = b
        heapq.heapreplace(heap, (load + int(sizes[j]), b))
    return out


class _Fill:
    """The state of a max_shard_fill run: current shard, bytes left in it, pieces emitted."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self.remaining = max_size
        self.shard = 0
        self.any_regular = False
        self.nlarge = 0
        self.tensor: list[int] = []
        self.shard_of: list[int] = []
        self.geom: list[int] = []

    def emit(self, i: int, offsets: list[int], lengths: list[int]) -> None:
        self.tensor.append(i)
        self.shard_of.append(self.shard)
        self.geom.extend(offsets)
        self.geom.extend(lengths)
        self.any_regular = True

    def emit_large(self, i: int, offsets: list[int], lengths: list[int]) -> None:
        self.tensor.append(i)
        self.shard_of.append(-1 - self.nlarge)
        self.geom.extend(offsets)
        self.geom.extend(lengths)
        self.nlarge += 1


def _prod(xs: list[int]) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def _next_partition(work: list[int], d: int, remaining: int) -> tuple[int, int]:
    """TensorFlow's choice: (axis, slab thickness) of the axis needing the fewest partitions so
    that one slab fits `remaining`; thickness 0 when no slab along any single axis fits."""
    num = _prod(work)
    best_axis, best_parts = 0, math.inf
    for axis, length in enumerate(work):
        per_slice = (num // length) * d
        slices = remaining // per_slice
        parts = math.inf if slices == 0 else -(-length // slices)
        if parts < best_parts:  # strict: ties keep the lower axis
            best_axis, best_parts = axis, parts
    if best_parts == math.inf:
        return 0, 0
    return best_axis, -(-work[best_axis] // int(best_parts))


def _place_box(st: _Fill, i: int, d: int, off: list[int], shape: list[int]) -> None:
    """TensorFlow's fill loop over the box `off`, `shape` (offsets relative to the tensor)."""
    r = len(shape)
    rel = [0] * r
    work = list(shape)
    wsize = _prod(work) * d
    while wsize > st.remaining:
        axis, part = _next_partition(work, d, st.remaining)
        if part == 0:
            if st.remaining < st.max_size:
                st.shard += 1
                st.remaining = st.max_size
                continue
            # Even an empty shard cannot take one slab along any single axis: TensorFlow loops
            # forever here. Cut a slab of thickness 1 off the first axis longer than 1 and fill
            # it recursively (its own single-axis slabs are thinner), then go on with the rest.
            a = next(b for b in range(r) if work[b] > 1)
            slab = list(work)
            slab[a] = 1
            _place_box(st, i, d, [o + x for o, x in zip(off, rel)], slab)
            rel[a] += 1
            work[a] = shape[a] - rel[a]
            wsize = _prod(work) * d
            continue
        piece = list(work)
        piece[axis] = part
        st.emit(i, [o + x for o, x in zip(off, rel)], piece)
        st.remaining -= _prod(piece) * d
        if st.remaining == 0:
            st.shard += 1
            st.remaining = st.max_size
        rel[axis] += part
        work[axis] = shape[axis] - rel[axis]
        wsize = _prod(work) * d
    if wsize > 0:
        st.emit(i, [o + x for o, x in zip(off, rel)], work)
        st.remaining -= wsize


def max_shard_fill(
    indptr: np.ndarray, dims: np.ndarray, itemsizes: np.ndarray, max_shard_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Plan TensorFlow's MaxShardSizePolicy over tensors with shapes in CSR form.

    Returns ``(piece_tensor, piece_shard, piece_geom, num_regular)``: one entry per piece in the
    order TensorFlow creates them; the geometry of a piece of a rank-r tensor is 2r numbers in
    `piece_geom` (offsets, then lengths, relative to the tensor). Shards ``0..num_regular-1`` are
    the filled ones; every piece that exceeds the maximum on its own (a scalar, or one element of
    a tensor whose item size exceeds it) gets a shard of its own after those, in order.

    Where TensorFlow does not return (no single-axis slab of the rest of a tensor fits an empty
    shard), a slab of thickness 1 is cut off the first axis longer than 1 and filled first, which
    in turn may cut its own slabs: every shard stays within the maximum. Zero-element tensors
    (which TensorFlow drops) go whole into the current shard.
    """
    n = itemsizes.shape[0]
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size must be >= 1, got {max_shard_size}")
    _check_csr(indptr, dims, n)
    st = _Fill(int(max_shard_size))
    for i in range(n):
        shape = [int(x) for x in dims[indptr[i] : indptr[i + 1]]]
        d = int(itemsizes[i])
        r = len(shape)
        if d < 0:
            raise ValueError(f"item {i}: negative item size {d}")
        for axis, x in enumerate(shape):
            if x < 0:
                raise ValueError(f"item {i}: negative dimension {x} on axis {axis}")
        total = _prod(shape) * d
        if total > _INT64_MAX:
            raise OverflowError(f"item {i}: {d} bytes x shape {shape} overflows int64")
        if r == 0:
            if d > st.max_size:
                st.emit_large(i, [], [])
            else:
                if d > st.remaining:
                    st.shard += 1
                    st.remaining = st.max_size
                st.emit(i, [], [])
                st.remaining -= d
            continue
        if total == 0:
            st.emit(i, [0] * r, shape)
            continue
        if d > st.max_size:
            # Not even one element fits a shard: every element alone, in C order.
            for flat in range(_prod(shape)):
                idx = []
                for x in reversed(shape):
                    idx.append(flat % x)
                    flat //= x
                st.emit_large(i, idx[::-1], [1] * r)
            continue
        _place_box(st, i, d, [0] * r, shape)
    regular = st.shard + 1 if st.any_regular else 0
    shard_of = [s if s >= 0 else regular - 1 - s for s in st.shard_of]
    return (
        np.array(st.tensor, dtype=np.int64),
        np.array(shard_of, dtype=np.int64),
        np.array(st.geom, dtype=np.int64),
        regular,
    )
