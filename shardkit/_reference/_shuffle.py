"""Pure-Python twin of shardkit._kernels._shuffle (same functions, same results, same errors).

Written with numpy for the copies: a piece of ``n`` items of ``s`` bytes is an ``(n, s)`` byte
matrix, and shuffling it is writing its transpose.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# The kernel stores unshuffles of at least this many bytes with streaming stores (same bytes).
NT_MIN_BYTES = 256 * 1024


def _bytes_of(obj: Any, k: int, role: str, writable: bool) -> np.ndarray:
    """A flat uint8 view of a C-contiguous buffer, with the kernel's error for anything else."""
    if isinstance(obj, np.ndarray) and obj.flags.c_contiguous and (
            obj.flags.writeable or not writable):
        # any dtype, ml_dtypes included (memoryview cannot export those)
        return obj.reshape(-1).view(np.uint8)
    try:
        mv = memoryview(obj)
    except TypeError as e:
        raise ValueError(
            f"{role} {k} ({type(obj).__name__}) is not a C-contiguous"
            f"{' writable' if writable else ''} buffer: {e}"
        ) from None
    if not mv.c_contiguous or (writable and mv.readonly):
        raise ValueError(
            f"{role} {k} ({type(obj).__name__}) is not a C-contiguous"
            f"{' writable' if writable else ''} buffer: "
            + ("read-only" if mv.c_contiguous else "not contiguous")
        )
    if isinstance(obj, np.ndarray):  # ml_dtypes arrays have no buffer format memoryview can cast
        return obj.reshape(-1).view(np.uint8)
    return np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, np.uint8)


def _table(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.int64)


def gather_shuffle(
    sources: Sequence[Any],
    src_index: Any,
    src_offset: Any,
    length: Any,
    itemsize: Any,
    dst: Any,
    dst_offset: Any,
) -> None:
    """Copy piece k of ``sources[src_index[k]]`` into ``dst`` at ``dst_offset[k]``, shuffled."""
    src_index, src_offset, length, itemsize, dst_offset = map(
        _table, (src_index, src_offset, length, itemsize, dst_offset)
    )
    m = len(src_index)
    if not all(len(t) == m for t in (src_offset, length, itemsize, dst_offset)):
        raise ValueError("gather_shuffle: the piece tables must all have the same length")
    srcs = [_bytes_of(s, k, "source", False) for k, s in enumerate(sources)]
    out = _bytes_of(dst, 0, "destination", True) if not isinstance(dst, np.ndarray) else dst
    if out.dtype != np.uint8 or out.ndim != 1:
        raise ValueError("gather_shuffle: dst must be a 1-d uint8 buffer")
    for k in range(m):
        j, off, ln, s, doff = (int(t[k]) for t in (src_index, src_offset, length, itemsize,
                                                   dst_offset))
        if j < 0 or j >= len(srcs):
            raise ValueError(f"gather_shuffle: piece {k} names source {j}, have {len(srcs)}")
        if s < 1 or ln < 0 or ln % s != 0:
            raise ValueError(
                f"gather_shuffle: piece {k} has length {ln}, not a whole number of {s}-byte items"
            )
        if off < 0 or off + ln > len(srcs[j]):
            raise ValueError(
                f"gather_shuffle: piece {k} reads bytes [{off}, {off + ln}) of source {j}, "
                f"which has {len(srcs[j])}"
            )
        if doff < 0 or doff + ln > len(out):
            raise ValueError(
                f"gather_shuffle: piece {k} writes bytes [{doff}, {doff + ln}) of a "
                f"{len(out)}-byte destination"
            )
    for k in range(m):
        j, off, ln, s, doff = (int(t[k]) for t in (src_index, src_offset, length, itemsize,
                                                   dst_offset))
        piece = srcs[j][off : off + ln].reshape(ln // s, s)
        out[doff : doff + ln] = piece.T.reshape(-1)


def unshuffle_scatter(
    src: Any,
    src_offset: Any,
    n_items: Any,
    itemsize: Any,
    item_begin: Any,
    item_count: Any,
    dests: Sequence[Any],
    dst_index: Any,
    dst_offset: Any,
) -> None:
    """Write items ``item_begin[k] ..+ item_count[k]`` of shuffled piece k into a destination."""
    src_offset, n_items, itemsize, item_begin, item_count, dst_index, dst_offset = map(
        _table, (src_offset, n_items, itemsize, item_begin, item_count, dst_index, dst_offset)
    )
    m = len(src_offset)
    if not all(
        len(t) == m for t in (n_items, itemsize, item_begin, item_count, dst_index, dst_offset)
    ):
        raise ValueError("unshuffle_scatter: the piece tables must all have the same length")
    inp = _bytes_of(src, 0, "source", False)
    outs = [_bytes_of(d, k, "destination", True) for k, d in enumerate(dests)]
    for k in range(m):
        off, n, s, ib, ic, j, doff = (
            int(t[k])
            for t in (src_offset, n_items, itemsize, item_begin, item_count, dst_index, dst_offset)
        )
        if s < 1 or n < 0 or ib < 0 or ic < 0 or ib + ic > n:
            raise ValueError(
                f"unshuffle_scatter: piece {k} asks for items [{ib}, {ib + ic}) of {n} items "
                f"of {s} bytes"
            )
        if off < 0 or off + n * s > len(inp):
            raise ValueError(
                f"unshuffle_scatter: piece {k} spans bytes [{off}, {off + n * s}) of a "
                f"{len(inp)}-byte source"
            )
        if j < 0 or j >= len(outs):
            raise ValueError(
                f"unshuffle_scatter: piece {k} names destination {j}, have {len(outs)}"
            )
        if doff < 0 or doff + ic * s > len(outs[j]):
            raise ValueError(
                f"unshuffle_scatter: piece {k} writes bytes [{doff}, {doff + ic * s}) of "
                f"destination {j}, which has {len(outs[j])}"
            )
    for k in range(m):
        off, n, s, ib, ic, j, doff = (
            int(t[k])
            for t in (src_offset, n_items, itemsize, item_begin, item_count, dst_index, dst_offset)
        )
        planes = inp[off : off + n * s].reshape(s, n)
        outs[j][doff : doff + ic * s] = planes[:, ib : ib + ic].T.reshape(-1)
