"""Packaging promises: no framework imported, a loud error without the build, stubs shipped."""

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import shardkit

PACKAGE = Path(shardkit.__file__).parent


def run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SHARDKIT_PUREPYTHON"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, env=env)


# imported by the calls that need them, never by `import shardkit` or the command's parser
DEFERRED = ("ml_dtypes", "orjson", "tqdm", "zstandard", "google.protobuf", "google_crc32c",
            "torch", "jax", "tensorflow", "matplotlib", "fsspec", "s3fs", "safetensors",
            "transformers")


def test_import_pulls_in_no_optional_or_slow_package():
    out = run(f"""
        import sys, shardkit
        print(sorted(m for m in {DEFERRED!r} if m in sys.modules))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["inspect", "--help"]])
def test_command_line_parser_pulls_in_no_optional_or_slow_package(argv):
    out = run(f"""
        import sys
        from shardkit.tools.cli import main
        code = main({argv!r})
        print(code, sorted(m for m in {DEFERRED!r} if m in sys.modules))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0 []"


def test_public_names_resolve_and_are_the_modules_own():
    """Every name of shardkit.__all__ is there on first access (imported with its module), and
    the lazily imported ones are exactly those imported for type checkers."""
    import ast

    for name in shardkit.__all__:
        assert getattr(shardkit, name) is not None, name
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    checked = next(n for n in tree.body if isinstance(n, ast.If)
                   and getattr(n.test, "id", "") == "TYPE_CHECKING")
    typed = {a.name: node.module for node in checked.body for a in node.names}
    assert typed == shardkit._LAZY
    for name, module in typed.items():
        assert getattr(shardkit, name) is getattr(__import__(f"shardkit.{module}",
                                                              fromlist=["x"]), name)
    assert shardkit.io.save is sys.modules["shardkit.io.save"]  # submodules by attribute, as before
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        shardkit.no_such_name  # noqa: B018


def test_ml_dtypes_is_imported_by_the_calls_that_need_it(tmp_path):
    """bfloat16 / float8 work wherever they are used: a checkpoint that holds them, a state
    built with them, arrays of them made after ``import shardkit``."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    shardkit.save(tmp_path / "bf", {"w": np.arange(3).astype(ml_dtypes.bfloat16)},
                  options=shardkit.CheckpointOptions(durable=False))
    out = run(f"""
        import sys, numpy as np, shardkit
        state = shardkit.load({str(tmp_path / "bf")!r})
        print(state["w"].dtype, state["w"].tolist(), "ml_dtypes" in sys.modules)
        from shardkit.tools.models import synthetic_state
        state = synthetic_state("llm-tiny", dtype="float8_e4m3fn")
        print(state["model"]["embed_tokens"]["weight"].dtype)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["bfloat16 [0.0, 1.0, 2.0] True", "float8_e4m3fn"]
    out = run(f"""
        import shardkit, ml_dtypes, numpy as np
        a = np.arange(4).astype(ml_dtypes.float8_e5m2)
        shardkit.save({str(tmp_path / "f8")!r}, {{"a": a, "b": np.ones(2, np.float32)}})
        print(shardkit.load({str(tmp_path / "f8")!r})["a"].dtype)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "float8_e5m2"


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
                                {{"experimental_sharding_callback":
                                  shardkit.MaxShardSizePolicy(100_000)}})):
            path = r"{tmp_path}" + f"/c{{i}}"
            shardkit.save(path, state, options=shardkit.CheckpointOptions(durable=False, **kw))
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


ROOT = PACKAGE.parent
needs_checkout = pytest.mark.skipif(
    not (ROOT / "setup.py").is_file(), reason="needs the source checkout (setup.py)"
)

_READ_SETUP = """
    import json, os, sys
    import Cython.Build, setuptools
    from setuptools.dist import Distribution
    captured = {}
    Cython.Build.cythonize = lambda exts, **kw: (captured.update(cythonize=kw), exts)[1]
    setuptools.setup = lambda **kw: captured.update(kw)
    sys.argv = ["setup.py"]
    namespace = {"__name__": "setup", "__file__": "setup.py"}
    exec(compile(open("setup.py").read(), "setup.py", "exec"), namespace)
    cmd = captured["cmdclass"]["build_ext"](Distribution({"ext_modules": captured["ext_modules"]}))
    cmd.initialize_options()
    cmd.ensure_finalized()
    print(json.dumps({
        "parallel": cmd.parallel,
        "cpus": os.cpu_count(),
        "nthreads": captured["cythonize"].get("nthreads"),
        "force": captured["cythonize"].get("force"),
        "boundscheck": captured["cythonize"]["compiler_directives"]["boundscheck"],
        "exts": {e.name.rsplit(".", 1)[1]: [e.sources, e.extra_compile_args, e.define_macros]
                 for e in captured["ext_modules"]},
    }))
"""


def _read_setup(debug: bool) -> dict:
    import json

    env = {k: v for k, v in os.environ.items() if k != "SHARDKIT_CYTHON_DEBUG"}
    if debug:
        env["SHARDKIT_CYTHON_DEBUG"] = "1"
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_READ_SETUP)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@needs_checkout
def test_release_build_is_parallel_without_debug_info():
    setup = _read_setup(debug=False)
    cpus = setup["cpus"]
    assert setup["parallel"] == cpus  # one compile job per CPU unless -j says otherwise
    assert setup["nthreads"] == (cpus if cpus > 1 else 0)
    assert setup["force"] is False and setup["boundscheck"] is False
    exts = setup["exts"]
    assert set(exts) == {"_gather", "_mmap", "_packing", "_shuffle", "_sizes", "_sstable",
                         "_table", "_views"}
    for name, (sources, flags, macros) in exts.items():
        assert flags[0] == "-g0", name  # after Python's own -g: no debug info
        hot = {"_gather", "_packing", "_shuffle", "_sstable", "_table"}
        assert flags[1] == ("-O3" if name in hot else "-O2"), name
        # The xxHash dispatcher is compiled once, into the one kernel that hashes.
        dispatch = [s for s in sources if "xxh_x86dispatch" in s]
        x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
        assert len(dispatch) == (1 if name == "_gather" and x86 else 0), name
        if name != "_gather":
            assert ["SHARDKIT_XXH_DISPATCH", "1"] not in macros, name


@needs_checkout
def test_debug_build_keeps_checks_and_debug_info():
    setup = _read_setup(debug=True)
    assert setup["force"] is True and setup["boundscheck"] is True
    assert all(flags == ["-O0", "-g"] for _, flags, _ in setup["exts"].values())


@needs_checkout
def test_sdist_ships_the_licenses_changelog_and_docs(tmp_path):
    import tarfile

    out = subprocess.run(
        [sys.executable, "-c",
         f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path)!r}))"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    sdist = tmp_path / out.stdout.split()[-1]
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        pkg_info = tar.extractfile(f"{sdist.name[: -len('.tar.gz')]}/PKG-INFO").read().decode()
    assert {"LICENSE", "CHANGELOG.md", "csrc/xxhash/LICENSE", "setup.py"} <= names
    docs = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert docs and docs <= names, sorted(docs - names)  # the README links to every one
    assert "License-Expression: Apache-2.0" in pkg_info
    assert "License-File: LICENSE" in pkg_info


def test_license_is_apache_2():
    if not (ROOT / "LICENSE").is_file():
        pytest.skip("needs the source checkout")
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("Copyright 2026 the shardkit authors\n")
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
