"""Strict JSON for shard headers and the manifest: each object parsed as its (key, value) pairs
so that a repeated key is an error, nesting bounded by MAX_DEPTH, every failure worded as the
caller's error class naming the file."""

from __future__ import annotations

import json
from typing import Any, Final

from ..errors import CheckpointFormatError
from .common import _INT_DIGITS, MAX_DEPTH, shown


def parse_strict_object(
    data: bytes, path: str, error: type[CheckpointFormatError], what: str
) -> tuple[Any, ...]:
    """A UTF-8 JSON object as `_loads_pairs` gives it; any failure is `error` naming `path`.
    `what` ("header " or "" for a whole file) starts the messages."""
    subject = f"{what}is " if what else ""
    try:
        parsed = _loads_pairs(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        # the position only: a message never quotes the file's bytes
        raise error(f"{path}: {subject}not UTF-8 (invalid byte at position {e.start})") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: {subject}not valid JSON ({e})") from None
    except ValueError:  # json's int conversion: more digits than Python converts
        raise error(f"{path}: {subject}not valid: an integer with more than {_INT_DIGITS} digits"
                    ) from None
    except RecursionError:
        raise error(_too_deep(path, what)) from None
    if type(parsed) is not tuple:
        raise error(f"{path}: {what}must be a JSON object, found {type(parsed).__name__}")
    return parsed


def _too_deep(path: str, what: str = "") -> str:
    return (f"{path}: {what}JSON is nested more than {MAX_DEPTH} levels deep (the limit; the "
            "top-level object is level 1)")


def nesting_within(value: Any, levels: int) -> bool:
    """True if `value` (decoded JSON: dicts and lists) has at most `levels` levels of containers
    (a scalar has 0, ``[]`` 1, ``[[]]`` 2). Level by level, never recursing; a flat container
    costs one C-level pass over its values."""
    level = [value] if type(value) in _DOC_CONTAINERS else []
    for _ in range(levels):
        if not level:
            return True
        nxt = []
        for v in level:
            values = v.values() if type(v) is dict else v
            if not _DOC_CONTAINERS.isdisjoint(map(type, values)):
                nxt += [c for c in values if type(c) in _DOC_CONTAINERS]
        level = nxt
    return not level


_DOC_CONTAINERS: Final = frozenset({dict, list})


def _loads_pairs(text: str) -> Any:
    """json.loads, but every JSON object becomes a tuple of its (key, value) pairs.

    Duplicate keys must be detected, and a Python object_pairs_hook costs a call per object. With
    the C-level `tuple` as hook, objects stay distinguishable from arrays (lists) and the decoders
    below turn them into dicts (`pairs_to_dict`, `pairs_to_plain`), checking for duplicates as
    they go; the hot per-tensor / per-entry objects are matched against their fixed key sequence
    instead.
    """
    return json.loads(text, object_pairs_hook=tuple)


def pairs_to_dict(pairs: tuple[tuple[str, Any], ...], what: str, path: str, error: type) -> dict:
    """A dict of the (key, value) `pairs` of one JSON object; `error` on a repeated key."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise error(f"{path}: {what} has the key {shown(k)} twice")
            seen.add(k)
    return out


def pairs_to_plain(x: Any, what: str, path: str, error: type, level: int = 1) -> Any:
    """`x` from `_loads_pairs` with every nested object turned into a dict (duplicates checked).
    `x` sits at nesting `level` of its document; `error` if it nests deeper than MAX_DEPTH."""
    t = type(x)
    if t is not tuple and t is not list:
        return x
    if level > MAX_DEPTH:
        raise error(_too_deep(path))
    if t is tuple:
        d = pairs_to_dict(x, what, path, error)
        if not _CONTAINERS.isdisjoint(map(type, d.values())):  # else nothing to convert
            for k, v in d.items():
                if type(v) is tuple or type(v) is list:
                    d[k] = pairs_to_plain(v, what, path, error, level + 1)
        return d
    if _CONTAINERS.isdisjoint(map(type, x)):
        return x
    return [pairs_to_plain(v, what, path, error, level + 1) if type(v) in _CONTAINERS else v
            for v in x]


_CONTAINERS: Final = frozenset({tuple, list})
