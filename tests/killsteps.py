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
it uses (no other library has started one before the fork: TensorFlow, imported for KIND
``tf-manager``, runs no op before it).

KIND ``tf-manager``: PATH is the directory of a shardkit ``CheckpointManager(...,
format="tensorflow", max_to_keep=2)`` over `tf_model`'s Keras model and Adam; the child
reopens it (``restore_or_initialize``), then makes SEED saves in SHARDS data files, each of
the variables set to `tf_values` of its checkpoint number first.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import numpy as np

KINDS = ("raw", "zstd", "fallback", "tensorflow", "s3", "tf-manager")


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


def tf_model(keras: Any) -> tuple[Any, Any]:
    """The Keras model and its Adam (built: its slots exist) the ``tf-manager`` kind saves."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)])
    opt = keras.optimizers.Adam(learning_rate=0.01)
    model.compile(opt, "mse")
    opt.build(model.trainable_variables)
    return model, opt


def tf_values(variables: list[Any], number: int) -> list[np.ndarray]:
    """What each of `variables` (the model's, then the optimizer's) holds in checkpoint
    `number`: the optimizer's iterations `number`, everything else drawn from it."""
    rng = np.random.default_rng(number)
    out = []
    for v in variables:
        dtype = np.dtype(v.dtype)
        if dtype.kind == "i":
            out.append(np.full(tuple(v.shape), number, dtype))
        else:
            out.append(rng.standard_normal(tuple(v.shape)).astype(dtype))
    return out


def _manager_saves(path: str, saves: int, shards: int) -> None:
    import keras

    import shardkit

    model, opt = tf_model(keras)
    variables = [*model.variables, *opt.variables]
    ckpt = shardkit.Checkpoint(model=model, optimizer=opt)
    manager = shardkit.CheckpointManager(ckpt, path, max_to_keep=2, format="tensorflow")
    manager.restore_or_initialize()
    options = shardkit.CheckpointOptions(
        threads=1, durable=True, experimental_sharding_callback=shardkit.BalancedPolicy(shards))
    for _ in range(saves):
        for v, value in zip(variables, tf_values(variables, ckpt.save_counter + 1)):
            v.assign(value)
        manager.save(options=options)


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
    if kind == "tf-manager":
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import keras  # noqa: F401  (imported once here; no op runs before the fork)
        import tensorflow  # noqa: F401

        import shardkit.adapters.tensorbundle.writer
        import shardkit.frameworks.tensorflow
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
                if kind == "tf-manager":
                    _manager_saves(path, seed, shards)
                else:
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
