"""The module paths from before the role subpackages keep working for one release, with a warning.

Each runs in a fresh interpreter, so that no earlier import has put the module in sys.modules.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from shardkit._moved import MOVED, MOVED_NAMES, new_name

PROBE = textwrap.dedent("""
    import json, sys, warnings
    old = sys.argv[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(f"import {old}", "the_importer.py", "exec"), {})
    module = sys.modules[old]
    new = module.__name__
    print(json.dumps({
        "new": new,
        "same": sys.modules[old] is sys.modules[new] is module,
        "warnings": [(w.category.__name__, str(w.message), w.filename) for w in caught
                     if issubclass(w.category, DeprecationWarning)],
    }))
""")


def probe(old: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, old], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("old", ["reader", "formats.tensorbundle.adapter", "compression.reader",
                                 "frameworks.tf_sharding", "api", "_snapshot"])
def test_an_old_path_is_the_new_module_with_a_warning(old):
    got = probe(f"shardkit.{old}")
    assert got["new"] == new_name(f"shardkit.{old}")
    assert got["same"]
    # one warning per moved name on the path (a moved package first), each at the import
    last = got["warnings"][-1]
    assert last[:2] == ["DeprecationWarning", f"shardkit.{old} moved to {got['new']}; import "
                        "it from there (the old path goes in the next release)"]
    assert {w[2] for w in got["warnings"]} == {"the_importer.py"}


def test_every_old_path_names_a_module_that_exists():
    import importlib.util

    for old, new in MOVED.items():
        assert importlib.util.find_spec(f"shardkit.{new}") is not None, (old, new)


def test_a_path_that_never_existed_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        __import__("shardkit.no_such_module")
    assert new_name("shardkit.no_such_module") is None
    assert new_name("numpy.reader") is None
    assert new_name("shardkit.format") is None  # format/ did not move


NAME_PROBE = textwrap.dedent("""
    import json, sys, warnings
    import shardkit
    name = sys.argv[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(f"from shardkit import {name} as value", "the_importer.py", "exec"), g := {})
    print(json.dumps({
        "module": g["value"].__module__,
        "all": name in shardkit.__all__,
        "warnings": [(w.category.__name__, str(w.message), w.filename) for w in caught],
    }))
""")


@pytest.mark.parametrize("name", sorted(MOVED_NAMES))
def test_a_name_that_left_all_resolves_with_a_warning(name):
    out = subprocess.run([sys.executable, "-c", NAME_PROBE, name], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["module"] == f"shardkit.{MOVED_NAMES[name]}"
    assert not got["all"]
    # the same warning at the same line (the import machinery asks once, then the statement)
    assert {tuple(w) for w in got["warnings"]} == {(
        "DeprecationWarning",
        f"shardkit.{name} is no longer a top-level name; import it from "
        f"shardkit.{MOVED_NAMES[name]} (the old name goes in the next release)",
        "the_importer.py")}


def test_every_error_stays_importable_from_shardkit():
    import shardkit
    import shardkit.errors

    errors = [n for n, v in vars(shardkit.errors).items()
              if isinstance(v, type) and issubclass(v, Warning | shardkit.ShardkitError)]
    assert len(errors) > 40
    for name in errors:
        assert getattr(shardkit, name) is getattr(shardkit.errors, name), name
    assert len(shardkit.__all__) <= 32
