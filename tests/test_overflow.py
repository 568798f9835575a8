"""Sizes, offsets and counts read from a file whose products or sums wrap int64: every
decoder refuses them with the corrupt-file error naming the file, the entry and the numbers
(docs/FORMAT.md sections 3.1 and 12), instead of reading other bytes."""

from __future__ import annotations

import numpy as np
import pytest

import shardkit
from shardkit.errors import CorruptIndexError
from shardkit.formats.tensorbundle import protos, table
from shardkit.formats.tensorbundle.crc import crc32c, mask

DT = protos.DATA_TYPES

# (dtype, shape, stored size): shape times item size is 2**64 or 2**63, which wraps int64 to
# 0 or -2**63; the stored size is what the wrapped product says
WRAPPING_SHAPES = [
    pytest.param("DT_DOUBLE", [2**61], 0, id="f64-2**61-size-0"),
    pytest.param("DT_FLOAT", [2**61], -(2**63), id="f32-2**61-size--2**63"),
    pytest.param("DT_INT64", [2**60, 2], 0, id="i64-2**60x2-size-0"),
]

ENTRY_POINTS = {
    "open": lambda p: shardkit.open(p).close(),
    "verify": lambda p: shardkit.open(p).verify(),
    "load": lambda p: shardkit.load(p),
    "get_slice": lambda p: shardkit.open(p).get_slice("a", (slice(0, 4),)),
}


@pytest.fixture(params=["whole", "sliced"])
def bundle(request, tmp_path):
    """A bundle of tensors "a" and "b"; "sliced": "b" stored as slices over three data files
    (the index's general path, one message per entry)."""
    state = {"a": np.arange(6, dtype=np.float32), "b": np.arange(4, dtype=np.int64)}
    prefix = tmp_path / "ck"
    policy = shardkit.MaxShardSizePolicy(max_shard_size=24) if request.param == "sliced" else None
    shardkit.save(prefix, state, format="tensorflow", sharding_callback=policy)
    if request.param == "sliced":
        with shardkit.open(prefix) as r:
            assert len(r.info("a").slices) == 1 and len(r.info("b").slices) == 3
    return prefix


def _reseal_entry(prefix, key: bytes, edit) -> None:
    """Let `edit(entry)` change the entry of `key`, set its crc32c to what the data file holds
    over the bytes the entry names (clipped to the file), and write the table sealed."""
    path = prefix.parent / f"{prefix.name}.index"
    items = table.read_table(path.read_bytes(), str(path))
    out = []
    for k, v in items:
        if k == key:
            e = protos.BundleEntryProto.FromString(v)
            edit(e)
            data = (prefix.parent / f"{prefix.name}.data-{e.shard_id:05d}-of-"
                    f"{_num_shards(items):05d}").read_bytes()
            lo = max(0, min(e.offset, len(data)))
            e.crc32c = mask(crc32c(data[lo : lo + max(0, e.size)]))
            v = e.SerializeToString()
        out.append((k, v))
    path.write_bytes(table.build_table(out))


def _num_shards(items) -> int:
    return protos.BundleHeaderProto.FromString(items[0][1]).num_shards


def _set_shape(e, dtype: str, shape: list[int], size: int) -> None:
    e.dtype = DT[dtype]
    del e.shape.dim[:]
    for d in shape:
        e.shape.dim.add(size=d)
    e.size = size


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
@pytest.mark.parametrize("dtype, shape, size", WRAPPING_SHAPES)
def test_tensorbundle_shape_times_item_size_that_wraps(bundle, entry_point, dtype, shape, size):
    _reseal_entry(bundle, b"a", lambda e: _set_shape(e, dtype, shape, size))
    with pytest.raises(CorruptIndexError) as e:
        ENTRY_POINTS[entry_point](bundle)
    text = str(e.value)
    assert "ck.index" in text and "'a'" in text and str(size) in text, text


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
@pytest.mark.parametrize("offset", [2**63 - 8, 2**63 - 1, 2**63 - 24])
def test_tensorbundle_offset_plus_size_that_wraps(bundle, entry_point, offset):
    _reseal_entry(bundle, b"a", lambda e: setattr(e, "offset", offset))
    with pytest.raises(CorruptIndexError, match="past the end") as e:
        ENTRY_POINTS[entry_point](bundle)
    text = str(e.value)
    # the end is the exact sum, not a wrapped one
    assert "'a'" in text and f"[{offset}, {offset + 24})" in text, text
