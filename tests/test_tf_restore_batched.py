"""restore_into of many TensorFlow variables: read in bulk and assigned in batches on a few
threads (`frameworks.tensorflow.assign_all`), still in place, bit-exact, checked first."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from tfhelpers import bits

import shardkit
from shardkit.errors import RestoreMismatchError


def _values(count: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    kinds = [np.float32, ml_dtypes.bfloat16, np.int64, np.bool_, np.float16, np.uint8]
    out = {}
    for i in range(count):
        kind = kinds[i % len(kinds)]
        shape = [(), (3,), (2, i % 5 + 1), (0, 2)][i % 4]
        a = rng.standard_normal(shape) * 100
        out[f"v{i:04d}"] = (a > 0) if kind is np.bool_ else a.astype(kind)
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_many_variables_saved_and_restored_in_place_bit_exact(tf, tmp_path, monkeypatch,
                                                              threads):
    """More variables than two batches (READ_BATCH), six dtypes, read and assigned one batch
    after the other or on threads: every one assigned, each the same object (and the same
    resource) as before."""
    from shardkit.frameworks import tensorflow as tfw

    monkeypatch.setattr(tfw, "TF_THREADS", threads)

    values = _values(2 * tfw.READ_BATCH + 50)
    shardkit.save(tmp_path / "c", {k: tf.Variable(v) for k, v in values.items()},
                  options=shardkit.CheckpointOptions(durable=False))
    stored = shardkit.load(tmp_path / "c")
    assert all(bits(stored[k]) == bits(v) for k, v in values.items())
    fresh = {k: tf.Variable(np.zeros_like(v)) for k, v in values.items()}
    ids = {k: id(v) for k, v in fresh.items()}
    handles = {k: v.handle for k, v in fresh.items()}
    status = shardkit.restore_into(tmp_path / "c", fresh)
    status.assert_consumed()
    for k, v in values.items():
        assert id(fresh[k]) == ids[k] and fresh[k].handle is handles[k], k
        assert bits(fresh[k].numpy()) == bits(v), k


def test_other_variable_types_and_a_single_assign(tf, keras, tmp_path):
    from shardkit.frameworks import tensorflow as tfw

    values = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(3)}
    shardkit.save(tmp_path / "c", values, options=shardkit.CheckpointOptions(durable=False))
    kv = keras.Variable(np.zeros((2, 3), np.float32))
    plain = tf.Variable(np.zeros(3, np.int64))
    shardkit.restore_into(tmp_path / "c", {"a": kv, "b": plain})
    assert np.asarray(kv).tolist() == values["a"].tolist() and plain.numpy().tolist() == [0, 1, 2]
    tfw.Assign(plain)(np.array([7, 8, 9]))  # one assign alone: the same batch path
    assert plain.numpy().tolist() == [7, 8, 9]
    seen = []
    tfw.assign_all([(seen.append, np.ones(1))])  # any other callable: called with the array
    assert seen[0].tolist() == [1.0]


def test_a_mismatch_is_found_before_any_variable_changes(tf, tmp_path):
    values = _values(40)
    shardkit.save(tmp_path / "c", values, options=shardkit.CheckpointOptions(durable=False))
    fresh = {k: tf.Variable(np.zeros_like(v)) for k, v in values.items()}
    last = sorted(fresh)[-1]
    fresh[last] = tf.Variable(np.zeros((7,), values[last].dtype))  # the wrong shape
    with pytest.raises(RestoreMismatchError, match=last):
        shardkit.restore_into(tmp_path / "c", fresh)
    assert all(not np.asarray(v.numpy(), np.float64).any() for v in fresh.values())
    fresh[last] = tf.Variable(np.zeros(values[last].shape, np.float64))  # the wrong dtype
    with pytest.raises(RestoreMismatchError, match=last):
        shardkit.restore_into(tmp_path / "c", fresh)
    assert all(not np.asarray(v.numpy(), np.float64).any() for v in fresh.values())
