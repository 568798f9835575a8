"""Restore into DTensors with resharding: every rank reads only its box of each stored tensor.

Ranks are spawned with torch.multiprocessing (spawn), gloo on 127.0.0.1, one spawn per test with
several cases in it, each spawn bounded by an explicit timeout. Checkpoints are written in the
test process: whole tensors (a single-process save), and tensors stored as the slices a Shard(0)
over N ranks holds, one shard file per rank (the layout of a distributed save), by a sharding
callback. Every restored local tensor is compared byte for byte with the same shard of a
DTensor distributed from the original array (``distribute_tensor``), and its full tensor with
the original.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is an optional dependency")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import shardkit  # noqa: E402
from shardkit.callback import ShardingCallback  # noqa: E402
from shardkit.slices import format_slice_spec  # noqa: E402

SPAWN_TIMEOUT = 120.0  # seconds for one spawn: start, torch import, all of its cases


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
        shardkit.save(paths["rows4"], state, sharding_callback=RowsPerRank(4))
    with pytest.warns(shardkit.SplitTensorsWarning):
        shardkit.save(paths["rows2"], state, sharding_callback=RowsPerRank(2))
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


# --- running ranks ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
               results: Any) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        try:
            out = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, None, out))
    except BaseException:
        results.put((rank, traceback.format_exc(), None))


def run_ranks(world: int, fn: Callable[..., Any], *args: Any,
              timeout: float = SPAWN_TIMEOUT) -> list[Any]:
    """Run fn(rank, world, *args) on `world` spawned ranks in one gloo group; return each rank's
    result; fail with the rank's traceback if one raised, or when `timeout` passes (the ranks
    are killed)."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, fn, args, results),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    import time

    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    got: dict[int, Any] = {}
    errors = []
    while not results.empty():
        rank, error, out = results.get()
        if error is not None:
            errors.append(f"rank {rank}:\n{error}")
        got[rank] = out
    if errors:
        pytest.fail("\n".join(errors))
    if hung:
        pytest.fail(f"ranks {hung} did not finish within {timeout} s")
    assert sorted(got) == list(range(world)), f"exit codes {[p.exitcode for p in procs]}"
    return [got[r] for r in range(world)]


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
        from shardkit import sources

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
    for name in ("full", "rows4", "rows2"):
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
            if pl == [Shard(0)]:
                # each rank asks for exactly its rows: no byte of another rank's rows
                counted[name] = counter.total
                assert counter.total == _local_nbytes(targets), name
    return counted


def test_placements_and_bytes_read_world4(tmp_path: Path) -> None:
    paths = write_checkpoints(tmp_path)
    counted = run_ranks(4, placements_world4, paths)
    state = global_state()
    total = sum(a.nbytes for a in state.values())
    replicated = state["scalar"].nbytes  # every rank reads the replicated scalar
    for name in ("full", "rows4", "rows2"):
        assert sum(c[name] for c in counted) == total + 3 * replicated
