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
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 1000, 4099])
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


@pytest.mark.parametrize("s", ITEMSIZES)
@pytest.mark.parametrize("shift", [0, 1, 2, 3, 4, 8, 12])
def test_large_unshuffles_at_any_destination_alignment(s, shift):
    # Pieces of at least NT_MIN_BYTES take the streaming-store path (after a few items written
    # one by one up to 16-byte alignment, or the plain path when no item boundary is aligned);
    # odd item counts and a partial item range leave tails on both sides.
    n = kernel.NT_MIN_BYTES // s + 37
    rng = np.random.default_rng(s * 100 + shift)
    src = rng.integers(0, 256, n * s, dtype=np.uint8)
    chunk = np.empty(n * s + 3, np.uint8)
    kernel.gather_shuffle([src], i64(0), i64(0), i64(n * s), i64(s), chunk, i64(3))
    assert chunk[3:].tobytes() == shuffled(src, s).tobytes()
    for b, c in ((0, n), (5, n - 9)):
        outs = []
        for impl in (kernel, twin):
            out = np.full(n * s + 32, 0xCD, np.uint8)
            impl.unshuffle_scatter(chunk, i64(3), i64(n), i64(s), i64(b), i64(c), [out],
                                   i64(0), i64(shift))
            outs.append(out)
        assert outs[0].tobytes() == outs[1].tobytes()
        assert outs[0][shift : shift + c * s].tobytes() == src[b * s : (b + c) * s].tobytes()
        assert (outs[0][:shift] == 0xCD).all() and (outs[0][shift + c * s :] == 0xCD).all()


@pytest.mark.parametrize("s", ITEMSIZES)
def test_unaligned_sources_and_many_pieces_match_twin(s):
    # Sources and destinations at odd addresses, pieces just below and above NT_MIN_BYTES.
    rng = np.random.default_rng(s)
    big = kernel.NT_MIN_BYTES // s + 1
    counts = [1, 15, 16, 17, 255, big - 2, big]
    base = rng.integers(0, 256, sum(counts) * s + 1, dtype=np.uint8)
    src = base[1:]  # an odd address
    offs = np.cumsum([0, *counts[:-1]]).astype(np.int64) * s
    lens = np.array(counts, np.int64) * s
    chunk_k = np.zeros(int(lens.sum()) + 1, np.uint8)
    chunk_t = chunk_k.copy()
    args = (np.zeros(len(counts), np.int64), offs, lens, np.full(len(counts), s, np.int64))
    kernel.gather_shuffle([src], *args, chunk_k, offs + 1)
    twin.gather_shuffle([src], *args, chunk_t, offs + 1)
    assert chunk_k.tobytes() == chunk_t.tobytes()
    n = np.array(counts, np.int64)
    dests = [np.zeros(int(c) * s + 1, np.uint8)[1:] for c in counts]
    kernel.unshuffle_scatter(chunk_k, offs + 1, n, args[3], np.zeros_like(n), n, dests,
                             np.arange(len(counts), dtype=np.int64), np.zeros_like(n))
    for d, o, ln in zip(dests, offs, lens):
        assert d.tobytes() == src[o : o + ln].tobytes()
