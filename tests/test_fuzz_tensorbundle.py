"""Mutation fuzzing of TensorBundle entries and data files with their checksums resealed
(docs/FORMAT.md section 12), so that only the structure checks can refuse a mutant.

Each mutant is judged against what TensorFlow's own reader makes of the mutated files (the
oracle, `fuzzing.TensorFlowOracle`): shardkit returns exactly that data, or refuses where
TensorFlow refuses (a verify that passes then is a failure). The seeds, the fuzz server and
the judging are test_fuzz.py's. About 100 mutants a target run in CI, 20,000 with
``HYPOTHESIS_PROFILE=thorough``.

A thorough target may run as several processes at once, each with its own hypothesis seed and
summary file (the counts of the files add up); e.g. two halves of 10,000 mutants each::

    HYPOTHESIS_PROFILE=thorough SHARDKIT_FUZZ_EXAMPLES=10000 SHARDKIT_FUZZ_SUMMARY=/tmp/a.json \
        python -m pytest -q -p no:cacheprovider tests/test_fuzz_tensorbundle.py \
        -k test_tensorbundle_entry_bounds --hypothesis-seed=1
    # and the same with --hypothesis-seed=2 and /tmp/b.json, at the same time

Each process has its own seeds, mutants directory, fuzz server and TensorFlow oracle (pytest's
temporary directories are per process). A run stopped with Ctrl-C (SIGINT) still writes its
summary.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import fuzzing as fz
import test_fuzz
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fuzz import FUZZ, PROFILE, _check

# test_fuzz.py's module fixtures, one instance of each for this module
seeds, server, oracle, work = test_fuzz.seeds, test_fuzz.server, test_fuzz.oracle, test_fuzz.work
EXAMPLES = int(os.environ.get("SHARDKIT_FUZZ_EXAMPLES", 0)) or {
    "thorough": 20_001, "ci": 100}.get(PROFILE, 20)
TB_BOUNDS = settings(FUZZ, max_examples=EXAMPLES)


@TB_BOUNDS
@given(entries=st.integers(1, 3), r=st.integers(0, 2**32))
def test_tensorbundle_entry_bounds(server, seeds, work, oracle, entries, r):
    """One to three entries of the index re-encoded with boundary values (offsets, sizes,
    dims, shapes whose byte count wraps int64, shard ids, slice extents, dtypes), every
    numeric entry's crc32c and the table's block checksums sealed again."""
    rnd = random.Random(r)

    def mutate(d: Path) -> None:
        p = d / f"{fz.TB_PREFIX}.index"
        items = fz.table_entries(p.read_bytes())
        for i in rnd.sample(range(1, len(items)), entries):
            items[i] = (items[i][0], fz.boundary_entry(items[i][1], rnd))
        items = fz.reseal_entries(d, items) if rnd.random() < 0.9 else items
        p.write_bytes(fz.table_bytes(items))

    _check(server, work, seeds[1]["tb"], mutate, f"tensorbundle entry bounds x{entries} r={r}",
           resealed=True, oracle=oracle)


@TB_BOUNDS
@given(how=st.sampled_from(["flip", "flip", "overwrite", "boundary", "truncate", "extend",
                            "swap"]), r=st.integers(0, 2**32))
def test_tensorbundle_data_resealed(server, seeds, work, oracle, how, r):
    """A data file damaged (bits, bytes, 8-byte boundary integers, cut, extended, swapped
    with another), then every numeric entry's crc32c sealed again over its bytes: another
    valid bundle, unless a string entry's own checksums or the structure refuse it."""
    rnd = random.Random(r)

    def mutate(d: Path) -> None:
        files = sorted(d.glob(f"{fz.TB_PREFIX}.data-*"))
        p = rnd.choice(files)
        data = p.read_bytes()
        if how == "swap":
            other = rnd.choice(files)
            data, other_data = other.read_bytes(), data
            other.write_bytes(other_data)
        elif how == "truncate":
            data = fz.truncate(data, rnd)
        elif how == "extend":
            data = fz.extend(data, rnd)
        elif how == "boundary" and data:
            at = rnd.randrange(len(data))
            value = rnd.choice(fz.BOUNDARY).to_bytes(8, "little", signed=True)
            data = data[:at] + value[: len(data) - at] + data[at + 8 :]
        else:
            data = {"flip": fz.bit_flips, "overwrite": fz.overwrite,
                    "boundary": fz.overwrite}[how](data, rnd)
        p.write_bytes(data)
        index = d / f"{fz.TB_PREFIX}.index"
        index.write_bytes(fz.table_bytes(fz.reseal_entries(d, fz.table_entries(
            index.read_bytes()))))

    _check(server, work, seeds[1]["tb"], mutate, f"tensorbundle data resealed {how} r={r}",
           resealed=True, oracle=oracle)


def test_the_oracle_judges_resealed_mutants(server, seeds, work, oracle):
    """The harness: TensorFlow reads the clean seed as the seed's data; a mutant it refuses
    must be refused by shardkit's verify, and other data after verify is a failure."""
    import pickle

    root, paths = seeds
    answer = oracle.reads(paths["tb"] / fz.TB_PREFIX, work / "seed.answer")
    with answer.open("rb") as f:
        told = pickle.load(f)["data"]
    assert fz._same(told, fz.as_tensorbundle_reads(fz.load_original(root)))
    result = server.run(paths["tb"], answer)
    assert set(result[k] for k in result if not k.startswith("_")) == {"equal"}, result
    # the seed judged as if TensorFlow had refused it, or read other data: both are failures
    refused = work / "refused.answer"
    with refused.open("wb") as f:
        pickle.dump({"data": None}, f)
    result = server.run(paths["tb"], refused)
    assert result["verify"] == result["load_verify"] == result["load"] == "verified_refused"
    assert result["cli_inspect"] == "silent" and fz.failures(result)
    other = work / "other.answer"
    with other.open("wb") as f:
        pickle.dump({"data": {**told, "step": told["step"] + 1}}, f)
    result = server.run(paths["tb"], other)
    assert result["load_verify"] == "wrong_after_verify" and fz.failures(result)
    assert oracle.reads(root / "missing" / "ckpt-9", work / "missing.answer") and pickle.loads(
        (work / "missing.answer").read_bytes())["data"] is None
