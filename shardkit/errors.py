"""The exceptions shardkit raises. Every one derives from ShardkitError."""

from __future__ import annotations

from dataclasses import dataclass


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


class InvalidMetadataError(ShardkitError, TypeError):
    """The metadata given to save() cannot be stored (e.g. nested deeper than the format allows)."""


class PolicyError(ShardkitError, ValueError):
    """A sharding policy was given arguments it cannot work with."""


class InvalidArgumentError(ShardkitError, ValueError):
    """An argument to save, a policy or the options has a value shardkit cannot use."""


class InvalidArgumentTypeError(ShardkitError, TypeError):
    """An argument to save, a policy or the options (or a part of the state) has the wrong type."""


class InvalidKeyError(InvalidArgumentError):
    """A state key that a checkpoint cannot hold: two values flatten to it, it is empty,
    reserved (``__metadata__``) or not valid UTF-8 (see shardkit.values.keys)."""


class InvalidKeyTypeError(InvalidKeyError, TypeError):
    """A state key that is neither a str nor an int (a bool, a float, None, a tuple...)."""


class CheckpointNotFoundError(ShardkitError, FileNotFoundError):
    """No checkpoint (no manifest) at the given path."""


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
    """Saving would replace an existing checkpoint and overwrite=False.

    When passing `keyword` (``overwrite=True``) would replace it, `remedy` says what that does
    and the message ends ``; pass overwrite=True <remedy>``; `worded` spells the argument
    another way (the command line names its flag)."""

    keyword = "overwrite"

    def __init__(self, message: str, remedy: str | None = None) -> None:
        super().__init__(message)
        self.message, self.remedy = message, remedy

    def worded(self, argument: str = f"{keyword}=True") -> str:
        """The message, naming the argument that would replace the checkpoint as `argument`."""
        if self.remedy is None:
            return self.message
        return f"{self.message}; pass {argument} {self.remedy}"

    def __str__(self) -> str:
        return self.worded()


class RestoreMismatchError(ShardkitError, ValueError):
    """A stored tensor does not fit the array it is being restored into."""


# Storage-format errors (checkpoint reader): each names the file and, where there is one, the entry.


class CorruptHeaderError(CheckpointFormatError):
    """A shard's header is not valid: bad JSON, bad field types, unknown dtype, too long."""


class EntryLayoutError(CorruptHeaderError):
    """A shard's entries do not tile its data region: out of range, overlapping, a hole."""


class GenerationMismatchError(CheckpointFormatError):
    """A shard file belongs to another checkpoint than its manifest (its generation differs):
    the directory mixes files of two saves, or was partially replaced."""


class TruncatedShardError(CheckpointFormatError):
    """A shard file is shorter than its header or the index says it is."""


class CorruptIndexError(CheckpointFormatError):
    """The manifest is not valid: bad JSON, missing or mistyped fields, slices that do not tile."""


class ShardPathError(CorruptIndexError):
    """A shard file name in the manifest would leave the checkpoint directory."""


class UnsafePickleError(CorruptIndexError):
    """A pickle in a foreign checkpoint (PyTorch DCP's ``.metadata``, a torch.save archive's
    ``data.pkl``) names a global outside the few its format needs: refused, never called."""


class UnknownCodecError(CheckpointFormatError):
    """A shard is stored with a codec this version of shardkit cannot decode."""


class SliceIndexError(ShardkitError, IndexError):
    """An index passed to get_slice does not fit the tensor (out of bounds, too many axes)."""


class MissingShardError(CheckpointFormatError):
    """A shard file listed in the manifest is missing from the checkpoint directory."""


class CheckpointReplacedError(CheckpointFormatError):
    """The checkpoint a reader opened was replaced (and its old directory deleted) mid-read."""


class NotRegularFileError(CheckpointFormatError):
    """A shard or the manifest is a directory, FIFO, device or socket, not a regular file."""


class SymlinkRefusedError(CheckpointFormatError):
    """A shard or the manifest is a symbolic link and the reader was not asked to follow links."""


class ShardIOError(ShardkitError, OSError):
    """The operating system failed a read, a write or a memory map of a checkpoint file, or the
    creation of its directory (errno kept: ENOSPC, EFBIG, EROFS, EACCES...)."""


class ReaderClosedError(ShardkitError, ValueError):
    """A CheckpointReader was used after close()."""


class MissingDependencyError(ShardkitError, ImportError):
    """An optional package (matplotlib, safetensors, torch...) is needed but not installed."""


class UnknownModelError(ShardkitError, ValueError):
    """No built-in synthetic model has the requested name."""


class IncompleteRestoreError(ShardkitError, AssertionError):
    """A restore did not match every checkpoint value to an object, or every object to a value."""


class SplitTensorsWarning(UserWarning):
    """`shardkit.save` stored some tensors split into slices (the sharding callback split them):
    HuggingFace loaders (``from_pretrained``, ``safetensors``) cannot read those, as they are
    absent from the manifest's ``weight_map``; shardkit reads them as usual. Policies that keep
    tensors whole: DefaultShardingPolicy, ShardByTaskPolicy, AllInOnePolicy."""


class RetentionWarning(UserWarning):
    """`CheckpointManager` retention kept a checkpoint it would have deleted: a symbolic link
    (retention never follows one, nor deletes what it points at), a manifest it cannot read
    (so what it names is unknown), or a deletion that failed. The new checkpoint is committed
    either way."""


# Many processes (shardkit.distributed): every rank of a collective save raises the same error.


class DistributedError(ShardkitError):
    """A collective operation of several processes (ranks) failed."""


class DistributedTimeoutError(DistributedError, TimeoutError):
    """A collective did not complete within its timeout, or a rank left it (died): names the
    operation and, where known, the ranks that did not answer."""


class DistributedStateError(DistributedError, ValueError):
    """The ranks of a collective save disagree about a tensor they all hold (shape or dtype),
    or a distributed tensor cannot be saved as slices (a Partial placement); names the key and
    the ranks."""


class DistributedSaveError(DistributedError, RuntimeError):
    """A rank of a collective save failed (its callback, validation, writing, the commit): every
    rank raises this, naming the failing `rank` and its cause (`cause_type`, `cause_message`).
    Nothing became visible and an earlier checkpoint at the path is intact."""

    def __init__(self, message: str, rank: int | None = None, cause_type: str = "",
                 cause_message: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.cause_type = cause_type
        self.cause_message = cause_message


# Object storage (shardkit.storage).


class StorageError(ShardIOError):
    """An object store refused a request for good (not a transient error: those are retried),
    or kept failing past the retries: names the object (its URL) and the store's reason."""


@dataclass(frozen=True, slots=True)
class Problem:
    """One problem `CheckpointReader.verify` found: the file to blame (a shard, or the manifest
    when the index is what disagrees), the checkpoint key (None when it is not about one key),
    what is wrong, what was expected and what was found, and the error class it raises as.

    ``str(problem)`` is ``<file>: <key or ->: <what>, expected <x> vs found <y>``.
    """

    file: str
    key: str | None
    what: str
    expected: str
    found: str
    error: type[CheckpointFormatError] = CheckpointFormatError

    @property
    def label(self) -> str:
        """How the command line labels it: ``UNSUPPORTED`` for a format this shardkit does not
        read (`UnsupportedVersionError`: a newer format, say), else ``CORRUPT``."""
        return "UNSUPPORTED" if issubclass(self.error, UnsupportedVersionError) else "CORRUPT"

    def __str__(self) -> str:
        key = "-" if self.key is None else repr(self.key)
        return " ".join(f"{self.file}: {key}: {self.what}, expected {self.expected} vs found "
                        f"{self.found}".split())

# every error and warning; all of them are importable from shardkit too
__all__ = [
    "ShardkitError", "SliceSpecError", "DeviceSpecError", "UnsupportedDTypeError",
    "ShardingValidationError", "InvalidMetadataError", "PolicyError", "InvalidArgumentError",
    "InvalidArgumentTypeError", "InvalidKeyError", "InvalidKeyTypeError",
    "CheckpointNotFoundError", "KeyNotFoundError", "CheckpointFormatError",
    "UnsupportedVersionError", "ChecksumError", "CheckpointExistsError",
    "RestoreMismatchError", "CorruptHeaderError", "EntryLayoutError",
    "GenerationMismatchError", "TruncatedShardError", "CorruptIndexError", "ShardPathError",
    "UnsafePickleError", "UnknownCodecError", "SliceIndexError", "MissingShardError",
    "CheckpointReplacedError", "NotRegularFileError", "SymlinkRefusedError", "ShardIOError",
    "ReaderClosedError",
    "MissingDependencyError", "UnknownModelError", "IncompleteRestoreError",
    "SplitTensorsWarning", "RetentionWarning", "DistributedError", "DistributedTimeoutError",
    "DistributedStateError", "DistributedSaveError", "StorageError", "Problem",
]
