"""Checkpoints on object storage, against a real S3 server (moto's server mode, tests/s3server.py)
with s3fs as the client: byte-exact round trips, ranged reads, the manager, manifest-last commit
under SIGKILL and concurrent writers, retries and permanent errors, `shardkit gc`, the
distributed save over 2 ranks, verify's parallel coalesced reads; and fsspec ``memory://``
round trips (one with string tensors)."""

from __future__ import annotations

import errno
import json
import os
import random
import select
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from s3server import S3Server, kill_state

import shardkit
from shardkit import format as fmt
from shardkit.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    ChecksumError,
    StorageError,
)
from shardkit.storage import base as storage_base
from shardkit.storage import fsspec as storage_fsspec
from shardkit.storage import open_storage, set_storage_options
from shardkit.storage import remote as storage_remote
from shardkit.storage.housekeeping import gc, mark_staging
from shardkit.storage.layout import SHARDS_PREFIX, is_marker, object_name
from shardkit.tools.cli import main as cli_main


@pytest.fixture(scope="module")
def s3():
    server = S3Server().start()
    set_storage_options("s3://", **server.options)
    try:
        yield server
    finally:
        set_storage_options("s3://")
        server.stop()


@pytest.fixture
def bucket(s3):
    return f"s3://{s3.bucket()}"


def _state(seed: int = 0, big: int = 300_000) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "model": {"w": rng.standard_normal((big // 100, 100)).astype(np.float32),
                  "b": rng.standard_normal(100).astype(np.float16)},
        "step": np.array(seed, np.int64),
        "ids": np.arange(1000, dtype=np.int32) + seed,
        "empty": np.zeros((0, 3), np.float64),
    }


def _equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k


def _flat(state: dict) -> dict:
    return {"model/w": state["model"]["w"], "model/b": state["model"]["b"],
            "step": state["step"], "ids": state["ids"], "empty": state["empty"]}


def _objects(url: str) -> dict[str, bytes]:
    store = open_storage(url)
    return {s.name: store.read_range(s.name, 0, s.size) if s.size else b""
            for s in store.list("")}


def _local_files(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir()}


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_round_trip_is_byte_for_byte_a_local_save(bucket, tmp_path, compression, monkeypatch):
    state = _state()
    url = f"{bucket}/run/ckpt"
    monkeypatch.setattr(fmt, "new_generation", lambda: "5" * 32)  # the same id in both saves
    policy = shardkit.DefaultShardingPolicy(threads=2, max_shard_size=400_000)  # 2 shards
    info = shardkit.save(url, state,
                         options=shardkit.CheckpointOptions(compression=compression,
                                                            experimental_sharding_callback=policy))
    local = shardkit.save(tmp_path / "c", state,
                          options=shardkit.CheckpointOptions(compression=compression,
                                                             experimental_sharding_callback=policy))
    assert info.generation == local.generation and len(local.files) == 3
    objects = _objects(url)
    markers = {n: json.loads(objects.pop(n)) for n in list(objects) if is_marker(n)}
    files = _local_files(tmp_path / "c")
    # the manifest at the prefix, the shards under the generation's directory: same bytes
    expected = {(n if n == fmt.MANIFEST_FILE else f"{SHARDS_PREFIX}{info.generation}/{n}"): d
                for n, d in files.items()}
    assert objects == expected
    # beside them, the staging marker of the upload names exactly its shard objects
    assert [sorted(m["objects"]) for m in markers.values()] == [
        sorted(n for n in expected if n != fmt.MANIFEST_FILE)]
    assert info.files == (*sorted(n for n in expected if n != fmt.MANIFEST_FILE),
                          fmt.MANIFEST_FILE)
    flat = shardkit.load(tmp_path / "c")
    _equal(shardkit.load(url), flat)
    _equal(shardkit.load(url, mmap=False), flat)
    assert shardkit.open(url).verify() == len(flat) - 0
    out = {k: np.zeros_like(v) for k, v in flat.items()}
    shardkit.restore_into(url, out)
    _equal(out, flat)


class _GetCounter:
    """Counts the GetObject requests s3fs's client sends, and their bytes (a botocore event
    hook on the client: the requests that reach the server)."""

    def __init__(self, fs) -> None:
        fs.connect()
        self.events = fs.s3.meta.events
        self.sizes: list[int] = []

    def __call__(self, parsed=None, **kwargs) -> None:
        self.sizes.append(int(parsed["ContentLength"]))

    def __enter__(self) -> _GetCounter:
        self.events.register("after-call.s3.GetObject", self)
        return self

    def __exit__(self, *exc) -> None:
        self.events.unregister("after-call.s3.GetObject", self)


def test_string_tensors_are_byte_for_byte_a_local_save(bucket, tmp_path, monkeypatch):
    state = {"w": np.arange(1000, dtype=np.float32),
             "vocab": np.array([b"", b"a", b"\x00\xff" * 50], object),
             "names": np.array([["alpha", "\u03b2"], ["", "gamma"]], object)}
    monkeypatch.setattr(fmt, "new_generation", lambda: "6" * 32)
    url = f"{bucket}/strings"
    info = shardkit.save(url, state, options=shardkit.CheckpointOptions(compression="zstd"))
    shardkit.save(tmp_path / "c", state, options=shardkit.CheckpointOptions(compression="zstd"))
    expected = {(n if n == fmt.MANIFEST_FILE else f"{SHARDS_PREFIX}{info.generation}/{n}"): d
                for n, d in _local_files(tmp_path / "c").items()}
    objects = _objects(url)
    marked = sorted(n for m in objects if is_marker(m) for n in json.loads(objects[m])["objects"])
    assert {n: d for n, d in objects.items() if not is_marker(n)} == expected
    assert f"{SHARDS_PREFIX}{'6' * 32}/strings.skstr" in expected
    assert marked == sorted(n for n in expected if n != fmt.MANIFEST_FILE)
    got = shardkit.load(url)
    assert got["vocab"].tolist() == state["vocab"].tolist()
    assert got["names"].tolist() == state["names"].tolist()
    assert got["w"].tobytes() == state["w"].tobytes()
    assert cli_main(["verify", url]) == 0


def test_one_row_get_slice_fetches_under_one_percent(bucket):
    w = np.arange(2000 * 1000, dtype=np.float32).reshape(2000, 1000)  # 8 MB
    url = f"{bucket}/slice"
    shardkit.save(url, {"w": w, "v": np.ones(10, np.float32)})
    with _GetCounter(open_storage(url).fs) as gets, shardkit.open(url) as r:
        opened = len(gets.sizes)  # the manifest
        row = r.get_slice("w", (slice(1234, 1235),))
        np.testing.assert_array_equal(row, w[1234:1235])
        shard_gets = gets.sizes[opened:]
        # the shard's header (one GET, 16 KiB at most) and the row's 4,000 bytes (one GET)
        assert len(shard_gets) == 2 and shard_gets[1] == 4000, shard_gets
        assert sum(shard_gets) < 0.01 * w.nbytes, shard_gets
        before = len(gets.sizes)
        block = r.get_slice("w", (slice(10, 13), slice(5, 7)))
        np.testing.assert_array_equal(block, w[10:13, 5:7])
        # the reader reads the small span from (10, 5) to (12, 7) at once: 2 rows + 8 bytes
        assert gets.sizes[before:] == [2 * 4000 + 8]
        before = len(gets.sizes)
        rows = r.get_slice("w", (slice(100, 400),))  # 1.2 MB of adjacent rows: one GET
        np.testing.assert_array_equal(rows, w[100:400])
        assert gets.sizes[before:] == [300 * 4000]


def test_manager_listing_retention_latest(bucket):
    root = f"{bucket}/train"
    ckpt = shardkit.Checkpoint(w=np.zeros(4, np.float32))
    manager = shardkit.CheckpointManager(ckpt, root, max_to_keep=2)
    assert manager.latest_checkpoint is None
    for step in range(3):
        ckpt.w[:] = step  # type: ignore[index]
        manager.save()
    assert manager.checkpoints == [f"{root}/ckpt-2", f"{root}/ckpt-3"]
    assert manager.latest_checkpoint == f"{root}/ckpt-3"
    names = {s.name.split("/")[0] for s in open_storage(root).list("")}
    assert names == {"ckpt-2", "ckpt-3"}  # ckpt-1 deleted, manifest and objects
    ckpt.w[:] = -1  # type: ignore[index]
    assert manager.restore_or_initialize() == f"{root}/ckpt-3"
    np.testing.assert_array_equal(ckpt.w, np.full(4, 2, np.float32))
    ckpt.w[:] = 7  # type: ignore[index]
    manager.save(options=shardkit.CheckpointOptions(enable_async=True))  # in the background
    manager.sync()
    assert manager.checkpoints == [f"{root}/ckpt-3", f"{root}/ckpt-4"]
    fresh = shardkit.Checkpoint(w=np.zeros(4, np.float32))
    fresh.restore(f"{root}/ckpt-4")
    np.testing.assert_array_equal(fresh.w, np.full(4, 7, np.float32))


def test_overwrite_deletes_old_generation_only_after_commit(bucket):
    url = f"{bucket}/ow"
    first = shardkit.save(url, _state(1))
    with pytest.raises(CheckpointExistsError):
        shardkit.save(url, _state(2))
    reader = shardkit.open(url, mmap=False)  # reads generation 1, no shard opened yet
    second = shardkit.save(url, _state(2), overwrite=True)
    with pytest.raises(CheckpointReplacedError, match="replaced while this reader"):
        reader["model/w"]  # generation 1's objects are deleted now
    names = [s.name for s in open_storage(url).list("")]
    assert all(first.generation not in n for n in names)
    assert any(second.generation in n for n in names)
    _equal(shardkit.load(url), shardkit.load(url))
    assert int(shardkit.load(url)["step"]) == 2
    reader.close()


def test_corrupt_object_is_named_by_verify(bucket, capsys):
    url = f"{bucket}/bad"
    info = shardkit.save(url, {"w": np.arange(100, dtype=np.float32)})
    store = open_storage(url)
    name = info.files[0]
    data = bytearray(store.read_range(name, 0, store.size(name)))
    data[-1] ^= 0xFF
    store.delete([name])
    store.write_file(name, [bytes(data)])
    with pytest.raises(ChecksumError, match="w"):
        shardkit.open(url).verify()
    assert cli_main(["verify", url]) == 1
    assert "CORRUPT" in capsys.readouterr().err
    assert cli_main(["inspect", url]) == 0
    assert "w" in capsys.readouterr().out


def test_verify_fetches_coalesced_ranges_in_parallel(bucket, monkeypatch):
    rng = np.random.default_rng(3)
    state = {f"small{i}": rng.standard_normal(256).astype(np.float32) for i in range(300)}
    state["big"] = rng.standard_normal(5 * 2**20 // 4).astype(np.float32)  # 5 MiB
    url = f"{bucket}/verify-parallel"
    info = shardkit.save(url, state)
    store = open_storage(url)
    with _GetCounter(store.fs) as gets, shardkit.open(url) as r:
        opened = len(gets.sizes)
        assert r.verify() == 301
        # the header (two GETs: it is over 16 KiB), then every entry's bytes in one
        # coalesced GET (not one GET per entry, nor 8 MiB steps)
        data = sum(a.nbytes for a in state.values())
        assert len(gets.sizes[opened:]) == 3 and gets.sizes[-1] == data, gets.sizes[opened:]
    # batches of 1 MiB: several in flight at once on the reader's pool, hashed in order
    monkeypatch.setattr(storage_remote, "TASK_BYTES", 2**20)
    monkeypatch.setattr(storage_remote, "PIECE", 2**19)
    lock, busy, most = threading.Lock(), [0], [0]
    real = storage_fsspec.FsspecStorage.read_ranges

    def counting(self, name, ranges):
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        try:
            time.sleep(0.05)
            return real(self, name, ranges)
        finally:
            with lock:
                busy[0] -= 1

    monkeypatch.setattr(storage_fsspec.FsspecStorage, "read_ranges", counting)
    with shardkit.open(url) as r:
        assert r.verify() == 301
    assert most[0] >= 2
    # a flipped byte inside the big entry is found and blamed on its shard object
    name = info.files[0]
    data = bytearray(store.read_range(name, 0, store.size(name)))
    data[-2 * 2**20] ^= 0xFF
    store.delete([name])
    store.write_file(name, [bytes(data)])
    with shardkit.open(url) as r:
        problems = r.verify_report().problems
    assert [(p.file, p.key, p.error) for p in problems] == [(store.join(name), "big",
                                                             ChecksumError)]


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_storage_interface(kind, bucket, tmp_path):
    """The interface both implementations share: write from buffers, ranged and coalesced
    reads, list, conditional publish, delete."""
    url = {"local": str(tmp_path / "st"), "memory": f"memory://iface/{os.getpid()}",
           "s3": f"{bucket}/iface"}[kind]
    store = open_storage(url)
    data = os.urandom(300_000)
    assert store.write_file("d/a.bin", [data[:1000], memoryview(data)[1000:]]) == len(data)
    assert store.size("d/a.bin") == len(data)
    assert store.read_range("d/a.bin", 5, 105) == data[5:105]
    ranges = [(200, 300), (0, 100), (100, 200), (5000, 5001)]
    assert store.read_ranges("d/a.bin", ranges) == [data[a:b] for a, b in ranges]
    with pytest.raises(FileNotFoundError):
        store.size("nothing")
    assert store.fetch("m", 100) is None
    assert store.publish("m", b"one", if_absent=True)
    assert not store.publish("m", b"two", if_absent=True)
    first = store.fetch("m", 100)
    assert first is not None and first.data == b"one"
    with pytest.raises(StorageError, match="limit"):
        store.fetch("m", 2)
    if kind != "memory":  # stores with tags: a stale tag loses, the current one wins
        assert store.conditional and first.tag is not None
        assert not store.publish("m", b"three", if_tag='"stale"')
        assert store.publish("m", b"three", if_tag=first.tag)
        assert not store.publish("m", b"four", if_tag=first.tag)  # the tag changed
        assert store.fetch("m", 100).data == b"three"
    assert [s.name for s in store.list("")] == ["d/a.bin", "m"]
    assert [s.name for s in store.list("d/")] == ["d/a.bin"]
    store.delete(["d/a.bin", "m", "missing"])
    assert store.list("") == []


def test_missing_checkpoint(bucket):
    with pytest.raises(CheckpointNotFoundError):
        shardkit.load(f"{bucket}/nothing-here")


class _Flaky:
    """Wraps s3fs's request method: the first `fail` calls of `method` raise `error`."""

    def __init__(self, fs, method: str, fail: int, error: Exception) -> None:
        self.real, self.method, self.left, self.error = fs._call_s3, method, fail, error
        self.raised = 0

    async def __call__(self, method, *args, **kwargs):
        if method == self.method and self.left > 0:
            self.left -= 1
            self.raised += 1
            raise self.error
        return await self.real(method, *args, **kwargs)


def _client_error(code: str, status: int):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "injected"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def test_throttling_is_retried_and_a_permanent_error_named(bucket, monkeypatch):
    monkeypatch.setattr(storage_base, "BACKOFF", 0.001)
    monkeypatch.setattr(storage_fsspec, "PART_SIZE", 5 * 2**20)  # S3's smallest part
    url = f"{bucket}/flaky"
    fs = open_storage(url).fs
    for method in ("put_object", "upload_part", "get_object"):
        flaky = _Flaky(fs, method, 3, _client_error("SlowDown", 503))
        monkeypatch.setattr(fs, "_call_s3", flaky)
        state = _state(3, big=5_000_000 if method == "upload_part" else 1000)
        shardkit.save(url, state, overwrite=True)
        _equal(shardkit.load(url), shardkit.load(url))
        monkeypatch.setattr(fs, "_call_s3", flaky.real)
        assert flaky.raised == 3, method
    reset = _Flaky(fs, "put_object", 2, ConnectionResetError(errno.ECONNRESET, "reset"))
    monkeypatch.setattr(fs, "_call_s3", reset)
    shardkit.save(url, _state(4, 1000), overwrite=True)
    assert reset.raised == 2
    denied = _Flaky(fs, "put_object", 100, _client_error("AccessDenied", 403))
    monkeypatch.setattr(fs, "_call_s3", denied)
    # the first object the save uploads is named: its staging marker
    with pytest.raises(StorageError, match=r"flaky/shards-[0-9a-f]+/\S+: uploading refused"):
        shardkit.save(url, _state(5, 1000), overwrite=True)
    assert denied.raised == 1  # not retried
    monkeypatch.setattr(fs, "_call_s3", denied.real)
    assert int(shardkit.load(url)["step"]) == 4  # the earlier checkpoint is intact
    assert {s.name.split("/")[0] for s in open_storage(url).list("")} == {
        fmt.MANIFEST_FILE, f"{SHARDS_PREFIX}{shardkit.open(url).generation}"}


def test_concurrent_writers_of_one_path_exactly_one_wins(bucket):
    url = f"{bucket}/race"
    barrier = threading.Barrier(2)
    results: list = [None, None]

    def write(i: int) -> None:
        barrier.wait()
        try:
            results[i] = shardkit.save(url, _state(10 + i, 200_000))
        except CheckpointExistsError as e:
            results[i] = e

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [r for r in results if isinstance(r, shardkit.SaveInfo)]
    assert len(winners) == 1, results
    assert int(shardkit.load(url)["step"]) == 10 + results.index(winners[0])
    prefixes = {s.name.split("/")[0] for s in open_storage(url).list("")}
    assert prefixes == {fmt.MANIFEST_FILE, f"{SHARDS_PREFIX}{winners[0].generation}"}


def _crashed_save(store, files: list[str]) -> str:
    """The objects a save leaves when it dies mid-upload: its staging marker, its first file
    uploaded, an unfinished multipart upload of its second. Returns its generation."""
    gen = fmt.new_generation()
    mark_staging(store, gen, files)
    store.write_file(object_name(files[0], gen), [b"x" * 10])
    bucket, key = store._bucket_key(object_name(files[1], gen))
    store._s3("create_multipart_upload", Bucket=bucket, Key=key)
    return gen


def _foreign(store, prefix: str) -> tuple[str, str]:
    """Another tool's objects under `prefix`: an object under a ``shards-`` name and a
    multipart upload in progress (one part sent). Returns the object's name and the upload."""
    store.write_file(f"{prefix}shards-x/notes.txt", [b"not shardkit's"])
    bucket, key = store._bucket_key(f"{prefix}shards-x/big.bin")
    upload = store._s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    store._s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=1,
              Body=b"y" * (5 * 2**20))
    return f"{prefix}shards-x/notes.txt", upload


def _complete_foreign(store, prefix: str, upload: str) -> None:
    """Complete `_foreign`'s upload: it must still be in progress."""
    bucket, key = store._bucket_key(f"{prefix}shards-x/big.bin")
    parts = store._s3("list_parts", Bucket=bucket, Key=key, UploadId=upload)["Parts"]
    store._s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload,
              MultipartUpload={"Parts": [{"PartNumber": p["PartNumber"], "ETag": p["ETag"]}
                                         for p in parts]})
    assert store.size(f"{prefix}shards-x/big.bin") == 5 * 2**20


def test_gc_removes_only_what_shardkit_staged(bucket, capsys):
    """gc deletes a crashed save's objects and aborts its upload (its staging marker names
    them); another tool's object under ``shards-x/`` and its upload in progress stay."""
    url = f"{bucket}/gc"
    info = shardkit.save(url, _state(0, 1000))
    store = open_storage(url)
    mine = {s.name for s in store.list("")}
    assert set(info.files) <= mine
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    gen = _crashed_save(store, files)
    name, upload = _foreign(store, "")
    assert gc(open_storage(url)) == []  # younger than the default hour: maybe a save in progress
    assert cli_main(["gc", url, "--older-than", "0"]) == 0
    out = capsys.readouterr().out
    assert "2 object(s) removed" in out and object_name(files[0], gen) in out  # and its marker
    assert {s.name for s in store.list("")} == mine | {name}
    assert [u[0] for u in store.unfinished_uploads()] == ["shards-x/big.bin"]
    _complete_foreign(store, "", upload)
    assert cli_main(["gc", url, "--older-than", "0"]) == 0
    assert "0 object(s) removed" in capsys.readouterr().out
    assert {s.name for s in store.list("")} == mine | {name, "shards-x/big.bin"}
    assert cli_main(["gc", "/not/a/url"]) == 1


def test_overwrite_and_retention_delete_only_shardkit_objects(bucket):
    """The clean-up after an overwrite and the manager's retention delete what a manifest or a
    staging marker names: a HuggingFace export ``ckpt-0/`` beside the checkpoints, a file a
    user put in a checkpoint's prefix, another tool's object and upload stay."""
    root = f"{bucket}/keep"
    store = open_storage(root)
    hf = {"ckpt-0/model.safetensors.index.json": json.dumps(
              {"metadata": {"total_size": 16},
               "weight_map": {"w": "model-00001-of-00001.safetensors"}}).encode(),
          "ckpt-0/model-00001-of-00001.safetensors": b"not read"}
    for n, d in hf.items():
        store.write_file(n, [d])
    ckpt = shardkit.Checkpoint(w=np.zeros(4, np.float32))
    manager = shardkit.CheckpointManager(ckpt, root, max_to_keep=1)
    manager.save()  # ckpt-1
    gen = _crashed_save(open_storage(f"{root}/ckpt-1"), ["model-00001-of-00001.safetensors",
                                                         "strings.skstr"])
    name, upload = _foreign(store, "ckpt-1/")
    store.write_file("ckpt-1/README.md", [b"mine"])
    manager.save(options=shardkit.CheckpointOptions(enable_async=True))  # ckpt-2, ckpt-1 goes
    manager.sync()
    assert manager.checkpoints == [f"{root}/ckpt-2"]
    left = {s.name for s in store.list("") if not s.name.startswith("ckpt-2/")}
    assert left == {*hf, name, "ckpt-1/README.md"}
    assert [u[0] for u in store.unfinished_uploads()] == ["ckpt-1/shards-x/big.bin"]
    _complete_foreign(store, "ckpt-1/", upload)
    assert all(store.read_range(n, 0, len(d)) == d for n, d in hf.items())
    assert gen not in str(left)
    # an overwrite: the old generation's objects go, another tool's stay
    url = f"{root}/ckpt-2"
    one = open_storage(url)
    old = shardkit.open(url).generation
    name, upload = _foreign(one, "")
    shardkit.save(url, _state(1, 1000), overwrite=True)
    names = {s.name for s in one.list("")}
    assert not any(old in n for n in names) and name in names
    _complete_foreign(one, "", upload)


def test_sigkill_mid_upload_never_exposes_a_partial_checkpoint(s3, bucket):
    """20 saves (overwrites) SIGKILLed at random points of their upload, in children forked by
    a runner process of their own (tests/s3server.py): after each, the path reads as all of the
    last committed checkpoint or all of the new one."""
    url = f"{bucket}/kill"
    shardkit.save(url, kill_state(0))
    started = time.perf_counter()
    shardkit.save(url, kill_state(0), overwrite=True)
    took = time.perf_counter() - started
    here = os.path.dirname(os.path.abspath(__file__))
    runner = subprocess.Popen(
        [sys.executable, "-c", "import sys, s3server; s3server.kill_rounds_main(*sys.argv[1:])",
         url, json.dumps(s3.options)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=here, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [here, *filter(None, [os.environ.get("PYTHONPATH")])])})
    committed, rng, outcomes = 0, random.Random(14), []
    try:
        for k in range(1, 21):
            assert runner.stdin is not None and runner.stdout is not None
            runner.stdin.write(f"{k} {rng.uniform(0.0, 5.0 * took)}\n")
            runner.stdin.flush()
            line = _readline(runner, 60)
            assert line in ("finished", "killed"), line
            finished = line == "finished"
            outcomes.append(finished)
            loaded = shardkit.load(url)
            step = int(loaded["step"])
            assert step in (committed, k), (k, step, committed)
            _equal(loaded, kill_state(step))  # all of the old or all of the new
            if step == k:
                committed = k
            else:
                assert not finished
    finally:
        runner.stdin.close()  # type: ignore[union-attr]
        try:
            runner.wait(30)
        except subprocess.TimeoutExpired:
            runner.kill()
            runner.wait(30)
        runner.stdout.close()  # type: ignore[union-attr]
    print(f"\nkill rounds: {outcomes.count(False)} mid-save, {outcomes.count(True)} after it")
    assert not all(outcomes), "every save finished before the kill: the test tested nothing"
    # the crashed saves' objects: the next save, or gc, removes them
    gc(open_storage(url), older_than=0)
    gen = shardkit.open(url).generation
    store = open_storage(url)
    assert {s.name.split("/")[0] for s in store.list("")} == {fmt.MANIFEST_FILE,
                                                             f"{SHARDS_PREFIX}{gen}"}
    assert store.unfinished_uploads() == []  # gc aborted the unfinished multipart uploads


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """A line of `proc`'s stdout within `timeout` seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the kill runner gave no answer within {timeout} s"
    return proc.stdout.readline().strip()  # type: ignore[union-attr]


def test_memory_url_round_trip():
    url = f"memory://shardkit-test/{os.getpid()}"
    state = _state(7, 1000)
    shardkit.save(url, state, options=shardkit.CheckpointOptions(compression="zstd"))
    flat = shardkit.load(url)
    assert int(flat["step"]) == 7 and flat["model/w"].tobytes() == state["model"]["w"].tobytes()
    shardkit.save(url, state, overwrite=True)
    _equal(shardkit.load(url), flat)
    open_storage(url).fs.rm(open_storage(url).root, recursive=True)


def test_string_tensors_round_trip_at_a_url_and_verify():
    url = f"memory://shardkit-strings/{os.getpid()}"
    words = {"w": np.arange(4, dtype=np.float32), "names": np.array([b"a", b"zzqq"], object),
             "text": np.array([["x", "\u00e9t\u00e9"], ["", "z"]], object)}
    info = shardkit.save(url, words)
    store = open_storage(url)
    strings_object = f"{SHARDS_PREFIX}{info.generation}/strings.skstr"
    assert strings_object in info.files and store.size(strings_object) > 0
    with shardkit.open(url) as r:
        assert r.keys() == ["w", "names", "text"]
        assert r["names"].tolist() == [b"a", b"zzqq"]
        assert r["text"].tolist() == [["x", "\u00e9t\u00e9"], ["", "z"]]
        assert r.verify_report().ok
    flat = shardkit.load(url)
    assert flat["w"].tobytes() == words["w"].tobytes() and flat["names"].tolist() == [b"a", b"zzqq"]
    # a damaged string object is found by verify, named by its object
    data = bytearray(store.fetch(strings_object, 1 << 20).data)
    data[data.index(b"zzqq")] ^= 0xFF  # not hex: not in the generation of the preamble
    store.fs.pipe_file(f"{store.root}/{strings_object}", bytes(data))
    with shardkit.open(url) as r:
        report = r.verify_report()
    assert [(p.file, p.key) for p in report.problems] == [(store.join(strings_object), "names")]
    store.fs.rm(store.root, recursive=True)


def test_tensorflow_format_is_refused_at_a_url_before_anything_is_written():
    url = f"memory://shardkit-refused/{os.getpid()}"
    with pytest.raises(shardkit.InvalidArgumentError, match="format='tensorflow' writes local"):
        shardkit.save(url, {"w": np.arange(4, dtype=np.float32)}, format="tensorflow")
    assert not open_storage(url).fs.exists(open_storage(url).root)


def _distributed_save(rank: int, world: int, url: str, options: dict) -> tuple:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    set_storage_options("s3://", **options)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6)
    state = {"s0": distribute_tensor(g, mesh, [Shard(0)]),
             "s1": distribute_tensor(g * 2, mesh, [Shard(1)]),
             "plain": torch.full((16,), 3.0)}
    info = shardkit.save(url, state)
    # restored on every rank into DTensors of another placement, by ranged reads
    target = {"s0": distribute_tensor(torch.zeros(64, 6), mesh, [Shard(1)]),
              "s1": distribute_tensor(torch.zeros(64, 6), mesh, [Shard(0)])}
    shardkit.restore_into(url, target, partial=True)
    same = (bool(torch.equal(target["s0"].full_tensor(), g))
            and bool(torch.equal(target["s1"].full_tensor(), g * 2)))
    return info.path, info.generation, same


def test_distributed_save_over_two_ranks(s3, bucket):
    from distributed import raise_any, run_ranks

    url = f"{bucket}/dist"
    out = raise_any(run_ranks(_distributed_save, 2, url, s3.options, timeout=120))
    assert out[0] == out[1] and out[0][2], out
    flat = shardkit.load(url)
    g = np.arange(64 * 6, dtype=np.float32).reshape(64, 6)
    np.testing.assert_array_equal(flat["s0"], g)
    np.testing.assert_array_equal(flat["s1"], g * 2)
    np.testing.assert_array_equal(flat["plain"], np.full(16, 3.0, np.float32))
    assert shardkit.open(url).verify() > 0
    assert shardkit.open(url).generation == out[0][1]


def test_storage_options_match_whole_bucket_and_path_components():
    """Options registered for a bucket reach that bucket only (never a bucket whose name merely
    starts the same), and the longest matching prefix wins."""
    from shardkit.storage import storage_options_for

    try:
        set_storage_options("s3://my-bucket", key="mine")
        set_storage_options("s3://my-bucket/run1/", key="run1")
        set_storage_options("memory://", key="any")
        assert storage_options_for("s3://my-bucket") == {"key": "mine"}
        assert storage_options_for("s3://my-bucket/") == {"key": "mine"}
        assert storage_options_for("s3://my-bucket/x/ckpt") == {"key": "mine"}
        assert storage_options_for("s3://my-bucket/run1") == {"key": "run1"}
        assert storage_options_for("s3://my-bucket/run1/ckpt-3") == {"key": "run1"}
        assert storage_options_for("s3://my-bucket/run10") == {"key": "mine"}
        bare = storage_options_for("s3://")  # whatever covers every s3:// URL (if anything)
        assert "key" not in bare or bare["key"] not in ("mine", "run1")
        assert storage_options_for("s3://my-bucket-other") == bare
        assert storage_options_for("s3://my-bucket-other/x") == bare
        assert storage_options_for("s3://my-bucketx/run1") == bare
        assert storage_options_for("gs://my-bucket/x") == {}
        assert storage_options_for("memory://a/b") == {"key": "any"}
    finally:
        for prefix in ("s3://my-bucket", "s3://my-bucket/run1/", "memory://"):
            set_storage_options(prefix)
