"""TensorFlow's TensorBundle checkpoints, read and written by shardkit, checked against real
TensorFlow (imported on first use: the `tf` fixture of conftest.py)."""

from __future__ import annotations

import os
import struct

import ml_dtypes
import numpy as np
import pytest
from tfhelpers import keras_model

import shardkit
from shardkit.adapters.tensorbundle import names, protos, table
from shardkit.adapters.tensorbundle.crc import crc32c, mask, unmask
from shardkit.adapters.tensorbundle.strings import decode_strings, encode_strings
from shardkit.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumError,
    CorruptIndexError,
    InvalidArgumentError,
    MissingShardError,
    ShardkitError,
    UnsupportedDTypeError,
    UnsupportedVersionError,
)
from shardkit.tools import cli


def _state() -> dict[str, np.ndarray]:
    """One tensor of every dtype both sides store, plus 0-d and empty ones."""
    rng = np.random.default_rng(3)
    out: dict[str, np.ndarray] = {
        "f16": rng.standard_normal((3, 5)).astype(np.float16),
        "f32": rng.standard_normal((4, 7)).astype(np.float32),
        "f64": rng.standard_normal(9),
        "bf16": rng.standard_normal((2, 3)).astype(ml_dtypes.bfloat16),
        "b": rng.integers(0, 2, 11).astype(bool),
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 4), np.int32),
    }
    for bits in (8, 16, 32, 64):
        info = np.iinfo(f"int{bits}")
        out[f"i{bits}"] = rng.integers(info.min, info.max, 6, dtype=f"int{bits}", endpoint=True)
        uinfo = np.iinfo(f"uint{bits}")
        out[f"u{bits}"] = rng.integers(0, uinfo.max, 6, dtype=f"uint{bits}", endpoint=True)
    return out


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _savev2(tf, prefix: str, state: dict[str, np.ndarray], specs: dict[str, str] | None = None
            ) -> None:
    """TensorFlow's own bundle writer (the SaveV2 op) on plain arrays."""
    names_, slices, tensors = [], [], []
    for k, v in state.items():
        names_.append(k.split("@")[0])
        slices.append((specs or {}).get(k, ""))
        tensors.append(v)
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names_, shape_and_slices=slices,
                      tensors=tensors)


# --- the pieces, against TensorFlow's definitions --------------------------------------------


def test_crc32c_and_mask_are_leveldb_s():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert unmask(mask(0x12345678)) == 0x12345678
    big = np.arange(3 << 18, dtype=np.uint8)  # fed in pieces of 1 MiB: same result
    assert crc32c(big) == crc32c(big.tobytes())


def test_protos_are_tensorflows(tf):
    from tensorflow.core.protobuf import tensor_bundle_pb2

    e = protos.BundleEntryProto(dtype=protos.DATA_TYPES["DT_BFLOAT16"], shard_id=2, offset=7,
                                size=12, crc32c=0xFFFFFFFF)
    e.shape.dim.add(size=3)
    s = e.slices.add()
    s.extent.add(start=1, length=2)
    s.extent.add()
    theirs = tensor_bundle_pb2.BundleEntryProto.FromString(e.SerializeToString())
    assert theirs.SerializeToString() == e.SerializeToString()
    assert theirs.dtype == tf.bfloat16.as_datatype_enum
    assert not theirs.slices[0].extent[1].HasField("length")


def test_table_round_trip_and_block_boundaries():
    items = [(b"", b"h")] + [(f"k{i:06d}".encode(), bytes(i % 300)) for i in range(3000)]
    data = table.build_table(items)
    assert table.read_table(data, "t.index") == items
    footer = data[-table.FOOTER_SIZE:]
    _, pos = table.get_varint(footer, 0, 40)
    _, pos = table.get_varint(footer, pos, 40)
    at, pos = table.get_varint(footer, pos, 40)
    size, _ = table.get_varint(footer, pos, 40)
    assert len(table._entries(memoryview(data)[at : at + size], "t", "index")) == 2  # 2 blocks
    with pytest.raises(ValueError, match="increase"):
        table.build_table([(b"b", b""), (b"a", b"")])


def test_slice_keys_are_tensorflows(tf, tmp_path):
    """EncodeTensorNameSlice: the keys TensorFlow stores slices under, for explicit and full
    extents and large offsets (multi-byte OrderedCode)."""
    x = np.arange(3 * 70000, dtype=np.int8).reshape(3, 70000)
    _savev2(tf, str(tmp_path / "p"), {"a/b": x[:, :65000], "a/b@2": x[:, 65000:]},
            {"a/b": "3 70000 -:0,65000", "a/b@2": "3 70000 0,3:65000,5000"})
    keys = {k for k, _ in table.read_table((tmp_path / "p.index").read_bytes(), "p")}
    assert names.encode_slice_key("a/b", [0, 0], [-1, 65000]) in keys
    assert names.encode_slice_key("a/b", [0, 65000], [3, 5000]) in keys
    got = shardkit.load(tmp_path / "p")
    assert _same(got["a/b"], x)


def test_string_encoding_matches_tensorflow(tf, tmp_path):
    values = [b"", b"abc", bytes(range(256)) * 3, "h\u00e9".encode()]
    _savev2(tf, str(tmp_path / "s"), {"s": np.array(values, object)})
    items = dict(table.read_table((tmp_path / "s.index").read_bytes(), "s"))
    entry = protos.BundleEntryProto.FromString(items[b"s"])
    data = (tmp_path / "s.data-00000-of-00001").read_bytes()
    stored = data[entry.offset : entry.offset + entry.size]
    assert encode_strings(values) == (stored, entry.crc32c)
    assert decode_strings(stored, 4, "s") == (values, entry.crc32c)


# --- TensorFlow -> shardkit ------------------------------------------------------------------


def test_many_keys_span_several_table_blocks_both_ways(tf, tmp_path):
    state = {f"layer{i:05d}/w": np.full(2, i, np.int32) for i in range(12000)}
    _savev2(tf, str(tmp_path / "tf"), state)
    assert (tmp_path / "tf.index").stat().st_size > table.BLOCK_SIZE
    got = shardkit.load(tmp_path / "tf")
    assert list(got) == sorted(state) and all(_same(got[k], v) for k, v in state.items())
    shardkit.save(tmp_path / "sk", state, format="tensorflow")
    assert (tmp_path / "sk.index").read_bytes() == (tmp_path / "tf.index").read_bytes()


def test_tensorflow_to_shardkit_every_dtype_bit_exact(tf, tmp_path):
    state = _state()
    _savev2(tf, str(tmp_path / "ck"), state)
    got = shardkit.load(tmp_path / "ck")
    assert set(got) == set(state)
    for k, v in state.items():
        assert _same(got[k], v), k
    # TensorFlow packs entries (data_alignment 1): those left unaligned come back as aligned
    # copies, the others as views of the map
    with shardkit.open(tmp_path / "ck") as r:
        placed = r.index.entries[0]
        odd = [k for k, e in placed.items() if e.begin % np.dtype(state[k].dtype).alignment]
        even = [k for k in placed if k not in odd and state[k].nbytes]
    assert odd and even
    assert all(got[k].flags.aligned for k in got)
    assert all(got[k].base is not None and not got[k].flags.owndata for k in even)
    assert all(got[k].flags.owndata for k in odd)
    assert shardkit.load(tmp_path / "ck", mmap=False, verify=True).keys() == got.keys()
    with shardkit.open(tmp_path / "ck.index") as r:  # the .index file names it too
        assert r.format == "tensorbundle"
        assert r.verify() == len(state)
        assert _same(r.get_slice("f32", (slice(1, 3), slice(None, None, -2))),
                     state["f32"][1:3, ::-2])


def test_tensorflow_checkpoint_write_variables_and_the_directory_state_file(tf, tmp_path):
    v = {"w": tf.Variable(np.arange(12, dtype=np.float32).reshape(3, 4)),
         "step": tf.Variable(np.int64(7))}
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(**v), tmp_path / "m", 3)
    manager.save()
    v["w"].assign_add(tf.ones((3, 4)))
    latest = manager.save()
    with shardkit.open(tmp_path / "m") as r:  # follows `checkpoint` to the latest
        assert r.path == str(tmp_path / "m")
        assert _same(r["w/.ATTRIBUTES/VARIABLE_VALUE"], v["w"].numpy())
    with shardkit.open(latest) as r:
        assert _same(r["step/.ATTRIBUTES/VARIABLE_VALUE"], np.int64(7))
    (tmp_path / "m" / "checkpoint").write_text('model_checkpoint_path: "/elsewhere/ckpt-1"\n')
    with pytest.raises(CheckpointNotFoundError, match="outside this directory"):
        shardkit.open(tmp_path / "m")
    (tmp_path / "m" / "checkpoint").write_text("model_checkpoint_path: 3 :\n")
    with pytest.raises(CorruptIndexError, match="CheckpointState"):
        shardkit.open(tmp_path / "m")


def test_max_shard_size_policy_output_is_reassembled(tf, tmp_path):
    """TensorFlow's own MaxShardSizePolicy splits a variable over data files under encoded
    slice keys; shardkit reads the whole tensor and any slice of it."""
    w = np.arange(60, dtype=np.float32).reshape(6, 10)
    ck = tf.train.Checkpoint(w=tf.Variable(w), b=tf.Variable(np.ones(3, np.float64)))
    policy = tf.train.experimental.MaxShardSizePolicy(max_shard_size=64)
    prefix = ck.write(tmp_path / "sh" / "ck",
                      options=tf.train.CheckpointOptions(experimental_sharding_callback=policy))
    key = "w/.ATTRIBUTES/VARIABLE_VALUE"
    with shardkit.open(prefix) as r:
        assert len(r.index.shards) > 2 and r.info(key).is_split
        assert _same(r[key], w)
        assert _same(r.get_slice(key, (slice(2, 5), 3)), w[2:5, 3])
        assert r.verify() == len(r.index.slice_tensor) + 1  # and the object graph
        assert r.keys()[-1] == "_CHECKPOINTABLE_OBJECT_GRAPH"


def test_partitioned_slices_with_full_extents(tf, tmp_path):
    x = np.arange(24, dtype=np.float64).reshape(4, 6)
    _savev2(tf, str(tmp_path / "p"), {"w": x[:1], "w@1": x[1:]},
            {"w": "4 6 0,1:-", "w@1": "4 6 1,3:-"})
    with shardkit.open(tmp_path / "p") as r:
        assert [s.spec for s in r.info("w").slices] == ["4 6 0,1:0,6", "4 6 1,3:0,6"]
        assert _same(r["w"], x)
        out = np.zeros_like(x)
        shardkit.restore_into(tmp_path / "p", {"w": out})
        assert _same(out, x)


def test_string_tensors_both_ways(tf, tmp_path):
    """DT_STRING: TensorFlow's varint lengths + length checksum + bytes, read as object arrays
    of bytes (tf.string's .numpy()); shardkit writes object, S and U arrays (str as UTF-8)."""
    texts = {"s": np.array([[b"", b"ab"], [bytes(range(256)), b"\xff\x00"]], object),
             "one": np.array(b"x" * 70000, object), "none": np.zeros((0, 2), object)}
    _savev2(tf, str(tmp_path / "tf"), {**texts, "n": np.arange(3)})
    with shardkit.open(tmp_path / "tf") as r:
        assert r.info("s").dtype_name == "STRING" and r.verify() == 4
        got = shardkit.load(tmp_path / "tf", verify=True)
    for k, v in texts.items():
        assert got[k].dtype == object and got[k].shape == v.shape
        assert got[k].tolist() == v.tolist()
    mixed = {**texts, "u": np.array(["h\u00e9", "z"]), "b": np.array([b"q", b""], "S2"),
             "n": np.arange(3)}
    shardkit.save(tmp_path / "sk", mixed, format="tensorflow")
    reader = tf.train.load_checkpoint(str(tmp_path / "sk"))
    for k, v in texts.items():
        assert np.asarray(reader.get_tensor(k), object).tolist() == v.tolist()
    assert reader.get_tensor("u").tolist() == ["h\u00e9".encode(), b"z"]
    assert reader.get_tensor("b").tolist() == [b"q", b""]
    data = tmp_path / "sk.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1  # the last entry is a string tensor's last byte
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="crc32c"):
        shardkit.open(tmp_path / "sk").verify()


def test_tensorflow_objects_saved_by_shardkit_are_restored_by_tensorflow(tf, keras, tmp_path):
    """A Keras model trained a few steps, saved by each side and restored by the other, gives
    the same predictions; TensorFlow's restore consumes every value shardkit wrote."""
    x = np.random.default_rng(0).standard_normal((32, 5)).astype(np.float32)
    y = x @ np.arange(5, dtype=np.float32)[:, None]
    trained, _ = keras_model(keras, 5, 4, 1)
    trained.fit(x, y, epochs=2, batch_size=8, verbose=0)
    want = trained.predict(x, verbose=0)
    ck = tf.train.Checkpoint(model=trained, optimizer=trained.optimizer)
    assert int(ck.save_counter) == 0  # created: TensorFlow's restore expects it
    shardkit.save(tmp_path / "sk", ck, format="tensorflow")
    assert (tf.train.list_variables(str(tmp_path / "sk"))
            == tf.train.list_variables(ck.write(str(tmp_path / "tf"))))
    fresh, _ = keras_model(keras, 5, 4, 1)
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(
        str(tmp_path / "sk")).assert_consumed()
    assert np.array_equal(fresh.predict(x, verbose=0), want)
    other, _ = keras_model(keras, 5, 4, 1)
    target = tf.train.Checkpoint(model=other, optimizer=other.optimizer)
    assert int(target.save_counter) == 0
    shardkit.restore_into(tmp_path / "tf", target).assert_consumed()
    assert np.array_equal(other.predict(x, verbose=0), want)
    assert int(other.optimizer.iterations) == int(trained.optimizer.iterations) > 0


# --- shardkit -> TensorFlow ------------------------------------------------------------------


def test_shardkit_to_tensorflow_every_dtype_bit_exact(tf, tmp_path):
    state = {**_state(), "nested": {"deep": np.arange(3, dtype=np.int16)}}
    info = shardkit.save(tmp_path / "ck", state, format="tensorflow")
    assert info.files == (str(tmp_path / "ck.data-00000-of-00001"), str(tmp_path / "ck.index"))
    assert sorted(os.listdir(tmp_path)) == ["ck.data-00000-of-00001", "ck.index"]  # no temp
    reader = tf.train.load_checkpoint(str(tmp_path / "ck"))
    flat = {k: v for k, v in state.items() if k != "nested"} | {"nested/deep": state["nested"]
                                                                 ["deep"]}
    assert dict(tf.train.list_variables(str(tmp_path / "ck"))) == {
        k: list(v.shape) for k, v in flat.items()}
    for k, v in flat.items():
        assert _same(reader.get_tensor(k), v), k


def test_shardkit_to_tensorflow_to_shardkit(tf, tmp_path):
    state = _state()
    shardkit.save(tmp_path / "a", state, format="tensorflow")
    reader = tf.train.load_checkpoint(str(tmp_path / "a"))
    _savev2(tf, str(tmp_path / "b"), {k: reader.get_tensor(k) for k in state})
    got = shardkit.load(tmp_path / "b", verify=True)
    for k, v in state.items():
        assert _same(got[k], v), k


def test_tensorflow_to_shardkit_to_tensorflow(tf, tmp_path):
    state = _state()
    _savev2(tf, str(tmp_path / "a"), state)
    shardkit.save(tmp_path / "b", shardkit.load(tmp_path / "a"), format="tensorflow")
    reader = tf.train.load_checkpoint(str(tmp_path / "b"))
    for k, v in state.items():
        assert _same(reader.get_tensor(k), v), k


def test_split_tensors_become_tensorflow_slices(tf, tmp_path):
    """A callback that splits tensors: one data file per shard, the full entry lists the
    slices, each under its encoded key; TensorFlow reassembles them."""
    w = np.arange(80, dtype=np.float32).reshape(8, 10)
    info = shardkit.save(tmp_path / "ck", {"w": w, "s": np.int32(3)}, format="tensorflow",
                         options=shardkit.CheckpointOptions(
                             experimental_sharding_callback=shardkit.MaxShardSizePolicy(max_shard_size=96)))
    count = len(info.files) - 1
    assert count > 3 and info.files[0].endswith(f"ck.data-00000-of-{count:05d}")
    reader = tf.train.load_checkpoint(str(tmp_path / "ck"))
    assert _same(reader.get_tensor("w"), w)
    assert reader.get_tensor("s") == 3
    with shardkit.open(tmp_path / "ck") as r:
        assert r.info("w").is_split and _same(r["w"], w)


def test_save_refuses_what_a_bundle_cannot_hold_and_keeps_old_checkpoints(tf, tmp_path):
    prefix = tmp_path / "ck"
    with pytest.raises(InvalidArgumentError, match="format must be"):
        shardkit.save(prefix, {"a": np.ones(2)}, format="tf")
    for kwargs in ({"options": shardkit.CheckpointOptions(compression="zstd")},
                   {"metadata": {"a": 1}}, {"progress": True}):
        with pytest.raises(InvalidArgumentError, match="format='tensorflow'"):
            shardkit.save(prefix, {"a": np.ones(2)}, format="tensorflow", **kwargs)
    shardkit.save(prefix, {"a": np.ones(2)}, format="tensorflow",
                  options=shardkit.CheckpointOptions(
                      experimental_sharding_callback=shardkit.MaxShardSizePolicy(max_shard_size=8)))
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        shardkit.save(prefix, {"a": np.zeros(2)}, format="tensorflow")
    # F8_E8M0 is a shardkit dtype the bundle writer has no DataType for (TensorFlow 2.21 has
    # none): refused, the old one stays
    with pytest.raises(UnsupportedDTypeError, match="'a': a TensorFlow checkpoint"):
        shardkit.save(prefix, {"a": np.ones(2, ml_dtypes.float8_e8m0fnu)}, format="tensorflow",
                      overwrite=True)
    assert _same(shardkit.load(prefix)["a"], np.ones(2))
    shardkit.save(prefix, {"a": np.zeros(2)}, format="tensorflow", overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["ck.data-00000-of-00001", "ck.index"]
    assert _same(tf.train.load_checkpoint(str(prefix)).get_tensor("a"), np.zeros(2))
    (tmp_path / "d").mkdir()
    with pytest.raises(InvalidArgumentError, match="directory exists"):
        shardkit.save(tmp_path / "d", {"a": np.ones(2)}, format="tensorflow")


def test_a_failed_publish_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    prefix = tmp_path / "ck"
    shardkit.save(prefix, {"a": np.ones(3)}, format="tensorflow")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real = os.rename

    def failing(src, dst, *args, **kwargs):
        if str(dst) == f"{prefix}.index" and os.path.basename(src) == "ck.index":  # the new
            raise OSError(28, "No space left on device")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="No space"):
        shardkit.save(prefix, {"a": np.zeros(3), "b": np.ones(1)}, format="tensorflow",
                      overwrite=True)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert _same(shardkit.load(prefix, verify=True)["a"], np.ones(3))


def test_an_overwrite_stopped_after_its_commit_is_the_new_checkpoint_for_tensorflow(
        tf, tmp_path, monkeypatch):
    """The same data file names: the commit is an index naming the new files under a free
    shard count; TensorFlow reads that interim checkpoint (docs/FORMAT.md section 12)."""
    prefix = tmp_path / "ck"
    shardkit.save(prefix, {"a": np.ones(3)}, format="tensorflow")
    real = os.rename
    commits = []

    def failing(src, dst, *args, **kwargs):
        if str(dst) == f"{prefix}.index":
            commits.append(src)
            if len(commits) == 2:  # the final index, after the interim one was committed
                raise OSError(5, "Input/output error")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="Input/output"):
        shardkit.save(prefix, {"a": np.zeros(3), "b": np.ones(1)}, format="tensorflow",
                      overwrite=True)
    monkeypatch.undo()
    assert {"ck.data-00000-of-00002", "ck.data-00001-of-00002"} <= set(os.listdir(tmp_path))
    reader = tf.train.load_checkpoint(str(prefix))
    assert _same(reader.get_tensor("a"), np.zeros(3)) and _same(reader.get_tensor("b"), np.ones(1))
    got = shardkit.load(prefix, verify=True)
    assert _same(got["a"], np.zeros(3)) and _same(got["b"], np.ones(1))
    shardkit.save(prefix, {"a": np.ones(3)}, format="tensorflow", overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["ck.data-00000-of-00001", "ck.index"]
    assert _same(tf.train.load_checkpoint(str(prefix)).get_tensor("a"), np.ones(3))


def test_convert_both_ways(tf, tmp_path, capsys):
    state = _state()
    _savev2(tf, str(tmp_path / "tf"), state)
    assert cli.main(["convert", str(tmp_path / "tf"), str(tmp_path / "sk")]) == 0
    assert "(shardkit)" in capsys.readouterr().out
    got = shardkit.load(tmp_path / "sk", verify=True)
    assert all(_same(got[k], v) for k, v in state.items())
    assert shardkit.open(tmp_path / "sk").format == "shardkit"
    assert cli.main(["convert", str(tmp_path / "sk"), str(tmp_path / "back")]) == 0
    reader = tf.train.load_checkpoint(str(tmp_path / "back"))
    assert all(_same(reader.get_tensor(k), v) for k, v in state.items())
    assert cli.main(["convert", str(tmp_path / "sk"), str(tmp_path / "back")]) == 1
    assert "overwrite" in capsys.readouterr().err
    assert cli.main(["convert", str(tmp_path / "tf"), str(tmp_path / "tf2"), "--to",
                     "tensorflow"]) == 0
    assert cli.main(["inspect", str(tmp_path / "tf2")]) == 0
    assert "checksums: crc32c" in capsys.readouterr().out
    assert cli.main(["verify", str(tmp_path / "tf2")]) == 0
    assert cli.main(["plan", str(tmp_path / "tf2"), "--policy", "default"]) == 0
    assert f"{len(state)} tensors" in capsys.readouterr().out


# --- corrupt and malformed input ---------------------------------------------------------------


@pytest.fixture()
def bundle(tmp_path):
    """A small bundle written by shardkit (its TensorFlow readability is tested above)."""
    state = {"a": np.arange(6, dtype=np.float32), "b": np.arange(4, dtype=np.int64)}
    shardkit.save(tmp_path / "ck", state, format="tensorflow")
    return tmp_path / "ck", state


def _rewrite_entries(prefix, edit) -> None:
    """Decode the index, let `edit(key, entry)` change entries, write it back resealed."""
    path = prefix.parent / f"{prefix.name}.index"
    items = table.read_table(path.read_bytes(), str(path))
    out = [items[0]]
    for k, v in items[1:]:
        e = protos.BundleEntryProto.FromString(v)
        edit(k, e)
        out.append((k, e.SerializeToString()))
    path.write_bytes(table.build_table(out))


def test_data_corruption_is_caught_by_verify(bundle):
    prefix, _ = bundle
    data = prefix.parent / "ck.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match=r"ck\.data-00000-of-00001.*crc32c") as e:
        shardkit.open(prefix).verify()
    assert "'b'" in str(e.value) or "'a'" in str(e.value)
    with pytest.raises(ChecksumError):
        shardkit.load(prefix, verify=True)
    assert cli.main(["verify", str(prefix)]) == 1


@pytest.mark.parametrize("damage, error, words", [
    (lambda d: d[:-1], CorruptIndexError, "bad magic"),
    (lambda d: d[:20], CorruptIndexError, "too short"),
    (lambda d: bytes([d[0] ^ 1]) + d[1:], CorruptIndexError, "checksum mismatch"),
    (lambda d: d[:-48] + b"\xff" * 40 + d[-8:], CorruptIndexError, "block handle"),
])
def test_damaged_index_file(bundle, damage, error, words):
    prefix, _ = bundle
    path = prefix.parent / "ck.index"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(error, match=words) as e:
        shardkit.open(prefix)
    assert str(path) in str(e.value)


def test_compressed_table_blocks_are_refused(bundle):
    prefix, _ = bundle
    path = prefix.parent / "ck.index"
    data = bytearray(path.read_bytes())
    # the first data block: its handle is the value of the index block's first entry
    footer = data[-48:]
    _, pos = table.get_varint(footer, 0, 40)
    _, pos = table.get_varint(footer, pos, 40)
    index_off, pos = table.get_varint(footer, pos, 40)
    index_size, _ = table.get_varint(footer, pos, 40)
    block = bytes(data[index_off : index_off + index_size])
    first = table._entries(memoryview(block), "x", "index")[0][1]
    off, p = table.get_varint(first, 0, len(first))
    n, _ = table.get_varint(first, p, len(first))
    data[off + n] = 1  # snappy
    data[off + n + 1 : off + n + 5] = struct.pack("<I", mask(crc32c(bytes(data[off : off + n
                                                                                 + 1]))))
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptIndexError, match="snappy"):
        shardkit.open(prefix)


@pytest.mark.parametrize("edit, error, words", [
    (lambda k, e: setattr(e, "size", e.size + 4) if k == b"a" else None, CorruptIndexError,
     "stored size"),
    (lambda k, e: setattr(e, "offset", 1 << 40) if k == b"a" else None, CorruptIndexError,
     "past the end"),
    (lambda k, e: setattr(e, "shard_id", 3) if k == b"a" else None, CorruptIndexError,
     "shard_id 3"),
    (lambda k, e: setattr(e, "dtype", protos.DATA_TYPES["DT_QINT8"]) if k == b"a" else None,
     UnsupportedDTypeError, "DT_QINT8"),
    (lambda k, e: e.shape.dim.add(size=-2) if k == b"a" else None, CorruptIndexError,
     "negative dimension"),
    (lambda k, e: e.slices.add().extent.add(start=0, length=3) if k == b"a" else None,
     CorruptIndexError, "encoded key is missing"),
    (lambda k, e: e.slices.add().extent.add(start=5, length=3) if k == b"a" else None,
     CorruptIndexError, "outside dimension"),
])
def test_inconsistent_entries(bundle, edit, error, words):
    prefix, _ = bundle
    _rewrite_entries(prefix, edit)
    with pytest.raises(error, match=words) as e:
        shardkit.open(prefix)
    assert "ck.index" in str(e.value)


def test_bad_entry_proto_and_header(bundle):
    prefix, _ = bundle
    path = prefix.parent / "ck.index"
    items = table.read_table(path.read_bytes(), "x")
    path.write_bytes(table.build_table([items[0], (b"a", b"\xff\xff\xff")]))
    with pytest.raises(CorruptIndexError, match="not a parseable BundleEntryProto"):
        shardkit.open(prefix)
    path.write_bytes(table.build_table(items[1:]))
    with pytest.raises(CorruptIndexError, match="no header entry"):
        shardkit.open(prefix)
    for change, words in ((lambda h: setattr(h, "endianness", 1), "big-endian"),
                          (lambda h: setattr(h.version, "min_consumer", 2), "newer"),
                          (lambda h: h.version.bad_consumers.append(1), "bad_consumers")):
        header = protos.BundleHeaderProto.FromString(items[0][1])
        change(header)
        path.write_bytes(table.build_table([(b"", header.SerializeToString()), *items[1:]]))
        with pytest.raises(UnsupportedVersionError, match=words):
            shardkit.open(prefix)


def test_missing_data_file(bundle):
    prefix, _ = bundle
    (prefix.parent / "ck.data-00000-of-00001").unlink()
    with pytest.raises(MissingShardError, match=r"ck\.data-00000-of-00001"):
        shardkit.open(prefix)


def test_every_malformed_input_is_a_shardkit_error(bundle):
    """Each byte of the index flipped in turn: always a ShardkitError, never another."""
    prefix, _ = bundle
    path = prefix.parent / "ck.index"
    original = path.read_bytes()
    for i in range(0, len(original)):
        data = bytearray(original)
        data[i] ^= 0x41
        path.write_bytes(bytes(data))
        try:
            shardkit.load(prefix, verify=True)
        except ShardkitError:
            pass


def test_an_overwrite_without_hard_links_keeps_the_interim_names(tmp_path, monkeypatch):
    prefix = tmp_path / "ck"
    shardkit.save(prefix, {"a": np.ones(3)}, format="tensorflow")

    def no_links(src, dst, *args, **kwargs):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    info = shardkit.save(prefix, {"a": np.zeros(3), "b": np.ones(1)}, format="tensorflow",
                         overwrite=True)
    monkeypatch.undo()
    files = ["ck.data-00000-of-00002", "ck.data-00001-of-00002", "ck.index"]
    assert sorted(os.listdir(tmp_path)) == files
    assert sorted(os.path.basename(f) for f in info.files) == files
    assert (tmp_path / "ck.data-00001-of-00002").stat().st_size == 0
    got = shardkit.load(prefix, verify=True)
    assert _same(got["a"], np.zeros(3)) and _same(got["b"], np.ones(1))


def test_a_publish_failing_halfway_removes_the_files_it_moved_in(tmp_path, monkeypatch):
    prefix = tmp_path / "ck"
    shardkit.save(prefix, {"a": np.ones(3)}, format="tensorflow")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real = os.rename

    def failing(src, dst, *args, **kwargs):
        if os.path.basename(dst) == "ck.data-00001-of-00002":  # the second interim file
            raise OSError(28, "No space left on device")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="No space"):
        shardkit.save(prefix, {"a": np.zeros(3)}, format="tensorflow", overwrite=True)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_slice_entries_of_no_listed_tensor_are_refused(tmp_path, tf):
    """A table whose sliced tensor lost its own entry still holds that tensor's slice entries:
    TensorFlow's reader refuses it (it lists the slice keys as variables it cannot read), so
    shardkit's open, load and verify refuse it too, naming the orphaned entry."""
    prefix = tmp_path / "ck"
    state = {"a": np.arange(6, dtype=np.float32), "b": np.arange(4, dtype=np.int64)}
    shardkit.save(prefix, state, format="tensorflow",
                  options=shardkit.CheckpointOptions(
                      experimental_sharding_callback=shardkit.MaxShardSizePolicy(max_shard_size=24)))
    index = tmp_path / "ck.index"
    items = table.read_table(index.read_bytes(), str(index))
    assert sum(k[:1] == b"\x00" for k, _ in items) == 3  # "b" in three slices
    index.write_bytes(table.build_table([(k, v) for k, v in items if k != b"b"]))
    with pytest.raises(Exception):  # noqa: B017  (TensorFlow's own error types vary)
        reader = tf.train.load_checkpoint(str(prefix))
        for key in reader.get_variable_to_shape_map():
            reader.get_tensor(key)
    for read in (lambda: shardkit.open(prefix).close(), lambda: shardkit.load(prefix),
                 lambda: shardkit.open(prefix).verify()):
        with pytest.raises(CorruptIndexError, match=r"is a slice of no tensor the table lists"):
            read()


@pytest.mark.parametrize("dtype, dims", [
    (np.uint16, [0, 2**62]),  # found by the entry-bounds fuzz target (x1 r=136655)
    (np.float64, [2**61, 0]),  # fewer elements than the shape limit, but 2**64 bytes
    (np.int8, [0, 2**32, 2**31]),
])
def test_an_empty_tensor_whose_shape_no_array_can_have_is_refused(tmp_path, dtype, dims):
    """A zero-element entry whose other dimensions multiply past 2**63 - 1 bytes holds no data
    to check, but numpy has no array of that shape: open, load and verify refuse it as a
    CorruptIndexError (as the safetensors header checks do), not numpy's ValueError."""
    prefix = tmp_path / "ck"
    shardkit.save(prefix, {"e": np.zeros((0, 3), dtype), "a": np.arange(3.0)},
                  format="tensorflow")

    def edit(k, e):
        if k == b"e":
            del e.shape.dim[:]
            for d in dims:
                e.shape.dim.add(size=d)

    _rewrite_entries(prefix, edit)
    for read in (lambda: shardkit.open(prefix).close(), lambda: shardkit.load(prefix),
                 lambda: shardkit.open(prefix).verify()):
        with pytest.raises(CorruptIndexError, match=r"tensor 'e'.*more than 2\*\*63 - 1 bytes"):
            read()
    assert cli.main(["verify", str(prefix)]) == 1
