"""Docstrings of the public API (issue 22, item 7): Google style, and no timings.

The public surface is read at run time: `shardkit.__all__` (less the errors and warnings), the
building blocks docs/API.md documents under their full path (``### `shardkit.values.slices.
check_tiling` ``: public in their modules, not in `__all__`), and the names of
`shardkit.distributed` and `shardkit.storage` that docs/API.md mentions; then the public methods
and properties of its classes. A callable that takes parameters needs an ``Args:`` section, one
that returns something an ``Returns:`` section, a module-level function a ``Raises:`` section,
a property a docstring. Timings (seconds, throughput, "3x faster") belong in bench/ and
CHANGELOG.md, never in a docstring: they are true of one machine on one day.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import shardkit

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "shardkit"

# Docstrings being rewritten elsewhere: each entry must still lack what it is listed with, so
# that it is removed once its docstring is written (the list only shrinks).
PENDING: dict[str, set[str]] = {}


def public_objects() -> dict[str, object]:
    found: dict[str, object] = {}
    for name in shardkit.__all__:
        obj = getattr(shardkit, name)
        if name != "__version__" and not (isinstance(obj, type)
                                          and issubclass(obj, BaseException)):
            found[name] = obj
    api = (ROOT / "docs" / "API.md").read_text()
    blocks = re.findall(r"^### `shardkit\.([\w.]+)\.(\w+)`$", api, flags=re.M)
    seams = re.findall(r"shardkit\.(distributed|storage)\.(\w+)", api)
    for module, name in sorted({*blocks, *seams}):
        obj = getattr(importlib.import_module(f"shardkit.{module}"), name)
        found.setdefault(f"{module}.{name}", obj)
    return found


def members(cls: type) -> dict[str, object]:
    """The public methods and properties of `cls` written in shardkit (its bases' included)."""
    out: dict[str, object] = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        raw = inspect.getattr_static(cls, name)
        if isinstance(raw, (staticmethod, classmethod)):
            raw = raw.__func__
        if isinstance(raw, property) or (inspect.isfunction(raw)
                                         and raw.__module__.startswith("shardkit")):
            out[name] = raw
    return out


def callables() -> dict[str, tuple[object, bool]]:
    """Qualified name -> (callable or property, whether it is a module-level function)."""
    out: dict[str, tuple[object, bool]] = {}
    for name, obj in public_objects().items():
        if inspect.isfunction(obj):
            out[name] = (obj, True)
        elif isinstance(obj, type):
            for member, raw in members(obj).items():
                out[f"{name.rpartition('.')[2]}.{member}"] = (raw, False)
    return out


def missing_sections(obj: object, module_level: bool) -> set[str]:
    if isinstance(obj, property):
        return set() if inspect.getdoc(obj) else {"docstring"}
    doc = inspect.getdoc(obj) or ""
    if not doc:
        return {"docstring"}
    sig = inspect.signature(obj)  # type: ignore[arg-type]
    needed = set()
    if [p for p in sig.parameters if p not in ("self", "cls")]:
        needed.add("Args:")
    if sig.return_annotation not in (inspect.Signature.empty, None, "None"):
        needed.add("Returns:")
    if module_level:
        needed.add("Raises:")
    return {section for section in needed
            if not re.search(rf"^{section}$", doc, flags=re.M)}


SCOPE = callables()


def test_scope_is_the_public_api():
    assert "load" in SCOPE and "CheckpointReader.get" in SCOPE
    assert "CheckpointReader.metadata" in SCOPE  # a property
    assert "Coordinator.all_gather" in SCOPE  # docs/API.md names shardkit.distributed.Coordinator
    for name in ("sharding.callback.shard_tensors", "sharding.tensors.shardable_tensors",
                 "values.slices.check_tiling", "values.slices.format_slice_spec",
                 "values.slices.parse_slice_spec", "sharding.policies.parse_size",
                 "Problem.label", "PolicyProfile.num_shards"):  # out of __all__, still public
        assert name in SCOPE, name
    assert set(PENDING) <= set(SCOPE), sorted(set(PENDING) - set(SCOPE))


@pytest.mark.parametrize("name", sorted(SCOPE))
def test_google_style_sections(name):
    obj, module_level = SCOPE[name]
    missing = missing_sections(obj, module_level)
    if name in PENDING:
        assert missing == PENDING[name], (
            f"{name}: now lacks {sorted(missing)}; update or remove its PENDING entry")
        return
    assert not missing, f"{name}: its docstring lacks {sorted(missing)}"


# A number (or a range) followed by a unit of time, a throughput, or a speed ratio. Sizes
# ("4MiB", "64 MiB parts"), counts and plain ratios of bytes ("8x the needed bytes") pass.
NUMBER = r"(?<![\w.])\d(?:[\d,.]*\d)?"
TIMING = re.compile(rf"""(?ix)
    {NUMBER} \s* (?: (?:-|to) \s* {NUMBER} \s* )?
        (?: s | secs? | seconds? | ms | msecs? | us | µs | μs | ns | mins? | minutes? | h | hours? )
        \b (?!/)
  | {NUMBER} \s* (?: [KMGT] i? )? B \s* / \s* s \b
  | {NUMBER} \s* (?: x | × | times ) \s+ (?: faster | slower | cheaper | quicker | as\ fast )
  | \b (?: twice | half | double ) \s+ (?: [\w']+ \s+ ){{0,3}} speed
  | {NUMBER} \s* % \s+ (?: less | more ) \s+ time
  | \b speed-?ups? \s+ of
""")


def docstrings() -> list[tuple[str, str]]:
    """Every string standing alone as a statement: the docstrings of modules, classes and
    functions, and those written under an attribute."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)):
                out.append((f"{path.relative_to(ROOT)}:{node.lineno}", node.value.value))
    return out


def test_no_timings_in_docstrings():
    found = [f"{where}: {m[0]!r}" for where, doc in docstrings() for m in TIMING.finditer(doc)]
    assert not found, "timings belong in bench/ or CHANGELOG.md:\n" + "\n".join(found)


@pytest.mark.parametrize("text", [
    "about 1.7 s here", "0.3-0.4 s against 1.2-1.9 s", "~0.07 us each", "costs 35 µs a variable",
    "about 10 GB/s", "3x faster than json", "about 4x cheaper", "twice one file's speed",
    "15% less time", "0.1 ms when cached",
])
def test_timing_pattern_finds(text):
    assert TIMING.search(text), text


@pytest.mark.parametrize("text", [
    "chunk_size=\"4MiB\"", "parts of 64 MiB", "8x the needed bytes", "a 4x6 tensor",
    "int64 sizes", "float16s", "50,000 tensors", "keep_checkpoint_every_n_hours", "E4M3",
    "timeout: seconds to wait",
])
def test_timing_pattern_passes(text):
    assert not TIMING.search(text), text
