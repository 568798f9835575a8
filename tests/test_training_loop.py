"""A real training loop: checkpoint every few steps, SIGKILL the process, resume, compare.

A small torch MLP trains on CPU with Adam (fixed seeds, deterministic algorithms, one thread),
saved every 3 steps by a CheckpointManager, synchronously or asynchronously. The process is
killed with SIGKILL and a new one resumes from the latest checkpoint. The resumed weights and
optimizer state must equal the saved ones byte for byte, and the resumed losses must equal those
of an uninterrupted run bit for bit.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardkit.format import MANIFEST_FILE
from shardkit.io.reader import open_checkpoint

pytest.importorskip("torch", reason="torch is an optional dependency")

ROOT = Path(__file__).resolve().parents[1]
TOTAL_STEPS = 20
MAX_TO_KEEP = 3

TRAIN = textwrap.dedent(
    """
    import hashlib, json, sys, time
    import numpy as np
    import torch

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    from shardkit.checkpoint import Checkpoint, CheckpointManager
    from shardkit.io.options import CheckpointOptions

    directory, mode, total, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    progress = {"step": np.zeros((), np.int64)}
    ckpt = Checkpoint(model=model, optimizer=opt, progress=progress)
    manager = CheckpointManager(ckpt, directory, max_to_keep=%(keep)d)
    options = CheckpointOptions(enable_async=mode == "async")

    def digest():
        h = hashlib.sha256()
        tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
        for i, s in opt.state_dict()["state"].items():
            tensors.update({f"optimizer/state/{i}/{k}": v for k, v in s.items()})
        for key in sorted(tensors):
            h.update(key.encode())
            h.update(tensors[key].contiguous().numpy().tobytes())
        groups = [{k: v for k, v in g.items()} for g in opt.state_dict()["param_groups"]]
        return h.hexdigest() + " " + json.dumps(groups, sort_keys=True)

    def say(*words):
        print(*words, flush=True)

    restored = manager.restore_or_initialize()
    if restored is not None:
        say("RESTORED", int(progress["step"]), digest())
    for s in range(int(progress["step"]), total):
        g = torch.Generator().manual_seed(1000 + s)
        x = torch.randn(16, 8, generator=g)
        y = torch.sin(x.sum(1, keepdim=True))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        progress["step"][...] = s + 1
        say("LOSS", s, loss.item().hex())
        if (s + 1) %% 3 == 0:
            manager.save(checkpoint_number=s + 1, options=options)
            say("SAVED", s + 1, digest())
        if s + 1 == kill_at:
            say("KILLME")
            time.sleep(120)
    manager.sync()
    say("DONE")
    """
) % {"keep": MAX_TO_KEEP}


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def parse(lines: list[str]) -> tuple[dict[int, str], dict[int, str], tuple[int, str] | None]:
    losses, saved, restored = {}, {}, None
    for line in lines:
        kind, _, rest = line.partition(" ")
        if kind == "LOSS":
            step, value = rest.split()
            losses[int(step)] = value
        elif kind == "SAVED":
            step, value = rest.split(" ", 1)
            saved[int(step)] = value
        elif kind == "RESTORED":
            step, value = rest.split(" ", 1)
            restored = (int(step), value)
    return losses, saved, restored


def train(script: Path, directory: Path, mode: str, kill_at: int = -1) -> list[str]:
    """Run the loop; with kill_at, SIGKILL it once it reports that step. Returns its lines."""
    args = [sys.executable, "-u", str(script), str(directory), mode, str(TOTAL_STEPS),
            str(kill_at)]
    lines = []
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env()) as proc:
        try:
            assert proc.stdout is not None and proc.stderr is not None
            for line in proc.stdout:
                line = line.strip()
                lines.append(line)
                if line == "KILLME":
                    os.kill(proc.pid, signal.SIGKILL)
                    break
            proc.wait(timeout=120)
            stderr = proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if kill_at > 0:
        assert proc.returncode == -signal.SIGKILL, stderr
    else:
        assert proc.returncode == 0 and lines[-1] == "DONE", stderr
    return lines


def file_digest(path: str) -> str:
    """The digest the training script computes, but from the checkpoint's files."""
    h = hashlib.sha256()
    with open_checkpoint(path) as reader:
        keys = [k for k in reader.keys() if k.startswith(("model/", "optimizer/state/"))]
        for key in sorted(keys):
            h.update(key.encode())
            h.update(reader.get(key).tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("train") / "train.py"
    path.write_text(TRAIN)
    return path


@pytest.fixture(scope="module")
def uninterrupted(script, tmp_path_factory) -> dict[int, str]:
    lines = train(script, tmp_path_factory.mktemp("reference"), "sync")
    losses, _, _ = parse(lines)
    assert sorted(losses) == list(range(TOTAL_STEPS))
    return losses


@pytest.mark.parametrize(("mode", "kill_at"), [("sync", 11), ("async", 12)])
def test_kill_and_resume(script, uninterrupted, tmp_path, mode, kill_at):
    run = tmp_path / "run"
    first = train(script, run, mode, kill_at)
    losses1, saved, _ = parse(first)
    assert max(losses1) == kill_at - 1

    # The latest committed checkpoint: the last save that finished before the kill. An async
    # save started right before the kill may or may not have committed; never half of one.
    committed = sorted(int(p.name.split("-")[1]) for p in run.iterdir()
                       if p.name.startswith("ckpt-") and (p / MANIFEST_FILE).exists())
    latest = committed[-1]
    expected_latest = {("sync", 11): {9}, ("async", 12): {9, 12}}[(mode, kill_at)]
    assert latest in expected_latest
    # a kill can land after an (async) save's commit and before its retention: one more then,
    # never fewer, and never a half-deleted one (the final listing below)
    assert len(committed) <= MAX_TO_KEEP + 1
    assert file_digest(str(run / f"ckpt-{latest}")) == saved[latest].split(" ")[0]

    second = train(script, run, mode)
    losses2, _, restored = parse(second)
    assert restored is not None
    step, state = restored
    assert step == latest
    assert state == saved[latest]  # weights, optimizer state and hyperparameters, byte for byte
    assert sorted(losses2) == list(range(latest, TOTAL_STEPS))
    assert {s: losses2[s] for s in losses2} == {s: uninterrupted[s] for s in losses2}
    assert {s: losses1[s] for s in losses1} == {s: uninterrupted[s] for s in losses1}

    names = sorted(p.name for p in run.iterdir())
    assert names == [f"ckpt-{n}" for n in (12, 15, 18)]  # exactly max_to_keep, nothing else
