"""CheckpointReader: lazy, zero-copy reading of a checkpoint.

A whole tensor of a raw shard comes back as a numpy view of a private (copy-on-write) map of the
shard: writable, writing never reaches the file, and the map is unmapped only when its last view
goes, so arrays stay valid after ``close()``. With ``mmap=False`` reads are large ``preadv``
calls on a thread pool into owned arrays, through a bounded set of descriptors
(`MAX_OPEN_FILES`). One reader reads one checkpoint (`shardkit.shards.files`); a shard that
vanished because the checkpoint was replaced raises CheckpointReplacedError, and `load` starts
again, a few times. The reader is a facade over `shardkit.io.reading`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import numpy as np

from ..errors import (
    CheckpointReplacedError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    MissingShardError,
    Problem,
)
from ..frameworks import convert_all, converter, module
from ..sharding.structure import nested_state
from ..sharding.tensors import gc_paused
from ..values.dtypes import numpy_dtype
from ..values.slicing import normalize_index
from ..values.strings import STRING_DTYPE, check_string_framework, kind_dtype
from .reading import boxes, whole
from .reading.shards import MAX_OPEN_FILES, ShardSet
from .reading.verify import VerifyReport, verify_boxes, verify_keys

__all__ = ["MAX_OPEN_FILES", "LOAD_ATTEMPTS", "CheckpointReader", "KeyInfo", "Problem",
           "SlicePlacement", "VerifyReport", "load", "open_checkpoint"]

LOAD_ATTEMPTS = 3  # how often `load` starts again when the checkpoint is replaced under it


@dataclass(frozen=True, slots=True)
class SlicePlacement:
    """Where one stored slice of a tensor lives."""

    spec: str
    shard: int
    file: str
    entry: str
    xxh3: str | None


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """What `CheckpointReader.info` reports about one tensor."""

    key: str
    dtype: np.dtype
    dtype_name: str
    shape: tuple[int, ...]
    device: str
    nbytes: int
    slices: tuple[SlicePlacement, ...]

    @property
    def is_split(self) -> bool:
        return len(self.slices) > 1


class CheckpointReader:
    """Read a checkpoint lazily; use as a context manager.

    `shardkit.adapters` detects the layout (`format`: shardkit's, HuggingFace's, a
    ``.safetensors`` file, a PyTorch DCP directory, a torch.save ``.pt`` file, a TensorBundle)
    and builds the entry table; the rest is the same for
    all. The reader reads the checkpoint that was at `path` when it was opened, and no other.
    Every array returned is writable and stays valid after `close`; writing to it never
    changes the checkpoint.

    Args:
        path: the checkpoint (directory, file or URL).
        mmap: map raw shards (else read them with ``preadv`` into owned arrays).
        verify: check every checksum on open.
        follow_symlinks: accept symlinked files.
        prefix: show only the sub-tree under this key prefix, keys relative to it.
    Raises:
        CheckpointNotFoundError: nothing is at `path`.
        CheckpointFormatError: the checkpoint is malformed (a subclass names the rule).
        KeyNotFoundError: no key is under `prefix`.
    """

    def __init__(self, path: str | os.PathLike[str], *, mmap: bool = True,
                 verify: bool = False, follow_symlinks: bool = False,
                 prefix: str | None = None) -> None:
        self.path = os.fspath(path)
        self._shards = shards = ShardSet(self.path, mmap=bool(mmap),
                                         follow_symlinks=bool(follow_symlinks))
        self.layout, self.index = shards.layout, shards.index
        self._strings = shards.strings  # string tensors, or None
        self._prefix, self._under = "", None  # a sub-tree's prefix and its keys (`prefix`)
        try:
            if prefix is not None:
                self._prefix, self._under = self._shards.keys_under(prefix)
            if verify:
                self.verify()
        except BaseException:
            self.close()
            raise

    # -- mapping-like API

    @property
    def format(self) -> str:
        """The layout read: "shardkit", "huggingface", "safetensors", "dcp", "torch-save" or
        "tensorbundle" (`shardkit.adapters`)."""
        return self.layout.name

    @property
    def generation(self) -> str | None:
        """The checkpoint's generation (a unique id made once per save, format 2.1); every
        shard read is checked to be of it. None for a format 2.0 checkpoint, which has none."""
        return self.index.generation

    @property
    def metadata(self) -> dict[str, Any]:
        """The user metadata saved with the checkpoint."""
        return self.index.user_metadata

    def keys(self) -> list[str]:
        """The checkpoint's keys.

        Returns:
            The keys in saved order (string tensors last); with a `prefix`, the keys under it,
            the prefix stripped.
        """
        if self._under is not None:
            n = len(self._prefix)
            return [k[n:] for k in self._under]
        return self._shards.stored_keys()

    def __iter__(self) -> Iterator[str]:
        if self._strings is None and self._under is None and not self.index.aliases:
            return iter(self.index.keys)
        return iter(self.keys())

    def __len__(self) -> int:
        if self._under is not None:
            return len(self._under)
        return self._shards.count()

    def _full(self, key: Any) -> Any:
        """The stored key of `key` as the caller names it (under `prefix`)."""
        return self._prefix + key if self._prefix and isinstance(key, str) else key

    def __contains__(self, key: object) -> bool:
        key = self._full(key)
        try:
            self.index.row(key)  # type: ignore[arg-type]
        except (KeyError, TypeError):
            return self._is_string(key)
        return True

    def _is_string(self, key: object) -> bool:
        """Whether `key` is a string tensor (`shardkit.strings`)."""
        return self._strings is not None and key in self._strings

    def __getitem__(self, key: str) -> np.ndarray:
        return self.get(key)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._shards.closed else f"{len(self)} tensors"
        return f"CheckpointReader({self.path!r}, {state})"

    def info(self, key: str) -> KeyInfo:
        """dtype, full shape, device and stored slices (with shard file names) of `key`.

        A string tensor reports dtype name ``"STRING"``, the numpy dtype of its kind (object for
        bytes / str), the bytes of its block and one placement, in the string file.

        Args:
            key: the tensor's key.
        Returns:
            Its `KeyInfo`.
        Raises:
            KeyNotFoundError: `key` is not stored.
        """
        named, key = key, self._full(key)
        if self._is_string(key):
            return dataclasses.replace(self._string_info(key), key=named)
        t = self._shards.tensor(key)
        shards = self.index.shards
        return KeyInfo(
            named, numpy_dtype(t.dtype), t.dtype, t.shape, t.device, t.nbytes,
            tuple(SlicePlacement(s.spec, s.shard, shards[s.shard].file, s.entry, s.xxh3)
                  for s in t.slices),
        )

    # -- reading

    @overload
    def get(self, key: str, *, framework: Literal["numpy"] = ..., device: Any = ...
            ) -> np.ndarray: ...
    @overload
    def get(self, key: str, *, framework: str, device: Any = ...) -> Any: ...

    def get(self, key: str, *, framework: str = "numpy", device: Any = None) -> Any:
        """The whole tensor `key` (ml_dtypes arrays for bfloat16 / float8); ``reader[key]`` too.

        Args:
            key: the tensor's key (under `prefix`, when the reader has one).
            framework: as for `load` (``reader[key]`` is always numpy).
            device: the framework's device.
        Returns:
            The tensor.
        Raises:
            KeyNotFoundError: `key` is not stored.
            CheckpointFormatError: a shard it reads is malformed.
            ReaderClosedError: the reader is closed.
        """
        conv = converter(framework, device)  # checked before anything is read
        key = self._full(key)
        with self._shards:
            if self._is_string(key):
                check_string_framework(framework, key)
                array = self._get_string(key)
            else:
                array = whole.get_one(self._shards, key)
        return array if conv is None else conv(array, key)

    def _get_many(self, keys: Sequence[str] | None, rows: np.ndarray | None = None
                  ) -> dict[str, np.ndarray]:
        """`get` of each key, in bulk: whole tensors of a raw mapped shard become views in one
        pass per shard; whole tensors stored in compressed shards are read in one batch, so
        that every chunk is decoded once and the chunks are decoded in parallel. `rows`: the
        keys' `ShardSet.rows_of`, when the caller has them."""
        strings = self._strings
        with self._shards:
            with gc_paused():  # one GC pass at the end, not one per ~700 new arrays
                if strings is not None and keys is None:  # every tensor, then every string one
                    every = whole.get_tensors(self._shards, None)
                    every.update((k, self._get_string(k)) for k in strings.keys)
                    return every
                if strings is not None and keys is not None:  # strings apart, in the order asked
                    wanted = list(dict.fromkeys(keys))
                    stored = set(strings.keys).intersection(wanted)  # not 50,000 calls of `in`
                    texts = {k: self._get_string(k) for k in wanted if k in stored}
                    if texts:
                        rest = whole.get_tensors(self._shards,
                                                 [k for k in wanted if k not in texts])
                        return {k: texts[k] if k in texts else rest[k] for k in wanted}
                return whole.get_tensors(self._shards, keys, rows)

    def _read_direct(self, targets: Sequence[tuple[str, np.ndarray]]) -> set[str]:
        """Decode whole tensors stored in compressed shards straight into their target arrays
        (`whole.read_direct`); returns those keys."""
        with self._shards:
            return whole.read_direct(self._shards, targets)

    @overload
    def get_slice(self, key: str, index: Any, *, framework: Literal["numpy"] = ...,
                  device: Any = ...) -> np.ndarray: ...
    @overload
    def get_slice(self, key: str, index: Any, *, framework: str, device: Any = ...
                  ) -> Any: ...

    def get_slice(self, key: str, index: Any, *, framework: str = "numpy",
                  device: Any = None) -> Any:
        """``full_tensor[index]``, reading only the bytes it needs of the slices it intersects.

        Args:
            key: the tensor's key.
            index: a numpy basic index (ints, slices with steps, ``...``, None).
            framework, device: as for `get`.
        Returns:
            The part of the tensor: a writable view of the private map when it is one raw
            entry's and `mmap` is on, else a new array.
        Raises:
            KeyNotFoundError: `key` is not stored.
            InvalidArgumentError: `index` is not a basic index of the tensor's shape.
        """
        conv = converter(framework, device)  # checked before anything is read
        key = self._full(key)
        with self._shards:
            if self._is_string(key):
                check_string_framework(framework, key)
                stored = self._get_string(key)
                normalize_index(index, stored.shape, key)  # the same checks and errors
                array = np.array(stored[index], dtype=stored.dtype)
            else:
                array = boxes.get_slice(self._shards, key, index)
        return array if conv is None else conv(array, key)

    def _verify_boxes(self, regions: Sequence[tuple[str, Sequence[int], Sequence[int]]]
                      ) -> None:
        """`verify` of only the stored slices that intersect the boxes (key, offsets,
        lengths); raises as `verify` does."""
        with self._shards:
            report = verify_boxes(self._shards, regions)
        if report.problems:
            raise report.error()

    def _read_boxes_into(self, regions: Sequence[tuple[str, Sequence[int], np.ndarray]]
                         ) -> None:
        """For each (key, offsets, out): fill `out` with that box of the tensor
        (`boxes.read_boxes_into`)."""
        with self._shards:
            boxes.read_boxes_into(self._shards, regions)

    def verify(self, keys: Sequence[str] | None = None) -> int:
        """Check the stored entries of `keys` against the index: shard files and sizes,
        headers, entry dtypes and shapes, and the xxh3-64 checksums.

        Everything is checked before anything is raised (`verify_report` returns the problems).

        Args:
            keys: the keys to check (default: all, and every frame of every compressed shard).
        Returns:
            The number of entries whose checksum was compared.
        Raises:
            CheckpointFormatError: of the first problem's class (`ChecksumError`,
                `MissingShardError`, ...), every problem a line, the list in ``problems``.
            KeyNotFoundError: a key is not stored.
        """
        report = self.verify_report(keys)
        if report.problems:
            raise report.error()
        return report.checked

    def verify_report(self, keys: Sequence[str] | None = None) -> VerifyReport:
        """What `verify` checks, returned instead of raised.

        Each distinct problem is listed once, in shard order, blaming the file that is
        inconsistent (the manifest when it records what its shard does not have).

        Args:
            keys: the keys to check, under `prefix` when the reader has one (default: all).
        Returns:
            The `VerifyReport`.
        Raises:
            KeyNotFoundError: a key is not stored.
        """
        if keys is not None and self._prefix:
            keys = [self._full(k) for k in ([keys] if isinstance(keys, str) else keys)]
        with self._shards:
            return verify_keys(self._shards, keys)

    def close(self) -> None:
        """Release files and maps. Arrays already returned stay valid (they keep their map)."""
        self._shards.close()

    # -- internals

    def _get_string(self, key: str) -> np.ndarray:
        """String tensor `key`, a new array of its kind (`shardkit.strings`)."""
        shards = self._shards
        shards.check_open()
        strings = self._strings
        assert strings is not None
        try:
            return strings.read(shards.directory, strings.row(key))
        except MissingShardError:
            if shards.replaced():
                raise CheckpointReplacedError(
                    f"{shards.directory.path}: the string file is gone: the checkpoint at "
                    f"{self.path} was replaced while this reader had it open; open it again "
                    "to read the new one") from None
            raise

    def _string_info(self, key: str) -> KeyInfo:
        self._shards.check_open()
        strings = self._strings
        assert strings is not None
        row = strings.row(key)
        return KeyInfo(key, kind_dtype(strings.kinds[row], f"{self.path}: {key!r}"), STRING_DTYPE,
                       strings.shapes[row], strings.devices[row], strings.nbytes(row),
                       (SlicePlacement("", -1, strings.file_of(row), key, strings.xxh3_of(row)),))

    def _open_shards(self, keys: Sequence[str] | None, rows: np.ndarray | None = None) -> None:
        """Open (and map) every shard holding `keys` (default: all; `rows`: their
        `ShardSet.rows_of`) now rather than on first read, so a concurrent overwrite has only
        this short window to delete them."""
        strings = self._strings
        if keys is not None and rows is None:
            rows = self._shards.rows_of(keys)
        if strings is not None and strings.keys and (
                rows is None or bool((rows < 0).any())):
            self._get_string(strings.keys[0])  # reads (and keeps) the string file now
        self._shards.open_all(rows)


def open_checkpoint(path: str | os.PathLike[str], *, mmap: bool = True,
                    follow_symlinks: bool = False, prefix: str | None = None
                    ) -> CheckpointReader:
    """Open a checkpoint for lazy reading; close the reader or use it in a ``with`` block.

    Args:
        path: the checkpoint (directory, file or URL).
        mmap: map raw shards (else read them into owned arrays).
        follow_symlinks: accept symlinked files.
        prefix: show the sub-tree under this key prefix, keys relative to it (as `load`'s).
    Returns:
        The `CheckpointReader`.
    Raises:
        CheckpointNotFoundError: nothing is at `path`.
        CheckpointFormatError: the checkpoint is malformed (a subclass names the rule).
        KeyNotFoundError: no key is under `prefix`.
    """
    return CheckpointReader(path, mmap=mmap, follow_symlinks=follow_symlinks, prefix=prefix)


@overload
def load(path: str | os.PathLike[str], keys: Sequence[str] | None = ..., *, verify: bool = ...,
         mmap: bool = ..., follow_symlinks: bool = ...,
         framework: Literal["numpy"] | None = ..., device: Any = ..., prefix: str | None = ...,
         weights_only: bool = ..., map_location: None = ...,
         nested: bool = ...) -> dict[str, np.ndarray]: ...
@overload
def load(path: str | os.PathLike[str], keys: Sequence[str] | None = ..., *, verify: bool = ...,
         mmap: bool = ..., follow_symlinks: bool = ..., framework: str | None = ...,
         device: Any = ..., prefix: str | None = ..., weights_only: bool = ...,
         map_location: Any = ..., nested: bool = ...) -> dict[str, Any]: ...


def load(
    path: str | os.PathLike[str],
    keys: Sequence[str] | None = None,
    *,
    verify: bool = False,
    mmap: bool = True,
    follow_symlinks: bool = False,
    framework: str | None = None,
    device: Any = None,
    prefix: str | None = None,
    weights_only: bool = True,
    map_location: Any = None,
    nested: bool = False,
) -> dict[str, Any]:
    """Read tensors of a checkpoint into a flat dict.

    A checkpoint replaced while it is read is read again (up to LOAD_ATTEMPTS times), so the
    result is always all of one checkpoint.

    Args:
        path: the checkpoint (directory, file or URL).
        keys: the keys to read (default: all, in saved order); a single str is one key.
        verify: check the checksums of the loaded entries first.
        mmap: whole raw tensors as views of private copy-on-write maps (writing to them never
            changes the files); else read into owned arrays.
        follow_symlinks: accept symlinked files.
        framework: "numpy", "torch", "jax" or "tensorflow" (`shardkit.frameworks`); None (the
            default) is "numpy", or "torch" with `map_location`.
        device: the framework's device (torch: a str or torch.device; jax: a Device, Sharding
            or platform string).
        prefix: take the sub-tree under this key prefix, stripped (``"model"`` returns
            ``model/0.weight`` as ``0.weight``, never ``modelx/...``); `keys` relative to it.
        weights_only: as ``torch.load``'s; always True here (shardkit never unpickles), and
            False is refused.
        map_location: as ``torch.load``'s, for torch tensors (implies ``framework="torch"``):
            a str or torch.device (every tensor there; "meta": tensors without data), a dict
            from saved location ("cpu", "cuda:0") to a str or torch.device (a location it does
            not name stays where it was saved), or a callable ``(tensor, location) -> tensor``
            given each tensor on the CPU and its saved location (None: where it was saved).
        nested: give back the state as it was saved (its dicts with their str and int keys,
            lists, tuples, NamedTuples, None, str and Python numbers, from the manifest's
            structure record) instead of a flat dict; a checkpoint without a record comes back
            as nested dicts of its ``/``-joined keys. Not with `keys`.
    Returns:
        A dict from key to numpy array (or the framework's tensor), in the order read; with
        `nested`, the nested state (under `prefix`, that sub-tree).
    Raises:
        CheckpointNotFoundError: nothing is at `path`.
        KeyNotFoundError: a key is not stored, or none is under the prefix.
        InvalidArgumentError: an unknown framework, a bad device, an empty prefix,
            ``weights_only=False``, or `map_location` with another framework than "torch",
            with `device`, naming a device torch cannot use here (a message naming the key and
            device), or its callable changing a tensor's shape or dtype.
        InvalidArgumentTypeError: `map_location` is none of its forms, or its callable
            returned neither a tensor nor None.
        MissingDependencyError: the framework is not installed.
        CheckpointFormatError: the checkpoint is malformed (a subclass names the rule).
        ShardIOError: the operating system failed a read.
    """
    if weights_only is not True:
        if weights_only is False:
            raise InvalidArgumentError(
                "weights_only=False: shardkit never unpickles (a checkpoint holds only typed "
                "tensors and values, never code), so every load is weights-only; drop the "
                "argument or pass True")
        raise InvalidArgumentTypeError(f"weights_only must be True, got {weights_only!r}")
    if nested is not False and (nested is not True or keys is not None):
        raise (InvalidArgumentTypeError(f"nested must be True or False, got {nested!r}")
               if nested is not True else InvalidArgumentError(
                   "nested=True gives back the whole state (or a prefix's sub-tree): pass "
                   "keys= or nested=True, not both"))
    mapper = None
    if map_location is not None:
        if framework not in (None, "torch") or device is not None:
            raise InvalidArgumentError(
                f"map_location places torch tensors: it takes framework='torch' (or none), not "
                f"framework={framework!r}, and no device= (got device={device!r})")
        framework = "torch"
    elif framework is None:
        framework = "numpy"
    conv = converter(framework, device)  # checked before anything is read
    if map_location is not None:
        mapper = module("torch").MapLocation(map_location)
    if isinstance(keys, str):
        keys = [keys]
    if keys is not None:
        keys = list(keys)
    for attempt in range(1, LOAD_ATTEMPTS + 1):
        try:
            with CheckpointReader(path, mmap=mmap, follow_symlinks=follow_symlinks) as reader:
                wanted = keys
                if prefix is not None:
                    start, under = reader._shards.keys_under(prefix)
                    wanted = under if keys is None else [
                        start + k if isinstance(k, str) else k for k in keys]
                if reader._strings is None and wanted == reader.index.keys:
                    wanted = None  # every key, in saved order: the full read (one C compare)
                # rows: fail on a missing key before reading anything
                rows = None if wanted is None else reader._shards.rows_of(wanted)
                if reader._strings is not None:
                    stored = reader._strings.keys
                    for key in stored if wanted is None else set(stored).intersection(wanted):
                        check_string_framework(framework, key)
                if mapper is not None:  # every target device checked before any read
                    index = reader.index
                    pairs = (index.rows().items() if rows is None
                             else zip(wanted or (), rows.tolist()))
                    conv = mapper.bind({k: index.devices[r] for k, r in pairs if r >= 0})
                reader._open_shards(wanted, rows)  # right after the index: a replace's window
                if verify:
                    reader.verify(wanted)
                arrays = reader._get_many(wanted, rows)
                structure, tied = reader.index.structure, bool(reader.index.aliases)
            if mapper is not None:  # by stored key, which the targets are keyed by
                arrays, conv = convert_all(arrays, conv, tied=tied), None
            if prefix is not None:
                arrays = {k[len(start):]: a for k, a in arrays.items()}
            arrays = arrays if conv is None else convert_all(arrays, conv, tied=tied)
            return nested_state(structure, arrays, reader.path, prefix) if nested else arrays
        except CheckpointReplacedError:
            if attempt == LOAD_ATTEMPTS:
                raise
    raise AssertionError("unreachable")

