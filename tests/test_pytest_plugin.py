"""The pytest plugin's checkpoint_benchmark fixture, run inside pytester sessions."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]


def entry_points() -> list[metadata.EntryPoint] | None:
    """shardkit's pytest11 entry points, None when shardkit is not installed."""
    try:
        dist = metadata.distribution("shardkit")
    except metadata.PackageNotFoundError:
        return None
    return [ep for ep in dist.entry_points if ep.group == "pytest11"]


# Without an installed entry point, load the plugin by name (as the entry point would).
PLUGIN = ([] if entry_points() else ["-p", "shardkit.tools.pytest_plugin"])
PLUGIN += ["-p", "no:cacheprovider"]


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    """The pytester subprocess runs elsewhere: let it import this checkout."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))

TESTS = """
import numpy as np
import pytest
from shardkit.io.options import CheckpointOptions

STATE_BYTES = 4 * 256 * 256 + 8 * 1000 + 8  # two arrays and the save counter

def state():
    return {"model": {"w": np.ones((256, 256), np.float32), "b": np.arange(1000.0)}}

def test_save(checkpoint_benchmark):
    r = checkpoint_benchmark.save(state(), CheckpointOptions(durable=False), rounds=3)
    assert r.operation == "save" and r.bytes == STATE_BYTES and r.shards == 1
    assert r.file_bytes > r.bytes and r.compression_ratio == r.bytes / r.file_bytes
    assert r.seconds > 0 and r.gb_per_s == r.bytes / r.seconds / 1e9

def test_async_save(checkpoint_benchmark):
    opts = CheckpointOptions(durable=False, enable_async=True)
    r = checkpoint_benchmark.save(state(), opts, rounds=3)
    assert r.bytes == STATE_BYTES

def test_restore(checkpoint_benchmark):
    s = state()
    r = checkpoint_benchmark.restore(s, rounds=2, warmup_rounds=0)
    assert r.operation == "restore" and r.bytes == STATE_BYTES
    assert s["model"]["w"].sum() == 256 * 256

def test_compressed(checkpoint_benchmark):
    opts = CheckpointOptions(durable=False, compression="zstd")
    r = checkpoint_benchmark.save(state(), opts, rounds=2)
    assert r.compression_ratio > 10  # ones and a ramp compress very well

def test_bad_state(checkpoint_benchmark):
    with pytest.raises(TypeError, match="takes a mapping of names to objects"):
        checkpoint_benchmark.save([1, 2])
"""


def test_fixture_times_and_records_extra_info(pytester):
    pytester.makepyfile(test_ckpt=TESTS)
    report = pytester.path / "bench.json"
    result = pytester.runpytest_subprocess(*PLUGIN, f"--benchmark-json={report}")
    result.assert_outcomes(passed=5)
    data = json.loads(report.read_text())
    by_name = {b["name"]: b for b in data["benchmarks"]}
    assert set(by_name) == {"test_save", "test_async_save", "test_restore", "test_compressed"}
    assert by_name["test_compressed"]["extra_info"]["compression_ratio"] > 10
    info = by_name["test_save"]["extra_info"]
    assert info["operation"] == "save" and info["bytes"] == 4 * 256 * 256 + 8 * 1000 + 8
    assert info["shards"] == 1 and info["gb_per_s"] > 0
    assert 0 < info["compression_ratio"] < 1  # raw shards: headers and index cost a little
    assert "durable=False" in info["options"]
    assert by_name["test_save"]["stats"]["rounds"] == 3
    assert by_name["test_restore"]["extra_info"]["operation"] == "restore"
    assert by_name["test_restore"]["stats"]["rounds"] == 2


def test_fixture_with_benchmarks_disabled(pytester):
    pytester.makepyfile(test_ckpt="""
import numpy as np

def test_save(checkpoint_benchmark):
    r = checkpoint_benchmark.save({"x": np.ones(10)})
    assert r.seconds is None and r.gb_per_s is None and r.bytes == 88
""")
    result = pytester.runpytest_subprocess(*PLUGIN, "--benchmark-disable")
    result.assert_outcomes(passed=1)


def test_fixture_is_listed(pytester):
    result = pytester.runpytest_subprocess(*PLUGIN, "--fixtures")
    result.stdout.fnmatch_lines(["*checkpoint_benchmark*", "*Time saving or restoring*"])


def test_entry_point_declared_when_installed():
    points = entry_points()
    if points is None:
        pytest.skip("shardkit is not installed (entry points exist only in an installed copy)")
    assert [(ep.name, ep.value) for ep in points] == [("shardkit", "shardkit.tools.pytest_plugin")]
