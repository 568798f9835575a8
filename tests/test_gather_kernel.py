"""The gather/scatter kernel against its pure-Python twin: same bytes, same errors."""

from __future__ import annotations

import errno
import mmap
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardkit._kernels import _gather as kernel
from shardkit._reference import _gather as twin

IMPLS = [pytest.param(kernel, id="kernel"), pytest.param(twin, id="twin")]


def _plan(arrays: list[np.ndarray], gaps: list[int] | None = None):
    """Addresses, lengths and packed offsets (with optional gaps) for `arrays`."""
    addresses = np.array([a.ctypes.data for a in arrays], dtype=np.uint64)
    lengths = np.array([a.nbytes for a in arrays], dtype=np.int64)
    gaps = gaps or [0] * len(arrays)
    offsets, pos = [], 0
    for n, gap in zip(lengths.tolist(), gaps):
        pos += gap
        offsets.append(pos)
        pos += n
    return addresses, lengths, np.array(offsets, dtype=np.int64), pos


@given(
    sizes=st.lists(st.integers(0, 300), max_size=40),
    gaps=st.lists(st.integers(0, 9), min_size=40, max_size=40),
    seed=st.integers(0, 2**32 - 1),
)
def test_gather_matches_twin_and_numpy(sizes, gaps, seed):
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    addresses, lengths, offsets, total = _plan(arrays, gaps[: len(arrays)])
    expected = np.full(total, 0xAB, dtype=np.uint8)
    for a, off in zip(arrays, offsets.tolist()):
        expected[off : off + a.nbytes] = a
    for impl in (kernel, twin):
        out = np.full(total, 0xAB, dtype=np.uint8)
        impl.gather(addresses, lengths, offsets, out)
        assert out.tobytes() == expected.tobytes()


@given(sizes=st.lists(st.integers(0, 300), max_size=40), seed=st.integers(0, 2**32 - 1))
def test_scatter_inverts_gather(sizes, seed):
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    addresses, lengths, offsets, total = _plan(arrays)
    packed = np.empty(total, dtype=np.uint8)
    kernel.gather(addresses, lengths, offsets, packed)
    for impl in (kernel, twin):
        dests = [np.zeros(n, dtype=np.uint8) for n in sizes]
        dest_addresses = np.array([d.ctypes.data for d in dests], dtype=np.uint64)
        impl.scatter(packed, offsets, lengths, dest_addresses)
        assert [d.tobytes() for d in dests] == [a.tobytes() for a in arrays]


@pytest.mark.parametrize("impl", IMPLS)
def test_sources_of_any_dtype_and_readonly_mmap(impl, tmp_path):
    f32 = np.arange(7, dtype=np.float32)
    ro = np.arange(5, dtype=np.int64)
    ro.flags.writeable = False
    path = tmp_path / "data"
    path.write_bytes(bytes(range(32)))
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            mm = np.frombuffer(mapped, dtype=np.uint8)
            addresses, lengths, offsets, total = _plan([f32, ro, mm])
            out = np.zeros(total, dtype=np.uint8)
            impl.gather(addresses, lengths, offsets, out)
            assert out.tobytes() == f32.tobytes() + ro.tobytes() + bytes(range(32))
            # scatter reads from a read-only mapping
            dest = np.zeros(32, dtype=np.uint8)
            impl.scatter(
                mapped, np.array([0], np.int64), np.array([32], np.int64),
                np.array([dest.ctypes.data], np.uint64),
            )
            assert dest.tobytes() == bytes(range(32))
            del mm
        finally:
            mapped.close()


@pytest.mark.parametrize("impl", IMPLS)
def test_readonly_destination_is_rejected(impl):
    a = np.arange(4, dtype=np.uint8)
    addresses, lengths, offsets, total = _plan([a])
    out = np.zeros(total, dtype=np.uint8)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        impl.gather(addresses, lengths, offsets, out)
    assert not out.any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("offset", "length"), [(21, 12), (-1, 4), (0, -4), (33, 0)], ids=["past-end", "neg-off",
                                                                       "neg-len", "off-past"]
)
def test_ranges_outside_the_buffer_are_rejected(impl, offset, length):
    src = np.arange(64, dtype=np.uint8)
    out = np.full(32, 7, dtype=np.uint8)
    args = (np.array([src.ctypes.data], np.uint64), np.array([length], np.int64),
            np.array([offset], np.int64))
    with pytest.raises(ValueError, match=rf"range 0 \(offset {offset}, length {length}\) lies "
                       r"outside the 32-byte destination buffer"):
        impl.gather(*args, out)
    assert (out == 7).all()  # nothing copied: all ranges are checked first
    with pytest.raises(ValueError, match="outside the 32-byte source buffer"):
        impl.scatter(out, args[2], args[1], args[0])


@pytest.mark.parametrize("impl", IMPLS)
def test_mismatched_argument_lengths(impl):
    a = np.arange(4, dtype=np.uint8)
    addresses, lengths, offsets, total = _plan([a, a])
    with pytest.raises(ValueError, match="equal lengths, got 2, 1, 2"):
        impl.gather(addresses, lengths[:1], offsets, np.zeros(total, np.uint8))


@pytest.mark.parametrize("impl", IMPLS)
def test_wrong_argument_dtypes(impl):
    a = np.arange(4, dtype=np.uint8)
    addresses, lengths, offsets, total = _plan([a])
    with pytest.raises(ValueError):
        impl.gather(addresses.astype(np.int64), lengths, offsets, np.zeros(total, np.uint8))
    with pytest.raises(ValueError):
        impl.gather(addresses, lengths.astype(np.int32), offsets, np.zeros(total, np.uint8))
    with pytest.raises(ValueError):
        impl.gather(addresses, lengths, offsets, np.zeros(total, np.float32))


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_inputs(impl):
    empty_u, empty_i = np.zeros(0, np.uint64), np.zeros(0, np.int64)
    impl.gather(empty_u, empty_i, empty_i, np.zeros(0, np.uint8))
    impl.scatter(b"", empty_i, empty_i, empty_u)


def test_kernel_in_threads_gives_the_same_bytes():
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in rng.integers(0, 5000, 500)]
    addresses, lengths, offsets, total = _plan(arrays)
    expected = np.concatenate(arrays).tobytes()

    def run(_: int) -> bytes:
        out = np.empty(total, dtype=np.uint8)
        for _ in range(20):
            kernel.gather(addresses, lengths, offsets, out)
        return out.tobytes()

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, range(8)))
    assert all(r == expected for r in results)


@given(
    shapes=st.lists(st.lists(st.integers(0, 6), max_size=3), max_size=30),
    gaps=st.lists(st.integers(0, 9), min_size=30, max_size=30),
    seed=st.integers(0, 2**32 - 1),
)
def test_gather_buffers_matches_twin(shapes, gaps, seed):
    rng = np.random.default_rng(seed)
    dtypes = [np.float32, np.int8, ml_dtypes.bfloat16, np.float64, np.bool_]
    arrays = [
        np.frombuffer(rng.bytes(int(np.prod(s)) * np.dtype(dtypes[i % 5]).itemsize),
                      dtype=dtypes[i % 5]).reshape(s)
        for i, s in enumerate(shapes)
    ]
    _, lengths, offsets, total = _plan(arrays, gaps[: len(arrays)])
    expected = np.full(total, 0xCD, dtype=np.uint8)
    for a, off in zip(arrays, offsets.tolist()):
        expected[off : off + a.nbytes] = np.frombuffer(a.tobytes(), dtype=np.uint8)
    for impl in (kernel, twin):
        out = np.full(total, 0xCD, dtype=np.uint8)
        assert impl.gather_buffers(arrays, offsets, out) == int(lengths.sum())
        assert out.tobytes() == expected.tobytes()


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_buffers_accepts_readonly_and_scalars_rejects_strided(impl):
    ro = np.arange(3, dtype=np.int16)
    ro.flags.writeable = False
    sources = [ro, np.array(5, dtype=np.int64), b"xyz"]
    out = np.zeros(17, dtype=np.uint8)
    assert impl.gather_buffers(sources, np.array([0, 6, 14], np.int64), out) == 17
    assert out.tobytes() == ro.tobytes() + np.int64(5).tobytes() + b"xyz"
    out[:] = 0
    with pytest.raises(ValueError, match="not C-contiguous"):
        impl.gather_buffers([ro, np.arange(8.0)[::2]], np.array([0, 6], np.int64), out)
    with pytest.raises(ValueError, match=r"source 1 \(8 bytes at offset 10\) does not fit in the "
                       r"17-byte destination buffer"):
        impl.gather_buffers(sources, np.array([0, 10, 14], np.int64), out)
    with pytest.raises(ValueError, match="must have equal lengths, got 3 and 2"):
        impl.gather_buffers(sources, np.array([0, 6], np.int64), out)
    with pytest.raises(TypeError, match="expected list, got tuple"):
        impl.gather_buffers(tuple(sources), np.array([0, 6, 14], np.int64), out)
    assert not out.any()  # every check happens before the first byte is copied
    ro_out = np.zeros(17, dtype=np.uint8)
    ro_out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        impl.gather_buffers(sources, np.array([0, 6, 14], np.int64), ro_out)


# --- write_arrays: one vectored write from many arrays' own memory -------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_write_arrays_writes_the_bytes_back_to_back(impl, tmp_path):
    rng = np.random.default_rng(5)
    arrays = [rng.random(int(n), dtype=np.float32) for n in rng.integers(0, 300, 500)]
    arrays += [np.zeros(0, np.int8), np.array(3.5), np.arange(6, dtype=ml_dtypes.bfloat16)]
    path = tmp_path / "out.bin"
    with open(path, "wb") as f:
        f.write(b"\xff" * 8)
        f.flush()
        written = impl.write_arrays(f.fileno(), arrays, 8)
    expected = b"".join(a.tobytes() for a in arrays)
    assert written == len(expected)
    assert path.read_bytes() == b"\xff" * 8 + expected
    assert impl.write_arrays(0, [], 0) == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_write_arrays_refuses_before_writing(impl, tmp_path):
    path = tmp_path / "out.bin"
    good = np.arange(4, dtype=np.uint8)
    with open(path, "wb") as f:
        with pytest.raises(ValueError, match="array 1 is not C-contiguous"):
            impl.write_arrays(f.fileno(), [good, np.arange(10.0)[::2]], 0)
        with pytest.raises(TypeError, match="array 0 is a bytes, not a numpy array"):
            impl.write_arrays(f.fileno(), [b"abc"], 0)
        with pytest.raises(ValueError, match="at most 1024"):
            impl.write_arrays(f.fileno(), [good] * 1025, 0)
    assert path.read_bytes() == b""
    with pytest.raises(OSError) as info:
        impl.write_arrays(-1, [good], 0)
    assert info.value.errno == errno.EBADF


@pytest.mark.parametrize("impl_name", ["kernel", "twin"])
def test_write_arrays_continues_a_short_write_then_reports_the_error(tmp_path, impl_name):
    """With RLIMIT_FSIZE below the data, pwritev writes what fits (a short write), and the
    continuation fails with EFBIG: the bytes that fit are there and the error is raised."""
    script = textwrap.dedent(f"""
        import errno, resource, signal, sys
        import numpy as np
        from shardkit.{'_kernels' if impl_name == 'kernel' else '_reference'} import _gather
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, resource.RLIM_INFINITY))
        arrays = [np.full(3000, i, np.uint8) for i in range(5)]
        with open(sys.argv[1], "wb") as f:
            try:
                _gather.write_arrays(f.fileno(), arrays, 0)
            except OSError as e:
                print("error", e.errno == errno.EFBIG)
    """)
    out = tmp_path / "limited.bin"
    proc = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "error True"
    data = out.read_bytes()
    assert len(data) == 10_000
    assert data == b"".join(bytes([i]) * 3000 for i in range(5))[:10_000]
