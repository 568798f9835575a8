"""Every ```python block of README.md runs, in order, in one namespace, in a temp directory."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(python_blocks()) >= 3


# The README's custom-callback example splits a tensor on purpose (it shows split slices), so
# its save warns that HuggingFace loaders cannot read them; that warning is not a failure here.
@pytest.mark.filterwarnings("ignore::shardkit.SplitTensorsWarning")
def test_readme_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(python_blocks()):
        try:
            exec(compile(block, f"README.md block {i}", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message is the point
            raise AssertionError(f"README python block {i} failed: {e!r}\n{block}") from e


def test_quick_start_commands_match_ci():
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    test_command = 'pip install -e ".[test]" && pytest'
    assert test_command in text and test_command in ci
    assert "pip install . && shardkit demo" in text
