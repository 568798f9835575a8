"""restore_into: copy a checkpoint's tensors into the caller's existing arrays and tensors; the
load status every restore returns (TensorFlow's CheckpointLoadStatus)."""
from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import (
    IncompleteRestoreError,
    InvalidArgumentTypeError,
    RestoreMismatchError,
    UnsupportedDTypeError,
)
from ..frameworks import (
    copy_into,
    expand_objects,
    is_dtensor,
    loaded,
    module,
    module_state,
    restore_target,
)
from ..sharding.structure import record_only
from ..sharding.tensors import OBJECT_GRAPH_KEY, flatten
from ..values.dtypes import numpy_dtype, safetensors_name
from .reader import CheckpointReader

_LARGE = 1 << 20  # whole tensors from this size on are copied in parallel pieces


def restore_into(path: str | os.PathLike[str], state: Mapping[str, Any], *,
                 verify: bool = False, partial: bool = False,
                 follow_symlinks: bool = False, prefix: str | None = None
                 ) -> CheckpointLoadStatus:
    """Copy the stored value of every leaf of `state` into it, in place.

    Everything (keys one to one, shapes, dtypes) is checked before anything is copied.

    Args:
        path: the checkpoint (directory, file or URL).
        state: nested mappings of numpy arrays, torch tensors (DTensors too), TensorFlow
            variables and objects, or a torch ``nn.Module`` (into its ``state_dict()``).
            Python values in it (None, str, numbers) cannot change in place: they are left as
            they are (`load(..., nested=True)` gives them back).
        verify: check the checksums of the entries read.
        partial: restore the leaves the checkpoint has and leave the others as they are.
        follow_symlinks: accept symlinked files.
        prefix: restore the sub-tree under this key prefix (as `load`'s): `state`'s keys and
            the status's are relative to it.
    Returns:
        The `CheckpointLoadStatus`: what was restored, missing and unexpected. jax arrays
        cannot change in place: for a `state` holding them (a pytree: dicts, lists, tuples,
        NamedTuples such as optax's states), its `state` is the restored tree, of the same
        structure (``jax.tree.structure``), dtypes and shardings, the other leaves as given.
    Raises:
        IncompleteRestoreError: keys do not match one to one and `partial` is False.
        RestoreMismatchError: a leaf's shape or dtype differs, or it cannot be written in place.
        InvalidArgumentTypeError: `partial` is not a bool.
        CheckpointNotFoundError, KeyNotFoundError, CheckpointFormatError: as `load`.
    """
    if not isinstance(partial, bool):
        raise InvalidArgumentTypeError(f"partial must be True or False, got {partial!r}")
    state = module_state(state)
    jax_module = loaded("jax")
    if jax_module is not None and jax_module.holds_arrays(state):
        host = jax_module.host_twin(state)  # numpy buffers in the tree's place, filled below
        status = _restore_into(path, host, verify, partial, follow_symlinks, prefix)
        missing = set(status.missing_keys)  # (partial) their buffers hold nothing: as given
        kept = {id(leaf) for key, leaf in flatten(host) if key in missing}
        status.state = jax_module.rebuild_like(state, host, kept)
        return status
    return _restore_into(path, state, verify, partial, follow_symlinks, prefix)


def _restore_into(path: str | os.PathLike[str], state: Mapping[str, Any], verify: bool,
                  partial: bool, follow_symlinks: bool, prefix: str | None
                  ) -> CheckpointLoadStatus:
    with CheckpointReader(path, follow_symlinks=follow_symlinks) as reader:
        if prefix is None and (tf_module := loaded("tensorflow")) is not None:
            tf_module.create_save_counter(state, reader)  # created lazily by TensorFlow
        targets = expand_objects(state, targets=True)  # TensorFlow objects: their variables
        # Python values cannot change in place: None, str and big ints (which only the
        # structure record holds) are left out, numbers are matched with their 0-d tensors
        leaves = [(key, leaf) for key, leaf in flatten(targets)
                  if type(leaf) is str or not record_only(leaf)]
        start, candidates = "", reader.keys()
        if prefix is not None:
            start, candidates = reader._shards.keys_under(prefix)
            leaves = [(start + key, leaf) for key, leaf in leaves]
        numbers = {key for key, leaf in leaves if type(leaf) in (bool, int, float)
                   or (type(leaf) is str and key not in reader)}  # a str: in the record
        if numbers:
            leaves = [(key, leaf) for key, leaf in leaves if key not in numbers]
        wanted = {key for key, _ in leaves} | numbers
        if targets is not state:  # the object graph is TensorFlow's bookkeeping, not a value
            wanted.add(start + OBJECT_GRAPH_KEY)
        missing = [key for key, _ in leaves if key not in reader]
        unexpected = [key for key in candidates if key not in wanted]
        # TensorFlow objects against a bundle with TensorFlow's object graph whose keys do not
        # match one to one (an unbuilt optimizer has no slots yet, a model not built the same
        # way names its variables otherwise): TensorFlow's own restore matches them by the
        # graph and defers the values of objects not created yet to their creation
        defer = (prefix is None and not partial and bool(missing or unexpected)
                 and targets is not state
                 and reader.format == "tensorbundle" and OBJECT_GRAPH_KEY in reader
                 and tf_module is not None and tf_module.objects_only(state))
        every = [key for key, _ in leaves]
        if not partial and not defer:
            check_complete(str(reader.path), missing, unexpected)
        elif missing:  # (with defer: those are checked by TensorFlow's graph match)
            absent = set(missing)
            leaves = [(key, leaf) for key, leaf in leaves if key not in absent]
        plans = []
        boxes: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        boxes_seen: dict[Any, Any] = {}  # the box per global shape, mesh and placements
        texts = []  # string tensors: (key, numpy target, the leaf to assign to when not numpy)
        for key, leaf in leaves:
            if reader._is_string(key):
                texts.append(_string_target(reader, key, leaf))
                continue
            t = reader._shards.tensor(key)
            box = None
            if is_dtensor(leaf):  # restored: the box of the global tensor this rank holds
                local, offset, local_shape = module("torch").dtensor_box(leaf, key, boxes_seen)
                target, writeback = _restore_target(local, key)
                box = offset
                boxes.append((key, offset, local_shape))
                shape = tuple(leaf.shape)
            else:
                target, writeback = _restore_target(leaf, key)
                shape = tuple(target.shape)
            expected = numpy_dtype(t.dtype)
            found = target.dtype
            if found.byteorder == ">":
                found = found.newbyteorder("<")
            if shape != t.shape or found != expected:
                what = "DTensor's global" if box is not None else "target has"
                raise RestoreMismatchError(
                    f"cannot restore key {key!r} from {reader.path}: the checkpoint has "
                    f"shape {list(t.shape)} dtype {_dtype_label(expected)}, the {what} "
                    f"shape {list(shape)} dtype {_dtype_label(target.dtype)}"
                )
            if writeback is None and not target.flags.writeable:
                raise RestoreMismatchError(
                    f"cannot restore key {key!r}: the target array is read-only"
                )
            if box is None and target.dtype.byteorder != ">" and target.flags.writeable and (
                    target.nbytes >= _LARGE or len(t.slices) > 1):
                box = (0,) * target.ndim  # read as the box of the whole tensor
            plans.append((key, target, writeback, box))
        if verify:
            sliced = {key for key, _, _ in boxes}
            whole = [key for key, *_ in plans if key not in sliced]
            whole += [key for key, _, _ in texts]
            if whole:
                reader.verify(whole)
            reader._verify_boxes(boxes)
        if defer:
            assert tf_module is not None
            graph = bytes(reader.get(OBJECT_GRAPH_KEY)[()])

            def stored_info(key: str) -> tuple[tuple[int, ...], np.dtype] | None:
                if key not in reader:
                    return None
                info = reader.info(key)
                return tuple(info.shape), info.dtype

            from ..frameworks.tensorflow_graph import read_deferred

            # checks everything TensorFlow's graph binds before its read assigns anything
            read_deferred(state, str(reader.path), graph, stored_info)
            return CheckpointLoadStatus(str(reader.path), every, [], unexpected)
        for key, target, assign in texts:
            stored = reader._get_string(key)
            if assign is not None:
                assign(stored)
            else:
                target[...] = stored
        # DTensors, and whole targets of a split or a large stored tensor, are read as boxes:
        # one copy from the map (or one read) per stored slice, in parallel, straight into the
        # target, never through a new array (small whole ones: the map view, copied)
        direct = reader._read_direct(
            [(key, target) for key, target, _, box in plans if box is None])
        reader._read_boxes_into(
            [(key, box, target) for key, target, _, box in plans if box is not None])
        done = {key for key, _, _, box in plans if box is not None} | direct
        assigns = [(key, writeback) for key, target, writeback, _ in plans if key not in done
                   and callable(writeback) and not target.flags.writeable]
        if assigns:  # TensorFlow variables: read in bulk, assigned in one batch
            from ..frameworks import tensorflow as tfw

            stored_all = reader._get_many([key for key, _ in assigns])
            tfw.assign_all([(fn, stored_all[key]) for key, fn in assigns])
        assigned = {key for key, _ in assigns}
        for key, target, writeback, _ in plans:
            if key in assigned:
                continue
            if key not in done:
                np.copyto(target, reader.get(key),
                          casting="equiv" if target.dtype.byteorder == ">" else "no")
            if writeback is not None:
                copy_into(writeback, target)
    restored = {key for key, *_ in plans} | {key for key, _, _ in texts}
    n = len(start)
    return CheckpointLoadStatus(str(reader.path), [k[n:] for k, _ in leaves if k in restored],
                                [k[n:] for k in missing], [k[n:] for k in unexpected])


def _string_target(reader: CheckpointReader, key: str, leaf: Any) -> tuple[str, Any, Any]:
    """(key, numpy array to fill, None) or (key, None, assign) for string tensor `key`;
    RestoreMismatchError unless `leaf` can take it in place (same kind and shape)."""
    info = reader.info(key)
    tfw = loaded("tensorflow")
    tf_assign = None if tfw is None else tfw.string_assign(leaf)  # for a tf.string variable
    if tf_assign is not None:
        shape, kind_ok = tuple(leaf.shape), True  # any string kind fits tf.string
        label = "tf.string"
    elif isinstance(leaf, np.ndarray):
        shape, kind_ok, label = leaf.shape, leaf.dtype == info.dtype, str(leaf.dtype)
        if kind_ok and not leaf.flags.writeable:
            raise RestoreMismatchError(f"cannot restore key {key!r}: the target array is "
                                       "read-only")
    else:
        raise RestoreMismatchError(
            f"cannot restore string tensor {key!r} in place into a {type(leaf).__name__}: "
            "only numpy arrays of its dtype and tf.string variables take it (use load())")
    if tuple(shape) != info.shape or not kind_ok:
        raise RestoreMismatchError(
            f"cannot restore key {key!r} from {reader.path}: the checkpoint has string tensor "
            f"shape {list(info.shape)} dtype {info.dtype}, the target has shape "
            f"{list(shape)} dtype {label}")
    return key, (None if tf_assign is not None else leaf), tf_assign


def copy_into_dtensor(reader: CheckpointReader, key: str, value: Any, dry: bool = False
                      ) -> None:
    """Fill this rank's local tensor of DTensor `value` with its box of the stored tensor `key`
    (global shape and dtype already checked), reading only the stored slices it intersects;
    `dry` only checks the placements."""
    local, offset, _ = module("torch").dtensor_box(value, key)
    if dry:
        return
    target, writeback = _restore_target(local, key)
    reader._read_boxes_into([(key, offset, target)])
    if writeback is not None:
        copy_into(writeback, target)


def _dtype_label(dt: np.dtype) -> str:
    try:
        return f"{safetensors_name(dt)} ({dt})"
    except UnsupportedDTypeError:
        return str(dt)


def _restore_target(leaf: Any, key: str) -> tuple[np.ndarray, Any]:
    """A numpy array sharing memory with `leaf`, and what to copy it back into when the leaf
    does not live in host memory (else None): a TensorFlow variable's assign, a torch tensor."""
    if isinstance(leaf, np.ndarray):
        return leaf, None
    got = restore_target(leaf, key)
    if got is not None:
        return got
    raise RestoreMismatchError(
        f"cannot restore key {key!r} in place into a {type(leaf).__name__}: only numpy arrays "
        "and torch tensors can be restored in place (use load() for a new dict)"
    )


@dataclasses.dataclass
class CheckpointLoadStatus:
    """What a restore matched, returned by `restore_into`, `Checkpoint.read` /
    `Checkpoint.restore` (and kept as `CheckpointManager.restore_status`).

    `restored_keys`: the target's values that were restored, in the target's order.
    `missing_keys`: values of the target that the checkpoint lacks (left unchanged).
    `unexpected_keys`: checkpoint values nothing in the target took.
    `state`: for a target holding jax arrays, the restored tree (below).

    A restore with missing or unexpected keys raises IncompleteRestoreError unless it was asked
    for with ``partial=True``; the assert_* methods then raise as TensorFlow's do.
    """

    path: str | None
    restored_keys: list[str]
    missing_keys: list[str]
    unexpected_keys: list[str]
    state: Any = None
    """`restore_into`'s target with its jax arrays replaced by the restored ones (jax arrays
    cannot change in place): the same tree; None when the target held none."""

    def assert_consumed(self) -> CheckpointLoadStatus:
        """Check that every value on both sides was matched.

        Returns:
            This status.
        Raises:
            IncompleteRestoreError: a value is missing or unexpected, or nothing was restored.
        """
        problems = []
        if self.missing_keys:
            problems.append(_listing("objects' values missing from the checkpoint",
                                     self.missing_keys))
        if self.unexpected_keys:
            problems.append(_listing("checkpoint values no object took", self.unexpected_keys))
        if self.path is None:
            problems.append("nothing was restored (restore(None))")
        if problems:
            raise IncompleteRestoreError(
                f"restore from {self.path} was not complete: " + "; ".join(problems)
            )
        return self

    def assert_existing_objects_matched(self) -> CheckpointLoadStatus:
        """Check that every value of the target was restored (checkpoint values may be left).

        Returns:
            This status.
        Raises:
            IncompleteRestoreError: a value of the target was not restored.
        """
        if self.missing_keys:
            raise IncompleteRestoreError(
                f"restore from {self.path}: "
                + _listing("objects' values missing from the checkpoint", self.missing_keys)
            )
        return self

    def assert_nontrivial_match(self) -> CheckpointLoadStatus:
        """Check that something was restored.

        Returns:
            This status.
        Raises:
            IncompleteRestoreError: nothing at all was restored.
        """
        if not self.restored_keys:
            raise IncompleteRestoreError(f"restore from {self.path} matched no value at all")
        return self

    def expect_partial(self) -> CheckpointLoadStatus:
        """Accept a partial restore (TensorFlow's spelling).

        Returns:
            This status.
        """
        return self


def check_complete(path: str, missing: list[str], unexpected: list[str]) -> None:
    """Raise IncompleteRestoreError naming the unmatched keys on both sides, if there are any.
    Called before anything is changed."""
    if not missing and not unexpected:
        return
    problems = []
    if missing:
        problems.append(_listing("target values missing from the checkpoint", missing))
    if unexpected:
        problems.append(_listing("checkpoint values nothing in the target takes", unexpected))
    hint = ""
    if missing and unexpected:
        close = difflib.get_close_matches(missing[0], unexpected[:10_000], n=1, cutoff=0.6)
        if close:
            hint = (f" (did you mean: {missing[0]!r} is stored as {close[0]!r}? A model wrapped "
                    "differently, e.g. in nn.Sequential or DataParallel, renames its keys)")
    raise IncompleteRestoreError(
        f"restore from {path} is incomplete: " + "; ".join(problems) + hint
        + "; nothing was changed. Pass partial=True to restore the values that match and leave "
        "the rest, then check the returned status (assert_consumed(), "
        "assert_existing_objects_matched())"
    )


def _listing(what: str, keys: list[str], limit: int = 10) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return f"{len(keys)} {what}: {shown}{more}"
