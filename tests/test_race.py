"""A reader and an overwriter racing on one path: no load ever mixes two checkpoints.

A second process overwrites the checkpoint again and again (every tensor of save number n holds
n); this process reads it meanwhile in every read mode. Each read must return tensors of one save
only, or raise a ShardkitError that says the checkpoint was replaced; never a mix. The race runs
for SHARDKIT_RACE_SECONDS (default 30) in all.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections import Counter

import numpy as np
import pytest

import shardkit
from shardkit.errors import ShardkitError

SECONDS = float(os.environ.get("SHARDKIT_RACE_SECONDS", "30"))
N_TENSORS = 24

WRITER = textwrap.dedent("""
    import sys, time, warnings
    import numpy as np
    import shardkit
    # MaxShardSizePolicy stores tensors as slices: expected, not worth a line per save
    warnings.simplefilter("ignore", shardkit.SplitTensorsWarning)
    path, codec, stop_at = sys.argv[1], sys.argv[2] or None, float(sys.argv[3])
    policy = shardkit.MaxShardSizePolicy(max_shard_size=8192)
    n = 1
    while time.time() < stop_at:
        state = {f"t{i:02d}": np.full(1024 + 7 * i, n, np.int32) for i in range(N_TENSORS)}
        shardkit.save(path, state, sharding_callback=policy, overwrite=True, durable=False,
                      compression=codec)
        n += 1
        time.sleep(0.05)
    print(n - 1)
""").replace("N_TENSORS", str(N_TENSORS))


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
        shardkit.save(path, first, durable=False, compression=codec or None,
                      sharding_callback=shardkit.MaxShardSizePolicy(max_shard_size=8192))
    seconds = SECONDS / 2
    stop_at = time.time() + seconds
    writer = subprocess.Popen([sys.executable, "-c", WRITER, path, codec, str(stop_at)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outcomes: Counter[str] = Counter()
    mixed = []
    seen: set[int] = set()
    try:
        i = 0
        while time.time() < stop_at:
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
        out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    saves = int(out.strip())
    assert not mixed, f"{len(mixed)} reads mixed checkpoints, e.g. {mixed[:3]}; {outcomes}"
    assert saves > 10 and len(seen) > 5, (saves, outcomes)  # the race did take place
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
