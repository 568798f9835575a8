"""Async saves: snapshot into reused host buffers, background write, waiting, error delivery."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import shardkit.io.flow as save_flow
import shardkit.io.save as api
from shardkit.errors import ShardkitError
from shardkit.format import MANIFEST_FILE
from shardkit.io.options import CheckpointOptions
from shardkit.io.reader import load
from shardkit.io.snapshot import ALIGNMENT, HostBufferPool, alloc_host_buffer
from shardkit.training.checkpoint import Checkpoint, CheckpointManager

ASYNC = CheckpointOptions(enable_async=True, durable=False)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def gate(monkeypatch):
    """Holds every background write until ``gate.set()`` (so tests see the pending state)."""
    event = threading.Event()
    real_save = api.save

    def gated_save(*args, **kwargs):
        assert event.wait(30), "test gate never opened"
        return real_save(*args, **kwargs)

    monkeypatch.setattr(api, "save", gated_save)
    yield event
    event.set()


@pytest.fixture
def failing_writer(monkeypatch):
    """Make the shard writer fail half-way, as a full disk would."""

    def fail(directory, *args, **kwargs):
        (Path(directory) / "model-00001-of-00001.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(save_flow, "write_shards", fail)


def no_temp_dirs(directory: Path) -> bool:
    return not [p for p in directory.iterdir() if ".shardkit-tmp-" in p.name]


def blocked(fn, *args):
    """Run fn in a thread; return (thread, result box). The thread is alive while blocked."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the test
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(0.3)
    return t, box


# --- host buffers -------------------------------------------------------------------------------


def test_alloc_host_buffer_unpinned_is_aligned_and_sized():
    for n in (0, 1, 100, 1 << 20):
        buf = alloc_host_buffer(n, pin=False)
        assert buf.dtype == np.uint8 and buf.nbytes == n and buf.flags.writeable
        assert n == 0 or buf.ctypes.data % ALIGNMENT == 0  # (an empty one has no bytes)
    with pytest.raises(ValueError, match="non-negative int"):
        alloc_host_buffer(-1)


def test_alloc_host_buffer_pinned_needs_cuda():
    torch = pytest.importorskip("torch", reason="torch is an optional dependency")
    if torch.cuda.is_available():
        buf = alloc_host_buffer(4096, pin=True)
        assert buf.nbytes == 4096 and buf.ctypes.data % ALIGNMENT == 0
    else:
        with pytest.raises(ShardkitError, match="pinned host buffers need torch with a CUDA"):
            alloc_host_buffer(4096, pin=True)


def test_pool_reuses_buffers_and_copies():
    pool = HostBufferPool()
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(10, dtype=np.int64)[::2]  # non-contiguous
    snap = pool.snapshot([("a", a), ("b", b)])
    assert pool.allocations == 2
    assert np.array_equal(snap["a"], a) and np.array_equal(snap["b"], b)
    assert snap["b"].flags.c_contiguous and not np.shares_memory(snap["a"], a)
    addr = snap["a"].ctypes.data
    a += 1
    snap2 = pool.snapshot([("a", a), ("b", b)])
    assert pool.allocations == 2 and snap2["a"].ctypes.data == addr  # reused
    assert np.array_equal(snap2["a"], a)
    pool.snapshot([("a", np.ones(100, np.float32))])  # grew: reallocated; "b" released
    assert pool.allocations == 3 and pool.nbytes == 400


def test_pool_snapshots_torch_bf16_and_non_contiguous():
    torch = pytest.importorskip("torch", reason="torch is an optional dependency")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t().to(torch.bfloat16)
    s = torch.tensor(3.5, dtype=torch.bfloat16)
    snap = HostBufferPool().snapshot([("t", t), ("s", s)])
    assert snap["t"].dtype == ml_dtypes.bfloat16 and snap["t"].shape == (4, 3)
    assert np.array_equal(snap["t"].astype(np.float32), t.float().numpy())
    assert snap["s"].shape == () and float(snap["s"]) == 3.5


# --- async Checkpoint -----------------------------------------------------------------------------


def test_async_save_snapshots_before_returning(tmp_path, gate):
    x = np.arange(5.0)
    ckpt = Checkpoint(s={"x": x})
    h = ckpt.save(tmp_path / "c", ASYNC)
    assert h.staged() and h.wait_staged() and not h.done()
    assert "pending" in repr(h)
    x[:] = -1  # the training loop goes on at once
    assert not (tmp_path / "c-1").exists()
    gate.set()
    assert h.wait() == str(tmp_path / "c-1") and h.done()
    assert load(h)["s/x"].tolist() == [0, 1, 2, 3, 4]


def test_async_pool_reused_between_saves(tmp_path):
    x = np.arange(1000, dtype=np.float64)
    ckpt = Checkpoint(s={"x": x, "y": np.ones(3)})
    ckpt.save(tmp_path / "c", ASYNC)
    pool = ckpt._pool
    allocations = pool.allocations
    ckpt.sync()
    x += 1
    ckpt.save(tmp_path / "c", ASYNC)
    ckpt.sync()
    assert pool.allocations == allocations  # the same buffers, not new ones
    assert load(tmp_path / "c-2")["s/x"][0] == 1.0


def test_wait_timeout(tmp_path, gate):
    h = Checkpoint(s={"x": np.ones(1)}).save(tmp_path / "c", ASYNC)
    with pytest.raises(TimeoutError, match=r"still running after 0\.05 s"):
        h.wait(timeout=0.05)
    with pytest.raises(TimeoutError):
        h.exception(timeout=0.05)


@pytest.mark.parametrize("call", ["save", "restore", "sync", "wait_until_finished", "write"])
def test_next_call_waits_for_pending_write(tmp_path, gate, call):
    x = np.arange(4.0)
    ckpt = Checkpoint(s={"x": x})
    first = ckpt.save(tmp_path / "c", ASYNC)
    args = {"save": (tmp_path / "c", ASYNC), "restore": (first,), "sync": (),
            "wait_until_finished": (), "write": (tmp_path / "w",)}[call]
    thread, box = blocked(getattr(ckpt, call), *args)
    assert thread.is_alive() and not first.done()  # blocked behind the pending write
    gate.set()
    thread.join(10)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    assert first.done() and (tmp_path / "c-1" / MANIFEST_FILE).exists()


def test_async_error_raised_by_next_call_once(tmp_path, failing_writer):
    ckpt = Checkpoint(s={"x": np.ones(2)})
    h = ckpt.save(tmp_path / "c", ASYNC)
    with pytest.raises(OSError, match="No space left on device") as info:
        ckpt.save(tmp_path / "c", ASYNC)
    assert info.value.errno == errno.ENOSPC
    assert any("asynchronous save of" in n for n in getattr(info.value, "__notes__", []))
    assert h.done() and isinstance(h.exception(), OSError) and "failed" in repr(h)
    assert not (tmp_path / "c-1").exists() and no_temp_dirs(tmp_path)
    ckpt.sync()  # already reported: not raised twice


def test_async_error_seen_through_handle_is_not_raised_again(tmp_path, failing_writer):
    ckpt = Checkpoint(s={"x": np.ones(2)})
    h = ckpt.save(tmp_path / "c", ASYNC)
    with pytest.raises(OSError, match="No space left"):
        h.wait()
    ckpt.sync()


def test_failed_async_save_keeps_earlier_checkpoints(tmp_path, monkeypatch):
    x = np.arange(3.0)
    manager = CheckpointManager(Checkpoint(s={"x": x}), tmp_path, max_to_keep=2)
    manager.save(options=ASYNC)
    manager.save(options=ASYNC)
    manager.sync()
    before = manager.checkpoints

    def fail(directory, *args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(save_flow, "write_shards", fail)
    x[:] = 7
    manager.save(options=ASYNC)
    with pytest.raises(OSError, match="Input/output error"):
        manager.save(options=ASYNC)
    assert manager.checkpoints == before
    assert all(load(p)["s/x"].tolist() == [0, 1, 2] for p in before)
    assert no_temp_dirs(tmp_path)


def test_directory_replaced_by_a_file(tmp_path):
    run = tmp_path / "run"
    manager = CheckpointManager(Checkpoint(s={"x": np.ones(2)}), run, max_to_keep=3)
    first = manager.save(options=ASYNC)
    manager.sync()
    run.rename(tmp_path / "moved")
    run.write_bytes(b"not a directory")
    manager.save(options=ASYNC)
    with pytest.raises(OSError):
        manager.sync()
    moved = tmp_path / "moved" / os.path.basename(first)
    assert load(moved)["s/x"].tolist() == [1, 1]


def test_retention_only_after_durable(tmp_path, gate):
    manager = CheckpointManager(Checkpoint(s={"x": np.ones(2)}), tmp_path, max_to_keep=1)
    gate.set()
    manager.save(options=ASYNC)
    manager.sync()
    gate.clear()
    h = manager.save(options=ASYNC)
    assert not h.done()
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-1"]
    assert manager.latest_checkpoint == str(tmp_path / "ckpt-1")
    gate.set()
    manager.sync()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-2"]


def run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env=env)


def test_interpreter_exit_waits_for_pending_write(tmp_path):
    proc = run_script(tmp_path, """
        import sys, threading
        import numpy as np
        import shardkit.io.save as api
        from shardkit.checkpoint import Checkpoint
        from shardkit.io.options import CheckpointOptions
        real = api.save
        gate = threading.Event()  # the write waits until the main thread has looked
        def slow(*a, **k):
            gate.wait(60)
            return real(*a, **k)
        api.save = slow
        h = Checkpoint(s={"x": np.arange(4.0)}).save(sys.argv[1] + "/c",
                                                     CheckpointOptions(enable_async=True))
        print("returned", h.done())
        gate.set()
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "returned False"
    assert load(tmp_path / "c-1")["s/x"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("compression", ["None", "'zstd'"])
def test_interpreter_exit_completes_a_pending_multi_shard_write(tmp_path, compression):
    """Writer and compression threads are started while the interpreter exits: a
    ThreadPoolExecutor would refuse them ("cannot schedule new futures after interpreter
    shutdown")."""
    proc = run_script(tmp_path, """
        import sys, threading
        import numpy as np
        import shardkit.io.save as api
        from shardkit.checkpoint import Checkpoint
        from shardkit.io.options import CheckpointOptions
        api.SINGLE_SHARD_BELOW = 0  # several shards, so several writer threads
        real = api.save
        gate = threading.Event()  # the write waits until the main thread has looked
        def slow(*a, **k):
            gate.wait(60)
            return real(*a, **k)
        api.save = slow
        state = {f"x{i}": np.full(1000, i, np.float32) for i in range(4)}
        h = Checkpoint(s=state).save(sys.argv[1] + "/c", CheckpointOptions(
            enable_async=True, threads=2, compression=COMPRESSION))
        print("returned", h.done())
        gate.set()
    """.replace("COMPRESSION", compression))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "returned False"
    assert "failed" not in proc.stderr, proc.stderr
    loaded = load(tmp_path / "c-1", verify=True)
    assert [float(loaded[f"s/x{i}"][0]) for i in range(4)] == [0.0, 1.0, 2.0, 3.0]
    assert len(list((tmp_path / "c-1").glob("model-*"))) >= 2


def test_restore_while_the_interpreter_exits(tmp_path):
    """Reads that use the reader's thread pool (zstd chunks decoded in parallel, large preads
    cut into pieces) still work from an atexit handler, when a ThreadPoolExecutor would refuse
    new work."""
    proc = run_script(tmp_path, """
        import atexit, sys
        import numpy as np
        import shardkit
        big = np.arange(6_000_000, dtype=np.float32)  # 24 MB: preads in parallel pieces
        shardkit.save(sys.argv[1] + "/raw", {"w": big}, durable=False)
        shardkit.save(sys.argv[1] + "/z", {"w": big}, durable=False, compression="zstd",
                      chunk_size="1MiB")
        def at_exit():
            with shardkit.open(sys.argv[1] + "/raw", mmap=False) as reader:
                got = reader["w"]
                reader.verify()
            target = {"w": np.zeros_like(big)}
            shardkit.restore_into(sys.argv[1] + "/z", target, verify=True)
            print("same", np.array_equal(got, big), np.array_equal(target["w"], big))
        atexit.register(at_exit)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "same True True", proc.stderr


def test_unreported_error_printed_at_exit(tmp_path):
    proc = run_script(tmp_path, """
        import sys
        import numpy as np
        import shardkit.io.flow as save_flow
        from shardkit.checkpoint import Checkpoint
        from shardkit.io.options import CheckpointOptions
        def broken(*a, **k):
            raise OSError(28, "No space left on device")
        save_flow.write_shards = broken
        Checkpoint(s={"x": np.ones(1)}).save(sys.argv[1] + "/c",
                                             CheckpointOptions(enable_async=True))
    """)
    assert "shardkit: the asynchronous save of" in proc.stderr
    assert "No space left on device" in proc.stderr
    assert not (tmp_path / "c-1").exists()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
# JAX, once imported by another test, warns at every fork that it is multithreaded; this test
# forks on purpose and the child touches no JAX state.
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
def test_forked_child_does_not_wait_for_the_parents_write(tmp_path, gate):
    import warnings

    from shardkit.io.snapshot import _wait_at_exit

    ckpt = Checkpoint(s={"x": np.ones(2)})
    h = ckpt.save(tmp_path / "c", ASYNC)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # the child: both calls must return at once although the write is pending
        code = 1
        try:
            ckpt.sync()
            _wait_at_exit()
            code = 0
        finally:
            os._exit(code)
    import time

    deadline = time.monotonic() + 300  # a hang, not a slow machine, runs out of it
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung waiting for its parent's write")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert not h.done()
    gate.set()
    ckpt.sync()
    assert h.done()


def test_device_staging_path_on_cpu(monkeypatch):
    """The CUDA staging code (pinned buffer, torch copy_, one synchronize) run with CPU tensors:
    only "is it on a GPU", the pinning and the synchronisation are stubbed."""
    torch = pytest.importorskip("torch", reason="torch is an optional dependency")
    import shardkit.io.snapshot as snapshot

    pins, syncs = [], []
    real_alloc = snapshot.alloc_host_buffer
    monkeypatch.setattr(snapshot, "_is_cuda_tensor", lambda v: isinstance(v, torch.Tensor))
    monkeypatch.setattr(snapshot, "alloc_host_buffer",
                        lambda n, pin=False: pins.append(pin) or real_alloc(n))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(1))
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()  # non-contiguous
    b = torch.arange(5, dtype=torch.float32).to(torch.bfloat16)
    s = torch.tensor(7, dtype=torch.int64)
    pool = HostBufferPool()
    snap = pool.snapshot([("w", w), ("b", b), ("s", s), ("np", np.ones(2))])
    assert pins == [True, True, True, False] and syncs == [1]
    assert np.array_equal(snap["w"], w.numpy()) and snap["w"].flags.c_contiguous
    assert snap["b"].dtype == ml_dtypes.bfloat16
    assert snap["b"].astype(float).tolist() == [0, 1, 2, 3, 4]
    assert snap["s"].shape == () and int(snap["s"]) == 7
    w.add_(1)  # a copy, not a view
    assert snap["w"][0, 0] == 0
    pool.snapshot([("w", w), ("b", b), ("s", s), ("np", np.ones(2))])
    assert len(pins) == 4  # buffers reused
