"""The map kernel (csrc/_mmap.pyx) against its pure-Python twin: a private, writable map of a
file that holds no descriptor and lives exactly as long as its last reference."""

from __future__ import annotations

import errno
import gc
import importlib
import os

import numpy as np
import pytest

PURE_PYTHON = os.environ.get("SHARDKIT_PUREPYTHON") == "1"
twin = importlib.import_module("shardkit._reference._mmap")
kernel = None if PURE_PYTHON else importlib.import_module("shardkit._kernels._mmap")
IMPLS = [pytest.param(twin, id="twin")] + (
    [] if PURE_PYTHON else [pytest.param(kernel, id="kernel")]
)


def _file(tmp_path, data: bytes) -> str:
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("impl", IMPLS)
def test_maps_the_file_bytes_writable_copy_on_write(impl, tmp_path):
    data = bytes(range(256)) * 40
    path = _file(tmp_path, data)
    fd = os.open(path, os.O_RDONLY)
    try:
        m = impl.Map(fd, len(data))
    finally:
        os.close(fd)  # the map needs no descriptor
    view = memoryview(m)
    assert not view.readonly and view.nbytes == len(data) and view.format == "B"
    assert bytes(view) == data
    a = np.frombuffer(m, np.uint8)
    assert a.flags.writeable
    a[:] = 7  # private pages: the file is untouched
    assert bytes(view[:3]) == b"\x07\x07\x07"
    with open(path, "rb") as f:
        assert f.read() == data
    assert len(m) == len(data)


@pytest.mark.parametrize("impl", IMPLS)
def test_views_keep_the_map_alive(impl, tmp_path):
    data = np.arange(1000, dtype=np.int64).tobytes()
    path = _file(tmp_path, data)
    fd = os.open(path, os.O_RDONLY)
    m = impl.Map(fd, len(data))
    os.close(fd)
    a = np.frombuffer(m, np.int64)[10:20]
    del m
    gc.collect()
    assert a.tolist() == list(range(10, 20))


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_map(impl, tmp_path):
    path = _file(tmp_path, b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        m = impl.Map(fd, 0)
    finally:
        os.close(fd)
    assert len(m) == 0 and bytes(memoryview(m)) == b""


@pytest.mark.parametrize("impl", IMPLS)
def test_failure_is_an_oserror_with_errno(impl, tmp_path):
    with pytest.raises(OSError) as e:
        impl.Map(-1, 4096)
    assert e.value.errno == errno.EBADF
    with pytest.raises(ValueError, match="negative"):
        impl.Map(0, -1)


@pytest.mark.skipif(PURE_PYTHON, reason="the compiled kernel is not under test")
def test_kernel_holds_no_descriptor(tmp_path):
    data = b"x" * 10000
    path = _file(tmp_path, data)
    before = len(os.listdir("/proc/self/fd"))
    maps = []
    for _ in range(20):
        fd = os.open(path, os.O_RDONLY)
        maps.append(kernel.Map(fd, len(data)))
        os.close(fd)
    assert len(os.listdir("/proc/self/fd")) == before
    assert all(bytes(memoryview(m)[:2]) == b"xx" for m in maps)
