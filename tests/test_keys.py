"""Checkpoint keys: save refuses, before writing anything, every key a reader would refuse or
misread; the native state walk and the Python walk refuse the same keys with the same words."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.errors import (
    CorruptIndexError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvalidKeyError,
    ShardkitError,
    UnsupportedDTypeError,
)
from shardkit.format import MANIFEST_FILE
from shardkit.sharding.tensors import flatten_columns, shardable_tensors, unflatten
from shardkit.training.checkpoint import Checkpoint
from shardkit.values import keys as sk_keys

A = np.arange(3, dtype=np.float32)
B = np.ones(2, np.int8)


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _save_refused(tmp_path: Path, state, match: str, error=InvalidKeyError):
    """`state` is refused with `error`; nothing is written, an existing checkpoint survives
    overwrite=True byte for byte."""
    fresh = tmp_path / "fresh"
    with pytest.raises(error, match=match) as info:
        shardkit.save(fresh, state)
    assert not fresh.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name != "good"] == []  # no temp left
    good = tmp_path / "good"
    if not good.exists():
        shardkit.save(good, {"w": A})
    before = _files(good)
    with pytest.raises(error, match=match):
        shardkit.save(good, state, overwrite=True)
    assert _files(good) == before
    assert np.array_equal(shardkit.load(good)["w"], A)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good"]
    return info.value


def _plain_and_python(state):
    """The same state twice: as plain dicts (native walk) and under an OrderedDict root (the
    Python walk)."""
    return [state, OrderedDict(state)]


@pytest.mark.parametrize("walk", ["native", "python"])
def test_flattened_collision_names_both_paths(tmp_path, walk):
    state = _plain_and_python({"a/b": A, "a": {"b": B}})[walk == "python"]
    err = _save_refused(tmp_path, state, r"'a/b'")
    msg = str(err)
    assert "state['a/b']" in msg and "state['a']['b']" in msg, msg
    assert isinstance(err, ValueError) and isinstance(err, ShardkitError)


def test_collision_through_a_list_index(tmp_path):
    err = _save_refused(tmp_path, {"l": [A], "l/0": B}, r"'l/0'")
    assert "state['l'][0]" in str(err) and "state['l/0']" in str(err)


def test_collision_through_an_int_key(tmp_path):
    err = _save_refused(tmp_path, OrderedDict([(1, A), ("1", B)]), r"'1'")
    assert "state[1]" in str(err) and "state['1']" in str(err)


@pytest.mark.parametrize("walk", ["native", "python"])
def test_empty_key_is_refused(tmp_path, walk):
    state = _plain_and_python({"": A, "w": B})[walk == "python"]
    err = _save_refused(tmp_path, state, r"empty")
    assert "state['']" in str(err)


@pytest.mark.parametrize("walk", ["native", "python"])
def test_metadata_key_is_reserved(tmp_path, walk):
    state = _plain_and_python({"__metadata__": A})[walk == "python"]
    _save_refused(tmp_path, state, r"'__metadata__'.* is reserved")


@pytest.mark.parametrize("walk", ["native", "python"])
def test_lone_surrogate_is_refused(tmp_path, walk):
    state = _plain_and_python({"ok": B, "x": {"a\ud800": A}})[walk == "python"]
    err = _save_refused(tmp_path, state, r"UTF-8")
    assert "state['x']['a\\ud800']" in str(err)


def test_native_and_python_walk_give_the_same_errors():
    for state in ({"a/b": A, "a": {"b": B}}, {"": A}, {"__metadata__": A},
                  {"x": [{"\udfff": A}]}):
        messages = []
        for s in _plain_and_python(state):
            with pytest.raises(InvalidKeyError) as info:
                flatten_columns(s)
            messages.append(str(info.value))
        assert messages[0] == messages[1]


@pytest.mark.parametrize("bad", [True, 1.5, None, (1, 2), b"k", np.int64(3)])
def test_key_that_is_not_str_or_int(tmp_path, bad):
    err = _save_refused(tmp_path, {"m": {bad: A}}, "is not a str or int", error=TypeError)
    assert isinstance(err, InvalidKeyError) and isinstance(err, TypeError)
    assert f"state['m'][{bad!r}]" in str(err)


def test_str_and_int_subclass_keys_are_stored_as_their_value(tmp_path):
    class Name(str):
        def __str__(self):
            return "other"

    class Num(int):
        def __str__(self):
            return "other"

        __repr__ = __str__

    shardkit.save(tmp_path / "c", {Name("n"): A, "m": {Num(7): B}})
    assert list(shardkit.load(tmp_path / "c")) == ["n", "m/7"]


def test_leaf_and_subtree_under_one_key_round_trip(tmp_path):
    """A reader lists keys flat, so ``a`` and ``a/b`` are told apart; unflatten cannot nest
    them and says so."""
    shardkit.save(tmp_path / "c", {"a": A, "a/b": B})
    got = shardkit.load(tmp_path / "c")
    assert list(got) == ["a", "a/b"]
    assert np.array_equal(got["a"], A) and np.array_equal(got["a/b"], B)
    with pytest.raises(InvalidKeyError, match=r"'a' is a tensor and also the prefix of 'a/b'"):
        unflatten(dict(got))


def test_checkpoint_save_refuses_bad_keys_before_writing(tmp_path):
    ckpt = Checkpoint(data={"a/b": A, "a": {"b": B}})
    with pytest.raises(InvalidKeyError, match=r"'data/a/b'"):
        ckpt.write(tmp_path / "c")
    assert not (tmp_path / "c").exists()
    ckpt = Checkpoint(__metadata__=A)
    for opts in (None, shardkit.CheckpointOptions(enable_async=True)):
        with pytest.raises(InvalidKeyError, match="reserved"):
            ckpt.write(tmp_path / "c", opts)  # async: refused at once, not in the background
        ckpt.sync()
    assert not (tmp_path / "c").exists()


def test_check_keys_is_shared_with_the_reader(tmp_path):
    shardkit.save(tmp_path / "c", {"w": A, "v": B})
    index = tmp_path / "c" / MANIFEST_FILE
    doc = json.loads(index.read_bytes())
    for bad, match in (("__metadata__", "reserved"), ("a\ud800", "UTF-8"), ("", "empty"),
                       ("w", "twice")):
        doc["shardkit"]["tensors"]["key"][1] = bad
        index.write_text(json.dumps(doc))
        with pytest.raises(CorruptIndexError, match=match) as info:
            shardkit.load(tmp_path / "c")
        assert os.fspath(index) in str(info.value)


def test_check_keys_accepts_what_save_writes():
    sk_keys.check_keys(["a", "a/b", "w:4 6 0,2:0,6", "\u00e9", "/", "a//b"])
    with pytest.raises(InvalidKeyError, match="'x' appears twice"):
        sk_keys.check_keys(["x", "y", "x"])


# --- plain ValueError / TypeError from save become ShardkitError subclasses ---------------------


@pytest.mark.parametrize("kwargs, error", [
    ({"threads": 0}, ValueError),
    ({"threads": "2"}, TypeError),
    ({"overwrite": 1}, TypeError),
    ({"progress": "yes"}, TypeError),
    ({"metadata": [1]}, TypeError),
    ({"metadata": {"x": float("nan")}}, TypeError),
    ({"metadata": {1: 2}}, TypeError),
    ({"compression": "lz4"}, ValueError),
    ({"level": 3}, ValueError),
    ({"compression": "zstd", "level": "3"}, TypeError),
    ({"compression": "zstd", "chunk_size": 3}, ValueError),
    ({"compression": "zstd", "chunk_size": 1.5}, TypeError),
    ({"compression": "zstd", "shuffle": 1}, TypeError),
    ({"options": "fast"}, TypeError),
    ({"options": shardkit.CheckpointOptions(enable_async=True)}, ValueError),
])
def test_bad_save_arguments_raise_shardkit_errors(tmp_path, kwargs, error):
    given = {k: kwargs.pop(k) for k in list(kwargs)
             if k in ("threads", "compression", "level", "chunk_size", "shuffle")}
    with pytest.raises(error) as info:
        options = shardkit.CheckpointOptions(**given) if given else kwargs.pop("options", None)
        shardkit.save(tmp_path / "c", {"w": A}, options=options, **kwargs)
    assert isinstance(info.value, ShardkitError), type(info.value)
    assert isinstance(info.value, InvalidArgumentError if error is ValueError
                      else InvalidArgumentTypeError)
    assert not (tmp_path / "c").exists()


def test_bad_state_raises_shardkit_errors(tmp_path):
    with pytest.raises(InvalidArgumentTypeError, match="state must be a mapping"):
        shardkit.save(tmp_path / "c", [A])
    with pytest.raises(InvalidArgumentTypeError, match=r"state at '<root>' must be a mapping"):
        shardable_tensors(_Opaque())
    with pytest.raises(UnsupportedDTypeError):  # string arrays are stored; objects are not
        shardkit.save(tmp_path / "c", {"s": np.array([1, "x"], dtype=object)})
    with pytest.raises(shardkit.PolicyError):
        shardkit.DefaultShardingPolicy(max_shard_size=0)
    with pytest.raises(InvalidArgumentTypeError):
        shardkit.DefaultShardingPolicy(max_shard_size="1")


class _Opaque:
    pass


def test_error_classes_are_exported():
    for name in ("InvalidKeyError", "InvalidArgumentError", "InvalidArgumentTypeError"):
        assert issubclass(getattr(shardkit, name), ShardkitError)
        assert getattr(shardkit, name) is getattr(shardkit.errors, name)
    assert issubclass(InvalidKeyError, ValueError)
