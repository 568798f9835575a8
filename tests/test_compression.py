"""Compressed (.skz) shards: header, chunk plan, parallel compression, decompression, corruption."""

from __future__ import annotations

import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from shardkit import format as fmt
from shardkit.errors import (
    CheckpointFormatError,
    ChecksumError,
    CorruptHeaderError,
    EntryLayoutError,
    SplitTensorsWarning,
    TruncatedShardError,
)
from shardkit.format import MANIFEST_FILE, EntryLayout, ShardInfo, layout_entries
from shardkit.io import save as api
from shardkit.io.options import CheckpointOptions
from shardkit.io.reader import CheckpointReader
from shardkit.sharding.policies import MaxShardSizePolicy
from shardkit.shards import skz
from shardkit.values.dtypes import PACKED, SAFETENSORS_NAMES, numpy_dtype

# the dtypes whose arrays are their stored bytes: these tests hand arrays to the shard writer
# directly; F4 (packed by the checkpoint writer) has tests/test_dtypes_float4.py
UNPACKED_NAMES = [n for n in SAFETENSORS_NAMES if n not in PACKED]


def make_state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every storable dtype, 0-d and empty shapes, float data that compresses a little."""
    state: dict[str, np.ndarray] = {}
    for k, name in enumerate(UNPACKED_NAMES):
        dt = numpy_dtype(name)
        shape = [(), (0,), (3, 0), (5,), (17, 3), (64, 9)][k % 6]
        if dt.kind == "f" or dt in (np.dtype(ml_dtypes.bfloat16),):
            a = (rng.standard_normal(shape) * 0.02).astype(dt)
        elif dt == np.dtype(bool):
            a = rng.integers(0, 2, shape).astype(bool)
        elif "float8" in str(dt):
            a = rng.standard_normal(shape).astype(dt)
        else:
            a = rng.integers(0, 100, shape).astype(dt)
        state[f"t{k}/{name}"] = np.asarray(a)
    state["big"] = (rng.standard_normal((300, 40)) * 0.05).astype(np.float32)
    return state


def write(path: Path, state: dict[str, np.ndarray], **kw) -> skz.SkzWriteStats:
    layouts = layout_entries([(k, v.dtype, v.shape) for k, v in state.items()])
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        return skz.write_zstd_shard(fd, str(path), layouts, [state[e.name] for e in layouts],
                                    **kw)
    finally:
        os.close(fd)


def read_all(shard: skz.SkzShard, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, e in shard.entries.items():
        a = np.empty(state[name].shape, state[name].dtype)
        shard.read_into(e, 0, e.nbytes, memoryview(a.reshape(-1).view(np.uint8)))
        out[name] = a
    return out


def assert_same(got: dict[str, np.ndarray], state: dict[str, np.ndarray]) -> None:
    assert list(sorted(got)) == list(sorted(state))
    for k, v in state.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].tobytes() == v.tobytes(), k


# --- options ----------------------------------------------------------------------------------


def test_resolve_compression_defaults_and_errors():
    assert skz.resolve_compression(None) is None
    opts = skz.resolve_compression("zstd")
    assert opts == skz.ZstdOptions(skz.DEFAULT_LEVEL, True, 4 * 1024 * 1024)
    assert skz.resolve_compression("zstd", 3, False, "512KiB") == skz.ZstdOptions(3, False,
                                                                                    512 * 1024)
    with pytest.raises(ValueError, match="compression must be None or 'zstd', got 'lz4'"):
        skz.resolve_compression("lz4")
    with pytest.raises(ValueError, match="level=5 needs compression='zstd'"):
        skz.resolve_compression(None, 5)
    with pytest.raises(ValueError, match=r"zstd level must be in -7..-1 or 1..22, got 23"):
        skz.resolve_compression("zstd", 23)
    with pytest.raises(ValueError, match="got 0"):
        skz.resolve_compression("zstd", 0)
    with pytest.raises(TypeError, match="level must be an int or None, got True"):
        skz.resolve_compression("zstd", True)
    with pytest.raises(TypeError, match="shuffle must be True or False, got 1"):
        skz.resolve_compression("zstd", shuffle=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "size"), [("4MiB", 4 << 20), ("1MB", 10**6), (" 64 ", 64),
                                            ("512kib", 512 << 10), (4096, 4096),
                                            ("64MiB", 64 << 20)])
def test_parse_chunk_size(text, size):
    assert skz.parse_chunk_size(text) == size


@pytest.mark.parametrize("bad", ["4 parsecs", "", "-8", "100.5", 100, 56, 8, 0, "2GiB", "1GiB",
                                 (64 << 20) + 8])
def test_parse_chunk_size_rejects(bad):
    with pytest.raises(ValueError, match="chunk_size"):
        skz.parse_chunk_size(bad)


def test_parse_chunk_size_rejects_types():
    with pytest.raises(TypeError, match="chunk_size must be an int or a size string"):
        skz.parse_chunk_size(4.0)  # type: ignore[arg-type]


# --- chunk plan -------------------------------------------------------------------------------


@given(st.lists(st.tuples(st.sampled_from(["F64", "F32", "BF16", "U8", "I16"]),
                          st.integers(0, 300)), max_size=12),
       st.sampled_from([64, 72, 128, 1000, 4096]), st.booleans())
def test_plan_pieces_cover_the_region_in_whole_items(specs, chunk, shuffle):
    layouts = layout_entries([(f"e{i}", numpy_dtype(d), (n,)) for i, (d, n) in enumerate(specs)])
    plan = skz.plan_chunks(layouts, chunk, shuffle)
    size = sum(e.nbytes for e in layouts)
    assert plan.data_size == size and plan.n_chunks == -(-size // chunk)
    assert plan.length.sum() == size and (plan.length > 0).all()
    assert (np.diff(plan.data_offset) == plan.length[:-1]).all()
    for i in range(plan.n_chunks):
        lo, hi = plan.ptr[i], plan.ptr[i + 1]
        c0, c1 = plan.chunk_range(i)
        assert hi > lo and plan.data_offset[lo] == c0
        assert plan.data_offset[hi - 1] + plan.length[hi - 1] == c1
    for p in range(len(plan.length)):
        e = layouts[int(plan.order[plan.entry[p]])]
        s = int(plan.itemsize[p])
        assert s == (numpy_dtype(e.dtype_name).itemsize if shuffle else 1)
        assert e.begin + plan.entry_offset[p] == plan.data_offset[p]
        assert plan.entry_offset[p] % s == 0 and plan.length[p] % s == 0
        assert plan.data_offset[p] + plan.length[p] <= e.end


def test_plan_rejects_a_split_inside_an_item():
    layouts = layout_entries([("a", np.dtype(np.uint8), (3,)), ("b", np.dtype(np.uint8), (90,))])
    bad = [layouts[0], EntryLayout("b", "F32", (22,), 3, 91, 1)]  # misaligned F32
    with pytest.raises(ValueError, match=r"splits entry 'b' .* inside an item"):
        skz.plan_chunks(bad, 64, True)


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("chunk", [64, 1024, 1 << 20])
@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip_every_dtype(tmp_path, shuffle, chunk, mmap):
    state = make_state(np.random.default_rng(chunk))
    path = tmp_path / "s.skz"
    stats = write(path, state, shuffle=shuffle, chunk_size=chunk)
    assert stats.file_size == path.stat().st_size
    assert stats.frames == -(-stats.data_size // chunk) and stats.frames > 0
    with skz.SkzShard(str(path), mmap=mmap) as shard:
        assert shard.header.shuffle is shuffle and shard.header.chunk_size == chunk
        assert shard.metadata["codec"] == "zstd"
        assert_same(read_all(shard, state), state)
        outs = {k: np.empty(v.shape, v.dtype) for k, v in state.items()}
        with ThreadPoolExecutor(2) as pool:
            shard.read_many([(shard.entries[k], 0, v.nbytes, outs[k]) for k, v in state.items()],
                            pool)
            assert shard.verify_frames(pool) == stats.frames
        assert_same(outs, state)


@pytest.mark.parametrize("level", [-3, 1, 3, 9])
def test_levels_round_trip_and_shuffle_helps(tmp_path, level):
    rng = np.random.default_rng(level + 10)
    w = {"w": (rng.standard_normal((256, 256)) * 0.02).astype(ml_dtypes.bfloat16)}
    plain = write(tmp_path / "p.skz", w, level=level, shuffle=False, chunk_size="64KiB")
    shuf = write(tmp_path / "s.skz", w, level=level, shuffle=True, chunk_size="64KiB")
    assert shuf.file_size < plain.file_size  # bf16 weights: the exponent plane compresses
    for name in ("p.skz", "s.skz"):
        with skz.SkzShard(str(tmp_path / name)) as shard:
            assert_same(read_all(shard, w), w)


def test_output_does_not_depend_on_thread_count(tmp_path):
    state = make_state(np.random.default_rng(3))
    files = []
    for threads in (1, 2, 3):
        write(tmp_path / f"{threads}.skz", state, chunk_size=256, threads=threads)
        files.append((tmp_path / f"{threads}.skz").read_bytes())
    assert files[0] == files[1] == files[2]


def test_partial_reads_and_entries_spanning_chunks(tmp_path):
    a = np.arange(10_000, dtype=np.float32).reshape(100, 100)
    b = np.arange(999, dtype=np.int16)
    state = {"a": a, "b": b}
    write(tmp_path / "s.skz", state, chunk_size=1000)
    with skz.SkzShard(str(tmp_path / "s.skz")) as shard:
        e = shard.entries["a"]
        for r0, r1 in [(0, 1), (37, 38), (2, 97), (99, 100), (0, 100)]:
            out = np.empty((r1 - r0, 100), np.float32)
            shard.read_into(e, r0 * 400, r1 * 400, out)
            assert out.tobytes() == a[r0:r1].tobytes()
        out16 = np.empty(500, np.int16)
        shard.read_into(shard.entries["b"], 2 * 10, 2 * 510, out16)
        assert (out16 == b[10:510]).all()
        with pytest.raises(ValueError, match=r"cannot read bytes \[2, 8\) of entry 'a'"):
            shard.read_into(e, 2, 8, np.empty(8, np.uint8))


def test_one_row_decodes_one_chunk(tmp_path):
    rows = np.arange(32000, dtype=np.float32)[:, None] + np.zeros((1, 1024), np.float32)
    write(tmp_path / "s.skz", {"emb": rows})
    with skz.SkzShard(str(tmp_path / "s.skz")) as shard:
        e = shard.entries["emb"]
        assert shard.plan.n_chunks == 32
        before = skz.frames_decompressed()
        out = np.empty(1024, np.float32)
        shard.read_into(e, 12345 * 4096, 12346 * 4096, out)
        assert skz.frames_decompressed() - before == 1
        assert (out == 12345).all()


def test_many_tiny_tensors_in_one_chunk(tmp_path):
    rng = np.random.default_rng(1)
    state = {f"layer{i}/bias": rng.standard_normal(i % 7).astype(np.float32) for i in range(500)}
    state.update({f"step{i}": np.int64(i) for i in range(100)})
    stats = write(tmp_path / "s.skz", state)
    assert stats.frames == 1
    with skz.SkzShard(str(tmp_path / "s.skz")) as shard:
        before = skz.frames_decompressed()
        outs = {k: np.empty(v.shape, v.dtype) for k, v in state.items()}
        shard.read_many([(shard.entries[k], 0, v.nbytes, outs[k]) for k, v in state.items()])
        assert skz.frames_decompressed() - before == 1
        assert_same(outs, state)
        assert_same(read_all(shard, state), state)  # read_into calls share the cached chunk
        assert skz.frames_decompressed() - before == 1


def test_incompressible_chunks_are_stored_raw(tmp_path):
    rng = np.random.default_rng(2)
    noise = rng.integers(0, 256, 50_000, dtype=np.uint8)
    zeros = np.zeros(20_000, np.uint8)
    state = {"noise": noise, "zeros": zeros}
    stats = write(tmp_path / "s.skz", state, chunk_size=10_000)
    assert stats.frames == 7 and stats.raw_frames == 5
    with skz.SkzShard(str(tmp_path / "s.skz")) as shard:
        kinds = shard.header.frames["kind"].tolist()
        assert kinds == [skz.KIND_RAW] * 5 + [skz.KIND_ZSTD] * 2
        assert_same(read_all(shard, state), state)


def test_empty_shard_and_wrong_array_size(tmp_path):
    stats = write(tmp_path / "e.skz", {"nothing": np.zeros((0, 4), np.float32)})
    assert stats.frames == 0 and stats.data_size == 0
    with skz.SkzShard(str(tmp_path / "e.skz")) as shard:
        assert shard.entries["nothing"].nbytes == 0
        assert shard.verify_frames() == 0
    layouts = layout_entries([("x", np.dtype(np.float32), (4,))])
    fd = os.open(tmp_path / "w.skz", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        with pytest.raises(ValueError, match="entry 'x': array has 12 bytes, its layout needs 16"):
            skz.write_zstd_shard(fd, "w.skz", layouts, [np.zeros(3, np.float32)])
    finally:
        os.close(fd)


# --- header -----------------------------------------------------------------------------------


def test_header_round_trip():
    layouts = layout_entries([("w", np.dtype(np.float32), (10, 10)), ("b", np.dtype(np.int8),
                                                                       (3,))])
    frames = np.zeros(3, skz.FRAME_DTYPE)
    head_len = len(skz.encode_skz_header(layouts, 160, True, None, {"note": "x"}))
    sizes = [100, 160, 83]
    offsets = head_len + np.cumsum([0, *sizes[:-1]])
    frames["offset"], frames["stored"] = offsets, sizes
    frames["raw"], frames["kind"] = [160, 160, 83], [1, 0, 0]
    frames["xxh3"] = [1, 2, 3]
    head = skz.encode_skz_header(layouts, 160, True, frames, {"note": "x"})
    assert len(head) == head_len and head.startswith(skz.MAGIC)
    h = skz.decode_skz_header(head, head_len + sum(sizes), "s.skz")
    assert (h.chunk_size, h.data_size, h.shuffle, h.data_start) == (160, 403, True, head_len)
    assert h.metadata == {"format": "pt", "shardkit": "2.2", "codec": "zstd", "note": "x"}
    assert list(h.entries) == ["w", "b"] and h.entries["b"].begin == 400
    assert h.frames.tobytes() == frames.tobytes()


def shard_bytes(tmp_path: Path) -> tuple[bytes, skz.SkzHeader]:
    state = {"w": np.linspace(0, 1, 600, dtype=np.float32), "n": np.arange(40, dtype=np.int16)}
    write(tmp_path / "s.skz", state, chunk_size=1024)
    data = (tmp_path / "s.skz").read_bytes()
    return data, skz.decode_skz_header(data, len(data), "s.skz")


def reseal(head: bytes | bytearray) -> bytes:
    """Recompute the header checksum, as a buggy writer would have written it."""
    body = bytes(head[:-8])
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def with_frames(data: bytes, h: skz.SkzHeader, frames: np.ndarray) -> bytes:
    table_at = h.data_start - 8 - len(frames) * skz.FRAME_DTYPE.itemsize
    head = data[:table_at] + frames.tobytes() + b"\0" * 8
    return reseal(head) + data[h.data_start :]


def expect_error(data: bytes, cls: type[Exception], message: str) -> None:
    with pytest.raises(cls, match=re.escape(message)) as info:
        skz.decode_skz_header(data, len(data), "ckpt/s.skz")
    assert "ckpt/s.skz" in str(info.value)


def test_header_corruptions_detected(tmp_path):
    data, h = shard_bytes(tmp_path)
    expect_error(b"XKZSHRD1" + data[8:], CorruptHeaderError, "not a .skz shard")
    expect_error(data[:30], TruncatedShardError, "shorter than the 40-byte")
    expect_error(data[: h.data_start - 3], TruncatedShardError, "needs")
    flipped = bytearray(data)
    flipped[60] ^= 1  # inside the JSON entry table
    expect_error(bytes(flipped), ChecksumError, ".skz header checksum mismatch")
    for field, value, cls, message in [
        (1, 100, CorruptHeaderError, "chunk size 100 is not a multiple of 8"),
        (3, 9, CorruptHeaderError, "9 frames recorded, but a data region of 2480 bytes"),
        (4, 6, CorruptHeaderError, "unknown flag bits 0x6"),
    ]:
        patched = bytearray(data[: h.data_start])
        struct.pack_into("<Q", patched, 8 * field, value)
        expect_error(reseal(patched) + data[h.data_start :], cls, message)


@pytest.mark.parametrize(("change", "cls", "message"), [
    (lambda f: f["raw"].__setitem__(0, 1000), CorruptHeaderError,
     "frame 0 records 1000 raw bytes, expected 1024"),
    (lambda f: f["kind"].__setitem__(1, 7), CorruptHeaderError, "frame 1 has unknown kind 7"),
    (lambda f: f["reserved"].__setitem__(2, 1), CorruptHeaderError, "(reserved 1)"),
    (lambda f: f["offset"].__setitem__(1, f["offset"][1] + 1), CorruptHeaderError,
     "frame 1 starts at byte"),
    (lambda f: f["kind"].__setitem__(0, 0), CorruptHeaderError,
     "impossible for a raw frame"),
    (lambda f: f["stored"].__setitem__(2, f["stored"][2] + 5), TruncatedShardError,
     "past the end of the file"),
    (lambda f: f["stored"].__setitem__(2, f["stored"][2] - 1), CorruptHeaderError,
     "1 bytes after the last frame"),
])
def test_frame_table_corruptions_detected(tmp_path, change, cls, message):
    data, h = shard_bytes(tmp_path)
    assert h.frames["kind"].tolist() == [1, 1, 1]
    frames = h.frames.copy()
    change(frames)
    expect_error(with_frames(data, h, frames), cls, message)


def test_entry_table_must_tile_the_data_region(tmp_path):
    data, h = shard_bytes(tmp_path)
    patched = bytearray(data[: h.data_start])
    struct.pack_into("<Q", patched, 16, h.data_size + 8)  # data size 8 bytes larger
    frames = h.frames.copy()
    frames["raw"][-1] += 8
    table_at = h.data_start - 8 - len(frames) * skz.FRAME_DTYPE.itemsize
    patched[table_at : h.data_start - 8] = frames.tobytes()
    with pytest.raises(EntryLayoutError, match="bytes after the last entry are not covered"):
        skz.decode_skz_header(reseal(patched) + data[h.data_start :], len(data), "s.skz")


@pytest.mark.parametrize("kind", ["zstd", "raw"])
@pytest.mark.parametrize("mmap", [True, False])
def test_corrupt_frame_raises_naming_shard_and_key(tmp_path, kind, mmap):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(2000) * 0.01).astype(np.float32)
    if kind == "raw":
        w = rng.integers(0, 2**32, 2000, dtype=np.uint32).view(np.float32)
    state = {"model/w": w, "model/b": np.ones(10, np.float32)}
    write(tmp_path / "s.skz", state, chunk_size=4096)
    data = bytearray((tmp_path / "s.skz").read_bytes())
    h = skz.decode_skz_header(data, len(data), "s.skz")
    assert h.frames["kind"][1] == (skz.KIND_ZSTD if kind == "zstd" else skz.KIND_RAW)
    data[int(h.frames["offset"][1]) + int(h.frames["stored"][1]) // 2] ^= 0x10
    (tmp_path / "s.skz").write_bytes(bytes(data))
    with skz.SkzShard(str(tmp_path / "s.skz"), mmap=mmap) as shard:
        e = shard.entries["model/w"]
        out = np.empty(2000, np.float32)
        message = (r"s\.skz: frame 1 .* holding entries 'model/w', 'model/b'; "
                   r"reading entry 'model/w'\) is corrupt")
        with pytest.raises(ChecksumError, match=message):
            shard.read_into(e, 0, e.nbytes, out)
        shard.read_into(e, 0, 4096, out)  # frame 0 is intact and still readable
        assert out[:1024].tobytes() == w[:1024].tobytes()
        with pytest.raises(ChecksumError, match="frame 1"):
            shard.verify_frames()


def test_zstd_damage_behind_a_valid_frame_hash_is_still_caught(tmp_path):
    # A frame rewritten consistently (hash recomputed) but with a broken zstd content checksum.
    w = np.linspace(0, 1, 3000, dtype=np.float32)
    write(tmp_path / "s.skz", {"w": w}, chunk_size=1 << 20)
    data = bytearray((tmp_path / "s.skz").read_bytes())
    h = skz.decode_skz_header(data, len(data), "s.skz")
    start, n = int(h.frames["offset"][0]), int(h.frames["stored"][0])
    data[start + n - 1] ^= 0xFF  # last byte of the zstd content checksum
    frames = h.frames.copy()
    frames["xxh3"][0] = xxhash.xxh3_64_intdigest(bytes(data[start : start + n]))
    fixed = with_frames(bytes(data), h, frames)
    (tmp_path / "s.skz").write_bytes(fixed)
    with skz.SkzShard(str(tmp_path / "s.skz")) as shard:
        with pytest.raises(ChecksumError, match="zstd cannot decode it"):
            shard.read_into(shard.entries["w"], 0, w.nbytes, np.empty(3000, np.float32))


@pytest.mark.parametrize("damage", ["checksum", "content"])
def test_damage_caught_when_decoding_into_the_thread_buffer(tmp_path, damage):
    # read_many over several chunks decodes each into a reused per-thread buffer (streaming
    # decoder), not through decompress(): zstd's checks must hold there too.
    w = np.linspace(0, 1, 3000, dtype=np.float32)
    write(tmp_path / "s.skz", {"w": w}, chunk_size=4096)
    data = bytearray((tmp_path / "s.skz").read_bytes())
    h = skz.decode_skz_header(data, len(data), "s.skz")
    assert (h.frames["kind"] == skz.KIND_ZSTD).all() and len(h.frames) == 3
    start, n = int(h.frames["offset"][1]), int(h.frames["stored"][1])
    data[start + (n - 1 if damage == "checksum" else n // 2)] ^= 0xFF
    frames = h.frames.copy()
    frames["xxh3"][1] = xxhash.xxh3_64_intdigest(bytes(data[start : start + n]))
    (tmp_path / "s.skz").write_bytes(with_frames(bytes(data), h, frames))
    with skz.SkzShard(str(tmp_path / "s.skz")) as shard, ThreadPoolExecutor(2) as pool:
        e = shard.entries["w"]
        with pytest.raises(ChecksumError, match=r"frame 1 .*reading entry 'w'\) is corrupt"):
            shard.read_many([(e, 0, e.nbytes, np.empty(3000, np.float32))], pool)
        good = np.empty(2048, np.float32)  # frames 0 and 2 still decode, through the buffer
        shard.read_many([(e, 0, 4096, good[:1024]), (e, 8192, e.nbytes, good[1024:1024 + 952])],
                        pool)
        assert good[:1024].tobytes() == w[:1024].tobytes()
        assert good[1024:1976].tobytes() == w[2048:].tobytes()


def test_open_checks_the_index_size(tmp_path):
    write(tmp_path / "s.skz", {"w": np.ones(100, np.float32)})
    size = (tmp_path / "s.skz").stat().st_size
    path = str(tmp_path / "s.skz")
    skz.open_zstd_shard(path, ShardInfo("s.skz", 0, "zstd", size)).close()
    with pytest.raises(TruncatedShardError, match=f"has {size} bytes, the index records"):
        skz.open_zstd_shard(path, ShardInfo("s.skz", 0, "zstd", size + 1))
    with pytest.raises(CheckpointFormatError, match=f"has {size} bytes, the index records"):
        skz.open_zstd_shard(path, ShardInfo("s.skz", 0, "zstd", size - 1))


@st.composite
def states(draw):
    n = draw(st.integers(1, 6))
    state = {}
    for i in range(n):
        dt = numpy_dtype(draw(st.sampled_from(UNPACKED_NAMES)))
        shape = tuple(draw(st.lists(st.integers(0, 9), max_size=3)))
        raw = draw(st.binary(min_size=int(np.prod(shape)) * dt.itemsize,
                             max_size=int(np.prod(shape)) * dt.itemsize))
        state[f"k{i}"] = np.frombuffer(raw, np.uint8).view(dt).reshape(shape).copy()
    return state


@given(states(), st.sampled_from([64, 72, 136, 4096]), st.booleans(), st.data())
def test_round_trip_property(tmp_path_factory, state, chunk, shuffle, data):
    path = tmp_path_factory.mktemp("prop") / "s.skz"
    write(path, state, chunk_size=chunk, shuffle=shuffle)
    with skz.SkzShard(str(path), mmap=data.draw(st.booleans())) as shard:
        assert_same(read_all(shard, state), state)
        key = data.draw(st.sampled_from(sorted(state)))
        a = state[key]
        n = a.size
        i0 = data.draw(st.integers(0, n))
        i1 = data.draw(st.integers(i0, n))
        s = a.dtype.itemsize
        out = np.empty(i1 - i0, a.dtype)
        shard.read_into(shard.entries[key], i0 * s, i1 * s, out)
        assert out.tobytes() == a.reshape(-1)[i0:i1].tobytes()


def test_concurrent_reads_share_chunks_correctly(tmp_path):
    rng = np.random.default_rng(9)
    state = {f"w{i}": rng.standard_normal(700 + i).astype(np.float32) for i in range(12)}
    write(tmp_path / "s.skz", state, chunk_size=2048)
    with skz.SkzShard(str(tmp_path / "s.skz")) as shard:

        def read(k: str) -> bool:
            out = np.empty_like(state[k])
            shard.read_into(shard.entries[k], 0, out.nbytes, out)
            return out.tobytes() == state[k].tobytes()

        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(read, [k for _ in range(10) for k in state]))


_FORK_SCRIPT = """
import os, sys, time
import numpy as np
from shardkit.shards import skz
from shardkit.format import layout_entries

def save(path):
    state = {"w": np.linspace(0, 1, 50_000, dtype=np.float32)}
    layouts = layout_entries([(k, v.dtype, v.shape) for k, v in state.items()])
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    skz.write_zstd_shard(fd, path, layouts, [state["w"]], chunk_size=4096, threads=2)
    os.close(fd)
    with skz.SkzShard(path) as shard:
        out = np.empty(50_000, np.float32)
        shard.read_into(shard.entries["w"], 0, out.nbytes, out)
        assert out.tobytes() == state["w"].tobytes()

save(sys.argv[1] + "/parent.skz")  # starts the kept compression threads
pid = os.fork()
if pid == 0:
    try:
        save(sys.argv[1] + "/child.skz")
    finally:
        os._exit(0 if os.path.exists(sys.argv[1] + "/child.skz") else 3)
for _ in range(300):
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.1)
os.kill(pid, 9)
sys.exit("the forked child hung")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_save_in_a_forked_child_after_a_save_in_the_parent(tmp_path):
    # The compression threads are kept between saves; a forked child has none of them and
    # must start its own instead of waiting forever on the parent's. (In a fresh interpreter:
    # this process has other threads, which make fork unsafe.)
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FORK_SCRIPT, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "child.skz").exists()


def test_write_error_names_the_file(tmp_path):
    path = tmp_path / "s.skz"
    path.write_bytes(b"")
    layouts = layout_entries([("x", np.dtype(np.float32), (1000,))])
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match=r"s\.skz: writing"):
            skz.write_zstd_shard(fd, str(path), layouts, [np.zeros(1000, np.float32)])
    finally:
        os.close(fd)


def test_entry_checksums_computed_while_compressing(tmp_path):
    state = make_state(np.random.default_rng(4))
    layouts = layout_entries([(k, v.dtype, v.shape) for k, v in state.items()])
    fd = os.open(tmp_path / "s.skz", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        stats = skz.write_zstd_shard(fd, "s.skz", layouts, [state[e.name] for e in layouts],
                                     chunk_size=256, checksum=True)
    finally:
        os.close(fd)
    assert stats.xxh3 == tuple(xxhash.xxh3_64_hexdigest(np.ascontiguousarray(state[e.name]))
                               for e in layouts)
    assert write(tmp_path / "t.skz", state).xxh3 == ()


# --- compressed checkpoints end to end (api.save / reader) ------------------------------------


def codecs(path: Path) -> list[str]:
    with CheckpointReader(path) as r:
        return [s.codec for s in r.index.shards]


@pytest.mark.parametrize(("shuffle", "level", "chunk"), [(True, None, "4MiB"), (False, 3, 256),
                                                          (True, -1, 72), (True, 9, 4096)])
@pytest.mark.parametrize("mmap", [True, False])
def test_checkpoint_round_trip(tmp_path, shuffle, level, chunk, mmap):
    state = make_state(np.random.default_rng(11))
    policy = MaxShardSizePolicy(3000)  # several shards, "big" split into row slices
    with pytest.warns(SplitTensorsWarning, match="tensors as slices"):
        api.save(tmp_path / "c", state,
                 options=CheckpointOptions(experimental_sharding_callback=policy,
                                           compression="zstd", level=level, shuffle=shuffle,
                                           chunk_size=chunk, durable=False))
    names = sorted(os.listdir(tmp_path / "c"))
    assert names[-1] == MANIFEST_FILE and all(n.endswith(".skz") for n in names[:-1])
    assert len(names) > 2 and set(codecs(tmp_path / "c")) == {"zstd"}
    loaded = api.load(tmp_path / "c", mmap=mmap, verify=True)
    assert_same(loaded, state)
    with CheckpointReader(tmp_path / "c", mmap=mmap) as r:
        assert r.info("big").is_split
        assert r.verify() == sum(len(r.info(k).slices) for k in state) > len(state)
        big = state["big"]
        for index in [np.s_[7], np.s_[3:250:7, 5:9], np.s_[..., -1], np.s_[299, 39]]:
            got = r.get_slice("big", index)
            assert got.tobytes() == np.ascontiguousarray(big[index]).tobytes(), index
        for key in state:
            assert r[key].tobytes() == state[key].tobytes()


def test_one_row_of_a_compressed_embedding_decodes_one_chunk(tmp_path):
    rows = np.arange(32000, dtype=np.float32)[:, None] + np.zeros((1, 1024), np.float32)
    api.save(tmp_path / "c", {"embed": rows},
             options=CheckpointOptions(compression="zstd", durable=False))
    with CheckpointReader(tmp_path / "c") as r:
        before = skz.frames_decompressed()
        row = r.get_slice("embed", np.s_[31999])
        assert skz.frames_decompressed() - before == 1
        assert row.shape == (1024,) and (row == 31999).all()
        before = skz.frames_decompressed()
        whole = r["embed"]  # 128 MiB: 32 chunks, each decoded once
        assert skz.frames_decompressed() - before == 32
        assert whole.tobytes() == rows.tobytes()


def test_load_decodes_each_chunk_once(tmp_path):
    rng = np.random.default_rng(12)
    state = {f"w{i}": rng.standard_normal(3000).astype(np.float32) for i in range(40)}
    api.save(tmp_path / "c", state,
             options=CheckpointOptions(compression="zstd", chunk_size="64KiB", durable=False))
    n_chunks = -(-sum(a.nbytes for a in state.values()) // (64 * 1024))
    before = skz.frames_decompressed()
    assert_same(api.load(tmp_path / "c"), state)
    assert skz.frames_decompressed() - before == n_chunks


def test_restore_into_from_compressed_shards(tmp_path):
    state = make_state(np.random.default_rng(13))
    api.save(tmp_path / "c", state,
             options=CheckpointOptions(compression="zstd", chunk_size=512, durable=False))
    target = {k: np.zeros_like(v) for k, v in state.items()}
    assert api.restore_into(tmp_path / "c", target, verify=True).restored_keys == list(state)
    assert_same(target, state)


def corrupt_frame(ckpt: Path, frame: int) -> Path:
    (shard,) = [p for p in ckpt.iterdir() if p.suffix == ".skz"]
    data = bytearray(shard.read_bytes())
    h = skz.decode_skz_header(data, len(data), shard.name)
    data[int(h.frames["offset"][frame]) + int(h.frames["stored"][frame]) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    return shard


def test_corrupt_frame_through_the_reader_names_shard_and_key(tmp_path):
    rng = np.random.default_rng(14)
    state = {"a/first": (rng.standard_normal(4096) * 0.1).astype(np.float32),
             "b/second": (rng.standard_normal(4096) * 0.1).astype(np.float32)}
    api.save(tmp_path / "c", state,
             options=CheckpointOptions(compression="zstd", chunk_size="16KiB", durable=False))
    shard = corrupt_frame(tmp_path / "c", 1)  # chunk 1 = the second tensor's bytes
    with CheckpointReader(tmp_path / "c") as r:
        assert r["a/first"].tobytes() == state["a/first"].tobytes()
        with pytest.raises(ChecksumError) as info:
            r["b/second"]
        assert str(shard) in str(info.value) and "'b/second'" in str(info.value)
        with pytest.raises(ChecksumError, match="frame 1"):
            r.get_slice("b/second", np.s_[10:20])
        with pytest.raises(ChecksumError, match="frame 1"):
            r.verify()
    with pytest.raises(ChecksumError, match="'b/second'"):
        api.load(tmp_path / "c")


def test_mixed_checkpoint_raw_and_zstd_shards(tmp_path, monkeypatch):
    generation = "0123456789abcdef0123456789abcdef"  # both saves': their shards make one
    monkeypatch.setattr(fmt, "new_generation", lambda: generation)
    rng = np.random.default_rng(15)
    raw_part = {"r/w": rng.standard_normal((64, 8)).astype(np.float32), "r/n": np.arange(5)}
    zstd_part = {"z/w": rng.standard_normal((32, 32)).astype(ml_dtypes.bfloat16),
                 "z/i": np.arange(100, dtype=np.int16)}
    api.save(tmp_path / "a", raw_part, options=CheckpointOptions(durable=False))
    api.save(tmp_path / "b", zstd_part,
             options=CheckpointOptions(compression="zstd", durable=False))
    ia = fmt.decode_index((tmp_path / "a" / MANIFEST_FILE).read_bytes(), "a")
    ib = fmt.decode_index((tmp_path / "b" / MANIFEST_FILE).read_bytes(), "b")
    assert len(ia.shards) == len(ib.shards) == 1
    out = tmp_path / "mixed"
    out.mkdir()
    names = [fmt.shard_file_name(0, 2, "raw"), fmt.shard_file_name(1, 2, "zstd")]
    os.rename(tmp_path / "a" / ia.shards[0].file, out / names[0])
    os.rename(tmp_path / "b" / ib.shards[0].file, out / names[1])
    tensors = dict(ia.tensors)
    for key, t in ib.tensors.items():
        tensors[key] = replace(t, slices=[replace(s, shard=1) for s in t.slices])
    index = fmt.CheckpointIndex.from_tensors(
        "merged", [replace(ia.shards[0], file=names[0]), replace(ib.shards[0], file=names[1])],
        tensors, generation=generation)
    (out / MANIFEST_FILE).write_bytes(fmt.encode_index(index))
    assert codecs(out) == ["raw", "zstd"]
    assert_same(api.load(out, verify=True), {**raw_part, **zstd_part})
    with CheckpointReader(out) as r:
        assert r.verify() == 4
        assert r.get_slice("z/w", np.s_[3]).tobytes() == zstd_part["z/w"][3].tobytes()


def test_restore_into_torch_tensors_decodes_in_place(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is an optional dependency")
    src = {"w": torch.randn(64, 32), "bf": torch.randn(16, dtype=torch.bfloat16)}
    api.save(tmp_path / "c", src,
             options=CheckpointOptions(compression="zstd", chunk_size=1024, durable=False))
    dst = {"w": torch.zeros(64, 32), "bf": torch.zeros(16, dtype=torch.bfloat16)}
    before = skz.frames_decompressed()
    assert api.restore_into(tmp_path / "c", dst).restored_keys == ["w", "bf"]
    assert torch.equal(dst["w"], src["w"]) and torch.equal(dst["bf"], src["bf"])
    assert skz.frames_decompressed() - before == -(-(64 * 32 * 4 + 16 * 2) // 1024)


def test_misaligned_entries_in_a_foreign_file_are_a_format_error(tmp_path):
    # A chunk boundary (64) inside an item of an F32 entry that starts at byte 62.
    layouts = [EntryLayout("u", "U8", (62,), 0, 62, 0), EntryLayout("f", "F32", (2,), 62, 70, 1)]
    data = bytes(range(70))
    frames = np.zeros(2, skz.FRAME_DTYPE)
    head_len = len(skz.encode_skz_header(layouts, 64, True))
    frames["offset"] = [head_len, head_len + 64]
    frames["stored"] = frames["raw"] = [64, 6]
    frames["xxh3"] = [xxhash.xxh3_64_intdigest(data[:64]), xxhash.xxh3_64_intdigest(data[64:])]
    path = tmp_path / "foreign.skz"
    path.write_bytes(skz.encode_skz_header(layouts, 64, True, frames) + data)
    with pytest.raises(CorruptHeaderError, match=r"foreign\.skz: chunk size 64 splits entry 'f'"):
        skz.SkzShard(str(path))


def test_read_many_with_overlapping_and_partial_requests(tmp_path):
    a = np.arange(5000, dtype=np.float32)
    b = np.arange(3000, dtype=np.int16)
    write(tmp_path / "s.skz", {"a": a, "b": b}, chunk_size=4096)
    with skz.SkzShard(str(tmp_path / "s.skz")) as shard:
        ea, eb = shard.entries["a"], shard.entries["b"]
        outs = [np.empty(1000, np.float32), np.empty(2000, np.float32), np.empty(5, np.int16),
                np.empty(3000, np.int16)]
        shard.read_many([(ea, 0, 4000, outs[0]), (ea, 2000, 10000, outs[1]),
                         (eb, 10, 20, outs[2]), (eb, 0, 6000, outs[3])])
        assert (outs[0] == a[:1000]).all() and (outs[1] == a[500:2500]).all()
        assert (outs[2] == b[5:10]).all() and (outs[3] == b).all()
        disjoint = [np.empty(7, np.float32), np.empty(4993, np.float32)]
        with ThreadPoolExecutor(2) as pool:
            shard.read_many([(ea, 28, 20000, disjoint[1]), (ea, 0, 28, disjoint[0])], pool)
        assert (np.concatenate(disjoint) == a).all()



# --- header limits: checked before anything is allocated ----------------------------------------


def test_chunk_size_limit_is_64_mib_for_writers_and_readers():
    assert skz.MAX_CHUNK_SIZE == 64 << 20
    with pytest.raises(ValueError, match=r"chunk_size must be a multiple of 8 between 64 and "
                       r"67108864 bytes, got '128MiB' \(134217728 bytes\)"):
        skz.parse_chunk_size("128MiB")


def _sparse_skz(path: Path, chunk: int, size: int, frames: int, file_size: int) -> None:
    """A .skz file whose preamble claims `chunk`, `size`, `frames`, with a valid entry table for
    `size` bytes of U8, the rest of its `file_size` bytes a hole (zeros, never written)."""
    layouts = layout_entries([("x", np.dtype(np.uint8), (size,))])
    head = skz.PREAMBLE.pack(skz.MAGIC, chunk, size, frames, 0) + fmt.encode_safetensors_header(
        layouts, {"codec": "zstd"})
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(file_size)


@pytest.mark.parametrize(("chunk", "match"), [
    ((64 << 20) + 8, r"chunk size 67108872 is not a multiple of 8 in 64\.\.67108864 "
                     r"\(the limit is 64 MiB\)"),
    (1 << 30, r"chunk size 1073741824 is not a multiple of 8 in 64\.\.67108864"),
])
def test_open_refuses_a_chunk_size_over_the_limit_before_reading_the_frame_table(
        tmp_path, chunk, match):
    import tracemalloc

    frames = 1 << 22  # a 128 MiB frame table, never read
    path = tmp_path / "s.skz"
    _sparse_skz(path, chunk, frames * chunk, frames, 1 << 28)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptHeaderError, match=rf"^{re.escape(str(path))}: " + match):
            skz.open_zstd_shard(str(path), ShardInfo("s.skz", 0, "zstd", 1 << 28))
        assert tracemalloc.get_traced_memory()[1] < 4 << 20
    finally:
        tracemalloc.stop()


def test_frame_count_is_checked_against_the_file_size_before_allocating(tmp_path):
    """F frames need a 32F-byte table and at least one stored byte each: a claimed frame count
    the file cannot hold fails before the table is read."""
    import tracemalloc

    frames = 1 << 22
    path = tmp_path / "s.skz"
    layouts_size = frames * 64
    size = 33 * frames  # the 128 MiB table fits, one more byte per frame and the header not
    _sparse_skz(path, 64, layouts_size, frames, size)
    tracemalloc.start()
    try:
        with pytest.raises(TruncatedShardError, match=(
                rf"{re.escape(str(path))}: header with 4194304 frames needs at least \d+ bytes "
                r"\(preamble, entry table, frame table, checksum and one byte per frame\), "
                rf"file has {size}")):
            skz.open_zstd_shard(str(path), ShardInfo("s.skz", 0, "zstd", size))
        assert tracemalloc.get_traced_memory()[1] < 4 << 20
    finally:
        tracemalloc.stop()
