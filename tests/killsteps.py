"""The kill-at-every-step harness of tests/test_crash.py: a save SIGKILLed just before each
step of its commit in turn.

A *step* is every call that changes or syncs what is on disk or in the store: ``os.rename``,
``os.replace``, ``os.link``, ``os.unlink``, ``os.rmdir``, ``os.fsync`` (also under
`storage.commit.fsync_dir`), the ``renameat2`` of `shardkit.storage.commit`, and for a URL each
object the storage writes, publishes or deletes (`FsspecStorage.write_file`, ``upload_file``,
``publish``, ``delete``). Nothing in shardkit knows about this: the child process wraps those
functions itself.

Run as ``python killsteps.py KIND PATH [OPTIONS_JSON]`` (KIND: `KINDS`), it reads commands on
stdin, one a line, ``SEED SHARDS KILL_AT``: it forks a child that saves `state(SEED)` in
SHARDS shards at PATH (overwrite) and SIGKILLs itself just before step KILL_AT (0: never), and
prints ``killed``, or ``done N`` with the number of steps the save took. Forking from one
process that imported everything once keeps each round cheap; the child starts every thread
it uses (no other library has started one before the fork).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import numpy as np

KINDS = ("raw", "zstd", "fallback", "tensorflow", "s3")


def state(seed: int) -> dict[str, Any]:
    """The flat state saved with `seed` (a string tensor too: it has a file of its own)."""
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 64)).astype(np.float32),
            "v": rng.standard_normal(32),
            "b": rng.integers(0, 99, 7).astype(np.int16),
            "s": np.array([b"step", str(seed).encode()], dtype=object)}


def same(loaded: dict[str, Any], expected: dict[str, Any]) -> bool:
    """Bit-exact: keys, dtypes, shapes and bytes (the values of an object array)."""
    if sorted(loaded) != sorted(expected):
        return False
    for k, v in expected.items():
        a = np.asarray(loaded[k])
        if a.dtype != v.dtype or a.shape != v.shape:
            return False
        if (a.tolist() if v.dtype.kind == "O" else a.tobytes()) != (
                v.tolist() if v.dtype.kind == "O" else v.tobytes()):
            return False
    return True


def _arm(kill_at: int, steps: list[str]) -> None:
    from shardkit.storage import commit

    def wrap(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def step(*args: Any, **kwargs: Any) -> Any:
            steps.append(name)
            if len(steps) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        setattr(owner, name, step)

    for name in ("rename", "replace", "link", "unlink", "rmdir", "fsync"):
        wrap(os, name)
    wrap(commit, "_call_renameat2")
    if "shardkit.storage.fsspec" in sys.modules:
        from shardkit.storage.fsspec import FsspecStorage

        for name in ("write_file", "upload_file", "publish", "delete"):
            wrap(FsspecStorage, name)


def _save(kind: str, path: str, seed: int, shards: int) -> None:
    import shardkit
    from shardkit.storage import commit

    kwargs: dict[str, Any] = {}
    compression = "zstd" if kind == "zstd" else None
    if kind == "fallback":
        commit._renameat2_fn = None  # the rename-aside fallback
    elif kind == "tensorflow":
        kwargs["format"] = "tensorflow"
    shardkit.save(path, state(seed), overwrite=True, **kwargs, options=shardkit.CheckpointOptions(
        threads=2, durable=True, experimental_sharding_callback=shardkit.BalancedPolicy(shards),
        compression=compression))


def main(kind: str, path: str, options_json: str = "{}") -> None:
    import warnings

    import shardkit

    warnings.simplefilter("ignore")  # SplitTensorsWarning and the like: not what is tested
    if kind == "s3":
        import s3fs  # noqa: F401  (imported once here, not in every child)

        import shardkit.storage.fsspec  # the storage steps are wrapped in the children

        shardkit.set_storage_options("s3://", **json.loads(options_json))
    for line in sys.stdin:
        seed, shards, kill_at = map(int, line.split())
        done_r, done_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                steps: list[str] = []
                _arm(kill_at, steps)
                _save(kind, path, seed, shards)
                os.write(done_w, f"{len(steps)} {' '.join(steps)}".encode())
                code = 0
            finally:
                os._exit(code)
        os.close(done_w)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(done_r, "rb") as f:
            said = f.read().decode()
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            print("killed", flush=True)
        elif os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            print(f"done {said}", flush=True)
        else:
            print(f"failed {status}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
