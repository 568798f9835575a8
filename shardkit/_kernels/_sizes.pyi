"""Stub for the compiled module built from csrc/_sizes.pyx."""

import numpy as np
import numpy.typing as npt

def check_csr(indptr: npt.NDArray[np.int64], dims: npt.NDArray[np.int64], n: int) -> None: ...
def shape_nbytes(
    indptr: npt.NDArray[np.int64],
    dims: npt.NDArray[np.int64],
    itemsizes: npt.NDArray[np.int64],
) -> npt.NDArray[np.int64]: ...
def checked_sum(sizes: npt.NDArray[np.int64]) -> int: ...
