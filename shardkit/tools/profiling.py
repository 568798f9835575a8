"""Compare sharding policies on one state: shard count, shard sizes, imbalance, planning time.

Planning reads only shapes, dtypes and views, so states from `shardkit.tools.models` with untouched
memory profile exactly like real ones.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..optional import require
from ..sharding.callback import ShardingCallback, shard_tensors
from ..sharding.tensors import ShardableTensor, shardable_tensors
from ..values.dtypes import stored_nbytes

__all__ = ["PolicyProfile", "format_table", "human_size", "plot_shard_sizes", "profile"]


@dataclass(frozen=True)
class PolicyProfile:
    """What one policy made of one state. Sizes are tensor data bytes (no file headers)."""

    name: str
    description: str
    shard_bytes: tuple[int, ...]
    """Data bytes of each shard, in shard order (all tasks)."""
    num_tensors: int
    """Tensors given to the policy."""
    num_split: int
    """Tensors the policy cut into more slices than it was given."""
    plan_seconds: float
    """Time of the callback calls plus validation."""
    max_shard_size: int | None = None
    """The policy's size limit per shard (its ``max_shard_size``), if it has one."""

    @property
    def num_shards(self) -> int:
        """The number of shards."""
        return len(self.shard_bytes)

    @property
    def total_bytes(self) -> int:
        """The data bytes of all shards."""
        return sum(self.shard_bytes)

    @property
    def min_bytes(self) -> int:
        """The smallest shard's data bytes (0 for none)."""
        return min(self.shard_bytes, default=0)

    @property
    def median_bytes(self) -> float:
        """The median shard's data bytes (0.0 for none)."""
        return statistics.median(self.shard_bytes) if self.shard_bytes else 0.0

    @property
    def max_bytes(self) -> int:
        """The largest shard's data bytes (0 for none)."""
        return max(self.shard_bytes, default=0)

    @property
    def imbalance(self) -> float:
        """Largest shard over the mean shard: 1.0 is perfectly even (and for no data at all)."""
        total = self.total_bytes
        return self.max_bytes * self.num_shards / total if total else 1.0


Policies = Sequence[ShardingCallback] | Mapping[str, ShardingCallback]


def profile(
    state: Mapping[str, Any] | Sequence[ShardableTensor], policies: Policies
) -> list[PolicyProfile]:
    """Run every policy on `state` and measure it.

    The ShardableTensors are built once, outside the timing; each policy's time covers its
    calls (one per device task) and the validation of its shards.

    Args:
        state: a nested state, or ready ShardableTensors.
        policies: callbacks (named by their ``name`` attribute or class name), or a mapping
            name -> callback.
    Returns:
        One `PolicyProfile` per policy, in order.
    Raises:
        ShardingValidationError: a policy broke the callback contract.
        InvalidKeyError, UnsupportedDTypeError: `state` cannot be saved (as `shardkit.save`).
    """
    if isinstance(state, Mapping):
        tensors = shardable_tensors(state)
    else:
        tensors = list(state)
    named = (
        list(policies.items())
        if isinstance(policies, Mapping)
        else [(_policy_name(p), p) for p in policies]
    )
    given = Counter(t.checkpoint_key for t in tensors)
    out = []
    for name, callback in named:
        start = time.perf_counter()
        task_shards = shard_tensors(callback, tensors)
        seconds = time.perf_counter() - start
        sizes = [sum(stored_nbytes(a) for slices in shard.values() for a in slices.values())
                 for _, shard in task_shards]
        returned: Counter[str] = Counter()
        for _, shard in task_shards:
            returned.update({key: len(slices) for key, slices in shard.items()})
        split = sum(1 for key, n in returned.items() if n > given[key])
        out.append(
            PolicyProfile(
                name=name,
                description=callback.description,
                shard_bytes=tuple(sizes),
                num_tensors=len(tensors),
                num_split=split,
                plan_seconds=seconds,
                max_shard_size=_limit(callback),
            )
        )
    return out


def _limit(callback: ShardingCallback) -> int | None:
    limit = getattr(callback, "max_shard_size", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def _policy_name(callback: ShardingCallback) -> str:
    name = getattr(callback, "name", None)
    return name if isinstance(name, str) and name else type(callback).__name__


def human_size(nbytes: float) -> str:
    """``"512 B"``, ``"1.5 KiB"``, ``"256.0 MiB"``: binary units, one decimal."""
    n = float(nbytes)
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


def plural(count: int, noun: str) -> str:
    """``"1 shard"``, ``"3 shards"``: a count and its noun, singular for one."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


_COLUMNS = ("policy", "shards", "min", "median", "max", "imbalance", "split", "total", "plan")


def format_table(profiles: Sequence[PolicyProfile]) -> str:
    """An aligned text table, one row per policy, followed by each policy's description."""
    rows = [
        (
            p.name,
            str(p.num_shards),
            human_size(p.min_bytes),
            human_size(p.median_bytes),
            human_size(p.max_bytes),
            f"{p.imbalance:.2f}",
            str(p.num_split),
            human_size(p.total_bytes),
            _seconds(p.plan_seconds),
        )
        for p in profiles
    ]
    widths = [max(len(r[i]) for r in [_COLUMNS, *rows]) for i in range(len(_COLUMNS))]

    def line(cells: Sequence[str]) -> str:
        # Name left-aligned, numbers right-aligned.
        parts = [cells[0].ljust(widths[0])]
        parts += [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join(parts).rstrip()

    lines = [line(_COLUMNS), line(["-" * w for w in widths])]
    lines += [line(r) for r in rows]
    if profiles:
        lines.append("")
        lines += [f"{p.name}: {p.description}" for p in profiles]
    return "\n".join(lines)


def plot_shard_sizes(
    profiles: Sequence[PolicyProfile], path: str | Path, *, title: str | None = None
) -> Any:
    """Write a PNG bar chart: one panel per policy, one bar per shard (MiB); return the Figure.

    All panels share one y-scale, so shard sizes compare across policies; shard numbers are
    integer ticks; a dashed line marks a policy's size limit when it is within the plotted
    range (a limit far above every shard, like the default policy's 5 GB, is named in the panel
    title instead). `title` heads the figure (e.g. the model's name).
    """
    require("matplotlib", "plotting shard sizes")
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, MaxNLocator
    # Figure without pyplot: no global state, no GUI backend; savefig renders with Agg.
    n = max(1, len(profiles))
    fig = Figure(figsize=(8.0, 1.0 + 2.2 * n + (0.4 if title else 0.0)), layout="constrained")
    axes = fig.subplots(n, 1, squeeze=False, sharey=True)[:, 0]
    if title:
        fig.suptitle(title)
    if not profiles:
        axes[0].text(0.5, 0.5, "no policies", ha="center", va="center")
        axes[0].set_axis_off()
    largest = max((p.max_bytes for p in profiles), default=0)
    # A limit up to twice the largest shard is drawn; beyond, it would flatten every bar.
    drawn = {
        p.name: p.max_shard_size
        for p in profiles
        if p.max_shard_size is not None and p.max_shard_size <= 2 * max(largest, 1)
    }
    top = max([largest, *drawn.values()]) / 2**20 * 1.08 or 1.0
    for ax, p in zip(axes, profiles):
        ax.bar(range(p.num_shards), [b / 2**20 for b in p.shard_bytes], width=0.8)
        limit = ""
        if p.name in drawn:
            ax.axhline(drawn[p.name] / 2**20, color="tab:red", linestyle="--", linewidth=1,
                       label=f"limit {human_size(drawn[p.name])}")
            ax.legend(loc="upper right", fontsize=8)
        elif p.max_shard_size is not None:
            limit = f", limit {human_size(p.max_shard_size)} (off scale)"
        ax.set_title(
            f"{p.name}: {plural(p.num_shards, 'shard')}, "
            f"max {human_size(p.max_bytes)}, imbalance {p.imbalance:.2f}{limit}",
            fontsize=9,
        )
        ax.set_ylabel("MiB")
        ax.set_ylim(0, top)
        # Integer shard numbers: every shard up to 12, else integer steps.
        ax.xaxis.set_major_locator(
            FixedLocator(range(p.num_shards)) if p.num_shards <= 12
            else MaxNLocator(integer=True)
        )
        ax.set_xlim(-0.6, max(p.num_shards, 1) - 0.4)
    axes[-1].set_xlabel("shard")
    fig.savefig(path, format="png", dpi=100)
    return fig
