"""`restore_into` of JAX pytrees: jax arrays cannot change in place, so the status carries the
restored tree (same structure, dtypes and shardings), and an optax training loop resumes
bit-identically from it."""

from __future__ import annotations

import numpy as np
import pytest

import shardkit
from shardkit.errors import IncompleteRestoreError, RestoreMismatchError

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")


def _params(seed: int) -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"dense": {"w": jax.random.normal(k1, (4, 3)), "b": jnp.zeros(3)},
            "scale": jax.random.normal(k2, (3,)).astype(jnp.bfloat16)}


def _loss(params, x):
    y = x @ params["dense"]["w"] + params["dense"]["b"]
    return jnp.mean((y * params["scale"].astype(jnp.float32)) ** 2)


def _step(tx, params, opt_state, x):
    grads = jax.grad(_loss)(params, x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _bits(tree) -> list[bytes]:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


def test_an_optax_loop_resumes_bit_identically(tmp_path):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))  # holds an EmptyState
    xs = [jax.random.normal(jax.random.PRNGKey(i), (8, 4)) for i in range(6)]
    params = _params(0)
    opt_state = tx.init(params)
    for x in xs[:3]:
        params, opt_state = _step(tx, params, opt_state, x)
    shardkit.save(tmp_path / "c", {"params": params, "opt_state": opt_state})
    whole_params, whole_state = params, opt_state
    for x in xs[3:]:
        whole_params, whole_state = _step(tx, whole_params, whole_state, x)

    fresh = _params(1)
    template = {"params": fresh, "opt_state": tx.init(fresh)}
    status = shardkit.restore_into(tmp_path / "c", template)
    status.assert_consumed()
    got = status.state
    assert jax.tree.structure(got) == jax.tree.structure(template)
    assert _bits(got) == _bits({"params": params, "opt_state": opt_state})
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(template)):
        assert isinstance(a, jax.Array) and a.dtype == b.dtype and a.sharding == b.sharding
    assert _bits(template["params"]) == _bits(fresh)  # the template itself is left as it was
    p, s = got["params"], got["opt_state"]
    for x in xs[3:]:
        p, s = _step(tx, p, s, x)  # tx.update takes the restored state as its own
    assert _bits(p) == _bits(whole_params) and _bits(s) == _bits(whole_state)


def test_a_template_that_does_not_match_is_refused(tmp_path):
    params = _params(0)
    shardkit.save(tmp_path / "c", {"params": params})
    bad = _params(0)
    bad["dense"]["w"] = jnp.zeros((3, 4))
    with pytest.raises(RestoreMismatchError, match=r"key 'params/dense/w'.*shape \[4, 3\]"):
        shardkit.restore_into(tmp_path / "c", {"params": bad})
    extra = dict(_params(0), more=jnp.ones(2))
    with pytest.raises(IncompleteRestoreError, match="'params/more'"):
        shardkit.restore_into(tmp_path / "c", {"params": extra})
    status = shardkit.restore_into(tmp_path / "c", {"params": extra}, partial=True)
    assert status.missing_keys == ["params/more"]
    assert np.asarray(status.state["params"]["more"]).tolist() == [1.0, 1.0]


def test_numpy_and_torch_targets_keep_their_status(tmp_path):
    shardkit.save(tmp_path / "c", {"w": np.arange(3.0)})
    target = {"w": np.zeros(3)}
    assert shardkit.restore_into(tmp_path / "c", target).state is None
    assert target["w"].tolist() == [0.0, 1.0, 2.0]
