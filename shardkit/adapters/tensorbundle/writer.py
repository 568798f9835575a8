"""Writing TensorBundle checkpoints: ``<prefix>.index`` + one ``<prefix>.data-*`` per shard.

Each shard of the (validated) callback becomes one data file, written by its own thread with
the native write kernel (`_gather.write_arrays`), entries by descending item size so that each
is aligned (shardkit maps them zero-copy). A split tensor is a full entry listing its slices
plus one entry per slice, as BundleWriter::AddSlice writes it (docs/FORMAT.md section 12).

The save is an output format of the save flow (`BundleOutput`): the files go into a hidden,
locked temp directory next to the prefix (`BundleOutput.stage`; a crashed save's is cleaned by
the next save there) and are published by `publish.publish`, the ``.index`` renamed last. The
``checkpoint`` state file is not written (``tf.train.Checkpoint.write`` does not either).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..._kernels import _gather
from ..._threads import ParallelRun
from ...errors import (
    CheckpointExistsError,
    InvalidArgumentError,
    ShardIOError,
    UnsupportedDTypeError,
)
from ...storage import commit
from ...storage.local import LocalStorage
from ...values.dtypes import safetensors_name
from ...values.slices import WHOLE, parse_slice_spec
from .crc import crc32c_extend, mask
from .datatypes import DATATYPE_OF, STRING
from .names import data_file, encode_slice_key, index_file
from .protos import BundleEntryProto, BundleHeaderProto
from .publish import publish
from .strings import as_bytes_list, encode_strings
from .table import build_table

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def is_string(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind in "OSU"


@dataclass(slots=True)
class _Entry:
    key: bytes
    dtype: int
    shape: tuple[int, ...]
    data: np.ndarray  # C-contiguous bytes (uint8) or the array itself
    size: int
    offset: int = 0
    crc: int = 0


@dataclass(slots=True)
class _DataFile:
    name: str
    path: Path
    entries: list[_Entry] = field(default_factory=list)
    size: int = 0


def _datatype(key: bytes, array: np.ndarray) -> int:
    name = STRING if is_string(array.dtype) else safetensors_name(array.dtype)
    if name not in DATATYPE_OF:
        raise UnsupportedDTypeError(
            f"{key.decode('utf-8')!r}: a TensorFlow checkpoint (TensorBundle) cannot hold dtype"
            f" {array.dtype}, which TensorFlow's DataType has no counterpart for; save it in"
            " shardkit's format instead")
    return DATATYPE_OF[name]


def _entry(key: bytes, array: np.ndarray, shape: tuple[int, ...]) -> _Entry:
    if is_string(array.dtype):
        data, crc = encode_strings(as_bytes_list(np.asarray(array)))
        raw = np.frombuffer(data, np.uint8)
        return _Entry(key, DATATYPE_OF[STRING], shape, raw, len(data), crc=crc)
    a = np.ascontiguousarray(array)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return _Entry(key, _datatype(key, a), shape, a, a.nbytes)


def _layout(f: _DataFile) -> None:
    """Offsets by descending item size (strings, item size 1, last), each entry aligned."""
    def item(e: _Entry) -> int:
        return 1 if e.dtype == DATATYPE_OF[STRING] else e.data.dtype.itemsize

    pos = 0
    for e in sorted(f.entries, key=lambda e: -item(e)):
        e.offset = pos
        pos += e.size
    f.entries.sort(key=lambda e: e.offset)
    f.size = pos


def _write_file(f: _DataFile, durable: bool) -> None:
    try:
        fd = os.open(f.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o644)
    except OSError as e:
        raise ShardIOError(e.errno, f"{f.path}: cannot create the data file: {e.strerror}") from e
    try:
        if f.size:
            _gather.preallocate(fd, f.size)
        arrays = [e.data for e in f.entries if e.size]
        at = f.entries[0].offset if f.entries else 0
        done = 0
        while done < len(arrays):
            n = _gather.write_arrays(fd, arrays[done:], at)
            if n == 0:  # not a C-contiguous numpy array: cannot happen (made contiguous)
                raise AssertionError("write_arrays wrote nothing")
            at += sum(a.nbytes for a in arrays[done : done + n])
            done += n
        for entry in f.entries:
            if entry.dtype != DATATYPE_OF[STRING]:
                entry.crc = mask(crc32c_extend(0, entry.data.reshape(-1).view(np.uint8)))
        if durable:
            os.fsync(fd)
    except OSError as e:
        if isinstance(e, ShardIOError):
            raise
        raise ShardIOError(e.errno, f"{f.path}: cannot write the data file: {e.strerror}") from e
    finally:
        os.close(fd)


def check_prefix(prefix: str, overwrite: bool) -> Path:
    """The prefix as a Path, or an error when it cannot be written."""
    path = Path(prefix)
    if not path.name or path.name in (".", ".."):
        raise InvalidArgumentError(f"{prefix!r} is not a checkpoint prefix (it names a "
                                   "directory; a TensorFlow prefix is a path such as dir/ckpt-1)")
    if path.is_dir():
        raise InvalidArgumentError(f"{prefix}: a directory exists at the prefix; a TensorFlow "
                                   "checkpoint is files named <prefix>.index and <prefix>.data-*")
    if os.path.lexists(index_file(prefix)) and not overwrite:
        raise CheckpointExistsError(f"{index_file(prefix)} exists", "to replace that checkpoint")
    return path


class BundleOutput:
    """``save(..., format="tensorflow")`` as an output format of the save flow
    (`io.flow.run_save`): `shards` (validated callback output, `io.writer.ShardColumns`) and the
    string tensors (which the callback does not see; they go into the last data file) as the
    TensorBundle at `prefix`."""

    user_metadata: dict[str, Any] = {}  # noqa: RUF012  # none: refused

    def __init__(self, prefix: str, opts: Any, user_metadata: dict[str, Any],
                 progress: bool) -> None:
        for name, bad in (("compression", opts.compression is not None),
                          ("metadata", bool(user_metadata)), ("progress", progress)):
            if bad:
                raise InvalidArgumentError(
                    f"save(..., format='tensorflow') cannot honour {name}: a TensorFlow "
                    "checkpoint stores raw tensors and no user metadata")
        self.url = self.prefix = prefix
        self.durable = opts.durable

    def check_target(self, overwrite: bool) -> None:
        check_prefix(self.prefix, overwrite)

    def stage(self, overwrite: bool) -> commit.Staging:
        """The locked temp directory next to the prefix (`store`, a LocalStorage of it; a
        crashed save's is cleaned by the next save there); no generation."""
        path = check_prefix(self.prefix, overwrite)
        path.parent.mkdir(parents=True, exist_ok=True)
        commit.cleanup_stale(path.parent)
        staging = commit.Staging(path, overwrite=overwrite, durable=self.durable)
        staging.store = LocalStorage(str(staging.path))
        staging.generation = None  # type: ignore[assignment]
        return staging

    def write(self, where: Any, generation: None, rank: Any, first: int, count: int
              ) -> tuple[list[_DataFile], list[tuple[bytes, bytes]]]:
        """The data files written and fsynced in `where` (the temp directory), and the
        entries of the ``.index``, sorted."""
        name, tmp = Path(self.prefix).name, Path(os.fspath(where))
        n = max(1, len(rank.shards))
        files = [_DataFile(data_file(name, i, n), tmp / data_file(name, i, n))
                 for i in range(n)]
        full: dict[bytes, Any] = {}
        for i, shard in enumerate(rank.shards):
            f = files[i]
            for key, spec, array in zip(shard.keys, shard.specs, shard.arrays):
                kb = key.encode("utf-8")
                shape = tuple(int(d) for d in np.shape(array))
                s = None if spec == WHOLE else parse_slice_spec(spec)
                if s is None or s.is_whole:
                    f.entries.append(_entry(kb, array, shape))
                    continue
                proto = full.get(kb)
                if proto is None:
                    proto = full[kb] = BundleEntryProto(dtype=_datatype(kb, np.asarray(array)))
                    for d in s.full_shape:
                        proto.shape.dim.add(size=d)
                ext = proto.slices.add()
                for o, ln in zip(s.offsets, s.lengths):
                    ext.extent.add(start=o, length=ln)
                f.entries.append(_entry(encode_slice_key(key, s.offsets, s.lengths), array,
                                        shape))
        strings = rank.strings
        if strings is not None:
            for key, array in zip(strings.keys, strings.arrays):
                files[-1].entries.append(_entry(key.encode("utf-8"), np.asarray(array),
                                                tuple(np.shape(array))))
        for f in files:
            _layout(f)
        ParallelRun(lambda f: _write_file(f, self.durable), files, rank.threads).wait()
        items: dict[bytes, bytes] = {}
        for i, f in enumerate(files):
            for e in f.entries:
                if e.key in items or e.key in full:
                    raise InvalidArgumentError(f"key {e.key!r} is stored twice")
                proto = BundleEntryProto(dtype=e.dtype, shard_id=i, offset=e.offset,
                                         size=e.size, crc32c=e.crc)
                for d in e.shape:
                    proto.shape.dim.add(size=d)
                items[e.key] = proto.SerializeToString()
        for kb, proto in full.items():
            items[kb] = proto.SerializeToString()
        return files, sorted(items.items())

    def commit(self, staging: commit.Staging,
               merged: tuple[list[_DataFile], list[tuple[bytes, bytes]]]
               ) -> tuple[str, tuple[str, ...], int, None]:
        """Publish the bundle, its ``.index`` last (`publish.publish`): its path, files (data
        files, then the index), bytes and (no) generation."""
        files, entries = merged

        @functools.cache
        def table(num_shards: int) -> bytes:
            header = BundleHeaderProto(num_shards=num_shards, endianness=0)
            header.version.producer = 1
            return build_table([(b"", header.SerializeToString()), *entries])

        parent = staging.target.parent
        published = publish(staging.path, parent, staging.target.name, len(files), table,
                             overwrite=staging.overwrite, durable=self.durable)
        staging.abort()  # the temp directory, empty now, and its lock
        staging.committed = True
        names = [str(parent / f) for f in (*published, index_file(staging.target.name))]
        return (self.prefix, tuple(names),
                sum(f.size for f in files) + len(table(len(published))), None)
