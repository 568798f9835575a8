"""TensorFlow's TensorBundle format: shardkit against TensorFlow, on the same files.

    python bench/bench_tensorbundle.py [--workload llm|many-small|all] [--quick] [--rounds N]
                                       [--check]

Per workload (bench/_workloads.py, flattened to checkpoint keys), in one process:

- read (the one definition of this comparison; bench/bench_tensorflow.py does not repeat it):
  a checkpoint written once by ``tf.train.Checkpoint(**variables).write`` is read by
  TensorFlow as ``tf.train.load_checkpoint(prefix)`` + one ``get_tensor(key)`` per key, the
  key list taken outside the timing (``tf.train.list_variables``, once: TensorFlow is not
  timed listing its keys), and by shardkit as ``shardkit.load(prefix)``, which returns every
  tensor (memory-mapped views, the default; and ``mmap=False``, which reads every byte);
- write: the same arrays written by ``tf.train.Checkpoint.write`` (from the variables) and by
  ``shardkit.save(..., format="tensorflow", durable=False)`` (TensorFlow does not fsync either).

The reads are measured first, then the writes: within each, rounds alternate between the
contenders in an order rotated each round, and the dirty pages of one step are synced
(untimed) before the next starts; medians are printed with ratios. Reads and writes are not
interleaved because a write's after-effects land on the step that follows it: on this kind of
virtual machine the host goes on writing after ``os.sync`` returns, and the memory a write
freed is faulted in again by the next step (measured: ``shardkit.load`` of the many-small
checkpoint took 83-93 ms after a read and 111-140 ms right after ``Checkpoint.write``, with
3,000-10,000 page faults instead of none).
``--check`` exits 1 unless shardkit.load reads the many-small checkpoint at least 3x as fast as
load_checkpoint + get_tensor (the issue's target).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np
from _workloads import QUICK, WORKLOADS, nbytes

READ_TARGET = 3.0  # shardkit.load vs load_checkpoint + get_tensor, many-small


def _flat(state: dict[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _median_time(fn: Any, rounds: list[float]) -> None:
    os.sync()  # untimed, as bench_tensorflow.py: no step pays for the last one's writeback
    t = time.perf_counter()
    fn()
    rounds.append(time.perf_counter() - t)


def run(name: str, quick: bool, rounds: int, work: Path) -> dict[str, float]:
    import tensorflow as tf

    import shardkit

    make, kwargs = (QUICK if quick else WORKLOADS)[name]
    arrays = _flat(make(**kwargs))
    size = nbytes(arrays)
    variables = {k: tf.Variable(v) for k, v in arrays.items()}
    ck = tf.train.Checkpoint(**variables)
    tf_prefix = ck.write(str(work / "tf" / "ck"))
    keys = [k for k, _ in tf.train.list_variables(tf_prefix)]
    print(f"\n{name}: {len(arrays)} tensors, {size / 1e9:.3f} GB")

    def tf_read() -> None:
        reader = tf.train.load_checkpoint(tf_prefix)
        for k in keys:
            reader.get_tensor(k)

    def sk_read() -> None:
        shardkit.load(tf_prefix)

    def sk_read_copy() -> None:
        shardkit.load(tf_prefix, mmap=False)

    def tf_write() -> None:
        shutil.rmtree(work / "tfw", ignore_errors=True)
        ck.write(str(work / "tfw" / "ck"))

    def sk_write() -> None:
        shutil.rmtree(work / "skw", ignore_errors=True)
        shardkit.save(work / "skw" / "ck", arrays, format="tensorflow",
                      options=shardkit.CheckpointOptions(durable=False))

    fns = {"tf_read": tf_read, "sk_read": sk_read, "sk_read_copy": sk_read_copy,
           "tf_write": tf_write, "sk_write": sk_write}
    times: dict[str, list[float]] = {n: [] for n in fns}
    for fn in fns.values():  # warm up: imports, first-touch of memory, page cache
        fn()
    for phase in (["tf_read", "sk_read", "sk_read_copy"], ["tf_write", "sk_write"]):
        for r in range(rounds):  # rotated: no step always comes first after another
            for n in phase[r % len(phase):] + phase[: r % len(phase)]:
                _median_time(fns[n], times[n])
    med = {n: statistics.median(v) for n, v in times.items()}
    got = shardkit.load(tf_prefix)
    reader = tf.train.load_checkpoint(tf_prefix)
    for k in keys[:: max(1, len(keys) // 50)]:  # the same values, spot-checked
        assert np.array_equal(got[k], reader.get_tensor(k)), k

    def line(label: str, a: str, b: str) -> None:
        print(f"  {label:<44} {med[a] * 1e3:9.1f} ms vs {med[b] * 1e3:9.1f} ms   "
              f"{med[b] / med[a]:6.2f}x  ({size / med[a] / 1e9:.2f} vs "
              f"{size / med[b] / 1e9:.2f} GB/s)")

    print(f"  medians of {rounds} alternating rounds; shardkit first, TensorFlow second")
    line("read: shardkit.load (mmap) vs get_tensor/key", "sk_read", "tf_read")
    line("read: shardkit.load(mmap=False) vs get_tensor", "sk_read_copy", "tf_read")
    line("write: save(format='tensorflow') vs write", "sk_write", "tf_write")
    return {"read": med["tf_read"] / med["sk_read"],
            "read_copy": med["tf_read"] / med["sk_read_copy"],
            "write": med["tf_write"] / med["sk_write"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("llm", "many-small", "all"), default="all")
    p.add_argument("--quick", action="store_true", help="smaller states (bench/_workloads.py)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = p.parse_args(argv)
    names = ["llm", "many-small"] if args.workload == "all" else [args.workload]
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-tb-", dir=os.environ.get("TMPDIR")) as d:
        for name in names:
            results[name] = run(name, args.quick, args.rounds, Path(d) / name)
    if args.check and "many-small" in results:
        ratio = results["many-small"]["read"]
        if ratio < READ_TARGET:
            print(f"MISS: many-small read {ratio:.2f}x < {READ_TARGET}x")
            return 1
        print(f"OK: many-small read {ratio:.2f}x >= {READ_TARGET}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
