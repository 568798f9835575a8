"""Sizes, offsets and counts read from a file whose products or sums wrap int64: every
decoder refuses them with the corrupt-file error naming the file, the entry and the numbers
(docs/FORMAT.md sections 3.1 and 12), instead of reading other bytes."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import xxhash

import shardkit
from shardkit import format as fmt
from shardkit.adapters.tensorbundle import protos, table
from shardkit.adapters.tensorbundle.crc import crc32c, mask
from shardkit.errors import CorruptHeaderError, CorruptIndexError, TruncatedShardError
from shardkit.shards import skz

DT = protos.DATA_TYPES

# (dtype, shape, stored size): shape times item size is 2**64 or 2**63, which wraps int64 to
# 0 or -2**63; the stored size is what the wrapped product says
WRAPPING_SHAPES = [
    pytest.param("DT_DOUBLE", [2**61], 0, id="f64-2**61-size-0"),
    pytest.param("DT_FLOAT", [2**61], -(2**63), id="f32-2**61-size--2**63"),
    pytest.param("DT_INT64", [2**60, 2], 0, id="i64-2**60x2-size-0"),
]

ENTRY_POINTS = {
    "open": lambda p: shardkit.open(p).close(),
    "verify": lambda p: shardkit.open(p).verify(),
    "load": lambda p: shardkit.load(p),
    "get_slice": lambda p: shardkit.open(p).get_slice("a", (slice(0, 4),)),
}


@pytest.fixture(params=["whole", "sliced"])
def bundle(request, tmp_path):
    """A bundle of tensors "a" and "b"; "sliced": "b" stored as slices over three data files
    (the index's general path, one message per entry)."""
    state = {"a": np.arange(6, dtype=np.float32), "b": np.arange(4, dtype=np.int64)}
    prefix = tmp_path / "ck"
    policy = shardkit.MaxShardSizePolicy(max_shard_size=24) if request.param == "sliced" else None
    shardkit.save(prefix, state, format="tensorflow",
                  options=shardkit.CheckpointOptions(experimental_sharding_callback=policy))
    if request.param == "sliced":
        with shardkit.open(prefix) as r:
            assert len(r.info("a").slices) == 1 and len(r.info("b").slices) == 3
    return prefix


def _reseal_entry(prefix, key: bytes, edit) -> None:
    """Let `edit(entry)` change the entry of `key`, set its crc32c to what the data file holds
    over the bytes the entry names (clipped to the file), and write the table sealed."""
    path = prefix.parent / f"{prefix.name}.index"
    items = table.read_table(path.read_bytes(), str(path))
    out = []
    for k, v in items:
        if k == key:
            e = protos.BundleEntryProto.FromString(v)
            edit(e)
            data = (prefix.parent / f"{prefix.name}.data-{e.shard_id:05d}-of-"
                    f"{_num_shards(items):05d}").read_bytes()
            lo = max(0, min(e.offset, len(data)))
            e.crc32c = mask(crc32c(data[lo : lo + max(0, e.size)]))
            v = e.SerializeToString()
        out.append((k, v))
    path.write_bytes(table.build_table(out))


def _num_shards(items) -> int:
    return protos.BundleHeaderProto.FromString(items[0][1]).num_shards


def _set_shape(e, dtype: str, shape: list[int], size: int) -> None:
    e.dtype = DT[dtype]
    del e.shape.dim[:]
    for d in shape:
        e.shape.dim.add(size=d)
    e.size = size


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
@pytest.mark.parametrize("dtype, shape, size", WRAPPING_SHAPES)
def test_tensorbundle_shape_times_item_size_that_wraps(bundle, entry_point, dtype, shape, size):
    _reseal_entry(bundle, b"a", lambda e: _set_shape(e, dtype, shape, size))
    with pytest.raises(CorruptIndexError) as e:
        ENTRY_POINTS[entry_point](bundle)
    text = str(e.value)
    assert "ck.index" in text and "'a'" in text and str(size) in text, text


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
@pytest.mark.parametrize("offset", [2**63 - 8, 2**63 - 1, 2**63 - 24])
def test_tensorbundle_offset_plus_size_that_wraps(bundle, entry_point, offset):
    _reseal_entry(bundle, b"a", lambda e: setattr(e, "offset", offset))
    with pytest.raises(CorruptIndexError, match="past the end") as e:
        ENTRY_POINTS[entry_point](bundle)
    text = str(e.value)
    # the end is the exact sum, not a wrapped one
    assert "'a'" in text and f"[{offset}, {offset + 24})" in text, text


# --- shardkit's manifest ------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [[2**30, 2**30, 2**30], [2**31 - 1] * 3, [2**21] * 3,
                                   [0, 2**40, 2**40], [2**62]])
@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_manifest_shape_past_int64_bytes(tmp_path, entry_point, shape):
    """Dims each below 2**31 whose product passes 2**63 - 1 bytes: the manifest's rule of
    docs/FORMAT.md section 9, checked on open (the dims alone do not tell it)."""
    path = tmp_path / "ck"
    shardkit.save(path, {"a": np.arange(6, dtype=np.float32)})
    manifest = path / "model.safetensors.index.json"
    doc = json.loads(manifest.read_text())
    doc["shardkit"]["tensors"]["shape"][0] = shape
    manifest.write_text(json.dumps(doc))
    with pytest.raises(CorruptIndexError, match="more than 2\\*\\*63 - 1 bytes") as e:
        ENTRY_POINTS[entry_point](path)
    assert "model.safetensors.index.json" in str(e.value) and "'a'" in str(e.value)


def test_manifest_shapes_within_int64_are_read(tmp_path):
    """The exact check runs for large dims too, and lets through what fits."""
    path = tmp_path / "ck"
    state = {"a": np.zeros((0, 2**20, 2**20, 2**20 - 1), np.uint8),
             "b": np.arange(3, dtype=np.int64)}
    shardkit.save(path, state)
    got = shardkit.load(path)
    assert got["a"].shape == state["a"].shape and got["b"].tolist() == [0, 1, 2]


# --- safetensors headers: shardkit's shards and foreign files -----------------------------------

# (dtype, shape, data_offsets) whose bytes wrap int64, or whose begin + size does
WRAPPING_ENTRIES = [
    pytest.param("F64", [2**61], [0, 0], id="f64-2**61-span-0"),
    pytest.param("F32", [2**61], [0, 2**63], id="f32-2**61-span-2**63"),
    pytest.param("I64", [2**60, 2], [0, 0], id="i64-2**60x2-span-0"),
    pytest.param("U8", [2**63 - 1], [0, 2**63 - 1], id="u8-2**63-1"),
    pytest.param("F64", [3], [2**63 - 8, 2**63 + 16], id="begin-2**63-8"),
    pytest.param("F64", [3], [2**64 - 8, 2**64 + 16], id="begin-2**64-8"),
    pytest.param("F64", [3], [-(2**63), -(2**63) + 24], id="begin--2**63"),
]


def _safetensors(entry: tuple[str, list[int], list[int]]) -> bytes:
    """A safetensors file of entry "a" (as given) and "b" (16 bytes, the data region)."""
    dtype, shape, offsets = entry
    header = {"a": {"dtype": dtype, "shape": shape, "data_offsets": offsets},
              "b": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(range(16))


@pytest.mark.parametrize("dtype, shape, offsets", WRAPPING_ENTRIES)
def test_safetensors_header_entry_that_wraps(tmp_path, dtype, shape, offsets):
    data = _safetensors((dtype, shape, offsets))
    with pytest.raises(CorruptHeaderError) as e:
        fmt.decode_safetensors_header(data, len(data), "dir/s.safetensors")
    assert "dir/s.safetensors" in str(e.value) and "'a'" in str(e.value)
    # a foreign single file, through every entry point
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    for name, run in ENTRY_POINTS.items():
        with pytest.raises(CorruptHeaderError) as e:
            run(path)
        assert "model.safetensors" in str(e.value) and "'a'" in str(e.value), name


@pytest.mark.parametrize("dtype, shape, offsets", WRAPPING_ENTRIES)
def test_shardkit_shard_header_entry_that_wraps(tmp_path, dtype, shape, offsets):
    """A shardkit shard whose header (the manifest recording its size) holds such an entry:
    refused on the first read and by verify, the shard named."""
    path = tmp_path / "ck"
    shardkit.save(path, {"a": np.arange(6, dtype=np.float32), "b": np.arange(2)})
    shard = path / "model-00001-of-00001.safetensors"
    _, text, rest = _parts(shard.read_bytes())
    header = json.loads(text)
    header["a"] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    shard.write_bytes(struct.pack("<Q", len(new)) + new + rest)
    manifest = path / "model.safetensors.index.json"
    doc = json.loads(manifest.read_text())
    doc["shardkit"]["shards"][0]["bytes"] = shard.stat().st_size
    manifest.write_text(json.dumps(doc))
    for name in ("verify", "load", "get_slice"):
        with pytest.raises(CorruptHeaderError) as e:
            ENTRY_POINTS[name](path)
        assert "model-00001-of-00001.safetensors" in str(e.value), name


def _parts(data: bytes) -> tuple[int, bytes, bytes]:
    (n,) = struct.unpack_from("<Q", data)
    return n, data[8 : 8 + n], data[8 + n :]


# --- .skz tables --------------------------------------------------------------------------------


@pytest.fixture()
def skz_shard(tmp_path):
    """A zstd checkpoint of one .skz shard with several frames, its bytes and header."""
    path = tmp_path / "ck"
    state = {"w": np.linspace(0, 1, 600, dtype=np.float32), "n": np.arange(40, dtype=np.int16)}
    shardkit.save(path, state,
                  options=shardkit.CheckpointOptions(compression="zstd", chunk_size=1024))
    (shard,) = path.glob("*.skz")
    data = shard.read_bytes()
    return shard, data, skz.decode_skz_header(data, len(data), str(shard))


def _with_frames(data: bytes, h: skz.SkzHeader, frames: np.ndarray) -> bytes:
    """The shard with its frame table replaced and the header checksum sealed again."""
    table_at = h.data_start - 8 - len(frames) * skz.FRAME_DTYPE.itemsize
    head = data[:table_at] + frames.tobytes()
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + data[h.data_start :]


@pytest.mark.parametrize("field, value", [
    ("offset", 2**63), ("offset", 2**64 - 1), ("offset", 2**63 - 1), ("offset", 2**32),
    ("stored", 2**32 - 1), ("stored", 2**31), ("raw", 2**32 - 1), ("raw", 0),
])
@pytest.mark.parametrize("frame", [0, -1])
def test_skz_frame_table_boundary_numbers(skz_shard, field, frame, value):
    shard, data, h = skz_shard
    frames = h.frames.copy()
    frames[field][frame] = value
    bad = _with_frames(data, h, frames)
    with pytest.raises((CorruptHeaderError, TruncatedShardError)) as e:
        skz.decode_skz_header(bad, len(bad), str(shard))
    assert shard.name in str(e.value) and "frame" in str(e.value)


@pytest.mark.parametrize("field, value", [(2, 2**63), (2, 2**64 - 1), (3, 2**63), (3, 2**64 - 1),
                                          (1, 2**63), (1, 2**64 - 8)])
def test_skz_preamble_boundary_numbers(skz_shard, field, value):
    """Data size, frame count and chunk size at int64's end and past it, the header sealed."""
    shard, data, h = skz_shard
    head = bytearray(data[: h.data_start - 8])
    struct.pack_into("<Q", head, 8 * field, value)
    bad = bytes(head) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(head))) + data[
        h.data_start :]
    with pytest.raises((CorruptHeaderError, TruncatedShardError)) as e:
        skz.decode_skz_header(bad, len(bad), str(shard))
    assert shard.name in str(e.value)
