"""Planning cores of the packing policies: which piece of which tensor goes into which shard.

- `max_shard_fill`: TensorFlow's MaxShardSizePolicy fill, made total (see its docstring).
- `first_fit`: first fit in a given order, O(n log n) with a max-tree over the bins' free space.
- `next_fit`: sequential fill without splitting (the baseline).
- `lpt`: each item onto the lightest of k bins, with a binary heap.

Inputs are const int64 memoryviews (read-only buffers work); every loop runs without the GIL.
Results and error messages match the pure-Python twin in shardkit._reference._packing exactly.
"""

from libc.stdint cimport INT64_MAX, int64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy

import numpy as np

cdef enum:
    OK = 0
    BAD_SIZE = 1
    BAD_ORDER = 2
    NEG_ITEMSIZE = 3
    NEG_DIM = 4
    OVERFLOW = 5
    NO_MEMORY = 6


# ---------------------------------------------------------------------------------------------
# Shared checks

cdef Py_ssize_t _first_negative(const int64_t[::1] sizes) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(sizes.shape[0]):
        if sizes[i] < 0:
            return i
    return -1


cdef Py_ssize_t _bad_order(const int64_t[::1] order, Py_ssize_t n, char* seen) noexcept nogil:
    """-1 if `order` is a permutation of 0..n-1, else the first position where it is not."""
    cdef Py_ssize_t p
    cdef int64_t j
    for p in range(n):
        j = order[p]
        if j < 0 or j >= n or seen[j]:
            return p
        seen[j] = 1
    return -1


cdef void _check_items(const int64_t[::1] sizes, const int64_t[::1] order) except *:
    cdef Py_ssize_t n = sizes.shape[0], bad
    with nogil:
        bad = _first_negative(sizes)
    if bad >= 0:
        raise ValueError(f"item {bad}: negative size {sizes[bad]}")
    if order.shape[0] != n:
        raise ValueError(f"order must have one entry per item ({n}), got {order.shape[0]}")
    cdef char* seen = <char*>calloc(n + 1, 1)
    if seen == NULL:
        raise MemoryError()
    with nogil:
        bad = _bad_order(order, n, seen)
    free(seen)
    if bad >= 0:
        raise ValueError(
            f"order is not a permutation of 0..{n - 1}: entry {order[bad]} at position {bad}"
        )


cdef void _check_csr(
    const int64_t[::1] indptr, const int64_t[::1] dims, Py_ssize_t n
) except *:
    cdef Py_ssize_t i, bad = -1
    if indptr.shape[0] != n + 1:
        raise ValueError(f"indptr must have {n + 1} entries (items + 1), got {indptr.shape[0]}")
    if indptr[0] != 0:
        raise ValueError(f"indptr[0] must be 0, got {indptr[0]}")
    with nogil:
        for i in range(1, n + 1):
            if indptr[i] < indptr[i - 1] or indptr[i] > dims.shape[0]:
                bad = i
                break
    if bad >= 0:
        raise ValueError(
            f"indptr[{bad}] = {indptr[bad]} is out of order or past the {dims.shape[0]} dims"
        )


cdef object _new_array(Py_ssize_t n):
    return np.empty(n, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# first_fit, next_fit, lpt

def first_fit(const int64_t[::1] sizes, const int64_t[::1] order, int64_t capacity):
    """Bin id per item: each item, in `order`, goes into the lowest-numbered bin it fits.

    Bins hold `capacity` bytes. Items larger than `capacity` get a bin of their own each, numbered
    after all the others in the order they are met. Bin ids are dense: 0..bins-1, none empty.
    """
    cdef Py_ssize_t n = sizes.shape[0]
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    _check_items(sizes, order)
    result = _new_array(n)
    cdef int64_t[::1] out = result
    # First fit leaves at most one bin at most half full, so it opens fewer than
    # 2 * total / capacity + 1 bins: a tree over that many leaves (not n) stays in cache.
    cdef Py_ssize_t i, need = n, leaves = 1
    cdef int64_t fitting = 0
    with nogil:
        for i in range(n):
            if sizes[i] <= capacity:
                fitting += sizes[i]
                if fitting > INT64_MAX // 4:
                    break
        if fitting <= INT64_MAX // 4 and 2 * (fitting // capacity) + 2 < need:
            need = 2 * (fitting // capacity) + 2
        while leaves < need:
            leaves *= 2
    cdef int64_t* tree = <int64_t*>malloc(2 * leaves * sizeof(int64_t))
    cdef int64_t* oversized = <int64_t*>malloc((n + 1) * sizeof(int64_t))
    if tree == NULL or oversized == NULL:
        free(tree)
        free(oversized)
        raise MemoryError()
    cdef Py_ssize_t p, node, k, nover = 0
    cdef int64_t j, s, bins = 0, left, right, best
    try:
        with nogil:
            for node in range(2 * leaves):
                tree[node] = capacity
            for p in range(n):
                j = order[p]
                s = sizes[j]
                if s > capacity:
                    oversized[nover] = j
                    nover += 1
                    continue
                # The root holds the most free space of all bins, and a bin never opened has
                # `capacity` free, so the walk down always ends at a bin with room.
                node = 1
                while node < leaves:
                    node = 2 * node if tree[2 * node] >= s else 2 * node + 1
                out[j] = node - leaves
                if node - leaves + 1 > bins:
                    bins = node - leaves + 1
                tree[node] -= s
                node >>= 1
                while node:
                    left = tree[2 * node]
                    right = tree[2 * node + 1]
                    best = left if left >= right else right
                    if tree[node] == best:
                        break
                    tree[node] = best
                    node >>= 1
            for k in range(nover):
                out[oversized[k]] = bins + k
    finally:
        free(tree)
        free(oversized)
    return result


def next_fit(const int64_t[::1] sizes, const int64_t[::1] order, int64_t capacity):
    """Bin id per item: items in `order` fill the current bin; one that does not fit opens the next.

    Items larger than `capacity` get a bin of their own each, numbered after all the others.
    """
    cdef Py_ssize_t n = sizes.shape[0]
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    _check_items(sizes, order)
    result = _new_array(n)
    cdef int64_t[::1] out = result
    cdef int64_t* oversized = <int64_t*>malloc((n + 1) * sizeof(int64_t))
    if oversized == NULL:
        raise MemoryError()
    cdef Py_ssize_t p, k, nover = 0
    cdef int64_t j, s, current = 0, free_bytes = capacity, bins
    cdef bint used = False
    try:
        with nogil:
            for p in range(n):
                j = order[p]
                s = sizes[j]
                if s > capacity:
                    oversized[nover] = j
                    nover += 1
                    continue
                if s > free_bytes:
                    current += 1
                    free_bytes = capacity
                out[j] = current
                free_bytes -= s
                used = True
            bins = current + 1 if used else 0
            for k in range(nover):
                out[oversized[k]] = bins + k
    finally:
        free(oversized)
    return result


cdef inline bint _lighter(int64_t la, int64_t ba, int64_t lb, int64_t bb) noexcept nogil:
    return la < lb or (la == lb and ba < bb)


cdef void _sift_down(int64_t* load, int64_t* bin_, Py_ssize_t m, Py_ssize_t pos) noexcept nogil:
    cdef Py_ssize_t child
    cdef int64_t l0 = load[pos], b0 = bin_[pos]
    while True:
        child = 2 * pos + 1
        if child >= m:
            break
        if child + 1 < m and _lighter(load[child + 1], bin_[child + 1], load[child], bin_[child]):
            child += 1
        if not _lighter(load[child], bin_[child], l0, b0):
            break
        load[pos] = load[child]
        bin_[pos] = bin_[child]
        pos = child
    load[pos] = l0
    bin_[pos] = b0


def lpt(const int64_t[::1] sizes, const int64_t[::1] order, int64_t num_bins):
    """Bin id per item: the first min(num_bins, n) items in `order` open bins 0, 1, ...; every
    later item goes onto the bin with the smallest load (ties: lowest bin id).

    With `order` sorting by decreasing size this is Graham's LPT rule. Every bin used is non-empty.
    """
    cdef Py_ssize_t n = sizes.shape[0]
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    _check_items(sizes, order)
    cdef Py_ssize_t i, where = -1
    cdef int64_t total = 0
    with nogil:
        for i in range(n):
            if total > INT64_MAX - sizes[i]:
                where = i
                break
            total += sizes[i]
    if where >= 0:
        raise OverflowError(f"item {where}: the running total of sizes overflows int64")
    result = _new_array(n)
    cdef int64_t[::1] out = result
    cdef Py_ssize_t m = n if n < num_bins else num_bins
    cdef int64_t* load = <int64_t*>malloc((m + 1) * sizeof(int64_t))
    cdef int64_t* bin_ = <int64_t*>malloc((m + 1) * sizeof(int64_t))
    if load == NULL or bin_ == NULL:
        free(load)
        free(bin_)
        raise MemoryError()
    cdef Py_ssize_t p
    cdef int64_t j
    try:
        with nogil:
            for p in range(m):
                j = order[p]
                out[j] = p
                load[p] = sizes[j]
                bin_[p] = p
            for p in range(m // 2 - 1, -1, -1):
                _sift_down(load, bin_, m, p)
            for p in range(m, n):
                j = order[p]
                out[j] = bin_[0]
                load[0] += sizes[j]
                _sift_down(load, bin_, m, 0)
    finally:
        free(load)
        free(bin_)
    return result


# ---------------------------------------------------------------------------------------------
# max_shard_fill

cdef struct Buf:
    int64_t* data
    Py_ssize_t size
    Py_ssize_t cap


cdef int _push(Buf* b, int64_t v) noexcept nogil:
    cdef int64_t* p
    cdef Py_ssize_t cap
    if b.size == b.cap:
        cap = 2 * b.cap if b.cap else 4096
        p = <int64_t*>realloc(b.data, cap * sizeof(int64_t))
        if p == NULL:
            return -1
        b.data = p
        b.cap = cap
    b.data[b.size] = v
    b.size += 1
    return 0


cdef object _to_array(Buf* b):
    arr = _new_array(b.size)
    cdef int64_t[::1] view = arr
    if b.size:
        memcpy(&view[0], b.data, b.size * sizeof(int64_t))
    return arr


cdef struct Fill:
    int64_t max_size
    int64_t remaining
    int64_t shard
    int64_t nlarge
    bint any_regular
    Buf tensor
    Buf shard_of
    Buf geom


cdef int _emit(
    Fill* st, Py_ssize_t i, int64_t shard, Py_ssize_t r, const int64_t* off, const int64_t* n
) noexcept nogil:
    cdef Py_ssize_t k
    if _push(&st.tensor, i) or _push(&st.shard_of, shard):
        return -1
    for k in range(r):
        if _push(&st.geom, off[k]):
            return -1
    for k in range(r):
        if _push(&st.geom, n[k]):
            return -1
    return 0


cdef inline int64_t _prod(const int64_t* x, Py_ssize_t r) noexcept nogil:
    cdef int64_t p = 1
    cdef Py_ssize_t k
    for k in range(r):
        p *= x[k]
    return p


cdef void _next_partition(
    const int64_t* work, Py_ssize_t r, int64_t d, int64_t remaining,
    Py_ssize_t* axis, int64_t* part,
) noexcept nogil:
    """TensorFlow's choice: the axis needing the fewest partitions for one slab to fit
    `remaining` (ties: lower axis) and the slab thickness; thickness 0 when none fits."""
    cdef int64_t num = _prod(work, r), length, slices, parts, best_parts = -1
    cdef Py_ssize_t a, best_axis = 0
    for a in range(r):
        length = work[a]
        slices = remaining // ((num // length) * d)
        if slices == 0:
            continue
        parts = (length - 1) // slices + 1
        if best_parts < 0 or parts < best_parts:
            best_axis = a
            best_parts = parts
    axis[0] = best_axis
    part[0] = 0 if best_parts < 0 else (work[best_axis] - 1) // best_parts + 1


cdef int _place_box(
    Fill* st, Py_ssize_t i, Py_ssize_t r, int64_t d,
    const int64_t* off, const int64_t* shape, int64_t* scratch,
) noexcept nogil:
    """TensorFlow's fill loop over one box (offsets relative to the tensor). 0, or -1 on OOM.

    `scratch` holds 4*r int64 for this call and as many again for each deeper one.
    """
    cdef int64_t* rel = scratch
    cdef int64_t* work = scratch + r
    cdef int64_t* off2 = scratch + 2 * r
    cdef int64_t* shape2 = scratch + 3 * r
    cdef Py_ssize_t b, a, axis = 0
    cdef int64_t part = 0, wsize
    for b in range(r):
        rel[b] = 0
        work[b] = shape[b]
    wsize = _prod(work, r) * d
    while wsize > st.remaining:
        _next_partition(work, r, d, st.remaining, &axis, &part)
        if part == 0:
            if st.remaining < st.max_size:
                st.shard += 1
                st.remaining = st.max_size
                continue
            # Not even an empty shard takes one slab along a single axis (TensorFlow loops
            # forever here): fill a slab of thickness 1 off the first axis longer than 1 on its
            # own, recursively, then go on with the rest.
            a = 0
            while a < r and work[a] <= 1:
                a += 1
            if a == r:
                return -2  # a single element larger than a shard; excluded by the caller
            for b in range(r):
                off2[b] = off[b] + rel[b]
                shape2[b] = work[b]
            shape2[a] = 1
            if _place_box(st, i, r, d, off2, shape2, scratch + 4 * r):
                return -1
            rel[a] += 1
            work[a] = shape[a] - rel[a]
            wsize = _prod(work, r) * d
            continue
        for b in range(r):
            off2[b] = off[b] + rel[b]
            shape2[b] = work[b]
        shape2[axis] = part
        if _emit(st, i, st.shard, r, off2, shape2):
            return -1
        st.any_regular = True
        st.remaining -= _prod(shape2, r) * d
        if st.remaining == 0:
            st.shard += 1
            st.remaining = st.max_size
        rel[axis] += part
        work[axis] = shape[axis] - rel[axis]
        wsize = _prod(work, r) * d
    if wsize > 0:
        for b in range(r):
            off2[b] = off[b] + rel[b]
        if _emit(st, i, st.shard, r, off2, work):
            return -1
        st.any_regular = True
        st.remaining -= wsize
    return 0


cdef int _fill_loop(
    Fill* st,
    const int64_t[::1] indptr,
    const int64_t* dims,
    const int64_t[::1] itemsizes,
    const int64_t* zeros,
    int64_t* ones,
    int64_t* scratch,
    Py_ssize_t* where,
    Py_ssize_t* where_axis,
) noexcept nogil:
    cdef Py_ssize_t i, k, r
    cdef const int64_t* shape
    cdef int64_t d, total, count, c
    cdef bint zero
    for i in range(itemsizes.shape[0]):
        r = indptr[i + 1] - indptr[i]
        shape = dims + indptr[i]
        d = itemsizes[i]
        where[0] = i
        if d < 0:
            return NEG_ITEMSIZE
        zero = d == 0
        for k in range(r):
            if shape[k] < 0:
                where_axis[0] = k
                return NEG_DIM
            if shape[k] == 0:
                zero = True
        total = 0
        if not zero:
            total = d
            for k in range(r):
                if total > INT64_MAX // shape[k]:
                    return OVERFLOW
                total *= shape[k]
        if r == 0:
            if d > st.max_size:
                if _emit(st, i, -1 - st.nlarge, 0, zeros, zeros):
                    return NO_MEMORY
                st.nlarge += 1
            else:
                if d > st.remaining:
                    st.shard += 1
                    st.remaining = st.max_size
                if _emit(st, i, st.shard, 0, zeros, zeros):
                    return NO_MEMORY
                st.any_regular = True
                st.remaining -= d
            continue
        if total == 0:
            # TensorFlow drops zero-element tensors; they go whole into the current shard.
            if _emit(st, i, st.shard, r, zeros, shape):
                return NO_MEMORY
            st.any_regular = True
            continue
        if d > st.max_size:
            # Not even one element fits a shard: every element alone, in C order. `scratch`
            # holds the element index.
            for k in range(r):
                scratch[k] = 0
                ones[k] = 1
            count = total // d
            for c in range(count):
                if _emit(st, i, -1 - st.nlarge, r, scratch, ones):
                    return NO_MEMORY
                st.nlarge += 1
                k = r - 1
                while k >= 0:
                    scratch[k] += 1
                    if scratch[k] < shape[k]:
                        break
                    scratch[k] = 0
                    k -= 1
            continue
        if _place_box(st, i, r, d, zeros, shape, scratch):
            return NO_MEMORY
    return OK


def max_shard_fill(
    const int64_t[::1] indptr,
    const int64_t[::1] dims,
    const int64_t[::1] itemsizes,
    int64_t max_shard_size,
):
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
    cdef Py_ssize_t n = itemsizes.shape[0], i, max_rank = 0, where = 0, where_axis = 0
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size must be >= 1, got {max_shard_size}")
    _check_csr(indptr, dims, n)
    with nogil:
        for i in range(n):
            if indptr[i + 1] - indptr[i] > max_rank:
                max_rank = indptr[i + 1] - indptr[i]
    cdef const int64_t* dims_p = &dims[0] if dims.shape[0] else NULL
    cdef Fill st
    st.max_size = max_shard_size
    st.remaining = max_shard_size
    st.shard = 0
    st.nlarge = 0
    st.any_regular = False
    st.tensor = Buf(NULL, 0, 0)
    st.shard_of = Buf(NULL, 0, 0)
    st.geom = Buf(NULL, 0, 0)
    cdef int64_t* zeros = <int64_t*>calloc(2 * max_rank + 1, sizeof(int64_t))
    cdef int64_t* scratch = <int64_t*>malloc((4 * max_rank * (max_rank + 2) + 1) * sizeof(int64_t))
    cdef int code
    cdef Py_ssize_t p
    cdef int64_t regular
    try:
        if zeros == NULL or scratch == NULL:
            raise MemoryError()
        with nogil:
            code = _fill_loop(
                &st, indptr, dims_p, itemsizes, zeros, zeros + max_rank, scratch, &where,
                &where_axis,
            )
            regular = st.shard + 1 if st.any_regular else 0
            if code == OK:
                for p in range(st.shard_of.size):
                    if st.shard_of.data[p] < 0:
                        st.shard_of.data[p] = regular - 1 - st.shard_of.data[p]
        if code == NEG_ITEMSIZE:
            raise ValueError(f"item {where}: negative item size {itemsizes[where]}")
        if code == NEG_DIM:
            raise ValueError(
                f"item {where}: negative dimension {dims[indptr[where] + where_axis]} "
                f"on axis {where_axis}"
            )
        if code == OVERFLOW:
            shape = [int(dims[k]) for k in range(indptr[where], indptr[where + 1])]
            raise OverflowError(
                f"item {where}: {itemsizes[where]} bytes x shape {shape} overflows int64"
            )
        if code == NO_MEMORY:
            raise MemoryError()
        return (
            _to_array(&st.tensor), _to_array(&st.shard_of), _to_array(&st.geom), int(regular)
        )
    finally:
        free(zeros)
        free(scratch)
        free(st.tensor.data)
        free(st.shard_of.data)
        free(st.geom.data)
