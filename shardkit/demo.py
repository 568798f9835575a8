"""`shardkit demo`: build a transformer-like state, plan it, save, verify, restore, report."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from .api import save
from .models import synthetic_state
from .policies import AllInOnePolicy, BalancedPolicy, BinPackPolicy, MaxShardSizePolicy
from .profiling import format_table, human_size, profile
from .reader import load, open_checkpoint
from .tensors import flatten


def run_demo(
    out: TextIO,
    *,
    model: str = "llm-small",
    dtype: str = "float32",
    directory: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the demo, printing to `out`; return the measured figures (seconds, bytes, shards)."""
    start = time.perf_counter()
    state = synthetic_state(model, dtype=dtype, materialize=True)
    flat = dict(flatten(state))
    total = sum(a.nbytes for a in flat.values())
    print(f"shardkit demo: model {model!r} ({dtype}), {len(flat)} tensors, "
          f"{human_size(total)}, built in {time.perf_counter() - start:.2f} s\n", file=out)

    policies = {
        "max-shard-size 64MiB": MaxShardSizePolicy("64MiB"),
        "bin-pack 64MiB": BinPackPolicy("64MiB"),
        "balanced 4": BalancedPolicy(4),
        "all-in-one": AllInOnePolicy(),
    }
    print("Sharding policies compared (planning only, nothing written):", file=out)
    print(format_table(profile(state, policies)), file=out)

    with tempfile.TemporaryDirectory(prefix="shardkit-demo-", dir=directory) as tmp:
        path = Path(tmp) / "checkpoint"
        rows: list[tuple[str, float, int]] = []
        figures: dict[str, Any] = {"bytes": total}

        info = _timed(rows, "save (default policy, durable)", total,
                      lambda: save(path, state, progress=progress))
        figures["shards"] = len(info.files) - 1
        with open_checkpoint(path) as reader:
            _timed(rows, "verify (xxh3-64 of every entry)", total, reader.verify)
        restored = _timed(rows, "load (memory-mapped views)", total, lambda: load(path))
        _timed(rows, "touch every restored byte", total,
               lambda: [int(a.reshape(-1).view(np.uint8).sum()) for a in restored.values()])
        same = _timed(rows, "compare with the original", total,
                      lambda: all(_same_bytes(flat[k], restored[k]) for k in flat))
        zpath = Path(tmp) / "checkpoint-zstd"
        zinfo = _timed(rows, "save zstd (shuffled, level 1, durable)", total,
                       lambda: save(zpath, state, compression="zstd"))
        zrestored = _timed(rows, "load zstd (parallel decompression)", total,
                           lambda: load(zpath))
        same = same and all(_same_bytes(flat[k], zrestored[k]) for k in flat)
        if not same:
            raise AssertionError("restored state differs from the saved one")
        figures["zstd_ratio"] = total / zinfo.bytes

        print(f"\nCheckpoint: {figures['shards']} shards + index.json, "
              f"{human_size(info.bytes)} on disk", file=out)
        width = max(len(r[0]) for r in rows)
        for label, seconds, nbytes in rows:
            rate = f"{nbytes / seconds / 1e9:6.2f} GB/s" if seconds > 0 else ""
            print(f"  {label:<{width}}  {seconds * 1e3:9.1f} ms  {rate}", file=out)
            figures[label] = seconds
        print(f"  zstd compression ratio: {figures['zstd_ratio']:.3f} (synthetic normal weights; "
              "trained weights compress better)", file=out)
        print("\nRound trip byte-exact (raw and zstd): yes", file=out)
    return figures


def _timed(rows: list[tuple[str, float, int]], label: str, nbytes: int,
           fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    result = fn()
    rows.append((label, time.perf_counter() - start, nbytes))
    return result


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(np.array_equal(np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                               np.ascontiguousarray(b).reshape(-1).view(np.uint8)))
