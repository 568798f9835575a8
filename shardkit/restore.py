"""restore_into: copy a checkpoint's tensors into the caller's existing arrays and tensors."""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from .dtypes import numpy_dtype, safetensors_name
from .errors import RestoreMismatchError, UnsupportedDTypeError
from .reader import CheckpointReader
from .tensors import flatten, to_host


def restore_into(path: str | os.PathLike[str], state: Mapping[str, Any], *,
                 verify: bool = False, follow_symlinks: bool = False) -> list[str]:
    """Copy the stored value of every leaf of `state` (numpy arrays, torch tensors) into it, in
    place. Every leaf is checked (key present, shape, dtype) before anything is copied.
    `follow_symlinks`: read shard files and index.json that are symlinks (refused by default).
    Returns the restored keys."""
    leaves = flatten(state)
    with CheckpointReader(path, follow_symlinks=follow_symlinks) as reader:
        plans = []
        for key, leaf in leaves:
            t = reader._tensor(key)
            target, writeback = _restore_target(leaf, key)
            expected = numpy_dtype(t.dtype)
            found = target.dtype
            if found.byteorder == ">":
                found = found.newbyteorder("<")
            if tuple(target.shape) != t.shape or found != expected:
                raise RestoreMismatchError(
                    f"cannot restore key {key!r} from {reader.path}: the checkpoint has "
                    f"shape {list(t.shape)} dtype {_dtype_label(expected)}, the target has "
                    f"shape {list(target.shape)} dtype {_dtype_label(target.dtype)}"
                )
            if writeback is None and not target.flags.writeable:
                raise RestoreMismatchError(
                    f"cannot restore key {key!r}: the target array is read-only"
                )
            plans.append((key, target, writeback))
        if verify:
            reader.verify([key for key, _, _ in plans])
        direct = reader._read_direct([(key, target) for key, target, _ in plans])
        for key, target, writeback in plans:
            if key in direct:
                if writeback is not None:
                    _torch_copy_back(writeback, target)
                continue
            stored = reader.get(key)
            if target.dtype.byteorder == ">":
                np.copyto(target, stored, casting="equiv")
            else:
                np.copyto(target, stored, casting="no")
            if writeback is not None:
                _torch_copy_back(writeback, target)
    return [key for key, _, _ in plans]


def _dtype_label(dt: np.dtype) -> str:
    try:
        return f"{safetensors_name(dt)} ({dt})"
    except UnsupportedDTypeError:
        return str(dt)


def _restore_target(leaf: Any, key: str) -> tuple[np.ndarray, Any]:
    """A numpy array sharing memory with `leaf`, and the torch tensor to copy back into when
    the leaf does not live in host memory (else None)."""
    if isinstance(leaf, np.ndarray):
        return leaf, None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(leaf, torch.Tensor):
        if leaf.device.type == "cpu" and not (leaf.is_conj() or leaf.is_neg()):
            array, _ = to_host(leaf, key)  # a view of the tensor's memory on CPU
            return array, None
        array, _ = to_host(leaf, key)
        return np.array(array), leaf
    raise RestoreMismatchError(
        f"cannot restore key {key!r} in place into a {type(leaf).__name__}: only numpy arrays "
        "and torch tensors can be restored in place (use load() for a new dict)"
    )


def _torch_copy_back(tensor: Any, host: np.ndarray) -> None:
    import torch

    if tensor.dtype in (torch.bfloat16, getattr(torch, "float8_e4m3fn", None),
                        getattr(torch, "float8_e5m2", None)):
        carrier = np.int16 if host.dtype.itemsize == 2 else np.uint8
        src = torch.from_numpy(host.view(carrier)).view(tensor.dtype)
    else:
        src = torch.from_numpy(host)
    with torch.no_grad():
        tensor.copy_(src)
