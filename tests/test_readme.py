"""Every ```python block of README.md runs, in order, in one namespace, in a temp directory."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(python_blocks()) >= 3


def test_readme_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(python_blocks()):
        try:
            exec(compile(block, f"README.md block {i}", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message is the point
            raise AssertionError(f"README python block {i} failed: {e!r}\n{block}") from e


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)


def quick_start() -> tuple[str, str]:
    """The README's two quick-start commands: (demo, test suite)."""
    commands = [b.strip() for b in bash_blocks()[:2]]
    assert len(commands) == 2 and all("\n" not in c for c in commands), commands
    return commands[0], commands[1]


def venv_of(command: str) -> str:
    m = re.fullmatch(r"python3 -m venv (\S+) && \. (\S+)/bin/activate && .+", command)
    assert m and m[1] == m[2], f"quick-start command does not create and activate a venv: {command}"
    return m[1]


def test_quick_start_commands():
    demo, tests = quick_start()
    assert demo.endswith("&& pip install . && shardkit demo")
    assert tests.endswith('&& pip install -e ".[test]" && pytest')
    # two fresh environments: the second command must not reuse what the first installed
    assert venv_of(demo) != venv_of(tests)
    ignored = (ROOT / ".gitignore").read_text().split()
    for venv in (venv_of(demo), venv_of(tests)):
        assert not venv.startswith("/") and ".." not in venv  # no machine paths
        assert f"{venv}/" in ignored


def test_ci_runs_exactly_the_readme_test_command():
    _, tests = quick_start()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests in ci_lines


def test_python_version_matches_pyproject():
    pyproject = (ROOT / "pyproject.toml").read_text()
    (version,) = re.findall(r'^requires-python = ">=(\d+\.\d+)"$', pyproject, flags=re.M)
    assert f"Python {version}+" in README.read_text()
    target = "py" + version.replace(".", "")
    assert re.search(rf'^target-version = "{target}"$', pyproject, flags=re.M)


FAKE_PYTHON3 = """#!/bin/sh
# stands in for `python3 -m venv DIR`: an activate script that puts fake pip and pytest first
mkdir -p "$3/bin"
printf 'PATH="%s/fakebin:$PATH"\\n' "$FAKE_ROOT" > "$3/bin/activate"
"""


@pytest.mark.parametrize(("pytest_status", "ci_status"), [(0, 0), (1, 1), (5, 1)])
def test_ci_fails_when_pytest_collects_nothing(tmp_path, pytest_status, ci_status):
    """.ci/run passes pytest's exit status on, except 5 (no tests collected), which fails."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    bins = {"bin/python3": FAKE_PYTHON3,
            "fakebin/pip": "#!/bin/sh\necho pip \"$@\" >> \"$FAKE_ROOT/log\"\n",
            "fakebin/pytest": "#!/bin/sh\necho pytest >> \"$FAKE_ROOT/log\"\n"
                              f"exit {pytest_status}\n"}
    for name, text in bins.items():
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        path.chmod(0o755)
    env = {**os.environ, "FAKE_ROOT": str(tmp_path),
           "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(repo / ".ci" / "run")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == ci_status, done.stderr
    assert (tmp_path / "log").read_text().splitlines() == ["pip install -e .[test]", "pytest"]
    assert (repo / quick_start()[1].split()[3]).is_dir()  # the venv the README names
    assert ("collected no tests" in done.stderr) == (pytest_status == 5)
