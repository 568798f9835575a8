"""The coordination seam of many processes: `Coordinator` (shardkit.coordinator, where a
process alone has its `LocalCoordinator` too) and `CountingCoordinator`, which counts the
collectives a save makes."""

from __future__ import annotations

from typing import Any

from ..coordinator import DEFAULT_TIMEOUT, Coordinator

__all__ = ["DEFAULT_TIMEOUT", "Coordinator", "CountingCoordinator"]


class CountingCoordinator(Coordinator):
    """A coordinator that counts the collectives made through it (`calls`, by kind) and
    forwards them to `inner`: how tests check that a save makes a constant number."""

    def __init__(self, inner: Coordinator) -> None:
        self.inner = inner
        self.calls: list[str] = []

    timeout = property(lambda self: self.inner.timeout,  # type: ignore[assignment]
                       lambda self, value: setattr(self.inner, "timeout", value))
    rank = property(lambda self: self.inner.rank)  # type: ignore[assignment]
    world_size = property(lambda self: self.inner.world_size)  # type: ignore[assignment]

    def _call(self, kind: str, *args: Any) -> Any:
        self.calls.append(kind)
        return getattr(self.inner, kind)(*args)

    def all_gather(self, payload: Any, op: str) -> list[Any]:
        return self._call("all_gather", payload, op)

    def gather(self, payload: Any, op: str, dst: int = 0) -> list[Any] | None:
        return self._call("gather", payload, op, dst)

    def broadcast(self, payload: Any, op: str, src: int = 0) -> Any:
        return self._call("broadcast", payload, op, src)

    def barrier(self, op: str) -> None:
        self._call("barrier", op)

    def background(self) -> Coordinator:
        got = getattr(self, "_background", None)
        if got is None:
            got = self._background = CountingCoordinator(self.inner.background())
        return got
