"""Gather many small buffers into one, and scatter one buffer back into many.

Sources and destinations are given as raw addresses (uint64) so that the copy loop touches no
Python object and runs without the GIL. The caller (shardkit.writer / shardkit.reader) takes the
addresses from arrays it keeps alive for the duration of the call and checks that destinations
are writable; these functions check every range against the buffer they do own.
`gather_buffers` takes the source objects themselves: it acquires their buffers first (with the
GIL, about 0.1 us each, against microseconds for reading an address from Python), then copies
without the GIL, then releases them.
"""

cimport numpy as cnp
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.errno cimport EINTR, EIO, errno
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, strerror
from posix.uio cimport iovec, pwritev

import numpy as np

cnp.import_array()

cdef enum:
    _IOV_LIMIT = 1024  # POSIX guarantees at least 16; Linux allows 1024

IOV_LIMIT = _IOV_LIMIT  # most arrays one write_arrays call takes


cdef Py_ssize_t _first_bad_range(
    const int64_t[::1] offsets, const int64_t[::1] lengths, int64_t size
) noexcept nogil:
    """Index of the first range outside 0..size (or negative), -1 if all fit."""
    cdef Py_ssize_t i
    cdef int64_t off, n
    for i in range(offsets.shape[0]):
        off = offsets[i]
        n = lengths[i]
        if off < 0 or n < 0 or off > size or n > size - off:
            return i
    return -1


cdef void _check(
    const uint64_t[::1] addresses,
    const int64_t[::1] lengths,
    const int64_t[::1] offsets,
    int64_t size,
    str what,
) except *:
    cdef Py_ssize_t bad
    if not (addresses.shape[0] == lengths.shape[0] == offsets.shape[0]):
        raise ValueError(
            f"addresses, lengths and offsets must have equal lengths, got "
            f"{addresses.shape[0]}, {lengths.shape[0]}, {offsets.shape[0]}"
        )
    with nogil:
        bad = _first_bad_range(offsets, lengths, size)
    if bad >= 0:
        raise ValueError(
            f"range {bad} (offset {offsets[bad]}, length {lengths[bad]}) lies outside the "
            f"{size}-byte {what} buffer"
        )


def gather(
    const uint64_t[::1] addresses,
    const int64_t[::1] lengths,
    const int64_t[::1] offsets,
    unsigned char[::1] out,
) -> None:
    """Copy ``lengths[i]`` bytes from address ``addresses[i]`` to ``out[offsets[i]:]``, for all i."""
    _check(addresses, lengths, offsets, out.shape[0], "destination")
    cdef Py_ssize_t i
    cdef unsigned char* base = &out[0] if out.shape[0] else NULL
    with nogil:
        for i in range(addresses.shape[0]):
            if lengths[i]:
                memcpy(base + offsets[i], <const void*><uintptr_t>addresses[i], <size_t>lengths[i])


def scatter(
    const unsigned char[::1] src,
    const int64_t[::1] offsets,
    const int64_t[::1] lengths,
    const uint64_t[::1] addresses,
) -> None:
    """Copy ``src[offsets[i]:offsets[i] + lengths[i]]`` to address ``addresses[i]``, for all i."""
    _check(addresses, lengths, offsets, src.shape[0], "source")
    cdef Py_ssize_t i
    cdef const unsigned char* base = &src[0] if src.shape[0] else NULL
    with nogil:
        for i in range(addresses.shape[0]):
            if lengths[i]:
                memcpy(<void*><uintptr_t>addresses[i], base + offsets[i], <size_t>lengths[i])


def gather_buffers(list sources, const int64_t[::1] offsets, unsigned char[::1] out) -> int:
    """Copy the bytes of each C-contiguous buffer ``sources[i]`` to ``out[offsets[i]:]``.

    Returns the number of bytes copied. Raises ValueError (nothing copied) if a source is not
    C-contiguous or does not fit in `out` at its offset.
    """
    cdef Py_ssize_t n = len(sources)
    cdef Py_ssize_t i, acquired = 0
    cdef int64_t size = out.shape[0]
    cdef int64_t total = 0
    cdef unsigned char* base = &out[0] if size else NULL
    if offsets.shape[0] != n:
        raise ValueError(
            f"sources and offsets must have equal lengths, got {n} and {offsets.shape[0]}"
        )
    cdef Py_buffer* views = <Py_buffer*>malloc(n * sizeof(Py_buffer)) if n else NULL
    if n and views == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            PyObject_GetBuffer(sources[i], &views[i], PyBUF_SIMPLE)
            acquired += 1
            if offsets[i] < 0 or offsets[i] > size or views[i].len > size - offsets[i]:
                raise ValueError(
                    f"source {i} ({views[i].len} bytes at offset {offsets[i]}) does not fit in "
                    f"the {size}-byte destination buffer"
                )
            total += views[i].len
        with nogil:
            for i in range(n):
                if views[i].len:
                    memcpy(base + offsets[i], views[i].buf, <size_t>views[i].len)
    finally:
        for i in range(acquired):
            PyBuffer_Release(&views[i])
        free(views)
    return total


def write_arrays(int fd, list arrays not None, int64_t offset):
    """Write the bytes of `arrays` back to back at `offset` of file `fd` with ``pwritev``, the
    GIL released; returns the bytes written (all of them: short writes are continued, EINTR
    retried, any other failure raises OSError with its errno).

    Each element must be exactly a C-contiguous numpy array (TypeError / ValueError otherwise,
    before anything is written). Their memory is read through numpy's C API, not the buffer
    protocol: numpy's buffer export costs microseconds per call on arrays another library
    (torch) has exported before, and two writer threads doing thousands of them held the GIL
    in turn for most of a save. At most IOV_MAX arrays per call.
    """
    cdef Py_ssize_t n = len(arrays)
    cdef Py_ssize_t i, k = 0
    cdef cnp.ndarray arr
    cdef int64_t total = 0, done = 0
    cdef ssize_t got
    cdef int err = 0
    cdef type ndarray = np.ndarray
    if n > _IOV_LIMIT:
        raise ValueError(f"{n} arrays in one call; at most {_IOV_LIMIT}")
    if n == 0:
        return 0
    cdef iovec* iov = <iovec*>malloc(n * sizeof(iovec))
    if iov == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            a = arrays[i]
            if type(a) is not ndarray:
                raise TypeError(f"array {i} is a {type(a).__name__}, not a numpy array")
            arr = <cnp.ndarray>a
            if not cnp.PyArray_IS_C_CONTIGUOUS(arr):
                raise ValueError(f"array {i} is not C-contiguous")
            iov[i].iov_base = cnp.PyArray_DATA(arr)
            iov[i].iov_len = <size_t>cnp.PyArray_NBYTES(arr)
            total += cnp.PyArray_NBYTES(arr)
        with nogil:  # `arrays` (held by the caller) keeps every array alive meanwhile
            while done < total:
                got = pwritev(fd, iov + k, <int>(n - k), offset + done)
                if got < 0:
                    if errno == EINTR:
                        continue
                    err = errno
                    break
                if got == 0:
                    err = EIO
                    break
                done += got
                while k < n and <size_t>got >= iov[k].iov_len:  # drop the finished buffers
                    got -= iov[k].iov_len
                    k += 1
                if k < n and got:
                    iov[k].iov_base = <char*>iov[k].iov_base + got
                    iov[k].iov_len -= <size_t>got
        if err:
            raise OSError(err, strerror(err).decode())
        return total
    finally:
        free(iov)
