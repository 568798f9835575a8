"""Many small tensors: the bulk (column-wise) paths of format, reader, writer, callback and the
default policy must behave exactly like the per-item checks they speed up."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import replace
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_format import index_document, tensor_view

import shardkit
from shardkit import format as fmt
from shardkit.errors import CorruptHeaderError, CorruptIndexError, ShardingValidationError
from shardkit.format import MANIFEST_FILE
from shardkit.io import save as api
from shardkit.sharding import callback
from shardkit.sharding.policies import MaxShardSizePolicy
from shardkit.sharding.tensors import columns_constructor, fast_constructor, shardable_tensors


def _state(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    dtypes = [np.float32, np.float16, np.int64, np.uint8, np.bool_, ml_dtypes.bfloat16]
    out = {}
    for i in range(n):
        shape = tuple(int(d) for d in rng.integers(0, 4, rng.integers(0, 3)))
        dt = np.dtype(dtypes[i % len(dtypes)])
        out[f"layer{i // 10}/p{i % 10}"] = (rng.random(shape) * 100).astype(dt)
    return out


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# --- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("max_shard_size", [None, 4096])
def test_many_small_tensors_round_trip(tmp_path, max_shard_size):
    state = _state(2000)
    policy = None if max_shard_size is None else api.DefaultShardingPolicy(
        threads=2, max_shard_size=max_shard_size)
    shardkit.save(tmp_path / "c", state, options=shardkit.CheckpointOptions(
        durable=False, experimental_sharding_callback=policy))
    loaded = shardkit.load(tmp_path / "c", verify=True)
    assert list(loaded) == list(state)
    for key, a in state.items():
        assert _same(loaded[key], a), key
        assert loaded[key].flags.writeable  # a view of a private map
    some = ["layer3/p1", "layer0/p0"]
    assert list(shardkit.load(tmp_path / "c", some)) == some


def test_round_trip_with_split_tensors_among_many_small(tmp_path):
    state = _state(300)
    state["big"] = np.arange(4000, dtype=np.float32).reshape(100, 40)
    state["wide"] = np.arange(3000, dtype=np.int16).reshape(3, 1000)
    with pytest.warns(shardkit.SplitTensorsWarning, match=r"stored \d+ tensors as slices"):
        shardkit.save(tmp_path / "c", state,
                      options=shardkit.CheckpointOptions(durable=False,
                                                         experimental_sharding_callback=MaxShardSizePolicy(2000)))
    view = tensor_view(index_document(tmp_path / "c"))
    assert len(view["big"]["slices"]) > 1  # really split
    loaded = shardkit.load(tmp_path / "c", verify=True)
    assert list(loaded) == list(state)
    for key, a in state.items():
        assert _same(loaded[key], a), key


# --- encoders are byte-identical to json.dumps ------------------------------------------------

NASTY = ["a", 'q"uote', "back\\slash", "nl\nand\ttab", "ü/ключ/🙂", "\x01ctl", "sp ace:1 2,3"]


def test_header_bytes_equal_json_dumps():
    entries = [(name, np.dtype("f4"), (2, i)) for i, name in enumerate(NASTY)]
    layouts = fmt.layout_entries(entries)
    header = fmt.encode_safetensors_header(layouts, {"note": 'x"y'})
    doc: dict[str, Any] = {"__metadata__": {"format": "pt", "shardkit": "2.2", "note": 'x"y'}}
    for e in layouts:
        doc[e.name] = {"dtype": e.dtype_name, "shape": list(e.shape),
                       "data_offsets": [e.begin, e.end]}
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    assert header[8:].rstrip(b" ") == text
    assert struct.unpack("<Q", header[:8])[0] == len(header) - 8


def _inputs(split: bool) -> tuple[str, list[fmt.ShardInfo], dict[str, fmt.TensorInfo], dict]:
    shards = [fmt.ShardInfo("shard-00000-of-00002.safetensors", 0, "raw", 10),
              fmt.ShardInfo("shard-00001-of-00002.safetensors", 1, "raw", 20)]
    tensors = {}
    for i, name in enumerate(NASTY):
        xxh3 = None if i % 2 else f"{i:016x}"
        tensors[name] = fmt.TensorInfo("F32", (i, 2), f"/job:w/task:{i % 2}", [
            fmt.SliceInfo("", i % 2, name, xxh3)
        ])
    tensors["scalar"] = fmt.TensorInfo("I8", (), "d", [fmt.SliceInfo("", 0, "scalar", None)])
    if split:
        tensors["s"] = fmt.TensorInfo("BF16", (4, 2), "d", [
            fmt.SliceInfo("4 2 0,2:0,2", 0, "s:4 2 0,2:0,2", None),
            fmt.SliceInfo("4 2 2,2:0,2", 1, "s:4 2 2,2:0,2", "0123456789abcdef"),
        ])
        # a key that looks like a slice of "s": same entry name, so only in another shard
        tensors["s:4 2 0,2:0,2"] = fmt.TensorInfo("U8", (3,), "/job:w/task:1", [
            fmt.SliceInfo("", 1, "s:4 2 0,2:0,2", None)
        ])
        tensors["full box"] = fmt.TensorInfo("U8", (3,), "d", [
            fmt.SliceInfo("3 0,3", 1, "full box:3 0,3", None)
        ])
    return "cb \"quoted\"", shards, tensors, {"n": [1, {"x": None}], "f": 0.5}


GENERATION = "0123456789abcdef0123456789abcdef"


def _of_generation(index: fmt.CheckpointIndex) -> fmt.CheckpointIndex:
    """`index` with its shards recording its generation, as a decoded index's do."""
    index.shards = [replace(s, generation=index.generation) for s in index.shards]
    return index


def _index(split: bool) -> fmt.CheckpointIndex:
    return _of_generation(fmt.CheckpointIndex.from_tensors(*_inputs(split),
                                                           generation=GENERATION))


def _reference_document(split: bool) -> dict[str, Any]:
    return _document_of(*_inputs(split))


def _document_of(callback: str, shards: list[fmt.ShardInfo], tensors: dict[str, fmt.TensorInfo],
                 user_metadata: dict, generation: str = GENERATION) -> dict[str, Any]:
    """The document of an index, built from the per-tensor objects by the rules of
    docs/FORMAT.md section 2 (from_tensors lists each shard's slices in tensor order)."""
    keys = list(tensors)
    devices = list(dict.fromkeys(t.device for t in tensors.values()))
    slices = sorted(((s.shard, row, s) for row, t in enumerate(tensors.values()) for s in t.slices),
                    key=lambda x: x[:2])
    return {
        "format": "shardkit",
        "format_version": fmt.FORMAT_VERSION,
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": {key: shards[t.slices[0].shard].file for key, t in tensors.items()
                       if len(t.slices) == 1 and t.slices[0].spec == ""},
        "shardkit": {
            "callback": callback,
            "generation": generation,
            "devices": devices,
            "shards": [{"file": s.file, "task": s.task, "codec": s.codec, "bytes": s.bytes}
                       for s in shards],
            "tensors": {
                "key": keys,
                "dtype": [t.dtype for t in tensors.values()],
                "shape": [list(t.shape) for t in tensors.values()],
                "device": [devices.index(t.device) for t in tensors.values()],
            },
            "slices": {
                "tensor": [row for _, row, _ in slices],
                "spec": [s.spec for _, _, s in slices],
                "shard": [s.shard for _, _, s in slices],
                "xxh3": [s.xxh3 for _, _, s in slices],
            },
            "user_metadata": user_metadata,
        },
    }


def _reference_index_bytes(split: bool) -> bytes:
    doc = _reference_document(split)
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


@pytest.mark.parametrize("split", [False, True])
def test_index_bytes_equal_json_dumps_and_round_trip(split):
    index = _index(split)
    data = fmt.encode_index(index)
    assert data == _reference_index_bytes(split)
    back = fmt.decode_index(data, "i.json")
    assert back == index
    assert fmt.encode_index(back) == data
    assert back.tensors == _inputs(split)[2]
    assert [back.tensor_info(k) for k in back.keys] == list(_inputs(split)[2].values())


_text = st.text(min_size=1, max_size=8)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=8,
)


@given(keys=st.lists(_text, min_size=0, max_size=6, unique=True),
       devices=st.lists(_text, min_size=1, max_size=3), callback=st.text(max_size=8),
       user_metadata=st.dictionaries(st.text(max_size=5), _json, max_size=3),
       data=st.data())
def test_index_bytes_equal_json_dumps_for_any_text(keys, devices, callback, user_metadata, data):
    shards = [fmt.ShardInfo("shard-00000-of-00002.safetensors", 0, "raw", 1),
              fmt.ShardInfo("shard-00001-of-00002.safetensors", 1, "zstd", 2)]
    tensors = {
        key: fmt.TensorInfo(
            data.draw(st.sampled_from(["F32", "U8", "BF16"])),
            tuple(data.draw(st.lists(st.integers(0, 3), max_size=2))),
            data.draw(st.sampled_from(devices)),
            [fmt.SliceInfo("", shard, key, data.draw(st.none() | st.just("0" * 16)))],
        )
        for key in keys for shard in (data.draw(st.integers(0, 1)),)
    }
    index = _of_generation(fmt.CheckpointIndex.from_tensors(callback, shards, tensors,
                                                            user_metadata, GENERATION))
    encoded = fmt.encode_index(index)
    doc = _document_of(callback, shards, tensors, user_metadata)
    assert encoded == json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
    back = fmt.decode_index(encoded, "i.json")
    assert back == index
    assert fmt.encode_index(back) == encoded


def test_index_rejects_nan_metadata():
    index = _index(False)
    index.user_metadata = {"x": math.nan}
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        fmt.encode_index(index)


# --- duplicate keys are found wherever they are -----------------------------------------------

_DOC = _reference_index_bytes(True).decode()


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ('{"format":"shardkit",', '{"format":"shardkit","format":"shardkit",', "format"),
        ('"shardkit":{"callback":', '"shardkit":{"callback":"x","callback":', "callback"),
        ('"weight_map":{"a":', '"weight_map":{"a":"x","a":', "a"),
        ('"metadata":{"total_size":', '"metadata":{"total_size":1,"total_size":', "total_size"),
        ('{"file":"shard-00000', '{"file":"x","file":"shard-00000', "file"),
        ('"bytes":20}', '"bytes":20,"bytes":20}', "bytes"),
        ('"tensors":{"key":', '"tensors":{"key":[],"key":', "key"),
        ('"device":[', '"device":[],"device":[', "device"),
        ('"slices":{"tensor":', '"slices":{"tensor":[],"tensor":', "tensor"),
        ('"xxh3":[', '"xxh3":[],"xxh3":[', "xxh3"),
        ('"user_metadata":{"n":', '"user_metadata":{"n":0,"n":', "n"),
        ('"user_metadata":{"n":[1,{"x":null}]', '"user_metadata":{"n":[1,{"x":null,"x":1}]', "x"),
        ('"shardkit":{', '"shardkit":{"devices":[],', "devices"),
    ],
)
def test_index_duplicate_keys_anywhere(old, new, key):
    assert old in _DOC
    data = _DOC.replace(old, new, 1).encode()
    with pytest.raises(CorruptIndexError, match=f"i.json: manifest has the key '{key}' twice"):
        fmt.decode_index(data, "i.json")


def _header_bytes(text: str) -> bytes:
    raw = text.encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('{"__metadata__":{"a":"1","a":"2"}}', "a"),
        ('{"__metadata__":{},"__metadata__":{}}', "__metadata__"),
        ('{"w":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}', "dtype"),
        ('{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"shape":[1]}}', "shape"),
    ],
)
def test_header_duplicate_keys_anywhere(text, key):
    buf = _header_bytes(text)
    with pytest.raises(CorruptHeaderError, match=f"s.bin: header has the key '{key}' twice"):
        fmt.decode_safetensors_header(buf + b"\0", len(buf) + 1, "s.bin")


def test_array_of_pairs_is_not_an_object():
    text = '{"w":[["dtype","U8"],["shape",[1]],["data_offsets",[0,1]]]}'
    buf = _header_bytes(text)
    with pytest.raises(CorruptHeaderError, match="entry 'w' must be a JSON object, found list"):
        fmt.decode_safetensors_header(buf + b"\0", len(buf) + 1, "s.bin")
    for where, match in [
        (("tensors",), "field shardkit.tensors must be dict, found list"),
        (("slices",), "field shardkit.slices must be dict, found list"),
        (("shards", 0), r"shardkit\.shards\[0\] must be a JSON object"),
    ]:
        doc = json.loads(_DOC)
        *parents, last = ("shardkit", *where)
        node = doc
        for p in parents:
            node = node[p]
        node[last] = [list(pair) for pair in node[last].items()]
        with pytest.raises(CorruptIndexError, match=match):
            fmt.decode_index(json.dumps(doc).encode(), "i.json")


def test_other_key_orders_take_the_checked_path():
    text = ('{"b":{"shape":[2],"data_offsets":[0,8],"dtype":"F32"},'
            '"a":{"data_offsets":[8,9],"dtype":"U8","shape":[]}}')
    buf = _header_bytes(text)
    entries, meta, start = fmt.decode_safetensors_header(buf + bytes(9), len(buf) + 9, "s.bin")
    assert meta == {}
    assert start == len(buf)
    assert [(e.name, e.dtype_name, e.shape, e.begin, e.end, e.order_index)
            for e in entries.values()] == [("b", "F32", (2,), 0, 8, 0), ("a", "U8", (), 8, 9, 1)]


# --- the bulk tiling check agrees with the per-entry one ---------------------------------------


def test_bulk_tiling_agrees_with_the_per_entry_check():
    rng = np.random.default_rng(7)
    for trial in range(400):
        n = int(rng.integers(0, 6))
        entries = {}
        pos = 0
        for i in range(n):
            size = int(rng.choice([0, 0, 1, 2, 3]))
            begin = pos + int(rng.choice([0, 0, 0, -1, 1])) if trial % 3 else pos
            begin = max(begin, 0)
            entries[f"e{i}"] = fmt.EntryLayout(f"e{i}", "U8", (size,), begin, begin + size, i)
            pos = begin + size
        order = list(entries)
        rng.shuffle(order)
        region = pos + int(rng.choice([0, 0, 1, -1]))
        header = {"__metadata__": {}}
        for name in order:
            e = entries[name]
            header[name] = {"dtype": "U8", "shape": [e.end - e.begin],
                            "data_offsets": [e.begin, e.end]}
        buf = _header_bytes(json.dumps(header))
        shuffled = {name: entries[name] for name in order}
        try:
            fmt._check_tiling(shuffled, max(region, 0), "s.bin")
            expected = None
        except CorruptHeaderError as e:
            expected = str(e)
        try:
            fmt.decode_safetensors_header(buf, len(buf) + max(region, 0), "s.bin")
            found = None
        except CorruptHeaderError as e:
            found = str(e)
        assert found == expected, (header, region)


# --- constructors, policy, callback ------------------------------------------------------------


def test_columns_constructor_equals_the_dataclass():
    make_many = columns_constructor(fmt.SliceInfo)
    made = make_many(["", "x"], [0, 1], ["a", "b"], [None, "0" * 16])
    assert made == [fmt.SliceInfo("", 0, "a", None), fmt.SliceInfo("x", 1, "b", "0" * 16)]
    assert make_many([], [], [], []) == []
    with pytest.raises(ValueError, match="need 4 columns of one length"):
        make_many([""], [0], ["a"], [])
    assert fast_constructor(fmt.SliceInfo)("", 0, "a", None) == made[0]


def _old_default_policy(policy: api.DefaultShardingPolicy, tensors: list[Any]) -> list[dict]:
    """The per-tensor loop the bulk DefaultShardingPolicy replaced (the oracle)."""
    sizes = [t.nbytes for t in tensors]
    total = sum(sizes)
    if total < api.SINGLE_SHARD_BELOW:
        count = 1
    else:
        count = max(policy.threads, math.ceil(total / policy.max_shard_size))
    count = max(1, min(count, len(sizes)))
    shards: list[dict] = []
    current: dict = {}
    filled = done = 0
    for t, size in zip(tensors, sizes):
        if current and (
            filled + size > policy.max_shard_size
            or (len(shards) < count - 1 and done + size / 2 > (len(shards) + 1) * total / count)
        ):
            shards.append(current)
            current, filled = {}, 0
        current.setdefault(t.checkpoint_key, {})[t.slice_spec] = t.tensor
        filled += size
        done += size
    if current:
        shards.append(current)
    return shards


@pytest.mark.parametrize(("threads", "max_size"), [(1, 10**9), (2, 10**9), (3, 700), (2, 1)])
def test_default_policy_cuts_like_the_per_tensor_loop(threads, max_size):
    rng = np.random.default_rng(threads)
    state = {f"t{i}": np.zeros(int(rng.integers(0, 300)), np.uint8) for i in range(200)}
    state["big"] = np.zeros(api.SINGLE_SHARD_BELOW, np.uint8)
    tensors = shardable_tensors(state)
    policy = api.DefaultShardingPolicy(threads=threads, max_shard_size=max_size)
    got, want = policy(tensors), _old_default_policy(policy, tensors)
    assert [list(s) for s in got] == [list(s) for s in want]
    for a, b in zip(got, want):
        for key in a:
            assert a[key].keys() == b[key].keys() == {""}
            assert a[key][""] is b[key][""]


def test_shards_of_the_given_arrays_are_accepted_as_they_are():
    tensors = shardable_tensors({f"k{i}": np.full(3, i, np.int32) for i in range(50)})
    shards = [{t.checkpoint_key: {"": t.tensor} for t in tensors[:20]},
              {}, {t.checkpoint_key: {"": t.tensor} for t in tensors[20:]}]
    callback.validate_shards(shards, tensors, "test")

    class Given(callback.ShardingCallback):
        description = "given"

        def __call__(self, ts):
            return shards

    out = callback.shard_tensors(Given(), tensors)
    assert [shard for _, shard in out] == [shards[0], shards[2]]


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        (lambda s, ts: s[1].update({"k0": {"": ts[0].tensor}}), "no tensor duplicated"),
        (lambda s, ts: s[0].pop("k3"), "no tensor removed"),
        (lambda s, ts: s[0].update({"k3": {"": ts[3].tensor.copy() + 1}}),
         "slices hold the original's data"),
        (lambda s, ts: s[0].update({"new": {"": ts[3].tensor}}), "no tensor added"),
    ],
)
def test_bulk_acceptance_still_rejects(change, rule):
    tensors = shardable_tensors({f"k{i}": np.full(3, i, np.int32) for i in range(10)})
    shards = [{t.checkpoint_key: {"": t.tensor} for t in tensors[:5]},
              {t.checkpoint_key: {"": t.tensor} for t in tensors[5:]}]
    change(shards, tensors)
    with pytest.raises(ShardingValidationError, match=rule):
        callback.validate_shards(shards, tensors, "test")


def test_one_shard_from_two_tasks_is_rejected():
    tensors = shardable_tensors(
        {"a": np.zeros(2), "b": np.zeros(2)},
        device=lambda k: "/job:w/task:0" if k == "a" else "/job:w/task:1",
    )
    shards = [{t.checkpoint_key: {"": t.tensor} for t in tensors}]
    with pytest.raises(ShardingValidationError, match="all tensors of a shard from one task"):
        callback.validate_shards(shards, tensors, "test")
    callback.validate_shards([{"a": {"": tensors[0].tensor}}, {"b": {"": tensors[1].tensor}}],
                             tensors, "test")


def test_entries_not_aligned_to_their_item_size_load_correctly(tmp_path):
    """Another writer may put a 4-byte entry at an odd offset: served by a per-entry view."""
    a, b, c = np.arange(3, dtype=np.uint8), np.arange(4, dtype=np.float32), np.float32(7)
    layouts = [fmt.EntryLayout("u", "U8", (3,), 0, 3, 0),
               fmt.EntryLayout("f", "F32", (4,), 3, 19, 1),
               fmt.EntryLayout("s", "F32", (), 19, 23, 2)]
    data = (fmt.encode_safetensors_header(layouts, {fmt.GENERATION_KEY: GENERATION})
            + a.tobytes() + b.tobytes() + c.tobytes())
    (tmp_path / "c").mkdir()
    name = fmt.shard_file_name(0, 1)
    (tmp_path / "c" / name).write_bytes(data)
    tensors = {e.name: fmt.TensorInfo(e.dtype_name, e.shape, "d", [
        fmt.SliceInfo("", 0, e.name, None)]) for e in layouts}
    shards = [fmt.ShardInfo(name, 0, "raw", len(data))]
    index = fmt.CheckpointIndex.from_tensors("x", shards, tensors, generation=GENERATION)
    (tmp_path / "c" / MANIFEST_FILE).write_bytes(fmt.encode_index(index))
    loaded = shardkit.load(tmp_path / "c")
    assert _same(loaded["u"], a) and _same(loaded["f"], b) and _same(loaded["s"], np.asarray(c))


def _saved(tmp_path, state):
    shardkit.save(tmp_path / "c", state, options=shardkit.CheckpointOptions(durable=False))
    return tmp_path / "c", json.loads((tmp_path / "c" / MANIFEST_FILE).read_text())


def test_header_the_writer_made_is_taken_without_parsing(tmp_path):
    from shardkit.io.reader import CheckpointReader

    state = {f"k{i}": np.full(i % 4, i, np.float32) for i in range(40)}
    state["i8"] = np.arange(3, dtype=np.int8)
    path, _ = _saved(tmp_path, state)
    with CheckpointReader(path) as r:
        sources = [r._shards.source(i) for i in range(len(r.index.shards))]
        assert all(src.matches_index for src in sources)
        for src in sources:  # the same result as parsing the header
            with open(src.path, "rb") as f:
                parsed = fmt.read_safetensors_header(
                    lambda a, b: os.pread(f.fileno(), b - a, a), os.path.getsize(src.path),
                    src.path)
            assert (src.entries, src.metadata, src.data_start) == parsed
            assert list(src.entries) == list(parsed[0])


def test_header_in_another_order_is_parsed_and_checked(tmp_path):
    from shardkit.io.reader import CheckpointReader

    state = {"a": np.arange(3, dtype=np.float32), "b": np.arange(2, dtype=np.float32)}
    path, index = _saved(tmp_path, state)
    # rewrite the shard with the entries in the other order (still a valid shard)
    name = index["shardkit"]["shards"][0]["file"]
    layouts = fmt.layout_entries([("b", np.dtype("f4"), (2,)), ("a", np.dtype("f4"), (3,))])
    meta = {fmt.GENERATION_KEY: index["shardkit"]["generation"]}  # still of this checkpoint
    data = (fmt.encode_safetensors_header(layouts, meta) + state["b"].tobytes()
            + state["a"].tobytes())
    (path / name).write_bytes(data)
    index["shardkit"]["shards"][0]["bytes"] = len(data)
    (path / MANIFEST_FILE).write_text(json.dumps(index))
    with CheckpointReader(path) as r:
        assert not r._shards.source(0).matches_index
        assert _same(r["a"], state["a"]) and _same(r["b"], state["b"])


def test_index_listing_a_shard_in_another_order_is_parsed_and_checked(tmp_path):
    """Readers must not rely on the writer's data-region order of a shard's slices."""
    from shardkit.io.reader import CheckpointReader

    state = {"a": np.arange(3, dtype=np.float32), "b": np.arange(2, dtype=np.float32),
             "c": np.arange(4, dtype=np.uint8)}
    path, index = _saved(tmp_path, state)
    slices = index["shardkit"]["slices"]
    assert slices["tensor"] == [0, 1, 2]
    for column in slices.values():
        column[0], column[1] = column[1], column[0]
    (path / MANIFEST_FILE).write_text(json.dumps(index))
    with CheckpointReader(path) as r:
        assert not r._shards.source(0).matches_index
        assert all(_same(r[k], a) for k, a in state.items())
        assert r.verify() == 3


def test_expected_header_with_uncovered_bytes_is_rejected(tmp_path):
    path, index = _saved(tmp_path, {"a": np.arange(3, dtype=np.float32)})
    name = index["shardkit"]["shards"][0]["file"]
    with open(path / name, "ab") as f:
        f.write(b"\0" * 8)
    index["shardkit"]["shards"][0]["bytes"] += 8
    (path / MANIFEST_FILE).write_text(json.dumps(index))
    with pytest.raises(CorruptHeaderError, match="8 bytes after the last entry are not covered"):
        shardkit.load(path)


def test_header_disagreeing_with_the_index_is_rejected(tmp_path):
    path, index = _saved(tmp_path, {"a": np.arange(4, dtype=np.float32)})
    index["shardkit"]["tensors"]["shape"][0] = [2, 2]
    (path / MANIFEST_FILE).write_text(json.dumps(index))
    with pytest.raises(CorruptHeaderError, match=r"does not match model\.safetensors\.index\.json: "
                       r"expected dtype F32 shape \[2, 2\], the shard has dtype F32 shape \[4\]"):
        shardkit.load(path)
