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


def test_pure_python_twins_round_trip_every_path(tmp_path):
    """The twins are the kernels' oracle and the SHARDKIT_PUREPYTHON=1 fallback: a save and
    load through them (raw and zstd shards, every dtype, many small and split tensors, a
    checksum verify) must give back the same bytes as the compiled kernels."""
    out = run(f"""
        import os
        os.environ["SHARDKIT_PUREPYTHON"] = "1"
        import numpy as np, ml_dtypes, shardkit
        import shardkit._kernels as k
        assert k.PURE_PYTHON
        rng = np.random.default_rng(1)
        dtypes = [np.float64, np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
                  np.int64, np.int32, np.int8, np.uint16, np.bool_]
        state = {{f"t{{i}}": rng.integers(0, 2, (i % 5 + 1, 7)).astype(dtypes[i % len(dtypes)])
                 for i in range(300)}}
        state["big"] = rng.random((600, 500)).astype(np.float32)
        state["strided"] = rng.random((40, 30))[::2, ::3]
        for i, kw in enumerate(({{}}, {{"compression": "zstd", "chunk_size": 4096}},
                                {{"sharding_callback": shardkit.MaxShardSizePolicy(100_000)}})):
            path = r"{tmp_path}" + f"/c{{i}}"
            shardkit.save(path, state, durable=False, **kw)
            back = shardkit.load(path, verify=True)
            for key, a in state.items():
                b = back[key]
                assert b.dtype == a.dtype and b.shape == a.shape, key
                assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), key
        print("ok")
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_typing_files_ship():
    assert (PACKAGE / "py.typed").is_file()
    for module in ("_sizes", "_packing", "_gather", "_shuffle"):
        assert (PACKAGE / "_kernels" / f"{module}.pyi").is_file(), module
