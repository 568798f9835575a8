import ml_dtypes
import numpy as np
import pytest

from shardkit.errors import UnsupportedDTypeError
from shardkit.sharding.tensors import ShardableTensor, flatten, shardable_tensors, unflatten
from shardkit.values.devices import DeviceSpec


def test_nested_keys_are_joined_in_order():
    a, b, c = np.arange(3), np.ones((2, 2), np.float32), np.zeros(0, np.int8)
    ts = shardable_tensors({"model": {"layer0": {"kernel": a, "bias": b}}, "step": c})
    assert [t.checkpoint_key for t in ts] == ["model/layer0/kernel", "model/layer0/bias", "step"]
    t = ts[1]
    assert t.tensor is b  # zero copy
    assert (t.dtype, t.shape, t.slice_spec, t.name) == (b.dtype, (2, 2), "", "model/layer0/bias")
    assert t.device == DeviceSpec.from_string("/job:localhost/replica:0/task:0/device:CPU:0")
    assert t.task == 0 and t.nbytes == 16


def test_tensor_save_spec_mirrors_tf():
    (t,) = shardable_tensors({"w": np.ones(3)})
    spec = t.tensor_save_spec
    assert spec.tensor is t.tensor
    assert (spec.name, spec.slice_spec, spec.dtype, spec.device) == ("w", "", t.dtype, t.device)


def test_scalars_lists_and_int_keys():
    ts = shardable_tensors({"lr": 0.1, "step": 7, "flag": True, "opt": {0: [np.ones(1), 2]}})
    by_key = {t.checkpoint_key: t for t in ts}
    assert by_key["lr"].dtype == np.float64 and by_key["lr"].shape == ()
    assert by_key["step"].dtype == np.int64
    assert by_key["flag"].dtype == np.bool_
    assert set(by_key) == {"lr", "step", "flag", "opt/0/0", "opt/0/1"}


def test_device_override():
    ts = shardable_tensors({"a": np.ones(1), "b": np.ones(1)},
                           device=lambda k: "/job:w/task:1" if k == "b" else "/job:w/task:0")
    assert [t.task for t in ts] == [0, 1]
    (t,) = shardable_tensors({"a": np.ones(1)}, device="/job:w/replica:0/task:3/device:GPU:1")
    assert t.task == 3 and t.device.device_type == "GPU"


def test_ml_dtypes_and_big_endian():
    bf = np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16)
    big = np.arange(3, dtype=">i4")
    by_key = {t.checkpoint_key: t for t in shardable_tensors({"bf": bf, "big": big})}
    assert by_key["bf"].tensor is bf
    assert by_key["big"].dtype == np.dtype("<i4")
    assert by_key["big"].tensor.tolist() == [0, 1, 2]


def test_unsupported_dtypes_name_the_key():
    with pytest.raises(UnsupportedDTypeError, match=r"'m/c'.*complex"):
        shardable_tensors({"m": {"c": np.zeros(2, np.clongdouble)}})
    with pytest.raises(UnsupportedDTypeError, match="'s'"):
        shardable_tensors({"s": np.array(["x"])})


def test_bad_state():
    with pytest.raises(TypeError, match="mapping of arrays"):
        shardable_tensors(np.ones(3))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"state key \(1, 2\)"):
        shardable_tensors({(1, 2): np.ones(1)})  # type: ignore[dict-item]


def test_frozen_and_fast_constructor_equivalent():
    (t,) = shardable_tensors({"w": np.ones(2)})
    with pytest.raises(AttributeError):
        t.name = "x"  # type: ignore[misc]
    rebuilt = ShardableTensor(*(getattr(t, f) for f in ShardableTensor.__slots__))
    assert rebuilt == t


def test_flatten_unflatten():
    state = {"a": {"b": 1, "c": {"d": 2}}, "e": 3}
    flat = flatten(state)
    assert flat == [("a/b", 1), ("a/c/d", 2), ("e", 3)]
    assert unflatten(dict(flat)) == state


def test_torch_tensors_become_host_views():
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    bf = torch.arange(4, dtype=torch.float32).to(torch.bfloat16)
    nc = w.t()  # non-contiguous
    by_key = {t.checkpoint_key: t for t in shardable_tensors({"w": w, "bf": bf, "nc": nc,
                                                              "s": torch.tensor(2.5)})}
    assert np.shares_memory(by_key["w"].tensor, w.numpy())
    assert by_key["bf"].dtype == ml_dtypes.bfloat16
    assert by_key["bf"].tensor.astype(np.float32).tolist() == [0, 1, 2, 3]
    assert by_key["nc"].tensor.tolist() == nc.tolist()
    assert by_key["s"].shape == () and float(by_key["s"].tensor) == 2.5
    bf0 = shardable_tensors({"x": torch.tensor(1.5, dtype=torch.bfloat16)})[0]
    assert bf0.shape == () and float(bf0.tensor) == 1.5


@pytest.mark.parametrize(("value", "what"), [
    ("hello", "a str ('hello')"),
    (None, "None"),
    (b"ab", "a bytes (b'ab')"),
    (object(), "an object (<object object at"),
    ({1, 2}, "a set ({1, 2})"),
    ("x" * 100, "a str ('" + "x" * 36 + "...)"),
])
def test_non_array_values_are_refused_pointing_to_metadata(value, what):
    with pytest.raises(UnsupportedDTypeError) as info:
        shardable_tensors({"cfg": {"v": value}})
    message = str(info.value)
    assert message.startswith(f"'cfg/v': {what}")
    assert "is not an array or a number" in message and "metadata=" in message


def test_list_of_strings_names_the_item():
    with pytest.raises(UnsupportedDTypeError, match=r"^'tags/1': a str \('b'\)"):
        shardable_tensors({"tags": [np.ones(1), "b"]})


def test_int_too_large_for_64_bits():
    for big in (2**64, -(2**63) - 1):
        with pytest.raises(UnsupportedDTypeError, match=rf"^'n': int {big} does not fit in 64"):
            shardable_tensors({"n": big})
    by_key = {t.checkpoint_key: t for t in shardable_tensors({"a": 2**64 - 1, "b": -(2**63)})}
    assert by_key["a"].dtype == np.uint64 and by_key["b"].dtype == np.int64


def test_string_and_object_arrays_point_to_metadata():
    for array in (np.array(["x"]), np.array([None]), np.str_("x")):
        with pytest.raises(UnsupportedDTypeError, match=r"cannot be stored .*go in metadata="):
            shardable_tensors({"s": array})
    with pytest.raises(UnsupportedDTypeError) as info:
        shardable_tensors({"c": np.zeros(1, np.clongdouble)})
    assert "metadata" not in str(info.value)  # numbers, not objects: no such hint
    for array in (np.zeros(2, ml_dtypes.float6_e2m3fn), np.zeros(2, ml_dtypes.int4)):
        with pytest.raises(UnsupportedDTypeError, match=rf"{array.dtype} cannot be stored") as e:
            shardable_tensors({"q": array})
        assert "metadata" not in str(e.value)  # ml_dtypes' numbers, though of kind "V"
    with pytest.raises(UnsupportedDTypeError, match="go in metadata="):
        shardable_tensors({"v": np.zeros(2, "V4")})


def test_torch_tensors_without_host_data_are_a_shardkit_error():
    torch = pytest.importorskip("torch")
    cases = [(torch.ones(2).to_sparse(), "Sparse"), (torch.empty(2, device="meta"), "meta")]
    for tensor, reason in cases:
        with pytest.raises(UnsupportedDTypeError, match=rf"^'t': cannot copy this torch Tensor "
                           rf"to a host array: .*{reason}"):
            shardable_tensors({"t": tensor})


def test_a_string_is_saved_in_the_structure_record_and_refused_by_tensorflow(tmp_path):
    import shardkit

    with pytest.raises(shardkit.ShardkitError, match=r"'name': format='tensorflow' stores "
                       r"tensors only, and this str is not one"):
        shardkit.save(tmp_path / "tf", {"w": np.ones(2), "name": "run"}, format="tensorflow")
    assert list(tmp_path.iterdir()) == []
    shardkit.save(tmp_path / "with", {"w": np.ones(2), "name": "run"})
    assert shardkit.load(tmp_path / "with", nested=True)["name"] == "run"
    assert list(shardkit.load(tmp_path / "with")) == ["w"]  # the flat view: tensors only
    shardkit.save(tmp_path / "ckpt", {"w": np.ones(2)}, metadata={"name": "run"})
    with shardkit.open(tmp_path / "ckpt") as reader:
        assert reader.metadata == {"name": "run"}
