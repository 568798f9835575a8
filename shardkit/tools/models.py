"""Built-in synthetic model states, and reading a state from a .safetensors or .npz file.

Planning needs shapes and dtypes, not bytes. By default a synthetic state's arrays are views into
one ``np.empty`` buffer whose pages are never touched, so a 4 GiB "llm-1b" costs no memory:
the kernel maps untouched anonymous pages lazily. The arrays are ordinary C-contiguous arrays
(``.nbytes``, ``.shape`` and slicing behave as usual), each in its own aligned, non-overlapping
region. ``materialize=True`` fills them with deterministic pseudo-random values for real saves.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import (
    CheckpointFormatError,
    ShardkitError,
    UnknownModelError,
    UnsupportedDTypeError,
)
from ..optional import require
from ..sharding.tensors import unflatten
from ..values.dtypes import STORABLE_NAMES, as_dtype, is_supported

__all__ = [
    "MODELS",
    "load_state_file",
    "model_shapes",
    "state_nbytes",
    "synthetic_state",
]


_ALIGN = 64  # every tensor starts on a cache line, as a fresh np.empty would


@dataclass(frozen=True)
class _LLMConfig:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int


def _llm(cfg: _LLMConfig) -> list[tuple[str, tuple[int, ...]]]:
    """A Llama-style decoder: embedding, per layer attention q/k/v/o + gated MLP + 2 norms."""
    h, kv = cfg.hidden, cfg.hidden // cfg.heads * cfg.kv_heads
    specs: list[tuple[str, tuple[int, ...]]] = [("model/embed_tokens/weight", (cfg.vocab, h))]
    for i in range(cfg.layers):
        p = f"model/layers/{i}/"
        specs += [
            (p + "input_layernorm/weight", (h,)),
            (p + "self_attn/q_proj/weight", (h, h)),
            (p + "self_attn/k_proj/weight", (kv, h)),
            (p + "self_attn/v_proj/weight", (kv, h)),
            (p + "self_attn/o_proj/weight", (h, h)),
            (p + "post_attention_layernorm/weight", (h,)),
            (p + "mlp/gate_proj/weight", (cfg.intermediate, h)),
            (p + "mlp/up_proj/weight", (cfg.intermediate, h)),
            (p + "mlp/down_proj/weight", (h, cfg.intermediate)),
        ]
    specs += [("model/norm/weight", (h,)), ("lm_head/weight", (cfg.vocab, h))]
    return specs


def _many_small() -> list[tuple[str, tuple[int, ...]]]:
    """50,000 tensors of 0-3 dimensions, log-uniform 1..~9000 elements (187 MB as float32)."""
    rng = np.random.default_rng(20_000)  # the shapes are part of the model, not of `seed`
    n = 50_000
    counts = np.exp(rng.uniform(0.0, math.log(9000.0), n)).astype(np.int64) + 1
    ndims = rng.integers(1, 4, n)
    ndims[::100] = 0  # a scalar every 100 tensors
    splits = rng.uniform(0.0, 1.0, (n, 2))
    specs = []
    for i in range(n):
        count, nd = int(counts[i]), int(ndims[i])
        if nd == 0:
            shape: tuple[int, ...] = ()
        elif nd == 1:
            shape = (count,)
        else:
            # Split the element count between the axes at random points (in log space).
            a = max(1, round(count ** (splits[i, 0] / (nd - 1))))
            rest = max(1, count // a)
            if nd == 2:
                shape = (a, rest)
            else:
                b = max(1, round(rest ** splits[i, 1]))
                shape = (a, b, max(1, rest // b))
        specs.append((f"block{i // 500:03d}/param{i % 500:03d}", shape))
    return specs


def _mixed() -> list[tuple[str, tuple[int, ...]]]:
    """Three huge tensors (1 GiB, 512 MiB, 256 MiB as float32) among 10,000 tiny ones."""
    specs: list[tuple[str, tuple[int, ...]]] = [
        ("embedding/weight", (131072, 2048)),
        ("head/weight", (2048, 65536)),
        ("cache/buffer", (8, 1024, 1024, 8)),
    ]
    for i in range(10_000):
        group = f"tiny/{i // 100:03d}/"
        if i % 50 == 0:
            specs.append((group + f"step{i % 100:02d}", ()))
        else:
            specs.append((group + f"bias{i % 100:02d}", (1 + (i * 37) % 64,)))
    return specs


_LLM_1B = _LLMConfig(vocab=32000, hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4)
_LLM_SMALL = _LLMConfig(vocab=16384, hidden=1024, intermediate=2816, layers=4, heads=16, kv_heads=4)
_LLM_TINY = _LLMConfig(vocab=2048, hidden=128, intermediate=352, layers=2, heads=4, kv_heads=2)

_BUILDERS: dict[str, tuple[Callable[[], list[tuple[str, tuple[int, ...]]]], str]] = {
    "llm-1b": (
        lambda: _llm(_LLM_1B),
        "1.1B-parameter Llama-style decoder, 22 layers, hidden 2048 (4.1 GiB as float32)",
    ),
    "llm-small": (
        lambda: _llm(_LLM_SMALL),
        "78M-parameter decoder, 4 layers, hidden 1024 (300 MiB as float32)",
    ),
    "llm-tiny": (
        lambda: _llm(_LLM_TINY),
        "0.9M-parameter decoder, 2 layers, hidden 128 (3.4 MiB as float32), for tests",
    ),
    "many-small": (
        _many_small,
        "50,000 small tensors of varied shapes, 0-3 dimensions (179 MiB as float32)",
    ),
    "mixed": (
        _mixed,
        "3 huge tensors (1 GiB, 512 MiB, 256 MiB as float32) among 10,000 tiny ones",
    ),
}

MODELS: dict[str, str] = {name: desc for name, (_, desc) in _BUILDERS.items()}
"""Name -> one-line description of every built-in synthetic model."""


def model_shapes(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(checkpoint_key, shape)`` of every tensor of model `name`, in state order."""
    try:
        build = _BUILDERS[name][0]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {name!r}; built-in models: {', '.join(MODELS)}"
        ) from None
    return build()


def synthetic_state(
    name: str,
    *,
    dtype: Any = "float32",
    materialize: bool = False,
    seed: int = 0,
    on_progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """The nested state (dicts of numpy arrays) of built-in model `name`.

    `dtype` is any storable dtype (``"float32"``, ``"bfloat16"``, ``"float16"``...). With
    ``materialize=False`` the arrays' memory is never touched (costs no RAM; contents undefined);
    with ``materialize=True`` they hold deterministic values drawn from `seed`: normal(0, 0.02)
    weights, norms near 1 (integer dtypes: small integers; bool: coin flips). `on_progress` is
    called with the bytes filled so far, every million values or so.
    """
    specs = model_shapes(name)
    dt = _storable_dtype(dtype)
    flat = _carve(specs, dt)
    if materialize:
        _fill(flat, seed, on_progress)
    return unflatten(flat)


def state_nbytes(name: str, dtype: Any = "float32") -> int:
    """Data bytes of built-in model `name` in `dtype`, without building it."""
    itemsize = _storable_dtype(dtype).itemsize
    return sum(math.prod(shape) * itemsize for _, shape in model_shapes(name))


def _storable_dtype(dtype: Any) -> np.dtype:
    try:
        dt = as_dtype(dtype)
    except TypeError:
        raise UnsupportedDTypeError(
            f"unknown dtype {dtype!r}; valid dtypes: {', '.join(STORABLE_NAMES)}"
        ) from None
    if not is_supported(dt) or dt.byteorder == ">":
        raise UnsupportedDTypeError(
            f"dtype {dt} cannot be stored; valid dtypes: {', '.join(STORABLE_NAMES)}"
        )
    return dt


def _carve(
    specs: list[tuple[str, tuple[int, ...]]], dtypes: np.dtype | list[np.dtype]
) -> dict[str, np.ndarray]:
    """One untouched buffer; each tensor a C-contiguous view of its own aligned region.

    `dtypes` is one dtype for all tensors, or one per tensor.
    """
    per_tensor = dtypes if isinstance(dtypes, list) else [dtypes] * len(specs)
    sizes = [math.prod(shape) * dt.itemsize for (_, shape), dt in zip(specs, per_tensor)]
    offsets = [0, *accumulate(-(-nbytes // _ALIGN) * _ALIGN for nbytes in sizes)]
    arena = np.empty(offsets[-1] + _ALIGN, np.uint8)
    base = (-arena.ctypes.data) % _ALIGN
    return {key: arena[base + at : base + at + nbytes].view(dt).reshape(shape)
            for (key, shape), dt, at, nbytes in zip(specs, per_tensor, offsets, sizes)}


_CHUNK = 1 << 20  # values drawn per generator call; reused buffer, stays in cache


def _fill(
    arrays: dict[str, np.ndarray], seed: int, on_progress: Callable[[int], None] | None = None
) -> None:
    """Fill the arrays, in order, from one stream of values drawn in large chunks.

    Drawing per chunk rather than per array keeps 50,000 small tensors as fast as one big one.
    Floats: normal(0, 0.02), plus 1 for norm weights; integers 0..99; bool: coin flips.
    """
    rng = np.random.default_rng(seed)
    kind = next(iter(arrays.values())).dtype.kind if arrays else "f"
    floating = kind not in "biu"  # ml_dtypes' bfloat16 / float8 report kind "V"
    buf: npt.NDArray[Any] = np.empty(_CHUNK, np.float32 if floating else np.int8)

    def draw() -> None:
        if floating:
            rng.standard_normal(out=buf, dtype=np.float32)
            np.multiply(buf, np.float32(0.02), out=buf)
        else:
            buf[...] = rng.integers(0, 2 if kind == "b" else 100, _CHUNK, dtype=np.int8)

    pos = _CHUNK
    filled = 0
    for key, array in arrays.items():
        flat = array.reshape(-1)
        plus_one = floating and key.endswith("norm/weight")
        done, n = 0, flat.size
        while done < n:
            if pos == _CHUNK:
                draw()
                pos = 0
            take = min(n - done, _CHUNK - pos)
            values: npt.NDArray[Any] = buf[pos : pos + take]
            if kind == "b":
                values = values.view(np.bool_)
            elif plus_one:
                values = values + np.float32(1.0)
            flat[done : done + take] = values  # float32 -> bfloat16 / float8 rounds here
            done += take
            pos += take
            if on_progress is not None:
                filled += take * array.itemsize
                on_progress(filled)


def load_state_file(path: str | Path, *, materialize: bool = True) -> dict[str, np.ndarray]:
    """Read a ``.safetensors`` or ``.npz`` file into a flat dict ``key -> array``.

    ``materialize=False`` reads only the file's header(s) and returns untouched arrays of the
    stored shapes and dtypes: enough to plan sharding without reading the data.
    """
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"{str(p)!r} is a directory, not a .safetensors or .npz file")
    if not p.is_file():
        raise FileNotFoundError(f"no such file: {str(p)!r}")
    suffix = p.suffix.lower()
    if suffix == ".safetensors":
        specs, dtypes, arrays = _read_safetensors(p, materialize)
    elif suffix == ".npz":
        specs, dtypes, arrays = _read_npz(p, materialize)
    else:
        raise CheckpointFormatError(
            f"{str(p)!r}: cannot read a {suffix or 'suffix-less'} file as a state; "
            "expected .safetensors or .npz"
        )
    if arrays is not None:
        return arrays
    for (key, _), dt in zip(specs, dtypes):
        if not is_supported(dt):
            raise UnsupportedDTypeError(
                f"{str(p)!r}: tensor {key!r} has dtype {dt}, which shardkit cannot store"
            )
    # Untouched placeholders, so a big file costs no memory; little-endian like the host
    # arrays a save would see.
    dtypes = [dt.newbyteorder("<") if dt.byteorder == ">" else dt for dt in dtypes]
    return _carve(specs, dtypes)


def _read_safetensors(
    p: Path, materialize: bool
) -> tuple[list[tuple[str, tuple[int, ...]]], list[np.dtype], dict[str, np.ndarray] | None]:
    safe_open = require("safetensors", f"reading {str(p)!r}").safe_open
    from ..values.dtypes import numpy_dtype

    try:
        with safe_open(str(p), framework="numpy") as f:
            keys = list(f.keys())
            if materialize:
                return [], [], {k: f.get_tensor(k) for k in keys}
            specs, dtypes = [], []
            for k in keys:
                s = f.get_slice(k)
                specs.append((k, tuple(int(d) for d in s.get_shape())))
                dtypes.append(numpy_dtype(s.get_dtype()))
            return specs, dtypes, None
    except ShardkitError:
        raise
    except Exception as e:  # SafetensorError, OSError, TypeError (dtype numpy lacks)...
        raise CheckpointFormatError(f"{str(p)!r}: not a readable safetensors file: {e}") from e


def _read_npz(
    p: Path, materialize: bool
) -> tuple[list[tuple[str, tuple[int, ...]]], list[np.dtype], dict[str, np.ndarray] | None]:
    try:
        if materialize:
            with np.load(p, allow_pickle=False) as npz:
                return [], [], {k: npz[k] for k in npz.files}
        specs, dtypes = [], []
        with zipfile.ZipFile(p) as zf:
            for member in zf.namelist():
                if not member.endswith(".npy"):
                    continue
                with zf.open(member) as fp:
                    shape, dt = _npy_header(fp)
                specs.append((member[: -len(".npy")], tuple(shape)))
                dtypes.append(dt)
            return specs, dtypes, None
    except Exception as e:  # BadZipFile, ValueError (pickled objects, bad .npy header)...
        raise CheckpointFormatError(f"{str(p)!r}: not a readable .npz file: {e}") from e


def _npy_header(fp: Any) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype from a .npy header, without reading the data."""
    version = np.lib.format.read_magic(fp)
    if version == (1, 0):
        shape, _, dt = np.lib.format.read_array_header_1_0(fp)
    elif version == (2, 0):
        shape, _, dt = np.lib.format.read_array_header_2_0(fp)
    else:  # 3.0 (utf-8 field names) has no public header reader: read the member
        fp.seek(0)
        array = np.lib.format.read_array(fp, allow_pickle=False)
        shape, dt = array.shape, array.dtype
    return tuple(int(d) for d in shape), np.dtype(dt)
