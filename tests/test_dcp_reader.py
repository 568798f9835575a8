"""PyTorch Distributed Checkpoint (DCP) directories and torch.save files read by shardkit.

Every checkpoint here is written by torch itself (``torch.distributed.checkpoint.save`` with the
FileSystemWriter, ``dcp_to_torch_save``, ``torch.save``) and read back through shardkit's one
reader, compared byte for byte with the tensors torch saved.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import distributed as harness  # noqa: E402  (tests/distributed.py)

import shardkit  # noqa: E402
from shardkit.errors import (  # noqa: E402
    ChecksumError,
    CorruptIndexError,
    KeyNotFoundError,
    UnknownCodecError,
    UnsafePickleError,
)
from shardkit.tools.cli import main  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _bytes(t) -> bytes:
    """The bytes of tensor `t` in C order (bfloat16 and all)."""
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _same(got: np.ndarray, want) -> None:
    assert tuple(got.shape) == tuple(want.shape)
    assert np.ascontiguousarray(got).tobytes() == _bytes(want)


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "model.w": torch.randn(6, 5, generator=g),
        "model.bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "model.f16": torch.randn(7, generator=g).to(torch.float16),
        "f64": torch.randn(2, 2, 2, generator=g, dtype=torch.float64),
        "i64": torch.arange(-5, 5),
        "i32": torch.arange(12, dtype=torch.int32).reshape(3, 4),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 200, 255], dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
        "c128": torch.randn(3, generator=g, dtype=torch.complex128),  # the one dtype table's
        "e8m0": torch.tensor([1.0, 2.0, 0.5]).to(torch.float8_e8m0fnu),
        "scalar": torch.tensor(2.5),
        "step": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 5),
        "big": torch.randn(300, 301, generator=g),  # its archive's records past the first KiBs
        "opt": {"lr": 0.1, "name": "adam"},  # non-tensor items: pickled objects
    }


def _tensors(state: dict) -> dict:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.fixture
def plain(tmp_path) -> tuple[str, dict]:
    state = _state()
    path = str(tmp_path / "dcp")
    dcp.save(state, checkpoint_id=path)
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp"]
    return path, state


@pytest.mark.parametrize("mmap", [True, False])
def test_plain_save_read_byte_for_byte(plain, mmap):
    path, state = plain
    want = _tensors(state)
    with shardkit.open(path, mmap=mmap) as reader:
        assert reader.format == "dcp"
        assert sorted(reader.keys()) == sorted(want)
        for key, t in want.items():
            _same(reader.get(key), t)
        assert reader.info("model.bf16").dtype_name == "BF16"
        assert reader.info("scalar").shape == ()
        assert reader.metadata["dcp.objects"] == ["opt.lr", "opt.name"]
        report = reader.verify_report()
        assert report.ok and report.checked == len(want)  # every chunk's zip CRC-32
    loaded = shardkit.load(path, mmap=mmap)
    assert loaded.keys() == want.keys()
    for key, t in want.items():
        _same(loaded[key], t)


def test_torch_tensors_out(plain):
    path, state = plain
    got = shardkit.load(path, framework="torch")
    for key, t in _tensors(state).items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key


def test_non_tensor_items_are_never_unpickled(plain):
    path, _ = plain
    with shardkit.open(path) as reader:
        with pytest.raises(KeyNotFoundError, match=r"'opt.lr'.*never unpickles"):
            reader.get("opt.lr")
    with pytest.raises(KeyNotFoundError, match="non-tensor item"):
        shardkit.load(path, keys=["opt.name"])


def test_index_read_without_importing_torch(plain):
    path, state = plain
    code = ("import sys, shardkit\n"
            f"r = shardkit.open({path!r})\n"
            "print(len(r.keys()), r.get('i32').sum(), r.verify_report().checked)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    env = {**os.environ, "PYTHONPATH": str(Path(shardkit.__file__).parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    n = len(_tensors(state))
    assert out.stdout.split() == [str(n), "66", str(n)]


def test_verify_finds_a_flipped_byte_by_key(plain):
    path, state = plain
    file = os.path.join(path, "__0_0.distcp")
    data = bytearray(open(file, "rb").read())
    needle = _bytes(state["model.w"])
    at = data.find(needle)
    assert at > 0
    data[at + 5] ^= 0x40
    open(file, "wb").write(bytes(data))
    with shardkit.open(path) as reader:
        report = reader.verify_report()
    assert not report.ok and report.checked == len(_tensors(state))
    [problem] = report.problems
    assert problem.error is ChecksumError and problem.key == "model.w"
    assert "crc32" in str(problem)
    with pytest.raises(ChecksumError, match=r"model\.w"):
        shardkit.load(path, verify=True)


# ---------------------------------------------------------------- two ranks, DTensors


def _global() -> dict:
    g = torch.Generator().manual_seed(11)
    return {
        "s0": torch.randn(9, 6, generator=g),  # Shard(0): rows 0..4, 5..8
        "s1": torch.randn(5, 10, generator=g),  # Shard(1)
        "bf16": torch.randn(8, 4, generator=g).to(torch.bfloat16),  # Shard(1) of bf16
        "rep": torch.randn(3, 3, generator=g, dtype=torch.float64),  # Replicate: once
        "tiny": torch.arange(2, dtype=torch.int64).reshape(1, 2),  # Shard(0): rank 1 empty
        "empty0": torch.zeros(0, 5),  # Shard(0) of no items
        "empty1": torch.zeros(0, 6, dtype=torch.int32),  # Shard(1): two chunks of no items
    }


def _save_dtensors(rank: int, world: int, path: str) -> list:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    g = _global()
    state = {
        "s0": distribute_tensor(g["s0"], mesh, [Shard(0)]),
        "s1": distribute_tensor(g["s1"], mesh, [Shard(1)]),
        "bf16": distribute_tensor(g["bf16"], mesh, [Shard(1)]),
        "rep": distribute_tensor(g["rep"], mesh, [Replicate()]),
        "tiny": distribute_tensor(g["tiny"], mesh, [Shard(0)]),
        "empty0": distribute_tensor(g["empty0"], mesh, [Shard(0)]),
        "empty1": distribute_tensor(g["empty1"], mesh, [Shard(1)]),
        "plain": torch.full((4,), 2.0),
    }
    dcp.save(state, checkpoint_id=path)
    files = sorted(os.listdir(path))
    # read back by shardkit on every rank into DTensors placed another way: resharded
    torch.distributed.barrier()
    target = {
        "s0": distribute_tensor(torch.zeros(9, 6), mesh, [Shard(1)]),
        "s1": distribute_tensor(torch.zeros(5, 10), mesh, [Shard(0)]),
        "bf16": distribute_tensor(torch.zeros(8, 4, dtype=torch.bfloat16), mesh, [Replicate()]),
        "rep": distribute_tensor(torch.zeros(3, 3, dtype=torch.float64), mesh, [Shard(0)]),
    }
    shardkit.restore_into(path, target, partial=True, verify=True)
    resharded = {k: bool(torch.equal(v.full_tensor(), g[k])) for k, v in target.items()}
    return [files, resharded]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dcp2") / "ckpt")
    results = harness.raise_any(harness.run_ranks(_save_dtensors, 2, path))
    for files, resharded in results:
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        assert resharded == {"s0": True, "s1": True, "bf16": True, "rep": True}
    return path


def _full() -> dict:
    return {**_global(), "plain": torch.full((4,), 2.0)}


def test_two_rank_dtensors_read_whole_at_world_one(sharded):
    with shardkit.open(sharded) as reader:
        assert len(reader.index.shards) == 2
        for key in ("s0", "s1", "bf16"):
            specs = sorted(s.spec for s in reader.info(key).slices)
            assert len(specs) == 2, (key, specs)
        assert [s.spec for s in reader.info("s0").slices] == ["9 6 0,5:0,6", "9 6 5,4:0,6"]
        assert [s.spec for s in reader.info("rep").slices] == [""]  # deduplicated by DCP
        assert reader.verify_report().ok
        for key, t in _full().items():
            _same(reader.get(key), t)
    for mmap in (True, False):
        loaded = shardkit.load(sharded, mmap=mmap)
        assert loaded.keys() == _full().keys()
        for key, t in _full().items():
            _same(loaded[key], t)


def test_get_slice_across_chunk_boundaries(sharded):
    full = _full()
    with shardkit.open(sharded) as reader:
        _same(reader.get_slice("s0", np.s_[3:7, 1:5]), full["s0"][3:7, 1:5])
        _same(reader.get_slice("s1", np.s_[1:4, 3:8]), full["s1"][1:4, 3:8])
        _same(reader.get_slice("bf16", np.s_[:, 1:3]), full["bf16"][:, 1:3])
        _same(reader.get_slice("s0", np.s_[5:6]), full["s0"][5:6])  # one chunk only
        got = reader.get_slice("s1", np.s_[::2, ::3])
        _same(got, full["s1"][::2, ::3])


def test_restore_into_numpy_and_torch(sharded):
    full = _full()
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    target["s1"] = np.zeros((5, 10), np.float32)
    status = shardkit.restore_into(sharded, target, verify=True)
    status.assert_consumed()
    for key, t in full.items():
        got = target[key]
        if isinstance(got, np.ndarray):
            _same(got, t)
        else:
            assert torch.equal(got, t), key


def test_convert_to_shardkit(sharded, tmp_path, capsys):
    dst = str(tmp_path / "converted")
    assert main(["convert", sharded, dst]) == 0  # --to defaults to shardkit for DCP
    assert "(shardkit)" in capsys.readouterr().out
    with shardkit.open(dst) as reader:
        assert reader.format == "shardkit"
        assert reader.verify_report().ok
        for key, t in _full().items():
            _same(reader.get(key), t)


def test_cli_inspect_and_verify(sharded, capsys):
    assert main(["inspect", sharded]) == 0
    out = capsys.readouterr().out
    assert "PyTorch Distributed Checkpoint (DCP)" in out
    assert "checksums: crc32" in out and "__1_0.distcp" in out and "9 6 5,4:0,6" in out
    assert main(["verify", sharded]) == 0


# ------------------------------------------------------------------ dcp_to_torch_save


def test_dcp_to_torch_save_file(plain, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, state = plain
    pt = str(tmp_path / "full.pt")
    dcp_to_torch_save(path, pt)
    with shardkit.open(pt) as reader:
        assert reader.format == "torch-save"
        assert sorted(reader.keys()) == sorted(_tensors(state))
        assert reader.metadata["dcp.objects"] == ["opt.lr", "opt.name"]
        assert reader.verify_report().ok
        for key, t in _tensors(state).items():
            _same(reader.get(key), t)
        with pytest.raises(KeyNotFoundError, match="non-tensor value"):
            reader.get("opt.lr")
    target = {k: torch.empty_like(v) for k, v in _tensors(state).items()}
    shardkit.restore_into(pt, target).assert_consumed()
    for key, t in _tensors(state).items():
        assert torch.equal(target[key], t), key


def test_torch_save_views_of_one_storage(tmp_path):
    base = torch.arange(20, dtype=torch.float32)
    state = {"a": base[2:8], "b": base.view(4, 5)[1:3], "c": base}
    pt = str(tmp_path / "views.pth")
    torch.save(state, pt)
    with shardkit.open(pt) as reader:
        for key, t in state.items():
            _same(reader.get(key), t)
        report = reader.verify_report()
        assert report.ok and report.checked == 1  # only "c" is its record's whole storage


# --------------------------------------------------------------------- broken files


def test_truncated_distcp(plain):
    path, _ = plain
    file = os.path.join(path, "__0_0.distcp")
    size = os.path.getsize(file)
    os.truncate(file, size - 100)
    with pytest.raises(CorruptIndexError, match=r"past its end .*truncated") as e:
        shardkit.open(path)
    assert "__0_0.distcp" in str(e.value) and "key '" in str(e.value)


def _rewrite_metadata(path: str, change) -> None:
    """Unpickle `path`'s .metadata with torch's own classes, change it, pickle it back."""
    file = os.path.join(path, ".metadata")
    with open(file, "rb") as f:
        md = pickle.load(f)
    change(md)
    with open(file, "wb") as f:
        pickle.dump(md, f)


def test_metadata_pointing_past_the_file_end(plain):
    path, _ = plain
    size = os.path.getsize(os.path.join(path, "__0_0.distcp"))

    def move(md):
        for k, info in md.storage_data.items():
            if k.fqn == "i32":
                info.offset = size - 10

    _rewrite_metadata(path, move)
    with pytest.raises(CorruptIndexError, match=rf"'i32'.*\[{size - 10}, .*past its end"):
        shardkit.open(path)


def test_metadata_offset_inside_another_chunk(plain):
    path, _ = plain

    def shift(md):
        for k, info in md.storage_data.items():
            if k.fqn == "i32":
                info.offset += 7

    _rewrite_metadata(path, shift)
    with pytest.raises(CorruptIndexError, match=r"'i32'.*cannot be read.*points at other"):
        shardkit.open(path)


def test_transformed_chunk_refused_by_key(plain):
    path, _ = plain

    def compress(md):
        for k, info in md.storage_data.items():
            if k.fqn == "model.w":
                info.transform_descriptors = ["stream.zstd/1"]

    _rewrite_metadata(path, compress)
    with pytest.raises(UnknownCodecError, match=r"'model.w'.*stream.zstd/1.*untransformed"):
        shardkit.open(path)


def test_non_c_order_chunk_refused_by_key(tmp_path):
    path = str(tmp_path / "dcp")
    dcp.save({"ok": torch.ones(2), "t": torch.arange(6.0).reshape(2, 3).t()}, checkpoint_id=path)
    with pytest.raises(UnknownCodecError, match=r"'t' is stored with strides \[1, 3\]"):
        shardkit.open(path)


# ------------------------------------------------------------------ crafted pickles


class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _crafted(marker: Path):
    """Pickles whose loading would create `marker`: each names a different global."""
    import builtins
    import subprocess as sp

    cmd = f"touch {marker}"
    return [
        ("os.system", pickle.dumps(_Reduce(os.system, (cmd,)))),
        ("builtins.eval", pickle.dumps(_Reduce(builtins.eval,
                                               (f"open({str(marker)!r}, 'w').close()",)))),
        ("subprocess.Popen", pickle.dumps(_Reduce(sp.Popen, (["touch", str(marker)],)))),
        ("builtins.exec", pickle.dumps(_Reduce(builtins.exec,
                                               (f"open({str(marker)!r}, 'w').close()",)))),
    ]


def test_crafted_metadata_refused_never_run(plain, tmp_path):
    path, _ = plain
    marker = tmp_path / "ran"
    for name, data in _crafted(marker):
        if name.startswith("builtins"):  # the pickle is real: unpickled as usual, it runs
            pickle.loads(data)
            assert marker.exists(), name
            marker.unlink()
        module = "posix" if b"posix" in data else name.rsplit(".", 1)[0]
        with open(os.path.join(path, ".metadata"), "wb") as f:
            f.write(data)
        with pytest.raises(UnsafePickleError, match=rf"global {module}\.\w+.*refused") as e:
            shardkit.open(path)
        assert isinstance(e.value, CorruptIndexError) and ".metadata" in str(e.value)
        assert not marker.exists(), name


def test_crafted_metadata_nested_inside_real_metadata(plain, tmp_path):
    path, _ = plain
    marker = tmp_path / "ran"

    def poison(md):
        md.planner_data = {"x": _Reduce(os.system, (f"touch {marker}",))}

    _rewrite_metadata(path, poison)
    with pytest.raises(UnsafePickleError, match="system"):
        shardkit.open(path)
    assert not marker.exists()


def _torch_save_bytes(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _evil_archive(real: bytes, data: bytes) -> bytes:
    """The torch.save archive `real` with its data.pkl replaced by the pickle `data`."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(real)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename,
                         data if info.filename.endswith("data.pkl") else src.read(info))
    return out.getvalue()


def test_crafted_archive_pickle_refused_never_run(tmp_path):
    marker = tmp_path / "ran"
    real = _torch_save_bytes({"w": torch.ones(3)})
    for name, data in _crafted(marker):
        pt = tmp_path / "evil.pt"
        pt.write_bytes(_evil_archive(real, data))
        with pytest.raises(UnsafePickleError, match=r"data\.pkl.*refused"):
            shardkit.open(str(pt))
        assert not marker.exists(), name


def test_crafted_chunk_pickle_in_distcp_refused(tmp_path):
    path = str(tmp_path / "dcp")
    dcp.save({"w": torch.ones(3)}, checkpoint_id=path)
    marker = tmp_path / "ran"
    _, data = _crafted(marker)[0]
    chunk = _evil_archive(_torch_save_bytes(torch.ones(3)), data)
    (Path(path) / "__0_0.distcp").write_bytes(chunk)

    def point(md):
        for info in md.storage_data.values():
            info.offset, info.length = 0, len(chunk)

    _rewrite_metadata(path, point)
    with pytest.raises(UnsafePickleError, match=r"'w'.*data\.pkl.*global posix\.system"):
        shardkit.open(path)
    assert not marker.exists()


def test_mutated_files_fail_only_as_format_errors(plain, tmp_path):
    # random bytes changed in .metadata or the .distcp, or either cut short: open, reads and
    # verify either work or raise a CheckpointFormatError; nothing else escapes
    import random
    import shutil

    from shardkit.errors import CheckpointFormatError

    path, _ = plain
    rng = random.Random(5)
    seen: dict[str, int] = {}
    for trial in range(300):
        dst = tmp_path / f"m{trial}"
        shutil.copytree(path, dst)
        victim = dst / rng.choice([".metadata", "__0_0.distcp"])
        data = bytearray(victim.read_bytes())
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.2:
            data = data[: rng.randrange(len(data))]
        victim.write_bytes(bytes(data))
        try:
            with shardkit.open(str(dst)) as reader:
                for key in reader.keys():
                    reader.get(key)
                reader.verify_report()
            kind = "ok"
        except CheckpointFormatError as e:
            kind = type(e).__name__
        seen[kind] = seen.get(kind, 0) + 1
        shutil.rmtree(dst)
    assert seen.get("CorruptIndexError", 0) > 100 and seen.get("UnsafePickleError", 0) > 5, seen
