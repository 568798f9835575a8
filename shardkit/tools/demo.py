"""`shardkit demo`: build a transformer-like state, plan it, save, verify, restore, report."""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ..optional import require
from .models import model_shapes, state_nbytes, synthetic_state
from .profiling import human_size, plural

_GROUP_BYTES = 64 * 2**20
"""The restore phases read, check and drop the state in groups of tensors of about this many
bytes (or a 32nd of the state, if larger), so that at most one group is held besides the
original: peak memory is the state plus a group, not two or three copies of it."""

_COMPARE_BYTES = 16 * 2**20  # bytes compared at a time (the comparison's temporary is this big)


def run_demo(
    out: TextIO,
    *,
    model: str = "llm-small",
    dtype: str = "float32",
    directory: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the demo, printing to `out`; return the measured figures (seconds, bytes, shards).

    With `progress`, every phase that reads or writes the state shows a tqdm bar on stderr.
    """
    start = time.perf_counter()
    nbytes = state_nbytes(model, dtype)
    print(f"shardkit demo: model {model!r} ({dtype}), {len(model_shapes(model))} tensors, "
          f"{human_size(nbytes)}: building it", file=out, flush=True)
    # The save and restore flow is imported after the first line, so that it shows at once.
    from ..format import MANIFEST_FILE
    from ..io.options import CheckpointOptions
    from ..io.reader import load
    from ..io.save import DefaultShardingPolicy, save
    from ..sharding.policies import (
        AllInOnePolicy,
        BalancedPolicy,
        BinPackPolicy,
        MaxShardSizePolicy,
    )
    from ..sharding.tensors import flatten
    from .profiling import format_table, profile

    with _Bar(progress, nbytes, "building") as bar:
        state = synthetic_state(model, dtype=dtype, materialize=True, on_progress=bar.to)
    flat = dict(flatten(state))
    total = sum(a.nbytes for a in flat.values())
    print(f"built in {time.perf_counter() - start:.2f} s\n", file=out)

    policies = {
        DEFAULT_POLICY_LABEL: DefaultShardingPolicy(),
        "max-shard-size 64MiB": MaxShardSizePolicy("64MiB"),
        "bin-pack 64MiB": BinPackPolicy("64MiB"),
        "balanced 4": BalancedPolicy(4),
        "all-in-one": AllInOnePolicy(),
    }
    print("Sharding policies compared (planning only, nothing written):", file=out)
    print(format_table(profile(state, policies)), file=out)

    groups = _groups(flat, max(_GROUP_BYTES, total // 32))
    with tempfile.TemporaryDirectory(prefix="shardkit-demo-", dir=directory) as tmp:
        path = Path(tmp) / "checkpoint"
        times: dict[str, float] = {}
        figures: dict[str, Any] = {"bytes": total}

        info = _timed(times, SAVE, lambda: save(path, state, progress=progress))
        figures["shards"] = len(info.files) - 1
        same = True
        with _Bar(progress, total, "verifying") as bar:
            for keys, nbytes in groups:
                _timed(times, VERIFY, partial(_verify, path, keys))
                bar.add(nbytes)
        with _Bar(progress, total, "restoring") as bar:
            for keys, nbytes in groups:
                restored = _timed(times, LOAD, partial(load, path, keys))
                _timed(times, TOUCH, partial(_touch_all, restored))
                same = _timed(times, COMPARE, partial(_same_all, flat, restored)) and same
                del restored  # unmaps the group's pages before the next group
                bar.add(nbytes)
        zpath = Path(tmp) / "checkpoint-zstd"
        zstd = CheckpointOptions(compression="zstd")
        zinfo = _timed(times, ZSAVE, lambda: save(zpath, state, options=zstd, progress=progress))
        with _Bar(progress, total, "restoring zstd") as bar:
            for keys, nbytes in groups:
                zrestored = _timed(times, ZLOAD, partial(load, zpath, keys))
                same = _same_all(flat, zrestored) and same
                del zrestored
                bar.add(nbytes)
        if not same:
            raise AssertionError("restored state differs from the saved one")
        figures["zstd_ratio"] = total / zinfo.bytes

        print(f"\nCheckpoint: {plural(figures['shards'], 'shard')} + {MANIFEST_FILE}, "
              f"{human_size(info.bytes)} on disk", file=out)
        width = max(map(len, times))
        for label, seconds in times.items():
            rate = f"{total / seconds / 1e9:6.2f} GB/s" if seconds > 0 else ""
            print(f"  {label:<{width}}  {seconds * 1e3:9.1f} ms  {rate}", file=out)
            figures[label] = seconds
        print(f"  zstd compression ratio: {figures['zstd_ratio']:.3f} (synthetic normal weights; "
              "trained weights compress better)", file=out)
        print("\nRound trip byte-exact (raw and zstd): yes", file=out)
    return figures


DEFAULT_POLICY_LABEL = "default (save's)"
SAVE = "save (default policy, durable)"
VERIFY = "verify (xxh3-64 of every entry)"
LOAD = "load (memory-mapped views)"
TOUCH = "touch every restored byte"
COMPARE = "compare with the original"
ZSAVE = "save zstd (shuffled, level 1, durable)"
ZLOAD = "load zstd (parallel decompression)"


class _Bar:
    """A tqdm bar in bytes on stderr, or nothing when disabled; a context manager."""

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self._bar: Any = None
        if enabled:
            tqdm = require("tqdm.auto", "the demo's progress bars").tqdm
            self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                             desc=desc, file=sys.stderr)

    def to(self, n: int) -> None:
        """Set the bar to `n` bytes done."""
        if self._bar is not None:
            self._bar.update(n - self._bar.n)

    def add(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()


def _groups(flat: dict[str, np.ndarray], target: int) -> list[tuple[list[str], int]]:
    """The keys of `flat`, in order, cut into groups of at least `target` bytes (the last may
    be smaller), each with its byte count."""
    groups: list[tuple[list[str], int]] = []
    keys: list[str] = []
    nbytes = 0
    for key, array in flat.items():
        keys.append(key)
        nbytes += array.nbytes
        if nbytes >= target:
            groups.append((keys, nbytes))
            keys, nbytes = [], 0
    if keys:
        groups.append((keys, nbytes))
    return groups


def _verify(path: Path, keys: list[str]) -> int:
    from ..io.reader import open_checkpoint

    with open_checkpoint(path) as reader:  # closed after each group: its pages are unmapped
        return reader.verify(keys)


def _touch_all(arrays: dict[str, np.ndarray]) -> list[int]:
    return [int(a.reshape(-1).view(np.uint8).sum()) for a in arrays.values()]


def _same_all(original: dict[str, np.ndarray], restored: dict[str, np.ndarray]) -> bool:
    return all(_same_bytes(original[k], restored[k]) for k in restored)


def _timed(times: dict[str, float], label: str, fn: Callable[[], Any]) -> Any:
    """Run `fn`, adding its time to ``times[label]``."""
    start = time.perf_counter()
    result = fn()
    times[label] = times.get(label, 0.0) + time.perf_counter() - start
    return result


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    x = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    y = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
    # In pieces: np.array_equal's boolean temporary would be as large as the tensor.
    return all(np.array_equal(x[i : i + _COMPARE_BYTES], y[i : i + _COMPARE_BYTES])
               for i in range(0, x.size, _COMPARE_BYTES))
