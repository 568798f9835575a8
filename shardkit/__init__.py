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
from .errors import *  # noqa: F403  (every error stays importable from shardkit)
from .errors import ShardkitError
from .optional import lazy_attributes

_moved.install()  # the old module paths, for one release

if TYPE_CHECKING:
    from .io.options import CheckpointOptions
    from .io.reader import CheckpointReader, VerifyReport
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
    from .sharding.callback import Shard, ShardingCallback, validate_shards
    from .sharding.policies import (
        AllInOnePolicy,
        BalancedPolicy,
        BinPackPolicy,
        MaxShardSizePolicy,
        ShardByTaskPolicy,
    )
    from .sharding.tensors import ShardableTensor, TensorSaveSpec
    from .storage import set_storage_options
    from .tools.profiling import profile
    from .training.checkpoint import Checkpoint, CheckpointLoadStatus, SaveHandle
    from .training.manager import CheckpointManager
    from .values.devices import DeviceSpec
    from .values.slices import SliceSpec

_LAZY: dict[str, str] = {  # public name -> the module that defines it, imported on first use
    "save": "io.save",
    "load": "io.save",
    "open": "io.save",
    "restore_into": "io.save",
    "SaveInfo": "io.save",
    "CheckpointOptions": "io.options",
    "CheckpointReader": "io.reader",
    "VerifyReport": "io.reader",
    "Checkpoint": "training.checkpoint",
    "CheckpointLoadStatus": "training.checkpoint",
    "CheckpointManager": "training.manager",
    "SaveHandle": "training.checkpoint",
    "ShardingCallback": "sharding.callback",
    "Shard": "sharding.callback",
    "validate_shards": "sharding.callback",
    "ShardableTensor": "sharding.tensors",
    "TensorSaveSpec": "sharding.tensors",
    "as_tensorflow_callback": "io.save",
    "DefaultShardingPolicy": "io.save",
    "get_policy": "io.save",  # io.save registers "default" in the policies registry
    "AllInOnePolicy": "sharding.policies",
    "BalancedPolicy": "sharding.policies",
    "BinPackPolicy": "sharding.policies",
    "MaxShardSizePolicy": "sharding.policies",
    "ShardByTaskPolicy": "sharding.policies",
    "profile": "tools.profiling",
    "DeviceSpec": "values.devices",
    "SliceSpec": "values.slices",
    "set_storage_options": "storage",
}
_lazy_attribute, __dir__ = lazy_attributes(__name__, _LAZY, globals())


def __getattr__(name: str) -> object:
    if name in _moved.MOVED_NAMES:
        return _moved.moved_attribute(name)
    return _lazy_attribute(name)


__version__ = "0.1.0"

# The surface a user holds in their head (docs/API.md). Every error stays importable from here
# too (`from shardkit import ChecksumError`), and all of them from shardkit.errors.
__all__ = [
    # save, read, restore
    "save",
    "load",
    "open",
    "restore_into",
    "SaveInfo",
    "CheckpointOptions",
    "CheckpointReader",
    "VerifyReport",
    # training loops
    "Checkpoint",
    "CheckpointLoadStatus",
    "CheckpointManager",
    "SaveHandle",
    # the sharding callback and its policies
    "ShardingCallback",
    "ShardableTensor",
    "TensorSaveSpec",
    "Shard",
    "validate_shards",
    "as_tensorflow_callback",
    "DefaultShardingPolicy",
    "AllInOnePolicy",
    "BalancedPolicy",
    "BinPackPolicy",
    "MaxShardSizePolicy",
    "ShardByTaskPolicy",
    "get_policy",
    "profile",
    # values, storage, errors
    "DeviceSpec",
    "SliceSpec",
    "set_storage_options",
    "ShardkitError",
    "__version__",
]
