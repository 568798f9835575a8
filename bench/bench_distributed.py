"""Distributed save and restore of Shard(0) DTensors: shardkit against PyTorch DCP.

    python bench/bench_distributed.py --world 2 --rounds 5 [--check]
    python bench/bench_distributed.py --world 4 --rounds 5      # oversubscribed on 2 cores

`--world` ranks are spawned in one process tree (gloo on 127.0.0.1). Each holds its Shard(0)
rows of every tensor of the llm-like state (bench/_workloads.py: embedding, 24 blocks, head;
1.47 GB float32 in all) as DTensors. The saves are measured first, then the loads: each
round runs every contender of its group once, in an order that rotates from round to round,
each between two barriers (the time is the slowest rank's). The loads start with one untimed
round, which absorbs what the saves left behind (writeback the host goes on with after
``os.sync``: measured, shardkit's load took 0.12-0.15 s in most rounds and 0.23-0.32 s when it
came first after the saves, which with 4 loads and 5 rounds it did twice and DCP's load once):

- ``shardkit save``: ``shardkit.save(path, dtensor_state)``, the collective save (every tensor
  whole, in HuggingFace's layout: each rank writes its own rows into the shared files, one
  commit); ``durable=True`` (the default: files and directories fsynced);
- ``shardkit slices save``: the same with the default policy given as a callback, which makes
  each rank write its own shards of per-rank slices (the layout before whole tensors);
- ``dcp save``: ``torch.distributed.checkpoint.save`` with the default ``FileSystemWriter``
  (``sync_files=True``: every file fsynced);
- ``safetensors floor``: each rank writes its local shards with ``safetensors.torch.save_file``
  into a file of its own and fsyncs it (no coordination, no index, not reshardable);
- ``shardkit load``: ``shardkit.restore_into`` into preallocated DTensors of the same placement;
- ``dcp load``: ``torch.distributed.checkpoint.load`` into preallocated DTensors of the same
  placement (default ``FileSystemReader``);
- ``dcp+shardkit save`` / ``dcp+shardkit load``: ``dcp.save`` and ``dcp.load`` as above, through
  shardkit's storage backend (``shardkit.training.dcp.StorageWriter`` / ``StorageReader``: DCP's
  planners, shardkit's save flow and reader);
- ``shardkit reshard``/``dcp reshard``: the world-`N` checkpoint restored on rank 0 alone into
  preallocated full (plain) tensors, DCP with ``no_dist=True``; the other ranks wait.

Every save starts from the same state of the disk: each save's directory is deleted right after
it, and everything still pending (the deletion, metadata the save did not fsync) is written to
disk (``os.sync``), untimed, before the next contender starts. On a virtual disk the deletion
matters as much as the sync: ``os.sync`` returns once the guest's writes reached the device, not
once the host has written them, so checkpoints kept for the loads made whichever save came
third in a round slower (measured: three identical 1.47 GB writers in a row took 0.8, 1.2 and
5.3 s; deleting each one's files, discarded with the ``discard`` mount option, evens them out).
The loads therefore read checkpoints written once, untimed, before the first round (page cache
warm, for both). The first round of each group checks that every restore is byte for byte.
Prints the medians, and the ratios against the targets: save >= 2x DCP, >= 0.9x the floor and
>= 0.9x the per-rank slices,
load >= 3x DCP, reshard >= 3x DCP; through the backend, dcp.save >= 1.5x and dcp.load >= 2x
DCP's own storage. With ``--check`` the exit status is 1 when one is missed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TARGETS = {  # (contender, reference, least ratio reference time / contender time)
    "save vs dcp": ("shardkit save", "dcp save", 2.0),
    "whole vs slices": ("shardkit save", "shardkit slices save", 0.9),
    "save vs floor": ("shardkit save", "safetensors floor", 0.9),
    "load vs dcp": ("shardkit load", "dcp load", 3.0),
    "reshard vs dcp": ("shardkit reshard", "dcp reshard", 3.0),
    "dcp save, shardkit writer": ("dcp+shardkit save", "dcp save", 1.5),
    "dcp load, shardkit reader": ("dcp+shardkit load", "dcp load", 2.0),
}


def llm_shapes(hidden: int = 1024, layers: int = 24, vocab: int = 32000
               ) -> list[tuple[str, tuple[int, ...]]]:
    """Flat keys and shapes of `_workloads.llm_state` (checked against it at start)."""
    h, f = hidden, 4 * hidden
    out: list[tuple[str, tuple[int, ...]]] = [("embed/weight", (vocab, h))]
    for i in range(layers):
        p = f"layers/{i}/"
        for n in ("q", "k", "v", "o"):
            out += [(f"{p}attn/{n}/weight", (h, h)), (f"{p}attn/{n}/bias", (h,))]
        out += [(f"{p}mlp/up/weight", (h, f)), (f"{p}mlp/up/bias", (f,)),
                (f"{p}mlp/down/weight", (f, h)), (f"{p}mlp/down/bias", (h,)),
                (f"{p}norm1/scale", (h,)), (f"{p}norm2/scale", (h,))]
    out += [("final_norm/scale", (h,)), ("lm_head/weight", (vocab, h))]
    return out


def _check_shapes() -> None:
    from _workloads import llm_state

    from shardkit.sharding.tensors import flatten

    small = dict(hidden=8, layers=2, vocab=16)
    got = [(k, tuple(a.shape)) for k, a in flatten(llm_state(**small))]
    assert got == llm_shapes(**small), "llm_shapes no longer mirrors _workloads.llm_state"


def rows_of(length: int, rank: int, world: int) -> tuple[int, int]:
    """torch.chunk's rows of `rank` (Shard(0)): (offset, length), length 0 past the end."""
    size = -(-length // world)
    lo = min(length, rank * size)
    return lo, min(length, lo + size) - lo


class Rank:
    """One rank's state, targets and contenders."""

    def __init__(self, rank: int, world: int, shapes: list[tuple[str, tuple[int, ...]]],
                 root: str) -> None:
        import torch
        from torch.distributed.tensor import DTensor, Shard, init_device_mesh

        self.rank, self.world, self.root = rank, world, root
        self.mesh = init_device_mesh("cpu", (world,))
        self.shapes = shapes
        rng = np.random.default_rng(1000 + rank)

        def dtensor(shape: tuple[int, ...], fill: bool) -> Any:
            _, n = rows_of(shape[0], rank, world)
            local = np.empty((n, *shape[1:]), np.float32)
            if fill and local.size:
                rng.random(out=local.reshape(-1), dtype=np.float32)
            elif local.size:
                local.fill(0)  # touched: warm memory, like a model's
            stride = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
            return DTensor.from_local(torch.from_numpy(local), self.mesh, [Shard(0)],
                                      run_check=False, shape=torch.Size(shape), stride=stride)

        self.state = {k: dtensor(s, True) for k, s in shapes}
        self.sk_targets = {k: dtensor(s, False) for k, s in shapes}
        self.dcp_targets = {k: dtensor(s, False) for k, s in shapes}
        self.skdcp_targets = {k: dtensor(s, False) for k, s in shapes}
        self.full = ({k: torch.zeros(s) for k, s in shapes} if rank == 0 else {})
        self.local_bytes = sum(t.to_local().nbytes for t in self.state.values())

    # -- contenders (each called on every rank between two barriers)

    def shardkit_save(self) -> None:
        import shardkit

        shardkit.save(self.path("shardkit"), self.state)

    def dcp_save(self) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state, checkpoint_id=self.path("dcp"))

    def shardkit_slices_save(self) -> None:
        import shardkit

        policy = shardkit.DefaultShardingPolicy()  # a callback given: per-rank slices
        shardkit.save(self.path("slices"), self.state,
                      options=shardkit.CheckpointOptions(experimental_sharding_callback=policy))

    def dcp_shardkit_save(self) -> None:
        import torch.distributed.checkpoint as dcp

        from shardkit.training.dcp import StorageWriter

        dcp.save(self.state, storage_writer=StorageWriter(self.path("dcp-shardkit")))

    def safetensors_floor(self) -> None:
        from safetensors.torch import save_file

        os.makedirs(self.path("floor"), exist_ok=True)
        target = os.path.join(self.path("floor"), f"rank{self.rank}.safetensors")
        save_file({k: t.to_local() for k, t in self.state.items()}, target)
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)  # the durability the others have
        finally:
            os.close(fd)

    def shardkit_load(self) -> None:
        import shardkit

        shardkit.restore_into(self.path("shardkit-read"), self.sk_targets)

    def dcp_load(self) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(self.dcp_targets, checkpoint_id=self.path("dcp-read"))

    def dcp_shardkit_load(self) -> None:
        import torch.distributed.checkpoint as dcp

        from shardkit.training.dcp import StorageReader

        dcp.load(self.skdcp_targets, storage_reader=StorageReader(self.path("shardkit-read")))

    def shardkit_reshard(self) -> None:
        import shardkit

        if self.rank == 0:
            shardkit.restore_into(self.path("shardkit-read"), self.full)

    def dcp_reshard(self) -> None:
        import torch.distributed.checkpoint as dcp

        if self.rank == 0:
            dcp.load(self.full, checkpoint_id=self.path("dcp-read"), no_dist=True)

    # -- helpers

    def write_reads(self) -> None:
        """The checkpoints the loads read (untimed, once): as the saves write them."""
        import torch.distributed.checkpoint as dcp

        import shardkit

        shardkit.save(self.path("shardkit-read"), self.state)
        dcp.save(self.state, checkpoint_id=self.path("dcp-read"))

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def check(self, what: str) -> None:
        """Byte-for-byte: the restored targets (and rank 0's full tensors) against the state."""
        import torch

        if what in ("shardkit load", "dcp load", "dcp+shardkit load"):
            targets = {"shardkit load": self.sk_targets, "dcp load": self.dcp_targets,
                       "dcp+shardkit load": self.skdcp_targets}[what]
            for k, t in self.state.items():
                if not torch.equal(targets[k].to_local(), t.to_local()):
                    raise AssertionError(f"{what}: {k} differs on rank {self.rank}")
            for t in targets.values():
                t.to_local().zero_()
        elif self.rank == 0 and what in ("shardkit reshard", "dcp reshard"):
            for k, t in self.state.items():
                n = t.to_local().shape[0]
                if not torch.equal(self.full[k][:n], t.to_local()):
                    raise AssertionError(f"{what}: {k} differs")
                self.full[k].zero_()


SAVES = ["shardkit save", "dcp save", "safetensors floor", "dcp+shardkit save",
         "shardkit slices save"]
LOADS = ["shardkit load", "dcp load", "shardkit reshard", "dcp reshard", "dcp+shardkit load"]
_METHOD = {name: name.replace(" ", "_").replace("+", "_") for name in SAVES + LOADS}
_WROTE = {"shardkit save": "shardkit", "dcp save": "dcp", "safetensors floor": "floor",
          "dcp+shardkit save": "dcp-shardkit", "shardkit slices save": "slices"}


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank on this machine
    # DCP's no_dist load says it assumes one process: that is the point of the reshard row
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=600))
        shapes = llm_shapes(**({"hidden": 256, "layers": 8, "vocab": 8000} if args.quick
                               else {}))
        r = Rank(rank, world, shapes, args.root)
        r.write_reads()
        _settle(rank)
        times: dict[str, list[float]] = {name: [] for name in SAVES + LOADS}
        for group in (SAVES, LOADS):
            # the loads start with an untimed round: it takes what the saves left behind
            first = -1 if group is LOADS else 0
            for i in range(first, args.rounds):
                k = i % len(group)
                for name in group[k:] + group[:k]:
                    dist.barrier()
                    t0 = time.perf_counter()
                    getattr(r, _METHOD[name])()
                    dist.barrier()
                    if i >= 0:
                        times[name].append(time.perf_counter() - t0)
                    if i == first:
                        r.check(name)
                    if rank == 0 and name in SAVES:  # every save starts from the same disk
                        shutil.rmtree(r.path(_WROTE[name]))
                    _settle(rank)
        if rank == 0:
            total = sum(int(np.prod(s)) * 4 for _, s in shapes)
            out.put(("ok", times, total))
        dist.destroy_process_group()
    except BaseException:
        out.put(("error", f"rank {rank}:\n{traceback.format_exc()}", 0))


def _settle(rank: int) -> None:
    """Untimed, between contenders: rank 0 writes everything still pending to disk (metadata
    the previous contender did not fsync, the deletion and discards of the previous save's
    files), so that no contender's time pays for what another left behind."""
    import torch.distributed as dist

    if rank == 0:
        os.sync()
    dist.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="a 0.1 GB state (a smoke run)")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--rounds-detail", action="store_true",
                   help="also print every round's time of every contender")
    args = p.parse_args(argv)
    _check_shapes()
    import torch.multiprocessing as mp

    args.root = tempfile.mkdtemp(prefix="bench-distributed-", dir=args.dir)
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, args.world, port, args, out))
             for r in range(args.world)]
    try:
        for proc in procs:
            proc.start()
        status, payload, total = out.get()
        for proc in procs:
            proc.join(60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(args.root, ignore_errors=True)
    if status != "ok":
        print(payload, file=sys.stderr)
        return 2
    return report(payload, total, args)


def report(times: dict[str, list[float]], total: int, args: argparse.Namespace) -> int:
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"world {args.world}, {total / 1e9:.2f} GB float32 as Shard(0) DTensors, "
          f"median of {args.rounds} alternating rounds")
    for name in SAVES + LOADS:
        spread = f"{min(times[name]):.3f}..{max(times[name]):.3f}"
        print(f"  {name:<18} {med[name]:7.3f} s  {total / med[name] / 1e9:6.2f} GB/s  "
              f"({spread})")
        if args.rounds_detail:
            print("      rounds: " + " ".join(f"{t:.3f}" for t in times[name]))
    missed = []
    for label, (mine, ref, least) in TARGETS.items():
        ratio = med[ref] / med[mine]
        ok = ratio >= least
        if not ok:
            missed.append(label)
        print(f"  {label:<16} {ratio:5.2f}x  (target >= {least}x) {'ok' if ok else 'MISSED'}")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
