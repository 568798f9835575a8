"""torch parity of save / load (issue 21, item 2): modules as state, weights_only,
map_location."""

from __future__ import annotations

import numpy as np
import pytest

import shardkit
from shardkit.errors import InvalidArgumentError, InvalidArgumentTypeError

torch = pytest.importorskip("torch")


def test_save_module_saves_its_state_dict(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    shardkit.save(tmp_path / "ck", model)
    loaded = shardkit.load(tmp_path / "ck", framework="torch")
    expected = model.state_dict()
    assert list(loaded) == list(expected)
    for key, value in expected.items():
        assert torch.equal(loaded[key], value)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    fresh.load_state_dict(loaded, strict=True)
    x = torch.randn(5, 3)
    assert torch.equal(fresh(x), model(x))


def test_weights_only_true_is_accepted(tmp_path):
    shardkit.save(tmp_path / "ck", {"a": np.arange(4, dtype=np.float32)})
    out = shardkit.load(tmp_path / "ck", weights_only=True)
    np.testing.assert_array_equal(out["a"], np.arange(4, dtype=np.float32))


def test_weights_only_false_is_refused_with_the_reason(tmp_path):
    shardkit.save(tmp_path / "ck", {"a": np.zeros(2)})
    with pytest.raises(InvalidArgumentError, match="never unpickles"):
        shardkit.load(tmp_path / "ck", weights_only=False)


@pytest.mark.parametrize("bad", [None, 1, "yes"])
def test_weights_only_other_values_are_type_errors(tmp_path, bad):
    shardkit.save(tmp_path / "ck", {"a": np.zeros(2)})
    with pytest.raises(InvalidArgumentTypeError, match="weights_only"):
        shardkit.load(tmp_path / "ck", weights_only=bad)


# --- map_location ----------------------------------------------------------------------------


def _state():
    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7,
            "h": torch.tensor([1.5, -2.25, 3.0e-3], dtype=torch.bfloat16),
            "n": torch.arange(5, dtype=torch.int64) - 2}


def _saved(tmp_path, gpu=False):
    """A checkpoint of `_state()`; with `gpu`, its manifest says it was saved from cuda:1 (this
    machine has no GPU to save from)."""
    path = tmp_path / ("gpu" if gpu else "cpu")
    shardkit.save(path, _state())
    if gpu:
        index = path / "model.safetensors.index.json"
        text = index.read_text()
        assert "device:CPU:0" in text
        index.write_text(text.replace("device:CPU:0", "device:GPU:1"))
    return path


def _assert_bit_exact(loaded, keys=("w", "h", "n")):
    expected = _state()
    assert list(loaded) == list(keys)
    for key in keys:
        got = loaded[key]
        assert isinstance(got, torch.Tensor) and got.device.type == "cpu"
        assert got.dtype == expected[key].dtype and got.shape == expected[key].shape
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        bits = width[got.element_size()]
        assert torch.equal(got.view(bits), expected[key].view(bits))


@pytest.mark.parametrize("where", ["cpu", "cpu:0", torch.device("cpu")])
def test_map_location_cpu_gives_torch_tensors_without_framework(tmp_path, where):
    _assert_bit_exact(shardkit.load(_saved(tmp_path), map_location=where))


def test_map_location_with_framework_torch(tmp_path):
    _assert_bit_exact(shardkit.load(_saved(tmp_path), framework="torch", map_location="cpu"))


@pytest.mark.parametrize("kwargs", [{"framework": "numpy"}, {"framework": "jax"},
                                    {"framework": "torch", "device": "cpu"}])
def test_map_location_with_another_framework_or_a_device_is_refused(tmp_path, kwargs):
    with pytest.raises(InvalidArgumentError, match="map_location"):
        shardkit.load(_saved(tmp_path), map_location="cpu", **kwargs)


def test_map_location_meta_gives_tensors_without_data(tmp_path):
    loaded = shardkit.load(_saved(tmp_path), map_location="meta")
    assert list(loaded) == ["w", "h", "n"]
    for key, value in _state().items():
        assert loaded[key].is_meta
        assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape


@pytest.mark.parametrize("where", ["cuda", "cuda:0", torch.device("cuda", 1), {"cpu": "cuda:0"}])
def test_map_location_to_cuda_without_a_gpu_names_the_key_and_device(tmp_path, where):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(InvalidArgumentError, match=r"key 'w' .*'cuda"):
        shardkit.load(_saved(tmp_path), map_location=where)


def test_map_location_dict_maps_saved_locations(tmp_path):
    path = _saved(tmp_path, gpu=True)
    _assert_bit_exact(shardkit.load(path, map_location={"cuda:1": "cpu"}))
    _assert_bit_exact(shardkit.load(path, map_location={"cuda:1": torch.device("cpu")}))


def test_map_location_dict_leaves_unnamed_locations_where_they_were_saved(tmp_path):
    _assert_bit_exact(shardkit.load(_saved(tmp_path), map_location={"cuda:1": "cpu"}))
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(InvalidArgumentError, match=r"key 'w' \(saved on 'cuda:1'\)"):
        shardkit.load(_saved(tmp_path, gpu=True), map_location={"cuda:0": "cpu"})


def test_map_location_of_a_device_torch_does_not_know(tmp_path):
    path = _saved(tmp_path)
    index = path / "model.safetensors.index.json"
    index.write_text(index.read_text().replace("device:CPU:0", "device:TPU:0"))
    _assert_bit_exact(shardkit.load(path, map_location={"tpu:0": "cpu"}))
    seen = []
    _assert_bit_exact(shardkit.load(path, map_location=lambda t, where: seen.append(where) or t))
    assert seen == ["tpu:0"] * 3
    with pytest.raises(InvalidArgumentError, match=r"key 'w' was saved on 'tpu:0'"):
        shardkit.load(path, map_location={"cpu": "cpu"})


def test_map_location_dict_with_keys_and_prefix(tmp_path):
    shardkit.save(tmp_path / "ck", {"model/" + k: v for k, v in _state().items()})
    loaded = shardkit.load(tmp_path / "ck", ["n", "w"], prefix="model",
                           map_location={"cpu": "cpu"})
    _assert_bit_exact(loaded, keys=("n", "w"))


def test_map_location_callable_gets_each_cpu_tensor_and_its_location(tmp_path):
    seen = []

    def move(tensor, where):
        seen.append((tensor.device.type, tuple(tensor.shape), where))
        return tensor.clone()

    _assert_bit_exact(shardkit.load(_saved(tmp_path, gpu=True), map_location=move))
    assert seen == [("cpu", (2, 3), "cuda:1"), ("cpu", (3,), "cuda:1"), ("cpu", (5,), "cuda:1")]


def test_map_location_callable_returning_none_keeps_the_saved_location(tmp_path):
    _assert_bit_exact(shardkit.load(_saved(tmp_path), map_location=lambda t, where: None))
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(InvalidArgumentError, match=r"key 'w' .*'cuda:1'"):
        shardkit.load(_saved(tmp_path, gpu=True), map_location=lambda t, where: None)


def test_map_location_callable_returning_a_non_tensor_is_a_type_error(tmp_path):
    with pytest.raises(InvalidArgumentTypeError, match=r"returned ndarray for key 'w'"):
        shardkit.load(_saved(tmp_path), map_location=lambda t, where: t.numpy())


def test_map_location_callable_changing_a_tensor_is_refused(tmp_path):
    path = _saved(tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"shape .*key 'w'"):
        shardkit.load(path, map_location=lambda t, where: t.reshape(-1))
    with pytest.raises(InvalidArgumentError, match=r"float64 .*key 'w'"):
        shardkit.load(path, map_location=lambda t, where: t.double())


@pytest.mark.parametrize("bad", [0, 1.5, ["cpu"], {0: "cpu"}, {"cpu": 0}])
def test_map_location_bad_types_are_type_errors(tmp_path, bad):
    with pytest.raises(InvalidArgumentTypeError, match="map_location"):
        shardkit.load(_saved(tmp_path), map_location=bad)


@pytest.mark.parametrize("bad", ["gpu", "cpux", {"cpu": "gpu:0"}])
def test_map_location_unknown_device_strings_are_refused(tmp_path, bad):
    with pytest.raises(InvalidArgumentError, match="is not a torch device"):
        shardkit.load(_saved(tmp_path), map_location=bad)
