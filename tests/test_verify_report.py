"""verify lists every problem once, blames the manifest when it is what disagrees, and words
every problem ``<file>: <key or ->: <what>, expected <x> vs found <y>``; `shardkit verify` prints
one ``CORRUPT:`` line per problem and exits 1."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from shardkit.errors import (
    ChecksumError,
    CorruptIndexError,
    MissingShardError,
    SplitTensorsWarning,
    TruncatedShardError,
)
from shardkit.format import MANIFEST_FILE
from shardkit.io import save as api
from shardkit.io.options import CheckpointOptions
from shardkit.io.reader import CheckpointReader
from shardkit.shards import skz
from shardkit.tools.cli import main

LINE = re.compile(r"^CORRUPT: (?P<file>[^:]+): (?P<key>'[^']*'|-): (?P<what>.+), "
                  r"expected (?P<expected>.+) vs found (?P<found>.+)$")


def save(path: Path, state: dict[str, np.ndarray], **kw) -> Path:
    api.save(path, state, options=CheckpointOptions(durable=False, **kw))
    return path


def corrupt_lines(capsys) -> tuple[list[str], str]:
    err = capsys.readouterr().err.splitlines()
    lines = [line for line in err if line.startswith("CORRUPT: ")]
    for line in lines:
        assert LINE.match(line), line
    return lines, err[-1]


def shard_files(path: Path, suffix: str) -> list[Path]:
    return sorted(path.glob(f"model-*{suffix}"))


def test_one_corrupted_entry_in_a_raw_shard(tmp_path, capsys):
    state = {"w": np.arange(64, dtype=np.float32), "b": np.arange(8, dtype=np.int8)}
    ckpt = save(tmp_path / "c", state)
    (shard,) = shard_files(ckpt, ".safetensors")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x40  # the last byte belongs to 'b' (int8, laid out last)
    shard.write_bytes(bytes(data))
    with CheckpointReader(ckpt) as r:
        report = r.verify_report()
        assert report.checked == 2
        assert [str(p) for p in report.problems] == [
            f"{shard}: 'b': checksum of entry 'b', expected xxh3 "
            f"{r.info('b').slices[0].xxh3} (model.safetensors.index.json) vs found "
            f"{report.problems[0].found}"]
        with pytest.raises(ChecksumError) as info:
            r.verify()
        assert str(info.value) == str(report.problems[0])
        assert info.value.problems == report.problems
    assert main(["verify", str(ckpt)]) == 1
    lines, last = corrupt_lines(capsys)
    assert lines == [f"CORRUPT: {report.problems[0]}"]
    assert last == f"{ckpt}: 1 problem(s) found"


def test_a_corrupt_frame_holding_two_tensors_is_reported_once(tmp_path, capsys):
    rng = np.random.default_rng(3)
    state = {"a": (rng.standard_normal(300) * 0.1).astype(np.float32),
             "b": (rng.standard_normal(300) * 0.1).astype(np.float32)}
    ckpt = save(tmp_path / "c", state, compression="zstd", chunk_size="64KiB")
    (shard,) = shard_files(ckpt, ".skz")
    data = bytearray(shard.read_bytes())
    h = skz.decode_skz_header(data, len(data), str(shard))
    assert len(h.frames) == 1  # both tensors in frame 0
    data[int(h.frames["offset"][0]) + int(h.frames["stored"][0]) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    with CheckpointReader(ckpt) as r:
        report = r.verify_report()
        # Before: the frame was reported by verify_frames, and again for each tensor in it.
        assert len(report.problems) == 1
        (p,) = report.problems
        assert p.file == str(shard) and p.key is None and p.error is ChecksumError
        assert p.what == "frame 0 (data bytes [0, 2400) holding entries 'a', 'b')"
        assert re.fullmatch(r"xxh3 [0-9a-f]{16} \(frame table\)", p.expected)
        assert report.checked == 0  # neither tensor could be hashed
        with pytest.raises(ChecksumError, match=r"frame 0 \(data bytes \[0, 2400\)"):
            r.verify()
        assert len(r.verify_report(["a"]).problems) == 1
    assert main(["verify", str(ckpt)]) == 1
    lines, _ = corrupt_lines(capsys)
    assert lines == [f"CORRUPT: {p}"]


def _edit_index(ckpt: Path, edit) -> None:
    index = json.loads((ckpt / MANIFEST_FILE).read_bytes())
    edit(index["shardkit"])
    (ckpt / MANIFEST_FILE).write_text(json.dumps(index))


def test_a_shard_size_the_index_gets_wrong_is_blamed_on_the_index(tmp_path, capsys):
    ckpt = save(tmp_path / "c", {"w": np.arange(10, dtype=np.float32)})
    (shard,) = shard_files(ckpt, ".safetensors")
    size = shard.stat().st_size

    def grow(sk):
        sk["shards"][0]["bytes"] += 8
    _edit_index(ckpt, grow)
    with CheckpointReader(ckpt) as r:
        report = r.verify_report()
        # Before: "shard is truncated", blaming the shard file, which is whole.
        assert [str(p) for p in report.problems] == [
            f"{ckpt / MANIFEST_FILE}: -: size of shard {shard.name}, expected {size} bytes "
            f"(the file's) vs found {size + 8} bytes"]
        assert report.checked == 1  # the shard itself was still verified
        with pytest.raises(CorruptIndexError, match="size of shard"):
            r.verify()
    assert main(["verify", str(ckpt)]) == 1
    assert len(corrupt_lines(capsys)[0]) == 1


def test_a_truncated_shard_is_blamed_on_the_shard(tmp_path):
    ckpt = save(tmp_path / "c", {"w": np.arange(10, dtype=np.float32)})
    (shard,) = shard_files(ckpt, ".safetensors")
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-4])
    with CheckpointReader(ckpt) as r:
        (p,) = r.verify_report().problems
        assert str(p) == (f"{shard}: -: file size, expected {size} bytes "
                          f"(model.safetensors.index.json) vs found {size - 4} bytes")
        with pytest.raises(TruncatedShardError):
            r.verify()


def test_a_dtype_the_index_gets_wrong_is_blamed_on_the_index(tmp_path):
    ckpt = save(tmp_path / "c", {"w": np.arange(10, dtype=np.int32), "v": np.ones(3)})

    def retype(sk):
        sk["tensors"]["dtype"][sk["tensors"]["key"].index("w")] = "F32"
    _edit_index(ckpt, retype)
    with CheckpointReader(ckpt) as r:
        report = r.verify_report()
        (shard,) = shard_files(ckpt, ".safetensors")
        assert [str(p) for p in report.problems] == [
            f"{ckpt / MANIFEST_FILE}: 'w': dtype of entry 'w' in shard {shard.name}, expected "
            "I32 (the shard's) vs found F32"]
        assert report.checked == 1  # 'v' is intact and checked


def test_a_missing_shard_and_a_corrupt_one_are_both_listed(tmp_path, capsys):
    from shardkit.sharding.policies import MaxShardSizePolicy

    state = {"a": np.arange(100, dtype=np.float32), "b": np.arange(100, dtype=np.int64)}
    with pytest.warns(SplitTensorsWarning, match="stored 2 tensors as slices"):
        ckpt = save(tmp_path / "c", state, experimental_sharding_callback=MaxShardSizePolicy(400))
    shards = shard_files(ckpt, ".safetensors")
    assert len(shards) >= 3
    shards[0].unlink()
    data = bytearray(shards[-1].read_bytes())
    data[-1] ^= 1
    shards[-1].write_bytes(bytes(data))
    with CheckpointReader(ckpt) as r:
        problems = r.verify_report().problems
        assert len(problems) == 2
        assert str(problems[0]) == (f"{shards[0]}: -: shard file, expected a file "
                                    "(model.safetensors.index.json lists it) vs found no such file")
        assert problems[1].file == str(shards[-1]) and problems[1].error is ChecksumError
        with pytest.raises(MissingShardError) as info:  # the first problem's class
            r.verify()
        assert str(info.value).splitlines() == ["2 problems:", *map(str, problems)]
    assert main(["verify", str(ckpt)]) == 1
    lines, last = corrupt_lines(capsys)
    assert lines == [f"CORRUPT: {p}" for p in problems]
    assert last == f"{ckpt}: 2 problem(s) found"


def test_cli_reports_a_corrupt_index_as_one_line(tmp_path, capsys):
    ckpt = save(tmp_path / "c", {"w": np.arange(4)})
    (ckpt / MANIFEST_FILE).write_text("{not json")
    assert main(["verify", str(ckpt)]) == 1
    lines, _ = corrupt_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith(f"CORRUPT: {ckpt / MANIFEST_FILE}: -: ")


def test_cli_reports_a_newer_format_as_unsupported_not_corrupt(tmp_path, capsys):
    ckpt = save(tmp_path / "c", {"w": np.arange(4)})
    manifest = ckpt / MANIFEST_FILE
    doc = json.loads(manifest.read_text())
    doc["format_version"] = "3.1"
    manifest.write_text(json.dumps(doc))
    assert main(["verify", str(ckpt)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert not [line for line in err if line.startswith("CORRUPT")]
    assert err[0] == (f"UNSUPPORTED: {manifest}: -: {MANIFEST_FILE}, expected a format this "
                      "shardkit reads vs found checkpoint format version 3.1 is newer than this "
                      "shardkit reads (up to 2.x); upgrade shardkit to read it")
