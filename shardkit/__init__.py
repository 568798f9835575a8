"""shardkit: sharded ML checkpoints with a TensorFlow-compatible sharding-callback API."""

from __future__ import annotations

from . import _kernels  # noqa: F401  (fails loudly here if the native build is missing)
from .callback import Shard, ShardingCallback
from .devices import DeviceSpec
from .errors import (
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ChecksumError,
    DeviceSpecError,
    KeyNotFoundError,
    PolicyError,
    RestoreMismatchError,
    ShardingValidationError,
    ShardkitError,
    SliceSpecError,
    UnsupportedDTypeError,
    UnsupportedVersionError,
)
from .slices import SliceSpec, check_tiling, format_slice_spec, parse_slice_spec
from .tensors import ShardableTensor, TensorSaveSpec, shardable_tensors

__version__ = "0.1.0"

__all__ = [
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "ChecksumError",
    "DeviceSpec",
    "DeviceSpecError",
    "KeyNotFoundError",
    "PolicyError",
    "RestoreMismatchError",
    "Shard",
    "ShardableTensor",
    "ShardingCallback",
    "ShardingValidationError",
    "ShardkitError",
    "SliceSpec",
    "SliceSpecError",
    "TensorSaveSpec",
    "UnsupportedDTypeError",
    "UnsupportedVersionError",
    "__version__",
    "check_tiling",
    "format_slice_spec",
    "parse_slice_spec",
    "shardable_tensors",
]
