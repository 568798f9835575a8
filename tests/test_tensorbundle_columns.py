"""The TensorBundle index read by one protobuf decode of all entries (`columns.framed_columns`)
against the entry-by-entry decode (`columns.entry_columns`): the same table for every entry
TensorFlow writes, and the general path taken (same table, same errors) for every entry that
decodes to the same BundleEntryProto by another encoding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.adapters.tensorbundle import adapter, columns, protos, table
from shardkit.errors import CorruptIndexError


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


@pytest.fixture()
def bundle(tmp_path):
    """A bundle of whole tensors, a scalar, an empty one and a string tensor (shardkit writes
    bundles as TensorFlow does: tests/test_tensorbundle.py)."""
    state = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.int64),
             "c": np.array(2.5, np.float64), "d": np.zeros((0, 3), np.int8),
             "s": np.array([b"x", b"yz"], object)}
    shardkit.save(tmp_path / "ck", state, format="tensorflow",
                  options=shardkit.CheckpointOptions(durable=False))
    return tmp_path / "ck", state


def _columns(index) -> tuple:
    return (index.keys, index.dtypes, index.shapes, index.slice_tensor, index.slice_shard,
            index.begins, index.slice_xxh3, index.aligned,
            None if index.strings is None else (index.strings.keys, index.strings.offsets,
                                                index.strings.sizes, index.strings.crcs))


@pytest.fixture()
def general(monkeypatch):
    """Counts the bundles read by the general path; `both(prefix)` opens one by each path."""
    calls = []
    entry_columns = columns.entry_columns

    def counted(*args):
        calls.append(args[0])
        return entry_columns(*args)

    monkeypatch.setattr(adapter, "entry_columns", counted)  # the name decode_bundle calls

    def both(prefix):
        """(table read as usual, table read by the general path, load); `calls` then counts
        the usual reads that took the general path, plus one (the forced one)."""
        with shardkit.open(prefix) as r:
            fast = _columns(r.index)
        got = shardkit.load(prefix)
        del calls[1:]  # open and load: the same choice
        with monkeypatch.context() as m:
            m.setattr(adapter, "framed_columns", lambda *a: None)
            with shardkit.open(prefix) as r:
                slow = _columns(r.index)
        return fast, slow, got

    return calls, both


def test_tensorflow_encodings_take_the_one_decode(bundle, general):
    prefix, state = bundle
    calls, both = general
    fast, slow, got = both(prefix)
    assert fast == slow and len(calls) == 1  # the forced one only
    for k, v in state.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].tolist() == (
            v.tolist()), k


def test_tensorflows_own_files_take_the_one_decode(tf, tmp_path, general):
    calls, both = general
    variables = {f"v{i}": tf.Variable(np.full((i % 3 + 1,), i, np.float32)) for i in range(40)}
    prefix = tf.train.Checkpoint(**variables).write(str(tmp_path / "tf" / "ck"))
    fast, slow, got = both(prefix)
    assert fast == slow and len(calls) == 1
    reader = tf.train.load_checkpoint(prefix)
    for key, _ in tf.train.list_variables(prefix):
        assert np.array_equal(got[key], reader.get_tensor(key)), key


def _reencode(prefix, key: bytes, encode) -> None:
    """Replace the entry of `key` by `encode(entry, its canonical bytes)`, resealed."""
    path = prefix.parent / f"{prefix.name}.index"
    items = table.read_table(path.read_bytes(), str(path))
    out = []
    for k, v in items:
        out.append((k, encode(protos.BundleEntryProto.FromString(v), v) if k == key else v))
    path.write_bytes(table.build_table(out))


def _tag(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


# Each: the same BundleEntryProto as protobuf decodes it, another encoding of it
REENCODINGS = {
    # a field twice: the last one counts
    "offset twice": lambda e, v: _tag(4, 0) + _varint(12345) + _without(e, "offset") + _tag(
        4, 0) + _varint(e.offset),
    # an explicit zero, which encoders leave out
    "explicit zero shard_id": lambda e, v: v + _tag(3, 0) + _varint(0),
    # a varint longer than it needs to be
    "overlong size": lambda e, v: _without(e, "size") + _tag(5, 0) + bytes(
        [(e.size & 0x7F) | 0x80, 0x80, 0x00]),
    # a field of no BundleEntryProto field number: kept as an unknown field
    "unknown field": lambda e, v: v + _tag(15, 0) + _varint(7),
    # offset sent packed (length-delimited): not how an int64 is encoded, so an unknown field
    # for BundleEntryProto (offset stays 0) but a value for a repeated field
    "packed offset": lambda e, v: _without(e, "offset") + _tag(4, 2) + _varint(1) + _varint(5),
    # the shape twice: BundleEntryProto merges them (here: an empty one, no dims added)
    "shape twice": lambda e, v: v + _tag(2, 2) + _varint(0),
    # a dim in each of two shape fields: merged, the dims of both
    "shape split": lambda e, v: _without(e, "shape") + _tag(2, 2) + _varint(4) + _tag(
        2, 2) + _varint(2) + _tag(1, 0) + _varint(2) + _tag(2, 2) + _varint(4) + _tag(
        2, 2) + _varint(2) + _tag(1, 0) + _varint(2),
}


def _without(entry, name: str) -> bytes:
    copy = protos.BundleEntryProto()
    copy.CopyFrom(entry)
    copy.ClearField(name)
    return copy.SerializeToString()


@pytest.mark.parametrize("how", sorted(REENCODINGS))
def test_other_encodings_take_the_general_path(bundle, general, how):
    prefix, _ = bundle
    calls, both = general
    _reencode(prefix, b"b", REENCODINGS[how])
    try:
        fast, slow, got = both(prefix)
    except CorruptIndexError as e:  # the general path's words, whichever path raised it
        with pytest.raises(CorruptIndexError) as again:
            with pytest.MonkeyPatch.context() as m:
                m.setattr(adapter, "framed_columns", lambda *a: None)
                shardkit.open(prefix)
        assert str(e) == str(again.value)
        assert calls  # the one decode declined: the general path raised it
        return
    assert fast == slow
    assert len(calls) == 2  # the one decode declined the re-encoded entry
    assert np.array_equal(got["b"].reshape(-1), np.arange(4)), how
    assert got["b"].shape == {"shape split": (2, 2)}.get(how, (4,))


def test_a_crc32c_of_zero_and_a_dtype_of_zero(bundle, general):
    """Fields an encoder leaves out when 0: read as 0 by either path (DT_INVALID refused)."""
    prefix, _ = bundle
    calls, both = general
    _reencode(prefix, b"b", lambda e, v: _without(e, "crc32c"))
    fast, slow, _ = both(prefix)
    row = fast[0].index("b")
    assert fast == slow and fast[6][fast[3].index(row)] == "00000000" and len(calls) == 1
    _reencode(prefix, b"b", lambda e, v: _without(e, "dtype"))
    with pytest.raises(shardkit.ShardkitError, match="DT_INVALID") as e:
        shardkit.open(prefix)
    assert "'b'" in str(e.value)


def test_misaligned_entries_are_copied_aligned_ones_are_views(tf, tmp_path):
    """TensorFlow packs entries back to back: a float64 after a 3-byte tensor starts at an odd
    offset; that file is marked not aligned, and its values still come back right."""
    state = {"a": np.arange(3, dtype=np.int8), "b": np.arange(5, dtype=np.float64)}
    tf.raw_ops.SaveV2(prefix=str(tmp_path / "ck"), tensor_names=list(state),
                      shape_and_slices=["", ""], tensors=list(state.values()))
    with shardkit.open(tmp_path / "ck") as r:
        assert r.index.aligned == [False] and r.index.begins == [[0, 3]]
        assert r["b"].tolist() == list(range(5)) and r["a"].tolist() == [0, 1, 2]
    got = shardkit.load(tmp_path / "ck")
    assert got["b"].tolist() == list(range(5)) and got["b"].ctypes.data % 8 == 0
    shardkit.save(tmp_path / "ok", state, format="tensorflow",
                  options=shardkit.CheckpointOptions(durable=False))
    with shardkit.open(tmp_path / "ok") as r:
        assert r.index.aligned == [True]  # shardkit's writer aligns every entry
        assert r["b"].tolist() == list(range(5))


def test_checksum_column_spells_each_entrys_crc32c(bundle):
    """`slice_xxh3` of a bundle is made on first use: per stored slice, the 8 hex digits of
    its entry's crc32c as the entry itself records it; it compares, indexes, iterates and
    encodes as the list it stands for."""
    import orjson

    prefix, _ = bundle
    with shardkit.open(prefix) as r:
        index = r.index
        column = index.slice_xxh3
        assert isinstance(column, adapter.HexColumn)
        body = table.read_table(Path(f"{prefix}.index").read_bytes(), str(prefix))[1:]
        crcs = {k.decode(): protos.BundleEntryProto.FromString(v).crc32c for k, v in body}
        want = [f"{crcs[index.keys[row]]:08x}" for row in index.slice_tensor]
        assert len(column) == len(want) and list(column) == want and column == want
        assert column[0] == want[0] and column[-1] == want[-1] and column[1:] == want[1:]
        assert column != want[::-1] and orjson.loads(orjson.dumps(column, default=list)) == want
        assert r.verify() == len(want) + 1  # and the string tensor's


def test_a_load_reads_each_string_entry_once_verify_reads_it_again(bundle, monkeypatch):
    """The reader reads the string tensors with its shards right after the index and keeps
    them for the load; verify never trusts that copy."""
    from shardkit.adapters.tensorbundle.strings import BundleStrings

    prefix, _ = bundle
    reads = []
    stored = BundleStrings._stored

    def counted(self, directory, row):
        reads.append(row)
        return stored(self, directory, row)

    monkeypatch.setattr(BundleStrings, "_stored", counted)
    got = shardkit.load(prefix)
    assert got["s"].tolist() == [b"x", b"yz"] and len(reads) == 1
    with shardkit.open(prefix) as r:
        assert r["s"].tolist() == [b"x", b"yz"] and r["s"].tolist() == [b"x", b"yz"]
        assert len(reads) == 2
        r.verify()
        assert len(reads) == 3


def test_keys_decode_as_utf8_strictly_newlines_and_all(tmp_path):
    """The keys are decoded in one call unless one holds a newline: both ways give every key
    back exactly, and a key that is not valid UTF-8 is refused by name either way."""
    state = {"a\nb": np.arange(3, dtype=np.int32), "plain": np.ones(2, np.float32),
             "é/ü": np.zeros(1, np.int8)}
    for keys in (["plain", "é/ü"], list(state)):
        prefix = tmp_path / f"ck{len(keys)}"
        shardkit.save(prefix, {k: state[k] for k in keys}, format="tensorflow",
                      options=shardkit.CheckpointOptions(durable=False))
        got = shardkit.load(prefix)
        assert sorted(got) == sorted(keys)
        assert all(np.array_equal(got[k], state[k]) for k in keys)
        path = prefix.parent / f"{prefix.name}.index"
        items = table.read_table(path.read_bytes(), str(path))
        bad = [(b"\xc3" if k == "é/ü".encode() else k, v) for k, v in items]
        path.write_bytes(table.build_table(bad))
        with pytest.raises(CorruptIndexError, match=r"key .*\\xc3.* is not valid UTF-8"):
            shardkit.load(prefix)
