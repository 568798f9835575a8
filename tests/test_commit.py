"""Atomic commit: temp directory, publication, overwrite by exchange, stale clean-up, locking."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardkit.errors import CheckpointExistsError, ShardkitError
from shardkit.format import MANIFEST_FILE
from shardkit.storage import commit

INDEX = json.dumps({"format": "shardkit", "format_version": "2.0"}).encode()


def _save(target: Path, content: str, *, overwrite: bool = False, durable: bool = False) -> Path:
    with commit.stage(target, overwrite=overwrite, durable=durable) as staging:
        tmp = staging.path
        assert tmp.parent == target.parent
        assert tmp.name.startswith(f".{target.name}.shardkit-tmp-")
        data = target / "data"
        assert not data.exists() or data.read_text() != content
        (tmp / "data").write_text(content)
        staging.commit(INDEX)
    return tmp


def _listing(parent: Path) -> list[str]:
    return sorted(os.listdir(parent))


def test_fresh_save_appears_whole_with_index_last(tmp_path):
    target = tmp_path / "ckpt"
    tmp = _save(target, "one")
    assert (target / "data").read_text() == "one"
    assert (target / MANIFEST_FILE).read_bytes() == INDEX
    assert not tmp.exists()
    assert _listing(tmp_path) == ["ckpt"]
    assert commit.is_checkpoint(target)


def test_missing_parents_are_created(tmp_path):
    target = tmp_path / "a" / "b" / "ckpt"
    _save(target, "x")
    assert (target / "data").read_text() == "x"


def test_existing_checkpoint_without_overwrite_is_an_error(tmp_path):
    target = tmp_path / "ckpt"
    _save(target, "one")
    with pytest.raises(CheckpointExistsError, match=r"ckpt already exists; pass overwrite=True"):
        commit.stage(target, overwrite=False, durable=False)
    assert (target / "data").read_text() == "one"
    assert _listing(tmp_path) == ["ckpt"]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "fallback"])
def test_overwrite_replaces_and_leaves_nothing_behind(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(commit, "_renameat2_fn", None)
    target = tmp_path / "ckpt"
    _save(target, "one")
    (target / "extra-old-file").write_text("old")
    _save(target, "two", overwrite=True, durable=True)
    assert (target / "data").read_text() == "two"
    assert not (target / "extra-old-file").exists()
    assert _listing(tmp_path) == ["ckpt"]


def test_exchange_is_used_when_available(tmp_path, monkeypatch):
    if commit._renameat2_fn is None:
        pytest.skip("renameat2 is not available on this platform")
    calls = []
    real = commit._call_renameat2
    monkeypatch.setattr(
        commit, "_call_renameat2", lambda s, d, f: calls.append(f) or real(s, d, f)
    )
    monkeypatch.setattr(commit, "_publish_fallback", lambda *a: pytest.fail("fallback used"))
    target = tmp_path / "ckpt"
    _save(target, "one")
    _save(target, "two", overwrite=True)
    assert calls == [commit._RENAME_NOREPLACE, commit._RENAME_NOREPLACE, commit._RENAME_EXCHANGE]
    assert (target / "data").read_text() == "two"


def test_overwrite_of_an_empty_directory_is_allowed(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    _save(target, "one", overwrite=True)
    assert (target / "data").read_text() == "one"


def test_overwrite_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    target = tmp_path / "mydata"
    target.mkdir()
    (target / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointExistsError,
                       match=r"not empty and holds no shardkit model\.safetensors\.index\.json "
                       r"\(a HuggingFace or other checkpoint is not shardkit's\)"
                       r"; refusing to replace it even with overwrite=True"):
        commit.stage(target, overwrite=True, durable=False)
    assert (target / "precious.txt").read_text() == "keep me"
    assert _listing(tmp_path) == ["mydata"]


@pytest.mark.parametrize("name", ["model.safetensors.index.json", "index.json"])
def test_overwrite_refuses_a_foreign_index_json(tmp_path, name):
    # a HuggingFace checkpoint: its manifest has metadata and weight_map, no shardkit section
    target = tmp_path / "hf"
    target.mkdir()
    (target / name).write_text(json.dumps({"metadata": {"total_size": 4},
                                           "weight_map": {"w": "model.safetensors"}}))
    (target / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(CheckpointExistsError,
                       match=r"holds no shardkit model\.safetensors\.index\.json"):
        commit.stage(target, overwrite=True, durable=False)
    assert (target / name).exists() and (target / "model.safetensors").read_bytes() == b"weights"


def test_a_2_1_checkpoint_with_index_json_is_replaced(tmp_path):
    target = tmp_path / "old"
    target.mkdir()
    (target / "index.json").write_bytes(INDEX)  # format 2.0 / 2.1 named the manifest so
    (target / "shard-00000-of-00001.safetensors").write_bytes(b"old")
    assert commit.is_checkpoint(target)
    _save(target, "new", overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == ["data", MANIFEST_FILE]


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_overwrite_refuses_files_and_symlinks(tmp_path, kind):
    target = tmp_path / "ckpt"
    if kind == "file":
        target.write_text("not a checkpoint")
    else:
        real = tmp_path / "real"
        _save(real, "one")
        target.symlink_to(real)
    with pytest.raises(CheckpointExistsError, match="is a file or a symlink"):
        commit.stage(target, overwrite=True, durable=False)
    assert os.path.lexists(target)


def test_bad_target_names(tmp_path):
    with pytest.raises(ShardkitError, match="not a directory name"):
        commit.stage("/", overwrite=False, durable=False)


def test_abort_on_exception_leaves_earlier_checkpoint_and_no_temp(tmp_path):
    target = tmp_path / "ckpt"
    _save(target, "one")
    with pytest.raises(RuntimeError, match="boom"):
        with commit.stage(target, overwrite=True, durable=False) as staging:
            (staging.path / "data").write_text("half")
            raise RuntimeError("boom")
    assert (target / "data").read_text() == "one"
    assert _listing(tmp_path) == ["ckpt"]


def test_commit_after_abort_is_an_error(tmp_path):
    staging = commit.stage(tmp_path / "ckpt", overwrite=False, durable=False)
    staging.abort()
    staging.abort()  # idempotent
    with pytest.raises(ShardkitError, match="already aborted"):
        staging.commit(INDEX)
    assert _listing(tmp_path) == []


def test_target_created_meanwhile_without_overwrite(tmp_path):
    target = tmp_path / "ckpt"
    with pytest.raises(CheckpointExistsError, match="created by someone else while this save ran"):
        with commit.stage(target, overwrite=False, durable=False) as staging:
            _save(target, "other")  # a concurrent saver wins the race
            staging.commit(INDEX)
    assert (target / "data").read_text() == "other"
    assert _listing(tmp_path) == ["ckpt"]


def test_durable_commit_fsyncs_index_directory_and_parent(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    target = tmp_path / "ckpt"
    with commit.stage(target, overwrite=False, durable=True) as staging:
        tmp = str(staging.path)
        staging.commit(INDEX)
    assert synced == [f"{tmp}/{MANIFEST_FILE}", tmp, str(tmp_path)]
    synced.clear()
    _save(tmp_path / "other", "x", durable=False)
    assert synced == []


def test_stale_temp_dirs_are_cleaned_by_the_next_save(tmp_path):
    stale = tmp_path / ".ckpt.shardkit-tmp-abc123"
    stale.mkdir()
    (stale / "model-00001-of-00001.safetensors").write_bytes(b"partial")
    stale_other = tmp_path / ".other.shardkit-tmp-zz9"
    stale_other.mkdir()
    unrelated = tmp_path / ".ckpt.backup"
    unrelated.mkdir()
    _save(tmp_path / "ckpt", "one")
    assert _listing(tmp_path) == [".ckpt.backup", "ckpt"]


def test_cleanup_skips_locked_temp_dirs(tmp_path):
    busy = tmp_path / ".ckpt.shardkit-tmp-busy1"
    busy.mkdir()
    fd = os.open(busy, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert commit.cleanup_stale(tmp_path) == []
        assert busy.exists()
    finally:
        os.close(fd)
    assert commit.cleanup_stale(tmp_path) == [busy.name]
    assert not busy.exists()


def test_a_running_save_in_the_same_process_survives_cleanup(tmp_path):
    with commit.stage(tmp_path / "a", overwrite=False, durable=False) as first:
        (first.path / "data").write_text("a")
        _save(tmp_path / "b", "b")  # its cleanup must not take the first save's temp dir
        assert (first.path / "data").read_text() == "a"
        first.commit(INDEX)
    assert (tmp_path / "a" / "data").read_text() == "a"
    assert _listing(tmp_path) == ["a", "b"]


def test_a_running_save_in_another_process_survives_cleanup(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        from shardkit import commit
        with commit.stage({str(tmp_path / "a")!r}, overwrite=False, durable=False) as s:
            (s.path / "data").write_text("a")
            print(s.path, flush=True)
            sys.stdin.readline()
            s.commit(b'{{"format": "shardkit"}}')
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        other_tmp = Path(child.stdout.readline().strip())
        assert other_tmp.exists()
        _save(tmp_path / "b", "b")
        assert (other_tmp / "data").read_text() == "a"
        child.stdin.write("\n")
        child.stdin.flush()
        child.stdin.close()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pipe in (child.stdin, child.stdout):
            pipe.close()
    assert _listing(tmp_path) == ["a", "b"]
    assert (tmp_path / "a" / "data").read_text() == "a"


def test_temp_dir_removed_before_locking_is_replaced(tmp_path, monkeypatch):
    real_flock = fcntl.flock
    raced = []

    def flock(fd: int, op: int) -> None:
        if not raced:  # a concurrent cleanup removes the fresh dir before we hold the lock
            raced.append(os.readlink(f"/proc/self/fd/{fd}"))
            os.rmdir(raced[0])
        real_flock(fd, op)

    monkeypatch.setattr(commit.fcntl, "flock", flock)
    staging = commit.stage(tmp_path / "ckpt", overwrite=False, durable=False)
    assert str(staging.path) != raced[0] and staging.path.is_dir()
    staging.commit(INDEX)
    assert _listing(tmp_path) == ["ckpt"]


def test_interrupted_fallback_overwrite_is_recovered(tmp_path):
    target = tmp_path / "ckpt"
    _save(target, "old")
    # A crash of the fallback between "rename old aside" and "rename new in".
    aside = tmp_path / ".ckpt.shardkit-old-x1y2"
    os.rename(target, aside)
    new = tmp_path / ".ckpt.shardkit-tmp-q9"
    new.mkdir()
    (new / "data").write_text("new")
    assert commit.cleanup_stale(tmp_path) == [new.name]  # the set-aside old one is kept
    assert aside.exists()
    assert commit.recover(target) is True
    assert (target / "data").read_text() == "old"
    assert commit.recover(target) is False
    assert _listing(tmp_path) == ["ckpt"]


def test_next_save_recovers_then_refuses_without_overwrite(tmp_path):
    target = tmp_path / "ckpt"
    _save(target, "old")
    os.rename(target, tmp_path / ".ckpt.shardkit-old-abc")
    with pytest.raises(CheckpointExistsError):
        commit.stage(target, overwrite=False, durable=False)
    assert (target / "data").read_text() == "old"
    _save(target, "new", overwrite=True)
    assert _listing(tmp_path) == ["ckpt"]
    assert (target / "data").read_text() == "new"


def test_leftover_old_dir_is_cleaned_once_the_checkpoint_exists(tmp_path):
    target = tmp_path / "ckpt"
    _save(target, "new")
    old = tmp_path / ".ckpt.shardkit-old-zzz"
    old.mkdir()
    (old / MANIFEST_FILE).write_bytes(INDEX)
    _save(tmp_path / "other", "x")
    assert _listing(tmp_path) == ["ckpt", "other"]


def test_is_checkpoint_reads_reordered_and_rejects_broken_indexes(tmp_path):
    reordered = tmp_path / "reordered"
    reordered.mkdir()
    (reordered / MANIFEST_FILE).write_text(
        json.dumps({"weight_map": {}, "shardkit": {}, "format": "shardkit"}))
    assert commit.is_checkpoint(reordered)
    no_section = tmp_path / "no-section"
    no_section.mkdir()
    (no_section / MANIFEST_FILE).write_text(json.dumps({"weight_map": {}, "format": "shardkit"}))
    assert not commit.is_checkpoint(no_section)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / MANIFEST_FILE).write_bytes(b'{"format": "shard')
    assert not commit.is_checkpoint(broken)
    assert not commit.is_checkpoint(tmp_path / "missing")


def test_published_directory_has_the_usual_mode(tmp_path):
    old_umask = os.umask(0o022)
    try:
        _save(tmp_path / "ckpt", "x")
    finally:
        os.umask(old_umask)
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o755


@pytest.mark.parametrize("kind", ["data-dir", "foreign-index", "file", "symlink"])
def test_no_overwrite_hint_where_overwrite_would_refuse(tmp_path, kind):
    # Without overwrite=True, a target that overwrite=True would also refuse gets the reason,
    # never the advice to pass overwrite=True.
    target = tmp_path / "target"
    if kind == "data-dir":
        target.mkdir()
        (target / "precious.txt").write_text("keep me")
    elif kind == "foreign-index":
        target.mkdir()
        (target / MANIFEST_FILE).write_text(json.dumps({"weight_map": {}}))
    elif kind == "file":
        target.write_text("not a checkpoint")
    else:
        real = tmp_path / "real"
        _save(real, "one")
        target.symlink_to(real)
    with pytest.raises(CheckpointExistsError) as info:
        commit.stage(target, overwrite=False, durable=False)
    message = str(info.value)
    assert "pass overwrite=True" not in message
    assert "Remove it or choose another path" in message
    assert os.path.lexists(target)


@pytest.mark.parametrize("kind", ["checkpoint", "empty-dir"])
def test_overwrite_hint_where_overwrite_would_replace(tmp_path, kind):
    target = tmp_path / "target"
    if kind == "checkpoint":
        _save(target, "one")
    else:
        target.mkdir()
    with pytest.raises(CheckpointExistsError, match="already exists; pass overwrite=True"):
        commit.stage(target, overwrite=False, durable=False)


def test_no_overwrite_hint_for_data_created_meanwhile(tmp_path):
    target = tmp_path / "ckpt"
    with pytest.raises(CheckpointExistsError) as info:
        with commit.stage(target, overwrite=False, durable=False) as staging:
            target.mkdir()  # someone else's data appears while this save runs
            (target / "precious.txt").write_text("keep me")
            staging.commit(INDEX)
    assert "pass overwrite=True" not in str(info.value)
    assert "refusing to replace it even with overwrite=True" in str(info.value)
    assert (target / "precious.txt").read_text() == "keep me"


def test_save_into_a_data_directory_gives_no_overwrite_hint(tmp_path):
    import numpy as np

    import shardkit

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError) as info:
        shardkit.save(tmp_path / "data", {"w": np.zeros(3)})
    assert "overwrite=True" in str(info.value) and "pass overwrite=True" not in str(info.value)


def test_a_tensorbundle_set_aside_by_an_earlier_release_is_moved_back(tmp_path):
    """Earlier releases moved the old bundle's files into their temp directory (``.old.*``,
    the index first) before renaming the new ones in; killed there, the temp directory held
    the only copy, and the next save's clean-up deleted it."""
    import numpy as np

    import shardkit

    old = {"a": np.arange(5.0), "b": np.ones(3, np.int32)}
    shardkit.save(tmp_path / "ck", old, format="tensorflow")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    stale = tmp_path / ".ck.shardkit-tmp-k1ll3d"
    stale.mkdir()
    for name in ["ck.index", *sorted(n for n in before if n != "ck.index")]:
        os.rename(tmp_path / name, stale / f".old.{name}")
    (stale / "ck.index").write_bytes(b"the new index, never renamed in")
    (tmp_path / "ck.data-00000-of-00001").write_bytes(b"the new data file, renamed in")
    shardkit.save(tmp_path / "other", {"x": np.zeros(1)}, format="tensorflow")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()
            if p.name.startswith("ck")} == before
    assert not [n for n in os.listdir(tmp_path) if ".shardkit-" in n]
    got = shardkit.load(tmp_path / "ck", verify=True)
    assert all(got[k].tobytes() == v.tobytes() for k, v in old.items())


def test_set_aside_files_are_not_restored_over_a_published_index(tmp_path):
    (tmp_path / "ck.index").write_bytes(b"new")
    stale = tmp_path / ".ck.shardkit-tmp-done"
    stale.mkdir()
    (stale / ".old.ck.index").write_bytes(b"old")
    assert commit.cleanup_stale(tmp_path) == [stale.name]
    assert _listing(tmp_path) == ["ck.index"] and (tmp_path / "ck.index").read_bytes() == b"new"


def test_recover_waits_for_a_running_save_of_that_path(tmp_path):
    target = tmp_path / "ckpt"
    _save(target, "old")
    os.rename(target, tmp_path / ".ckpt.shardkit-old-a1")  # a fallback between its renames
    running = tmp_path / ".ckpt.shardkit-tmp-r1"
    running.mkdir()
    fd = os.open(running, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert commit.recover(target) is False  # that save puts its checkpoint there next
    finally:
        os.close(fd)
    assert commit.recover(target) is True  # it died: the old one goes back
    assert (target / "data").read_text() == "old"


def test_a_reader_of_a_path_left_missing_by_the_fallback_finds_the_old_checkpoint(tmp_path):
    import numpy as np

    import shardkit

    shardkit.save(tmp_path / "ck", {"a": np.arange(3.0)})
    os.rename(tmp_path / "ck", tmp_path / ".ck.shardkit-old-a1")  # killed between the renames
    assert shardkit.load(tmp_path / "ck", verify=True)["a"].tolist() == [0.0, 1.0, 2.0]
    assert _listing(tmp_path) == ["ck"]


def test_a_replaced_checkpoint_loses_its_manifest_first(tmp_path, monkeypatch):
    """Its removal cut short must not leave something `recover` would take for a checkpoint."""
    target = tmp_path / "ckpt"
    _save(target, "old")
    seen = []
    real = commit.remove_tree

    def remove_tree(path):
        seen.append(sorted(os.listdir(path)))
        real(path)

    monkeypatch.setattr(commit, "remove_tree", remove_tree)
    _save(target, "new", overwrite=True)
    assert seen == [["data"]]


def test_a_partly_removed_old_dir_is_not_recovered(tmp_path):
    aside = tmp_path / ".ckpt.shardkit-old-b2"
    aside.mkdir()
    (aside / "data").write_text("half of a deleted checkpoint")
    assert commit.recover(tmp_path / "ckpt") is False
    assert commit.cleanup_stale(tmp_path) == [aside.name]
