"""The _shuffle kernel against its pure-Python twin, and against a direct numpy definition."""

from __future__ import annotations

import mmap
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardkit._kernels import _shuffle as kernel
from shardkit._reference import _shuffle as twin

ITEMSIZES = (1, 2, 3, 4, 8, 16)
BOTH = pytest.mark.parametrize("impl", [kernel, twin], ids=["kernel", "twin"])


def i64(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def shuffled(data: np.ndarray, s: int) -> np.ndarray:
    """Definition: byte b of item i goes to b * n + i."""
    return data.reshape(-1, s).T.reshape(-1)


@st.composite
def pieces(draw):  # a chunk built from several sources of mixed item sizes
    count = draw(st.integers(1, 6))
    sources, table, pos = [], [], 0
    for j in range(count):
        s = draw(st.sampled_from(ITEMSIZES))
        n_src = draw(st.integers(0, 40))
        data = np.frombuffer(draw(st.binary(min_size=n_src * s, max_size=n_src * s)), np.uint8)
        first = draw(st.integers(0, n_src))
        n = draw(st.integers(0, n_src - first))
        sources.append(data)
        table.append((j, first * s, n * s, s, pos))
        pos += n * s
    gap = draw(st.integers(0, 5))
    return sources, np.array(table, np.int64).reshape(-1, 5).T.copy(), pos + gap


@given(pieces())
def test_gather_shuffle_matches_twin_and_definition(case):
    sources, (idx, off, ln, size, doff), total = case
    out_k = np.full(total, 0xAB, np.uint8)
    out_t = out_k.copy()
    kernel.gather_shuffle(sources, idx, off, ln, size, out_k, doff)
    twin.gather_shuffle(sources, idx, off, ln, size, out_t, doff)
    assert out_k.tobytes() == out_t.tobytes()
    for j, o, n, s, d in zip(idx, off, ln, size, doff):
        assert out_k[d : d + n].tobytes() == shuffled(sources[j][o : o + n], s).tobytes()
    assert (out_k[int(doff[-1] + ln[-1]) :] == 0xAB).all()  # nothing written past the pieces


@given(pieces(), st.data())
def test_unshuffle_scatter_inverts_gather_for_any_item_range(case, data):
    sources, (idx, off, ln, size, doff), total = case
    chunk = np.zeros(total, np.uint8)
    kernel.gather_shuffle(sources, idx, off, ln, size, chunk, doff)
    table = []
    for k, (n, s, d) in enumerate(zip(ln, size, doff)):
        items = int(n // s)
        b = data.draw(st.integers(0, items))
        c = data.draw(st.integers(0, items - b))
        table.append((d, items, s, b, c, k, 3))
    t = np.array(table, np.int64).reshape(-1, 7).T.copy()
    outs_k = [np.full(int(c * s) + 5, 7, np.uint8) for c, s in zip(t[4], t[2])]
    outs_t = [o.copy() for o in outs_k]
    kernel.unshuffle_scatter(chunk, t[0], t[1], t[2], t[3], t[4], outs_k, t[5], t[6])
    twin.unshuffle_scatter(chunk, t[0], t[1], t[2], t[3], t[4], outs_t, t[5], t[6])
    for k, (j, o, s, b, c) in enumerate(zip(idx, off, size, t[3], t[4])):
        expect = sources[j][o + b * s : o + (b + c) * s]
        assert outs_k[k][3 : 3 + c * s].tobytes() == expect.tobytes()
        assert outs_k[k].tobytes() == outs_t[k].tobytes()
        assert (outs_k[k][:3] == 7).all() and (outs_k[k][3 + c * s :] == 7).all()


@pytest.mark.parametrize("s", ITEMSIZES)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 4099])
def test_fast_paths_every_tail_length(s, n):
    src = np.random.default_rng(n * 31 + s).integers(0, 256, n * s, dtype=np.uint8)
    out = np.empty(n * s, np.uint8)
    kernel.gather_shuffle([src], i64(0), i64(0), i64(n * s), i64(s), out, i64(0))
    assert out.tobytes() == shuffled(src, s).tobytes()
    back = np.empty(n * s, np.uint8)
    kernel.unshuffle_scatter(out, i64(0), i64(n), i64(s), i64(0), i64(n), [back], i64(0), i64(0))
    assert back.tobytes() == src.tobytes()


@BOTH
def test_typed_and_read_only_sources(impl, tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    a.flags.writeable = False
    path = tmp_path / "src.bin"
    path.write_bytes(np.arange(16, dtype=np.uint16).tobytes())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        out = np.zeros(48 + 32, np.uint8)
        impl.gather_shuffle([a.reshape(-1).view(np.uint8), m, b"\x01\x02"], i64(0, 1),
                            i64(0, 0), i64(48, 32), i64(4, 2), out, i64(0, 48))
        assert out[:48].tobytes() == shuffled(a.view(np.uint8).reshape(-1), 4).tobytes()
        assert out[48:].tobytes() == shuffled(np.frombuffer(m, np.uint8), 2).tobytes()


@BOTH
def test_gather_errors_before_writing(impl):
    src = np.arange(16, dtype=np.uint8)
    out = np.zeros(16, np.uint8)
    cases = [
        ((i64(1), i64(0), i64(8), i64(4), i64(0)), "names source 1, have 1"),
        ((i64(0), i64(0), i64(6), i64(4), i64(0)), "not a whole number of 4-byte items"),
        ((i64(0), i64(12), i64(8), i64(4), i64(0)), "reads bytes [12, 20) of source 0"),
        ((i64(0), i64(0), i64(8), i64(4), i64(12)), "writes bytes [12, 20) of a 16-byte"),
        ((i64(0), i64(0, 0), i64(8), i64(4), i64(0)), "same length"),
    ]
    for (idx, off, ln, s, d), message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            impl.gather_shuffle([src], idx, off, ln, s, out, d)
        assert not out.any()
    strided = np.arange(32, dtype=np.uint8)[::2]
    with pytest.raises(ValueError, match=r"source 0 .* is not a C-contiguous buffer"):
        impl.gather_shuffle([strided], i64(0), i64(0), i64(8), i64(1), out, i64(0))


@BOTH
def test_unshuffle_errors_before_writing(impl):
    chunk = np.arange(16, dtype=np.uint8)
    out = np.zeros(8, np.uint8)
    cases = [
        ((i64(0), i64(4), i64(4), i64(2), i64(3), i64(0), i64(0)), "items [2, 5) of 4 items"),
        ((i64(8), i64(4), i64(4), i64(0), i64(1), i64(0), i64(0)), "spans bytes [8, 24)"),
        ((i64(0), i64(4), i64(4), i64(0), i64(1), i64(2), i64(0)), "names destination 2"),
        ((i64(0), i64(4), i64(4), i64(0), i64(2), i64(0), i64(4)), "writes bytes [4, 12)"),
    ]
    for (o, n, s, b, c, j, d), message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            impl.unshuffle_scatter(chunk, o, n, s, b, c, [out], j, d)
        assert not out.any()
    read_only = np.zeros(8, np.uint8)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match=r"destination 0 .* writable buffer"):
        impl.unshuffle_scatter(chunk, i64(0), i64(4), i64(4), i64(0), i64(1), [read_only],
                               i64(0), i64(0))


def test_kernel_in_threads_matches_twin():
    rng = np.random.default_rng(5)
    srcs = [rng.integers(0, 256, 4096 * s, dtype=np.uint8) for s in (1, 2, 4, 8)]
    n = [len(x) for x in srcs]
    args = (i64(0, 1, 2, 3), i64(0, 0, 0, 0), i64(*n), i64(1, 2, 4, 8),
            np.cumsum([0, *n[:-1]]).astype(np.int64))
    expect = np.empty(sum(n), np.uint8)
    twin.gather_shuffle(srcs, *args[:4], expect, args[4])

    def run(_: int) -> bytes:
        out = np.empty(sum(n), np.uint8)
        for _ in range(20):
            kernel.gather_shuffle(srcs, *args[:4], out, args[4])
        return out.tobytes()

    with ThreadPoolExecutor(4) as pool:
        assert all(r == expect.tobytes() for r in pool.map(run, range(8)))
