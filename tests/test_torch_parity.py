"""torch parity of save / load (issue 21, item 2): modules as state, weights_only."""

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
