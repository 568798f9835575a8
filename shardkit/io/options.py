"""CheckpointOptions: how a checkpoint is written, under TensorFlow's option names plus shardkit's.

``CheckpointOptions(experimental_sharding_callback=MaxShardSizePolicy("1GB"))`` is spelled as in
``tf.train.CheckpointOptions``; shardkit's own options (compression, durability, threads,
checksums) follow. Every argument is checked here, so a bad option fails before any work starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import InvalidArgumentError, InvalidArgumentTypeError
from ..sharding.callback import ShardingCallback, is_sharding_callback
from ..values.devices import DeviceSpec

COMPRESSIONS = ("zstd",)


@dataclass(frozen=True)
class CheckpointOptions:
    """Options for writing a checkpoint.

    TensorFlow's names:

    - ``experimental_sharding_callback``: a `ShardingCallback` deciding which tensors go into
      which shard file; None picks shardkit's default (see `shardkit.io.save.save`).
    - ``enable_async``: write in a background thread after taking a snapshot of the state, so
      training can go on. Honoured by the checkpoint manager; the functional `save` is
      synchronous and rejects it.
    - ``experimental_io_device``: the device through which files are accessed, in TensorFlow a
      host CPU. shardkit always writes from the calling host process, so only a CPU device (or
      None) is accepted; the option exists so TensorFlow code ports unchanged.
    - ``experimental_write_callbacks``: callables run, in order, after each save has been
      committed; one that takes a parameter receives the checkpoint path. Return values are
      ignored.

    shardkit's own:

    - ``compression``: None for raw safetensors shards, or ``"zstd"`` for compressed shards.
    - ``level``: the zstd level (-7..-1 or 1..22; None: shardkit.shards.skz's default); only
      with ``compression="zstd"``, like ``shuffle`` (byte-shuffle each chunk by item size
      before compressing, default True) and ``chunk_size`` (independently compressed chunks,
      default ``"4MiB"``).
    - ``durable``: fsync every file and directory before the save returns (default True).
    - ``threads``: writer threads; None picks one per core (at most 8).
    - ``checksum``: record an xxh3-64 checksum per tensor slice (default True).
    """

    experimental_sharding_callback: ShardingCallback | None = None
    enable_async: bool = False
    experimental_io_device: str | None = None
    experimental_write_callbacks: Sequence[Callable[..., Any]] | None = None
    compression: str | None = None
    level: int | None = None
    shuffle: bool = True
    chunk_size: int | str = "4MiB"
    durable: bool = True
    threads: int | None = None
    checksum: bool = True
    _write_callbacks: tuple[Callable[..., Any], ...] = field(
        init=False, repr=False, compare=False, default=()
    )

    def __post_init__(self) -> None:
        cb = self.experimental_sharding_callback
        if cb is not None and not is_sharding_callback(cb):
            raise InvalidArgumentTypeError(
                "experimental_sharding_callback must be a sharding callback: a "
                "shardkit.ShardingCallback, a tf.train.experimental.ShardingCallback, or any "
                "object with a description property and __call__(shardable_tensors); got "
                f"{type(cb).__name__}"
            )
        for name in ("enable_async", "durable", "checksum"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidArgumentTypeError(f"{name} must be True or False, got {value!r}")
        _check_io_device(self.experimental_io_device)
        object.__setattr__(
            self, "_write_callbacks", _check_write_callbacks(self.experimental_write_callbacks)
        )
        if self.compression is not None and self.compression not in COMPRESSIONS:
            raise InvalidArgumentError(
                f"compression must be None or one of {', '.join(map(repr, COMPRESSIONS))}, "
                f"got {self.compression!r}"
            )
        if self.compression is None:
            defaults = {f.name: f.default for f in fields(self)}
            given = [f"{name}={getattr(self, name)!r}"
                     for name in ("level", "shuffle", "chunk_size")
                     if getattr(self, name) != defaults[name]]
            if given:
                raise InvalidArgumentError(
                    f"{', '.join(given)} needs compression (e.g. compression='zstd'); raw "
                    "shards have no level, shuffle or chunk size"
                )
        else:
            from ..shards.skz import resolve_compression  # imports zstandard: only when asked

            resolve_compression(self.compression, self.level, self.shuffle, self.chunk_size)
        check_threads(self.threads)

    @property
    def write_callbacks(self) -> tuple[Callable[..., Any], ...]:
        """The validated ``experimental_write_callbacks`` as a tuple (empty if None)."""
        return self._write_callbacks

    def run_write_callbacks(self, save_path: str) -> None:
        """Call each write callback, passing `save_path` to those that take a parameter.

        Args:
            save_path: the path of the checkpoint just written.
        """
        for fn in self._write_callbacks:
            if _takes_argument(fn):
                fn(save_path)
            else:
                fn()


def check_options(options: CheckpointOptions | None) -> CheckpointOptions:
    """`options`, checked to be CheckpointOptions; the defaults for None."""
    if options is None:
        return CheckpointOptions()
    if not isinstance(options, CheckpointOptions):
        raise InvalidArgumentTypeError(
            f"options must be a CheckpointOptions, got {type(options).__name__}")
    return options


def check_threads(threads: int | None) -> None:
    """Raise unless `threads` is None or a positive int."""
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise InvalidArgumentTypeError(f"threads must be a positive int or None, got {threads!r}")
    if threads < 1:
        raise InvalidArgumentError(f"threads must be at least 1, got {threads}")


def _check_io_device(device: str | None) -> None:
    if device is None:
        return
    if not isinstance(device, str):
        raise InvalidArgumentTypeError(
            f"experimental_io_device must be a device string, got {device!r}")
    spec = DeviceSpec.from_string(device)  # DeviceSpecError if malformed
    if spec.device_type not in (None, "CPU"):
        raise InvalidArgumentError(
            f"experimental_io_device={device!r}: files are accessed from a host CPU; "
            f"device type {spec.device_type} cannot do I/O"
        )


def _check_write_callbacks(callbacks: Any) -> tuple[Callable[..., Any], ...]:
    if callbacks is None:
        return ()
    if callable(callbacks) or isinstance(callbacks, (str, bytes)):
        raise InvalidArgumentTypeError(
            "experimental_write_callbacks must be a list of callables, not one")
    out = tuple(callbacks)
    for i, fn in enumerate(out):
        if not callable(fn):
            raise InvalidArgumentTypeError(
                f"experimental_write_callbacks[{i}] is not callable: {fn!r}")
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            continue  # builtins without a signature: called with the path
        required = [
            p for p in params
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if len(required) > 1:
            raise InvalidArgumentTypeError(
                f"experimental_write_callbacks[{i}] ({getattr(fn, '__name__', fn)!r}) takes "
                f"{len(required)} required arguments; a write callback takes none or save_path"
            )
    return out


def _takes_argument(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params
    )
