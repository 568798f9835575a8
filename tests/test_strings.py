"""String tensors (docs/FORMAT.md section 2.3): numpy bytes / str / object arrays round-trip
through save, load, get, get_slice, restore_into, verify and Checkpoint, in a file of their own
beside safetensors shards that stay plain; every malformed part is a clear error.
(tf.string is covered in test_tensorflow_values.py.)"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import shardkit
from shardkit.errors import (
    CheckpointFormatError,
    ChecksumError,
    CorruptHeaderError,
    CorruptIndexError,
    GenerationMismatchError,
    InvalidKeyError,
    MissingShardError,
    RestoreMismatchError,
    ShardkitError,
    TruncatedShardError,
    UnsupportedDTypeError,
)
from shardkit.format import MANIFEST_FILE
from shardkit.values import strings as sks


def _objects(items, shape=None):
    a = np.empty(len(items), object)
    a[:] = items
    return a.reshape(shape if shape is not None else (len(items),))


def string_state():
    scalar = np.empty((), object)
    scalar[()] = b"\x00one\xff"
    return {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "text": {
            "tf_form": _objects([b"a", b"", b"\x00\x00", b"x" * 300], (2, 2)),
            "py_str": _objects(["h\u00e9llo", "", "\U0001f600"]),
            "u": np.array([["ab", "cde"], ["", "\u00e9"]]),        # <U3
            "s": np.array([b"q", b"rr\x00s", b""], dtype="S6"),     # inner NUL kept
            "scalar": scalar,
            "empty": np.zeros((0, 3), dtype="U2"),
            "u_scalar": np.str_("z\u00fc"),
        },
        "step": np.int64(3),
    }


def same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.tolist() == b.tolist() if a.dtype.kind == "O" else a.tobytes() == b.tobytes()


def flat(state):
    from shardkit.sharding.tensors import flatten

    return dict(flatten(state))


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "c"
    shardkit.save(path, string_state(), options=shardkit.CheckpointOptions(durable=False))
    return path


def test_every_kind_round_trips_with_its_own_dtype(saved):
    want = flat(string_state())
    got = shardkit.load(saved)
    assert list(got) == ["w", "step", *[k for k in want if k.startswith("text/")]]  # saved order
    for key, value in want.items():
        assert same(got[key], value), key
    # object arrays of bytes come back holding bytes, of str holding str
    assert type(got["text/tf_form"].flat[0]) is bytes
    assert type(got["text/py_str"][0]) is str
    assert got["text/u_scalar"].dtype == np.dtype("<U2") and got["text/u_scalar"].shape == ()
    with shardkit.open(saved, mmap=False) as r:
        assert r.keys() == ["w", "step", *[k for k in want if k.startswith("text/")]]
        assert len(r) == len(want) and "text/u" in r and "text/nope" not in r
        for key, value in want.items():
            assert same(r.get(key), value) and same(r[key], value), key
        assert same(r.get_slice("text/tf_form", (slice(None), 1)), want["text/tf_form"][:, 1])
        assert same(r.get_slice("text/u", (1, slice(None, None, -1))), want["text/u"][1, ::-1])
        assert same(r.get_slice("text/scalar", ()), want["text/scalar"])
        with pytest.raises(shardkit.errors.SliceIndexError):
            r.get_slice("text/py_str", 7)
        info = r.info("text/u")
        assert (info.dtype_name, info.dtype, info.shape) == ("STRING", np.dtype("<U3"), (2, 2))
        assert info.slices[0].file == sks.STRING_FILE and len(info.slices[0].xxh3) == 16
        assert r.verify() == 2 + len(want) - 2  # every tensor and string tensor compared
    assert same(shardkit.load(saved, ["text/s", "w"])["text/s"], want["text/s"])


def test_manifest_section_version_and_plain_safetensors_shards(saved, tmp_path):
    doc = json.loads((saved / MANIFEST_FILE).read_text())
    assert doc["format_version"] == "2.3"
    assert set(doc["weight_map"]) == {"w", "step"}  # strings are not in weight_map
    sec = doc["shardkit"]["strings"]
    assert sec["file"] == "strings.skstr" and sec["bytes"] == (saved / "strings.skstr").stat(
        ).st_size
    assert sec["kind"][:4] == ["bytes", "str", "U3", "S6"]
    assert (saved / "strings.skstr").read_bytes()[:8] == b"SKSTRNG1"
    from safetensors.numpy import load_file

    shard = next(p for p in saved.iterdir() if p.suffix == ".safetensors")
    assert set(load_file(shard)) == {"w", "step"}
    # without string tensors nothing changes: format 2.2, no section, no string file
    shardkit.save(tmp_path / "plain", {"w": np.ones(2)},
                  options=shardkit.CheckpointOptions(durable=False))
    doc = json.loads((tmp_path / "plain" / MANIFEST_FILE).read_text())
    assert doc["format_version"] == "2.2" and "strings" not in doc["shardkit"]
    assert not (tmp_path / "plain" / "strings.skstr").exists()


def test_was_refused_before(tmp_path):
    """The issue's failure: ``dtype <U10 cannot be stored``."""
    a = np.array(["0123456789"])
    assert a.dtype == np.dtype("<U10")
    shardkit.save(tmp_path / "c", {"a": a}, options=shardkit.CheckpointOptions(durable=False))
    assert same(shardkit.load(tmp_path / "c")["a"], a)


def test_strings_only_compressed_and_with_callbacks(tmp_path):
    texts = {"t": _objects([b"a", b"bb"]), "u": np.array(["x"])}
    shardkit.save(tmp_path / "only", texts, options=shardkit.CheckpointOptions(durable=False))
    assert all(same(shardkit.load(tmp_path / "only")[k], v) for k, v in texts.items())
    state = {**texts, "w": np.arange(4.0)}
    shardkit.save(tmp_path / "z", state,
                  options=shardkit.CheckpointOptions(compression="zstd", durable=False))
    assert all(same(shardkit.load(tmp_path / "z")[k], v) for k, v in state.items())
    shardkit.save(tmp_path / "task", state,
                  options=shardkit.CheckpointOptions(
                      experimental_sharding_callback=shardkit.ShardByTaskPolicy(), durable=False))
    with shardkit.open(tmp_path / "task") as r:
        assert all(same(r[k], v) for k, v in state.items()) and r.verify() == 3


@pytest.mark.parametrize("bad, what", [
    (_objects([b"a", "b"]), "bytes, str"),
    (_objects([1, 2]), "int"),
    (_objects([b"a", None]), "NoneType, bytes"),
])
def test_object_arrays_of_other_things_are_refused(tmp_path, bad, what):
    with pytest.raises(UnsupportedDTypeError, match=rf"'bad': an object array .*holds {what}"):
        shardkit.save(tmp_path / "c", {"ok": np.ones(2), "bad": bad},
                      options=shardkit.CheckpointOptions(durable=False))
    assert not (tmp_path / "c").exists()


def test_unencodable_str_is_refused_and_earlier_checkpoint_kept(tmp_path):
    shardkit.save(tmp_path / "c", {"a": np.array(["kept"])},
                  options=shardkit.CheckpointOptions(durable=False))
    with pytest.raises(UnsupportedDTypeError, match=r"'a'.*not valid Unicode"):
        shardkit.save(tmp_path / "c", {"a": _objects(["\ud800"])}, overwrite=True,
                      options=shardkit.CheckpointOptions(durable=False))
    assert same(shardkit.load(tmp_path / "c")["a"], np.array(["kept"]))
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no temp directory left


def test_key_rules_apply_across_tensors_and_strings(tmp_path):
    with pytest.raises(InvalidKeyError, match="a/b"):
        shardkit.save(tmp_path / "c", {"a/b": np.ones(1), "a": {"b": np.array(["x"])}},
                      options=shardkit.CheckpointOptions(durable=False))


def test_frameworks_without_strings_refuse_them(saved):
    pytest.importorskip("torch")
    with pytest.raises(UnsupportedDTypeError,
                       match="'text/tf_form' is a string tensor, and torch has no"):
        shardkit.load(saved, framework="torch")
    with shardkit.open(saved) as r:
        with pytest.raises(UnsupportedDTypeError, match="string tensor"):
            r.get("text/u", framework="torch")
        with pytest.raises(UnsupportedDTypeError, match="string tensor"):
            r.get_slice("text/u", 0, framework="torch")
        assert r.get("w", framework="torch").shape == (3, 4)  # the rest loads
    assert set(shardkit.load(saved, ["w"], framework="torch")) == {"w"}


def test_restore_into_in_place_and_mismatches(saved):
    want = flat(string_state())
    targets = {k: (np.zeros_like(v) if v.dtype.kind != "O" else np.empty(v.shape, object))
               for k, v in want.items()}
    targets["step"] = np.zeros((), np.int64)
    held = targets["text/u"]
    status = shardkit.restore_into(saved, targets, verify=True)
    assert held is targets["text/u"] and same(held, want["text/u"])
    assert all(same(targets[k], v) for k, v in want.items())
    assert set(status.restored_keys) == set(want)
    for key, bad, match in [
        ("text/u", np.zeros((2, 2), "U2"), r"dtype <U3, the target has shape \[2, 2\] dtype <U2"),
        ("text/u", np.zeros((2,), "U3"), r"shape \[2, 2\]"),
        ("text/tf_form", np.zeros((2, 2), "S4"), "dtype object"),
        ("text/py_str", "abc", "in place into a str"),
    ]:
        wrong = dict(targets)
        wrong[key] = bad
        with pytest.raises(RestoreMismatchError, match=match):
            shardkit.restore_into(saved, wrong)
    ro = np.zeros((2, 2), "U3")
    ro.flags.writeable = False
    with pytest.raises(RestoreMismatchError, match="read-only"):
        shardkit.restore_into(saved, {**targets, "text/u": ro})


def test_checkpoint_and_async_manager_with_strings(tmp_path):
    vocab = np.array(["a", "bcd"])
    objs = _objects([b"x", b"yy"])
    ckpt = shardkit.Checkpoint(data={"vocab": vocab, "objs": objs, "w": np.ones(2)})
    ckpt.write(tmp_path / "c")
    vocab[:] = ["", ""]
    objs[:] = [b"", b""]
    ckpt.read(tmp_path / "c").assert_consumed()
    assert vocab.tolist() == ["a", "bcd"] and objs.tolist() == [b"x", b"yy"]
    manager = shardkit.CheckpointManager(ckpt, tmp_path / "m", max_to_keep=1)
    path = manager.save(options=shardkit.CheckpointOptions(enable_async=True))
    vocab[:] = ["changed", "after"]  # the async save copied the strings first
    ckpt.sync()
    assert same(shardkit.load(str(path))["data/vocab"], np.array(["a", "bcd"]))


# --- corrupt string files and sections ---------------------------------------------------------


def _section_edit(path, edit):
    p = path / MANIFEST_FILE
    doc = json.loads(p.read_text())
    edit(doc["shardkit"]["strings"], doc)
    p.write_text(json.dumps(doc))


@pytest.mark.parametrize("edit, match", [
    (lambda s, d: s.update(kind=["float", *s["kind"][1:]]), "unknown kind"),
    (lambda s, d: s.update(key=s["key"][:-1]), "has 7 items"),
    (lambda s, d: s.update(key=["w", *s["key"][1:]]), "both a tensor and a string tensor"),
    (lambda s, d: s.update(key=[s["key"][1]] * len(s["key"])), "appears twice"),
    (lambda s, d: s.update(offset=[3, *s["offset"][1:]]), "offset / length out of range"),
    (lambda s, d: s.update(length=[10 ** 9, *s["length"][1:]]), "offset / length out of range"),
    (lambda s, d: s.update(shape=[[-1], *s["shape"][1:]]), "shape must be"),
    (lambda s, d: s.update(shape=[[10 ** 6], *s["shape"][1:]]), "cannot hold"),
    (lambda s, d: s.update(xxh3=["XYZ", *s["xxh3"][1:]]), "xxh3 must be"),
    (lambda s, d: s.update(file="../x"), "not a plain file name"),
    (lambda s, d: s.update(file=d["shardkit"]["shards"][0]["file"]), "as a shard and as"),
    (lambda s, d: s.pop("device"), "strings.device is missing"),
    (lambda s, d: s.update(bytes="9"), "strings.bytes is missing or not a int"),
    (lambda s, d: d["shardkit"].update(strings=[]), "must be a JSON object"),
])
def test_bad_sections_are_corrupt_index_errors(saved, edit, match):
    _section_edit(saved, edit)
    with pytest.raises(CorruptIndexError, match=match) as e:
        shardkit.open(saved)
    assert MANIFEST_FILE in str(e.value)


def test_corrupt_string_file(saved, tmp_path):
    f = saved / "strings.skstr"
    good = f.read_bytes()
    sec = json.loads((saved / MANIFEST_FILE).read_text())["shardkit"]["strings"]
    def lengths_at(row):  # block: u64 D, D bytes of descriptor, the lengths, the elements
        start = sec["offset"][row]
        return start + 8 + int.from_bytes(good[start : start + 8], "little")

    # a flipped element byte: verify names the tensor; a plain read does not hash
    at = lengths_at(0) + 8 * 4  # first element byte of text/tf_form
    f.write_bytes(good[:at] + b"b" + good[at + 1:])
    with shardkit.open(saved) as r:
        with pytest.raises(ChecksumError, match=r"'text/tf_form'.*checksum of string tensor"):
            r.verify()
        assert r.verify(["w", "text/u"]) == 2
    with pytest.raises(ChecksumError):
        shardkit.load(saved, verify=True)
    # element lengths that do not add up
    f.write_bytes(good[: lengths_at(0)] + b"\xff" * 8 + good[lengths_at(0) + 8:])
    with pytest.raises(CorruptHeaderError, match="element lengths add up"):
        shardkit.load(saved)
    # bad UTF-8 in a str element (the checksum is not consulted by a plain read)
    at = lengths_at(1) + 8 * 3
    f.write_bytes(good[:at] + b"\xff" + good[at + 1:])
    with pytest.raises(CorruptHeaderError, match="not valid UTF-8"):
        shardkit.load(saved, ["text/py_str"])
    f.write_bytes(b"XXXXXXXX" + good[8:])
    with pytest.raises(CorruptHeaderError, match="bad magic"):
        shardkit.load(saved)
    f.write_bytes(good[:-8])
    with pytest.raises(TruncatedShardError, match="string file has"):
        shardkit.load(saved)
    with shardkit.open(saved) as r:
        assert same(r["w"], string_state()["w"])  # the tensors still read
        with pytest.raises(TruncatedShardError):
            r.verify()
    f.write_bytes(good + b"\0" * 8)
    with pytest.raises(CheckpointFormatError, match="string file has"):
        shardkit.load(saved)
    # another checkpoint's string file: generation mismatch
    shardkit.save(tmp_path / "other", string_state(),
                  options=shardkit.CheckpointOptions(durable=False))
    shutil.copy(tmp_path / "other" / "strings.skstr", f)
    with pytest.raises(GenerationMismatchError, match="another checkpoint"):
        shardkit.load(saved)
    os.unlink(f)
    with pytest.raises(MissingShardError):
        shardkit.load(saved, ["text/u"])
    with shardkit.open(saved) as r:
        report = r.verify_report()
        assert [p.error for p in report.problems] == [MissingShardError]
    assert set(shardkit.load(saved, ["w"])) == {"w"}


def test_block_descriptor_must_match_the_manifest(saved):
    """The manifest's key, kind and shape of a string tensor are checked against its block,
    so a manifest edit cannot pass verify and return other data."""
    def swap(s, d):
        s["offset"][0], s["offset"][4] = s["offset"][4], s["offset"][0]
        s["length"][0], s["length"][4] = s["length"][4], s["length"][0]
        s["xxh3"][0], s["xxh3"][4] = s["xxh3"][4], s["xxh3"][0]

    for edit in (swap, lambda s, d: s["kind"].__setitem__(2, "U4"),
                 lambda s, d: s["shape"].__setitem__(0, [4])):
        path = saved.parent / f"e{id(edit)}"
        shutil.copytree(saved, path)
        _section_edit(path, edit)
        with shardkit.open(path) as r:
            with pytest.raises(CorruptIndexError, match="describes another tensor"):
                r.verify()
        with pytest.raises(CorruptIndexError, match="describes another tensor"):
            shardkit.load(path)


def test_elements_longer_than_their_width_are_corrupt(tmp_path):
    shardkit.save(tmp_path / "c", {"s": np.array([b"ab"], "S2")},
                  options=shardkit.CheckpointOptions(checksum=False, durable=False))
    p = tmp_path / "c" / MANIFEST_FILE
    doc = json.loads(p.read_text())
    doc["shardkit"]["strings"]["kind"] = ["S1"]
    p.write_text(json.dumps(doc))
    with pytest.raises(CorruptIndexError, match="describes another tensor"):
        shardkit.load(tmp_path / "c")
    items = [b"ab"]
    with pytest.raises(CorruptHeaderError, match="longer than its width 1"):
        sks.decode_elements("S1", (1,), items, "here")
    with pytest.raises(CorruptHeaderError, match="longer than its width 1"):
        sks.decode_elements("U1", (1,), items, "here")


def test_reader_of_2_2_skips_the_section(saved):
    """A 2.2 reader ignores the unknown section: with it removed and the version 2.2 (what
    such a reader sees), the manifest still reads, and the shards are untouched."""
    def as_2_2(s, d):
        d["shardkit"].pop("strings")
        d["format_version"] = "2.2"
    _section_edit(saved, as_2_2)
    assert set(shardkit.load(saved)) == {"w", "step"}


def test_a_2_3_manifest_that_lost_its_strings_section_is_corrupt(saved):
    """Format 2.3 is written exactly when there are string tensors, so a 2.3 manifest without
    the section has lost tensors: refused, never read as a checkpoint without them."""
    _section_edit(saved, lambda s, d: d["shardkit"].pop("strings"))
    for read in (shardkit.open, shardkit.load, lambda p: shardkit.load(p, verify=True)):
        with pytest.raises(CorruptIndexError, match=r"shardkit\.strings section is missing"):
            read(saved)


def test_a_strings_section_needs_format_2_3(saved):
    _section_edit(saved, lambda s, d: d.update(format_version="2.2"))
    with pytest.raises(CorruptIndexError, match=r"needs format_version 2\.3, found '2\.2'"):
        shardkit.open(saved)


def test_a_kind_wider_than_numpy_allows_is_a_shardkit_error(tmp_path, capsys):
    """``U999999999`` is a kind the format allows but numpy has no dtype for: info, inspect
    and load raise UnsupportedDTypeError naming the key, never numpy's TypeError."""
    from shardkit.errors import UnsupportedDTypeError
    from shardkit.tools.cli import main as cli_main

    shardkit.save(tmp_path / "c", {"s": np.array(["ab"], "U2"), "w": np.ones(2)},
                  options=shardkit.CheckpointOptions(checksum=False, durable=False))
    p = tmp_path / "c" / MANIFEST_FILE
    doc = json.loads(p.read_text())
    doc["shardkit"]["strings"]["kind"] = ["U999999999"]
    p.write_text(json.dumps(doc))
    with shardkit.open(tmp_path / "c") as reader:
        with pytest.raises(UnsupportedDTypeError, match=r"'s'.*U999999999 has no numpy dtype"):
            reader.info("s")
        assert reader.info("w").shape == (2,)
    assert cli_main(["inspect", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err
    assert "U999999999 has no numpy dtype" in err and "Traceback" not in err
    with pytest.raises(ShardkitError):
        shardkit.load(tmp_path / "c")
    # the block itself saying so (a consistent string file): decoding refuses it the same way
    with pytest.raises(UnsupportedDTypeError, match=r"here: string kind U999999999"):
        sks.decode_elements("U999999999", (1,), [b"ab"], "here")
    assert sks.decode_elements("S999999999", (0,), [], "here").dtype == np.dtype("S999999999")
