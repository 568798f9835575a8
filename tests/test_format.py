"""shardkit.format: shard header and index.json encode/decode, layout, golden bytes.

`write_checkpoint` below builds checkpoints from shardkit.format's encoders alone (no writer
module), so the reader tests (test_reader.py, test_bad_input.py) import it from here.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import xxhash

from shardkit import format as fmt
from shardkit.errors import (
    CorruptHeaderError,
    CorruptIndexError,
    EntryLayoutError,
    GenerationMismatchError,
    ShardPathError,
    TruncatedShardError,
    UnsupportedVersionError,
)
from shardkit.format import MANIFEST_FILE
from shardkit.values.slices import format_slice_spec

# --- checkpoint factory (used by the reader tests too) -----------------------------------------

Item = tuple[str, str, int, np.ndarray]  # key, slice spec, shard number, data of that slice


def row_slices(key: str, a: np.ndarray, parts: int, shards: Sequence[int]) -> list[Item]:
    """Split `a` along axis 0 into `parts` slices, slice i stored in shard shards[i]."""
    bounds = np.linspace(0, a.shape[0], parts + 1).astype(int)
    out = []
    for i in range(parts):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        offsets = (lo,) + (0,) * (a.ndim - 1)
        lengths = (hi - lo, *a.shape[1:])
        out.append((key, format_slice_spec(a.shape, offsets, lengths), shards[i], a[lo:hi]))
    return out


DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"


def write_checkpoint(
    path: Path,
    items: Sequence[Item],
    *,
    n_shards: int | None = None,
    checksum: bool = True,
    user_metadata: dict[str, Any] | None = None,
    full_shapes: dict[str, tuple[int, ...]] | None = None,
    generation: str | None = None,
    legacy: bool = False,
) -> fmt.CheckpointIndex:
    """Write shards + the manifest with shardkit.format's encoders. Items in save order; like the
    writer, the manifest lists each shard's slices in data-region order (docs/FORMAT.md section
    2). Without a `generation` the manifest says format 2.0 (no generation anywhere).
    `legacy`: exactly as formats 2.0 / 2.1 wrote checkpoints (2.1 with a `generation`):
    ``index.json``, shards ``shard-00000-of-0000N.safetensors`` whose ``__metadata__`` is
    ``{"format": "shardkit"}`` (then the generation); else the names and header metadata of
    format 2.2 (`fmt.MANIFEST_FILE`, `fmt.shard_file_name`, `fmt.shard_metadata`)."""
    path.mkdir(parents=True, exist_ok=True)
    n = n_shards if n_shards is not None else max(s for _, _, s, _ in items) + 1
    per_shard: list[list[Item]] = [[] for _ in range(n)]
    for it in items:
        per_shard[it[2]].append(it)
    keys = list(dict.fromkeys(k for k, _, _, _ in items))
    rows = {k: i for i, k in enumerate(keys)}
    dtypes: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for key, spec, _, a in items:
        if key not in shapes:
            dtypes[key] = fmt.safetensors_name(a.dtype)
            shapes[key] = tuple(
                a.shape if spec == "" else (full_shapes or {}).get(key) or _full(spec))
    slice_tensor: list[int] = []
    slice_spec: list[str] = []
    slice_shard: list[int] = []
    slice_xxh3: list[str | None] = []
    shard_infos = []
    for i, shard_items in enumerate(per_shard):
        layouts = fmt.layout_entries(
            [(fmt.entry_name(k, s), a.dtype, a.shape) for k, s, _, a in shard_items]
        )
        if legacy:
            header = fmt.encode_header_columns(
                [e.name for e in layouts], [e.dtype_name for e in layouts],
                [e.shape for e in layouts], [e.begin for e in layouts], [e.end for e in layouts],
                fmt.legacy_shard_metadata(generation))
        else:
            header = fmt.encode_safetensors_header(
                layouts, None if generation is None else {fmt.GENERATION_KEY: generation})
        data = bytearray(fmt.data_size(layouts))
        for e in layouts:
            key, spec, _, a = shard_items[e.order_index]
            raw = np.ascontiguousarray(a).tobytes()
            data[e.begin : e.end] = raw
            slice_tensor.append(rows[key])
            slice_spec.append(spec)
            slice_shard.append(i)
            slice_xxh3.append(xxhash.xxh3_64_hexdigest(raw) if checksum else None)
        name = legacy_shard_name(i, n) if legacy else fmt.shard_file_name(i, n)
        (path / name).write_bytes(header + bytes(data))
        shard_infos.append(fmt.ShardInfo(name, 0, "raw", len(header) + len(data), generation))
    index = fmt.CheckpointIndex(
        "test-callback", shard_infos, keys, [dtypes[k] for k in keys], [shapes[k] for k in keys],
        [DEVICE] * len(keys), slice_tensor, slice_spec, slice_shard, slice_xxh3,
        dict(user_metadata or {}),
        "2.0" if generation is None else "2.1" if legacy else fmt.FORMAT_VERSION, generation,
    )
    manifest = fmt.LEGACY_MANIFEST_FILE if legacy else fmt.MANIFEST_FILE
    (path / manifest).write_bytes(fmt.encode_index(index))
    return index


def legacy_shard_name(i: int, n: int) -> str:
    """Shard `i` (0-based) of `n` as formats 2.0 / 2.1 named it."""
    return f"shard-{i:05d}-of-{n:05d}.safetensors"


def _full(spec: str) -> tuple[int, ...]:
    return tuple(int(d) for d in spec.split(" ")[:-1])


def whole(items: dict[str, np.ndarray], n_shards: int = 1) -> list[Item]:
    """Whole tensors, assigned round robin to `n_shards` shards."""
    return [(k, "", i % n_shards, a) for i, (k, a) in enumerate(items.items())]


def index_document(path: Path) -> dict[str, Any]:
    """The parsed manifest of the checkpoint at `path` (found as the reader finds it)."""
    name = fmt.find_manifest(Path(path))
    assert name is not None, f"no manifest in {path}"
    return json.loads((Path(path) / name).read_bytes())


def tensor_view(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A 2.0 index document per key, in save order: dtype, shape, device (the string) and the
    slices ({spec, shard, entry, xxh3}, in listed order), with entry names composed as readers
    compose them (docs/FORMAT.md section 4)."""
    sk = doc["shardkit"]
    t, s = sk["tensors"], sk["slices"]
    view = {
        key: {"dtype": dtype, "shape": shape, "device": sk["devices"][device], "slices": []}
        for key, dtype, shape, device in zip(t["key"], t["dtype"], t["shape"], t["device"],
                                             strict=True)
    }
    for row, spec, shard, xxh3 in zip(s["tensor"], s["spec"], s["shard"], s["xxh3"], strict=True):
        key = t["key"][row]
        view[key]["slices"].append({"spec": spec, "shard": shard, "xxh3": xxh3,
                                    "entry": key if spec == "" else f"{key}:{spec}"})
    return view


# --- names -----------------------------------------------------------------------------------


def test_constants():
    assert fmt.FORMAT_NAME == "shardkit"
    assert fmt.FORMAT_VERSION == "2.2" and fmt.FORMAT_MAJOR == 2
    assert fmt.MANIFEST_FILE == "model.safetensors.index.json"  # HuggingFace's name
    assert fmt.MANIFEST_FILES == ("model.safetensors.index.json", "index.json")  # lookup order
    assert fmt.LEGACY_MANIFEST_FILE == "index.json" and fmt.INDEX_FILE == fmt.MANIFEST_FILE
    assert fmt.HEADER_FORMAT == "pt"
    assert fmt.shard_metadata("g") == {"format": "pt", "shardkit": "2.2", "generation": "g"}
    assert fmt.legacy_shard_metadata("g") == {"format": "shardkit", "generation": "g"}
    assert fmt.MAX_HEADER_BYTES == 100 * 1024 * 1024
    assert fmt.RAW_SUFFIX == ".safetensors"


def test_shard_file_name():
    # HuggingFace's names, numbered from 1 (format 2.2; 2.0 / 2.1 wrote shard-00000-of-...)
    assert fmt.shard_file_name(0, 3) == "model-00001-of-00003.safetensors"
    assert fmt.shard_file_name(2, 3, "raw") == "model-00003-of-00003.safetensors"
    assert fmt.shard_file_name(1, 12, "zstd") == "model-00002-of-00012.skz"
    assert fmt.shard_file_name(0, 1) == "model-00001-of-00001.safetensors"
    with pytest.raises(ValueError, match="unknown codec 'lz4'"):
        fmt.shard_file_name(0, 1, "lz4")
    with pytest.raises(ValueError, match=r"outside 0\.\.2"):
        fmt.shard_file_name(3, 3)


def test_entry_name():
    assert fmt.entry_name("model/w") == "model/w"
    assert fmt.entry_name("model/w", "") == "model/w"
    assert fmt.entry_name("model/w", "4 6 2,2:0,6") == "model/w:4 6 2,2:0,6"


# --- layout ----------------------------------------------------------------------------------


def test_layout_orders_by_descending_itemsize_stably():
    entries = [
        ("u8", np.dtype("u1"), (3,)),
        ("f64", np.dtype("f8"), (2,)),
        ("bf16", np.dtype(ml_dtypes.bfloat16), (5,)),
        ("f32a", np.dtype("f4"), ()),
        ("i16", np.dtype("i2"), (1,)),
        ("f32b", np.dtype("f4"), (2, 0)),
        ("f32c", np.dtype("f4"), (3,)),
    ]
    layouts = fmt.layout_entries(entries)
    assert [e.name for e in layouts] == ["f64", "f32a", "f32b", "f32c", "bf16", "i16", "u8"]
    assert [e.order_index for e in layouts] == [1, 3, 5, 6, 2, 4, 0]
    assert [(e.begin, e.end) for e in layouts] == [
        (0, 16), (16, 20), (20, 20), (20, 32), (32, 42), (42, 44), (44, 47)
    ]
    assert [e.dtype_name for e in layouts] == ["F64", "F32", "F32", "F32", "BF16", "I16", "U8"]
    assert fmt.data_size(layouts) == 47
    assert fmt.data_size([]) == 0


@pytest.mark.parametrize("seed", range(5))
def test_every_entry_is_aligned_for_mixed_dtypes(seed):
    rng = np.random.default_rng(seed)
    dtypes = [np.dtype(d) for d in ("f8", "f4", "f2", "i8", "i4", "i2", "i1", "u8", "?")]
    dtypes += [np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)]
    entries = [
        (f"t{i}", dtypes[rng.integers(len(dtypes))], tuple(rng.integers(0, 4, rng.integers(0, 3))))
        for i in range(30)
    ]
    layouts = fmt.layout_entries(entries)
    header = fmt.encode_safetensors_header(layouts)
    assert len(header) % 8 == 0
    for e in layouts:
        size = np.dtype(entries[e.order_index][1]).itemsize
        assert (len(header) + e.begin) % size == 0, e
    # contiguous, no holes
    pos = 0
    for e in layouts:
        assert e.begin == pos
        pos = e.end


def test_layout_rejects_duplicates_and_bad_shapes():
    with pytest.raises(ValueError, match="'a' appears twice"):
        fmt.layout_entries([("a", np.dtype("f4"), (1,)), ("a", np.dtype("f4"), (2,))])
    with pytest.raises(ValueError, match="negative dimension"):
        fmt.layout_entries([("a", np.dtype("f4"), (-1,))])


# --- header ----------------------------------------------------------------------------------

GOLDEN_HEADER = (  # format 2.0
    b"\x98\x00\x00\x00\x00\x00\x00\x00"  # N = 152: 151 bytes of JSON + 1 space
    b'{"__metadata__":{"format":"shardkit"},'
    b'"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
    b'"b:2 0,1":{"dtype":"I16","shape":[1],"data_offsets":[8,10]}}'
    b" "
)
GOLDEN_HEADER_2_2 = (  # no generation: the writer always adds one (GOLDEN_HEADER_2_2_GEN)
    b"\xa8\x00\x00\x00\x00\x00\x00\x00"  # N = 168: 162 bytes of JSON + 6 spaces
    b'{"__metadata__":{"format":"pt","shardkit":"2.2"},'
    b'"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
    b'"b:2 0,1":{"dtype":"I16","shape":[1],"data_offsets":[8,10]}}'
    b"      "
)


def _columns(layouts: list[fmt.EntryLayout]) -> tuple[list[Any], ...]:
    return ([e.name for e in layouts], [e.dtype_name for e in layouts],
            [e.shape for e in layouts], [e.begin for e in layouts], [e.end for e in layouts])


def test_golden_header_bytes():
    layouts = fmt.layout_entries(
        [("b:2 0,1", np.dtype("i2"), (1,)), ("w", np.dtype("f4"), (2,))]
    )
    header = fmt.encode_safetensors_header(layouts)
    assert header == GOLDEN_HEADER_2_2
    assert len(header) == 176
    assert struct.unpack("<Q", header[:8])[0] == 168
    legacy = fmt.encode_header_columns(*_columns(layouts), fmt.legacy_shard_metadata(None))
    assert legacy == GOLDEN_HEADER and len(legacy) == 160


def test_header_round_trip_with_metadata():
    layouts = fmt.layout_entries(
        [("a", np.dtype("f8"), (3, 2)), ("ü/ключ", np.dtype("u1"), ()), ("e", np.dtype("i4"), (0,))]
    )
    header = fmt.encode_safetensors_header(layouts, {"note": "x"})
    size = len(header) + fmt.data_size(layouts)
    entries, meta, start = fmt.decode_safetensors_header(header, size, "s.safetensors")
    assert start == len(header)
    assert meta == {"format": "pt", "shardkit": "2.2", "note": "x"}
    assert list(entries) == ["a", "e", "ü/ключ"]
    for e in layouts:
        d = entries[e.name]
        assert (d.dtype_name, d.shape, d.begin, d.end) == (e.dtype_name, e.shape, e.begin, e.end)


def test_encode_header_rejects_bad_metadata_and_reserved_names():
    with pytest.raises(TypeError, match="str to str"):
        fmt.encode_safetensors_header([], {"n": 1})  # type: ignore[dict-item]
    bad = [fmt.EntryLayout("__metadata__", "F32", (), 0, 4, 0)]
    with pytest.raises(ValueError, match="reserved"):
        fmt.encode_safetensors_header(bad)


def _pread_of(f):
    """`f`'s bytes as the header readers take them: ``read(start, end)``."""
    return lambda start, end: os.pread(f.fileno(), end - start, start)


def test_read_header_from_file(tmp_path):
    layouts = fmt.layout_entries([("x", np.dtype("f4"), (4,))])
    header = fmt.encode_safetensors_header(layouts)
    p = tmp_path / "s.safetensors"
    p.write_bytes(header + bytes(16))
    with open(p, "rb") as f:
        entries, _, start = fmt.read_safetensors_header(
            _pread_of(f), p.stat().st_size, str(p))
    assert start == len(header)
    assert entries["x"].end == 16


def _header(d: Any, pad: bool = True) -> bytes:
    text = d if isinstance(d, bytes) else json.dumps(d).encode()
    if pad:
        text += b" " * (-(len(text) + 8) % 8)
    return struct.pack("<Q", len(text)) + text


def _entry(dtype: str, shape: list[int], b: int, e: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [b, e]}


@pytest.mark.parametrize(
    ("header", "data", "error", "match"),
    [
        (b"{not json", 0, CorruptHeaderError, "s.bin: header is not valid JSON"),
        (b"\xff\xfe", 0, CorruptHeaderError, "s.bin: header is not UTF-8"),
        ([1, 2], 0, CorruptHeaderError, "must be a JSON object, found list"),
        ({"a": 3}, 0, CorruptHeaderError, "entry 'a' must be a JSON object"),
        ({"a": {"dtype": "F32"}}, 0, CorruptHeaderError, r"entry 'a' lacks the field\(s\)"),
        ({"a": _entry("Q7", [1], 0, 4)}, 4, CorruptHeaderError, "entry 'a' has unknown dtype 'Q7'"),
        ({"a": _entry("F32", [-1], 0, 4)}, 4, CorruptHeaderError, "'a': shape must be a list"),
        ({"a": _entry("F32", [1.0], 0, 4)}, 4, CorruptHeaderError, "'a': shape must be a list"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, 4, CorruptHeaderError,
         "'a': data_offsets must be 2 integers"),
        ({"a": _entry("F32", [2], 0, 4)}, 4, EntryLayoutError, "span 4 bytes, but dtype F32"),
        ({"a": _entry("F32", [1], 4, 0)}, 4, EntryLayoutError, "not 0 <= begin <= end"),
        ({"a": _entry("F32", [1], 8, 12)}, 4, EntryLayoutError,
         "'a' data_offsets .8, 12. run past"),
        ({"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [1], 4, 8)}, 8, EntryLayoutError,
         "entries 'a' .0, 8. and 'b' .4, 8. overlap"),
        ({"a": _entry("F32", [1], 0, 4), "b": _entry("F32", [1], 8, 12)}, 12, EntryLayoutError,
         "hole of 4 bytes after entry 'a'"),
        ({"a": _entry("F32", [1], 4, 8)}, 8, EntryLayoutError, "hole of 4 bytes at the start"),
        ({"a": _entry("F32", [1], 0, 4)}, 8, EntryLayoutError, "4 bytes after the last entry"),
        ({"__metadata__": {"x": 1}}, 0, CorruptHeaderError, "__metadata__ must map str to str"),
        (b'{"a":{"dtype":"U8","shape":[],"data_offsets":[0,1]},'
         b'"a":{"dtype":"U8","shape":[],"data_offsets":[1,2]}}', 2, CorruptHeaderError,
         "header has the key 'a' twice"),
    ],
)
def test_decode_header_rejects(header, data, error, match):
    buf = _header(header)
    with pytest.raises(error, match=match):
        fmt.decode_safetensors_header(buf + bytes(data), len(buf) + data, "s.bin")


def test_header_length_limits():
    with pytest.raises(TruncatedShardError, match=r"s\.bin: file is 5 bytes, shorter than the 8"):
        fmt.header_length(b"12345", 5, "s.bin")
    big = struct.pack("<Q", fmt.MAX_HEADER_BYTES + 1)
    with pytest.raises(CorruptHeaderError, match="exceeds the limit of 104857600 bytes"):
        fmt.header_length(big, 1 << 40, "s.bin")
    with pytest.raises(TruncatedShardError, match=r"runs past the end of the file \(8 \+ 100"):
        fmt.header_length(struct.pack("<Q", 100), 50, "s.bin")
    assert fmt.header_length(struct.pack("<Q", 100), 108, "s.bin") == 100


def test_safetensors_package_reads_our_shard(tmp_path):
    safetensors_numpy = pytest.importorskip(
        "safetensors.numpy", reason="safetensors (optional test dependency) is not installed"
    )
    from safetensors import safe_open

    rng = np.random.default_rng(0)
    arrays = {
        "i8": rng.integers(-9, 9, (3, 5)).astype(np.int8),
        "f64": rng.standard_normal((2, 3)),
        "scalar": np.array(7, np.int32),
        "f16": rng.standard_normal(7).astype(np.float16),
        "empty": np.zeros((0, 4), np.float32),
        "b": rng.integers(0, 2, 9).astype(bool),
        "u64": np.arange(4, dtype=np.uint64) * (1 << 60),
    }
    write_checkpoint(tmp_path, whole(arrays))
    shard = tmp_path / fmt.shard_file_name(0, 1)
    loaded = safetensors_numpy.load_file(str(shard))
    assert loaded.keys() == arrays.keys()
    for k, a in arrays.items():
        assert loaded[k].dtype == a.dtype and loaded[k].shape == a.shape
        np.testing.assert_array_equal(loaded[k], a)
    with safe_open(str(shard), "np") as f:
        assert f.metadata() == {"format": "pt", "shardkit": "2.2"}
        np.testing.assert_array_equal(f.get_tensor("f64"), arrays["f64"])


def test_our_decoder_reads_a_safetensors_file(tmp_path):
    safetensors_numpy = pytest.importorskip(
        "safetensors.numpy", reason="safetensors (optional test dependency) is not installed"
    )
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(3, dtype=np.int64)}
    p = tmp_path / "x.safetensors"
    safetensors_numpy.save_file(arrays, str(p))
    raw = p.read_bytes()
    entries, _, start = fmt.decode_safetensors_header(raw, len(raw), str(p))
    for k, a in arrays.items():
        e = entries[k]
        got = np.frombuffer(raw[start + e.begin : start + e.end], a.dtype).reshape(e.shape)
        np.testing.assert_array_equal(got, a)


# --- index -----------------------------------------------------------------------------------

D0 = "/job:localhost/replica:0/task:0/device:CPU:0"
D1 = "/job:w/replica:0/task:1/device:CPU:0"
SHARD_A, SHARD_B = "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"


def _index(generation: str | None = None) -> fmt.CheckpointIndex:
    """Rows: w (split over both shards), b, s, e; slices j: 0 w[0:2], 1 s, 2 w[2:4], 3 b, 4 e.
    Format 2.0 (no generation) unless a `generation` is given (2.1)."""
    index = fmt.CheckpointIndex.from_tensors(
        "max-shard-size(1KiB)",
        [fmt.ShardInfo(SHARD_A, 0, "raw", 120), fmt.ShardInfo(SHARD_B, 1, "raw", 96)],
        {
            "w": fmt.TensorInfo("F32", (4, 6), D0, [
                fmt.SliceInfo("4 6 0,2:0,6", 0, "w:4 6 0,2:0,6", "0123456789abcdef"),
                fmt.SliceInfo("4 6 2,2:0,6", 1, "w:4 6 2,2:0,6", None),
            ]),
            "b": fmt.TensorInfo("BF16", (3,), D1, [fmt.SliceInfo("", 1, "b", None)]),
            "s": fmt.TensorInfo("I64", (), "/device:CPU:0", [fmt.SliceInfo("", 0, "s", None)]),
            "e": fmt.TensorInfo("U8", (0,), D0, [fmt.SliceInfo("", 1, "e", "2d06800538d394c2")]),
        },
        {"step": 3, "nested": {"lr": 0.5, "tags": ["a"]}}, generation,
    )
    if generation is None:
        index.version = "2.0"
    else:
        index.shards = [fmt.ShardInfo(s.file, s.task, s.codec, s.bytes, generation)
                        for s in index.shards]
    return index


EXPECTED_DOC: dict[str, Any] = {
    "format": "shardkit",
    "format_version": "2.0",
    "metadata": {"total_size": 4 * 6 * 4 + 3 * 2 + 8},
    "weight_map": {"b": SHARD_B, "s": SHARD_A, "e": SHARD_B},
    "shardkit": {
        "callback": "max-shard-size(1KiB)",
        "devices": [D0, D1, "/device:CPU:0"],
        "shards": [{"file": SHARD_A, "task": 0, "codec": "raw", "bytes": 120},
                   {"file": SHARD_B, "task": 1, "codec": "raw", "bytes": 96}],
        "tensors": {"key": ["w", "b", "s", "e"], "dtype": ["F32", "BF16", "I64", "U8"],
                    "shape": [[4, 6], [3], [], [0]], "device": [0, 1, 2, 0]},
        "slices": {"tensor": [0, 2, 0, 1, 3], "spec": ["4 6 0,2:0,6", "", "4 6 2,2:0,6", "", ""],
                   "shard": [0, 0, 1, 1, 1],
                   "xxh3": ["0123456789abcdef", None, None, None, "2d06800538d394c2"]},
        "user_metadata": {"step": 3, "nested": {"lr": 0.5, "tags": ["a"]}},
    },
}


def _compact(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def test_index_bytes_are_the_documented_column_layout():
    index = _index()
    data = fmt.encode_index(index)
    assert data == _compact(EXPECTED_DOC)
    assert list(json.loads(data)["weight_map"]) == ["b", "s", "e"]  # save order


def test_index_round_trip_and_hf_fields():
    index = _index()
    data = fmt.encode_index(index)
    back = fmt.decode_index(data, "ckpt/index.json")
    assert back == index
    assert fmt.encode_index(back) == data
    assert back.version == "2.0" and back.callback == "max-shard-size(1KiB)"
    assert back.keys == ["w", "b", "s", "e"]
    assert back.devices == [D0, D1, "/device:CPU:0", D0]  # one string per tensor in memory
    assert back.entry_names() == ["w:4 6 0,2:0,6", "s", "w:4 6 2,2:0,6", "b", "e"]
    assert back.total_size() == EXPECTED_DOC["metadata"]["total_size"]
    assert list(back.tensors) == ["w", "b", "s", "e"]
    assert back.tensors["w"].is_split and not back.tensors["b"].is_split
    assert back.tensors["w"].slices == [
        fmt.SliceInfo("4 6 0,2:0,6", 0, "w:4 6 0,2:0,6", "0123456789abcdef"),
        fmt.SliceInfo("4 6 2,2:0,6", 1, "w:4 6 2,2:0,6", None)]
    assert back.tensors == index.tensors
    fresh = fmt.decode_index(data, "ckpt/index.json")  # tensor_info without building .tensors
    assert [fresh.tensor_info(k) for k in fresh.keys] == list(index.tensors.values())
    with pytest.raises(KeyError):
        fresh.tensor_info("nope")


GENERATION = "0123456789abcdef0123456789abcdef"


def _doc_2_1() -> dict[str, Any]:
    """EXPECTED_DOC as formats 2.1 and 2.2 write it: the generation right after the callback
    (2.2 changed file names and headers, not the manifest's content)."""
    doc = json.loads(json.dumps(EXPECTED_DOC))
    doc["format_version"] = fmt.FORMAT_VERSION
    sk = doc["shardkit"]
    doc["shardkit"] = {"callback": sk.pop("callback"), "generation": GENERATION, **sk}
    return doc


def test_index_2_1_bytes_record_the_generation_after_the_callback():
    data = fmt.encode_index(_index(GENERATION))
    assert data == _compact(_doc_2_1())
    back = fmt.decode_index(data, "ckpt/index.json")
    assert back == _index(GENERATION) and back.version == "2.2"
    assert back.generation == GENERATION
    assert {s.generation for s in back.shards} == {GENERATION}  # what each shard must record
    assert fmt.encode_index(back) == data


def test_index_2_0_without_a_generation_round_trips():
    data = fmt.encode_index(_index())
    assert b"generation" not in data
    back = fmt.decode_index(data, "ckpt/index.json")
    assert back.version == "2.0" and back.generation is None
    assert {s.generation for s in back.shards} == {None}


def test_new_generations_are_unique_hex():
    made = {fmt.new_generation() for _ in range(1000)}
    assert len(made) == 1000 and all(re.fullmatch(r"[0-9a-f]{32}", g) for g in made)


GOLDEN_HEADER_2_2_GEN = (
    b"\xd8\x00\x00\x00\x00\x00\x00\x00"  # N = 216: 210 bytes of JSON + 6 spaces
    b'{"__metadata__":{"format":"pt","shardkit":"2.2",'
    b'"generation":"0123456789abcdef0123456789abcdef"},'
    b'"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
    b'"b:2 0,1":{"dtype":"I16","shape":[1],"data_offsets":[8,10]}}'
    b"      "
)
GOLDEN_HEADER_2_1 = (
    b"\xc8\x00\x00\x00\x00\x00\x00\x00"  # N = 200: 199 bytes of JSON + 1 space
    b'{"__metadata__":{"format":"shardkit","generation":"0123456789abcdef0123456789abcdef"},'
    b'"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
    b'"b:2 0,1":{"dtype":"I16","shape":[1],"data_offsets":[8,10]}}'
    b" "
)


@pytest.mark.parametrize("version", ["2.2", "2.1"])
def test_golden_header_bytes_with_a_generation(tmp_path, version):
    layouts = fmt.layout_entries([("b:2 0,1", np.dtype("i2"), (1,)), ("w", np.dtype("f4"), (2,))])
    if version == "2.2":
        header = fmt.encode_safetensors_header(layouts, {fmt.GENERATION_KEY: GENERATION})
        assert header == GOLDEN_HEADER_2_2_GEN
        assert fmt.encode_header_columns(*_columns(layouts), fmt.shard_metadata(GENERATION)) \
            == header
        expected_meta = {"format": "pt", "shardkit": "2.2", "generation": GENERATION}
    else:  # what format 2.1 wrote, which readers still take without parsing
        header = fmt.encode_header_columns(*_columns(layouts),
                                           fmt.legacy_shard_metadata(GENERATION))
        assert header == GOLDEN_HEADER_2_1
        expected_meta = {"format": "shardkit", "generation": GENERATION}
    path = tmp_path / "s"
    path.write_bytes(header + bytes(10))
    size = len(header) + 10
    with open(path, "rb") as f:  # the writer's bytes are taken without parsing
        entries, meta, start, begins = fmt.read_expected_safetensors_header(
            _pread_of(f), size, "s", ["w", "b:2 0,1"], ["F32", "I16"], [(2,), (1,)],
            generation=GENERATION)
    assert (entries, begins, start) == (None, [0, 8], len(header))
    assert meta == expected_meta
    fmt.check_generation(meta, GENERATION, "s")
    with open(path, "rb") as f:  # another generation: parsed, and the check then refuses it
        entries, meta, _, begins = fmt.read_expected_safetensors_header(
            _pread_of(f), size, "s", ["w", "b:2 0,1"], ["F32", "I16"], [(2,), (1,)],
            generation="f" * 32)
    assert begins is None and list(entries) == ["w", "b:2 0,1"] and meta == expected_meta
    with pytest.raises(GenerationMismatchError, match=(
            "s: shard belongs to another checkpoint: the manifest is of generation f{32}, the "
            f"shard header records generation '{GENERATION}'")):
        fmt.check_generation(meta, "f" * 32, "s")
    fmt.check_generation(meta, None, "s")  # a 2.0 index checks nothing


@pytest.mark.parametrize("bad", ["", 5, [], "x" * 65, "a b", "ü" * 3, True])
def test_index_rejects_a_malformed_generation(bad):
    def change(doc):
        doc["shardkit"]["generation"] = bad

    with pytest.raises(CorruptIndexError, match=r"i\.json: field shardkit\.generation must be a "
                       r"string of 1 to 64 letters, digits, '_', '\.' or '-', found "):
        fmt.decode_index(_mutated(change), "i.json")


def test_decode_accepts_any_member_order_and_whitespace():
    reordered = json.dumps(EXPECTED_DOC, indent=3, sort_keys=True).encode()
    assert fmt.decode_index(reordered, "i.json") == _index()
    pretty = json.dumps(EXPECTED_DOC, indent="\t").encode()
    assert fmt.encode_index(fmt.decode_index(pretty, "i.json")) == _compact(EXPECTED_DOC)


def test_from_tensors_rejects_a_foreign_entry_name():
    with pytest.raises(ValueError, match=r"entry of 'a' slice '' must be 'a', got 'renamed'"):
        fmt.CheckpointIndex.from_tensors(
            "cb", [fmt.ShardInfo(SHARD_A, 0, "raw", 8)],
            {"a": fmt.TensorInfo("U8", (1,), D0, [fmt.SliceInfo("", 0, "renamed", None)])})


def test_single_full_box_slice_is_stored_as_key_colon_spec():
    def change(doc):  # as a writer records it: the tensor is not in weight_map
        _set("shardkit.slices.spec.3", "3 0,3")(doc)
        del doc["weight_map"]["b"]

    index = fmt.decode_index(_mutated(change), "i.json")
    assert index.tensors["b"].slices == [fmt.SliceInfo("3 0,3", 1, "b:3 0,3", None)]
    assert not index.tensors["b"].is_split
    assert "b" not in json.loads(fmt.encode_index(index))["weight_map"]


def test_index_rejects_unserialisable_metadata():
    index = _index()
    index.user_metadata = {"x": object()}
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        fmt.encode_index(index)


def _mutated(change) -> bytes:
    doc = json.loads(fmt.encode_index(_index()))
    change(doc)
    return json.dumps(doc).encode()


def _set(path: str, value: Any):
    def change(doc):
        *parents, last = path.split(".")
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node[int(last)] = value
        elif value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return change


_DELETE = object()


def _drop_slice(j: int):
    def change(doc):
        for column in doc["shardkit"]["slices"].values():
            del column[j]
    return change


def _add_tensor(key: str, dtype: str, shape: list[int], at: int, spec: str, shard: int):
    """Append a tensor (device 0) and insert its one slice as slice `at`."""
    def change(doc):
        t, s = doc["shardkit"]["tensors"], doc["shardkit"]["slices"]
        for name, value in (("key", key), ("dtype", dtype), ("shape", shape), ("device", 0)):
            t[name].append(value)
        for name, value in (("tensor", len(t["key"]) - 1), ("spec", spec), ("shard", shard),
                            ("xxh3", None)):
            s[name].insert(at, value)
    return change


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        # top level and versions
        (_set("format", "other"), CorruptIndexError,
         "\"format\" must be 'shardkit', found 'other'"),
        (_set("format", _DELETE), CorruptIndexError, "\"format\" must be 'shardkit', found None"),
        (_set("format_version", "3.0"), UnsupportedVersionError,
         r"version 3\.0 is newer than this shardkit reads \(up to 2\.x\); upgrade shardkit"),
        (_set("format_version", "1.0"), UnsupportedVersionError,
         r"version 1\.0 is a pre-release layout this shardkit no longer reads \(it reads 2\.x\)"),
        (_set("format_version", "2.x"), CorruptIndexError,
         "format_version must be a string like \"2.0\", found '2.x'"),
        (_set("format_version", "2"), CorruptIndexError, "format_version must be a string"),
        (_set("format_version", 2), CorruptIndexError, "format_version must be a string"),
        (_set("format_version", _DELETE), CorruptIndexError,
         "format_version must be a string like \"2.0\", found None"),
        (_set("metadata", []), CorruptIndexError, "'metadata' must be a JSON object"),
        (_set("weight_map", []), CorruptIndexError, "'weight_map' must be a JSON object"),
        (_set("metadata", _DELETE), CorruptIndexError, "missing field metadata"),
        (_set("weight_map", _DELETE), CorruptIndexError, "missing field weight_map"),
        (_set("shardkit", _DELETE), CorruptIndexError, "missing field shardkit"),
        (_set("shardkit", []), CorruptIndexError, "field shardkit must be dict, found list"),
        (_set("shardkit.callback", 5), CorruptIndexError, "shardkit.callback must be str"),
        (_set("shardkit.callback", _DELETE), CorruptIndexError,
         "missing field shardkit.callback"),
        (_set("shardkit.user_metadata", []), CorruptIndexError, "user_metadata must be dict"),
        # shards
        (_set("shardkit.shards", {}), CorruptIndexError, "field shardkit.shards must be list"),
        (_set("shardkit.shards.0", "x"), CorruptIndexError,
         r"shardkit\.shards\[0\] must be a JSON object"),
        (_set("shardkit.shards.0.task", -1), CorruptIndexError, r"shards\[0\].task must be >= 0"),
        (_set("shardkit.shards.0.bytes", True), CorruptIndexError, "bytes must be int"),
        (_set("shardkit.shards.1.codec", 3), CorruptIndexError,
         r"field shardkit\.shards\[1\]\.codec must be str"),
        (_set("shardkit.shards.0.file", _DELETE), CorruptIndexError,
         r"missing field shardkit\.shards\[0\]\.file"),
        (_set("shardkit.shards.0.file", ""), CorruptIndexError,
         "shard file name must be a non-empty string"),
        (_set("shardkit.shards.1.file", SHARD_A), CorruptIndexError, "listed twice"),
        (_set("shardkit.shards.0.file", "../evil.safetensors"), ShardPathError,
         "'../evil.safetensors' is not a plain file name"),
        (_set("shardkit.shards.0.file", "/etc/passwd"), ShardPathError, "'/etc/passwd'"),
        (_set("shardkit.shards.0.file", "a\\b"), ShardPathError, "not a plain file name"),
        (_set("shardkit.shards.0.file", "a\0b"), ShardPathError, "not a plain file name"),
        (_set("shardkit.shards.0.file", "index.json"), ShardPathError, "not a plain file name"),
        (_set("shardkit.shards.0.file", "a" * 256), ShardPathError, "at most 255 bytes"),
        (_set("shardkit.shards.0.file", "\u00e9" * 128), ShardPathError, "at most 255 bytes"),
        (_set("shardkit.shards.0.file", "x\ud800.safetensors"), ShardPathError,
         "not a plain file name"),
        # devices
        (_set("shardkit.devices", _DELETE), CorruptIndexError, "missing field shardkit.devices"),
        (_set("shardkit.devices.1", 1), CorruptIndexError,
         "field shardkit.devices must be a list of strings"),
        (_set("shardkit.devices", [D0, D1, D0]), CorruptIndexError,
         f"device '{D0}' is listed twice in shardkit.devices"),
        # the tensors columns
        (_set("shardkit.tensors", _DELETE), CorruptIndexError, "missing field shardkit.tensors"),
        (_set("shardkit.tensors", []), CorruptIndexError,
         "field shardkit.tensors must be dict, found list"),
        (_set("shardkit.tensors.key", _DELETE), CorruptIndexError,
         "missing field shardkit.tensors.key"),
        (_set("shardkit.tensors.key", "w"), CorruptIndexError,
         "field shardkit.tensors.key must be list, found str"),
        (_set("shardkit.tensors.key.1", 7), CorruptIndexError,
         "field shardkit.tensors.key must be a list of strings"),
        (_set("shardkit.tensors.dtype", ["F32", "BF16", "I64"]), CorruptIndexError,
         r"field shardkit\.tensors\.dtype has 3 values, expected 4 \(one per row\)"),
        (_set("shardkit.tensors.shape", [[4, 6], [3], [], [0], [1]]), CorruptIndexError,
         r"field shardkit\.tensors\.shape has 5 values, expected 4"),
        (_set("shardkit.tensors.device", [0]), CorruptIndexError,
         r"field shardkit\.tensors\.device has 1 values, expected 4"),
        (_set("shardkit.tensors.device", _DELETE), CorruptIndexError,
         "missing field shardkit.tensors.device"),
        (_set("shardkit.tensors.key.1", "w"), CorruptIndexError,
         "shardkit.tensors.key: key 'w' appears twice; checkpoint keys must be unique"),
        (_set("shardkit.tensors.key.1", ""), CorruptIndexError,
         "shardkit.tensors.key: a key is the empty string; checkpoint keys must be non-empty"),
        (_set("shardkit.tensors.key.1", "__metadata__"), CorruptIndexError,
         "shardkit.tensors.key: key '__metadata__' is reserved by the safetensors header"),
        (_set("shardkit.tensors.dtype.1", "F128"), CorruptIndexError,
         "tensor 'b' has unknown dtype 'F128'; known: F64"),
        (_set("shardkit.tensors.dtype.1", ["F32"]), CorruptIndexError,
         r"tensor 'b' has unknown dtype \['F32'\]"),
        (_set("shardkit.tensors.shape.1", [3, -1]), CorruptIndexError,
         r"tensor 'b' shape must be a list of non-negative integers, found \[3, -1\]"),
        (_set("shardkit.tensors.shape.1", "3"), CorruptIndexError,
         "tensor 'b' shape must be a list of non-negative integers, found '3'"),
        (_set("shardkit.tensors.shape.1", [3.0]), CorruptIndexError, "tensor 'b' shape must"),
        (_set("shardkit.tensors.shape.1", [True]), CorruptIndexError, "tensor 'b' shape must"),
        (_set("shardkit.tensors.device.3", 3), CorruptIndexError,
         r"tensor 'e': device 3 is not an index into shardkit\.devices \(3 entries\)"),
        (_set("shardkit.tensors.device.3", -1), CorruptIndexError, "tensor 'e': device -1 is not"),
        (_set("shardkit.tensors.device.3", "0"), CorruptIndexError, "tensor 'e': device '0' is"),
        # the slices columns
        (_set("shardkit.slices", _DELETE), CorruptIndexError, "missing field shardkit.slices"),
        (_set("shardkit.slices", []), CorruptIndexError, "field shardkit.slices must be dict"),
        (_set("shardkit.slices.tensor", _DELETE), CorruptIndexError,
         "missing field shardkit.slices.tensor"),
        (_set("shardkit.slices.spec", ["", "", "", ""]), CorruptIndexError,
         r"field shardkit\.slices\.spec has 4 values, expected 5"),
        (_set("shardkit.slices.shard", [0, 0, 1, 1, 1, 1]), CorruptIndexError,
         r"field shardkit\.slices\.shard has 6 values, expected 5"),
        (_set("shardkit.slices.xxh3", None), CorruptIndexError,
         "field shardkit.slices.xxh3 must be list, found NoneType"),
        (_set("shardkit.slices.tensor.4", 4), CorruptIndexError,
         r"slice 4: tensor 4 is not an index into shardkit\.tensors\.key \(4 entries\)"),
        (_set("shardkit.slices.tensor.4", True), CorruptIndexError, "slice 4: tensor True is not"),
        (_set("shardkit.slices.shard.4", 2), CorruptIndexError,
         r"slice 4: shard 2 is not an index into shardkit\.shards \(2 entries\)"),
        (_set("shardkit.slices.shard.1", -1), CorruptIndexError, "slice 1: shard -1 is not"),
        (_set("shardkit.slices.shard.0", 1), CorruptIndexError,
         r"shardkit\.slices must be listed shard by shard \(shard numbers never decreasing\)"),
        (_set("shardkit.slices.spec.1", None), CorruptIndexError,
         "shardkit.slices.spec must hold strings"),
        (_set("shardkit.slices.xxh3.1", "AB"), CorruptIndexError,
         "tensor 's' slice '': xxh3 must be 16 lowercase hex digits or null, found 'AB'"),
        (_set("shardkit.slices.xxh3.0", "0123456789ABCDEF"), CorruptIndexError,
         "tensor 'w' slice '4 6 0,2:0,6': xxh3 must be 16 lowercase hex"),
        (_set("shardkit.slices.xxh3.4", "2d06800538d394c2f"), CorruptIndexError,
         "tensor 'e' slice '': xxh3 must be"),
        (_set("shardkit.slices.xxh3.3", 5), CorruptIndexError, "found 5"),
        (_drop_slice(3), CorruptIndexError, "tensor 'b' has no slices"),
        (_set("shardkit.slices.spec.2", "4 6 3,1:0,6"), CorruptIndexError,
         r"the slices of tensor 'w' do not tile its shape \[4, 6\]: .*gap"),
        (_set("shardkit.slices.spec.2", "4 6 1,3:0,6"), CorruptIndexError,
         "slices of tensor 'w' do not tile .*overlap"),
        (_set("shardkit.slices.spec.2", "5 6 2,2:0,6"), CorruptIndexError,
         "tensor 'w': slice spec '5 6 2,2:0,6' is for shape"),
        (_set("shardkit.slices.spec.2", "garbage"), CorruptIndexError,
         "tensor 'w': malformed slice spec 'garbage'"),
        (_set("shardkit.slices.spec.2", ""), CorruptIndexError,
         "slices of tensor 'w' do not tile .*overlap"),
        (_set("shardkit.slices.spec.3", "3 0,2"), CorruptIndexError,
         r"the slices of tensor 'b' do not tile its shape \[3\]"),
        (_add_tensor("w:4 6 0,2:0,6", "F32", [2, 6], 1, "", 0), CorruptIndexError,
         f"entry 'w:4 6 0,2:0,6' of shard '{SHARD_A}' is claimed by more than one slice "
         r"\(tensors 'w' and 'w:4 6 0,2:0,6'\)"),
    ],
)
def test_decode_index_rejects(change, error, match):
    with pytest.raises(error, match=match) as info:
        fmt.decode_index(_mutated(change), "ckpt/index.json")
    assert "ckpt/index.json" in str(info.value)


def test_same_entry_name_in_different_shards_is_allowed():
    def change(doc):  # a whole tensor, so weight_map lists it
        _add_tensor("w:4 6 0,2:0,6", "F32", [2, 6], 5, "", 1)(doc)
        doc["weight_map"]["w:4 6 0,2:0,6"] = SHARD_B

    index = fmt.decode_index(_mutated(change), "i.json")
    assert index.entry_names().count("w:4 6 0,2:0,6") == 2


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"{", "not valid JSON"),
        (b"\xff", "not UTF-8"),
        (b"[]", "must be a JSON object, found list"),
        (b'{"format": "shardkit", "format": "shardkit"}', "has the key 'format' twice"),
        (b"[" * 100000 + b"]" * 100000, "nested more than 64 levels deep|must be a JSON object"),
    ],
)
def test_decode_index_rejects_bad_json(data, match):
    with pytest.raises(CorruptIndexError, match=match):
        fmt.decode_index(data, "ckpt/index.json")


def test_newer_minor_version_is_accepted_and_unknown_fields_ignored():
    def newer(doc):
        doc["format_version"] = "2.7"
        doc["shardkit"]["generation"] = GENERATION  # from 2.1 on, every manifest has one
        doc["added_later"] = {"x": 1}
        doc["shardkit"]["added_later"] = [1]
        doc["shardkit"]["tensors"]["added_later"] = ["one", "value", "per", "row"]
        doc["shardkit"]["slices"]["added_later"] = [1, 2]  # not checked against the row count
        doc["shardkit"]["shards"][0]["added_later"] = None

    index = fmt.decode_index(_mutated(newer), "i.json")
    assert index.version == "2.7" and index.generation == GENERATION
    assert index.tensors == _index().tensors
    assert json.loads(fmt.encode_index(index))["format_version"] == "2.7"


@pytest.mark.parametrize("section", ["tensors", "slices"])
def test_duplicate_keys_inside_an_unknown_column_are_rejected(section):
    """Readers ignore columns they do not know, but no JSON object anywhere may repeat a key."""
    def newer(doc):
        doc["format_version"] = "2.7"
        doc["shardkit"][section]["added_later"] = ["DUP"]

    data = _mutated(newer).replace(b'"DUP"', b'{"x": 1, "x": 2}')
    with pytest.raises(CorruptIndexError, match=r"i\.json: manifest has the key 'x' twice"):
        fmt.decode_index(data, "i.json")


def test_write_checkpoint_helper_produces_a_valid_tree(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    items = row_slices("a", a, 2, [0, 1]) + whole({"b": np.ones(2, np.int8)})
    index = write_checkpoint(tmp_path, items)
    assert sorted(os.listdir(tmp_path)) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", MANIFEST_FILE]
    back = fmt.decode_index((tmp_path / MANIFEST_FILE).read_bytes(), MANIFEST_FILE)
    assert back == index
    legacy = write_checkpoint(tmp_path / "legacy", items, generation=GENERATION, legacy=True)
    assert sorted(os.listdir(tmp_path / "legacy")) == [
        "index.json", "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    assert legacy.version == "2.1"
    assert [s.spec for s in back.tensors["a"].slices] == ["4 3 0,2:0,3", "4 3 2,2:0,3"]
    view = tensor_view(index_document(tmp_path))
    assert list(view) == ["a", "b"]
    assert view["b"] == {"dtype": "I8", "shape": [2], "device": DEVICE, "slices": [
        {"spec": "", "shard": 0, "entry": "b",
         "xxh3": xxhash.xxh3_64_hexdigest(np.ones(2, np.int8).tobytes())}]}


def test_slices_are_listed_in_data_region_order(tmp_path):
    """Like the writer, the factory lists a shard's slices in layout order (descending item
    size), which is what lets the reader take the header without parsing it."""
    from shardkit.io.reader import CheckpointReader

    items = whole({"u": np.ones(3, np.uint8), "d": np.ones(2), "h": np.ones(1, np.float16)})
    write_checkpoint(tmp_path, items)
    doc = index_document(tmp_path)
    assert doc["shardkit"]["tensors"]["key"] == ["u", "d", "h"]
    assert doc["shardkit"]["slices"]["tensor"] == [1, 2, 0]
    shard = (tmp_path / fmt.shard_file_name(0, 1)).read_bytes()
    header, _, _ = fmt.decode_safetensors_header(shard, len(shard), "s")
    assert list(header) == ["d", "h", "u"]
    with CheckpointReader(tmp_path) as r:
        assert r._shards.source(0).matches_index


def _doc_section(title: str) -> str:
    text = (Path(__file__).parent.parent / "docs" / "FORMAT.md").read_text()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _xxd_bytes(dump: str) -> bytes:
    """The bytes of an `xxd` dump (offset, 8 groups of 4 hex digits, text)."""
    out = b""
    for line in dump.strip().splitlines():
        offset, rest = line.split(": ", 1)
        assert int(offset, 16) == len(out)
        out += bytes.fromhex(rest[:39].replace(" ", ""))
    return out


def test_worked_example_of_the_format_doc(tmp_path):
    """The tiny checkpoint of docs/FORMAT.md section 10, byte for byte (shards and index)."""
    emb = np.array([[1, 2], [3, 4]], np.uint8)
    items = [("bias", "", 0, np.array([1.0, -2.0], np.float32)),
             ("step", "", 0, np.array(7, np.int64)),
             ("emb", "2 2 0,1:0,2", 0, emb[0:1]), ("emb", "2 2 1,1:0,2", 1, emb[1:2])]
    write_checkpoint(tmp_path, items, user_metadata={"epoch": 3}, legacy=True)
    s0 = (tmp_path / "shard-00000-of-00002.safetensors").read_bytes()
    s1 = (tmp_path / "shard-00001-of-00002.safetensors").read_bytes()
    assert len(s0) == 250 and s0[:8] == bytes.fromhex("e000000000000000")
    assert s0[8:28] == b'{"__metadata__":{"fo'
    # end of the JSON, 4 spaces, then the data: step = 7, bias = [1.0, -2.0], emb row 0
    assert s0[0xE0:] == bytes.fromhex("385d7d7d20202020" "0700000000000000" "0000803f000000c0"
                                      "0102")
    assert s1 == (
        bytes.fromhex("7000000000000000")
        + b'{"__metadata__":{"format":"shardkit"},'
        + b'"emb:2 2 1,1:0,2":{"dtype":"U8","shape":[1,2],"data_offsets":[0,2]}}'
        + b"      " + b"\x03\x04"
    )
    section = _doc_section("10. Worked example")
    dumps = re.findall(r"```\n(.*?)```", section, re.S)
    assert [_xxd_bytes(d) for d in dumps] == [s0, s1]
    (documented,) = re.findall(r"```json\n(.*?)```", section, re.S)
    data = (tmp_path / "index.json").read_bytes()
    assert data == _compact(json.loads(documented))
    view = tensor_view(json.loads(data))
    assert [s["xxh3"] for t in view.values() for s in t["slices"]] == [
        "28a0ba9c345d3723", "81671e58d6b596af", "08130b77ddef5807", "754ea65aedd96680"]


def test_index_example_of_the_format_doc(tmp_path):
    """The manifest example of docs/FORMAT.md section 2, byte for byte."""
    items = whole({"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                   "b/c": np.array(3, np.int8), "b/d": np.zeros(0)})
    write_checkpoint(tmp_path, items, generation=GENERATION)
    section = _doc_section("2. The manifest: model.safetensors.index.json")
    (documented,) = re.findall(r"```json\n(.*?)```", section, re.S)
    assert (tmp_path / MANIFEST_FILE).read_bytes() == _compact(json.loads(documented))


# --- hostile content: every failure a CorruptIndexError / CorruptHeaderError -------------------

HUGE = "1" + "0" * 5000  # over Python's int-string limit (4300 digits)


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def _index_text(change=None, pretty: bool = False) -> bytes:
    """The 2.1 index document, compact (as shardkit writes it) or pretty, with a JSON text edit:
    `change` maps the compact text to the text wanted."""
    data = fmt.encode_index(_index(GENERATION)).decode()
    if change is not None:
        data = change(data)
    if pretty:  # another writer's spelling: the fully checked json path
        data = data.replace(',"', ', "').rstrip("\n")
    return data.encode() + (b"" if pretty else b"\n")


@pytest.mark.parametrize("pretty", [False, True])
@pytest.mark.parametrize(("edit", "match"), [
    (lambda t: t.replace('"bytes":120', '"bytes":' + HUGE),
     "an integer with more than 4300 digits"),
    (lambda t: t.replace('"total_size":110', '"total_size":' + HUGE),
     "an integer with more than 4300 digits"),
    (lambda t: t.replace('"user_metadata":{', '"user_metadata":{"deep":' + _deep(62) + ","),
     "nested more than 64 levels deep"),
    (lambda t: t.replace('"format":"shardkit"', '"format":' + _deep(70)),
     "nested more than 64 levels deep"),
    (lambda t: t.replace('"weight_map":{', '"weight_map":{"x":' + _deep(5000) + ","),
     "nested more than 64 levels deep"),
    (lambda t: t.replace('"user_metadata":{', '"user_metadata":{"x":' + '{"a":' * 100 + "1"
                         + "}" * 100 + ","), "nested more than 64 levels deep"),
])
def test_index_with_huge_numbers_or_deep_nesting_is_refused(edit, match, pretty):
    with pytest.raises(CorruptIndexError, match=r"^ckpt/index\.json: .*" + match):
        fmt.decode_index(_index_text(edit, pretty), "ckpt/index.json")


@pytest.mark.parametrize("pretty", [False, True])
def test_nesting_up_to_the_limit_is_accepted(pretty):
    # the root object is level 1, shardkit 2, user_metadata 3: 61 more levels reach 64
    data = _index_text(lambda t: t.replace('"user_metadata":{', '"user_metadata":{"d":'
                                           + _deep(61) + ","), pretty)
    assert fmt.MAX_DEPTH == 64
    assert fmt.decode_index(data, "i.json").user_metadata["d"] == json.loads(_deep(61))


@pytest.mark.parametrize("value", ["x" * 1_000_000, ["y" * 100] * 100_000, 10**4000],
                         ids=["long-string", "long-list", "4000-digit-int"])
def test_error_messages_never_echo_a_huge_value(value):
    def change(doc):
        doc["format"] = value

    data = _mutated(change)
    with pytest.raises(CorruptIndexError, match="not a shardkit checkpoint index") as e:
        fmt.decode_index(data, "i.json")
    assert len(str(e.value)) < 300


@pytest.mark.parametrize(("shape", "match"), [
    ([0, 2**64], r"tensor 's': shape \[0, 18446744073709551616\] has more than 2\*\*63 - 1 bytes"),
    ([0, 2**62, 2**62], r"tensor 's': shape \[0, 4611686018427387904, 4611686018427387904\] has "
                        r"more than 2\*\*63 - 1 bytes"),
    ([1] * 65, r"tensor 's' has 65 dimensions, more than the limit of 64"),
])
def test_index_refuses_shapes_no_array_can_have(shape, match):
    with pytest.raises(CorruptIndexError, match=match):
        fmt.decode_index(_mutated(_set("shardkit.tensors.shape.2", shape)), "i.json")


def _header_bytes(text: str) -> bytes:
    body = text.encode()
    body += b" " * (-(len(body) + 8) % 8)
    return struct.pack("<Q", len(body)) + body


ENTRY = '"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}'


@pytest.mark.parametrize(("text", "match"), [
    ('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,' + HUGE + ']}}',
     "an integer with more than 4300 digits"),
    ('{"__metadata__":{"x":' + _deep(70) + '},' + ENTRY + '}', "nested more than 64 levels deep"),
    ('{"__metadata__":{"x":' + _deep(5000) + '},' + ENTRY + '}', "nested more than 64 levels deep"),
    ('{' + ENTRY + ',"b":{"dtype":' + _deep(100) + '}}', "nested more than 64 levels deep"),
    ('{' + ENTRY + ',"b":{"dtype":"U8","shape":[0,' + str(2**64) + '],"data_offsets":[2,2]}}',
     r"entry 'b': shape \[0, 18446744073709551616\] has more than 2\*\*63 - 1 bytes"),
    ('{' + ENTRY + ',"b":{"dtype":"U8","shape":' + json.dumps([1] * 65)
     + ',"data_offsets":[2,3]}}', "entry 'b' has 65 dimensions, more than the limit of 64"),
    ('{"__metadata__":{"format":' + json.dumps(["z" * 100_000]) + '},' + ENTRY + '}',
     r"__metadata__ must map str to str, got \{'format': \['z+\.\.\.z+'\]\}$"),
])
def test_shard_header_with_hostile_content_is_refused(text, match):
    data = _header_bytes(text)
    with pytest.raises(CorruptHeaderError, match=r"^s\.safetensors: .*" + match) as e:
        fmt.decode_safetensors_header(data + b"\x01\x02\x03", len(data) + 2, "s.safetensors")
    assert len(str(e.value)) < 400


# --- formats 2.0 / 2.1 on disk: index.json, shard-* names, {"format": "shardkit"} headers -------


@pytest.mark.parametrize("generation", [None, GENERATION], ids=["2.0", "2.1"])
def test_a_2_0_or_2_1_checkpoint_is_still_read_verified_and_replaceable(tmp_path, generation):
    from shardkit.io.reader import CheckpointReader, load
    from shardkit.storage import commit
    from shardkit.tools.cli import main

    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    items = row_slices("a", a, 2, [0, 1]) + whole({"b": np.ones(2, np.int8)})
    index = write_checkpoint(tmp_path / "c", items, generation=generation, legacy=True)
    ckpt = tmp_path / "c"
    assert fmt.find_manifest(ckpt) == "index.json" and commit.is_checkpoint(ckpt)
    with CheckpointReader(ckpt) as r:
        assert r.index == index and r.index.version == ("2.0" if generation is None else "2.1")
        assert r.verify() == 3
        np.testing.assert_array_equal(r["a"], a)
        # the old headers are recognised as the writer's own: taken without parsing
        assert all(r._shards.source(i).matches_index for i in range(2))
    assert main(["verify", str(ckpt)]) == 0
    doc = json.loads((ckpt / "index.json").read_bytes())
    doc["shardkit"]["shards"][1]["bytes"] += 8
    (ckpt / "index.json").write_text(json.dumps(doc))
    with CheckpointReader(ckpt) as r:  # a problem of the manifest blames the file that is there
        (problem,) = r.verify_report().problems
        assert problem.file == str(ckpt / "index.json")
    # saving over it (overwrite=True) replaces it by a 2.2 checkpoint: one manifest
    import shardkit

    shardkit.save(ckpt, {"a": a}, overwrite=True, options=shardkit.CheckpointOptions(durable=False))
    assert sorted(os.listdir(ckpt)) == ["model-00001-of-00001.safetensors", MANIFEST_FILE]
    np.testing.assert_array_equal(load(ckpt)["a"], a)


def test_find_manifest_prefers_the_huggingface_name(tmp_path):
    assert fmt.find_manifest(tmp_path) is None
    (tmp_path / "index.json").write_text("{}")
    assert fmt.find_manifest(tmp_path) == "index.json"
    (tmp_path / MANIFEST_FILE).symlink_to("nowhere")  # present (opening it decides)
    assert fmt.find_manifest(tmp_path) == MANIFEST_FILE
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert fmt.find_manifest(fd) == MANIFEST_FILE
    finally:
        os.close(fd)
    assert fmt.find_manifest(tmp_path / "missing") is None


@pytest.mark.parametrize("name", fmt.MANIFEST_FILES)
def test_a_shard_may_not_be_named_like_a_manifest(name):
    def change(doc):
        doc["shardkit"]["shards"][0]["file"] = name

    with pytest.raises(ShardPathError, match=rf"{re.escape(name)}' is not a plain file name"):
        fmt.decode_index(_mutated(change), "ckpt/m.json")


@pytest.mark.parametrize("version", ["2.1", "2.2", "2.7"])
def test_from_2_1_on_a_manifest_without_its_generation_is_corrupt(version):
    """Format 2.1 added the generation, and every writer since records it: a manifest of 2.1
    or later without one has lost it, and read as it is no shard would be checked against the
    save it belongs to. A 2.0 manifest has none and is read without the check."""
    def lost(doc):
        doc["format_version"] = version
        del doc["shardkit"]["generation"]

    data = json.dumps(_doc_2_1()).encode()
    assert fmt.decode_index(data, "i.json").generation == GENERATION
    doc = _doc_2_1()
    lost(doc)
    with pytest.raises(CorruptIndexError, match=rf"i\.json: format_version {version} records the "
                       r"checkpoint's generation, but shardkit\.generation is missing"):
        fmt.decode_index(json.dumps(doc).encode(), "i.json")
    assert fmt.decode_index(fmt.encode_index(_index()), "i.json").generation is None  # 2.0


def test_the_column_wise_fast_decode_is_the_checked_decode():
    """The fast decode cuts shardkit's manifest at the markers between its columns; keys and
    metadata that spell those markers (escaped inside their strings) decode exactly as the
    checked path decodes them, and so does an index whose bytes are not shardkit's own
    spelling (the checked path then runs)."""
    from shardkit.format import index_decoding as m

    keys = ['a],"dtype":["x', 'b},"slices":{"tensor":[', 'c]}', '},"shardkit":{"callback":']
    info = fmt.CheckpointIndex(
        "cb", [fmt.ShardInfo("model-00001-of-00001.safetensors", 0, "raw", 64, "g" * 8)], keys,
        ["F32"] * 4, [(1,), (2, 3), (), (0,)], ["cpu"] * 4, [0, 1, 2, 3], [""] * 4, [0] * 4,
        ["0" * 16, None, "f" * 16, "1" * 16],
        {"tensors": {"key": ["z"]}, "xxh3": [None], "weight_map": {"k": "v"}}, "2.2", "g" * 8)
    data = fmt.encode_index(info)
    assert m._canonical_document(data) is not None  # the fast path takes it
    checked = m._index_of(m._index_objects(m.parse_strict_object(data, "p", CorruptIndexError, ""),
                                           "p"), "p")
    fast = fmt.decode_index(data, "p")
    assert fast == checked and fast.keys == keys and fast.user_metadata == info.user_metadata
    assert fmt.encode_index(fast) == data
    spaced = data.replace(b'"dtype":', b'"dtype": ')  # valid JSON, not shardkit's spelling
    assert fmt.decode_index(spaced, "p") == checked
    repeated = data.replace(b'"weight_map":{', b'"weight_map":{"x":"y","x":"y",')
    with pytest.raises(CorruptIndexError, match="twice"):
        fmt.decode_index(repeated, "p")
