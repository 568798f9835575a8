"""The other layouts torch 2.13's DCP writes, read by shardkit bit-exact.

An FSDP2 model (``fully_shard``: ``Shard(0)`` DTensors) with its AdamW state and a replicated
tensor, saved by 2 real ranks (gloo on 127.0.0.1) with ``dcp.save`` four ways: the default
FileSystemWriter, without rank coordination (``use_collectives=False``: a ``__<rank>.metadata``
per rank, no ``.metadata``), with ``SerializationFormat.SAFETENSORS`` ``.distcp`` files, and
through the ``HuggingFaceStorageWriter`` (which writes a HuggingFace directory); then keys with
DCP's ``.`` under ``prefix=``, and the broken variants of the new layouts.
"""

from __future__ import annotations

import os
import pickle
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import distributed as harness  # noqa: E402  (tests/distributed.py)

import shardkit  # noqa: E402
from shardkit.errors import CorruptIndexError, KeyNotFoundError  # noqa: E402
from shardkit.tools.cli import main  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

VARIANTS = ("plain", "per-rank", "safetensors")


def _bytes(t) -> bytes:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _same(got: np.ndarray, want) -> None:
    assert tuple(got.shape) == tuple(want.shape)
    assert np.ascontiguousarray(got).tobytes() == _bytes(want)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def _save_fsdp2(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 5, generator=torch.Generator().manual_seed(1))).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    g = torch.Generator().manual_seed(2)
    rep = distribute_tensor(torch.randn(3, 4, generator=g, dtype=torch.float64), mesh,
                            [Replicate()])
    state = {"model": msd, "optim": osd, "extra": {"rep": rep, "count": torch.tensor(5)}}
    dcp.save(state, checkpoint_id=f"{root}/plain")
    dcp.save(state, checkpoint_id=f"{root}/per-rank", use_collectives=False)
    dcp.save(state, storage_writer=FileSystemWriter(
        f"{root}/safetensors", serialization_format=SerializationFormat.SAFETENSORS))
    dcp.save(msd, storage_writer=HuggingFaceStorageWriter(
        f"{root}/hf", save_distributed=True, enable_consolidation=True))
    full = {}
    for prefix, part in (("model", msd), ("optim.state", osd["state"]), ("extra", state["extra"])):
        for key, value in _flat(part):
            if isinstance(value, torch.Tensor):
                value = value.full_tensor() if hasattr(value, "full_tensor") else value
                full[f"{prefix}.{key}"] = value.detach().clone()
    return full


def _flat(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("fsdp2"))
    full, again = harness.raise_any(harness.run_ranks(_save_fsdp2, 2, root, timeout=300))
    assert full.keys() == again.keys()
    return root, full


def test_the_layouts_are_what_torch_writes(saved):
    root, full = saved
    assert sorted(os.listdir(f"{root}/plain")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert sorted(os.listdir(f"{root}/per-rank")) == ["__0.metadata", "__0_0.distcp",
                                                     "__1.metadata", "__1_0.distcp"]
    head = open(f"{root}/safetensors/__0_0.distcp", "rb").read(9)
    assert head[8:9] == b"{"  # a safetensors header, not a torch.save archive
    assert "model.0.weight" in full and "optim.state.0.weight.exp_avg" in full
    assert tuple(full["model.0.weight"].shape) == (7, 5)  # rows 0..3 and 4..6 on two ranks


@pytest.mark.parametrize("variant", VARIANTS)
def test_fsdp2_save_read_bit_exact(saved, variant):
    root, full = saved
    path = f"{root}/{variant}"
    with shardkit.open(path) as reader:
        assert reader.format == "dcp"
        assert sorted(reader.keys()) == sorted(full)
        specs = [s.spec for s in reader.info("model.0.weight").slices]
        assert specs == ["7 5 0,4:0,5", "7 5 4,3:0,5"]  # FSDP2's Shard(0), one file each
        assert [s.spec for s in reader.info("extra.rep").slices] == [""]  # once
        if variant == "per-rank":  # each rank saved it, uncoordinated: rank 0's is read
            assert reader.info("extra.rep").slices[0].file == "__0_0.distcp"
        for key, t in full.items():
            _same(reader.get(key), t)
        w = full["optim.state.0.weight.exp_avg"]
        _same(reader.get_slice("optim.state.0.weight.exp_avg", np.s_[2:6, 1:4]), w[2:6, 1:4])
        report = reader.verify_report()
        assert report.ok
        # torch.save archives carry a CRC-32 each; DCP's safetensors files carry none
        assert report.checked == (0 if variant == "safetensors" else len(reader.index.slice_spec))
        assert "optim.param_groups.0.lr" in reader.metadata["dcp.objects"]
    for mmap in (True, False):
        loaded = shardkit.load(path, mmap=mmap)
        assert loaded.keys() == full.keys()
        for key, t in full.items():
            _same(loaded[key], t)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fsdp2_restore_and_convert(saved, variant, tmp_path, capsys):
    root, full = saved
    path = f"{root}/{variant}"
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    shardkit.restore_into(path, target, verify=True).assert_consumed()
    for key, t in full.items():
        assert torch.equal(target[key], t), key
    dst = str(tmp_path / "converted")
    assert main(["convert", path, dst]) == 0
    assert "(shardkit)" in capsys.readouterr().out
    with shardkit.open(dst) as reader:
        assert reader.verify_report().ok
        for key, t in full.items():
            _same(reader.get(key), t)


def test_huggingface_storage_writer_is_read_as_huggingface(saved):
    # HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True): the ranks'
    # pieces consolidated into model-*.safetensors and its model.safetensors.index.json
    root, full = saved
    with shardkit.open(f"{root}/hf") as reader:
        assert reader.format == "huggingface"
        model = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
        assert sorted(reader.keys()) == sorted(model)
        for key, t in model.items():
            _same(reader.get(key), t)
        assert reader.verify_report().ok


def test_huggingface_storage_writer_one_process(tmp_path):
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    g = torch.Generator().manual_seed(4)
    state = {"a.w": torch.randn(4, 3, generator=g), "a.b": torch.arange(5.0),
             "h": torch.randn(2, 2, generator=g).to(torch.bfloat16)}
    path = str(tmp_path / "hf")
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(
        path, fqn_to_index_mapping={"a.w": 1, "a.b": 2, "h": 2}))
    assert sorted(os.listdir(path)) == ["model-00001-of-00002.safetensors",
                                        "model-00002-of-00002.safetensors",
                                        "model.safetensors.index.json"]
    with shardkit.open(path) as reader:
        assert reader.format == "huggingface" and len(reader.index.shards) == 2
        for key, t in state.items():
            _same(reader.get(key), t)


@pytest.mark.parametrize("variant", ["plain", "per-rank"])
def test_prefix_selects_dcp_components(saved, variant):
    root, full = saved
    path = f"{root}/{variant}"
    model = _model()
    got = shardkit.load(path, framework="torch", prefix="model")
    assert sorted(got) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    model.load_state_dict(got, strict=True)
    for key, t in model.state_dict().items():
        assert torch.equal(t, full[f"model.{key}"]), key
    some = shardkit.load(path, prefix="optim.state.0.", keys=["weight.exp_avg"])
    _same(some["weight.exp_avg"], full["optim.state.0.weight.exp_avg"])
    with shardkit.open(path, prefix="extra") as reader:
        assert sorted(reader.keys()) == ["count", "rep"]
        _same(reader.get("rep"), full["extra.rep"])
    target = {k[len("model."):]: torch.zeros_like(v) for k, v in full.items()
              if k.startswith("model.")}
    shardkit.restore_into(path, target, prefix="model").assert_consumed()
    with pytest.raises(KeyNotFoundError, match=r"prefix 'mode'.*prefixes stored: 'model\.'"):
        shardkit.load(path, prefix="mode")  # a whole component only, never model.* by 'mode'


def test_prefix_of_a_torch_save_file(tmp_path):
    pt = str(tmp_path / "sd.pt")
    state = {"enc.w": torch.ones(2, 2), "enc.b": torch.zeros(2), "dec.w": torch.eye(2)}
    torch.save(state, pt)
    assert sorted(shardkit.load(pt, prefix="enc")) == ["b", "w"]


# ------------------------------------------------------------------------- broken


def _rewrite(file: str, change) -> None:
    with open(file, "rb") as f:
        md = pickle.load(f)
    change(md)
    with open(file, "wb") as f:
        pickle.dump(md, f)


def _copy(saved, variant, tmp_path) -> str:
    import shutil

    root, _ = saved
    dst = str(tmp_path / variant)
    shutil.copytree(f"{root}/{variant}", dst)
    return dst


def test_rank_metadata_files_that_disagree(saved, tmp_path):
    path = _copy(saved, "per-rank", tmp_path)

    def grow(md):
        meta = md.state_dict_metadata["model.0.weight"]
        meta.size = torch.Size([8, 5])

    _rewrite(f"{path}/__1.metadata", grow)
    with pytest.raises(CorruptIndexError, match=r"__1\.metadata: key 'model\.0\.weight' is of "
                       r"size \[8, 5\].*of size \[7, 5\].*in __0\.metadata"):
        shardkit.open(path)


def test_rank_metadata_file_missing_leaves_a_hole(saved, tmp_path):
    path = _copy(saved, "per-rank", tmp_path)
    os.remove(f"{path}/__1.metadata")  # rank 1's chunks are then in no index
    with pytest.raises(CorruptIndexError, match=r"'model\.0\.weight' do not tile"):
        shardkit.open(path)


def test_rank_metadata_object_and_tensor(saved, tmp_path):
    path = _copy(saved, "per-rank", tmp_path)

    def swap(md):
        md.state_dict_metadata["optim.param_groups.0.lr"] = md.state_dict_metadata["extra.count"]

    _rewrite(f"{path}/__1.metadata", swap)
    with pytest.raises(CorruptIndexError, match=r"'optim\.param_groups\.0\.lr' is a tensor "
                       "here and an object"):
        shardkit.open(path)


def _one_safetensors(tmp_path) -> tuple[str, dict]:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    state = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(5)),
             "b": torch.arange(5.0), "obj": {"lr": 0.5}}
    path = str(tmp_path / "st")
    dcp.save(state, storage_writer=FileSystemWriter(
        path, serialization_format=SerializationFormat.SAFETENSORS))
    return path, state


def test_safetensors_distcp_one_process(tmp_path):
    path, state = _one_safetensors(tmp_path)
    with shardkit.open(path) as reader:
        assert sorted(reader.keys()) == ["b", "w"]
        assert reader.metadata["dcp.objects"] == ["obj.lr"]  # written before the tensors
        _same(reader.get("w"), state["w"])
        _same(reader.get("b"), state["b"])


def test_safetensors_distcp_length_disagrees(tmp_path):
    path, _ = _one_safetensors(tmp_path)

    def shorten(md):
        for k, info in md.storage_data.items():
            if k.fqn == "w":
                info.length = 40

    _rewrite(f"{path}/.metadata", shorten)
    with pytest.raises(CorruptIndexError, match=r"__0_0\.distcp: key 'w' chunk at \[0, 0\]: "
                       "the index says 40 bytes, its safetensors entry holds 48"):
        shardkit.open(path)


def test_safetensors_distcp_entry_of_another_shape(tmp_path):
    path, _ = _one_safetensors(tmp_path)

    def reshape(md):
        md.state_dict_metadata["w"].size = torch.Size([3, 4])
        md.state_dict_metadata["w"].chunks[0].sizes = torch.Size([3, 4])

    _rewrite(f"{path}/.metadata", reshape)
    with pytest.raises(CorruptIndexError, match=r"'w'.*safetensors entry is F32 \[4, 3\], the "
                       r"index says F32 \[3, 4\]"):
        shardkit.open(path)


def test_safetensors_distcp_sharding_info_disagrees(tmp_path):
    path, _ = _one_safetensors(tmp_path)
    file = f"{path}/__0_0.distcp"
    data = open(file, "rb").read()
    old = b'\\"w\\": {\\"saved_offsets\\": [0, 0]}'
    assert data.count(old) == 1
    open(file, "wb").write(data.replace(old, old.replace(b"[0, 0]", b"[0, 1]")))
    with pytest.raises(CorruptIndexError, match=r"'w'.*DCP_SHARDING_INFO gives \[0, 1\]"):
        shardkit.open(path)


def test_safetensors_distcp_without_the_entry(tmp_path):
    path, _ = _one_safetensors(tmp_path)

    def rename(md):
        md.state_dict_metadata["v"] = md.state_dict_metadata.pop("w")
        for k in list(md.storage_data):
            if k.fqn == "w":
                md.storage_data[type(k)("v", k.offset, k.index)] = md.storage_data.pop(k)

    _rewrite(f"{path}/.metadata", rename)
    with pytest.raises(CorruptIndexError, match=r"key 'v'.*has no entry 'v'"):
        shardkit.open(path)


def test_dcp_manifest_name_in_the_not_found_message(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(shardkit.errors.CheckpointNotFoundError, match=r"__0\.metadata"):
        shardkit.open(str(tmp_path / "x"))


# --------------------------------- torch.save archives: what torch's own reader refuses


def _pt(tmp_path, data: bytes) -> str:
    pt = tmp_path / "t.pt"
    pt.write_bytes(data)
    return str(pt)


def _saved_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    torch.save({"w": torch.arange(6.0)}, buf)
    return buf.getvalue()


def _with_record(data: bytes, name: str, value: bytes | None) -> bytes:
    """The archive `data` with record `name` holding `value` (None: left out)."""
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            if info.filename.endswith("/" + name):
                if value is not None:
                    dst.writestr(info.filename, value)
            else:
                dst.writestr(info.filename, src.read(info))
    return out.getvalue()


@pytest.mark.parametrize("value, shown_as", [(None, "missing"), (b"0\n", r"b'0\\n'"),
                                             (b"11\n", r"b'11\\n'"), (b"x\n", r"b'x\\n'")])
def test_archive_version_torch_refuses(tmp_path, value, shown_as):
    data = _with_record(_saved_bytes(), "version", value)
    with pytest.raises(CorruptIndexError, match=rf"version record is {shown_as}, not a "
                       r"version torch reads \(1 to 10"):
        shardkit.open(_pt(tmp_path, data))


@pytest.mark.parametrize("value", [b"1\n", b"3", b" 10\n", b"3x"])
def test_archive_versions_torch_reads(tmp_path, value):
    data = _with_record(_saved_bytes(), "version", value)
    torch.load(_pt(tmp_path, data), weights_only=True)  # torch reads it: so does shardkit
    _same(shardkit.load(_pt(tmp_path, data))["w"], torch.arange(6.0))


def test_archive_record_sizes_disagree(tmp_path):
    data = bytearray(_saved_bytes())
    cd = data.find(b"PK\x01\x02" + bytes(4))
    while data[cd + 46 : cd + 46 + 14] != b"archive/data/0":
        cd = data.find(b"PK\x01\x02", cd + 4)
    data[cd + 24] += 1  # the stored record's size, one more than its compressed size
    with pytest.raises(CorruptIndexError, match=r"record 'archive/data/0' .* is 24 bytes "
                       "stored for 25 .* sizes disagree"):
        shardkit.open(_pt(tmp_path, bytes(data)))


def test_archive_record_outside_its_directory(tmp_path):
    data = bytearray(_saved_bytes())
    at = data.rfind(b"archive/byteorder")  # its central directory entry's name
    data[at] = ord("X")
    with pytest.raises(CorruptIndexError, match=r"record 'Xrchive/byteorder' is not in the "
                       "archive's directory 'archive/'"):
        shardkit.open(_pt(tmp_path, bytes(data)))


def test_metadata_layout_torch_does_not_know(tmp_path):
    path = str(tmp_path / "d")
    dcp.save({"w": torch.ones(2)}, checkpoint_id=path)
    file = os.path.join(path, ".metadata")
    data = open(file, "rb").read()
    assert data.count(b"\x8c\rtorch.strided") == 1
    open(file, "wb").write(data.replace(b"\x8c\rtorch.strided", b"\x8c\rtorch.stride!"))
    with pytest.raises(CorruptIndexError, match=r"layout 'torch.stride!' is not one of torch's"):
        shardkit.open(path)


def test_dcp_at_a_url_is_refused_naming_why(tmp_path):
    # a DCP directory uploaded to S3 (moto's server): the fsspec storage reads shardkit's own
    # checkpoints only, and says so for DCP by name, never half-reading it
    pytest.importorskip("moto")
    s3fs = pytest.importorskip("s3fs")
    from s3server import S3Server

    path = str(tmp_path / "d")
    dcp.save({"w": torch.ones(3)}, checkpoint_id=path)
    server = S3Server().start()
    try:
        shardkit.set_storage_options("s3://", **server.options)
        bucket = server.bucket()
        fs = s3fs.S3FileSystem(**server.options)
        for name in os.listdir(path):
            fs.put(os.path.join(path, name), f"{bucket}/dcp/{name}")
        with pytest.raises(shardkit.errors.ShardkitError, match=r"__0_0\.distcp: only shardkit "
                           r"checkpoints are read from URLs \(a HuggingFace, PyTorch DCP"):
            shardkit.open(f"s3://{bucket}/dcp")
    finally:
        shardkit.set_storage_options("s3://")
        server.stop()
