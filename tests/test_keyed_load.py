"""shardkit.io.reader: `load(keys=)` returns exactly what a full load returns, planned column-wise;
`load(prefix=)` / `restore_into(prefix=)` take a sub-tree, with the prefix stripped."""

from __future__ import annotations

import numpy as np
import pytest

import shardkit
from shardkit import format as fmt
from shardkit.errors import InvalidArgumentError, InvalidArgumentTypeError, KeyNotFoundError

RNG = np.random.default_rng(26)


def mixed_state() -> dict:
    """Whole tensors, tensors split over several shards, 0-d and empty ones, string tensors."""
    return {
        "model": {"embed": RNG.random((64, 16), np.float32),
                  "layers": [{"w": RNG.random((8, 8)), "b": np.arange(8, dtype=np.int16)}
                             for _ in range(3)],
                  "names": np.array([b"a", b"bc"], dtype=object)},
        "opt": {"step": np.int64(7), "empty": np.zeros((0, 3), np.float32)},
        "tag": np.array(["x", "yz"]),
    }


@pytest.fixture(params=["whole", "split"])
def saved(request, tmp_path):
    path = tmp_path / "ckpt"
    callback = shardkit.BinPackPolicy("1KiB") if request.param == "split" else None
    with pytest.warns(shardkit.SplitTensorsWarning) if callback else _nothing():
        shardkit.save(path, mixed_state(),
                      options=shardkit.CheckpointOptions(experimental_sharding_callback=callback))
    with shardkit.open(path) as reader:
        split = reader.info("model/embed").slices
        assert len({s.shard for s in split}) == (1 if callback is None else len(split)) > 0
    return path


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_same(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert np.array_equal(got[key], value), key


@pytest.mark.parametrize("mmap", [True, False])
def test_keyed_loads_return_what_a_full_load_returns(saved, mmap):
    full = shardkit.load(saved, mmap=mmap)
    keys = list(full)
    assert_same(shardkit.load(saved, keys, mmap=mmap), full)
    backwards = keys[::-1]
    assert_same(shardkit.load(saved, backwards, mmap=mmap), {k: full[k] for k in backwards})
    some = keys[::3]
    assert_same(shardkit.load(saved, some, mmap=mmap), {k: full[k] for k in some})
    twice = [keys[2], keys[0], keys[2], keys[0]]  # duplicates: each key once, first order
    assert_same(shardkit.load(saved, twice, mmap=mmap), {keys[2]: full[keys[2]],
                                                          keys[0]: full[keys[0]]})


def test_split_tensors_span_several_shards(tmp_path):
    path = tmp_path / "ckpt"
    state = {"big": RNG.random((256, 8)), "small": np.arange(3.0)}
    with pytest.warns(shardkit.SplitTensorsWarning):
        shardkit.save(path, state,
                      options=shardkit.CheckpointOptions(
                          experimental_sharding_callback=shardkit.BinPackPolicy("4KiB")))
    with shardkit.open(path) as reader:
        assert len({s.shard for s in reader.info("big").slices}) > 1
    assert_same(shardkit.load(path, ["small", "big"]), {"small": state["small"],
                                                        "big": state["big"]})


def test_a_missing_key_fails_before_anything_is_read(saved):
    with pytest.raises(KeyNotFoundError, match=r"'model/embd'.*did you mean 'model/embed'"):
        shardkit.load(saved, ["opt/step", "model/embd"])
    with pytest.raises(KeyNotFoundError, match=r"key \['x'\]"):
        shardkit.load(saved, [["x"]])  # unhashable: still named


def test_keyed_loads_plan_column_wise(tmp_path, monkeypatch):
    """A keyed load does not build a TensorInfo per key (that was 2.2x a full load at 50,000
    keys): the keys are checked and planned on the index's columns."""
    path = tmp_path / "ckpt"
    state = {f"t{i}": np.full(i % 5 + 1, i, np.float32) for i in range(2000)}
    shardkit.save(path, state)
    calls = []
    original = fmt.CheckpointIndex.tensor_info
    monkeypatch.setattr(fmt.CheckpointIndex, "tensor_info",
                        lambda self, key: calls.append(key) or original(self, key))
    keys = list(state)[::-1]
    got = shardkit.load(path, keys)
    assert list(got) == keys and calls == []
    assert all(np.array_equal(got[k], state[k]) for k in keys)
    assert_same(shardkit.load(path, keys[::10]), {k: state[k] for k in keys[::10]})
    assert calls == []


# -- prefix=


def test_prefix_takes_a_torch_modules_sub_tree_from_a_checkpoint(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "ckpt")
    shardkit.Checkpoint(model=model, optimizer=optimizer).write(path)
    assert "model/0.weight" in shardkit.load(path)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    with pytest.raises(RuntimeError):  # the keys carry the prefix
        fresh.load_state_dict(shardkit.load(path, framework="torch"))
    fresh.load_state_dict(shardkit.load(path, framework="torch", prefix="model/"))
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    target = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    status = shardkit.restore_into(path, target, prefix="model")
    assert status.restored_keys == list(model.state_dict())
    assert status.unexpected_keys == [] and status.missing_keys == []
    assert all(torch.equal(target[k], v) for k, v in model.state_dict().items())


def test_prefix_is_a_key_component_boundary(tmp_path):
    path = tmp_path / "ckpt"
    state = {"model": {"w": np.ones(2), "b": np.zeros(1)}, "modelx": {"w": np.full(2, 5.0)},
             "other": np.arange(2)}
    shardkit.save(path, state)
    for prefix in ("model", "model/", "model//"):
        got = shardkit.load(path, prefix=prefix)
        assert list(got) == ["w", "b"] and got["w"].tolist() == [1.0, 1.0]
    assert list(shardkit.load(path, prefix="modelx")) == ["w"]


def test_prefix_with_keys_is_relative_and_strings_come_along(saved):
    full = shardkit.load(saved)
    got = shardkit.load(saved, ["embed", "names", "layers/1/w"], prefix="model")
    assert_same(got, {"embed": full["model/embed"], "names": full["model/names"],
                      "layers/1/w": full["model/layers/1/w"]})
    under = shardkit.load(saved, prefix="model")
    assert_same(under, {k[len("model/"):]: v for k, v in full.items()
                        if k.startswith("model/")})
    assert list(shardkit.load(saved, "step", prefix="opt")) == ["step"]
    with pytest.raises(KeyNotFoundError, match="'model/step'"):
        shardkit.load(saved, ["step"], prefix="model")
    with pytest.raises(KeyNotFoundError, match="key 3 is not in checkpoint"):
        shardkit.load(saved, [3], prefix="model")


def test_no_key_under_a_prefix_names_it_and_the_nearest(saved):
    with pytest.raises(KeyNotFoundError) as e:
        shardkit.load(saved, prefix="modle")
    message = str(e.value)
    assert "prefix 'modle'" in message and "'model/'" in message and str(saved) in message
    with pytest.raises(KeyNotFoundError, match=r"prefix 'model/layers/9'.*'model/layers/"):
        shardkit.load(saved, prefix="model/layers/9")
    with pytest.raises(KeyNotFoundError, match="prefix 'tag'"):  # a tensor, not a sub-tree
        shardkit.load(saved, prefix="tag")
    with pytest.raises(KeyNotFoundError, match="prefix 'nothing'"):
        shardkit.restore_into(saved, {"w": np.zeros(1)}, prefix="nothing")


def test_bad_prefixes(saved):
    with pytest.raises(InvalidArgumentError, match="prefix must name a key component"):
        shardkit.load(saved, prefix="/")
    with pytest.raises(InvalidArgumentError):
        shardkit.load(saved, prefix="")
    with pytest.raises(InvalidArgumentTypeError, match="prefix must be a str"):
        shardkit.load(saved, prefix=3)


def test_restore_into_a_sub_tree_checks_only_keys_under_it(saved):
    full = shardkit.load(saved)
    target = {"step": np.zeros((), np.int64), "empty": np.ones((0, 3), np.float32)}
    status = shardkit.restore_into(saved, target, prefix="opt/")
    assert status.restored_keys == ["step", "empty"] and status.unexpected_keys == []
    assert target["step"] == full["opt/step"]
    with pytest.raises(shardkit.IncompleteRestoreError, match="opt/empty"):
        shardkit.restore_into(saved, {"step": np.zeros((), np.int64)}, prefix="opt")
    status = shardkit.restore_into(saved, {"step": np.zeros((), np.int64)}, prefix="opt",
                                   partial=True)
    assert status.unexpected_keys == ["empty"]


def test_open_with_a_prefix_reads_the_sub_tree(saved):
    full = shardkit.load(saved)
    with shardkit.open(saved, prefix="model") as reader:
        names = [k[len("model/"):] for k in full if k.startswith("model/")]
        assert reader.keys() == names and list(reader) == names and len(reader) == len(names)
        assert "embed" in reader and "model/embed" not in reader and "opt/step" not in reader
        assert np.array_equal(reader["embed"], full["model/embed"])
        assert np.array_equal(reader.get_slice("embed", np.s_[3:9]), full["model/embed"][3:9])
        assert np.array_equal(reader.get("names"), full["model/names"])
        assert reader.info("layers/0/w").key == "layers/0/w"
        assert reader.info("names").key == "names"
        assert reader.verify(["embed", "names"]) >= 2
        with pytest.raises(KeyNotFoundError, match="'model/step'"):
            reader.get("step")
    with pytest.raises(KeyNotFoundError, match="prefix 'nothing'"):
        shardkit.open(saved, prefix="nothing")
