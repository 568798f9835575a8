"""Stub for the compiled module built from csrc/_packing.pyx."""

import numpy as np
import numpy.typing as npt

def first_fit(
    sizes: npt.NDArray[np.int64], order: npt.NDArray[np.int64], capacity: int
) -> npt.NDArray[np.int64]: ...
def next_fit(
    sizes: npt.NDArray[np.int64], order: npt.NDArray[np.int64], capacity: int
) -> npt.NDArray[np.int64]: ...
def lpt(
    sizes: npt.NDArray[np.int64], order: npt.NDArray[np.int64], num_bins: int
) -> npt.NDArray[np.int64]: ...
def max_shard_fill(
    indptr: npt.NDArray[np.int64],
    dims: npt.NDArray[np.int64],
    itemsizes: npt.NDArray[np.int64],
    max_shard_size: int,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], int]: ...
