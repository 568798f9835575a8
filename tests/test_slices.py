import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardkit.errors import SliceSpecError
from shardkit.values.slices import SliceSpec, check_tiling, format_slice_spec, parse_slice_spec


def test_parse_tf_example():
    s = parse_slice_spec("4 6 2,2:0,6")
    assert s == SliceSpec((4, 6), (2, 0), (2, 6))
    assert s.shape == (2, 6)
    assert s.to_index() == (slice(2, 4), slice(0, 6))
    assert not s.is_whole
    assert str(s) == "4 6 2,2:0,6"


def test_whole_spec_needs_shape_and_dash_means_full_axis():
    assert parse_slice_spec("", (3, 5)).is_whole
    with pytest.raises(SliceSpecError, match="needs the tensor's full shape"):
        parse_slice_spec("")
    assert parse_slice_spec("4 6 -:1,2") == SliceSpec((4, 6), (0, 1), (4, 2))


def test_full_shape_must_match_the_tensor():
    msg = r"for shape \[4, 6\], but the tensor has shape \[4, 7\]"
    with pytest.raises(SliceSpecError, match=msg):
        parse_slice_spec("4 6 0,4:0,6", (4, 7))


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("4 6", "range '6' of axis 0 is not offset,length"),
        ("46", "no slice ranges"),
        ("4 x 0,1:0,1", "integers separated by single spaces"),
        ("4 6 0,1", "1 ranges for 2 dimensions"),
        ("4 6 0,1:0", "is not offset,length"),
        ("4 6 0,a:0,6", "not two integers"),
        ("4 6 3,2:0,6", "outside 0..4"),
        ("4 6 -1,2:0,6", "outside 0..4"),
        ("4 6 0,0:0,6", "is empty"),
        ("-4 6 0,1:0,6", "negative dimension"),
    ],
)
def test_malformed_specs(spec, why):
    with pytest.raises(SliceSpecError, match="malformed slice spec") as info:
        parse_slice_spec(spec)
    assert why in str(info.value)
    assert repr(spec) in str(info.value)


def test_non_string_spec():
    with pytest.raises(SliceSpecError, match="must be a str"):
        parse_slice_spec(None)  # type: ignore[arg-type]


def test_intersect():
    a = parse_slice_spec("4 6 0,3:0,4")
    b = parse_slice_spec("4 6 2,2:2,4")
    assert a.intersect(b) == SliceSpec((4, 6), (2, 2), (1, 2))
    assert a.intersect(parse_slice_spec("4 6 3,1:0,6")) is None
    with pytest.raises(SliceSpecError, match="different shapes"):
        a.intersect(parse_slice_spec("5 6 0,1:0,6"))


def test_scalar_spec_is_empty_string():
    assert format_slice_spec((), (), ()) == ""
    assert parse_slice_spec("", ()).is_whole


def test_tiling_accepts_exact_cover():
    specs = ("4 6 0,2:0,6", "4 6 2,2:0,3", "4 6 2,2:3,3")
    check_tiling((4, 6), [parse_slice_spec(s) for s in specs])
    check_tiling((0, 3), [SliceSpec.whole((0, 3))])
    check_tiling((), [SliceSpec.whole(())])


def test_tiling_rejects_gap_overlap_and_foreign_shape():
    with pytest.raises(SliceSpecError, match="there is a gap"):
        check_tiling((4, 6), [parse_slice_spec("4 6 0,2:0,6")])
    with pytest.raises(SliceSpecError, match="overlap"):
        check_tiling((4, 6), [parse_slice_spec("4 6 0,3:0,6"), parse_slice_spec("4 6 2,2:0,6")])
    with pytest.raises(SliceSpecError, match=r"is for shape \[5, 6\]"):
        check_tiling((4, 6), [parse_slice_spec("5 6 0,5:0,6")])


@st.composite
def boxes(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=4)))
    offsets = tuple(draw(st.integers(0, d - 1)) for d in shape)
    lengths = tuple(draw(st.integers(1, d - o)) for d, o in zip(shape, offsets))
    return SliceSpec(shape, offsets, lengths)


@given(boxes())
def test_round_trip(box):
    text = str(box)
    assert parse_slice_spec(text, box.full_shape) == box


@given(st.lists(st.integers(1, 5), min_size=1, max_size=3), st.data())
def test_random_axis_partitions_tile(shape, data):
    axis = data.draw(st.integers(0, len(shape) - 1))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, shape[axis] - 1)), max_size=3))))
    cuts = [c for c in cuts if c < shape[axis]]
    bounds = [0, *cuts, shape[axis]]
    parts = []
    for lo, hi in itertools.pairwise(bounds):
        offsets = [0] * len(shape)
        lengths = list(shape)
        offsets[axis], lengths[axis] = lo, hi - lo
        parts.append(SliceSpec(tuple(shape), tuple(offsets), tuple(lengths)))
    check_tiling(shape, parts)
    if len(parts) > 1:
        with pytest.raises(SliceSpecError):
            check_tiling(shape, parts[1:])
