import ml_dtypes
import numpy as np
import pytest

from shardkit.errors import UnsupportedDTypeError
from shardkit.values.dtypes import SAFETENSORS_NAMES, itemsize, numpy_dtype, safetensors_name

EXPECTED = {
    "F64": (np.float64, 8), "F32": (np.float32, 4), "F16": (np.float16, 2),
    "BF16": (ml_dtypes.bfloat16, 2), "F8_E4M3": (ml_dtypes.float8_e4m3fn, 1),
    "F8_E5M2": (ml_dtypes.float8_e5m2, 1), "I64": (np.int64, 8), "I32": (np.int32, 4),
    "I16": (np.int16, 2), "I8": (np.int8, 1), "U64": (np.uint64, 8), "U32": (np.uint32, 4),
    "U16": (np.uint16, 2), "U8": (np.uint8, 1), "BOOL": (np.bool_, 1),
    "C64": (np.complex64, 8), "F8_E4M3FNUZ": (ml_dtypes.float8_e4m3fnuz, 1),
    "F8_E5M2FNUZ": (ml_dtypes.float8_e5m2fnuz, 1), "C128": (np.complex128, 16),
    "F8_E8M0": (ml_dtypes.float8_e8m0fnu, 1),
    "F4": (ml_dtypes.float4_e2m1fn, 1),  # the numpy array's item size; stored two a byte
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_table(name):
    dtype, size = EXPECTED[name]
    assert safetensors_name(np.dtype(dtype)) == name
    assert numpy_dtype(name) == np.dtype(dtype)
    assert itemsize(name) == size


def test_every_name_listed():
    assert set(SAFETENSORS_NAMES) == set(EXPECTED)


def test_rejections():
    with pytest.raises(UnsupportedDTypeError, match="big-endian"):
        safetensors_name(np.dtype(">f4"))
    with pytest.raises(UnsupportedDTypeError, match="cannot be stored"):
        safetensors_name(np.dtype(np.clongdouble))
    with pytest.raises(UnsupportedDTypeError, match="unknown dtype name 'F128'"):
        numpy_dtype("F128")
