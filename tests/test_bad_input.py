"""Corrupt, truncated and hostile checkpoints: each raises its own ShardkitError subclass whose
message names the file and the key; never a bare json / numpy / OS error, a crash or a hang."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import stat
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_format import row_slices, whole, write_checkpoint

from shardkit import format as fmt
from shardkit.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    ChecksumError,
    CorruptHeaderError,
    CorruptIndexError,
    EntryLayoutError,
    KeyNotFoundError,
    MissingShardError,
    NotRegularFileError,
    ShardkitError,
    ShardPathError,
    SymlinkRefusedError,
    TruncatedShardError,
    UnknownCodecError,
    UnsupportedVersionError,
)
from shardkit.format import MANIFEST_FILE
from shardkit.io import reader as rd
from shardkit.io import save as api
from shardkit.io.restore import restore_into

M = re.escape(MANIFEST_FILE)  # in the messages that name the manifest

SHARD0 = fmt.shard_file_name(0, 1)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    path = tmp_path / "ckpt"
    write_checkpoint(path, whole({"w": np.arange(6, dtype=np.float32), "b": np.ones(2, np.int8)}))
    return path


def _edit_index(path: Path, change) -> None:
    doc = json.loads((path / MANIFEST_FILE).read_bytes())
    change(doc)
    (path / MANIFEST_FILE).write_text(json.dumps(doc))


def _replace_shard(path: Path, data: bytes, name: str = SHARD0) -> None:
    """Put `data` in a shard and record its size in the index (so only the content is bad)."""
    (path / name).write_bytes(data)

    def change(doc):
        for s in doc["shardkit"]["shards"]:
            if s["file"] == name:
                s["bytes"] = len(data)

    _edit_index(path, change)


def _shard_with_header(header: Any, data: bytes) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-(len(text) + 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _read_all(path: Path, **kw) -> None:
    with rd.CheckpointReader(path, **kw) as r:
        for k in r.keys():
            r.get(k)


# --- missing things -------------------------------------------------------------------------------


def test_missing_checkpoint_directory(tmp_path):
    with pytest.raises(CheckpointNotFoundError,
                       match=r"no checkpoint at .*nope: the path does not exist"):
        rd.CheckpointReader(tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError, match="nope"):
        rd.load(tmp_path / "nope")


def test_checkpoint_path_is_a_file(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError, match=r"the path is a file, and not one a reader "
                       r"opens \(it takes a checkpoint directory, a .safetensors file, or a "
                       r"TensorFlow checkpoint's prefix or .index file\)"):
        rd.CheckpointReader(tmp_path / "f")


def test_a_manifest_or_a_data_file_given_as_the_checkpoint_says_what_to_pass(tmp_path):
    """Not "the path is not a directory": the reader names the file and what it takes."""
    api.save(tmp_path / "ckpt", {"w": np.ones(2)})
    manifest = tmp_path / "ckpt" / MANIFEST_FILE
    with pytest.raises(CheckpointNotFoundError) as e:
        rd.load(manifest)
    assert str(e.value) == (f"no checkpoint at {manifest}: it is a checkpoint's manifest; "
                            f"pass its directory {tmp_path / 'ckpt'}")
    api.save(tmp_path / "tf" / "ckpt-1", {"w": np.ones(2)}, format="tensorflow")
    data = tmp_path / "tf" / "ckpt-1.data-00000-of-00001"
    assert data.is_file()
    with pytest.raises(CheckpointNotFoundError) as e:
        rd.load(data)
    assert str(e.value) == (f"no checkpoint at {data}: it is a data file of a TensorFlow "
                            f"checkpoint; pass the checkpoint's prefix {tmp_path / 'tf' / 'ckpt-1'}"
                            " (or its .index file)")
    assert rd.load(tmp_path / "tf" / "ckpt-1")["w"].tolist() == [1.0, 1.0]  # as it says


def test_missing_index(ckpt):
    (ckpt / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointNotFoundError,
                       match=rf"ckpt: {M} is missing \(nor is there an index\.json"):
        rd.CheckpointReader(ckpt)


def test_index_is_a_directory(ckpt):
    (ckpt / MANIFEST_FILE).unlink()
    (ckpt / MANIFEST_FILE).mkdir()
    with pytest.raises(NotRegularFileError,
                       match=rf"ckpt/{M}: {M} is a directory, not a regular file"):
        rd.CheckpointReader(ckpt)


def test_missing_key(ckpt):
    with rd.CheckpointReader(ckpt) as r:
        with pytest.raises(KeyNotFoundError, match=r"key 'ww' is not in checkpoint .*ckpt "
                           r"\(2 tensors\); did you mean 'w'\?") as info:
            r["ww"]
        assert isinstance(info.value, KeyError)
        with pytest.raises(KeyNotFoundError, match="key 'zzzzz' is not in checkpoint"):
            r.info("zzzzz")


def test_missing_shard_file(ckpt):
    (ckpt / SHARD0).unlink()
    with rd.CheckpointReader(ckpt) as r:
        with pytest.raises(MissingShardError, match=rf"{SHARD0}: shard file listed in the manifest "
                           r"is missing .*while reading key 'w'"):
            r["w"]


# --- the manifest ---------------------------------------------------------------------------------


def test_corrupt_index_json(ckpt):
    (ckpt / MANIFEST_FILE).write_bytes(b'{"format": "shardkit", ')
    with pytest.raises(CorruptIndexError, match=rf"ckpt/{M}: not valid JSON"):
        rd.CheckpointReader(ckpt)


def test_newer_major_version(ckpt):
    _edit_index(ckpt, lambda d: d.update(format_version="3.1"))
    with pytest.raises(UnsupportedVersionError, match=rf"{M}: checkpoint format version 3\.1"
                       r" is newer than this shardkit reads \(up to 2\.x\); upgrade shardkit"):
        rd.load(ckpt)


def test_pre_release_version_1_is_refused(ckpt):
    """A 1.x index (one object per tensor) is refused by its version, before its layout."""
    w = {"dtype": "F32", "shape": [6], "device": "/device:CPU:0",
         "slices": [{"spec": "", "shard": 0, "entry": "w", "xxh3": None}]}

    def to_v1(doc):
        doc["format_version"] = "1.0"
        doc["shardkit"]["tensors"] = {"w": w}
        del doc["shardkit"]["slices"], doc["shardkit"]["devices"]

    _edit_index(ckpt, to_v1)
    with pytest.raises(UnsupportedVersionError, match=rf"{M}: checkpoint format version 1\.0"
                       r" is a pre-release layout this shardkit no longer reads \(it reads 2\.x\); "
                       r"load it with the shardkit that wrote it and save it again"):
        rd.CheckpointReader(ckpt)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/tmp/abs.safetensors",
                                  "sub/../../x", "..", "C:evil"])
def test_shard_name_leaving_the_directory(ckpt, name):
    def change(doc):
        doc["shardkit"]["shards"][0]["file"] = name
    _edit_index(ckpt, change)
    with pytest.raises(ShardPathError,
                       match=rf"{M}: shard file name .* is not a plain file"):
        rd.CheckpointReader(ckpt)


def test_unknown_codec(ckpt):
    _edit_index(ckpt, lambda d: d["shardkit"]["shards"][0].update(codec="lz9"))
    with rd.CheckpointReader(ckpt) as r:
        with pytest.raises(UnknownCodecError, match=rf"{SHARD0}: shard codec 'lz9' is not "
                           r"supported .*while reading key 'w'"):
            r["w"]


def _set_row(column: str, key: str, value: Any):
    """Change `column` of `key`'s row in shardkit.tensors."""
    def change(doc):
        tensors = doc["shardkit"]["tensors"]
        tensors[column][tensors["key"].index(key)] = value
    return change


def test_index_and_header_disagree(ckpt):
    def change(doc):
        _set_row("shape", "w", [2, 3])(doc)
        _set_row("dtype", "w", "I32")(doc)

    _edit_index(ckpt, change)
    with rd.CheckpointReader(ckpt) as r:
        with pytest.raises(CorruptHeaderError, match=rf"{SHARD0}: entry 'w' \(key 'w', slice ''\) "
                           rf"does not match {M}: expected dtype I32 shape \[2, 3\], the "
                           r"shard has dtype F32 shape \[6\]"):
            r["w"]


def _set_spec(key: str, spec: str):
    def change(doc):
        row = doc["shardkit"]["tensors"]["key"].index(key)
        slices = doc["shardkit"]["slices"]
        slices["spec"][slices["tensor"].index(row)] = spec
    return change


def _weight_map_kept(change):
    """`change`, then weight_map rewritten to agree with shardkit's section (as a writer would
    record it), so that only the shard and the section disagree."""
    def changed(doc):
        change(doc)
        sk = doc["shardkit"]
        keys, sl = sk["tensors"]["key"], sk["slices"]
        rows = list(sl["tensor"])
        doc["weight_map"] = {
            keys[row]: sk["shards"][shard]["file"]
            for row, spec, shard in zip(sl["tensor"], sl["spec"], sl["shard"])
            if spec == "" and rows.count(row) == 1}
    return changed


@pytest.mark.parametrize(
    ("change", "match"),
    [
        # the entry name is composed from key and spec: a full-box spec names "w:6 0,6"
        (_weight_map_kept(_set_spec("w", "6 0,6")),
         rf"entry 'w:6 0,6' \(key 'w', slice '6 0,6'\) is listed in {M} but not in the shard"),
        (_weight_map_kept(_set_row("key", "w", "w2")),
         rf"entry 'w2' \(key 'w2', slice ''\) is listed in {M} but not in the shard"),
    ],
    ids=["full-box-spec", "renamed-key"],
)
def test_entry_missing_from_shard(ckpt, change, match):
    _edit_index(ckpt, change)
    for use_mmap in (True, False):
        with rd.CheckpointReader(ckpt, mmap=use_mmap) as r:
            with pytest.raises(CorruptHeaderError, match=match):
                r["b"]


# --- shard files --------------------------------------------------------------------------------


def test_truncated_shard(ckpt):
    data = (ckpt / SHARD0).read_bytes()
    (ckpt / SHARD0).write_bytes(data[:-3])
    for use_mmap in (True, False):
        with rd.CheckpointReader(ckpt, mmap=use_mmap) as r:
            with pytest.raises(TruncatedShardError, match=rf"{SHARD0}: shard is truncated: file "
                               rf"has {len(data) - 3} bytes, the manifest records {len(data)} "
                               r".*while reading key 'b'"):
                r["b"]


def test_shard_longer_than_recorded(ckpt):
    with open(ckpt / SHARD0, "ab") as f:
        f.write(b"junk")
    with rd.CheckpointReader(ckpt) as r:
        with pytest.raises(CheckpointFormatError, match=r"bytes, but the manifest records"):
            r["b"]


def test_shard_shorter_than_length_prefix(ckpt):
    _replace_shard(ckpt, b"\x01\x02")
    with pytest.raises(TruncatedShardError, match=r"file is 2 bytes, shorter than the 8-byte"):
        _read_all(ckpt)


def test_header_length_past_end_of_file(ckpt):
    _replace_shard(ckpt, struct.pack("<Q", 1000) + b"{}      ")
    with pytest.raises(TruncatedShardError, match=rf"{SHARD0}: header length 1000 runs past the "
                       r"end of the file \(8 \+ 1000 bytes needed, file has 16\)"):
        _read_all(ckpt)


def test_header_length_over_limit(ckpt):
    _replace_shard(ckpt, struct.pack("<Q", fmt.MAX_HEADER_BYTES + 8) + b"{}      ")
    with pytest.raises(CorruptHeaderError, match=r"header length 104857608 exceeds the limit of "
                       r"104857600 bytes .*while reading key 'w'"):
        _read_all(ckpt)


def test_corrupt_json_header(ckpt):
    _replace_shard(ckpt, _shard_with_header(b'{"w": {"dtype": "F32", ', bytes(26)))
    with pytest.raises(CorruptHeaderError, match=rf"{SHARD0}: header is not valid JSON .*"
                       r"while reading key 'w'"):
        _read_all(ckpt)


W = {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}
B = {"dtype": "I8", "shape": [2], "data_offsets": [24, 26]}


@pytest.mark.parametrize(
    ("header", "data", "error", "match"),
    [
        ({"w": {**W, "data_offsets": [0, 24]}, "b": {**B, "data_offsets": [30, 32]}}, 26,
         EntryLayoutError, r"entry 'b' data_offsets \[30, 32\] run past the end of the data "
                           r"region \(26 bytes\)"),
        ({"w": W, "b": {**B, "data_offsets": [22, 24]}}, 26, EntryLayoutError,
         r"entries 'w' \[0, 24\] and 'b' \[22, 24\] overlap"),
        ({"w": W, "b": {**B, "data_offsets": [26, 28]}}, 28, EntryLayoutError,
         r"hole of 2 bytes after entry 'w' \(bytes 24\.\.26\) before entry 'b'"),
        ({"w": {**W, "dtype": "F31"}, "b": B}, 26, CorruptHeaderError,
         r"entry 'w' has unknown dtype 'F31'"),
        ({"w": {**W, "shape": [7]}, "b": B}, 26, EntryLayoutError,
         r"entry 'w': data_offsets \[0, 24\] span 24 bytes, but dtype F32 and shape \[7\] need 28"),
        ({"w": {**W, "shape": "6"}, "b": B}, 26, CorruptHeaderError,
         r"entry 'w': shape must be a list of non-negative integers"),
        ({"w": {**W, "data_offsets": [0, "24"]}, "b": B}, 26, CorruptHeaderError,
         r"entry 'w': data_offsets must be 2 integers"),
        ([W, B], 26, CorruptHeaderError, r"header must be a JSON object, found list"),
    ],
    ids=["out-of-range", "overlap", "hole", "unknown-dtype", "size-mismatch", "bad-shape",
         "bad-offsets", "not-object"],
)
def test_bad_shard_headers(ckpt, header, data, error, match):
    _replace_shard(ckpt, _shard_with_header(header, bytes(data)))
    for use_mmap in (True, False):
        with rd.CheckpointReader(ckpt, mmap=use_mmap) as r:
            with pytest.raises(error, match=match) as info:
                r["w"]
    assert SHARD0 in str(info.value)
    assert "key 'w'" in str(info.value)


# --- checksums ----------------------------------------------------------------------------------


def _flip_data_byte(path: Path, name: str, from_end: int = 1) -> None:
    p = path / name
    data = bytearray(p.read_bytes())
    data[-from_end] ^= 0x40
    p.write_bytes(bytes(data))


def test_checksum_mismatch_verify_and_load(ckpt):
    _flip_data_byte(ckpt, SHARD0)  # the last byte belongs to 'b' (int8, laid out last)
    with rd.CheckpointReader(ckpt) as r:
        r["w"]  # reading without verification does not look at checksums
        with pytest.raises(ChecksumError, match=rf"{SHARD0}: 'b': checksum of entry 'b', expected "
                           rf"xxh3 [0-9a-f]{{16}} \({M}\) vs found [0-9a-f]{{16}}$"):
            r.verify()
        assert r.verify(["w"]) == 1
    for use_mmap in (True, False):
        with pytest.raises(ChecksumError, match="'b': checksum of entry 'b'"):
            rd.load(ckpt, verify=True, mmap=use_mmap)
    assert list(rd.load(ckpt, ["w"], verify=True)) == ["w"]
    with pytest.raises(ChecksumError, match="'b': checksum of entry 'b'"):
        rd.CheckpointReader(ckpt, verify=True)
    with pytest.raises(ChecksumError, match="'b': checksum of entry 'b'"):
        restore_into(ckpt, {"b": np.zeros(2, np.int8)}, verify=True, partial=True)


def test_checksum_mismatch_in_a_slice(tmp_path):
    a = np.arange(24, dtype=np.int32).reshape(6, 4)
    write_checkpoint(tmp_path, row_slices("a", a, 2, [0, 1]))
    _flip_data_byte(tmp_path, fmt.shard_file_name(1, 2))
    with pytest.raises(ChecksumError, match=r"model-00002-of-00002\.safetensors: 'a': checksum "
                       r"of slice '6 4 3,3:0,4' \(entry 'a:6 4 3,3:0,4'\), expected xxh3"):
        rd.load(tmp_path, verify=True, mmap=False)


# --- fuzz: any damage gives a ShardkitError or a correct read -------------------------------------


def _exercise(path: Path) -> None:
    for use_mmap in (True, False):
        with rd.CheckpointReader(path, mmap=use_mmap) as r:
            for k in r.keys():
                r.get(k)
                r.get_slice(k, np.s_[..., ::2])
            r.verify()


@pytest.mark.parametrize("target", ["shard", "index"])
def test_random_damage_never_escapes_as_a_foreign_error(tmp_path, target):
    base = tmp_path / "base"
    a = np.arange(40, dtype=np.float32).reshape(8, 5)
    write_checkpoint(base, row_slices("a", a, 2, [0, 1]) + whole({"b": np.ones(3, np.int16)}))
    name = fmt.shard_file_name(0, 2) if target == "shard" else MANIFEST_FILE
    original = (base / name).read_bytes()
    rng = random.Random(target)
    outcomes = {"ok": 0, "error": 0}
    for trial in range(120):
        data = bytearray(original)
        how = trial % 3
        if how == 0:  # flip bytes
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif how == 1:  # cut
            del data[rng.randrange(len(data)) :]
        else:  # overwrite a run with a random byte value
            i = rng.randrange(len(data))
            data[i : i + rng.randint(1, 16)] = bytes([rng.randrange(256)]) * 16
        (base / name).write_bytes(bytes(data))
        try:
            _exercise(base)
            outcomes["ok"] += 1
        except ShardkitError:
            outcomes["error"] += 1
    assert outcomes["error"] > 0


# --- hostile files: not regular files, symlinks ------------------------------------------------


def _shard_to(ckpt: Path, make, name: str = SHARD0) -> Path:
    (ckpt / name).unlink()
    make(ckpt / name)
    return ckpt / name


def test_shard_is_a_directory(ckpt, tmp_path):
    _shard_to(ckpt, Path.mkdir)
    for use_mmap in (True, False):
        with pytest.raises(NotRegularFileError, match=rf"ckpt/{SHARD0}: shard file is a "
                           r"directory, not a regular file \(while reading key 'w'\)"):
            _read_all(ckpt, mmap=use_mmap)
    with pytest.raises(NotRegularFileError, match="is a directory"):
        rd.load(ckpt)
    with pytest.raises(NotRegularFileError, match="is a directory"):
        restore_into(ckpt, {"w": np.zeros(6, np.float32)}, partial=True)


OPEN_IN_CHILD = """
    import sys
    from shardkit import reader as rd
    try:
        rd.load(sys.argv[1], mmap=sys.argv[2] == "1")
    except Exception as e:
        print(type(e).__name__, str(e))
"""


def _load_in_child(ckpt: Path, use_mmap: bool = True) -> str:
    """load() in a subprocess, so that a hang fails the test instead of stopping the suite."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(OPEN_IN_CHILD), str(ckpt),
                           "1" if use_mmap else "0"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


@pytest.mark.parametrize("use_mmap", [True, False], ids=["mmap", "pread"])
def test_shard_is_a_fifo(ckpt, use_mmap):
    _shard_to(ckpt, os.mkfifo)
    out = _load_in_child(ckpt, use_mmap)
    assert out.startswith(f"NotRegularFileError {ckpt / SHARD0}: shard file is a FIFO, "
                          "not a regular file"), out


def test_index_is_a_fifo(ckpt):
    (ckpt / MANIFEST_FILE).unlink()
    os.mkfifo(ckpt / MANIFEST_FILE)
    out = _load_in_child(ckpt)
    assert out == (f"NotRegularFileError {ckpt / MANIFEST_FILE}: {MANIFEST_FILE} is a FIFO, not a "
                   "regular file"), out


def test_shard_is_a_device(ckpt):
    try:
        _shard_to(ckpt, lambda p: os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 3)))
    except PermissionError:
        pytest.skip("cannot create a device node here")
    out = _load_in_child(ckpt)
    assert out.startswith(f"NotRegularFileError {ckpt / SHARD0}: shard file is a character "
                          "device, not a regular file"), out


def test_shard_is_a_socket(ckpt):
    sock = socket.socket(socket.AF_UNIX)
    try:
        _shard_to(ckpt, lambda p: sock.bind(str(p)))
        with pytest.raises(NotRegularFileError, match=rf"{SHARD0}: shard file is a socket, not "
                           "a regular file"):
            _read_all(ckpt)
    finally:
        sock.close()


def test_device_behind_a_followed_symlink_is_refused(ckpt):
    _shard_to(ckpt, lambda p: p.symlink_to("/dev/zero"))
    with pytest.raises(NotRegularFileError, match=rf"{SHARD0}: shard file is a character "
                       "device, not a regular file"):
        _read_all(ckpt, follow_symlinks=True)


SECRET = b"SECRET-\x89\xff\x00-BYTES" * 8


def test_symlinked_shard_is_refused_unless_asked(ckpt, tmp_path):
    real = tmp_path / "elsewhere.safetensors"
    real.write_bytes((ckpt / SHARD0).read_bytes())
    _shard_to(ckpt, lambda p: p.symlink_to(real))
    for use_mmap in (True, False):
        with pytest.raises(SymlinkRefusedError, match=rf"ckpt/{SHARD0}: shard file is a "
                           r"symbolic link; .*follow_symlinks=True"):
            _read_all(ckpt, mmap=use_mmap)
    with pytest.raises(SymlinkRefusedError):
        rd.load(ckpt)
    with pytest.raises(SymlinkRefusedError):
        restore_into(ckpt, {"w": np.zeros(6, np.float32)}, partial=True)
    got = rd.load(ckpt, follow_symlinks=True)
    np.testing.assert_array_equal(got["w"], np.arange(6, dtype=np.float32))
    target = {"w": np.zeros(6, np.float32)}
    restore_into(ckpt, target, follow_symlinks=True, partial=True)
    np.testing.assert_array_equal(target["w"], got["w"])
    with rd.CheckpointReader(ckpt, follow_symlinks=True, mmap=False) as r:
        assert r.verify() == 2


def test_symlinked_index_is_refused_unless_asked(ckpt, tmp_path):
    real = tmp_path / "index-elsewhere.json"
    real.write_bytes((ckpt / MANIFEST_FILE).read_bytes())
    (ckpt / MANIFEST_FILE).unlink()
    (ckpt / MANIFEST_FILE).symlink_to(real)
    with pytest.raises(SymlinkRefusedError, match=rf"ckpt/{M}: {M} is a "
                       r"symbolic link; .*follow_symlinks=True"):
        rd.CheckpointReader(ckpt)
    assert list(rd.load(ckpt, follow_symlinks=True)) == ["w", "b"]


def test_symlink_to_foreign_bytes_never_echoes_them(ckpt, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    _shard_to(ckpt, lambda p: p.symlink_to(secret))
    for kw in ({}, {"follow_symlinks": True}):
        with pytest.raises(CheckpointFormatError) as e:
            _read_all(ckpt, **kw)
        assert "SECRET" not in str(e.value) and "\\x89" not in str(e.value)
    _edit_index(ckpt, lambda doc: doc["shardkit"]["shards"][0].update(bytes=len(SECRET)))
    with pytest.raises(CheckpointFormatError) as e:
        _read_all(ckpt, follow_symlinks=True)
    assert "SECRET" not in str(e.value) and "0x89" not in str(e.value), str(e.value)


def test_header_not_utf8_names_the_position_not_the_byte(ckpt):
    _replace_shard(ckpt, _shard_with_header(b'{"w": "\xff\xfe"}', b""))
    with pytest.raises(CorruptHeaderError, match=r"header is not UTF-8 \(invalid byte at "
                       r"position \d+\)") as e:
        _read_all(ckpt)
    assert "0xff" not in str(e.value)


# --- generations: one checkpoint's files only (format 2.1) ----------------------------------------


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_shard_of_another_save_is_refused_naming_both_generations(tmp_path, compression):
    import shardkit
    from shardkit.errors import GenerationMismatchError

    state = {"a": np.arange(6, dtype=np.float32), "b": np.arange(3, dtype=np.int8)}
    first = shardkit.save(tmp_path / "one", state,
                          options=shardkit.CheckpointOptions(compression=compression))
    second = shardkit.save(tmp_path / "two", {k: v + 1 for k, v in state.items()},
                           options=shardkit.CheckpointOptions(compression=compression))
    assert first.generation != second.generation
    assert re.fullmatch(r"[0-9a-f]{32}", first.generation)
    (name,) = [f for f in first.files if f != MANIFEST_FILE]
    (tmp_path / "one" / name).write_bytes((tmp_path / "two" / name).read_bytes())
    _edit_index(tmp_path / "one", lambda doc: doc["shardkit"]["shards"][0].update(
        bytes=(tmp_path / "two" / name).stat().st_size))
    with rd.CheckpointReader(tmp_path / "one") as r:
        assert r.generation == first.generation
    message = (rf"{re.escape(str(tmp_path / 'one' / name))}: shard belongs to another "
               rf"checkpoint: the manifest is of generation {first.generation}, the shard header "
               rf"records generation '{second.generation}' \(the directory mixes files of "
               r"different saves, or was partially replaced\)")
    for mmap in (True, False):
        with pytest.raises(GenerationMismatchError, match=message):
            rd.load(tmp_path / "one", mmap=mmap)
    with rd.CheckpointReader(tmp_path / "one") as r, pytest.raises(GenerationMismatchError):
        r.verify()
    with rd.CheckpointReader(tmp_path / "one") as r, pytest.raises(GenerationMismatchError):
        r.get_slice("a", np.s_[1:])


def test_a_shard_without_a_generation_in_a_2_1_checkpoint_is_refused(ckpt):
    """A 2.0 shard (no generation) next to a 2.1 index is a mixed directory too."""
    from shardkit.errors import GenerationMismatchError

    _edit_index(ckpt, lambda doc: doc["shardkit"].update(generation="ab" * 16))
    with pytest.raises(GenerationMismatchError,
                       match=r"the manifest is of generation abab.*, the shard header records "
                             r"generation none"):
        _read_all(ckpt)


def test_a_2_0_checkpoint_opens_without_a_generation_check(tmp_path):
    """An index without shardkit.generation (format 2.0) checks nothing, whatever the shards
    record."""
    import shardkit

    state = {"a": np.arange(6, dtype=np.float32)}
    shardkit.save(tmp_path / "c", state)

    def to_2_0(doc):
        doc["format_version"] = "2.0"
        del doc["shardkit"]["generation"]

    _edit_index(tmp_path / "c", to_2_0)
    with rd.CheckpointReader(tmp_path / "c") as r:
        assert r.generation is None and r.index.version == "2.0"
        np.testing.assert_array_equal(r["a"], state["a"])
        assert r.verify() == 1
