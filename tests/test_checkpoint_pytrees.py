"""`Checkpoint` of pytrees: tuples, NamedTuples (optax states), None and empty subtrees are
tracked, and a restore gives back the same tree (NamedTuple types by import path), dtypes and
JAX shardings, so that an optax loop resumes bit-identically."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

import shardkit
from shardkit.errors import CorruptIndexError, InvalidArgumentTypeError, RestoreMismatchError
from shardkit.training.checkpoint import Checkpoint, CheckpointManager, CheckpointOptions

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
nn = pytest.importorskip("flax.linen")
serialization = pytest.importorskip("flax.serialization")


class Pair(NamedTuple):
    first: np.ndarray
    second: np.ndarray


def _params(seed: int) -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"w": jax.random.normal(k1, (4, 3)), "b": jax.random.normal(k2, (3,))}


def _bits(tree) -> list[bytes]:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


def _types(tree) -> list[str]:
    """Every node's type by import path, depth first (jax.tree.structure does not tell two
    NamedTuples of one name apart)."""
    out = []

    def walk(node):
        out.append(f"{type(node).__module__}:{type(node).__qualname__}")
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(tree)
    return out


def _same_tree(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert _types(got) == _types(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert type(a) is type(b) and getattr(a, "dtype", None) == getattr(b, "dtype", None)
        if isinstance(b, jax.Array):
            assert a.sharding == b.sharding


def test_an_optax_state_is_tracked_and_comes_back_as_it_was(tmp_path):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))  # holds an EmptyState
    state = tx.init(_params(0))
    state = jax.tree.map(lambda a: a + 1, state)  # not what init gives
    Checkpoint(opt_state=state).write(tmp_path / "c")

    fresh = Checkpoint(opt_state=tx.init(_params(1)))
    status = fresh.read(tmp_path / "c")
    status.assert_consumed()
    _same_tree(fresh.opt_state, state)
    assert type(fresh.opt_state[1][0]) is optax.ScaleByAdamState
    assert type(fresh.opt_state[0]) is optax.EmptyState
    assert _bits(fresh.opt_state) == _bits(state)
    assert status.restored_keys == ["opt_state/1/0/0", "opt_state/1/0/1/b", "opt_state/1/0/1/w",
                                    "opt_state/1/0/2/b", "opt_state/1/0/2/w"]


def test_tuples_lists_none_and_empty_subtrees_inside_a_dict_come_back(tmp_path):
    tx = optax.adam(1e-2)
    state = {"opt": tx.init(_params(0)), "none": None, "empty": {}, "nothing": (),
             "pair": Pair(np.arange(3.0), np.ones(2, np.int32)), "items": [np.zeros(1)],
             "step": 7}
    Checkpoint(s=state).write(tmp_path / "c")

    template = {"opt": tx.init(_params(1)), "none": None, "empty": {}, "nothing": (),
                "pair": Pair(np.zeros(3), np.zeros(2, np.int32)), "items": [np.ones(1)],
                "step": 0}
    fresh = Checkpoint(s=template)
    fresh.read(tmp_path / "c").assert_consumed()
    assert fresh.s is template  # the dict is filled, its immutable values replaced
    _same_tree(template, state)
    assert template["step"] == 7 and template["none"] is None and template["empty"] == {}
    assert _bits(template) == _bits(state)


def test_a_tuple_of_numpy_arrays_is_restored_in_place(tmp_path):
    Checkpoint(pair=Pair(np.arange(3.0), np.arange(2, dtype=np.int32)), plain=(np.ones(2),),
               items=[np.full(2, 5.0)], nothing=None).write(tmp_path / "c")

    pair, plain = Pair(np.zeros(3), np.zeros(2, np.int32)), (np.zeros(2),)
    fresh = Checkpoint(pair=pair, plain=plain, items=[np.zeros(2)], nothing=None)
    fresh.read(tmp_path / "c").assert_consumed()
    assert fresh.pair is pair and fresh.plain is plain  # nothing to replace: the same tuples
    assert pair.first.tolist() == [0.0, 1.0, 2.0] and pair.second.tolist() == [0, 1]
    assert plain[0].tolist() == [1.0, 1.0] and fresh.items[0].tolist() == [5.0, 5.0]
    assert fresh.nothing is None


def test_a_recorded_namedtuple_wins_over_a_plain_template_and_stands_in_when_not_imported(
        tmp_path):
    Checkpoint(pair=Pair(np.arange(3.0), np.ones(2))).write(tmp_path / "c")
    fresh = Checkpoint(pair=(np.zeros(3), np.zeros(2)))
    fresh.read(tmp_path / "c").assert_consumed()
    assert type(fresh.pair) is Pair and fresh.pair.first.tolist() == [0.0, 1.0, 2.0]

    layout = _layout({"pair": {"kind": "tree", "tree": {
        "t": [{"x": "pair/0", "k": "numpy"}, {"x": "pair/1", "k": "numpy"}],
        "nt": ["no_such_module_here:Point", ["x", "y"]]}}})
    shardkit.save(tmp_path / "d", {"pair/0": np.ones(1), "pair/1": np.zeros(1),
                                   "save_counter": np.array(0)}, metadata=layout)
    fresh = Checkpoint(pair=None)
    fresh.read(tmp_path / "d").assert_consumed()
    assert "no_such_module_here" not in sys.modules  # looked up, never imported
    assert type(fresh.pair).__name__ == "Point" and fresh.pair._fields == ("x", "y")
    assert fresh.pair.x.tolist() == [1.0] and fresh.pair.y.tolist() == [0.0]


def _layout(objects: dict) -> dict:
    return {"shardkit.checkpoint": {"version": 1, "objects": objects}}


def test_a_checkpoint_of_the_old_skeleton_restores_into_a_namedtuple_template(tmp_path):
    # as Checkpoint wrote an optax state before NamedTuples were recorded: a plain tuple
    moment = [{"d": [["w", {"x": f"opt/0/{i}/w", "k": "jax"}]]} for i in (1, 2)]
    old = {"t": [{"t": [{"x": "opt/0/0", "k": "jax"}, *moment]}, {"t": []}]}
    stored = {"opt/0/0": np.array(3, np.int32), "opt/0/1/w": np.full(2, 0.5, np.float32),
              "opt/0/2/w": np.full(2, 0.25, np.float32), "save_counter": np.array(4)}
    shardkit.save(tmp_path / "c", stored, metadata=_layout({"opt": {"kind": "tree",
                                                                    "tree": old}}))
    tx = optax.adam(1e-2)
    template = tx.init({"w": jnp.zeros(2)})
    fresh = Checkpoint(opt=template)
    fresh.read(tmp_path / "c").assert_consumed()
    _same_tree(fresh.opt, template)
    assert int(fresh.opt[0].count) == 3 and fresh.opt[0].nu["w"].tolist() == [0.25, 0.25]
    assert fresh.save_counter == 4

    plain = Checkpoint(opt=((jnp.zeros((), jnp.int32), {"w": jnp.zeros(2)},
                             {"w": jnp.zeros(2)}), ()))
    plain.read(tmp_path / "c").assert_consumed()  # a plain template: plain tuples, as stored
    assert type(plain.opt) is tuple and type(plain.opt[0]) is tuple


def test_a_malformed_namedtuple_record_is_refused_naming_the_key(tmp_path):
    for bad, why in (([1, 2], "needs"), (["m:Point", ["x"]], r"1 field names|needs")):
        layout = _layout({"pair": {"kind": "tree", "tree": {
            "t": [{"x": "pair/0", "k": "numpy"}, {"x": "pair/1", "k": "numpy"}], "nt": bad}}})
        path = tmp_path / str(len(os.listdir(tmp_path)))
        shardkit.save(path, {"pair/0": np.ones(1), "pair/1": np.zeros(1)}, metadata=layout)
        with pytest.raises(CorruptIndexError, match=f"namedtuple at 'pair'.*{why}"):
            Checkpoint(pair=None).read(path)


def test_what_cannot_be_tracked_is_refused_and_a_leaf_mismatch_names_its_key(tmp_path):
    with pytest.raises(InvalidArgumentTypeError, match=r"cannot track a set; pass .*NamedTuple"):
        Checkpoint(bad={1, 2})
    with pytest.raises(InvalidArgumentTypeError, match=r"'s/0': cannot checkpoint a set"):
        Checkpoint(s=({1},)).write(tmp_path / "x")
    tx = optax.adam(1e-2)
    Checkpoint(opt=tx.init(_params(0))).write(tmp_path / "c")
    wrong = tx.init({"w": jnp.zeros((3, 4)), "b": jnp.zeros(3)})
    with pytest.raises(RestoreMismatchError, match=r"'opt/0/1/w'.*shape \[4, 3\].*shape \[3, 4\]"):
        Checkpoint(opt=wrong).read(tmp_path / "c")


def test_a_manager_saves_an_optax_state_async_and_restores_it_into_a_fresh_checkpoint(tmp_path):
    tx = optax.adamw(1e-2)
    state = jax.tree.map(lambda a: a + 2, tx.init(_params(0)))
    manager = CheckpointManager(Checkpoint(opt=state), tmp_path / "run", max_to_keep=1)
    manager.save(checkpoint_number=3, options=CheckpointOptions(enable_async=True))
    manager.sync()

    template = tx.init(_params(1))
    fresh = CheckpointManager(Checkpoint(opt=template), tmp_path / "run", max_to_keep=1)
    assert fresh.restore_or_initialize() == str(tmp_path / "run" / "ckpt-3")
    _same_tree(fresh.checkpoint.opt, state)
    assert _bits(fresh.checkpoint.opt) == _bits(state)


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.relu(nn.Dense(8)(x)))


def test_a_flax_mlp_with_adam_resumes_bit_identically_from_a_fresh_checkpoint(tmp_path):
    model, tx = _MLP(), optax.adam(1e-2)
    xs = [jax.random.normal(jax.random.PRNGKey(i), (16, 4)) for i in range(8)]
    ys = [jnp.sum(x, axis=1, keepdims=True) for x in xs]

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(p):
            return jnp.mean((model.apply({"params": p}, x) - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def run(params, opt_state, batches):
        losses = []
        for x, y in batches:
            params, opt_state, loss = step(params, opt_state, x, y)
            losses.append(np.asarray(loss).tobytes())
        return params, opt_state, losses

    params = model.init(jax.random.PRNGKey(0), xs[0])["params"]
    batches = list(zip(xs, ys))
    _, _, whole = run(params, tx.init(params), batches)

    params, opt_state, first = run(params, tx.init(params), batches[:4])
    Checkpoint(params=params, opt_state=opt_state).write(tmp_path / "c")

    other = model.init(jax.random.PRNGKey(1), xs[0])["params"]
    fresh = Checkpoint(params=other, opt_state=tx.init(other))
    fresh.read(tmp_path / "c").assert_consumed()
    _same_tree(fresh.opt_state, opt_state)
    _same_tree(fresh.params, params)
    _, _, rest = run(fresh.params, fresh.opt_state, batches[4:])
    assert first + rest == whole

    # flax's state dicts: adam's EmptyState is the empty dict under "1", which comes back too
    state_dict = serialization.to_state_dict({"params": params, "opt_state": opt_state})
    Checkpoint(state=state_dict).write(tmp_path / "d")
    target = {"params": other, "opt_state": tx.init(other)}
    fresh = Checkpoint(state=serialization.to_state_dict(target))
    fresh.read(tmp_path / "d").assert_consumed()
    assert fresh.state["opt_state"]["1"] == {}
    back = serialization.from_state_dict(target, fresh.state)
    _same_tree(back, {"params": params, "opt_state": opt_state})
    assert _bits(back) == _bits({"params": params, "opt_state": opt_state})


_SHARDED = """
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from shardkit.training.checkpoint import Checkpoint, CheckpointManager, CheckpointOptions
mesh = Mesh(np.array(jax.devices()), ("x",))
rows, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
def params(seed):
    w = jax.random.normal(jax.random.PRNGKey(seed), (4, 3))
    return {"w": jax.device_put(w, rows), "b": jax.device_put(jnp.ones(3) * seed, whole)}
tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
state = jax.jit(tx.init)(params(0))
Checkpoint(opt=state, params=params(0)).write(PATH)
template = jax.tree.map(lambda a: jax.device_put(a, rows) if a.ndim == 2 else a,
                       tx.init(params(1)))
fresh = Checkpoint(opt=template, params=params(1))
fresh.read(PATH).assert_consumed()
assert jax.tree.structure(fresh.opt) == jax.tree.structure(state)
for a, b, c in zip(jax.tree.leaves(fresh.opt), jax.tree.leaves(template), jax.tree.leaves(state)):
    assert a.sharding == b.sharding and a.dtype == b.dtype, (a.sharding, b.sharding)
    assert np.asarray(a).tobytes() == np.asarray(c).tobytes()
assert fresh.params["w"].sharding == rows and len(fresh.params["w"].addressable_shards) == 2
assert np.asarray(fresh.params["w"]).tobytes() == np.asarray(params(0)["w"]).tobytes()
assert fresh.opt[1][0].mu["w"].sharding == rows and fresh.opt[1][0].nu["b"].sharding == whole
print("ok")
"""


def test_sharded_jax_arrays_come_back_with_their_template_shardings(tmp_path):
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
                   [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    code = f"PATH = {json.dumps(str(tmp_path / 'c'))}\n" + textwrap.dedent(_SHARDED)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok"]
