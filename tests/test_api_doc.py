"""docs/API.md covers the public API: every name in shardkit.__all__ has an entry, every
parameter of a public function or constructor is named in its entry, and the error tree is the
real class hierarchy."""

from __future__ import annotations

import builtins as builtins_module
import importlib
import inspect
import re
from pathlib import Path

import pytest

import shardkit
import shardkit.errors
from shardkit._moved import MOVED_NAMES

API = Path(__file__).resolve().parent.parent / "docs" / "API.md"
ERRORS = sorted(n for n in shardkit.errors.__all__
                if issubclass(getattr(shardkit.errors, n), BaseException))
DOCUMENTED = sorted(set(shardkit.__all__) - set(ERRORS) - {"__version__"})
# building blocks outside __all__, headed by their full path
BY_PATH = {f"shardkit.{module}.{name}": name for name, module in MOVED_NAMES.items()}
BY_PATH["shardkit.errors.Problem"] = "Problem"


def sections() -> dict[str, str]:
    """``### `name` `` heading -> the text up to the next heading."""
    parts = re.split(r"^#{2,3} ", API.read_text(), flags=re.M)
    out = {}
    for part in parts[1:]:
        heading, _, body = part.partition("\n")
        m = re.fullmatch(r"`([\w.]+)`", heading.strip())
        if m:
            out[m[1]] = body
    return out


def test_every_public_name_has_an_entry():
    text = API.read_text()
    headed = sections()
    assert set(DOCUMENTED) <= set(headed), sorted(set(DOCUMENTED) - set(headed))
    assert set(BY_PATH) <= set(headed), sorted(set(BY_PATH) - set(headed))
    assert not set(headed) - set(shardkit.__all__) - set(BY_PATH), "entries for non-public names"
    for name in ERRORS:  # each error: a line of the tree and a described bullet
        assert re.search(rf"^ *{name}\b", text, flags=re.M), name
        assert f"`{name}`: " in text, f"{name}: not described under Errors"
    assert "`__version__`" in text
    assert "](docs/API.md)" in (API.parent.parent / "README.md").read_text()  # linked


@pytest.mark.parametrize("name", DOCUMENTED + sorted(BY_PATH))
def test_entry_names_every_parameter(name):
    module, _, short = name.rpartition(".")
    obj = getattr(importlib.import_module(module) if module else shardkit, short)
    body = sections()[name]
    name = short
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):  # a type alias (Shard): nothing to call
        assert name == "Shard", f"{name}: no signature"
        return
    assert f"{name}(" in body, f"{name}: no signature in its entry"
    for p in params:
        assert re.search(rf"\b{p}\b", body), f"{name}: parameter {p!r} not in docs/API.md"


def test_error_tree_is_the_class_hierarchy():
    tree = re.search(r"```\n(ShardkitError\n.*?)```", API.read_text(), flags=re.S)
    assert tree, "no error tree"
    parents: list[str] = []
    seen = set()
    for line in tree[1].splitlines():
        depth = (len(line) - len(line.lstrip())) // 4
        m = re.fullmatch(r"(\w+)(?:  \(([\w, ]+)\))?", line.strip())
        assert m, line
        name, also = m[1], m[2]
        cls = getattr(shardkit, name)
        del parents[depth:]
        expected_bases = [getattr(shardkit, parents[-1])] if parents else [Exception]
        expected_bases += [getattr(builtins_module, b) for b in (also.split(", ") if also else [])]
        assert list(cls.__bases__) == expected_bases, (name, cls.__bases__)
        parents.append(name)
        seen.add(name)
    assert seen == {n for n in ERRORS if issubclass(getattr(shardkit, n), shardkit.ShardkitError)}


def test_warnings_are_listed_with_their_base():
    """Warnings are not errors: they stand in a block of their own, each with its base."""
    warnings = [n for n in ERRORS if issubclass(getattr(shardkit, n), Warning)]
    assert warnings == ["RetentionWarning", "SplitTensorsWarning"]
    block = re.search(r"### Warnings\n\n```\n(.*?)```", API.read_text(), flags=re.S)
    assert block, "no Warnings block"
    for name in warnings:
        base = getattr(shardkit, name).__bases__[0].__name__
        assert f"{name}  ({base})" in block[1]
