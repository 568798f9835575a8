"""Byte shuffle fused with gather (save) and unshuffle fused with scatter (restore)."""

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray
from typing_extensions import Buffer

NT_MIN_BYTES: int

def gather_shuffle(
    sources: Sequence[Buffer],
    src_index: NDArray[np.int64],
    src_offset: NDArray[np.int64],
    length: NDArray[np.int64],
    itemsize: NDArray[np.int64],
    dst: NDArray[np.uint8] | bytearray,
    dst_offset: NDArray[np.int64],
) -> None: ...
def unshuffle_scatter(
    src: Buffer,
    src_offset: NDArray[np.int64],
    n_items: NDArray[np.int64],
    itemsize: NDArray[np.int64],
    item_begin: NDArray[np.int64],
    item_count: NDArray[np.int64],
    dests: Sequence[Buffer],
    dst_index: NDArray[np.int64],
    dst_offset: NDArray[np.int64],
) -> None: ...
