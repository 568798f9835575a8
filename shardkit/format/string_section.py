"""The manifest's ``shardkit.strings`` section (format 2.3, docs/FORMAT.md "String tensors"),
decoded and checked into the `strings.StringFile` that reads it."""

from __future__ import annotations

import math
import re
from typing import Any

from ..errors import CorruptIndexError
from ..values.keys import check_keys
from ..values.strings import KIND_RE, StringFile
from .common import MAX_NDIM, check_shard_file_name


def decode_strings_section(sec: Any, path: str, generation: str | None) -> StringFile:
    """The manifest's ``shardkit.strings`` object, checked; CorruptIndexError naming `path`."""
    where = "shardkit.strings"
    if type(sec) is not dict:
        raise CorruptIndexError(f"{path}: {where} must be a JSON object")
    for name, kind in (("file", str), ("bytes", int)):
        if type(sec.get(name)) is not kind:
            raise CorruptIndexError(f"{path}: field {where}.{name} is missing or not a "
                                    f"{kind.__name__}")
    file = check_shard_file_name(sec["file"], path)
    size = sec["bytes"]
    cols = {}
    for name in ("key", "kind", "shape", "device", "offset", "length", "xxh3"):
        col = sec.get(name)
        if type(col) is not list:
            raise CorruptIndexError(f"{path}: field {where}.{name} is missing or not a list")
        cols[name] = col
    n = len(cols["key"])
    bad = [name for name, col in cols.items() if len(col) != n]
    if bad:
        raise CorruptIndexError(f"{path}: {where}.{bad[0]} has {len(cols[bad[0]])} items, "
                                f"{where}.key {n}")
    keys = cols["key"]
    if not all(type(k) is str for k in keys):
        raise CorruptIndexError(f"{path}: {where}.key must hold strings")
    check_keys(keys, error=CorruptIndexError, where=f"{path}: {where}.key: ")
    for i, key in enumerate(keys):
        kind, shape, dev = cols["kind"][i], cols["shape"][i], cols["device"][i]
        off, length, digest = cols["offset"][i], cols["length"][i], cols["xxh3"][i]
        if type(kind) is not str or not KIND_RE.fullmatch(kind):
            raise CorruptIndexError(f"{path}: string tensor {key!r} has unknown kind "
                                    f"{str(kind)[:40]!r} (bytes, str, S<n>, U<n>)")
        if (type(shape) is not list or len(shape) > MAX_NDIM
                or not all(type(d) is int and 0 <= d < 2**40 for d in shape)):
            raise CorruptIndexError(f"{path}: string tensor {key!r} shape must be a list of "
                                    "non-negative integers")
        if type(dev) is not str:
            raise CorruptIndexError(f"{path}: string tensor {key!r} device must be a string")
        if not (type(off) is int and type(length) is int and 0 <= off and 0 <= length
                and off + length <= size and off % 8 == 0):
            raise CorruptIndexError(f"{path}: string tensor {key!r}: offset / length out of "
                                    f"range for a {size}-byte string file")
        if 16 + 8 * math.prod(shape) > length:
            raise CorruptIndexError(f"{path}: string tensor {key!r}: {length} bytes cannot hold "
                                    f"{math.prod(shape)} elements")
        if digest is not None and not (type(digest) is str and re.fullmatch(r"[0-9a-f]{16}",
                                                                             digest)):
            raise CorruptIndexError(f"{path}: string tensor {key!r}: xxh3 must be 16 "
                                    "lowercase hex digits or null")
    return StringFile(list(keys), list(cols["kind"]), [tuple(s) for s in cols["shape"]],
                      list(cols["device"]), file=file, size=size, offsets=list(cols["offset"]),
                      lengths=list(cols["length"]), xxh3=list(cols["xxh3"]),
                      generation=generation)
