"""The views kernel (csrc/_views.pyx) against its pure-Python twin."""

from __future__ import annotations

import gc
import importlib
import os
import re
import sys

import ml_dtypes
import numpy as np
import pytest

PURE_PYTHON = os.environ.get("SHARDKIT_PUREPYTHON") == "1"
twin = importlib.import_module("shardkit._reference._views")
kernel = None if PURE_PYTHON else importlib.import_module("shardkit._kernels._views")
IMPLS = [pytest.param(twin, id="twin")] + (
    [] if PURE_PYTHON else [pytest.param(kernel, id="kernel")]
)

DTYPES = [np.dtype(t) for t in (np.float64, np.float32, np.int16, np.uint8, np.bool_)] + [
    np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)]


def _base(n: int = 256, writeable: bool = False) -> np.ndarray:
    base = np.arange(n, dtype=np.uint8)
    base.flags.writeable = writeable
    return base


@pytest.mark.skipif(PURE_PYTHON, reason="SHARDKIT_PUREPYTHON=1: the twin is the implementation")
def test_kernel_matches_twin_on_random_layouts():
    rng = np.random.default_rng(3)
    base = _base(4096)
    for _ in range(200):
        n = int(rng.integers(0, 12))
        dtypes = [DTYPES[int(i)] for i in rng.integers(0, len(DTYPES), n)]
        shapes = [tuple(int(d) for d in rng.integers(0, 4, int(rng.integers(0, 4))))
                  for _ in range(n)]
        begins = [int(b) for b in rng.integers(0, 3000, n)]  # any offset, aligned or not
        start = int(rng.integers(0, 8))
        got = kernel.make_views(base, start, begins, dtypes, shapes)
        want = twin.make_views(base, start, begins, dtypes, shapes)
        for g, w in zip(got, want):
            assert (g.dtype, g.shape, g.flags.writeable, g.flags.aligned) == (
                w.dtype, w.shape, w.flags.writeable, w.flags.aligned)
            assert g.flags.c_contiguous and g.tobytes() == w.tobytes()


@pytest.mark.parametrize("impl", IMPLS)
def test_views_share_memory_and_keep_the_base_alive(impl):
    base = _base(64, writeable=True)
    views = impl.make_views(base, 8, [0, 4], [np.dtype(np.float32), np.dtype(np.uint8)],
                            [(1,), (2, 2)])
    assert views[1].tolist() == [[12, 13], [14, 15]]
    assert all(v.flags.writeable for v in views)
    views[1][0, 0] = 99
    assert base[12] == 99
    readonly = impl.make_views(_base(64), 0, [3], [np.dtype(np.uint8)], [()])[0]
    assert not readonly.flags.writeable and int(readonly) == 3
    held = sys.getrefcount(base)
    del views
    gc.collect()
    assert sys.getrefcount(base) < held
    v = impl.make_views(_base(16), 0, [0], [np.dtype(np.uint8)], [(16,)])[0]
    gc.collect()  # the base array is referenced only by the view now
    assert v.tolist() == list(range(16))


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_ranges_and_inputs_are_refused(impl):
    base = _base(64)
    f8 = np.dtype(np.float64)
    cases = [
        (([60], [f8], [(1,)]), "view 0: bytes \\[60, 68\\) are outside the 64-byte buffer"),
        (([-1], [f8], [()]), "outside the 64-byte buffer"),
        (([0], [f8], [(2**40, 2**40)]), "needs more than the 64-byte buffer"),
        (([0], [f8], [(2, -1)]), "negative dimension"),
        (([0, 0], [f8], [()]), "differ in length"),
    ]
    for (begins, dtypes, shapes), message in cases:
        with pytest.raises(ValueError, match=message):
            impl.make_views(base, 0, begins, dtypes, shapes)
    assert impl.make_views(base, 64, [0], [f8], [(0, 5)])[0].shape == (0, 5)  # empty at the end
    with pytest.raises(ValueError, match="contiguous 1-d array of bytes"):
        impl.make_views(np.zeros((2, 2), np.uint8), 0, [], [], [])
    with pytest.raises(ValueError, match="contiguous 1-d array of bytes"):
        impl.make_views(np.zeros(4, np.float32), 0, [], [], [])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("nd", [32, 33, 40, 64])
def test_views_of_up_to_64_dimensions(impl, nd):
    """numpy 2 arrays have up to 64 dimensions; the kernel takes all of them."""
    shape = (2,) + (1,) * (nd - 2) + (3,)
    (view,) = impl.make_views(_base(), 8, [0], [np.dtype(np.uint8)], [shape])
    assert view.shape == shape
    np.testing.assert_array_equal(view.reshape(-1), np.arange(8, 14, dtype=np.uint8))


@pytest.mark.parametrize("impl", IMPLS)
def test_views_of_more_than_64_dimensions_are_refused(impl):
    with pytest.raises(ValueError, match="65"):
        impl.make_views(_base(), 0, [0], [np.dtype(np.uint8)], [(1,) * 65])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("start, begin", [
    (8, 2**63 - 4),  # the sum wraps int64
    (8, 2**63 - 1),
    (0, 2**63),  # not an int64 at all
    (0, 2**64),
    (8, -(2**63)),
    (2**62, 2**62),
])
def test_ranges_whose_offset_wraps_int64_are_refused_with_the_exact_numbers(impl, start, begin):
    """start + begin from a file, near or past int64's end: the same refusal, worded with
    the exact (unwrapped) numbers, in the kernel and its twin."""
    f4 = np.dtype(np.float32)
    end = start + begin + 8
    with pytest.raises(ValueError, match=re.escape(
            f"view 0: bytes [{start + begin}, {end}) are outside the 64-byte buffer")):
        impl.make_views(_base(64), start, [begin], [f4], [(2,)])
