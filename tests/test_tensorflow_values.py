"""TensorFlow values in and out: tf.Tensor, tf.Variable, tf.Module, Keras models and
optimizers saved under TensorFlow's own checkpoint keys, restored in place, loaded as tf
tensors; bit-exact for every dtype both support, strings included."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from tfhelpers import bits, keras_model, module

import shardkit
from shardkit.errors import (
    IncompleteRestoreError,
    InvalidArgumentError,
    RestoreMismatchError,
)
from shardkit.sharding.tensors import shardable_tensors

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("tensorflow is not installed (optional)", allow_module_level=True)

GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"


def test_import_shardkit_does_not_import_tensorflow():
    code = ("import sys, numpy as np, shardkit, tempfile, os\n"
            "d = tempfile.mkdtemp()\n"
            "shardkit.save(os.path.join(d, 'c'), {'a': np.ones(2), 's': np.array(['x'])})\n"
            "shardkit.load(os.path.join(d, 'c'))\n"
            "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _all_dtypes(tf):
    rng = np.random.default_rng(3)
    values = {
        "f16": rng.standard_normal((3, 2)).astype(np.float16),
        "f32": np.array([np.nan, -0.0, np.inf, 1e-40], np.float32),
        "f64": rng.standard_normal(5),
        "bf16": rng.standard_normal((2, 2)).astype(ml_dtypes.bfloat16),
        "f8": np.array([1.5, -2.0], ml_dtypes.float8_e4m3fn),
        "i8": np.array([-128, 127], np.int8), "i16": np.array([-3], np.int16),
        "i32": np.array([[2**31 - 1]], np.int32), "i64": np.array(-(2**62), np.int64),
        "u8": np.array([255], np.uint8), "u16": np.array([65535], np.uint16),
        "u32": np.array([2**32 - 1], np.uint32), "u64": np.array([2**64 - 1], np.uint64),
        "bool": np.array([True, False]),
    }
    strings = np.empty(3, object)
    strings[:] = [b"", b"\x00\xffbytes", "h\u00e9".encode()]
    values["str"] = strings
    return values


def test_every_dtype_bit_exact_as_variables_and_tensors(tf, tmp_path):
    values = _all_dtypes(tf)
    state = {"var": {k: tf.Variable(v) for k, v in values.items()},
             "const": {k: tf.constant(v) for k, v in values.items()}}
    shardkit.save(tmp_path / "c", state, options=shardkit.CheckpointOptions(durable=False))
    got = shardkit.load(tmp_path / "c")
    for kind in ("var", "const"):
        for k, v in values.items():
            assert bits(got[f"{kind}/{k}"]) == bits(v), (kind, k)
    as_tf = shardkit.load(tmp_path / "c", framework="tensorflow")
    for k, v in values.items():
        t = as_tf[f"var/{k}"]
        assert isinstance(t, tf.Tensor) and t.dtype == state["var"][k].dtype, k
        assert bits(t.numpy()) == bits(v), k
    with shardkit.open(tmp_path / "c") as r:
        assert r.get("var/str", framework="tensorflow").dtype == tf.string
        assert r.get_slice("var/f64", slice(1, 3), framework="tensorflow").shape == (2,)
        assert r.verify() == 2 * len(values)
    # restore in place: the same variables, their values replaced
    fresh = {k: tf.Variable(np.zeros_like(v) if v.dtype != object else
                            tf.constant([b""] * 3)) for k, v in values.items()}
    ids = {k: id(v) for k, v in fresh.items()}
    shardkit.restore_into(tmp_path / "c", {"var": fresh}, partial=True)
    for k, v in values.items():
        assert id(fresh[k]) == ids[k] and bits(fresh[k].numpy()) == bits(v), k


def test_tf_values_were_refused_and_a_device_string_gives_the_task(tf, tmp_path):
    """The issue's first failure: tf.Variables were not accepted as state."""
    with tf.device("/CPU:0"):
        v = tf.Variable([1.0, 2.0])
    shardkit.save(tmp_path / "c", {"v": v}, options=shardkit.CheckpointOptions(durable=False))
    with shardkit.open(tmp_path / "c") as r:
        assert r.info("v").device == v.device == "/job:localhost/replica:0/task:0/device:CPU:0"
    tensors = shardable_tensors({"v": v})
    assert tensors[0].device.task == 0 and tensors[0].device.device_type == "CPU"


def test_host_view_of_an_eager_tensor_is_zero_copy(tf):
    from shardkit.frameworks import to_host

    t = tf.constant(np.arange(1024, dtype=np.float32))
    a, _ = to_host(t, "t")
    b, _ = to_host(t, "t")
    assert np.shares_memory(a, b)  # both views of the tensor's own buffer
    v = tf.Variable(np.arange(4.0))
    before, _ = to_host(v, "v")
    v.assign(np.zeros(4))  # copy-on-write: the host view keeps the value it was read at
    assert before.tolist() == [0.0, 1.0, 2.0, 3.0] and to_host(v, "v")[0].tolist() == [0] * 4


def test_batched_host_arrays_fast_path_bytes_devices_and_no_copy(tf):
    """host_arrays takes exact ResourceVariables by a fast path (no dtype / device properties):
    the same bytes and device as the general path, views of the variable's buffer (two reads
    share memory: no copy), strings left to the caller, other values through the general path."""
    from shardkit.frameworks import tensorflow as sktf

    rng = np.random.default_rng(3)
    with tf.device("/CPU:0"):
        plain = [tf.Variable(rng.standard_normal((2, n)).astype(np.float32)) for n in (1, 5, 9)]
        ints = tf.Variable(np.arange(6, dtype=np.int64))
        halves = tf.Variable(np.linspace(0, 1, 7).astype(np.float16))
        text = tf.Variable([b"x", b"yz"])
    const = tf.constant([1, 2, 3], dtype=tf.int32)
    values = [*plain, ints, text, const, halves]
    assert type(plain[0]) in sktf._PLAIN_VARIABLE_TYPES
    keys = [f"k{i}" for i in range(len(values))]
    first = sktf.host_arrays(values, keys, strings=True)
    second = sktf.host_arrays(values, keys, strings=True)
    assert first[4] is None and second[4] is None  # the string variable: the caller's
    for value, got, again in zip(values, first, second):
        if got is None:
            continue
        array, device = got
        expected = value.numpy()
        assert array.dtype == expected.dtype and array.shape == expected.shape
        assert array.tobytes() == expected.tobytes()
        assert device.device_type == "CPU" and device.task == 0
        assert np.shares_memory(array, again[0])  # one buffer: no copy made by either read
    with pytest.raises(shardkit.UnsupportedDTypeError, match="'k4'"):
        sktf.host_arrays(values, keys)  # strings not taken: refused, naming the key
    assert not sktf.is_trackable(plain[0]) and not sktf.is_trackable(const)
    assert not sktf.is_trackable(np.zeros(2)) and sktf.is_trackable(tf.Module())


def _module(tf, scale=1.0):
    return module(tf, child=module(tf, w=tf.ones((2, 3)) * scale, b=tf.zeros(3) + scale),
                  step=tf.Variable(7 if scale == 1.0 else 0, dtype=tf.int64),
                  names=[b"a", b"bc"] if scale == 1.0 else [b"", b""])


def test_module_keys_and_object_graph_are_tensorflows(tf, tmp_path):
    root = _module(tf)
    prefix = tf.train.Checkpoint(model=root).write(str(tmp_path / "tf" / "ckpt"))
    shardkit.save(tmp_path / "sk", {"model": root},
                  options=shardkit.CheckpointOptions(durable=False))
    tf_keys = sorted(name for name, _ in tf.train.list_variables(prefix))
    with shardkit.open(tmp_path / "sk") as r:
        assert sorted(r.keys()) == tf_keys
        assert "model/child/w/.ATTRIBUTES/VARIABLE_VALUE" in r
        graph = r[GRAPH][()]
    assert graph == tf.train.load_checkpoint(prefix).get_tensor(GRAPH)
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    proto = trackable_object_graph_pb2.TrackableObjectGraph.FromString(graph)
    assert len(proto.nodes) > 3
    # the module as the whole state: keys as tf.train.Checkpoint(root=module) writes them
    shardkit.save(tmp_path / "root", root, options=shardkit.CheckpointOptions(durable=False))
    prefix = tf.train.Checkpoint(root).write(str(tmp_path / "tf2" / "ckpt"))
    with shardkit.open(tmp_path / "root") as r:
        assert sorted(r.keys()) == sorted(n for n, _ in tf.train.list_variables(prefix))


def test_module_restored_in_place(tf, tmp_path):
    shardkit.save(tmp_path / "c", {"model": _module(tf), "extra": np.arange(3)},
                  options=shardkit.CheckpointOptions(durable=False))
    fresh = _module(tf, scale=0.0)
    w = fresh.child.w
    status = shardkit.restore_into(tmp_path / "c", {"model": fresh, "extra": np.zeros(3, int)})
    assert fresh.child.w is w and w.numpy().tolist() == [[1.0] * 3] * 2
    assert fresh.step.numpy() == 7 and fresh.names.numpy().tolist() == [b"a", b"bc"]
    assert GRAPH not in status.unexpected_keys
    status.assert_consumed()
    # shape / dtype checks, and immutable targets
    bad = _module(tf, scale=0.0)
    bad.child.w = tf.Variable(tf.ones((3, 2)))
    with pytest.raises(RestoreMismatchError, match=r"shape \[2, 3\] dtype F32.*shape \[3, 2\]"):
        shardkit.restore_into(tmp_path / "c", {"model": bad, "extra": np.zeros(3, int)})
    bad.child.w = tf.Variable(tf.ones((2, 3), tf.float64))
    with pytest.raises(RestoreMismatchError, match="F64"):
        shardkit.restore_into(tmp_path / "c", {"model": bad, "extra": np.zeros(3, int)})
    with pytest.raises(RestoreMismatchError, match="tensors are immutable"):
        shardkit.restore_into(tmp_path / "c", {"extra": tf.constant([0, 0, 0])}, partial=True)
    with pytest.raises(IncompleteRestoreError, match="extra"):
        shardkit.restore_into(tmp_path / "c", {"model": _module(tf, 0.0)})
    with pytest.raises(InvalidArgumentError, match="collides"):
        shardkit.save(tmp_path / "x", {"model": _module(tf), "model/child": np.ones(1)})


def _keras_model(keras, seed):
    return keras_model(keras, 4, 8, 2, activation="relu", seed=seed)


@pytest.fixture(scope="module")
def trained(keras):
    model, opt = _keras_model(keras, 0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 4)).astype(np.float32)
    y = rng.standard_normal((32, 2)).astype(np.float32)
    model.fit(x, y, epochs=3, batch_size=8, verbose=0)
    return model, opt, x


def test_keras_model_trained_saved_restored_same_predictions(tf, keras, trained, tmp_path):
    model, opt, x = trained
    shardkit.save(tmp_path / "c", {"model": model, "optimizer": opt},
                  options=shardkit.CheckpointOptions(durable=False))
    prefix = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "tf" / "x"))
    with shardkit.open(tmp_path / "c") as r:
        assert sorted(r.keys()) == sorted(n for n, _ in tf.train.list_variables(prefix))
    fresh, fresh_opt = _keras_model(keras, 1)
    assert not np.allclose(fresh.predict(x, verbose=0), model.predict(x, verbose=0))
    shardkit.restore_into(tmp_path / "c", {"model": fresh, "optimizer": fresh_opt}
                          ).assert_consumed()
    assert np.array_equal(fresh.predict(x, verbose=0), model.predict(x, verbose=0))
    assert int(fresh_opt.iterations.numpy()) == int(opt.iterations.numpy()) == 12
    for a, b in zip(opt.variables, fresh_opt.variables):  # slots (Adam's m and v) too
        assert np.array_equal(a.numpy(), b.numpy())


def test_checkpoint_and_manager_track_tensorflow_objects(tf, keras, trained, tmp_path):
    model, opt, x = trained
    mod = _module(tf)
    ckpt = shardkit.Checkpoint(model=model, optimizer=opt, mod=mod, t=tf.constant([1, 2]))
    manager = shardkit.CheckpointManager(ckpt, tmp_path / "m", max_to_keep=2)
    manager.save(options=shardkit.CheckpointOptions(enable_async=True))
    ckpt.sync()
    fresh, fresh_opt = _keras_model(keras, 2)
    fresh_mod = _module(tf, 0.0)
    other = shardkit.Checkpoint(model=fresh, optimizer=fresh_opt, mod=fresh_mod,
                                t=tf.constant([0, 0]))
    other_manager = shardkit.CheckpointManager(other, tmp_path / "m", max_to_keep=2)
    other_manager.restore_or_initialize()
    assert np.array_equal(fresh.predict(x, verbose=0), model.predict(x, verbose=0))
    assert fresh_mod.names.numpy().tolist() == [b"a", b"bc"]
    assert other.t.numpy().tolist() == [1, 2] and isinstance(other.t, tf.Tensor)
    with shardkit.open(manager.latest_checkpoint) as r:
        assert "mod/child/w/.ATTRIBUTES/VARIABLE_VALUE" in r
        # the keys of tf.train.Checkpoint(model=, optimizer=, mod=): each variable once, by
        # its shortest path (the compiled model's weights are its optimizer's), no aliases
        prefix = tf.train.Checkpoint(model=model, optimizer=opt, mod=mod).save(
            str(tmp_path / "tf" / "ck"))
        assert sorted(r.keys()) == sorted(
            [n for n, _ in tf.train.list_variables(prefix)
             if n not in ("_CHECKPOINTABLE_OBJECT_GRAPH",
                          "save_counter/.ATTRIBUTES/VARIABLE_VALUE")]
            + ["save_counter", "t"])
        assert not any(k.startswith("model/") for k in r.keys()) and not r.index.aliases


def test_load_as_tensorflow_checks_the_device(tf, tmp_path):
    shardkit.save(tmp_path / "c", {"a": np.arange(3)},
                  options=shardkit.CheckpointOptions(durable=False))
    got = shardkit.load(tmp_path / "c", framework="tensorflow", device="/CPU:0")
    assert got["a"].device.endswith("CPU:0") and got["a"].numpy().tolist() == [0, 1, 2]
    with pytest.raises(InvalidArgumentError, match="TensorFlow device string"):
        shardkit.load(tmp_path / "c", framework="tensorflow", device=3)


def test_keras_model_across_formats_with_assert_consumed(tf, keras, trained, tmp_path):
    """The same trained model and optimizer, given as a mapping: written by shardkit as a
    TensorFlow checkpoint and restored by TensorFlow (assert_consumed), and written by
    TensorFlow and restored by shardkit in place."""
    model, opt, x = trained
    want = model.predict(x, verbose=0)
    shardkit.save(tmp_path / "sk", {"model": model, "optimizer": opt}, format="tensorflow")
    fresh, fresh_opt = _keras_model(keras, 3)
    tf.train.Checkpoint(model=fresh, optimizer=fresh_opt).read(
        str(tmp_path / "sk")).assert_consumed()
    assert np.array_equal(fresh.predict(x, verbose=0), want)
    prefix = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "tf" / "x"))
    other, other_opt = _keras_model(keras, 4)
    shardkit.restore_into(prefix, {"model": other, "optimizer": other_opt}).assert_consumed()
    assert np.array_equal(other.predict(x, verbose=0), want)
    assert int(other_opt.iterations.numpy()) == int(opt.iterations.numpy())
