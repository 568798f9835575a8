"""Framework-native loading: ``load(path, framework="torch" | "jax", device=...)`` and the same
options on ``CheckpointReader.get`` / ``get_slice`` (shardkit.frameworks)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from test_reader import _split_ckpt

import shardkit
from shardkit.errors import (
    InvalidArgumentError,
    InvalidArgumentTypeError,
    MissingDependencyError,
    ShardkitError,
    UnsupportedDTypeError,
)
from shardkit.frameworks import FRAMEWORKS, convert_all, converter
from shardkit.values.dtypes import STORABLE

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

ROOT = Path(__file__).resolve().parent.parent
DTYPES = sorted(STORABLE, key=str)
SHAPES = [(3, 5), (), (0, 4), (7,)]
TORCH_DTYPES = {
    "bool": torch.bool, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
    "uint16": torch.uint16, "int32": torch.int32, "uint32": torch.uint32,
    "int64": torch.int64, "uint64": torch.uint64, "float16": torch.float16,
    "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz, "float8_e5m2fnuz": torch.float8_e5m2fnuz,
    "complex64": torch.complex64, "complex128": torch.complex128,
    "float8_e8m0fnu": torch.float8_e8m0fnu,
}
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)


def random_array(dtype: np.dtype, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random bit patterns of `dtype` (NaN payloads, infinities, subnormals included)."""
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    raw = rng.integers(0, 256, (*shape, dtype.itemsize), dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def torch_bits(t) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def file_bytes(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir())}


def mapping_of(address: int) -> tuple[str, str] | None:
    """(permissions, path) of the mapping of this process that holds `address`."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return parts[1], parts[5].strip() if len(parts) > 5 else ""
    return None


@pytest.fixture
def every_dtype(tmp_path):
    state = {f"{dt}/{i}": random_array(dt, shape, i)
             for dt in DTYPES for i, shape in enumerate(SHAPES)}
    shardkit.save(tmp_path / "c", state, options=shardkit.CheckpointOptions(durable=False))
    return tmp_path / "c", state


# --- the package ---------------------------------------------------------------------------------


def test_import_shardkit_imports_no_framework(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        import numpy as np
        import shardkit, shardkit.frameworks
        shardkit.save({str(tmp_path / "c")!r}, {{"a": np.ones(3)}}, durable=False)
        shardkit.load({str(tmp_path / "c")!r}, framework="numpy")
        with shardkit.open({str(tmp_path / "c")!r}) as r:
            r.get("a", framework="numpy"), r.get_slice("a", 0, framework="numpy")
        print(sorted(m for m in ("torch", "jax", "shardkit.frameworks.torch",
                                  "shardkit.frameworks.jax") if m in sys.modules))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, timeout=120).stdout
    assert out.strip() == "[]"


def to_framework(array: np.ndarray, framework: str = "numpy", device=None, key: str = ""):
    """`array` as a `framework` tensor on `device`, the way `load` converts it."""
    conv = converter(framework, device)
    return array if conv is None else conv(array, key)


def test_numpy_is_the_identity(every_dtype):
    path, state = every_dtype
    assert converter() is None and converter("numpy", "cpu") is None
    a = np.arange(3)
    assert to_framework(a) is a
    got = shardkit.load(path, framework="numpy", device="cpu")
    assert all(type(v) is np.ndarray and bits(v) == bits(state[k]) for k, v in got.items())
    assert FRAMEWORKS == ("numpy", "torch", "jax", "tensorflow")
    assert convert_all({"a": a}, None)["a"] is a


# --- torch ---------------------------------------------------------------------------------------


def test_torch_every_dtype_bit_exact(every_dtype):
    path, state = every_dtype
    got = shardkit.load(path, framework="torch")
    assert list(got) == list(state)
    for key, t in got.items():
        want = state[key]
        assert isinstance(t, torch.Tensor), key
        assert t.dtype == TORCH_DTYPES[want.dtype.name], key
        assert tuple(t.shape) == want.shape and t.device.type == "cpu", key
        assert torch_bits(t) == bits(want), key


@pytest.mark.parametrize("dtype", [BF16, E4M3, E5M2, np.dtype(np.float32), np.dtype(bool),
                                   np.dtype(np.uint64)])
def test_torch_values_match_numpy(tmp_path, dtype):
    if dtype.kind == "b":
        a = np.arange(-6, 6) % 3 == 0
    elif dtype.kind in "iu":
        a = np.arange(12).astype(dtype)
    else:
        a = np.linspace(-6, 6, 12).astype(np.float32).astype(dtype)
    shardkit.save(tmp_path / "c", {"a": a}, options=shardkit.CheckpointOptions(durable=False))
    t = shardkit.load(tmp_path / "c", framework="torch")["a"]
    if dtype.kind == "b" or dtype.kind in "iu":
        assert t.numpy().tolist() == a.tolist()
    else:
        assert t.float().numpy().tolist() == a.astype(np.float32).tolist()


def test_torch_is_zero_copy_over_the_map_and_copy_on_write(tmp_path):
    state = {"bf": np.linspace(-2, 2, 1000).astype(BF16),
             "f8": np.linspace(-2, 2, 1000).astype(E4M3),
             "f32": np.linspace(-2, 2, 1000).astype(np.float32),
             "i64": np.arange(1000, dtype=np.int64),
             "scalar": np.array(1.5, BF16)}
    shardkit.save(tmp_path / "c", state, options=shardkit.CheckpointOptions(durable=False))
    before = file_bytes(tmp_path / "c")
    shard = next(str(tmp_path / "c" / n) for n in before if n.endswith(".safetensors"))
    got = shardkit.load(tmp_path / "c", framework="torch")
    for key, t in got.items():
        perms, mapped = mapping_of(t.data_ptr())
        assert mapped == shard and perms.startswith("rw") and perms.endswith("p"), key
    got["bf"].add_(1).mul_(2)
    got["f32"].mul_(-1)
    got["i64"].add_(7)
    got["f8"].fill_(0.5)
    got["scalar"].add_(1)
    assert got["i64"][3].item() == 10 and got["scalar"].item() == 2.5
    assert file_bytes(tmp_path / "c") == before
    again = shardkit.load(tmp_path / "c", framework="torch")
    for key, t in again.items():
        assert torch_bits(t) == bits(state[key]), key


def test_reader_get_torch_shares_the_map_with_numpy(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4).astype(BF16)
    shardkit.save(tmp_path / "c", {"a": a}, options=shardkit.CheckpointOptions(durable=False))
    with shardkit.open(tmp_path / "c") as r:
        view = r.get("a")
        t = r.get("a", framework="torch")
        assert type(r["a"]) is np.ndarray
        assert t.data_ptr() == view.ctypes.data and t.dtype == torch.bfloat16
        t[0, 0] = 100  # the reader's map is shared: numpy sees torch's write
        assert float(view[0, 0]) == 100.0
        s = r.get_slice("a", (slice(1, 3), slice(None, None, 2)), framework="torch")
        assert s.tolist() == torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)[
            1:3, ::2].tolist()
        rev = r.get_slice("a", (slice(None, None, -1), 1), framework="torch")  # negative step
        assert rev.float().tolist() == [9.0, 5.0, 1.0]
        one = r.get_slice("a", (2, 3), framework="torch")
        assert one.shape == () and one.item() == 11.0
        empty = r.get_slice("a", slice(0, 0), framework="torch")
        assert tuple(empty.shape) == (0, 4) and empty.dtype == torch.bfloat16
    assert t.float().sum().item() == a.astype(np.float32).sum() + 100  # valid after close


def test_torch_split_and_zstd_and_unmapped(tmp_path):
    a = random_array(BF16, (4, 6), 3)
    _split_ckpt(tmp_path / "split", a)
    state = {f"k{i}": random_array(dt, (5, 3), i) for i, dt in enumerate([BF16, E4M3, E5M2])}
    state["f"] = np.arange(4096, dtype=np.float32)
    shardkit.save(tmp_path / "z", state,
                  options=shardkit.CheckpointOptions(compression="zstd", durable=False))
    t = shardkit.load(tmp_path / "split", framework="torch")["t"]
    assert t.dtype == torch.bfloat16 and torch_bits(t) == bits(a)
    with shardkit.open(tmp_path / "split") as r:
        s = r.get_slice("t", (slice(0, 3), slice(1, 5)), framework="torch")
        assert torch_bits(s) == bits(a[0:3, 1:5])
        assert torch_bits(r.get("t", framework="torch")) == bits(a)
    before = file_bytes(tmp_path / "z")
    for mmap in (True, False):
        got = shardkit.load(tmp_path / "z", framework="torch", mmap=mmap)
        for key, v in got.items():
            assert torch_bits(v) == bits(state[key]), key
        got["f"].add_(1)
        with shardkit.open(tmp_path / "z", mmap=mmap) as r:
            assert torch_bits(r.get("k0", framework="torch")) == bits(state["k0"])
            assert r.get_slice("f", slice(10, 13), framework="torch").tolist() == [10, 11, 12]
    unmapped = shardkit.load(tmp_path / "split", framework="torch", mmap=False)["t"]
    assert torch_bits(unmapped) == bits(a)
    assert file_bytes(tmp_path / "z") == before


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.norm = torch.nn.BatchNorm1d(3)  # buffers: running stats, an int64 counter
        self.scale = torch.nn.Parameter(torch.randn(3).to(torch.bfloat16))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("codes", torch.randn(2, 2).to(torch.float8_e4m3fn))

    def forward(self, x):
        return self.norm(self.fc(x)) * self.scale.float()


def test_load_state_dict_idiom(tmp_path):
    torch.manual_seed(0)
    src = _Net()
    src.norm(torch.randn(8, 3))  # non-trivial running stats
    shardkit.save(tmp_path / "c", src.state_dict(),
                  options=shardkit.CheckpointOptions(durable=False))
    before = file_bytes(tmp_path / "c")
    dst = _Net()
    result = dst.load_state_dict(shardkit.load(tmp_path / "c", framework="torch"))
    assert not result.missing_keys and not result.unexpected_keys
    want, got = src.state_dict(), dst.state_dict()
    assert list(got) == list(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch_bits(got[key]) == torch_bits(want[key]), key
    assert dst.scale.dtype == torch.bfloat16 and dst.norm.num_batches_tracked.item() == 1
    stats = dst.norm.running_mean.clone()
    dst(torch.randn(8, 4))  # training mode: updates the loaded buffers in place
    assert not torch.equal(dst.norm.running_mean, stats)
    with torch.no_grad():
        for p in dst.parameters():
            p.add_(1)
    assert file_bytes(tmp_path / "c") == before


def test_in_place_ops_on_every_tensor(tmp_path):
    rng = np.random.default_rng(1)
    dtypes = [BF16, BF16, E4M3, E5M2, np.float32, np.float32, BF16, E4M3]
    state = {f"t{i}": rng.uniform(-8, 8, (3 + i, 2)).astype(np.float32).astype(dt)
             for i, dt in enumerate(dtypes)}
    state["t5"] = np.array(2.25, np.float32)  # 0-d
    state["t6"] = np.zeros((0, 3), BF16)  # empty
    shardkit.save(tmp_path / "c", state, options=shardkit.CheckpointOptions(durable=False))
    before = file_bytes(tmp_path / "c")
    got = shardkit.load(tmp_path / "c", framework="torch")
    for t in got.values():
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            # torch 2.13 has no CPU add_/mul_ kernels for float8: compute wide, write in place
            t.copy_(t.float().add_(1).mul_(2))
        else:
            t.add_(1).mul_(2)
    for key, t in got.items():
        a = state[key]
        if a.dtype in (E4M3, E5M2):
            want = ((a.astype(np.float32) + 1) * 2).astype(a.dtype)
        else:  # one rounding per op, as torch does
            want = ((a.astype(np.float32) + 1).astype(a.dtype).astype(np.float32) * 2
                    ).astype(a.dtype)
        assert torch_bits(t) == bits(want), key
    assert file_bytes(tmp_path / "c") == before
    again = shardkit.load(tmp_path / "c")
    assert all(bits(again[k]) == bits(state[k]) for k in state)


def test_torch_device_handling(tmp_path):
    shardkit.save(tmp_path / "c", {"a": np.arange(4, dtype=np.float32)},
                  options=shardkit.CheckpointOptions(durable=False))
    with shardkit.open(tmp_path / "c") as r:
        ptr = r.get("a").ctypes.data
        for device in ("cpu", "cpu:0", torch.device("cpu")):
            t = r.get("a", framework="torch", device=device)
            assert t.device.type == "cpu" and t.data_ptr() == ptr  # still zero-copy
        with pytest.raises(InvalidArgumentError, match="meta tensor has no data"):
            r.get("a", framework="torch", device="meta")
        with pytest.raises(InvalidArgumentError, match="meta"):
            r.get_slice("a", 0, framework="torch", device=torch.device("meta"))
    # checked before anything is read: a bad device wins over a missing checkpoint
    with pytest.raises(InvalidArgumentError, match="'meta'"):
        shardkit.load(tmp_path / "nothing", framework="torch", device="meta")
    with pytest.raises(InvalidArgumentError, match="not a torch device"):
        shardkit.load(tmp_path / "c", framework="torch", device="warp-drive")
    with pytest.raises(InvalidArgumentTypeError, match=r"str or a torch\.device"):
        shardkit.load(tmp_path / "c", framework="torch", device=3.5)
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgumentError, match="'cuda' is not available to torch"):
            shardkit.load(tmp_path / "c", framework="torch", device="cuda")


# --- jax -----------------------------------------------------------------------------------------


def test_jax_every_dtype_bit_exact(every_dtype):
    path, state = every_dtype
    with jax.enable_x64(True):
        got = shardkit.load(path, framework="jax")
    assert list(got) == list(state)
    for key, j in got.items():
        want = state[key]
        assert isinstance(j, jax.Array), key
        assert j.dtype == want.dtype and j.shape == want.shape, key
        assert bits(np.asarray(j)) == bits(want), key


def test_jax_64_bit_needs_x64_mode(tmp_path):
    shardkit.save(tmp_path / "c", {"small": np.arange(3, dtype=np.int32),
                                   "big": np.arange(3, dtype=np.int64)},
                  options=shardkit.CheckpointOptions(durable=False))
    with jax.enable_x64(False):
        assert shardkit.load(tmp_path / "c", "small", framework="jax")["small"].dtype == np.int32
        with pytest.raises(UnsupportedDTypeError, match="'big': dtype int64 needs jax's 64-bit"):
            shardkit.load(tmp_path / "c", framework="jax")


def test_jax_copies_and_is_immutable(tmp_path):
    a = np.arange(1024, dtype=np.float32).astype(BF16)
    shardkit.save(tmp_path / "c", {"a": a}, options=shardkit.CheckpointOptions(durable=False))
    with shardkit.open(tmp_path / "c") as r:
        view = r.get("a")
        j = r.get("a", framework="jax")
        assert j.unsafe_buffer_pointer() != view.ctypes.data  # a copy, not the map
        view[:] = 0  # writing the (private) map does not reach the jax array
        assert bits(np.asarray(j)) == bits(a)
        with pytest.raises(TypeError):
            j[0] = 5  # jax arrays are immutable
        assert float(j.at[0].set(5)[0]) == 5.0 and float(j[0]) == 0.0
        s = r.get_slice("a", slice(None, 4, -1), framework="jax", device="cpu")
        assert isinstance(s, jax.Array) and bits(np.asarray(s)) == bits(np.zeros(1019, BF16))


def test_jax_split_zstd_and_devices(tmp_path):
    a = random_array(E5M2, (4, 6), 5)
    _split_ckpt(tmp_path / "split", a)
    shardkit.save(tmp_path / "z", {"a": a, "b": np.arange(9, dtype=np.int8)},
                  options=shardkit.CheckpointOptions(compression="zstd", durable=False))
    dev = jax.devices("cpu")[0]
    for device in (None, "cpu", "cpu:0", dev, jax.sharding.SingleDeviceSharding(dev)):
        j = shardkit.load(tmp_path / "split", framework="jax", device=device)["t"]
        assert bits(np.asarray(j)) == bits(a) and list(j.devices()) == [dev]
        z = shardkit.load(tmp_path / "z", framework="jax", device=device)
        assert bits(np.asarray(z["a"])) == bits(a) and z["b"].tolist() == list(range(9))
    with shardkit.open(tmp_path / "split") as r:
        assert bits(np.asarray(r.get_slice("t", (1, slice(2, 6)), framework="jax"))) == bits(
            a[1, 2:6])
    with pytest.raises(InvalidArgumentError, match="jax has 1 'cpu' device"):
        shardkit.load(tmp_path / "z", framework="jax", device="cpu:7")
    with pytest.raises(InvalidArgumentError, match="jax has no 'tpu' devices"):
        shardkit.load(tmp_path / "nothing", framework="jax", device="tpu")
    with pytest.raises(InvalidArgumentTypeError, match="jax Device"):
        shardkit.load(tmp_path / "z", framework="jax", device=torch.device("cpu"))


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["load", "get", "get_slice"])
def test_unknown_framework_names_the_options(tmp_path, call):
    shardkit.save(tmp_path / "c", {"a": np.ones(2)},
                  options=shardkit.CheckpointOptions(durable=False))
    with shardkit.open(tmp_path / "c") as r:
        run = {"load": lambda **kw: shardkit.load(tmp_path / "c", **kw),
               "get": lambda **kw: r.get("a", **kw),
               "get_slice": lambda **kw: r.get_slice("a", 0, **kw)}[call]
        with pytest.raises(InvalidArgumentError,
                           match=r"unknown framework 'tf'; choose 'numpy' \(the "
                                 r"default\), 'torch', 'jax' or 'tensorflow'"):
            run(framework="tf")
        with pytest.raises(InvalidArgumentTypeError, match="framework must be a str"):
            run(framework=torch)
        with pytest.raises(InvalidArgumentError, match="numpy arrays live in host memory"):
            run(framework="numpy", device="cuda")


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_framework_not_installed(tmp_path, monkeypatch, framework):
    shardkit.save(tmp_path / "c", {"a": np.ones(2)},
                  options=shardkit.CheckpointOptions(durable=False))
    monkeypatch.setitem(sys.modules, framework, None)  # import fails as if not installed
    with pytest.raises(MissingDependencyError,
                       match=f"framework='{framework}' needs {framework}, which cannot be "
                             f'imported .*: pip install "shardkit\\[{framework}\\]"'):
        shardkit.load(tmp_path / "c", framework=framework)
    with shardkit.open(tmp_path / "c") as r, pytest.raises(ShardkitError, match="'numpy'"):
        r.get("a", framework=framework)
    assert type(shardkit.load(tmp_path / "c")["a"]) is np.ndarray
