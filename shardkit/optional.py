"""Imports on first use: the optional packages and the core ones that take long to import.

`lazy_import(name, needed_for)` stands in for module `name` and imports it at its first
attribute access; `require(name, needed_for)` imports it now. Both raise
MissingDependencyError naming the extra that installs a missing package, so that
``import shardkit`` imports numpy and the kernels only (docs/ARCHITECTURE.md) and every other
package is imported by the call that needs it.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable
from typing import Any, Final

from .errors import MissingDependencyError

EXTRAS: Final[dict[str, tuple[str, str]]] = {
    "google": ("protobuf", "tensorbundle"),
    "google_crc32c": ("google-crc32c", "tensorbundle"),
    "fsspec": ("fsspec", "s3"),
    "s3fs": ("s3fs", "s3"),
    "torch": ("torch", "torch"),
    "jax": ("jax", "jax"),
    "jaxlib": ("jax", "jax"),
    "tensorflow": ("tensorflow-cpu", "tensorflow"),
    "matplotlib": ("matplotlib", "plot"),
    "safetensors": ("safetensors", "huggingface"),
}
"""Top-level module -> (the distribution that provides it, the shardkit extra that installs
it). Modules not listed here are core dependencies."""


def missing(name: str, needed_for: str, cause: BaseException | None = None
            ) -> MissingDependencyError:
    """The MissingDependencyError saying what to install for module `name`, which `needed_for`
    (e.g. "reading a TensorFlow checkpoint") needs; `cause`, the ImportError, may name a
    dependency of it as the one missing."""
    top = name.partition(".")[0]
    gone = getattr(cause, "name", None) or name
    if gone.partition(".")[0] in EXTRAS:  # the module's own dependency is the one missing
        top = gone.partition(".")[0]
    why = f" ({cause})" if cause is not None else ""
    if top in EXTRAS:
        dist, extra = EXTRAS[top]
        return MissingDependencyError(
            f"{needed_for} needs {dist}, which cannot be imported{why}: "
            f'pip install "shardkit[{extra}]" (or pip install {dist})')
    return MissingDependencyError(
        f"{needed_for} needs {name}, one of shardkit's own dependencies, which cannot be "
        f"imported{why}: reinstall shardkit (pip install shardkit)")


def require(name: str, needed_for: str) -> types.ModuleType:
    """Module `name`, imported now; MissingDependencyError (naming `needed_for`) when it, or a
    module it imports, is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise missing(name, needed_for, e) from None


class LazyModule(types.ModuleType):
    """Module `name`, imported at the first access to one of its attributes (then its
    attributes are copied in, so later accesses cost what a module's do)."""

    def __init__(self, name: str, needed_for: str) -> None:
        super().__init__(name)
        self.__needed_for = needed_for

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_LazyModule__"):
            raise AttributeError(attr)
        module = require(self.__name__, self.__needed_for)
        self.__dict__.update(module.__dict__)
        return getattr(module, attr)


def lazy_import(name: str, needed_for: str) -> Any:
    """A stand-in for module `name` that imports it on first use (`require`); typed Any, as
    modules import the real one under TYPE_CHECKING."""
    return LazyModule(name, needed_for)


def lazy_attributes(package: str, where: dict[str, str], namespace: dict[str, Any]
                    ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for package `package`: each name of `where` imported from
    its submodule (`where`: name -> submodule) on first access, any submodule by name; a name
    found is stored in `namespace`, the package's ``globals()``."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is not None:
            value = getattr(importlib.import_module(f"{package}.{module}"), name)
        elif not name.startswith("__"):
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return __getattr__, __dir__


__all__ = ["EXTRAS", "LazyModule", "lazy_attributes", "lazy_import", "missing", "require"]
