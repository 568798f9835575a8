"""The coordination seam of many processes: `Coordinator` (shardkit.coordinator, where a
process alone has its `LocalCoordinator` too)."""

from __future__ import annotations

from ..coordinator import DEFAULT_TIMEOUT, Coordinator

__all__ = ["DEFAULT_TIMEOUT", "Coordinator"]
