"""The write-and-hash kernel against its pure-Python twin: same bytes, same digests, same
errors."""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit._kernels import _gather as kernel
from shardkit._reference import _gather as twin

IMPLS = [pytest.param(kernel, id="kernel"), pytest.param(twin, id="twin")]


def _write(impl, path, arrays, offset=0, prefix=b"", digests=True):
    """Run write_arrays into a new file at `path`; returns (count, file bytes, digests)."""
    out = np.zeros(len(arrays), np.uint64) if digests else None
    with open(path, "wb") as f:
        f.write(prefix)
        f.flush()
        count = impl.write_arrays(f.fileno(), arrays, offset, out)
    return count, path.read_bytes(), out


@pytest.mark.parametrize("impl", IMPLS)
def test_writes_back_to_back_and_hashes_every_array(impl, tmp_path):
    """Thousands of small arrays (several vectored writes: over IOV_LIMIT buffers and over
    WRITE_BATCH bytes), arrays larger than WRITE_BATCH (written and hashed in chunks) between
    them, every dtype family, 0-d and empty arrays."""
    rng = np.random.default_rng(5)
    arrays = [rng.random(int(n), dtype=np.float32) for n in rng.integers(0, 3000, 2500)]
    big = rng.integers(0, 256, 2 * kernel.WRITE_BATCH + 12345, dtype=np.uint8)
    arrays[700:700] = [big, np.zeros(0, np.int8), big[:kernel.WRITE_BATCH]]
    arrays += [np.array(3.5), np.arange(6, dtype=ml_dtypes.bfloat16),
               np.array([True, False]), np.arange(5, dtype=ml_dtypes.float8_e4m3fn), big]
    count, data, digests = _write(impl, tmp_path / "out.bin", arrays, 8, b"\xff" * 8)
    assert count == len(arrays)
    assert data == b"\xff" * 8 + b"".join(a.tobytes() for a in arrays)
    assert digests.tolist() == [xxhash.xxh3_64_intdigest(a.tobytes()) for a in arrays]


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 70_000), max_size=60), seed=st.integers(0, 2**32 - 1))
def test_kernel_matches_twin(tmp_path_factory, sizes, seed):
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    tmp = tmp_path_factory.mktemp("w")
    got = _write(kernel, tmp / "k.bin", arrays, 3, b"abc")
    want = _write(twin, tmp / "t.bin", arrays, 3, b"abc")
    assert got[0] == want[0] == len(arrays)
    assert got[1] == want[1]
    assert got[2].tolist() == want[2].tolist()


@pytest.mark.parametrize("impl", IMPLS)
def test_without_digests_only_writes(impl, tmp_path):
    arrays = [np.arange(n, dtype=np.int16) for n in (3, 0, 900)]
    count, data, _ = _write(impl, tmp_path / "out.bin", arrays, digests=False)
    assert (count, data) == (3, b"".join(a.tobytes() for a in arrays))


@pytest.mark.parametrize("impl", IMPLS)
def test_reads_readonly_and_mapped_arrays(impl, tmp_path):
    ro = np.arange(5, dtype=np.int64)
    ro.flags.writeable = False
    src = tmp_path / "src"
    src.write_bytes(bytes(range(32)))
    with open(src, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            mm = np.frombuffer(mapped, dtype=np.uint8)
            count, data, digests = _write(impl, tmp_path / "out.bin", [ro, mm])
            assert count == 2 and data == ro.tobytes() + bytes(range(32))
            assert digests[1] == xxhash.xxh3_64_intdigest(bytes(range(32)))
            del mm
        finally:
            mapped.close()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", [np.arange(10.0)[::2], np.asfortranarray(np.ones((3, 4))),
                                 b"abc", memoryview(b"abc"), [1, 2]])
def test_stops_before_the_first_unusable_element(impl, tmp_path, bad):
    """Non-contiguous arrays and non-arrays are left to the caller: the arrays before one are
    written and hashed, nothing from it on is touched."""
    good = [np.arange(4, dtype=np.uint8), np.arange(3, dtype=np.float64)]
    after = np.arange(9, dtype=np.uint8)
    count, data, digests = _write(impl, tmp_path / "out.bin", [*good, bad, after])
    assert count == 2
    assert data == b"".join(a.tobytes() for a in good)
    assert digests[:2].tolist() == [xxhash.xxh3_64_intdigest(a.tobytes()) for a in good]
    assert digests[2:].tolist() == [0, 0]
    assert _write(impl, tmp_path / "first.bin", [bad, *good])[:2] == (0, b"")


@pytest.mark.parametrize("impl", IMPLS)
def test_argument_errors(impl, tmp_path):
    good = np.arange(4, dtype=np.uint8)
    with open(tmp_path / "out.bin", "wb") as f:
        with pytest.raises(ValueError, match="digests holds 1 values, 2 arrays given"):
            impl.write_arrays(f.fileno(), [good, good], 0, np.zeros(1, np.uint64))
        with pytest.raises(TypeError):
            impl.write_arrays(f.fileno(), (good,), 0)
        assert impl.write_arrays(f.fileno(), [], 0) == 0
    assert (tmp_path / "out.bin").read_bytes() == b""
    with pytest.raises(OSError) as info:
        impl.write_arrays(-1, [good], 0)
    assert info.value.errno == errno.EBADF


def test_kernel_in_threads_gives_the_same_bytes(tmp_path):
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in rng.integers(0, 5000, 500)]
    expected = b"".join(a.tobytes() for a in arrays)
    hashes = [xxhash.xxh3_64_intdigest(a.tobytes()) for a in arrays]

    def run(i: int) -> bool:
        ok = True
        for j in range(10):
            count, data, digests = _write(kernel, tmp_path / f"{i}-{j}.bin", arrays)
            ok &= count == len(arrays) and data == expected and digests.tolist() == hashes
        return ok

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(run, range(8)))


@pytest.mark.parametrize("impl_name", ["kernel", "twin"])
@pytest.mark.parametrize(("sizes", "limit"), [
    ([3000] * 5, 10_000),  # a short pwritev
    ([100, kernel.WRITE_BATCH + 50_000], kernel.WRITE_BATCH + 10_000),  # a short chunk pwrite
], ids=["vectored", "large"])
def test_continues_a_short_write_then_reports_the_error(tmp_path, impl_name, sizes, limit):
    """With RLIMIT_FSIZE below the data, a write stops short at the limit, and the continuation
    fails with EFBIG: the bytes that fit are there and the error is raised."""
    script = textwrap.dedent(f"""
        import errno, resource, signal, sys
        import numpy as np
        from shardkit.{'_kernels' if impl_name == 'kernel' else '_reference'} import _gather
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))
        arrays = [np.full(n, i, np.uint8) for i, n in enumerate({sizes})]
        with open(sys.argv[1], "wb") as f:
            try:
                _gather.write_arrays(f.fileno(), arrays, 0, np.zeros(len(arrays), np.uint64))
            except OSError as e:
                print("error", e.errno == errno.EFBIG)
    """)
    out = tmp_path / "limited.bin"
    proc = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "error True"
    data = out.read_bytes()
    assert len(data) == limit
    assert data == b"".join(bytes([i % 256]) * n for i, n in enumerate(sizes))[:limit]


@pytest.mark.parametrize("impl", IMPLS)
def test_hex_digests(impl):
    values = np.array([0, 1, 0xDEADBEEF, 2**64 - 1, xxhash.xxh3_64_intdigest(b"x")], np.uint64)
    assert impl.hex_digests(values) == [
        "0000000000000000", "0000000000000001", "00000000deadbeef", "ffffffffffffffff",
        xxhash.xxh3_64_hexdigest(b"x"),
    ]
    assert impl.hex_digests(np.zeros(0, np.uint64)) == []


@pytest.mark.parametrize("impl", IMPLS)
def test_preallocate(impl, tmp_path):
    with open(tmp_path / "f.bin", "wb") as f:
        if not sys.platform.startswith("linux"):  # no fallocate: nothing done
            assert impl.preallocate(f.fileno(), 12345) is False
            return
        assert impl.preallocate(f.fileno(), 12345) is True
        assert os.fstat(f.fileno()).st_size == 12345
        assert impl.preallocate(f.fileno(), 0) is False
        with pytest.raises(OSError) as info:  # far beyond any file-size limit
            impl.preallocate(f.fileno(), 1 << 62)
        assert info.value.errno in (errno.EFBIG, errno.ENOSPC)
    with pytest.raises(OSError) as info:
        impl.preallocate(-1, 10)
    assert info.value.errno == errno.EBADF


@pytest.mark.parametrize("impl", IMPLS)
def test_start_writeback_is_a_hint(impl, tmp_path):
    with open(tmp_path / "f.bin", "wb") as f:
        f.write(b"x" * 10000)
        f.flush()
        assert impl.start_writeback(f.fileno(), 0, 10000) is sys.platform.startswith("linux")
        assert impl.start_writeback(f.fileno(), 0, 0) is False
    assert (tmp_path / "f.bin").read_bytes() == b"x" * 10000
    r, w = os.pipe()
    try:  # not a file: not taken, and no error
        assert impl.start_writeback(w, 0, 10) is False
    finally:
        os.close(r)
        os.close(w)
    assert impl.start_writeback(-1, 0, 10) is False


# --- read_arrays: the reverse, many arrays filled by vectored reads --------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_read_arrays_fills_back_to_back(impl, tmp_path):
    rng = np.random.default_rng(7)
    arrays = [rng.random(int(n), dtype=np.float32) for n in rng.integers(0, 900, 2500)]
    arrays += [np.zeros(0, np.int8), np.array(3.5), np.arange(6, dtype=ml_dtypes.bfloat16)]
    _, data, _ = _write(impl, tmp_path / "src.bin", arrays, 5, b"hdr..")
    out = [np.empty_like(a) for a in arrays]
    with open(tmp_path / "src.bin", "rb") as f:
        assert impl.read_arrays(f.fileno(), out, 5) == len(data) - 5
        assert impl.read_arrays(f.fileno(), [], 0) == 0
        # the file ends early: the bytes there are read, the count says how many
        tail = [np.zeros(10, np.uint8), np.zeros(10, np.uint8)]
        assert impl.read_arrays(f.fileno(), tail, len(data) - 15) == 15
        assert tail[0].tobytes() == data[-15:-5] and tail[1][:5].tobytes() == data[-5:]
    assert all(a.tobytes() == b.tobytes() and a.dtype == b.dtype for a, b in zip(arrays, out))


@pytest.mark.parametrize("impl", IMPLS)
def test_read_arrays_refuses_before_reading(impl, tmp_path):
    (tmp_path / "f").write_bytes(bytes(range(64)))
    ro = np.zeros(4, np.uint8)
    ro.flags.writeable = False
    good = np.zeros(4, np.uint8)
    with open(tmp_path / "f", "rb") as f:
        for bad, error in ((ro, ValueError), (np.zeros(8)[::2], ValueError),
                           (bytearray(4), TypeError)):
            with pytest.raises(error):
                impl.read_arrays(f.fileno(), [good, bad], 0)
            assert not good.any()
    with pytest.raises(OSError) as info:
        impl.read_arrays(-1, [good], 0)
    assert info.value.errno == errno.EBADF
