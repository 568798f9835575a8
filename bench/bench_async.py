"""How long a training loop is blocked by a checkpoint save: async vs sync vs one np.copyto.

    python bench/bench_async.py --size-gb 1 --rounds 5

For a state of about 1 GB (float32 tensors of 64 MiB, like a model's weights) it measures, as the
median of alternating rounds in one process:

- ``copyto``: one ``np.copyto`` of every tensor into warm, preallocated buffers (the floor of any
  snapshot: the bytes have to be copied once);
- ``async``: ``CheckpointManager.save`` with ``enable_async=True``: the time until it returns (the
  snapshot); the write that follows runs in the background and is waited for, untimed, before
  the next round;
- ``sync``: ``CheckpointManager.save`` without async (the whole durable write).

Then the peak resident memory each needs above the state itself, each in a fresh subprocess
(``ru_maxrss``). Target: async blocks at most 1.5x one copyto; the exit status is 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardkit.io.options import CheckpointOptions  # noqa: E402
from shardkit.training.checkpoint import Checkpoint, CheckpointManager  # noqa: E402

TENSOR_BYTES = 64 * 1024 * 1024
TARGET_RATIO = 1.5


def tensor_count(size_gb: float) -> int:
    return max(1, round(size_gb * 1e9 / TENSOR_BYTES))


def make_state(size_gb: float) -> dict[str, np.ndarray]:
    n = TENSOR_BYTES // 4
    return {f"layer{i:02d}": np.full(n, i, np.float32) for i in range(tensor_count(size_gb))}


class Runner:
    """The three ways of blocking the loop, each warmed up once."""

    def __init__(self, state: dict[str, np.ndarray], directory: str, durable: bool) -> None:
        self.state = state
        self.dest = {k: np.empty_like(v) for k, v in state.items()}
        self.manager = CheckpointManager(Checkpoint(model=state), directory, max_to_keep=1)
        self.async_opts = CheckpointOptions(enable_async=True, durable=durable)
        self.sync_opts = CheckpointOptions(durable=durable)

    def copyto(self) -> float:
        start = time.perf_counter()
        for key, value in self.state.items():
            np.copyto(self.dest[key], value)
        return time.perf_counter() - start

    def async_save(self) -> float:
        self.manager.sync()  # the previous background write is not the loop's cost
        start = time.perf_counter()
        self.manager.save(options=self.async_opts)
        blocked = time.perf_counter() - start
        self.manager.sync()
        return blocked

    def sync_save(self) -> float:
        self.manager.sync()
        start = time.perf_counter()
        self.manager.save(options=self.sync_opts)
        return time.perf_counter() - start

    def touch(self) -> None:
        """Change the weights a little between rounds, as training would."""
        for value in self.state.values():
            value[:1] += 1


def measure(size_gb: float, rounds: int, directory: str, durable: bool) -> dict[str, list[float]]:
    runner = Runner(make_state(size_gb), directory, durable)
    modes = {"copyto": runner.copyto, "async": runner.async_save, "sync": runner.sync_save}
    for fn in modes.values():  # warm-up: first touch of buffers, page cache, imports
        fn()
    times: dict[str, list[float]] = {name: [] for name in modes}
    order = list(modes)
    for r in range(rounds):
        for name in order[r % 3 :] + order[: r % 3]:  # alternate which mode goes first
            runner.touch()
            times[name].append(modes[name]())
    runner.manager.sync()
    return times


def peak_rss() -> int:
    """Peak resident bytes of this process image. VmHWM, not ru_maxrss: on Linux ru_maxrss
    keeps the forking parent's peak across exec."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_child(mode: str, size_gb: float, directory: str, durable: bool) -> None:
    """Run one mode twice in this (fresh) process; print its peak RSS above the state."""
    state = make_state(size_gb)
    for a in state.values():
        a[:] = 1  # resident now
    base = peak_rss()
    runner = Runner(state, directory, durable)
    fn = {"copyto": runner.copyto, "async": runner.async_save, "sync": runner.sync_save}[mode]
    fn()
    fn()
    runner.manager.sync()
    peak = peak_rss()
    print(json.dumps({"mode": mode, "extra_bytes": peak - base}))


def peak_memory(size_gb: float, directory: str, durable: bool) -> dict[str, int]:
    out = {}
    for mode in ("copyto", "async", "sync"):
        sub = os.path.join(directory, f"peak-{mode}")
        os.makedirs(sub)
        proc = subprocess.run(
            [sys.executable, __file__, "--peak-child", mode, "--size-gb", str(size_gb),
             "--dir", sub] + ([] if durable else ["--no-durable"]),
            capture_output=True, text=True, check=True,
        )
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])["extra_bytes"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--no-durable", action="store_true", help="skip fsync")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    parser.add_argument("--peak-child", choices=("copyto", "async", "sync"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    durable = not args.no_durable

    with tempfile.TemporaryDirectory(prefix="shardkit-bench-", dir=args.dir) as tmp:
        if args.peak_child:
            peak_child(args.peak_child, args.size_gb, args.dir or tmp, durable)
            return 0
        times = measure(args.size_gb, args.rounds, os.path.join(tmp, "timing"), durable)
        peaks = {} if args.no_memory else peak_memory(args.size_gb, tmp, durable)

    count = tensor_count(args.size_gb)
    total = count * TENSOR_BYTES
    print(f"state: {total / 2**30:.2f} GiB in {count} float32 tensors; "
          f"durable={durable}; median of {args.rounds} alternating rounds")
    print(f"{'mode':<8}{'blocked s':>11}{'GB/s':>8}{'peak extra MiB':>16}   rounds (s)")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        peak = f"{peaks[name] / 2**20:.0f}" if name in peaks else "-"
        print(f"{name:<8}{med[name]:>11.3f}{total / med[name] / 1e9:>8.2f}{peak:>16}   "
              + " ".join(f"{t:.3f}" for t in ts))
    ratio = med["async"] / med["copyto"]
    ok = ratio <= TARGET_RATIO
    print(f"async / copyto = {ratio:.2f} (target <= {TARGET_RATIO}): {'PASS' if ok else 'FAIL'}")
    print(f"sync / async = {med['sync'] / med['async']:.1f}x longer blocked without async")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
