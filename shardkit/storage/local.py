"""The local file system behind the storage interface: the native path.

A save stages a locked temp directory and publishes it with one rename or exchange
(`storage.commit`); the planned shard files are written by the native write kernel
(`storage.native`). A reader opens the checkpoint directory once and every file relative to
that handle (`LocalCheckpoint`, over `shards.files.CheckpointDirectory`). At the byte level,
`publish` writes a temp file and renames it over the name (atomic), ``if_absent`` by a hard
link, which fails if the name exists.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .._kernels import _gather
from ..errors import (
    CheckpointFormatError,
    RetentionWarning,
    ShardIOError,
    ShardkitError,
    StorageError,
)
from ..format import (
    MANIFEST_FILE,
    MANIFEST_FILES,
    MAX_INDEX_BYTES,
    check_shard_file_name,
    decode_index,
    find_manifest,
)
from ..shards.files import (
    CheckpointDirectory,
    CheckpointFile,
    FilePool,
    locate,
    open_directory,
    open_shard_file,
)
from ..shards.raw import shard_opener
from . import commit, native
from .base import Fetched, ShardFile, Storage, Stored

_T = TypeVar("_T")


class LocalCheckpoint(CheckpointDirectory):
    """An opened local checkpoint, for the reader: the directory handle (closed by `close`,
    or when this object goes), the one file asked for when `path` named a ``.safetensors`` or
    TensorFlow ``.index`` file (`single`), and the shard files opened through the handle."""

    def __init__(self, path: str, follow_symlinks: bool, pool: FilePool | None) -> None:
        directory, self.single = locate(path)  # a .safetensors file: its directory
        fd = open_directory(directory)
        self._closer = weakref.finalize(self, os.close, fd)
        super().__init__(directory, fd, follow_symlinks, pool)

    def close(self) -> None:
        self._closer()

    def shard_path(self, file: str, generation: str | None) -> str:
        return os.path.join(self.path, file)

    def opener(self, codec: str, path: str) -> Any:
        return shard_opener(codec, path)

    def open_shard_file(self, path: str, file: str, generation: str | None) -> CheckpointFile:
        return open_shard_file(path, self.follow_symlinks, name=file, dir_fd=self.dir_fd,
                               pool=self.pool)


@contextlib.contextmanager
def os_errors(path: str, doing: str) -> Iterator[None]:
    """The save's one translation of the file system's errors: an OSError that is not already
    a ShardkitError (a full disk, a read-only file system, a parent that is a file, a denied
    permission...) leaves as ShardIOError, errno kept, naming the file and what was being
    done."""
    try:
        yield
    except ShardkitError:
        raise
    except OSError as e:
        where = e.filename if isinstance(e.filename, str) and e.filename else path
        why = e.strerror or str(e)
        if e.errno in (errno.EEXIST, errno.ENOTDIR):  # mkdir / open below a file
            up = where
            while up and not os.path.isdir(up):
                if os.path.lexists(up):
                    where, why = up, "it is a file, not a directory"
                    break
                up = os.path.dirname(up.rstrip("/"))
        # str(): "[Errno N] <doing> of <path> failed: <why>: '<file>'"
        raise ShardIOError(e.errno or errno.EIO, f"{doing} of {path} failed: {why}",
                           where) from e


class LocalStaging:
    """A local save in progress (`storage.commit.Staging`), its commit's OSErrors worded by
    `os_errors`; a failed commit removes the temp directory (`abort`), as any failed save."""

    def __init__(self, staging: commit.Staging) -> None:
        self._staging = staging

    store = property(lambda self: self._staging.store)
    generation = property(lambda self: self._staging.generation)
    target = property(lambda self: self._staging.target)
    committed = property(lambda self: self._staging.committed)

    def commit(self, index_bytes: bytes | Sequence[bytes]) -> None:
        with os_errors(str(self._staging.target), "committing the checkpoint"):
            self._staging.commit(index_bytes)

    def abort(self) -> None:
        with os_errors(str(self._staging.path), "removing the unfinished save"):
            self._staging.abort()


class LocalStorage(Storage):
    conditional = True

    def __init__(self, path: str) -> None:
        self.path = path  # as given: the reader's messages name it so
        self.url = os.path.abspath(path)

    def __fspath__(self) -> str:
        """A local storage is its directory: ``Path(storage)`` is that path."""
        return self.path

    # -- checkpoints

    def check_target(self, overwrite: bool) -> None:
        with os_errors(self.url, "checking where to save"):
            commit.check_target(self.path, overwrite)

    def stage(self, *, overwrite: bool, durable: bool) -> LocalStaging:
        with os_errors(self.url, "starting the save"):
            staging = commit.stage(self.path, overwrite=overwrite, durable=durable)
        staging.store = LocalStorage(str(staging.path))
        return LocalStaging(staging)

    def write_shards(self, files: list[ShardFile], *, generation: str, compressed: bool,
                     threads: int, durable: bool, checksum: bool, bar: Any,
                     zstd_options: dict[str, Any], meanwhile: Callable[[], _T]) -> _T:
        directory = Path(self.path)
        for f in files:
            f.path = directory / f.file
        with os_errors(self.url, "writing the shards"):
            if not compressed:
                return native._run(files, native._regions(files, threads), threads, durable,
                                   checksum, bar, meanwhile)
            native._run_zstd(files, threads, durable, checksum, bar, **zstd_options)
        return meanwhile()

    def write_strings(self, strings: Any, generation: str, checksum: bool,
                      durable: bool) -> Any:
        with os_errors(self.url, "writing the string file"):
            return native._write_strings(Path(self.path), strings, generation, checksum,
                                         durable)

    def open_checkpoint(self, *, follow_symlinks: bool, pool: Any) -> LocalCheckpoint:
        if not os.path.lexists(self.path) and not os.path.lexists(self.path + ".index"):
            commit.recover(self.path)  # an overwrite killed between the fallback's renames
        return LocalCheckpoint(self.path, follow_symlinks, pool)

    def _listed(self) -> list[tuple[str, str]]:
        """(name, path) of each entry directly under here; none when there is no directory."""
        try:
            return [(name, os.path.join(self.url, name)) for name in os.listdir(self.url)]
        except FileNotFoundError:
            return []

    def children(self) -> list[tuple[str, str]]:
        return [(name, path) for name, path in self._listed() if commit.is_checkpoint(path)]

    def commit_time(self) -> float:
        try:
            return os.stat(os.path.join(self.url, find_manifest(self.url) or MANIFEST_FILE)
                           ).st_mtime
        except FileNotFoundError:
            return time.time()

    def interrupted_removals(self) -> list[str]:
        return [p for _, p in self._listed() if not os.path.islink(p)
                and os.path.isfile(os.path.join(p, REMOVAL_MARKER)) and find_manifest(p) is None]

    def remove_checkpoint(self) -> None:
        """The files to delete written to a marker, then the manifest (the directory stops
        being a checkpoint at once), the files it names, the marker, then the directory if
        nothing else is in it; a file shardkit did not write stays. A removal killed halfway
        (a marker, no manifest) is finished by the next call. A symbolic link is neither
        followed nor removed (RetentionWarning)."""
        path = self.url
        if os.path.islink(path):
            warnings.warn(f"{path}: a symbolic link, not a checkpoint directory shardkit "
                          "wrote; left as it is (and what it points at)", RetentionWarning,
                          stacklevel=2)
            return
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # someone else deleted it
        except OSError as e:
            raise ShardIOError(e.errno, f"{path}: cannot open the checkpoint to delete it: "
                                        f"{e.strerror}") from None
        try:
            manifest = find_manifest(fd)
            if manifest is None:  # no checkpoint; perhaps one whose removal was killed halfway
                names = _marked_for_removal(fd, path)
            else:
                mfd = os.open(manifest, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                with os.fdopen(mfd, "rb") as f:
                    data = f.read(MAX_INDEX_BYTES + 1)
                try:
                    files = decode_index(data, os.path.join(path, manifest)).files()
                except CheckpointFormatError as e:
                    raise type(e)(f"{e}; not deleted, since what it names is unknown") from None
                names = [manifest, *files]
                _mark_for_removal(fd, names)
            for name in [*names, REMOVAL_MARKER] if names is not None else []:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
        except OSError as e:
            raise ShardIOError(e.errno, f"{path}: deleting the checkpoint failed: "
                                        f"{e.strerror}") from None
        finally:
            os.close(fd)
        if names is None:
            return  # neither a checkpoint nor one being removed
        try:
            os.rmdir(path)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                raise ShardIOError(e.errno, f"{path}: cannot remove the emptied checkpoint "
                                            f"directory: {e.strerror}") from None

    # -- bytes

    def _path(self, name: str) -> str:
        return os.path.join(self.url, *name.split("/")) if name else self.url

    def write_file(self, name: str, buffers: Iterable[Any]) -> int:
        path = self._path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            at = 0
            for b in buffers:
                a = np.frombuffer(b, np.uint8)
                _gather.write_arrays(fd, [a], at)
                at += a.nbytes
            return at
        finally:
            os.close(fd)

    def upload_file(self, name: str, local_path: str) -> None:
        with open(local_path, "rb") as f:
            self.write_file(name, iter(lambda: f.read(1 << 24), b""))

    def read_range(self, name: str, start: int, end: int) -> bytes:
        fd = os.open(self._path(name), os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.pread(fd, end - start, start)
        finally:
            os.close(fd)
        if len(data) != end - start:
            raise StorageError(5, f"{self.join(name)}: short read at {start}")
        return data

    def size(self, name: str) -> int:
        return os.stat(self._path(name)).st_size

    def fetch(self, name: str, limit: int) -> Fetched | None:
        try:
            st = os.stat(self._path(name))
        except FileNotFoundError:
            return None
        if st.st_size > limit:
            raise StorageError(27, f"{self.join(name)}: over the {limit}-byte limit")
        with open(self._path(name), "rb") as f:
            return Fetched(f.read(), f"{st.st_ino}-{st.st_mtime_ns}")

    def list(self, prefix: str = "") -> list[Stored]:
        out = []
        for root, _, files in os.walk(self.url):
            for f in files:
                full = os.path.join(root, f)
                name = os.path.relpath(full, self.url).replace(os.sep, "/")
                if name.startswith(prefix):
                    st = os.stat(full)
                    out.append(Stored(name, st.st_size, st.st_mtime))
        return sorted(out, key=lambda s: s.name)

    def delete(self, names: Sequence[str]) -> None:
        for n in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(n))

    def publish(self, name: str, data: bytes, *, if_absent: bool = False,
                if_tag: str | None = None) -> bool:
        path = self._path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        try:
            if if_absent:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    return False
                return True
            if if_tag is not None:
                current = self.fetch(name, 1 << 62)
                if current is None or current.tag != if_tag:
                    return False
            os.replace(tmp, path)
            return True
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


REMOVAL_MARKER = ".shardkit-removing"
"""The file `LocalStorage.remove_checkpoint` writes into a checkpoint before it deletes the
manifest: a JSON list of the names it deletes, so that a removal killed halfway can be
finished."""


def _mark_for_removal(dir_fd: int, names: list[str]) -> None:
    fd = os.open(REMOVAL_MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as f:
        f.write(json.dumps(names).encode())
        f.flush()
        os.fsync(f.fileno())  # on disk before the manifest's deletion is


def _marked_for_removal(dir_fd: int, path: str) -> list[str] | None:
    """The names the removal marker lists, each a plain name inside the directory; None
    when there is no marker or it cannot be trusted (then nothing is deleted)."""
    try:
        fd = os.open(REMOVAL_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_INDEX_BYTES + 1)
    try:
        names = json.loads(data)
        if not isinstance(names, list):
            return None
        return [n if n in MANIFEST_FILES else check_shard_file_name(n, path) for n in names]
    except (ValueError, ShardkitError):
        return None
