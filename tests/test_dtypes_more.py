"""Issue 21 item 3 (first part): complex64, float8_e4m3fnuz and float8_e5m2fnuz are stored
under safetensors' names, bit-exact through every read mode, torch, jax and safetensors."""

import ml_dtypes
import numpy as np
import pytest

import shardkit
from shardkit import CheckpointOptions
from shardkit.values.dtypes import itemsize, numpy_dtype, safetensors_name

NAMES = {"C64": np.complex64, "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
         "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz}


def _special(name: str) -> np.ndarray:
    """Every bit pattern of a float8 (nan 0x80, subnormals), or complex64 with -0.0, a nan
    payload, subnormals and infinities in both parts, as an odd-length 2-D array."""
    if name != "C64":
        return np.arange(256, dtype=np.uint8).view(NAMES[name]).reshape(16, 16)[:, :15].copy()
    bits = np.array([0x80000000, 0x7FC01234, 0xFFA00001, 0x00000001, 0x807FFFFF, 0x7F800000,
                     0xFF800000, 0x3F800000, 0, 0x00400000], dtype=np.uint32)
    rng = np.random.default_rng(0)
    pairs = rng.choice(bits, size=(7, 6)).astype("<u4")
    return pairs.view(np.complex64).reshape(7, 3).copy()


def _bytes(a) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("name", sorted(NAMES))
def test_table(name):
    assert safetensors_name(np.dtype(NAMES[name])) == name
    assert numpy_dtype(name) == np.dtype(NAMES[name])
    assert itemsize(name) == np.dtype(NAMES[name]).itemsize


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("name", sorted(NAMES))
def test_round_trip_every_read_mode(tmp_path, name, compression):
    a = _special(name)
    state = {"a": a, "b": np.ones(5, np.float32)}
    p = tmp_path / "ck"
    shardkit.save(p, state, options=CheckpointOptions(compression=compression, durable=False))
    for mmap in (True, False):
        out = shardkit.load(p, mmap=mmap)
        assert out["a"].dtype == a.dtype and out["a"].shape == a.shape
        assert _bytes(out["a"]) == _bytes(a)
        with shardkit.open(p, mmap=mmap) as r:
            part = r.get_slice("a", np.s_[1:6:2, ::-1])
            assert part.dtype == a.dtype and _bytes(part) == _bytes(a[1:6:2, ::-1])
    target = {"a": np.zeros_like(a), "b": np.zeros(5, np.float32)}
    shardkit.restore_into(p, target)
    assert _bytes(target["a"]) == _bytes(a)


@pytest.mark.parametrize("name", sorted(NAMES))
def test_torch_and_safetensors(tmp_path, name):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    a = _special(name)
    p = tmp_path / "ck"
    shardkit.save(p, {"a": a}, options=CheckpointOptions(durable=False))
    t = shardkit.load(p, framework="torch")["a"]
    want = {"C64": torch.complex64, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
            "F8_E5M2FNUZ": torch.float8_e5m2fnuz}[name]
    assert t.dtype == want and tuple(t.shape) == a.shape
    assert t.view(torch.uint8).numpy().tobytes() == _bytes(a)
    shards = sorted(p.glob("*.safetensors"))
    assert shards
    got = {}
    for f in shards:
        got.update(st_torch.load_file(str(f)))
    assert got["a"].dtype == want
    assert got["a"].contiguous().view(torch.uint8).numpy().tobytes() == _bytes(a)
    # saving torch tensors of these dtypes comes back bit-exact too
    q = tmp_path / "from_torch"
    shardkit.save(q, {"t": t}, options=CheckpointOptions(durable=False))
    assert _bytes(shardkit.load(q)["t"]) == _bytes(a)


def test_safetensors_numpy_reads_complex(tmp_path):
    st_np = pytest.importorskip("safetensors.numpy")
    a = _special("C64")
    p = tmp_path / "ck"
    shardkit.save(p, {"a": a}, options=CheckpointOptions(durable=False))
    got = {}
    for f in sorted(p.glob("*.safetensors")):
        got.update(st_np.load_file(str(f)))
    assert got["a"].dtype == np.complex64 and _bytes(got["a"]) == _bytes(a)


@pytest.mark.parametrize("name", sorted(NAMES))
def test_jax(tmp_path, name):
    jnp = pytest.importorskip("jax.numpy")
    a = _special(name)
    p = tmp_path / "ck"
    shardkit.save(p, {"a": a}, options=CheckpointOptions(durable=False))
    j = shardkit.load(p, framework="jax")["a"]
    assert j.dtype == jnp.dtype(NAMES[name]) and _bytes(np.asarray(j)) == _bytes(a)
