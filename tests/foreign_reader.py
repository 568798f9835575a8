"""What a HuggingFace directory or a single safetensors file says, read without shardkit: the
rules of docs/FORMAT.md (sections 3.1, 9 and 11) spelled out again in plain Python (json,
struct, numpy), so that the fuzz targets of tests/test_fuzz_huggingface.py can tell a mutant
that is another valid checkpoint (whose data shardkit must return) from one it must refuse.

`expected(path, seeds)` is the truth for one mutant directory, named ``<seed>-<n>``: its
tensors as numpy arrays, or None when the layout's rules refuse it. A ``sk`` mutant is a
shardkit checkpoint whose weight_map (or metadata) was edited: its truth is the seed's state
while the weight_map is still the one the writer wrote and metadata an object, else None.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER = 100 * 1024 * 1024
MAX_DEPTH = 64
MAX_NDIM = 64
MAX_NAME = 255


def _dtypes() -> dict[str, np.dtype]:
    import ml_dtypes

    return {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
            "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
            "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype("<i8"),
            "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
            "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"),
            "U8": np.dtype("u1"), "BOOL": np.dtype("?"), "C64": np.dtype("<c8"),
            "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
            "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz), "C128": np.dtype("<c16"),
            "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu)}


class Refused(Exception):
    """The file breaks a rule of its layout."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise Refused(f"key {k!r} twice")
        out[k] = v
    return out


def _depth(v: Any) -> int:
    if isinstance(v, dict):
        return 1 + max(map(_depth, v.values()), default=0)
    if isinstance(v, list):
        return 1 + max(map(_depth, v), default=0)
    return 0


def _json(data: bytes) -> Any:
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=_pairs,
                         parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: > 4300 digits
        raise Refused(f"not JSON: {e}") from None
    if _depth(doc) > MAX_DEPTH:
        raise Refused("nested too deep")
    return doc


def _no_constant(name: str) -> Any:
    raise Refused(f"{name} is not JSON")


def _int(v: Any) -> bool:
    return type(v) is int


def _key_ok(key: str) -> bool:
    if key in ("", "__metadata__"):
        return False
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def plain_name(name: Any) -> bool:
    """A file name a manifest may give: inside the directory, nothing else (section 9)."""
    if not isinstance(name, str) or not name:
        return False
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return size <= MAX_NAME and not (
        "/" in name or "\\" in name or "\0" in name or name.startswith("..")
        or name in (".", MANIFEST, "index.json") or (len(name) > 1 and name[1] == ":"))


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file (section 3.1's header rules), or Refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise Refused("missing") from None
    if not stat.S_ISREG(st.st_mode):
        raise Refused("not a regular file")
    data = path.read_bytes()
    if len(data) < 8:
        raise Refused("no length prefix")
    (n,) = struct.unpack_from("<Q", data)
    if n > MAX_HEADER or 8 + n > len(data):
        raise Refused("header length")
    header = _json(data[8 : 8 + n])
    if not isinstance(header, dict):
        raise Refused("header not an object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise Refused("__metadata__")
    region = memoryview(data)[8 + n :]
    dtypes = _dtypes()
    entries = []
    for name, e in header.items():
        if not _key_ok(name) or not isinstance(e, dict):
            raise Refused(f"entry {name!r}")
        if not {"dtype", "shape", "data_offsets"} <= e.keys():
            raise Refused("fields")
        dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(dtype, str) or dtype not in dtypes:
            raise Refused("dtype")
        if not isinstance(shape, list) or not all(_int(d) and d >= 0 for d in shape):
            raise Refused("shape")
        item = dtypes[dtype].itemsize
        if len(shape) > MAX_NDIM or math.prod(d for d in shape if d) * item > 2**63 - 1:
            raise Refused("no array has this shape")
        if not (isinstance(offs, list) and len(offs) == 2 and all(map(_int, offs))):
            raise Refused("data_offsets")
        begin, end = offs
        if not 0 <= begin <= end or end - begin != math.prod(shape) * item:
            raise Refused("offsets and size")
        entries.append((begin, end, name, dtypes[dtype], tuple(shape)))
    # the non-empty entries chain from 0 to the end of the region; empty ones sit on a boundary
    pos, bounds = 0, {0}
    for begin, end, *_ in sorted(e for e in entries if e[1] > e[0]):
        if begin != pos:
            raise Refused("hole or overlap")
        pos = end
        bounds.add(end)
    if pos != len(region) or any(b not in bounds for b, e, *_ in entries if b == e):
        raise Refused("tiling")
    return {name: np.frombuffer(region[begin:end], dtype).reshape(shape).copy()
            for begin, end, name, dtype, shape in entries}


def read_huggingface(directory: Path) -> dict[str, np.ndarray]:
    """The tensors of a HuggingFace sharded directory (section 11), or Refused."""
    doc = _json((directory / MANIFEST).read_bytes())
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise Refused("weight_map")
    if not isinstance(doc.get("metadata", {}), dict):
        raise Refused("metadata")
    weight_map: dict[str, Any] = doc["weight_map"]
    if not all(plain_name(f) for f in weight_map.values()):
        raise Refused("a file name that is not a plain name in the directory")
    out: dict[str, np.ndarray] = {}
    for file in sorted(set(weight_map.values())):
        for key, array in read_safetensors(directory / file).items():
            if weight_map.get(key) != file:
                raise Refused(f"{file} holds {key!r} elsewhere in weight_map or not in it")
            out[key] = array
    if out.keys() != weight_map.keys():
        raise Refused("weight_map names a key no shard holds")
    return out


def expected(path: Path, seeds: Path) -> dict[str, np.ndarray] | None:
    """The truth for mutant `path` (see the module docstring)."""
    kind = path.name.split("-")[0]
    try:
        if kind == "sk":
            seed = json.loads((seeds / "sk" / MANIFEST).read_bytes())["weight_map"]
            mutant = _json((path / MANIFEST).read_bytes())
            # the writer's weight_map, member order aside, and metadata still an object
            same = mutant.get("weight_map") == seed and isinstance(mutant.get("metadata"), dict)
            return sk_state() if same else None
        if kind == "st":
            return read_safetensors(path / SINGLE)
        return read_huggingface(path)
    except Refused:
        return None


def seed_truth(path: Path, seeds: Path) -> dict[str, np.ndarray]:
    """The state of the seed mutant `path` was made from (for a mutant that must be refused:
    every entry point is asked for all of it)."""
    kind = path.name.split("-")[0]
    return sk_state() if kind == "sk" else expected(seeds / kind, seeds) or {}


def sk_state() -> dict[str, np.ndarray]:
    """The shardkit seed: whole tensors in several shards, one split tensor, string tensors."""
    rng = np.random.default_rng(11)
    text = np.empty(3, object)
    text[:] = [b"one", b"", b"\xff\x00"]
    return {"w": rng.standard_normal((8, 8)).astype(np.float32),
            "b": rng.standard_normal(8).astype(np.float32),
            "ids": rng.integers(-(2**40), 2**40, 16, dtype=np.int64),
            "big": rng.integers(-1000, 1000, 300, dtype=np.int16),  # split by the policy
            "step": np.array(5, np.int64), "text": text,
            "names": np.array(["ab", "c\u00e9"])}
