"""Tensors that are one memory: arrays of a state whose bytes are exactly the same (same address,
dtype, shape and strides), as tied weights are (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``). A save stores such a tensor once and records the other names as
aliases of it (docs/FORMAT.md section 2.5). Arrays that only overlap are not shared."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._kernels import _table


def shared_rows(arrays: Sequence[np.ndarray], specs: Sequence[str] | None = None
                ) -> dict[int, int]:
    """The rows whose array is exactly the memory of an earlier row's.

    One kernel pass reads the addresses; only rows whose address repeats are compared further
    (dtype, shape, strides and, when given, the slice spec). Empty arrays share nothing.

    Args:
        arrays: host numpy arrays, in save order.
        specs: each array's slice spec of its tensor (a rank's local shards), or None.
    Returns:
        row -> the first row of the same memory, for every row after the first of its group.
    """
    if len(arrays) < 2:
        return {}
    addresses = _table.array_addresses(list(arrays))
    order = np.argsort(addresses, kind="stable")
    ordered = addresses[order]
    repeated = (ordered[1:] == ordered[:-1]) & (ordered[1:] != 0)
    if not repeated.any():
        return {}
    rows = np.union1d(order[1:][repeated], order[:-1][repeated])  # ascending: save order
    first: dict[tuple[object, ...], int] = {}
    shared: dict[int, int] = {}
    for i in rows.tolist():
        a = arrays[i]
        same = (int(addresses[i]), a.dtype, a.shape, a.strides,
                None if specs is None else specs[i])
        j = first.setdefault(same, i)
        if j != i:
            shared[i] = j
    return shared
