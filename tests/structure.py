"""The package's structure, measured by reading its source (issue 22, item 8).

Every module of a package is parsed with `ast`; nothing is imported or executed. What it finds:

- **Imports.** Every ``import`` and ``from ... import`` statement, at module level and inside
  functions (a function-level import is one with a ``def`` / ``async def`` around it), except
  the body of an ``if TYPE_CHECKING:`` (or ``if typing.TYPE_CHECKING:``) block, which never runs
  (its ``else:`` does, and is read). Relative imports are resolved against the importer's
  package. ``from pkg import name`` is an import of the module ``pkg.name`` when that module
  exists, else an import of the name ``name`` from ``pkg`` (its ``__init__.py``). ``import a.b.c``
  is an import of ``a.b.c``. Only imports of the package's own modules are edges; an import of
  a module deeper than the package has (``from .x.y import z`` where ``x.y`` is not a module)
  is an edge to the longest prefix that is one. An import of ``pkg.sub`` is not also an edge to
  ``pkg``, although Python runs ``pkg/__init__.py`` first: every submodule would otherwise be in
  a circle with a package that re-exports it. Not seen (they are no statements): imports made
  by ``importlib.import_module``, ``optional.lazy_import`` and the package's
  ``optional.lazy_attributes`` tables, whose module names are strings.
- **Circles**: the strongly connected components of more than one module of the import graph
  (module-level and function-level edges alike), each as the sorted tuple of its modules.
- **Private names across subpackages.** A module's *subpackage* is the package that directly
  contains it: for ``shardkit/format/header.py`` that is ``shardkit.format``, for
  ``shardkit/errors.py`` it is ``shardkit`` (the root package counts as one of them), and for
  a package's ``__init__.py`` the package itself. A private name is a name with one leading
  underscore (``_x``, not a dunder) imported with ``from m import _x`` where ``m._x`` is not a
  module. Such an import is *across subpackages* when the importer's subpackage is not the
  subpackage of ``m`` (the module the name is imported from). Private *modules* (``_kernels``,
  ``_reference``, ``_threads``, ``_moved``) are not counted: they are the package's shared
  internals, placed in the layer order like any module.
- **Sizes**: each module's line count (lines of its file) and each class's
  (``end_lineno - lineno + 1`` of its ``class`` statement; nested classes named
  ``Outer.Inner``).
- **Layer order**: `LAYERS`, the order of docs/ARCHITECTURE.md, "Modules, top to bottom"
  ("Imports point down this list only"). An import from a module to one on a row above it is a
  violation; modules on one row may import each other (the doc gives no order among them),
  except where the doc orders them (`format/`: "each importing only those before it").
  `LAYER_GAPS` says where the doc's order had to be completed to be encoded.

``python tests/structure.py`` prints the counts and the lists for shardkit/. The checks with
their allowlists of today's violations are in tests/test_structure.py.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "shardkit"

# The layer order of docs/ARCHITECTURE.md ("Modules, top to bottom": "Imports point down this list
# only"), one row per line of its table, top first, with the table's own spelling: a path
# ending in "/" is every module under that folder that no more specific entry names; a file
# is that module. A module takes the row of its most specific entry. Rows given as a list of
# lists are ordered within themselves (top first).
LAYERS: list[tuple[str, ...] | list[tuple[str, ...]]] = [
    ("tools/", "__main__.py"),
    ("training/",),
    ("io/snapshot.py",),
    ("io/save.py",),
    ("distributed/save.py", "distributed/routing.py", "distributed/whole.py"),
    ("io/flow.py",),
    ("io/writer.py",),
    ("io/restore.py",),
    ("io/reader.py",),
    ("io/reading/",),
    ("io/options.py", "io/__init__.py"),
    # the table's lines "adapters/" and "adapters/tensorbundle/": one row (see LAYER_GAPS)
    ("adapters/", "adapters/tensorbundle/"),
    # the table's lines of storage/: one row, as its "Layers" paragraph has it
    ("storage/",),
    ("shards/raw.py", "shards/__init__.py"),
    # shards/skz/: "Its modules, each importing only those before it: container.py; codec.py;
    # writer.py; verify.py; reader.py; __init__.py re-exports the names other modules use"
    [
        ("shards/skz/__init__.py",),
        ("shards/skz/reader.py",),
        ("shards/skz/verify.py",),
        ("shards/skz/writer.py",),
        ("shards/skz/codec.py",),
        ("shards/skz/container.py", "shards/skz/"),
    ],
    ("shards/files.py",),
    # format/: "Its modules, each importing only those before it: common.py; strictjson.py;
    # header.py; string_section.py; index.py; index_encoding.py; index_decoding.py; __init__.py
    # re-exports every name"
    [
        ("format/__init__.py",),
        ("format/index_decoding.py",),
        ("format/index_encoding.py",),
        ("format/index.py",),
        ("format/string_section.py",),
        ("format/header.py",),
        ("format/strictjson.py",),
        ("format/common.py", "format/"),
    ],
    ("sharding/__init__.py", "sharding/policies.py"),
    ("sharding/tf_saver_callback.py",),
    ("sharding/callback.py",),
    ("sharding/tf_sharding.py",),
    ("sharding/structure.py",),
    ("sharding/tensors.py",),
    ("distributed/",),  # "distributed/ (but save.py, routing.py)"
    ("coordinator.py",),
    ("frameworks/",),
    ("values/",),
    ("__init__.py", "_moved.py"),  # not in the table: see LAYER_GAPS
    ("optional.py",),
    ("errors.py",),
    ("_threads.py",),
    ("_kernels/",),
    ("_reference/",),
]

LAYER_GAPS = (
    "the package's own __init__.py is not in the table; it is placed just above optional.py, "
    "the lowest row its own imports allow: at module level it imports optional and errors "
    "only, and its public names load from the modules above through optional.lazy_attributes, "
    "which no import statement shows (so `from shardkit import __version__` is no violation)",
    "the table gives storage/ three lines (the seam, local, object stores), but its 'Layers' "
    "paragraph places storage/ as one layer, and every storage module imports the seam "
    "(storage.base) the lines above it own: encoded as one row",
    "the table's line adapters/tensorbundle/ stands under adapters/, whose adapters it is one of "
    "(adapters/__init__.py detects it, its adapter subclasses adapters.base): encoded as one row",
    "rows name no order among their own modules (tools/ / __main__, training/, storage/, "
    "adapters/, frameworks/, distributed/, values/): they may import each other",
    "format/ and shards/skz/ are one line of the table each, ordered within by their own "
    "sentence ('each importing only those before it'); a new module of either goes with its "
    "lowest module (common.py, container.py) until the doc places it",
    "the rule that only io/save.py and training/checkpoint.py import distributed/save.py and "
    "distributed/routing.py ('Many processes') is not encoded beyond the row order",
)


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    module: str  # the package's module imported (or imported from)
    name: str | None  # the name imported from `module`, None when the module itself is
    line: int
    function_level: bool


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    lines: int
    tree: ast.Module
    compiled: bool = False  # an extension module: its `.pyi` stub or built file, no source

    @property
    def subpackage(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclass
class Report:
    package: str
    modules: dict[str, Module]
    imports: list[Import]
    circles: list[tuple[str, ...]]
    private_imports: set[tuple[str, str, str]]
    module_lines: dict[str, int]
    class_lines: dict[tuple[str, str], int]
    layer_of: dict[str, tuple[int, int] | None] = field(default_factory=dict)
    layer_violations: set[tuple[str, str]] = field(default_factory=set)

    @property
    def function_level(self) -> list[Import]:
        return [i for i in self.imports if i.function_level]

    @property
    def edges(self) -> set[tuple[str, str]]:
        return {(i.importer, i.module) for i in self.imports if i.importer != i.module}

    def long_modules(self, limit: int = MAX_MODULE_LINES) -> dict[str, int]:
        return {m: n for m, n in self.module_lines.items() if n > limit}

    def long_classes(self, limit: int = MAX_CLASS_LINES) -> dict[tuple[str, str], int]:
        return {c: n for c, n in self.class_lines.items() if n > limit}

    @property
    def unplaced(self) -> set[str]:
        return {m for m, layer in self.layer_of.items() if layer is None}


def find_modules(root: Path) -> dict[str, Module]:
    """Every ``.py`` module under the package folder `root`, by dotted name."""
    root = Path(root)
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = rel.parts
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        # only folders that are packages (an __init__.py on the way down)
        if not all(
            (root.parent.joinpath(*parts[:k]) / "__init__.py").exists()
            for k in range(1, len(parts) if not is_package else len(parts) + 1)
        ):
            continue
        text = path.read_text(encoding="utf-8")
        name = ".".join(parts)
        found[name] = Module(
            name, path, is_package, len(text.splitlines()), ast.parse(text, str(path))
        )
    # compiled modules (``_kernels/_gather.pyi`` beside ``_gather.cpython-*.so``): imports of
    # them are module imports, in their folder's layer; they have no source to read
    for path in sorted([*root.rglob("*.pyi"), *root.rglob("*.so"), *root.rglob("*.pyd")]):
        folder = ".".join(path.parent.relative_to(root.parent).parts)
        name = f"{folder}.{path.name.split('.')[0]}"
        if folder in found and name not in found:
            found[name] = Module(name, path, False, 0, ast.Module(body=[], type_ignores=[]), True)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> Iterable[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Each import statement that can run, with whether a function is around it."""

    def walk(node: ast.AST, in_function: bool):
        for child in ast.iter_child_nodes(node):
            yield from walk_one(child, in_function)

    def walk_one(node: ast.AST, in_function: bool):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for sub in node.orelse:  # the body never runs; `else:` does
                yield from walk_one(sub, in_function)
            return
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from walk(node, inner)

    yield from walk(tree, False)


def _known(name: str, modules: dict[str, Module]) -> str | None:
    """`name` if it is a module, else its longest prefix that is one."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def resolve_imports(module: Module, modules: dict[str, Module]) -> list[Import]:
    """The imports of `module` that reach a module of the package."""
    out = []
    for node, in_function in _import_nodes(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name, modules)
                if target is not None:
                    out.append(Import(module.name, target, None, node.lineno, in_function))
            continue
        if node.level:
            base_parts = module.subpackage.split(".")
            up = node.level - 1
            if up >= len(base_parts):
                continue  # beyond the top: not the package's
            base = ".".join(base_parts[: len(base_parts) - up])
            if node.module:
                base = f"{base}.{node.module}"
        else:
            base = node.module or ""
        source = _known(base, modules)
        if source is None:
            continue  # another distribution's module
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if source == base and sub in modules:
                out.append(Import(module.name, sub, None, node.lineno, in_function))
            else:
                out.append(Import(module.name, source, alias.name, node.lineno, in_function))
    return out


def strongly_connected(edges: set[tuple[str, str]]) -> list[tuple[str, ...]]:
    """Tarjan's components of more than one node, each sorted, the list sorted."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        # iterative DFS: (node, iterator over its successors)
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        work = [(start, iter(graph[start]))]
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(tuple(sorted(component)))
    return sorted(found)


def class_lines(module: Module) -> dict[tuple[str, str], int]:
    """Each class of `module`, by (module, qualified name), with its line count."""
    out: dict[tuple[str, str], int] = {}

    def visit(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}"
                out[(module.name, name)] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(module.tree, "")
    return out


def layer_table(layers=None) -> list[tuple[str, tuple[int, int]]]:
    """(module path or folder spelled as in the doc, its (row, place in row))."""
    out = []
    for row, entry in enumerate(LAYERS if layers is None else layers):
        subrows = entry if isinstance(entry, list) else [entry]
        for sub, names in enumerate(subrows):
            for name in names:
                out.append((name, (row, sub)))
    return out


def layer_of(module: Module, table) -> tuple[int, int] | None:
    """The (row, place) of `module` in `table`: its file's entry, else its closest folder's."""
    rel = module.name.split(".")[1:]
    path = "/".join([*rel, "__init__.py"] if module.is_package else rel) + (
        "" if module.is_package else ".py"
    )
    best = None
    for name, layer in table:
        if name == path:
            return layer
        if (
            name.endswith("/")
            and path.startswith(name)
            and (best is None or len(name) > len(best[0]))
        ):
            best = (name, layer)
    return best[1] if best else None


def analyze(root: Path = PACKAGE_DIR, layers=None) -> Report:
    """Measure the package whose folder is `root`; `layers` defaults to `LAYERS`."""
    root = Path(root)
    modules = find_modules(root)
    imports = []
    for module in modules.values():
        imports.extend(resolve_imports(module, modules))
    report = Report(
        package=root.name,
        modules=modules,
        imports=imports,
        circles=[],
        private_imports=set(),
        module_lines={m.name: m.lines for m in modules.values() if not m.compiled},
        class_lines={},
    )
    report.circles = strongly_connected(report.edges)
    for imp in imports:
        name = imp.name
        if (
            name
            and name.startswith("_")
            and not (name.startswith("__") and name.endswith("__"))
            and modules[imp.importer].subpackage != modules[imp.module].subpackage
        ):
            report.private_imports.add((imp.importer, imp.module, name))
    for module in modules.values():
        report.class_lines.update(class_lines(module))
    table = layer_table(layers)
    report.layer_of = {m.name: layer_of(m, table) for m in modules.values()}
    for a, b in report.edges:
        la, lb = report.layer_of[a], report.layer_of[b]
        if la is not None and lb is not None and la > lb:
            report.layer_violations.add((a, b))
    return report


def short(name: str) -> str:
    """``shardkit.format.header`` as ``format.header`` (the package's name off)."""
    return name.partition(".")[2] or name


def render(report: Report) -> str:
    long_modules = report.long_modules()
    long_classes = report.long_classes()
    function_level = report.function_level
    lines = [
        f"structure of {report.package}/ ({len(report.module_lines)} modules, "
        f"{sum(report.module_lines.values())} lines; read with ast, nothing imported)",
        f"  import circles:                      {len(report.circles)} "
        f"({len({m for c in report.circles for m in c})} modules)",
        f"  function-level imports:              "
        f"{len({(i.importer, i.line) for i in function_level})} statements "
        f"({len(function_level)} names or modules, in "
        f"{len({i.importer for i in function_level})} modules)",
        f"  private names across subpackages:    {len(report.private_imports)}",
        f"  modules over {MAX_MODULE_LINES} lines:               {len(long_modules)}",
        f"  classes over {MAX_CLASS_LINES} lines:               {len(long_classes)}",
        f"  layer-order violations:              {len(report.layer_violations)}",
        f"  modules the layer table does not place: {len(report.unplaced)}",
        "",
        "import circles:",
    ]
    for circle in report.circles:
        lines.append("  " + " <-> ".join(short(m) for m in circle))
        members = set(circle)
        statements = sorted(
            {
                (i.importer, i.line, i.module, i.function_level)
                for i in report.imports
                if i.importer in members and i.module in members and i.importer != i.module
            }
        )
        lines += [
            f"      {short(a)}:{line} -> {short(b)}" + ("  (in a function)" if f else "")
            for a, line, b, f in statements
        ]
    lines.append("private names across subpackages (importer: module._name):")
    lines += [f"  {short(a)}: {short(m)}.{n}" for a, m, n in sorted(report.private_imports)]
    lines.append(f"modules over {MAX_MODULE_LINES} lines:")
    lines += [f"  {short(m)}: {n}" for m, n in sorted(long_modules.items(), key=lambda x: -x[1])]
    lines.append(f"classes over {MAX_CLASS_LINES} lines:")
    lines += [
        f"  {short(m)}.{c}: {n}" for (m, c), n in sorted(long_classes.items(), key=lambda x: -x[1])
    ]
    lines.append("layer-order violations (importer -> module above it, docs/ARCHITECTURE.md):")
    lines += [f"  {short(a)} -> {short(b)}" for a, b in sorted(report.layer_violations)]
    if report.unplaced:
        lines.append("modules the layer table does not place:")
        lines += [f"  {short(m)}" for m in sorted(report.unplaced)]
    lines.append("function-level imports (importer:line -> module[.name]):")
    lines += [
        f"  {short(i.importer)}:{i.line} -> {short(i.module)}" + (f".{i.name}" if i.name else "")
        for i in sorted(function_level, key=lambda i: (i.importer, i.line, i.module))
    ]
    lines.append("where the layer table completes docs/ARCHITECTURE.md:")
    lines += [f"  - {gap}" for gap in LAYER_GAPS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else PACKAGE_DIR
    print(render(analyze(root)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
