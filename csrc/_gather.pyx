"""Write many arrays to a file from their own memory, hashing each with xxh3-64 on the way;
read many arrays back the same way.

`write_arrays` is the raw-shard writer's hot loop: small arrays leave in vectored writes
(``pwritev``, at most IOV_LIMIT buffers and about WRITE_BATCH bytes each), large ones in
WRITE_BATCH chunks, and every byte is hashed just before it is written, while it is still in
cache. The GIL is released for all of it. Arrays are read through numpy's C API, not the buffer
protocol: numpy's buffer export costs microseconds per call on arrays another library (torch)
has exported before, which thousands of tensors turn into a GIL-bound loop.
"""

cimport numpy as cnp
from cpython.unicode cimport PyUnicode_FromStringAndSize
from libc.errno cimport EINTR, EINVAL, EIO, ENOSYS, EOPNOTSUPP, errno
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport strerror
from posix.uio cimport iovec, preadv, pwritev

cnp.import_array()


cdef extern from "xxh3.h" nogil:
    ctypedef struct XXH3_state_t:
        pass
    uint64_t XXH3_64bits(const void* data, size_t length)
    XXH3_state_t* XXH3_createState()
    int XXH3_freeState(XXH3_state_t* state)
    int XXH3_64bits_reset(XXH3_state_t* state)
    int XXH3_64bits_update(XXH3_state_t* state, const void* data, size_t length)
    uint64_t XXH3_64bits_digest(const XXH3_state_t* state)


cdef extern from *:
    """
    #if defined(__linux__)
    #include <fcntl.h>
    static int shardkit_fallocate(int fd, long long size) {
        return fallocate(fd, 0, 0, (off_t)size) == 0 ? 0 : errno;
    }
    static int shardkit_start_writeback(int fd, long long offset, long long length) {
        return sync_file_range(fd, (off_t)offset, (off_t)length,
                               SYNC_FILE_RANGE_WRITE) == 0 ? 0 : errno;
    }
    #else
    static int shardkit_fallocate(int fd, long long size) { return EOPNOTSUPP; }
    static int shardkit_start_writeback(int fd, long long offset, long long length) {
        return EOPNOTSUPP;
    }
    #endif
    """
    int shardkit_fallocate(int fd, long long size) nogil
    int shardkit_start_writeback(int fd, long long offset, long long length) nogil


cdef enum:
    _IOV_LIMIT = 1024  # POSIX guarantees at least 16; Linux allows 1024
    _WRITE_BATCH = 4 * 1024 * 1024  # hashed, then written while still in cache (L2/L3)

IOV_LIMIT = _IOV_LIMIT  # most buffers in one pwritev
WRITE_BATCH = _WRITE_BATCH  # bytes per write call (a larger array leaves in chunks of this)


cdef Py_ssize_t _consume(iovec* iov, Py_ssize_t k, Py_ssize_t n, size_t done) noexcept nogil:
    """Drop `done` transferred bytes from the front of ``iov[k:n]``; returns the index of the
    first buffer not yet complete."""
    while k < n and done >= iov[k].iov_len:
        done -= iov[k].iov_len
        k += 1
    if k < n and done:
        iov[k].iov_base = <char*>iov[k].iov_base + done
        iov[k].iov_len -= done
    return k


cdef int _pwritev_all(int fd, iovec* iov, Py_ssize_t n, int64_t offset) noexcept nogil:
    """Write all of ``iov[0:n]`` at `offset`, continuing short writes and retrying EINTR
    (`iov` is consumed). Returns 0 or an errno."""
    cdef Py_ssize_t k = 0
    cdef ssize_t got
    while k < n:
        if iov[k].iov_len == 0:
            k += 1
            continue
        got = pwritev(fd, iov + k, <int>(n - k), offset)
        if got < 0:
            if errno == EINTR:
                continue
            return errno
        if got == 0:
            return EIO
        offset += got
        k = _consume(iov, k, n, <size_t>got)
    return 0


cdef int _pwrite_all(int fd, const char* data, size_t n, int64_t offset) noexcept nogil:
    cdef iovec one
    one.iov_base = <void*>data
    one.iov_len = n
    return _pwritev_all(fd, &one, 1, offset)


cdef int _write_hashed(int fd, iovec* iov, Py_ssize_t n, int64_t offset, uint64_t* digests,
                       XXH3_state_t* state) noexcept nogil:
    """Write ``iov[0:n]`` back to back at `offset`; with `digests`, the xxh3-64 of each buffer
    into ``digests[i]``. Returns 0 or an errno."""
    cdef Py_ssize_t i, first = 0  # ``iov[first:i]``: hashed, not yet written
    cdef size_t size, pending = 0, step, done
    cdef const char* data
    cdef int err
    for i in range(n):
        size = iov[i].iov_len
        if size <= _WRITE_BATCH:
            if i - first == _IOV_LIMIT or pending + size > _WRITE_BATCH:
                err = _pwritev_all(fd, iov + first, i - first, offset)
                if err:
                    return err
                offset += pending
                first, pending = i, 0
            if digests != NULL:
                digests[i] = XXH3_64bits(iov[i].iov_base, size)
            pending += size
            continue
        # a large buffer: write what is pending, then this one chunk by chunk
        err = _pwritev_all(fd, iov + first, i - first, offset)
        if err:
            return err
        offset += pending
        pending = 0
        data = <const char*>iov[i].iov_base
        if digests != NULL:
            XXH3_64bits_reset(state)
        done = 0
        while done < size:
            step = min(<size_t>_WRITE_BATCH, size - done)
            if digests != NULL:
                XXH3_64bits_update(state, data + done, step)
            err = _pwrite_all(fd, data + done, step, offset)
            if err:
                return err
            offset += step
            done += step
        if digests != NULL:
            digests[i] = XXH3_64bits_digest(state)
        first = i + 1
    return _pwritev_all(fd, iov + first, n - first, offset)


cdef Py_ssize_t _describe_buffers(list arrays, iovec* iov, bint writable) except -1:
    """Fill ``iov`` with the memory of the leading elements of `arrays` that are C-contiguous
    (and, if asked, writable) numpy arrays; returns how many there are."""
    cdef Py_ssize_t i
    cdef cnp.ndarray arr
    for i in range(len(arrays)):
        a = arrays[i]
        if not cnp.PyArray_Check(a):
            return i
        arr = <cnp.ndarray>a
        if not cnp.PyArray_IS_C_CONTIGUOUS(arr) or (writable and not cnp.PyArray_ISWRITEABLE(arr)):
            return i
        iov[i].iov_base = cnp.PyArray_DATA(arr)
        iov[i].iov_len = <size_t>cnp.PyArray_NBYTES(arr)
    return len(arrays)


def write_arrays(int fd, list arrays not None, int64_t offset, uint64_t[::1] digests=None):
    """Write the bytes of `arrays` back to back at `offset` of file `fd`, the GIL released;
    with `digests`, store the xxh3-64 of array i in ``digests[i]``.

    Stops before the first element that is not a C-contiguous numpy array and returns how many
    arrays it wrote (all of them normally); the caller deals with that one and calls again for
    the rest. Short writes are continued and EINTR retried; any other failure raises OSError
    with its errno (some bytes may have been written).
    """
    cdef Py_ssize_t n = len(arrays)
    cdef Py_ssize_t count
    cdef int err = 0
    cdef uint64_t* out = NULL
    cdef XXH3_state_t* state = NULL
    if digests is not None:
        if digests.shape[0] < n:
            raise ValueError(f"digests holds {digests.shape[0]} values, {n} arrays given")
        out = &digests[0] if n else NULL
    if n == 0:
        return 0
    cdef iovec* iov = <iovec*>malloc(n * sizeof(iovec))
    if iov == NULL:
        raise MemoryError()
    try:
        count = _describe_buffers(arrays, iov, False)
        if out != NULL:
            state = XXH3_createState()
            if state == NULL:
                raise MemoryError()
        with nogil:  # `arrays` (held by the caller) keeps every array alive meanwhile
            err = _write_hashed(fd, iov, count, offset, out, state)
        if err:
            raise OSError(err, strerror(err).decode())
        return count
    finally:
        XXH3_freeState(state)
        free(iov)


def hex_digests(const uint64_t[::1] values):
    """Each value as 16 lowercase hex digits (xxhash's ``hexdigest`` spelling), as a list."""
    cdef Py_ssize_t i, j
    cdef uint64_t v
    cdef char text[16]
    cdef const char* digits = b"0123456789abcdef"
    out = [None] * values.shape[0]
    for i in range(values.shape[0]):
        v = values[i]
        for j in range(15, -1, -1):
            text[j] = digits[v & 15]
            v >>= 4
        out[i] = PyUnicode_FromStringAndSize(text, 16)
    return out


def preallocate(int fd, int64_t size) -> bool:
    """Reserve the first `size` bytes of file `fd` on disk (Linux ``fallocate``), so that a
    full disk fails here, before anything is written, and the writes that follow skip the file
    system's delayed allocation. False (nothing done) where the file system or OS cannot;
    OSError with its errno otherwise (ENOSPC: the data would not fit)."""
    cdef int err
    if size <= 0:
        return False
    with nogil:
        err = shardkit_fallocate(fd, size)
    if err == 0:
        return True
    if err == EOPNOTSUPP or err == ENOSYS or err == EINVAL:
        return False
    raise OSError(err, strerror(err).decode())


def start_writeback(int fd, int64_t offset, int64_t length) -> bool:
    """Ask the OS to start writing bytes `offset` to `offset + length` of file `fd` to disk now
    (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), without waiting for it: the disk works
    while the next bytes are still being written, so the fsync that makes the file durable
    finds little left to do. A hint: True if it was taken, False otherwise (never raises; the
    fsync reports any I/O error)."""
    cdef int err
    if length <= 0:
        return False
    with nogil:
        err = shardkit_start_writeback(fd, offset, length)
    return err == 0


def read_arrays(int fd, list arrays not None, int64_t offset):
    """Fill `arrays` back to back from `offset` of file `fd` with ``preadv`` (at most IOV_LIMIT
    buffers a call), the GIL released. Returns the bytes read: less than the arrays hold only
    when the file ends first. Each element must be a writable C-contiguous numpy array
    (TypeError / ValueError otherwise, before anything is read); OSError on a failed read.
    """
    cdef Py_ssize_t n = len(arrays)
    cdef Py_ssize_t i, k = 0, stop
    cdef int64_t total = 0, done = 0
    cdef ssize_t got
    cdef int err = 0
    if n == 0:
        return 0
    cdef iovec* iov = <iovec*>malloc(n * sizeof(iovec))
    if iov == NULL:
        raise MemoryError()
    try:
        i = _describe_buffers(arrays, iov, True)
        if i < n:
            a = arrays[i]
            if not cnp.PyArray_Check(a):
                raise TypeError(f"array {i} is a {type(a).__name__}, not a numpy array")
            raise ValueError(f"array {i} is not a writable C-contiguous array")
        for i in range(n):
            total += <int64_t>iov[i].iov_len
        with nogil:  # `arrays` (held by the caller) keeps every array alive meanwhile
            while done < total:
                while k < n and iov[k].iov_len == 0:
                    k += 1
                stop = min(n, k + _IOV_LIMIT)
                got = preadv(fd, iov + k, <int>(stop - k), offset + done)
                if got < 0:
                    if errno == EINTR:
                        continue
                    err = errno
                    break
                if got == 0:  # end of file
                    break
                done += got
                k = _consume(iov, k, n, <size_t>got)
        if err:
            raise OSError(err, strerror(err).decode())
        return done
    finally:
        free(iov)
