"""TensorFlow variables: tf.train.Checkpoint against shardkit, in one run, alternating.

    python bench/bench_tensorflow.py                  # both workloads, full size
    python bench/bench_tensorflow.py --quick --check  # smaller states; exit 1 on a missed target

The llm-like and many-small states of `_workloads` become tf.Variables (one per tensor, flat
names). Each round, in this order: ``tf.train.Checkpoint(**variables).write(prefix)``,
``shardkit.save(path, variables)``, ``Checkpoint.read(prefix)`` against
``shardkit.restore_into(path, variables)`` (both in place, into the same variables).
Before the rounds, each side writes once untimed (its one-time costs, reported apart), so
the medians compare warm steady-state saves. Medians over the rounds are reported, with the
time shardkit spends turning the variables into host arrays. What each side writes: TensorFlow
the variables plus its object graph (a TrackableObjectGraph proto of one node per variable,
as a string tensor) in a ``.index`` and a ``.data`` file; shardkit, given a plain dict of
variables (no objects, so no object graph), the variables in safetensors shards with their
checksums, its index and manifest. The two writes swap places every round, and the dirty
pages of one measurement are synced (untimed) before the next starts, so neither pays for the
other's writeback. Neither side fsyncs (TensorFlow's writer does not; shardkit runs with
``durable=False`` for the comparison, and ``durable=True`` is reported too).

Reading a TensorFlow checkpoint (``tf.train.load_checkpoint`` + ``get_tensor`` per key
against ``shardkit.load``) is measured by bench/bench_tensorbundle.py alone, with its one
definition.

Targets (--check): save at least 2x TensorFlow's write (llm-like) and 20x (many-small).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _workloads

import shardkit
from shardkit.sharding.tensors import flatten, host_columns

TARGETS = {("llm", "save"): 2.0, ("many-small", "save"): 20.0}


def _variables(tf, name: str, quick: bool) -> tuple[dict, int]:
    make, kwargs = (_workloads.QUICK if quick else _workloads.WORKLOADS)[name]
    flat = dict(flatten(make(**kwargs)))
    nbytes = _workloads.nbytes(flat)
    variables = {}
    for key in list(flat):
        variables[key.replace("/", "_")] = tf.Variable(flat.pop(key))  # numpy freed as we go
    return variables, nbytes


def _timed(fn: Callable[[], object]) -> float:
    os.sync()  # untimed: every measurement starts without the previous one's dirty pages
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(name: str, rounds: int, quick: bool, root: Path) -> dict[str, float]:
    import tensorflow as tf

    variables, nbytes = _variables(tf, name, quick)
    ckpt = tf.train.Checkpoint(**variables)
    times: dict[str, list[float]] = {}

    def add(what: str, seconds: float) -> None:
        times.setdefault(what, []).append(seconds)

    def one_round(prefix: str, sk: Path, tf_first: bool) -> None:
        writes = [("tf_write", lambda: ckpt.write(prefix)),
                  ("sk_save", lambda: shardkit.save(sk, variables,
                                                    options=shardkit.CheckpointOptions(
                                                        durable=False)))]
        for what, fn in writes if tf_first else writes[::-1]:
            add(what, _timed(fn))
        add("sk_flatten", _timed(lambda: host_columns(variables)))
        add("sk_save_durable", _timed(lambda: shardkit.save(sk, variables, overwrite=True)))
        add("tf_read", _timed(lambda: ckpt.read(prefix).assert_consumed()))
        add("sk_restore", _timed(lambda: shardkit.restore_into(sk, variables)))

    # Warm-up, outside the medians and reported apart: each side's first write in the process
    # pays one-time costs (TensorFlow builds its save function; shardkit's batched reads make
    # TensorFlow build a read kernel per set of variable shapes).
    first = {"tf_first_write": _timed(lambda: ckpt.write(str(root / "warm-tf" / "ckpt"))),
             "sk_first_save": _timed(lambda: shardkit.save(root / "warm-sk", variables,
                                                           options=shardkit.CheckpointOptions(
                                                               durable=False)))}
    shutil.rmtree(root / "warm-tf", ignore_errors=True)
    shutil.rmtree(root / "warm-sk", ignore_errors=True)
    for r in range(rounds):
        one_round(str(root / f"tf{r}" / "ckpt"), root / f"sk{r}", tf_first=r % 2 == 0)
        shutil.rmtree(root / f"tf{r}", ignore_errors=True)
        shutil.rmtree(root / f"sk{r}", ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = nbytes / 1e9
    print(f"\n{name}: {len(variables)} variables, {nbytes / 1e6:.0f} MB, {rounds} rounds "
          "(median seconds, GB/s)")
    print("  first write in the process (warm-up, not in the medians): TensorFlow "
          f"{first['tf_first_write']:.3f} s, shardkit {first['sk_first_save']:.3f} s")
    for k, v in med.items():
        print(f"  {k:24s} {v:8.3f} s  {gb / v:7.2f} GB/s   (rounds {min(times[k]):.3f} - "
              f"{max(times[k]):.3f} s)")
    ratios = {"save": med["tf_write"] / med["sk_save"],
              "restore": med["tf_read"] / med["sk_restore"]}
    print(f"  shardkit spends {med['sk_flatten']:.3f} s of its save turning the variables "
          "into host arrays")
    for k, v in ratios.items():
        target = TARGETS.get((name, k))
        note = "" if target is None else f"  (target >= {target:g}x: "
        note += "" if target is None else ("met)" if v >= target else "MISSED)")
        print(f"  speed-up {k:20s} {v:6.1f}x{note}")
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["llm", "many-small", "all"], default="all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the smaller states of _workloads")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    names = ["llm", "many-small"] if args.workload == "all" else [args.workload]
    root = Path(tempfile.mkdtemp(prefix="bench-tf-", dir=args.dir))
    missed = []
    try:
        for name in names:
            ratios = run(name, args.rounds, args.quick, root)
            missed += [f"{name} {k}: {v:.1f}x < {TARGETS[(name, k)]:g}x"
                       for k, v in ratios.items()
                       if (name, k) in TARGETS and v < TARGETS[(name, k)]]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if missed:
        print("\nmissed: " + "; ".join(missed))
    return 1 if (args.check and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
