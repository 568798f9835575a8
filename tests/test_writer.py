"""save(): shard files byte for byte, through shardkit's reader and through safetensors itself."""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import struct
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import xxhash
from safetensors import safe_open
from test_format import index_document, tensor_view

from shardkit import format as fmt
from shardkit.errors import CheckpointExistsError, ShardingValidationError, SplitTensorsWarning
from shardkit.format import MANIFEST_FILE
from shardkit.io import save as api
from shardkit.io import writer
from shardkit.io.options import CheckpointOptions
from shardkit.io.reader import load
from shardkit.sharding.callback import ShardingCallback
from shardkit.storage import native
from shardkit.values.dtypes import PACKED, SAFETENSORS_NAMES, numpy_dtype
from shardkit.values.slices import format_slice_spec

SAFETENSORS_NUMPY = {n for n in SAFETENSORS_NAMES if not n.startswith("F8_")}


def _random(rng: np.random.Generator, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(rng.bytes(n), dtype=np.uint8).view(dtype).reshape(shape).copy()


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Byte-for-byte (NaN payloads included), same dtype and shape."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    )


def _raw_entries(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Parse a safetensors file by hand: entry -> (dtype, shape, bytes)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert (8 + n) % 8 == 0
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__")
    body = data[8 + n :]
    spans = sorted(e["data_offsets"] for e in header.values())
    pos = 0
    for begin, end in spans:  # contiguous, no holes, covering the region exactly
        assert begin == pos
        pos = end
    assert pos == len(body)
    return {k: (e["dtype"], e["shape"], body[slice(*e["data_offsets"])]) for k, e in header.items()}


def _check_checkpoint(path: Path, flat: dict[str, np.ndarray]) -> dict:
    """Every tensor round-trips through shardkit's reader (verified) and through safetensors."""
    index = index_document(path)
    loaded = load(path, verify=True)
    assert list(loaded) == list(flat)
    for key, value in flat.items():
        assert _same(loaded[key], value), key
    tensors = tensor_view(index)
    assert list(tensors) == list(flat)
    assert index["weight_map"] == {
        key: index["shardkit"]["shards"][t["slices"][0]["shard"]]["file"]
        for key, t in tensors.items() if [s["spec"] for s in t["slices"]] == [""]}
    for shard_no, shard in enumerate(index["shardkit"]["shards"]):
        file = path / shard["file"]
        assert shard["bytes"] == file.stat().st_size
        assert shard["codec"] == "raw"
        raw = _raw_entries(file)
        # the index lists a shard's slices in data-region order (the header's layout order)
        in_index = [name for shard, name in _composed_entries(index) if shard == shard_no]
        assert in_index == _data_region_order(file)
        with safe_open(str(file), framework="np") as f:
            # HuggingFace's "pt", the format version and the checkpoint's generation (the
            # manifest's) in every shard (format 2.2)
            assert f.metadata() == {"format": "pt", "shardkit": "2.2",
                                    "generation": index["shardkit"]["generation"]}
            assert sorted(f.keys()) == sorted(raw)
            by_entry = {s["entry"]: (key, s) for key, t in tensors.items()
                        for s in t["slices"] if s["shard"] == shard_no}
            for entry, (dtype_name, shape, data) in raw.items():
                key, slice_info = by_entry[entry]  # entry names are composed, never parsed
                info, spec = tensors[key], slice_info["spec"]
                assert slice_info["xxh3"] == xxhash.xxh3_64_hexdigest(data)
                original = flat[key]
                if spec:
                    region = tuple(
                        slice(int(o), int(o) + int(n))
                        for o, n in (r.split(",") for r in spec.split(" ")[-1].split(":"))
                    )
                    original = original[region]
                assert _same(np.frombuffer(data, numpy_dtype(dtype_name)).reshape(shape),
                             original)
                sl = f.get_slice(entry)
                assert (sl.get_dtype(), sl.get_shape()) == (info["dtype"], list(original.shape))
                if dtype_name in SAFETENSORS_NUMPY:
                    assert _same(f.get_tensor(entry), original), entry
    return index


def _composed_entries(index: dict) -> list[tuple[int, str]]:
    """(shard, entry name) of every slice, in the order the manifest lists them."""
    keys = index["shardkit"]["tensors"]["key"]
    s = index["shardkit"]["slices"]
    return [(shard, keys[row] if spec == "" else f"{keys[row]}:{spec}")
            for row, spec, shard in zip(s["tensor"], s["spec"], s["shard"], strict=True)]


def _data_region_order(path: Path) -> list[str]:
    """The entry names of a raw shard, sorted by position in the data region (stable for empty
    entries: header order)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__")
    assert list(header) == sorted(header, key=lambda k: header[k]["data_offsets"])
    return list(header)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def test_every_dtype_and_odd_shape_round_trips(tmp_path, rng):
    flat = {}
    # every name safetensors knows, as _check_checkpoint opens each shard with it: it refuses a
    # whole shard holding C128, shardkit's own name (docs/FORMAT.md section 3.2), which
    # tests/test_dtypes_wide.py round-trips through shardkit's reader; and not F4, whose
    # entries are not its arrays' bytes (packed two a byte): tests/test_dtypes_float4.py
    for name in [n for n in SAFETENSORS_NAMES if n != "C128" and n not in PACKED]:
        dt = numpy_dtype(name)
        flat[f"{name}/matrix"] = _random(rng, dt, (3, 5))
        flat[f"{name}/scalar"] = _random(rng, dt, ())
        flat[f"{name}/empty"] = _random(rng, dt, (0, 4))
    base = _random(rng, np.dtype(np.float32), (6, 8))
    flat["layout/strided"] = base[::2, 1::3]
    flat["layout/fortran"] = np.asfortranarray(_random(rng, np.dtype(np.int32), (4, 7)))
    flat["layout/transposed_bf16"] = _random(rng, np.dtype(ml_dtypes.bfloat16), (5, 3)).T
    flat["layout/negative_stride"] = _random(rng, np.dtype(np.int16), (9,))[::-1]
    state: dict = {}
    for key, value in flat.items():
        group, leaf = key.split("/")
        state.setdefault(group, {})[leaf] = value
    info = api.save(tmp_path / "ckpt", state, options=CheckpointOptions(durable=False))
    assert info.files == ("model-00001-of-00001.safetensors", MANIFEST_FILE)
    assert info.bytes == sum((tmp_path / "ckpt" / f).stat().st_size for f in info.files)
    assert info.seconds > 0
    _check_checkpoint(tmp_path / "ckpt", flat)


def test_index_records_order_devices_metadata_and_callback(tmp_path, rng):
    flat = {"z": _random(rng, np.dtype(np.float32), (4,)),
            "a": _random(rng, np.dtype(np.int8), (3,))}
    api.save(tmp_path / "ckpt", flat, metadata={"step": 7, "tags": ["x"]},
             options=CheckpointOptions(durable=False))
    index = index_document(tmp_path / "ckpt")
    assert index["format"] == "shardkit" and index["format_version"] == "2.2"
    assert re.fullmatch(r"[0-9a-f]{32}", index["shardkit"]["generation"])
    assert index["metadata"] == {"total_size": 19}
    assert index["weight_map"] == {"z": "model-00001-of-00001.safetensors",
                                   "a": "model-00001-of-00001.safetensors"}
    assert list(index["weight_map"]) == ["z", "a"]
    sk = index["shardkit"]
    assert sk["tensors"]["key"] == ["z", "a"]
    assert sk["devices"] == ["/job:localhost/replica:0/task:0/device:CPU:0"]
    assert sk["tensors"]["device"] == [0, 0]
    assert sk["user_metadata"] == {"step": 7, "tags": ["x"]}
    assert sk["callback"] == api.DefaultShardingPolicy().description
    assert tensor_view(index)["z"]["device"] == "/job:localhost/replica:0/task:0/device:CPU:0"


def test_checksum_false_stores_null(tmp_path, rng):
    api.save(tmp_path / "ckpt", {"x": _random(rng, np.dtype(np.float64), (10,))},
             options=CheckpointOptions(checksum=False, durable=False))
    index = index_document(tmp_path / "ckpt")
    assert index["shardkit"]["slices"]["xxh3"] == [None]
    assert tensor_view(index)["x"]["slices"][0]["xxh3"] is None


class _SplitRows(ShardingCallback):
    """Splits every 2-d tensor into row blocks of `rows`, one shard per block (views)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    @property
    def description(self) -> str:
        return f"split rows by {self.rows}"

    def __call__(self, shardable_tensors):
        shards = []
        for t in shardable_tensors:
            if t.tensor.ndim != 2 or t.tensor.shape[0] == 0:
                shards.append({t.checkpoint_key: {"": t.tensor}})
                continue
            n, m = t.tensor.shape
            for start in range(0, n, self.rows):
                length = min(self.rows, n - start)
                spec = format_slice_spec((n, m), (start, 0), (length, m))
                shards.append({t.checkpoint_key: {spec: t.tensor[start : start + length]}})
        return shards


def test_split_tensors_round_trip(tmp_path, rng):
    flat = {
        "w": _random(rng, np.dtype(np.float32), (10, 3)),
        "v": _random(rng, np.dtype(ml_dtypes.bfloat16), (5, 2)),
        "s": _random(rng, np.dtype(np.int64), ()),
    }
    with pytest.warns(SplitTensorsWarning, match=r"ckpt: the sharding callback stored 2 tensors "
                      r"as slices \(e\.g\. 'w'\); HuggingFace loaders .* cannot read"):
        api.save(tmp_path / "ckpt", flat,
                 options=CheckpointOptions(experimental_sharding_callback=_SplitRows(4),
                                           durable=False))
    index = _check_checkpoint(tmp_path / "ckpt", flat)
    w = tensor_view(index)["w"]
    assert [s["spec"] for s in w["slices"]] == ["10 3 0,4:0,3", "10 3 4,4:0,3", "10 3 8,2:0,3"]
    assert [s["entry"] for s in w["slices"]] == ["w:10 3 0,4:0,3", "w:10 3 4,4:0,3",
                                                 "w:10 3 8,2:0,3"]
    assert w["shape"] == [10, 3]
    assert "w" not in index["weight_map"] and "s" in index["weight_map"]
    assert len(index["shardkit"]["shards"]) == 3 + 2 + 1
    assert index["shardkit"]["callback"] == "split rows by 4"


def _policies():
    from shardkit.sharding import policies

    return [
        policies.ShardByTaskPolicy(),
        policies.MaxShardSizePolicy(700),
        policies.MaxShardSizePolicy("2KiB"),
        policies.AllInOnePolicy(),
        policies.BinPackPolicy(1500),
        policies.BalancedPolicy(3),
    ]


def test_every_builtin_policy_round_trips(tmp_path, rng):
    flat = {f"layer{i}/w": _random(rng, np.dtype(np.float32), (int(rng.integers(1, 20)), 13))
            for i in range(12)}
    flat["big"] = _random(rng, np.dtype(np.float16), (40, 30))  # larger than some max sizes
    flat["scalar"] = _random(rng, np.dtype(np.uint8), ())
    flat["empty"] = _random(rng, np.dtype(np.int32), (0,))
    for i, policy in enumerate(_policies()):
        path = tmp_path / f"ckpt{i}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            api.save(path, flat,
                     options=CheckpointOptions(experimental_sharding_callback=policy,
                                               durable=False))
        index = _check_checkpoint(path, flat)
        assert index["shardkit"]["callback"] == policy.description
        # the save warns, once, exactly when a tensor is missing from weight_map (split)
        split = [k for k, t in tensor_view(index).items()
                 if [s["spec"] for s in t["slices"]] != [""]]
        assert [type(w.message) for w in caught] == [SplitTensorsWarning] * bool(split), policy
        assert sorted(index["weight_map"]) == sorted(set(flat) - set(split))
        if split:
            assert f"stored {len(split)} tensor" in str(caught[0].message)


def test_many_small_tensors_leave_in_one_kernel_call(tmp_path, rng, monkeypatch):
    """3000 small tensors: the header, then one call of the native kernel (which batches them
    into vectored writes itself, see tests/test_write_kernel.py), then the manifest."""
    flat = {f"t{i:05d}": _random(rng, np.dtype(np.float32), (int(rng.integers(0, 40)),))
            for i in range(3000)}
    calls = []
    real_write_arrays = writer._gather.write_arrays
    monkeypatch.setattr(writer._gather, "write_arrays",
                        lambda fd, arrays, o, d=None: calls.append(len(arrays))
                        or real_write_arrays(fd, arrays, o, d))
    api.save(tmp_path / "ckpt", flat, options=CheckpointOptions(durable=False, threads=1))
    # the shard header (its pieces), the 3000 entries, then the manifest (its pieces)
    header = len(fmt.header_parts(["a"], ["F32"], [(1,)], [0], [4]))
    assert calls[:2] == [header, 3000] and len(calls) == 3
    _check_checkpoint(tmp_path / "ckpt", flat)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_output_does_not_depend_on_threads_buffers_or_regions(tmp_path, rng, monkeypatch, threads):
    flat = {f"k{i}": _random(rng, np.dtype(np.float32), (int(rng.integers(0, 3000)),))
            for i in range(60)}
    flat["nc"] = _random(rng, np.dtype(np.float64), (50, 40))[:, ::3]
    monkeypatch.setattr(fmt, "new_generation", lambda: "5" * 32)  # the same id for every save
    api.save(tmp_path / "ref", flat,
             options=CheckpointOptions(durable=False, threads=1,
                                       experimental_sharding_callback=_OneShard()))
    # Small groups and regions: many kernel calls, one shard cut into regions.
    monkeypatch.setattr(native, "WRITE_GROUP", 4096)
    monkeypatch.setattr(native, "MIN_REGION", 8000)
    for checksum in (True, False):
        path = tmp_path / f"t{threads}{checksum}"
        api.save(path, flat,
                 options=CheckpointOptions(durable=True, threads=threads, checksum=checksum,
                                           experimental_sharding_callback=_OneShard()))
        name = "model-00001-of-00001.safetensors"
        assert (path / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
        ref_index = (tmp_path / "ref" / MANIFEST_FILE).read_text()
        if checksum:
            assert (path / MANIFEST_FILE).read_text() == ref_index
    _check_checkpoint(tmp_path / f"t{threads}True", flat)


@pytest.mark.parametrize("durable", [True, False])
def test_durable_save_starts_writeback_group_by_group(tmp_path, rng, monkeypatch, durable):
    flat = {f"k{i}": _random(rng, np.dtype(np.float32), (int(rng.integers(500, 3000)),))
            for i in range(40)}
    monkeypatch.setattr(native, "WRITE_GROUP", 4096)
    started: list[tuple[int, int]] = []
    real = writer._gather.start_writeback
    monkeypatch.setattr(writer._gather, "start_writeback",
                        lambda fd, offset, n: started.append((offset, n)) or real(fd, offset, n))
    api.save(tmp_path / "c", flat,
             options=CheckpointOptions(durable=durable, threads=1,
                                       experimental_sharding_callback=_OneShard()))
    _check_checkpoint(tmp_path / "c", flat)
    if not durable:  # nothing will be fsynced: the OS writes back when it likes
        assert started == []
        return
    size = (tmp_path / "c" / "model-00001-of-00001.safetensors").stat().st_size
    data = sum(a.nbytes for a in flat.values())
    assert len(started) > 1  # group by group, as the data is written
    assert started[0][0] == size - data  # the data region, back to back, to its end
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(started))
    assert started[-1][0] + started[-1][1] == size


class _OneShard(ShardingCallback):
    @property
    def description(self) -> str:
        return "one shard"

    def __call__(self, shardable_tensors):
        return [{t.checkpoint_key: {t.slice_spec: t.tensor} for t in shardable_tensors}]


def test_regions_split_a_big_shard_between_threads(monkeypatch):
    monkeypatch.setattr(native, "MIN_REGION", 100)
    n = 10
    offsets = np.arange(n, dtype=np.int64) * 100 + 8
    plan = native._ShardPlan(Path("x"), "x", 0, [b"1234", b"5678"], [f"k{i}" for i in range(n)],
                             [""] * n, [np.zeros(0)] * n, offsets, offsets + 100, None, 1008,
                             np.zeros(n, np.uint64), None)
    regions = native._regions([plan], threads=2)
    assert [(r.start, r.stop) for r in regions] == [(0, 5), (5, 10)]
    assert [r.with_header for r in regions] == [True, False]
    assert plan.pending == 2
    assert plan.offsets[regions[1].start] == 508


def test_few_large_tensors_several_shards(tmp_path, rng):
    flat = {f"big{i}": _random(rng, np.dtype(np.float32), (300, 1000)) for i in range(4)}
    policy = api.DefaultShardingPolicy(threads=2)
    monkey = pytest.MonkeyPatch()
    monkey.setattr(api, "SINGLE_SHARD_BELOW", 0)
    try:
        api.save(tmp_path / "ckpt", flat,
                 options=CheckpointOptions(experimental_sharding_callback=policy, durable=False,
                                           threads=2))
    finally:
        monkey.undo()
    index = _check_checkpoint(tmp_path / "ckpt", flat)
    assert [s["file"] for s in index["shardkit"]["shards"]] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_default_policy_balances_and_caps(monkeypatch, rng):
    from shardkit.sharding.tensors import shardable_tensors

    sizes = [100, 100, 100, 100, 100, 500]
    state = {f"t{i}": np.zeros(n, np.uint8) for i, n in enumerate(sizes)}
    tensors = shardable_tensors(state)
    assert len(api.DefaultShardingPolicy(threads=4)(tensors)) == 1  # small state: one shard
    monkeypatch.setattr(api, "SINGLE_SHARD_BELOW", 0)
    shards = api.DefaultShardingPolicy(threads=2)(tensors)
    assert [list(s) for s in shards] == [["t0", "t1", "t2", "t3", "t4"], ["t5"]]
    shards = api.DefaultShardingPolicy(threads=1, max_shard_size=250)(tensors)
    assert [list(s) for s in shards] == [["t0", "t1"], ["t2", "t3"], ["t4"], ["t5"]]
    assert all(s[k][""] is state[k] for s in shards for k in s)  # no copies
    with pytest.raises(ValueError, match="max_shard_size must be positive"):
        api.DefaultShardingPolicy(max_shard_size=0)
    with pytest.raises(TypeError, match="threads must be a positive int"):
        api.DefaultShardingPolicy(threads=1.5)  # type: ignore[arg-type]


class _Dropper(ShardingCallback):
    @property
    def description(self) -> str:
        return "drops the last tensor"

    def __call__(self, shardable_tensors):
        return [{t.checkpoint_key: {"": t.tensor} for t in shardable_tensors[:-1]}]


def test_rule_breaking_callback_writes_nothing(tmp_path, rng, monkeypatch):
    first = {"a": _random(rng, np.dtype(np.float32), (4,))}
    api.save(tmp_path / "ckpt", first, options=CheckpointOptions(durable=False))
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    monkeypatch.setattr(os, "open", _forbidden_open(os.open, tmp_path))
    state = {"a": first["a"] + 1, "b": first["a"]}
    with pytest.raises(ShardingValidationError, match="drops the last tensor"):
        api.save(tmp_path / "ckpt", state, overwrite=True,
                 options=CheckpointOptions(experimental_sharding_callback=_Dropper()))
    with pytest.raises(ShardingValidationError, match="drops the last tensor"):
        api.save(tmp_path / "new", state,
                 options=CheckpointOptions(experimental_sharding_callback=_Dropper()))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before


def _forbidden_open(real_open, root: Path):
    def guarded(path, flags, *args, **kwargs):
        if str(path).startswith(str(root)) and flags & os.O_CREAT:
            raise AssertionError(f"a file was created before validation: {path}")
        return real_open(path, flags, *args, **kwargs)

    return guarded


def test_existing_path_without_overwrite(tmp_path, rng):
    api.save(tmp_path / "ckpt", {"a": np.zeros(2)}, options=CheckpointOptions(durable=False))
    with pytest.raises(CheckpointExistsError, match="already exists; pass overwrite=True"):
        api.save(tmp_path / "ckpt", {"a": np.ones(2)}, options=CheckpointOptions(durable=False))
    info = api.save(tmp_path / "ckpt", {"a": np.ones(2)},
                    options=CheckpointOptions(durable=False), overwrite=True)
    assert _same(load(info.path)["a"], np.ones(2))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.parametrize("fail_after", [0, 1, 5])
def test_disk_full_mid_save_keeps_earlier_checkpoint(tmp_path, rng, monkeypatch, fail_after):
    earlier = {"w": _random(rng, np.dtype(np.float32), (1000,))}
    api.save(tmp_path / "ckpt", earlier, options=CheckpointOptions(durable=False))
    monkeypatch.setattr(native, "WRITE_GROUP", 4096)
    real_pwritev, real_write_arrays = os.pwritev, writer._gather.write_arrays
    count = [0]

    def failing(real):
        def write(*args):
            count[0] += 1
            if count[0] > fail_after:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(*args)
        return write

    monkeypatch.setattr(os, "pwritev", failing(real_pwritev))
    monkeypatch.setattr(writer._gather, "write_arrays", failing(real_write_arrays))
    big = {f"w{i}": _random(rng, np.dtype(np.float32), (40000,)) for i in range(8)}
    with pytest.raises(OSError, match=r"writing shard file: No space left on device") as err:
        api.save(tmp_path / "ckpt", big, overwrite=True, options=CheckpointOptions(threads=2))
    assert err.value.errno == errno.ENOSPC
    assert re.search(r"model-0000\d-of-0000\d\.safetensors$", err.value.filename)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert _same(load(tmp_path / "ckpt", verify=True)["w"], earlier["w"])


def test_disk_too_small_fails_before_writing(tmp_path, rng, monkeypatch):
    """Reserving a shard's size reports a full disk before any data is written; the error
    names the shard file and the earlier checkpoint stays."""
    earlier = {"w": _random(rng, np.dtype(np.float32), (1000,))}
    api.save(tmp_path / "ckpt", earlier, options=CheckpointOptions(durable=False))
    written = []

    def full(fd, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer._gather, "preallocate", full)
    monkeypatch.setattr(writer._gather, "write_arrays", lambda *a: written.append(a))
    big = {f"w{i}": _random(rng, np.dtype(np.float32), (4000,)) for i in range(8)}
    with pytest.raises(OSError, match=r"reserving \d+ bytes for shard file: No space left") as err:
        api.save(tmp_path / "ckpt", big, overwrite=True)
    assert err.value.errno == errno.ENOSPC
    assert re.search(r"model-0000\d-of-0000\d\.safetensors$", err.value.filename)
    assert written == []
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert _same(load(tmp_path / "ckpt", verify=True)["w"], earlier["w"])


def test_shard_files_have_their_exact_size(tmp_path, rng):
    """Preallocation reserves exactly the bytes the shard holds: sizes match the index."""
    flat = {f"t{i}": _random(rng, np.dtype(np.float16), (int(rng.integers(0, 999)),))
            for i in range(300)}
    api.save(tmp_path / "ckpt", flat, options=CheckpointOptions(durable=False, threads=3))
    index = _check_checkpoint(tmp_path / "ckpt", flat)
    for shard in index["shardkit"]["shards"]:
        assert (tmp_path / "ckpt" / shard["file"]).stat().st_size == shard["bytes"]


@pytest.mark.parametrize("fallocate", [True, False], ids=["reserve", "no-fallocate"])
def test_a_real_write_failure_keeps_earlier_checkpoint(tmp_path, fallocate):
    """No mocked writes: a file-size limit makes the save fail with EFBIG, when it reserves a
    shard's space or, where the file system cannot reserve (simulated), inside the native
    kernel's writes part way through a shard. The error names the shard file, the earlier
    checkpoint stays, no temp directory is left."""
    script = textwrap.dedent(f"""
        import errno, resource, signal, sys
        import numpy as np
        import shardkit
        from shardkit import writer
        if not {fallocate}:
            writer._gather.preallocate = lambda fd, size: False
        path = sys.argv[1]
        shardkit.save(path, {{"w": np.arange(1000, dtype=np.float32)}}, durable=False)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, resource.RLIM_INFINITY))
        big = {{f"t{{i}}": np.full(3000, i, np.float32) for i in range(200)}}  # 2.4 MB
        try:
            shardkit.save(path, big, overwrite=True, threads=2)
        except OSError as e:
            doing = e.strerror.split(" shard file:")[0].split(" failed: ")[-1]
            print(e.errno == errno.EFBIG, doing, e.filename, sep="|")
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    efbig, doing, filename = proc.stdout.strip().split("|")
    assert efbig == "True"
    assert re.fullmatch(r"reserving \d+ bytes for" if fallocate else "writing", doing), doing
    assert re.search(r"model-0000\d-of-0000\d\.safetensors$", filename)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert _same(load(tmp_path / "ckpt", verify=True)["w"], np.arange(1000, dtype=np.float32))


def test_progress_bar(tmp_path, rng, capsys):
    api.save(tmp_path / "ckpt", {"a": _random(rng, np.dtype(np.float32), (1000,))},
             progress=True, options=CheckpointOptions(durable=False))
    err = capsys.readouterr().err
    assert "saving" in err and "100%" in err


def test_options_and_conflicts(tmp_path, rng):
    seen = []
    opts = CheckpointOptions(
        experimental_sharding_callback=_SplitRows(2),
        experimental_write_callbacks=[lambda path: seen.append(path), lambda: seen.append("x")],
        durable=False,
    )
    with pytest.warns(SplitTensorsWarning, match=r"stored 1 tensor as slices \(e\.g\. 'm'\)"):
        info = api.save(tmp_path / "ckpt", {"m": np.zeros((3, 2))}, options=opts)
    assert seen == [info.path, "x"]
    index = json.loads((tmp_path / "ckpt" / MANIFEST_FILE).read_text())
    assert index["shardkit"]["callback"] == "split rows by 2"
    # The keywords that moved into CheckpointOptions still work, with a DeprecationWarning
    # naming the spelling to use; one at its default defers to options; one that disagrees is
    # an error.
    moved = r"the save\(\) keywords durable are deprecated: pass options=CheckpointOptions\("
    with pytest.warns(DeprecationWarning, match=moved + r"durable=False\)"):
        api.save(tmp_path / "ok", {"m": np.zeros(2)}, durable=False,
                 options=CheckpointOptions(durable=False))
    with pytest.warns(DeprecationWarning, match=moved + r"durable=True\)"):
        api.save(tmp_path / "ok2", {"m": np.zeros(2)}, durable=True,
                 options=CheckpointOptions(durable=False))
    with pytest.warns(DeprecationWarning, match="sharding_callback, threads are deprecated"):
        info = api.save(tmp_path / "kw", {"m": np.zeros((3, 2))},
                        sharding_callback=_OneShard(), threads=1)
    assert load(info.path)["m"].shape == (3, 2)
    assert json.loads((tmp_path / "kw" / MANIFEST_FILE).read_text())["shardkit"]["callback"] \
        == _OneShard().description
    conflict = r"save\(\.\.\., durable=False\) conflicts with options\.durable=True"
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=conflict):
        api.save(tmp_path / "bad", {"m": np.zeros(2)}, durable=False, options=CheckpointOptions())
    with pytest.warns(DeprecationWarning), pytest.raises(
            ValueError, match=r"threads=2\) conflicts with options\.threads=1"):
        api.save(tmp_path / "bad", {"m": np.zeros(2)}, threads=2,
                 options=CheckpointOptions(threads=1))
    with pytest.warns(DeprecationWarning), pytest.raises(
            ValueError, match=r"sharding_callback=.*conflicts"):
        api.save(tmp_path / "bad", {"m": np.zeros(2)}, sharding_callback=_OneShard(),
                 options=CheckpointOptions(experimental_sharding_callback=_SplitRows(1)))
    with pytest.raises(TypeError, match="unexpected keyword argument 'thread'"):
        api.save(tmp_path / "bad", {"m": np.zeros(2)}, thread=2)
    with pytest.raises(ValueError, match="functional save\\(\\) is synchronous"):
        api.save(tmp_path / "bad", {"m": np.zeros(2)}, options=CheckpointOptions(
            enable_async=True))
    with pytest.raises(TypeError, match="options must be a CheckpointOptions, got dict"):
        api.save(tmp_path / "bad", {"m": np.zeros(2)}, options={"durable": False})
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"experimental_sharding_callback": "by-task"}, TypeError, "must be a sharding callback"),
        ({"durable": 1}, TypeError, "durable must be True or False, got 1"),
        ({"threads": 0}, ValueError, "threads must be at least 1, got 0"),
        ({"threads": True}, TypeError, "threads must be a positive int or None"),
        ({"compression": "lz4"}, ValueError, "compression must be None or one of 'zstd'"),
        ({"level": 3}, ValueError, "level=3 needs compression"),
        ({"compression": "zstd", "level": 99}, ValueError,
         r"zstd level must be in -7\.\.-1 or 1\.\.22"),
        ({"compression": "zstd", "level": 0}, ValueError, r"got 0"),
        ({"shuffle": False}, ValueError, "shuffle=False needs compression"),
        ({"compression": "zstd", "chunk_size": "3"}, ValueError,
         "chunk_size must be a multiple of 8"),
        ({"experimental_io_device": "/device:GPU:0"}, ValueError, "device type GPU cannot do I/O"),
        ({"experimental_write_callbacks": print}, TypeError, "a list of callables, not one"),
        ({"experimental_write_callbacks": [1]}, TypeError, r"\[0\] is not callable"),
        ({"experimental_write_callbacks": [lambda a, b: 0]}, TypeError, "takes 2 required"),
    ],
)
def test_bad_options(kwargs, error, message):
    with pytest.raises(error, match=message):
        CheckpointOptions(**kwargs)


def test_io_device_cpu_is_accepted():
    assert CheckpointOptions(experimental_io_device="/job:localhost/device:CPU:0")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"metadata": {"x": object()}}, TypeError, "metadata must be JSON-serialisable"),
        ({"metadata": {"x": float("nan")}}, TypeError, "no NaN"),
        ({"metadata": {1: 2}}, TypeError, "metadata keys must be str, got 1"),
        ({"metadata": [1]}, TypeError, "metadata must be a dict, got list"),
        ({"overwrite": "yes"}, TypeError, "overwrite must be True or False"),
    ],
)
def test_bad_save_arguments_write_nothing(tmp_path, kwargs, error, message):
    with pytest.raises(error, match=message):
        api.save(tmp_path / "ckpt", {"a": np.zeros(2)}, **kwargs)
    assert os.listdir(tmp_path) == []


def test_state_must_be_a_mapping(tmp_path):
    with pytest.raises(TypeError, match="state must be a mapping"):
        api.save(tmp_path / "ckpt", [np.zeros(2)])  # type: ignore[arg-type]


def test_torch_tensors_are_saved_without_conversion_by_the_caller(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is optional")
    state = {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "b": torch.ones(3)}
    api.save(tmp_path / "ckpt", state, options=CheckpointOptions(durable=False))
    out = load(tmp_path / "ckpt")
    assert out["w"].dtype == ml_dtypes.bfloat16
    assert out["w"].astype(np.float32).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert out["b"].tolist() == [1, 1, 1]


def test_empty_state_and_zero_size_only(tmp_path):
    info = api.save(tmp_path / "none", {}, options=CheckpointOptions(durable=False))
    assert info.files == (MANIFEST_FILE,)
    assert load(tmp_path / "none") == {}
    flat = {"a": np.zeros((0, 2)), "b": np.zeros((3, 0), dtype=np.int8)}
    api.save(tmp_path / "zero", flat, options=CheckpointOptions(durable=False))
    _check_checkpoint(tmp_path / "zero", flat)


def test_tasks_get_their_own_shards_numbered_globally(tmp_path, rng):
    from shardkit import format as fmt
    from shardkit.sharding.callback import shard_tensors
    from shardkit.sharding.tensors import shardable_tensors
    from shardkit.storage import commit

    flat = {f"t{i}": _random(rng, np.dtype(np.float32), (i + 1,)) for i in range(6)}
    tensors = shardable_tensors(
        flat, device=lambda key: f"/job:worker/task:{int(key[1:]) % 2}/device:CPU:0"
    )
    policy = api.DefaultShardingPolicy(threads=2)
    task_shards = shard_tensors(policy, tensors)
    with commit.stage(tmp_path / "ckpt", overwrite=False, durable=False) as staging:
        index, index_chunks = writer.write_shards(staging.path, writer.shard_columns(task_shards),
                                    writer.SavedTensors.of(tensors),
                                    CheckpointOptions(durable=False),
                                    description=policy.description, threads=2)
        assert b"".join(index_chunks) == fmt.encode_index(index)
        staging.commit(index_chunks)
    assert [(s.file, s.task) for s in index.shards] == [
        ("model-00001-of-00002.safetensors", 0), ("model-00002-of-00002.safetensors", 1)]
    assert index.tensors["t3"].device == "/job:worker/task:1/device:CPU:0"
    assert index.tensors["t3"].slices[0].shard == 1
    loaded = load(tmp_path / "ckpt", verify=True)
    assert all(_same(loaded[k], v) for k, v in flat.items())


def test_fsync_failure_keeps_earlier_checkpoint(tmp_path, rng, monkeypatch):
    earlier = {"w": _random(rng, np.dtype(np.float32), (100,))}
    api.save(tmp_path / "ckpt", earlier, options=CheckpointOptions(durable=False))

    def fsync(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match=r"syncing shard file: Input/output error") as err:
        api.save(tmp_path / "ckpt", {"w": earlier["w"] + 1}, overwrite=True,
                 options=CheckpointOptions(durable=True))
    assert err.value.errno == errno.EIO
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert _same(load(tmp_path / "ckpt", verify=True)["w"], earlier["w"])


def test_zstd_shards_round_trip(tmp_path, rng):
    flat = {
        "w": np.repeat(_random(rng, np.dtype(np.float32), (50, 1)), 40, axis=1),  # compressible
        "bf": _random(rng, np.dtype(ml_dtypes.bfloat16), (7, 3)),
        "nc": _random(rng, np.dtype(np.int64), (10, 10))[::3, 1::2],
        "s": _random(rng, np.dtype(np.uint8), ()),
        "e": _random(rng, np.dtype(np.float16), (0, 2)),
    }
    opts = CheckpointOptions(compression="zstd", level=3, durable=False,
                             experimental_sharding_callback=_SplitRows(20))
    with pytest.warns(SplitTensorsWarning, match="stored 3 tensors as slices"):
        info = api.save(tmp_path / "ckpt", flat, options=opts)
    assert all(f.endswith(".skz") for f in info.files[:-1])
    index = index_document(tmp_path / "ckpt")
    shards = index["shardkit"]["shards"]
    assert {s["codec"] for s in shards} == {"zstd"}
    assert [s["bytes"] for s in shards] == [(tmp_path / "ckpt" / s["file"]).stat().st_size
                                            for s in shards]
    assert sum(s["bytes"] for s in shards) < sum(a.nbytes for a in flat.values())
    loaded = load(tmp_path / "ckpt", verify=True)
    assert all(_same(loaded[k], v) for k, v in flat.items())
    w = tensor_view(index)["w"]["slices"]
    whole = np.ascontiguousarray(flat["w"])
    assert [s["xxh3"] for s in w] == [
        xxhash.xxh3_64_hexdigest(whole[i : i + 20].tobytes()) for i in (0, 20, 40)]


def test_compression_keywords_and_options_agree(tmp_path, rng):
    flat = {"w": np.zeros((64, 64), np.float32)}
    info = api.save(tmp_path / "kw", flat,
                    options=CheckpointOptions(compression="zstd", level=5, shuffle=False,
                                              chunk_size="64KiB", durable=False))
    assert info.files[0].endswith(".skz")
    assert _same(load(tmp_path / "kw", verify=True)["w"], flat["w"])
    opts = CheckpointOptions(compression="zstd", level=5, durable=False)
    with pytest.warns(DeprecationWarning, match="keywords compression, durable are deprecated"):
        api.save(tmp_path / "same", flat, compression="zstd", options=opts, durable=False)
    with pytest.warns(DeprecationWarning), pytest.raises(
            ValueError, match=r"level=7\) conflicts with options\.level=5"):
        api.save(tmp_path / "bad", flat, level=7, options=opts)
    with pytest.raises(ValueError, match="level=3 needs compression"):
        api.save(tmp_path / "bad", flat, options=CheckpointOptions(level=3))
    assert sorted(os.listdir(tmp_path)) == ["kw", "same"]


@pytest.mark.parametrize("tasks", [1, 2])
def test_default_policy_on_columns_writes_what_the_general_path_writes(tmp_path, rng,
                                                                       monkeypatch, tasks):
    """save() plans the default policy on columns (no ShardableTensor per tensor); the bytes
    must equal those of running the same policy through the callback API."""
    from shardkit.sharding import tensors as tensors_module

    dtypes = [np.float64, np.float32, np.int8, np.float16, ml_dtypes.bfloat16, np.bool_]
    flat = {f"g{i % 3}/t{i}": _random(rng, np.dtype(dtypes[i % len(dtypes)]), (i % 5, 3))
            for i in range(40)}
    flat["scalar"] = np.float32(2.5)
    flat["fortran"] = np.asfortranarray(_random(rng, np.dtype(np.float32), (3, 4)))
    device = (None if tasks == 1 else
              (lambda key: f"/job:worker/task:{len(key) % 2}/device:CPU:0"))
    columns = tensors_module.host_columns
    monkeypatch.setattr(api, "host_columns",
                        lambda state, _device=None, strings=None, aliases=None:
                        columns(state, device, strings, aliases))
    monkeypatch.setattr(api, "SINGLE_SHARD_BELOW", 0)  # several shards per task
    policy = api.DefaultShardingPolicy(threads=3)

    class Wrapped(ShardingCallback):  # the same policy, seen as a user callback
        description = policy.description

        def __call__(self, shardable_tensors):
            return policy(shardable_tensors)

    seen = []
    real = api._default_shards
    monkeypatch.setattr(api, "_default_shards", lambda *a: seen.append(1) or real(*a))
    monkeypatch.setattr(fmt, "new_generation", lambda: "5" * 32)  # the same id for both saves
    api.save(tmp_path / "fast", flat,
             options=CheckpointOptions(experimental_sharding_callback=policy, durable=False))
    assert seen  # the column path ran
    general = api.shardable_tensors
    monkeypatch.setattr(api, "shardable_tensors",
                        lambda state, strings=None, aliases=None:
                        general(state, device, strings, aliases))
    api.save(tmp_path / "slow", flat,
             options=CheckpointOptions(experimental_sharding_callback=Wrapped(), durable=False))
    fast, slow = sorted((tmp_path / "fast").iterdir()), sorted((tmp_path / "slow").iterdir())
    assert [f.name for f in fast] == [f.name for f in slow] and len(fast) > 2
    for a, b in zip(fast, slow):
        assert a.read_bytes() == b.read_bytes(), a.name
    loaded = load(tmp_path / "fast", verify=True)
    assert all(_same(loaded[k], np.asarray(v)) for k, v in flat.items())


def test_runs_with_non_contiguous_arrays_are_gathered(tmp_path, rng):
    """A run of small entries with a strided array in it cannot leave in one vectored write:
    it is gathered (the strided one copied to C order) and written from the buffer."""
    flat = {f"t{i}": _random(rng, np.dtype(np.float32), (i % 7 + 1, 3)) for i in range(200)}
    flat["f"] = np.asfortranarray(_random(rng, np.dtype(np.int16), (5, 4)))
    flat["s"] = _random(rng, np.dtype(np.float64), (40, 6))[::2, 1::2]
    api.save(tmp_path / "c", flat, options=CheckpointOptions(durable=False))
    loaded = load(tmp_path / "c", verify=True)
    assert all(_same(loaded[k], v) for k, v in flat.items())



@pytest.mark.parametrize("compression", [None, "zstd"])
def test_writer_keeps_only_a_few_shard_files_open(tmp_path, monkeypatch, compression):
    flat = {f"t{i:03d}": np.full(16, i, np.int32) for i in range(120)}
    policy = api.DefaultShardingPolicy(threads=2, max_shard_size=64)
    real_open, real_close = os.open, os.close
    shard_fds: set[int] = set()
    most = [0]

    def counting_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if os.path.basename(os.fspath(path)).startswith("model-") and flags & os.O_WRONLY:
            shard_fds.add(fd)
            most[0] = max(most[0], len(shard_fds))
        return fd

    def counting_close(fd):
        shard_fds.discard(fd)
        real_close(fd)

    monkeypatch.setattr(os, "open", counting_open)
    monkeypatch.setattr(os, "close", counting_close)
    api.save(tmp_path / "c", flat,
             options=CheckpointOptions(durable=True, experimental_sharding_callback=policy,
                                       threads=2, compression=compression))
    monkeypatch.undo()
    assert not shard_fds
    assert 1 <= most[0] <= 2, most[0]
    got = load(tmp_path / "c", verify=True)
    assert all((got[k] == v).all() for k, v in flat.items())


def test_metadata_nested_deeper_than_the_format_allows_is_refused_at_save(tmp_path):
    from shardkit.errors import InvalidMetadataError

    def deep(levels):
        value: object = 1
        for _ in range(levels):
            value = [value]
        return value

    # user_metadata is level 3 of the manifest (the top object is 1): 62 levels fit in 64
    api.save(tmp_path / "ok", {"a": np.zeros(2)}, metadata={"d": deep(61)},
             options=CheckpointOptions(durable=False))
    assert load(tmp_path / "ok") and json.loads(
        (tmp_path / "ok" / MANIFEST_FILE).read_text())["shardkit"]["user_metadata"]["d"] == deep(61)
    for levels in (62, 5000):
        with pytest.raises(InvalidMetadataError, match="metadata is nested more than 62 levels "
                           r"deep; the manifest allows 64 levels \(user_metadata is level 3\)"):
            api.save(tmp_path / f"bad{levels}", {"a": np.zeros(2)}, metadata={"d": deep(levels)})
        assert not (tmp_path / f"bad{levels}").exists()
