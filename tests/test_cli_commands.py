"""`shardkit demo`, `inspect` and `verify`."""

import json

import numpy as np
import pytest

from shardkit.api import save
from shardkit.cli import main
from shardkit.policies import MaxShardSizePolicy


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    state = {"a": np.arange(100, dtype=np.float32).reshape(10, 10), "b": {"c": np.ones(3)}}
    save(path, state, sharding_callback=MaxShardSizePolicy(200), metadata={"step": 3})
    return path


def test_demo_runs_end_to_end(tmp_path, capsys):
    assert main(["demo", "--model", "llm-tiny", "--dir", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "model 'llm-tiny' (float32), 21 tensors" in out
    for row in ("max-shard-size", "bin-pack", "balanced", "all-in-one", "save (default policy",
                "verify (xxh3-64", "load (memory-mapped", "save zstd", "load zstd",
                "zstd compression ratio", "Round trip byte-exact (raw and zstd): yes"):
        assert row in out
    assert list(tmp_path.iterdir()) == []  # the temporary checkpoint is gone


def test_demo_bfloat16(tmp_path, capsys):
    args = ["demo", "--model", "llm-tiny", "--dtype", "bfloat16", "--dir", str(tmp_path)]
    assert main([*args, "--no-progress"]) == 0
    assert "Round trip byte-exact (raw and zstd): yes" in capsys.readouterr().out


def test_inspect_lists_shards_and_slices(checkpoint, capsys):
    assert main(["inspect", str(checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "2 tensors, 3 shards" in out
    assert "metadata: {'step': 3}" in out
    generation = json.loads((checkpoint / "index.json").read_text())["shardkit"]["generation"]
    assert f"generation: {generation}\n" in out
    assert "shard-00000-of-00003.safetensors  task 0  raw" in out
    assert "10 10 0,5:0,10" in out and "10 10 5,5:0,10" in out
    assert "F64" in out and "[10, 10]" in out


def test_verify_ok_and_corrupt(checkpoint, capsys):
    assert main(["verify", str(checkpoint)]) == 0
    assert "OK (3 entries checked, 2 tensors)" in capsys.readouterr().out
    shard = checkpoint / "shard-00001-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["verify", str(checkpoint)]) == 1
    err = capsys.readouterr().err
    assert "CORRUPT:" in err and "shard-00001-of-00003.safetensors" in err
    assert "shard-00001-of-00003.safetensors: 'a': checksum of slice '10 10 " in err
    assert "1 problem(s) found" in err


def test_verify_missing_checkpoint(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope")]) == 1
    assert "no checkpoint at" in capsys.readouterr().err
