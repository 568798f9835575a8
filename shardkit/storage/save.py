"""Saving to a store: shard objects first, the manifest last (docs/FORMAT.md section 13).

`FsspecStorage.stage`, `write_shards` and `write_strings` are these; the save flow itself is a
local one's. The manifest read at staging decides whether the save may replace it; the shards
of the writer's plan are uploaded under ``shards-<generation>/`` (raw ones from the arrays'
memory, ``.skz`` ones compressed into a local temp file first); the manifest is published
conditionally on the tag read; only then are the other generations' objects deleted.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .. import format as fmt
from .._threads import ParallelRun, WorkerPool
from ..errors import CheckpointExistsError, CheckpointFormatError, ShardkitError
from ..values.strings import STRING_FILE, StringColumns, StringFile
from .base import ShardFile, Storage
from .housekeeping import manifest_objects, mark_staging, remove_owned
from .layout import object_name
from .native import _as_bytes, _run_zstd, _write_strings


class RemoteStaging:
    """A save in progress at a URL, in the role `storage.commit.Staging` has locally: `path` is
    where the shards go (the URL; the objects carry `generation`), `commit` publishes the manifest
    conditionally and then deletes every other generation, `abort` deletes this save's
    objects."""

    def __init__(self, store: Storage, *, overwrite: bool) -> None:
        url = store.url
        self.store = store
        self.path = self.target = self.store.url
        self.committed = False
        self.generation = fmt.new_generation()
        self._old = self.store.fetch(fmt.MANIFEST_FILE, fmt.MAX_INDEX_BYTES)
        self._old_index: fmt.CheckpointIndex | None = None
        if self._old is not None:
            if not overwrite:
                raise CheckpointExistsError(f"{url}: a checkpoint exists", "to replace it")
            self._old_index = _check_replaceable(self.store, self._old.data)

    def commit(self, chunks: Sequence[bytes]) -> None:
        old = self._old
        if not self.store.publish(fmt.MANIFEST_FILE, b"".join(chunks), if_absent=old is None,
                                  if_tag=None if old is None else old.tag):
            raise CheckpointExistsError(
                f"{self.path}: another save published a checkpoint here first (the manifest "
                "changed while this save uploaded); nothing of this save is visible")
        self.committed = True
        try:
            remove_owned(self.store, self.generation)
            replaced = self._old_index
            if replaced is not None and replaced.generation != self.generation:
                self.store.delete(manifest_objects(replaced))  # a save from before staging markers
        except ShardkitError:  # the checkpoint is committed; `shardkit gc` removes the rest
            pass

    def abort(self) -> None:
        if not self.committed:
            with contextlib.suppress(Exception):
                remove_owned(self.store, None, only=self.generation)


def upload_shards(store: Storage, plans: list[ShardFile], generation: str, *, compressed: bool,
                  threads: int, checksum: bool, zstd_options: dict[str, Any]) -> None:
    """The planned shard files, uploaded as objects of `generation` (module docstring)."""
    mark_staging(store, generation, [p.file for p in plans])
    names = [object_name(p.file, generation) for p in plans]
    if not compressed:
        _upload_raw(store, plans, names, threads, checksum)
    else:
        _upload_zstd(store, plans, names, threads, checksum, zstd_options)


def upload_strings(store: Storage, strings: StringColumns, generation: str,
                   checksum: bool) -> StringFile:
    """The string file (`shardkit.strings`) of the save of `generation`: written to a local
    temp file by the local writer (it wants a descriptor), then uploaded next to the shard
    objects."""
    mark_staging(store, generation, [STRING_FILE])
    with tempfile.TemporaryDirectory(prefix="shardkit-upload-") as tmp:
        made = _write_strings(Path(tmp), strings, generation, checksum, False)
        store.upload_file(object_name(STRING_FILE, generation), os.path.join(tmp, STRING_FILE))
    return made


def _check_replaceable(store: Storage, data: bytes) -> fmt.CheckpointIndex:
    try:
        return fmt.decode_index(data, store.join(fmt.MANIFEST_FILE))
    except CheckpointFormatError as e:
        raise CheckpointExistsError(
            f"{store.url}: holds a manifest that is not a readable shardkit checkpoint ({e}); "
            "shardkit never replaces it") from None


def _raw_buffers(p: Any, checksum: bool) -> Iterator[Any]:
    """The bytes of raw shard `p` in order (header pieces, then each entry), hashing each entry
    with xxh3-64 into ``p.digests`` as it leaves."""
    import xxhash

    yield from p.header
    for i, a in enumerate(p.arrays):
        b = _as_bytes(a)
        if checksum:
            p.digests[i] = xxhash.xxh3_64_intdigest(b.data)
        yield b


def _upload_raw(store: Storage, plans: list[ShardFile], names: list[str], threads: int,
                checksum: bool) -> None:
    def job(planned: tuple[ShardFile, str]) -> None:
        p, name = planned
        n = store.write_file(name, _raw_buffers(p, checksum))
        if n != p.size:
            raise ShardkitError(f"{store.join(name)}: wrote {n} bytes, planned {p.size}")

    ParallelRun(job, list(zip(plans, names)), threads).wait()


def _upload_zstd(store: Storage, plans: list[ShardFile], names: list[str], threads: int,
                 checksum: bool, options: dict[str, Any]) -> None:
    """Each .skz shard is compressed into a local temp file (the zstd writer seals its header
    after the frames, so it needs a seekable file) and uploaded while the next one is
    compressed; a file is removed once uploaded: local disk holds at most two compressed
    shards."""
    def upload(path: Path, name: str) -> None:
        try:
            store.upload_file(name, str(path))
        finally:
            os.unlink(path)

    with tempfile.TemporaryDirectory(prefix="shardkit-upload-") as tmp:
        pool = WorkerPool(1, "shardkit-upload-skz")
        pending: Any = None
        try:
            for p, name in zip(plans, names):
                p.path = Path(tmp) / p.file
                _run_zstd([p], threads, False, checksum, None, **options)
                if pending is not None:
                    pending.result()
                pending = pool.submit(upload, p.path, name)
            if pending is not None:
                pending.result()
        finally:
            pool.shutdown(wait=True)  # before the temp directory goes


__all__ = ["RemoteStaging", "upload_shards", "upload_strings"]
