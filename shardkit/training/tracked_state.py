"""The state of the objects a `checkpoint.Checkpoint` tracks: what a tracked object is
(arrays, pytrees of them, torch modules and optimizers, TensorFlow variables, anything with
``state_dict()``), its state collected into tensors and a JSON skeleton (tied tensors stored
once; NamedTuples named as `sharding.structure` records them), and restored from a reader into
the objects in place."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np

from ..errors import (
    InvalidArgumentTypeError,
    InvalidKeyError,
    InvalidKeyTypeError,
    RestoreMismatchError,
)
from ..frameworks import copy_into, is_dtensor, is_variable, kind_of, loaded, module
from ..io.reader import CheckpointReader
from ..io.restore import copy_into_dtensor
from ..sharding.structure import namedtuple_detail, namedtuple_type
from ..sharding.tensors import SEPARATOR

MISSING: Any = object()  # "no value here" (distinct from None, which is a value)


# --- what a tracked object is -------------------------------------------------------------------


def is_tensor(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic)) or kind_of(x) is not None or is_variable(x)


def _tensor_kind(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    if isinstance(x, np.generic):
        return "scalar"
    return kind_of(x) or "tensorflow"  # else a TensorFlow (or Keras) variable


def object_kind(name: str, obj: Any) -> str:
    if is_tensor(obj):
        return "array"
    tfw = loaded("tensorflow")
    if tfw is not None and tfw.is_trackable(obj):
        return "tensorflow"  # tf.Module, Keras model / optimizer: TensorFlow's keys
    torch = loaded("torch")
    kind = None if torch is None else torch.object_kind(obj)
    if kind is not None:
        return kind  # type: ignore[no-any-return]
    if callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    ):
        return "stateful"
    if obj is None or isinstance(obj, (MutableMapping, list, tuple)):
        return "tree"  # a pytree: dicts, lists, tuples, NamedTuples (optax states), None
    raise InvalidArgumentTypeError(
        f"Checkpoint({name}=...): cannot track a {type(obj).__name__}; pass an array, a dict, "
        "list, tuple or NamedTuple of arrays, a torch module or optimizer, or an object with "
        "state_dict() and load_state_dict()"
    )


# --- saving: state -> flat tensors + a JSON skeleton --------------------------------------------


class StateCollector:
    """Gathers the tensors to store while the JSON skeleton of each object is built."""

    def __init__(self) -> None:
        self.tensors: dict[str, Any] = {}
        self._keys: set[str] = set()

    def tensor(self, key: str, value: Any) -> dict[str, Any]:
        if key in self._keys:
            raise InvalidKeyError(
                f"two values map to the checkpoint key {key!r}; a dict key containing "
                f"{SEPARATOR!r} collides with a nested one. Rename one of them"
            )
        self._keys.add(key)
        enc: dict[str, Any] = {"x": key, "k": _tensor_kind(value)}
        self.tensors[key] = value  # tied ones are stored once by the save (its aliases)
        return enc


def encode_skeleton(node: Any, key: str, col: StateCollector) -> dict[str, Any]:
    """The JSON skeleton of `node`; tensors are replaced by references to checkpoint keys."""
    if is_tensor(node):
        return col.tensor(key, node)
    if node is None or isinstance(node, (bool, int, str)):
        return {"v": node}
    if isinstance(node, float):
        return {"f": repr(node)}  # exact, and also for inf / nan (which JSON lacks)
    if isinstance(node, Mapping):
        items = []
        for k, v in node.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise InvalidKeyTypeError(
                    f"{key!r}: key {k!r} is not a str or int; cannot checkpoint it")
            items.append([k, encode_skeleton(v, f"{key}{SEPARATOR}{k}", col)])
        return {"d": items}
    if isinstance(node, (list, tuple)):
        tag = "t" if isinstance(node, tuple) else "l"
        enc = {tag: [encode_skeleton(v, f"{key}{SEPARATOR}{i}", col) for i, v in enumerate(node)]}
        named = namedtuple_detail(node)
        if named is not None:  # as the structure record names it; older readers see a tuple
            enc["nt"] = named
        return enc
    raise InvalidArgumentTypeError(
        f"{key!r}: cannot checkpoint a {type(node).__name__}; state may hold tensors, dicts, "
        "lists, tuples, NamedTuples, None, bool, int, float and str"
    )


# --- restoring: JSON skeleton + reader -> values, in place --------------------------------------


def _dtype_of(x: Any) -> np.dtype:
    if isinstance(x, (np.ndarray, np.generic)):
        dt = x.dtype
        return dt.newbyteorder("<") if dt.byteorder == ">" else dt
    return module(_tensor_kind(x)).host_dtype(x.dtype)  # type: ignore[no-any-return]


def _new_value(array: np.ndarray, kind: str, like: Any) -> Any:
    """A new object of `kind` holding a copy of the stored `array` (which may be a map view)."""
    if kind == "scalar":
        return array[()]
    if kind in ("torch", "tensorflow", "jax"):  # jax: present if the state held JAX arrays
        return module(kind).new_like(np.array(array), like)
    return np.array(array)


class StateRestorer:
    """One pass over the skeletons: a dry pass validates everything, the real one copies."""

    def __init__(self, reader: CheckpointReader, dry: bool,
                 templates: Mapping[str, Any] | None = None) -> None:
        self.reader = reader
        self.dry = dry
        self.templates = templates or {}  # key prefix -> DTensor new values are made like
        self.restored: list[str] = []
        self.missing: list[str] = []
        self.used: set[str] = set()
        self.changed = False  # a value was replaced or created, not copied in place

    def value(self, enc: dict[str, Any], current: Any, key: str, create: bool) -> Any:
        if "x" in enc:
            return self.tensor(enc, current, key, create)
        if "d" in enc:
            return self.mapping(enc["d"], current, key, create)
        if "l" in enc or "t" in enc:
            return self.sequence(enc, current, key, create)
        if current is MISSING and not create:
            return MISSING
        value = float(enc["f"]) if "f" in enc else enc["v"]
        if not (type(current) is type(value) and (current == value or value != value)):
            self.changed = True
        return value

    def mapping(self, items: list[Any], current: Any, key: str, create: bool) -> Any:
        if current is MISSING and not create:
            return MISSING
        if not isinstance(current, Mapping):
            create = True  # a new container: everything in it is new
        mutable = isinstance(current, MutableMapping)
        cur = current if isinstance(current, Mapping) else {}
        target: Any = current if mutable else {}
        stored = set()
        for k, sub in items:
            stored.add(k)
            child = cur.get(k, MISSING)
            new = self.value(sub, child, f"{key}{SEPARATOR}{k}", create)
            if new is not MISSING and not self.dry and (child is not new or not mutable):
                target[k] = new
        for k, v in cur.items():
            if k not in stored:
                self.note_missing(v, f"{key}{SEPARATOR}{k}")
                if not mutable and not self.dry:
                    target[k] = v
        if not mutable:
            self.changed = True
        return target

    def sequence(self, enc: dict[str, Any], current: Any, key: str, create: bool) -> Any:
        items = enc["l"] if "l" in enc else enc["t"]
        if current is MISSING and not create:
            return MISSING
        if not isinstance(current, (list, tuple)):
            create = True
        cur = current if isinstance(current, (list, tuple)) else ()
        out = []
        for i, sub in enumerate(items):
            child = cur[i] if i < len(cur) else MISSING
            new = self.value(sub, child, f"{key}{SEPARATOR}{i}", create)
            if new is not MISSING:
                out.append(new)
            elif child is not MISSING:
                out.append(child)
        for i in range(len(items), len(cur)):
            self.note_missing(cur[i], f"{key}{SEPARATOR}{i}")
        if "l" in enc and isinstance(current, list) and len(current) == len(out):
            if not self.dry:
                current[:] = out
            return current
        if "l" in enc:
            self.changed = True
            return out
        cls = self.tuple_type(enc, current, len(items), key)  # checked in the dry pass too
        if type(current) is cls and len(current) == len(out) and all(
                a is b for a, b in zip(current, out)):
            return current  # every item restored in place: the same tuple
        self.changed = True
        if cls is tuple or len(out) != len(items):  # a partial restore's or dry pass's gaps
            return tuple(out)
        return cls(*out)

    def tuple_type(self, enc: dict[str, Any], current: Any, n: int, key: str) -> Any:
        """The type of a restored tuple: the recorded NamedTuple (the current value's type
        when it is that one, else `structure.namedtuple_type`'s lookup), a plain tuple; or, for
        a skeleton that records none (written before NamedTuples were), the current value's
        NamedTuple type when it has as many fields."""
        current_named = namedtuple_detail(current)
        if "nt" not in enc:
            return type(current) if current_named and len(current_named[1]) == n else tuple
        if enc["nt"] == current_named:
            return type(current)
        return namedtuple_type(enc["nt"], n, key, str(self.reader.path))

    def note_missing(self, value: Any, key: str) -> None:
        col = StateCollector()
        collect_tensor_keys(value, key, col)
        self.missing.extend(col.tensors)

    def tensor(self, enc: dict[str, Any], current: Any, key: str, create: bool) -> Any:
        src = enc.get("alias", enc["x"])  # "alias": a tied tensor, in older skeletons
        if src not in self.reader:
            if current is not MISSING:
                self.note_missing(current, key)
            return current
        if current is MISSING and not create:
            return MISSING
        self.used.add(src)
        info = self.reader.info(src)
        self.restored.append(key)
        where = f"{key!r}" if src == key else f"{key!r} (tied to {src!r})"
        if current is MISSING or not is_tensor(current):
            self.changed = True
            like = self.templates.get(key.rpartition(SEPARATOR)[0] + SEPARATOR)
            if like is not None and tuple(like.shape) == tuple(info.shape):
                # new optimizer state of a DTensor parameter: a DTensor like it
                copy_into_dtensor(self.reader, src, like, dry=True)
                if self.dry:
                    return current
                new = module("torch").empty_like(like, info.dtype)
                copy_into_dtensor(self.reader, src, new)
                return new
            if self.dry:
                return current
            return _new_value(self.reader.get(src), enc.get("k", "numpy"), None)
        found_shape, found_dtype = tuple(current.shape), _dtype_of(current)
        if found_shape != tuple(info.shape) or found_dtype != info.dtype:
            raise RestoreMismatchError(
                f"cannot restore {where} from {self.reader.path}: the checkpoint has shape "
                f"{list(info.shape)} dtype {info.dtype}, the object has shape "
                f"{list(found_shape)} dtype {found_dtype}"
            )
        if is_dtensor(current):  # this rank's box of the stored tensor, into its local tensor
            copy_into_dtensor(self.reader, src, current, self.dry)
            return current
        kind = _tensor_kind(current)
        if kind in ("scalar", "jax") or (kind == "tensorflow" and not is_variable(current)):
            # immutable: replaced by a new value of the same kind
            self.changed = True
            return current if self.dry else _new_value(self.reader.get(src), kind, current)
        if kind == "numpy" and not current.flags.writeable:
            raise RestoreMismatchError(
                f"cannot restore {where} in place: the numpy array is read-only"
            )
        if not self.dry:
            copy_into(current, self.reader.get(src))  # in place
        return current


def collect_tensor_keys(value: Any, key: str, col: StateCollector) -> None:
    """Collect the tensor keys under `value`, ignoring what cannot be checkpointed."""
    try:
        encode_skeleton(value, key, col)
    except (TypeError, ValueError):
        pass
