"""Framework tensors <-> host numpy arrays: the one registry every path converts through.

This core dispatches to one module per framework (`torch.py`, `jax.py`, `tensorflow.py`), each
with the same functions: `owns`, `to_host` (without a copy where the framework allows it: save,
the async snapshot), `from_host` and `converter` (``load(..., framework=, device=)``, the device
checked once, before anything is read), `restore_target` / `copy_into` (in place, for
`restore_into`), `host_dtype`, `new_like`; the dtypes map in one table, `shardkit.values.dtypes`. A
framework's module is imported only once the framework is (`loaded`) or asked for; `kind_of`
answers from ``sys.modules``, so ``import shardkit`` imports no framework. numpy is the identity.
"""

from __future__ import annotations

import gc
import importlib
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import numpy as np

from ..errors import (
    InvalidArgumentError,
    InvalidArgumentTypeError,
    MissingDependencyError,
    UnsupportedDTypeError,
)
from ..optional import require
from ..values.devices import DeviceSpec
from ..values.dtypes import STORABLE_NAMES, is_supported

FRAMEWORKS: tuple[str, ...] = ("numpy", "torch", "jax", "tensorflow")
"""The values of ``framework=``: "numpy" (the default), "torch", "jax", "tensorflow"."""

Converter = Callable[[np.ndarray, str], Any]
"""Converts one stored array (and names its key in errors) to a framework tensor."""

_OPTIONS = "'numpy' (the default), 'torch', 'jax' or 'tensorflow'"
_NAMES = FRAMEWORKS[1:]  # each the name of its own top-level module and of ours
_MODULES: dict[str, ModuleType] = {}
_KINDS: dict[type, tuple[tuple[bool, ...], str | None]] = {}  # type -> (imported, framework)


def module(name: str) -> ModuleType:
    """shardkit's module for framework `name` ("torch", "jax", "tensorflow"); imports it."""
    got = _MODULES.get(name)
    if got is None:
        got = _MODULES[name] = importlib.import_module(f"{__name__}.{name}")
    return got


def loaded(name: str) -> ModuleType | None:
    """`module(name)` if the framework itself is imported already, else None (without
    importing anything): the one check of ``sys.modules`` for a framework."""
    return module(name) if sys.modules.get(name) is not None else None


def kind_of(value: Any) -> str | None:
    """The framework whose tensor `value` is ("torch", "jax", "tensorflow"; its module's
    `owns`), None for anything else. Imports no framework (a tensor of one exists only once it
    is imported); decided once per type (for None: while no other framework is imported)."""
    known = _KINDS.get(type(value))
    if known is not None and known[1] is not None:
        return known[1]
    mods = sys.modules
    present = (mods.get("torch") is not None, mods.get("jax") is not None,
               mods.get("tensorflow") is not None)
    if known is not None and known[0] == present:
        return None
    kind = next((n for n, here in zip(_NAMES, present) if here and module(n).owns(value)), None)
    _KINDS[type(value)] = (present, kind)
    return kind


def is_variable(value: Any) -> bool:
    """A TensorFlow or Keras variable (restored in place with ``assign``)."""
    tfw = loaded("tensorflow")
    return tfw is not None and bool(tfw.is_variable(value))


def dtensor_type() -> type | None:
    """The DTensor class if torch.distributed.tensor is loaded (else no value can be one)."""
    found = sys.modules.get("torch.distributed.tensor")
    return getattr(found, "DTensor", None) if found is not None else None


def is_dtensor(value: Any) -> bool:
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(value, dtensor)


# --- values in -----------------------------------------------------------------------------------


def to_host(value: Any, key: str = "") -> tuple[np.ndarray, DeviceSpec | None]:
    """A host numpy array for `value` and the device it came from (None for host memory)."""
    if type(value) is np.ndarray:
        array, dev = value, None
    elif (kind := kind_of(value)) is not None:
        try:
            array, dev = module(kind).to_host(value)
        except Exception as e:  # sparse or meta tensors, deleted or unaddressable arrays...
            raise UnsupportedDTypeError(
                f"{key!r}: cannot copy this {kind} {type(value).__name__} to a host array: "
                f"{e}") from e
    else:
        try:
            array, dev = np.asarray(value), None
        except Exception as e:
            raise UnsupportedDTypeError(
                f"{key!r}: cannot convert {type(value).__name__} to an array: {e}"
            ) from e
        if array.dtype.kind in "OUSV" and not isinstance(value, (np.ndarray, np.generic)):
            raise UnsupportedDTypeError(_not_a_tensor(key, value))
    dt = array.dtype
    if dt.byteorder == ">":
        if not is_supported(dt):
            raise UnsupportedDTypeError(f"{key!r}: dtype {dt} cannot be stored")
        array = array.astype(dt.newbyteorder("<"))
    elif not is_supported(dt):
        # ml_dtypes' types are of kind "V" too, but numbers (float4_e2m1fn, int4): no such hint
        raw = dt.kind in "OUS" or dt.type is np.void
        hint = "; strings and objects go in metadata=" if raw else ""
        raise UnsupportedDTypeError(
            f"{key!r}: dtype {dt} cannot be stored (supported: {', '.join(STORABLE_NAMES)})"
            f"{hint}"
        )
    return array, dev


def _not_a_tensor(key: str, value: Any) -> str:
    """Why a Python value that is not numeric data cannot be a tensor, and where it can go."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (f"{key!r}: int {value} does not fit in 64 bits; store it as a float, or in "
                "save(..., metadata={...})")
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    name = type(value).__name__
    what = "None" if value is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name} ({shown})"
    return (f"{key!r}: {what} is not an array or a number, so it cannot be a tensor; "
            "put it in save(..., metadata={...}), which takes JSON values (str, numbers, bools, "
            "None, lists, dicts)")


def string_to_host(value: Any) -> tuple[np.ndarray, DeviceSpec | None] | None:
    """A string tensor (a numpy array or scalar of bytes, str or objects; a tf.string tensor or
    variable, as an object array of bytes, a copy) as a host array and its device (None for
    numpy); None for a value that is none."""
    if isinstance(value, (np.ndarray, np.generic)):
        return (np.asarray(value), None) if value.dtype.kind in "OSU" else None
    if kind_of(value) == "tensorflow" and (tfw := module("tensorflow")).tf_is_string(value):
        return tfw.string_to_host(value)  # type: ignore[no-any-return]
    return None


def memory_key(value: Any) -> tuple[Any, ...] | None:
    """What makes two framework tensors one memory: for torch tensors their device, address,
    shape, strides and dtype (two views of one storage compare equal; None when empty), for
    other frameworks' tensors and variables the object itself (a TensorFlow variable reached
    from a model and its optimizer); None for anything else (a numpy scalar is a value, and
    equal ones may be one cached object)."""
    kind = kind_of(value)
    if kind == "torch":
        return module("torch").memory_key(value)
    if kind is not None or is_variable(value):
        return ("object", id(value))
    return None


def module_state(state: Any) -> Any:
    """A torch ``nn.Module``'s ``state_dict()`` (tensors sharing the module's memory), as
    ``torch.save`` and ``load_state_dict`` users pass it; anything else unchanged."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(state, torch.nn.Module):
        return state.state_dict()
    return state


def expand_objects(state: Any, targets: bool = False) -> Any:
    """`state` with TensorFlow objects (tf.Module, Keras models and optimizers...) flattened to
    TensorFlow's checkpoint keys (`tensorflow.expand`), for restore `targets` their variables
    under those keys; anything else unchanged."""
    tfw = loaded("tensorflow")
    return state if tfw is None else (tfw.expand_targets if targets else tfw.expand)(state)


# --- values out ----------------------------------------------------------------------------------


def converter(framework: str = "numpy", device: Any = None) -> Converter | None:
    """The function that turns a loaded array into a `framework` tensor on `device`, or None
    when the arrays stay numpy arrays (framework "numpy", device None or "cpu").

    Checks everything it can before any tensor is read: an unknown framework or a device the
    framework cannot hold data on raises InvalidArgumentError, a framework that is not
    installed MissingDependencyError.
    """
    if framework == "numpy":
        if device is None or device == "cpu":
            return None
        raise InvalidArgumentError(
            f"device={device!r} with framework='numpy': numpy arrays live in host memory "
            "(use device=None or 'cpu', or framework='torch' / 'jax' for a device)")
    if not isinstance(framework, str):
        raise InvalidArgumentTypeError(
            f"framework must be a str, {_OPTIONS}; got {type(framework).__name__}")
    if framework not in FRAMEWORKS:
        raise InvalidArgumentError(f"unknown framework {framework!r}; choose {_OPTIONS}")
    try:
        require(framework, f"framework={framework!r}")
    except MissingDependencyError as e:
        raise MissingDependencyError(f"{e}; or choose another of {_OPTIONS}") from None
    conv: Converter = module(framework).converter(device)
    return conv


def convert_all(arrays: Mapping[str, np.ndarray], conv: Converter | None, *,
                tied: bool = False) -> dict[str, Any]:
    """Every array of `arrays` through `conv`, in order (the same arrays when `conv` is None).
    `tied`: some keys hold the same array (aliases), each converted once so that they stay
    one tensor."""
    if conv is None:
        return dict(arrays)
    with gc_paused():  # tens of thousands of new tensors: one GC pass at the end
        if not tied:
            return dict(zip(arrays, map(conv, arrays.values(), arrays)))
        done: dict[int, Any] = {}
        return {k: done[id(a)] if id(a) in done else done.setdefault(id(a), conv(a, k))
                for k, a in arrays.items()}


@contextmanager
def gc_paused() -> Iterator[None]:
    """Creating a million small objects triggers many useless cyclic-GC passes."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# --- restoring in place --------------------------------------------------------------------------


def restore_target(leaf: Any, key: str) -> tuple[np.ndarray, Any] | None:
    """For a framework tensor or variable `leaf`: a host array to restore it through (its own
    memory where it can be) and what to give the restored array to afterwards (None when the
    array is the leaf's memory; else a callable or the tensor, for `copy_into`); None for a
    leaf no framework restores in place."""
    if kind_of(leaf) == "torch":
        return module("torch").restore_target(leaf, key)  # type: ignore[no-any-return]
    tfw = loaded("tensorflow")  # its variables (Keras' too); jax arrays are immutable
    return None if tfw is None else tfw.restore_target(leaf, key)  # type: ignore[no-any-return]


def copy_into(target: Any, array: np.ndarray) -> None:
    """Copy the stored `array` into `target` in place: a numpy array (of either byte order), a
    framework tensor or variable, or the callable `restore_target` gave (an assign)."""
    if isinstance(target, np.ndarray):
        np.copyto(target, array, casting="equiv")
    elif callable(target):
        target(array)
    else:  # a TensorFlow variable when no framework owns it: a Keras one
        module(kind_of(target) or "tensorflow").copy_into(target, array)


__all__ = ["FRAMEWORKS", "Converter", "convert_all", "converter", "copy_into", "dtensor_type",
           "expand_objects", "gc_paused", "is_dtensor",
           "is_variable", "kind_of", "loaded", "module", "restore_target", "string_to_host",
           "to_host"]
