"""Writing TensorBundle checkpoints: ``<prefix>.index`` + one ``<prefix>.data-*`` per shard.

The shards come from shardkit's planner (the sharding callback, validated); each becomes one
data file, written by its own writer thread with the native write kernel
(`_gather.write_arrays`: vectored writes from the arrays' own memory, GIL released). Entries of a
data file are laid out by descending item size, so that each starts at a multiple of it (a
TensorFlow reader takes any offset; shardkit maps aligned entries zero-copy). A whole tensor is
one entry under its key; a tensor the callback split is a full entry listing its slices plus one
entry per slice under TensorFlow's encoded slice key, as BundleWriter::AddSlice writes it.
Every entry carries its masked crc32c.

Commit (what "atomic" means for a prefix, whose files share a directory with others): all files
are written into a hidden temp directory next to the prefix (``.<name>.shardkit-tmp-*``, locked
like shardkit's own saves, so a crashed save's leftovers are cleaned by the next save there) and
fsynced (`durable`); `publish.publish` then moves them in with the ``.index`` renamed last, as
the one commit step, and removes the old checkpoint's data files after it. The old files are
never moved: at every instant the prefix holds the complete old or the complete new checkpoint.
The ``checkpoint`` state file is not written (``tf.train.Checkpoint.write`` does not write it
either).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..._kernels import _gather
from ..._threads import ParallelRun
from ...errors import CheckpointExistsError, InvalidArgumentError, ShardIOError
from ...storage import commit
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


def _datatype(array: np.ndarray) -> int:
    if is_string(array.dtype):
        return DATATYPE_OF[STRING]
    return DATATYPE_OF[safetensors_name(array.dtype)]


def _entry(key: bytes, array: np.ndarray, shape: tuple[int, ...]) -> _Entry:
    if is_string(array.dtype):
        data, crc = encode_strings(as_bytes_list(np.asarray(array)))
        raw = np.frombuffer(data, np.uint8)
        return _Entry(key, DATATYPE_OF[STRING], shape, raw, len(data), crc=crc)
    a = np.ascontiguousarray(array)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return _Entry(key, _datatype(a), shape, a, a.nbytes)


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


def write_bundle(prefix: str, shards: Sequence[Any], strings: Any = None, *, threads: int,
                 durable: bool, overwrite: bool) -> tuple[list[str], int]:
    """Write `shards` (validated callback output, `writer.ShardColumns`) and the string
    tensors `strings` (a `strings.StringColumns`, which the callback does not see; they go into
    the last data file) as the TensorBundle at `prefix`; returns (the files written, data files
    then the index; their total bytes)."""
    target = check_prefix(prefix, overwrite)
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    commit.cleanup_stale(parent)
    n = max(1, len(shards))
    tmp, lock_fd = commit.locked_tmp(target)
    try:
        files = [_DataFile(data_file(target.name, i, n), tmp / data_file(target.name, i, n))
                 for i in range(n)]
        full: dict[bytes, Any] = {}
        for i, shard in enumerate(shards):
            f = files[i]
            for key, spec, array in zip(shard.keys, shard.specs, shard.arrays):
                kb = key.encode("utf-8")
                shape = tuple(int(d) for d in np.shape(array))
                whole = spec == WHOLE
                if not whole:
                    s = parse_slice_spec(spec)
                    whole = s.is_whole
                if whole:
                    f.entries.append(_entry(kb, array, shape))
                    continue
                proto = full.get(kb)
                if proto is None:
                    proto = full[kb] = BundleEntryProto(dtype=_datatype(np.asarray(array)))
                    for d in s.full_shape:
                        proto.shape.dim.add(size=d)
                ext = proto.slices.add()
                for o, ln in zip(s.offsets, s.lengths):
                    ext.extent.add(start=o, length=ln)
                f.entries.append(_entry(encode_slice_key(key, s.offsets, s.lengths), array,
                                        shape))
        if strings is not None:
            for key, array in zip(strings.keys, strings.arrays):
                files[-1].entries.append(_entry(key.encode("utf-8"), np.asarray(array),
                                                tuple(np.shape(array))))
        for f in files:
            _layout(f)
        ParallelRun(lambda f: _write_file(f, durable), files, threads).wait()
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
        entries = sorted(items.items())

        @functools.cache
        def table(num_shards: int) -> bytes:
            header = BundleHeaderProto(num_shards=num_shards, endianness=0)
            header.version.producer = 1
            return build_table([(b"", header.SerializeToString()), *entries])

        published = publish(tmp, parent, target.name, n, table, overwrite=overwrite,
                            durable=durable)
    finally:
        try:
            commit.remove_tree(tmp)
        finally:
            os.close(lock_fd)
    names = [str(parent / f) for f in published] + [str(parent / index_file(target.name))]
    return names, sum(f.size for f in files) + len(table(len(published)))

