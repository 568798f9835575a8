"""shardkit: sharded ML checkpoints with a TensorFlow-compatible sharding-callback API.

    import shardkit
    shardkit.save("ckpt", {"model": {"w": w, "b": b}})
    state = shardkit.load("ckpt")            # memory-mapped, zero-copy
"""

from __future__ import annotations

from . import _kernels  # noqa: F401  (fails loudly here if the native build is missing)
from .api import DefaultShardingPolicy, SaveInfo, load, open, restore_into, save
from .callback import Shard, ShardingCallback, shard_tensors, validate_shards
from .checkpoint import Checkpoint, CheckpointLoadStatus, CheckpointManager, SaveHandle
from .devices import DeviceSpec
from .errors import (
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    ChecksumError,
    CorruptHeaderError,
    CorruptIndexError,
    DeviceSpecError,
    EntryLayoutError,
    GenerationMismatchError,
    IncompleteRestoreError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvalidKeyError,
    InvalidKeyTypeError,
    InvalidMetadataError,
    KeyNotFoundError,
    MissingDependencyError,
    MissingShardError,
    NotRegularFileError,
    PolicyError,
    ReaderClosedError,
    RestoreMismatchError,
    ShardingValidationError,
    ShardIOError,
    ShardkitError,
    ShardPathError,
    SliceIndexError,
    SliceSpecError,
    SplitTensorsWarning,
    SymlinkRefusedError,
    TruncatedShardError,
    UnknownCodecError,
    UnknownModelError,
    UnsupportedDTypeError,
    UnsupportedVersionError,
)
from .options import CheckpointOptions
from .policies import (
    AllInOnePolicy,
    BalancedPolicy,
    BinPackPolicy,
    MaxShardSizePolicy,
    ShardByTaskPolicy,
    get_policy,
    parse_size,
)
from .profiling import PolicyProfile, profile
from .reader import CheckpointReader, Problem, VerifyReport
from .slices import SliceSpec, check_tiling, format_slice_spec, parse_slice_spec
from .tensors import ShardableTensor, TensorSaveSpec, shardable_tensors

__version__ = "0.1.0"

__all__ = [
    "AllInOnePolicy",
    "BalancedPolicy",
    "BinPackPolicy",
    "Checkpoint",
    "CheckpointLoadStatus",
    "CheckpointManager",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CheckpointOptions",
    "CheckpointReplacedError",
    "CheckpointReader",
    "ChecksumError",
    "CorruptHeaderError",
    "CorruptIndexError",
    "DefaultShardingPolicy",
    "DeviceSpec",
    "DeviceSpecError",
    "EntryLayoutError",
    "GenerationMismatchError",
    "IncompleteRestoreError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "InvalidKeyError",
    "InvalidKeyTypeError",
    "InvalidMetadataError",
    "KeyNotFoundError",
    "MaxShardSizePolicy",
    "MissingDependencyError",
    "MissingShardError",
    "NotRegularFileError",
    "PolicyError",
    "PolicyProfile",
    "Problem",
    "ReaderClosedError",
    "RestoreMismatchError",
    "SaveHandle",
    "SaveInfo",
    "Shard",
    "ShardByTaskPolicy",
    "ShardIOError",
    "ShardPathError",
    "ShardableTensor",
    "ShardingCallback",
    "ShardingValidationError",
    "ShardkitError",
    "SliceIndexError",
    "SliceSpec",
    "SliceSpecError",
    "SplitTensorsWarning",
    "SymlinkRefusedError",
    "TensorSaveSpec",
    "TruncatedShardError",
    "UnknownCodecError",
    "UnknownModelError",
    "UnsupportedDTypeError",
    "UnsupportedVersionError",
    "VerifyReport",
    "__version__",
    "check_tiling",
    "format_slice_spec",
    "get_policy",
    "load",
    "open",
    "parse_size",
    "parse_slice_spec",
    "profile",
    "restore_into",
    "save",
    "shard_tensors",
    "shardable_tensors",
    "validate_shards",
]
