"""The callback contract: TF's documented callback runs unchanged; every rule is enforced."""

import numpy as np
import pytest

from shardkit.errors import ShardingValidationError
from shardkit.sharding.callback import ShardingCallback, shard_tensors, validate_shards
from shardkit.sharding.tensors import shardable_tensors
from shardkit.values.devices import DeviceSpec

DESC = "test policy"


class AllInOnePolicy(ShardingCallback):
    """TensorFlow's documentation example, unchanged except `set_default` -> `setdefault`."""

    @property
    def description(self):
        return "Place all tensors in a single shard."

    def __call__(self, shardable_tensors):
        tensors = {}
        for shardable_tensor in shardable_tensors:
            tensor = shardable_tensor.tensor_save_spec.tensor
            checkpoint_key = shardable_tensor.checkpoint_key
            slice_spec = shardable_tensor.slice_spec
            tensors.setdefault(checkpoint_key, {})[slice_spec] = tensor
        return [tensors]


@pytest.fixture
def tensors():
    return shardable_tensors(
        {"a": np.arange(24, dtype=np.float32).reshape(4, 6), "b": np.arange(3, dtype=np.int64)}
    )


def whole(ts):
    return {t.checkpoint_key: {"": t.tensor} for t in ts}


def expect(rule, key, spec, expected, found, fn, *args):
    with pytest.raises(ShardingValidationError) as info:
        fn(*args)
    msg = str(info.value)
    assert f"rule {rule!r}" in msg
    assert f"callback: {DESC}\n" in msg
    assert f"key: {key!r}, slice spec: {spec!r}" in msg
    assert f"expected: {expected}" in msg
    assert f"found: {found}" in msg
    return msg


def test_tf_documentation_callback_runs_unchanged(tensors):
    shards = shard_tensors(AllInOnePolicy(), tensors)
    assert len(shards) == 1
    task, shard = shards[0]
    assert task == 0 and list(shard) == ["a", "b"]
    assert shard["a"][""] is tensors[0].tensor


def test_error_is_runtime_error_like_tf():
    assert issubclass(ShardingValidationError, RuntimeError)


def test_valid_whole_and_copied_tensors_pass(tensors):
    validate_shards([whole(tensors)], tensors, DESC)
    copies = [{t.checkpoint_key: {"": t.tensor.copy()}} for t in tensors]
    validate_shards(copies, tensors, DESC)


def test_removed(tensors):
    expect("no tensor removed", "b", "", "the tensor in one shard (whole or as slices)",
           "it is in no shard", validate_shards, [{"a": {"": tensors[0].tensor}}], tensors, DESC)


def test_added(tensors):
    shards = [whole(tensors) | {"c": {"": np.ones(1)}}]
    expect("no tensor added", "c", "", "only keys given to the callback",
           "a key the callback was not given", validate_shards, shards, tensors, DESC)


def test_slice_outside_the_tensor_is_added(tensors):
    shards = [{"a": {"5 6 0,5:0,6": np.zeros((5, 6), np.float32)}, "b": {"": tensors[1].tensor}}]
    expect("no tensor added", "a", "5 6 0,5:0,6",
           "slices inside the given tensor of full shape [4, 6]",
           "a slice of full shape [5, 6]", validate_shards, shards, tensors, DESC)


def test_reshaped(tensors):
    shards = [{"a": {"": tensors[0].tensor.reshape(6, 4)}, "b": {"": tensors[1].tensor}}]
    expect("no shape change", "a", "", "shape [4, 6]", "shape [6, 4]",
           validate_shards, shards, tensors, DESC)


def test_retyped(tensors):
    shards = [{"a": {"": tensors[0].tensor}, "b": {"": tensors[1].tensor.astype(np.int32)}}]
    expect("no dtype change", "b", "", "dtype int64", "dtype int32",
           validate_shards, shards, tensors, DESC)


def test_changed_values(tensors):
    shards = [{"a": {"": tensors[0].tensor + 1}, "b": {"": tensors[1].tensor}}]
    expect("slices hold the original's data", "a", "",
           "the original's values in that region (a view of it, or an equal copy)",
           "different values", validate_shards, shards, tensors, DESC)


def test_duplicated(tensors):
    shards = [whole(tensors), {"b": {"": tensors[1].tensor}}]
    expect("no tensor duplicated", "b", "", "each (key, slice) in exactly one shard",
           "a second copy in shard 1", validate_shards, shards, tensors, DESC)


def test_whole_and_split_at_once(tensors):
    a = tensors[0].tensor
    shards = [whole(tensors), {"a": {"4 6 0,4:0,6": a[0:4]}}]
    expect("no tensor duplicated", "a", "4 6 0,4:0,6", "a tensor either whole or split into slices",
           "both whole (slice spec '') and as slices", validate_shards, shards, tensors, DESC)


def test_task_change():
    ts = shardable_tensors({"a": np.ones(2)}, device="/job:w/task:0")
    moved = ts[0].tensor_save_spec
    moved = type(moved)(moved.tensor, moved.name, moved.slice_spec, moved.dtype,
                        DeviceSpec.from_string("/job:w/task:1"))
    validate_shards([{"a": {"": ts[0].tensor_save_spec}}], ts, DESC)
    expect("no task change", "a", "", "task 0", "task 1",
           validate_shards, [{"a": {"": moved}}], ts, DESC)


def test_one_task_per_shard():
    ts = shardable_tensors({"a": np.ones(2), "b": np.ones(2)},
                           device=lambda k: f"/job:w/task:{0 if k == 'a' else 1}")
    validate_shards([{"a": {"": ts[0].tensor}}, {"b": {"": ts[1].tensor}}], ts, DESC)
    expect("all tensors of a shard from one task", "b", "", "task 0 (of the shard's first tensor)",
           "task 1 in shard 0", validate_shards, [whole(ts)], ts, DESC)


def test_valid_split_views_and_copies(tensors):
    a = tensors[0].tensor
    shards = [
        {"a": {"4 6 0,2:0,6": a[0:2], "4 6 2,2:0,3": a[2:4, 0:3].copy()}},
        {"a": {"4 6 2,2:3,3": a[2:4, 3:6]}, "b": {"": tensors[1].tensor}},
    ]
    validate_shards(shards, tensors, DESC)


def test_split_with_gap(tensors):
    a = tensors[0].tensor
    shards = [{"a": {"4 6 0,2:0,6": a[0:2]}, "b": {"": tensors[1].tensor}}]
    msg = expect("split tensors tile the original exactly", "a", "4 6 0,2:0,6",
                 "slices covering shape [4, 6] exactly once", "slices cover 12 of the 24",
                 validate_shards, shards, tensors, DESC)
    assert "gap" in msg


def test_split_with_overlap(tensors):
    a = tensors[0].tensor
    shards = [{"a": {"4 6 0,3:0,6": a[0:3], "4 6 2,2:0,6": a[2:4]}, "b": {"": tensors[1].tensor}}]
    msg = expect("split tensors tile the original exactly", "a", "4 6 0,3:0,6, 4 6 2,2:0,6",
                 "slices covering shape [4, 6] exactly once", "slices '4 6 0,3:0,6' and",
                 validate_shards, shards, tensors, DESC)
    assert "overlap" in msg


def test_split_slice_with_wrong_data_or_shape(tensors):
    a = tensors[0].tensor
    wrong = [{"a": {"4 6 0,2:0,6": a[2:4], "4 6 2,2:0,6": a[2:4]}, "b": {"": tensors[1].tensor}}]
    expect("slices hold the original's data", "a", "4 6 0,2:0,6",
           "the original's values in that region (a view of it, or an equal copy)",
           "different values", validate_shards, wrong, tensors, DESC)
    b = tensors[1].tensor
    bad_shape = [{"a": {"4 6 0,2:0,6": a[0:3], "4 6 2,2:0,6": a[2:4]}, "b": {"": b}}]
    expect("no shape change", "a", "4 6 0,2:0,6", "shape [2, 6]", "shape [3, 6]",
           validate_shards, bad_shape, tensors, DESC)


def test_malformed_slice_spec(tensors):
    shards = [{"a": {"4 6 0,2": tensors[0].tensor[:2]}, "b": {"": tensors[1].tensor}}]
    expect("slice specs are well formed", "a", "4 6 0,2",
           "TensorFlow slice spec text, e.g. '4 6 2,2:0,6'", "malformed slice spec",
           validate_shards, shards, tensors, DESC)


def test_shards_must_be_mappings(tensors):
    expect("each shard is a mapping", "<shard 0>", "",
           "a mapping checkpoint_key -> slice_spec -> tensor", "list",
           validate_shards, [[1, 2]], tensors, DESC)
    expect("each shard is a mapping", "a", "", "a mapping slice_spec -> tensor", "ndarray",
           validate_shards, [{"a": tensors[0].tensor}], tensors, DESC)


def test_input_slices_can_be_split_further():
    """A ShardableTensor that is itself a slice: pieces are relative to the full tensor."""
    full = np.arange(16, dtype=np.int32).reshape(4, 4)
    (base,) = shardable_tensors({"w": full[2:4]})
    part = type(base)(base.tensor, base.dtype, base.device, "w", (2, 4), "4 4 2,2:0,4", "w")
    ok = [{"w": {"4 4 2,1:0,4": full[2:3]}}, {"w": {"4 4 3,1:0,4": full[3:4]}}]
    validate_shards(ok, [part], DESC)
    expect("no tensor removed", "w", "4 4 2,2:0,4", "the tensor in one shard (whole or as slices)",
           "it is in no shard", validate_shards, [], [part], DESC)


class Broken(ShardingCallback):
    def __init__(self, result):
        self.result = result

    @property
    def description(self):
        return DESC

    def __call__(self, shardable_tensors):
        return self.result


def test_shard_tensors_runs_once_per_task_and_validates():
    ts = shardable_tensors({"a": np.ones(2), "b": np.ones(3), "c": np.ones(1)},
                           device=lambda k: f"/task:{1 if k == 'b' else 0}")
    calls = []

    class PerTask(ShardingCallback):
        description = "per task"

        def __call__(self, group):
            calls.append([t.checkpoint_key for t in group])
            return [{t.checkpoint_key: {"": t.tensor}} for t in group] + [{}]

    out = shard_tensors(PerTask(), ts)
    assert calls == [["a", "c"], ["b"]]
    assert [(task, list(shard)) for task, shard in out] == [(0, ["a"]), (0, ["c"]), (1, ["b"])]
    with pytest.raises(ShardingValidationError, match="'returns a sequence of shards'"):
        shard_tensors(Broken({"a": {}}), ts)
    with pytest.raises(ShardingValidationError, match="no tensor removed"):
        shard_tensors(Broken([]), ts)


def test_hash_uses_description_and_plain_attributes():
    class Sized(ShardingCallback):
        def __init__(self, size):
            self.size = size
            self.fn = print  # callables are ignored

        @property
        def description(self):
            return "sized"

        def __call__(self, shardable_tensors):
            return []

    assert hash(Sized(3)) == hash(Sized(3))
    assert hash(Sized(3)) != hash(Sized(4))
    with pytest.raises(TypeError):
        ShardingCallback()  # type: ignore[abstract]


def test_duplicate_copy_then_original_is_caught(tensors):
    """A copy in one shard and the very array in a later one: still a duplicate, either order."""
    a, b = (t.tensor for t in tensors)
    for shards in ([{"a": {"": a.copy()}}, {"a": {"": a}, "b": {"": b}}],
                   [{"a": {"": a}}, {"a": {"": a.copy()}, "b": {"": b}}]):
        expect("no tensor duplicated", "a", "", "each (key, slice) in exactly one shard",
               "a second copy in shard 1", validate_shards, shards, tensors, DESC)
