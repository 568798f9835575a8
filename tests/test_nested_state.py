"""The structure record: `save` keeps None, str, Python numbers of any size, lists, tuples,
NamedTuples, int dict keys and empty containers, and `load(..., nested=True)` gives the state
back with every key and leaf of its own type (docs/FORMAT.md, "The structure record")."""

from __future__ import annotations

import collections
import json
import math
import struct
import subprocess
import sys
import textwrap

import distributed as harness  # tests/distributed.py
import numpy as np
import pytest

import shardkit
from shardkit.errors import CorruptIndexError, InvalidArgumentError, InvalidArgumentTypeError

Pair = collections.namedtuple("Pair", "mu nu")
MANIFEST = "model.safetensors.index.json"


def _state() -> dict:
    return {
        "model": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
        "optim": {
            "state": {0: {"step": np.float32(3.0), "exp_avg": np.ones(2)}, 7: {}},
            "param_groups": [{
                "lr": 0.1 + 0.2, "betas": (0.9, 0.999), "foreach": None, "amsgrad": False,
                "params": [0, 7], "name": "dé", "count": 2**64 - 1, "huge": -(2**90),
                "nan": math.nan, "inf": -math.inf, "neg": -0.0, "steps": 12,
            }],
        },
        "pair": Pair(np.zeros(1, np.int8), None),
        "empty": {"d": {}, "l": [], "t": ()},
        "mixed": [None, np.ones(1), "x"],
        "a/b": {"c": np.full(1, 5.0)},  # a key holding the separator
    }


def _same(a, b, where="state") -> None:
    """`a` and `b` equal in structure, key types, leaf types and bits."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b) and [type(k) for k in a] == [type(k) for k in b], where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), where  # nan, -0.0: exact bits
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), where
    else:
        assert a == b, where


def test_every_kind_of_value_comes_back_as_saved(tmp_path):
    state = _state()
    shardkit.save(tmp_path / "c", state)
    back = shardkit.load(tmp_path / "c", nested=True)
    expected = dict(state)
    expected["optim"] = dict(state["optim"], state={0: {"step": np.array(np.float32(3.0)),
                                                        "exp_avg": np.ones(2)}, 7: {}})
    _same(back, expected)
    assert type(back["pair"]) is Pair  # its module is imported: the type itself
    group = back["optim"]["param_groups"][0]
    assert type(group["count"]) is int and group["count"] == 2**64 - 1
    assert type(group["amsgrad"]) is bool and type(group["steps"]) is int


def test_the_flat_views_hold_only_tensors(tmp_path):
    from safetensors.numpy import load_file

    shardkit.save(tmp_path / "c", _state())
    flat = shardkit.load(tmp_path / "c")
    assert "optim/param_groups/0/foreach" not in flat and "mixed/0" not in flat
    assert flat["optim/param_groups/0/lr"].dtype == np.float64  # numbers: 0-d tensors
    manifest = json.loads((tmp_path / "c" / MANIFEST).read_text())
    assert list(manifest["weight_map"]) == list(flat)
    files = set(manifest["weight_map"].values())
    seen = {k for f in files for k in load_file(str(tmp_path / "c" / f))}
    assert seen == set(flat)


def test_a_plain_state_records_nothing(tmp_path):
    state = {"a": {"b": np.ones(2)}, "c": np.zeros(1)}
    shardkit.save(tmp_path / "c", state)
    assert "structure" not in json.loads((tmp_path / "c" / MANIFEST).read_text())["shardkit"]
    _same(shardkit.load(tmp_path / "c", nested=True), state)


def test_nested_with_a_prefix_and_a_framework(tmp_path):
    torch = pytest.importorskip("torch")
    shardkit.save(tmp_path / "c", _state())
    optim = shardkit.load(tmp_path / "c", nested=True, prefix="optim", framework="torch")
    assert list(optim) == ["state", "param_groups"]
    assert isinstance(optim["state"][0]["exp_avg"], torch.Tensor)
    assert optim["param_groups"][0]["betas"] == (0.9, 0.999)
    assert type(optim["param_groups"][0]["lr"]) is float


def test_nested_argument_errors(tmp_path):
    shardkit.save(tmp_path / "c", {"w": np.ones(1)})
    with pytest.raises(InvalidArgumentError, match="pass keys= or nested=True, not both"):
        shardkit.load(tmp_path / "c", ["w"], nested=True)
    with pytest.raises(InvalidArgumentTypeError, match="nested must be True or False"):
        shardkit.load(tmp_path / "c", nested="yes")


def test_a_namedtuple_type_is_never_imported(tmp_path):
    shardkit.save(tmp_path / "c", {"p": Pair(np.ones(1), 3)})
    path = tmp_path / "c" / MANIFEST
    doc = json.loads(path.read_text())
    rows = doc["shardkit"]["structure"]
    row = next(r for r in rows if r[1] == "namedtuple")
    row[2][0] = "shardkit_never_imported_module:Pair"
    path.write_text(json.dumps(doc))
    back = shardkit.load(tmp_path / "c", nested=True)
    assert "shardkit_never_imported_module" not in sys.modules
    assert back["p"]._fields == ("mu", "nu") and back["p"].nu == 3
    assert type(back["p"]).__name__ == "Pair" and type(back["p"]) is not Pair


def _with_rows(tmp_path, edit) -> str:
    shardkit.save(tmp_path / "c", {"l": [np.ones(1), None], "d": {1: "x"}}, overwrite=True)
    path = tmp_path / "c" / MANIFEST
    doc = json.loads(path.read_text())
    edit(doc["shardkit"]["structure"])
    path.write_text(json.dumps(doc))
    return str(tmp_path / "c")


@pytest.mark.parametrize("edit, message", [
    (lambda rows: rows.append([["q"], "pickle"]), r"row \[\['q'\], 'pickle'\] is not"),
    (lambda rows: rows.append([["x", "y"], "none"]), r"\['x', 'y'\] has no parent row"),
    (lambda rows: rows.insert(4, [["l", 5], "none"]), r"list \['l'\] are not numbered 0, 1"),
    (lambda rows: rows.append([["d", 1], "none"]), r"dict \['d'\] lists a key twice"),
    (lambda rows: rows.append([["z"], "tensor"]), r"places tensor 'z', which is not stored"),
    (lambda rows: rows.append([[1.5], "none"]), r"holds 1.5, not a str or int key"),
    (lambda rows: rows.append([["b"], "bigint", "12e3"]), r"int at 'b' must be decimal digits"),
    (lambda rows: rows.append([["b"], "bigint", "9" * 5000]), r"must be decimal digits"),
    (lambda rows: rows.append([["s"], "str"]), r"str at 's' has no text"),
    (lambda rows: rows.append([["n"], "namedtuple", ["m:N", ["a"]]]), r"\[0 field names\]"),
    (lambda rows: rows.__setitem__(0, [[], "tensor"]), r"must start with the root"),
    (lambda rows: rows.insert(1, [[], "dict"]), r"outside the root's tree"),
    (lambda rows: rows.clear(), r"non-empty list of rows"),
])
def test_a_hostile_record_is_a_clear_error(tmp_path, edit, message):
    path = _with_rows(tmp_path, edit)
    with pytest.raises(CorruptIndexError, match=message):
        shardkit.load(path, nested=True)
    with pytest.raises(CorruptIndexError, match=message):
        shardkit.open(path)  # checked when the manifest is read, whatever is asked of it


def test_restore_into_an_optimizer_state_dict(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    shardkit.save(tmp_path / "c", {"optim": opt.state_dict()})
    saved = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    for v in opt.state_dict()["state"][0].values():
        v.zero_()
    shardkit.restore_into(tmp_path / "c", {"optim": opt.state_dict()})  # None, bools, floats
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(v, saved[k]), k


def _collective(rank: int, world: int, path: str) -> None:
    import pytest
    import torch.distributed as dist

    from shardkit.errors import DistributedSaveError

    state = {"w": np.full(2, float(rank)) if rank == 0 else np.full(3, 1.0),
             "meta": {"ranks": world, "tag": None, "names": ("a", "b")}}
    if rank == 1:  # values of one rank only, as DCP's planner hands them out
        state = {"v": state["w"], "meta": state["meta"], "opt": {"lr": 0.5, "off": None}}
    else:
        state["note"] = "rank 0's"
    shardkit.save(path, state, process_group=dist.group.WORLD)
    plain = {"w": np.zeros(2)} if rank == 0 else {"v": np.ones(1), "x": None}
    shardkit.save(path + "-mixed", plain, process_group=dist.group.WORLD)  # rank 0 plain
    clash = {"x": None if rank == 0 else "text"}
    with pytest.raises(DistributedSaveError, match="'x' is a none on rank 0 and a str on rank 1"):
        shardkit.save(path + "-clash", clash, process_group=dist.group.WORLD)


def test_the_collective_save_records_every_ranks_structure(tmp_path):
    harness.raise_any(harness.run_ranks(_collective, 2, str(tmp_path / "c"), timeout=120))
    back = shardkit.load(tmp_path / "c", nested=True)
    assert list(back) == ["w", "meta", "note", "v", "opt"]
    assert back["meta"] == {"ranks": 2, "tag": None, "names": ("a", "b")}
    assert back["opt"] == {"lr": 0.5, "off": None} and back["note"] == "rank 0's"
    assert back["w"].tolist() == [0.0, 0.0] and back["v"].tolist() == [1.0, 1.0, 1.0]
    mixed = shardkit.load(tmp_path / "c-mixed", nested=True)
    assert list(mixed) == ["w", "v", "x"] and mixed["x"] is None
    assert not (tmp_path / "c-clash").exists()


LOOP = textwrap.dedent("""
    import sys, torch, shardkit
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    mode, path = sys.argv[1], sys.argv[2]
    start = 0
    if mode == "resume":
        ck = shardkit.load(path, framework="torch", nested=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        sched.load_state_dict(ck["sched"])
        torch.set_rng_state(ck["rng"])
        start = ck["step"]
        assert type(start) is int
    losses = []
    for step in range(start, 10):
        x = torch.randn(32, 8)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item().hex())
        if mode == "save" and step == 4:
            shardkit.save(path, {"model": model.state_dict(), "optim": opt.state_dict(),
                                 "sched": sched.state_dict(), "step": step + 1,
                                 "rng": torch.get_rng_state()})
            break
    print(" ".join(losses))
""")


def test_a_torch_training_loop_resumes_bit_identically(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    path = str(tmp_path / "ckpt")

    def run(mode: str) -> list[str]:
        done = subprocess.run([sys.executable, str(script), mode, path], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    whole = run("full")
    before = run("save")
    after = run("resume")  # a fresh process, from the checkpoint alone
    assert len(whole) == 10 and before + after == whole


def test_numpy_scalars_stay_tensors_and_large_dicts_take_the_quick_check(tmp_path):
    big = {f"k{i}": np.full(1, i) for i in range(40)}  # over the quick check's item-by-item size
    state = {"s": np.float64(2.5), "l": [np.float32(1.0)], "big": big}
    shardkit.save(tmp_path / "c", state)
    back = shardkit.load(tmp_path / "c", nested=True)
    assert type(back["s"]) is np.ndarray and back["s"].dtype == np.float64  # not a float
    assert back["l"][0].dtype == np.float32
    _same(back["big"], big)
    for odd, name in (({**big, "x": None}, "n"), ({**big, "x/y": np.ones(1)}, "sep"),
                      ({**big, "e": {}}, "empty"), ({**big, "f": 0.5}, "float")):
        shardkit.save(tmp_path / name, {"big": odd})
        _same(shardkit.load(tmp_path / name, nested=True), {"big": odd})
    shardkit.save(tmp_path / "plain", {"big": big})
    assert "structure" not in json.loads((tmp_path / "plain" / MANIFEST).read_text())["shardkit"]
