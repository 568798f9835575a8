"""TensorFlow's sharding callbacks in shardkit, and shardkit's in TensorFlow.

TensorFlow's own policies (MaxShardSizePolicy, ShardByTaskPolicy) and subclasses of
tf.train.experimental.ShardingCallback run inside shardkit.save on TensorFlow's own
ShardableTensors; the cases of TensorFlow's sharding_policies_test.py / sharding_util_test.py
(MaxShardSizePolicy 1-D and 2-D, ShardByTaskPolicy, every validate_shards rule) are ported here
and run through shardkit, matching TensorFlow's error wording. The reverse adapter lets
TensorFlow's Checkpoint.write use shardkit's policies.
"""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest
from tfhelpers import module

import shardkit
from shardkit.errors import InvalidArgumentTypeError, ShardingValidationError
from shardkit.sharding.tensors import shardable_tensors

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("tensorflow is not installed (optional)", allow_module_level=True)

V0 = "v0/.ATTRIBUTES/VARIABLE_VALUE"
V1 = "v1/.ATTRIBUTES/VARIABLE_VALUE"


@pytest.fixture(scope="module")
def policies(tf):
    from tensorflow.python.checkpoint.sharding import sharding_policies

    return sharding_policies


def _save_split(path, state, callback):
    with warnings.catch_warnings():  # TensorFlow's policies store slices: expected here
        warnings.simplefilter("ignore", shardkit.SplitTensorsWarning)
        shardkit.save(path, state,
                      options=shardkit.CheckpointOptions(experimental_sharding_callback=callback,
                                                         durable=False))


def _layout(path):
    """[(shard, key, spec, values)] of every stored slice, shard by shard."""
    out = []
    with shardkit.open(path) as r:
        for key in r.keys():
            if key.startswith("_"):
                continue
            full = r[key]
            for s in r.info(key).slices:
                box = shardkit.SliceSpec.parse(s.spec, full.shape) if s.spec else None
                values = full if box is None else full[box.to_index()]
                out.append((s.shard, key, s.spec, values.tolist()))
    return sorted(out, key=lambda x: x[0])


def _shard_keys(layout):
    shards: dict[int, set[str]] = {}
    for shard, key, _, _ in layout:
        shards.setdefault(shard, set()).add(key)
    return [shards[i] for i in sorted(shards)]


def test_tensorflow_policies_are_accepted_was_a_type_error(tf, policies, tmp_path):
    """The issue's failure: ``TypeError: experimental_sharding_callback must be a
    shardkit.ShardingCallback``."""
    state = {"w": tf.Variable([1.0, 2.0])}
    for cb in (policies.MaxShardSizePolicy(max_shard_size=4), policies.ShardByTaskPolicy()):
        opts = shardkit.CheckpointOptions(experimental_sharding_callback=cb)
        _save_split(tmp_path / type(cb).__name__, state, cb)
        assert opts.experimental_sharding_callback is cb
        assert shardkit.load(tmp_path / type(cb).__name__)["w"].tolist() == [1.0, 2.0]


@pytest.fixture(scope="module")
def root_1d(tf):
    return module(tf, v0=tf.Variable([0.0, 1.0, 2.0, 3.0], dtype=tf.float32),
                  v1=tf.Variable([[4], [5], [6], [7]], dtype=tf.int32))


# TensorFlow's test_MaxShardSizePolicy_1D: max_shard_size -> (slice specs of v0, of v1), one
# shard each in that order (TensorFlow's object-graph shard aside: shardkit stores strings apart)
CASES_1D = {
    4: (["4 0,1", "4 1,1", "4 2,1", "4 3,1"],
        ["4 1 0,1:0,1", "4 1 1,1:0,1", "4 1 2,1:0,1", "4 1 3,1:0,1"]),
    8: (["4 0,2", "4 2,2"], ["4 1 0,2:0,1", "4 1 2,2:0,1"]),
    10: (["4 0,2", "4 2,2"], ["4 1 0,2:0,1", "4 1 2,2:0,1"]),
    16: (["4 0,4"], ["4 1 0,4:0,1"]),
    18: (["4 0,4"], ["4 1 0,4:0,1"]),
}


@pytest.mark.parametrize("size", sorted(CASES_1D))
def test_max_shard_size_policy_1d(policies, root_1d, tmp_path, size):
    _save_split(tmp_path / "c", root_1d, policies.MaxShardSizePolicy(max_shard_size=size))
    layout = _layout(tmp_path / "c")
    v0_specs, v1_specs = CASES_1D[size]
    assert _shard_keys(layout) == [{V0}] * len(v0_specs) + [{V1}] * len(v1_specs)
    assert [spec for _, key, spec, _ in layout if key == V0] == v0_specs
    assert [spec for _, key, spec, _ in layout if key == V1] == v1_specs
    values = [v for _, key, _, v in layout if key == V0]
    per = 4 // len(v0_specs)
    assert values == [[float(x) for x in range(i, i + per)] for i in range(0, 4, per)]
    got = shardkit.load(tmp_path / "c")
    assert got[V0].tolist() == [0.0, 1.0, 2.0, 3.0] and got[V1].ravel().tolist() == [4, 5, 6, 7]


@pytest.fixture(scope="module")
def root_2d(tf):
    return module(tf, v0=[[0, 1], [2, 3], [4, 5]],
                  v1=[[[6.0], [7.0]], [[8.0], [9.0]], [[10.0], [11.0]]])


# TensorFlow's test_MaxShardSizePolicy_2D: size -> shard keys, and the stored slices
CASES_2D = {
    8: ([{V0}] * 3 + [{V1}] * 3,
        [(V0, "3 2 0,1:0,2", [[0, 1]]), (V0, "3 2 1,1:0,2", [[2, 3]]),
         (V0, "3 2 2,1:0,2", [[4, 5]]), (V1, "3 2 1 0,1:0,2:0,1", [[[6.0], [7.0]]]),
         (V1, "3 2 1 1,1:0,2:0,1", [[[8.0], [9.0]]]),
         (V1, "3 2 1 2,1:0,2:0,1", [[[10.0], [11.0]]])]),
    12: ([{V0}] * 2 + [{V1}] * 2,
         [(V0, "3 2 0,3:0,1", [[0], [2], [4]]), (V0, "3 2 0,3:1,1", [[1], [3], [5]]),
          (V1, "3 2 1 0,3:0,1:0,1", [[[6.0]], [[8.0]], [[10.0]]]),
          (V1, "3 2 1 0,3:1,1:0,1", [[[7.0]], [[9.0]], [[11.0]]])]),
    16: ([{V0}, {V0, V1}, {V1}],
         [(V0, "3 2 0,2:0,2", [[0, 1], [2, 3]]), (V0, "3 2 2,1:0,2", [[4, 5]]),
          (V1, "3 2 1 0,1:0,2:0,1", [[[6.0], [7.0]]]),
          (V1, "3 2 1 1,2:0,2:0,1", [[[8.0], [9.0]], [[10.0], [11.0]]])]),
}
CASES_2D[10] = CASES_2D[8]


@pytest.mark.parametrize("size", sorted(CASES_2D))
def test_max_shard_size_policy_2d(policies, root_2d, tmp_path, size):
    _save_split(tmp_path / "c", root_2d, policies.MaxShardSizePolicy(max_shard_size=size))
    layout = _layout(tmp_path / "c")
    keys, slices = CASES_2D[size]
    assert _shard_keys(layout) == keys
    assert sorted((k, s, v) for _, k, s, v in layout) == sorted(slices)
    with shardkit.open(tmp_path / "c") as r:
        assert r.verify() == len(slices) + 1  # and the object graph
        assert r[V1].tolist() == root_2d.v1.numpy().tolist()


def test_string_variables_are_stored_apart_from_the_callback(tf, policies, tmp_path):
    """TensorFlow's test_MaxShardSizePolicy_Strings / _LargeScalar: shardkit keeps string
    tensors in its string file, so the callback sees only the numeric ones and the strings
    come back whole."""
    root = module(tf, v0=[b"ABCDEFGHIJ", b"0123456789", b"KLMNOPQRST", b"9876543210"],
                  v1=b"0123456789", v2=[1.0, 2.0])
    seen = []

    class Recording(policies.MaxShardSizePolicy):
        def __call__(self, tensors):
            seen.extend(t.checkpoint_key for t in tensors)
            return super().__call__(tensors)

    _save_split(tmp_path / "c", root, Recording(max_shard_size=4))
    assert seen == ["v2/.ATTRIBUTES/VARIABLE_VALUE"]
    got = shardkit.load(tmp_path / "c", framework="tensorflow")
    assert got[V0].numpy().tolist() == root.v0.numpy().tolist()
    assert got[V1].numpy() == b"0123456789" and got[V1].dtype == tf.string


def test_shard_by_task_policy_groups_by_task(tf, policies):
    """TensorFlow's test_ShardByTaskPolicy: one shard per task (tasks given by device)."""
    from shardkit.sharding.callback import shard_tensors

    state = {f"v{i}": np.array(float(i), np.float32) for i in range(3)}
    tensors = shardable_tensors(
        state, device=lambda key: f"/job:worker/replica:0/task:{key[1]}/device:CPU:0")
    shards = shard_tensors(policies.ShardByTaskPolicy(), tensors)
    assert [(task, list(shard)) for task, shard in shards] == [
        (0, ["v0"]), (1, ["v1"]), (2, ["v2"])]
    for (_, shard), t in zip(shards, tensors):
        assert shard[t.checkpoint_key][""] is t.tensor  # handed back unchanged: no copy


def test_callback_receives_tensorflow_types(tf, tmp_path):
    from tensorflow.python.checkpoint.sharding import sharding_util
    from tensorflow.python.training.saving import saveable_object

    got = []

    class Inspecting(tf.train.experimental.ShardingCallback):
        @property
        def description(self):
            return "inspecting"

        def __call__(self, shardable_tensors):
            got.extend(shardable_tensors)
            return [{t.checkpoint_key: {t.slice_spec: t.tensor} for t in shardable_tensors}]

    w = tf.Variable(tf.ones((2, 3), tf.bfloat16))
    shardkit.save(tmp_path / "c", {"w": w, "n": np.arange(3)},
                  options=shardkit.CheckpointOptions(experimental_sharding_callback=Inspecting(),
                                                     durable=False))
    assert [t.checkpoint_key for t in got] == ["w", "n"]
    t = got[0]
    assert isinstance(t, sharding_util.ShardableTensor)
    assert isinstance(t.tensor, tf.Tensor) and t.dtype == tf.bfloat16
    assert isinstance(t.dtype, tf.DType) and isinstance(t.shape, tf.TensorShape)
    assert t.shape == (2, 3) and isinstance(t.device, tf.DeviceSpec)
    assert t.device.task == 0 and t.device.device_type == "CPU"
    assert isinstance(t._tensor_save_spec, saveable_object.SaveSpec)
    assert t._tensor_save_spec.name == "w" and t.slice_spec == ""
    assert got[1].dtype == tf.int64
    with shardkit.open(tmp_path / "c") as r:
        assert r.metadata == {} and "inspecting" in r.index.callback
        assert np.array_equal(r["w"], w.numpy())


def test_any_object_honouring_the_contract(tmp_path):
    class Duck:
        description = "duck-typed: all in one shard"

        def __call__(self, tensors):
            return [{t.checkpoint_key: {t.slice_spec: t.tensor} for t in tensors}]

    shardkit.save(tmp_path / "c", {"a": np.ones(2), "b": np.zeros(3)},
                  options=shardkit.CheckpointOptions(experimental_sharding_callback=Duck(),
                                                     durable=False))
    assert set(shardkit.load(tmp_path / "c")) == {"a", "b"}
    for bad in (lambda ts: [], object(), Duck):
        with pytest.raises(InvalidArgumentTypeError, match="description property and __call__"):
            shardkit.CheckpointOptions(experimental_sharding_callback=bad)


# --- TensorFlow's sharding_util_test.py validate_shards cases ---------------------------------


def _tf_callback(tf, description, fn):
    class Callback(tf.train.experimental.ShardingCallback):
        @property
        def description(self):
            return description

        def __call__(self, shardable_tensors):
            return fn(shardable_tensors)

    return Callback()


def _rule_cases(tf):
    from tensorflow.python.training.saving import saveable_object

    def dup(ts):
        t = ts[0]
        return [{t.checkpoint_key: {t.slice_spec: t.tensor}}] * 2 + [
            {u.checkpoint_key: {u.slice_spec: u.tensor}} for u in ts[1:]]

    def added(ts):
        return [{t.checkpoint_key: {t.slice_spec: t.tensor} for t in ts},
                {"ADDED_TENSOR_ABC123": {"": tf.constant(1.0)}}]

    def change(how):
        def fn(ts):
            return [{t.checkpoint_key: {t.slice_spec: how(t) if t.checkpoint_key == "v0"
                                        else t.tensor}} for t in ts]
        return fn

    def other_task(t):
        return saveable_object.SaveSpec(t.tensor, t.slice_spec, t.name, t.dtype,
                                        "/job:worker/replica:0/task:1/device:CPU:0")

    return {
        "multiple tensors with the same checkpoint key and slice spec were found": dup,
        "a tensor not originally in the object graph": added,
        "a tensor was found with an altered shape": change(lambda t: tf.transpose(t.tensor)),
        "a tensor was found with an altered dtype": change(lambda t: tf.cast(t.tensor,
                                                                             tf.int32)),
        "a tensor was found with an altered task": change(other_task),
        "tensors in the object graph were not found": lambda ts: [],
    }


@pytest.mark.parametrize("phrase", [
    "multiple tensors with the same checkpoint key and slice spec were found",
    "a tensor not originally in the object graph",
    "a tensor was found with an altered shape",
    "a tensor was found with an altered dtype",
    "a tensor was found with an altered task",
    "tensors in the object graph were not found",
])
def test_validation_uses_tensorflows_wording(tf, tmp_path, phrase):
    cb = _tf_callback(tf, "rule breaker", _rule_cases(tf)[phrase])
    state = {"v0": tf.Variable([[0.0, 1.0]]), "v1": tf.Variable(1.0)}
    shardkit.save(tmp_path / "old", {"kept": np.ones(1)},
                  options=shardkit.CheckpointOptions(durable=False))
    with pytest.raises(ShardingValidationError, match=phrase) as e:
        shardkit.save(tmp_path / "old", state,
                      options=shardkit.CheckpointOptions(experimental_sharding_callback=cb,
                                                         durable=False), overwrite=True)
    assert isinstance(e.value, RuntimeError) and "rule breaker" in str(e.value)
    assert set(shardkit.load(tmp_path / "old")) == {"kept"}  # the earlier checkpoint stays


def test_tensors_with_different_tasks_in_one_shard(tf):
    """TensorFlow's test_validate_shards_different_tasks: a callback given tensors of two
    tasks at once (shardkit itself calls it per task) that puts them in one shard."""
    from shardkit.sharding.tf_sharding import run_tensorflow_callback

    tensors = shardable_tensors(
        {"v0": np.zeros(()), "v1": np.ones(())},
        device=lambda key: f"/job:worker/replica:0/task:{key[1]}/device:CPU:0")
    cb = _tf_callback(tf, "different tasks callback", lambda ts: [
        {t.checkpoint_key: {t.slice_spec: t.tensor} for t in ts}])
    shards = run_tensorflow_callback(cb, tensors)
    with pytest.raises(ShardingValidationError, match="tensors with different tasks were found"):
        shardkit.validate_shards(shards, tensors, cb.description)


# --- shardkit's callbacks in TensorFlow's saver --------------------------------------------------


@pytest.mark.parametrize("policy, files", [
    (shardkit.MaxShardSizePolicy(max_shard_size=16), 4),
    (shardkit.BinPackPolicy(max_shard_size=24), 3),
])
def test_shardkit_policy_in_tensorflow_checkpoint_write(tf, root_2d, tmp_path, policy, files):
    prefix = tf.train.Checkpoint(root_2d).write(
        str(tmp_path / "tf" / "ckpt"),
        options=tf.train.CheckpointOptions(
            experimental_sharding_callback=shardkit.as_tensorflow_callback(policy)))
    data = sorted(p.name for p in (tmp_path / "tf").iterdir() if ".data-" in p.name)
    assert len(data) == files
    fresh = module(tf, v0=tf.zeros((3, 2), tf.int32), v1=tf.zeros((3, 2, 1)))
    tf.train.Checkpoint(fresh).read(prefix).assert_consumed()
    assert fresh.v0.numpy().tolist() == root_2d.v0.numpy().tolist()
    assert fresh.v1.numpy().tolist() == root_2d.v1.numpy().tolist()
    reader = tf.train.load_checkpoint(prefix)
    assert reader.get_tensor(V1).tolist() == root_2d.v1.numpy().tolist()


def test_as_tensorflow_callback_refuses_other_things(tf):
    with pytest.raises(InvalidArgumentTypeError, match=r"takes a shardkit\.ShardingCallback"):
        shardkit.as_tensorflow_callback(object())
    cb = shardkit.as_tensorflow_callback(shardkit.AllInOnePolicy())
    assert isinstance(cb, tf.train.experimental.ShardingCallback)
    assert cb.description == shardkit.AllInOnePolicy().description
