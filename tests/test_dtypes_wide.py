"""Issue 21 item 3: complex128 (shardkit's name C128) and float8_e8m0fnu (safetensors' F8_E8M0)
are stored bit-exact through every read mode, torch and jax; safetensors reads F8_E8M0 shards
and, as docs/FORMAT.md says, refuses a shard that holds C128."""

import ml_dtypes
import numpy as np
import pytest

import shardkit
from shardkit import CheckpointOptions, UnsupportedDTypeError
from shardkit.values.dtypes import STORABLE_NAMES, itemsize, numpy_dtype, safetensors_name

NAMES = {"C128": np.complex128, "F8_E8M0": ml_dtypes.float8_e8m0fnu}
RAW = CheckpointOptions(durable=False)


def _special(name: str) -> np.ndarray:
    """Every bit pattern of float8_e8m0fnu (0xFF is its nan), or complex128 with -0.0, nan
    payloads, subnormals and infinities in both parts, as an odd-width 2-D array."""
    if name == "F8_E8M0":
        return np.arange(256, dtype=np.uint8).view(NAMES[name]).reshape(16, 16)[:, :15].copy()
    bits = np.array([0x8000000000000000, 0x7FF8000000001234, 0xFFF4000000000001, 1,
                     0x800FFFFFFFFFFFFF, 0x7FF0000000000000, 0xFFF0000000000000,
                     0x3FF0000000000000, 0, 0x0008000000000000], dtype=np.uint64)
    pairs = np.random.default_rng(0).choice(bits, size=(7, 6)).astype("<u8")
    return pairs.view(np.complex128).reshape(7, 3).copy()


def _bytes(a) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("name", sorted(NAMES))
def test_table(name):
    dtype = np.dtype(NAMES[name])
    assert safetensors_name(dtype) == name
    assert numpy_dtype(name) == dtype
    assert itemsize(name) == dtype.itemsize
    assert dtype.name in STORABLE_NAMES


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("name", sorted(NAMES))
def test_round_trip_every_read_mode(tmp_path, name, compression):
    a = _special(name)
    state = {"a": a, "b": np.ones(5, np.float32), "c": a[::2, 1:].copy()}
    p = tmp_path / "ck"
    shardkit.save(p, state, options=CheckpointOptions(compression=compression, durable=False))
    for mmap in (True, False):
        out = shardkit.load(p, mmap=mmap)
        for key in ("a", "c"):
            assert out[key].dtype == a.dtype and out[key].shape == state[key].shape
            assert _bytes(out[key]) == _bytes(state[key])
        with shardkit.open(p, mmap=mmap) as r:
            assert r.info("a").dtype_name == name
            part = r.get_slice("a", np.s_[1:6:2, ::-1])
            assert part.dtype == a.dtype and _bytes(part) == _bytes(a[1:6:2, ::-1])
            r.verify()
    target = {"a": np.zeros_like(a), "b": np.zeros(5, np.float32),
              "c": np.zeros_like(state["c"])}
    shardkit.restore_into(p, target)
    assert _bytes(target["a"]) == _bytes(a) and _bytes(target["c"]) == _bytes(state["c"])


@pytest.mark.parametrize("name", sorted(NAMES))
def test_torch(tmp_path, name):
    torch = pytest.importorskip("torch")
    a = _special(name)
    p = tmp_path / "ck"
    shardkit.save(p, {"a": a}, options=RAW)
    t = shardkit.load(p, framework="torch")["a"]
    want = {"C128": torch.complex128, "F8_E8M0": torch.float8_e8m0fnu}[name]
    assert t.dtype == want and tuple(t.shape) == a.shape
    assert t.view(torch.uint8).numpy().tobytes() == _bytes(a)
    with shardkit.open(p) as r:
        part = r.get_slice("a", np.s_[2:5], framework="torch")
        assert part.dtype == want and part.view(torch.uint8).numpy().tobytes() == _bytes(a[2:5])
    # torch tensors of these dtypes save bit-exact too, and restore_into copies into them
    q = tmp_path / "from_torch"
    shardkit.save(q, {"t": t}, options=RAW)
    assert _bytes(shardkit.load(q)["t"]) == _bytes(a)
    target = {"t": torch.zeros(a.shape, dtype=want)}
    shardkit.restore_into(q, target)
    assert target["t"].view(torch.uint8).numpy().tobytes() == _bytes(a)


def test_safetensors_reads_float8_e8m0(tmp_path):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    a = _special("F8_E8M0")
    p = tmp_path / "ck"
    shardkit.save(p, {"a": a, "b": np.arange(3, dtype=np.int16)}, options=RAW)
    got = {}
    for f in sorted(p.glob("*.safetensors")):
        got.update(st_torch.load_file(str(f)))
    assert got["a"].dtype == torch.float8_e8m0fnu and tuple(got["a"].shape) == a.shape
    assert got["a"].contiguous().view(torch.uint8).numpy().tobytes() == _bytes(a)


def test_safetensors_does_not_know_complex128(tmp_path):
    # C128 is shardkit's name (docs/FORMAT.md 3.2): safetensors refuses the shard that holds one
    safetensors = pytest.importorskip("safetensors")
    p = tmp_path / "ck"
    shardkit.save(p, {"a": _special("C128")}, options=RAW)
    (shard,) = p.glob("*.safetensors")
    with pytest.raises(safetensors.SafetensorError, match="C128"):
        safetensors.safe_open(str(shard), framework="numpy")


@pytest.mark.parametrize("name", sorted(NAMES))
def test_jax(tmp_path, name):
    jax = pytest.importorskip("jax")
    a = _special(name)
    p = tmp_path / "ck"
    shardkit.save(p, {"a": a}, options=RAW)
    with jax.enable_x64(True):
        j = shardkit.load(p, framework="jax")["a"]
        assert j.dtype == jax.numpy.dtype(NAMES[name]) and _bytes(np.asarray(j)) == _bytes(a)
        q = tmp_path / "from_jax"
        shardkit.save(q, {"j": j}, options=RAW)
        assert _bytes(shardkit.load(q)["j"]) == _bytes(a)


def test_jax_complex128_needs_x64_mode(tmp_path):
    jax = pytest.importorskip("jax")
    shardkit.save(tmp_path / "ck", {"c": _special("C128")}, options=RAW)
    with jax.enable_x64(False), pytest.raises(
            UnsupportedDTypeError, match="'c': dtype complex128 needs jax's 64-bit mode"):
        shardkit.load(tmp_path / "ck", framework="jax")


def test_refusal_lists_the_new_dtypes(tmp_path):
    with pytest.raises(UnsupportedDTypeError, match="complex256 cannot be stored") as e:
        shardkit.save(tmp_path / "ck", {"z": np.zeros(2, np.clongdouble)})
    assert not (tmp_path / "ck").exists()
    assert "complex128" in str(e.value) and "float8_e8m0fnu" in str(e.value)
