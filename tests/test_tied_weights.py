"""Tensors of one memory (tied weights) are stored once: the other names are aliases in the
manifest (docs/FORMAT.md, "Aliases"); every reader gives every name back, HuggingFace's and
accelerate's loaders read the shards as they read HuggingFace's own saves."""

from __future__ import annotations

import json

import distributed as harness  # tests/distributed.py
import numpy as np
import pytest

import shardkit
from shardkit.errors import CorruptIndexError, DistributedSaveError
from shardkit.io.snapshot import HostBufferPool
from shardkit.values.sharing import shared_rows

MANIFEST = "model.safetensors.index.json"


def _manifest(path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def _entries(path) -> list[str]:
    """The entry names of every shard of the checkpoint at `path`, as safetensors reads them."""
    from safetensors import safe_open

    names = []
    for file in sorted(set(_manifest(path)["weight_map"].values())):
        with safe_open(str(path / file), "np") as f:
            names += list(f.keys())
    return names


def _tied() -> dict:
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    return {"emb": w, "bias": np.ones(3), "head": w, "view": w[:], "nested": {"again": w}}


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_one_memory_is_stored_once_and_every_name_reads_back(tmp_path, compression):
    state = _tied()
    opts = shardkit.CheckpointOptions(compression=compression)
    shardkit.save(tmp_path / "c", state, options=opts)
    doc = _manifest(tmp_path / "c")
    assert doc["shardkit"]["tensors"]["key"] == ["emb", "bias"]
    assert doc["shardkit"]["aliases"] == {"key": ["head", "view", "nested/again"],
                                          "of": ["emb", "emb", "emb"]}
    assert doc["metadata"]["total_size"] == 12 * 4 + 3 * 8  # HuggingFace's: stored bytes
    if compression is None:
        assert sorted(doc["weight_map"]) == ["bias", "emb"]
        assert sorted(_entries(tmp_path / "c")) == ["bias", "emb"]
    back = shardkit.load(tmp_path / "c")
    assert list(back) == ["emb", "bias", "head", "view", "nested/again"]
    for key in ("head", "view", "nested/again"):
        assert back[key] is back["emb"]  # one memory, as saved
    np.testing.assert_array_equal(back["head"], state["emb"])
    some = shardkit.load(tmp_path / "c", keys=["head", "bias"])
    assert list(some) == ["head", "bias"]
    np.testing.assert_array_equal(some["head"], state["emb"])
    both = shardkit.load(tmp_path / "c", keys=["head", "emb"])
    assert both["head"] is both["emb"]
    with shardkit.open(tmp_path / "c") as r:
        assert len(r) == 5 and "head" in r and "nested/again" in r
        assert list(r) == r.keys() == ["emb", "bias", "head", "view", "nested/again"]
        np.testing.assert_array_equal(r["view"], state["emb"])
        np.testing.assert_array_equal(r.get_slice("head", (1, slice(None, 2))), [4.0, 5.0])
        assert r.info("head").key == "head" and r.info("head").shape == (3, 4)
        assert r.verify(["head"]) >= 0
    assert shardkit.load(tmp_path / "c", nested=True)["nested"]["again"].shape == (3, 4)
    targets = {k: np.zeros_like(v) for k, v in shardkit.load(tmp_path / "c").items()}
    status = shardkit.restore_into(tmp_path / "c", targets)
    assert not status.missing_keys and not status.unexpected_keys
    for key in ("emb", "head", "view", "nested/again"):
        np.testing.assert_array_equal(targets[key], state["emb"])


def test_overlapping_views_and_empty_arrays_are_stored_as_they_are(tmp_path):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    empty = np.zeros((0, 4), np.float32)
    state = {"w": w, "rows": w[1:], "t": w.T, "first": w[0], "bytes": w.view(np.int32),
             "e1": empty, "e2": empty, "e3": w[:0],
             "yes": np.True_, "again": np.True_}  # numpy's one True: a value, not a memory
    shardkit.save(tmp_path / "c", state)
    doc = _manifest(tmp_path / "c")
    assert "aliases" not in doc["shardkit"]
    assert doc["shardkit"]["tensors"]["key"] == list(state)
    back = shardkit.load(tmp_path / "c")
    for key, value in state.items():
        np.testing.assert_array_equal(back[key], value)


def test_shared_rows_compares_address_dtype_shape_strides_and_spec():
    w = np.zeros((4, 4), np.float32)
    assert shared_rows([w, w[:], w.reshape(4, 4), w[1:], w.T, w.view(np.int32)]) == {1: 0, 2: 0}
    assert shared_rows([w, w], ["4 4 0,2:0,4", "4 4 2,2:0,4"]) == {}
    assert shared_rows([w, np.ones(3), w], ["", "", ""]) == {2: 0}
    assert shared_rows([]) == shared_rows([w]) == {}


def test_the_callback_sees_the_stored_tensors_only(tmp_path):
    seen = []

    class Record(shardkit.ShardingCallback):
        description = "records what it is given"

        def __call__(self, shardable_tensors):
            seen.extend(t.checkpoint_key for t in shardable_tensors)
            return [{t.checkpoint_key: {t.slice_spec: t.tensor} for t in shardable_tensors}]

    shardkit.save(tmp_path / "c", _tied(),
                  options=shardkit.CheckpointOptions(experimental_sharding_callback=Record()))
    assert seen == ["emb", "bias"]
    assert list(shardkit.load(tmp_path / "c")) == ["emb", "bias", "head", "view", "nested/again"]


def test_a_tensorflow_bundle_stores_every_name(tmp_path):
    pytest.importorskip("tensorflow")
    import tensorflow as tf

    state = _tied()
    shardkit.save(str(tmp_path / "b"), state, format="tensorflow")
    reader = tf.train.load_checkpoint(str(tmp_path / "b"))
    for key in ("emb", "head", "view", "nested/again"):
        np.testing.assert_array_equal(reader.get_tensor(key), state["emb"])


def test_an_async_snapshot_copies_one_memory_once(tmp_path):
    pool = HostBufferPool()
    state = _tied()
    copy = pool.snapshot([("emb", state["emb"]), ("bias", state["bias"]),
                          ("head", state["head"]), ("view", state["view"])])
    assert copy["head"] is copy["emb"] is copy["view"]
    assert copy["emb"] is not state["emb"]
    np.testing.assert_array_equal(copy["head"], state["emb"])
    assert pool.nbytes == 12 * 4 + 3 * 8
    again = pool.snapshot([("head", state["head"]), ("emb", state["emb"])])
    assert again["head"] is again["emb"] and pool.nbytes == 12 * 4  # the tie, not its name
    shardkit.save(tmp_path / "c", copy)
    assert _manifest(tmp_path / "c")["shardkit"]["aliases"] == {"key": ["head", "view"],
                                                                "of": ["emb", "emb"]}


# -- torch and HuggingFace


def _gpt2():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                     n_positions=16, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config), config


def _same_weights(a, b) -> bool:
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_gpt2_tied_weights_load_in_huggingface_safetensors_and_accelerate(tmp_path):
    import torch

    model, config = _gpt2()
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    shardkit.save(tmp_path / "g", model)  # the module's state_dict()
    config.save_pretrained(tmp_path / "g")
    doc = _manifest(tmp_path / "g")
    assert doc["shardkit"]["aliases"] == {"key": ["lm_head.weight"],
                                          "of": ["transformer.wte.weight"]}
    assert "lm_head.weight" not in doc["weight_map"]
    assert "lm_head.weight" not in _entries(tmp_path / "g")

    from safetensors.torch import load_model

    fresh, _ = _gpt2()
    torch.nn.init.zeros_(fresh.transformer.wte.weight)
    (shard,) = set(doc["weight_map"].values())
    missing, unexpected = load_model(fresh, str(tmp_path / "g" / shard), strict=True)
    assert not missing and not unexpected and _same_weights(fresh, model)

    import transformers

    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "g")
    assert _same_weights(loaded, model)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()

    accelerate = pytest.importorskip("accelerate")
    other, _ = _gpt2()
    torch.nn.init.zeros_(other.transformer.wte.weight)
    accelerate.load_checkpoint_in_model(other, str(tmp_path / "g"))
    assert _same_weights(other, model)

    back = shardkit.load(tmp_path / "g", framework="torch")
    assert back["lm_head.weight"].data_ptr() == back["transformer.wte.weight"].data_ptr()
    mapped = shardkit.load(tmp_path / "g", map_location="cpu")
    assert mapped["lm_head.weight"].data_ptr() == mapped["transformer.wte.weight"].data_ptr()
    strict, _ = _gpt2()
    strict.load_state_dict(back, strict=True)
    assert _same_weights(strict, model)
    target, _ = _gpt2()
    torch.nn.init.zeros_(target.transformer.wte.weight)
    status = shardkit.restore_into(tmp_path / "g", target)  # a module: its state_dict()
    assert not status.missing_keys and not status.unexpected_keys
    assert _same_weights(target, model)


def test_a_tied_model_and_its_optimizer_resume_from_a_nested_load(tmp_path):
    import torch

    model, _ = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 100, (2, 8))
    model(ids, labels=ids).loss.backward()
    opt.step()
    shardkit.save(tmp_path / "c", {"model": model.state_dict(), "optim": opt.state_dict()})
    back = shardkit.load(tmp_path / "c", framework="torch", nested=True)
    again, _ = _gpt2()
    again.load_state_dict(back["model"], strict=True)
    assert _same_weights(again, model)
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-3)
    opt2.load_state_dict(back["optim"])
    for m, o in ((model, opt), (again, opt2)):
        o.zero_grad()
        m(ids, labels=ids).loss.backward()
        o.step()
    assert _same_weights(again, model)


# -- many ranks


def _collective_tied(rank: int, world: int, path: str, tie_on_rank_1: bool) -> None:
    import torch.distributed as dist

    w = np.full((2, 3), 1.0 + rank, np.float32)
    state = {f"own{rank}": w, f"tied{rank}": w, "common": np.arange(4.0),
             "common_tied": None}
    state["common_tied"] = state["common"] if (rank == 0 or tie_on_rank_1) else np.arange(4.0)
    shardkit.save(path, state, process_group=dist.group.WORLD)


def test_a_collective_save_stores_each_ranks_tied_tensors_once(tmp_path):
    harness.raise_any(harness.run_ranks(_collective_tied, 2, str(tmp_path / "c"), True,
                                        timeout=120))
    doc = _manifest(tmp_path / "c")
    aliases = dict(zip(doc["shardkit"]["aliases"]["key"], doc["shardkit"]["aliases"]["of"]))
    assert aliases == {"tied0": "own0", "common_tied": "common", "tied1": "own1"}
    assert sorted(doc["shardkit"]["tensors"]["key"]) == ["common", "own0", "own1"]
    back = shardkit.load(tmp_path / "c")
    assert back["tied1"] is back["own1"]
    np.testing.assert_array_equal(back["tied1"], np.full((2, 3), 2.0))
    np.testing.assert_array_equal(back["common_tied"], np.arange(4.0))


def test_a_tensor_tied_on_one_rank_only_fails_every_rank(tmp_path):
    results = harness.run_ranks(_collective_tied, 2, str(tmp_path / "c"), False, timeout=120)
    for got in results:
        assert isinstance(got, DistributedSaveError), got
        assert "'common_tied' is the memory of 'common' on rank 0" in str(got)
    assert not (tmp_path / "c").exists()


# -- hostile manifests


def _rewrite(path, aliases) -> None:
    doc = _manifest(path)
    doc["shardkit"]["aliases"] = aliases
    (path / MANIFEST).write_text(json.dumps(doc))


@pytest.mark.parametrize("aliases, message", [
    ([["head", "emb"]], "shardkit.aliases must be a JSON object"),
    ({"of": ["emb"]}, "missing field shardkit.aliases.key"),
    ({"key": ["head"]}, "missing field shardkit.aliases.of"),
    ({"key": "head", "of": ["emb"]}, "shardkit.aliases.key must be list"),
    ({"key": [1], "of": ["emb"]}, "shardkit.aliases.key must be a list of strings"),
    ({"key": ["head"], "of": [None]}, "shardkit.aliases.of must be a list of strings"),
    ({"key": ["head", "x"], "of": ["emb"]}, "has 1 values, expected 2 (one per alias)"),
    ({"key": ["head", "head"], "of": ["emb", "emb"]}, "head"),
    ({"key": [""], "of": ["emb"]}, "empty string"),
    ({"key": ["__metadata__"], "of": ["emb"]}, "__metadata__"),
    ({"key": ["bias"], "of": ["emb"]}, "'bias' is both an alias and a stored tensor"),
    ({"key": ["head"], "of": ["nothing"]}, "alias 'head' names 'nothing', which is not a tensor"),
    ({"key": ["head", "view"], "of": ["emb", "head"]}, "alias 'view' names 'head'"),
])
def test_a_manifest_with_bad_aliases_is_refused(tmp_path, aliases, message):
    shardkit.save(tmp_path / "c", _tied())
    _rewrite(tmp_path / "c", aliases)
    with pytest.raises(CorruptIndexError) as info:
        shardkit.open(tmp_path / "c")
    assert message in str(info.value)
    assert str(tmp_path / "c") in str(info.value)


def test_a_structure_record_may_place_an_alias(tmp_path):
    state = {"model": [np.ones(2), None], "again": None}
    state["again"] = state["model"][0]
    shardkit.save(tmp_path / "c", state)
    assert _manifest(tmp_path / "c")["shardkit"]["aliases"] == {"key": ["again"],
                                                                "of": ["model/0"]}
    back = shardkit.load(tmp_path / "c", nested=True)
    assert back["model"][1] is None and back["again"] is back["model"][0]


def test_one_framework_object_under_two_keys_is_stored_once(tmp_path):
    """The very same object (a TensorFlow variable reached from a model and its optimizer, a
    torch tensor) is one memory whatever its device: converted once, stored once."""
    tf = pytest.importorskip("tensorflow")
    import torch

    v = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
    t = torch.arange(4.0)
    shardkit.save(tmp_path / "c", {"model": {"v": v, "t": t}, "opt": {"v": v, "t": t[:]}})
    doc = _manifest(tmp_path / "c")
    assert doc["shardkit"]["tensors"]["key"] == ["model/v", "model/t"]
    assert doc["shardkit"]["aliases"] == {"key": ["opt/v", "opt/t"], "of": ["model/v", "model/t"]}
    back = shardkit.load(tmp_path / "c")
    np.testing.assert_array_equal(back["opt/v"], v.numpy())
    np.testing.assert_array_equal(back["opt/t"], t.numpy())
