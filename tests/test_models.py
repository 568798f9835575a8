import itertools
import math
import sys

import ml_dtypes
import numpy as np
import pytest

from shardkit.errors import (
    CheckpointFormatError,
    MissingDependencyError,
    UnknownModelError,
    UnsupportedDTypeError,
)
from shardkit.sharding.tensors import flatten
from shardkit.tools.models import (
    MODELS,
    load_state_file,
    model_shapes,
    synthetic_state,
)

MiB = 2**20


def _flat(state):
    return dict(flatten(state))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_models_lists_every_model_with_a_one_line_description():
    assert set(MODELS) == {"llm-1b", "llm-tiny", "llm-small", "many-small", "mixed"}
    for desc in MODELS.values():
        assert desc and "\n" not in desc


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_builds_with_the_declared_shapes(name):
    flat = _flat(synthetic_state(name))
    shapes = model_shapes(name)
    assert list(flat) == [key for key, _ in shapes]
    for key, shape in shapes:
        array = flat[key]
        assert array.shape == shape
        assert array.dtype == np.float32
        assert array.flags.c_contiguous
        assert array.ctypes.data % 64 == 0


def test_llm_1b_has_the_parameter_count_of_a_1_1b_llama():
    # vocab 32000, hidden 2048, MLP 5632, 22 layers, 4 of 32 heads for k/v (TinyLlama's shapes)
    flat = _flat(synthetic_state("llm-1b"))
    per_layer = 2 * 2048 + 2 * 2048 * 2048 + 2 * 256 * 2048 + 3 * 5632 * 2048
    expected = 2 * 32000 * 2048 + 22 * per_layer + 2048
    assert expected == 1_100_048_384
    assert sum(a.size for a in flat.values()) == expected
    assert len(flat) == 1 + 22 * 9 + 2
    assert flat["model/layers/21/self_attn/k_proj/weight"].shape == (256, 2048)
    assert flat["model/layers/0/mlp/down_proj/weight"].shape == (2048, 5632)
    assert flat["lm_head/weight"].shape == (32000, 2048)


@pytest.mark.parametrize(
    ("name", "count", "low", "high"),
    [
        ("llm-tiny", 21, 2 * MiB, 8 * MiB),
        ("llm-small", 39, 200 * MiB, 500 * MiB),
        ("many-small", 50_000, 170 * 10**6, 230 * 10**6),
        ("mixed", 10_003, 1792 * MiB, 1800 * MiB),
    ],
)
def test_model_sizes_are_about_right(name, count, low, high):
    flat = _flat(synthetic_state(name))
    assert len(flat) == count
    assert low <= sum(a.nbytes for a in flat.values()) <= high


def test_many_small_has_varied_small_shapes():
    flat = _flat(synthetic_state("many-small"))
    ndims = {a.ndim for a in flat.values()}
    assert ndims == {0, 1, 2, 3}
    sizes = np.array([a.size for a in flat.values()])
    assert sizes.max() <= 9001
    assert len(set(a.shape for a in flat.values())) > 10_000


def test_mixed_has_a_few_huge_and_many_tiny_tensors():
    sizes = sorted(a.nbytes for a in _flat(synthetic_state("mixed")).values())
    assert sizes[-3:] == [256 * MiB, 512 * MiB, 1024 * MiB]
    assert max(sizes[:-3]) <= 256
    assert sizes[0] == 4  # the scalars


def test_arrays_do_not_overlap():
    arrays = list(_flat(synthetic_state("llm-tiny")).values())
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start


def test_unmaterialized_llm_1b_takes_no_memory():
    before = _rss_bytes()
    state = synthetic_state("llm-1b")
    flat = _flat(state)
    # Slicing, as policies do, does not touch the pages either.
    halves = [a[: max(1, a.shape[0] // 2)] for a in flat.values()]
    after = _rss_bytes()
    assert sum(a.nbytes for a in flat.values()) > 4 * 2**30
    assert after - before < 64 * MiB, f"RSS grew by {(after - before) / MiB:.0f} MiB"
    assert len(halves) == len(flat)


def test_dtype_argument():
    flat = _flat(synthetic_state("llm-tiny", dtype="bfloat16"))
    assert {a.dtype for a in flat.values()} == {np.dtype(ml_dtypes.bfloat16)}
    f32 = _flat(synthetic_state("llm-tiny"))
    assert sum(a.nbytes for a in flat.values()) * 2 == sum(a.nbytes for a in f32.values())
    assert _flat(synthetic_state("llm-tiny", dtype=np.float16))["lm_head/weight"].itemsize == 2


@pytest.mark.parametrize("dtype", ["complex256", "U4", ">f4", object])
def test_unstorable_dtype_is_refused(dtype):
    with pytest.raises(UnsupportedDTypeError, match="cannot be stored"):
        synthetic_state("llm-tiny", dtype=dtype)


def test_unknown_dtype_name_is_refused():
    with pytest.raises(UnsupportedDTypeError, match="unknown dtype 'floaty'"):
        synthetic_state("llm-tiny", dtype="floaty")


def test_unknown_model_names_the_known_ones():
    with pytest.raises(UnknownModelError, match=r"unknown model 'llm-2b'; built-in models: llm-1b"):
        synthetic_state("llm-2b")


def _state_bytes(state):
    return {k: a.tobytes() for k, a in flatten(state)}


def test_materialize_is_deterministic_and_depends_on_the_seed():
    a = _state_bytes(synthetic_state("llm-tiny", materialize=True, seed=1))
    b = _state_bytes(synthetic_state("llm-tiny", materialize=True, seed=1))
    c = _state_bytes(synthetic_state("llm-tiny", materialize=True, seed=2))
    assert a == b
    assert all(a[k] != c[k] for k in a)


def test_materialized_values_look_like_weights():
    flat = _flat(synthetic_state("llm-tiny", materialize=True))
    w = flat["model/layers/0/mlp/up_proj/weight"]
    assert np.isfinite(w).all()
    assert 0.018 < float(w.std()) < 0.022
    assert abs(float(w.mean())) < 0.001
    norm = flat["model/norm/weight"]
    assert 0.9 < float(norm.min()) and float(norm.max()) < 1.1


def test_materialize_bfloat16_rounds_the_float32_values():
    f32 = _flat(synthetic_state("llm-tiny", materialize=True, seed=3))
    bf16 = _flat(synthetic_state("llm-tiny", dtype="bfloat16", materialize=True, seed=3))
    for key in f32:
        np.testing.assert_array_equal(bf16[key], f32[key].astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("dtype", ["int8", "uint16", "bool"])
def test_materialize_integer_and_bool_dtypes(dtype):
    flat = _flat(synthetic_state("llm-tiny", dtype=dtype, materialize=True))
    w = flat["lm_head/weight"]
    assert w.dtype == np.dtype(dtype)
    assert len(np.unique(w)) > 1


# ------------------------------------------------------------------------------ load_state_file


def _sample():
    return {
        "model/w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "model/b": np.array([1, 2, 3], dtype=np.int64),
        "step": np.array(7, dtype=np.int32),
    }


def test_load_npz(tmp_path):
    path = tmp_path / "state.npz"
    np.savez(path, **_sample())
    loaded = load_state_file(path)
    assert list(loaded) == list(_sample())
    for key, array in _sample().items():
        np.testing.assert_array_equal(loaded[key], array)
        assert loaded[key].dtype == array.dtype


def test_load_npz_without_data_reads_shapes_and_dtypes(tmp_path):
    path = tmp_path / "state.npz"
    np.savez_compressed(path, **_sample(), big_endian=np.arange(5, dtype=">f8"))
    loaded = load_state_file(path, materialize=False)
    assert list(loaded) == [*_sample(), "big_endian"]
    for key, array in _sample().items():
        assert loaded[key].shape == array.shape
        assert loaded[key].dtype == array.dtype
    assert loaded["big_endian"].dtype == np.dtype("<f8")
    assert loaded["big_endian"].shape == (5,)


def test_load_npz_refuses_object_arrays(tmp_path):
    path = tmp_path / "state.npz"
    np.savez(path, o=np.array([None, 1], dtype=object))
    with pytest.raises(CheckpointFormatError, match=r"not a readable \.npz file"):
        load_state_file(path)
    with pytest.raises(UnsupportedDTypeError, match=r"tensor 'o' has dtype object"):
        load_state_file(path, materialize=False)


def test_load_safetensors(tmp_path):
    from safetensors.numpy import save_file

    state = {**_sample(), "half": np.linspace(0, 1, 8).astype(ml_dtypes.bfloat16)}
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    loaded = load_state_file(path)
    assert set(loaded) == set(state)
    for key, array in state.items():
        assert loaded[key].dtype == array.dtype
        np.testing.assert_array_equal(loaded[key], array)
    lazy = load_state_file(str(path), materialize=False)
    assert {k: (a.shape, a.dtype) for k, a in lazy.items()} == {
        k: (a.shape, a.dtype) for k, a in loaded.items()
    }


def test_load_safetensors_without_the_package(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\0" * 16)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(MissingDependencyError,
                       match=r'pip install "shardkit\[huggingface\]" \(or pip install safetensors'):
        load_state_file(path)


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
@pytest.mark.parametrize("materialize", [True, False])
def test_load_corrupt_file(tmp_path, suffix, materialize):
    path = tmp_path / f"junk{suffix}"
    path.write_bytes(b"this is not a tensor file at all")
    with pytest.raises(CheckpointFormatError, match=r"junk\.(safetensors|npz)'?: not a readable"):
        load_state_file(path, materialize=materialize)


def test_load_unknown_suffix(tmp_path):
    path = tmp_path / "state.pt"
    path.write_bytes(b"x")
    with pytest.raises(CheckpointFormatError, match=r"cannot read a \.pt file.*\.safetensors or"):
        load_state_file(path)


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_state_file(tmp_path / "absent.npz")


def test_sizes_match_model_shapes():
    for name in ("llm-tiny", "mixed"):
        total = sum(math.prod(s) for _, s in model_shapes(name)) * 4
        assert total == sum(a.nbytes for a in _flat(synthetic_state(name)).values())


def test_load_directory(tmp_path):
    with pytest.raises(IsADirectoryError, match=r"is a directory, not a \.safetensors or \.npz"):
        load_state_file(tmp_path)


def test_load_without_data_gives_aligned_disjoint_placeholders(tmp_path):
    path = tmp_path / "state.npz"
    np.savez(path, **_sample())
    arrays = list(load_state_file(path, materialize=False).values())
    assert all(a.ctypes.data % 64 == 0 and a.flags.c_contiguous for a in arrays)
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start
