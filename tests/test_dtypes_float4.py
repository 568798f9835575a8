"""float4_e2m1fn (safetensors "F4"): stored two elements a byte, element 0 in the low nibble,
the header's and the manifest's shapes counting elements, as safetensors stores it; read back
unpacked (numpy, jax) or as torch's packed float4_e2m1fn_x2, through every read mode."""

import json
import re
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import xxhash

import shardkit
from shardkit import CheckpointOptions
from shardkit._kernels import _table
from shardkit._reference import _table as ref_table
from shardkit.errors import (
    CorruptHeaderError,
    CorruptIndexError,
    EntryLayoutError,
    ShardingValidationError,
    UnsupportedDTypeError,
)
from shardkit.format import MANIFEST_FILE
from shardkit.sharding.callback import ShardingCallback
from shardkit.sharding.policies import POLICIES, get_policy
from shardkit.sharding.tensors import shardable_tensors
from shardkit.values.dtypes import entry_sizes, nbytes, numpy_dtype, safetensors_name
from shardkit.values.nibbles import pack, unpack

F4 = np.dtype(ml_dtypes.float4_e2m1fn)
# the 16 codes and the values ml_dtypes gives them: no nan and no inf in e2m1fn; code 8 is -0
VALUES = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
ZSTD = CheckpointOptions(compression="zstd", chunk_size=64)
INDICES = [np.s_[1:3, 1:4], np.s_[:, 1], np.s_[:, 3:], np.s_[::-1, ::3], np.s_[2], np.s_[..., 5],
           np.s_[1, 1:2], np.s_[:, 1::2], np.s_[None, 0, -3:], ()]


def codes(shape, seed=0):
    """Every code at least once (for 16 elements or more), shuffled, as float4_e2m1fn."""
    n = int(np.prod(shape))
    raw = np.resize(np.arange(16, dtype=np.uint8), n)
    return np.random.default_rng(seed).permutation(raw).reshape(shape).view(F4)


def packed_bytes(array):
    """The stored bytes, computed here without shardkit: element 2k low, 2k+1 high nibble."""
    c = array.reshape(-1).view(np.uint8).astype(np.uint16)
    return bytes((c[0::2] | (c[1::2] << 4)).astype(np.uint8))


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def raw_header(path):
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def shard_of(ckpt):
    return next(Path(ckpt).glob("*.safetensors"))


def test_the_table_and_the_size_rule():
    assert safetensors_name(F4) == "F4" and numpy_dtype("F4") == F4
    assert nbytes("F4", (4, 6)) == 12 and nbytes("F4", (0, 3)) == 0 and nbytes("F32", (3,)) == 12
    assert nbytes("F4", (3,)) == -1  # no stored tensor has an odd count: no size matches it
    assert entry_sizes(["F32", "F4", "U8", "F4"], [(2,), (2, 3), (5,), (1,)]) == [8, 3, 5, -1]
    # the kernels size the stored (packed) arrays the writer hands them: they agree with it
    for shape in [(4, 6), (2, 3), (0, 2), (16,)]:
        stored = [pack(codes(shape))]
        assert _table.array_nbytes(stored).tolist() == [nbytes("F4", shape)]
        assert ref_table.array_nbytes(stored).tolist() == [nbytes("F4", shape)]


def test_pack_and_unpack_every_code():
    a = np.arange(16, dtype=np.uint8).view(F4)
    assert a.astype(np.float32).tolist() == VALUES and np.signbit(a.astype(np.float32)[8])
    assert bytes(pack(a)) == bytes([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE])
    assert same(unpack(pack(a), F4, (16,)), a)
    assert same(unpack(pack(a), F4, (3,), first=5), a[5:8])  # from a high nibble
    with pytest.raises(ValueError, match="odd count"):
        pack(a[:3])


@pytest.mark.parametrize("options", [None, ZSTD], ids=["raw", "zstd"])
@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip_in_every_read_mode(tmp_path, options, mmap):
    state = {"w": codes((4, 6)), "odd_rows": codes((2, 3), 1), "v": codes((32,), 2),
             "empty": codes((0, 5)), "f": np.arange(5, dtype=np.float32),
             "t": codes((12, 8), 3)[:, ::2]}  # not contiguous: packed in C order
    shardkit.save(tmp_path / "c", state, options=options)
    loaded = shardkit.load(tmp_path / "c", mmap=mmap)
    for key, value in state.items():
        assert same(loaded[key], value), key
    assert loaded["w"].flags.writeable and loaded["w"].flags.c_contiguous
    with shardkit.open(tmp_path / "c", mmap=mmap) as reader:
        assert reader.info("w").dtype == F4 and reader.info("w").shape == (4, 6)
        assert reader.verify() == len(state)
        assert same(reader.get("odd_rows"), state["odd_rows"])
        for key in ("w", "odd_rows", "t"):
            for index in INDICES:
                try:
                    want = state[key][index]
                except IndexError:
                    continue
                assert same(reader.get_slice(key, index), np.ascontiguousarray(want)), (key,
                                                                                         index)
    target = {k: np.zeros_like(v) for k, v in state.items()}
    target["t"] = np.zeros((12, 8), F4)[:, ::2]  # a strided target
    shardkit.restore_into(tmp_path / "c", target)
    for key, value in state.items():
        assert same(np.ascontiguousarray(target[key]), np.ascontiguousarray(value)), key


def test_stored_bytes_header_index_and_checksums(tmp_path):
    state = {"w": codes((4, 6)), "odd_rows": codes((2, 3), 1), "f": np.ones(3, np.float64)}
    shardkit.save(tmp_path / "c", state)
    header, data = raw_header(shard_of(tmp_path / "c"))
    manifest = json.loads((tmp_path / "c" / MANIFEST_FILE).read_text())
    tensors, slices = manifest["shardkit"]["tensors"], manifest["shardkit"]["slices"]
    for key in ("w", "odd_rows"):
        entry = header[key]
        assert entry["dtype"] == "F4" and entry["shape"] == list(state[key].shape)
        b, e = entry["data_offsets"]
        assert data[b:e] == packed_bytes(state[key])  # half the elements' count of bytes
        row = tensors["key"].index(key)
        assert tensors["dtype"][row] == "F4" and tensors["shape"][row] == list(state[key].shape)
        assert slices["xxh3"][slices["tensor"].index(row)] == xxhash.xxh3_64_hexdigest(data[b:e])
    assert manifest["metadata"]["total_size"] == 12 + 3 + 24


def test_safetensors_reads_shardkit_shards(tmp_path):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    state = {"w": codes((4, 6)), "v": codes((32,), 2)}
    shardkit.save(tmp_path / "c", state)
    got = st.load_file(str(shard_of(tmp_path / "c")))
    for key, value in state.items():
        t = got[key]
        assert t.dtype == torch.float4_e2m1fn_x2
        assert tuple(t.shape) == (*value.shape[:-1], value.shape[-1] // 2)
        assert t.view(torch.uint8).numpy().tobytes() == packed_bytes(value)
        ours = shardkit.load(tmp_path / "c", framework="torch")[key]
        assert ours.dtype == t.dtype and torch.equal(ours.view(torch.uint8), t.view(torch.uint8))


def test_shardkit_reads_safetensors_files(tmp_path):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    raw = torch.from_numpy(np.random.default_rng(5).integers(0, 256, (3, 4), np.uint8))
    path = tmp_path / "model.safetensors"
    st.save_file({"w": raw.view(torch.float4_e2m1fn_x2), "b": torch.ones(2)}, str(path))
    with shardkit.open(path) as reader:
        w = reader["w"]
        assert w.dtype == F4 and w.shape == (3, 8)
        assert packed_bytes(w) == raw.numpy().tobytes()
        assert same(reader.get_slice("w", np.s_[:, 3:6]), np.ascontiguousarray(w[:, 3:6]))
        assert reader.verify_report().ok  # no checksums: sizes, dtypes and shapes


def test_torch_gives_and_takes_float4_e2m1fn_x2(tmp_path):
    torch = pytest.importorskip("torch")
    x2 = torch.from_numpy(np.frombuffer(packed_bytes(codes((4, 6))), np.uint8).reshape(4, 3)
                          .copy()).view(torch.float4_e2m1fn_x2)
    shardkit.save(tmp_path / "c", {"w": x2, "odd_rows": codes((2, 3))})
    assert same(shardkit.load(tmp_path / "c")["w"], codes((4, 6)))  # (..., 2 * last) elements
    with shardkit.open(tmp_path / "c") as reader:
        got = reader.get("w", framework="torch")
        assert got.dtype == torch.float4_e2m1fn_x2 and tuple(got.shape) == (4, 3)
        assert torch.equal(got.view(torch.uint8), x2.view(torch.uint8))
        rows = reader.get_slice("w", np.s_[1:3], framework="torch")
        assert torch.equal(rows.view(torch.uint8), x2[1:3].view(torch.uint8))
        with pytest.raises(UnsupportedDTypeError, match=r"'odd_rows'.*float4_e2m1fn_x2.*"
                                                        r"no even last dimension"):
            reader.get("odd_rows", framework="torch")
    target = {"w": torch.zeros(4, 3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
              "odd_rows": np.zeros((2, 3), F4)}
    shardkit.restore_into(tmp_path / "c", target)
    assert torch.equal(target["w"].view(torch.uint8), x2.view(torch.uint8))
    with pytest.raises(UnsupportedDTypeError, match="0-d float4_e2m1fn_x2"):
        shardkit.save(tmp_path / "d", {"s": x2[0, 0]})


def test_jax_gives_float4_e2m1fn(tmp_path):
    jnp = pytest.importorskip("jax.numpy")
    shardkit.save(tmp_path / "c", {"w": codes((4, 6))}, options=ZSTD)
    got = shardkit.load(tmp_path / "c", framework="jax", device="cpu")["w"]
    assert got.dtype == jnp.float4_e2m1fn and same(np.asarray(got), codes((4, 6)))


def test_an_odd_element_count_is_refused_naming_the_key(tmp_path):
    for shape in [(3,), (), (3, 5)]:
        with pytest.raises(UnsupportedDTypeError, match=r"'m/q': F4 stores two elements a byte,"
                                                        r" so it needs an even element count"):
            shardkit.save(tmp_path / "c", {"m": {"q": np.zeros(shape, F4)}})
        assert not (tmp_path / "c").exists()


def _pieces(shards):
    return [(key, spec, value) for shard in shards for key, slices in shard.items()
            for spec, value in slices.items()]


CONFIGS = {"max-shard-size": {"max_shard_size": 5}, "bin-pack": {"max_shard_size": 5},
           "balanced": {"num_shards": 7}, "default": {"max_shard_size": 5, "threads": 3}}


@pytest.mark.parametrize("name", sorted({*POLICIES, "default"}))  # default: io.save's
def test_policies_never_split_at_an_odd_element(tmp_path, name):
    state = {"a": codes((6, 10)), "b": codes((5, 6), 1), "odd_last": codes((4, 3), 2),
             "c": codes((2, 2, 4), 3), "f": np.arange(12, dtype=np.float32).reshape(3, 4)}
    policy = get_policy(name, **CONFIGS.get(name, {}))
    pieces = _pieces(policy(shardable_tensors(state)))
    assert len(pieces) > len(state) or name in ("by-task", "all-in-one", "default")
    for key, spec, value in pieces:
        if value.dtype == F4:
            assert value.size % 2 == 0, (name, key, spec, value.shape)
    if name in ("max-shard-size", "bin-pack"):
        split = {key for key, spec, value in pieces if value.dtype == F4 and spec
                 and value.shape != state[key].shape}
        assert {"a", "b", "c"} <= split and "odd_last" not in split  # odd last axis: whole
    options = CheckpointOptions(experimental_sharding_callback=policy)
    with pytest.warns(UserWarning) if name in ("max-shard-size", "bin-pack", "balanced") else \
            _no_warning():
        shardkit.save(tmp_path / "c", state, options=options)
    for mmap in (True, False):
        loaded = shardkit.load(tmp_path / "c", mmap=mmap)
        for key, value in state.items():
            assert same(loaded[key], value), (key, mmap)
        with shardkit.open(tmp_path / "c", mmap=mmap) as reader:
            assert reader.verify() == len(pieces)  # every stored slice
            assert same(reader.get_slice("a", np.s_[1:5, 3:8]), state["a"][1:5, 3:8])
            assert same(reader.get_slice("b", np.s_[:, 1::2]), state["b"][:, 1::2].copy())
        target = {k: np.zeros_like(v) for k, v in state.items()}
        shardkit.restore_into(tmp_path / "c", target)
        assert all(same(target[k], v) for k, v in state.items())


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _OddSplit(ShardingCallback):
    """Splits 'w' (2 x 3 float4) into its two rows: 3 elements each."""

    description = "odd rows"

    def __call__(self, tensors):
        t = tensors[0]
        return [{"w": {"2 3 0,1:0,3": t.tensor[:1]}}, {"w": {"2 3 1,1:0,3": t.tensor[1:]}}]


def test_a_callback_splitting_at_an_odd_element_is_refused(tmp_path):
    options = CheckpointOptions(experimental_sharding_callback=_OddSplit())
    with pytest.raises(ShardingValidationError,
                       match=r"(?s)rule 'slices of a packed tensor hold an even count of "
                             r"elements'.*'w'.*'2 3 0,1:0,3'.*shape \[1, 3\], 3 elements"):
        shardkit.save(tmp_path / "c", {"w": codes((2, 3))}, options=options)
    assert not (tmp_path / "c").exists()


def _forge(path, entries, data):
    body = json.dumps(entries).encode()
    body += b" " * (-len(body) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(body)) + body + data)


def test_hostile_headers_are_refused_naming_the_file(tmp_path):
    odd = tmp_path / "odd.safetensors"
    _forge(odd, {"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}, b"\x21")
    with pytest.raises(CorruptHeaderError, match=rf"{odd}: entry 'w': F4 stores two elements a "
                                                 r"byte.*shape \[3\] has 3"):
        shardkit.open(odd).get("w")
    long = tmp_path / "long.safetensors"
    _forge(long, {"w": {"dtype": "F4", "shape": [4], "data_offsets": [0, 4]}}, b"\x21" * 4)
    with pytest.raises(EntryLayoutError, match=rf"{long}: entry 'w': data_offsets \[0, 4\] span "
                                               r"4 bytes, but dtype F4 and shape \[4\] need 2"):
        shardkit.open(long).get("w")


def test_a_hostile_manifest_is_refused_naming_the_file(tmp_path):
    shardkit.save(tmp_path / "c", {"w": codes((2, 4))})
    manifest = tmp_path / "c" / MANIFEST_FILE
    doc = json.loads(manifest.read_text())
    doc["shardkit"]["tensors"]["shape"] = [[1, 3]]
    manifest.write_text(json.dumps(doc))
    with pytest.raises(CorruptIndexError, match=rf"{manifest}: tensor 'w': F4 stores two elements"
                                                r" a byte.*shape \[1, 3\] has 3"):
        shardkit.open(tmp_path / "c")


def test_tensorflow_bundles_hold_float4_one_element_a_byte(tmp_path):
    tf = pytest.importorskip("tensorflow")
    state = {"w": codes((2, 7)), "f": np.ones(3, np.float32)}
    shardkit.save(tmp_path / "sk", state, format="tensorflow")
    reader = tf.train.load_checkpoint(str(tmp_path / "sk"))
    assert reader.get_variable_to_dtype_map()["w"] == tf.dtypes.as_dtype(33)  # DT_FLOAT4_E2M1FN
    assert same(np.asarray(reader.get_tensor("w")), state["w"])
    data = next(tmp_path.glob("sk.data-*")).read_bytes()
    assert state["w"].view(np.uint8).tobytes() in data  # a byte each, not packed
    # TensorFlow's own bundle, of an odd count (which only shardkit's format refuses)
    x = codes((3, 5), 4)
    tf.raw_ops.SaveV2(prefix=str(tmp_path / "tf"), tensor_names=["x"], shape_and_slices=[""],
                      tensors=[tf.convert_to_tensor(x)])
    for mmap in (True, False):
        with shardkit.open(tmp_path / "tf", mmap=mmap) as got:
            assert same(got["x"], x) and got.verify() == 1
            assert same(got.get_slice("x", np.s_[:, 1:4]), x[:, 1:4].copy())
        target = {"x": np.zeros((3, 5), F4)}
        shardkit.restore_into(tmp_path / "tf", target)
        assert same(target["x"], x)
    with pytest.raises(UnsupportedDTypeError, match=r"'x': F4 stores two elements a byte"):
        shardkit.save(tmp_path / "again", shardkit.load(tmp_path / "tf"))
    variable = tf.Variable(tf.convert_to_tensor(codes((2, 8))))  # TensorFlow values in
    shardkit.save(tmp_path / "v", {"v": variable})
    assert same(shardkit.load(tmp_path / "v")["v"], codes((2, 8)))
    back = shardkit.load(tmp_path / "v", framework="tensorflow")["v"]  # and out
    assert back.dtype == tf.dtypes.as_dtype(33) and same(back.numpy(), codes((2, 8)))


def _collective_save(rank, world, path):
    import torch

    state = {"shared": codes((6, 10)), f"own{rank}": codes((4, 4), rank + 1)}
    info = shardkit.save(path, state, process_group=torch.distributed.group.WORLD)
    return info.files


def test_a_collective_save_counts_float4_bytes_as_stored(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available():
        pytest.skip("torch built without torch.distributed")
    import distributed as harness  # tests/distributed.py

    path = str(tmp_path / "c")
    harness.raise_any(harness.run_ranks(_collective_save, 2, path))
    loaded = shardkit.load(path)
    assert same(loaded["shared"], codes((6, 10)))
    assert same(loaded["own0"], codes((4, 4), 1)) and same(loaded["own1"], codes((4, 4), 2))
    with shardkit.open(path) as reader:
        assert reader.verify() == 3 and reader.index.total_size() == 30 + 8 + 8


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_an_async_checkpoint_save_and_restore(tmp_path, compression):
    from shardkit.training.checkpoint import Checkpoint

    weights = {"w": codes((4, 6)), "odd_rows": codes((2, 3), 1)}
    options = CheckpointOptions(enable_async=True, compression=compression)
    ckpt = Checkpoint(model=weights)
    path = ckpt.save(str(tmp_path / "c"), options)
    ckpt.sync()
    fresh = {k: np.zeros_like(v) for k, v in weights.items()}
    Checkpoint(model=fresh).read(str(path)).assert_consumed()
    assert all(same(fresh[k], v) for k, v in weights.items())


def test_inspect_shows_the_stored_bytes_of_each_slice(tmp_path, capsys):
    from shardkit.tools.cli import main

    options = CheckpointOptions(experimental_sharding_callback=get_policy(
        "max-shard-size", max_shard_size=64))
    with pytest.warns(UserWarning):
        shardkit.save(tmp_path / "c", {"w": codes((16, 16))}, options=options)  # 128 bytes
    assert main(["inspect", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "F4" in out and "16 16 0,8:0,16" in out and "16 16 8,8:0,16" in out
    assert re.findall(r"16 16 \d,8:0,16  (\d+ B)  \[", out) == ["64 B", "64 B"]  # not 128 B
    assert main(["verify", str(tmp_path / "c")]) == 0


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_checkpoint_at_a_url(tmp_path, compression):
    import os

    from shardkit.storage import open_storage

    pytest.importorskip("fsspec")
    url = f"memory://shardkit-float4/{os.getpid()}-{compression}"
    state = {"w": codes((4, 6)), "odd_rows": codes((2, 3), 1)}
    options = CheckpointOptions(compression=compression)
    shardkit.save(url, state, options=options)
    try:
        for key, value in shardkit.load(url).items():
            assert same(value, state[key]), key
        with shardkit.open(url) as reader:
            assert reader.verify() == 2
            assert same(reader.get_slice("w", np.s_[:, 1:4]), state["w"][:, 1:4].copy())
        if compression is None:  # uploaded from the packed arrays: a local save's bytes
            shardkit.save(tmp_path / "c", state, options=options)
            store = open_storage(url)
            shard = next(s for s in store.list("") if s.name.endswith(".safetensors"))
            _, data = raw_header(shard_of(tmp_path / "c"))
            assert store.read_range(shard.name, 0, shard.size).endswith(data)
    finally:
        open_storage(url).fs.rm(open_storage(url).root, recursive=True)


def test_profile_counts_the_stored_bytes():
    from shardkit.tools.profiling import profile

    got = profile({"w": codes((16, 16)), "f": np.ones(8, np.float32)},
                  {"bin-pack": get_policy("bin-pack", max_shard_size=64)})
    assert sum(got[0].shard_bytes) == 128 + 32 and max(got[0].shard_bytes) <= 64
