"""A save killed with SIGKILL at a random moment never leaves a partial checkpoint behind.

A child process overwrites an earlier checkpoint and is killed at a random delay spread over the
measured duration of its save. Afterwards the path must load, with checksums verified, as exactly
the earlier checkpoint or exactly the new one; and the next save must clean up the leftovers.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from shardkit import api, commit
from shardkit.reader import load

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL (POSIX)")

CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from shardkit import api, commit
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
    api.save(path, old, durable=False)
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
        if not exchange:
            commit.recover(path)  # the fallback's documented recovery step
        loaded = load(path, verify=True)
        if _equal(loaded, old):
            outcomes.append("old")
        elif _equal(loaded, new):
            outcomes.append("new")
            api.save(path, old, overwrite=True, durable=False)  # start the next round from old
        else:
            pytest.fail("the checkpoint after a killed save is neither the old nor the new one")
        del loaded
        if any(".shardkit-" in name for name in os.listdir(tmp_path)):
            outcomes[-1] += "+leftovers"
        # The next save cleans whatever the killed one left behind.
        api.save(tmp_path / "other", {"x": np.zeros(1)}, overwrite=True, durable=False)
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
