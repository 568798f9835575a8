"""Checkpoint: save/write/read/restore of numpy trees, torch modules and optimizers, in place."""

from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import shardkit.io.save as api
from shardkit.errors import CheckpointNotFoundError, IncompleteRestoreError, RestoreMismatchError
from shardkit.format import MANIFEST_FILE
from shardkit.io.options import CheckpointOptions
from shardkit.io.reader import load, open_checkpoint
from shardkit.training.checkpoint import (
    METADATA_KEY,
    SAVE_COUNTER,
    Checkpoint,
    CheckpointLoadStatus,
    SaveHandle,
)

torch = pytest.importorskip("torch", reason="torch is an optional dependency")

FAST = CheckpointOptions(durable=False)


def ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def index_of(path: str) -> dict:
    with open(os.path.join(path, MANIFEST_FILE)) as f:
        return json.load(f)


def trained(seed: int = 0, steps: int = 3, dtype=torch.float32):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    model.to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4, dtype=dtype)).float().pow(2).sum().backward()
        opt.step()
    return model, opt


# --- numpy trees and Python values ------------------------------------------------------------


def test_numpy_tree_round_trip_in_place(tmp_path):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.array([1, -2], dtype=np.int64)
    tree = {"w": w, "sub": {"b": b, "flag": np.bool_(True)}}
    path = Checkpoint(params=tree).write(tmp_path / "c", FAST)

    w2, b2 = np.zeros_like(w), np.zeros_like(b)
    tree2 = {"w": w2, "sub": {"b": b2, "flag": np.bool_(False)}}
    before = (ptr(w2), ptr(b2))
    status = Checkpoint(params=tree2).read(path)
    status.assert_consumed()
    assert (ptr(tree2["w"]), ptr(tree2["sub"]["b"])) == before  # no reallocation
    assert tree2["w"] is w2 and tree2["sub"]["b"] is b2
    assert w2.tobytes() == w.tobytes() and b2.tobytes() == b.tobytes()
    assert tree2["sub"]["flag"] is np.True_ or tree2["sub"]["flag"] == np.True_
    assert sorted(status.restored_keys) == ["params/sub/b", "params/sub/flag", "params/w"]


def test_python_values_round_trip_exactly(tmp_path):
    values = {
        "epoch": 7, "lr": 0.1 + 0.2, "inf": math.inf, "name": "run-1", "none": None,
        "flag": False, "pair": (1, 2.5), "items": [1, "a", None], "nested": {3: "int key"},
    }
    path = Checkpoint(state=dict(values)).write(tmp_path / "c", FAST)
    target = {k: None for k in values}
    Checkpoint(state=target).read(path)
    assert target == values
    assert type(target["pair"]) is tuple and type(target["items"]) is list
    assert type(target["flag"]) is bool and list(target["nested"]) == [3]


def test_nan_float_round_trips(tmp_path):
    path = Checkpoint(s={"x": math.nan}).write(tmp_path / "c", FAST)
    target = {"x": 0.0}
    Checkpoint(s=target).read(path)
    assert math.isnan(target["x"])


def test_top_level_array_and_numpy_scalar(tmp_path):
    a = np.linspace(0, 1, 7)
    path = Checkpoint(a=a, s={"v": np.float32(2.5)}).write(tmp_path / "c", FAST)
    a2, holder = np.zeros(7), {"v": np.float32(0)}
    ckpt = Checkpoint(a=a2, s=holder)
    ckpt.read(path).assert_consumed()
    assert np.array_equal(a2, a) and ckpt.a is a2
    assert holder["v"] == np.float32(2.5) and holder["v"].dtype == np.float32


def test_list_of_arrays_restored_in_place(tmp_path):
    arrays = [np.full(3, i, np.int32) for i in range(3)]
    path = Checkpoint(s={"layers": arrays}).write(tmp_path / "c", FAST)
    target = {"layers": [np.zeros(3, np.int32) for _ in range(3)]}
    originals = list(target["layers"])
    Checkpoint(s=target).read(path).assert_consumed()
    assert all(t is o for t, o in zip(target["layers"], originals))
    assert [int(t[0]) for t in target["layers"]] == [0, 1, 2]


def test_restore_from_plain_save_matches_by_key(tmp_path):
    api.save(tmp_path / "plain", {"m": {"w": np.ones(3), "extra": np.zeros(1)}},
             options=CheckpointOptions(durable=False))
    w = np.zeros(3)
    with pytest.raises(IncompleteRestoreError, match=r"'m/absent'.*'m/extra'"):
        Checkpoint(m={"w": w, "absent": np.zeros(2)}).read(tmp_path / "plain")
    assert not w.any()
    status = Checkpoint(m={"w": w, "absent": np.zeros(2)}).read(tmp_path / "plain",
                                                                partial=True)
    assert np.array_equal(w, np.ones(3))
    assert status.missing_keys == ["m/absent"]
    assert status.unexpected_keys == ["m/extra"]


# --- torch ------------------------------------------------------------------------------------


def test_module_and_adam_round_trip_in_place_byte_for_byte(tmp_path):
    model, opt = trained(0)
    path = Checkpoint(model=model, optimizer=opt).write(tmp_path / "c", FAST)

    model2, opt2 = trained(1)
    opt2.param_groups[0]["lr"] = 0.5
    param_ptrs = [p.data_ptr() for p in model2.parameters()]
    state_ptrs = {k: t.data_ptr() for i, s in opt2.state_dict()["state"].items()
                  for k, t in s.items()}
    Checkpoint(model=model2, optimizer=opt2).read(path).assert_consumed()

    assert [p.data_ptr() for p in model2.parameters()] == param_ptrs
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert a.numpy().tobytes() == b.numpy().tobytes()
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s2["param_groups"] == s1["param_groups"]
    assert s2["param_groups"][0]["betas"] == (0.8, 0.95)
    for i in s1["state"]:
        for k in s1["state"][i]:
            assert s2["state"][i][k].numpy().tobytes() == s1["state"][i][k].numpy().tobytes()
    assert {k: t.data_ptr() for i, s in s2["state"].items() for k, t in s.items()} == state_ptrs


def test_fresh_optimizer_gets_its_state_and_continues_identically(tmp_path):
    model, opt = trained(0)
    path = Checkpoint(model=model, optimizer=opt).write(tmp_path / "c", FAST)
    torch.manual_seed(5)
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt2 = torch.optim.Adam(model2.parameters(), lr=1.0)
    assert not opt2.state  # no step yet: nothing to fill in place
    Checkpoint(model=model2, optimizer=opt2).read(path).assert_consumed()
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert int(opt2.state_dict()["state"][0]["step"]) == 4


def test_sgd_momentum_none_and_int_state_round_trip(tmp_path):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3)
    opt.step()
    path = Checkpoint(opt=opt).write(tmp_path / "c", FAST)
    q = torch.nn.Parameter(torch.ones(3))
    opt2 = torch.optim.SGD([q], lr=0.7)
    Checkpoint(opt=opt2).read(path)
    assert opt2.param_groups[0]["momentum"] == 0.9 and opt2.param_groups[0]["lr"] == 0.1
    assert torch.equal(opt2.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"])


def test_bf16_module_round_trips(tmp_path):
    model, opt = trained(0, dtype=torch.bfloat16)
    path = Checkpoint(model=model, optimizer=opt).write(tmp_path / "c", FAST)
    with open_checkpoint(path) as r:
        assert r.info("model/0.weight").dtype_name == "BF16"
        assert r.get("model/0.weight").dtype == ml_dtypes.bfloat16
    model2, opt2 = trained(3, dtype=torch.bfloat16)
    Checkpoint(model=model2, optimizer=opt2).read(path).assert_consumed()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b) and b.dtype == torch.bfloat16
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"],
                       opt.state_dict()["state"][0]["exp_avg"])


def test_non_contiguous_tensors_and_arrays(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    t = base.t()  # a transposed view
    a = np.arange(20, dtype=np.int16).reshape(4, 5)[:, ::2]
    path = Checkpoint(s={"t": t, "a": a}).write(tmp_path / "c", FAST)
    stored = load(path)
    assert np.array_equal(stored["s/t"], t.numpy()) and np.array_equal(stored["s/a"], a)
    base2 = torch.zeros(4, 6)
    t2 = base2.t()
    a_base = np.zeros((4, 5), np.int16)
    a2 = a_base[:, ::2]
    Checkpoint(s={"t": t2, "a": a2}).read(path).assert_consumed()
    assert torch.equal(base2, base)
    assert np.array_equal(a_base[:, ::2], a) and not a_base[:, 1::2].any()


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied


def test_tied_tensors_stored_once_restored_to_all(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    path = Checkpoint(model=model).write(tmp_path / "c", FAST)
    idx = index_of(path)
    assert "model/embed.weight" in idx["shardkit"]["tensors"]["key"]
    assert "model/head.weight" not in idx["shardkit"]["tensors"]["key"]
    assert idx["shardkit"]["aliases"] == {"key": ["model/head.weight"],  # the save's aliases
                                          "of": ["model/embed.weight"]}
    torch.manual_seed(1)
    model2 = Tied()
    status = Checkpoint(model=model2).read(path)
    status.assert_consumed()
    assert set(status.restored_keys) == {"model/embed.weight", "model/head.weight"}
    assert torch.equal(model2.head.weight, model.embed.weight)
    assert model2.head.weight is model2.embed.weight


def test_a_tied_tensor_of_an_older_skeleton_restores(tmp_path):
    """Before the save's aliases (docs/FORMAT.md section 2.5), a Checkpoint recorded a tied
    tensor in its own skeleton (``"alias"``) and stored it once under the first key."""
    torch.manual_seed(0)
    model = Tied()
    path = Checkpoint(model=model).write(tmp_path / "c", FAST)
    idx = index_of(path)
    del idx["shardkit"]["aliases"]
    idx["shardkit"].pop("structure", None)  # older checkpoints had none
    tree = idx["shardkit"]["user_metadata"][METADATA_KEY]["objects"]["model"]["tree"]["d"]
    assert tree[1][0] == "head.weight"
    tree[1][1]["alias"] = "model/embed.weight"
    (Path(path) / MANIFEST_FILE).write_text(json.dumps(idx))
    torch.manual_seed(1)
    model2 = Tied()
    torch.nn.init.zeros_(model2.embed.weight)
    status = Checkpoint(model=model2).read(path)
    status.assert_consumed()
    assert torch.equal(model2.head.weight, model.embed.weight)


def test_numpy_aliases_stored_once(tmp_path):
    a = np.arange(6.0)
    path = Checkpoint(s={"a": a, "b": a, "view": a[::2]}).write(tmp_path / "c", FAST)
    with open_checkpoint(path) as r:
        assert r.keys() == ["s/a", "s/view", SAVE_COUNTER, "s/b"]  # the alias last
        assert r.index.keys == ["s/a", "s/view", SAVE_COUNTER]
    x, y, z = np.zeros(6), np.zeros(6), np.zeros(3)
    Checkpoint(s={"a": x, "b": y, "view": z}).read(path).assert_consumed()
    assert np.array_equal(y, a) and np.array_equal(z, a[::2])


# --- save counter, paths ----------------------------------------------------------------------


def test_save_numbers_with_counter_and_restores_it(tmp_path):
    ckpt = Checkpoint(s={"x": np.ones(2)})
    p1 = ckpt.save(tmp_path / "ck", FAST)
    p2 = ckpt.save(tmp_path / "ck", FAST)
    assert (os.path.basename(p1), os.path.basename(p2), ckpt.save_counter) == ("ck-1", "ck-2", 2)
    w = ckpt.write(tmp_path / "exact", FAST)
    assert os.path.basename(w) == "exact" and ckpt.save_counter == 2
    assert int(load(p1)[SAVE_COUNTER]) == 1
    other = Checkpoint(s={"x": np.zeros(2)})
    other.restore(p2)
    assert other.save_counter == 2
    assert os.path.basename(other.save(tmp_path / "ck", FAST)) == "ck-3"


def test_write_replaces_existing_checkpoint(tmp_path):
    x = np.ones(2)
    ckpt = Checkpoint(s={"x": x})
    ckpt.write(tmp_path / "c", FAST)
    x[:] = 5
    ckpt.write(tmp_path / "c", FAST)
    assert load(tmp_path / "c")["s/x"].tolist() == [5, 5]


@pytest.mark.parametrize("enable_async", [False, True])
def test_compressed_checkpoint_round_trips(tmp_path, enable_async):
    model, opt = trained(0)
    opts = CheckpointOptions(compression="zstd", durable=False, enable_async=enable_async)
    ckpt = Checkpoint(model=model, optimizer=opt)
    path = ckpt.save(tmp_path / "c", opts)
    ckpt.sync()
    assert [p.suffix for p in sorted(Path(path).glob("model-*"))] == [".skz"]
    model2, opt2 = trained(1)
    Checkpoint(model=model2, optimizer=opt2).read(path).assert_consumed()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_save_handle_is_the_path(tmp_path):
    h = Checkpoint(s={"x": np.ones(1)}).write(tmp_path / "c", FAST)
    assert isinstance(h, SaveHandle) and isinstance(h, str)
    assert h == str(tmp_path / "c") and h.path == h and h.done() and h.staged()
    assert h.wait() == h and h.exception() is None and h.wait_staged()
    assert type(pickle.loads(pickle.dumps(h))) is str
    assert "durable" in repr(h)


def test_objects_are_attributes():
    x = np.ones(1)
    ckpt = Checkpoint(x=x)
    assert ckpt.x is x
    with pytest.raises(AttributeError, match="no object or attribute 'y'"):
        ckpt.y  # noqa: B018


# --- errors and status ------------------------------------------------------------------------


def test_shape_mismatch_names_key_and_changes_nothing(tmp_path):
    path = Checkpoint(a={"x": np.ones(3)}, b={"y": np.ones((2, 2))}).write(tmp_path / "c", FAST)
    x, y = np.zeros(3), np.zeros((2, 3))
    with pytest.raises(RestoreMismatchError, match=r"'b/y'.*shape \[2, 2\].*shape \[2, 3\]"):
        Checkpoint(a={"x": x}, b={"y": y}).read(path)
    assert not x.any()  # validated before anything was copied


def test_dtype_mismatch_names_key(tmp_path):
    model, _ = trained(0)
    path = Checkpoint(model=model).write(tmp_path / "c", FAST)
    model2, _ = trained(0, dtype=torch.float64)
    with pytest.raises(RestoreMismatchError, match=r"'model/0.weight'.*float32.*float64"):
        Checkpoint(model=model2).read(path)


def test_read_only_target_rejected(tmp_path):
    path = Checkpoint(s={"x": np.ones(3)}).write(tmp_path / "c", FAST)
    x = np.zeros(3)
    x.flags.writeable = False
    with pytest.raises(RestoreMismatchError, match="'s/x' in place: the numpy array is read-only"):
        Checkpoint(s={"x": x}).read(path)


def test_optimizer_that_does_not_fit_is_a_restore_error(tmp_path):
    _, opt = trained(0)
    path = Checkpoint(opt=opt).write(tmp_path / "c", FAST)
    other = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(RestoreMismatchError, match=r"'opt'.*load_state_dict rejected"):
        Checkpoint(opt=other).read(path)


def test_status_reports_missing_and_unexpected(tmp_path):
    path = Checkpoint(m={"a": np.ones(1), "gone": np.ones(1)}, old={"z": np.ones(1)}).write(
        tmp_path / "c", FAST
    )
    with pytest.raises(IncompleteRestoreError, match=r"'m/new'.*'m/gone'"):
        Checkpoint(m={"a": np.zeros(1), "new": np.zeros(1)}).read(path)
    status = Checkpoint(m={"a": np.zeros(1), "new": np.zeros(1)}).read(path, partial=True)
    assert isinstance(status, CheckpointLoadStatus)
    assert status.missing_keys == ["m/new"]
    assert sorted(status.unexpected_keys) == ["m/gone", "old/z"]
    with pytest.raises(IncompleteRestoreError, match=r"1 objects' values missing.*'m/new'"):
        status.assert_consumed()
    with pytest.raises(IncompleteRestoreError, match="'m/gone'"):
        status.assert_consumed()
    with pytest.raises(IncompleteRestoreError, match="'m/new'"):
        status.assert_existing_objects_matched()
    assert status.expect_partial() is status
    assert status.assert_nontrivial_match() is status
    ok = Checkpoint(m={"a": np.zeros(1)}).read(path, partial=True)
    assert ok.assert_existing_objects_matched() is ok
    with pytest.raises(IncompleteRestoreError, match="matched no value"):
        Checkpoint(q={"a": np.zeros(1)}).read(path, partial=True).assert_nontrivial_match()


def test_module_with_missing_and_extra_layers(tmp_path):
    small = torch.nn.Sequential(torch.nn.Linear(2, 2))
    path = Checkpoint(model=small).write(tmp_path / "c", FAST)
    big = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(IncompleteRestoreError, match=r"'model/1\.weight', 'model/1\.bias'"):
        Checkpoint(model=big).read(path)
    status = Checkpoint(model=big).read(path, partial=True)
    assert status.missing_keys == ["model/1.weight", "model/1.bias"]
    assert status.unexpected_keys == []
    assert torch.equal(big[0].weight, small[0].weight)


def test_module_with_fewer_layers_reports_unexpected(tmp_path):
    big = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    path = Checkpoint(model=big).write(tmp_path / "c", FAST)
    small = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(IncompleteRestoreError, match=r"'model/1\.weight', 'model/1\.bias'"):
        Checkpoint(model=small).read(path)
    status = Checkpoint(model=small).read(path, partial=True)
    assert status.missing_keys == []
    assert status.unexpected_keys == ["model/1.weight", "model/1.bias"]
    assert list(small.state_dict()) == ["0.weight", "0.bias"]  # nothing added to the module
    assert torch.equal(small[0].weight, big[0].weight)


def test_restore_none_restores_nothing():
    status = Checkpoint(s={"x": np.ones(2)}).restore(None)
    assert status.missing_keys == ["s/x"] and status.path is None
    with pytest.raises(IncompleteRestoreError, match=r"restore\(None\)"):
        status.assert_consumed()


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        Checkpoint(s={"x": np.ones(1)}).read(tmp_path / "nothing")


def test_newer_layout_version_rejected(tmp_path):
    meta = {METADATA_KEY: {"version": 99, "objects": {}}}
    api.save(tmp_path / "c", {"s": {"x": np.ones(1)}}, metadata=meta,
             options=CheckpointOptions(durable=False))
    with pytest.raises(RestoreMismatchError, match="layout version 99 is newer"):
        Checkpoint(s={"x": np.ones(1)}).read(tmp_path / "c")


@pytest.mark.parametrize(
    ("objects", "error", "match"),
    [
        ({"save_counter": np.ones(1)}, ValueError, "reserved"),
        ({"a/b": np.ones(1)}, ValueError, "must not contain '/'"),
        ({"x": 3}, TypeError, r"Checkpoint\(x=...\): cannot track a int"),
        ({"x": {np.float32(1)}}, TypeError, "cannot track a set"),
    ],
)
def test_bad_objects(objects, error, match):
    with pytest.raises(error, match=match):
        Checkpoint(**objects)


def test_unstorable_values_and_key_collisions(tmp_path):
    with pytest.raises(TypeError, match=r"'s/bad': cannot checkpoint a set"):
        Checkpoint(s={"bad": {1, 2}}).write(tmp_path / "a", FAST)
    with pytest.raises(TypeError, match=r"key \(1, 2\) is not a str or int"):
        Checkpoint(s={(1, 2): np.ones(1)}).write(tmp_path / "b", FAST)
    with pytest.raises(ValueError, match="two values map to the checkpoint key 's/a/b'"):
        Checkpoint(s={"a/b": np.ones(1), "a": {"b": np.ones(1)}}).write(tmp_path / "c", FAST)
    assert not any(p.name in ("a", "b", "c") for p in tmp_path.iterdir())


def test_options_type_checked(tmp_path):
    ckpt = Checkpoint(s={"x": np.ones(1)})
    with pytest.raises(TypeError, match="options must be a CheckpointOptions, got dict"):
        ckpt.write(tmp_path / "c", {"durable": False})  # type: ignore[arg-type]


def test_write_callbacks_run_after_commit(tmp_path):
    seen = []
    opts = CheckpointOptions(durable=False, experimental_write_callbacks=[seen.append])
    path = Checkpoint(s={"x": np.ones(1)}).write(tmp_path / "c", opts)
    assert seen == [path]


class Counter:
    """A user object with state_dict / load_state_dict (neither torch nor numpy)."""

    def __init__(self, n: int) -> None:
        self.n, self.hist = n, np.arange(n, dtype=np.int32)

    def state_dict(self) -> dict:
        return {"n": self.n, "hist": self.hist.copy()}

    def load_state_dict(self, sd: dict) -> None:
        self.n, self.hist = sd["n"], sd["hist"]


def test_generic_stateful_object(tmp_path):
    path = Checkpoint(c=Counter(4)).write(tmp_path / "c", FAST)
    c = Counter(4)
    c.hist[:] = 0
    c.n = 1
    Checkpoint(c=c).read(path).assert_consumed()
    assert c.n == 4 and c.hist.tolist() == [0, 1, 2, 3]


def test_jax_arrays_and_pytrees(tmp_path):
    jax = pytest.importorskip("jax", reason="jax is an optional dependency")
    jnp = jax.numpy
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "layers": [jnp.ones(2), jnp.zeros(1)]}
    opts = CheckpointOptions(durable=False, enable_async=True)
    ckpt = Checkpoint(params=tree, top=jnp.full(2, 3.0))
    path = ckpt.save(tmp_path / "c", opts)
    ckpt.sync()
    assert load(path)["params/w"].tolist() == [[0, 1, 2], [3, 4, 5]]
    target = {"w": jnp.zeros((2, 3)), "layers": [jnp.zeros(2), jnp.ones(1)]}
    layers = target["layers"]
    ckpt2 = Checkpoint(params=target, top=jnp.zeros(2))
    ckpt2.read(path).assert_consumed()
    assert isinstance(target["w"], jax.Array) and isinstance(ckpt2.top, jax.Array)
    assert np.array_equal(np.asarray(target["w"]), np.arange(6.0).reshape(2, 3))
    assert target["layers"] is layers and np.array_equal(np.asarray(layers[0]), np.ones(2))
    assert np.array_equal(np.asarray(ckpt2.top), [3.0, 3.0])
    with pytest.raises(RestoreMismatchError, match="'params/w'"):
        Checkpoint(params={"w": jnp.zeros(3)}).read(path)
