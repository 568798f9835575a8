"""Pure-Python twin of shardkit._kernels._sizes: byte sizes of many tensors, overflow-checked.

Shapes come in CSR form: the shape of item ``i`` is ``dims[indptr[i]:indptr[i + 1]]``.
"""

from __future__ import annotations

import numpy as np

_INT64_MAX = 2**63 - 1


def check_csr(indptr: np.ndarray, dims: np.ndarray, n: int) -> None:
    """Raise ValueError unless `indptr` is a CSR pointer of `n` items into `dims`."""
    if indptr.shape[0] != n + 1:
        raise ValueError(f"indptr must have {n + 1} entries (items + 1), got {indptr.shape[0]}")
    if n + 1 and indptr[0] != 0:
        raise ValueError(f"indptr[0] must be 0, got {indptr[0]}")
    for i in range(n):
        if indptr[i + 1] < indptr[i] or indptr[i + 1] > dims.shape[0]:
            raise ValueError(
                f"indptr[{i + 1}] = {indptr[i + 1]} is out of order or past the "
                f"{dims.shape[0]} dims"
            )


def shape_nbytes(indptr: np.ndarray, dims: np.ndarray, itemsizes: np.ndarray) -> np.ndarray:
    """``itemsizes[i] * prod(shape i)`` for every item, as int64.

    Raises ValueError for a negative dimension or item size, OverflowError (naming the item) when
    a size does not fit in int64. A zero dimension makes the size 0 whatever the others are.
    """
    n = itemsizes.shape[0]
    check_csr(indptr, dims, n)
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        shape = [int(d) for d in dims[indptr[i] : indptr[i + 1]]]
        size = int(itemsizes[i])
        if size < 0:
            raise ValueError(f"item {i}: negative item size {size}")
        for axis, d in enumerate(shape):
            if d < 0:
                raise ValueError(f"item {i}: negative dimension {d} on axis {axis}")
        for d in shape:
            size *= d
        if size > _INT64_MAX:
            raise OverflowError(
                f"item {i}: {int(itemsizes[i])} bytes x shape {shape} overflows int64"
            )
        out[i] = size
    return out


def checked_sum(sizes: np.ndarray) -> int:
    """The sum of non-negative int64 `sizes`; OverflowError naming the item where it overflows."""
    total = 0
    for i in range(sizes.shape[0]):
        s = int(sizes[i])
        if s < 0:
            raise ValueError(f"item {i}: negative size {s}")
        total += s
        if total > _INT64_MAX:
            raise OverflowError(f"item {i}: the running total of sizes overflows int64")
    return total
