"""README.md: every ```python block runs on its own, in a fresh interpreter in a temp directory
(a block that defines ``test_`` functions is run by pytest, as a reader would run it); a block
whose first line is ``# needs: torch, ...`` is skipped, saying so, only when one of those packages
is missing. The examples of README.md and of each docs/*.md also replay as a reader pastes them:
all in order in one folder, twice. A docs block that is only a signature (``name(params)``, maybe
``-> type``) documents a public name of shardkit and is checked to name one, not run. The
quick-start commands, .ci/run and the extras the README names are checked too."""

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


# what a `# needs:` line may name -> the module to import and the extra that installs it
NEEDS = {"torch": ("torch", "torch"), "jax": ("jax", "jax"), "matplotlib": ("matplotlib", "plot"),
         "pytest-benchmark": ("pytest_benchmark", "pytest"),
         "transformers": ("transformers", "huggingface"),
         "tensorflow": ("tensorflow", "tensorflow")}


DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(doc: Path = README) -> list[tuple[int, str]]:
    """(line number in `doc`, code) of every ```python block."""
    text = doc.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m[1])
            for m in re.finditer(r"```python\n(.*?)```", text, flags=re.S)]


def signature_of(code: str) -> str | None:
    """The name a block documents when the block is only its signature (it reads as a ``def``
    line: ``name(params) -> type``), else None."""
    try:
        tree = ast.parse(f"def {code.strip()}: ...")
    except SyntaxError:
        return None
    return tree.body[0].name if len(tree.body) == 1 else None  # type: ignore[attr-defined]


def examples(doc: Path) -> list[tuple[int, str]]:
    """The ```python blocks of `doc` but its signatures."""
    return [(line, code) for line, code in python_blocks(doc) if signature_of(code) is None]


def needs(code: str) -> list[str]:
    first = code.split("\n", 1)[0]
    return [n.strip() for n in first.split(":", 1)[1].split(",")] if first.startswith(
        "# needs:") else []


def test_readme_has_examples():
    assert len(python_blocks()) >= 3


def test_needs_lines_name_known_packages_and_their_extras():
    """Every optional package a block needs is one the README tells the reader to install."""
    text = README.read_text()
    named = {n for _, code in python_blocks() for n in needs(code)}
    assert named >= {"torch", "pytest-benchmark"}
    for line, code in python_blocks():
        imported = set(re.findall(r"^(?:import|from) (\w+)", code, flags=re.M))
        used = {n for n, (module, _) in NEEDS.items() if module in imported}
        if "checkpoint_benchmark" in code:
            used.add("pytest-benchmark")
        assert used <= set(needs(code)), f"README block at line {line}: add '# needs: {used}'"
    for name in named:
        assert name in NEEDS, f"unknown package in a '# needs:' line: {name}"
        assert f'pip install "shardkit[{NEEDS[name][1]}]"' in text, name


def test_readme_extras_exist():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    named = set(re.findall(r'"shardkit\[(\w+)\]"|"\.\[(\w+)\]"', README.read_text()))
    named_extras = {a or b for a, b in named}
    assert named_extras >= {"torch", "jax", "plot", "pytest", "test", "bench"}
    assert named_extras <= set(extras)
    for package, (_, extra) in NEEDS.items():
        assert any(dep.startswith(package) for dep in extras[extra]), (package, extra)


def plugin_args() -> list[str]:
    """Load shardkit's pytest plugin by name when it is not installed (no entry point)."""
    try:
        dist = metadata.distribution("shardkit")
    except metadata.PackageNotFoundError:
        return ["-p", "shardkit.tools.pytest_plugin"]
    return [] if any(ep.group == "pytest11" for ep in dist.entry_points) else [
        "-p", "shardkit.tools.pytest_plugin"]


def run_block(folder: Path, where: str, code: str) -> None:
    """Run one example in `folder` as a reader would (pytest for a block of ``test_``
    functions), in a fresh interpreter; assert it passed."""
    is_test = re.search(r"^def test_", code, flags=re.M) is not None
    script = folder / ("test_readme_block.py" if is_test else "readme_block.py")
    script.write_text(code)
    command = ([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin_args(),
                script.name] if is_test else [sys.executable, script.name])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{where} failed:\n{code}\n{done.stdout}\n{done.stderr}"
    if is_test:
        assert re.search(r"\b[1-9]\d* passed\b", done.stdout) and "skipped" not in done.stdout, (
            done.stdout)


def missing_packages(code: str) -> list[str]:
    return [n for n in needs(code) if importlib.util.find_spec(NEEDS[n][0]) is None]


@pytest.mark.parametrize("line_code", python_blocks(), ids=lambda b: f"line{b[0]}")
def test_readme_block_runs_alone(tmp_path, line_code):
    line, code = line_code
    missing = missing_packages(code)
    if missing:
        pytest.skip(f"README block at line {line} needs {', '.join(missing)} (not installed)")
    run_block(tmp_path, f"README block at line {line} (run on its own)", code)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_examples_replay_in_order_in_one_folder(tmp_path, doc):
    """Pasted one after the other into one folder, and then all again, every example passes: no
    example trips over what an earlier one (or its own first run) left there."""
    blocks = examples(doc)
    skipped = sorted({n for _, code in blocks for n in missing_packages(code)})
    for attempt in ("first", "second"):
        for line, code in blocks:
            if not missing_packages(code):
                run_block(tmp_path, f"{doc.name} block at line {line} ({attempt} run of all "
                                    "blocks in order, in one folder)", code)
    if skipped:
        pytest.skip(f"{doc.name}: blocks that need {', '.join(skipped)} were not run "
                    "(not installed)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_signature_blocks_name_public_names(doc):
    """A signature is of a name in shardkit.__all__ or shardkit.errors, or of a building block
    documented under its module (shardkit._moved.MOVED_NAMES)."""
    import importlib

    import shardkit
    from shardkit._moved import MOVED_NAMES

    for line, code in python_blocks(doc):
        name = signature_of(code)
        if name is None:
            continue
        if name in MOVED_NAMES:
            module = importlib.import_module(f"shardkit.{MOVED_NAMES[name]}")
            assert hasattr(module, name), f"{doc.name} line {line}: {name} is not in {module}"
        else:
            assert name in shardkit.__all__ or name in shardkit.errors.__all__, \
                f"{doc.name} line {line}: {name} is not public"


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
