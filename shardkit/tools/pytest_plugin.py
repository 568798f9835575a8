"""pytest plugin: guard your own checkpoint speed in CI with pytest-benchmark.

Installed with shardkit (entry point ``pytest11``); it provides the ``checkpoint_benchmark``
fixture, which needs pytest-benchmark::

    from shardkit import CheckpointOptions

    def test_checkpoint_speed(checkpoint_benchmark):
        model = build_model()
        checkpoint_benchmark.save({"model": model}, CheckpointOptions(durable=False))

    def test_restore_speed(checkpoint_benchmark):
        checkpoint_benchmark.restore({"model": build_model()})

The state is what `shardkit.Checkpoint` takes as keyword arguments. Each round times one save
into a fresh directory (or one restore in place; for ``enable_async=True`` only the snapshot).
What it records in ``extra_info`` is listed in docs/TRAINING.md.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # imported when used: every pytest run loads this plugin
    from ..io.options import CheckpointOptions
    from ..training.checkpoint import Checkpoint


@dataclasses.dataclass(frozen=True)
class CheckpointBenchmarkResult:
    """What one `CheckpointBenchmark` run measured (also stored in ``extra_info``)."""

    operation: str
    path: str
    bytes: int
    file_bytes: int
    shards: int
    seconds: float | None  # median round; None when benchmarks are disabled
    gb_per_s: float | None
    compression_ratio: float


class CheckpointBenchmark:
    """Times checkpoint saves or restores of a state through pytest-benchmark's ``benchmark``.

    Use one of `save` / `restore` per test (pytest-benchmark times one thing per test).
    """

    def __init__(self, benchmark: Any, directory: Path) -> None:
        self._benchmark = benchmark
        self._directory = Path(directory)

    def save(self, state: Mapping[str, Any], options: CheckpointOptions | None = None, *,
             rounds: int = 5, warmup_rounds: int = 1) -> CheckpointBenchmarkResult:
        """Time ``Checkpoint(**state).write(path, options)``, each round into a fresh path."""
        ckpt, options = self._checkpoint(state, options)
        path = self._directory / "checkpoint"

        def setup() -> None:
            ckpt.sync()  # an async round's write finishes outside the timed call
            _remove(path)

        self._benchmark.pedantic(ckpt.write, args=(path, options), setup=setup,
                                 rounds=rounds, warmup_rounds=warmup_rounds)
        ckpt.sync()
        return self._record("save", path, options)

    def restore(self, state: Mapping[str, Any], options: CheckpointOptions | None = None, *,
                rounds: int = 5, warmup_rounds: int = 1) -> CheckpointBenchmarkResult:
        """Write the state once with `options` (untimed), then time restoring it in place."""
        ckpt, options = self._checkpoint(state, options)
        path = self._directory / "checkpoint"
        _remove(path)
        ckpt.write(path, options)
        ckpt.sync()
        self._benchmark.pedantic(ckpt.read, args=(path,), rounds=rounds,
                                 warmup_rounds=warmup_rounds)
        return self._record("restore", path, options)

    def _checkpoint(self, state: Mapping[str, Any], options: CheckpointOptions | None
                    ) -> tuple[Checkpoint, CheckpointOptions]:
        from ..training.checkpoint import Checkpoint, check_options

        if not isinstance(state, Mapping):
            raise TypeError(
                "checkpoint_benchmark takes a mapping of names to objects, as Checkpoint(**state)"
                f" does; got {type(state).__name__}"
            )
        return Checkpoint(**state), check_options(options)

    def _record(self, operation: str, path: Path, options: CheckpointOptions
                ) -> CheckpointBenchmarkResult:
        from ..io.reader import open_checkpoint

        with open_checkpoint(path) as reader:
            data = sum(reader.info(k).nbytes for k in reader.keys())
            files = sum(s.bytes for s in reader.index.shards)
            shards = len(reader.index.shards)
        meta = self._benchmark.stats
        seconds = meta.stats.median if meta is not None else None
        result = CheckpointBenchmarkResult(
            operation, os.fspath(path), data, files, shards, seconds,
            gb_per_s=data / seconds / 1e9 if seconds else None,
            compression_ratio=data / files if files else 1.0,
        )
        info = dataclasses.asdict(result)
        del info["path"], info["seconds"]  # the rest, and the options
        self._benchmark.extra_info.update(info, options=repr(options))
        return result


def _remove(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)


@pytest.fixture
def checkpoint_benchmark(benchmark: Any, tmp_path: Path) -> CheckpointBenchmark:
    """Time saving or restoring a state with given CheckpointOptions (see shardkit docs)."""
    return CheckpointBenchmark(benchmark, tmp_path / "checkpoint_benchmark")
