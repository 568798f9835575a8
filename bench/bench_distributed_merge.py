"""What a collective save adds on top of a single-process one, for many tensors: no I/O.

Run: python bench/bench_distributed_merge.py [--tensors 100000] [--ranks 4] [--rounds 7]

Two states of `--tensors` tensors over `--ranks` ranks, as the collective save sees them:

- ``sharded``: every tensor a Shard(0) DTensor, so each rank holds a slice of each
  (ranks x tensors slices);
- ``split``: each rank holds its own tensors whole (tensors / ranks each), plus one replicated
  small tensor per 100 tensors that every rank holds.

For each it times (median of `--rounds`, in this one process): ``merge``, rank 0's work after
the ``index`` gather: unpickling the ranks' index columns and `distributed.save.merge`
(the merged `format.CheckpointIndex`); and ``assign``, every rank's de-duplication after
the ``plan`` all-gather (unpickling the columns and `distributed.save.plan`). The target:
the merge of 100,000 tensors from 4 ranks adds under 100 ms. The manifest's encoding is not
counted: a single-process save of the same tensors encodes the same manifest.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

import numpy as np

from shardkit import format as fmt
from shardkit.distributed.save import _part, columns, merge, plan
from shardkit.values.slices import format_slice_spec


def _parts(kind: str, n: int, ranks: int) -> tuple[list[bytes], list[bytes]]:
    """The pickled payloads of the ``plan`` and ``index`` collectives, per rank."""
    plans, indexes = [], []
    gen = fmt.new_generation()
    for r in range(ranks):
        if kind == "sharded":
            keys = [f"layers/{i}/weight" for i in range(n)]
            rows = 64 // ranks
            specs = [format_slice_spec((64, 32), (r * rows, 0), (rows, 32))] * n
            shapes = [(64, 32)] * n
            nbytes = [rows * 32 * 4] * n
        else:
            own = n // ranks
            keys = [f"rank{r}/t{i}" for i in range(own)] + [f"shared/{i}" for i in
                                                            range(n // 100)]
            specs = [""] * len(keys)
            shapes = [(16,)] * len(keys)
            nbytes = [64] * len(keys)
        m = len(keys)
        dtypes = ["F32"] * m
        devices = [f"/job:worker/replica:0/task:{r}/device:CPU:0"] * m
        plans.append(pickle.dumps(columns(keys, specs, dtypes, shapes, nbytes, devices),
                                  protocol=5))
    pieces = plan([pickle.loads(p) for p in plans])
    for r in range(ranks):
        cols = pickle.loads(plans[r])
        specs_r = [cols[1].values[c] for c in np.frombuffer(cols[1].codes, np.int32)]
        shapes_r = [cols[3].values[c] for c in np.frombuffer(cols[3].codes, np.int32)]
        device = cols[5].values[0]
        written = pieces.mine[r]
        m = len(written)
        half = m // 2
        files = [fmt.shard_file_name(2 * r + s, 2 * ranks) for s in range(2)]
        local = fmt.CheckpointIndex(
            "bench", [fmt.ShardInfo(f, r, "raw", 1 << 20, gen) for f in files],
            [cols[0][i] for i in written], ["F32"] * m, [shapes_r[i] for i in written],
            [device] * m, list(range(m)), [specs_r[i] for i in written],
            [0] * half + [1] * (m - half), ["0123456789abcdef"] * m)
        indexes.append(pickle.dumps(_part(local, written, specs_r), protocol=5))
    return plans, indexes


def _plan(plans: list[bytes]):  # type: ignore[no-untyped-def]
    return plan([pickle.loads(p) for p in plans])


def _merge(pieces, indexes: list[bytes], gen: str) -> fmt.CheckpointIndex:  # type: ignore[no-untyped-def]
    return merge(pieces, [pickle.loads(p) for p in indexes], description="bench",
                 user_metadata={}, generation=gen)


def _median_ms(fn, rounds: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    gen = fmt.new_generation()
    print(f"{args.tensors} tensors from {args.ranks} ranks, median of {args.rounds} (ms)")
    for kind in ("sharded", "split"):
        plans, indexes = _parts(kind, args.tensors, args.ranks)
        pieces = _plan(plans)
        merged = _merge(pieces, indexes, gen)
        slices = len(merged.slice_tensor)
        encode = _median_ms(lambda: fmt.encode_index(merged), args.rounds)  # noqa: B023
        merged_ms = _median_ms(lambda: _merge(pieces, indexes, gen), args.rounds)  # noqa: B023
        dedup = _median_ms(lambda: _plan(plans), args.rounds)  # noqa: B023
        print(f"  {kind:8s} {len(merged.keys):7d} tensors {slices:7d} slices: merge "
              f"{merged_ms:7.1f}   assign {dedup:7.1f}   (manifest encode, not added: "
              f"{encode:6.1f})")


if __name__ == "__main__":
    main()
