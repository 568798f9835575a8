"""Checkpoint and CheckpointManager: a drop-in saver for training loops, in TensorFlow's terms.

    ckpt = Checkpoint(model=model, optimizer=optimizer)
    manager = CheckpointManager(ckpt, "runs/ckpt", max_to_keep=3)
    manager.restore_or_initialize()
    ...
    manager.save(checkpoint_number=step, options=CheckpointOptions(enable_async=True))

A `Checkpoint` tracks named objects: pytrees of arrays (numpy, torch, JAX; nested dicts, lists,
tuples, NamedTuples such as optax states, None), torch modules and optimizers, and anything with
``state_dict()`` / ``load_state_dict()``. Each tensor is stored under ``<object name>/<path in
its state>``; the structure of every state, with its non-tensor values (optimizer
hyperparameters, step counts, None) and NamedTuple types (by import path, as
`sharding.structure` names them), is stored as JSON in the checkpoint's user metadata under
``"shardkit.checkpoint"``; the save counter is the 0-d int64 tensor ``save_counter``. Tensors
that share memory (tied weights) are stored once and restored into every alias. Restoring
copies into the existing arrays and tensors in place. An async save (``enable_async=True``) is
described in docs/TRAINING.md. `CheckpointManager` lives in training/manager.py and is
re-exported here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import (
    InvalidArgumentError,
    InvalidArgumentTypeError,
    RestoreMismatchError,
)
from ..frameworks import is_dtensor, module
from ..io import save as api
from ..io.options import CheckpointOptions, check_options
from ..io.reader import open_checkpoint
from ..io.restore import CheckpointLoadStatus, check_complete
from ..io.snapshot import AsyncWriter, HostBufferPool, SaveHandle
from ..sharding.tensors import OBJECT_GRAPH_KEY, SEPARATOR
from ..storage import open_storage
from ..values.keys import check_keys
from .manager import CheckpointManager
from .tracked_state import (
    MISSING,
    StateCollector,
    StateRestorer,
    collect_tensor_keys,
    encode_skeleton,
    object_kind,
)

SAVE_COUNTER = "save_counter"
TF_SAVE_COUNTER = "save_counter/.ATTRIBUTES/VARIABLE_VALUE"  # tf.train.Checkpoint's key
METADATA_KEY = "shardkit.checkpoint"
LAYOUT_VERSION = 1
JOINT = "joint"  # a TensorFlow object's layout entry: its keys are the joint graph's

# --- Checkpoint ---------------------------------------------------------------------------------


class Checkpoint:
    """Saves and restores named objects; TensorFlow's ``tf.train.Checkpoint`` for any framework.

    ``Checkpoint(model=model, optimizer=opt, data={"epoch": 0, "rng": rng_state})``. Objects are
    reachable as attributes (``ckpt.model``). `save` writes ``<prefix>-<save_counter>``, `write`
    writes exactly the path given; both return a `SaveHandle` (the path). `restore` / `read` copy
    the stored values into the existing arrays and tensors in place.

    Optimizers (and any object with ``state_dict()`` / ``load_state_dict()``): their existing
    state is filled in place, state not created yet (no step taken) is created from the
    checkpoint, and both go to ``load_state_dict``. JAX arrays, numpy scalars, Python values,
    tuples and NamedTuples are immutable: they are replaced inside their containers
    (``ckpt.<name>`` for a top-level one), a NamedTuple by its saved type.
    """

    def __init__(self, **objects: Any) -> None:
        kinds = {}
        for name, obj in objects.items():
            if name == SAVE_COUNTER:
                raise InvalidArgumentError(
                    f"{SAVE_COUNTER!r} is reserved for the checkpoint's save counter")
            if SEPARATOR in name:
                raise InvalidArgumentError(
                    f"object name {name!r} must not contain {SEPARATOR!r}")
            kinds[name] = object_kind(name, obj)
        self._objects: dict[str, Any] = dict(objects)
        self._kinds = kinds
        self._save_counter = 0
        self._pool = HostBufferPool()
        self._writer = AsyncWriter()

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects")
        if objects is not None and name in objects:
            return objects[name]
        raise AttributeError(f"Checkpoint has no object or attribute {name!r}")

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(self._objects)}; save_counter={self._save_counter})"

    @property
    def save_counter(self) -> int:
        """How many times `save` (or a manager) numbered a checkpoint; saved and restored."""
        return self._save_counter

    # -- writing

    def save(self, file_prefix: str | os.PathLike[str],
             options: CheckpointOptions | None = None, *, process_group: Any = None,
             timeout: float | None = None) -> SaveHandle:
        """Increment `save_counter` and write ``<file_prefix>-<save_counter>``.

        Args:
            file_prefix: the path before ``-<save_counter>``.
            options, process_group, timeout: as for `write`.
        Returns:
            The `SaveHandle` (the checkpoint's path).
        Raises:
            ShardkitError: what `write` raises.
        """
        self._writer.wait()
        self._save_counter += 1
        return self._write(f"{os.fspath(file_prefix)}-{self._save_counter}", options,
                           process_group=process_group, timeout=timeout)

    def write(self, file_prefix: str | os.PathLike[str],
              options: CheckpointOptions | None = None, *, process_group: Any = None,
              timeout: float | None = None) -> SaveHandle:
        """Write the checkpoint at exactly `file_prefix` (replacing one already there).

        An async collective save commits from the background over a process group of its own,
        never interleaving with the training loop's collectives.

        Args:
            file_prefix: the checkpoint's path or URL.
            options: how to write (`CheckpointOptions`; ``enable_async`` writes in the
                background after a snapshot).
            process_group: save collectively, as `shardkit.save`: every rank calls it, each
                writes its own shards (also without it when the objects hold DTensors).
            timeout: seconds a collective save waits for the other ranks at each step.
        Returns:
            The `SaveHandle` (the checkpoint's path), already durable unless async.
        Raises:
            ShardkitError: what `shardkit.save` raises (for an async save: a pending write's
                error, here or from the handle).
        """
        return self._write(os.fspath(file_prefix), options, process_group=process_group,
                           timeout=timeout)

    def sync(self) -> None:
        """Wait for a pending async save; raise its error if it failed."""
        self._writer.wait()

    wait_until_finished = sync

    def _write(self, path: str, options: CheckpointOptions | None,
               after_commit: Callable[[str], None] | None = None, *,
               process_group: Any = None, timeout: float | None = None,
               format: str = "shardkit") -> SaveHandle:
        opts = check_options(options)
        self._writer.wait()
        if format == "tensorflow":
            tensors, metadata = self._collect_tensorflow(), None
            coord = None
        else:
            tensors, metadata = self._collect()
            coord = api._coordinator(tensors, process_group, timeout)  # None: process alone

        def write(target: str, tensors: dict[str, Any], opts: CheckpointOptions) -> str:
            with api._no_split_warning():
                info = api.save(target, tensors, options=opts, metadata=metadata,
                                overwrite=True, process_group=coord, format=format)
            if after_commit is not None:
                after_commit(info.path)
            return info.path

        if not opts.enable_async:
            return SaveHandle(write(path, tensors, opts))
        check_keys(list(tensors))  # here, not in the background write
        where: dict[str, Any] = {}
        if coord is not None:
            from ..distributed.routing import as_local_shards, local_parts

            tensors, where = local_parts(tensors)  # a rank snapshots its local shards only
            coord = coord.background()
        snapshot = self._pool.snapshot(tensors.items())
        del tensors  # the write must not see later changes
        if where:
            snapshot = as_local_shards(snapshot, where)
        write_opts = dataclasses.replace(opts, enable_async=False)
        target = open_storage(path).url
        return self._writer.submit(target, lambda: write(target, snapshot, write_opts))

    def _current(self, name: str, joint: dict[str, dict[str, Any]] | None = None) -> Any:
        """The state of object `name` as it is saved: a TensorFlow object's variables under
        the keys of the joint graph (`_joint_tensorflow`, or `joint` when given)."""
        obj = self._objects[name]
        kind = self._kinds[name]
        if kind == "tensorflow":
            if joint is None:
                joint = self._joint_tensorflow()
            return joint.get(name, {})  # {key relative to name: variable}
        return obj if kind in ("array", "tree") else obj.state_dict()

    def _currents(self) -> dict[str, Any]:
        """`_current` of every object, the joint graph's keys serialized once."""
        joint = self._joint_tensorflow() if "tensorflow" in self._kinds.values() else None
        return {name: self._current(name, joint) for name in self._kinds}

    def _tensorflow_root(self) -> Any:
        """One ``tf.train.Checkpoint`` over the tracked TensorFlow objects, its save counter
        created (what TensorFlow's own ``Checkpoint(**objects).save`` serializes)."""
        root = self.__dict__.get("_tf_root")
        if root is None:
            objects = {n: self._objects[n] for n, k in self._kinds.items() if k == "tensorflow"}
            root = self._tf_root = module("tensorflow").checkpoint_root(objects)
        return root

    def _collect_tensorflow(self) -> dict[str, Any]:
        """The tensors of a TensorFlow-format save: the TensorFlow objects and the save counter
        under the keys and object graph of ``tf.train.Checkpoint(**objects).save``, the other
        objects' tensors under their own keys (a TensorBundle holds no Checkpoint layout)."""
        tfw = module("tensorflow")
        root = self._tensorflow_root()
        root.save_counter.assign(self._save_counter)
        col = StateCollector()
        for name, kind in self._kinds.items():
            if kind != "tensorflow":
                encode_skeleton(self._current(name), name, col)
        return {**tfw.expand(root), **col.tensors}

    def _joint_tensorflow(self) -> dict[str, dict[str, Any]]:
        """Each tracked TensorFlow object's variables under the keys of the joint graph
        (``{name: {key relative to name: variable}}``), and the save counter's: the keys
        ``tf.train.Checkpoint(**objects).save`` gives, where each variable is named once, by
        its shortest path from the root (a compiled Keras model tracks its optimizer, whose
        ``_trainable_variables`` are the model's weights: they are ``optimizer/...`` only)."""
        flat = module("tensorflow").object_variables(self._tensorflow_root())
        out: dict[str, dict[str, Any]] = {}
        for key, value in flat.items():
            name, _, rest = key.partition(SEPARATOR)
            out.setdefault(name, {})[rest] = value
        return out

    def _collect(self) -> tuple[dict[str, Any], dict[str, Any]]:
        col = StateCollector()
        currents = self._currents()
        objects: dict[str, Any] = {}
        for name, kind in self._kinds.items():
            objects[name] = {"kind": kind, "tree": encode_skeleton(currents[name], name, col)}
            if kind == "tensorflow":  # the joint graph's keys (older saves: the object's own)
                objects[name][JOINT] = True
        col.tensor(SAVE_COUNTER, np.array(self._save_counter, np.int64))
        metadata = {METADATA_KEY: {"version": LAYOUT_VERSION, "objects": objects}}
        return col.tensors, metadata

    # -- reading

    def read(self, save_path: str | os.PathLike[str],
             options: CheckpointOptions | None = None, *,
             partial: bool = False) -> CheckpointLoadStatus:
        """Restore every tracked object (and the save counter) from `save_path`, in place.

        Everything is checked before anything is changed: keys one to one, shapes and dtypes.

        Args:
            save_path: the checkpoint's path or URL.
            options: accepted as TensorFlow's (checked, otherwise unused).
            partial: restore what matches and leave the rest (the status lists it).
        Returns:
            The `CheckpointLoadStatus`.
        Raises:
            IncompleteRestoreError: values do not match one to one and `partial` is False.
            RestoreMismatchError: a shape or dtype differs, or ``load_state_dict`` refused.
            InvalidArgumentTypeError: `partial` is not a bool.
            CheckpointNotFoundError, CheckpointFormatError: as `shardkit.load`.
        """
        check_options(options)
        if not isinstance(partial, bool):
            raise InvalidArgumentTypeError(f"partial must be True or False, got {partial!r}")
        self._writer.wait()
        path = str(os.fspath(save_path))
        with open_checkpoint(path) as reader:
            layout = reader.metadata.get(METADATA_KEY)
            stored = _stored_objects(layout, path)
            joint = None  # the TensorFlow objects' keys: the joint graph's, as TensorFlow's
            if "tensorflow" in self._kinds.values():
                joint = self._joint_tensorflow()
            counter = TF_SAVE_COUNTER if TF_SAVE_COUNTER in reader else SAVE_COUNTER
            plans = []
            for name, kind in self._kinds.items():
                current = self._current(name, joint)
                entry = stored.get(name, {})
                if kind == "tensorflow" and "tree" in entry and not entry.get(JOINT):
                    # saved before the joint keys: each object's own ("model/optimizer/...")
                    current = module("tensorflow").object_variables(self._objects[name])
                enc = entry.get("tree")
                if enc is None:  # not saved by a Checkpoint: match tensors by key
                    enc = encode_skeleton(current, name, StateCollector())
                plans.append((name, kind, current, enc, kind in ("optimizer", "stateful")))
            templates = self._state_templates()
            dry = StateRestorer(reader, dry=True, templates=templates)
            for name, _, current, enc, create in plans:
                dry.value(enc, current, name, create)
            if not partial:
                dry.used.update((counter, OBJECT_GRAPH_KEY))
                check_complete(path, dry.missing, [k for k in reader.keys() if k not in dry.used])
            restorer = StateRestorer(reader, dry=False, templates=templates)
            for name, kind, current, enc, create in plans:
                restorer.changed = False
                new = restorer.value(enc, current, name, create)
                self._apply(name, kind, current, new, restorer.changed, path)
            restorer.used.add(OBJECT_GRAPH_KEY)
            if counter in reader:
                restorer.used.add(counter)
                self._save_counter = int(reader.get(counter))
                if joint is not None:
                    self._tensorflow_root().save_counter.assign(self._save_counter)
            unexpected = [k for k in reader.keys() if k not in restorer.used]
        return CheckpointLoadStatus(path, restorer.restored, restorer.missing, unexpected)

    def _state_templates(self) -> dict[str, Any]:
        """``"<optimizer>/state/<i>/"`` -> parameter i, for every tracked torch optimizer's
        DTensor parameters: state such an optimizer has not created yet is created like its
        parameter (a DTensor of the same placements, this rank's box restored), not as a full
        tensor the optimizer could not step with."""
        out: dict[str, Any] = {}
        for name, kind in self._kinds.items():
            if kind != "optimizer":
                continue
            params = [p for g in self._objects[name].param_groups for p in g["params"]]
            for i, p in enumerate(params):  # state_dict numbers them in this order
                if is_dtensor(p):
                    out[f"{name}{SEPARATOR}state{SEPARATOR}{i}{SEPARATOR}"] = p
        return out

    def restore(self, save_path: str | os.PathLike[str] | None,
                options: CheckpointOptions | None = None, *,
                partial: bool = False) -> CheckpointLoadStatus:
        """`read`, and TensorFlow's ``restore(None)``.

        Args:
            save_path: the checkpoint's path or URL; None restores nothing and raises nothing
                (the status lists every value as missing).
            options, partial: as for `read`.
        Returns:
            The `CheckpointLoadStatus`.
        Raises:
            ShardkitError: what `read` raises.
        """
        if save_path is None:
            self._writer.wait()
            col = StateCollector()
            for name, current in self._currents().items():
                collect_tensor_keys(current, name, col)
            return CheckpointLoadStatus(None, [], list(col.tensors), [])
        return self.read(save_path, options, partial=partial)

    def _apply(self, name: str, kind: str, current: Any, new: Any, changed: bool,
               path: str) -> None:
        obj = self._objects[name]
        if kind in ("array", "tree"):
            if new is not MISSING and new is not current:
                self._objects[name] = new
            return
        if kind == "module" and not changed:
            return  # every tensor was copied into the module's own memory
        if kind == "tensorflow":
            return  # every variable was assigned in place
        try:
            obj.load_state_dict(new)
        except (KeyError, ValueError, RuntimeError, TypeError) as e:
            raise RestoreMismatchError(
                f"cannot restore {name!r} from {path}: its load_state_dict rejected the "
                f"stored state: {e}"
            ) from e


def _stored_objects(layout: Any, path: str) -> dict[str, Any]:
    if layout is None:
        return {}
    if not isinstance(layout, dict) or not isinstance(layout.get("objects"), dict):
        raise RestoreMismatchError(
            f"{path}: user metadata {METADATA_KEY!r} is not a Checkpoint layout"
        )
    version = layout.get("version")
    if not isinstance(version, int) or version > LAYOUT_VERSION:
        raise RestoreMismatchError(
            f"{path}: Checkpoint layout version {version!r} is newer than this shardkit reads "
            f"({LAYOUT_VERSION}); upgrade shardkit"
        )
    return layout["objects"]


__all__ = [
    "Checkpoint",
    "CheckpointLoadStatus",
    "CheckpointManager",
    "CheckpointOptions",
    "SaveHandle",
]
