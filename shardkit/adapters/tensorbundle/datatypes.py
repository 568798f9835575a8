"""TensorFlow's DataType enum (``tensorflow/core/framework/types.proto``), as plain numbers,
and its map to shardkit's dtype names (`DTYPE_OF`, `DATATYPE_OF`)."""

from __future__ import annotations

from typing import Final

# DataType (tensorflow/core/framework/types.proto) values shardkit maps to its dtypes, plus
# DT_STRING; other values are refused by name (`DATA_TYPE_NAMES`).
DATA_TYPES: Final[dict[str, int]] = {
    "DT_INVALID": 0, "DT_FLOAT": 1, "DT_DOUBLE": 2, "DT_INT32": 3, "DT_UINT8": 4,
    "DT_INT16": 5, "DT_INT8": 6, "DT_STRING": 7, "DT_COMPLEX64": 8, "DT_INT64": 9,
    "DT_BOOL": 10, "DT_QINT8": 11, "DT_QUINT8": 12, "DT_QINT32": 13, "DT_BFLOAT16": 14,
    "DT_QINT16": 15, "DT_QUINT16": 16, "DT_UINT16": 17, "DT_COMPLEX128": 18, "DT_HALF": 19,
    "DT_RESOURCE": 20, "DT_VARIANT": 21, "DT_UINT32": 22, "DT_UINT64": 23,
    "DT_FLOAT8_E5M2": 24, "DT_FLOAT8_E4M3FN": 25, "DT_FLOAT8_E4M3FNUZ": 26,
    "DT_FLOAT8_E4M3B11FNUZ": 27, "DT_FLOAT8_E5M2FNUZ": 28, "DT_INT4": 29, "DT_UINT4": 30,
    "DT_INT2": 31, "DT_UINT2": 32, "DT_FLOAT4_E2M1FN": 33,
}
DATA_TYPE_NAMES: Final[dict[int, str]] = {v: k for k, v in DATA_TYPES.items()}

STRING: Final = "STRING"
"""shardkit's dtype name for TensorFlow's DT_STRING (an object array of bytes when read)."""

# DataType -> shardkit's dtype name
DTYPE_OF: Final[dict[int, str]] = {
    DATA_TYPES["DT_FLOAT"]: "F32", DATA_TYPES["DT_DOUBLE"]: "F64", DATA_TYPES["DT_HALF"]: "F16",
    DATA_TYPES["DT_BFLOAT16"]: "BF16", DATA_TYPES["DT_FLOAT8_E4M3FN"]: "F8_E4M3",
    DATA_TYPES["DT_FLOAT8_E5M2"]: "F8_E5M2", DATA_TYPES["DT_INT64"]: "I64",
    DATA_TYPES["DT_INT32"]: "I32", DATA_TYPES["DT_INT16"]: "I16", DATA_TYPES["DT_INT8"]: "I8",
    DATA_TYPES["DT_UINT64"]: "U64", DATA_TYPES["DT_UINT32"]: "U32",
    DATA_TYPES["DT_UINT16"]: "U16", DATA_TYPES["DT_UINT8"]: "U8", DATA_TYPES["DT_BOOL"]: "BOOL",
    DATA_TYPES["DT_COMPLEX64"]: "C64", DATA_TYPES["DT_COMPLEX128"]: "C128",
    DATA_TYPES["DT_FLOAT8_E4M3FNUZ"]: "F8_E4M3FNUZ",
    DATA_TYPES["DT_FLOAT8_E5M2FNUZ"]: "F8_E5M2FNUZ", DATA_TYPES["DT_STRING"]: STRING,
    DATA_TYPES["DT_FLOAT4_E2M1FN"]: "F4",  # one element a byte in a bundle, not packed
}
DATATYPE_OF: Final[dict[str, int]] = {v: k for k, v in DTYPE_OF.items()}
