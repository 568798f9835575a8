"""shardkit.optional: every package beyond numpy is imported by the call that needs it, and a
missing one is a MissingDependencyError naming the extra that installs it, from the API and from
the command line (one line, exit code 1, no traceback).

Each case runs in a fresh interpreter in which the package cannot be imported (a `sys.meta_path`
finder that refuses it, as if it were not installed)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.errors import MissingDependencyError

BLOCKER = """
import sys
BLOCKED = {blocked!r}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name in BLOCKED or name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
for _name in list(sys.modules):
    if _name in BLOCKED or _name.partition(".")[0] in BLOCKED:
        del sys.modules[_name]
sys.meta_path.insert(0, Block())
"""


def without(blocked: list[str], code: str, *, cwd=None) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter in which the modules `blocked` cannot be imported."""
    env = {k: v for k, v in os.environ.items() if k != "SHARDKIT_PUREPYTHON"}
    program = BLOCKER.format(blocked=set(blocked)) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


def api_error(blocked: list[str], call: str, *, setup: str = "") -> str:
    """The MissingDependencyError's message when `call` runs without `blocked`."""
    out = without(blocked, f"""
        import numpy as np
        import shardkit
        from shardkit.errors import MissingDependencyError
        {setup}
        try:
            {call}
        except MissingDependencyError as e:
            print("MISSING", e)
        else:
            print("NO ERROR")
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("MISSING "), out.stdout + out.stderr
    return out.stdout


def cli_error(blocked: list[str], *argv: str) -> str:
    """stderr of ``shardkit ARGV`` without `blocked`, checked to be one clean error line."""
    out = without(blocked, f"""
        from shardkit.tools.cli import main
        raise SystemExit(main({list(argv)!r}))
    """)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("shardkit: error: ") and out.stderr.count("\n") == 1, out.stderr
    return out.stderr


def extra(name: str) -> str:
    return f'pip install "shardkit[{name}]"'


@pytest.fixture(scope="module")
def tf_checkpoint(tmp_path_factory):
    pytest.importorskip("google.protobuf", reason="writing the bundle needs protobuf")
    path = tmp_path_factory.mktemp("tf") / "ckpt"
    shardkit.save(path, {"w": np.arange(6, dtype=np.float32)}, format="tensorflow")
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("sk") / "ckpt"
    shardkit.save(path, {"w": np.arange(6, dtype=np.float32)},
                  options=shardkit.CheckpointOptions(durable=False))
    return str(path)


# -- protobuf and crc32c: TensorBundle, the [tensorbundle] extra ---------------------------------


@pytest.mark.parametrize("blocked", [["google"], ["google.protobuf"]])
def test_tensorbundle_without_protobuf(tf_checkpoint, tmp_path, blocked):
    for call in (f"shardkit.load({tf_checkpoint!r})",
                 f"shardkit.save({str(tmp_path / 'out')!r}, {{'a': np.ones(2)}}, "
                 "format='tensorflow')"):
        message = api_error(blocked, call)
        assert "reading or writing a TensorFlow checkpoint (TensorBundle) needs protobuf" in (
            message), message
        assert extra("tensorbundle") in message
    for argv in (["inspect", tf_checkpoint], ["verify", tf_checkpoint],
                 ["convert", tf_checkpoint, str(tmp_path / "sk")]):
        assert extra("tensorbundle") in cli_error(blocked, *argv)
    assert not (tmp_path / "out.index").exists() and not (tmp_path / "sk").exists()


def test_tensorbundle_without_crc32c(tf_checkpoint):
    message = api_error(["google_crc32c", "crc32c"], f"shardkit.load({tf_checkpoint!r})")
    assert "needs google-crc32c" in message and extra("tensorbundle") in message
    assert extra("tensorbundle") in cli_error(["google_crc32c", "crc32c"], "inspect",
                                              tf_checkpoint)


def test_tensorbundle_needs_no_tensorflow(tf_checkpoint):
    out = without(["tensorflow"], f"""
        import sys, shardkit
        print(shardkit.load({tf_checkpoint!r})["w"].tolist(), "tensorflow" in sys.modules)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("]")[1].strip() == "False"


# -- fsspec and s3fs: URLs, the [s3] extra -------------------------------------------------------


@pytest.mark.parametrize("blocked", [["fsspec"], ["s3fs"]])
def test_urls_without_fsspec_or_s3fs(blocked):
    dist = blocked[0]
    message = api_error(blocked, "shardkit.load('s3://bucket/ckpt')")
    assert f"needs {dist}" in message and extra("s3") in message, message
    assert extra("s3") in cli_error(blocked, "inspect", "s3://bucket/ckpt")


# -- the frameworks ------------------------------------------------------------------------------


@pytest.mark.parametrize("framework", ["torch", "jax", "tensorflow"])
def test_framework_without_its_package(checkpoint, framework):
    message = api_error([framework], f"shardkit.load({checkpoint!r}, framework={framework!r})")
    assert f"framework={framework!r} needs" in message and extra(framework) in message


def test_as_tensorflow_callback_without_tensorflow():
    message = api_error(["tensorflow"],
                        "shardkit.as_tensorflow_callback(shardkit.MaxShardSizePolicy(10))")
    assert "as_tensorflow_callback needs tensorflow-cpu" in message
    assert extra("tensorflow") in message


# -- matplotlib and safetensors ------------------------------------------------------------------


def test_plot_without_matplotlib(tmp_path):
    stderr = cli_error(["matplotlib"], "plan", "--model", "llm-tiny", "--plot",
                       str(tmp_path / "p.png"))
    assert "plotting shard sizes needs matplotlib" in stderr and extra("plot") in stderr
    assert not (tmp_path / "p.png").exists()


def test_state_file_without_safetensors(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"\0" * 16)
    message = api_error(["safetensors"], f"shardkit.tools.models.load_state_file({str(path)!r})",
                        setup="import shardkit.tools.models")
    assert "needs safetensors" in message and extra("huggingface") in message


# -- the core dependencies: imported lazily, needed only by the calls that use them --------------


def test_float32_round_trip_needs_no_ml_dtypes_tqdm_or_zstandard(tmp_path):
    out = without(["ml_dtypes", "tqdm", "zstandard"], f"""
        import numpy as np, shardkit
        shardkit.save({str(tmp_path / "c")!r}, {{"w": np.arange(4, dtype=np.float32)}})
        print(shardkit.load({str(tmp_path / "c")!r})["w"].tolist())
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0.0, 1.0, 2.0, 3.0]"


def test_core_dependency_missing_says_to_reinstall(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    shardkit.save(tmp_path / "bf", {"w": np.ones(3, ml_dtypes.bfloat16)},
                  options=shardkit.CheckpointOptions(durable=False))
    shardkit.save(tmp_path / "raw", {"w": np.ones(3, np.float32)},
                  options=shardkit.CheckpointOptions(durable=False))
    cases = [(["ml_dtypes"], f"shardkit.load({str(tmp_path / 'bf')!r})", "ml_dtypes"),
             (["zstandard"], f"shardkit.save({str(tmp_path / 'z')!r}, {{'a': np.ones(2)}}, "
                             "compression='zstd')", "zstandard"),
             (["tqdm"], f"shardkit.save({str(tmp_path / 't')!r}, {{'a': np.ones(2)}}, "
                        "progress=True)", "tqdm"),
             (["orjson"], f"shardkit.load({str(tmp_path / 'raw')!r})", "orjson")]
    for blocked, call, name in cases:
        message = api_error(blocked, call)
        assert f"needs {name}" in message and "reinstall shardkit" in message, message


# -- the helpers themselves ----------------------------------------------------------------------


def test_lazy_import_imports_on_first_attribute():
    out = without([], """
        import sys
        from shardkit.optional import lazy_import
        js = lazy_import("json", "a test")
        before = "json" in sys.modules
        print(before, js.dumps([1]), "json" in sys.modules, js.loads is sys.modules["json"].loads)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "[1]", "True", "True"]


def test_lazy_import_of_a_missing_module():
    from shardkit.optional import lazy_import, require

    module = lazy_import("shardkit_no_such_module", "a test")
    with pytest.raises(MissingDependencyError, match="a test needs shardkit_no_such_module"):
        module.anything  # noqa: B018
    with pytest.raises(MissingDependencyError, match="reinstall shardkit"):
        require("shardkit_no_such_module", "a test")


def test_missing_names_the_dependency_that_is_absent():
    tomllib = pytest.importorskip("tomllib")
    from shardkit.optional import EXTRAS, missing

    cause = ModuleNotFoundError("No module named 'google'", name="google")
    error = missing("shardkit.adapters.tensorbundle.protos", "reading", cause)
    assert str(error).startswith("reading needs protobuf, which cannot be imported")
    assert extra("tensorbundle") in str(error)
    extras = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    for module, (dist, name) in EXTRAS.items():
        assert extra(name) in str(missing(module, "x")), module
        assert any(dep.startswith(dist) for dep in extras[name]), (module, name)
