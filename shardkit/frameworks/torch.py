"""torch tensors <-> host numpy arrays, without a copy on the CPU either way.

``Tensor.numpy()`` and ``torch.from_numpy`` share the memory (for a mapped shard: the writable
copy-on-write map, so in-place ops never reach the file). bfloat16 and float8, which numpy
holds as ml_dtypes and torch cannot exchange with numpy, go through an integer array of the same
width (`dtypes.carrier`) and ``Tensor.view(dtype)``: still the same memory. Only arrays torch
cannot share (negative strides from a reversed `get_slice`, read-only arrays) are copied
first. A tensor on another device is copied to the host (the async snapshot: into a pinned
buffer, without blocking); loading to another device is one ``Tensor.to(device)`` copy; "meta"
is refused (it holds no data). `MapLocation` is ``load(..., map_location=)``, torch.load's forms
over the devices the manifest records (`location` gives torch's tag of one), where "meta" is
allowed, as torch.load allows it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from ..errors import (
    InvalidArgumentError,
    InvalidArgumentTypeError,
    RestoreMismatchError,
    UnsupportedDTypeError,
)
from ..values.devices import DeviceSpec
from ..values.dtypes import as_dtype, carrier, framework_dtypes, packed_name
from ..values.nibbles import pack, unpack
from . import to_host as checked_to_host


@functools.lru_cache(maxsize=1)
def _special() -> tuple[dict[Any, tuple[Any, np.dtype]], dict[np.dtype, tuple[np.dtype, Any]]]:
    """The dtypes torch and numpy cannot exchange, both ways: torch dtype -> (torch carrier,
    ml_dtypes dtype), and ml_dtypes dtype -> (numpy carrier, torch dtype)."""
    to_torch = {v: k for k, v in framework_dtypes(torch).items()}
    pairs = [(dt, wide) for dt in to_torch if (wide := carrier(dt)) is not None]
    return ({to_torch[dt]: (to_torch[wide], dt) for dt, wide in pairs},
            {dt: (wide, to_torch[dt]) for dt, wide in pairs})


def owns(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


# torch's packed float4: two elements a byte along the last axis (the element shape is the
# tensor's with its last dimension doubled); numpy holds them unpacked, as float4_e2m1fn
_FLOAT4_X2 = getattr(torch, "float4_e2m1fn_x2", None)


def host_dtype(dtype: Any) -> np.dtype:
    """The numpy (or ml_dtypes) dtype that holds a torch dtype's values."""
    if dtype is not None and dtype == _FLOAT4_X2:
        return as_dtype("float4_e2m1fn")
    got = framework_dtypes(torch).get(dtype)
    return got if got is not None else torch.empty(0, dtype=dtype).numpy().dtype


def torch_dtype(dtype: np.dtype, key: str = "") -> torch.dtype:
    """The torch dtype of the numpy (or ml_dtypes) dtype of stored tensor `key`.

    Raises:
        UnsupportedDTypeError: torch has no such dtype.
    """
    got = _torch_dtypes().get(np.dtype(dtype))
    if got is None:
        raise UnsupportedDTypeError(f"{key!r}: torch has no dtype for {dtype}")
    return got


@functools.lru_cache(maxsize=1)
def _torch_dtypes() -> dict[np.dtype, Any]:
    return {v: k for k, v in framework_dtypes(torch).items()}


def to_host(t: Any) -> tuple[np.ndarray, DeviceSpec]:
    """A host array of tensor `t` (a view of its memory on the CPU) and its device."""
    reinterpret = _special()[0]
    dev = t.device
    dev_spec = DeviceSpec(
        "localhost", 0, 0, "GPU" if dev.type == "cuda" else dev.type.upper(), dev.index or 0
    )
    t = t.detach()
    if dev.type != "cpu":
        t = t.cpu()
    if t.dtype == _FLOAT4_X2:  # unpacked: a copy of (..., 2 * last) elements
        if t.dim() == 0:
            raise ValueError("a 0-d float4_e2m1fn_x2 tensor has no last axis to unpack along")
        shape = (*t.shape[:-1], 2 * t.shape[-1])
        data = t.contiguous().view(torch.uint8).numpy()
        return unpack(data, host_dtype(t.dtype), shape), dev_spec
    if t.dtype in reinterpret:
        wide, np_dtype = reinterpret[t.dtype]
        if t.dim() == 0:
            return t.reshape(1).view(wide).numpy().view(np_dtype).reshape(()), dev_spec
        return t.view(wide).numpy().view(np_dtype), dev_spec
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.numpy(), dev_spec


def memory_key(t: Any) -> tuple[Any, ...] | None:
    """Device, data address, shape, strides and dtype of a non-empty plain tensor: equal for
    two tensors of one memory (tied weights, on any device); None for the others."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.numel() == 0:
        return None
    return ("torch", str(t.device), t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def from_host(array: np.ndarray, key: str = "") -> torch.Tensor:
    """A CPU tensor over `array`'s memory (a copy only when torch cannot share it: read-only
    memory, negative strides). `key` is unused (the converter signature)."""
    if not array.flags.writeable:
        array = array.copy()
    if packed_name(array.dtype) is not None:
        return _float4_x2(array, key)
    special = _special()[1].get(array.dtype)
    try:
        if special is None:
            return _from_numpy(array)
        return _from_numpy(array.view(special[0])).view(special[1])
    except ValueError:  # "At least one stride in the given numpy array is negative"
        if array.ndim and min(array.strides) < 0:
            return from_host(array.copy())
        raise


_from_numpy = torch.from_numpy


def _float4_x2(array: np.ndarray, key: str) -> torch.Tensor:
    """A float4_e2m1fn array as torch's only float4 dtype, float4_e2m1fn_x2: packed two a byte
    along the last axis, that axis halved (a new tensor)."""
    if _FLOAT4_X2 is None or array.ndim == 0 or array.shape[-1] % 2:
        why = ("this torch has no float4_e2m1fn_x2" if _FLOAT4_X2 is None else
               f"its shape {list(array.shape)} has no even last dimension")
        raise UnsupportedDTypeError(
            f"{key!r}: torch holds float4_e2m1fn only as float4_e2m1fn_x2, two elements a byte "
            f"along the last axis, and {why}; read it with framework='numpy'")
    packed = pack(array).reshape(*array.shape[:-1], array.shape[-1] // 2)
    return _from_numpy(packed).view(_FLOAT4_X2)


def converter(device: Any = None) -> Any:
    """The array -> tensor function for `device` (None, "cpu", a str or a torch.device)."""
    target = _device(device)
    if target is None:
        return from_host  # per tensor: one call, no wrapper

    def on_device(array: np.ndarray, key: str = "") -> torch.Tensor:
        return from_host(array).to(target)

    return on_device


def _device(device: Any) -> torch.device | None:
    """`device` as a torch.device, None for the CPU (no copy); checked to hold data."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise InvalidArgumentTypeError(
            f"device must be a str or a torch.device for framework='torch', got "
            f"{type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidArgumentError(f"device={device!r} is not a torch device: {e}") from e
    if dev.type == "meta":
        raise InvalidArgumentError(
            f"device={device!r}: a meta tensor has no data, so a loaded tensor cannot be one; "
            "load to 'cpu' (the default) or another device, or read shapes and dtypes with "
            "CheckpointReader.info")
    if dev.type == "cpu":
        return None
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as e:
        raise InvalidArgumentError(f"device={device!r} is not available to torch: {e}") from e
    return dev


def _in_host_memory(t: Any) -> bool:
    """A CPU tensor whose memory is its value (not a lazy conjugate or negation, not packed)."""
    return bool(t.device.type == "cpu" and not (t.is_conj() or t.is_neg())
                and t.dtype != _FLOAT4_X2)


def restore_target(leaf: Any, key: str) -> tuple[np.ndarray, Any] | None:
    """For a tensor `leaf`: a host array sharing its memory and None, or (off the CPU) a host
    copy and the tensor to `copy_into` after; None for other leaves."""
    if not isinstance(leaf, torch.Tensor):
        return None
    array, _ = checked_to_host(leaf, key)  # a view of the tensor's memory on the CPU
    return (array, None) if _in_host_memory(leaf) else (np.array(array), leaf)


def copy_into(t: Any, array: np.ndarray) -> None:
    """Copy `array` (same shape and dtype) into tensor `t` in place, on any device."""
    if _in_host_memory(t):
        np.copyto(checked_to_host(t)[0], array, casting="no")  # the tensor's own memory
        return
    with torch.no_grad():
        t.copy_(from_host(np.ascontiguousarray(array)))


def new_like(array: np.ndarray, like: Any) -> torch.Tensor:
    """A tensor over `array` on `like`'s device (a copy there when it is not the CPU)."""
    t = from_host(array)
    device = getattr(like, "device", None)
    return t if device is None or device.type == "cpu" else t.to(device)


def object_kind(obj: Any) -> str | None:
    """"optimizer" or "module" for a torch optimizer or module (its state_dict), else None."""
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    return "module" if isinstance(obj, torch.nn.Module) else None


def empty_like(like: Any, dtype: np.dtype) -> Any:
    """An uninitialised tensor (a DTensor for one) like `like`, in numpy dtype `dtype`."""
    return torch.empty_like(like, dtype=from_host(np.empty(0, dtype)).dtype)


# --- the async snapshot: device tensors into pinned host buffers -------------------------------


def pinned_buffer(nbytes: int) -> np.ndarray | None:
    """A page-locked uint8 host buffer of `nbytes` (device copies need no bounce buffer);
    None without a CUDA device."""
    if not torch.cuda.is_available():
        return None
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


def copy_to_host(t: Any, buffer: np.ndarray) -> np.ndarray:
    """Start copying device tensor `t` into uint8 `buffer` (pinned, of its size) without
    waiting (`synchronize` waits); the buffer as a host array of `t`'s stored dtype."""
    t = t.detach()
    with torch.no_grad():
        torch.from_numpy(buffer).view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
    return buffer.view(host_dtype(t.dtype)).reshape(tuple(t.shape))


def synchronize() -> None:
    torch.cuda.synchronize()  # the non-blocking copies must land before the write


@functools.lru_cache(maxsize=1)
def _dtensor_api() -> tuple[Any, Any, Any]:
    """Replicate, Shard and torch's local shape / global offset helper (imported once)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return Replicate, Shard, compute_local_shape_and_global_offset


def dtensor_local(value: Any, cache: dict[Any, Any] | None, check: Any
                  ) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """The local tensor of DTensor `value` (its own memory: writing to it writes the DTensor),
    and the global offset and shape of the box of the global tensor it holds on this rank, as
    torch's own helper computes it (every placement it knows, uneven shards, n-D meshes; a
    rank outside the mesh holds an empty box); `check(placements)` raises first for the ones
    the caller refuses. `cache` (a dict the caller keeps for one save or restore) remembers the
    box per global shape, mesh and placements, which many tensors of a model share."""
    placements = tuple(value.placements)
    mesh = value.device_mesh
    ident = (tuple(value.shape), id(mesh), placements)  # the mesh outlives the cache
    got = None if cache is None else cache.get(ident)
    if got is None:
        check(placements)
        shape, offset = _dtensor_api()[2](value.shape, mesh, placements)
        got = tuple(int(o) for o in offset), tuple(int(n) for n in shape)
        if cache is not None:
            cache[ident] = got
    with torch.no_grad():
        local = value.to_local()
    return local, got[0], got[1]


def dtensor_box(value: Any, key: str, cache: dict[Any, Any] | None = None
                ) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """`dtensor_local` for a restore into DTensor `value`: Shard(d) (even or not) and Replicate
    placements only. Partial (pending reductions) and strided shards, whose local tensor is
    not one box of the global tensor, are refused (RestoreMismatchError)."""
    replicate, shard, _ = _dtensor_api()

    def check(placements: tuple[Any, ...]) -> None:
        for p in placements:
            if type(p) is not replicate and type(p) is not shard:
                raise RestoreMismatchError(
                    f"cannot restore key {key!r} into a DTensor with placement "
                    f"{type(p).__name__} ({p}): only Shard(d) and Replicate placements hold a "
                    "box of the global tensor; restore into a Shard or Replicate DTensor and "
                    "redistribute it"
                )

    local, offset, shape = dtensor_local(value, cache, check)
    if tuple(local.shape) != shape:
        raise RestoreMismatchError(
            f"cannot restore key {key!r}: the DTensor's local tensor has shape "
            f"{list(local.shape)}, its placements {list(value.placements)} on mesh "
            f"{value.device_mesh} give {list(shape)}"
        )
    return local, offset, shape


# --- load(..., map_location=): torch.load's forms -------------------------------------------------


def location(device: str) -> str:
    """torch's location tag for a device string of the manifest: "cpu", "cuda:N" (a GPU), else
    the lower-case type and index ("xpu:0")."""
    spec = DeviceSpec.from_string(device)
    kind = (spec.device_type or "CPU").lower()
    if kind == "cpu":
        return "cpu"
    return f"{'cuda' if kind == 'gpu' else kind}:{spec.device_index or 0}"


def _target(value: Any, what: str) -> torch.device:
    """A target of `map_location` (a str or torch.device) as a torch.device."""
    if not isinstance(value, (str, torch.device)):
        raise InvalidArgumentTypeError(
            f"{what} must be a str or a torch.device, got {type(value).__name__} ({value!r})")
    try:
        return torch.device(value)
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidArgumentError(f"{what}={value!r} is not a torch device: {e}") from e


class MapLocation:
    """``torch.load``'s `map_location`, checked before anything is read: a str or torch.device
    (every tensor there), a dict from stored location tag ("cpu", "cuda:0") to target (a tag
    it does not name stays where it was saved), or a callable ``(tensor, location) -> tensor``
    called with each CPU tensor (None: where it was saved). "meta" gives tensors without data.
    """

    def __init__(self, map_location: Any) -> None:
        self.fixed: torch.device | None = None
        self.table: dict[str, torch.device] | None = None
        self.call: Any = None
        if isinstance(map_location, (str, torch.device)):
            self.fixed = _target(map_location, "map_location")
        elif isinstance(map_location, dict):
            self.table = {}
            for tag, value in map_location.items():
                if not isinstance(tag, str):
                    raise InvalidArgumentTypeError(
                        f"map_location's keys must be location strings such as 'cuda:0', got "
                        f"{type(tag).__name__} ({tag!r})")
                self.table[tag] = _target(value, f"map_location[{tag!r}]")
        elif callable(map_location):
            self.call = map_location
        else:
            raise InvalidArgumentTypeError(
                "map_location must be a str, a torch.device, a dict from location to device or "
                f"a callable (tensor, location) -> tensor, got {type(map_location).__name__}")
        self._usable: set[torch.device] = set()

    def bind(self, devices: dict[str, str]) -> Any:
        """The converter for the keys of `devices` (key -> stored device string), each target
        device checked to be usable (InvalidArgumentError naming the key) before any read."""
        tags = {key: location(dev) for key, dev in devices.items()}
        if self.call is not None:
            return functools.partial(self._called, tags)
        targets = {}
        for key, tag in tags.items():
            dev = self.fixed if self.fixed is not None else (
                self.table.get(tag) if self.table is not None else None)
            targets[key] = self._checked(_saved(key, tag) if dev is None else dev, key, tag)
        return functools.partial(_placed, targets)

    def _checked(self, dev: torch.device, key: str, tag: str) -> torch.device | None:
        """`dev` (None for the CPU), once torch showed it can hold a tensor there."""
        if dev.type == "cpu":
            return None
        if dev not in self._usable and dev.type != "meta":
            try:
                torch.empty(0, device=dev)
            except (RuntimeError, AssertionError) as e:
                raise InvalidArgumentError(
                    f"map_location: key {key!r} (saved on {tag!r}) goes to device "
                    f"{str(dev)!r}, which torch cannot use here: {e}") from e
            self._usable.add(dev)
        return dev

    def _called(self, tags: dict[str, str], array: np.ndarray, key: str = "") -> torch.Tensor:
        tensor = from_host(array)
        got = self.call(tensor, tags[key])
        if got is None:
            dev = self._checked(_saved(key, tags[key]), key, tags[key])
            return tensor if dev is None else tensor.to(dev)
        if not isinstance(got, torch.Tensor):
            raise InvalidArgumentTypeError(
                f"map_location returned {type(got).__name__} for key {key!r}; it must return "
                "a torch.Tensor (or None: where it was saved)")
        if got.shape != tensor.shape or got.dtype != tensor.dtype:
            raise InvalidArgumentError(
                f"map_location returned a {got.dtype} tensor of shape {list(got.shape)} for key "
                f"{key!r}, stored as {tensor.dtype} {list(tensor.shape)}; it may move a tensor, "
                "not change it")
        return got


def _saved(key: str, tag: str) -> torch.device:
    """The device key `key` was saved from (location `tag`), for a tensor left there."""
    try:
        return torch.device(tag)
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidArgumentError(
            f"map_location: key {key!r} was saved on {tag!r}, which is not a torch device "
            f"({e}); map its location to one") from e


def _placed(targets: dict[str, torch.device | None], array: np.ndarray, key: str = ""
            ) -> torch.Tensor:
    tensor = from_host(array)
    dev = targets[key]
    return tensor if dev is None else tensor.to(dev)
