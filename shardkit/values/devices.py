"""DeviceSpec: TensorFlow device strings such as ``/job:worker/replica:0/task:1/device:GPU:0``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..errors import DeviceSpecError


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """A (possibly partial) device name. Unset fields are None, as in ``tf.DeviceSpec``."""

    job: str | None = None
    replica: int | None = None
    task: int | None = None
    device_type: str | None = None
    device_index: int | None = None

    @classmethod
    def from_string(cls, spec: str) -> DeviceSpec:
        """Parse a device string.

        Args:
            spec: ``/job:j/replica:r/task:t/device:TYPE:i``, any part optional (also ``/cpu:0``).
        Returns:
            The parsed spec.
        Raises:
            DeviceSpecError: `spec` is not a device string.
        """
        return _parse(spec)

    def to_string(self) -> str:
        """The device string; `from_string` reads it back.

        Returns:
            ``/job:.../replica:.../task:.../device:TYPE:i``, unset parts left out.
        """
        parts = []
        if self.job is not None:
            parts.append(f"/job:{self.job}")
        if self.replica is not None:
            parts.append(f"/replica:{self.replica}")
        if self.task is not None:
            parts.append(f"/task:{self.task}")
        if self.device_type is not None:
            index = "*" if self.device_index is None else str(self.device_index)
            parts.append(f"/device:{self.device_type}:{index}")
        return "".join(parts)

    def __str__(self) -> str:
        return self.to_string()


def _int(value: str, field: str, spec: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise DeviceSpecError(
            f"device string {spec!r}: {field} {value!r} is not an integer"
        ) from None
    if n < 0:
        raise DeviceSpecError(f"device string {spec!r}: {field} {n} is negative")
    return n


@lru_cache(maxsize=1024)
def _parse(spec: str) -> DeviceSpec:
    if not isinstance(spec, str):
        raise DeviceSpecError(f"device must be a str, got {type(spec).__name__}")
    fields: dict[str, object] = {}
    for part in spec.split("/"):
        if not part:
            continue
        pieces = part.split(":")
        head = pieces[0].lower()
        if head == "job" and len(pieces) == 2 and pieces[1]:
            fields["job"] = pieces[1]
        elif head == "replica" and len(pieces) == 2:
            fields["replica"] = _int(pieces[1], "replica", spec)
        elif head == "task" and len(pieces) == 2:
            fields["task"] = _int(pieces[1], "task", spec)
        elif head in ("device", "cpu", "gpu", "tpu") and len(pieces) == 2 + (head == "device"):
            kind, index = pieces[-2:]  # device:TYPE:N, or the short TYPE:N
            fields["device_type"] = kind.upper()
            if index != "*":
                fields["device_index"] = _int(index, "device index", spec)
        else:
            raise DeviceSpecError(
                f"cannot parse device string {spec!r} at {part!r} "
                "(expected /job:NAME/replica:N/task:N/device:TYPE:N, any part optional)"
            )
    return DeviceSpec(**fields)  # type: ignore[arg-type]
