"""Structure-aware fuzzing of the HuggingFace layouts shardkit reads and of the HuggingFace half
of its own manifest (docs/FORMAT.md sections 2, 3.1 and 11).

Three targets, each mutant read through every entry point in a forked child of the fuzz server
(tests/fuzzing.py, `ForeignFuzzServer`):

- a HuggingFace sharded directory (written by huggingface_hub): manifest edits that keep it
  valid JSON (weight_map retargeted to another shard, to ``../x``, to an absolute path, to
  another file of the directory, keys added, dropped or renamed, hostile values, metadata) and
  header number edits in its shards;
- a single safetensors file (written by safetensors): header numbers at boundaries (offsets,
  lengths, shape entries at 0, -1, 2**31, 2**32, 2**53, 2**63 - 1, 2**64 / itemsize, shapes whose
  product wraps), and self-consistent edits that make another valid file;
- a shardkit checkpoint whose weight_map alone is edited: it must be refused unless it is
  still exactly the one the writer wrote.

Neither layout has checksums to reseal, so only the structure checks can catch these. What a
mutant really says comes from `foreign_reader` (the format's rules in plain json + numpy, not
shardkit): a mutant those rules accept must read back as exactly that data, one they refuse must
be an error at every entry point. About 60 mutants per target by default (200 with CI set);
``HYPOTHESIS_PROFILE=thorough`` runs 20,000 each (set SHARDKIT_FUZZ_SUMMARY=file.json to keep
the counts).

A thorough target may run as several processes at once, each with its own ``--hypothesis-seed=N``
and summary file, whose counts add up; SHARDKIT_FUZZ_EXAMPLES=N sets each process's share (see
tests/test_fuzz_tensorbundle.py). A run stopped with Ctrl-C (SIGINT) still writes its summary.
"""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
from pathlib import Path

import foreign_reader
import fuzzing as fz
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="torch (test dependency) is not installed")
huggingface_hub = pytest.importorskip("huggingface_hub", reason="huggingface_hub not installed")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors not installed")

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev")
EXAMPLES = int(os.environ.get("SHARDKIT_FUZZ_EXAMPLES", 0)) or {
    "thorough": 20_000, "ci": 200}.get(PROFILE, 60)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

COUNTS: collections.Counter[str] = collections.Counter()
MANIFEST = foreign_reader.MANIFEST


def _torch_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(12, 8, generator=g).to(torch.bfloat16),
        "layer.0.weight": torch.randn(8, 8, generator=g),
        "layer.0.bias": torch.randn(8, generator=g).to(torch.float16),
        "layer.1.weight": torch.randn(4, 8, generator=g).to(torch.float64),
        "layer.1.mask": torch.randint(0, 2, (3, 5), generator=g).to(torch.bool),
        "ids": torch.randint(-(2**40), 2**40, (6,), generator=g),
        "q8": torch.randint(-128, 127, (9,), generator=g).to(torch.int8),
        "f8": torch.randn(7, generator=g).to(torch.float8_e4m3fn),
        "step": torch.tensor(17),
        "empty": torch.zeros(0, 3, dtype=torch.uint8),
    }


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    import shardkit

    root = tmp_path_factory.mktemp("fuzz-hf-seeds")
    (root / "hf").mkdir()
    huggingface_hub.save_torch_state_dict(_torch_state(0), root / "hf", max_shard_size=400)
    (root / "hf" / "config.json").write_text('{"model_type": "bert"}')
    (root / "st").mkdir()
    safetensors_torch.save_file(_torch_state(1), str(root / "st" / foreign_reader.SINGLE),
                                metadata={"format": "pt"})
    with pytest.warns(shardkit.SplitTensorsWarning):  # "big" is split on purpose
        shardkit.save(root / "sk", foreign_reader.sk_state(),
                      options=shardkit.CheckpointOptions(
                          experimental_sharding_callback=shardkit.BinPackPolicy(256),
                          durable=False))
    return root


@pytest.fixture(scope="module")
def server(seeds):
    srv = fz.ForeignFuzzServer(seeds)
    yield srv
    srv.close()
    _write_summary()


def _write_summary() -> None:
    summary = os.environ.get("SHARDKIT_FUZZ_SUMMARY")
    if summary:
        Path(summary).write_text(json.dumps({"profile": PROFILE, "counts": dict(COUNTS)},
                                            indent=1))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Where mutants are made; ``outside`` beside them holds real shards of other values (the
    same keys), so a reader that followed ``../outside/...`` would find data."""
    root = tmp_path_factory.mktemp("fuzz-hf-mutants")
    (root / "outside").mkdir()
    huggingface_hub.save_torch_state_dict(_torch_state(5), root / "outside", max_shard_size=400)
    return root


def _check(server, seeds: Path, work: Path, kind: str, mutate, what: str) -> None:
    """Copy seed `kind`, let `mutate(dir)` change it, read it through every entry point: when
    the layout's rules accept the mutant every read returns what it says; else every entry
    point raises a ShardkitError."""
    dest = work / f"{kind}-{COUNTS['mutants']}"
    shutil.copytree(seeds / kind, dest)
    try:
        mutate(dest)
        refused = foreign_reader.expected(dest, seeds) is None
        result = server.run(dest)
    finally:
        shutil.rmtree(dest, ignore_errors=True)
    COUNTS["mutants"] += 1
    if COUNTS["mutants"] % 100 == 0:  # a long run's counts so far
        _write_summary()
    COUNTS[f"{kind} {'refused' if refused else 'valid'}"] += 1
    outcomes = {k: v for k, v in result.items() if not k.startswith("_")}
    for outcome in outcomes.values():
        COUNTS[outcome.split(":")[0]] += 1
    if result.get("_status") != "done":
        COUNTS[result["_status"].split(":")[0]] += 1
    problems = fz.failures(result)
    if refused:
        problems += [f"{k}: {v}, but the layout's rules refuse this mutant"
                     for k, v in outcomes.items() if v != "error"]
    else:
        if "error" in outcomes.values():
            COUNTS["valid, refused by shardkit"] += 1
        problems += [f"{k}: data other than the mutant holds" for k, v in outcomes.items()
                     if v == "silent"]
    assert not problems, f"{what}: " + "; ".join(problems)


def _weight_map_edit(d: Path, rnd: random.Random, how: str, work: Path) -> None:
    """One edit of the manifest's weight_map (or metadata); the result stays valid JSON."""
    p = d / MANIFEST
    doc = json.loads(p.read_bytes())
    wm = doc["weight_map"]
    keys, files = list(wm), sorted(set(wm.values()))
    key = rnd.choice(keys)
    outside = sorted(f.name for f in (work / "outside").glob("*.safetensors"))
    if how == "retarget":  # another shard of this directory
        wm[key] = rnd.choice(files)
    elif how == "parent":
        wm[key] = rnd.choice([f"../outside/{rnd.choice(outside)}", f"../{d.name}/{wm[key]}",
                              "../x", "..", f"./{wm[key]}", f"sub/../{wm[key]}"])
    elif how == "absolute":
        wm[key] = rnd.choice([str(work / "outside" / rnd.choice(outside)), str(d / wm[key]),
                              "/dev/zero", "C:" + wm[key], "\\\\host\\" + wm[key]])
    elif how == "other_file":
        wm[key] = rnd.choice(["config.json", MANIFEST, "index.json", ".", "", "missing",
                              "a" * 256, "x\ud800", "x\0y", wm[key] + " "])
    elif how == "add":
        wm[rnd.choice([key + "_", "", "__metadata__", "x\ud800", "big", "text", "ghost"])] = (
            rnd.choice(files))
    elif how == "drop":
        for k in rnd.sample(keys, rnd.choice([1, 1, len(keys)])):
            del wm[k]
    elif how == "rename":
        wm[key + rnd.choice(["x", ":0", "/", " "])] = wm.pop(key)
    elif how == "reorder":  # the same map in another member order: still the same truth
        doc["weight_map"] = dict(rnd.sample(list(wm.items()), len(wm)))
    elif how == "metadata":
        doc["metadata"] = rnd.choice([[], 1, None, {"total_size": -1}, {}, "x"])
    else:  # a value replaced by a hostile literal, spliced in as text
        wm[key] = "\0MARK\0"
        text = json.dumps(doc, ensure_ascii=False).replace('"\\u0000MARK\\u0000"',
                                                           rnd.choice(fz.HOSTILE_JSON))
        p.write_bytes(text.encode("utf-8", "surrogatepass"))
        return
    p.write_bytes(json.dumps(doc, ensure_ascii=False).encode("utf-8", "surrogatepass"))


WEIGHT_MAP_EDITS = ["retarget", "parent", "absolute", "other_file", "add", "drop", "rename",
                    "reorder", "metadata", "hostile"]


@FUZZ
@given(how=st.sampled_from([*WEIGHT_MAP_EDITS, "shard_header", "shard_header"]),
       r=st.integers(0, 2**32))
def test_huggingface_directory(server, seeds, work, how, r):
    rnd = random.Random(r)

    def mutate(d: Path) -> None:
        if how == "shard_header":
            p = rnd.choice(sorted(d.glob("*.safetensors")))
            p.write_bytes(fz.header_number_edit(p.read_bytes(), rnd))
        else:
            _weight_map_edit(d, rnd, how, work)

    _check(server, seeds, work, "hf", mutate, f"HuggingFace directory {how} r={r}")


@FUZZ
@given(r=st.integers(0, 2**32))
def test_single_safetensors_file(server, seeds, work, r):
    rnd = random.Random(r)

    def mutate(d: Path) -> None:
        p = d / foreign_reader.SINGLE
        data = p.read_bytes()
        for _ in range(rnd.choice([1, 1, 1, 2])):
            data = fz.header_number_edit(data, rnd)
        p.write_bytes(data)

    _check(server, seeds, work, "st", mutate, f"safetensors file r={r}")


@FUZZ
@given(how=st.sampled_from(WEIGHT_MAP_EDITS), r=st.integers(0, 2**32))
def test_shardkit_weight_map(server, seeds, work, how, r):
    """shardkit's own manifest with only its weight_map edited: refused unless unchanged."""
    rnd = random.Random(r)
    _check(server, seeds, work, "sk", lambda d: _weight_map_edit(d, rnd, how, work),
           f"shardkit weight_map {how} r={r}")


def test_the_independent_reader_agrees_with_the_safetensors_library(seeds):
    """foreign_reader, the truth of these targets, reads the seeds as safetensors itself does,
    and refuses what the format's rules refuse."""
    got = foreign_reader.expected(seeds / "st", seeds)
    want = safetensors_torch.load_file(str(seeds / "st" / foreign_reader.SINGLE))
    assert got is not None and got.keys() == want.keys()
    for key, tensor in want.items():
        assert got[key].shape == tuple(tensor.shape)
        assert got[key].tobytes() == tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    hf = foreign_reader.expected(seeds / "hf", seeds)
    assert hf is not None and hf.keys() == _torch_state(0).keys()
    assert np.array_equal(hf["ids"], _torch_state(0)["ids"].numpy())
    assert foreign_reader.expected(seeds / "sk", seeds) is not None
    assert not foreign_reader.plain_name("../x") and not foreign_reader.plain_name("a" * 256)
    assert foreign_reader.plain_name("model-00001-of-00002.safetensors")


def test_the_targets_see_failures(server, seeds, work):
    """The classifier: a clean seed of each kind passes with every read equal; a mutant the
    rules refuse but a reader accepted would be called a failure."""
    for kind in fz.FOREIGN_SEEDS:
        result = server.run(seeds / kind)
        assert result["_status"] == "done"
        assert {v for k, v in result.items() if not k.startswith("_")} == {"equal"}, result
    with pytest.raises(AssertionError, match="the layout's rules refuse this mutant"):
        # a weight_map edit shardkit refuses, checked as if it had been read: the refusal must
        # be everywhere, so one "equal" outcome fails
        _check(_Accepting(server), seeds, work, "sk", lambda d: _weight_map_edit(
            d, random.Random(0), "drop", work), "self-check")


class _Accepting:
    """A server that reports every entry point as having returned the right data."""

    def __init__(self, server) -> None:
        self.server = server

    def run(self, path):
        result = self.server.run(path)
        return {k: ("equal" if not k.startswith("_") else v) for k, v in result.items()}
