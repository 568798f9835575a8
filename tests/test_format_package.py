"""shardkit.format as a package: every name of the former single module is still importable
from it, each defined once, and its modules import one way (docs/ARCHITECTURE.md)."""

import ast
import importlib
import re
from pathlib import Path

import shardkit.format as fmt

PACKAGE = Path(fmt.__file__).parent
ROOT = PACKAGE.parent.parent
# each imports only those before it
MODULES = ("common", "strictjson", "header", "string_section", "index", "index_encoding",
           "index_decoding")

def _defined(tree: ast.Module) -> list[str]:
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return names


def test_every_name_of_the_modules_is_defined_once_and_reexported():
    """`shardkit.format.X` is the object its module defines, private names included (the rest
    of shardkit and the tests use them as `fmt.X`), and every public name is in `__all__`."""
    where: dict[str, str] = {}
    for mod in MODULES:
        for name in _defined(ast.parse((PACKAGE / f"{mod}.py").read_text())):
            assert name not in where, f"{name} is defined in both {where[name]} and {mod}"
            where[name] = mod
    assert {"CheckpointIndex", "decode_index", "EntryLayout", "check_slices"} <= set(where)
    for name, mod in where.items():
        assert getattr(fmt, name, None) is getattr(
            importlib.import_module(f"shardkit.format.{mod}"), name), name
    public = {n for n in where if not n.startswith("_")}
    assert public <= set(fmt.__all__), sorted(public - set(fmt.__all__))
    dtypes = importlib.import_module("shardkit.values.dtypes")
    assert fmt.safetensors_name is dtypes.safetensors_name


def test_modules_import_one_way():
    for i, mod in enumerate(MODULES):
        tree = ast.parse((PACKAGE / f"{mod}.py").read_text())
        siblings = {node.module for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.level == 1}
        assert siblings <= set(MODULES[:i]), f"{mod} imports {sorted(siblings)}"


def test_pyproject_lists_every_package():
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"([^"]+)"', re.search(
        r"^packages = \[(.*?)\]", text, re.MULTILINE | re.DOTALL).group(1)))
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "shardkit").rglob("__init__.py")}
    assert on_disk <= listed, sorted(on_disk - listed)
