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

from . import (
    _kernels,  # noqa: F401  (fails loudly here if the native build is missing)
    _moved,
)
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

_moved.install()  # the old module paths, for one release

if TYPE_CHECKING:
    from .io.options import CheckpointOptions
    from .io.reader import CheckpointReader, Problem, VerifyReport
    from .io.save import (
        DefaultShardingPolicy,
        SaveInfo,
        as_tensorflow_callback,
        get_policy,
        load,
        open,
        restore_into,
        save,
    )
    from .sharding.callback import Shard, ShardingCallback, shard_tensors, validate_shards
    from .sharding.policies import (
        AllInOnePolicy,
        BalancedPolicy,
        BinPackPolicy,
        MaxShardSizePolicy,
        ShardByTaskPolicy,
        parse_size,
    )
    from .sharding.tensors import ShardableTensor, TensorSaveSpec, shardable_tensors
    from .storage import set_storage_options
    from .tools.profiling import PolicyProfile, profile
    from .training.checkpoint import Checkpoint, CheckpointLoadStatus, CheckpointManager, SaveHandle
    from .values.devices import DeviceSpec
    from .values.slices import SliceSpec, check_tiling, format_slice_spec, parse_slice_spec

_LAZY: dict[str, str] = {  # public name -> the module that defines it, imported on first use
    "DefaultShardingPolicy": "io.save",
    "SaveInfo": "io.save",
    "load": "io.save",
    "open": "io.save",
    "restore_into": "io.save",
    "save": "io.save",
    "Shard": "sharding.callback",
    "ShardingCallback": "sharding.callback",
    "shard_tensors": "sharding.callback",
    "validate_shards": "sharding.callback",
    "Checkpoint": "training.checkpoint",
    "CheckpointLoadStatus": "training.checkpoint",
    "CheckpointManager": "training.checkpoint",
    "SaveHandle": "training.checkpoint",
    "DeviceSpec": "values.devices",
    "as_tensorflow_callback": "io.save",
    "CheckpointOptions": "io.options",
    "AllInOnePolicy": "sharding.policies",
    "BalancedPolicy": "sharding.policies",
    "BinPackPolicy": "sharding.policies",
    "MaxShardSizePolicy": "sharding.policies",
    "ShardByTaskPolicy": "sharding.policies",
    "get_policy": "io.save",  # api registers "default" in the policies registry
    "parse_size": "sharding.policies",
    "PolicyProfile": "tools.profiling",
    "profile": "tools.profiling",
    "CheckpointReader": "io.reader",
    "Problem": "io.reader",
    "VerifyReport": "io.reader",
    "SliceSpec": "values.slices",
    "check_tiling": "values.slices",
    "format_slice_spec": "values.slices",
    "parse_slice_spec": "values.slices",
    "set_storage_options": "storage",
    "ShardableTensor": "sharding.tensors",
    "TensorSaveSpec": "sharding.tensors",
    "shardable_tensors": "sharding.tensors",
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
