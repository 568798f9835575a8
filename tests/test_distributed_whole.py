"""The collective save's whole-tensor layout: DTensors of many ranks stored as whole safetensors
entries, each rank writing only its own pieces' bytes, so that HuggingFace's loaders read a
multi-rank save as they read a single process's (shardkit.distributed.whole).

Ranks are spawned by tests/distributed.py (gloo on 127.0.0.1). A tiny Llama (transformers,
built from a config) under FSDP2 is saved by 2 ranks and loaded by ``from_pretrained`` with no
missing or unexpected key, byte for byte; ``Shard(1)`` pieces (strided runs) of several dtypes
and ranks that hold nothing of a tensor are checked against safetensors itself; the fallbacks
to per-rank slices warn with `SplitTensorsWarning`, saying why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is an optional dependency")

import distributed as harness  # noqa: E402  (tests/distributed.py)

import shardkit  # noqa: E402
from shardkit.distributed.whole import runs  # noqa: E402

SPAWN_TIMEOUT = 180.0


def _bytes(t: Any) -> bytes:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _slices_in(path: Path) -> list[str]:
    """The stored entries that are slices (named ``key:spec`` in a shard header)."""
    found = []
    for shard in path.glob("*.safetensors"):
        with open(shard, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        found += [k for k in header if k != "__metadata__" and ":" in k]
    return found


def llama_save(rank: int, world: int, path: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=96)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = model.state_dict()
    full = {k: v.full_tensor() for k, v in state.items()}  # a collective: on every rank
    shardkit.save(path, state)
    if rank == 0:
        config.save_pretrained(path)
    return full if rank == 0 else None


def test_a_2_rank_fsdp2_llama_loads_with_from_pretrained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "llama"
    full, _ = harness.raise_any(harness.run_ranks(llama_save, 2, str(path),
                                                  timeout=SPAWN_TIMEOUT))
    assert _slices_in(path) == []
    with open(path / "model.safetensors.index.json") as f:
        assert sorted(json.load(f)["weight_map"]) == sorted(full)
    model, info = transformers.LlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    for key, value in model.state_dict().items():
        assert _bytes(value) == _bytes(full[key]), key
    assert shardkit.open(path).verify() == len(full)


def placements_save(rank: int, world: int, root: str) -> Any:
    import warnings

    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    state = {
        "rows": distribute_tensor(torch.randn(9, 6), mesh, [Shard(0)]),
        "cols_bf16": distribute_tensor(torch.randn(5, 7).to(torch.bfloat16), mesh, [Shard(1)]),
        "mid": distribute_tensor(torch.randn(3, 4, 5), mesh, [Shard(1)]),
        "last": distribute_tensor(torch.arange(60, dtype=torch.int32).reshape(3, 4, 5), mesh,
                                  [Shard(2)]),
        "few": distribute_tensor(torch.randn(1, 3), mesh, [Shard(0)]),  # rank 1 holds none
        "rep": distribute_tensor(torch.randn(4), mesh, [Replicate()]),
        "plain": torch.arange(6, dtype=torch.int64),
        "scalar": torch.tensor(3.0),
    }
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v.clone())
            for k, v in state.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shardkit.save(f"{root}/whole", state)
        shardkit.save(f"{root}/zstd", state,
                      options=shardkit.CheckpointOptions(compression="zstd"))
    import shardkit.distributed.save as collective

    real = collective.directory_identity
    collective.directory_identity = lambda p: (-1, rank) if rank == 1 else real(p)  # elsewhere
    try:
        with warnings.catch_warnings(record=True) as apart:
            warnings.simplefilter("always")
            shardkit.save(f"{root}/apart", state)
    finally:
        collective.directory_identity = real
    return full, [str(w.message) for w in caught + apart
                  if issubclass(w.category, shardkit.SplitTensorsWarning)]


def test_every_placement_is_written_whole_and_the_fallbacks_say_why(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    results = harness.raise_any(harness.run_ranks(placements_save, 2, str(tmp_path),
                                                  timeout=SPAWN_TIMEOUT))
    full = results[0][0]
    whole = tmp_path / "whole"
    assert _slices_in(whole) == []
    stored: dict[str, Any] = {}
    for shard in whole.glob("*.safetensors"):
        stored.update(safetensors_torch.load_file(shard))
    assert sorted(stored) == sorted(full)
    for key, value in full.items():
        assert stored[key].dtype == value.dtype and _bytes(stored[key]) == _bytes(value), key
    assert shardkit.open(whole).verify() == len(full)
    for name in ("zstd", "apart"):  # per-rank slices, read back the same
        loaded = shardkit.load(tmp_path / name, framework="torch")
        for key, value in full.items():
            assert _bytes(loaded[key]) == _bytes(value), (name, key)
    for rank, (_, messages) in enumerate(results):
        assert len(messages) == 2, (rank, messages)
        zstd, apart = messages
        assert "because compression is on" in zstd and "shardkit convert" in zstd
        assert "do not share one file system" in apart


@pytest.mark.parametrize("shape, spec, expected", [
    ((4, 3), "4 3 1,2:-", ([12], 24)),            # rows: one run
    ((4, 3), "4 3 -:1,2", ([4, 16, 28, 40], 8)),  # columns: one run per row
    ((2, 3, 4), "2 3 4 -:1,1:-", ([16, 64], 16)),  # a middle axis: runs span the last
    ((2, 3, 4), "2 3 4 1,1:-:-", ([48], 48)),
    ((5,), "", ([0], 20)),
    ((), "", ([0], 4)),
])
def test_runs_of_a_piece(shape: tuple[int, ...], spec: str,
                         expected: tuple[list[int], int]) -> None:
    offsets, run = runs(shape, spec, 4)
    assert offsets.tolist() == expected[0] and run == expected[1]
    if spec:  # the runs, in order, are the piece's bytes
        full = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
        box = shardkit.SliceSpec.parse(spec, shape)
        piece = full[box.to_index()].tobytes()
        raw = full.tobytes()
        assert b"".join(raw[o:o + run] for o in offsets.tolist()) == piece
