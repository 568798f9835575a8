"""`ShardSet`: one opened checkpoint's index and shard sources, the state every read shares.

It opens the checkpoint once through its `Storage` (locally the directory handle every file is
opened through; at a URL the manifest's object and the shard objects of its generation), opens
each shard's source on first use and checks its header against the index, and owns the read
pool, the lock and the count of reads in flight that `close` waits for.
"""

from __future__ import annotations

import difflib
import operator
import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Any

import numpy as np

from ..._threads import WorkerPool
from ...adapters import SHARDKIT, ParsedHeader
from ...adapters import read_index as read_layout
from ...errors import (
    CheckpointFormatError,
    CheckpointReplacedError,
    CorruptHeaderError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    KeyNotFoundError,
    MissingShardError,
    ReaderClosedError,
)
from ...format import EntryLayout, SliceInfo, TensorInfo
from ...shards.files import FilePool
from ...shards.raw import RawShard, ShardSource
from ...storage import open_storage
from ...values.slices import SliceSpec, parse_slice_spec
from ...values.strings import StringTensors

MAX_OPEN_FILES = 64  # shard descriptors a reader keeps open between reads (mmap=False)


class ShardSet:
    """The index and the lazily opened shard sources of the checkpoint at `path` (a
    directory, a file a layout accepts, or a URL); CheckpointFormatError when its layout or
    manifest is malformed."""

    def __init__(self, path: str, *, mmap: bool, follow_symlinks: bool) -> None:
        self.path = path
        self.mmap = mmap
        self._files = FilePool(MAX_OPEN_FILES)
        # shard headers a foreign layout's adapter parsed already: used on first read when the
        # file is still the one parsed (same stamp), not parsed twice
        self._headers: dict[int, ParsedHeader] = {}
        directory = open_storage(path).open_checkpoint(follow_symlinks=follow_symlinks,
                                                       pool=self._files)
        self.directory = directory
        try:
            self.layout, self.manifest, self.index = read_layout(
                directory, directory.single, self._headers)
        except BaseException:
            directory.close()
            raise
        self.manifest_path = directory.join(self.manifest)
        generation = directory.generation = self.index.generation  # its files' generation
        self.shard_paths = [directory.shard_path(s.file, generation) for s in self.index.shards]
        self.strings: StringTensors | None = self.index.strings  # string tensors, or None
        self.sources: dict[int, ShardSource] = {}
        self._specs: dict[str, list[SliceSpec]] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0  # reads in flight; close() waits for them before releasing files
        self._pool: WorkerPool | None = None
        self.closed = False

    # -- reads in flight, and closing

    def __enter__(self) -> None:
        """``with shards:`` is one read in flight, which `close` waits for."""
        with self._lock:
            self.check_open()
            self._active += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._active -= 1
            if not self._active:
                self._idle.notify_all()

    def check_open(self) -> None:
        if self.closed:
            raise ReaderClosedError(f"checkpoint reader for {self.path} is closed")

    def close(self) -> None:
        """Wait for the reads in flight, then release the sources, the pool and the directory."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            while self._active:  # never pull a file from under a read in another thread
                self._idle.wait()
            sources, self.sources = self.sources, {}
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        for src in sources.values():
            src.close()
        self.directory.close()

    def worker_pool(self) -> WorkerPool:
        """The read pool, started on first use."""
        with self._lock:
            self.check_open()
            if self._pool is None:
                workers = max(2, min(8, os.cpu_count() or 1))
                self._pool = WorkerPool(workers, "shardkit-read")
                weakref.finalize(self, self._pool.shutdown, wait=False)
            return self._pool

    # -- the index

    def count(self) -> int:
        """Keys readable: tensors stored, their aliases and string tensors."""
        return (len(self.index.keys) + len(self.index.aliases or ())
                + (0 if self.strings is None else len(self.strings.keys)))

    def stored_keys(self) -> list[str]:
        """Every key, in saved order (aliases, then string tensors, last)."""
        if self.strings is not None:
            return [*self.index.all_keys(), *self.strings.keys]
        return self.index.all_keys()

    def keys_under(self, prefix: str) -> tuple[str, list[str]]:
        """(`prefix` ending in one separator, the keys under it, in saved order) for a
        ``prefix=`` argument: "model" and "model/" both select ``model/...`` (a key component
        boundary: never ``modelx/...``, nor the key "model" itself). The separator is the
        layout's (`FormatAdapter.separator`: ``.`` in DCP's and torch.save's flattened names,
        where "model" selects ``model.0.weight``). KeyNotFoundError, naming the prefix and the
        nearest prefixes stored, when no key is under it."""
        if not isinstance(prefix, str):
            raise InvalidArgumentTypeError(f"prefix must be a str, got {prefix!r}")
        sep = self.layout.separator
        start = prefix.rstrip(sep) + sep
        if start == sep:
            raise InvalidArgumentError(f"prefix must name a key component, got {prefix!r}")
        keys = self.stored_keys()
        under = [k for k in keys if k.startswith(start)]
        if not under:
            depth = start.count(sep)
            stored = dict.fromkeys(sep.join(k.split(sep, depth)[:depth]) + sep
                                   for k in keys if k.count(sep) >= depth)
            close = difflib.get_close_matches(start, list(stored), n=3, cutoff=0.5)
            near = close or list(stored)[:3]
            hint = f"; prefixes stored: {', '.join(map(repr, near))}" if near else ""
            raise KeyNotFoundError(f"no key under prefix {prefix!r} in checkpoint {self.path} "
                                   f"({self.count()} tensors){hint}")
        return start, under

    def tensor(self, key: str) -> TensorInfo:
        """The index's `TensorInfo` of `key`; KeyNotFoundError with the nearest key."""
        self.check_open()
        try:
            return self.index.tensor_info(key)
        except (KeyError, TypeError):
            pass
        why = self.layout.missing(self.index, key) if isinstance(key, str) else None
        if why is not None:
            raise KeyNotFoundError(f"key {key!r} of checkpoint {self.path} is {why}")
        close = difflib.get_close_matches(str(key), self.index.keys, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise KeyNotFoundError(
            f"key {key!r} is not in checkpoint {self.path} ({self.count()} tensors){hint}"
        )

    def rows_of(self, keys: Sequence[str]) -> np.ndarray:
        """The index row of each of `keys` (-1 for a string tensor), looked up once for the
        whole read; KeyNotFoundError (with a hint) for the first key that is neither."""
        try:
            rows = np.fromiter(map(self.index.rows().get, keys, repeat(-1)), np.intp, len(keys))
        except TypeError:  # an unhashable key: named by the per-key check
            rows = np.full(len(keys), -1, np.intp)
        strings = self.strings
        for i in np.flatnonzero(rows < 0).tolist():
            if strings is None or keys[i] not in strings:
                self.tensor(keys[i])
        return rows

    def slice_specs(self, key: str, t: TensorInfo) -> list[SliceSpec]:
        """The parsed specs of `key`'s stored slices (cached)."""
        specs = self._specs.get(key)
        if specs is None:
            specs = self._specs[key] = [parse_slice_spec(s.spec, t.shape) for s in t.slices]
        return specs

    # -- shard sources

    def entry(self, key: str, s: SliceInfo) -> tuple[ShardSource, EntryLayout]:
        """The source and entry of stored slice `s` of `key`."""
        src = self.source_for(key, s.shard)
        return src, src.entries[s.entry]  # presence checked when the shard was opened

    def source_for(self, key: str, shard: int) -> ShardSource:
        """`source`, with the key being read named in an error."""
        try:
            return self.source(shard)
        except CheckpointFormatError as e:
            if f"key {key!r}" in str(e):
                raise
            # same error class, plus the key the caller asked for
            raise type(e)(f"{e} (while reading key {key!r})") from None

    def source(self, i: int) -> ShardSource:
        """Shard `i`'s source, opened on first use and checked against the index."""
        src = self.sources.get(i)
        if src is not None:
            return src
        with self._lock:
            self.check_open()
            src = self.sources.get(i)
            if src is None:
                src = self._open_source(i)
                self.sources[i] = src
            return src

    def _open_source(self, i: int) -> ShardSource:
        info = self.index.shards[i]
        path = self.shard_paths[i]
        opener = self.directory.opener(info.codec, path)  # UnknownCodecError for an unknown one
        file = self.open_file(i)
        try:
            # a layout whose index places the entries (TensorBundle) opens its own
            src = self.layout.open_source(self.index, i, path, info, mmap=self.mmap, file=file)
            if src is None and opener is RawShard:
                # a foreign layout's headers are in any order: no writer's header to
                # recognise, parse it
                expected = self.expected(i) if self.layout is SHARDKIT else None
                parsed = self._headers.pop(i, None)
                header = None
                if parsed is not None and file.stamp() == parsed.stamp:
                    header = parsed.entries, parsed.metadata, parsed.data_start
                src = RawShard(path, info, mmap=self.mmap, expected=expected, file=file,
                               header=header)
            elif src is None:
                src = opener(path, info, mmap=self.mmap, file=file)
        except BaseException:
            file.close()
            raise
        try:
            if not src.matches_index:
                self._check_against_index(i, src)
        except BaseException:
            src.close()
            raise
        return src

    def open_all(self, rows: np.ndarray | None) -> None:
        """Open every shard holding the tensors at index `rows` (None: every shard; -1 rows,
        string tensors, are skipped)."""
        index = self.index
        if rows is None:
            shards: Iterable[int] = range(len(index.shards))
        else:
            rows = rows[rows >= 0]
            if bool((index.slice_counts()[rows] == 1).all()):  # each stored whole: one slice
                slice_ids = index.first_slice()[rows]
            else:
                wanted = np.zeros(len(index.keys), bool)
                wanted[rows] = True
                slice_ids = np.flatnonzero(wanted[np.asarray(index.slice_tensor, np.intp)])
            stops = [index.shard_range(i).stop for i in range(len(index.shards))]
            shards = np.unique(np.searchsorted(stops, slice_ids, side="right")).tolist()
        for i in shards:
            self.source(i)

    def open_file(self, i: int) -> Any:
        """Shard file `i`, opened through the checkpoint's directory (locally its handle)."""
        path = self.shard_paths[i]
        try:
            return self.directory.open_shard_file(path, self.index.shards[i].file,
                                                  self.index.generation)
        except MissingShardError:
            if self.replaced():
                raise CheckpointReplacedError(
                    f"{path}: shard file is gone: the checkpoint at {self.path} was replaced "
                    "while this reader had it open, and the directory it reads from was "
                    "deleted; open the checkpoint again to read the new one"
                ) from None
            raise

    def replaced(self) -> bool:
        """Whether the directory this reader reads is no longer the one at its path."""
        return bool(self.directory.replaced())

    def expected(self, i: int) -> tuple[list[str], list[str], list[tuple[int, ...]]]:
        """What the index says shard `i` holds: entry names, dtype names and shapes, in
        data-region order."""
        index = self.index
        r = index.shard_range(i)
        names = index.entry_names()[r.start : r.stop]
        dtype_names = list(map(index.dtypes.__getitem__, index.slice_tensor[r.start : r.stop]))
        return names, dtype_names, index.slice_shapes()[r.start : r.stop]

    def _check_against_index(self, i: int, src: ShardSource) -> None:
        """Every slice the index puts in shard `i` must be an entry of it, same dtype and shape.

        Compared column-wise first (C-level maps); on any mismatch the per-slice check finds
        the first offender and words the message.
        """
        names, dtype_names, shapes = self.expected(i)
        entries = src.entries
        found = list(map(entries.get, names))
        if (
            not any(map(operator.is_, found, repeat(None)))
            and list(map(_dtype_name_of, found)) == dtype_names
            and list(map(_shape_of, found)) == shapes
        ):
            return
        index = self.index
        for j, name, dtype_name, shape, entry in zip(
            index.shard_range(i), names, dtype_names, shapes, found
        ):
            if entry is not None and entry.dtype_name == dtype_name and entry.shape == shape:
                continue
            key, spec = index.keys[index.slice_tensor[j]], index.slice_spec[j]
            where = f"{src.path}: entry {name!r} (key {key!r}, slice {spec!r})"
            if entry is None:
                raise CorruptHeaderError(
                    f"{where} is listed in {self.manifest} but not in the shard")
            raise CorruptHeaderError(
                f"{where} does not match {self.manifest}: expected dtype {dtype_name} shape "
                f"{list(shape)}, the shard has dtype {entry.dtype_name} shape "
                f"{list(entry.shape)}"
            )


_dtype_name_of = operator.attrgetter("dtype_name")
_shape_of = operator.attrgetter("shape")
