"""Keyed loads against a full load of the same checkpoint, in one run.

    python bench/bench_keyed_load.py [--quick] [--rounds N] [--mmap | --no-mmap] [--check]

The many-small workload (bench/_workloads.py: 50,000 float32 tensors, 200 MB; ``--quick``:
10,000) is saved once; then ``shardkit.load(path)``, ``load(path, keys=<every key>)`` (in the
saved order) and ``load(path, keys=<every tenth key>)`` alternate, in a new random order every
round after one untimed warm-up each (bench/compare.py's `alternate`), on a warm page cache.
Ratios are medians of the per-round ratios. ``--check`` exits 1 unless the keyed load of every
key takes at most 1.1x the full load and that of a tenth at most 0.2x.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _workloads
from compare import alternate, ratio

import shardkit

ALL_TARGET, TENTH_TARGET = 1.1, 0.2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="10,000 tensors instead of 50,000")
    p.add_argument("--rounds", type=int, default=9, help="timed rounds (default: 9)")
    p.add_argument("--mmap", action=argparse.BooleanOptionalAction, default=True,
                   help="memory-mapped views (default) or owned arrays (--no-mmap)")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--check", action="store_true",
                   help=f"exit 1 unless all keys <= {ALL_TARGET}x and a tenth <= "
                        f"{TENTH_TARGET}x the full load")
    args = p.parse_args(argv)
    make, kwargs = (_workloads.QUICK if args.quick else _workloads.WORKLOADS)["many-small"]
    root = Path(tempfile.mkdtemp(prefix="bench-keyed-", dir=args.dir))
    try:
        path = root / "ckpt"
        shardkit.save(path, make(**kwargs), options=shardkit.CheckpointOptions(durable=False))
        with shardkit.open(path) as reader:
            keys = reader.keys()
        tenth = keys[::10]
        mmap = args.mmap
        methods = {
            "load()": (lambda: shardkit.load(path, mmap=mmap), lambda: None),
            "load(keys=all)": (lambda: shardkit.load(path, keys, mmap=mmap), lambda: None),
            "load(keys=tenth)": (lambda: shardkit.load(path, tenth, mmap=mmap), lambda: None),
        }
        times = alternate(methods, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"many-small: {len(keys)} tensors, mmap={mmap}, median of {args.rounds} rounds")
    for name, runs in times.items():
        print(f"  {name:<18} {statistics.median(runs) * 1e3:8.1f} ms")
    every = ratio(times, "load(keys=all)", "load()")
    some = ratio(times, "load(keys=tenth)", "load()")
    ok = every <= ALL_TARGET and some <= TENTH_TARGET
    print(f"load(keys=all) / load():   {every:.2f}x (target <= {ALL_TARGET}x)")
    print(f"load(keys=tenth) / load(): {some:.2f}x (target <= {TENTH_TARGET}x)")
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
