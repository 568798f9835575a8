"""Packaging promises: no framework imported, a loud error without the build, stubs shipped."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import shardkit

PACKAGE = Path(shardkit.__file__).parent


def run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SHARDKIT_PUREPYTHON"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, env=env)


def test_import_pulls_in_no_framework():
    out = run("""
        import sys, shardkit
        print(sorted(m for m in ("torch", "jax", "tensorflow", "matplotlib") if m in sys.modules))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_missing_build_fails_loudly_with_instructions():
    out = run("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.startswith("shardkit._kernels._"):
                    raise ImportError("simulated missing extension " + name)
        sys.meta_path.insert(0, Block())
        import shardkit
    """)
    assert out.returncode != 0
    assert "compiled kernels are missing or broken" in out.stderr
    assert "pip install" in out.stderr


def test_pure_python_switch_uses_the_reference_twins():
    out = run("""
        import os
        os.environ["SHARDKIT_PUREPYTHON"] = "1"
        import shardkit._kernels as k
        print(k.PURE_PYTHON, k._sizes.__name__)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "shardkit._reference._sizes"]


def test_typing_files_ship():
    assert (PACKAGE / "py.typed").is_file()
    for module in ("_sizes", "_packing", "_gather", "_shuffle"):
        assert (PACKAGE / "_kernels" / f"{module}.pyi").is_file(), module
