"""shardkit: sharded ML checkpoints with a TensorFlow-compatible sharding-callback API.

    import shardkit
    shardkit.save("ckpt", {"model": {"w": w, "b": b}})
    state = shardkit.load("ckpt")            # memory-mapped, zero-copy

``import shardkit`` imports numpy, the kernels and the errors; every other name is imported
with its module on first use (`optional.lazy_attributes`), each optional package by the call
that needs it (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _kernels  # noqa: F401  (fails loudly here if the native build is missing)
from .errors import (
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    ChecksumError,
    CorruptHeaderError,
    CorruptIndexError,
    DeviceSpecError,
    DistributedError,
    DistributedSaveError,
    DistributedStateError,
    DistributedTimeoutError,
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
    RetentionWarning,
    ShardingValidationError,
    ShardIOError,
    ShardkitError,
    ShardPathError,
    SliceIndexError,
    SliceSpecError,
    SplitTensorsWarning,
    StorageError,
    SymlinkRefusedError,
    TruncatedShardError,
    UnknownCodecError,
    UnknownModelError,
    UnsupportedDTypeError,
    UnsupportedVersionError,
)
from .optional import lazy_attributes

if TYPE_CHECKING:
    from .api import DefaultShardingPolicy, SaveInfo, get_policy, load, open, restore_into, save
    from .callback import Shard, ShardingCallback, shard_tensors, validate_shards
    from .checkpoint import Checkpoint, CheckpointLoadStatus, CheckpointManager, SaveHandle
    from .devices import DeviceSpec
    from .frameworks import as_tensorflow_callback
    from .options import CheckpointOptions
    from .policies import (
        AllInOnePolicy,
        BalancedPolicy,
        BinPackPolicy,
        MaxShardSizePolicy,
        ShardByTaskPolicy,
        parse_size,
    )
    from .profiling import PolicyProfile, profile
    from .reader import CheckpointReader, Problem, VerifyReport
    from .slices import SliceSpec, check_tiling, format_slice_spec, parse_slice_spec
    from .storage import set_storage_options
    from .tensors import ShardableTensor, TensorSaveSpec, shardable_tensors

_LAZY: dict[str, str] = {  # public name -> the module that defines it, imported on first use
    "DefaultShardingPolicy": "api",
    "SaveInfo": "api",
    "load": "api",
    "open": "api",
    "restore_into": "api",
    "save": "api",
    "Shard": "callback",
    "ShardingCallback": "callback",
    "shard_tensors": "callback",
    "validate_shards": "callback",
    "Checkpoint": "checkpoint",
    "CheckpointLoadStatus": "checkpoint",
    "CheckpointManager": "checkpoint",
    "SaveHandle": "checkpoint",
    "DeviceSpec": "devices",
    "as_tensorflow_callback": "frameworks",
    "CheckpointOptions": "options",
    "AllInOnePolicy": "policies",
    "BalancedPolicy": "policies",
    "BinPackPolicy": "policies",
    "MaxShardSizePolicy": "policies",
    "ShardByTaskPolicy": "policies",
    "get_policy": "api",  # api registers "default" in the policies registry
    "parse_size": "policies",
    "PolicyProfile": "profiling",
    "profile": "profiling",
    "CheckpointReader": "reader",
    "Problem": "reader",
    "VerifyReport": "reader",
    "SliceSpec": "slices",
    "check_tiling": "slices",
    "format_slice_spec": "slices",
    "parse_slice_spec": "slices",
    "set_storage_options": "storage",
    "ShardableTensor": "tensors",
    "TensorSaveSpec": "tensors",
    "shardable_tensors": "tensors",
}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

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
    "DistributedError",
    "DistributedSaveError",
    "DistributedStateError",
    "DistributedTimeoutError",
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
    "RetentionWarning",
    "SplitTensorsWarning",
    "StorageError",
    "SymlinkRefusedError",
    "TensorSaveSpec",
    "TruncatedShardError",
    "UnknownCodecError",
    "UnknownModelError",
    "UnsupportedDTypeError",
    "UnsupportedVersionError",
    "VerifyReport",
    "__version__",
    "as_tensorflow_callback",
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
    "set_storage_options",
    "shard_tensors",
    "shardable_tensors",
    "validate_shards",
]
