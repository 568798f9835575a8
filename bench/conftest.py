"""Shared workloads for the planning benchmarks: many tensors of mixed sizes, without the memory.

Every tensor is a zero-stride view of one float32 zero, so its `nbytes` is that of its shape while
it occupies no memory; 1024 distinct shapes are shared by all tensors of a workload.
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

import numpy as np
import pytest

from shardkit.sharding.tensors import ShardableTensor, shardable_tensors

MiB = 2**20
_BASE = np.zeros(1, dtype=np.float32)


def _shapes(rng: np.random.Generator, count: int) -> list[tuple[int, int]]:
    """Log-uniform byte sizes: 99% from 16 B to 4 MiB, 1% from 4 MiB to 1 GiB; 2-D shapes."""
    large = rng.random(count) < 0.01
    low = np.where(large, np.log(4 * MiB), np.log(16))
    high = np.where(large, np.log(1024 * MiB), np.log(4 * MiB))
    elems = np.maximum(1, np.exp(rng.uniform(low, high)) // 4).astype(np.int64)
    cols = np.minimum(elems, 2 ** rng.integers(0, 13, size=count))
    rows = np.maximum(1, elems // cols)
    return list(zip(rows.tolist(), cols.tolist()))


@lru_cache(maxsize=4)
def mixed_tensors(n: int, seed: int = 0) -> list[ShardableTensor]:
    """`n` ShardableTensors of mixed sizes (built once per size and reused)."""
    rng = np.random.default_rng(seed)
    protos = [
        np.lib.stride_tricks.as_strided(_BASE, shape=shape, strides=(0, 0), writeable=False)
        for shape in _shapes(rng, 1024)
    ]
    pick = rng.integers(0, len(protos), size=n).tolist()
    return shardable_tensors({f"layer{i}/w": protos[p] for i, p in enumerate(pick)})


RESULTS: dict[tuple[str, int], dict[str, tuple[float, float]]] = {}


def _record(benchmark, name: str, n: int, impl: str) -> None:
    """Keep (min, median) of a finished benchmark for the speed-up table."""
    stats = getattr(benchmark, "stats", None)
    if stats is not None:
        RESULTS.setdefault((name, n), {})[impl] = (stats.stats.min, stats.stats.median)


@pytest.fixture(scope="session")
def planning():
    """What the planning benchmarks share: workloads, and the timings recorded so far."""
    return SimpleNamespace(tensors=mixed_tensors, record=_record, results=RESULTS)


def pytest_terminal_summary(terminalreporter) -> None:
    if not RESULTS:
        return
    tr = terminalreporter
    tr.section("planning: seconds (min / median), native vs pure-Python twin")
    tr.write_line(
        f"{'benchmark':<28}{'n':>9}{'native min':>12}{'median':>9}{'python min':>12}"
        f"{'median':>9}{'speed-up (min)':>16}"
    )
    for (name, n), r in sorted(RESULTS.items()):
        native, python = r.get("native"), r.get("python")
        cells = [f"{name:<28}{n:>9}"]
        for pair in (native, python):
            cells.append(f"{pair[0]:>12.4f}{pair[1]:>9.4f}" if pair else f"{'-':>12}{'-':>9}")
        if native and python:
            cells.append(f"{python[0] / native[0]:>15.1f}x")
        tr.write_line("".join(cells))
