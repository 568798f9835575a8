"""The coordination seam: what a save needs from its group of processes.

A `Coordinator` is one rank's handle on a group of `world_size` ranks. Its collectives move
small picklable payloads (index columns, never tensor bytes); each waits at most its timeout
and then raises DistributedTimeoutError naming the operation and the ranks that did not answer,
so a dead or stuck rank never hangs the others. Every rank must call the same collectives in
the same order. `LocalCoordinator` is a process alone, over which `io.flow` runs its save.
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
    def rank(self) -> int:
        """This process's rank, ``0 .. world_size - 1``."""

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """The number of ranks in the group."""

    @abc.abstractmethod
    def all_gather(self, payload: Any, op: str) -> list[Any]:
        """Every rank's `payload`, on every rank.

        Args:
            payload: this rank's small picklable value (so for `gather` and `broadcast`).
            op: the step's name, for errors (so for every collective).
        Returns:
            The payloads in rank order.
        Raises:
            DistributedTimeoutError: a rank did not answer within `timeout`.
        """

    @abc.abstractmethod
    def gather(self, payload: Any, op: str, dst: int = 0) -> list[Any] | None:
        """Every rank's `payload` on rank `dst`.

        Args:
            payload, op: as for `all_gather`.
            dst: the rank that receives them.
        Returns:
            On `dst` the payloads in rank order, on the others None.
        Raises:
            DistributedTimeoutError: a rank did not answer within `timeout`.
        """

    @abc.abstractmethod
    def broadcast(self, payload: Any, op: str, src: int = 0) -> Any:
        """Rank `src`'s `payload` on every rank.

        Args:
            payload, op: as for `all_gather`; only `src`'s payload counts (others pass None).
            src: the rank that sends.
        Returns:
            Rank `src`'s payload.
        Raises:
            DistributedTimeoutError: `src` did not answer within `timeout`.
        """

    @abc.abstractmethod
    def barrier(self, op: str) -> None:
        """Return once every rank has called it.

        Args:
            op: the step's name, for errors.
        Raises:
            DistributedTimeoutError: a rank did not arrive within `timeout`.
        """

    def background(self) -> Coordinator:
        """A twin for saves that commit from a background thread; every rank asks at once.

        Returns:
            A coordinator over the same ranks whose collectives never interleave with these.
        Raises:
            NotImplementedError: the base class has none.
        """
        raise NotImplementedError(f"{type(self).__name__} has no background coordinator")

    def with_timeout(self, timeout: float | None) -> Coordinator:
        """Set how long collectives wait.

        Args:
            timeout: seconds (None: unchanged).
        Returns:
            This coordinator.
        """
        if timeout is not None:
            self.timeout = float(timeout)
        return self


class LocalCoordinator(Coordinator):
    """A process alone: rank 0 of a world of 1, whose collectives return its own payload."""

    timeout = DEFAULT_TIMEOUT
    rank = 0  # type: ignore[assignment]
    world_size = 1  # type: ignore[assignment]

    def all_gather(self, payload: Any, op: str) -> list[Any]:
        return [payload]

    def gather(self, payload: Any, op: str, dst: int = 0) -> list[Any] | None:
        return [payload]

    def broadcast(self, payload: Any, op: str, src: int = 0) -> Any:
        return payload

    def barrier(self, op: str) -> None:
        pass
