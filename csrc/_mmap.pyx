"""A private, writable memory map of a file that holds no descriptor.

`Map(fd, size)` maps the first `size` bytes of `fd` with ``MAP_PRIVATE`` and
``PROT_READ | PROT_WRITE``: copy-on-write, so arrays over it are writable and writing to them
never reaches the file. Unlike ``mmap.mmap`` it keeps no duplicate of the descriptor (the caller
may close `fd` at once) and has no ``close()``: the pages are unmapped in ``__dealloc__``, when
the last reference goes, and numpy arrays made from its buffer reference it. A map's lifetime is
therefore owned by reference counts only, and no view can outlive its memory.
"""

from cpython.buffer cimport PyBUF_WRITABLE
from libc.errno cimport errno
from libc.string cimport strerror

cdef extern from "sys/mman.h" nogil:
    void* mmap(void* addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void* addr, size_t length)
    int PROT_READ
    int PROT_WRITE
    int MAP_PRIVATE
    void* MAP_FAILED


cdef class Map:
    """The first `size` bytes of file `fd`, mapped copy-on-write; a writable byte buffer.

    OSError (with errno) when the system refuses the map; ValueError for a negative size.
    A size of 0 maps nothing and gives an empty buffer."""

    cdef char* data
    cdef Py_ssize_t size
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]
    cdef object __weakref__

    def __cinit__(self, int fd, Py_ssize_t size):
        cdef void* p
        cdef int err = 0
        self.data = NULL
        self.size = 0
        if size < 0:
            raise ValueError(f"cannot map a negative size ({size} bytes)")
        if size > 0:
            with nogil:
                p = mmap(NULL, <size_t>size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0)
                if p == MAP_FAILED:
                    err = errno
            if p == MAP_FAILED:
                raise OSError(err, strerror(err).decode("utf-8", "replace"))
            self.data = <char*>p
        self.size = size
        self.shape[0] = size
        self.strides[0] = 1

    def __dealloc__(self):
        if self.data != NULL:
            munmap(self.data, <size_t>self.size)
            self.data = NULL

    def __len__(self):
        return self.size

    def __getbuffer__(self, Py_buffer* buf, int flags):
        buf.buf = self.data
        buf.obj = self
        buf.len = self.size
        buf.readonly = 0
        buf.itemsize = 1
        buf.format = "B"
        buf.ndim = 1
        buf.shape = self.shape
        buf.strides = self.strides
        buf.suboffsets = NULL
        buf.internal = NULL

    def __releasebuffer__(self, Py_buffer* buf):
        pass  # nothing to count: the exporter lives while any export references it
