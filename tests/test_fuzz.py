"""Mutation fuzzing of every file kind a checkpoint holds, read through every reader entry point.

Each example copies a seed checkpoint written by shardkit, mutates one part of one file (bit
flips, truncation, extension, JSON edits, or a rewrite kept consistent so the mutation reaches
the checks behind the first one) and hands it to the fuzz server (tests/fuzzing.py), which
reads it in a forked child through open / get / get_slice / load / verify / restore_into and the
CLI. A crash, a hang, an exception outside ShardkitError, wrong data after verify, or peak
memory over the cap fails the example. A TensorBundle mutant whose checksums were sealed again
over the change may be another valid checkpoint: it is judged against what TensorFlow's own
reader makes of the mutated files (`fuzzing.TensorFlowOracle`), never excused. About 2,000
mutants run by default;
``HYPOTHESIS_PROFILE=thorough`` runs 100,000 (set SHARDKIT_FUZZ_SUMMARY=file.json to keep the
counts).
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import random
import shutil
import signal
import struct
from pathlib import Path

import fuzzing as fz
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev")
TESTS = 10
EXAMPLES = {"thorough": 100_000 // TESTS + 1, "ci": 2_000 // TESTS + 1}.get(PROFILE, 40)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

COUNTS: collections.Counter[str] = collections.Counter()
PEAK = [0]


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-seeds")
    paths = fz.make_seeds(root)
    # the same state saved again: another checkpoint whose shards look alike
    import shardkit

    paths["raw_again"] = root / "raw_again"
    with pytest.warns(shardkit.SplitTensorsWarning):  # slices on purpose, as the seeds
        shardkit.save(paths["raw_again"], fz.seed_state(),
                      options=shardkit.CheckpointOptions(
                          experimental_sharding_callback=shardkit.MaxShardSizePolicy(max_shard_size=1024),
                          durable=False))
    return root, paths


@pytest.fixture(scope="module")
def server(seeds):
    srv = fz.FuzzServer(seeds[0])
    yield srv
    srv.close()
    _write_summary()


def _write_summary() -> None:
    """The counts so far to SHARDKIT_FUZZ_SUMMARY, if set (also every 500 mutants, so that a
    long run that is stopped keeps them)."""
    summary = os.environ.get("SHARDKIT_FUZZ_SUMMARY")
    if summary:
        Path(summary).write_text(json.dumps(
            {"profile": PROFILE, "counts": dict(COUNTS), "peak_rss_growth": PEAK[0]}, indent=1))


@pytest.fixture(scope="module")
def oracle():
    """TensorFlow's reader in a process of its own, for resealed TensorBundle mutants."""
    pytest.importorskip("tensorflow")
    tf_oracle = fz.TensorFlowOracle()
    yield tf_oracle
    tf_oracle.close()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-mutants")


def _shards(path: Path, suffix: str) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name.endswith(suffix))


def _check(server, work: Path, seed: Path, mutate, what: str, resealed: bool = False,
           oracle: fz.TensorFlowOracle | None = None) -> None:
    """Copy `seed`, let `mutate(dir)` change it, read it through every entry point.
    `resealed`: the mutant may be another valid checkpoint (a TensorBundle whose checksums
    were sealed again over the change), so what is right is what `oracle` (TensorFlow's
    reader) makes of the mutated files: its data, or an error where it refuses them."""
    dest = work / f"m{COUNTS['mutants']}"
    shutil.copytree(seed, dest)
    answer = work / f"m{COUNTS['mutants']}.answer"
    try:
        mutate(dest)
        expected = None
        if resealed:
            assert oracle is not None, "a resealed mutant needs the oracle"
            expected = oracle.reads(dest / fz.TB_PREFIX, answer)
            told = _told(answer)
            COUNTS["oracle_refused" if told["data"] is None else "oracle_read"] += 1
            if "how" in told:  # TensorFlow died on it, or hung (judged by the time limit)
                COUNTS[f"oracle_{told['how']}"] += 1
        result = server.run(dest, expected)
    finally:
        shutil.rmtree(dest, ignore_errors=True)
        answer.unlink(missing_ok=True)
    COUNTS["mutants"] += 1
    if COUNTS["mutants"] % 500 == 0:
        _write_summary()
    for name, outcome in result.items():
        if not name.startswith("_"):
            COUNTS[outcome.split(":")[0]] += 1
    if result.get("_status") != "done":
        COUNTS[result["_status"].split(":")[0]] += 1
    PEAK[0] = max(PEAK[0], int(result.get("_rss_growth", 0)))
    problems = fz.failures(result)
    assert not problems, f"{what}: " + "; ".join(problems)


def _told(answer: Path) -> dict:
    with answer.open("rb") as f:
        return pickle.load(f)


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def _record_size(ckpt: Path, shard: Path) -> None:
    index = fz.manifest_path(ckpt)
    index.write_bytes(fz.set_recorded_size(index.read_bytes(), shard.name, shard.stat().st_size))


def _pick(rnd: random.Random, ckpt: Path, suffix: str) -> Path:
    return rnd.choice(_shards(ckpt, suffix))


# --- the manifest ---------------------------------------------------------------------------------


@FUZZ
@given(seed=st.sampled_from(["raw", "zstd"]), how=st.sampled_from(
    ["json", "json", "json", "flip", "truncate", "extend", "overwrite"]), r=st.integers(0, 2**32))
def test_index_json(server, seeds, work, seed, how, r):
    rnd = random.Random(r)

    def mutate(d: Path) -> None:
        p = fz.manifest_path(d)
        data = p.read_bytes()
        data = {"json": fz.json_edit, "flip": fz.bit_flips, "truncate": fz.truncate,
                "extend": fz.extend, "overwrite": fz.overwrite}[how](data, rnd)
        _write(p, data)

    _check(server, work, seeds[1][seed], mutate, f"manifest {how} r={r} ({seed})")


# --- raw shards ---------------------------------------------------------------------------------


@FUZZ
@given(how=st.sampled_from(["flip", "overwrite", "huge", "small"]), r=st.integers(0, 2**32))
def test_raw_length_prefix(server, seeds, work, how, r):
    rnd = random.Random(r)

    def mutate(d: Path) -> None:
        p = _pick(rnd, d, ".safetensors")
        data = p.read_bytes()
        if how == "huge":
            data = struct.pack("<Q", rnd.choice((2**63, 2**64 - 1, 2**40, len(data)))) + data[8:]
        elif how == "small":
            data = struct.pack("<Q", rnd.randrange(0, 16)) + data[8:]
        else:
            data = {"flip": fz.bit_flips, "overwrite": fz.overwrite}[how](data, rnd, 0, 8)
        _write(p, data)

    _check(server, work, seeds[1]["raw"], mutate, f"length prefix {how} r={r}")


@FUZZ
@given(how=st.sampled_from(["json", "json", "flip", "overwrite"]), consistent=st.booleans(),
       r=st.integers(0, 2**32))
def test_raw_header(server, seeds, work, how, consistent, r):
    rnd = random.Random(r)

    def mutate(d: Path) -> None:
        p = _pick(rnd, d, ".safetensors")
        n, text, rest = fz.safetensors_parts(p.read_bytes())
        if how == "json":
            data = fz.with_header(fz.json_edit(text.rstrip(b" "), rnd), rest)
        else:
            data = {"flip": fz.bit_flips, "overwrite": fz.overwrite}[how](
                p.read_bytes(), rnd, 8, 8 + n)
        _write(p, data)
        if consistent:  # the index records the new size: only the header itself is wrong
            _record_size(d, p)

    _check(server, work, seeds[1]["raw"], mutate, f"raw header {how} consistent={consistent} r={r}")


@FUZZ
@given(how=st.sampled_from(["flip", "overwrite", "truncate", "extend"]), consistent=st.booleans(),
       r=st.integers(0, 2**32))
def test_raw_data(server, seeds, work, how, consistent, r):
    rnd = random.Random(r)

    def mutate(d: Path) -> None:
        p = _pick(rnd, d, ".safetensors")
        data = p.read_bytes()
        n, _, _ = fz.safetensors_parts(data)
        if how in ("flip", "overwrite"):
            data = {"flip": fz.bit_flips, "overwrite": fz.overwrite}[how](data, rnd, 8 + n)
        else:
            data = {"truncate": fz.truncate, "extend": fz.extend}[how](data, rnd)
        _write(p, data)
        if consistent:
            _record_size(d, p)

    _check(server, work, seeds[1]["raw"], mutate, f"raw data {how} consistent={consistent} r={r}")


# --- the string file (docs/FORMAT.md section 2.3) ---------------------------------------------


@FUZZ
@given(seed=st.sampled_from(["raw", "zstd"]), how=st.sampled_from(
    ["flip", "flip", "overwrite", "truncate", "extend", "preamble"]), consistent=st.booleans(),
       r=st.integers(0, 2**32))
def test_string_file(server, seeds, work, seed, how, consistent, r):
    rnd = random.Random(r)

    def mutate(d: Path) -> None:
        p = d / "strings.skstr"
        data = p.read_bytes()
        if how == "preamble":  # magic, generation length, generation
            data = fz.bit_flips(data, rnd, 0, 56)
        else:
            data = {"flip": fz.bit_flips, "overwrite": fz.overwrite, "truncate": fz.truncate,
                    "extend": fz.extend}[how](data, rnd)
        _write(p, data)
        if consistent:  # the manifest records the new size: only the content is wrong
            index = fz.manifest_path(d)
            index.write_bytes(fz.set_string_file_size(index.read_bytes(), len(data)))

    _check(server, work, seeds[1][seed], mutate,
           f"string file {how} consistent={consistent} r={r} ({seed})")


# --- TensorFlow's TensorBundle (docs/FORMAT.md, "TensorFlow's TensorBundle") ---------------

TB_FUZZ = settings(FUZZ, max_examples=max(10, EXAMPLES // 2))


@TB_FUZZ
@given(how=st.sampled_from(["flip", "overwrite", "truncate", "extend", "footer", "block",
                            "block", "entry", "entry", "entry", "header", "drop", "state"]),
       r=st.integers(0, 2**32))
def test_tensorbundle_index(server, seeds, work, oracle, how, r):
    """The .index table: raw damage, the footer, a block's bytes with its checksum resealed
    (so the block parser sees them), one field of an entry or of the header re-encoded in a
    resealed table, an entry dropped, the state file naming another checkpoint."""
    rnd = random.Random(r)

    def mutate(d: Path) -> None:
        p = d / f"{fz.TB_PREFIX}.index"
        data = p.read_bytes()
        if how in ("flip", "overwrite"):
            data = {"flip": fz.bit_flips, "overwrite": fz.overwrite}[how](data, rnd)
        elif how == "truncate":
            data = fz.truncate(data, rnd)
        elif how == "extend":
            data = fz.extend(data, rnd)
        elif how == "footer":
            data = fz.bit_flips(data, rnd, len(data) - 48, len(data) - 8)
        elif how == "block":
            off, size = rnd.choice(fz.table_blocks(data))
            data = fz.reseal_block(fz.bit_flips(data, rnd, off, off + size), off, size)
        elif how in ("entry", "header", "drop"):
            items = fz.table_entries(data)
            i = 0 if how == "header" else rnd.randrange(1, len(items))
            if how == "drop":
                del items[i]
            else:
                items[i] = (items[i][0], fz.edit_proto(items[i][1], i == 0, rnd))
            data = fz.table_bytes(items)
        else:
            (d / "checkpoint").write_text(rnd.choice([
                'model_checkpoint_path: "ckpt-2"\n', 'model_checkpoint_path: "../x"\n',
                "model_checkpoint_path: 1\n", 'model_checkpoint_path: ""\n', "\xff"]))
        _write(p, data)

    _check(server, work, seeds[1]["tb"], mutate, f"tensorbundle index {how} r={r}",
           resealed=how in ("block", "entry", "header", "drop"), oracle=oracle)


@TB_FUZZ
@given(how=st.sampled_from(["flip", "flip", "overwrite", "truncate", "extend", "swap",
                            "remove"]), r=st.integers(0, 2**32))
def test_tensorbundle_data(server, seeds, work, how, r):
    """The data files: damaged bytes (numeric entries: caught by verify; string entries: their
    length checksum or verify), truncated, extended, swapped, missing."""
    rnd = random.Random(r)

    def mutate(d: Path) -> None:
        files = sorted(d.glob(f"{fz.TB_PREFIX}.data-*"))
        p = rnd.choice(files)
        if how == "remove":
            p.unlink()
            return
        data = p.read_bytes()
        if how == "swap":
            other = rnd.choice(files)
            data, other_data = other.read_bytes(), data
            other.write_bytes(other_data)
        elif how == "truncate":
            data = fz.truncate(data, rnd)
        elif how == "extend":
            data = fz.extend(data, rnd)
        else:
            data = {"flip": fz.bit_flips, "overwrite": fz.overwrite}[how](data, rnd)
        _write(p, data)

    _check(server, work, seeds[1]["tb"], mutate, f"tensorbundle data {how} r={r}")


# --- .skz shards --------------------------------------------------------------------------------


def _skz_test(server, seeds, work, part: str, how: str, reseal: bool, r: int) -> None:
    rnd = random.Random(r)

    def mutate(d: Path) -> None:
        p = _pick(rnd, d, ".skz")
        data = p.read_bytes()
        parts = fz.skz_parts(data)
        lo, hi = {"preamble": (0, fz.SKZ_PREAMBLE),
                  "entries": (fz.SKZ_PREAMBLE, parts["header_end"]),
                  "table": (parts["table"], parts["check"] + 8),
                  "frames": (parts["frames"], len(data))}[part]
        if how == "json":
            text = data[parts["header"] : parts["header_end"]]
            new = fz.json_edit(text.rstrip(b" "), rnd)
            new += b" " * (-(len(new) + 48) % 8)
            data = (data[: fz.SKZ_PREAMBLE] + struct.pack("<Q", len(new)) + new
                    + data[parts["header_end"] :])
        elif how == "truncate":
            data = fz.truncate(data, rnd)
        elif how == "extend":
            data = fz.extend(data, rnd)
        else:
            data = {"flip": fz.bit_flips, "overwrite": fz.overwrite}[how](data, rnd, lo, hi)
        if reseal:
            data = fz.reseal_skz(data)
        _write(p, data)
        _record_size(d, p)

    _check(server, work, seeds[1]["zstd"], mutate, f".skz {part} {how} reseal={reseal} r={r}")


@FUZZ
@given(how=st.sampled_from(["flip", "overwrite"]), reseal=st.booleans(), r=st.integers(0, 2**32))
def test_skz_preamble(server, seeds, work, how, reseal, r):
    _skz_test(server, seeds, work, "preamble", how, reseal, r)


@FUZZ
@given(how=st.sampled_from(["json", "json", "flip", "overwrite"]), reseal=st.booleans(),
       r=st.integers(0, 2**32))
def test_skz_entry_table(server, seeds, work, how, reseal, r):
    _skz_test(server, seeds, work, "entries", how, reseal, r)


@FUZZ
@given(how=st.sampled_from(["flip", "overwrite"]), reseal=st.sampled_from([True, True, False]),
       r=st.integers(0, 2**32))
def test_skz_frame_table(server, seeds, work, how, reseal, r):
    _skz_test(server, seeds, work, "table", how, reseal, r)


@FUZZ
@given(how=st.sampled_from(["flip", "flip", "overwrite", "truncate", "extend"]),
       r=st.integers(0, 2**32))
def test_skz_frames(server, seeds, work, how, r):
    _skz_test(server, seeds, work, "frames", how, False, r)


# --- whole-file substitutions -------------------------------------------------------------------


@FUZZ
@given(how=st.sampled_from(["other_checkpoint", "swap", "duplicate"]), r=st.integers(0, 2**32))
def test_shard_substitution(server, seeds, work, how, r):
    """Shards that are each valid, in the wrong checkpoint or the wrong place."""
    rnd = random.Random(r)

    def mutate(d: Path) -> None:
        shards = _shards(d, ".safetensors")
        a = rnd.choice(shards)
        if how == "other_checkpoint":  # the same name from another save of the same state
            shutil.copyfile(seeds[1]["raw_again"] / a.name, a)
        else:
            b = rnd.choice([s for s in shards if s != a] or shards)
            data_a, data_b = a.read_bytes(), b.read_bytes()
            a.write_bytes(data_b)
            if how == "swap":
                b.write_bytes(data_a)
                _record_size(d, b)
        _record_size(d, a)

    _check(server, work, seeds[1]["raw"], mutate, f"substitution {how} r={r}")


def test_the_fuzzer_sees_failures(server, seeds, work):
    """The harness itself: a clean seed passes; the classifier calls what it must a failure."""
    for name in ("raw", "zstd", "tb"):
        result = server.run(seeds[1][name])
        assert result["_status"] == "done"
        assert {v for k, v in result.items() if not k.startswith("_")} == {"equal"}, result
    assert server.run("!segv")["_status"] == f"crash: signal {signal.SIGSEGV}"
    quick = fz.FuzzServer(seeds[0], timeout=1)
    try:
        assert quick.run("!sleep")["_status"] == "hang"
    finally:
        quick.close()
    assert fz.failures({"_status": "hang"}) == ["hang"]
    assert fz.failures({"_status": "done", "load": "foreign: ValueError: x"}) == [
        "load: foreign: ValueError: x"]
    assert fz.failures({"_status": "done", "load": "wrong_after_verify"})
    assert fz.failures({"_status": "done", "_rss_growth": str(2 << 30)})
    assert not fz.failures({"_status": "done", "load": "silent", "verify": "error"})
