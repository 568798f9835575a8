"""A reader and an overwriter racing on one path: no load ever mixes two checkpoints.

A second process overwrites the checkpoint again and again (every tensor of save number n holds
n); this process reads it meanwhile in every read mode. Each read must return tensors of one save
only, or raise a ShardkitError that says the checkpoint was replaced; never a mix. Each race
lasts at least SHARDKIT_RACE_SECONDS / 2 (default 30 in all) and until the writer has made
MIN_SAVES saves and every read mode has read: a loaded machine makes it longer, never thinner;
the writer not starting or stalling fails after a generous bound.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.errors import ShardkitError

SECONDS = float(os.environ.get("SHARDKIT_RACE_SECONDS", "30"))
N_TENSORS = 24

MIN_SAVES = 10
LIMIT = 900.0  # seconds for the writer to start, or to make its next save: only a hang is slower

WRITER = textwrap.dedent("""
    import os, sys, time, warnings
    import numpy as np
    import shardkit
    # MaxShardSizePolicy stores tensors as slices: expected, not worth a line per save
    warnings.simplefilter("ignore", shardkit.SplitTensorsWarning)
    path, codec, stop = sys.argv[1], sys.argv[2] or None, sys.argv[3]
    policy = shardkit.MaxShardSizePolicy(max_shard_size=8192)
    n = 1
    while not os.path.exists(stop):
        state = {f"t{i:02d}": np.full(1024 + 7 * i, n, np.int32) for i in range(N_TENSORS)}
        shardkit.save(path, state, sharding_callback=policy, overwrite=True, durable=False,
                      compression=codec)
        print(n, flush=True)  # one line per save: the test follows the writer's progress
        n += 1
        time.sleep(0.05)
""").replace("N_TENSORS", str(N_TENSORS))


class Writer:
    """The overwriting process, the number of saves it has made so far, and its stop."""

    def __init__(self, path: str, codec: str, stop: str) -> None:
        self.stop_file = stop
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER, path, codec, stop],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.saves = 0
        self.progressed = threading.Event()
        self.last = time.monotonic()
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.saves = int(line)
            self.last = time.monotonic()
            self.progressed.set()

    def wait_started(self) -> None:
        """Until the first save is done (fails if the writer exits or takes over LIMIT)."""
        deadline = time.monotonic() + LIMIT
        while not self.progressed.wait(1.0):
            assert self.proc.poll() is None, f"the writer exited: {self.proc.stderr.read()}"
            assert time.monotonic() < deadline, f"the writer made no save in {LIMIT:.0f} s"

    def check_alive(self) -> None:
        """The writer is running and made a save within LIMIT."""
        assert self.proc.poll() is None, f"the writer exited: {self.proc.stderr.read()}"
        assert time.monotonic() - self.last < LIMIT, (
            f"the writer made no save in {LIMIT:.0f} s (after save {self.saves})")

    def finish(self) -> tuple[int, str]:
        """Stop the writer; its exit code and stderr."""
        Path(self.stop_file).touch()
        try:
            _, err = self.proc.communicate(timeout=LIMIT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        self.thread.join(timeout=60)
        return self.proc.returncode, err


def _rounds(arrays) -> set[int]:
    found = set()
    for a in arrays:
        values = np.unique(np.asarray(a))
        found.update(int(v) for v in values)
    return found


def _read(path: str, mode: str) -> set[int]:
    if mode == "load":
        return _rounds(shardkit.load(path).values())
    if mode == "load_pread":
        return _rounds(shardkit.load(path, mmap=False).values())
    if mode == "load_verify":
        return _rounds(shardkit.load(path, verify=True).values())
    with shardkit.open(path, mmap=mode != "reader_pread") as r:  # key by key, slices too
        parts = []
        for k in r.keys():
            parts.append(r[k])
            parts.append(r.get_slice(k, np.s_[3:900:7]))
        return _rounds(parts)


MODES = ("load", "load_pread", "load_verify", "reader", "reader_pread")


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["", "zstd"])
def test_reader_never_mixes_generations(tmp_path, codec):
    path = str(tmp_path / "ckpt")
    first = {f"t{i:02d}": np.full(1024 + 7 * i, 0, np.int32) for i in range(N_TENSORS)}
    with pytest.warns(shardkit.SplitTensorsWarning, match=f"stored {N_TENSORS} tensors"):
        shardkit.save(path, first,
                      options=shardkit.CheckpointOptions(durable=False, compression=codec or None,
                                                         experimental_sharding_callback=shardkit.MaxShardSizePolicy(max_shard_size=8192)))
    writer = Writer(path, codec, str(tmp_path / "stop"))
    outcomes: Counter[str] = Counter()
    mixed = []
    seen: set[int] = set()

    def raced_enough() -> bool:
        return (writer.saves >= MIN_SAVES and len(seen) > 5 and time.monotonic() >= until
                and all(outcomes[f"{mode}: ok"] > 0 for mode in ("load", "load_pread",
                                                                  "load_verify"))
                and all(any(k.startswith(f"{m}: ") for k in outcomes) for m in MODES))

    try:
        writer.wait_started()
        until = time.monotonic() + SECONDS / 2  # the race's least length, from the first save
        give_up = until + LIMIT  # the asserts below then say what the race lacked
        i = 0
        while not raced_enough() and time.monotonic() < give_up:
            writer.check_alive()
            mode = MODES[i % len(MODES)]
            i += 1
            try:
                rounds = _read(path, mode)
            except ShardkitError as e:
                outcomes[f"{mode}: {type(e).__name__}"] += 1
                continue
            seen |= rounds
            if len(rounds) != 1:
                mixed.append((mode, sorted(rounds)))
            outcomes[f"{mode}: ok"] += 1
    finally:
        code, err = writer.finish()
    assert code == 0, err
    saves = writer.saves
    assert not mixed, f"{len(mixed)} reads mixed checkpoints, e.g. {mixed[:3]}; {outcomes}"
    assert saves >= MIN_SAVES and len(seen) > 5, (saves, outcomes)  # the race took place
    for mode in MODES:  # every mode read while checkpoints were being replaced
        assert sum(v for k, v in outcomes.items() if k.startswith(f"{mode}: ")) > 0, outcomes
    for mode in ("load", "load_pread", "load_verify"):
        assert outcomes[f"{mode}: ok"] > 0, outcomes
    # A one-shot load starts again when the checkpoint is replaced under it: it fails only when
    # replaced during each of its attempts, which a loaded machine can make happen now and then.
    loads = sum(v for k, v in outcomes.items() if k.startswith("load"))
    failed = {k: v for k, v in outcomes.items() if k.startswith("load") and not k.endswith(": ok")}
    assert all(k.endswith(": CheckpointReplacedError") for k in failed), outcomes
    assert sum(failed.values()) <= loads // 20, outcomes
    print(f"{saves} saves, {sum(outcomes.values())} reads: {dict(outcomes)}")
