"""TensorFlow's deferred restore, checked first: a restore target of TensorFlow objects whose
keys do not match a TensorBundle's one to one (an unbuilt Keras optimizer has no slots yet)
is restored by TensorFlow's own ``tf.train.Checkpoint.read``, which binds objects by the
bundle's object graph, assigns what exists as it goes and defers the values of objects not
created yet to their creation. Before that read, `check_deferred` binds the graph the same way
and checks every value it would assign, so a mismatch changes nothing.

Imported by `io.restore` only for such a restore (it imports TensorFlow).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf  # type: ignore[import-untyped]

from ..errors import RestoreMismatchError
from .tensorflow import _assignable, host_dtype, is_trackable, object_variables

Stored = Callable[[str], "tuple[tuple[int, ...], np.dtype] | None"]
"""A checkpoint key -> its stored shape and dtype, or None when the checkpoint lacks it."""


def read_deferred(state: Any, path: str, graph: bytes,
                  stored: Stored) -> None:
    """Restore `state` (`objects_only`) from the TensorBundle at `path` (a prefix, its
    ``.index`` or a directory with a state file) with TensorFlow's own
    ``tf.train.Checkpoint.read``: what exists now is assigned, values of objects not created
    yet (an unbuilt Keras optimizer's slots) are restored when they are created, as
    TensorFlow defers them.

    Everything is checked before anything is assigned (TensorFlow's read assigns as it
    matches, so a mismatch found late left the target half restored): `check_deferred`
    matches the bundle's object graph `graph` against `state`'s objects as TensorFlow does
    and checks each matched variable against `stored` (checkpoint key -> shape and dtype).

    Raises:
        RestoreMismatchError: a matched variable's shape or dtype differs from the stored
            one, the graph names a value the bundle lacks, or an existing variable of `state`
            matches nothing in the graph; nothing was changed.
    """
    root = state if is_trackable(state) else tf.train.Checkpoint(**state)
    check_deferred(root, path, graph, stored)
    prefix = path
    if os.path.isdir(path):
        prefix = tf.train.latest_checkpoint(path) or path
    elif path.endswith(".index"):
        prefix = path[: -len(".index")]
    status = root.read(prefix)
    try:
        status.assert_existing_objects_matched()
    except AssertionError as e:
        raise RestoreMismatchError(f"cannot restore from {path}: {e}") from None


def check_deferred(root: Any, path: str, graph: bytes,
                   stored: Stored) -> None:
    """What `read_deferred` checks first, changing nothing: the nodes of the object graph
    `graph` (a serialized ``TrackableObjectGraph``) bound to `root`'s objects by local name
    from the root, breadth first, as TensorFlow's restore binds them (a node whose object does
    not exist yet is deferred: not checked); each bound variable's ``VARIABLE_VALUE`` against
    `stored`; then every variable of `root` bound to some node.

    Raises:
        RestoreMismatchError: as `read_deferred`.
    """
    from tensorflow.core.protobuf import (  # type: ignore[import-untyped]
        trackable_object_graph_pb2,
    )
    from tensorflow.python.trackable import base  # type: ignore[import-untyped]

    proto = trackable_object_graph_pb2.TrackableObjectGraph()
    proto.ParseFromString(graph)
    if not proto.nodes:
        raise RestoreMismatchError(f"cannot restore from {path}: its object graph is empty")
    bound: dict[int, Any] = {0: root}
    names = {0: ""}
    queue = [0]
    matched: set[int] = set()  # id() of the variables bound to a node
    while queue:
        node_id = queue.pop(0)
        obj = bound[node_id]
        node = proto.nodes[node_id]
        if _assignable(obj):
            matched.add(id(obj))
            for attribute in node.attributes:
                if attribute.name == "VARIABLE_VALUE":
                    _check_stored(obj, attribute.checkpoint_key, names[node_id], path, stored)
        if not node.children:
            continue
        children = obj._trackable_children(save_type=base.SaveType.CHECKPOINT)
        for ref in node.children:
            if ref.node_id in bound or not 0 <= ref.node_id < len(proto.nodes):
                continue
            child = children.get(ref.local_name)
            if child is None:
                continue  # not created yet: TensorFlow defers its values to its creation
            bound[ref.node_id] = child
            names[ref.node_id] = f"{names[node_id]}/{ref.local_name}".lstrip("/")
            queue.append(ref.node_id)
    unmatched = [key for key, variable in object_variables(root).items()
                 if _assignable(variable) and id(variable) not in matched]
    if unmatched:
        shown = ", ".join(repr(k) for k in unmatched[:10])
        more = f" and {len(unmatched) - 10} more" if len(unmatched) > 10 else ""
        raise RestoreMismatchError(
            f"cannot restore from {path}: its object graph has no object for "
            f"{len(unmatched)} variable(s) of the target: {shown}{more}; nothing was changed")


def _check_stored(variable: Any, key: str, where: str, path: str,
                  stored: Stored) -> None:
    """RestoreMismatchError unless the checkpoint value `key` fits `variable` (at object path
    `where` in the graph) in shape and dtype (a tf.string variable: any string tensor)."""
    got = stored(key)
    if got is None:
        raise RestoreMismatchError(
            f"cannot restore {where!r} from {path}: its object graph names the value {key!r}, "
            "which the checkpoint does not hold; nothing was changed")
    shape, dtype = got
    is_string = tf.as_dtype(variable.dtype) == tf.string
    want = np.dtype(object) if is_string else host_dtype(variable.dtype)
    if tuple(shape) != tuple(variable.shape) or (dtype.kind == "O") != is_string or (
            not is_string and dtype != want):
        raise RestoreMismatchError(
            f"cannot restore {where!r} from {path}: the checkpoint has {key!r} of shape "
            f"{list(shape)} dtype {dtype}, the target variable {_name(variable)} has shape "
            f"{list(variable.shape)} dtype {want}; nothing was changed")


def _name(variable: Any) -> str:
    return repr(getattr(variable, "path", None) or getattr(variable, "name", "?"))


__all__ = ["check_deferred", "read_deferred"]
