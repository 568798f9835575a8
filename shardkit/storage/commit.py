"""Atomic publication of a checkpoint directory (docs/FORMAT.md section 8).

A save writes everything into a hidden sibling temp directory ``.<name>.shardkit-tmp-<random>``,
the manifest last, and publishes it with one rename (an existing checkpoint: one
``renameat2(RENAME_EXCHANGE)``, else the fallback that renames the old one aside, which
`recover` renames back when a crash cut it short). A reader sees the old complete checkpoint,
the new complete one, or nothing. Stale-temp clean-up never deletes the only copy of a
checkpoint.

Concurrency: every temp directory is locked with ``flock`` on its own directory fd for as long as
its save runs. Stale-directory cleanup only removes directories whose lock it can take without
waiting, so it never deletes the work of a save running in another process; a save whose fresh
temp directory was removed by a cleaner in the instant before it took the lock notices (the inode
behind its fd is gone) and starts again with a new name.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import platform
import re
import secrets
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from .. import format as fmt
from .._kernels import _gather
from ..errors import CheckpointExistsError, ShardkitError
from ..format import FORMAT_NAME, MANIFEST_FILE, find_manifest

TMP_MARK: Final = ".shardkit-tmp-"
OLD_MARK: Final = ".shardkit-old-"
ASIDE_MARK: Final = ".old."
"""How TensorBundle saves of earlier releases named the replaced checkpoint's files that they
moved into their temp directory (``.old.<prefix>.index`` first)."""

_RENAME_NOREPLACE: Final = 1
_RENAME_EXCHANGE: Final = 2
_AT_FDCWD: Final = -100
# renameat2 syscall numbers, for a libc without the wrapper (glibc < 2.28).
_SYS_RENAMEAT2: Final = {"x86_64": 316, "aarch64": 276, "i686": 353, "ppc64le": 357}


_FORMAT_FIELD = re.compile(rb'^\s*\{\s*"format"\s*:\s*"shardkit"\s*[,}]')


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True if `path` is a directory holding a shardkit manifest (`format.find_manifest`: a
    ``model.safetensors.index.json``, or the ``index.json`` of formats 2.0 / 2.1) that is
    shardkit's (`is_shardkit_manifest`). A HuggingFace checkpoint's manifest (``metadata`` and
    ``weight_map`` only) is not.
    """
    name = find_manifest(path)
    if name is None:
        return False
    try:
        with open(Path(path) / name, "rb") as f:
            return is_shardkit_manifest(f.read(4096), f.read)
    except OSError:
        return False


def is_shardkit_manifest(head: bytes, rest: Callable[[], bytes]) -> bool:
    """Whether the manifest whose first bytes are `head` (`rest()` gives the others) is
    shardkit's: ``"format": "shardkit"`` and a ``"shardkit"`` section.

    shardkit writes ``"format": "shardkit"`` as the first field, so normally only the start of
    the file is read (an index of a million tensors is not parsed just to be replaced); a
    manifest whose fields were reordered is parsed in full.
    """
    if _FORMAT_FIELD.match(head):
        return True
    try:
        doc = json.loads(head + rest())
    except (OSError, ValueError):
        return False
    return (isinstance(doc, dict) and doc.get("format") == FORMAT_NAME
            and isinstance(doc.get("shardkit"), dict))


def write_new(path: str | os.PathLike[str], chunks: Sequence[bytes], durable: bool) -> None:
    """Create the file `path` (none may be there) from `chunks`, written back to back, and
    fsync it when `durable`: a manifest, a TensorBundle's index."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _gather.write_arrays(fd, [np.frombuffer(c, np.uint8) for c in chunks if c], 0)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that the names in it (renames, new files) are durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Staging:
    """A locked temp directory that becomes the checkpoint at `target` on `commit`.

    Use as a context manager: leaving the block with an exception (or without committing)
    removes the temp directory, so a failed save leaves no trace and any earlier checkpoint at
    `target` untouched.
    """

    def __init__(self, target: Path, *, overwrite: bool, durable: bool) -> None:
        self.target = target
        self.overwrite = overwrite
        self.durable = durable
        self.committed = False
        self.generation = fmt.new_generation()  # the save's id, in every file it writes
        self.store: Any = None  # where its files go: set by storage.LocalStorage.stage
        self._lock_fd: int | None
        self.path, self._lock_fd = locked_tmp(target)

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.committed:
            self.abort()

    def abort(self) -> None:
        """Remove the temp directory and release its lock. Idempotent."""
        if self._lock_fd is not None:
            try:
                remove_tree(self.path)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None

    def commit(self, index_bytes: bytes | Sequence[bytes]) -> None:
        """Write the manifest last and publish the temp directory at `target`. `index_bytes`
        may come in pieces, written back to back."""
        if self._lock_fd is None:
            raise ShardkitError(f"cannot commit {self.target}: the save was already aborted")
        write_new(self.path / MANIFEST_FILE,
                  [index_bytes] if isinstance(index_bytes, bytes) else index_bytes, self.durable)
        if self.durable:
            os.fsync(self._lock_fd)  # the directory's entries
        old = _publish(self.path, self.target, overwrite=self.overwrite)
        self.committed = True
        os.close(self._lock_fd)
        self._lock_fd = None
        if self.durable:
            fsync_dir(self.target.parent)
        if old is not None:
            _discard(old)


def _discard(old: Path) -> None:
    """Remove a replaced checkpoint, its manifest first: a removal cut short leaves a directory
    that is no checkpoint, which neither `recover` nor anyone else takes for one."""
    name = find_manifest(old)
    if name is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(old / name)
    remove_tree(old)


def stage(path: str | os.PathLike[str], *, overwrite: bool, durable: bool) -> Staging:
    """Check that a checkpoint may be written at `path` and open its temp directory.

    Raises CheckpointExistsError if `path` exists and `overwrite` is False, or if it exists and
    is not a shardkit checkpoint (shardkit never deletes data it did not write). Also recovers
    from an interrupted fallback overwrite and removes stale temp directories of crashed saves
    in the same parent directory.
    """
    target = Path(os.path.abspath(os.fspath(path)))
    if not target.name or target.name in (".", ".."):
        raise ShardkitError(f"cannot save a checkpoint at {str(path)!r}: not a directory name")
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)
    check_target(target, overwrite)
    cleanup_stale(target.parent)
    return Staging(target, overwrite=overwrite, durable=durable)


def check_target(path: str | os.PathLike[str], overwrite: bool) -> None:
    """Raise CheckpointExistsError unless a checkpoint may be written at `path`."""
    target = Path(os.path.abspath(os.fspath(path)))
    if not os.path.lexists(target):
        return
    replaceable = not target.is_symlink() and target.is_dir() and (
        is_checkpoint(target) or not _scan(target)
    )
    if not overwrite and replaceable:
        raise CheckpointExistsError(
            f"{target} already exists", "to replace the checkpoint there")
    if target.is_symlink() or not target.is_dir():
        raise CheckpointExistsError(
            f"{target} exists and is not a checkpoint directory (it is a file or a symlink); "
            "shardkit only replaces checkpoints it wrote. Remove it or choose another path"
        )
    if not replaceable:
        raise CheckpointExistsError(
            f"{target} exists, is not empty and holds no shardkit {MANIFEST_FILE} (a HuggingFace "
            "or other checkpoint is not shardkit's); refusing to "
            "replace it even with overwrite=True, so as never to delete data that is not a "
            "checkpoint. Remove it or choose another path"
        )


def recover(path: str | os.PathLike[str]) -> bool:
    """Finish an interrupted fallback overwrite: if `path` is missing but an old checkpoint was
    set aside under ``.<name>.shardkit-old-<random>``, rename it back. True if it did.

    Called by every save and by the reader of a missing local path. Nothing is renamed while a
    save of `path` runs (it holds the lock of a temp directory of that name): it may be between
    its two renames and is about to put its new checkpoint in place.
    """
    target = Path(os.path.abspath(os.fspath(path)))
    if os.path.lexists(target) or not target.parent.is_dir():
        return False
    entries = _scan(target.parent)
    running = f".{target.name}{TMP_MARK}"
    if any(e.name.startswith(running) and _locked(e.path) for e in entries):
        return False
    prefix = f".{target.name}{OLD_MARK}"
    for entry in entries:
        if entry.name.startswith(prefix) and is_checkpoint(entry.path):
            try:
                os.rename(entry.path, target)
            except OSError:
                continue  # another process recovered it first
            return True
    return False


_STALE = re.compile(r"^\..+(\.shardkit-tmp-|\.shardkit-old-)[A-Za-z0-9_]+$")


def cleanup_stale(parent: str | os.PathLike[str]) -> list[str]:
    """Remove temp directories of crashed saves in `parent`; returns the names removed.

    Only directories named by shardkit (``.<name>.shardkit-tmp-*`` / ``-old-*``) whose lock is
    free are removed. Nothing that is the only copy of a checkpoint is: a set-aside old
    checkpoint (``-old-``) is kept while its checkpoint path is missing, because `recover` still
    needs it; a temp directory holding the files of a TensorBundle an earlier release set aside
    there (``.old.*``) while its prefix has no ``.index`` gets them moved back first.
    """
    removed = []
    for entry in _scan(Path(parent)):
        name = entry.name
        if not _STALE.match(name) or not entry.is_dir(follow_symlinks=False):
            continue
        if OLD_MARK in name:
            original = name[1 : name.rindex(OLD_MARK)]
            if not os.path.lexists(os.path.join(parent, original)) and is_checkpoint(entry.path):
                continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a running save holds it
            if TMP_MARK in name:
                _restore_aside(entry.path, Path(parent), name[1 : name.rindex(TMP_MARK)])
            remove_tree(Path(entry.path))
            removed.append(name)
        finally:
            os.close(fd)
    return removed


def _restore_aside(tmp: str, parent: Path, name: str) -> bool:
    """Move the files of the TensorBundle at prefix `name` back from the stale temp directory
    `tmp` (``.old.<file>``) when the prefix has no ``.index``: they are its only copy (a save
    of an earlier release killed while replacing it). The index goes last. True if it did."""
    index = ASIDE_MARK + name + ".index"
    try:
        aside = [e for e in os.listdir(tmp) if e.startswith(ASIDE_MARK)]
    except OSError:
        return False
    if index not in aside or os.path.lexists(parent / index[len(ASIDE_MARK):]):
        return False
    for e in sorted(aside, key=lambda e: e == index):
        os.rename(os.path.join(tmp, e), parent / e[len(ASIDE_MARK):])
    return True


def _locked(path: str) -> bool:
    """Whether a save holds the lock of the temp directory `path`."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the lock, if taken
    return False


def _scan(parent: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(parent) as it:
            return list(it)
    except OSError:
        return []


def _new_dir(parent: Path, prefix: str) -> Path:
    """A new directory ``<prefix><random>`` with the mode a plain mkdir gives (umask honoured;
    tempfile.mkdtemp would make it 0700, and the rename would publish that mode)."""
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(6)}"
        try:
            os.mkdir(path, 0o777)
        except FileExistsError:
            continue
        return path
    raise ShardkitError(f"could not create a directory named {prefix}* in {parent}")


def locked_tmp(target: Path) -> tuple[Path, int]:
    """A new temp directory ``.<name>.shardkit-tmp-<random>`` next to `target`, and the
    descriptor holding its lock (the caller closes it). Stale-temp clean-up leaves it alone
    while the lock is held."""
    for _ in range(100):
        path = _new_dir(target.parent, f".{target.name}{TMP_MARK}")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # A concurrent cleanup may have taken the lock first and removed the directory.
            alive = os.fstat(fd).st_nlink > 0 and _same_inode(path, fd)
        except BaseException:
            os.close(fd)
            raise
        if alive:
            return path, fd
        os.close(fd)
    raise ShardkitError(f"could not create a temp directory next to {target}")


def _same_inode(path: Path, fd: int) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def remove_tree(path: Path) -> None:
    """rmtree that tolerates entries vanishing under it (a concurrent cleanup)."""

    def tolerate_missing(func: object, p: str, exc: BaseException) -> None:
        if not isinstance(exc, FileNotFoundError):
            raise exc

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=tolerate_missing)
    else:
        shutil.rmtree(path, onerror=lambda f, p, info: tolerate_missing(f, p, info[1]))


def _publish(tmp: Path, target: Path, *, overwrite: bool) -> Path | None:
    """Move `tmp` to `target`. Returns where the replaced old checkpoint now is, if any."""
    if _renameat2(tmp, target, _RENAME_NOREPLACE):
        return None
    if not overwrite:
        check_target(target, overwrite=True)  # not replaceable at all: say so, without the hint
        raise CheckpointExistsError(
            f"{target} was created by someone else while this save ran", "to replace it")
    check_target(target, overwrite=True)
    if _renameat2(tmp, target, _RENAME_EXCHANGE):
        return tmp  # the old checkpoint now lives under the temp name
    return _publish_fallback(tmp, target)


def _publish_fallback(tmp: Path, target: Path) -> Path:
    old = _new_dir(target.parent, f".{target.name}{OLD_MARK}")
    os.rename(target, old)  # old is an empty dir: rename replaces it
    # If we crash here, `recover` renames `old` back; the new checkpoint stays in `tmp`.
    os.rename(tmp, target)
    return old


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; True if it renamed (or exchanged).

    False if `dst` exists (NOREPLACE) or if the call or flag is unsupported (EXCHANGE). Without
    renameat2, NOREPLACE degrades to a plain rename when `dst` is absent.
    """
    rc, err = _call_renameat2(os.fsencode(src), os.fsencode(dst), flags)
    if rc == 0:
        return True
    if err == errno.EEXIST or (flags == _RENAME_NOREPLACE and err == errno.ENOTEMPTY):
        return False
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        if flags == _RENAME_NOREPLACE:
            if os.path.lexists(dst):
                return False
            os.rename(src, dst)  # not atomic against a concurrent creator; best effort
            return True
        return False
    raise OSError(err, f"renaming {src} to {dst}: {os.strerror(err)}")


def _load_renameat2():  # type: ignore[no-untyped-def]
    if os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn
    number = _SYS_RENAMEAT2.get(platform.machine()) if platform.system() == "Linux" else None
    if number is None:
        return None
    syscall = libc.syscall
    syscall.restype = ctypes.c_long

    def via_syscall(olddir, old, newdir, new, flags):  # type: ignore[no-untyped-def]
        return syscall(
            ctypes.c_long(number),
            ctypes.c_int(olddir),
            ctypes.c_char_p(old),
            ctypes.c_int(newdir),
            ctypes.c_char_p(new),
            ctypes.c_uint(flags),
        )

    return via_syscall


_renameat2_fn = _load_renameat2()


def _call_renameat2(src: bytes, dst: bytes, flags: int) -> tuple[int, int]:
    if _renameat2_fn is None:
        return -1, errno.ENOSYS
    rc = _renameat2_fn(_AT_FDCWD, src, _AT_FDCWD, dst, flags)
    return (0, 0) if rc == 0 else (-1, ctypes.get_errno())
