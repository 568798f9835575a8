"""The built-in sharding policies: TensorFlow's two, and packing policies TensorFlow lacks.

Every policy is a ShardingCallback: it maps the ShardableTensors of one device task to a list of
shards ``{checkpoint_key: {slice_spec: array}}``. A policy that splits a tensor returns numpy views
of it (``tensor[region]``) under TensorFlow slice specs that name the region within the full,
original tensor, also when the input is itself already a slice. No policy returns an empty shard.

HuggingFace loaders read only tensors stored whole (spec ``""``): ``DefaultShardingPolicy``,
``ShardByTaskPolicy`` and ``AllInOnePolicy`` keep them so, ``BinPackPolicy`` and
``BalancedPolicy`` split those over their target, ``MaxShardSizePolicy`` gives every tensor an
explicit spec; ``save`` warns (``SplitTensorsWarning``) when any tensor is stored as slices.

The planning cores run in the compiled kernels (``shardkit._kernels._packing``); this module only
gathers sizes and shapes into int64 arrays and builds the shard dicts from the plan.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import operator
import re
from collections.abc import Sequence
from decimal import Decimal
from typing import Any, ClassVar

import numpy as np

from .._kernels import _packing, _sizes
from ..errors import PolicyError, SliceSpecError
from ..values.dtypes import packed_name
from ..values.slices import format_slice_spec, parse_slice_spec
from .callback import Shard, ShardingCallback
from .tensors import ShardableTensor, gc_paused

logger = logging.getLogger("shardkit")

Shards = list[Shard]

_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


def parse_size(size: int | str, name: str = "size") -> int:
    """A positive byte count from an int or a size string.

    Args:
        size: bytes, or a string such as ``"256MB"``, ``"1GiB"``, ``"1.5GB"``; units
            (case-insensitive) B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (of 1024).
        name: the argument's name in error messages.
    Returns:
        The number of bytes.
    Raises:
        PolicyError: anything else, or a zero, negative, fractional or over-int64 count.
    """
    if isinstance(size, (bool, np.bool_)):
        raise PolicyError(f"{name} must be a byte count or a size string, got bool {size!r}")
    if isinstance(size, (int, np.integer)):
        n = int(size)
    elif isinstance(size, str):
        m = _SIZE_RE.fullmatch(size)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise PolicyError(
                f"{name} {size!r} is not a size: expected a number and an optional unit, "
                "e.g. '256MB', '1GiB', '512KiB', '1.5GB' (units B, KB, MB, GB, TB, KiB, MiB, "
                "GiB, TiB)"
            )
        exact = Decimal(m.group(1)) * _UNITS[unit]  # the regex admits only valid decimals
        if exact != exact.to_integral_value():
            raise PolicyError(f"{name} {size!r} is {exact} bytes, not a whole number of bytes")
        n = int(exact)
    else:
        raise PolicyError(
            f"{name} must be an int or a size string such as '256MB', "
            f"got {type(size).__name__} {size!r}"
        )
    if n <= 0:
        raise PolicyError(f"{name} must be positive, got {size!r} ({n} bytes)")
    if n > 2**63 - 1:
        raise PolicyError(f"{name} {size!r} ({n} bytes) does not fit in int64")
    return n


class _Policy(ShardingCallback):
    """Shared by the built-in policies: a registry name and a JSON-safe config."""

    name: ClassVar[str]

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments, JSON-safe.

        Returns:
            The keyword arguments: ``type(p)(**p.get_config())`` rebuilds `p`.
        """
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


class _PlanningPolicy(_Policy):
    """A policy that plans with the native kernels: `_plan` on the list, cyclic GC paused (building
    a million small result dicts would otherwise trigger many useless GC passes)."""

    def __call__(self, shardable_tensors: Sequence[ShardableTensor]) -> Shards:
        with gc_paused():
            return self._plan(list(shardable_tensors))

    def _plan(self, ts: list[ShardableTensor]) -> Shards:
        raise NotImplementedError


class _SizedPolicy(_PlanningPolicy):
    """A planning policy whose one argument is `max_shard_size`."""

    def __init__(self, max_shard_size: int | str) -> None:
        self.max_shard_size = parse_size(max_shard_size, "max_shard_size")

    def get_config(self) -> dict[str, Any]:
        return {"max_shard_size": self.max_shard_size}


class ShardByTaskPolicy(_Policy):
    """One shard per device task, tensors unchanged (TensorFlow's ``ShardByTaskPolicy``).

    Guarantee: one shard per distinct task in the input, in order of first appearance; every
    tensor whole, under its own slice spec. The library calls a policy once per task, so this is
    one shard per call; a mixed list is grouped by ``t.task``.
    """

    name = "by-task"

    @property
    def description(self) -> str:
        return "Split tensors into shards based on their device spec task."

    def __call__(self, shardable_tensors: Sequence[ShardableTensor]) -> Shards:
        by_task: dict[int, Shard] = {}
        for t in shardable_tensors:
            shard = by_task.setdefault(t.device.task or 0, {})
            shard.setdefault(t.checkpoint_key, {})[t.slice_spec] = t.tensor
        return list(by_task.values())


class AllInOnePolicy(_Policy):
    """Everything in one shard, tensors unchanged.

    Guarantee: exactly one shard (none for no tensors), every tensor whole, in input order.
    """

    name = "all-in-one"

    @property
    def description(self) -> str:
        return "Place all tensors in a single shard."

    def __call__(self, shardable_tensors: Sequence[ShardableTensor]) -> Shards:
        shard: Shard = {}
        for t in shardable_tensors:
            shard.setdefault(t.checkpoint_key, {})[t.slice_spec] = t.tensor
        return [shard] if shard else []


class MaxShardSizePolicy(_SizedPolicy):
    """TensorFlow's ``MaxShardSizePolicy``: fill shards in input order up to `max_shard_size`.

    A tensor that does not fit the space left in the current shard is split: a slab along the
    axis that needs the fewest partitions fills the shard, the rest goes on into the next ones.
    Scalars larger than the maximum go each alone into a shard after all the others (a warning
    is logged). Every tensor that is placed gets an explicit slice spec, as TensorFlow does.

    Guarantee: for every input on which TensorFlow returns, the same shards, keys, slice specs and
    order as ``tf.train.experimental.MaxShardSizePolicy``, except that zero-element tensors (which
    TensorFlow drops, failing validation) go whole into the current shard. Every shard holds at
    most `max_shard_size` bytes, except one per oversized piece that cannot be split (a scalar, or
    a single element when the item size itself exceeds the maximum), which is alone in its shard.

    Where TensorFlow never returns (no single-axis slab of the rest fits even an empty shard:
    it appends empty shards forever), this policy cuts a slab of thickness 1 off the first axis
    longer than 1, further cut the same way if needed, so it returns and the maximum holds.
    """

    name = "max-shard-size"

    @property
    def description(self) -> str:
        return "Split tensors into shards with a max shard size."

    def _plan(self, ts: list[ShardableTensor]) -> Shards:
        n = len(ts)
        if not n:
            return []
        shapes = [t.tensor.shape for t in ts]
        paired = _paired(ts)
        planned = shapes if not paired else [
            _planning_shape(t)[0] if i in paired else s for i, (t, s) in enumerate(zip(ts, shapes))]
        ranks = np.fromiter(map(len, planned), dtype=np.int64, count=n)
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(ranks, out=indptr[1:])
        dims = np.fromiter(itertools.chain.from_iterable(planned), np.int64, int(indptr[-1]))
        itemsizes = np.fromiter((t.tensor.itemsize for t in ts), np.int64, count=n)
        for i in paired:
            itemsizes[i] = _planning_shape(ts[i])[1]
        try:
            owner, shard_of, geom, regular = _packing.max_shard_fill(
                indptr, dims, itemsizes, self.max_shard_size
            )
        except OverflowError as e:
            raise PolicyError(f"{self.description} {_tensor_of(ts, e)}: {e}") from e
        # Pieces come tensor by tensor, in input order: walk both together.
        counts = np.bincount(owner, minlength=n).tolist()
        # Whole pieces get TensorFlow's explicit spec; scalars and zero-element tensors (which
        # TensorFlow drops) keep their own.
        own_spec = ((ranks == 0) | (_sizes.shape_nbytes(indptr, dims, itemsizes) == 0)).tolist()
        num_shards = int(shard_of.max()) + 1 if shard_of.shape[0] else 0
        shards: Shards = [{} for _ in range(num_shards)]
        shard_list, geom_list = shard_of.tolist(), geom.tolist()
        whole_specs: dict[Any, str] = {}
        p = g = 0
        for i, (t, shape, count, keep) in enumerate(zip(ts, planned, counts, own_spec)):
            r = len(shape)
            if count == 1:
                if keep:
                    spec = t.slice_spec
                elif t.slice_spec == "":
                    cached = whole_specs.get(shape)
                    spec = cached if cached is not None else whole_specs.setdefault(
                        shape, _whole_spec(t)
                    )
                else:
                    spec = _whole_spec(t)
                pieces: Any = ((shard_list[p], spec, t.tensor),)
                g += 2 * r
            else:
                pieces = []
                for k in range(p, p + count):
                    offsets, lengths = geom_list[g : g + r], geom_list[g + r : g + 2 * r]
                    if i in paired:
                        offsets, lengths = _elements(offsets, lengths)
                    cut = _cut(t, offsets, lengths)
                    pieces.append((shard_list[k], *cut))
                    g += 2 * r
            p += count
            if pieces[0][0] >= regular:
                self._warn_oversized(t, pieces[0][1], count)
            key = t.checkpoint_key
            for s, spec, value in pieces:
                slices = shards[s].get(key)
                if slices is None:
                    shards[s][key] = {spec: value}
                else:
                    slices[spec] = value
        return shards

    def _warn_oversized(self, t: ShardableTensor, spec: str, pieces: int) -> None:
        if t.tensor.ndim == 0:
            logger.warning(
                "Tensor %s is a %s scalar of size %s bytes and cannot be partitioned into a "
                "shard of max shard size %s bytes. It will be added as an individual shard that "
                "exceeds the max shard size.",
                t.checkpoint_key, t.dtype, t.tensor.nbytes, self.max_shard_size,
            )
        else:
            logger.warning(
                "Tensor %s's minimum slice (one element, e.g. %s) has size %s bytes and cannot "
                "be partitioned into a shard of max shard size %s bytes. Each of its %s "
                "elements will be added as an individual shard that exceeds the max shard size.",
                t.checkpoint_key, spec, t.tensor.itemsize, self.max_shard_size, pieces,
            )


class BinPackPolicy(_SizedPolicy):
    """First-fit-decreasing bin packing into shards of at most `max_shard_size` bytes.

    Tensors larger than the maximum are split first, into maximum-sized slabs along axis 0 when
    one row fits, else along the axis needing the fewest partitions, else (no single-axis slab
    fits) into rows of rows, recursively. Then the pieces, largest first (ties in input order), go
    each into the lowest-numbered shard with room. Within a shard entries keep input order.

    Guarantee: every shard holds at most `max_shard_size` bytes, except that a piece that cannot
    be split below the maximum (a scalar, or one element when the item size exceeds it) is alone
    in a shard of its own. Tensors not larger than the maximum are never split. The number of
    shards is never more than sequential fill (next fit) of the same pieces in the same
    (decreasing) order needs, and at most 11/9 of the optimum plus one (the FFD bound) for the
    given pieces. (Next fit in some other, lucky order can need fewer.)
    """

    name = "bin-pack"

    @property
    def description(self) -> str:
        return (
            "Bin-pack tensors first-fit-decreasing into shards of at most "
            f"{self.max_shard_size} bytes."
        )

    def _plan(self, ts: list[ShardableTensor]) -> Shards:
        if not ts:
            return []
        sizes = _nbytes(ts)
        plan = _split_large(ts, sizes, self.max_shard_size)
        order = np.argsort(-plan.sizes, kind="stable")
        ids = _packing.first_fit(plan.sizes, order, self.max_shard_size)
        return plan.build(ts, ids)


class BalancedPolicy(_PlanningPolicy):
    """Exactly `num_shards` shards of near-equal bytes (fewer only if there are fewer pieces).

    Tensors larger than ``target = ceil(total / num_shards)`` are split into pieces of at most
    `target` bytes (as in BinPackPolicy), so one large tensor cannot unbalance the shards. Then
    the pieces, largest first (ties in input order), go each onto the currently lightest shard
    (Graham's LPT rule; ties to the lowest shard). Within a shard entries keep input order.

    Guarantee: ``min(num_shards, pieces)`` shards, none empty, and the heaviest holds at most
    ``total / num_shards + largest piece`` bytes (it was the lightest when it got its last
    piece), so at most ``mean + max(target, item size)``: twice the mean at worst.
    """

    name = "balanced"

    def __init__(self, num_shards: int) -> None:
        if isinstance(num_shards, (bool, np.bool_)) or not isinstance(
            num_shards, (int, np.integer)
        ):
            raise PolicyError(
                f"num_shards must be an int, got {type(num_shards).__name__} {num_shards!r}"
            )
        if num_shards < 1:
            raise PolicyError(f"num_shards must be >= 1, got {num_shards}")
        self.num_shards = int(num_shards)

    @property
    def description(self) -> str:
        return f"Balance tensors over {self.num_shards} shards of near-equal size (LPT)."

    def get_config(self) -> dict[str, Any]:
        return {"num_shards": self.num_shards}

    def _plan(self, ts: list[ShardableTensor]) -> Shards:
        if not ts:
            return []
        sizes = _nbytes(ts)
        total = _sizes.checked_sum(sizes)
        target = max(1, -(-total // self.num_shards))
        plan = _split_large(ts, sizes, target)
        order = np.argsort(-plan.sizes, kind="stable")
        ids = _packing.lpt(plan.sizes, order, self.num_shards)
        return plan.build(ts, ids)


POLICIES: dict[str, type[ShardingCallback]] = {
    cls.name: cls
    for cls in (ShardByTaskPolicy, MaxShardSizePolicy, AllInOnePolicy, BinPackPolicy,
                BalancedPolicy)
}
"""The one registry of policies by short name (`get_policy`, ``shardkit plan --policy``); the
default policy, defined with `save`, registers itself as "default" (`register_policy`)."""


def register_policy(name: str, cls: type[ShardingCallback]) -> None:
    """Make `cls` (built from keyword arguments) known to `get_policy` as `name`."""
    POLICIES[name] = cls


def policy_names() -> list[str]:
    """The short names `get_policy` accepts, sorted."""
    return sorted(POLICIES)


def get_policy(name: str, **config: Any) -> ShardingCallback:
    """Build a built-in policy from its short name.

    Args:
        name: one of `policy_names()`, e.g. ``"bin-pack"``.
        **config: the policy's constructor arguments, e.g. ``max_shard_size="1GiB"``.
    Returns:
        The policy.
    Raises:
        PolicyError: an unknown name, or arguments the policy does not take.
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise PolicyError(f"unknown policy {name!r}; known: {', '.join(policy_names())}")
    try:
        return cls(**config)
    except TypeError as e:
        raise PolicyError(f"policy {name!r} cannot be built from {config!r}: {e}") from e


# ---------------------------------------------------------------------------------------------
# Helpers: sizes, regions, cutting views, splitting large tensors


def _nbytes(ts: list[ShardableTensor]) -> np.ndarray:
    return np.fromiter((t.nbytes for t in ts), dtype=np.int64, count=len(ts))


def _paired(ts: list[ShardableTensor]) -> set[int]:
    """The inputs of a packed dtype (float4_e2m1fn, two elements a byte): the policies plan
    them by `_planning_shape`, so that no piece holds an odd count of elements."""
    dtypes = {d for d in set(map(operator.attrgetter("dtype"), ts)) if packed_name(d)}
    return {i for i, t in enumerate(ts) if t.dtype in dtypes} if dtypes else set()


def _planning_shape(t: ShardableTensor) -> tuple[tuple[int, ...], int]:
    """The shape and item size a policy plans a packed tensor `t` by: pairs of elements along
    its last axis, one byte each (any box of pairs is a box of an even count of elements:
    `_elements` maps it back); one indivisible item of all its bytes (shape ``()``) when its
    last axis is odd: such a tensor is never split."""
    shape = t.tensor.shape
    if shape and shape[-1] % 2 == 0:
        return (*shape[:-1], shape[-1] // 2), 1
    return (), t.nbytes


def _elements(offsets: Sequence[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """A box of `_planning_shape`'s pairs as a box of elements: the last axis doubled."""
    return ([*offsets[:-1], 2 * offsets[-1]], [*lengths[:-1], 2 * lengths[-1]])


def _tensor_of(ts: list[ShardableTensor], e: Exception) -> str:
    m = re.match(r"item (\d+):", str(e))
    if m is None:
        return ""
    t = ts[int(m.group(1))]
    return f"(tensor {t.checkpoint_key!r}, slice spec {t.slice_spec!r})"


def _root(t: ShardableTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The full shape of the original tensor and the offsets of `t` within it."""
    shape = t.tensor.shape
    if t.slice_spec == "":
        return shape, (0,) * len(shape)
    try:
        region = parse_slice_spec(t.slice_spec)
    except SliceSpecError as e:
        raise PolicyError(f"tensor {t.checkpoint_key!r}: {e}") from e
    if region.lengths != tuple(shape):
        raise PolicyError(
            f"tensor {t.checkpoint_key!r}: slice spec {t.slice_spec!r} has shape "
            f"{list(region.lengths)}, but its array has shape {list(shape)}"
        )
    return region.full_shape, region.offsets


def _whole_spec(t: ShardableTensor) -> str:
    """TensorFlow's explicit spec for all of `t` (``"4 6 0,4:0,6"`` for a whole [4, 6] tensor)."""
    full, offsets = _root(t)
    return format_slice_spec(full, offsets, t.tensor.shape)


def _cut(t: ShardableTensor, offsets: Sequence[int], lengths: Sequence[int]) -> tuple[str, Any]:
    """The spec (within the full original tensor) and view of a region of `t` (offsets within t).

    Same text as format_slice_spec, built faster: this runs once per piece of every split.
    """
    if t.slice_spec == "":
        full, absolute = t.tensor.shape, offsets
    else:
        full, root = _root(t)
        absolute = [a + b for a, b in zip(root, offsets)]
    spec = _shape_prefix(full) + ":".join([f"{o},{n}" for o, n in zip(absolute, lengths)])
    view = t.tensor[tuple(map(slice, offsets, map(operator.add, offsets, lengths)))]
    return spec, view


@functools.lru_cache(maxsize=4096)
def _shape_prefix(full: tuple[int, ...]) -> str:
    return " ".join(map(str, full)) + " "


def _split_box(shape: tuple[int, ...], d: int, cap: int) -> list[tuple[list[int], list[int]]]:
    """Regions (offsets, lengths) tiling a tensor of `shape` and item size `d`, each <= `cap`
    bytes unless it is a single element larger than `cap`.

    Slabs along axis 0 when one row fits (contiguous views), else along the axis that needs the
    fewest partitions; when no single-axis slab fits, rows of thickness 1 off the first axis
    longer than 1, each split the same way.
    """
    out: list[tuple[list[int], list[int]]] = []

    def split(off: list[int], shp: list[int]) -> None:
        num = math.prod(shp)
        if num * d <= cap:
            out.append((off, shp))
            return
        best: tuple[float, int, int] = (math.inf, 0, 0)  # (parts, axis, thickness)
        for a, length in enumerate(shp):
            thick = cap // ((num // length) * d)
            if thick and -(-length // thick) < best[0]:
                best = (-(-length // thick), a, thick)
            if a == 0 and thick:
                break  # axis 0 fits: contiguous slabs win
        _, a, thick = best
        recurse = not thick  # no single-axis slab fits: rows of thickness 1, each split again
        if recurse:
            a = next((b for b, length in enumerate(shp) if length > 1), -1)
            if a < 0:
                out.append((off, shp))  # one element larger than cap: cannot be split
                return
            thick = 1
        for start in range(0, shp[a], thick):
            o, s = list(off), list(shp)
            o[a] += start
            s[a] = min(thick, shp[a] - start)
            if recurse:
                split(o, s)
            else:
                out.append((o, s))

    split([0] * len(shape), list(shape))
    return out


class _Plan:
    """The pieces to pack, in input order: `sizes[k]` is the size of piece k. A tensor in
    `split` (tensor index -> [(spec, view), ...]) is there as its regions, any other one whole."""

    def __init__(self, sizes: np.ndarray, split: dict[int, list[tuple[str, Any]]]) -> None:
        self.sizes = sizes
        self.split = split

    def build(self, ts: list[ShardableTensor], ids: np.ndarray) -> Shards:
        """The shards for bin ids `ids` (one per piece); entries of a shard in input order."""
        shards: Shards = [{} for _ in range(int(ids.max()) + 1)] if ids.shape[0] else []
        ids_list = ids.tolist()
        start = p = 0  # next tensor, next piece
        for i in sorted(self.split):
            _add_whole(shards, ts[start:i], ids_list[p : p + i - start])
            p += i - start
            key = ts[i].checkpoint_key
            for spec, value in self.split[i]:
                _add(shards[ids_list[p]], key, spec, value)
                p += 1
            start = i + 1
        _add_whole(shards, ts[start:], ids_list[p:])
        return shards


def _add(shard: Shard, key: str, spec: str, value: Any) -> None:
    slices = shard.get(key)
    if slices is None:
        shard[key] = {spec: value}
    else:
        slices[spec] = value


def _add_whole(shards: Shards, ts: list[ShardableTensor], ids: list[int]) -> None:
    """Each tensor whole into shard ``ids[k]``: the hot loop of the packing policies."""
    for t, s in zip(ts, ids):
        shard = shards[s]
        slices = shard.get(t.checkpoint_key)
        if slices is None:
            shard[t.checkpoint_key] = {t.slice_spec: t.tensor}
        else:
            slices[t.slice_spec] = t.tensor


def _split_large(ts: list[ShardableTensor], sizes: np.ndarray, cap: int) -> _Plan:
    """Split every splittable tensor larger than `cap` bytes into regions of at most `cap`."""
    paired = _paired(ts)
    big = [int(i) for i in np.flatnonzero(sizes > cap)
           if ts[int(i)].tensor.ndim > 0 and (i not in paired or _planning_shape(ts[i])[0])]
    if not big:
        return _Plan(sizes, {})
    split: dict[int, list[tuple[str, Any]]] = {}
    piece_sizes: dict[int, list[int]] = {}
    for i in big:
        t = ts[i]
        shape, item = _planning_shape(t) if i in paired else (t.tensor.shape, t.tensor.itemsize)
        regions = _split_box(shape, item, cap)
        piece_sizes[i] = [math.prod(lengths) * item for _, lengths in regions]
        if i in paired:
            regions = [_elements(off, lengths) for off, lengths in regions]
        split[i] = [_cut(t, off, lengths) for off, lengths in regions]
    counts = np.ones(len(ts), dtype=np.int64)
    for i in big:
        counts[i] = len(split[i])
    starts = np.zeros(len(ts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    all_sizes = np.repeat(sizes, counts)
    for i in big:
        all_sizes[starts[i] : starts[i + 1]] = piece_sizes[i]
    return _Plan(all_sizes, split)
