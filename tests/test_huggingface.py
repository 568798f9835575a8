"""A checkpoint `shardkit.save` writes with the default options is a HuggingFace sharded
safetensors checkpoint as it stands (docs/FORMAT.md section 1.1): transformers' `from_pretrained`,
huggingface_hub's loaders and `safetensors` read it, bit for bit. Real models, built from tiny
configs (nothing is downloaded)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch (test dependency) is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
huggingface_hub = pytest.importorskip("huggingface_hub", reason="huggingface_hub not installed")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors not installed")

import shardkit  # noqa: E402
from shardkit import format as fmt  # noqa: E402
from shardkit.sharding.policies import (  # noqa: E402
    AllInOnePolicy,
    BalancedPolicy,
    BinPackPolicy,
    MaxShardSizePolicy,
    ShardByTaskPolicy,
)
from shardkit.tools.cli import main  # noqa: E402


def _bert():
    config = transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=48,
                                     max_position_embeddings=40, type_vocab_size=2)
    return transformers.BertModel, config


def _gpt2():  # tie_word_embeddings: lm_head.weight is transformer.wte.weight
    config = transformers.GPT2Config(vocab_size=80, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=2, tie_word_embeddings=True)
    return transformers.GPT2LMHeadModel, config


def _llama():
    config = transformers.LlamaConfig(vocab_size=112, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM, config


MODELS = {"bert": _bert, "gpt2-tied": _gpt2, "llama": _llama}


def _model(name: str, seed: int = 0):
    cls, config = MODELS[name]()
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # no parameter left at an initial constant: equality means something
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return cls, config, model


def _save(path: Path, model, config, sharding_callback=None) -> shardkit.SaveInfo:
    with warnings.catch_warnings():
        warnings.simplefilter("error", shardkit.SplitTensorsWarning)  # whole tensors only
        info = shardkit.save(path, model.state_dict(), options=shardkit.CheckpointOptions(
            durable=False, experimental_sharding_callback=sharding_callback))
    config.save_pretrained(path)
    return info


def _assert_same_weights(loaded, model) -> None:
    want, got = model.state_dict(), loaded.state_dict()
    assert list(got) == list(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


def _manifest(path: Path) -> dict:
    return json.loads((path / fmt.MANIFEST_FILE).read_text())


@pytest.mark.parametrize("name", list(MODELS))
def test_from_pretrained_loads_a_default_checkpoint_bit_exact(tmp_path, name):
    cls, config, model = _model(name)
    info = _save(tmp_path / "ckpt", model, config)
    assert info.files == ("model-00001-of-00001.safetensors", fmt.MANIFEST_FILE)
    loaded, loading = cls.from_pretrained(tmp_path / "ckpt", output_loading_info=True)
    assert loading["missing_keys"] == set() and loading["unexpected_keys"] == set()
    assert loading["mismatched_keys"] == set() and not loading["error_msgs"]
    _assert_same_weights(loaded, model)
    for (key, p), (_, q) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(p, q), key
    manifest = _manifest(tmp_path / "ckpt")
    aliases = manifest["shardkit"].get("aliases", {"key": []})["key"]
    assert aliases == (["lm_head.weight"] if name == "gpt2-tied" else [])  # stored once
    stored = {k: t for k, t in model.state_dict().items() if k not in aliases}
    assert manifest["weight_map"] == dict.fromkeys(stored, info.files[0])
    assert manifest["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in stored.values())
    assert not (tmp_path / "ckpt" / "index.json").exists()  # one manifest


def test_tied_gpt2_weights_are_saved_once_and_load_tied(tmp_path):
    """`state_dict()` holds a tied weight under both of its keys (the same tensor); shardkit
    stores it once, as HuggingFace's own save_pretrained does, and `load` gives both keys
    (tests/test_tied_weights.py). from_pretrained finds none missing or unexpected, and ties
    them again."""
    cls, config, model = _model("gpt2-tied")
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    _save(tmp_path / "ckpt", model, config)
    stored = shardkit.load(tmp_path / "ckpt")
    assert {"lm_head.weight", "transformer.wte.weight"} <= stored.keys()
    assert (stored["lm_head.weight"] == stored["transformer.wte.weight"]).all()
    loaded, loading = cls.from_pretrained(tmp_path / "ckpt", output_loading_info=True)
    assert loading["missing_keys"] == set() and loading["unexpected_keys"] == set()
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    _assert_same_weights(loaded, model)
    ids = torch.arange(10).reshape(1, 10)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_default_multi_shard_checkpoint_loads_in_from_pretrained(tmp_path):
    cls, config, model = _model("llama")
    policy = shardkit.DefaultShardingPolicy(max_shard_size=20_000)  # several shards
    info = _save(tmp_path / "ckpt", model, config, sharding_callback=policy)
    shards = info.files[:-1]
    n = len(shards)
    assert n >= 3 and info.files[-1] == fmt.MANIFEST_FILE
    assert list(shards) == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(_manifest(tmp_path / "ckpt")["weight_map"].values()) == set(shards)
    loaded, loading = cls.from_pretrained(tmp_path / "ckpt", output_loading_info=True)
    assert loading["missing_keys"] == set() and loading["unexpected_keys"] == set()
    _assert_same_weights(loaded, model)


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_huggingface_hub_loads_the_checkpoint(tmp_path, name):
    cls, config, model = _model(name)
    _save(tmp_path / "ckpt", model, config,
          sharding_callback=shardkit.DefaultShardingPolicy(max_shard_size=30_000))
    fresh = cls(config)
    result = huggingface_hub.load_torch_model(fresh, tmp_path / "ckpt", strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    _assert_same_weights(fresh, model)
    merged = {}
    for shard in sorted(set(_manifest(tmp_path / "ckpt")["weight_map"].values())):
        merged.update(huggingface_hub.load_state_dict_from_file(tmp_path / "ckpt" / shard))
    assert merged.keys() == model.state_dict().keys()


def test_safetensors_reads_every_shard_bit_exact(tmp_path):
    _, config, model = _model("llama")
    info = _save(tmp_path / "ckpt", model, config,
                 sharding_callback=shardkit.DefaultShardingPolicy(max_shard_size=25_000))
    want = model.state_dict()
    seen = {}
    from safetensors import safe_open

    for shard in info.files[:-1]:
        part = safetensors_torch.load_file(tmp_path / "ckpt" / shard)
        assert not seen.keys() & part.keys()
        seen.update(part)
        with safe_open(tmp_path / "ckpt" / shard, "pt") as f:
            assert f.metadata() == {"format": "pt", "shardkit": fmt.FORMAT_VERSION,
                                    "generation": info.generation}
    assert seen.keys() == want.keys()
    for key, tensor in want.items():
        assert seen[key].dtype == tensor.dtype and torch.equal(seen[key], tensor), key


@pytest.mark.parametrize("policy", [ShardByTaskPolicy(), AllInOnePolicy()],
                         ids=["by-task", "all-in-one"])
def test_policies_that_keep_tensors_whole_write_huggingface_checkpoints(tmp_path, policy):
    cls, config, model = _model("bert")
    _save(tmp_path / "ckpt", model, config, sharding_callback=policy)  # no warning
    loaded, loading = cls.from_pretrained(tmp_path / "ckpt", output_loading_info=True)
    assert loading["missing_keys"] == set() and loading["unexpected_keys"] == set()
    _assert_same_weights(loaded, model)


@pytest.mark.parametrize("policy", [MaxShardSizePolicy(4096), BinPackPolicy(4096),
                                    BalancedPolicy(20)], ids=["max-shard-size", "bin-pack",
                                                             "balanced"])
def test_a_splitting_policy_warns_once_naming_the_count_and_a_key(tmp_path, policy):
    _, _, model = _model("bert")
    state = model.state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = shardkit.save(tmp_path / "ckpt", state,
                             options=shardkit.CheckpointOptions(
                                 experimental_sharding_callback=policy, durable=False))
    manifest = _manifest(tmp_path / "ckpt")
    split = [k for k in state if k not in manifest["weight_map"]]
    assert split, "the policy was expected to split something at this size"
    (warning,) = caught
    assert warning.category is shardkit.SplitTensorsWarning
    assert issubclass(shardkit.SplitTensorsWarning, UserWarning)
    assert warning.filename == __file__  # points at the caller of save
    message = str(warning.message)
    assert message.startswith(f"{info.path}: the sharding callback stored {len(split)} tensor")
    assert repr(split[0]) in message and "weight_map" in message
    assert "DefaultShardingPolicy, ShardByTaskPolicy and AllInOnePolicy" in message
    restored = shardkit.load(tmp_path / "ckpt")  # shardkit itself reads them as usual
    assert all(torch.equal(torch.from_numpy(restored[k]), v) for k, v in state.items())


def test_checkpoint_objects_do_not_warn_about_split_tensors(tmp_path):
    """Checkpoint / CheckpointManager keys are object paths no HuggingFace loader reads."""
    _, _, model = _model("bert")
    opts = shardkit.CheckpointOptions(experimental_sharding_callback=MaxShardSizePolicy(4096),
                                      durable=False)
    manager = shardkit.CheckpointManager(shardkit.Checkpoint(model=model), tmp_path, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", shardkit.SplitTensorsWarning)
        path = manager.save(options=opts)
    assert manager.latest_checkpoint == path
    with shardkit.open(path) as r:
        assert any(r.info(k).is_split for k in r.keys())


def test_overwrite_never_replaces_a_huggingface_save_pretrained_directory(tmp_path):
    _, _, model = _model("bert")
    model.save_pretrained(tmp_path / "hf")  # transformers' own format
    before = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "model.safetensors" in before
    with pytest.raises(shardkit.CheckpointExistsError, match=r"hf exists, is not empty and "
                       r"holds no shardkit model\.safetensors\.index\.json"):
        shardkit.save(tmp_path / "hf", model.state_dict(), overwrite=True,
                      options=shardkit.CheckpointOptions(durable=False))
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == before
    # a sharded HuggingFace checkpoint has a model.safetensors.index.json, not shardkit's
    model.save_pretrained(tmp_path / "hf-sharded", max_shard_size="20KB")
    assert (tmp_path / "hf-sharded" / fmt.MANIFEST_FILE).exists()
    with pytest.raises(shardkit.CheckpointExistsError, match="holds no shardkit"):
        shardkit.save(tmp_path / "hf-sharded", model.state_dict(), overwrite=True)
    assert len(list((tmp_path / "hf-sharded").glob("model-*.safetensors"))) > 1


# --- one truth for every reader: weight_map must agree with shardkit's section -----------------


def _numpy_state():
    import numpy as np

    text = np.empty(2, object)
    text[:] = [b"x", b"yz"]
    return {"a": np.arange(64, dtype=np.float32), "b": np.arange(64, dtype=np.int8),
            "c": np.ones((4, 4), np.float64), "split": np.arange(300, dtype=np.int16),
            "text": text}


@pytest.fixture
def split_brain(tmp_path):
    """A checkpoint of two shards (whole tensors in both), one split tensor and a string
    tensor, its weight_map, and another checkpoint of the same keys and other values."""
    state = _numpy_state()
    path, other = tmp_path / "ckpt", tmp_path / "other"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", shardkit.SplitTensorsWarning)
        shardkit.save(path, state,
                      options=shardkit.CheckpointOptions(
                          experimental_sharding_callback=BinPackPolicy(256), durable=False))
        shardkit.save(other, {k: v[::-1].copy() for k, v in state.items()},
                      options=shardkit.CheckpointOptions(
                          experimental_sharding_callback=BinPackPolicy(256), durable=False))
    weight_map = _manifest(path)["weight_map"]
    assert len(set(weight_map.values())) > 1  # whole tensors in more than one shard
    assert "split" not in weight_map and "text" not in weight_map
    return path, other, weight_map


def test_a_consistent_weight_map_with_split_and_string_tensors_reads(split_brain):
    path, _, _ = split_brain
    with shardkit.open(path) as r:
        r.verify()
        assert set(r.keys()) == set(_numpy_state())
    assert main(["verify", str(path)]) == 0


SPLIT_BRAIN = {
    # the same key read from another checkpoint, beside or anywhere
    "parent": lambda wm, other: {**wm, "a": f"../{other.name}/{wm['a']}"},
    "absolute": lambda wm, other: {**wm, "a": str(other / wm["a"])},
    # another file of this directory: another shard, a file beside it
    "other_shard": lambda wm, other: {**wm, "a": wm["b"]},
    "config": lambda wm, other: {**wm, "a": "config.json"},
    "added": lambda wm, other: {**wm, "ghost": wm["a"]},
    "dropped": lambda wm, other: {k: v for k, v in wm.items() if k != "b"},
    "split_added": lambda wm, other: {**wm, "split": wm["a"]},
    "string_added": lambda wm, other: {**wm, "text": wm["a"]},
    "emptied": lambda wm, other: {},
}


@pytest.mark.parametrize("edit", list(SPLIT_BRAIN))
def test_a_weight_map_that_disagrees_with_shardkits_section_is_refused(split_brain, edit):
    """Both sections of the manifest are one truth: a weight_map that sends HuggingFace's
    loaders elsewhere than shardkit's section is a CorruptIndexError for open, load, verify
    and the CLI, naming the manifest and the key."""
    path, other, weight_map = split_brain
    (path / "config.json").write_text("{}")
    doc = _manifest(path)
    doc["weight_map"] = SPLIT_BRAIN[edit](weight_map, other)
    (path / fmt.MANIFEST_FILE).write_text(json.dumps(doc))
    match = rf"{re.escape(fmt.MANIFEST_FILE)}: weight_map .*(the manifest's two sections disagree)"
    for read in (lambda: shardkit.open(path), lambda: shardkit.load(path),
                 lambda: shardkit.load(path, mmap=False, verify=True),
                 lambda: shardkit.open(path).verify()):
        with pytest.raises(shardkit.CorruptIndexError, match=match):
            read()
    for command in ("verify", "inspect"):
        with contextlib.redirect_stderr(io.StringIO()) as err:
            assert main([command, str(path)]) == 1
        assert "two sections disagree" in err.getvalue()


def test_a_real_model_saved_by_shardkit_passes_both_readers(tmp_path):
    """transformers' own loader and shardkit's agree on a shardkit save of a real model (several
    shards); retargeting one weight_map entry to another save of the model is refused by
    shardkit (transformers would load the other weights)."""
    cls, config, model = _model("bert")
    _, _, other_model = _model("bert", seed=1)
    policy = shardkit.DefaultShardingPolicy(max_shard_size=20_000)
    _save(tmp_path / "ckpt", model, config, sharding_callback=policy)
    _save(tmp_path / "other", other_model, config, sharding_callback=policy)
    with shardkit.open(tmp_path / "ckpt") as r:
        r.verify()
    loaded = cls.from_pretrained(tmp_path / "ckpt")
    _assert_same_weights(loaded, model)
    doc = _manifest(tmp_path / "ckpt")
    key = next(iter(doc["weight_map"]))
    doc["weight_map"][key] = f"../other/{doc['weight_map'][key]}"
    (tmp_path / "ckpt" / fmt.MANIFEST_FILE).write_text(json.dumps(doc))
    match = rf"weight_map puts {re.escape(repr(key))} in '\.\./other/"
    with pytest.raises(shardkit.CorruptIndexError, match=match):
        shardkit.load(tmp_path / "ckpt")
