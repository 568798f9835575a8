"""shardkit as a storage backend of torch.distributed.checkpoint (shardkit.training.dcp).

``dcp.save`` / ``dcp.async_save`` through `StorageWriter` write ordinary shardkit checkpoints
(shardkit.open, verify, safetensors and HuggingFace readers); ``dcp.load`` through
`StorageReader` reads them, and any checkpoint shardkit opens, with DCP's planners resharding.
One process alone, then 2-rank FSDP2 saves read back at world 1, 2 and 3 (gloo on 127.0.0.1,
spawned by tests/distributed.py), with ``get_state_dict`` / ``set_state_dict``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is an optional dependency")

import distributed as harness  # noqa: E402  (tests/distributed.py)
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

import shardkit  # noqa: E402
from shardkit.errors import (  # noqa: E402
    CheckpointExistsError,
    ChecksumError,
    DistributedSaveError,
    UnsupportedDTypeError,
)
from shardkit.training.dcp import StorageReader, StorageWriter  # noqa: E402

SPAWN_TIMEOUT = 180.0


@pytest.fixture(autouse=True)
def _quiet_dcp() -> Any:
    with warnings.catch_warnings():  # DCP's "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        yield


def _raised(call: Any, error: type[BaseException]) -> list[BaseException]:
    """The errors of each rank `call` (a DCP save or load) raised, each an `error`: DCP
    wraps the storage layer's in its CheckpointException (a BaseException)."""
    with pytest.raises(CheckpointException) as got:
        call()
    errors = [exc for exc, _ in got.value.failures.values()]
    assert errors and all(isinstance(e, error) for e in errors), errors
    return errors


def _bytes(t: Any) -> bytes:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _mlp(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def _adam_step(model: Any, opt: Any, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _trained(seed: int = 0) -> tuple[Any, Any]:
    model = _mlp(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        _adam_step(model, opt, seed * 100 + step)
    return model, opt


def _same_state(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert _bytes(a) == _bytes(b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b)  # DCP orders items its own way
        for k in a:
            _same_state(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same_state(x, y)
    else:
        assert type(a) is type(b) and a == b, (a, b)


# --- one process -----------------------------------------------------------------------------


def test_save_writes_a_shardkit_checkpoint_that_dcp_loads_back_and_training_continues(
        tmp_path: Path) -> None:
    model, opt = _trained()
    path = tmp_path / "ck"
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 3},
             storage_writer=StorageWriter(path))
    with shardkit.open(path) as reader:
        assert reader.format == "shardkit"
        assert reader.verify() > 0
        assert {"model/0.weight", "model/2.bias", "optim/state/0/exp_avg"} <= set(reader.keys())
    nested = shardkit.load(path, framework="torch", nested=True)
    saved = opt.state_dict()  # None, bools, tuples typed, never pickled; DCP's keys are str
    _same_state(saved["param_groups"], nested["optim"]["param_groups"])
    _same_state({str(k): v for k, v in saved["state"].items()}, nested["optim"]["state"])
    assert nested["step"] == 3

    fresh, fresh_opt = _trained(seed=1)  # other values everywhere
    target = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict(), "step": 0}
    dcp.load(target, storage_reader=StorageReader(path))
    fresh_opt.load_state_dict(target["optim"])
    assert target["step"] == 3
    _same_state(model.state_dict(), fresh.state_dict())
    _same_state(opt.state_dict(), fresh_opt.state_dict())
    for step in range(3, 6):  # bit-identical losses from here on
        assert _adam_step(model, opt, step) == _adam_step(fresh, fresh_opt, step)


def test_a_model_state_dict_saved_through_dcp_is_read_by_safetensors(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model, _ = _trained()
    dcp.save(model.state_dict(), storage_writer=StorageWriter(tmp_path / "ck"))
    shards = sorted((tmp_path / "ck").glob("*.safetensors"))
    loaded: dict[str, Any] = {}
    for shard in shards:
        loaded.update(safetensors_torch.load_file(shard))
    _same_state(dict(sorted(model.state_dict().items())), dict(sorted(loaded.items())))


def test_the_reader_serves_checkpoints_shardkit_saved_itself(tmp_path: Path) -> None:
    model, opt = _trained()
    shardkit.save(tmp_path / "own", {"model": model.state_dict(), "optim": opt.state_dict()})
    fresh, fresh_opt = _trained(seed=2)
    target = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
    dcp.load(target, storage_reader=StorageReader(tmp_path / "own"))
    fresh_opt.load_state_dict(target["optim"])
    _same_state(model.state_dict(), fresh.state_dict())
    _same_state(opt.state_dict(), fresh_opt.state_dict())


def test_the_reader_converts_dtypes_as_dcps_own_reader_does(tmp_path: Path) -> None:
    model, _ = _trained()
    dcp.save(model.state_dict(), storage_writer=StorageWriter(tmp_path / "ours"))
    dcp.save(model.state_dict(), storage_writer=dcp.FileSystemWriter(tmp_path / "theirs"))
    ours = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in model.state_dict().items()}
    theirs = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in ours.items()}
    dcp.load(ours, storage_reader=StorageReader(tmp_path / "ours"))
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(tmp_path / "theirs"))
    _same_state(theirs, ours)
    assert any(_bytes(t) != _bytes(torch.zeros_like(t)) for t in ours.values())


def test_checkpoint_id_names_the_checkpoint_and_an_existing_one_is_kept(tmp_path: Path) -> None:
    model, _ = _trained()
    writer = StorageWriter(tmp_path / "unused")
    dcp.save(model.state_dict(), checkpoint_id=tmp_path / "a", storage_writer=writer)
    assert shardkit.open(tmp_path / "a").keys() and not (tmp_path / "unused").exists()
    before = sorted(p.read_bytes() for p in (tmp_path / "a").iterdir())
    (error,) = _raised(lambda: dcp.save(_trained(seed=3)[0].state_dict(),
                                        storage_writer=StorageWriter(tmp_path / "a")),
                       CheckpointExistsError)
    assert "already exists" in str(error)
    assert sorted(p.read_bytes() for p in (tmp_path / "a").iterdir()) == before
    dcp.save(_trained(seed=3)[0].state_dict(),
             storage_writer=StorageWriter(tmp_path / "a", overwrite=True))
    assert sorted(p.read_bytes() for p in (tmp_path / "a").iterdir()) != before


def test_a_value_shardkit_cannot_type_is_refused_by_name_and_nothing_is_written(
        tmp_path: Path) -> None:
    class Opaque:
        pass

    (error,) = _raised(lambda: dcp.save({"w": torch.ones(3), "extra": Opaque()},
                                        storage_writer=StorageWriter(tmp_path / "ck")),
                       UnsupportedDTypeError)
    assert "'extra'" in str(error)
    assert not (tmp_path / "ck").exists()
    assert os.listdir(tmp_path) == []


def test_verify_true_checks_the_slices_read(tmp_path: Path) -> None:
    dcp.save({"w": torch.arange(64, dtype=torch.float32)},
             storage_writer=StorageWriter(tmp_path / "ck"))
    (shard,) = (tmp_path / "ck").glob("*.safetensors")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x40
    shard.write_bytes(bytes(data))
    target = {"w": torch.zeros(64)}
    (error,) = _raised(lambda: dcp.load(target, storage_reader=StorageReader(
        tmp_path / "ck", verify=True)), ChecksumError)
    assert "w" in str(error)
    dcp.load(target, storage_reader=StorageReader(tmp_path / "ck"))  # unchecked: as stored
    assert target["w"][-1].item() != 63.0 and target["w"][:-1].equal(torch.arange(63.0))


# --- many ranks ------------------------------------------------------------------------------


def _fsdp2(world: int, seed: int) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _mlp(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(2):
        _adam_step(model, opt, seed * 100 + step)
    return model, opt


def _full(state: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.full_tensor()
    if isinstance(state, torch.Tensor):  # a copy: the optimizer steps its own in place
        return state.clone()
    if isinstance(state, dict):
        return {k: _full(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_full(v) for v in state]
    return state


def fsdp2_save(rank: int, world: int, root: str) -> Any:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _fsdp2(world, seed=0)
    msd, osd = get_state_dict(model, opt)
    full = _full({"model": msd, "optim": osd})  # a collective: on every rank
    dcp.save({"model": msd, "optim": osd}, storage_writer=StorageWriter(f"{root}/sync"))
    future = dcp.async_save({"model": msd, "optim": osd},
                            storage_writer=StorageWriter(f"{root}/async"))
    future.result()
    _adam_step(model, opt, 7)  # the async save holds the state of when it was called
    errors = _raised(lambda: dcp.save({"model": msd}, storage_writer=StorageWriter(
        f"{root}/sync")), DistributedSaveError)  # every rank fails alike
    assert all("exists" in str(e) for e in errors)
    return full if rank == 0 else None


def fsdp2_load(rank: int, world: int, root: str, expected: Any) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    for name in ("sync", "async"):
        model, opt = _fsdp2(world, seed=5)  # other values everywhere
        msd, osd = get_state_dict(model, opt)
        target = {"model": msd, "optim": osd}
        dcp.load(target, storage_reader=StorageReader(f"{root}/{name}"))
        set_state_dict(model, opt, model_state_dict=target["model"],
                       optim_state_dict=target["optim"])
        msd, osd = get_state_dict(model, opt)
        _same_state(expected, _full({"model": msd, "optim": osd}))


def test_fsdp2_saves_through_dcp_read_at_world_1_2_and_3(tmp_path: Path) -> None:
    root = str(tmp_path)
    (expected, _) = harness.raise_any(harness.run_ranks(fsdp2_save, 2, root,
                                                        timeout=SPAWN_TIMEOUT))
    for name in ("sync", "async"):
        path = tmp_path / name
        assert shardkit.open(path).verify() > 0
        loaded = shardkit.load(path, framework="torch")
        for key, value in expected["model"].items():
            assert _bytes(loaded[f"model/{key}"]) == _bytes(value), key
        state = shardkit.load(path, framework="torch", nested=True)["optim"]["state"]
        for fqn, moments in expected["optim"]["state"].items():
            _same_state(moments, state[fqn])
    for world in (2, 3):
        harness.raise_any(harness.run_ranks(fsdp2_load, world, root, expected,
                                            timeout=SPAWN_TIMEOUT))
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _mlp(seed=9)  # world 1: a plain model, in this process
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _adam_step(model, opt, 1)
    msd, osd = get_state_dict(model, opt)
    target = {"model": msd, "optim": osd}
    dcp.load(target, storage_reader=StorageReader(tmp_path / "sync"))
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    _same_state(expected, dict(zip(("model", "optim"), get_state_dict(model, opt))))
    assert np.isfinite(_adam_step(model, opt, 2))
