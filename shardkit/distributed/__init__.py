"""Many processes: the coordination seam and a rank of the collective save (docs/ARCHITECTURE.md).

`Coordinator` (defined in shardkit.coordinator, re-exported by base.py) is what a save needs
from a group of processes; `TorchCoordinator` (torch.py) implements it over a torch.distributed
process group. `save.py` is a rank's side of the save flow (`shardkit.io.flow`) when the
state holds DTensors or a `process_group` is given, and `routing.py` decides that
(`coordinator_for`); both sit with the front door in docs/ARCHITECTURE.md's layer order, above
the seam. torch is imported only then: `import shardkit` never imports it.
"""

from __future__ import annotations

from .base import DEFAULT_TIMEOUT, Coordinator

__all__ = ["DEFAULT_TIMEOUT", "Coordinator"]
