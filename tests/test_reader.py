"""shardkit.io.reader: CheckpointReader, load, restore_into on checkpoints written by the encoders
of shardkit.format."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
import weakref
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from test_format import row_slices, whole, write_checkpoint

from shardkit import format as fmt
from shardkit.errors import (
    IncompleteRestoreError,
    KeyNotFoundError,
    ReaderClosedError,
    RestoreMismatchError,
    SliceIndexError,
    SplitTensorsWarning,
    TruncatedShardError,
)
from shardkit.format import MANIFEST_FILE
from shardkit.io import reader as rd
from shardkit.io import restore
from shardkit.io import save as api
from shardkit.io.options import CheckpointOptions
from shardkit.io.reading import boxes as reading_boxes
from shardkit.io.reading.shards import ShardSet
from shardkit.io.restore import restore_into
from shardkit.sharding.tensors import flatten, unflatten
from shardkit.shards import files
from shardkit.shards import raw as sources
from shardkit.values import slicing
from shardkit.values.slices import format_slice_spec

RNG = np.random.default_rng(1234)


def _sample(dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return RNG.integers(0, 2, shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return RNG.integers(info.min, info.max, shape, dtype=dt, endpoint=True)
    return (RNG.standard_normal(shape) * 4).astype(dt)


ALL_DTYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64,
    ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
]


def _same(a: np.ndarray, b: np.ndarray) -> None:
    """Same dtype, shape and bytes (NaN-safe: compares the raw bytes)."""
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


@pytest.fixture(params=[True, False], ids=["mmap", "pread"])
def use_mmap(request):
    return request.param


# --- whole tensors -------------------------------------------------------------------------------


@pytest.fixture
def all_dtypes_ckpt(tmp_path):
    arrays = {}
    for dt in ALL_DTYPES:
        name = np.dtype(dt).name
        arrays[f"m/{name}"] = _sample(dt, (3, 5))
        arrays[f"scalar/{name}"] = _sample(dt, ())
        arrays[f"empty/{name}"] = _sample(dt, (0, 3))
    write_checkpoint(tmp_path / "c", whole(arrays, n_shards=3), user_metadata={"step": 7})
    return tmp_path / "c", arrays


def test_every_dtype_round_trips(all_dtypes_ckpt, use_mmap):
    path, arrays = all_dtypes_ckpt
    with rd.CheckpointReader(path, mmap=use_mmap) as r:
        assert r.keys() == list(arrays)
        assert len(r) == len(arrays)
        assert r.metadata == {"step": 7}
        for k, a in arrays.items():
            got = r[k]
            _same(got, a)
            assert got.flags.writeable  # a private map, or an owned array


def test_mmap_views_are_zero_copy_writable_copy_on_write_and_aligned(all_dtypes_ckpt):
    path, arrays = all_dtypes_ckpt
    before = _file_bytes(path)
    with rd.CheckpointReader(path) as r:
        for k in arrays:
            got = r.get(k)
            assert got.flags.writeable
            if got.size:
                assert not got.flags.owndata and got.base is not None
                assert got.ctypes.data % got.dtype.itemsize == 0, k
                got.flat[0] = got.flat[-1]  # private pages: the file does not change
    assert _file_bytes(path) == before


def test_pread_arrays_are_owned_and_writable(all_dtypes_ckpt):
    path, _ = all_dtypes_ckpt
    with rd.CheckpointReader(path, mmap=False) as r:
        a = r["m/float32"]
    a[0, 0] = 1.5  # owned memory, still usable after close
    assert a[0, 0] == 1.5


def _rewrite_shards(path: Path, change: str) -> None:
    """What another program may do to a shard: truncate it (``open(p, "wb")``, as
    safetensors.save_file and save_pretrained do when they rewrite a file) or overwrite its
    bytes in place."""
    for shard in path.iterdir():
        if shard.name == MANIFEST_FILE:
            continue
        if change == "truncate":
            open(shard, "wb").close()
        else:
            size = shard.stat().st_size
            with open(shard, "r+b") as f:
                f.seek(size // 2)
                f.write(b"\xa5" * (size - size // 2))


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("change", ["truncate", "rewrite"])
def test_owned_copies_survive_the_files_changing_under_them(tmp_path, compression, change):
    """`mmap=False` reads owned copies (docs/FORMAT.md section 9, "Files changed under a
    reader"): a shard truncated or rewritten in place afterwards changes nothing already read,
    verified or not, and reading every byte does not crash."""
    state = {"w": np.arange(4 * 4096, dtype=np.float32).reshape(4, 4096),
             "b": np.arange(7, dtype=np.int64)}
    api.save(tmp_path / "c", state,
             options=CheckpointOptions(compression=compression, durable=False))
    got = rd.load(tmp_path / "c", mmap=False, verify=True)
    with rd.CheckpointReader(tmp_path / "c", mmap=False) as r:
        part = r.get_slice("w", (slice(1, 3),))
    _rewrite_shards(tmp_path / "c", change)
    assert np.array_equal(got["w"], state["w"]) and np.array_equal(got["b"], state["b"])
    assert np.array_equal(part, state["w"][1:3])


def test_a_map_is_a_view_of_the_file(tmp_path):
    """What docs/FORMAT.md promises for mapped arrays (`mmap=True`, the default) when another
    program changes the file: an in-place rewrite changes the values of an array not yet
    written to, even one `verify=True` checked; a truncation makes reading a page of it raise
    SIGBUS (in a child process here)."""
    state = {"w": np.arange(4 * 4096, dtype=np.float32)}
    api.save(tmp_path / "c", state, options=CheckpointOptions(durable=False))
    got = rd.load(tmp_path / "c", verify=True)
    _rewrite_shards(tmp_path / "c", "rewrite")
    assert not np.array_equal(got["w"], state["w"])  # the view shows the file's new bytes
    api.save(tmp_path / "d", state, options=CheckpointOptions(durable=False))
    script = textwrap.dedent(f"""
        import numpy as np
        from shardkit import reader
        got = reader.load({str(tmp_path / "d")!r})
        shard = {str(tmp_path / "d" / fmt.shard_file_name(0, 1))!r}
        open(shard, "wb").close()
        print(float(np.sum(got["w"])))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert run.returncode == -signal.SIGBUS, run.stderr[-2000:]


def test_bf16_and_fp8_come_back_as_ml_dtypes(all_dtypes_ckpt):
    path, _ = all_dtypes_ckpt
    with rd.CheckpointReader(path) as r:
        assert r["m/bfloat16"].dtype == np.dtype(ml_dtypes.bfloat16)
        assert r["m/float8_e4m3fn"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
        assert r["m/float8_e5m2"].dtype == np.dtype(ml_dtypes.float8_e5m2)
        assert r["scalar/float64"].shape == ()


def test_info_and_contains(tmp_path):
    a = _sample(np.float32, (4, 6))
    write_checkpoint(tmp_path, row_slices("w", a, 2, [0, 1]) + whole({"b": _sample(np.int8, (2,))}))
    with rd.open_checkpoint(tmp_path) as r:
        assert "w" in r and "b" in r and "x" not in r and 3 not in r
        info = r.info("w")
        assert info.dtype == np.float32 and info.dtype_name == "F32"
        assert info.shape == (4, 6) and info.nbytes == 96 and info.is_split
        assert info.device == "/job:localhost/replica:0/task:0/device:CPU:0"
        assert [(s.spec, s.file, s.entry) for s in info.slices] == [
            ("4 6 0,2:0,6", "model-00001-of-00002.safetensors", "w:4 6 0,2:0,6"),
            ("4 6 2,2:0,6", "model-00002-of-00002.safetensors", "w:4 6 2,2:0,6"),
        ]
        assert not r.info("b").is_split
        assert isinstance(r.index, fmt.CheckpointIndex)
        assert list(r) == ["w", "b"]
        assert "2 tensors" in repr(r)


def test_shards_are_opened_lazily(tmp_path):
    write_checkpoint(tmp_path, whole({"a": np.ones(3), "b": np.zeros(2)}, n_shards=2))
    with rd.CheckpointReader(tmp_path) as r:
        assert r._shards.sources == {}
        r["b"]
        assert list(r._shards.sources) == [1]


# --- split tensors -------------------------------------------------------------------------------


def _split_ckpt(path, a, key="t"):
    """`a` stored as a 2x2 grid of blocks (rows split at 1, cols at 2) across 3 shards."""
    r0, c0 = 1, 2
    items = []
    for i, (ro, rl) in enumerate([(0, r0), (r0, a.shape[0] - r0)]):
        for j, (co, cl) in enumerate([(0, c0), (c0, a.shape[1] - c0)]):
            offsets = (ro, co, *([0] * (a.ndim - 2)))
            lengths = (rl, cl, *a.shape[2:])
            spec = format_slice_spec(a.shape, offsets, lengths)
            idx = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
            items.append((key, spec, (2 * i + j) % 3, a[idx]))
    write_checkpoint(path, items)


@pytest.mark.parametrize("dtype", [np.float32, np.int8, ml_dtypes.bfloat16, np.float64])
def test_split_tensor_is_assembled(tmp_path, dtype, use_mmap):
    a = _sample(dtype, (5, 7, 3))
    _split_ckpt(tmp_path, a)
    with rd.CheckpointReader(tmp_path, mmap=use_mmap) as r:
        got = r.get("t")
        _same(got, a)
        assert got.flags.writeable and got.flags.owndata


def test_row_split_across_shards_large_enough_for_parallel_reads(tmp_path, monkeypatch):
    # Small chunk size so the pool path and chunk splitting run on a small array.
    monkeypatch.setattr(files, "PARALLEL_MIN", 1024)
    monkeypatch.setattr(files, "PARALLEL_MIN_BUFFER", 1)
    monkeypatch.setattr(files, "READ_CHUNK", 1000)
    a = _sample(np.float64, (64, 33))
    b = _sample(np.int16, (10_001,))
    write_checkpoint(tmp_path, row_slices("a", a, 3, [0, 1, 2]) + whole({"b": b}))
    with rd.CheckpointReader(tmp_path, mmap=False) as r:
        _same(r["a"], a)
        _same(r["b"], b)
        _same(r.get_slice("a", np.s_[5:60:3, ::-2]), a[5:60:3, ::-2])
        assert r._shards._pool is not None
    assert r._shards._pool is None


INDEXES = [
    (), np.s_[...], np.s_[0], np.s_[-1], np.s_[1:4], np.s_[::-1], np.s_[4:0:-2], np.s_[:, 2],
    np.s_[:, 1:6:2], np.s_[..., 1], np.s_[2, ..., ::-1], np.s_[1:2, 2:3, 1:2], np.s_[3, 4, 2],
    np.s_[-2:, -5:-1], np.s_[None, 1], np.s_[:, None, ::3], np.s_[0:0], np.s_[:, 5:2],
    np.s_[np.int64(1), ::4], np.s_[100:], np.s_[:, :, -1], np.s_[::2, ::-3, ::-1],
]


@pytest.mark.parametrize("index", INDEXES, ids=[repr(i) for i in INDEXES])
def test_get_slice_matches_numpy(tmp_path, index, use_mmap):
    a = _sample(np.int32, (5, 7, 3))
    _split_ckpt(tmp_path / "split", a)
    write_checkpoint(tmp_path / "whole", whole({"t": a}))
    for path in ("split", "whole"):
        with rd.CheckpointReader(tmp_path / path, mmap=use_mmap) as r:
            _same(r.get_slice("t", index), a[index])


def test_get_slice_hypothesis(tmp_path_factory):
    hyp = pytest.importorskip("hypothesis", reason="hypothesis (test dependency) not installed")
    st = pytest.importorskip("hypothesis.strategies", reason="hypothesis not installed")
    a = _sample(np.uint16, (6, 5, 4))
    path = tmp_path_factory.mktemp("hyp")
    _split_ckpt(path, a)

    def axis_index(dim):
        return st.one_of(
            st.integers(-dim, dim - 1),
            st.builds(slice, st.none() | st.integers(-dim - 2, dim + 2),
                      st.none() | st.integers(-dim - 2, dim + 2),
                      st.none() | st.integers(-4, 4).filter(bool)),
        )

    gap_min = slicing._GAP_MIN

    @hyp.settings(max_examples=200, deadline=None)
    @hyp.given(st.tuples(axis_index(6), axis_index(5), axis_index(4)), st.booleans(),
               st.booleans())
    def check(index, use_mmap, skip_gaps):
        slicing._GAP_MIN = 0 if skip_gaps else gap_min
        try:
            with rd.CheckpointReader(path, mmap=use_mmap) as r:
                _same(r.get_slice("t", index), a[index])
        finally:
            slicing._GAP_MIN = gap_min

    check()


def test_get_slice_returns_views_only_within_one_raw_entry(tmp_path):
    a = _sample(np.float32, (4, 6))
    write_checkpoint(tmp_path, row_slices("w", a, 2, [0, 1]))
    with rd.CheckpointReader(tmp_path) as r:
        inside = r.get_slice("w", np.s_[2:4, 1::2])
        assert inside.flags.writeable and not inside.flags.owndata
        across = r.get_slice("w", np.s_[1:3])
        assert across.flags.writeable
        _same(inside, a[2:4, 1::2])
        _same(across, a[1:3])


def test_get_slice_reads_only_needed_bytes(tmp_path, monkeypatch):
    a = _sample(np.float64, (100, 50))
    write_checkpoint(tmp_path, row_slices("a", a, 4, [0, 1, 2, 3]))
    reads = []
    orig = sources.RawShard.read_tasks

    def spy(self, requests):
        reads.extend((entry.name, begin, end) for entry, begin, end, _ in requests)
        return orig(self, requests)

    monkeypatch.setattr(sources.RawShard, "read_tasks", spy)
    with rd.CheckpointReader(tmp_path, mmap=False) as r:
        _same(r.get_slice("a", np.s_[30:32, 10:12]), a[30:32, 10:12])
    # rows 30..31 lie in the second slice (rows 25..49); bytes of local rows 5..6, cols 10..11
    assert reads == [("a:100 50 25,25:0,50", (5 * 50 + 10) * 8, (6 * 50 + 11) * 8 + 8)]


def test_get_slice_skips_large_gaps_in_pread_mode(tmp_path, monkeypatch):
    a = _sample(np.int16, (40, 30, 20))
    write_checkpoint(tmp_path, row_slices("a", a, 2, [0, 1]))
    reads: list[int] = []
    orig = sources.RawShard.read_tasks

    def spy(self, requests):
        reads.extend(end - begin for _, begin, end, _ in requests)
        return orig(self, requests)

    monkeypatch.setattr(sources.RawShard, "read_tasks", spy)
    with rd.CheckpointReader(tmp_path, mmap=False) as r:
        _same(r.get_slice("a", np.s_[3:33:10, 5]), a[3:33:10, 5])
        # rows 3 and 13 are in the first stored slice (rows 0..19), row 23 in the second.
        # Under 1 MiB a span is read whole, gaps included: rows 3..13 of column 5.
        assert reads == [(10 * 30 * 20 + 20) * 2, 20 * 2]
        reads.clear()
        monkeypatch.setattr(slicing, "_GAP_MIN", 0)
        _same(r.get_slice("a", np.s_[3:33:10, 5]), a[3:33:10, 5])
        assert reads == [20 * 2] * 3  # one 20-element row per selected index
        reads.clear()
        _same(r.get_slice("a", np.s_[::13, ::-7, 3]), a[::13, ::-7, 3])
        assert reads == [2] * 20  # 4 rows x 5 columns, one element each
        monkeypatch.setattr(reading_boxes, "MAX_PIECES", 1)
        reads.clear()
        _same(r.get_slice("a", np.s_[3:33:10, 5]), a[3:33:10, 5])
        assert reads == [(10 * 30 * 20 + 20) * 2, 20 * 2]  # over budget: not split


@pytest.mark.parametrize("index", INDEXES, ids=[repr(i) for i in INDEXES])
def test_get_slice_with_gap_skipping_matches_numpy(tmp_path, monkeypatch, index):
    monkeypatch.setattr(slicing, "_GAP_MIN", 0)
    a = _sample(np.float32, (5, 7, 3))
    _split_ckpt(tmp_path, a)
    with rd.CheckpointReader(tmp_path, mmap=False) as r:
        _same(r.get_slice("t", index), a[index])


def test_get_slice_errors(tmp_path):
    write_checkpoint(tmp_path, whole({"t": np.zeros((3, 4))}))
    with rd.CheckpointReader(tmp_path) as r:
        with pytest.raises(SliceIndexError, match="'t': index 3 is out of bounds for axis 0"):
            r.get_slice("t", 3)
        with pytest.raises(SliceIndexError, match="'t': index -5 is out of bounds for axis 1"):
            r.get_slice("t", (0, -5))
        with pytest.raises(SliceIndexError, match="too many indices: 3 for a tensor of shape"):
            r.get_slice("t", (0, 0, 0))
        with pytest.raises(SliceIndexError, match="single ellipsis"):
            r.get_slice("t", (..., ...))
        with pytest.raises(SliceIndexError, match=r"basic indices only .* list"):
            r.get_slice("t", [0, 1])
        with pytest.raises(SliceIndexError, match=r"basic indices only .* bool"):
            r.get_slice("t", True)
        with pytest.raises(KeyNotFoundError, match="'u'"):
            r.get_slice("u", 0)


def test_scalar_and_empty_tensors(tmp_path, use_mmap):
    arrays = {"s": np.array(3.5, np.float32), "e": np.zeros((2, 0, 3), np.int16),
              "z": np.zeros(0, np.uint8)}
    write_checkpoint(tmp_path, whole(arrays))
    with rd.CheckpointReader(tmp_path, mmap=use_mmap) as r:
        for k, a in arrays.items():
            _same(r[k], a)
        _same(r.get_slice("s", ()), arrays["s"][()][...])
        _same(r.get_slice("s", ...), arrays["s"][...])
        _same(r.get_slice("e", np.s_[1]), arrays["e"][1])


def test_checkpoint_with_only_empty_tensors(tmp_path, use_mmap):
    # the data region of the shard is empty: nothing to map beyond the header
    write_checkpoint(tmp_path, whole({"e": np.zeros((0,), np.float32)}))
    with rd.CheckpointReader(tmp_path, mmap=use_mmap) as r:
        _same(r["e"], np.zeros((0,), np.float32))
        assert r.verify() == 1


def test_mmap_and_pread_give_identical_results(tmp_path):
    a = _sample(ml_dtypes.bfloat16, (9, 4))
    items = row_slices("a", a, 3, [0, 1, 0]) + whole({"b": _sample(np.uint32, (17,))}, 2)
    write_checkpoint(tmp_path, items)
    with rd.CheckpointReader(tmp_path) as m, rd.CheckpointReader(tmp_path, mmap=False) as p:
        for k in m.keys():
            _same(m[k], p[k])
            _same(m.get_slice(k, np.s_[1::2]), p.get_slice(k, np.s_[1::2]))


# --- lifetime ------------------------------------------------------------------------------------


def test_views_outlive_the_reader(tmp_path):
    a = _sample(np.float64, (64, 64))
    write_checkpoint(tmp_path, whole({"a": a, "b": np.ones(3)}))
    r = rd.CheckpointReader(tmp_path)
    view = r["a"]
    part = r.get_slice("a", np.s_[3:5])
    mm = weakref.ref(r._shards.sources[0]._map)
    assert mm() is not None
    r.close()  # must not raise although views are exported
    r.close()  # idempotent
    ref = weakref.ref(r)
    del r
    gc.collect()
    assert ref() is None
    assert mm() is not None  # still mapped: the views keep it alive
    _same(view, a)
    _same(part, a[3:5])
    assert float(view.sum()) == float(a.sum())
    del view, part
    gc.collect()
    assert mm() is None  # unmapped with its last view


def test_map_is_closed_when_no_view_is_alive(tmp_path):
    write_checkpoint(tmp_path, whole({"a": np.ones(8)}))
    r = rd.CheckpointReader(tmp_path)
    float(r["a"].sum())  # the temporary view dies at once
    gc.collect()
    mm = weakref.ref(r._shards.sources[0]._map)
    r.close()
    assert mm() is None


def test_use_after_close_raises(tmp_path):
    write_checkpoint(tmp_path, whole({"a": np.ones(2)}))
    r = rd.CheckpointReader(tmp_path)
    r.close()
    with pytest.raises(ReaderClosedError, match="is closed"):
        r["a"]


def test_close_waits_for_reads_in_other_threads(tmp_path, monkeypatch):
    a = _sample(np.int32, (100,))
    write_checkpoint(tmp_path, whole({"a": a}))
    started, release = threading.Event(), threading.Event()
    events: list[str] = []
    orig = sources.RawShard.read_tasks

    def slow(self, requests):
        tasks = orig(self, requests)

        def read():
            started.set()
            release.wait(10)
            for task in tasks:
                task()
            events.append("read done")
        return [read]

    monkeypatch.setattr(sources.RawShard, "read_tasks", slow)
    r = rd.CheckpointReader(tmp_path, mmap=False)
    result: list[np.ndarray] = []
    reader_thread = threading.Thread(target=lambda: result.append(r["a"]))
    reader_thread.start()
    assert started.wait(10)
    closer = threading.Thread(target=lambda: (r.close(), events.append("closed")))
    closer.start()
    for _ in range(10_000):  # wait until close() has begun (it then blocks on the read)
        if r._shards.closed:
            break
        threading.Event().wait(0.001)
    with pytest.raises(ReaderClosedError):  # new reads are refused once close() began
        r["a"]
    assert events == []
    release.set()
    reader_thread.join(10)
    closer.join(10)
    assert events == ["read done", "closed"]  # the descriptor was closed after the read
    _same(result[0], a)


def test_concurrent_gets_open_each_shard_once(tmp_path):
    arrays = {f"k{i}": _sample(np.float32, (50,)) for i in range(16)}
    write_checkpoint(tmp_path, whole(arrays, n_shards=4))
    opened = []
    orig = sources.RawShard.__init__

    def counting(self, *a, **kw):
        opened.append(a[0])
        orig(self, *a, **kw)

    errors = []
    with rd.CheckpointReader(tmp_path) as r:
        sources.RawShard.__init__ = counting  # type: ignore[method-assign]
        try:
            def work():
                try:
                    for k, a in arrays.items():
                        _same(r[k], a)
                except BaseException as e:  # pragma: no cover - reported below
                    errors.append(e)

            threads = [threading.Thread(target=work) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            sources.RawShard.__init__ = orig  # type: ignore[method-assign]
    assert not errors
    assert sorted(opened) == sorted(set(opened)) and len(opened) == 4


# --- load / verify --------------------------------------------------------------------------------


def test_load_all_and_some(tmp_path, use_mmap):
    a = _sample(np.float32, (6, 2))
    items = row_slices("x/a", a, 2, [0, 1]) + whole({"x/b": np.arange(3), "c": np.ones(())}, 2)
    write_checkpoint(tmp_path, items)
    got = rd.load(tmp_path, mmap=use_mmap)
    assert list(got) == ["x/a", "x/b", "c"]
    _same(got["x/a"], a)
    _same(got["x/b"], np.arange(3))
    some = rd.load(tmp_path, ["c"], verify=True, mmap=use_mmap)
    assert list(some) == ["c"]
    assert list(rd.load(tmp_path, "x/b", mmap=use_mmap)) == ["x/b"]
    with pytest.raises(KeyNotFoundError, match=r"'x/bb' is not in checkpoint .*did you mean 'x/b'"):
        rd.load(tmp_path, ["x/bb"])
    nested = unflatten(got)
    assert set(nested["x"]) == {"a", "b"}


def test_verify_counts_checked_entries(tmp_path):
    a = _sample(np.int64, (4, 3))
    write_checkpoint(tmp_path / "c", row_slices("a", a, 2, [0, 1]) + whole({"b": a}))
    write_checkpoint(tmp_path / "n", whole({"b": a}), checksum=False)
    with rd.CheckpointReader(tmp_path / "c", mmap=False) as r:
        assert r.verify() == 3
        assert r.verify(["b"]) == 1
    with rd.CheckpointReader(tmp_path / "n", verify=True) as r:
        assert r.verify() == 0


def test_verify_streams_large_entries_in_pread_mode(tmp_path, monkeypatch):
    monkeypatch.setattr(files.CheckpointFile, "task_bytes", 1000)  # batches of 1000 bytes
    a = _sample(np.float32, (3001,))
    write_checkpoint(tmp_path, whole({"a": a}))
    with rd.CheckpointReader(tmp_path, mmap=False) as r:
        assert r.verify() == 1


# --- restore_into ---------------------------------------------------------------------------------


def test_restore_into_numpy_in_place(tmp_path):
    a = _sample(np.float32, (4, 6))
    b = _sample(ml_dtypes.bfloat16, (3,))
    items = row_slices("model/w", a, 2, [0, 1]) + whole({"model/b": b, "step": np.array(9)}, 2)
    write_checkpoint(tmp_path, items)
    state = {"model": {"w": np.zeros((4, 6), np.float32), "b": np.zeros(3, ml_dtypes.bfloat16)},
             "step": np.array(0)}
    w_before = state["model"]["w"]
    restored = restore_into(tmp_path, state, verify=True)
    assert restored.restored_keys == ["model/w", "model/b", "step"]
    assert restored.missing_keys == restored.unexpected_keys == []
    assert state["model"]["w"] is w_before
    _same(state["model"]["w"], a)
    _same(state["model"]["b"], b)
    assert state["step"] == 9


def test_restore_into_big_endian_target(tmp_path):
    a = np.arange(5, dtype="<i4")
    write_checkpoint(tmp_path, whole({"a": a}))
    target = np.zeros(5, ">i4")
    restore_into(tmp_path, {"a": target})
    assert target.tolist() == a.tolist()


def test_restore_into_mismatches(tmp_path):
    write_checkpoint(tmp_path, whole({"w": np.zeros((2, 3), np.float32), "s": np.zeros(())}))
    good = np.zeros((2, 3), np.float32)
    with pytest.raises(RestoreMismatchError,
                       match=r"key 'w' .*checkpoint has shape \[2, 3\] dtype F32 \(float32\), "
                             r"the target has shape \[3, 2\] dtype F32"):
        restore_into(tmp_path, {"w": np.zeros((3, 2), np.float32)}, partial=True)
    with pytest.raises(RestoreMismatchError,
                       match=r"key 'w' .*target has shape \[2, 3\] dtype F64"):
        restore_into(tmp_path, {"w": np.zeros((2, 3))}, partial=True)
    with pytest.raises(IncompleteRestoreError,
                       match=r"1 target values missing from the checkpoint: 'missing'; "
                             r"1 checkpoint values nothing in the target takes: 's'"):
        restore_into(tmp_path, {"w": good, "missing": np.zeros(1)})
    assert not good.any()  # nothing copied before the error
    ro = np.zeros((2, 3), np.float32)
    ro.flags.writeable = False
    with pytest.raises(RestoreMismatchError, match="target array is read-only"):
        restore_into(tmp_path, {"w": ro}, partial=True)
    # a Python number cannot change in place: matched with its 0-d tensor, left as it is
    # (load(..., nested=True) gives it back); a numpy scalar is still refused
    target = {"w": good, "s": 1.0}
    restore_into(tmp_path, target)
    assert target["s"] == 1.0
    with pytest.raises(RestoreMismatchError, match="in place into a"):
        restore_into(tmp_path, {"s": np.float64(1.0)}, partial=True)


def test_restore_into_torch(tmp_path):
    torch = pytest.importorskip("torch", reason="torch (optional) is not installed")
    w = _sample(np.float32, (4, 6))
    bf = _sample(ml_dtypes.bfloat16, (5,))
    s = np.array(1.25, ml_dtypes.bfloat16)
    items = row_slices("w", w, 2, [0, 1]) + whole({"bf": bf, "s": s, "i": np.arange(4)}, 2)
    write_checkpoint(tmp_path, items)
    state = {
        "w": torch.zeros(4, 6, requires_grad=True),
        "bf": torch.zeros(5, dtype=torch.bfloat16),
        "s": torch.zeros((), dtype=torch.bfloat16),
        "i": torch.zeros(8, dtype=torch.int64)[::2],  # strided view into a bigger buffer
    }
    restored = restore_into(tmp_path, state)
    assert restored.restored_keys == ["w", "bf", "s", "i"]
    np.testing.assert_array_equal(state["w"].detach().numpy(), w)
    got_bf = state["bf"].view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    _same(got_bf, bf)
    assert float(state["s"]) == 1.25
    assert state["i"].tolist() == [0, 1, 2, 3]
    with pytest.raises(RestoreMismatchError, match=r"key 'bf' .*checkpoint has shape \[5\] dtype "
                       r"BF16 \(bfloat16\), the target has shape \[5\] dtype F32"):
        restore_into(tmp_path, {"bf": torch.zeros(5)}, partial=True)
    with pytest.raises(RestoreMismatchError, match=r"key 'w' .*target has shape \[6, 4\]"):
        restore_into(tmp_path, {"w": torch.zeros(6, 4)}, partial=True)


def test_restore_into_torch_copy_back_path(tmp_path):
    torch = pytest.importorskip("torch", reason="torch (optional) is not installed")
    bf = _sample(ml_dtypes.bfloat16, (5,))
    write_checkpoint(tmp_path, whole({"bf": bf, "f": np.arange(3, dtype=np.float32)}))
    # Tensors outside host memory (CUDA...) are restored through a host copy and copy_back;
    # the copy-back itself is checked here on CPU tensors.
    state = {"bf": torch.zeros(5, dtype=torch.bfloat16), "f": torch.zeros(3)}
    target, back = restore._restore_target(state["bf"], "bf")
    assert back is None
    from shardkit.frameworks import copy_into

    copy_into(state["bf"], np.asarray(bf))
    copy_into(state["f"], np.arange(3, dtype=np.float32))
    _same(state["bf"].view(torch.int16).numpy().view(ml_dtypes.bfloat16), bf)
    assert state["f"].tolist() == [0.0, 1.0, 2.0]
    assert target.shape == (5,)


def test_no_open_files_leak(tmp_path):
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to count open files")
    write_checkpoint(tmp_path, whole({"a": np.ones(4), "b": np.ones(2)}, n_shards=2))
    before = len(os.listdir("/proc/self/fd"))
    for use_mmap in (True, False):
        with rd.CheckpointReader(tmp_path, mmap=use_mmap) as r:
            float(r["a"].sum() + r["b"].sum())
    assert len(os.listdir("/proc/self/fd")) == before
    r = rd.CheckpointReader(tmp_path, mmap=False)
    float(r["a"].sum())
    assert len(os.listdir("/proc/self/fd")) == before + 2  # the directory and one shard
    del r  # dropped without close(): the descriptors are released with the reader
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before


def test_single_full_box_slice_is_read_as_a_view(tmp_path):
    # Some policies name an unsplit tensor by an explicit full-box spec instead of "".
    a = _sample(np.float32, (4, 3))
    write_checkpoint(tmp_path, [("a", "4 3 0,4:0,3", 0, a)])
    doc = json.loads((tmp_path / MANIFEST_FILE).read_text())
    assert doc["weight_map"] == {}  # no entry is named "a", so HF-style tools must not look
    with rd.CheckpointReader(tmp_path) as r:
        got = r["a"]
        assert got.flags.writeable and not got.flags.owndata
        _same(got, a)
        assert not r.info("a").is_split


# --- round trips through the real writer (shardkit.io.save.save) ------------------------------
# (imported inside the tests: the reader tests above do not depend on the writer)


def _state():
    return {
        "model": {
            "w": _sample(np.float32, (300, 40)),
            "b": _sample(np.float64, (40,)),
            "emb": _sample(ml_dtypes.bfloat16, (50, 8)),
            "q": _sample(ml_dtypes.float8_e4m3fn, (17, 3)),
        },
        "opt": [_sample(np.int64, ()), _sample(np.uint16, (0, 5)), _sample(np.bool_, (33,))],
    }


@pytest.mark.parametrize("policy", ["default", "max-shard-size", "all-in-one"])
def test_round_trip_through_save(tmp_path, policy, use_mmap):
    from shardkit.io.save import save
    from shardkit.sharding.policies import AllInOnePolicy, MaxShardSizePolicy

    callback = {"default": None, "max-shard-size": MaxShardSizePolicy(8192),
                "all-in-one": AllInOnePolicy()}[policy]
    state = _state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save(tmp_path / "c", state,
             options=CheckpointOptions(experimental_sharding_callback=callback, durable=False),
             metadata={"step": 5})
    # only the splitting policy warns that HuggingFace loaders cannot read what it split
    assert [type(w.message) for w in caught] == (
        [SplitTensorsWarning] if policy == "max-shard-size" else [])
    flat = dict(flatten(state))
    with rd.CheckpointReader(tmp_path / "c", mmap=use_mmap) as r:
        assert r.keys() == list(flat)
        assert r.metadata == {"step": 5}
        if policy == "max-shard-size":
            assert r.info("model/w").is_split  # 48 KB tensor, 8 KB shards
            assert len(r.index.shards) > 5
        for k, a in flat.items():
            _same(r[k], a)
            if a.ndim:
                _same(r.get_slice(k, np.s_[1::3]), a[1::3])
        _same(r.get_slice("model/w", np.s_[-7:3:-11, ::-9]), flat["model/w"][-7:3:-11, ::-9])
        assert r.verify() == sum(len(r.info(k).slices) for k in r.keys())
    loaded = rd.load(tmp_path / "c", verify=True, mmap=use_mmap)
    for k, a in flat.items():
        _same(loaded[k], a)


def test_save_then_restore_into_torch_and_numpy(tmp_path):
    torch = pytest.importorskip("torch", reason="torch (optional) is not installed")
    from shardkit.io.save import save
    from shardkit.sharding.policies import MaxShardSizePolicy

    src = {"w": torch.randn(64, 32), "bf": torch.randn(16, dtype=torch.bfloat16),
           "n": np.arange(10, dtype=np.int32)}
    with pytest.warns(SplitTensorsWarning, match=r"\(e\.g\. 'w'\)"):
        save(tmp_path / "c", src,
             options=CheckpointOptions(experimental_sharding_callback=MaxShardSizePolicy(2048),
                                       durable=False))
    dst = {"w": torch.zeros(64, 32), "bf": torch.zeros(16, dtype=torch.bfloat16),
           "n": np.zeros(10, np.int32)}
    assert restore_into(tmp_path / "c", dst, verify=True).restored_keys == ["w", "bf", "n"]
    assert torch.equal(dst["w"], src["w"]) and torch.equal(dst["bf"], src["bf"])
    np.testing.assert_array_equal(dst["n"], src["n"])


def test_zstd_shards_are_read_through_the_codec_hook(tmp_path, use_mmap):
    from shardkit.io.options import CheckpointOptions
    from shardkit.io.save import save

    state = _state()
    save(tmp_path / "c", state, options=CheckpointOptions(compression="zstd", durable=False))
    with rd.CheckpointReader(tmp_path / "c", mmap=use_mmap) as r:
        assert {s.codec for s in r.index.shards} == {"zstd"}
        for k, a in flatten(state):
            _same(r[k], a)
        w = dict(flatten(state))["model/w"]
        _same(r.get_slice("model/w", np.s_[5:290:4, 3]), w[5:290:4, 3])
        assert r.verify() == len(r.keys())


def test_pread_mode_reads_runs_of_adjacent_entries(tmp_path, monkeypatch):
    """mmap=False: a run of adjacent entries is filled by one vectored read, not one read per
    tensor; entries skipped by the request split the runs."""
    flat = {f"t{i:04d}": _sample(np.float32, (i % 7 + 1,)) for i in range(3000)}
    api.save(tmp_path / "c", flat, options=CheckpointOptions(durable=False, threads=1))
    calls = []
    real = files._gather.read_arrays
    monkeypatch.setattr(files._gather, "read_arrays",
                        lambda fd, arrays, at: calls.append(len(arrays)) or real(fd, arrays, at))
    got = rd.load(tmp_path / "c", mmap=False)
    assert calls == [3000]
    for k, v in flat.items():
        _same(got[k], v)
    calls.clear()
    some = [f"t{i:04d}" for i in (*range(10, 20), *range(30, 35))]
    got = rd.load(tmp_path / "c", keys=some, mmap=False)
    assert sorted(calls) == [5, 10]
    for k in some:
        _same(got[k], flat[k])
        assert got[k].flags.writeable and got[k].flags.owndata


def test_pread_mode_notices_a_shard_cut_short_after_opening(tmp_path):
    flat = {f"t{i}": _sample(np.int16, (50,)) for i in range(20)}
    api.save(tmp_path / "c", flat, options=CheckpointOptions(durable=False, threads=1))
    (shard,) = (tmp_path / "c").glob("*.safetensors")
    with rd.CheckpointReader(tmp_path / "c", mmap=False) as r:
        _same(r["t0"], flat["t0"])  # the shard is open (its size checked) from here on
        os.truncate(shard, shard.stat().st_size - 30)
        with pytest.raises(TruncatedShardError, match=r"unexpected end of file at byte \d+ "
                           r"\(needed 30 more bytes\)"):
            r._get_many(None)


def test_read_pieces_cut_runs_into_reads_of_a_chunk():
    arrays = [np.zeros(n, np.uint8) for n in (3, 10, 0, 2, 25)]
    pieces = files._read_pieces(arrays, 100, 8)
    assert [(at, size) for _, at, size in pieces] == [(100, 8), (108, 8), (116, 8), (124, 8),
                                                      (132, 8)]
    assert [[b.nbytes for b in bufs] for bufs, _, _ in pieces] == [
        [3, 5], [5, 0, 2, 1], [8], [8], [8]]
    assert pieces[0][0][0] is arrays[0]  # whole arrays go as they are
    assert all(np.shares_memory(b, arrays[4]) for b in pieces[2][0])
    one = np.zeros(4, np.uint8)
    ((bufs, at, size),) = files._read_pieces([one], 7, 8)
    assert bufs[0] is one and (at, size) == (7, 4)
    assert files._read_pieces([], 7, 8) == []


def test_pread_mode_large_tensors_read_in_parallel_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "READ_CHUNK", 4096)
    monkeypatch.setattr(files, "PARALLEL_MIN", 4096)
    monkeypatch.setattr(files, "PARALLEL_MIN_BUFFER", 1024)
    flat = {"big": _sample(np.float32, (300, 41)), "bf": _sample(ml_dtypes.bfloat16, (9000,)),
            "small": _sample(np.int8, (5,))}
    api.save(tmp_path / "c", flat, options=CheckpointOptions(durable=False, threads=1))
    threads = set()
    real = files._gather.read_arrays
    monkeypatch.setattr(files._gather, "read_arrays", lambda fd, bufs, at: threads.add(
        threading.current_thread().name) or real(fd, bufs, at))
    got = rd.load(tmp_path / "c", mmap=False)
    for k, v in flat.items():
        _same(got[k], v)
    assert threads and all(name.startswith("shardkit-read") for name in threads)


# --- returned arrays own their memory; one checkpoint per reader ------------------------------


def _run_python(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `script` in a fresh interpreter (a crash must not take the suite with it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


ARRAYS_OUTLIVE_READER = """
    import gc, sys
    import numpy as np
    import shardkit
    from shardkit.io import save as api
    path, compression = sys.argv[1], sys.argv[2]
    x = np.arange(100, dtype=np.float32)
    api.save(path, {"x": x, "s": np.float64(2.5)}, options=shardkit.CheckpointOptions(
        durable=False, compression=None if compression == "raw" else compression))
    got = []
    for use_mmap in (True, False):
        with shardkit.open(path, mmap=use_mmap) as r:
            parts = [r.get_slice("x", np.s_[2:10]), r.get_slice("x", np.s_[::7]),
                     r.get_slice("x", 5), r.get_slice("x", ...), r.get_slice("s", ()),
                     r.get("x"), r["x"]]
        r = shardkit.open(path, mmap=use_mmap)
        parts.append(r.get_slice("x", np.s_[90:]))
        del r
        gc.collect()
        parts.append(shardkit.load(path, mmap=use_mmap)["x"])
        gc.collect()
        got.append([np.asarray(p).tolist() for p in parts])
    want = [x[2:10].tolist(), x[::7].tolist(), 5.0, x.tolist(), 2.5, x.tolist(), x.tolist(),
            x[90:].tolist(), x.tolist()]
    assert got == [want, want], got
    print("ok")
"""


@pytest.mark.parametrize("compression", ["raw", "zstd"])
def test_arrays_outlive_their_reader(tmp_path, compression):
    proc = _run_python(ARRAYS_OUTLIVE_READER, str(tmp_path / "c"), compression)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "ok"


def _file_bytes(path) -> dict[str, bytes]:
    return {name: (Path(path) / name).read_bytes() for name in sorted(os.listdir(path))}


def test_loaded_arrays_are_writable_and_writing_never_changes_the_file(tmp_path):
    flat = {"a": _sample(np.float32, (64, 3)), "b": _sample(np.int16, (7,)),
            "s": _sample(np.int64, ())}
    api.save(tmp_path / "c", flat, options=CheckpointOptions(durable=False))
    before = _file_bytes(tmp_path / "c")
    for use_mmap in (True, False):
        got = rd.load(tmp_path / "c", mmap=use_mmap)
        with rd.CheckpointReader(tmp_path / "c", mmap=use_mmap) as r:
            got["slice"] = r.get_slice("a", np.s_[3:9, 1])
            got["zero-d"] = r.get_slice("s", ())
        for k, a in got.items():
            assert a.flags.writeable, k
            a[...] = 1
        del got
        gc.collect()
    assert _file_bytes(tmp_path / "c") == before
    for k, a in rd.load(tmp_path / "c").items():
        _same(a, flat[k])


TORCH_ADD = """
    import sys
    import numpy as np
    import torch
    import shardkit
    from shardkit.io import save as api
    path = sys.argv[1]
    api.save(path, {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, durable=False)
    t = torch.from_numpy(shardkit.load(path)["w"])
    t.add_(1)
    assert t[0, 0].item() == 1.0
    assert shardkit.load(path)["w"][0, 0] == 0.0
    print("ok")
"""


def test_torch_add_in_place_on_a_loaded_array(tmp_path):
    pytest.importorskip("torch")
    proc = _run_python(TORCH_ADD, str(tmp_path / "c"))
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("index", [(), ...], ids=["empty-tuple", "ellipsis"])
def test_zero_d_get_slice_returns_the_stored_value(tmp_path, use_mmap, compression, index):
    flat = {"s": np.float64(-3.25), "i": np.int8(-7), "v": _sample(np.float32, (40,))}
    api.save(tmp_path / "c", flat,
             options=CheckpointOptions(durable=False, compression=compression))
    with rd.CheckpointReader(tmp_path / "c", mmap=use_mmap) as r:
        for _ in range(3):  # uninitialised memory would differ from call to call
            for k in ("s", "i"):
                got = r.get_slice(k, index)
                assert isinstance(got, np.ndarray) and got.shape == ()
                _same(got, np.asarray(flat[k]))
        assert r.verify() == 3


def _overwrite(path, flat) -> None:
    api.save(path, flat, options=CheckpointOptions(durable=False), overwrite=True)


def _gen(n: int, shards: int = 1) -> dict[str, np.ndarray]:
    return {k: np.full(64, n * 10 + i, np.int32) for i, k in enumerate("abcd"[: max(2, shards)])}


@pytest.fixture
def two_shard_policy():
    return api.DefaultShardingPolicy(threads=1, max_shard_size=256)


def test_reader_reads_the_checkpoint_it_opened_after_an_overwrite(tmp_path, use_mmap):
    path = tmp_path / "c"
    api.save(path, _gen(1), options=CheckpointOptions(durable=False))
    with rd.CheckpointReader(path, mmap=use_mmap) as r:
        np.testing.assert_array_equal(r["a"], _gen(1)["a"])
        _overwrite(path, _gen(2))
        np.testing.assert_array_equal(r["b"], _gen(1)["b"])  # same shard, opened before
        np.testing.assert_array_equal(r.get_slice("b", np.s_[3:5]), _gen(1)["b"][3:5])
        assert r.verify() == 2
    np.testing.assert_array_equal(rd.load(path)["b"], _gen(2)["b"])


def test_reader_never_reads_a_shard_of_the_new_checkpoint(tmp_path, use_mmap, two_shard_policy):
    path = tmp_path / "c"
    api.save(path, _gen(1, 4),
             options=CheckpointOptions(durable=False,
                                       experimental_sharding_callback=two_shard_policy))
    with rd.CheckpointReader(path, mmap=use_mmap) as r:
        assert len(r.index.shards) == 4
        np.testing.assert_array_equal(r["a"], _gen(1, 4)["a"])
        api.save(path, _gen(2, 4), overwrite=True,
                 options=CheckpointOptions(durable=False,
                                           experimental_sharding_callback=two_shard_policy))
        with pytest.raises(rd.CheckpointReplacedError) as e:
            r["d"]
        msg = str(e.value)
        assert str(path) in msg and "model-00004-of-00004.safetensors" in msg
        assert "replaced" in msg and "key 'd'" in msg


def test_load_retries_from_scratch_when_the_checkpoint_is_replaced(tmp_path, monkeypatch,
                                                                   two_shard_policy):
    path = tmp_path / "c"
    api.save(path, _gen(1, 4),
             options=CheckpointOptions(durable=False,
                                       experimental_sharding_callback=two_shard_policy))
    real = ShardSet.source
    replaced = []

    def source(self, i):
        if i == 2 and len(replaced) < 2:  # overwritten between reading shards 0-1 and 2
            replaced.append(i)
            api.save(path, _gen(len(replaced) + 1, 4), overwrite=True,
                     options=CheckpointOptions(durable=False,
                                               experimental_sharding_callback=two_shard_policy))
        return real(self, i)

    monkeypatch.setattr(ShardSet, "source", source)
    for use_mmap in (True, False):
        replaced.clear()
        got = rd.load(path, mmap=use_mmap)
        assert len(replaced) == 2
        for k, v in _gen(3, 4).items():  # all of the last generation, nothing mixed
            np.testing.assert_array_equal(got[k], v)


def test_load_retries_when_the_old_directory_is_half_deleted_at_open(tmp_path, monkeypatch):
    """An overwrite deletes the old directory's files before the directory: a reader that opened
    the old directory and then finds no manifest in it was overtaken by a replace, not looking
    at a missing checkpoint."""
    from shardkit.shards import files
    path = tmp_path / "c"
    api.save(path, _gen(1), options=CheckpointOptions(durable=False))
    real = files.CheckpointDirectory.read_manifest
    calls = []

    def read_manifest(self, name, limit):
        if not calls:
            calls.append(name)
            aside = tmp_path / "old"
            os.rename(path, aside)  # the handle now names the old directory, still present
            api.save(path, _gen(2), options=CheckpointOptions(durable=False))
            (aside / MANIFEST_FILE).unlink()
        return real(self, name, limit)

    monkeypatch.setattr(files.CheckpointDirectory, "read_manifest", read_manifest)
    got = rd.load(path)
    assert calls
    for k, v in _gen(2).items():
        np.testing.assert_array_equal(got[k], v)


def test_load_gives_up_after_a_bounded_number_of_replacements(tmp_path, monkeypatch,
                                                              two_shard_policy):
    path = tmp_path / "c"
    api.save(path, _gen(1, 4),
             options=CheckpointOptions(durable=False,
                                       experimental_sharding_callback=two_shard_policy))
    real = ShardSet.source
    count = [0]

    def source(self, i):
        if i == 2:
            count[0] += 1
            api.save(path, _gen(count[0] + 1, 4), overwrite=True,
                     options=CheckpointOptions(durable=False,
                                               experimental_sharding_callback=two_shard_policy))
        return real(self, i)

    monkeypatch.setattr(ShardSet, "source", source)
    with pytest.raises(rd.CheckpointReplacedError, match="replaced"):
        rd.load(path)
    assert count[0] == rd.LOAD_ATTEMPTS


def test_racing_loads_never_mix_generations(tmp_path, two_shard_policy):
    path = tmp_path / "c"
    api.save(path, _gen(0, 4),
             options=CheckpointOptions(durable=False,
                                       experimental_sharding_callback=two_shard_policy))
    stop = threading.Event()

    def overwrite():
        n = 1
        while not stop.is_set():
            api.save(path, _gen(n, 4), overwrite=True,
                     options=CheckpointOptions(durable=False,
                                               experimental_sharding_callback=two_shard_policy))
            n += 1

    t = threading.Thread(target=overwrite)
    t.start()
    try:
        for i in range(40):
            got = rd.load(path, mmap=bool(i % 2))
            gens = {int(v[0]) // 10 for v in got.values()}
            assert len(gens) == 1, gens
    finally:
        stop.set()
        t.join()


MANY_SHARDS = """
    import os, resource, sys
    import numpy as np
    import shardkit
    from shardkit.io import save as api
    from shardkit.io.restore import restore_into
    path, compression = sys.argv[1], sys.argv[2]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    flat = {f"t{i:04d}": np.full(16, i, np.int32) for i in range(1100)}
    policy = api.DefaultShardingPolicy(threads=2, max_shard_size=64)
    api.save(path, flat, options=shardkit.CheckpointOptions(
        durable=True, experimental_sharding_callback=policy,
        compression=None if compression == "raw" else compression))
    assert len([n for n in os.listdir(path) if n.startswith("model-")]) == 1100
    for use_mmap in (True, False):
        got = shardkit.load(path, mmap=use_mmap, verify=True)
        assert all((got[k] == v).all() for k, v in flat.items())
        with shardkit.open(path, mmap=use_mmap) as r:
            assert r.verify() == 1100
            held = [r[k] for k in flat]
            assert all((r.get_slice(k, np.s_[2:4]) == v[2:4]).all() for k, v in flat.items())
        assert all((a == flat[k]).all() for a, k in zip(held, flat))
        del got, held
    target = {k: np.zeros_like(v) for k, v in flat.items()}
    restore_into(path, target, verify=True)
    assert all((target[k] == v).all() for k, v in flat.items())
    print("ok")
"""


@pytest.mark.parametrize("compression", ["raw", "zstd"])
def test_1100_shards_under_a_256_descriptor_limit(tmp_path, compression):
    if os.environ.get("SHARDKIT_PUREPYTHON") == "1" and sys.version_info < (3, 13):
        pytest.skip("the pure-Python map twin holds a descriptor per map before Python 3.13")
    proc = _run_python(MANY_SHARDS, str(tmp_path / "c"), compression, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert proc.stdout.strip() == "ok"


def test_pread_reader_holds_a_bounded_number_of_descriptors(tmp_path):
    flat = {f"t{i:03d}": np.full(16, i, np.int32) for i in range(200)}
    policy = api.DefaultShardingPolicy(threads=1, max_shard_size=64)
    api.save(tmp_path / "c", flat,
             options=CheckpointOptions(durable=False, experimental_sharding_callback=policy))
    before = len(os.listdir("/proc/self/fd"))
    with rd.CheckpointReader(tmp_path / "c", mmap=False) as r:
        for k, v in flat.items():
            np.testing.assert_array_equal(r[k], v)
        held = len(os.listdir("/proc/self/fd")) - before
        assert held <= rd.MAX_OPEN_FILES + 1, held  # + the directory
        for k, v in flat.items():  # evicted files are opened again
            np.testing.assert_array_equal(r.get_slice(k, np.s_[1:3]), v[1:3])
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("nd", [33, 40, 64])
def test_tensors_of_33_to_64_dimensions_round_trip_in_every_read_mode(tmp_path, compression,
                                                                     mmap, nd):
    import shardkit

    a = np.arange(12, dtype=np.float32).reshape((2,) + (1,) * (nd - 3) + (2, 3))
    small = np.arange(2, dtype=np.int8).reshape((1,) * (nd - 1) + (2,))
    shardkit.save(tmp_path / "c", {"a": a, "s": small},
                  options=shardkit.CheckpointOptions(compression=compression))
    loaded = shardkit.load(tmp_path / "c", mmap=mmap, verify=True)
    assert loaded["a"].shape == a.shape and np.array_equal(loaded["a"], a)
    assert np.array_equal(loaded["s"], small)
    with shardkit.open(tmp_path / "c", mmap=mmap) as r:
        assert np.array_equal(r.get("a"), a)
        index = (1,) + (0,) * (nd - 3) + (slice(None), slice(1, 3))
        assert np.array_equal(r.get_slice("a", index), a[index])
        assert r.verify() == 2
    target = {"a": np.zeros_like(a), "s": np.zeros_like(small)}
    shardkit.restore_into(tmp_path / "c", target)
    assert np.array_equal(target["a"], a)
