"""Start-up times: ``import shardkit`` against ``import numpy``, ``shardkit --version`` and the
demo's first line, each a fresh interpreter, the runs alternating, medians reported.

    python bench/bench_startup.py [--runs 15] [--check]

Targets (docs/ARCHITECTURE.md): ``import shardkit`` at most 1.5 times ``import numpy``,
``shardkit --version`` under 0.5 s and the demo's first line within 0.5 s, on a quiet machine.
``--check`` exits with status 1 when one is missed. Run it from the checkout: the checkout's
``shardkit`` comes first on the path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
RATIO_TARGET = 1.5
SECONDS_TARGET = 0.5


def _run(argv: list[str]) -> float:
    """Seconds from start to exit of `argv`."""
    start = time.perf_counter()
    subprocess.run(argv, env=ENV, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def _first_line(argv: list[str]) -> float:
    """Seconds from start to the first line `argv` prints (then it is ended)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        if not proc.stdout.readline():
            raise SystemExit(f"{argv}: no output")
        return time.perf_counter() - start
    finally:
        proc.kill()
        proc.wait()


MEASURES: dict[str, Callable[[], float]] = {
    "import numpy": lambda: _run([sys.executable, "-c", "import numpy"]),
    "import shardkit": lambda: _run([sys.executable, "-c", "import shardkit"]),
    "shardkit --version": lambda: _run([sys.executable, "-m", "shardkit", "--version"]),
    "demo, first line": lambda: _first_line(
        [sys.executable, "-m", "shardkit", "demo", "--model", "llm-tiny", "--no-progress"]),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="runs of each (default 15)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {name: [] for name in MEASURES}
    for measure in MEASURES.values():  # once each first: the files are in the page cache
        measure()
    for _ in range(args.runs):
        for name, measure in MEASURES.items():
            times[name].append(measure())
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:<20} median {median[name] * 1e3:7.1f} ms  "
              f"(min {min(t) * 1e3:.1f}, max {max(t) * 1e3:.1f}, {len(t)} runs)")
    ratio = median["import shardkit"] / median["import numpy"]
    print(f"import shardkit / import numpy: {ratio:.2f} (target <= {RATIO_TARGET})")
    missed = [f"import shardkit is {ratio:.2f}x import numpy"] if ratio > RATIO_TARGET else []
    for name in ("shardkit --version", "demo, first line"):
        if median[name] > SECONDS_TARGET:
            missed.append(f"{name} takes {median[name]:.2f} s")
    try:
        print(f"load average: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    except OSError:
        pass
    if args.check and missed:
        print("missed: " + "; ".join(missed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
