"""Many read-only (or writable) numpy arrays over one buffer, in one call.

`make_views` is what a load of 50,000 small tensors spends its time on after the index: one
``np.ndarray(shape, dtype, buffer, offset)`` costs about 0.6 us in Python, mostly argument
parsing and a buffer export per view. Here each view is made with the numpy C API
(``PyArray_NewFromDescr`` on the base array's memory, with the base array as its ``base``), so the
base array, and through it the memory map it wraps, lives as long as any view.
"""

cimport numpy as cnp
from cpython.ref cimport PyObject, Py_INCREF
from libc.stdint cimport int64_t

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    ctypedef struct PyTypeObject:
        pass
    PyTypeObject PyArray_Type
    object PyArray_NewFromDescr(PyTypeObject* subtype, cnp.PyArray_Descr* descr, int nd,
                                cnp.npy_intp* dims, cnp.npy_intp* strides, void* data,
                                int flags, PyObject* obj)

cdef extern from *:
    bint _add_overflows "__builtin_add_overflow"(int64_t a, int64_t b, int64_t* out) nogil

cdef enum:
    _MAX_DIMS = 64  # numpy 2.x's limit (1.x refuses more than 32 itself); more is refused


def make_views(cnp.ndarray base not None, int64_t start, list begins not None,
               list dtypes not None, list shapes not None):
    """Arrays ``dtypes[i]`` of ``shapes[i]`` over the bytes of the 1-d uint8 array `base` from
    ``start + begins[i]``, C order; writable only if `base` is. ValueError for a range outside
    `base`, a negative dimension or lists of unequal lengths."""
    cdef Py_ssize_t n = len(begins)
    cdef Py_ssize_t i, k, nd
    cdef cnp.npy_intp dims[_MAX_DIMS]
    cdef int64_t size, nbytes, offset, dim, begin
    cdef char* data
    cdef int flags
    cdef bint empty, wraps
    cdef cnp.dtype descr
    cdef tuple shape
    if len(dtypes) != n or len(shapes) != n:
        raise ValueError(f"begins, dtypes and shapes differ in length: {n}, {len(dtypes)}, "
                         f"{len(shapes)}")
    if cnp.PyArray_NDIM(base) != 1 or cnp.PyArray_ITEMSIZE(base) != 1 or not (
            cnp.PyArray_IS_C_CONTIGUOUS(base)):
        raise ValueError("base must be a contiguous 1-d array of bytes")
    data = <char*>cnp.PyArray_DATA(base)
    size = cnp.PyArray_NBYTES(base)
    flags = cnp.NPY_ARRAY_WRITEABLE if cnp.PyArray_ISWRITEABLE(base) else 0
    cdef list out = [None] * n
    for i in range(n):
        descr = <cnp.dtype?>dtypes[i]
        shape = <tuple?>shapes[i]
        nd = len(shape)
        if nd > _MAX_DIMS:
            raise ValueError(f"view {i}: {nd} dimensions, more than {_MAX_DIMS}")
        empty = False
        for k in range(nd):
            dim = shape[k]
            if dim < 0:
                raise ValueError(f"view {i}: negative dimension in shape {shape}")
            dims[k] = <cnp.npy_intp>dim
            empty = empty or dim == 0
        nbytes = 0 if empty else descr.itemsize
        for k in range(nd if not empty else 0):
            if nbytes > size // dims[k]:  # cannot fit (checked before it could overflow)
                raise ValueError(f"view {i}: shape {shape} needs more than the {size}-byte "
                                 "buffer")
            nbytes *= dims[k]
        try:
            begin = begins[i]
            wraps = _add_overflows(start, begin, &offset)
        except OverflowError:  # not an int64: outside any buffer
            wraps = True
        if wraps or offset < 0 or nbytes > size or offset > size - nbytes:
            # worded with Python ints: the exact numbers, not what int64 wrapped them to
            raise ValueError(f"view {i}: bytes [{start + begins[i]}, "
                             f"{start + begins[i] + nbytes}) are outside the {size}-byte buffer")
        Py_INCREF(descr)  # PyArray_NewFromDescr steals a reference to the descriptor
        view = PyArray_NewFromDescr(&PyArray_Type, <cnp.PyArray_Descr*>descr, <int>nd, dims,
                                    NULL, data + offset, flags, NULL)
        cnp.set_array_base(view, base)  # keeps base (and what it wraps) alive
        out[i] = view
    return out
