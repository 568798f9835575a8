"""The local file system behind the storage interface.

A thin adapter over the native code the local save and load paths use directly
(`_gather.write_arrays` with ``fallocate``, ``preadv``, rename): `write_file` writes buffers
with the write kernel, reads are ``pread``, `publish` writes a temp file and renames it over
the name (atomic), ``if_absent`` by a hard link, which fails if the name exists. Local saves
and loads do not go through this class (they keep their native path, docs/ARCHITECTURE.md);
it lets storage-level tools (`shardkit gc`, the tests of the interface) treat a directory like
any store.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .._kernels import _gather
from ..errors import StorageError
from .base import Fetched, Storage, Stored


class LocalStorage(Storage):
    conditional = True

    def __init__(self, path: str) -> None:
        self.url = os.path.abspath(path)

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
            try:
                os.unlink(self._path(n))
            except FileNotFoundError:
                pass

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
