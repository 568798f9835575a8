"""CheckpointManager: numbering, retention, intervals, restore_or_initialize, owned names only."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from shardkit.format import MANIFEST_FILE
from shardkit.io.options import CheckpointOptions
from shardkit.io.reader import load
from shardkit.training.checkpoint import Checkpoint, CheckpointManager

FAST = CheckpointOptions(durable=False)


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def make(tmp_path, **kwargs):
    x = np.zeros(3)
    manager = CheckpointManager(Checkpoint(s={"x": x}), tmp_path, **kwargs)
    return manager, x


def test_keeps_exactly_max_to_keep(tmp_path):
    manager, x = make(tmp_path, max_to_keep=3)
    for i in range(7):
        x[:] = i
        path = manager.save(options=FAST)
        assert os.path.basename(path) == f"ckpt-{i + 1}"
    assert names(tmp_path) == ["ckpt-5", "ckpt-6", "ckpt-7"]
    assert manager.checkpoints == [str(tmp_path / f"ckpt-{i}") for i in (5, 6, 7)]
    assert manager.latest_checkpoint == str(tmp_path / "ckpt-7")
    assert load(manager.latest_checkpoint)["s/x"].tolist() == [6, 6, 6]


def test_max_to_keep_none_keeps_all(tmp_path):
    manager, _ = make(tmp_path, max_to_keep=None)
    for _ in range(4):
        manager.save(options=FAST)
    assert len(manager.checkpoints) == 4 and len(names(tmp_path)) == 4


def test_explicit_numbers_and_custom_name(tmp_path):
    manager, _ = make(tmp_path, max_to_keep=2, checkpoint_name="model")
    for step in (100, 200, 300):
        manager.save(checkpoint_number=step, options=FAST)
    assert names(tmp_path) == ["model-200", "model-300"]
    assert manager.checkpoint.save_counter == 3
    np_number = manager.save(checkpoint_number=np.int64(400), options=FAST)
    assert os.path.basename(np_number) == "model-400"


def test_only_owned_committed_directories_count_and_are_deleted(tmp_path):
    foreign = ["ckpt-1.bak", "other-1", "ckpt-01", "ckpt-x", ".ckpt-1"]
    for name in foreign:
        (tmp_path / name).mkdir()
        (tmp_path / name / MANIFEST_FILE).write_text("{}")
    (tmp_path / "ckpt-50").mkdir()  # half-written by someone: no manifest
    manager, _ = make(tmp_path, max_to_keep=1)
    assert manager.latest_checkpoint is None and manager.checkpoints == []
    for _ in range(3):
        manager.save(options=FAST)
    assert manager.latest_checkpoint == str(tmp_path / "ckpt-3")
    assert names(tmp_path) == sorted([*foreign, "ckpt-3", "ckpt-50"])
    assert all((tmp_path / n / MANIFEST_FILE).read_text() == "{}" for n in foreign)


def test_refuses_to_replace_a_foreign_file(tmp_path):
    (tmp_path / "ckpt-1").write_text("not mine")
    manager, _ = make(tmp_path)
    with pytest.raises(FileExistsError, match="not a checkpoint directory"):
        manager.save(options=FAST)
    assert (tmp_path / "ckpt-1").read_text() == "not mine"


def test_half_written_checkpoint_never_latest(tmp_path):
    manager, _ = make(tmp_path, max_to_keep=2)
    manager.save(options=FAST)
    (tmp_path / "ckpt-9").mkdir()
    (tmp_path / "ckpt-9" / "model-00001-of-00001.safetensors").write_bytes(b"torn")
    assert manager.latest_checkpoint == str(tmp_path / "ckpt-1")
    for _ in range(3):
        manager.save(options=FAST)
    assert names(tmp_path) == ["ckpt-3", "ckpt-4", "ckpt-9"]


def test_restore_or_initialize(tmp_path):
    calls = []
    x = np.zeros(2)
    manager = CheckpointManager(Checkpoint(s={"x": x}), tmp_path, init_fn=lambda: calls.append(1))
    assert manager.restore_or_initialize() is None and calls == [1]
    x[:] = 4
    manager.save(options=FAST)
    manager.save(options=FAST)
    # a new process: fresh objects, same directory
    y = np.zeros(2)
    ckpt = Checkpoint(s={"x": y})
    again = CheckpointManager(ckpt, tmp_path, init_fn=lambda: calls.append(2))
    assert again.restore_or_initialize() == str(tmp_path / "ckpt-2")
    assert calls == [1] and y.tolist() == [4, 4] and ckpt.save_counter == 2
    assert os.path.basename(again.save(options=FAST)) == "ckpt-3"  # numbering continues


def test_checkpoint_interval(tmp_path):
    step = {"value": 0}
    manager, _ = make(tmp_path, max_to_keep=None, step_counter=lambda: step["value"],
                      checkpoint_interval=5)
    saved = []
    for s in range(0, 13):
        step["value"] = s
        if manager.save(checkpoint_number=s, options=FAST) is not None:
            saved.append(s)
    assert saved == [0, 5, 10]
    step["value"] = 11
    assert manager.save(checkpoint_number=11, check_interval=False, options=FAST) is not None
    step["value"] = 13
    assert manager.save(checkpoint_number=13, options=FAST) is None  # 11 + 5 > 13
    assert names(tmp_path) == ["ckpt-0", "ckpt-10", "ckpt-11", "ckpt-5"]


def test_step_counter_can_be_an_array(tmp_path):
    counter = np.array(0)
    manager, _ = make(tmp_path, step_counter=counter, checkpoint_interval=2)
    results = []
    for s in range(4):
        counter[...] = s
        results.append(manager.save(options=FAST) is not None)
    assert results == [True, False, True, False]


def test_keep_checkpoint_every_n_hours(tmp_path):
    manager, _ = make(tmp_path, max_to_keep=2, keep_checkpoint_every_n_hours=1)
    start = time.time() - 10 * 3600
    # ckpt-1 at +0 h, ckpt-2 at +0.5 h, ckpt-3 at +1.2 h, ckpt-4 at +1.5 h, ckpt-5 at +2.3 h ...
    offsets = [0, 0.5, 1.2, 1.5, 2.3, 2.4, 2.5]
    for i, hours in enumerate(offsets, start=1):
        manager.save(options=FAST)
        stamp = start + hours * 3600
        os.utime(tmp_path / f"ckpt-{i}" / MANIFEST_FILE, (stamp, stamp))
    manager.save(options=FAST)
    # kept forever: ckpt-1 (oldest), ckpt-3 (>= 1 h after it), ckpt-5 (>= 1 h after ckpt-3)
    assert names(tmp_path) == ["ckpt-1", "ckpt-3", "ckpt-5", "ckpt-7", "ckpt-8"]
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-7", "ckpt-8"]


def test_deletion_leaves_no_hidden_directories(tmp_path):
    manager, _ = make(tmp_path, max_to_keep=1)
    for _ in range(3):
        manager.save(options=FAST)
    assert names(tmp_path) == ["ckpt-3"]


def test_stale_temp_directory_of_a_crashed_save_is_cleaned(tmp_path):
    manager, _ = make(tmp_path, max_to_keep=1)
    stale = tmp_path / ".ckpt-2.shardkit-tmp-abc123"
    stale.mkdir()
    (stale / "model-00001-of-00001.safetensors").write_bytes(b"torn")
    manager.save(options=FAST)
    assert names(tmp_path) == ["ckpt-1"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_to_keep": 0}, ValueError, "max_to_keep must be a positive int or None, got 0"),
        ({"max_to_keep": 2.0}, ValueError, "max_to_keep"),
        ({"keep_checkpoint_every_n_hours": -1}, ValueError, "positive number, got -1"),
        ({"checkpoint_interval": 3}, ValueError, "needs a step_counter"),
        ({"checkpoint_interval": 0, "step_counter": 1}, ValueError, "positive int, got 0"),
        ({"checkpoint_name": "a/b"}, ValueError, "plain file name"),
        ({"checkpoint_name": ".hidden"}, ValueError, "plain file name"),
        ({"init_fn": 3}, TypeError, "init_fn must be callable"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        CheckpointManager(Checkpoint(s={"x": np.ones(1)}), tmp_path, **kwargs)


def test_bad_checkpoint_and_numbers(tmp_path):
    with pytest.raises(TypeError, match="checkpoint must be a Checkpoint, got dict"):
        CheckpointManager({"x": 1}, tmp_path)  # type: ignore[arg-type]
    manager, _ = make(tmp_path)
    with pytest.raises(TypeError, match=r"checkpoint_number must be an int, got 1\.5"):
        manager.save(checkpoint_number=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="checkpoint_number must be >= 0, got -1"):
        manager.save(checkpoint_number=-1)
    assert names(tmp_path) == []


def test_properties(tmp_path):
    manager, _ = make(tmp_path / "sub", checkpoint_interval=None)
    assert manager.directory == str(tmp_path / "sub")
    assert manager.checkpoint_interval is None
    assert manager.checkpoints == [] and manager.latest_checkpoint is None  # dir not created yet
    manager.save(options=FAST)
    assert (tmp_path / "sub" / "ckpt-1" / MANIFEST_FILE).is_file()


def test_retention_deletes_only_files_the_manifest_names(tmp_path):
    """A HuggingFace export ``ckpt-0/`` beside the checkpoints and a file a user put inside
    one stay; the checkpoint's own files go (and its directory, once empty)."""
    (tmp_path / "ckpt-0").mkdir()
    hf = {MANIFEST_FILE: '{"metadata": {}, "weight_map": {"w": "model.safetensors"}}',
          "model.safetensors": "not read"}
    for n, text in hf.items():
        (tmp_path / "ckpt-0" / n).write_text(text)
    manager, _ = make(tmp_path, max_to_keep=1)
    manager.save(options=FAST)
    manager.save(options=FAST)
    (tmp_path / "ckpt-2" / "README.md").write_text("notes")
    manager.save(options=FAST)
    assert names(tmp_path) == ["ckpt-0", "ckpt-2", "ckpt-3"]  # ckpt-1 gone, directory and all
    assert names(tmp_path / "ckpt-2") == ["README.md"]
    assert {n: (tmp_path / "ckpt-0" / n).read_text() for n in hf} == hf
    manager.save(options=FAST)  # ckpt-2 is no checkpoint any more, and is not deleted
    assert names(tmp_path) == ["ckpt-0", "ckpt-2", "ckpt-4"]


def test_a_removal_killed_halfway_is_finished_by_the_next_save(tmp_path):
    """Retention SIGKILLed right after it deleted a checkpoint's manifest (the directory is no
    checkpoint any more, its shards still there) leaves nothing behind for long: the next
    save's retention finishes that removal, and only that checkpoint's own files go."""
    import signal
    import subprocess
    import sys
    import textwrap

    manager, _ = make(tmp_path, max_to_keep=1)
    manager.save(options=FAST)
    (tmp_path / "ckpt-1" / "README.md").write_text("notes")
    # a process of its own (no fork of this one, which may hold JAX's threads), killed just
    # after its first deletion: the manifest
    script = textwrap.dedent(f"""
        import os, signal
        from shardkit.storage import open_storage
        unlink = os.unlink
        def unlink_then_die(*args, **kwargs):
            unlink(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        os.unlink = unlink_then_die
        open_storage({str(tmp_path / "ckpt-1")!r}).remove_checkpoint()
    """)
    root = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": root}, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = names(tmp_path / "ckpt-1")
    assert MANIFEST_FILE not in left and any(n.endswith(".safetensors") for n in left), left
    assert manager.checkpoints == []  # half deleted: no checkpoint
    manager.save(options=FAST)
    assert names(tmp_path) == ["ckpt-1", "ckpt-2"]
    assert names(tmp_path / "ckpt-1") == ["README.md"]  # the user's file stays, nothing else


@pytest.mark.parametrize("target", ["directory", "file"])
def test_retention_never_follows_a_symlinked_checkpoint(tmp_path, target):
    """A ``ckpt-N`` that is a symbolic link (to a checkpoint directory, or to a file) is
    skipped by retention with a RetentionWarning: the save that triggered it returns, the
    link and what it points at stay, no temp directory is left."""
    from shardkit import save
    from shardkit.errors import RetentionWarning

    root = tmp_path / "run"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    if target == "directory":
        save(elsewhere, {"s/x": np.ones(3)}, options=CheckpointOptions(durable=False))
    else:
        elsewhere.write_text("a file")
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir()} if target == "directory" \
        else elsewhere.read_bytes()
    os.symlink(elsewhere, root / "ckpt-1")
    manager, _ = make(root, max_to_keep=1)
    with pytest.warns(RetentionWarning, match="symbolic link") if target == "directory" \
            else _no_warning():
        manager.save(2, options=FAST)
        manager.save(3, options=FAST)
    assert names(root) == ["ckpt-1", "ckpt-3"]
    assert os.path.islink(root / "ckpt-1")
    after = {p.name: p.read_bytes() for p in elsewhere.iterdir()} if target == "directory" \
        else elsewhere.read_bytes()
    assert after == before
    assert names(tmp_path) == ["elsewhere", "run"]


class _no_warning:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
