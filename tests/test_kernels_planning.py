"""The planning kernels (_sizes, _packing) against their pure-Python twins, and their own rules."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardkit._kernels import PURE_PYTHON, _packing, _sizes
from shardkit._reference import _packing as ref_packing
from shardkit._reference import _sizes as ref_sizes

I64 = np.int64
INT64_MAX = 2**63 - 1

pytestmark = pytest.mark.skipif(
    PURE_PYTHON, reason="SHARDKIT_PUREPYTHON=1: the kernels are the twins themselves"
)


def public(module):
    return sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))


def test_kernels_and_twins_have_the_same_functions():
    assert public(_sizes) == public(ref_sizes) == ["check_csr", "checked_sum", "shape_nbytes"]
    assert public(_packing) == public(ref_packing) == [
        "first_fit", "lpt", "max_shard_fill", "next_fit"
    ]


def csr(shapes):
    indptr = np.zeros(len(shapes) + 1, dtype=I64)
    np.cumsum([len(s) for s in shapes], out=indptr[1:])
    dims = np.array([d for s in shapes for d in s], dtype=I64)
    return indptr, dims


def same(a, b):
    if isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == I64 and b.dtype == I64
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b and type(a) is type(b)


def both(name, module, ref_module, *args):
    """Call the kernel and its twin; same result, or the same exception type and message."""
    results = []
    for mod in (module, ref_module):
        try:
            results.append(("ok", getattr(mod, name)(*args)))
        except (ValueError, OverflowError) as e:
            results.append((type(e), str(e)))
    (ka, a), (kb, b) = results
    assert ka == kb, results
    if ka == "ok":
        same(a, b)
    else:
        assert a == b
    return results[0]


shapes_st = st.lists(st.lists(st.integers(0, 6), max_size=3), max_size=8)
itemsize_st = st.sampled_from([1, 2, 4, 8])


@st.composite
def items(draw, max_size=40, max_n=30):
    sizes = draw(st.lists(st.integers(0, max_size), max_size=max_n))
    order = draw(st.permutations(range(len(sizes))))
    return np.array(sizes, dtype=I64), np.array(order, dtype=I64)


# ---------------------------------------------------------------------------------------------
# _sizes


@given(shapes_st, st.data())
def test_shape_nbytes_matches_twin_and_numpy(shapes, data):
    its = np.array([data.draw(itemsize_st) for _ in shapes], dtype=I64)
    indptr, dims = csr(shapes)
    kind, got = both("shape_nbytes", _sizes, ref_sizes, indptr, dims, its)
    assert kind == "ok"
    assert got.tolist() == [math.prod(s) * int(d) for s, d in zip(shapes, its)]


@given(st.lists(st.integers(0, 2**40), max_size=20))
def test_checked_sum_matches_twin(values):
    kind, got = both("checked_sum", _sizes, ref_sizes, np.array(values, dtype=I64))
    assert kind == "ok" and got == sum(values)


def test_sizes_edge_cases():
    empty = np.zeros(0, dtype=I64)
    assert _sizes.shape_nbytes(np.zeros(1, dtype=I64), empty, empty).tolist() == []
    assert _sizes.checked_sum(empty) == 0
    # A zero dimension wins over an overflowing product of the others.
    indptr, dims = csr([[2**40, 2**40, 0]])
    assert _sizes.shape_nbytes(indptr, dims, np.array([8], dtype=I64)).tolist() == [0]
    # Exactly INT64_MAX fits.
    indptr, dims = csr([[INT64_MAX]])
    assert _sizes.shape_nbytes(indptr, dims, np.array([1], dtype=I64)).tolist() == [INT64_MAX]


@pytest.mark.parametrize(
    ("shapes", "its", "error", "message"),
    [
        ([[2], [2**31, 2**31, 2]], [4, 2], OverflowError,
         "item 1: 2 bytes x shape [2147483648, 2147483648, 2] overflows int64"),
        ([[2**62]], [2], OverflowError, "item 0: 2 bytes x shape [4611686018427387904] "
         "overflows int64"),
        ([[3], [4, -1]], [1, 1], ValueError, "item 1: negative dimension -1 on axis 1"),
        ([[3]], [-4], ValueError, "item 0: negative item size -4"),
    ],
)
def test_shape_nbytes_errors(shapes, its, error, message):
    indptr, dims = csr(shapes)
    kind, text = both("shape_nbytes", _sizes, ref_sizes, indptr, dims, np.array(its, dtype=I64))
    assert kind is error and text == message


def test_checked_sum_errors():
    kind, text = both("checked_sum", _sizes, ref_sizes, np.array([1, INT64_MAX], dtype=I64))
    assert kind is OverflowError
    assert text == "item 1: the running total of sizes overflows int64"
    kind, text = both("checked_sum", _sizes, ref_sizes, np.array([1, -2], dtype=I64))
    assert kind is ValueError and text == "item 1: negative size -2"


@pytest.mark.parametrize(
    ("indptr", "message"),
    [
        ([0, 1], "indptr must have 3 entries (items + 1), got 2"),
        ([1, 1, 2], "indptr[0] must be 0, got 1"),
        ([0, 2, 1], "indptr[2] = 1 is out of order or past the 2 dims"),
        ([0, 1, 3], "indptr[2] = 3 is out of order or past the 2 dims"),
    ],
)
def test_bad_csr_is_rejected_not_read_out_of_bounds(indptr, message):
    args = (np.array(indptr, dtype=I64), np.array([2, 3], dtype=I64), np.array([1, 1], dtype=I64))
    kind, text = both("shape_nbytes", _sizes, ref_sizes, *args)
    assert kind is ValueError and text == message
    kind, text = both("max_shard_fill", _packing, ref_packing, *args, 10)
    assert kind is ValueError and text == message


def test_sizes_accept_read_only_buffers():
    indptr, dims = csr([[2, 3], [4]])
    its = np.array([4, 8], dtype=I64)
    for a in (indptr, dims, its):
        a.flags.writeable = False
    assert _sizes.shape_nbytes(indptr, dims, its).tolist() == [24, 32]
    assert _sizes.checked_sum(its) == 12


def test_wrong_dtype_is_rejected():
    with pytest.raises(ValueError, match="Buffer dtype mismatch"):
        _sizes.checked_sum(np.array([1, 2], dtype=np.int32))


# ---------------------------------------------------------------------------------------------
# _packing: first_fit, next_fit, lpt


@pytest.mark.parametrize("name", ["first_fit", "next_fit"])
@given(items(), st.integers(1, 50))
def test_fit_matches_twin(name, sized, capacity):
    sizes, order = sized
    kind, ids = both(name, _packing, ref_packing, sizes, order, capacity)
    assert kind == "ok"
    check_bins(sizes, ids, capacity)


def check_bins(sizes, ids, capacity):
    """Dense bin ids, no empty bin, every bin within capacity unless it holds one big item."""
    if not sizes.shape[0]:
        return
    loads = np.bincount(ids, weights=sizes, minlength=int(ids.max()) + 1)
    counts = np.bincount(ids)
    assert (counts > 0).all()
    for b in range(len(loads)):
        assert loads[b] <= capacity or counts[b] == 1


@given(items(), st.integers(1, 50))
def test_first_fit_is_first_fit(sized, capacity):
    """Brute force: each item, in order, lands in the lowest bin that had room for it."""
    sizes, order = sized
    ids = _packing.first_fit(sizes, order, capacity)
    loads: list[int] = []
    for j in order.tolist():
        s = int(sizes[j])
        if s > capacity:
            continue
        b = next((b for b, load in enumerate(loads) if load + s <= capacity), len(loads))
        if b == len(loads):
            loads.append(0)
        loads[b] += s
        assert ids[j] == b


@given(items(), st.integers(1, 50))
def test_first_fit_never_uses_more_bins_than_next_fit(sized, capacity):
    sizes, order = sized
    ff = _packing.first_fit(sizes, order, capacity)
    nf = _packing.next_fit(sizes, order, capacity)
    assert (ff.max() if ff.size else -1) <= (nf.max() if nf.size else -1)


@given(items(max_size=1000), st.integers(1, 8))
def test_lpt_matches_twin_and_bound(sized, k):
    sizes, order = sized
    kind, ids = both("lpt", _packing, ref_packing, sizes, order, k)
    assert kind == "ok"
    n = sizes.shape[0]
    if not n:
        return
    assert sorted(set(ids.tolist())) == list(range(min(k, n)))
    decreasing = np.argsort(-sizes, kind="stable")
    ids = _packing.lpt(sizes, decreasing, k)
    loads = np.bincount(ids, weights=sizes)
    assert loads.max() <= sizes.sum() / k + sizes.max()


def test_lpt_spreads_zero_sizes_over_all_bins():
    ids = _packing.lpt(np.zeros(5, dtype=I64), np.arange(5, dtype=I64), 3)
    assert ids.tolist() == [0, 1, 2, 0, 0]


def test_first_fit_edge_cases():
    empty = np.zeros(0, dtype=I64)
    assert _packing.first_fit(empty, empty, 10).tolist() == []
    assert _packing.next_fit(empty, empty, 10).tolist() == []
    assert _packing.lpt(empty, empty, 3).tolist() == []
    # Zero sizes fit anywhere; one huge item gets its own bin after the others.
    sizes = np.array([0, 2**62, 5, 0, 7], dtype=I64)
    order = np.arange(5, dtype=I64)
    assert _packing.first_fit(sizes, order, 10).tolist() == [0, 2, 0, 0, 1]
    assert _packing.next_fit(sizes, order, 10).tolist() == [0, 2, 0, 0, 1]
    only_big = np.array([11, 12], dtype=I64)
    assert _packing.first_fit(only_big, np.array([1, 0], dtype=I64), 10).tolist() == [1, 0]


@pytest.mark.parametrize("capacity", [10, 11, 1000])
def test_first_fit_with_every_bin_just_over_half_full(capacity):
    """The kernel sizes its tree by the first-fit bound (< 2 * total / capacity + 1 bins); items
    just over half the capacity each need a bin of their own, the tightest case."""
    sizes = np.full(101, capacity // 2 + 1, dtype=I64)
    sizes[::7] = 0
    order = np.arange(101, dtype=I64)
    got = _packing.first_fit(sizes, order, capacity)
    same(got, ref_packing.first_fit(sizes, order, capacity))
    assert int(got.max()) + 1 == 101 - len(sizes[::7])


def test_first_fit_many_items_matches_twin():
    rng = np.random.default_rng(5)
    sizes = rng.integers(0, 1000, size=3000).astype(I64)
    order = np.argsort(-sizes, kind="stable")
    same(_packing.first_fit(sizes, order, 1500), ref_packing.first_fit(sizes, order, 1500))
    same(_packing.lpt(sizes, order, 7), ref_packing.lpt(sizes, order, 7))


@pytest.mark.parametrize("name", ["first_fit", "next_fit", "lpt"])
@pytest.mark.parametrize(
    ("sizes", "order", "limit", "error", "message"),
    [
        ([1, 2], [0, 1], 0, ValueError, None),
        ([1, -2], [0, 1], 5, ValueError, "item 1: negative size -2"),
        ([1, 2], [0], 5, ValueError, "order must have one entry per item (2), got 1"),
        ([1, 2], [1, 1], 5, ValueError,
         "order is not a permutation of 0..1: entry 1 at position 1"),
        ([1, 2], [0, 2], 5, ValueError,
         "order is not a permutation of 0..1: entry 2 at position 1"),
    ],
)
def test_packing_errors(name, sizes, order, limit, error, message):
    kind, text = both(name, _packing, ref_packing, np.array(sizes, dtype=I64),
                      np.array(order, dtype=I64), limit)
    assert kind is error
    if message is None:
        what = "num_bins" if name == "lpt" else "capacity"
        message = f"{what} must be >= 1, got 0"
    assert text == message


def test_lpt_total_overflow():
    kind, text = both("lpt", _packing, ref_packing, np.array([INT64_MAX, 1], dtype=I64),
                      np.array([0, 1], dtype=I64), 2)
    assert kind is OverflowError
    assert text == "item 1: the running total of sizes overflows int64"


# ---------------------------------------------------------------------------------------------
# _packing: max_shard_fill


@given(shapes_st, st.data(), st.integers(1, 70))
def test_max_shard_fill_matches_twin(shapes, data, max_size):
    its = np.array([data.draw(itemsize_st) for _ in shapes], dtype=I64)
    indptr, dims = csr(shapes)
    kind, (owner, shard_of, geom, regular) = both(
        "max_shard_fill", _packing, ref_packing, indptr, dims, its, max_size
    )
    assert kind == "ok"
    check_fill(shapes, its, max_size, owner, shard_of, geom, regular)


def check_fill(shapes, its, max_size, owner, shard_of, geom, regular):
    """Every element of every tensor in exactly one piece; shards dense, none empty, within
    max_size except the oversized pieces, each alone after the regular shards."""
    covered = [np.zeros(s, dtype=np.int64) for s in shapes]
    loads: dict[int, int] = {}
    counts: dict[int, int] = {}
    at = 0
    for i, s in zip(owner.tolist(), shard_of.tolist()):
        r = len(shapes[i])
        off, lengths = geom[at : at + r].tolist(), geom[at + r : at + 2 * r].tolist()
        at += 2 * r
        covered[i][tuple(slice(o, o + n) for o, n in zip(off, lengths))] += 1
        loads[s] = loads.get(s, 0) + math.prod(lengths) * int(its[i])
        counts[s] = counts.get(s, 0) + 1
    assert at == geom.shape[0]
    for c, shape in zip(covered, shapes):
        assert (c == 1).all(), shape
    assert sorted(loads) == list(range(len(loads)))
    for s, load in loads.items():
        if s < regular:
            assert load <= max_size
        else:
            assert counts[s] == 1 and load > max_size


def test_max_shard_fill_edge_cases():
    empty = np.zeros(0, dtype=I64)
    out = _packing.max_shard_fill(np.zeros(1, dtype=I64), empty, empty, 8)
    same(out, (empty, empty, empty, 0))
    # A scalar larger than the max goes alone after the regular shards.
    indptr, dims = csr([[], [2]])
    same(_packing.max_shard_fill(indptr, dims, np.array([8, 2], dtype=I64), 4),
         (np.array([0, 1], dtype=I64), np.array([1, 0], dtype=I64),
          np.array([0, 2], dtype=I64), 1))
    # One huge item: a [2^40, 4] float64 tensor with a 1 GiB max is cut into 2^15 row slabs.
    indptr, dims = csr([[2**40, 4]])
    owner, shard_of, geom, regular = _packing.max_shard_fill(
        indptr, dims, np.array([8], dtype=I64), 2**30
    )
    assert (owner == 0).all()
    assert regular == 2**15 and shard_of.tolist() == list(range(2**15))
    assert geom[:4].tolist() == [0, 0, 2**25, 4]


def test_max_shard_fill_errors():
    indptr, dims = csr([[3], [2**62, 4]])
    kind, text = both("max_shard_fill", _packing, ref_packing, indptr, dims,
                      np.array([4, 1], dtype=I64), 8)
    assert kind is OverflowError
    assert text == "item 1: 1 bytes x shape [4611686018427387904, 4] overflows int64"
    kind, text = both("max_shard_fill", _packing, ref_packing, indptr, dims,
                      np.array([4, 1], dtype=I64), 0)
    assert kind is ValueError and text == "max_shard_size must be >= 1, got 0"
    indptr, dims = csr([[3, -2]])
    kind, text = both("max_shard_fill", _packing, ref_packing, indptr, dims,
                      np.array([4], dtype=I64), 8)
    assert kind is ValueError and text == "item 0: negative dimension -2 on axis 1"


def test_kernels_in_threads_match_twins():
    rng = np.random.default_rng(11)
    cases = []
    for _ in range(16):
        shapes = [list(rng.integers(1, 9, size=rng.integers(0, 4))) for _ in range(200)]
        indptr, dims = csr(shapes)
        its = rng.choice([1, 2, 4, 8], size=len(shapes)).astype(I64)
        sizes = rng.integers(0, 5000, size=2000).astype(I64)
        cases.append((indptr, dims, its, sizes, np.argsort(-sizes, kind="stable")))

    def run(mod_packing, mod_sizes, c):
        indptr, dims, its, sizes, order = c
        return (mod_packing.max_shard_fill(indptr, dims, its, 96),
                mod_packing.first_fit(sizes, order, 7000),
                mod_packing.lpt(sizes, order, 5),
                mod_sizes.shape_nbytes(indptr, dims, its))

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda c: run(_packing, _sizes, c), cases))
    for c, g in zip(cases, got):
        want = run(ref_packing, ref_sizes, c)
        for a, b in zip(g, want):
            same(a, b)

