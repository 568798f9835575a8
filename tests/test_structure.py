"""The package's structure as a ratchet (issue 22, item 8): tests/structure.py measures it.

Each check compares what is measured with an allowlist of the violations shardkit had when the
check was written. A violation not in its allowlist fails (a new circle, a new private import
across subpackages, a new import up the layer order of docs/ARCHITECTURE.md, a module over
600 lines, a class over 400, or one of those that grew past its ceiling). An allowlist entry
that no longer occurs fails too, so that it is removed: the lists only shrink. The refactor of
issue 22 is done when every list is empty.

The second half proves the instrument on small packages written to tmp_path.
"""

from __future__ import annotations

import itertools
import textwrap

import pytest
import structure

# --- today's known violations -------------------------------------------------------------
# Each entry is a literal. Remove an entry when its violation is gone; never add one for new
# code (fix the code, or the doc's layer order with the change it describes).

KNOWN_CIRCLES: set[tuple[str, ...]] = set()

# (importer, module the name is imported from, name)
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()

# module: its line ceiling (today's count)
KNOWN_LONG_MODULES: dict[str, int] = {}

# (module, class): its line ceiling (today's count)
KNOWN_LONG_CLASSES: dict[tuple[str, str], int] = {}

# (importer, module on a row above it in docs/ARCHITECTURE.md's table)
KNOWN_LAYER_VIOLATIONS: set[tuple[str, str]] = set()


@pytest.fixture(scope="module")
def report():
    return structure.analyze()


# --- the ratchet: the checks against the allowlists ---------------------------------------


def circle_problems(measured, known) -> list[str]:
    problems = []
    for circle in measured:
        if not any(set(circle) <= set(entry) for entry in known):
            problems.append(f"new import circle: {circle}")
    for entry in sorted(known):
        if any(set(entry) < set(circle) for circle in measured):
            problems.append(f"known circle {entry} is now part of a larger one")
        elif tuple(sorted(entry)) not in measured:
            problems.append(
                f"known circle {entry} no longer occurs as listed: remove it from the "
                "allowlist (or replace it with the smaller circle that is left)"
            )
    return problems


def set_problems(what, measured, known) -> list[str]:
    problems = [f"new {what}: {item}" for item in sorted(set(measured) - set(known))]
    problems += [
        f"known {what} {item} no longer occurs: remove it from the allowlist"
        for item in sorted(set(known) - set(measured))
    ]
    return problems


def size_problems(what, measured, known, limit) -> list[str]:
    """`measured`: every item's line count; `known`: item -> ceiling."""
    problems = []
    for item, lines in sorted(measured.items()):
        if lines <= limit:
            continue
        if item not in known:
            problems.append(f"new {what} over {limit} lines: {item} ({lines} lines)")
        elif lines > known[item]:
            problems.append(
                f"{what} {item} grew to {lines} lines, past its ceiling of {known[item]}"
            )
    for item in sorted(known):
        if measured.get(item, 0) <= limit:
            problems.append(
                f"known {what} {item} is no longer over {limit} lines "
                f"({measured.get(item, 'gone')}): remove it from the allowlist"
            )
    return problems


def test_no_new_import_circle(report):
    assert circle_problems(report.circles, KNOWN_CIRCLES) == []


def test_no_new_private_import_across_subpackages(report):
    problems = set_problems(
        "private import across subpackages", report.private_imports, KNOWN_PRIVATE_IMPORTS
    )
    assert problems == []


def test_no_new_module_over_600_lines(report):
    problems = size_problems(
        "module", report.module_lines, KNOWN_LONG_MODULES, structure.MAX_MODULE_LINES
    )
    assert problems == []


def test_no_new_class_over_400_lines(report):
    problems = size_problems(
        "class", report.class_lines, KNOWN_LONG_CLASSES, structure.MAX_CLASS_LINES
    )
    assert problems == []


def test_no_new_import_against_the_layer_order(report):
    problems = set_problems(
        "import up the layer order", report.layer_violations, KNOWN_LAYER_VIOLATIONS
    )
    assert problems == []


def test_every_module_has_a_layer(report):
    # a new module or folder the table of docs/ARCHITECTURE.md does not name: add it there
    # and to structure.LAYERS
    assert report.unplaced == set()


def test_the_layer_table_names_only_what_exists(report):
    paths = {
        "/".join(m.path.relative_to(structure.PACKAGE_DIR).parts) for m in report.modules.values()
    }
    for name, _ in structure.layer_table():
        if name.endswith("/"):
            assert any(p.startswith(name) for p in paths), name
        else:
            assert name in paths, name


def test_the_layer_table_follows_the_document():
    doc = (structure.PACKAGE_DIR.parent / "docs" / "ARCHITECTURE.md").read_text()
    table = doc.split("## Modules, top to bottom", 1)[1].split("\n\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    first_cells = [row.split("|")[1] for row in rows]

    def position(name):
        for i, cell in enumerate(first_cells):
            if f"`{name}`" in cell:
                return i
        for i, cell in enumerate(first_cells):  # "storage/" (`__init__.py`, `base.py`)
            folder, _, base = name.rpartition("/")
            if folder and f"`{folder}/`" in cell and f"`{base}`" in cell:
                return i
        raise AssertionError(f"{name} is not in docs/ARCHITECTURE.md's table")

    seen = [
        (position(name), layer)
        for name, layer in structure.layer_table()
        if name != "__init__.py" and not name.startswith(("format/", "shards/skz/"))
    ]
    # the encoded rows keep the document's order (rows merged in LAYER_GAPS stay merged)
    for (pos_a, layer_a), (pos_b, layer_b) in itertools.pairwise(seen):
        assert pos_a <= pos_b or layer_a == layer_b, (pos_a, pos_b)


# --- the instrument, proven on small packages ---------------------------------------------


def write_package(tmp_path, files: dict[str, str], name: str = "pkg"):
    root = tmp_path / name
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


FLAT = [("a.py",), ("b.py",), ("c.py",), ("__init__.py", "sub/")]


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    root = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from .b import thing\n",
            "b.py": "thing = 1\n\ndef later():\n    from .a import other\n    return other\n",
            "c.py": "import pkg.a\n",
        },
    )
    report = structure.analyze(root, FLAT)
    assert report.circles == [("pkg.a", "pkg.b")]
    [late] = report.function_level
    assert (late.importer, late.module, late.name) == ("pkg.b", "pkg.a", "other")
    # and the check fails on it
    assert circle_problems(report.circles, set()) == ["new import circle: ('pkg.a', 'pkg.b')"]
    # a known circle that is gone fails too
    gone = structure.analyze(write_package(tmp_path, {"__init__.py": "", "a.py": ""}, "q"))
    assert "remove it" in circle_problems(gone.circles, {("q.a", "q.b")})[0]
    # a known circle that grew into a larger one: the larger one is new
    assert circle_problems([("a", "b", "c")], {("a", "b")}) == [
        "new import circle: ('a', 'b', 'c')",
        "known circle ('a', 'b') is now part of a larger one",
    ]
    # a circle that shrank is no new one, but its old entry is stale
    assert circle_problems([("a", "b")], {("a", "b", "c")}) == [
        "known circle ('a', 'b', 'c') no longer occurs as listed: remove it from the allowlist"
        " (or replace it with the smaller circle that is left)"
    ]


def test_type_checking_imports_are_ignored(tmp_path):
    root = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": """\
                from typing import TYPE_CHECKING
                import typing
                from .b import thing
                if TYPE_CHECKING:
                    from .c import Hint
                if typing.TYPE_CHECKING:
                    from . import c
                else:
                    from .b import other
                """,
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n",
            "c.py": "",
        },
    )
    report = structure.analyze(root, FLAT)
    assert report.circles == []
    assert {(i.module, i.name) for i in report.imports} == {
        ("pkg.b", "thing"),
        ("pkg.b", "other"),
    }


def test_relative_and_submodule_imports_resolve(tmp_path):
    root = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "top.py": "value = 1\n",
            "sub/__init__.py": "from . import leaf\nfrom .leaf import name\n",
            "sub/leaf.py": "from .. import top\nfrom ..top import value\nimport pkg.sub.deep\n",
            "sub/deep/__init__.py": "from ...top import value\nfrom ... import top as t\n",
            "sub/kernels.pyi": "",
            "sub/uses.py": "from . import kernels\nfrom json import dumps\nimport os\n",
        },
    )
    report = structure.analyze(root, [("__init__.py", "top.py", "sub/")])
    got = {(i.importer, i.module, i.name) for i in report.imports}
    assert got == {
        ("pkg.sub", "pkg.sub.leaf", None),
        ("pkg.sub", "pkg.sub.leaf", "name"),
        ("pkg.sub.leaf", "pkg.top", None),
        ("pkg.sub.leaf", "pkg.top", "value"),
        ("pkg.sub.leaf", "pkg.sub.deep", None),
        ("pkg.sub.deep", "pkg.top", "value"),
        ("pkg.sub.deep", "pkg.top", None),
        ("pkg.sub.uses", "pkg.sub.kernels", None),  # a compiled module (its stub)
    }
    assert report.layer_violations == set()
    assert report.modules["pkg.sub.deep"].subpackage == "pkg.sub.deep"
    assert report.modules["pkg.sub.leaf"].subpackage == "pkg.sub"


def test_a_private_name_imported_across_subpackages_is_found(tmp_path):
    root = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "core.py": "_hidden = 1\n__dunder__ = 2\n",
            "_private_module.py": "public = 1\n",
            "inner.py": "from .core import _hidden\n",  # same subpackage: allowed
            "sub/__init__.py": "from .mod import _own\n",  # same subpackage: allowed
            "sub/mod.py": """\
                _own = 1
                from ..core import _hidden, __dunder__
                from .. import _private_module
                def f():
                    from pkg.core import _hidden as again
                """,
        },
    )
    report = structure.analyze(
        root, [("__init__.py", "core.py", "_private_module.py", "inner.py", "sub/")]
    )
    assert report.private_imports == {("pkg.sub.mod", "pkg.core", "_hidden")}
    problems = set_problems("private import", report.private_imports, set())
    assert problems == ["new private import: ('pkg.sub.mod', 'pkg.core', '_hidden')"]
    stale = set_problems("private import", set(), {("pkg.x", "pkg.y", "_z")})
    assert "remove it from the allowlist" in stale[0]


def test_a_601_line_module_and_a_401_line_class_are_reported(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(400))
    root = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "long.py": "\n" * 601,
            "exact.py": "\n" * 600,
            "klass.py": "class Big:\n" + body + "    class Inner:\n        pass\n",
        },
    )
    report = structure.analyze(root, [("__init__.py", "long.py", "exact.py", "klass.py")])
    assert report.module_lines["pkg.long"] == 601
    assert report.long_modules() == {"pkg.long": 601}
    assert report.long_classes() == {("pkg.klass", "Big"): 403}
    assert report.class_lines[("pkg.klass", "Big.Inner")] == 2
    limit = structure.MAX_MODULE_LINES
    assert size_problems("module", report.module_lines, {}, limit) == [
        "new module over 600 lines: pkg.long (601 lines)"
    ]
    assert (
        "grew to 601" in size_problems("module", report.module_lines, {"pkg.long": 600}, limit)[0]
    )
    assert size_problems("module", report.module_lines, {"pkg.long": 700}, limit) == []
    shrunk = size_problems("module", {"pkg.exact": 600}, {"pkg.exact": 650}, limit)
    assert shrunk == [
        "known module pkg.exact is no longer over 600 lines (600): remove it from the allowlist"
    ]


def test_an_import_up_the_layer_order_is_found(tmp_path):
    root = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "top.py": "from .low import x\n",
            "low.py": "x = 1\ndef f():\n    from .top import y\n",
            "ordered/__init__.py": "from .second import z\n",
            "ordered/first.py": "from .second import z\n",  # first may not import second
            "ordered/second.py": "z = 1\n",
            "loose.py": "",
        },
    )
    layers = [
        ("__init__.py", "top.py"),
        ("low.py",),
        [("ordered/__init__.py",), ("ordered/second.py",), ("ordered/first.py",)],
    ]
    report = structure.analyze(root, layers)
    assert report.layer_violations == {
        ("pkg.low", "pkg.top"),
        ("pkg.ordered.first", "pkg.ordered.second"),
    }
    assert report.unplaced == {"pkg.loose"}
    assert set_problems("layer", report.layer_violations, {("pkg.low", "pkg.top")}) == [
        "new layer: ('pkg.ordered.first', 'pkg.ordered.second')"
    ]


def test_the_command_line_report_prints_the_counts(capsys):
    assert structure.main([]) == 0
    out = capsys.readouterr().out
    for heading in (
        "import circles:",
        "function-level imports:",
        "private names across subpackages:",
        "modules over 600 lines:",
        "classes over 400 lines:",
        "layer-order violations:",
    ):
        assert heading in out
