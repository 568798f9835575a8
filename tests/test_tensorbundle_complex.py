"""complex64 variables in TensorFlow checkpoints (TensorBundle's DT_COMPLEX64), both ways, with
the real TensorFlow (the `tf` fixture of conftest.py); compared bit-exact, nan and -0.0 parts
included."""

from __future__ import annotations

import numpy as np

import shardkit

_PARTS = np.array([0.0, -0.0, np.nan, -np.inf, 1.5, -3.25e-30, np.inf, 7.0], np.float32)


def _values() -> np.ndarray:
    """A (2, 2) complex64 array whose real and imaginary parts hold nan, -0.0 and infinities."""
    return _PARTS.view(np.complex64).reshape(2, 2)


def test_tensorflow_complex64_variable_is_read_bit_exact(tf, tmp_path):
    want = _values()
    prefix = str(tmp_path / "ck")
    tf.train.Checkpoint(v=tf.Variable(want)).write(prefix)
    got = shardkit.load(prefix)["v/.ATTRIBUTES/VARIABLE_VALUE"]
    assert got.dtype == np.complex64 and got.shape == (2, 2)
    assert got.tobytes() == want.tobytes()


def test_saved_complex64_is_read_by_tensorflow_bit_exact(tf, tmp_path):
    want = _values()
    prefix = str(tmp_path / "ck")
    shardkit.save(prefix, {"c": want, "f": np.arange(3, dtype=np.float32)}, format="tensorflow")
    reader = tf.train.load_checkpoint(prefix)
    assert reader.get_variable_to_dtype_map()["c"] == tf.complex64
    got = reader.get_tensor("c")
    assert got.dtype == np.complex64 and got.tobytes() == want.tobytes()
    assert reader.get_tensor("f").tobytes() == np.arange(3, dtype=np.float32).tobytes()
