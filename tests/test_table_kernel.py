"""The header-table kernel against its pure-Python twin and json.dumps: same bytes, same errors."""

from __future__ import annotations

import importlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

PURE_PYTHON = os.environ.get("SHARDKIT_PUREPYTHON", "") == "1"
twin = importlib.import_module("shardkit._reference._table")
kernel = twin if PURE_PYTHON else importlib.import_module("shardkit._kernels._table")
needs_kernel = pytest.mark.skipif(
    PURE_PYTHON, reason="SHARDKIT_PUREPYTHON=1: the compiled kernel is not under test"
)
IMPLS = [pytest.param(kernel, id="kernel", marks=needs_kernel), pytest.param(twin, id="twin")]


def _offsets(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _json_dumps_entries(names, dtype_names, shapes, begins, ends) -> bytes:
    """The oracle: each entry as json.dumps writes it in a safetensors header."""
    return "".join(
        "," + json.dumps(
            {name: {"dtype": dtype, "shape": list(shape), "data_offsets": [b, e]}},
            separators=(",", ":"), ensure_ascii=False,
        )[1:-1]
        for name, dtype, shape, b, e in zip(names, dtype_names, shapes, begins, ends)
    ).encode("utf-8")


# Text biased towards the bytes that need escaping, plus any other code point but surrogates.
_names = st.text(
    st.sampled_from('"\\\n\r\t\b\f\x00\x01\x1f\x7f /aé\u2028😀')
    | st.characters(exclude_categories=("Cs",)),
    max_size=40,
)
_dtypes = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0x7E, exclude_characters='"\\'), max_size=8
)
_shapes = st.lists(st.integers(0, 2**62) | st.integers(0, 9), max_size=5)
_int64 = st.integers(-(2**63), 2**63 - 1)


@given(
    entries=st.lists(st.tuples(_names, _dtypes, _shapes, st.booleans(), _int64, _int64),
                     max_size=30),
)
def test_entries_match_twin_and_json_dumps(entries):
    names = [e[0] for e in entries]
    dtype_names = [e[1] for e in entries]
    shapes = [tuple(e[2]) if e[3] else list(e[2]) for e in entries]
    begins = _offsets(*[e[4] for e in entries])
    ends = _offsets(*[e[5] for e in entries])
    expected = _json_dumps_entries(names, dtype_names, shapes, begins.tolist(), ends.tolist())
    assert twin.encode_header_entries(names, dtype_names, shapes, begins, ends) == expected
    if not PURE_PYTHON:
        assert kernel.encode_header_entries(names, dtype_names, shapes, begins, ends) == expected


@pytest.mark.parametrize("impl", IMPLS)
def test_explicit_bytes(impl):
    assert impl.encode_header_entries([], [], [], _offsets(), _offsets()) == b""
    assert impl.encode_header_entries(
        ["a", "group12/t12345"], ["F32", "BF16"], [(1, 1234), ()], _offsets(0, 4936),
        _offsets(4936, 4938),
    ) == (
        b',"a":{"dtype":"F32","shape":[1,1234],"data_offsets":[0,4936]}'
        b',"group12/t12345":{"dtype":"BF16","shape":[],"data_offsets":[4936,4938]}'
    )
    assert impl.encode_header_entries(
        ['q"b\\s\n\r\t\b\f\x00\x1f\x7fé😀'], ["I8"], [[0, 2**62, 2**63 - 1]],
        _offsets(-(2**63)), _offsets(2**63 - 1),
    ) == (
        b',"q\\"b\\\\s\\n\\r\\t\\b\\f\\u0000\\u001f\x7f\xc3\xa9\xf0\x9f\x98\x80":{"dtype":"I8",'
        b'"shape":[0,4611686018427387904,9223372036854775807],'
        b'"data_offsets":[-9223372036854775808,9223372036854775807]}'
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_dims_may_be_numpy_integers(impl):
    out = impl.encode_header_entries(
        ["x"], ["U8"], [(np.int64(3), np.uint64(2**63 - 1), np.int8(0))], _offsets(0), _offsets(0)
    )
    assert out == b',"x":{"dtype":"U8","shape":[3,9223372036854775807,0],"data_offsets":[0,0]}'


@pytest.mark.parametrize("impl", IMPLS)
def test_long_and_many_entries_grow_the_buffer(impl):
    n = 5000
    names = [f"layer{i}/" + '"\n' * (i % 7) * 300 for i in range(n)]
    dtype_names = ["F64"] * n
    shapes = [(i, 2**62) for i in range(n)]
    begins = np.arange(n, dtype=np.int64) * 8
    ends = begins + 8
    out = impl.encode_header_entries(names, dtype_names, shapes, begins, ends)
    assert out == _json_dumps_entries(names, dtype_names, shapes, begins.tolist(), ends.tolist())
    assert json.loads("{" + out[1:].decode() + "}")[names[-1]]["shape"] == [n - 1, 2**62]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["\ud800", 'ab"\\\udfff', "é\udc80"])
def test_surrogate_name_is_a_unicode_encode_error(impl, name):
    with pytest.raises(UnicodeEncodeError) as caught:
        impl.encode_header_entries(["ok", name], ["F32"] * 2, [()] * 2, _offsets(0, 0),
                                   _offsets(0, 0))
    with pytest.raises(UnicodeEncodeError) as direct:
        name.encode("utf-8")
    assert str(caught.value) == str(direct.value)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("shape", "error", "message"),
    [
        ((2, -1), ValueError, r"entry 1 \('t'\): shape dim -1 is outside 0\.\.2\*\*63-1"),
        ([2**63], ValueError, r"entry 1 \('t'\): shape dim 9223372036854775808 is outside"),
        ((np.int32(-4),), ValueError, r"entry 1 \('t'\): shape dim -4 is outside"),
        ((2.0,), TypeError, r"entry 1 \('t'\): shape dims must be ints, got float 2\.0"),
        ((True,), TypeError, r"entry 1 \('t'\): shape dims must be ints, got bool True"),
        (("3",), TypeError, r"entry 1 \('t'\): shape dims must be ints, got str '3'"),
        (3, TypeError, r"entry 1 \('t'\): shape must be a tuple or list of ints, got int"),
        (np.array([1, 2]), TypeError, r"shape must be a tuple or list of ints, got ndarray"),
        (None, TypeError, r"shape must be a tuple or list of ints, got NoneType"),
    ],
    ids=["negative", "too-big", "np-negative", "float", "bool", "str", "int", "ndarray", "none"],
)
def test_bad_shapes(impl, shape, error, message):
    with pytest.raises(error, match=message):
        impl.encode_header_entries(["s", "t"], ["F32", "F32"], [(1,), shape], _offsets(0, 4),
                                   _offsets(4, 8))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ['F"32', "F\\", "F\n", "F\x7f", "é", "F\ud800"])
def test_dtype_names_needing_escapes_are_rejected(impl, dtype):
    with pytest.raises(ValueError, match=r"entry 0 \('a'\): dtype name .* is not printable ASCII"):
        impl.encode_header_entries(["a"], [dtype], [()], _offsets(0), _offsets(0))


@pytest.mark.parametrize("impl", IMPLS)
def test_non_str_names_and_dtypes(impl):
    with pytest.raises(TypeError, match="entry 0: names must be str, got bytes"):
        impl.encode_header_entries([b"a"], ["F32"], [()], _offsets(0), _offsets(0))
    with pytest.raises(TypeError, match=r"entry 0 \('a'\): dtype names must be str, got NoneType"):
        impl.encode_header_entries(["a"], [None], [()], _offsets(0), _offsets(0))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("which", range(5))
def test_length_mismatch(impl, which):
    args = [["a", "b"], ["F32", "F32"], [(), ()], _offsets(0, 0), _offsets(0, 0)]
    args[which] = args[which][:1]
    counts = ", ".join("1" if k == which else "2" for k in range(5))
    with pytest.raises(ValueError, match=f"must have equal lengths, got {counts}"):
        impl.encode_header_entries(*args)


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_argument_types(impl):
    good = [["a", "b"], ["F32"] * 2, [(), ()], _offsets(0, 0), _offsets(0, 0)]
    for position, bad, error in [
        (0, ("a", "b"), TypeError), (1, None, TypeError), (2, ((), ()), TypeError),
        (3, None, TypeError), (3, [0, 0], TypeError), (4, np.zeros(2), ValueError),
        (4, np.zeros(2, np.int32), ValueError), (3, np.zeros(2, np.uint64), ValueError),
        (3, np.zeros((2, 1), np.int64), ValueError), (4, np.zeros(4, np.int64)[::2], ValueError),
    ]:
        args = list(good)
        args[position] = bad
        with pytest.raises(error):
            impl.encode_header_entries(*args)


@needs_kernel
def test_kernel_survives_lists_shrinking_during_the_call():
    names = ["a", "b"]

    class Shrinks:
        def __index__(self) -> int:
            names.clear()
            return 1

    with pytest.raises(RuntimeError, match="changed size during the call"):
        kernel.encode_header_entries(names, ["F32", "F32"], [(Shrinks(),), ()], _offsets(0, 0),
                                     _offsets(0, 0))


@needs_kernel
def test_kernel_in_threads_gives_the_same_bytes():
    n = 2000
    args = ([f"t{i}/é\"{i}" for i in range(n)], ["F16"] * n, [(i, 3) for i in range(n)],
            np.arange(n, dtype=np.int64), np.arange(1, n + 1, dtype=np.int64))
    expected = twin.encode_header_entries(*args)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: kernel.encode_header_entries(*args), range(16)))
    assert all(r == expected for r in results)


@pytest.mark.parametrize("impl", IMPLS)
def test_array_nbytes(impl):
    arrays = [
        np.zeros((2, 3), np.float32), np.zeros(0, np.int8), np.array(5, np.int64),
        np.zeros((4, 6), np.float64)[::2, 1::3], np.zeros(7, ml_dtypes.bfloat16),
        np.zeros((2, 2), np.complex128).T, memoryview(b"abcde"),
    ]
    out = impl.array_nbytes(arrays)
    assert out.dtype == np.int64
    assert out.tolist() == [24, 0, 8, 32, 14, 64, 5]
    assert impl.array_nbytes([]).tolist() == []


@pytest.mark.parametrize("impl", IMPLS)
def test_array_nbytes_errors(impl):
    with pytest.raises(TypeError):
        impl.array_nbytes((np.zeros(1),))
    with pytest.raises(AttributeError):
        impl.array_nbytes([np.zeros(1), 3])


@pytest.mark.parametrize("impl", IMPLS)
def test_array_addresses(impl):
    w = np.zeros((4, 6), np.float64)
    arrays = [w, w[:], w[1:], w[::2, 1::3], w.T, np.zeros(0, np.int8), w[:0], np.array(5)]
    out = impl.array_addresses(arrays)
    base = w.__array_interface__["data"][0]
    assert out.dtype == np.int64
    assert out.tolist() == [base, base, base + 48, base + 8, base, 0, 0,
                            arrays[-1].__array_interface__["data"][0]]
    assert impl.array_addresses([]).tolist() == []
    with pytest.raises(TypeError, match=r"arrays\[1\] is a memoryview, not a numpy array"):
        impl.array_addresses([w, memoryview(b"ab")])
    with pytest.raises(TypeError):
        impl.array_addresses((w,))


@pytest.mark.parametrize("impl", IMPLS)
def test_describe_arrays_one_pass(impl):
    from shardkit.values.dtypes import STORABLE

    values = [np.zeros((2, 3), np.float32), np.arange(5, dtype=np.int8), np.array(1.0),
              np.asfortranarray(np.ones((3, 2), np.uint16)), np.zeros(0, np.bool_)]
    dtypes, nbytes, shapes = impl.describe_arrays(values, STORABLE)
    assert dtypes == [a.dtype for a in values]
    assert nbytes.dtype == np.int64 and nbytes.tolist() == [24, 5, 8, 12, 0]
    assert shapes == [(2, 3), (5,), (), (3, 2), (0,)]
    assert impl.describe_arrays([], STORABLE)[1].shape == (0,)
    # anything that is not exactly a numpy array of a storable dtype: None, the caller converts
    class Sub(np.ndarray):
        pass

    for odd in ([1.0], np.zeros(2, ">f4"), np.zeros(2, np.clongdouble), np.zeros(2).view(Sub)):
        assert impl.describe_arrays([values[0], odd], STORABLE) is None
    with pytest.raises(TypeError):
        impl.describe_arrays((values[0],), STORABLE)


# --- flatten_plain: the state walk of shardkit.sharding.tensors.flatten, for plain containers

_leaves = st.one_of(st.integers(0, 9).map(lambda n: np.arange(n, dtype=np.float32)),
                    st.just("text"), st.none(), st.floats(allow_nan=False))
_states = st.recursive(
    _leaves,
    lambda children: st.one_of(
        st.dictionaries(st.text(max_size=4), children, max_size=4),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
    ),
    max_leaves=30,
)


@given(st.dictionaries(st.text(max_size=4), _states, max_size=5))
def test_flatten_plain_is_flatten(state):
    from shardkit.sharding.tensors import SEPARATOR, flatten

    expected = flatten(state)
    for impl in (kernel, twin):
        keys, values = impl.flatten_plain(state, SEPARATOR)
        assert keys == [k for k, _ in expected]
        assert all(a is b for a, (_, b) in zip(values, expected, strict=True))


@pytest.mark.parametrize("impl", IMPLS)
def test_flatten_plain_leaves_other_states_to_python(impl):
    """Anything but plain dicts with str keys, lists and tuples: None (the Python walk
    handles it, and raises its errors)."""
    from collections import OrderedDict
    from types import MappingProxyType

    a = np.zeros(2)
    deep: dict = {"x": a}
    for _ in range(300):
        deep = {"d": deep}
    for state in ({"a": {1: a}}, {"a": OrderedDict(b=a)}, {"a": [MappingProxyType({"b": a})]},
                  OrderedDict(a=a), [a], deep):
        assert impl.flatten_plain(state, "/") is None
    assert impl.flatten_plain({"a": {"b": a}, "c": [a, (a,)]}, ".") == (
        ["a.b", "c.0", "c.1.0"], [a, a, a])
    assert impl.flatten_plain({}, "/") == ([], [])
    with pytest.raises(TypeError):
        impl.flatten_plain({}, None)
