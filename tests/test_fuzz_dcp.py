"""Mutation fuzzing of PyTorch DCP directories (docs/FORMAT.md section 11) read by shardkit,
through tests/fuzzing.py's server: ``.distcp`` bytes changed with their zip CRC-32s sealed again
(`dcp_fuzzing.reseal_distcp`), ``.metadata`` bytes changed, and ``.metadata`` edited with DCP's
own classes and pickled again, so that mutants reach the decoding behind the checksums.

Each mutant is judged against what torch makes of it (`dcp_fuzzing.torch_dcp_reads`, in an
oracle process): shardkit returns exactly that data, or raises a ShardkitError; another
exception, a crash, a hang, wrong data after verify, or a verify that passes where torch
refuses the mutant fails the example. The seed is a real 2-rank save (gloo, DTensors in
Shard(0), Shard(1) and Replicate, plain tensors, a non-tensor item). About 100 mutants a
target run in CI, 20 by default, 1,000 with ``HYPOTHESIS_PROFILE=thorough``
(SHARDKIT_FUZZ_EXAMPLES overrides).
"""

from __future__ import annotations

import os
import pickle
import random
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import dcp_fuzzing as dz  # noqa: E402
import distributed as harness  # noqa: E402
import fuzzing as fz  # noqa: E402
import test_fuzz  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_fuzz import COUNTS, FUZZ, PROFILE, _check  # noqa: E402

# test_fuzz.py's module fixtures, one instance of each for this module
seeds, server, work = test_fuzz.seeds, test_fuzz.server, test_fuzz.work
EXAMPLES = int(os.environ.get("SHARDKIT_FUZZ_EXAMPLES", 0)) or {
    "thorough": 1_000, "ci": 100}.get(PROFILE, 20)
DCP_FUZZ = settings(FUZZ, max_examples=EXAMPLES)
FILES = ["__0_0.distcp", "__1_0.distcp"]


def _save(rank: int, world: int, path: str) -> list[str]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(17)
    state = {
        "s0": distribute_tensor(torch.randn(9, 6, generator=g), mesh, [Shard(0)]),
        "s1": distribute_tensor(torch.randn(5, 10, generator=g).to(torch.bfloat16), mesh,
                                [Shard(1)]),
        "rep": distribute_tensor(torch.randn(3, 3, generator=g, dtype=torch.float64), mesh,
                                 [Replicate()]),
        "ids": torch.arange(-4, 7, dtype=torch.int64),
        "mask": torch.tensor([[True, False], [False, True]]),
        "step": torch.tensor(12, dtype=torch.int32),
        "empty": torch.zeros(0, 3),
        "opt": {"lr": 0.5},
    }
    dcp.save(state, checkpoint_id=path)
    return sorted(os.listdir(path))


@pytest.fixture(scope="module")
def dcp_seed(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dcp-seed") / "ckpt"
    for files in harness.raise_any(harness.run_ranks(_save, 2, str(path))):
        assert files == [".metadata", *FILES]
    return path


@pytest.fixture(scope="module")
def torch_oracle():
    oracle = fz.TensorFlowOracle(kind="torch")
    yield oracle
    oracle.close()


class _Oracle:
    """`_check`'s oracle interface for a DCP directory (its `reads` takes the directory): torch's
    reading, except for a mutant torch refuses that changed only zip bookkeeping shardkit does
    not read (`dcp_fuzzing.bookkeeping_only`: a ``version`` record, zip64 counts, another
    record's flags): its tensors are the seed's, which shardkit must return or refuse."""

    def __init__(self, oracle: fz.TensorFlowOracle, seed: Path, work: Path) -> None:
        self.oracle, self.seed = oracle, seed
        self.seed_answer = oracle.reads(seed, work / "dcp-seed.answer").read_bytes()

    def reads(self, prefix: Path, answer: Path) -> Path:
        self.oracle.reads(prefix.parent, answer)
        told = pickle.loads(answer.read_bytes())
        if told["data"] is None and dz.bookkeeping_only(str(self.seed), str(prefix.parent)):
            COUNTS["dcp_bookkeeping_only"] += 1
            answer.write_bytes(self.seed_answer)
        return answer


@pytest.fixture(scope="module")
def judge(torch_oracle, dcp_seed, work) -> _Oracle:
    return _Oracle(torch_oracle, dcp_seed, work)


def _run(server, work, dcp_seed, judge, mutate, what: str) -> None:
    # `_check` hands the oracle `dest / TB_PREFIX`; ours reads `dest` itself
    _check(server, work, dcp_seed, mutate, what, resealed=True, oracle=judge)


def _damage(data: bytes, how: str, rnd: random.Random, places: list[tuple[int, int]]) -> bytes:
    if how == "values":  # inside a tensor's record: another valid checkpoint once resealed
        span = dz.tensor_bytes_at(data, places, rnd)
        if span is not None:
            return fz.overwrite(data, rnd, *span)
    if how == "truncate":
        return fz.truncate(data, rnd)
    if how == "extend":
        return fz.extend(data, rnd)
    if how == "boundary" and data:
        at = rnd.randrange(len(data))
        value = (rnd.choice(dz.BOUNDARY) % 2**64).to_bytes(8, "little")
        return data[:at] + value[: len(data) - at] + data[at + 8 :]
    return {"flip": fz.bit_flips, "overwrite": fz.overwrite}.get(how, fz.overwrite)(data, rnd)


@DCP_FUZZ
@given(how=st.sampled_from(["values", "values", "flip", "overwrite", "boundary", "truncate",
                            "extend"]), r=st.integers(0, 2**32))
def test_dcp_distcp_resealed(server, work, dcp_seed, judge, how, r):
    """A ``.distcp`` file damaged (a tensor's bytes, bits or bytes anywhere, 8-byte boundary
    integers, cut, extended), then every chunk archive's CRC-32s sealed again (nine times in
    ten), so that a changed value is another valid checkpoint."""
    rnd = random.Random(r)

    def mutate(d: Path) -> None:
        name = rnd.choice(FILES)
        places = dz.archives(str(d), name)
        data = bytearray(_damage((d / name).read_bytes(), how, rnd, places))
        if rnd.random() < 0.9:
            data = dz.reseal_distcp(data, places)
        (d / name).write_bytes(bytes(data))

    _run(server, work, dcp_seed, judge, mutate, f"dcp distcp {how} r={r}")


@DCP_FUZZ
@given(how=st.sampled_from(["flip", "overwrite", "boundary", "truncate", "extend"]),
       r=st.integers(0, 2**32))
def test_dcp_metadata_bytes(server, work, dcp_seed, judge, how, r):
    """``.metadata``'s pickle damaged (it has no checksum of its own): refused or, where the
    pickle still loads with DCP's classes only, read as torch reads it."""
    rnd = random.Random(r)

    def mutate(d: Path) -> None:
        p = d / dz.METADATA
        p.write_bytes(_damage(p.read_bytes(), how, rnd, []))

    _run(server, work, dcp_seed, judge, mutate, f"dcp metadata {how} r={r}")


@DCP_FUZZ
@given(edits=st.integers(1, 3), values=st.booleans(), r=st.integers(0, 2**32))
def test_dcp_metadata_edits(server, work, dcp_seed, judge, edits, values, r):
    """``.metadata`` edited with DCP's own classes and pickled again (`dcp_fuzzing.
    edit_metadata`: offsets, lengths, chunk boxes, sizes, dtypes, swapped or dropped storage,
    other files, transforms), one to three times; with `values`, a tensor's bytes in a
    ``.distcp`` changed and resealed too."""
    rnd = random.Random(r)

    def mutate(d: Path) -> None:
        if values:
            name = rnd.choice(FILES)
            places = dz.archives(str(d), name)
            data = bytearray(_damage((d / name).read_bytes(), "values", rnd, places))
            (d / name).write_bytes(bytes(dz.reseal_distcp(data, places)))
        p = d / dz.METADATA
        data = p.read_bytes()
        for _ in range(edits):
            data = dz.edit_metadata(data, rnd, FILES)
        p.write_bytes(data)

    _run(server, work, dcp_seed, judge, mutate, f"dcp metadata edits x{edits} r={r}")


def test_the_harness_reaches_behind_the_checksums(server, work, dcp_seed, judge):
    """The seed reads as torch reads it; a tensor's bytes changed without resealing are
    refused by every verifying read; resealed, they are another valid checkpoint that shardkit
    reads exactly as torch does, verify included; a verify that passes where the oracle
    refuses is a failure."""
    import shutil

    oracle = judge

    def judged(d: Path, tag: str) -> tuple[dict, dict | None]:
        answer = oracle.reads(d / fz.TB_PREFIX, work / f"{tag}.answer")
        told = pickle.loads(answer.read_bytes())["data"]
        return server.run(d, answer), told

    result, told = judged(dcp_seed, "seed")
    assert told is not None and sorted(told) == ["empty", "ids", "mask", "rep", "s0", "s1",
                                                 "step"]
    assert {v for k, v in result.items() if not k.startswith("_")} == {"equal"}, result
    for reseal in (False, True):
        d = work / f"values-{reseal}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(dcp_seed, d)
        places = dz.archives(str(d), FILES[0])
        data = bytearray((d / FILES[0]).read_bytes())
        begin, _ = dz.tensor_bytes_at(bytes(data), places[:1], random.Random(0))
        data[begin] ^= 0x01
        if reseal:
            dz.reseal_distcp(data, places)
        (d / FILES[0]).write_bytes(bytes(data))
        result, changed = judged(d, f"values-{reseal}")
        if reseal:
            assert changed is not None and not fz._same(changed, told)  # other values
            assert result["load_verify"] == result["verify"] == "equal", result
        else:
            assert result["load_verify"] == result["cli_verify"] == "error", result
        assert not fz.failures(result), result
    answer = work / "refused.answer"
    answer.write_bytes(pickle.dumps({"data": None}))
    assert fz.failures(server.run(dcp_seed, answer))  # the seed judged as refused: caught
    COUNTS["dcp_harness_checks"] += 1
