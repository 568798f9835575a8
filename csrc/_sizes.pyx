"""Byte sizes of many tensors at once, with int64 overflow detection.

Shapes come in CSR form: the shape of item ``i`` is ``dims[indptr[i]:indptr[i + 1]]``. Results and
error messages match the pure-Python twin in shardkit._reference._sizes exactly.
"""

from libc.stdint cimport INT64_MAX, int64_t

import numpy as np

# Error codes of the nogil loops; the index of the offending item comes back separately.
cdef enum:
    OK = 0
    BAD_INDPTR = 1
    NEG_ITEMSIZE = 2
    NEG_DIM = 3
    OVERFLOW = 4


cdef Py_ssize_t _bad_indptr(const int64_t[::1] indptr, Py_ssize_t ndims) noexcept nogil:
    """-1 if indptr is a valid CSR pointer into ndims dims, else the first bad position."""
    cdef Py_ssize_t i
    if indptr.shape[0] and indptr[0] != 0:
        return 0
    for i in range(1, indptr.shape[0]):
        if indptr[i] < indptr[i - 1] or indptr[i] > ndims:
            return i
    return -1


cdef int _nbytes_loop(
    const int64_t[::1] indptr,
    const int64_t[::1] dims,
    const int64_t[::1] itemsizes,
    int64_t[::1] out,
    Py_ssize_t* where,
    Py_ssize_t* axis,
) noexcept nogil:
    cdef Py_ssize_t i, k
    cdef int64_t size, d
    cdef bint zero
    for i in range(itemsizes.shape[0]):
        size = itemsizes[i]
        if size < 0:
            where[0] = i
            return NEG_ITEMSIZE
        zero = size == 0
        for k in range(indptr[i], indptr[i + 1]):
            if dims[k] < 0:
                where[0] = i
                axis[0] = k - indptr[i]
                return NEG_DIM
            if dims[k] == 0:
                zero = True
        if zero:
            out[i] = 0
            continue
        # All factors are positive here, so the running product only grows: an intermediate
        # overflow means the final size overflows too.
        for k in range(indptr[i], indptr[i + 1]):
            d = dims[k]
            if size > INT64_MAX // d:
                where[0] = i
                return OVERFLOW
            size *= d
        out[i] = size
    return OK


def _shape_of(const int64_t[::1] indptr, const int64_t[::1] dims, Py_ssize_t i):
    return [int(dims[k]) for k in range(indptr[i], indptr[i + 1])]


def check_csr(const int64_t[::1] indptr, const int64_t[::1] dims, Py_ssize_t n):
    """Raise ValueError unless `indptr` is a CSR pointer of `n` items into `dims`."""
    cdef Py_ssize_t bad
    if indptr.shape[0] != n + 1:
        raise ValueError(f"indptr must have {n + 1} entries (items + 1), got {indptr.shape[0]}")
    with nogil:
        bad = _bad_indptr(indptr, dims.shape[0])
    if bad == 0:
        raise ValueError(f"indptr[0] must be 0, got {indptr[0]}")
    if bad > 0:
        raise ValueError(
            f"indptr[{bad}] = {indptr[bad]} is out of order or past the {dims.shape[0]} dims"
        )


def shape_nbytes(
    const int64_t[::1] indptr, const int64_t[::1] dims, const int64_t[::1] itemsizes
):
    """``itemsizes[i] * prod(shape i)`` for every item, as an int64 array.

    Raises ValueError for a negative dimension or item size, OverflowError (naming the item) when
    a size does not fit in int64. A zero dimension makes the size 0 whatever the others are.
    """
    cdef Py_ssize_t n = itemsizes.shape[0]
    check_csr(indptr, dims, n)
    result = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] out = result
    cdef Py_ssize_t where = 0, axis = 0
    cdef int code
    with nogil:
        code = _nbytes_loop(indptr, dims, itemsizes, out, &where, &axis)
    if code == NEG_ITEMSIZE:
        raise ValueError(f"item {where}: negative item size {itemsizes[where]}")
    if code == NEG_DIM:
        raise ValueError(
            f"item {where}: negative dimension {dims[indptr[where] + axis]} on axis {axis}"
        )
    if code == OVERFLOW:
        raise OverflowError(
            f"item {where}: {itemsizes[where]} bytes x shape "
            f"{_shape_of(indptr, dims, where)} overflows int64"
        )
    return result


def checked_sum(const int64_t[::1] sizes):
    """The sum of non-negative int64 `sizes`; OverflowError naming the item where it overflows."""
    cdef Py_ssize_t i, where = -1
    cdef int64_t total = 0
    cdef int code = OK
    with nogil:
        for i in range(sizes.shape[0]):
            if sizes[i] < 0:
                code = NEG_DIM
                where = i
                break
            if total > INT64_MAX - sizes[i]:
                code = OVERFLOW
                where = i
                break
            total += sizes[i]
    if code == NEG_DIM:
        raise ValueError(f"item {where}: negative size {sizes[where]}")
    if code == OVERFLOW:
        raise OverflowError(f"item {where}: the running total of sizes overflows int64")
    return int(total)
