"""complex128 (DT_COMPLEX128 <-> C128) and float8_e4m3fnuz / float8_e5m2fnuz (DT_FLOAT8_E4M3FNUZ,
DT_FLOAT8_E5M2FNUZ) in TensorFlow checkpoints, both ways, with the real TensorFlow (the `tf`
fixture of conftest.py), compared bit-exact; complex TensorFlow variables saved by shardkit in
its own format, synchronously and asynchronously."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import shardkit
from shardkit import CheckpointOptions, UnsupportedDTypeError

_PARTS = np.array([0.0, -0.0, np.nan, -np.inf, 1.5, -3.25e-300, np.inf, 5e-324], np.float64)
KEY = "v/.ATTRIBUTES/VARIABLE_VALUE"


def _complex(dtype=np.complex128) -> np.ndarray:
    """A (2, 2) complex array whose parts hold nan, -0.0, infinities and subnormals."""
    parts = _PARTS if dtype == np.complex128 else _PARTS.astype(np.float32)
    return parts.view(dtype).reshape(2, 2)


def _float8(name: str) -> np.ndarray:
    """Every bit pattern of a float8 fnuz dtype (0x80 is its only nan), as (16, 16)."""
    return np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, name)).reshape(16, 16)


def _state() -> dict[str, np.ndarray]:
    return {"c128": _complex(), "e4m3fnuz": _float8("float8_e4m3fnuz"),
            "e5m2fnuz": _float8("float8_e5m2fnuz"), "f": np.arange(3, dtype=np.float32)}


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_tensorflow_complex128_variable_is_read_bit_exact(tf, tmp_path):
    prefix = str(tmp_path / "ck")
    tf.train.Checkpoint(v=tf.Variable(_complex())).write(prefix)
    got = shardkit.load(prefix, verify=True)[KEY]
    assert _same(got, _complex())
    with shardkit.open(prefix) as r:
        assert r.info(KEY).dtype_name == "C128"
        assert _same(r.get_slice(KEY, np.s_[::-1, 1]), _complex()[::-1, 1])


def test_tensorflow_float8_fnuz_tensors_are_read_bit_exact(tf, tmp_path):
    # TensorFlow 2.21 has no variable kernels for these dtypes on the CPU: SaveV2 of tensors
    state = _state()
    prefix = str(tmp_path / "ck")
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=list(state), shape_and_slices=[""] * 4,
                      tensors=[tf.constant(v) for v in state.values()])
    got = shardkit.load(prefix, verify=True)
    assert set(got) == set(state) and all(_same(got[k], v) for k, v in state.items())


def test_saved_dtypes_are_read_by_tensorflow_bit_exact(tf, tmp_path):
    state = _state()
    prefix = str(tmp_path / "ck")
    shardkit.save(prefix, state, format="tensorflow")
    reader = tf.train.load_checkpoint(prefix)
    assert reader.get_variable_to_dtype_map() == {
        "c128": tf.complex128, "e4m3fnuz": tf.as_dtype(ml_dtypes.float8_e4m3fnuz),
        "e5m2fnuz": tf.as_dtype(ml_dtypes.float8_e5m2fnuz), "f": tf.float32}
    for k, v in state.items():
        assert _same(reader.get_tensor(k), v), k
    restored = tf.raw_ops.RestoreV2(
        prefix=prefix, tensor_names=list(state), shape_and_slices=[""] * 4,
        dtypes=[tf.as_dtype(v.dtype) for v in state.values()])
    assert all(_same(t.numpy(), v) for t, v in zip(restored, state.values()))
    # and back again: TensorFlow's reading of shardkit's bundle is shardkit's to read
    assert all(_same(shardkit.load(prefix, verify=True)[k], v) for k, v in state.items())


def test_float8_e8m0_has_no_tensorflow_datatype(tf, tmp_path):
    # TensorFlow 2.21's DataType has no float8_e8m0fnu: refused naming the key, nothing written
    with pytest.raises(UnsupportedDTypeError, match="'e': a TensorFlow checkpoint"):
        shardkit.save(tmp_path / "ck", {"e": np.ones(2, ml_dtypes.float8_e8m0fnu)},
                      format="tensorflow")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_tensorflow_values_save(tf, tmp_path, dtype):
    want = _complex(dtype)
    state = {"var": tf.Variable(want), "tensor": tf.constant(want[::-1])}
    shardkit.save(tmp_path / "sk", state, options=CheckpointOptions(durable=False))
    got = shardkit.load(tmp_path / "sk")
    assert _same(got["var"], want) and _same(got["tensor"], want[::-1])
    shardkit.save(tmp_path / "tf", state, format="tensorflow")
    reader = tf.train.load_checkpoint(str(tmp_path / "tf"))
    assert _same(reader.get_tensor("var"), want) and _same(reader.get_tensor("tensor"),
                                                            want[::-1])
    # restore_into writes into the variable in place
    target = {"var": tf.Variable(np.zeros_like(want))}
    shardkit.restore_into(tmp_path / "sk", target, partial=True)
    assert _same(target["var"].numpy(), want)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_tensorflow_variables_save_asynchronously(tf, tmp_path, dtype):
    # the async snapshot copies each value through frameworks.to_host, which refused complex
    want = _complex(dtype)
    ckpt = shardkit.Checkpoint(state={"v": tf.Variable(want)})
    handle = ckpt.save(tmp_path / "ck", options=CheckpointOptions(enable_async=True,
                                                                   durable=False))
    path = handle.result()
    assert _same(shardkit.load(path)["state/v"], want)
