"""The coordination seam: what a collective save needs from a group of processes.

A `Coordinator` is one rank's handle on a group of `world_size` ranks. Its collectives move
small picklable payloads (index columns, never tensor bytes); each waits at most its timeout
and then raises DistributedTimeoutError naming the operation and the ranks that did not answer,
so a dead or stuck rank never hangs the others. Every rank must call the same collectives in
the same order.
"""

from __future__ import annotations

import abc
from typing import Any

DEFAULT_TIMEOUT = 300.0  # seconds a collective of a save waits for the other ranks


class Coordinator(abc.ABC):
    """One rank of a group of processes: `rank` in ``0 .. world_size - 1``."""

    timeout: float

    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def world_size(self) -> int: ...

    @abc.abstractmethod
    def all_gather(self, payload: Any, op: str) -> list[Any]:
        """Every rank's `payload`, in rank order, on every rank. `op` names the step in errors."""

    @abc.abstractmethod
    def gather(self, payload: Any, op: str, dst: int = 0) -> list[Any] | None:
        """Every rank's `payload` in rank order on rank `dst`; None on the others."""

    @abc.abstractmethod
    def broadcast(self, payload: Any, op: str, src: int = 0) -> Any:
        """Rank `src`'s `payload` on every rank (the others pass anything, e.g. None)."""

    @abc.abstractmethod
    def barrier(self, op: str) -> None:
        """Return once every rank has called it."""

    def background(self) -> Coordinator:
        """A coordinator over the same ranks whose collectives never interleave with this
        one's (for saves that commit from a background thread); made once, reused. Every
        rank must ask for it at the same point. The base class has none."""
        raise NotImplementedError(f"{type(self).__name__} has no background coordinator")

    def with_timeout(self, timeout: float | None) -> Coordinator:
        """This coordinator with collectives waiting `timeout` seconds (None: unchanged)."""
        if timeout is not None:
            self.timeout = float(timeout)
        return self


class CountingCoordinator(Coordinator):
    """A coordinator that counts the collectives made through it (`calls`, by kind) and
    forwards them to `inner`: how tests check that a save makes a constant number."""

    def __init__(self, inner: Coordinator) -> None:
        self.inner = inner
        self.calls: list[str] = []

    @property
    def timeout(self) -> float:  # type: ignore[override]
        return self.inner.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self.inner.timeout = value

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def all_gather(self, payload: Any, op: str) -> list[Any]:
        self.calls.append("all_gather")
        return self.inner.all_gather(payload, op)

    def gather(self, payload: Any, op: str, dst: int = 0) -> list[Any] | None:
        self.calls.append("gather")
        return self.inner.gather(payload, op, dst)

    def broadcast(self, payload: Any, op: str, src: int = 0) -> Any:
        self.calls.append("broadcast")
        return self.inner.broadcast(payload, op, src)

    def barrier(self, op: str) -> None:
        self.calls.append("barrier")
        self.inner.barrier(op)

    def background(self) -> Coordinator:
        got = getattr(self, "_background", None)
        if got is None:
            got = self._background = CountingCoordinator(self.inner.background())
        return got
