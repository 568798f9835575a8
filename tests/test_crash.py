"""A save killed with SIGKILL never leaves a partial checkpoint behind.

A child process overwrites an earlier checkpoint and is killed at a random delay spread over the
measured duration of its save; and, with tests/killsteps.py, just before each step of its
commit in turn (every rename, link, unlink, fsync, object write), in every format and storage.
Afterwards the path must load, with checksums verified, as exactly the earlier checkpoint or
exactly the new one; and the next save must clean up the leftovers without losing it.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import killsteps
import numpy as np
import pytest
from s3server import S3Server

import shardkit
from shardkit.io import save as api
from shardkit.io.options import CheckpointOptions
from shardkit.io.reader import load

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL (POSIX)")

CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from shardkit.io import save as api
    from shardkit.storage import commit
    path, seed, exchange = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    if not exchange:
        commit._renameat2_fn = None  # exercise the rename-aside fallback
    rng = np.random.default_rng(seed)
    state = {f"layer{i}": {"w": rng.standard_normal((256, 256), dtype=np.float32),
                           "b": rng.standard_normal(256, dtype=np.float32)} for i in range(12)}
    state["small"] = {str(i): np.full(i % 7, i, dtype=np.int16) for i in range(400)}
    print("ready", flush=True)
    t = time.perf_counter()
    api.save(path, state, overwrite=True, threads=2)
    print(time.perf_counter() - t, flush=True)
    """
)


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    flat = {}
    for i in range(12):
        flat[f"layer{i}/w"] = rng.standard_normal((256, 256), dtype=np.float32)
        flat[f"layer{i}/b"] = rng.standard_normal(256, dtype=np.float32)
    for i in range(400):
        flat[f"small/{i}"] = np.full(i % 7, i, dtype=np.int16)
    return flat


def _spawn(path: Path, seed: int, exchange: bool) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(seed), "1" if exchange else "0"],
        stdout=subprocess.PIPE, text=True, cwd=os.getcwd(),
    )


def _equal(loaded: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> bool:
    return list(loaded) == list(expected) and all(
        loaded[k].dtype == v.dtype and loaded[k].shape == v.shape
        and loaded[k].tobytes() == v.tobytes() for k, v in expected.items()
    )


def _kill_rounds(tmp_path: Path, rounds: int, exchange: bool,
                 until_leftovers: bool = False) -> list[str]:
    """`rounds` saves over the checkpoint, each SIGKILLed at a random point of its length (as
    measured, and shortened by every save that ended before its kill); with `until_leftovers`,
    more rounds (5 times as many at most) until a kill landed while the save was writing."""
    path = tmp_path / "ckpt"
    old_seed, new_seed = 1, 2
    old, new = _state(old_seed), _state(new_seed)
    api.save(path, old, options=CheckpointOptions(durable=False))
    # How long does the child's save take? Measure one uninterrupted run.
    child = _spawn(tmp_path / "probe", new_seed, exchange)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0, out
    duration = float(out.split()[-1])
    outcomes = []
    rng = random.Random(20240611 + exchange)
    while len(outcomes) < rounds or (
            until_leftovers and not any(o.endswith("+leftovers") for o in outcomes)
            and len(outcomes) < 5 * rounds):
        child = _spawn(path, new_seed, exchange)
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0, 1.3 * duration))
            child.send_signal(signal.SIGKILL)
        finally:
            out, _ = child.communicate(timeout=120)
        if out.strip():  # the save ended before the kill: aim within its length next time
            duration = min(duration, float(out.split()[-1]))
        loaded = load(path, verify=True)  # after the fallback's first rename: recovered by it
        if _equal(loaded, old):
            outcomes.append("old")
        elif _equal(loaded, new):
            outcomes.append("new")
            api.save(path, old, overwrite=True,
                     options=CheckpointOptions(durable=False))  # start the next round from old
        else:
            pytest.fail("the checkpoint after a killed save is neither the old nor the new one")
        del loaded
        if any(".shardkit-" in name for name in os.listdir(tmp_path)):
            outcomes[-1] += "+leftovers"
        # The next save cleans whatever the killed one left behind.
        api.save(tmp_path / "other", {"x": np.zeros(1)}, overwrite=True,
                 options=CheckpointOptions(durable=False))
        assert sorted(os.listdir(tmp_path)) == ["ckpt", "other", "probe"], os.listdir(tmp_path)
    return outcomes


def test_sigkill_during_overwrite_by_exchange(tmp_path):
    outcomes = _kill_rounds(tmp_path, rounds=20, exchange=True, until_leftovers=True)
    assert len(outcomes) >= 20
    # The kills are spread over the save: some must land while it is writing.
    assert any(o.endswith("+leftovers") for o in outcomes), outcomes


def test_sigkill_during_overwrite_by_fallback(tmp_path):
    outcomes = _kill_rounds(tmp_path, rounds=6, exchange=False)
    assert len(outcomes) == 6


# --- killed just before each step of the commit ------------------------------------------------

HELPER = Path(__file__).with_name("killsteps.py")
OLD, NEW = 1, 2
REPLY_TIMEOUT = 300.0  # seconds for one save in the helper (a loaded machine)


class _Helper:
    """tests/killsteps.py in a process of its own: `save` forks one save there."""

    def __init__(self, kind: str, path: str, options: dict | None = None) -> None:
        import shardkit as package

        env = {**os.environ, "PYTHONPATH": str(Path(package.__file__).parents[1])}
        self.proc = subprocess.Popen(
            [sys.executable, str(HELPER), kind, path, json.dumps(options or {})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def save(self, seed: int, shards: int, kill_at: int = 0) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{seed} {shards} {kill_at}\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT)
        assert ready, "the helper did not answer"
        reply = self.proc.stdout.readline().strip()
        assert reply == "killed" or reply.startswith("done"), reply
        return reply

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            assert self.proc.stdout is not None
            self.proc.stdout.close()


def _outcome(path: object) -> str:
    """"old" or "new": what the path holds, loaded with every checksum verified."""
    loaded = load(path, verify=True)
    for name, seed in (("old", OLD), ("new", NEW)):
        if killsteps.same(loaded, killsteps.state(seed)):
            return name
    pytest.fail(f"{path} holds neither the old nor the new checkpoint")


def _kill_every_step(helper: _Helper, old_shards: int, new_shards: int, path: object,
                     after_kill: object, after_reset: object) -> list[str]:
    assert helper.save(OLD, old_shards).startswith("done")
    count = int(helper.save(NEW, new_shards).split()[1])
    assert count > 3
    assert helper.save(OLD, old_shards).startswith("done")
    outcomes = []
    for k in range(1, count + 1):
        assert helper.save(NEW, new_shards, kill_at=k) == "killed"
        got = _outcome(path)
        after_kill(got)  # the next save there cleans up; the checkpoint is still the same
        assert _outcome(path) == got, f"killed before step {k}: lost by the next save"
        assert helper.save(OLD, old_shards).startswith("done")
        after_reset()
        outcomes.append(got)
    # before the first step nothing was published; after the commit the new one is there
    assert outcomes[0] == "old" and outcomes[-1] == "new", outcomes
    return outcomes


@pytest.mark.parametrize(("kind", "old_shards", "new_shards"), [
    ("raw", 2, 2), ("zstd", 2, 3), ("fallback", 2, 2),
    ("tensorflow", 2, 2),  # the same data-file names: the new files come in under others first
    ("tensorflow", 1, 3), ("tensorflow", 3, 1),
])
def test_sigkill_before_every_step_of_a_local_overwrite(tmp_path, kind, old_shards, new_shards):
    parent = tmp_path / "dir"
    parent.mkdir()
    path = parent / "ck"
    tf = kind == "tensorflow"
    other = parent / "other"

    def after_kill(_got: str) -> None:
        shardkit.save(other, {"x": np.zeros(1)}, overwrite=True,
                      options=shardkit.CheckpointOptions(durable=False),
                      **({"format": "tensorflow"} if tf else {}))
        assert not [n for n in os.listdir(parent) if ".shardkit-" in n], os.listdir(parent)

    def after_reset() -> None:
        if tf:
            expected = ["ck.index", *(f"ck.data-{i:05d}-of-{old_shards:05d}"
                                      for i in range(old_shards))]
            assert sorted(n for n in os.listdir(parent) if n.startswith("ck.")) == sorted(expected)
        else:
            assert sorted(os.listdir(parent)) == ["ck", "other"]

    helper = _Helper(kind, str(path))
    try:
        _kill_every_step(helper, old_shards, new_shards, path, after_kill, after_reset)
    finally:
        helper.close()


@pytest.fixture(scope="module")
def s3():
    server = S3Server().start()
    shardkit.set_storage_options("s3://", **server.options)
    try:
        yield server
    finally:
        shardkit.set_storage_options("s3://")
        server.stop()


def test_sigkill_before_every_step_of_an_s3_overwrite(s3):
    from shardkit.storage import open_storage
    from shardkit.storage.housekeeping import gc
    from shardkit.storage.layout import SHARDS_PREFIX

    url = f"s3://{s3.bucket()}/ck"
    store = open_storage(url)

    def generations() -> set[str]:
        return {s.name.split("/")[0] for s in store.list(SHARDS_PREFIX)}

    def after_kill(_got: str) -> None:
        # what the killed save left; `_kill_every_step` checks the rest
        gc(open_storage(url), older_than=0)
        assert len(generations()) == 1, generations()

    def after_reset() -> None:
        names = {s.name for s in store.list("")}
        assert "model.safetensors.index.json" in names and len(generations()) == 1, names

    helper = _Helper("s3", url, s3.options)
    try:
        _kill_every_step(helper, 2, 2, url, after_kill, after_reset)
    finally:
        helper.close()


def test_sigkill_before_every_step_of_a_tensorflow_format_manager_save(tf, keras, tmp_path):
    """A shardkit `CheckpointManager(..., format="tensorflow")` in a process of its own (real
    TensorFlow) SIGKILLed just before each step of one save in turn (data files, the index,
    TensorFlow's state file, retention's deletions): afterwards TensorFlow's
    ``latest_checkpoint`` names a complete checkpoint it restores bit-exact (weights, Adam's
    slots, iterations, save counter), TensorFlow's manager lists only complete ones, and the
    shardkit manager reopened on the directory resumes saving, leaving nothing behind."""
    from tfhelpers import bits

    directory = str(tmp_path / "run")
    model, opt = killsteps.tf_model(keras)
    variables = [*model.variables, *opt.variables]

    def number(path: str) -> int:
        return int(path.rsplit("-", 1)[1])

    def check() -> int:
        latest = tf.train.latest_checkpoint(directory)
        assert latest is not None
        root = tf.train.Checkpoint(model=model, optimizer=opt)
        listed = tf.train.CheckpointManager(root, directory, max_to_keep=2).checkpoints
        assert listed and listed[-1] == latest and len(listed) <= 2, listed
        for path in listed:  # each complete: restored by TensorFlow, every value bit-exact
            restored = tf.train.Checkpoint(model=model, optimizer=opt)
            restored.restore(path).assert_consumed()
            want = killsteps.tf_values(variables, number(path))
            assert [bits(v.numpy()) for v in variables] == [bits(a) for a in want], path
            assert int(restored.save_counter.numpy()) == number(path)
        return number(latest)

    def clean(latest: int) -> None:
        expected = ["checkpoint"] + [f"ckpt-{i}{suffix}" for i in (latest - 1, latest)
                                     for suffix in (".index", ".data-00000-of-00002",
                                                    ".data-00001-of-00002")]
        assert sorted(os.listdir(directory)) == sorted(expected)

    helper = _Helper("tf-manager", directory)
    try:
        assert helper.save(2, 2).startswith("done")  # ckpt-1, ckpt-2
        assert check() == 2
        reply = helper.save(1, 2).split()  # ckpt-3: what one save with retention steps on
        count, latest = int(reply[1]), 3
        assert check() == latest and count > 5, reply
        clean(latest)
        outcomes = []
        for k in range(1, count + 1):
            assert helper.save(1, 2, kill_at=k) == "killed"
            got = check()
            assert got in (latest, latest + 1), (k, got)
            outcomes.append(got - latest)
            assert helper.save(1, 2).startswith("done")  # reopened: resumes from `got`
            latest = got + 1
            assert check() == latest, k
            clean(latest)
        assert outcomes[0] == 0 and outcomes[-1] == 1, outcomes
    finally:
        helper.close()
