"""Old module paths (before the package was cut into role subpackages) as aliases that warn.

``import shardkit.reader`` still works for one release: it gives the module now at
``shardkit.io.reader`` itself (one module object, so patching either name patches both) and a
``DeprecationWarning`` naming the new path. docs/ARCHITECTURE.md lists where each module lives.
Names that left ``shardkit.__all__`` (`MOVED_NAMES`) likewise still resolve, with a warning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED = {  # old path under shardkit -> new path (a package maps everything under it)
    "keys": "values.keys",
    "dtypes": "values.dtypes",
    "devices": "values.devices",
    "slices": "values.slices",
    "slicing": "values.slicing",
    "strings": "values.strings",
    "tensors": "sharding.tensors",
    "callback": "sharding.callback",
    "policies": "sharding.policies",
    "frameworks.tf_sharding": "sharding.tf_sharding",
    "frameworks.tf_saver_callback": "sharding.tf_saver_callback",
    "compression": "shards.skz",
    "sources": "shards.raw",
    "files": "shards.files",
    "commit": "storage.commit",
    "formats": "adapters",
    "api": "io.save",
    "writer": "io.writer",
    "reader": "io.reader",
    "reading": "io.reading",
    "restore": "io.restore",
    "options": "io.options",
    "_snapshot": "io.snapshot",
    "checkpoint": "training.checkpoint",
    "tracked_state": "training.tracked_state",
    "cli": "tools.cli",
    "demo": "tools.demo",
    "profiling": "tools.profiling",
    "models": "tools.models",
    "pytest_plugin": "tools.pytest_plugin",
}


MOVED_NAMES = {  # a name no longer in shardkit.__all__ -> the module that defines it
    "shard_tensors": "sharding.callback",
    "shardable_tensors": "sharding.tensors",
    "parse_size": "sharding.policies",
    "check_tiling": "values.slices",
    "format_slice_spec": "values.slices",
    "parse_slice_spec": "values.slices",
    "PolicyProfile": "tools.profiling",
}


def moved_attribute(name: str) -> object:
    """``shardkit.<name>`` for a name in `MOVED_NAMES`, with a DeprecationWarning naming its
    module; AttributeError for any other name."""
    module = MOVED_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
    warnings.warn(f"shardkit.{name} is no longer a top-level name; import it from "
                  f"shardkit.{module} (the old name goes in the next release)",
                  DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(f"shardkit.{module}"), name)


def new_name(fullname: str) -> str | None:
    """The module an old ``shardkit.*`` path now names, or None if the path did not move."""
    parts = fullname.split(".")
    if parts[0] != "shardkit":
        return None
    for n in range(len(parts), 1, -1):
        moved = MOVED.get(".".join(parts[1:n]))
        if moved is not None:
            return ".".join(["shardkit", moved, *parts[n:]])
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds an old path first, so no second copy of a moved module is ever loaded."""

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        if new is None:
            return None
        # stacklevel 2: the import statement (warnings skips importlib's own frames)
        warnings.warn(f"{fullname} moved to {new}; import it from there (the old path goes "
                      "in the next release)", DeprecationWarning, stacklevel=2)
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
