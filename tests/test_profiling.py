import sys
import time

import numpy as np
import pytest

from shardkit.errors import MissingDependencyError, ShardingValidationError
from shardkit.sharding.callback import ShardingCallback
from shardkit.sharding.tensors import shardable_tensors
from shardkit.tools.profiling import (
    PolicyProfile,
    format_table,
    human_size,
    plot_shard_sizes,
    profile,
)
from shardkit.values.slices import format_slice_spec

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _state():
    # 96 + 80 + 4 + 16 = 196 bytes of data
    return {
        "a": np.arange(24, dtype=np.float32).reshape(4, 6),
        "b": np.zeros(10, dtype=np.float64),
        "c": np.array(3, dtype=np.int32),
        "d": np.ones(8, dtype=np.float16),
    }


class AllInOne(ShardingCallback):
    name = "one"

    @property
    def description(self):
        return "everything in one shard"

    def __call__(self, shardable_tensors):
        shard = {}
        for t in shardable_tensors:
            shard.setdefault(t.checkpoint_key, {})[t.slice_spec] = t.tensor
        return [shard]


class OnePerTensor(ShardingCallback):
    @property
    def description(self):
        return "a shard per tensor"

    def __call__(self, shardable_tensors):
        return [{t.checkpoint_key: {t.slice_spec: t.tensor}} for t in shardable_tensors]


class SplitFirst(ShardingCallback):
    """Rows of the first tensor in two shards (halves along axis 0), the rest in a third."""

    @property
    def description(self):
        return "split the first tensor in halves"

    def __call__(self, shardable_tensors):
        first, *rest = shardable_tensors
        rows, cols = first.shape
        half = rows // 2
        top = {
            first.checkpoint_key: {
                format_slice_spec((rows, cols), (0, 0), (half, cols)): first.tensor[:half]
            }
        }
        bottom = {
            first.checkpoint_key: {
                format_slice_spec((rows, cols), (half, 0), (rows - half, cols)): first.tensor[half:]
            }
        }
        others = {t.checkpoint_key: {t.slice_spec: t.tensor} for t in rest}
        return [top, bottom, others]


class DropsOne(ShardingCallback):
    @property
    def description(self):
        return "forgets the last tensor"

    def __call__(self, shardable_tensors):
        return [{t.checkpoint_key: {t.slice_spec: t.tensor} for t in shardable_tensors[:-1]}]


class Slow(AllInOne):
    @property
    def description(self):
        return "sleeps 50 ms"

    def __call__(self, shardable_tensors):
        time.sleep(0.05)
        return super().__call__(shardable_tensors)


def test_profile_numbers_match_hand_computed_values():
    one, per_tensor, split = profile(_state(), [AllInOne(), OnePerTensor(), SplitFirst()])

    assert one.name == "one"  # the callback's name attribute
    assert one.description == "everything in one shard"
    assert one.shard_bytes == (196,)
    assert (one.num_shards, one.min_bytes, one.median_bytes, one.max_bytes) == (1, 196, 196, 196)
    assert one.imbalance == 1.0
    assert (one.num_tensors, one.num_split, one.total_bytes) == (4, 0, 196)

    assert per_tensor.name == "OnePerTensor"  # no name attribute: the class name
    assert per_tensor.shard_bytes == (96, 80, 4, 16)
    assert (per_tensor.min_bytes, per_tensor.median_bytes, per_tensor.max_bytes) == (4, 48, 96)
    assert per_tensor.imbalance == pytest.approx(96 / (196 / 4))
    assert per_tensor.num_split == 0

    assert split.shard_bytes == (48, 48, 100)
    assert split.median_bytes == 48
    assert split.imbalance == pytest.approx(100 / (196 / 3))
    assert split.num_split == 1
    assert split.total_bytes == 196

    for p in (one, per_tensor, split):
        assert p.plan_seconds > 0


def test_profile_takes_a_mapping_of_named_policies():
    profiles = profile(_state(), {"mine": OnePerTensor(), "all": AllInOne()})
    assert [p.name for p in profiles] == ["mine", "all"]
    assert [p.num_shards for p in profiles] == [4, 1]


def test_profile_calls_the_policy_once_per_task():
    tensors = shardable_tensors(
        _state(),
        device=lambda key: f"/job:w/replica:0/task:{1 if key in ('b', 'd') else 0}/device:CPU:0",
    )
    (p,) = profile(tensors, [AllInOne()])
    assert p.shard_bytes == (96 + 4, 80 + 16)  # task 0 first (order of first appearance)
    assert p.num_tensors == 4


def test_profile_times_the_callback():
    (p,) = profile(_state(), [Slow()])
    assert p.plan_seconds >= 0.05


def test_profile_validates_the_shards():
    with pytest.raises(ShardingValidationError, match="no tensor removed"):
        profile(_state(), [DropsOne()])


def test_profile_of_an_empty_state():
    (p,) = profile({}, [AllInOne()])
    assert p.shard_bytes == ()
    assert (p.num_shards, p.min_bytes, p.median_bytes, p.max_bytes, p.total_bytes) == (
        0,
        0,
        0,
        0,
        0,
    )
    assert p.imbalance == 1.0


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (256 * 2**20, "256.0 MiB"),
        (3 * 2**30 // 2, "1.5 GiB"),
        (5 * 2**40, "5.0 TiB"),
        (2**60, "1048576.0 TiB"),
        (48.5, "48 B"),
    ],
)
def test_human_size(nbytes, text):
    assert human_size(nbytes) == text


def test_format_table():
    profiles = profile(_state(), {"per-tensor": OnePerTensor(), "split": SplitFirst()})
    text = format_table(profiles)
    lines = text.splitlines()
    header, rule, row1, row2, blank, desc1, desc2 = lines
    assert header.split() == [
        "policy",
        "shards",
        "min",
        "median",
        "max",
        "imbalance",
        "split",
        "total",
        "plan",
    ]
    assert set(rule.replace(" ", "")) == {"-"}
    assert len({len(header), len(rule), len(row1), len(row2)}) == 1  # aligned
    assert row1.split()[:12] == [
        "per-tensor",
        "4",
        "4",
        "B",
        "48",
        "B",
        "96",
        "B",
        "1.96",
        "0",
        "196",
        "B",
    ]
    assert row1.endswith(("us", "ms", " s"))
    assert row2.split()[:12] == [
        "split",
        "3",
        "48",
        "B",
        "48",
        "B",
        "100",
        "B",
        "1.53",
        "1",
        "196",
        "B",
    ]
    assert blank == ""
    assert desc1 == "per-tensor: a shard per tensor"
    assert desc2 == "split: split the first tensor in halves"


def test_format_table_human_sizes_and_times():
    p = PolicyProfile("big", "d", (256 * 2**20, 2**30), 2, 0, 1.5)
    row = format_table([p]).splitlines()[2]
    assert "256.0 MiB" in row
    assert "640.0 MiB" in row  # median
    assert "1.0 GiB" in row
    assert "1.25 GiB" not in row and "1.2 GiB" in row  # total, one decimal
    assert row.endswith("1.50 s")
    fast = PolicyProfile("fast", "d", (1,), 1, 0, 0.0123)
    assert format_table([fast]).splitlines()[2].endswith("12.3 ms")


def test_format_table_of_nothing_is_just_the_header():
    assert format_table([]).splitlines()[0].split()[0] == "policy"
    assert len(format_table([]).splitlines()) == 2


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the [plot] extra) is not installed")
    profiles = profile(_state(), {"per-tensor": OnePerTensor(), "one": AllInOne()})
    path = tmp_path / "sizes.png"
    plot_shard_sizes(profiles, path)
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 1000
    # PNG IHDR: width and height (big-endian) at bytes 16..24; two panels make it tall.
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (800, 540)


def test_plot_of_no_profiles_still_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the [plot] extra) is not installed")
    path = tmp_path / "empty.png"
    plot_shard_sizes([], str(path))
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(MissingDependencyError, match=r'pip install "shardkit\[plot\]"'):
        plot_shard_sizes([], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_profile_built_in_policies_by_hand():
    from shardkit.sharding.policies import AllInOnePolicy, BinPackPolicy, MaxShardSizePolicy

    one, sequential, packed, capped = profile(
        _state(),
        [AllInOnePolicy(), MaxShardSizePolicy(100), BinPackPolicy(100), MaxShardSizePolicy(64)],
    )
    assert (one.name, one.shard_bytes, one.num_split) == ("all-in-one", (196,), 0)
    # Sequential fill up to 100 B: a (96) | b (80) + c (4) + d (16)
    assert (sequential.name, sequential.shard_bytes) == ("max-shard-size", (96, 100))
    assert sequential.num_split == 0
    # First-fit decreasing into 100 B bins: 96 + 4 | 80 + 16
    assert (packed.name, packed.shard_bytes, packed.num_split) == ("bin-pack", (100, 96), 0)
    # 196 B in shards of at most 64 B: a (96 B), b (80 B) and one more tensor get split
    assert capped.total_bytes == 196
    assert capped.max_bytes <= 64
    assert capped.num_shards == 4
    assert capped.num_split == 3
    assert capped.imbalance == pytest.approx(64 / 49)
