"""A TensorBundle data file as a shard source: the raw source over entries the index places.

TensorFlow packs entries back to back (BundleWriter's data_alignment is 1), so an entry may
start at an offset that is not a multiple of its item size: such an entry is copied out of the
map into an aligned array; aligned entries are zero-copy views as for shardkit's shards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...format import EntryLayout, ShardInfo, entry_layouts
from ...shards.raw import RawShard
from ...values.dtypes import itemsize


class BundleData(RawShard):
    """One ``<prefix>.data-0000i-of-0000n`` file; `entries` from the ``.index`` (offsets from
    the start of the file: there is no header). TensorFlow stores float4_e2m1fn one element a
    byte, as numpy holds it: its entries are not `packed`."""

    packed = False

    def __init__(self, path: str, info: ShardInfo, begins: list[int],
                 layout: Callable[[], tuple[list[str], list[str], list[tuple[int, ...]],
                                            list[int]]], *,
                 mmap: bool, file: Any, aligned: bool = False) -> None:
        """`begins`: where the file's entries start, from the index; `layout()`: the entries
        (names, dtype names, shapes, begins), asked for only when their EntryLayouts are (a
        load of every tensor never needs them): the index is this file's only description,
        so the source matches it by construction. `aligned`: the index found every entry
        aligned for its dtype (then none is checked again)."""
        super().__init__(path, info, mmap=mmap and file.size > 0, file=file,
                         header=({}, {}, 0))
        self._entries = None
        self._layout = layout
        self.begins = begins
        self.aligned = aligned

    @property
    def entries(self) -> dict[str, EntryLayout]:  # type: ignore[override]
        if self._entries is None:
            names, dtype_names, shapes, begins = self._layout()
            sizes = {d: itemsize(d) for d in set(dtype_names)}  # the bundle's size rule
            ends = [b + math.prod(s) * sizes[d] for b, s, d in zip(begins, shapes, dtype_names)]
            self._entries = dict(zip(names, entry_layouts(names, dtype_names, shapes, begins,
                                                          ends)))
        return self._entries

    def view(self, entry: EntryLayout, begin: int, end: int) -> memoryview | None:
        if entry.begin % _align(entry.dtype_name):
            return None
        return super().view(entry, begin, end)

    def whole_arrays(self, begins: Sequence[int], dtypes: Sequence[np.dtype],
                     shapes: Sequence[tuple[int, ...]],
                     run: Callable[[Sequence[Callable[[], None]]], None] | None = None
                     ) -> list[np.ndarray]:
        if self._map is None or self.aligned or all(
                b % d.alignment == 0 for b, d in zip(begins, dtypes)):
            return super().whole_arrays(begins, dtypes, shapes, run)
        out: list[np.ndarray] = []
        for b, d, s in zip(begins, dtypes, shapes):
            if b % d.alignment == 0:
                out.extend(super().whole_arrays([b], [d], [s]))
                continue
            a = np.empty(s, d)
            n = a.nbytes
            if n:
                a.reshape(-1).view(np.uint8)[:] = np.frombuffer(self._map, np.uint8, n, b)
            out.append(a)
        return out


def _align(dtype_name: str) -> int:
    from ...errors import UnsupportedDTypeError
    from ...values.dtypes import numpy_dtype

    try:
        return numpy_dtype(dtype_name).alignment
    except UnsupportedDTypeError:
        return 1
