"""The local storage's save-side failures (shardkit.storage.local): a full disk, a file over the
size limit, a read-only file system, a parent that is a file each raise ShardIOError naming the
file and the cause; the earlier checkpoint stays intact and no temp directory is left."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import shardkit
from shardkit._kernels import _gather
from shardkit.errors import ShardIOError
from shardkit.storage import commit


def _state(n: int = 1000, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal(n).astype(np.float32), "step": np.array(seed, np.int64)}


@pytest.fixture
def earlier(tmp_path):
    """An earlier checkpoint at ``tmp_path / "c"``; checks afterwards that it is intact and
    that nothing else is left in ``tmp_path``."""
    state = _state(1000, 1)
    shardkit.save(tmp_path / "c", state, options=shardkit.CheckpointOptions(durable=False))
    before = {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()}
    yield tmp_path / "c"
    assert {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no temp directory
    assert shardkit.load(tmp_path / "c")["w"].tobytes() == state["w"].tobytes()


def test_full_disk_on_a_shard_write(earlier, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_gather, "write_arrays", full)  # the write primitive
    with pytest.raises(ShardIOError, match=r"writing the shards of .*\.c\.shardkit-tmp-\w+ "
                                           r"failed: .*No space left") as got:
        shardkit.save(earlier, _state(), overwrite=True)
    assert got.value.errno == errno.ENOSPC and isinstance(got.value, OSError)
    assert got.value.filename.endswith("model-00001-of-00001.safetensors")


def test_read_only_file_system_when_staging(earlier, monkeypatch):
    mkdir = os.mkdir

    def read_only(path, *args, **kwargs):
        if commit.TMP_MARK in os.fspath(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only)
    with pytest.raises(ShardIOError, match=r"starting the save of .*c failed: Read-only file "
                                           r"system: '.*\.c\.shardkit-tmp-") as got:
        shardkit.save(earlier, _state(), overwrite=True)
    assert got.value.errno == errno.EROFS


def test_failed_publish_keeps_the_earlier_checkpoint(earlier, monkeypatch):
    def refused(*args, **kwargs):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(earlier))

    monkeypatch.setattr(commit, "_publish", refused)
    with pytest.raises(ShardIOError, match=r"committing the checkpoint of .*c failed: "
                                           r"Permission denied: '.*c'"):
        shardkit.save(earlier, _state(), overwrite=True)


def test_parent_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    for where in (tmp_path / "file" / "ckpt", tmp_path / "file" / "deeper" / "ckpt"):
        with pytest.raises(ShardIOError, match=r"starting the save of .*ckpt failed: it is a "
                                               r"file, not a directory") as got:
            shardkit.save(where, _state())
        assert got.value.filename == str(tmp_path / "file")
    assert sorted(os.listdir(tmp_path)) == ["file"]
    assert (tmp_path / "file").read_text() == "not a directory"


_OVER_LIMIT = textwrap.dedent("""
    import json, resource, signal, sys
    import numpy as np
    import shardkit
    path, kind = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    w = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)  # 4 MiB
    state = {"w": w}
    if kind == "strings":
        state = {"w": w[:10], "s": np.array([b"x" * (2 << 20)], object)}
    try:
        shardkit.save(path, state, overwrite=True, compression="zstd" if kind == "zstd" else None)
        print(json.dumps(None))
    except Exception as e:
        print(json.dumps([[c.__name__ for c in type(e).__mro__], e.errno, str(e)]))
""")


@pytest.mark.parametrize("kind", ["raw", "zstd", "strings"])
def test_file_size_limit_is_a_shardkit_error(earlier, kind):
    """A real kernel error: the save runs in a process whose files may not exceed 1 MiB."""
    out = subprocess.run([sys.executable, "-c", _OVER_LIMIT, str(earlier), kind],
                         capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got is not None, "the save did not fail"
    classes, code, message = got
    assert "ShardIOError" in classes and "OSError" in classes, got
    assert code == errno.EFBIG and "File too large" in message, got
    assert "shardkit-tmp-" in message, got  # the file being written is named
