"""Checkpoint format v1: pure encode/decode of shard headers and index.json, with every limit.

A raw shard is a safetensors file: ``u64`` little-endian header length N, N bytes of UTF-8 JSON
padded with spaces so that ``8 + N`` is a multiple of 8, then the data region. Entries are laid out
by descending item size (stable), contiguous, so each starts aligned to its item size.
``docs/FORMAT.md`` is the full specification. Nothing here writes files; decoders read only the
bytes they were given (``read_safetensors_header`` reads the header from an open file).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Final

import numpy as np

from .dtypes import SAFETENSORS_NAMES, itemsize, safetensors_name
from .errors import (
    CorruptHeaderError,
    CorruptIndexError,
    EntryLayoutError,
    ShardPathError,
    SliceSpecError,
    TruncatedShardError,
    UnsupportedVersionError,
)
from .slices import WHOLE, SliceSpec, check_tiling, parse_slice_spec

FORMAT_NAME: Final = "shardkit"
FORMAT_VERSION: Final = "1.0"
FORMAT_MAJOR: Final = 1
INDEX_FILE: Final = "index.json"
MAX_HEADER_BYTES: Final = 100 * 1024 * 1024
MAX_INDEX_BYTES: Final = 1024 * 1024 * 1024
RAW_SUFFIX: Final = ".safetensors"
ZSTD_SUFFIX: Final = ".skz"
CODEC_SUFFIXES: Final[dict[str, str]] = {"raw": RAW_SUFFIX, "zstd": ZSTD_SUFFIX}
HEADER_ALIGNMENT: Final = 8
METADATA_KEY: Final = "__metadata__"

_ITEMSIZE: Final[dict[str, int]] = {name: itemsize(name) for name in SAFETENSORS_NAMES}
_XXH3_RE: Final = re.compile(r"[0-9a-f]{16}")
_LEN = struct.Struct("<Q")
_xxh3_ok = _XXH3_RE.fullmatch


def shard_file_name(index: int, count: int, codec: str = "raw") -> str:
    """``shard-00000-of-00003.safetensors`` (``.skz`` for codec ``"zstd"``)."""
    try:
        suffix = CODEC_SUFFIXES[codec]
    except KeyError:
        raise ValueError(f"unknown codec {codec!r}; known: {', '.join(CODEC_SUFFIXES)}") from None
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} is outside 0..{count - 1}")
    return f"shard-{index:05d}-of-{count:05d}{suffix}"


def entry_name(key: str, slice_spec: str = WHOLE) -> str:
    """The entry name in a shard: the key for a whole tensor, ``"key:spec"`` for a slice."""
    return key if slice_spec == WHOLE else f"{key}:{slice_spec}"


# --- shard header -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EntryLayout:
    """One entry of a shard: where its bytes are, relative to the start of the data region.

    `order_index` is the entry's position in the input of `layout_entries` (writer side) or in the
    header (reader side).
    """

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    begin: int
    end: int
    order_index: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def layout_entries(entries: Sequence[tuple[str, np.dtype, Sequence[int]]]) -> list[EntryLayout]:
    """Order `entries` (name, dtype, shape) by descending item size, stably, with offsets.

    Offsets are contiguous from 0. Item sizes are powers of two, so every entry starts at a
    multiple of its own item size (and the data region itself starts at a multiple of 8).
    """
    items = []
    for i, (name, dtype, shape) in enumerate(entries):
        dt = np.dtype(dtype)
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"entry {name!r}: negative dimension in shape {list(dims)}")
        items.append((i, str(name), safetensors_name(dt), dims, dt.itemsize))
    items.sort(key=lambda t: -t[4])  # list.sort is stable
    out: list[EntryLayout] = []
    pos = 0
    seen: set[str] = set()
    for i, name, dtype_name, dims, size in items:
        if name in seen:
            raise ValueError(f"entry name {name!r} appears twice in one shard")
        seen.add(name)
        n = math.prod(dims) * size
        out.append(EntryLayout(name, dtype_name, dims, pos, pos + n, i))
        pos += n
    return out


def data_size(layouts: Sequence[EntryLayout]) -> int:
    """Bytes of the data region covered by `layouts`."""
    return max((e.end for e in layouts), default=0)


def encode_safetensors_header(
    layouts: Sequence[EntryLayout], metadata: Mapping[str, str] | None = None
) -> bytes:
    """The 8-byte length prefix plus the space-padded JSON header; data starts at len(result).

    `metadata` (str -> str, as safetensors requires) is merged into ``__metadata__`` after
    ``"format": "shardkit"``. Entries appear in the order given (use `layout_entries`).
    """
    meta: dict[str, str] = {"format": FORMAT_NAME}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"shard metadata must map str to str, got {k!r}: {v!r}")
        meta[k] = v
    header: dict[str, Any] = {METADATA_KEY: meta}
    for e in layouts:
        if e.name == METADATA_KEY or e.name in header:
            raise ValueError(f"entry name {e.name!r} is reserved or appears twice")
        header[e.name] = {"dtype": e.dtype_name, "shape": list(e.shape),
                          "data_offsets": [e.begin, e.end]}
    try:
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"an entry name cannot be encoded as UTF-8: {err}") from None
    pad = -(len(text) + 8) % HEADER_ALIGNMENT
    text += b" " * pad
    if len(text) > MAX_HEADER_BYTES:
        raise ValueError(
            f"shard header would be {len(text)} bytes, over the {MAX_HEADER_BYTES}-byte limit; "
            "use more, smaller shards"
        )
    return _LEN.pack(len(text)) + text


def header_length(prefix: bytes | bytearray | memoryview, file_size: int, path: str) -> int:
    """Check and return N from the first 8 bytes of a shard of `file_size` bytes."""
    if file_size < 8 or len(prefix) < 8:
        raise TruncatedShardError(
            f"{path}: file is {file_size} bytes, shorter than the 8-byte header length prefix"
        )
    (n,) = _LEN.unpack_from(prefix, 0)
    if n > MAX_HEADER_BYTES:
        raise CorruptHeaderError(
            f"{path}: header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes "
            "(not a shardkit/safetensors shard, or corrupt)"
        )
    if 8 + n > file_size:
        raise TruncatedShardError(
            f"{path}: header length {n} runs past the end of the file "
            f"(8 + {n} bytes needed, file has {file_size})"
        )
    return n


def _no_duplicates(what: str, path: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            for k, _ in pairs:
                if k in seen:
                    raise _Duplicate(f"{path}: {what} has the key {k!r} twice")
                seen.add(k)
        return out

    return hook


class _Duplicate(Exception):
    pass


def _is_int(x: Any) -> bool:
    return type(x) is int


_INT_ONLY: Final = frozenset({int})


def _dims(x: Any) -> bool:
    """True for a list of non-negative ints (not bools). Runs in C for the common case."""
    return type(x) is list and (not x or (set(map(type, x)) <= _INT_ONLY and min(x) >= 0))


def decode_safetensors_header(
    buf: bytes | bytearray | memoryview, file_size: int, path: str
) -> tuple[dict[str, EntryLayout], dict[str, str], int]:
    """Parse and validate a raw shard header from its first bytes (at least ``8 + N``).

    Returns (entries by name, in header order; ``__metadata__``; data_start). Checks the length
    prefix, JSON, every entry's dtype / shape / data_offsets, that entries tile the data region
    ``[0, file_size - data_start)`` exactly (no overlap, no hole, nothing out of range).
    """
    n = header_length(buf, file_size, path)
    if len(buf) < 8 + n:
        raise TruncatedShardError(f"{path}: got {len(buf)} bytes, the header needs {8 + n}")
    raw = bytes(buf[8 : 8 + n])
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates("header", path))
    except _Duplicate as e:
        raise CorruptHeaderError(str(e)) from None
    except UnicodeDecodeError as e:
        raise CorruptHeaderError(f"{path}: header is not UTF-8 ({e})") from None
    except json.JSONDecodeError as e:
        raise CorruptHeaderError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CorruptHeaderError(
            f"{path}: header must be a JSON object, found {type(header).__name__}"
        )
    data_start = 8 + n
    region = file_size - data_start
    metadata = header.pop(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(
        isinstance(v, str) for v in metadata.values()
    ):
        raise CorruptHeaderError(f"{path}: {METADATA_KEY} must map str to str, got {metadata!r}")
    entries: dict[str, EntryLayout] = {}
    for i, (name, value) in enumerate(header.items()):
        entries[name] = _decode_entry(name, value, i, path)
    _check_tiling(entries, region, path)
    return entries, metadata, data_start


def _decode_entry(name: str, e: Any, i: int, path: str) -> EntryLayout:
    if type(e) is dict:  # fast path for a valid entry; anything odd goes the slow, precise way
        dtype: Any = e.get("dtype")
        shape: Any = e.get("shape")
        offs: Any = e.get("data_offsets")
        size = _ITEMSIZE.get(dtype) if type(dtype) is str else None
        if size is not None and _dims(shape) and _dims(offs) and len(offs) == 2:
            begin, end = offs
            if begin <= end and end - begin == math.prod(shape) * size:
                return EntryLayout(name, dtype, tuple(shape), begin, end, i)
    return _decode_entry_checked(name, e, i, path)


def _decode_entry_checked(name: str, e: Any, i: int, path: str) -> EntryLayout:
    where = f"{path}: entry {name!r}"
    if not isinstance(e, dict):
        raise CorruptHeaderError(f"{where} must be a JSON object, found {type(e).__name__}")
    missing = {"dtype", "shape", "data_offsets"} - e.keys()
    if missing:
        raise CorruptHeaderError(f"{where} lacks the field(s) {sorted(missing)}")
    dtype = e["dtype"]
    if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
        raise CorruptHeaderError(
            f"{where} has unknown dtype {dtype!r}; known: {', '.join(SAFETENSORS_NAMES)}"
        )
    shape = e["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CorruptHeaderError(
            f"{where}: shape must be a list of non-negative integers, found {shape!r}"
        )
    offs = e["data_offsets"]
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)):
        raise CorruptHeaderError(f"{where}: data_offsets must be 2 integers, found {offs!r}")
    begin, end = offs
    if begin < 0 or end < begin:
        raise EntryLayoutError(f"{where}: data_offsets [{begin}, {end}] are not 0 <= begin <= end")
    expected = math.prod(shape) * _ITEMSIZE[dtype]
    if end - begin != expected:
        raise EntryLayoutError(
            f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes, but dtype {dtype} "
            f"and shape {shape} need {expected}"
        )
    return EntryLayout(name, dtype, tuple(shape), begin, end, i)


def _check_tiling(entries: Mapping[str, EntryLayout], region: int, path: str) -> None:
    pos = 0
    prev: EntryLayout | None = None
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.end > region:
            raise EntryLayoutError(
                f"{path}: entry {e.name!r} data_offsets [{e.begin}, {e.end}] run past the end of "
                f"the data region ({region} bytes)"
            )
        if e.begin < pos:
            assert prev is not None
            raise EntryLayoutError(
                f"{path}: entries {prev.name!r} [{prev.begin}, {prev.end}] and {e.name!r} "
                f"[{e.begin}, {e.end}] overlap"
            )
        if e.begin > pos:
            after = f"after entry {prev.name!r}" if prev is not None else "at the start"
            raise EntryLayoutError(
                f"{path}: hole of {e.begin - pos} bytes {after} (bytes {pos}..{e.begin}) "
                f"before entry {e.name!r}"
            )
        if e.nbytes:  # empty entries may sit anywhere inside the covered range
            pos, prev = e.end, e
    if pos != region:
        raise EntryLayoutError(
            f"{path}: {region - pos} bytes after the last entry are not covered by any entry "
            f"(data region is {region} bytes, entries end at {pos})"
        )


def read_safetensors_header(
    f: BinaryIO | int, file_size: int, path: str
) -> tuple[dict[str, EntryLayout], dict[str, str], int]:
    """Read and decode the header of an open shard (file object or descriptor) of `file_size`.

    Reads 8 bytes, checks N against the limit and the file size, then reads exactly N bytes.
    """
    prefix = _pread(f, 8, 0)
    n = header_length(prefix, file_size, path)
    body = _pread(f, n, 8)
    if len(body) < n:
        raise TruncatedShardError(f"{path}: header cut short: read {len(body)} of {n} bytes")
    return decode_safetensors_header(prefix + body, file_size, path)


def _pread(f: BinaryIO | int, n: int, offset: int) -> bytes:
    fd = f if isinstance(f, int) else f.fileno()
    chunks = []
    while n > 0:
        b = os.pread(fd, n, offset)
        if not b:
            break
        chunks.append(b)
        n -= len(b)
        offset += len(b)
    return b"".join(chunks)


# --- index.json -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One shard file: plain file name, device task, codec ("raw" / "zstd"), size in bytes."""

    file: str
    task: int
    codec: str
    bytes: int


@dataclass(frozen=True, slots=True)
class SliceInfo:
    """Where one slice of a tensor is stored: shard number, entry name, xxh3-64 hex or None."""

    spec: str
    shard: int
    entry: str
    xxh3: str | None


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor of the checkpoint: safetensors dtype name, full shape, device, its slices."""

    dtype: str
    shape: tuple[int, ...]
    device: str
    slices: list[SliceInfo]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]

    @property
    def is_split(self) -> bool:
        """More than one stored slice (one slice always covers the whole tensor)."""
        return len(self.slices) > 1


@dataclass(slots=True)
class CheckpointIndex:
    """The content of index.json. `tensors` keeps the order the tensors were saved in."""

    callback: str
    shards: list[ShardInfo]
    tensors: dict[str, TensorInfo]
    user_metadata: dict[str, Any] = field(default_factory=dict)
    version: str = FORMAT_VERSION


def encode_index(index: CheckpointIndex) -> bytes:
    """index.json bytes (compact UTF-8 JSON and a newline), with the HuggingFace-style
    metadata.total_size and weight_map (tensors stored whole, in an entry named after their key).
    """
    shards = index.shards
    # only tensors stored whole under their own key, which is what HF-style tools look up
    weight_map = {
        key: shards[t.slices[0].shard].file
        for key, t in index.tensors.items()
        if len(t.slices) == 1 and t.slices[0].entry == key
    }
    doc = {
        "format": FORMAT_NAME,
        "format_version": index.version,
        "metadata": {"total_size": sum(t.nbytes for t in index.tensors.values())},
        "weight_map": weight_map,
        "shardkit": {
            "callback": index.callback,
            "shards": [
                {"file": s.file, "task": s.task, "codec": s.codec, "bytes": s.bytes}
                for s in shards
            ],
            "tensors": {
                key: {
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "device": t.device,
                    "slices": [
                        {"spec": s.spec, "shard": s.shard, "entry": s.entry, "xxh3": s.xxh3}
                        for s in t.slices
                    ],
                }
                for key, t in index.tensors.items()
            },
            "user_metadata": index.user_metadata,
        },
    }
    try:  # compact: with indent, json falls back to its pure-Python encoder (20x slower)
        text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint metadata is not JSON-serialisable: {e}") from None
    return text.encode("utf-8") + b"\n"


def parse_version(version: Any, path: str) -> tuple[int, int]:
    """(major, minor) of a "MAJOR.MINOR" version; refuses majors newer than this reader's."""
    m = re.fullmatch(r"(\d+)\.(\d+)", version) if isinstance(version, str) else None
    if m is None:
        raise CorruptIndexError(
            f"{path}: format_version must be a string like \"1.0\", found {version!r}"
        )
    major, minor = int(m.group(1)), int(m.group(2))
    if major > FORMAT_MAJOR:
        raise UnsupportedVersionError(
            f"{path}: checkpoint format version {version} is newer than this shardkit reads "
            f"(up to {FORMAT_MAJOR}.x); upgrade shardkit to read it"
        )
    if major < 1:
        raise CorruptIndexError(f"{path}: format_version {version!r} is not a shardkit version")
    return major, minor


def check_shard_file_name(name: Any, path: str) -> str:
    """`name` if it is a plain file name inside the checkpoint directory, else ShardPathError."""
    if not isinstance(name, str) or not name:
        raise CorruptIndexError(f"{path}: shard file name must be a non-empty string, got {name!r}")
    if (
        "/" in name
        or "\\" in name
        or "\0" in name
        or name in (".", "..")
        or name.startswith("..")
        or os.path.isabs(name)
        or (len(name) > 1 and name[1] == ":")  # Windows drive
        or name == INDEX_FILE
    ):
        raise ShardPathError(
            f"{path}: shard file name {name!r} is not a plain file name inside the checkpoint "
            "directory (no '/', '\\', '..', absolute paths, drive letters, NUL or index.json)"
        )
    return name


def decode_index(data: bytes, path: str) -> CheckpointIndex:
    """Parse and validate index.json; every error is a CorruptIndexError (or subclass)
    naming `path` and the field, except newer majors: UnsupportedVersionError."""
    try:
        doc = json.loads(
            bytes(data).decode("utf-8"), object_pairs_hook=_no_duplicates("index.json", path)
        )
    except _Duplicate as e:
        raise CorruptIndexError(str(e)) from None
    except UnicodeDecodeError as e:
        raise CorruptIndexError(f"{path}: not UTF-8 ({e})") from None
    except json.JSONDecodeError as e:
        raise CorruptIndexError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CorruptIndexError(f"{path}: must be a JSON object, found {type(doc).__name__}")
    if doc.get("format") != FORMAT_NAME:
        raise CorruptIndexError(
            f"{path}: \"format\" must be {FORMAT_NAME!r}, found {doc.get('format')!r} "
            "(not a shardkit checkpoint index)"
        )
    version = doc.get("format_version")
    parse_version(version, path)
    assert isinstance(version, str)  # parse_version checked it
    sk = _field(doc, "shardkit", dict, path, "")
    for name, kind in (("metadata", dict), ("weight_map", dict)):
        if name in doc and not isinstance(doc[name], kind):
            raise CorruptIndexError(f"{path}: {name!r} must be a JSON object")
    callback = _field(sk, "callback", str, path, "shardkit.")
    user_metadata = _field(sk, "user_metadata", dict, path, "shardkit.")
    raw_shards = _field(sk, "shards", list, path, "shardkit.")
    shards: list[ShardInfo] = []
    seen_files: set[str] = set()
    for i, s in enumerate(raw_shards):
        where = f"shardkit.shards[{i}]."
        if not isinstance(s, dict):
            raise CorruptIndexError(f"{path}: shardkit.shards[{i}] must be a JSON object")
        file = check_shard_file_name(_field(s, "file", str, path, where), path)
        if file in seen_files:
            raise CorruptIndexError(f"{path}: shard file {file!r} is listed twice")
        seen_files.add(file)
        task = _nonneg_int(s, "task", path, where)
        codec = _field(s, "codec", str, path, where)
        nbytes = _nonneg_int(s, "bytes", path, where)
        shards.append(ShardInfo(file, task, codec, nbytes))
    raw_tensors = _field(sk, "tensors", dict, path, "shardkit.")
    tensors = {
        key: _decode_tensor(key, t, len(shards), path) for key, t in raw_tensors.items()
    }
    owner: dict[tuple[int, str], str] = {}
    for key, t in tensors.items():
        for s in t.slices:
            if (s.shard, s.entry) in owner:
                other = owner[(s.shard, s.entry)]
                raise CorruptIndexError(
                    f"{path}: entry {s.entry!r} of shard {shards[s.shard].file!r} is claimed by "
                    f"more than one slice (tensors {other!r} and {key!r})"
                )
            owner[(s.shard, s.entry)] = key
    return CheckpointIndex(callback, shards, tensors, user_metadata, version)


def _field(d: dict[str, Any], name: str, kind: type, path: str, where: str) -> Any:
    if name not in d:
        raise CorruptIndexError(f"{path}: missing field {where}{name}")
    v = d[name]
    if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
        raise CorruptIndexError(
            f"{path}: field {where}{name} must be {kind.__name__}, found {type(v).__name__} {v!r}"
        )
    return v


def _nonneg_int(d: dict[str, Any], name: str, path: str, where: str) -> int:
    v = _field(d, name, int, path, where)
    if v < 0:
        raise CorruptIndexError(f"{path}: field {where}{name} must be >= 0, found {v}")
    return int(v)


def _decode_tensor(key: str, t: Any, n_shards: int, path: str) -> TensorInfo:
    if type(t) is dict:  # fast path for a valid whole tensor; the rest goes the checked way
        dtype: Any = t.get("dtype")
        shape: Any = t.get("shape")
        device: Any = t.get("device")
        slices: Any = t.get("slices")
        if (
            type(dtype) is str
            and dtype in _ITEMSIZE
            and _dims(shape)
            and type(device) is str
            and type(slices) is list
            and len(slices) == 1
            and type(s := slices[0]) is dict
            and s.get("spec") == WHOLE
            and type(shard := s.get("shard")) is int
            and 0 <= shard < n_shards
            and type(entry := s.get("entry")) is str
            and ((xxh3 := s.get("xxh3")) is None or (type(xxh3) is str and _xxh3_ok(xxh3)))
        ):
            return TensorInfo(dtype, tuple(shape), device, [SliceInfo(WHOLE, shard, entry, xxh3)])
    return _decode_tensor_checked(key, t, n_shards, path)


def _decode_tensor_checked(key: str, t: Any, n_shards: int, path: str) -> TensorInfo:
    where = f"shardkit.tensors[{key!r}]."
    if not isinstance(t, dict):
        raise CorruptIndexError(f"{path}: tensor {key!r} must be a JSON object")
    dtype = _field(t, "dtype", str, path, where)
    if dtype not in _ITEMSIZE:
        raise CorruptIndexError(
            f"{path}: tensor {key!r} has unknown dtype {dtype!r}; known: "
            + ", ".join(SAFETENSORS_NAMES)
        )
    shape = _field(t, "shape", list, path, where)
    if not all(_is_int(d) and d >= 0 for d in shape):
        raise CorruptIndexError(
            f"{path}: tensor {key!r} shape must be a list of non-negative integers, found {shape}"
        )
    shape_t = tuple(shape)
    device = _field(t, "device", str, path, where)
    raw_slices = _field(t, "slices", list, path, where)
    if not raw_slices:
        raise CorruptIndexError(f"{path}: tensor {key!r} has no slices")
    slices: list[SliceInfo] = []
    specs: list[SliceSpec] = []
    for j, s in enumerate(raw_slices):
        sw = f"{where}slices[{j}]."
        if not isinstance(s, dict):
            raise CorruptIndexError(f"{path}: {sw[:-1]} must be a JSON object")
        spec = _field(s, "spec", str, path, sw)
        shard = _nonneg_int(s, "shard", path, sw)
        if shard >= n_shards:
            raise CorruptIndexError(
                f"{path}: tensor {key!r} slice {spec!r} is in shard {shard}, but the checkpoint "
                f"has {n_shards} shard(s)"
            )
        entry = _field(s, "entry", str, path, sw)
        xxh3 = s.get("xxh3", None)
        if xxh3 is not None and not (isinstance(xxh3, str) and _XXH3_RE.fullmatch(xxh3)):
            raise CorruptIndexError(
                f"{path}: tensor {key!r} slice {spec!r}: xxh3 must be 16 lowercase hex digits "
                f"or null, found {xxh3!r}"
            )
        try:
            specs.append(parse_slice_spec(spec, shape_t))
        except SliceSpecError as e:
            raise CorruptIndexError(f"{path}: tensor {key!r}: {e}") from None
        slices.append(SliceInfo(spec, shard, entry, xxh3))
    if len(slices) > 1 or slices[0].spec != WHOLE:
        try:
            check_tiling(shape_t, specs)
        except SliceSpecError as e:
            raise CorruptIndexError(
                f"{path}: the slices of tensor {key!r} do not tile its shape {list(shape_t)}: {e}"
            ) from None
    return TensorInfo(dtype, shape_t, device, slices)
