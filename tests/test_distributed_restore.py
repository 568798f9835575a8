"""Restore into DTensors with resharding: every rank reads only its box of each stored tensor.

Ranks are spawned by the harness of tests/distributed.py (gloo on 127.0.0.1), one spawn per test
with several cases in it, each spawn bounded by an explicit timeout. Checkpoints are written in the
test process: whole tensors (a single-process save), and tensors stored as the slices a Shard(0)
over N ranks holds, one shard file per rank (the layout of a distributed save), by a sharding
callback. Every restored local tensor is compared byte for byte with the same shard of a
DTensor distributed from the original array (``distribute_tensor``), and its full tensor with
the original. Then checkpoints written by the collective save itself are restored with
resharding, an FSDP2 model and its Adam state are restored with ``Checkpoint.read``, and a
2-rank FSDP2 training loop is SIGKILLed and resumed (collective manager and rank-0 save).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is an optional dependency")

import distributed as harness  # noqa: E402  (tests/distributed.py)
import torch.distributed as dist  # noqa: E402

import shardkit  # noqa: E402
from shardkit.sharding.callback import ShardingCallback  # noqa: E402
from shardkit.values.slices import format_slice_spec  # noqa: E402

SPAWN_TIMEOUT = 120.0  # seconds for all the cases of one spawn, from when its ranks started


# --- the states and their checkpoints (built in the test process) -------------------------------


def global_state() -> dict[str, np.ndarray]:
    """Tensors of several dtypes and shapes: even and uneven over 2 and 4 ranks (7 and 3 rows),
    bf16, a scalar, a 3-d tensor."""
    def ramp(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return (np.arange(int(np.prod(shape))) * 0.5 - 3).astype(dtype).reshape(shape)

    return {
        "w": ramp((8, 6), np.float32),
        "uneven": ramp((7, 5), np.float64),
        "tiny": ramp((3, 4), np.int32),  # over 4 ranks: one rank holds no row
        "bf": ramp((6, 10), ml_dtypes.bfloat16),
        "cube": ramp((4, 6, 3), np.float32),
        "scalar": np.array(42, np.int64),
    }


def chunks(length: int, n: int) -> list[tuple[int, int]]:
    """torch.chunk's split of `length` into `n` (offset, length) pieces, empty ones dropped."""
    size = -(-length // n)
    return [(o, min(size, length - o)) for o in range(0, length, size)] if length else []


class RowsPerRank(ShardingCallback):
    """Each tensor stored as the slices a Shard(0) over `ranks` holds; shard i holds every
    tensor's slice of rank i (scalars and 0-row tensors whole, in shard 0)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks

    @property
    def description(self) -> str:
        return f"rows per rank over {self.ranks} ranks"

    def __call__(self, shardable_tensors: Sequence[Any]) -> list[dict[str, dict[str, Any]]]:
        shards: list[dict[str, dict[str, Any]]] = [{} for _ in range(self.ranks)]
        for t in shardable_tensors:
            if not t.shape or t.shape[0] == 0:
                shards[0][t.checkpoint_key] = {t.slice_spec: t.tensor}
                continue
            for i, (off, n) in enumerate(chunks(t.shape[0], self.ranks)):
                spec = format_slice_spec(t.shape, [off] + [0] * (len(t.shape) - 1),
                                         [n, *t.shape[1:]])
                shards[i][t.checkpoint_key] = {spec: t.tensor[off : off + n]}
        return [s for s in shards if s]


def write_checkpoints(root: Path) -> dict[str, str]:
    state = global_state()
    paths = {"full": str(root / "full"), "rows4": str(root / "rows4"),
             "rows2": str(root / "rows2")}
    shardkit.save(paths["full"], state)
    with pytest.warns(shardkit.SplitTensorsWarning):
        shardkit.save(paths["rows4"], state,
                      options=shardkit.CheckpointOptions(
                          experimental_sharding_callback=RowsPerRank(4)))
    with pytest.warns(shardkit.SplitTensorsWarning):
        shardkit.save(paths["rows2"], state,
                      options=shardkit.CheckpointOptions(
                          experimental_sharding_callback=RowsPerRank(2)))
    paths["rows4z"] = str(root / "rows4z")  # compressed shards: boxes through the codec
    with pytest.warns(shardkit.SplitTensorsWarning):
        shardkit.save(paths["rows4z"], state,
                      options=shardkit.CheckpointOptions(
                          experimental_sharding_callback=RowsPerRank(4), compression="zstd",
                          chunk_size="64KiB"))
    return paths


def entry_region(shard_file: str, entry: str) -> tuple[int, int]:
    """File offsets [begin, end) of `entry`'s bytes in a safetensors shard."""
    with open(shard_file, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    begin, end = header[entry]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def corrupt_slices(ckpt: str, keep: Callable[[str, str], bool]) -> int:
    """Overwrite with 0xFF the bytes of every stored slice for which keep(key, spec) is False;
    returns how many slices were corrupted. Checksums in the manifest stay the old ones."""
    done = 0
    with shardkit.open(ckpt) as reader:
        placements = [(k, p) for k in reader.keys() for p in reader.info(k).slices]
    for key, p in placements:
        if keep(key, p.spec):
            continue
        path = os.path.join(ckpt, p.file)
        begin, end = entry_region(path, p.entry)
        with open(path, "r+b") as f:
            f.seek(begin)
            f.write(b"\xff" * (end - begin))
        done += 1
    return done


# --- what the ranks do --------------------------------------------------------------------------


def _torch_of(a: np.ndarray) -> Any:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _bytes(t: Any) -> bytes:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _targets(state: dict[str, np.ndarray], mesh: Any, placements: Sequence[Any]
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """DTensors of the state's shapes and dtypes, filled with garbage, and the expected
    DTensors (the originals distributed)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    targets, expected = {}, {}
    for key, a in state.items():
        pl = placements if a.ndim else [Replicate()] * mesh.ndim
        pl = [p if getattr(p, "dim", 0) < max(a.ndim, 1) else Replicate() for p in pl]
        expected[key] = distribute_tensor(_torch_of(a), mesh, pl)
        garbage = torch.full(a.shape, 7, dtype=expected[key].dtype)
        targets[key] = distribute_tensor(garbage, mesh, pl)
    return targets, expected


def _check_equal(targets: dict[str, Any], expected: dict[str, Any],
                 state: dict[str, np.ndarray], what: str) -> None:
    for key, t in targets.items():
        assert _bytes(t.to_local()) == _bytes(expected[key].to_local()), f"{what}: {key}"
        assert _bytes(t.full_tensor()) == _bytes(_torch_of(state[key])), f"{what}: {key} full"


class ByteCounter:
    """Counts the bytes the reader asks its raw shard sources for (views of the map and
    reads), by file: the proof that a rank reads only what its boxes need."""

    def __init__(self) -> None:
        from shardkit.shards import raw as sources

        self.by_file: dict[str, int] = {}
        self._sources = sources
        self._view, self._read = sources.RawShard.view, sources.RawShard.read_into
        counter = self

        def view(src: Any, entry: Any, begin: int, end: int) -> Any:
            counter.add(src.path, end - begin)
            return counter._view(src, entry, begin, end)

        def read_into(src: Any, entry: Any, begin: int, end: int, dest: Any) -> None:
            counter.add(src.path, end - begin)
            counter._read(src, entry, begin, end, dest)

        sources.RawShard.view, sources.RawShard.read_into = view, read_into

    def add(self, path: str, n: int) -> None:
        name = os.path.basename(path)
        self.by_file[name] = self.by_file.get(name, 0) + n

    @property
    def total(self) -> int:
        return sum(self.by_file.values())

    def close(self) -> None:
        self._sources.RawShard.view, self._sources.RawShard.read_into = self._view, self._read


def _local_nbytes(targets: dict[str, Any]) -> int:
    return sum(t.to_local().numel() * t.element_size() for t in targets.values())


def placements_world4(rank: int, world: int, paths: dict[str, str]) -> dict[str, int]:
    """Shard(0), Shard(1), Replicate, uneven and empty shards, a 2x2 mesh, from whole tensors
    and from 4-rank and 2-rank row slices; bytes read counted for the Shard(0) cases."""
    from torch.distributed.tensor import Replicate, Shard, init_device_mesh

    state = global_state()
    mesh = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    cases = [(mesh, [Shard(0)]), (mesh, [Shard(1)]), (mesh, [Replicate()]),
             (mesh2, [Shard(0), Shard(1)]), (mesh2, [Replicate(), Shard(0)]),
             (mesh2, [Shard(1), Shard(1)])]
    counted = {}
    for name in ("full", "rows4", "rows2", "rows4z"):
        for m, pl in cases:
            targets, expected = _targets(state, m, pl)
            local = targets["w"].to_local()
            counter = ByteCounter()
            try:
                status = shardkit.restore_into(paths[name], targets)
            finally:
                counter.close()
            assert sorted(status.restored_keys) == sorted(state)
            # the local tensor is the DTensor's own memory, written in place
            assert local.data_ptr() == targets["w"].to_local().data_ptr()
            _check_equal(targets, expected, state, f"{name} {pl}")
            if pl == [Shard(0)] and name != "rows4z":
                # each rank asks for exactly its rows: no byte of another rank's rows
                counted[name] = counter.total
                assert counter.total == _local_nbytes(targets), name
    return counted


def world4(rank: int, world: int, paths: dict[str, str], tmp: str) -> dict[str, int]:
    counted = placements_world4(rank, world, paths)
    saved_and_resharded(rank, world, tmp)
    return counted


def test_world4_placements_bytes_read_and_distributed_saves(tmp_path: Path) -> None:
    """One spawn of 4 ranks: `placements_world4`, then `saved_and_resharded`."""
    paths = write_checkpoints(tmp_path)
    (tmp_path / "saves").mkdir()
    counted = harness.raise_any(harness.run_ranks(world4, 4, paths, str(tmp_path / "saves"),
                                                  timeout=SPAWN_TIMEOUT))
    state = global_state()
    total = sum(a.nbytes for a in state.values())
    replicated = state["scalar"].nbytes  # every rank reads the replicated scalar
    for name in ("full", "rows4", "rows2"):
        assert sum(c[name] for c in counted) == total + 3 * replicated


# --- resharding 4 -> 2, files and bytes of other ranks, errors, FSDP2 (world 2) -----------------


def rank_rows(key: str, shape: tuple[int, ...], rank: int, world: int) -> tuple[int, int] | None:
    """Rows (offset, length) of `key` a Shard(0) over `world` gives `rank` (None: none; a
    scalar: the whole)."""
    if not shape:
        return (0, 1)
    parts = chunks(shape[0], world)
    return parts[rank] if rank < len(parts) else None


def spec_rows(spec: str, shape: tuple[int, ...]) -> tuple[int, int]:
    if not spec:
        return (0, shape[0] if shape else 1)
    off, n = spec.split(" ")[-1].split(":")[0].split(",")
    return int(off), int(n)


def rank_copy(src: str, dst: str, rank: int, world: int) -> tuple[int, int]:
    """A copy of checkpoint `src` in which every stored slice that rank `rank`'s Shard(0) box
    does not intersect is overwritten with 0xFF (its checksum left as it was) and every shard
    file holding only such slices is deleted. Returns (slices corrupted, files deleted)."""
    shutil.copytree(src, dst)
    shapes = {k: tuple(a.shape) for k, a in global_state().items()}

    def needed(key: str, spec: str) -> bool:
        mine = rank_rows(key, shapes[key], rank, world)
        if mine is None:
            return False
        lo, n = spec_rows(spec, shapes[key])
        return lo < mine[0] + mine[1] and mine[0] < lo + n

    with shardkit.open(dst) as reader:
        placements = [(k, p) for k in reader.keys() for p in reader.info(k).slices]
    files = {p.file for _, p in placements}
    used = {p.file for k, p in placements if needed(k, p.spec)}
    corrupted = corrupt_slices(dst, needed)
    for name in files - used:
        os.remove(os.path.join(dst, name))
    return corrupted, len(files - used)


def reshard_world2(rank: int, world: int, paths: dict[str, str], tmp: str) -> None:
    from torch.distributed.tensor import DTensor, Partial, Shard, init_device_mesh

    state = global_state()
    mesh = init_device_mesh("cpu", (world,))
    # 4 -> 2 (rows saved, columns restored), 1 -> 2, and rows restored as rows
    for name, pl in (("rows4", [Shard(1)]), ("rows4", [Shard(0)]), ("full", [Shard(1)]),
                     ("rows2", [Shard(1)])):
        targets, expected = _targets(state, mesh, pl)
        shardkit.restore_into(paths[name], targets)
        _check_equal(targets, expected, state, f"{name} {pl}")

    # other ranks' slices corrupted and their files deleted: this rank's restore never notices,
    # with verify=True too (it checks the slices it reads)
    mine = os.path.join(tmp, f"rank{rank}")
    targets, expected = _targets(state, mesh, [Shard(0)])
    status = shardkit.restore_into(mine, targets, verify=True)
    _check_equal(targets, expected, state, "others corrupted")
    assert sorted(status.restored_keys) == sorted(state)

    # a slice this rank needs is corrupted: verify=True names it, nothing is changed
    bad = os.path.join(tmp, f"bad{rank}")
    targets, _ = _targets(state, mesh, [Shard(0)])
    before = _bytes(targets["w"].to_local())
    with pytest.raises(shardkit.ChecksumError, match="'w'"):
        shardkit.restore_into(bad, targets, verify=True)
    assert _bytes(targets["w"].to_local()) == before

    # errors, raised before anything is changed, naming the key
    def fresh() -> dict[str, Any]:
        return _targets(state, mesh, [Shard(0)])[0]

    t = fresh()
    t["uneven"] = DTensor.from_local(torch.zeros(4 if rank == 0 else 3, 5, dtype=torch.float32),
                                     mesh, [Shard(0)], shape=(7, 5), stride=(5, 1))
    with pytest.raises(shardkit.RestoreMismatchError,
                       match=r"'uneven'.*float64.*DTensor's global shape \[7, 5\] dtype F32"):
        shardkit.restore_into(paths["rows4"], t)
    assert _bytes(t["w"].to_local()) == _bytes(fresh()["w"].to_local())  # unchanged
    t = fresh()
    t["w"] = DTensor.from_local(torch.zeros(4, 7), mesh, [Shard(0)], shape=(8, 7),
                                stride=(7, 1))
    with pytest.raises(shardkit.RestoreMismatchError, match=r"'w'.*\[8, 6\].*\[8, 7\]"):
        shardkit.restore_into(paths["full"], t)
    t = fresh()
    t["w"] = DTensor.from_local(torch.zeros(8, 6), mesh, [Partial()], shape=(8, 6),
                                stride=(6, 1))
    with pytest.raises(shardkit.RestoreMismatchError, match=r"'w'.*Partial"):
        shardkit.restore_into(paths["full"], t)
    t = fresh()
    t["extra"] = t.pop("w")
    with pytest.raises(shardkit.IncompleteRestoreError, match=r"'extra'.*'w'"):
        shardkit.restore_into(paths["full"], t)
    status = shardkit.restore_into(paths["full"], t, partial=True)
    assert status.missing_keys == ["extra"] and status.unexpected_keys == ["w"]


def test_world2_reshard_corrupt_others_errors_fsdp2(tmp_path: Path) -> None:
    """One spawn of 2 ranks: `reshard_world2`, then `fsdp2_read` of a trained MLP."""
    paths = write_checkpoints(tmp_path)
    deleted = []
    for rank in range(2):
        corrupted, removed = rank_copy(paths["rows4"], str(tmp_path / f"rank{rank}"), rank, 2)
        assert corrupted > 0
        deleted.append(removed)
        bad = str(tmp_path / f"bad{rank}")
        shutil.copytree(paths["rows4"], bad)
        first = rank_rows("w", (8, 6), rank, 2)[0]  # type: ignore[index]
        # only this rank's first row slice of "w"
        assert corrupt_slices(
            bad, lambda k, s, first=first: k != "w" or spec_rows(s, (8, 6))[0] != first) == 1
    assert deleted[0] == 2  # rank 0 needs two of the four row files
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _adam_step(model, opt, seed=1)
    from shardkit.training.checkpoint import Checkpoint

    Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "trained"))
    harness.raise_any(harness.run_ranks(world2, 2, paths, str(tmp_path), timeout=SPAWN_TIMEOUT))


def world2(rank: int, world: int, paths: dict[str, str], tmp: str) -> None:
    reshard_world2(rank, world, paths, tmp)
    fsdp2_read(rank, world, os.path.join(tmp, "trained"))


def test_full_tensors_from_sliced_checkpoints_single_process(tmp_path: Path) -> None:
    """2 -> 1 and 4 -> 1: plain tensors and arrays restored from row slices, byte for byte;
    load and get_slice agree."""
    paths = write_checkpoints(tmp_path)
    state = global_state()
    for name in ("rows2", "rows4", "rows4z"):
        tensors = {k: _torch_of(np.zeros_like(a)) for k, a in state.items()}
        shardkit.restore_into(paths[name], tensors)
        for k, a in state.items():
            assert _bytes(tensors[k]) == _bytes(_torch_of(a)), (name, k)
        arrays = {k: np.zeros_like(a) for k, a in state.items()}
        shardkit.restore_into(paths[name], arrays)
        loaded = shardkit.load(paths[name], framework="torch")
        for k, a in state.items():
            assert arrays[k].tobytes() == a.tobytes()
            assert _bytes(loaded[k]) == _bytes(_torch_of(a))


# --- Checkpoint.read into an FSDP2 model and its Adam optimizer (world 2) ------------------------


def _mlp() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def _fsdp2_mlp(mesh: Any) -> tuple[Any, Any]:
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _adam_step(model: Any, opt: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def fsdp2_read(rank: int, world: int, path: str) -> None:
    from torch.distributed.tensor import DTensor, init_device_mesh

    from shardkit.training.checkpoint import Checkpoint

    mesh = init_device_mesh("cpu", (world,))
    model, opt = _fsdp2_mlp(mesh)
    _adam_step(model, opt, seed=99)  # other data: every value differs from the saved ones
    params = [p.to_local().data_ptr() for p in model.parameters()]
    moments = [opt.state[p]["exp_avg"].to_local().data_ptr() for p in model.parameters()]
    status = Checkpoint(model=model, optimizer=opt).read(path)
    status.assert_consumed()
    saved = shardkit.load(path, framework="torch")
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor)
        assert _bytes(p.full_tensor()) == _bytes(saved[f"model/{name}"]), name
    for i, p in enumerate(model.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert _bytes(opt.state[p][k].full_tensor()) == _bytes(
                saved[f"optimizer/state/{i}/{k}"]), (i, k)
    # restored in place: the same local memory as before
    assert [p.to_local().data_ptr() for p in model.parameters()] == params
    assert [opt.state[p]["exp_avg"].to_local().data_ptr() for p in model.parameters()] == moments
    # and training goes on exactly as in one process from the same checkpoint
    _adam_step(model, opt, seed=5)
    ref = _mlp()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    _adam_step(ref, ref_opt, seed=1)
    Checkpoint(model=ref, optimizer=ref_opt).read(path)
    _adam_step(ref, ref_opt, seed=5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.full_tensor(), q, rtol=1e-6, atol=1e-7), name
    # an optimizer that has not stepped yet (a fresh resume): its state is created as DTensors
    # placed like the parameters, holding this rank's box
    fresh, fresh_opt = _fsdp2_mlp(mesh)
    assert not fresh_opt.state
    Checkpoint(model=fresh, optimizer=fresh_opt).read(path).assert_consumed()
    for i, p in enumerate(fresh.parameters()):
        state = fresh_opt.state[p]
        for k in ("exp_avg", "exp_avg_sq"):
            assert isinstance(state[k], DTensor) and state[k].placements == p.placements
            assert _bytes(state[k].full_tensor()) == _bytes(saved[f"optimizer/state/{i}/{k}"])
    _adam_step(fresh, fresh_opt, seed=5)  # steps, and as the in-place restored model did
    for (name, p), q in zip(fresh.named_parameters(), model.parameters()):
        assert _bytes(p.to_local()) == _bytes(q.to_local()), name




# --- truly distributed saves, restored with resharding (world 4) ---------------------------------


def saved_and_resharded(rank: int, world: int, tmp: str) -> None:
    """Saved collectively by 4 ranks as Shard(0) (and as 2x2 [Shard(0), Shard(1)]), restored on
    4 ranks as Shard(1) and Replicate, on 2 of them as Shard(1), on rank 0 alone as full
    tensors; a rank-0-only save of whole tensors restored on all 4 as Shard(0) (1 -> 4)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, init_device_mesh

    state = global_state()
    mesh = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    pair = DeviceMesh("cpu", [0, 1])  # every rank takes part in making it; 2 and 3 hold nothing
    for name, m, pl in (("rows", mesh, [Shard(0)]), ("grid", mesh2, [Shard(0), Shard(1)])):
        source = _targets(state, m, pl)[1]  # the originals, distributed
        path = os.path.join(tmp, name)
        shardkit.save(path, source)
        for m2, pl2 in ((mesh, [Shard(1)]), (mesh, [Replicate()]), (mesh2, [Shard(1), Shard(0)])):
            targets, expected = _targets(state, m2, pl2)
            shardkit.restore_into(path, targets)
            _check_equal(targets, expected, state, f"{name} -> {pl2}")
        targets, expected = _targets(state, pair, [Shard(1)])
        shardkit.restore_into(path, targets)  # ranks 2 and 3: outside the mesh, nothing read
        if rank < 2:  # 4 -> 2
            for key, t in targets.items():
                assert _bytes(t.to_local()) == _bytes(expected[key].to_local()), (name, key)
        if rank == 0:  # 4 -> 1: plain tensors, a single-process load, verify
            full = {k: _torch_of(np.zeros_like(a)) for k, a in state.items()}
            shardkit.restore_into(path, full, verify=True)
            loaded = shardkit.load(path, verify=True)
            for k, a in state.items():
                assert _bytes(full[k]) == _bytes(_torch_of(a)), (name, k)
                assert loaded[k].tobytes() == a.tobytes(), (name, k)
        dist.barrier()
    # 1 -> 4: one process saves whole tensors, every rank restores its shard
    single = os.path.join(tmp, "single")
    if rank == 0:
        shardkit.save(single, state)
    dist.barrier()
    targets, expected = _targets(state, mesh, [Shard(0)])
    shardkit.restore_into(single, targets)
    _check_equal(targets, expected, state, "1 -> 4")



# --- kill-and-resume of a 2-rank FSDP2 training loop with Adam ----------------------------------

TOTAL_STEPS = 8
SAVE_EVERY = 2
KILL_AT = 5  # rank 1 dies in the middle of this step (index), before saving step 6


def _local_digest(model: Any, opt: Any) -> str:
    """sha256 of this rank's bytes of every parameter and optimizer state value."""
    import hashlib

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode() + _bytes(p.to_local()))
    for i, p in enumerate(model.parameters()):
        for k, v in sorted(opt.state[p].items()):
            local = v.to_local() if hasattr(v, "to_local") else v
            h.update(f"{i}/{k}".encode() + _bytes(local))
    return h.hexdigest()


def _train_step(model: Any, opt: Any, step: int, rank: int, die: bool = False) -> str:
    """One step on this rank's batch of `step`; returns the loss, exactly (float.hex)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    if die:
        os.kill(os.getpid(), 9)  # SIGKILL, between the forward and the backward's collectives
    loss.backward()
    opt.step()
    return float(loss.item()).hex()


def _gathered(value: Any) -> Any:
    """`value` with every DTensor replaced by its full tensor (a collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: _gathered(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_gathered(v) for v in value]
    return value


def _manager(directory: str, model: Any, opt: Any, progress: Any, collective: bool) -> Any:
    from shardkit.training.checkpoint import Checkpoint, CheckpointManager

    return CheckpointManager(Checkpoint(model=model, optimizer=opt, progress=progress),
                             directory, max_to_keep=2,
                             process_group=dist.group.WORLD if collective else None)


MODES = ("collective", "rank0")


def killed_run(rank: int, world: int, root: str, log: str) -> None:
    """Two identical FSDP2 models trained side by side on the same batches, each saved every
    SAVE_EVERY steps into a directory of its own: "collective" through a manager with a
    process group (every rank writes its shards), "rank0" as the gathered full state saved by
    rank 0 alone (``if rank == 0``, a barrier after it). Rank 1 SIGKILLs itself at KILL_AT."""
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    runs = {mode: (*_fsdp2_mlp(mesh), {"step": np.zeros((), np.int64)}) for mode in MODES}
    model, opt, progress = runs["collective"]
    manager = _manager(os.path.join(root, "collective"), model, opt, progress, True)
    with open(f"{log}{rank}", "a") as out:
        for step in range(TOTAL_STEPS):
            for mode, (model, opt, progress) in runs.items():
                die = rank == 1 and step == KILL_AT and mode == MODES[0]
                loss = _train_step(model, opt, step, rank, die=die)
                out.write(json.dumps({"mode": mode, "step": step, "loss": loss}) + "\n")
                progress["step"][...] = step + 1
                if (step + 1) % SAVE_EVERY:
                    continue
                if mode == "collective":
                    manager.save(checkpoint_number=step + 1)
                else:
                    full_model = _gathered(model.state_dict())
                    full_opt = _gathered(opt.state_dict())
                    if rank == 0:
                        _manager(os.path.join(root, mode), full_model, full_opt, progress,
                                 False).save(checkpoint_number=step + 1)
                    dist.barrier()
                out.write(json.dumps({"mode": mode, "saved": step + 1,
                                      "digest": _local_digest(model, opt)}) + "\n")
            out.flush()


def resumed_run(rank: int, world: int, root: str) -> dict[str, Any]:
    """The uninterrupted run, then each mode's resumed one, all in fresh models."""
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model, opt = _fsdp2_mlp(mesh)
    out: dict[str, Any] = {"straight": [_train_step(model, opt, step, rank)
                                        for step in range(TOTAL_STEPS)]}
    out["straight_digest"] = _local_digest(model, opt)
    for mode in MODES:
        model, opt = _fsdp2_mlp(mesh)
        _train_step(model, opt, 0, rank + 7)  # Adam state exists, and every value differs
        progress = {"step": np.zeros((), np.int64)}
        manager = _manager(os.path.join(root, mode), model, opt, progress, mode == "collective")
        latest = manager.restore_or_initialize()
        manager.restore_status.assert_consumed()
        start = int(progress["step"])
        restored = _local_digest(model, opt)
        resumed = [_train_step(model, opt, step, rank) for step in range(start, TOTAL_STEPS)]
        out[mode] = {"latest": latest, "start": start, "restored": restored,
                     "resumed": resumed, "resumed_digest": _local_digest(model, opt)}
    return out


def test_kill_and_resume_2_ranks(tmp_path: Path) -> None:
    """A 2-rank FSDP2 loop with Adam killed mid-step (rank 1 SIGKILLed, the job torn down),
    restarted: each mode restores its latest checkpoint into fresh models and continues."""
    root, log = str(tmp_path / "ckpts"), str(tmp_path / "log")
    # the job torn down once rank 1 is gone: what rank 0 raised meanwhile (its collectives
    # fail without the peer) is the expected outcome, not checked; what it logged is
    died = harness.run_ranks(killed_run, 2, root, log, timeout=SPAWN_TIMEOUT, stop_on_kill=True)
    assert isinstance(died[1], harness.RankError) and died[1].exitcode == -9, died
    records = [[json.loads(line) for line in Path(f"{log}{r}").read_text().splitlines()]
               for r in range(2)]
    results = harness.raise_any(harness.run_ranks(resumed_run, 2, root, timeout=SPAWN_TIMEOUT))
    with shardkit.open(os.path.join(root, "collective", "ckpt-4")) as reader:
        # every rank wrote its own rows into one whole entry (the HuggingFace layout)
        assert reader.info("model/0.weight").slices[0].spec == ""
        assert not reader.info("optimizer/state/0/exp_avg").is_split
    with shardkit.open(os.path.join(root, "rank0", "ckpt-4")) as reader:
        assert not reader.info("model/0.weight").is_split
    for mode in MODES:
        for rank, res in enumerate(results):
            mine = [x for x in records[rank] if x["mode"] == mode]
            saved = {x["saved"]: x["digest"] for x in mine if "saved" in x}
            assert sorted(saved) == [2, 4], (mode, rank)  # died before saving step 6
            got = res[mode]
            assert got["latest"].endswith("ckpt-4") and got["start"] == 4, (mode, got)
            # the restored weights and Adam state are the saved ones, byte for byte
            assert got["restored"] == saved[4], (mode, rank)
            # the losses after resuming are those of the uninterrupted run, bit for bit, and
            # so are the final weights and optimizer state
            assert got["resumed"] == res["straight"][4:], (mode, rank)
            assert got["resumed_digest"] == res["straight_digest"], (mode, rank)
            # the killed run, up to its death, was the uninterrupted run
            losses = [x["loss"] for x in mine if "loss" in x]
            assert losses == res["straight"][: len(losses)], (mode, rank)
