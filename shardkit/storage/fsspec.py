"""Object stores and other file systems through fsspec (s3fs for ``s3://``).

Writes go through `write_file`: on S3, one PutObject up to 2 * PART_SIZE bytes, else a
multipart upload whose parts (PART_SIZE bytes, the first twice that) leave at most
PARTS_IN_FLIGHT at a time per file, so memory stays bounded however large the shard;
elsewhere, fsspec's own buffered writer. Reads are ranged GETs (``cat_file``), several at once
through ``cat_ranges`` (concurrent on fsspec's event loop for async stores). The manifest is
published with a conditional PutObject on S3 (``If-None-Match: *`` for a new checkpoint,
``If-Match: <ETag>`` for an overwrite), so two writers of one path cannot both win. Every request
is retried on transient errors (`base.with_retries`).
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, wait
from typing import Any, TypeVar

from .._threads import WorkerPool
from ..errors import MissingDependencyError, StorageError
from ..format import MANIFEST_FILE
from ..optional import missing, require
from .base import MAX_COALESCED, Fetched, ShardFile, Storage, Stored, coalesce, with_retries
from .housekeeping import list_checkpoints, remove_checkpoint
from .layout import object_name
from .remote import RemoteDirectory
from .save import RemoteStaging, upload_shards, upload_strings

_T = TypeVar("_T")

PART_SIZE = 32 * 1024 * 1024  # bytes per multipart part (S3's minimum is 5 MiB); the first
# part may be twice that, so objects up to 2 * PART_SIZE leave in one PutObject (as s3fs does)
PARTS_IN_FLIGHT = 2  # parts of one file uploading at once: memory <= 3 * PART_SIZE per file
_pool_lock = threading.Lock()
_pool: WorkerPool | None = None


def _upload_pool() -> WorkerPool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = WorkerPool(8, "shardkit-upload")
        return _pool


class FsspecStorage(Storage):
    """A checkpoint at an fsspec URL (``s3://bucket/prefix``, ``memory://x``, ``file:///x``);
    `storage_options` go to the file system (e.g. s3fs's ``client_kwargs``, ``key``)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        fsspec = require("fsspec", "reading or writing a URL")
        self.url = url.rstrip("/")
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        except ImportError as e:  # the store's own package (s3fs for s3://)
            if self.url.startswith(("s3://", "s3a://")):
                raise missing("s3fs", f"{url}", e) from None
            raise MissingDependencyError(f"{url}: {e} (the package fsspec names)") from None
        self.root = root.rstrip("/")
        self.s3 = hasattr(self.fs, "_call_s3")
        self.conditional = self.s3

    # -- naming

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def _retry(self, call: Any, what: str, name: str) -> Any:
        return with_retries(call, what, self.join(name))

    def _s3(self, method: str, **kwargs: Any) -> Any:
        from fsspec.asyn import sync  # type: ignore[import-untyped]

        return sync(self.fs.loop, self.fs._call_s3, method, **kwargs)

    def _bucket_key(self, name: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self._path(name))
        return bucket, key

    # -- checkpoints (the object layout and manifest-last commit: storage.save, storage.remote)

    def shard_name(self, file: str, generation: str | None) -> str:
        return object_name(file, generation)

    def check_target(self, overwrite: bool) -> None:
        pass  # the manifest is read once, when the save is staged

    def stage(self, *, overwrite: bool, durable: bool) -> Any:
        return RemoteStaging(self, overwrite=overwrite)

    def write_shards(self, files: list[ShardFile], *, generation: str, compressed: bool,
                     threads: int, durable: bool, checksum: bool, bar: Any,
                     zstd_options: dict[str, Any], meanwhile: Callable[[], _T]) -> _T:
        upload_shards(self, files, generation, compressed=compressed, threads=threads,
                      checksum=checksum, zstd_options=zstd_options)
        if bar is not None:
            bar.update(sum(f.size for f in files))
        return meanwhile()

    def write_strings(self, strings: Any, generation: str, checksum: bool,
                      durable: bool) -> Any:
        return upload_strings(self, strings, generation, checksum)

    def open_checkpoint(self, *, follow_symlinks: bool, pool: Any) -> Any:
        return RemoteDirectory(self)

    def children(self) -> list[tuple[str, str]]:
        return [(name, f"{self.url}/{name}") for name, _ in list_checkpoints(self)]

    def commit_time(self) -> float:
        try:
            return self.list(MANIFEST_FILE)[0].mtime
        except IndexError:
            return time.time()

    def remove_checkpoint(self) -> None:
        remove_checkpoint(self)

    # -- writing

    def write_file(self, name: str, buffers: Iterable[Any]) -> int:
        if not self.s3:
            def write() -> int:
                n = 0
                with self.fs.open(self._path(name), "wb") as f:
                    for b in buffers:
                        n += f.write(b) or 0
                return n
            return self._retry(write, "writing", name)  # type: ignore[no-any-return]
        return self._multipart(name, buffers)

    def _multipart(self, name: str, buffers: Iterable[Any]) -> int:
        bucket, key = self._bucket_key(name)
        pool = _upload_pool()
        upload_id: str | None = None
        inflight: deque[Future[Any]] = deque()
        parts: list[dict[str, Any]] = []
        total = 0
        part = io.BytesIO()  # a file object: aiohttp streams it (raw bytes would be one blob)

        def body(data: io.BytesIO) -> io.BytesIO:
            data.seek(0)  # again on every attempt
            return data

        def send(number: int, data: io.BytesIO) -> dict[str, Any]:
            out = self._retry(lambda: self._s3("upload_part", Bucket=bucket, Key=key,
                                               UploadId=upload_id, PartNumber=number,
                                               Body=body(data)), f"uploading part {number} of",
                              name)
            return {"PartNumber": number, "ETag": out["ETag"]}

        def flush(data: io.BytesIO) -> None:
            nonlocal upload_id
            if upload_id is None:
                upload_id = self._retry(lambda: self._s3(
                    "create_multipart_upload", Bucket=bucket, Key=key)["UploadId"],
                    "starting the upload of", name)
            while len(inflight) >= PARTS_IN_FLIGHT:
                parts.append(inflight.popleft().result())
            inflight.append(pool.submit(send, len(parts) + len(inflight) + 1, data))

        try:
            for b in buffers:
                view = memoryview(b).cast("B")
                pos, n = 0, len(view)
                total += n
                while pos < n:
                    size = PART_SIZE if upload_id is not None else 2 * PART_SIZE
                    take = min(n - pos, size - part.tell())
                    part.write(view[pos : pos + take])
                    pos += take
                    if part.tell() == size:
                        flush(part)
                        part = io.BytesIO()
            if upload_id is None:  # small: one request
                self._retry(lambda: self._s3("put_object", Bucket=bucket, Key=key,
                                             Body=body(part)), "uploading", name)
                return total
            if part.tell():
                flush(part)
            while inflight:
                parts.append(inflight.popleft().result())
            parts.sort(key=lambda p: p["PartNumber"])
            self._retry(lambda: self._s3("complete_multipart_upload", Bucket=bucket, Key=key,
                                         UploadId=upload_id, MultipartUpload={"Parts": parts}),
                        "completing the upload of", name)
        except BaseException:
            for f in inflight:
                f.cancel()
            wait(inflight)  # the parts already on their way land before the abort
            if upload_id is not None:
                with contextlib.suppress(Exception):
                    self._s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            raise
        self.fs.invalidate_cache(self._path(name))
        return total

    def upload_file(self, name: str, local_path: str) -> None:
        with open(local_path, "rb") as f:
            self.write_file(name, iter(lambda: f.read(PART_SIZE), b""))

    def publish(self, name: str, data: bytes, *, if_absent: bool = False,
                if_tag: str | None = None) -> bool:
        if self.s3:
            bucket, key = self._bucket_key(name)
            cond: dict[str, str] = {}
            if if_absent:
                cond["IfNoneMatch"] = "*"
            elif if_tag is not None:
                cond["IfMatch"] = if_tag
            try:
                self._retry(lambda: self._s3("put_object", Bucket=bucket, Key=key,
                                             Body=io.BytesIO(data), **cond), "publishing", name)
            except StorageError as e:
                if _precondition_failed(e.__cause__):
                    return False
                raise
            finally:
                self.fs.invalidate_cache(self._path(name))
            return True
        current = self.fetch(name, 1 << 62)
        if (if_absent and current is not None) or (
                if_tag is not None and (current is None or current.tag != if_tag)):
            return False
        self._retry(lambda: self.fs.pipe_file(self._path(name), data), "publishing", name)
        return True

    # -- reading

    def read_range(self, name: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        data = self._retry(lambda: self.fs.cat_file(self._path(name), start=start, end=end),
                           f"reading bytes {start}-{end} of", name)
        if len(data) != end - start:
            raise StorageError(5, f"{self.join(name)}: read {len(data)} of the {end - start} "
                                  f"bytes at {start} (the object is shorter than its manifest "
                                  "says)")
        return data  # type: ignore[no-any-return]

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        groups = coalesce(ranges, limit=MAX_COALESCED)
        path = self._path(name)
        if len(groups) == 1:
            got = [self.read_range(name, groups[0][0], groups[0][1])]
        else:
            got = self._retry(lambda: self.fs.cat_ranges(
                [path] * len(groups), [g[0] for g in groups], [g[1] for g in groups],
                on_error="raise"), "reading ranges of", name)
        out: list[bytes] = [b""] * len(ranges)
        for (start, end, members), data in zip(groups, got):
            if len(data) != end - start:
                raise StorageError(5, f"{self.join(name)}: read {len(data)} of the "
                                      f"{end - start} bytes at {start}")
            view = memoryview(data)
            for i in members:
                a, b = ranges[i]
                out[i] = bytes(view[a - start : b - start]) if len(members) > 1 else data
        return out

    def size(self, name: str) -> int:
        path = self._path(name)
        self.fs.invalidate_cache(path)
        info = self._retry(lambda: self.fs.info(path), "looking up", name)
        if info.get("type") == "directory":
            raise FileNotFoundError(path)
        return int(info["size"])

    def fetch(self, name: str, limit: int) -> Fetched | None:
        if self.s3:
            bucket, key = self._bucket_key(name)

            async def get() -> tuple[bytes, str]:
                resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
                try:
                    length = int(resp.get("ContentLength", 0))
                    if length > limit:
                        raise StorageError(27, f"{self.join(name)}: {length} bytes, over the "
                                               f"{limit}-byte limit")
                    body = await resp["Body"].read()
                finally:
                    resp["Body"].close()
                return body, resp["ETag"]

            from fsspec.asyn import sync  # type: ignore[import-untyped]
            try:
                data, tag = self._retry(lambda: sync(self.fs.loop, get), "reading", name)
            except FileNotFoundError:
                return None
            return Fetched(data, tag)
        path = self._path(name)
        try:
            size = self.size(name)
            if size > limit:
                raise StorageError(27, f"{self.join(name)}: {size} bytes, over the "
                                       f"{limit}-byte limit")
            data = self._retry(lambda: self.fs.cat_file(path), "reading", name)
        except FileNotFoundError:  # none, or deleted since it was looked up
            return None
        return Fetched(data, None)

    def list(self, prefix: str = "") -> list[Stored]:
        self.fs.invalidate_cache(self.root)
        try:
            found = self._retry(lambda: self.fs.find(self.root, detail=True), "listing", prefix)
        except FileNotFoundError:
            return []
        out = []
        strip = len(self.root) + 1
        for path, info in found.items():
            if info.get("type") == "directory":
                continue
            name = path[strip:] if path.startswith(self.root + "/") else path
            if not name.startswith(prefix):
                continue
            mtime = info.get("LastModified") or info.get("mtime") or info.get("created") or 0
            if hasattr(mtime, "timestamp"):
                mtime = mtime.timestamp()
            out.append(Stored(name, int(info.get("size") or 0), float(mtime)))
        return sorted(out, key=lambda s: s.name)

    def delete(self, names: Sequence[str]) -> None:
        if not names:
            return
        paths = [self._path(n) for n in names]
        if self.s3:  # DeleteObjects, 1,000 keys a request; missing keys are no error
            self._retry(lambda: self.fs.rm(paths), "deleting", names[0])
        else:
            for name, path in zip(names, paths):
                with contextlib.suppress(FileNotFoundError):
                    self._retry(lambda path=path: self.fs.rm_file(path), "deleting", name)
        self.fs.invalidate_cache(self.root)

    def unfinished_uploads(self) -> Sequence[tuple[str, str, float]]:
        if not self.s3:
            return []
        bucket, key = self._bucket_key("")
        root = key.rstrip("/") + "/"
        listed = self._retry(lambda: self._s3("list_multipart_uploads", Bucket=bucket,
                                              Prefix=root),
                             "listing the unfinished uploads of", "")
        out = []
        for u in listed.get("Uploads", []):
            started = u.get("Initiated")
            age = time.time() - started.timestamp() if hasattr(started, "timestamp") else 1e18
            out.append((u["Key"][len(root):], u["UploadId"], age))
        return out

    def abort_upload(self, name: str, upload_id: str) -> None:
        bucket, key = self._bucket_key(name)
        self._retry(lambda: self._s3("abort_multipart_upload", Bucket=bucket, Key=key,
                                     UploadId=upload_id), "aborting an upload of", name)


def _precondition_failed(e: BaseException | None) -> bool:
    """Whether a refused PutObject was refused for its condition (412, or S3's 409 for a
    conditional write racing another)."""
    while e is not None:
        text = f"{type(e).__name__} {e}"
        if any(w in text for w in ("PreconditionFailed", "412", "ConditionalRequestConflict",
                                   "At least one of the pre-conditions")):
            return True
        e = e.__cause__ or e.__context__
    return False
