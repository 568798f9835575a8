"""pytest-benchmark suites for save and restore.

    python -m pytest bench/bench_io.py --benchmark-only
    python -m pytest bench/bench_io.py --benchmark-only --benchmark-json out.json

Sizes fit a 2-core machine: an LLM-like state of about 80 MB and 5,000 small tensors. Each save
writes to a fresh path (the previous output is removed outside the timed region). The
side-by-side comparison with other libraries is bench/compare.py.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _workloads

from shardkit.io import save as api
from shardkit.io.options import CheckpointOptions
from shardkit.sharding.tensors import flatten

STATES = {
    "llm": lambda: _workloads.llm_state(hidden=256, layers=12),
    "many-small": lambda: _workloads.many_small_state(count=5_000, total_bytes=20_000_000),
}


@pytest.fixture(scope="module", params=sorted(STATES))
def state(request):
    return request.param, STATES[request.param]()


def _fresh(path: Path):
    def setup():
        shutil.rmtree(path, ignore_errors=True)

    return setup


@pytest.mark.parametrize("durable", [False, True], ids=["page-cache", "durable"])
def test_save(benchmark, state, tmp_path, durable):
    _, s = state
    path = tmp_path / "ckpt"
    nbytes = sum(a.nbytes for _, a in flatten(s))
    benchmark.extra_info["bytes"] = nbytes
    benchmark.pedantic(
        lambda: api.save(path, s, options=CheckpointOptions(durable=durable)),
        setup=_fresh(path), rounds=5, warmup_rounds=1
    )


@pytest.mark.parametrize("checksum", [True, False], ids=["xxh3", "no-checksum"])
def test_save_checksum_cost(benchmark, state, tmp_path, checksum):
    _, s = state
    path = tmp_path / "ckpt"
    benchmark.pedantic(
        lambda: api.save(path, s, options=CheckpointOptions(durable=False, checksum=checksum)),
        setup=_fresh(path), rounds=5, warmup_rounds=1,
    )


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "read"])
def test_load(benchmark, state, tmp_path, mmap):
    _, s = state
    path = tmp_path / "ckpt"
    api.save(path, s, options=CheckpointOptions(durable=False))
    out = benchmark(lambda: api.load(path, mmap=mmap))
    assert len(out) == len(flatten(s))


def test_load_and_touch_every_byte(benchmark, state, tmp_path):
    _, s = state
    path = tmp_path / "ckpt"
    api.save(path, s, options=CheckpointOptions(durable=False))

    def run() -> float:
        return float(sum(a.sum(dtype=np.float64) for a in api.load(path).values()))

    benchmark(run)


def test_restore_into(benchmark, state, tmp_path):
    _, s = state
    path = tmp_path / "ckpt"
    api.save(path, s, options=CheckpointOptions(durable=False))
    target = {k: np.empty_like(a) for k, a in flatten(s)}
    benchmark(lambda: api.restore_into(path, target))
    first = next(iter(target))
    assert np.array_equal(target[first], dict(flatten(s))[first])
