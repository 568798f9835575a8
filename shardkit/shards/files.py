"""Opening the files of a checkpoint safely, and keeping few of them open.

Every file a reader takes from a checkpoint (manifest, shards) is opened by `open_file`: relative
to the checkpoint's directory handle when there is one, non-blocking (a FIFO cannot hang the
open), without following a symlink unless asked, and refused unless ``fstat`` says it is a
regular file. `CheckpointFile` wraps one such file for the shard sources: its descriptor can be
given up (once mapped, or when a `FilePool` evicts it) and is then opened again through the same
directory handle, checked to be the same inode. No error message quotes a file's bytes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

import numpy as np

from .._kernels import _gather, _mmap
from ..errors import (
    CheckpointNotFoundError,
    CheckpointReplacedError,
    CorruptIndexError,
    MissingShardError,
    NotRegularFileError,
    ShardIOError,
    SymlinkRefusedError,
    TruncatedShardError,
)

READ_CHUNK = 8 * 1024 * 1024  # bytes per pread task; big enough that syscall cost vanishes
PARALLEL_MIN = 2 * READ_CHUNK  # bytes of reads from which they go to a pool as several tasks
PARALLEL_MIN_BUFFER = 256 * 1024  # mean buffer size from which reads go to a pool
ADVISE_MIN = 64 * 1024 * 1024  # bytes of reads from which readahead is asked for

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a plain file")


def open_directory(path: str) -> int:
    """A descriptor of the checkpoint directory `path` (the directory handle every file of the
    checkpoint is opened through); CheckpointNotFoundError when it is missing or not one."""
    try:
        return os.open(path, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the path does not exist") from None
    except NotADirectoryError:
        raise CheckpointNotFoundError(f"no checkpoint at {path}: {_what_file(path)}") from None
    except OSError as e:
        raise ShardIOError(e.errno, f"{path}: cannot open the checkpoint directory: "
                                    f"{e.strerror}") from None


def _what_file(path: str) -> str:
    """What the file `path`, given as a checkpoint, is, and what to pass instead."""
    import re

    from ..format import MANIFEST_FILES

    name = os.path.basename(path)
    if name in MANIFEST_FILES:
        return f"it is a checkpoint's manifest; pass its directory {os.path.dirname(path) or '.'}"
    data = re.fullmatch(r"(.+)\.data-\d+-of-\d+", path)  # TensorFlow's DataFilename
    if data:
        return (f"it is a data file of a TensorFlow checkpoint; pass the checkpoint's prefix "
                f"{data[1]} (or its {BUNDLE_INDEX_SUFFIX} file)")
    return ("the path is a file, and not one a reader opens (it takes a checkpoint directory, "
            f"a {SAFETENSORS_SUFFIX} file, or a TensorFlow checkpoint's prefix or "
            f"{BUNDLE_INDEX_SUFFIX} file)")


def locate(path: str) -> tuple[str, str | None]:
    """(directory, file name) of what a reader opens at `path`: a ``.safetensors`` file, a
    torch.save ``.pt`` / ``.pth`` file, or a TensorFlow ``<prefix>.index`` (also given as the
    prefix itself, when no such path exists), is read through its parent directory's handle as
    that one name; anything else is a checkpoint directory (file name None)."""
    if path.endswith((SAFETENSORS_SUFFIX, BUNDLE_INDEX_SUFFIX, *TORCH_SAVE_SUFFIXES)
                     ) and os.path.isfile(path):
        directory, name = os.path.split(path)
        return directory or os.curdir, name
    if not os.path.exists(path) and os.path.isfile(path + BUNDLE_INDEX_SUFFIX):
        # a TensorFlow checkpoint prefix: read as its .index file
        directory, name = os.path.split(path + BUNDLE_INDEX_SUFFIX)
        return directory or os.curdir, name
    return path, None


SAFETENSORS_SUFFIX = ".safetensors"
BUNDLE_INDEX_SUFFIX = ".index"  # a TensorFlow TensorBundle's index file: <prefix>.index
TORCH_SAVE_SUFFIXES = (".pt", ".pth")  # a torch.save file (dcp_to_torch_save's output)


def directory_replaced(path: str, dir_fd: int) -> bool:
    """Whether the directory opened as `dir_fd` is no longer the one at `path` (deleted, moved
    aside, or exchanged for a new checkpoint by an overwrite)."""
    try:
        opened = os.fstat(dir_fd)
        if opened.st_nlink == 0:
            return True
        st = os.stat(path)
    except OSError:
        return True
    return (st.st_dev, st.st_ino) != (opened.st_dev, opened.st_ino)


def open_file(name: str, path: str, role: str, *, dir_fd: int | None = None,
              follow_symlinks: bool = False) -> tuple[int, os.stat_result]:
    """Open the checkpoint file `name` (relative to `dir_fd`, else a path) for reading: a
    blocking, close-on-exec descriptor of a regular file, and its ``fstat``.

    `path` (for messages) and `role` ("shard file", "manifest") name it in errors:
    SymlinkRefusedError for a symlink unless `follow_symlinks`, NotRegularFileError for a
    directory, FIFO, device or socket, ShardIOError for other failures. FileNotFoundError, when
    there is no such file, is left to the caller to word."""
    flags = os.O_RDONLY | _NONBLOCK | _CLOEXEC | (0 if follow_symlinks else _NOFOLLOW)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks and _is_symlink(name, dir_fd):
            raise SymlinkRefusedError(
                f"{path}: {role} is a symbolic link; shardkit reads only the checkpoint's own "
                "files unless asked to follow links (follow_symlinks=True)") from None
        if e.errno == errno.ENXIO:  # a socket, or a device without a driver
            kind = _lstat_kind(name, dir_fd, follow_symlinks)
            raise NotRegularFileError(f"{path}: {role} is {kind}, not a regular file") from None
        raise ShardIOError(e.errno, f"{path}: cannot open {role}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(f"{path}: {role} is {_kind(st.st_mode)}, not a regular file")
        if _NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _is_symlink(name: str, dir_fd: int | None) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _lstat_kind(name: str, dir_fd: int | None, follow_symlinks: bool) -> str:
    try:
        return _kind(os.stat(name, dir_fd=dir_fd, follow_symlinks=follow_symlinks).st_mode)
    except OSError:
        return "not a plain file"


def read_range(fd: int, start: int, end: int, path: str, what: str) -> bytes:
    """Bytes ``[start, end)`` of an open file (fewer if it ends first), by pread; `what` names
    them in the ShardIOError of a failed read."""
    parts, at = [], start
    while at < end:
        try:
            data = os.pread(fd, end - at, at)
        except OSError as e:
            raise ShardIOError(e.errno, f"{path}: cannot read {what}: {e.strerror}") from None
        if not data:
            break
        parts.append(data)
        at += len(data)
    return b"".join(parts)


Run = tuple[int, Sequence[np.ndarray]]  # (offset, writable C-contiguous arrays read back to back)


class ByteSource(Protocol):
    """The bytes of one shard, wherever they live: what the raw and ``.skz`` readers use.

    Two implementations: `CheckpointFile` (a local file: pread / preadv, a copy-on-write map)
    and `shardkit.storage.remote.RemoteFile` (a store's object: ranged GETs, coalesced, several
    in flight; no map). Call sequence: the storage opens it
    (``Storage.open_checkpoint(...).open_shard_file``), a shard reader reads its header with
    `read`, takes a map with `take_map` when mapping (None when the source cannot map: read
    on), reads with `read` / `readinto` / `read_tasks`, and `close`s it. Every read is safe
    from several threads at once; a read past the end raises TruncatedShardError.
    """

    path: str
    size: int

    @property
    def task_bytes(self) -> int:
        """About how many bytes one task of `read_tasks` reads (a verify's batch)."""
        ...

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` (fewer at the end)."""
        ...

    def readinto(self, offset: int, dest: Any) -> None:
        """Fill the writable buffer `dest` with the bytes from `offset`."""
        ...

    def read_tasks(self, runs: Sequence[Run]) -> list[Callable[[], None]]:
        """Many reads as independent tasks for any threads: each run's arrays filled back to
        back from its offset (a file: preadv batches of about READ_CHUNK, one task when the
        reads are too small to gain from threads; a store: coalesced GETs, concurrent within a
        task)."""
        ...

    def take_map(self) -> Any:
        """A copy-on-write map of the whole source (it then holds no descriptor), or None."""
        ...

    def close(self) -> None: ...


def byte_view(a: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array, as a flat uint8 view."""
    return a.reshape(-1).view(np.uint8)


def run_each(calls: Sequence[Callable[[], None]]) -> None:
    """Run `calls` one after the other, on this thread."""
    for call in calls:
        call()


def pool_tasks(reads: Sequence[tuple[Callable[[], None], int, int]]
               ) -> list[Callable[[], None]]:
    """Reads (call, bytes, buffers) as tasks for a pool: all in one task, in turn, under
    PARALLEL_MIN bytes in all; else those of buffers under PARALLEL_MIN_BUFFER bytes on
    average (bound by per-buffer work under the GIL: threads only contend) in one task, the
    others a task each."""
    if sum(n for _, n, _ in reads) < PARALLEL_MIN:
        small, tasks = list(reads), []
    else:
        small = [r for r in reads if r[1] < r[2] * PARALLEL_MIN_BUFFER]
        tasks = [r[0] for r in reads if r[1] >= r[2] * PARALLEL_MIN_BUFFER]
    if len(small) > 1:
        return [partial(run_each, [call for call, _, _ in small]), *tasks]
    return [call for call, _, _ in small] + tasks


def _read_pieces(arrays: Sequence[np.ndarray], start: int, chunk: int
                 ) -> list[tuple[list[np.ndarray], int, int]]:
    """Cut adjacent arrays (the first at file offset `start`) into reads of about `chunk`
    bytes: (buffers, offset, bytes). An array that does not fit a read is cut into byte views."""
    out: list[tuple[list[np.ndarray], int, int]] = []
    bufs: list[np.ndarray] = []
    at, size = start, 0
    for a in arrays:
        n = a.nbytes
        if size + n <= chunk:  # the usual case: whole arrays, no views made
            bufs.append(a)
            size += n
            continue
        flat = byte_view(a)
        pos = 0
        while pos < n:
            take = min(n - pos, chunk - size)
            bufs.append(flat[pos : pos + take])
            size += take
            pos += take
            if size == chunk:
                out.append((bufs, at, size))
                at, bufs, size = at + size, [], 0
    if bufs:
        out.append((bufs, at, size))
    return out


def pread_into(fd: int, dest: memoryview, offset: int, path: str) -> None:
    """Fill `dest` from `fd` at `offset` (os.preadv releases the GIL); short file -> error."""
    done, n = 0, len(dest)
    while done < n:
        try:
            got = os.preadv(fd, [dest[done:]], offset + done)
        except OSError as e:
            raise ShardIOError(e.errno, f"{path}: cannot read {n - done} bytes at "
                                        f"{offset + done}: {e.strerror}") from None
        if got == 0:
            raise TruncatedShardError(
                f"{path}: unexpected end of file at byte {offset + done} "
                f"(needed {n - done} more bytes)"
            )
        done += got


class CheckpointFile:
    """One regular file of a checkpoint, opened with `open_file`.

    ``with file as fd:`` lends its descriptor for a read (reopening it through the directory
    handle if it was given up); `map` maps it copy-on-write; `release` gives the descriptor up
    now (a map needs none). With a `pool`, at most the pool's limit of files keep a descriptor
    between reads. Reopening a file that is gone or is another inode raises
    CheckpointReplacedError: the checkpoint was replaced under the reader.
    """

    def __init__(self, name: str, path: str, role: str, *, dir_fd: int | None = None,
                 follow_symlinks: bool = False, pool: FilePool | None = None) -> None:
        self.name, self.path, self.role = name, path, role
        self._dir_fd, self._follow = dir_fd, follow_symlinks
        self._fd = -1
        self._pool = pool
        fd, st = open_file(name if dir_fd is not None else path, path, role, dir_fd=dir_fd,
                           follow_symlinks=follow_symlinks)
        self._fd = fd
        self.size = st.st_size
        self._identity = (st.st_dev, st.st_ino)
        self._users = 0
        self._closed = False
        if pool is not None:
            with pool._lock:
                pool._opened(self)

    def __enter__(self) -> int:
        pool = self._pool
        if pool is None:
            if self._fd < 0:
                self._reopen()
            return self._fd
        with pool._lock:
            if self._fd < 0:
                self._reopen()
            self._users += 1
            pool._used(self)
        return self._fd

    def __exit__(self, *exc: object) -> None:
        pool = self._pool
        if pool is not None:
            with pool._lock:
                self._users -= 1
                pool._trim()

    def read_all(self) -> bytes:
        """The whole file (its `size` bytes when it was opened; fewer if it shrank since)."""
        with self as fd:
            return read_range(fd, 0, self.size, self.path, self.role)

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the file (fewer at its end), by pread.

        Raises:
            ShardIOError: the read failed.
        """
        with self as fd:
            return read_range(fd, start, end, self.path, f"{end - start} bytes at {start}")

    task_bytes = READ_CHUNK

    def readinto(self, offset: int, dest: Any) -> None:
        """Fill `dest` with the bytes from `offset`, by preadv (the GIL released)."""
        with self as fd:
            pread_into(fd, memoryview(dest).cast("B"), offset, self.path)

    def read_tasks(self, runs: Sequence[Run]) -> list[Callable[[], None]]:
        """See `ByteSource.read_tasks`: preadv of the arrays back to back, in reads of about
        READ_CHUNK bytes (the GIL released)."""
        pieces = [p for at, arrays in runs for p in _read_pieces(arrays, at, READ_CHUNK)]
        if sum(want for _, _, want in pieces) >= ADVISE_MIN:
            self._will_need([(at, want) for _, at, want in pieces])
        return pool_tasks([(partial(self._read_arrays, bufs, at, want), want, len(bufs))
                           for bufs, at, want in pieces])

    def _will_need(self, ranges: list[tuple[int, int]]) -> None:
        """Tell the kernel that the byte ranges (offset, length) are read next, so that it
        reads them ahead in large requests. Without it, a file not in the page cache is read
        at the pace of the default readahead window, which chunks read by two threads in turn
        keep small. Cheap when the file is cached."""
        if not hasattr(os, "posix_fadvise"):
            return
        with self as fd:
            for at, n in ranges:
                try:
                    os.posix_fadvise(fd, at, n, os.POSIX_FADV_WILLNEED)
                except OSError:  # advice only (some file systems refuse it)
                    return

    def _read_arrays(self, bufs: list[np.ndarray], at: int, want: int) -> None:
        with self as fd:
            try:
                got = _gather.read_arrays(fd, bufs, at)
            except OSError as e:
                raise ShardIOError(e.errno, f"{self.path}: cannot read {want} bytes at {at}: "
                                            f"{e.strerror}") from None
        if got != want:
            raise TruncatedShardError(
                f"{self.path}: unexpected end of file at byte {at + got} "
                f"(needed {want - got} more bytes)"
            )

    def stamp(self) -> tuple[int, int, int, int]:
        """(device, inode, size, mtime in ns) of the open file now: equal stamps mean a
        header parsed earlier is still the file's (`adapters.ParsedHeader`)."""
        with self as fd:
            st = os.fstat(fd)
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def map(self) -> Any:
        """The whole file mapped copy-on-write (a writable buffer that holds no descriptor)."""
        with self as fd:
            try:
                return _mmap.Map(fd, self.size)
            except OSError as e:
                raise ShardIOError(e.errno, f"{self.path}: cannot map the {self.size}-byte "
                                            f"{self.role}: {e.strerror}") from None

    def take_map(self) -> Any:
        """`map`, then close the file: a map needs no descriptor."""
        try:
            return self.map()
        finally:
            self.close()

    def release(self) -> None:
        """Close the descriptor now; a later read opens the file again."""
        if self._pool is not None:
            with self._pool._lock:
                if not self._users:
                    self._pool._forget(self)
                    self._close_fd()
        else:
            self._close_fd()

    def close(self) -> None:
        self._closed = True
        self.release()

    def __del__(self) -> None:  # a source dropped without close() must not leak descriptors
        self._close_fd()

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _reopen(self) -> None:
        if self._closed:
            raise ShardIOError(errno.EBADF, f"{self.path}: {self.role} is closed")
        replaced = (f"{self.path}: the {self.role} was replaced or deleted since this reader "
                    "opened it (the checkpoint was overwritten); open the checkpoint again")
        try:
            fd, st = open_file(self.name if self._dir_fd is not None else self.path, self.path,
                               self.role, dir_fd=self._dir_fd, follow_symlinks=self._follow)
        except FileNotFoundError:
            raise CheckpointReplacedError(replaced) from None
        if (st.st_dev, st.st_ino) != self._identity:
            os.close(fd)
            raise CheckpointReplacedError(replaced)
        self._fd = fd
        if self._pool is not None:
            self._pool._opened(self)


class FilePool:
    """Bounds the descriptors a reader's files keep open between reads: beyond `limit`, the
    least recently used idle file gives its descriptor up (files in use by a read keep theirs,
    so the bound can be passed by the number of reads in flight)."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._lock = threading.Lock()
        self._open: OrderedDict[int, CheckpointFile] = OrderedDict()

    def _opened(self, f: CheckpointFile) -> None:  # under the lock
        self._open[id(f)] = f
        self._trim()

    def _used(self, f: CheckpointFile) -> None:
        self._open.move_to_end(id(f))

    def _forget(self, f: CheckpointFile) -> None:
        self._open.pop(id(f), None)

    def _trim(self) -> None:
        if len(self._open) <= self.limit:
            return
        for key, f in list(self._open.items()):
            if len(self._open) <= self.limit:
                break
            if not f._users:
                del self._open[key]
                f._close_fd()


SHARD_ROLE = "shard file"


def open_shard_file(path: str, follow_symlinks: bool = False, *, name: str | None = None,
                    dir_fd: int | None = None, pool: FilePool | None = None,
                    listed_in: str | None = None) -> CheckpointFile:
    """Shard file `name` of the checkpoint directory `dir_fd` (else the file at `path`), opened
    with `open_file`; MissingShardError, naming the manifest `listed_in`, when there is none."""
    try:
        return CheckpointFile(name if name is not None else path, path, SHARD_ROLE,
                              dir_fd=dir_fd, follow_symlinks=follow_symlinks, pool=pool)
    except FileNotFoundError:
        raise MissingShardError(f"{path}: shard file listed in {listed_in or 'the manifest'} is "
                                "missing from the checkpoint") from None


class CheckpointDirectory:
    """The files of one opened checkpoint directory, as the format adapters see them: every name
    is opened relative to the directory handle `dir_fd` by `open_file` (regular files only, no
    symlinks unless `follow_symlinks`). `path` is the directory's path, for messages only."""

    def __init__(self, path: str, dir_fd: int, follow_symlinks: bool = False,
                 pool: FilePool | None = None) -> None:
        self.path, self.dir_fd, self.follow_symlinks, self.pool = (path, dir_fd, follow_symlinks,
                                                                   pool)

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def replaced(self) -> bool:
        """Whether this directory is no longer the one at its path (see `directory_replaced`)."""
        return directory_replaced(self.path, self.dir_fd)

    def has(self, name: str) -> bool:
        """Whether the directory has an entry `name` (of any kind: opening it decides)."""
        try:
            os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
        except OSError:
            return False
        return True

    def read_manifest(self, name: str, limit: int) -> bytes | None:
        """The bytes of the manifest file `name` (an index), None when there is none;
        CorruptIndexError when it is over `limit` bytes (checked before reading)."""
        path = self.join(name)
        try:
            fd, st = open_file(name, path, name, dir_fd=self.dir_fd,
                               follow_symlinks=self.follow_symlinks)
        except FileNotFoundError:
            return None
        try:
            if st.st_size > limit:
                raise CorruptIndexError(f"{path}: {st.st_size} bytes, over the {limit}-byte limit")
            return read_range(fd, 0, st.st_size, path, name)
        finally:
            os.close(fd)

    def open_shard(self, name: str, listed_in: str | None = None) -> CheckpointFile:
        """Shard file `name`, opened (see `open_shard_file`)."""
        return open_shard_file(self.join(name), self.follow_symlinks, name=name,
                               dir_fd=self.dir_fd, pool=self.pool, listed_in=listed_in)
