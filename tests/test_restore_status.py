"""No silent partial restore: restore_into, Checkpoint.read / restore and
CheckpointManager.restore_or_initialize refuse, before changing anything, a restore that would
leave target values or checkpoint values unmatched, unless partial=True; the returned
CheckpointLoadStatus has TensorFlow's assert_* / expect_partial methods."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import shardkit
from shardkit import Checkpoint, CheckpointLoadStatus, CheckpointManager
from shardkit.errors import IncompleteRestoreError, RestoreMismatchError, ShardkitError


def _net(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _trained(seed: int = 0):
    model = _net(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).pow(2).mean().backward()
    opt.step()
    return model, opt


def _copies(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# --- restore_into ----------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(2, dtype=np.int8),
             "extra": np.full(3, 7.0)}
    shardkit.save(tmp_path / "c", state)
    return tmp_path / "c", state


def test_restore_into_returns_a_status(saved):
    path, state = saved
    target = {k: np.zeros_like(v) for k, v in state.items()}
    status = shardkit.restore_into(path, target)
    assert isinstance(status, CheckpointLoadStatus)
    assert status.restored_keys == ["w", "b", "extra"]
    assert status.missing_keys == [] and status.unexpected_keys == []
    assert status.assert_consumed() is status
    for k, v in state.items():
        assert target[k].tobytes() == v.tobytes()


def test_restore_into_refuses_missing_and_unexpected_keys_untouched(saved):
    path, _ = saved
    target = {"w": np.zeros((2, 3), np.float32), "new": np.zeros(4)}
    with pytest.raises(IncompleteRestoreError) as info:
        shardkit.restore_into(path, target)
    msg = str(info.value)
    assert str(path) in msg
    assert "1 target values missing from the checkpoint: 'new'" in msg
    assert "2 checkpoint values nothing in the target takes: 'b', 'extra'" in msg
    assert "partial=True" in msg and "nothing was changed" in msg
    assert isinstance(info.value, ShardkitError)
    assert not target["w"].any() and not target["new"].any()


def test_restore_into_partial_restores_the_match(saved):
    path, state = saved
    target = {"w": np.zeros((2, 3), np.float32), "new": np.zeros(4)}
    status = shardkit.restore_into(path, target, partial=True)
    assert target["w"].tobytes() == state["w"].tobytes() and not target["new"].any()
    assert status.restored_keys == ["w"]
    assert status.missing_keys == ["new"] and status.unexpected_keys == ["b", "extra"]
    assert status.expect_partial() is status
    assert status.assert_nontrivial_match() is status
    with pytest.raises(IncompleteRestoreError, match="'new'"):
        status.assert_consumed()
    with pytest.raises(IncompleteRestoreError, match="'new'"):
        status.assert_existing_objects_matched()


def test_restore_into_partial_with_only_unexpected(saved):
    """TF: objects all matched, checkpoint values left over: assert_existing_objects_matched
    passes, assert_consumed raises."""
    path, _ = saved
    target = {"b": np.zeros(2, np.int8)}
    with pytest.raises(IncompleteRestoreError, match="'w', 'extra'"):
        shardkit.restore_into(path, target)
    status = shardkit.restore_into(path, target, partial=True)
    assert status.assert_existing_objects_matched() is status
    with pytest.raises(IncompleteRestoreError, match=r"2 checkpoint values no object took"):
        status.assert_consumed()


def test_restore_into_shape_mismatch_still_checked_first(saved):
    path, _ = saved
    target = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.int8), "extra": np.zeros(3)}
    with pytest.raises(RestoreMismatchError):
        shardkit.restore_into(path, target)
    assert not target["b"].any()


def test_listing_is_bounded(tmp_path):
    shardkit.save(tmp_path / "c", {f"k{i:02d}": np.zeros(1) for i in range(25)})
    with pytest.raises(IncompleteRestoreError) as info:
        shardkit.restore_into(tmp_path / "c", {})
    msg = str(info.value)
    assert "25 checkpoint values" in msg and "'k09'" in msg and "'k10'" not in msg
    assert "and 15 more" in msg


# --- torch: a module wrapped differently -------------------------------------------------------


def test_wrapped_module_is_not_restored_silently(tmp_path):
    """Saved as nn.Sequential(model) (keys 0.0.weight...), restored into the bare model (keys
    0.weight...): today the step and Adam state were restored and the weights silently not."""
    model, opt = _trained(0)
    progress = {"step": np.array(7, np.int64)}
    Checkpoint(model=torch.nn.Sequential(model), optimizer=opt, progress=progress).write(
        tmp_path / "c")

    fresh, fresh_opt = _trained(1)
    fresh_progress = {"step": np.zeros((), np.int64)}
    before = _copies(fresh)
    opt_before = {k: v.clone() for k, v in fresh_opt.state[fresh_opt.param_groups[0]["params"][0]]
                  .items()}
    ckpt = Checkpoint(model=fresh, optimizer=fresh_opt, progress=fresh_progress)
    with pytest.raises(IncompleteRestoreError) as info:
        ckpt.read(tmp_path / "c")
    msg = str(info.value)
    assert "'model/0.weight'" in msg and "'model/0.0.weight'" in msg
    assert "partial=True" in msg
    assert "did you mean" in msg or "stored as" in msg
    # nothing changed: weights, Adam state, step, save counter
    assert _unchanged(fresh, before)
    state0 = fresh_opt.state[fresh_opt.param_groups[0]["params"][0]]
    assert all(torch.equal(state0[k], v) for k, v in opt_before.items())
    assert int(fresh_progress["step"]) == 0 and ckpt.save_counter == 0

    # the same model wrapped the same way restores completely, byte for byte
    target, target_opt = _trained(2)
    status = Checkpoint(model=torch.nn.Sequential(target), optimizer=target_opt,
                        progress={"step": np.zeros((), np.int64)}).read(tmp_path / "c")
    status.assert_consumed()
    for k, v in model.state_dict().items():
        assert target.state_dict()[k].numpy().tobytes() == v.numpy().tobytes()


def test_partial_checkpoint_restore_reports_the_match(tmp_path):
    model, _ = _trained(0)
    Checkpoint(model=torch.nn.Sequential(model), progress={"step": np.array(3)}).write(
        tmp_path / "c")
    fresh = _net(1)
    progress = {"step": np.zeros((), np.int64)}
    status = Checkpoint(model=fresh, progress=progress).restore(tmp_path / "c", partial=True)
    assert int(progress["step"]) == 3
    assert "progress/step" in status.restored_keys
    assert sorted(status.missing_keys) == sorted(f"model/{k}" for k in fresh.state_dict())
    assert sorted(status.unexpected_keys) == sorted(
        f"model/0.{k}" for k in model.state_dict())
    assert status.expect_partial() is status
    status.assert_nontrivial_match()
    with pytest.raises(IncompleteRestoreError):
        status.assert_consumed()
    with pytest.raises(IncompleteRestoreError):
        status.assert_existing_objects_matched()


def test_checkpoint_unexpected_only(tmp_path):
    a = {"x": np.arange(3.0), "y": np.ones(2)}
    Checkpoint(data=a, more={"z": np.ones(1)}).write(tmp_path / "c")
    target = {"x": np.zeros(3), "y": np.zeros(2)}
    with pytest.raises(IncompleteRestoreError, match="'more/z'"):
        Checkpoint(data=target).read(tmp_path / "c")
    assert not target["x"].any()
    status = Checkpoint(data=target).read(tmp_path / "c", partial=True)
    assert target["x"].tobytes() == a["x"].tobytes()
    assert status.assert_existing_objects_matched() is status
    with pytest.raises(IncompleteRestoreError, match="'more/z'"):
        status.assert_consumed()


def test_restore_none_is_not_an_error(tmp_path):
    status = Checkpoint(data={"x": np.zeros(2)}).restore(None)
    assert status.missing_keys == ["data/x"]
    assert status.expect_partial() is status
    with pytest.raises(IncompleteRestoreError):
        status.assert_consumed()


# --- the manager -------------------------------------------------------------------------------


def test_manager_restore_or_initialize_refuses_a_partial_restore(tmp_path):
    model, _ = _trained(0)
    step = {"step": np.array(5, np.int64)}
    CheckpointManager(Checkpoint(model=torch.nn.Sequential(model), progress=step),
                      tmp_path, max_to_keep=2).save()
    fresh = _net(1)
    before = _copies(fresh)
    progress = {"step": np.zeros((), np.int64)}
    manager = CheckpointManager(Checkpoint(model=fresh, progress=progress), tmp_path)
    with pytest.raises(IncompleteRestoreError, match=r"'model/0\.weight'"):
        manager.restore_or_initialize()
    assert _unchanged(fresh, before) and int(progress["step"]) == 0
    assert manager.restore_status is None

    path = manager.restore_or_initialize(partial=True)
    assert path == manager.latest_checkpoint
    assert int(progress["step"]) == 5 and _unchanged(fresh, before)
    status = manager.restore_status
    assert isinstance(status, CheckpointLoadStatus) and status.path == path
    assert status.restored_keys == ["progress/step"]
    with pytest.raises(IncompleteRestoreError):
        status.assert_existing_objects_matched()


def test_manager_complete_restore_status(tmp_path):
    model, opt = _trained(0)
    CheckpointManager(Checkpoint(model=model, optimizer=opt), tmp_path).save()
    target, target_opt = _trained(3)
    manager = CheckpointManager(Checkpoint(model=target, optimizer=target_opt), tmp_path)
    assert manager.restore_or_initialize() == manager.latest_checkpoint
    manager.restore_status.assert_consumed()
    for k, v in model.state_dict().items():
        assert target.state_dict()[k].numpy().tobytes() == v.numpy().tobytes()
    empty = CheckpointManager(Checkpoint(model=_net(0)), tmp_path / "none")
    assert empty.restore_or_initialize() is None and empty.restore_status is None
