"""The house rules that tools can check: ruff on everything, mypy on the package."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed by the test extra")
def test_ruff_clean():
    proc = subprocess.run(["ruff", "check", "shardkit", "tests", "bench"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_clean():
    pytest.importorskip("mypy", reason="mypy is installed by the test extra")
    proc = subprocess.run([sys.executable, "-m", "mypy", "shardkit"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
