"""TensorFlow's object graph (``_CHECKPOINTABLE_OBJECT_GRAPH``) rebuilt from checkpoint keys.

An object-based TensorFlow checkpoint stores each value under the path of local names from the
root to its object, then ``.ATTRIBUTES`` and the attribute's name
(``model/layer_with_weights-0/kernel/.ATTRIBUTES/VARIABLE_VALUE``), every name escaped as
TensorFlow's ``trackable_utils.escape_local_name`` does (``.`` -> ``..``, ``/`` -> ``./``).
The graph TensorFlow restores by is the tree of those paths: one node per path, its children
by local name, its attributes with their checkpoint keys. `object_graph` builds it for keys
that have no graph (a shardkit `Checkpoint` converted with ``shardkit convert --to
tensorflow``), without TensorFlow.
"""

from __future__ import annotations

from collections.abc import Iterable

ATTRIBUTES = ".ATTRIBUTES"


def _unescape(raw: str) -> str:
    out, i = [], 0
    while i < len(raw):
        if raw[i] == "." and i + 1 < len(raw) and raw[i + 1] in "./":
            out.append(raw[i + 1])
            i += 2
        else:
            out.append(raw[i])
            i += 1
    return "".join(out)


def split_key(key: str) -> tuple[list[str], str] | None:
    """A checkpoint key's object path (local names, unescaped) and attribute name, or None
    for a key that is not an object attribute's."""
    raw: list[str] = []  # the components between unescaped "/"s, still escaped
    start = i = 0
    while i < len(key):
        if key[i] == "." and i + 1 < len(key) and key[i + 1] in "./":
            i += 2
        elif key[i] == "/":
            raw.append(key[start:i])
            start = i = i + 1
        else:
            i += 1
    raw.append(key[start:])
    # a local name ".ATTRIBUTES" is stored escaped ("..ATTRIBUTES"): only the marker is raw
    if len(raw) < 2 or raw[-2] != ATTRIBUTES or ATTRIBUTES in raw[:-2] or "" in raw:
        return None
    return [_unescape(r) for r in raw[:-2]], _unescape(raw[-1])


def _is_marker(key: str) -> bool:
    return f"/{ATTRIBUTES}/" in key or key.startswith(f"{ATTRIBUTES}/")


def object_graph(keys: Iterable[str]) -> bytes | None:
    """The serialized ``TrackableObjectGraph`` of the object attributes among `keys` (node 0
    the root), or None when no key is one."""
    from .protos import TrackableObjectGraph

    graph = TrackableObjectGraph()
    root = graph.nodes.add()
    del root  # node 0
    ids: dict[tuple[str, ...], int] = {(): 0}
    found = False
    for key in keys:
        if not _is_marker(key):
            continue
        split = split_key(key)
        if split is None:
            continue
        path, attribute = split
        found = True
        for depth in range(1, len(path) + 1):
            here = tuple(path[:depth])
            if here not in ids:
                ids[here] = len(graph.nodes)
                graph.nodes.add()
                ref = graph.nodes[ids[here[:-1]]].children.add()
                ref.node_id, ref.local_name = ids[here], here[-1]
        tensor = graph.nodes[ids[tuple(path)]].attributes.add()
        tensor.name, tensor.full_name, tensor.checkpoint_key = attribute, "/".join(path), key
    return graph.SerializeToString() if found else None


__all__ = ["ATTRIBUTES", "object_graph", "split_key"]
