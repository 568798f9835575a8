"""The exceptions shardkit raises. Every one derives from ShardkitError."""

from __future__ import annotations


class ShardkitError(Exception):
    """Base class of every error shardkit raises on purpose."""


class SliceSpecError(ShardkitError, ValueError):
    """A slice spec string is malformed or does not fit the tensor it describes."""


class DeviceSpecError(ShardkitError, ValueError):
    """A device string cannot be parsed."""


class UnsupportedDTypeError(ShardkitError, TypeError):
    """A dtype that shardkit cannot store (object, strings, complex, big-endian...)."""


class ShardingValidationError(ShardkitError, RuntimeError):
    """A sharding callback returned shards that break one of the callback contract's rules."""


class PolicyError(ShardkitError, ValueError):
    """A sharding policy was given arguments it cannot work with."""


class CheckpointNotFoundError(ShardkitError, FileNotFoundError):
    """No checkpoint (no index.json) at the given path."""


class KeyNotFoundError(ShardkitError, KeyError):
    """The checkpoint holds no tensor under the requested key."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class CheckpointFormatError(ShardkitError, ValueError):
    """A checkpoint file is corrupt, truncated or not in a format shardkit reads."""


class UnsupportedVersionError(CheckpointFormatError):
    """The checkpoint was written by a newer, incompatible format version."""


class ChecksumError(CheckpointFormatError):
    """Bytes read back do not match the checksum recorded when they were written."""


class CheckpointExistsError(ShardkitError, FileExistsError):
    """Saving would replace an existing checkpoint and overwrite=False."""


class RestoreMismatchError(ShardkitError, ValueError):
    """A stored tensor does not fit the array it is being restored into."""
