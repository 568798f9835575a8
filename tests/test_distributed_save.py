"""Collective saves on torch.distributed (gloo, spawned ranks on this machine).

Each test spawns its ranks once (tests/distributed.py) and runs several cases per spawn:
spawning costs about 2 s per rank.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import distributed as harness  # noqa: E402  (tests/distributed.py)

import shardkit  # noqa: E402
from shardkit.coordinator import Coordinator  # noqa: E402
from shardkit.errors import (  # noqa: E402
    DistributedSaveError,
    DistributedStateError,
    DistributedTimeoutError,
)
from shardkit.storage import commit  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch built without torch.distributed")


class CountingCoordinator(Coordinator):
    """A coordinator that counts the collectives made through it (`calls`, by kind) and
    forwards them to `inner`: how tests check that a save makes a constant number."""

    def __init__(self, inner: Coordinator) -> None:
        self.inner = inner
        self.calls: list[str] = []

    timeout = property(lambda self: self.inner.timeout,  # type: ignore[assignment]
                       lambda self, value: setattr(self.inner, "timeout", value))
    rank = property(lambda self: self.inner.rank)  # type: ignore[assignment]
    world_size = property(lambda self: self.inner.world_size)  # type: ignore[assignment]

    def _call(self, kind: str, *args: Any) -> Any:
        self.calls.append(kind)
        return getattr(self.inner, kind)(*args)

    def all_gather(self, payload: Any, op: str) -> list[Any]:
        return self._call("all_gather", payload, op)

    def gather(self, payload: Any, op: str, dst: int = 0) -> list[Any] | None:
        return self._call("gather", payload, op, dst)

    def broadcast(self, payload: Any, op: str, src: int = 0) -> Any:
        return self._call("broadcast", payload, op, src)

    def barrier(self, op: str) -> None:
        self._call("barrier", op)

    def background(self) -> Coordinator:
        got = getattr(self, "_background", None)
        if got is None:
            got = self._background = CountingCoordinator(self.inner.background())
        return got


def _global_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "s0": rng.standard_normal((9, 6)).astype(np.float32),
        "s1": rng.standard_normal((5, 10)).astype(np.float32),
        "rep": rng.standard_normal((4, 4)).astype(np.float64),
        "uneven": np.arange(7 * 3, dtype=np.int32).reshape(7, 3),
        "tiny": np.arange(3 * 2, dtype=np.int64).reshape(3, 2),  # some ranks hold nothing
        "bf16": rng.standard_normal((8, 4)).astype(np.float32),
        "empty": np.zeros((0, 5), np.float32),
        "m2_a": rng.standard_normal((6, 8)).astype(np.float32),
        "m2_b": rng.standard_normal((6, 8)).astype(np.float32),
        "m2_c": rng.standard_normal((6, 8)).astype(np.float32),
    }


def _placement_state(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = {k: torch.from_numpy(v.copy()) for k, v in _global_tensors().items()}
    g["bf16"] = g["bf16"].to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    state = {
        "s0": distribute_tensor(g["s0"], mesh, [Shard(0)]),
        "s1": distribute_tensor(g["s1"], mesh, [Shard(1)]),
        "rep": distribute_tensor(g["rep"], mesh, [Replicate()]),
        "uneven": distribute_tensor(g["uneven"], mesh, [Shard(0)]),
        "tiny": distribute_tensor(g["tiny"], mesh, [Shard(0)]),
        "bf16": distribute_tensor(g["bf16"], mesh, [Shard(0)]),
        "empty": distribute_tensor(g["empty"], mesh, [Shard(0)]),
        "plain": torch.full((16,), 3.0),  # a plain tensor on every rank: written once
        "step": torch.tensor(12),
        f"own{rank}": np.full((rank + 1,), rank, np.int16),  # each rank's own key
    }
    if world == 4:
        mesh2 = init_device_mesh("cpu", (2, 2))
        state["m2_a"] = distribute_tensor(g["m2_a"], mesh2, [Shard(0), Replicate()])
        state["m2_b"] = distribute_tensor(g["m2_b"], mesh2, [Replicate(), Shard(1)])
        state["m2_c"] = distribute_tensor(g["m2_c"], mesh2, [Shard(0), Shard(1)])
    return state


def _save_placements(rank: int, world: int, path: str) -> tuple:
    info = shardkit.save(path, _placement_state(rank, world))
    return info.files, info.generation, info.path


def _expected(world: int) -> dict[str, np.ndarray]:
    g = _global_tensors()
    if world != 4:
        for k in ("m2_a", "m2_b", "m2_c"):
            del g[k]
    out = dict(g)
    out["plain"] = np.full((16,), 3.0, np.float32)
    out["step"] = np.array(12, np.int64)
    for r in range(world):
        out[f"own{r}"] = np.full((r + 1,), r, np.int16)
    return out


def _check_saved(path: str, world: int, results: list) -> None:
    harness.raise_any(results)
    assert len({r for r in results}) == 1  # same files, generation and path on every rank
    loaded = shardkit.load(path)
    expected = _expected(world)
    assert set(loaded) == set(expected)
    import ml_dtypes

    for key, want in expected.items():
        got = loaded[key]
        if key == "bf16":
            want = want.astype(ml_dtypes.bfloat16)
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert got.tobytes() == want.tobytes(), key
    with shardkit.open(path) as reader:
        reader.verify()
    with shardkit.open(path) as reader:
        index = reader.index
    # the default policy cut the whole layout for the writer threads of all ranks: each rank's
    # share of the cores the ranks share on this machine
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert f"threads={max(1, min(8, (cores or 1) // world)) * world}," in index.callback
    # every shard is written by one rank and named in one global numbering
    tasks = sorted({s.task for s in index.shards})
    assert set(tasks) <= set(range(world))
    n = len(index.shards)
    assert [s.file for s in index.shards] == [
        f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    # whole tensors are plain safetensors entries: read them with safetensors itself
    from safetensors.numpy import load_file

    whole = {key: file for key, file in _weight_map(path).items()}
    assert {"plain", "step", "rep", "empty"} <= set(whole)
    for key, file in whole.items():
        entry = load_file(os.path.join(path, file))[key]
        if key != "bf16":
            assert entry.tobytes() == expected[key].tobytes(), key
    assert not [e for e in os.listdir(os.path.dirname(path)) if commit.TMP_MARK in e]


def _weight_map(path: str) -> dict[str, str]:
    import json

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return json.load(f)["weight_map"]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dtensor_placements_saved_as_global_slices(tmp_path, world):
    path = str(tmp_path / "ckpt")
    _check_saved(path, world, harness.run_ranks(_save_placements, world, path))


def _replicated_state(rank: int, world: int, path: str) -> tuple:
    # 12 replicated plain tensors of different sizes, and one shard each: the copies are
    # spread so that every rank writes about the same bytes
    sizes = [1000, 900, 800, 700, 600, 500, 400, 300, 200, 100, 50, 25]
    state = {f"r{i}": torch.full((n,), float(i)) for i, n in enumerate(sizes)}
    state[f"only{rank}"] = torch.zeros(100)
    policy = shardkit.DefaultShardingPolicy(threads=5)  # given: each rank writes its own files
    info = shardkit.save(path, state, process_group=torch.distributed.group.WORLD,
                         options=shardkit.CheckpointOptions(threads=5,
                                                            experimental_sharding_callback=policy))
    return info.files


def test_replicated_data_written_once_with_balanced_bytes(tmp_path):
    path = str(tmp_path / "ckpt")
    harness.raise_any(harness.run_ranks(_replicated_state, 3, path))
    with shardkit.open(path) as reader:
        index = reader.index
        assert "threads=5," in index.callback  # threads= asked for: not the share
        per_task = {t: 0 for t in range(3)}
        for s in index.shards:
            per_task[s.task] += s.bytes
        keys = list(reader.keys())
        for i in range(12):
            assert reader.index.tensor_info(f"r{i}").slices[0].spec == ""
    assert len(keys) == 15 and len(index.slice_tensor) == 15  # each replicated tensor once
    data = [b - 0 for b in per_task.values()]
    assert max(data) - min(data) < 1000 * 4 + 600, per_task  # within about one large piece


def _failures(rank: int, world: int, root: str) -> dict:
    """Several failing saves over the same process group; each must fail on every rank the
    same way and leave the earlier checkpoint at the path intact."""
    import shardkit.distributed.whole as whole
    import shardkit.storage.native as writer  # the native write path
    from shardkit._kernels import _gather
    from shardkit.distributed.torch import TorchCoordinator
    from shardkit.sharding.policies import ShardByTaskPolicy

    out: dict = {}
    path = os.path.join(root, "ckpt")
    base = {"w": torch.arange(8.0), f"own{rank}": torch.ones(4)}
    first = shardkit.save(path, base, process_group=torch.distributed.group.WORLD)
    out["first"] = first.generation

    def attempt(name, state, **kw):
        try:
            shardkit.save(path, state, process_group=torch.distributed.group.WORLD,
                          overwrite=True, **kw)
            out[name] = "saved"
        except Exception as e:
            out[name] = (type(e).__name__, getattr(e, "rank", None), str(e))
        torch.distributed.barrier()  # every rank has returned: no temp directory is left
        out[name + "/tmp"] = sorted(e for e in os.listdir(root) if commit.TMP_MARK in e)
        torch.distributed.barrier()  # before the next save makes one

    # shape and dtype must agree across ranks
    attempt("shape", {"x": torch.zeros(3 + rank)})
    attempt("dtype", {"x": torch.zeros(3, dtype=torch.float32 if rank else torch.float64)})

    class Raising(ShardByTaskPolicy):
        def __call__(self, tensors):
            if rank == 1:
                raise RuntimeError("callback broke on purpose")
            return super().__call__(tensors)

    attempt("callback", {"y": torch.ones(5), f"k{rank}": torch.ones(2)},
            options=shardkit.CheckpointOptions(experimental_sharding_callback=Raising()))

    class Dropping(ShardByTaskPolicy):
        def __call__(self, tensors):
            shards = super().__call__(tensors)
            if rank == 1:
                shards[0].popitem()
            return shards

    attempt("validation", {"y": torch.ones(5), f"k{rank}": torch.ones(2)},
            options=shardkit.CheckpointOptions(experimental_sharding_callback=Dropping()))

    real_region = writer._write_region

    def failing_region(region, *a):
        if rank == 1:
            raise OSError(errno.EIO, "injected write failure")
        return real_region(region, *a)

    real_pwrite = whole._pwrite_all  # the whole-tensor layout's writes

    def failing_pwrite(jobs):
        if rank == 1:
            raise OSError(errno.EIO, "injected write failure")
        return real_pwrite(jobs)

    writer._write_region, whole._pwrite_all = failing_region, failing_pwrite
    try:
        attempt("write", {"z": torch.ones(100), f"k{rank}": torch.ones(2)})
    finally:
        writer._write_region, whole._pwrite_all = real_region, real_pwrite

    real_prealloc = _gather.preallocate

    def full_disk(fd, size):
        if rank == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_prealloc(fd, size)

    _gather.preallocate = full_disk
    try:
        attempt("enospc", {"z": torch.ones(100), f"k{rank}": torch.ones(2)})
    finally:
        _gather.preallocate = real_prealloc

    try:  # an existing checkpoint without overwrite
        shardkit.save(path, base, process_group=torch.distributed.group.WORLD)
        out["exists"] = "saved"
    except Exception as e:
        out["exists"] = (type(e).__name__, getattr(e, "rank", None), str(e))

    try:  # every rank must name the same path
        shardkit.save(os.path.join(root, f"p{rank}"), base,
                      process_group=torch.distributed.group.WORLD)
        out["paths"] = "saved"
    except Exception as e:
        out["paths"] = (type(e).__name__, getattr(e, "rank", None), str(e))

    # the number of collectives does not depend on the number of tensors
    counts = []
    for n in (3, 300, 3000):
        coord = CountingCoordinator(TorchCoordinator())
        state = {f"t{i}": torch.full((2,), float(i)) for i in range(n)}
        state.update({f"mine{rank}/{i}": torch.ones(1) for i in range(n)})
        shardkit.save(os.path.join(root, f"count{n}"), state, process_group=coord)
        counts.append(list(coord.calls))
    out["counts"] = counts
    # payloads that fit one round and larger ones (a second round), mixed across the ranks
    coord = TorchCoordinator()
    big = bytes(range(256)) * 1024
    for case in ((b"x", b"x"), (big, big), (b"x", big), (big, b"x")):
        every = [(0, case[0]), (1, case[1])]
        assert coord.all_gather(every[rank], "test") == every
        assert coord.gather(every[rank], "test", dst=1) == (every if rank == 1 else None)
        assert coord.broadcast(every[1] if rank == 1 else None, "test", src=1) == every[1]
    out["coordinated"] = [len(p) for _, p in coord.all_gather((rank, big[: 70000 * rank]),
                                                              "test")]
    out["final"] = shardkit.open(path).index.generation
    # compressed shards, written by each rank the same way
    shardkit.save(os.path.join(root, "zstd"), {"rep": torch.arange(64.0), f"own{rank}":
                  torch.full((100,), float(rank))},
                  options=shardkit.CheckpointOptions(compression="zstd"),
                  process_group=torch.distributed.group.WORLD)
    # without DTensors or a group, a save is this process's alone: rank 0 saves, rank 1 not
    if rank == 0:
        shardkit.save(os.path.join(root, "alone"), {"a": torch.ones(2)})
    torch.distributed.barrier()
    # last (the group is unusable afterwards): a rank that is late fails the others within
    # the timeout, naming it, and never hangs them
    if rank == 1:
        time.sleep(3)
    started = time.monotonic()
    try:
        shardkit.save(os.path.join(root, "late"), base,
                      process_group=torch.distributed.group.WORLD, timeout=1)
        out["late"] = "saved"
    except DistributedTimeoutError as e:
        out["late"] = (type(e).__name__, str(e), time.monotonic() - started)
    return out


def test_failures_on_one_rank_fail_every_rank_and_keep_the_earlier_checkpoint(tmp_path):
    results = harness.raise_any(harness.run_ranks(_failures, 2, str(tmp_path)))
    r0, r1 = results
    assert r0["first"] == r1["first"] == r0["final"] == r1["final"]
    for case in ("shape", "dtype"):
        for r in results:
            kind, _, message = r[case]
            assert kind == "DistributedStateError" and "'x'" in message
            assert "rank 0" in message and "rank 1" in message
    assert "[3]" in r0["shape"][2] and "[4]" in r0["shape"][2]
    assert r0["shape"] == r1["shape"] and r0["dtype"] == r1["dtype"]
    for case, failing, words in (("callback", 1, "callback broke on purpose"),
                                 ("validation", 1, "ShardingValidationError"),
                                 ("write", 1, "injected write failure"),
                                 ("enospc", 0, "No space left on device")):
        for r in results:
            kind, who, message = r[case]
            assert (kind, who) == ("DistributedSaveError", failing), (case, r[case])
            assert words in message and f"failed on rank {failing}" in message, message
            assert r[case + "/tmp"] == [], case
        assert r0[case] == r1[case]
    for r in results:
        assert r["exists"][:2] == ("DistributedSaveError", 0)
        assert "CheckpointExistsError" in r["exists"][2]
        assert r["paths"][0] == "DistributedStateError" and "same path" in r["paths"][2]
        assert r["counts"][0] == r["counts"][1] == r["counts"][2]
        assert r["counts"][0] == ["all_gather", "all_gather", "gather", "broadcast"]
        assert r["coordinated"] == [0, 70000]
    assert not os.path.exists(tmp_path / "p0") and not os.path.exists(tmp_path / "p1")
    zstd = shardkit.load(str(tmp_path / "zstd"))
    assert (zstd["rep"] == np.arange(64.0, dtype=np.float32)).all()
    assert (zstd["own0"] == 0).all() and (zstd["own1"] == 1).all()
    with shardkit.open(str(tmp_path / "zstd")) as reader:
        assert {s.codec for s in reader.index.shards} == {"zstd"}
        assert {s.task for s in reader.index.shards} == {0, 1}
    with shardkit.open(str(tmp_path / "alone")) as reader:
        assert list(reader.keys()) == ["a"] and reader.index.shards[0].task == 0
    kind, message, elapsed = r0["late"]
    assert kind == "DistributedTimeoutError" and "rank 1 did not answer" in message, message
    assert "'plan'" in message and elapsed < 2.5, r0["late"]
    assert r1["late"][0] == "DistributedTimeoutError"
    assert not os.path.exists(tmp_path / "late")
    with shardkit.open(str(tmp_path / "count3000")) as reader:
        assert len(reader.keys()) == 3000 + 2 * 3000


def _fsdp2(rank: int, world: int, path: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        torch.manual_seed(1 + rank)
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    state = {"model": model.state_dict(), "optim": opt.state_dict()["state"]}
    shardkit.save(path, state)
    from torch.distributed.tensor import DTensor

    from shardkit.sharding.tensors import flatten_columns

    full = {}
    for key, value in zip(*flatten_columns(state)):
        value = value.full_tensor() if isinstance(value, DTensor) else value
        full[key] = value.detach().numpy().copy()
    return full


def test_fsdp2_model_and_optimizer_state(tmp_path):
    path = str(tmp_path / "ckpt")
    results = harness.raise_any(harness.run_ranks(_fsdp2, 2, path))
    assert results[0].keys() == results[1].keys()
    loaded = shardkit.load(path)
    assert set(loaded) == set(results[0])
    for key, want in results[0].items():
        assert loaded[key].tobytes() == want.tobytes() and loaded[key].shape == want.shape, key
    assert any(k.endswith("exp_avg_sq") for k in loaded)


KILL_ROUNDS = 20


def _kill_round(rank: int, world: int, i: int, path: str, parent_generation: str) -> tuple:
    import shardkit.distributed.whole as whole
    import shardkit.storage.native as writer  # the native write path
    from shardkit.sharding.policies import ShardByTaskPolicy

    victim = i % world
    where = ("callback", "write", "whole")[(i // world) % 3]  # "whole": the default layout

    class Killing(ShardByTaskPolicy):
        def __call__(self, tensors):
            if rank == victim and where == "callback":
                os.kill(os.getpid(), signal.SIGKILL)
            return super().__call__(tensors)

    if rank == victim and where == "write":
        real = writer._write_region

        def write_then_die(region, *a):
            real(region, *a)  # some bytes are on disk
            os.kill(os.getpid(), signal.SIGKILL)

        writer._write_region = write_then_die
    if rank == victim and where == "whole":
        real_runs = whole._pwrite_all

        def runs_then_die(jobs):
            real_runs(jobs[: len(jobs) // 2 + 1])  # some bytes are in the shared files
            os.kill(os.getpid(), signal.SIGKILL)

        whole._pwrite_all = runs_then_die
    state = {"w": torch.arange(1000.0), f"own{rank}": torch.ones(5000)}
    started = time.monotonic()
    callback = None if where == "whole" else Killing()
    try:
        shardkit.save(path, state, process_group=torch.distributed.group.WORLD,
                      overwrite=True, timeout=10,
                      options=shardkit.CheckpointOptions(experimental_sharding_callback=callback))
        outcome = "saved"
    except (DistributedTimeoutError, DistributedSaveError) as e:
        outcome = type(e).__name__
    elapsed = time.monotonic() - started
    generation = shardkit.open(path).index.generation
    tmp = sorted(e for e in os.listdir(os.path.dirname(path)) if commit.TMP_MARK in e)
    return outcome, elapsed, generation == parent_generation, tmp, victim


def _kill_rounds(rank: int, world: int, path: str, workdir: str, generation: str) -> list:
    return harness.forked_rounds(
        rank, world, KILL_ROUNDS, workdir,
        lambda r, w, i: _kill_round(r, w, i, path, generation), timeout=30)


def test_a_rank_killed_mid_save_never_leaves_a_partial_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    earlier = shardkit.save(path, {"w": np.arange(3.0)})
    work = tmp_path / "stores"
    work.mkdir()
    results = harness.raise_any(harness.run_ranks(
        _kill_rounds, 2, path, str(work), earlier.generation, init=False, timeout=240))
    for i in range(KILL_ROUNDS):
        victim = i % 2
        survivor = results[1 - victim][i]
        assert results[victim][i] == ("killed", signal.SIGKILL), (i, results[victim][i])
        assert not isinstance(survivor, BaseException), (i, survivor)
        outcome, elapsed, intact, tmp, _ = survivor
        assert outcome in ("DistributedTimeoutError", "DistributedSaveError"), (i, survivor)
        assert elapsed < 10 + 5, (i, survivor)
        assert intact, (i, survivor)  # the earlier checkpoint, never a partial new one
        if victim == 1:  # rank 0 survived and removed the temp directory
            assert tmp == [], (i, survivor)
    assert shardkit.open(path).index.generation == earlier.generation
    with shardkit.open(path) as reader:
        reader.verify()
    commit.cleanup_stale(str(tmp_path))  # what a dead rank 0 left is stale, and goes
    assert not [e for e in os.listdir(tmp_path) if commit.TMP_MARK in e]


def test_single_process_save_does_not_import_torch_distributed(tmp_path):
    import subprocess
    import sys

    code = ("import sys, numpy as np, shardkit; shardkit.save(sys.argv[1], {'a': np.ones(3)});"
            "print(sorted(m for m in sys.modules if m.startswith(('torch', 'shardkit.distr'))))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def _cols(keys, specs, dtypes, shapes, nbytes):
    from shardkit.distributed.save import columns

    return columns(keys, specs, dtypes, shapes, nbytes, ["/job:worker/task:0"] * len(keys))


def test_assign_balances_and_checks_pieces():
    from shardkit.distributed.save import EXACT, plan

    cols = [
        _cols(["a", "b", "c"], ["", "", ""], ["F32"] * 3, [(10,), (20,), (5,)], [40, 80, 20]),
        _cols(["a", "b", "d"], ["", "", ""], ["F32"] * 3, [(10,), (20,), (5,)], [40, 80, 20]),
    ]
    # c and d are single-held (20 bytes each); b (largest) goes to the least-loaded holder,
    # the lower rank on a tie, then a to the other
    assert plan(cols).mine == [[1, 2], [0, 2]]
    pieces = plan(cols)
    assert [pieces.keys[i] for i in pieces.tensor_first] == ["a", "b", "c", "d"]
    assert pieces.tensor_row.tolist() == [0, 1, 2, 0, 1, 3]
    with pytest.raises(DistributedStateError, match=r"'a'.*rank 0.*F32.*rank 1.*F64"):
        plan([_cols(["a"], [""], ["F32"], [(10,)], [40]),
                _cols(["a"], [""], ["F64"], [(10,)], [80])])
    with pytest.raises(DistributedStateError, match=r"'a'.*rank 0.*\[10\].*rank 1.*\[11\]"):
        plan([_cols(["a"], [""], ["F32"], [(10,)], [40]),
                _cols(["a"], [""], ["F32"], [(11,)], [44])])
    with pytest.raises(DistributedStateError, match="missing or two overlap"):
        plan([_cols(["a"], ["4 2 0,2:0,2"], ["F32"], [(4, 2)], [16]), _cols([], [], [], [], [])])
    with pytest.raises(DistributedStateError, match="missing or two overlap"):  # overlap
        plan([_cols(["a", "a"], ["2 0,2", "2 1,1"], ["F32"] * 2, [(2,), (2,)], [8, 4])])
    # beyond EXACT replicated pieces the small ones go round-robin: still every piece once,
    # and 3 ranks within a few pieces of each other
    n = EXACT + 3000
    shared = _cols([f"k{i}" for i in range(n)], [""] * n, ["F32"] * n, [(1 + i % 7,)
                   for i in range(n)], [4 * (1 + i % 7) for i in range(n)])
    mine = plan([shared, shared, shared]).mine
    assert sorted(i for m in mine for i in m) == list(range(n))
    loads = [sum(4 * (1 + i % 7) for i in m) for m in mine]
    assert max(loads) - min(loads) <= 2 * 28, loads
    assert plan([_cols([], [], [], [], [])] * 2).mine == [[], []]


def test_writer_threads_share_the_cores_of_a_machine_among_its_ranks():
    from shardkit.distributed.save import machine, writer_threads

    a, b = frozenset({0, 1}), frozenset({2, 3})
    eight = frozenset(range(8))
    # two ranks on one machine, both free to use its 8 cores: 4 threads each
    assert [writer_threads([("h", eight), ("h", eight)], r) for r in (0, 1)] == [4, 4]
    # ranks pinned to cores of their own do not share: each uses all of its own
    assert [writer_threads([("h", a), ("h", b)], r) for r in (0, 1)] == [2, 2]
    # ranks on other machines do not count; more ranks than cores: one thread each
    assert writer_threads([("h", a), ("g", a), ("g", a)], 0) == 2
    assert writer_threads([("h", a)] * 4, 3) == 1
    assert writer_threads([("h", frozenset(range(64)))], 0) == 8  # at most 8
    host, cores = machine()
    assert host and cores and cores <= frozenset(range(4096))
    assert machine() == (host, cores)  # the same on every call: ranks of one process agree


def _manager(rank: int, world: int, directory: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    weights = distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)])
    state = {"w": weights, "bias": torch.zeros(3)}
    ckpt = shardkit.Checkpoint(state=state)
    if rank == 1:
        ckpt._save_counter = 7  # rank 0 numbers the checkpoints, whatever the others count
    manager = shardkit.CheckpointManager(ckpt, directory, max_to_keep=2,
                                         process_group=torch.distributed.group.WORLD)
    out: dict = {"saved": [], "listed": []}
    for step in range(1, 4):
        weights.to_local().fill_(step)
        state["bias"].fill_(step)
        out["saved"].append(os.path.basename(str(manager.save())))
        out["listed"].append([os.path.basename(p) for p in manager.checkpoints])
    # async: each rank snapshots its local shard; the commit runs in the background over a
    # group of its own while this thread keeps using the default group
    weights.to_local().fill_(10)
    handle = manager.save(options=shardkit.CheckpointOptions(enable_async=True))
    weights.to_local().fill_(-1)  # after the snapshot: not saved
    torch.distributed.all_reduce(torch.ones(1))  # the training loop's own collective
    manager.sync()
    out["async"] = os.path.basename(str(handle))
    out["latest"] = os.path.basename(manager.latest_checkpoint or "")
    out["listed_end"] = [os.path.basename(p) for p in manager.checkpoints]
    out["counter"] = ckpt.save_counter
    return out


def test_manager_numbering_retention_and_async_save_agree_on_every_rank(tmp_path):
    directory = str(tmp_path / "run")
    r0, r1 = harness.raise_any(harness.run_ranks(_manager, 2, directory))
    assert r0 == r1
    assert r0["saved"] == ["ckpt-1", "ckpt-2", "ckpt-3"]
    assert r0["listed"] == [["ckpt-1"], ["ckpt-1", "ckpt-2"], ["ckpt-2", "ckpt-3"]]
    assert r0["async"] == r0["latest"] == "ckpt-4" and r0["counter"] == 4
    assert r0["listed_end"] == ["ckpt-3", "ckpt-4"]
    assert sorted(os.listdir(directory)) == ["ckpt-3", "ckpt-4"]  # retention by rank 0
    loaded = shardkit.load(os.path.join(directory, "ckpt-4"))
    weights = next(v for k, v in loaded.items() if k.endswith("w"))
    assert weights.shape == (6, 4) and (weights == 10).all()  # the snapshot, both halves
    loaded3 = shardkit.load(os.path.join(directory, "ckpt-3"))
    assert all((v == 3).all() for k, v in loaded3.items() if "save_counter" not in k)


def test_string_tensors_are_refused_by_a_collective_save_naming_the_key():
    from shardkit.distributed.save import held

    state = {"w": np.zeros(3, np.float32), "s": np.array([b"a", b"bc"], object)}
    with pytest.raises(shardkit.DistributedStateError, match="'s' is a string tensor"):
        held(state, 0)
    with pytest.raises(shardkit.DistributedStateError, match="'u' is a string tensor"):
        held({"u": np.array(["x"])}, 1)
    assert held({"w": state["w"]}, 0).keys == ["w"]
