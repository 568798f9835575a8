"""The rules for checkpoint keys, one check shared by the writer and every reader. No I/O.

A checkpoint key is a str that is not empty, not ``__metadata__``, valid UTF-8 when encoded (no
lone surrogates) and unique in its checkpoint (docs/FORMAT.md section 2): ``{"a/b": x, "a":
{"b": y}}`` flattens to ``a/b`` twice and is refused. Anything else is allowed (``/``, ``:``,
any Unicode, ``a//b``, ``a`` beside ``a/b``). `save` checks the flattened keys before it
writes anything; `decode_index` checks the keys of every index it reads with the same function.

The check costs a few set operations and one UTF-8 encode of the joined keys, whatever the
number of keys; the per-key search that words an error runs only once one is known to exist.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import InvalidKeyError

RESERVED: frozenset[str] = frozenset({"__metadata__"})


def check_keys(keys: Sequence[str], *, origin: Callable[[int], str] | None = None,
               error: type[Exception] = InvalidKeyError, where: str = "") -> None:
    """Raise `error` (InvalidKeyError by default) unless every key of `keys` (all str) follows
    the rules above. `origin(i)` describes where key ``keys[i]`` came from (e.g. the path in
    the caller's state) for the message; `where` prefixes the message (a reader's file)."""
    problem = key_problem(keys, origin)
    if problem is not None:
        raise error(f"{where}{problem}")


def key_problem(keys: Sequence[str], origin: Callable[[int], str] | None = None) -> str | None:
    """None when `keys` follow the rules, else a sentence naming the first offending key."""
    unique = set(keys)
    if len(unique) != len(keys):
        return _duplicate(keys, origin)
    if "" in unique:
        return (f"a key is the empty string{_from(origin, list(keys).index(''))}; checkpoint "
                "keys must be non-empty")
    reserved = unique & RESERVED
    if reserved:
        key = min(reserved)
        return (f"key {key!r}{_from(origin, list(keys).index(key))} is reserved by the "
                "safetensors header format (it holds a shard's metadata); rename it")
    joined = "".join(keys)
    if not joined.isascii():
        try:
            joined.encode("utf-8")
        except UnicodeEncodeError:
            return _not_utf8(keys, origin)
    return None


def _from(origin: Callable[[int], str] | None, i: int) -> str:
    return f" (from {origin(i)})" if origin is not None else ""


def _duplicate(keys: Sequence[str], origin: Callable[[int], str] | None) -> str:
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        j = first.setdefault(key, i)
        if j != i:
            if origin is None:
                return f"key {key!r} appears twice; checkpoint keys must be unique"
            return (f"key {key!r} comes from two values, {origin(j)} and {origin(i)}: nested "
                    "keys are joined with '/', so a key containing '/' can collide with a "
                    "nested one; rename one of them")
    raise AssertionError("no duplicate found")  # pragma: no cover


def _not_utf8(keys: Sequence[str], origin: Callable[[int], str] | None) -> str:
    for i, key in enumerate(keys):
        try:
            key.encode("utf-8")
        except UnicodeEncodeError as e:
            return (f"key {key!r}{_from(origin, i)} is not valid UTF-8: character "
                    f"{key[e.start]!r} at position {e.start} is a lone surrogate; keys are "
                    "stored as UTF-8 JSON")
    raise AssertionError("no key fails to encode")  # pragma: no cover


__all__ = ["RESERVED", "check_keys", "key_problem"]
