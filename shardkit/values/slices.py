"""Slice specs in TensorFlow's ``SaveSliceInfo.spec`` text.

``"4 6 2,2:0,6"`` is rows 2..3 (offset 2, length 2) and all 6 columns of a ``[4, 6]`` tensor: the
full shape, a space, then ``offset,length`` per dimension joined by ``:``. A dimension may also be
written ``-`` (all of it), as TensorFlow's parser accepts. ``""`` is the whole tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from ..errors import SliceSpecError

WHOLE = ""


@dataclass(frozen=True, slots=True)
class SliceSpec:
    """A box inside a tensor of shape `full_shape`: `offsets[i]` .. `offsets[i] + lengths[i]`."""

    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @classmethod
    def parse(cls, spec: str, full_shape: Sequence[int] | None = None) -> SliceSpec:
        """TensorFlow's spec text as a box (``str(box)`` is the text again).

        Args:
            spec: ``"4 6 2,2:0,6"`` (rows 2-3 of a 4x6 tensor), or ``""`` for a whole tensor.
            full_shape: the tensor's shape; needed for ``""``, checked against any other spec.
        Returns:
            The SliceSpec.
        Raises:
            SliceSpecError: malformed text, a box outside the tensor, or another shape.
        """
        return parse_slice_spec(spec, full_shape)

    @classmethod
    def whole(cls, full_shape: Sequence[int]) -> SliceSpec:
        """The box of a whole tensor.

        Args:
            full_shape: the tensor's shape.
        Returns:
            The box covering all of it.
        """
        shape = tuple(int(d) for d in full_shape)
        return cls(shape, (0,) * len(shape), shape)

    @property
    def shape(self) -> tuple[int, ...]:
        """The box's own shape (`lengths`)."""
        return self.lengths

    @property
    def is_whole(self) -> bool:
        """Whether the box is the whole tensor."""
        return self.lengths == self.full_shape

    @property
    def size(self) -> int:
        """The number of elements in the box."""
        return math.prod(self.lengths)

    def to_index(self) -> tuple[slice, ...]:
        """The numpy index of this box.

        Returns:
            One ``slice`` per axis: ``full_tensor[spec.to_index()]`` is the box.
        """
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths))

    def intersect(self, other: SliceSpec) -> SliceSpec | None:
        """The common box of two slices of the same tensor.

        Args:
            other: a box of a tensor of the same full shape.
        Returns:
            The intersection, or None if they do not overlap.
        Raises:
            SliceSpecError: the full shapes differ.
        """
        if self.full_shape != other.full_shape:
            raise SliceSpecError(
                f"cannot intersect slices of different shapes {list(self.full_shape)} "
                f"and {list(other.full_shape)}"
            )
        offsets, lengths = [], []
        for a0, an, b0, bn in zip(self.offsets, self.lengths, other.offsets, other.lengths):
            lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
            if hi <= lo:
                return None
            offsets.append(lo)
            lengths.append(hi - lo)
        return SliceSpec(self.full_shape, tuple(offsets), tuple(lengths))

    def __str__(self) -> str:
        return format_slice_spec(self.full_shape, self.offsets, self.lengths)


def format_slice_spec(
    full_shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]
) -> str:
    """TensorFlow's spec text of a box, such as ``"4 6 2,2:0,6"``.

    Args:
        full_shape: the tensor's shape (empty for a scalar, whose spec is ``""``).
        offsets: where the box starts, one per axis.
        lengths: its length along each axis.
    Returns:
        The spec text; a whole tensor still gets explicit ranges.
    Raises:
        TypeError, ValueError: a value that is not an integer (bounds are not checked).
    """
    if not full_shape:
        return WHOLE
    dims = " ".join(str(int(d)) for d in full_shape)
    ranges = ":".join(f"{int(o)},{int(n)}" for o, n in zip(offsets, lengths))
    return f"{dims} {ranges}"


def parse_slice_spec(spec: str, full_shape: Sequence[int] | None = None) -> SliceSpec:
    """Parse TensorFlow's spec text into a box, checking its bounds.

    Args:
        spec: the text, such as ``"4 6 2,2:0,6"``, or ``""`` for a whole tensor.
        full_shape: the tensor's shape: needed for ``""``, else checked if given.
    Returns:
        The box.
    Raises:
        SliceSpecError: malformed text, a range out of bounds, or another full shape.
    """
    if not isinstance(spec, str):
        raise SliceSpecError(f"slice spec must be a str, got {type(spec).__name__}: {spec!r}")
    expected = None if full_shape is None else tuple(int(d) for d in full_shape)
    if spec == WHOLE:
        if expected is None:
            raise SliceSpecError('the whole-tensor spec "" needs the tensor\'s full shape')
        return SliceSpec.whole(expected)
    parsed = _parse(spec)
    if expected is not None and parsed.full_shape != expected:
        raise SliceSpecError(
            f"slice spec {spec!r} is for shape {list(parsed.full_shape)}, "
            f"but the tensor has shape {list(expected)}"
        )
    return parsed


@lru_cache(maxsize=65536)
def _parse(spec: str) -> SliceSpec:
    def bad(why: str) -> SliceSpecError:
        return SliceSpecError(
            f"malformed slice spec {spec!r}: {why} "
            '(expected e.g. "4 6 2,2:0,6": full shape, a space, offset,length per dimension)'
        )

    parts = spec.split(" ")
    if len(parts) < 2:
        raise bad("no slice ranges after the full shape")
    try:
        full = tuple(int(p) for p in parts[:-1])
    except ValueError:
        raise bad("the full shape must be integers separated by single spaces") from None
    if any(d < 0 for d in full):
        raise bad("negative dimension in the full shape")
    ranges = parts[-1].split(":")
    if len(ranges) != len(full):
        raise bad(f"{len(ranges)} ranges for {len(full)} dimensions")
    offsets, lengths = [], []
    for axis, (text, dim) in enumerate(zip(ranges, full)):
        if text == "-":
            offsets.append(0)
            lengths.append(dim)
            continue
        pieces = text.split(",")
        if len(pieces) != 2:
            raise bad(f"range {text!r} of axis {axis} is not offset,length")
        try:
            off, n = int(pieces[0]), int(pieces[1])
        except ValueError:
            raise bad(f"range {text!r} of axis {axis} is not two integers") from None
        if off < 0 or n < 0 or off + n > dim:
            raise bad(f"range {text!r} of axis {axis} is outside 0..{dim}")
        if n == 0 and dim != 0:
            raise bad(f"range {text!r} of axis {axis} is empty")
        offsets.append(off)
        lengths.append(n)
    return SliceSpec(full, tuple(offsets), tuple(lengths))


def check_tiling(full_shape: Sequence[int], slices: Iterable[SliceSpec]) -> None:
    """Check that `slices` cover a tensor exactly: no overlap, no gap.

    Args:
        full_shape: the tensor's shape.
        slices: boxes of it.
    Raises:
        SliceSpecError: a box of another shape, two that overlap, or a gap.
    """
    # Sweep over axis 0: a slice can only overlap those whose axis-0 range is still open.
    full = tuple(int(d) for d in full_shape)
    items = sorted(slices, key=lambda s: s.offsets)
    total = math.prod(full)
    covered = 0
    active: list[SliceSpec] = []
    for s in items:
        if s.full_shape != full:
            raise SliceSpecError(
                f"slice {str(s)!r} is for shape {list(s.full_shape)}, not {list(full)}"
            )
        if not full:
            covered += 1
            if len(items) > 1:
                raise SliceSpecError("a scalar cannot be split into slices")
            continue
        start = s.offsets[0]
        active = [a for a in active if a.offsets[0] + a.lengths[0] > start]
        for a in active:
            if s.intersect(a) is not None:
                raise SliceSpecError(f"slices {str(a)!r} and {str(s)!r} overlap")
        active.append(s)
        covered += s.size
    if total == 0 and len(items) == 1:
        return
    if covered != total:
        raise SliceSpecError(
            f"slices cover {covered} of the {total} elements of shape {list(full)}: "
            "there is a gap"
        )
