"""Per-entry work of writing many small tensors: the entries of a raw shard's JSON header, and
the byte sizes and addresses of many arrays.

`encode_header_entries` writes ``,"name":{"dtype":...,"shape":[...],"data_offsets":[b,e]}`` for
every entry into one growable C buffer and returns it as one bytes object. Names are escaped
byte-for-byte like ``json.encoder.encode_basestring(name).encode("utf-8")``: the UTF-8 bytes
come from ``PyUnicode_AsUTF8AndSize`` (no copy for ASCII names) and runs that need no escaping
are copied with memcpy. The loop touches Python objects (the name, dtype and shape of each
entry), so it holds the GIL. `array_nbytes` reads ``.nbytes`` straight into an int64 array,
with no list of Python ints in between.

Results and errors match the pure-Python twin in shardkit._reference._table; messages match too,
except Cython's own messages for a wrong argument type or buffer format.
"""

from cpython.bool cimport PyBool_Check
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_CheckExact
from cpython.number cimport PyNumber_Index
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_GET_SIZE, PyTuple_New, PyTuple_SET_ITEM
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_Check
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy

cimport numpy as cnp
import numpy as np

cnp.import_array()

cdef enum:
    # Longest decimal int64 ("-9223372036854775808") plus a separator.
    _INT_ROOM = 21
    # The fixed bytes of one entry (',' two quotes ':{"dtype":"' '","shape":['
    # '],"data_offsets":[' ',' ']}', 56 bytes), rounded up.
    _ENTRY_ROOM = 64


cdef struct _Buf:
    char* data
    size_t size
    size_t cap


cdef int _grow(_Buf* b, size_t extra) except -1:
    """Make room for `extra` more bytes, at least doubling the capacity."""
    cdef size_t cap = b.cap * 2 if b.cap else 4096
    cdef char* p
    while cap < b.size + extra:
        cap *= 2
    p = <char*>realloc(b.data, cap)
    if p == NULL:
        raise MemoryError()
    b.data = p
    b.cap = cap
    return 0


# _ESCAPE[c] is 0 when byte c is copied as is, else the letter after the backslash ('u' for
# \u00XX). Bytes >= 0x80 belong to UTF-8 sequences and are copied.
cdef unsigned char _ESCAPE[256]
cdef const char* _HEX = b"0123456789abcdef"
cdef const char* _DIGITS = (
    b"00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    b"40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    b"8081828384858687888990919293949596979899"
)


cdef void _init_escape_table() noexcept:
    cdef int c
    for c in range(256):
        _ESCAPE[c] = c'u' if c < 0x20 else 0
    _ESCAPE[ord('"')] = c'"'
    _ESCAPE[ord('\\')] = c'\\'
    _ESCAPE[ord('\n')] = c'n'
    _ESCAPE[ord('\r')] = c'r'
    _ESCAPE[ord('\t')] = c't'
    _ESCAPE[ord('\b')] = c'b'
    _ESCAPE[ord('\f')] = c'f'


_init_escape_table()


cdef inline char* _put_json_string(char* out, const char* s, Py_ssize_t n) noexcept nogil:
    """Write `s` (UTF-8, n bytes) as a JSON string; needs room for 6 * n + 2 bytes."""
    cdef Py_ssize_t i, start = 0
    cdef unsigned char c, e
    out[0] = c'"'
    out += 1
    for i in range(n):
        c = <unsigned char>s[i]
        e = _ESCAPE[c]
        if e == 0:
            continue
        if i > start:
            memcpy(out, s + start, <size_t>(i - start))
            out += i - start
        out[0] = c'\\'
        if e == c'u':
            out[1] = c'u'
            out[2] = c'0'
            out[3] = c'0'
            out[4] = _HEX[c >> 4]
            out[5] = _HEX[c & 15]
            out += 6
        else:
            out[1] = <char>e
            out += 2
        start = i + 1
    if n > start:
        memcpy(out, s + start, <size_t>(n - start))
        out += n - start
    out[0] = c'"'
    return out + 1


cdef inline char* _put_int(char* out, int64_t value) noexcept nogil:
    """Write `value` in decimal; needs room for 20 bytes."""
    cdef char tmp[20]
    cdef char* end = tmp + 20
    cdef char* p = end
    cdef uint64_t u = <uint64_t>value
    cdef unsigned int r
    if value < 0:
        out[0] = c'-'
        out += 1
        u = (<uint64_t>0) - u
    while u >= 100:
        r = <unsigned int>(u % 100) * 2
        u //= 100
        p -= 2
        p[0] = _DIGITS[r]
        p[1] = _DIGITS[r + 1]
    if u >= 10:
        r = <unsigned int>u * 2
        p -= 2
        p[0] = _DIGITS[r]
        p[1] = _DIGITS[r + 1]
    else:
        p -= 1
        p[0] = <char>(c'0' + u)
    memcpy(out, p, <size_t>(end - p))
    return out + (end - p)


cdef inline char* _put_bytes(char* out, const char* s, size_t n) noexcept nogil:
    memcpy(out, s, n)
    return out + n


cdef inline bint _plain_ascii(const char* s, Py_ssize_t n) noexcept nogil:
    """True if all n bytes are printable ASCII that JSON copies unescaped."""
    cdef Py_ssize_t k
    cdef unsigned char c
    for k in range(n):
        c = <unsigned char>s[k]
        if c < 0x20 or c >= 0x7f or _ESCAPE[c]:
            return False
    return True


cdef int64_t _dim(object d, Py_ssize_t i, str name) except -1:
    """The value of one dim: an int (not bool) or an object with __index__, >= 0, < 2**63."""
    cdef int overflow = 0
    cdef int64_t v
    if not PyLong_CheckExact(d):
        try:
            if PyBool_Check(d):
                raise TypeError
            d = PyNumber_Index(d)
        except TypeError:
            raise TypeError(
                f"entry {i} ({name!r}): shape dims must be ints, got {type(d).__name__} {d!r}"
            ) from None
    v = PyLong_AsLongLongAndOverflow(d, &overflow)
    if overflow or v < 0:
        raise ValueError(
            f"entry {i} ({name!r}): shape dim {int(d)} is outside 0..2**63-1"
        )
    return v


def encode_header_entries(
    list names not None,
    list dtype_names not None,
    list shapes not None,
    const int64_t[::1] begins not None,
    const int64_t[::1] ends not None,
) -> bytes:
    """``,"name":{"dtype":"F32","shape":[2,3],"data_offsets":[b,e]}`` for every entry, as UTF-8.

    Names are escaped like ``json.encoder.encode_basestring``. Raises UnicodeEncodeError for a
    name that is not valid UTF-8 text, TypeError for a non-str name or dtype or a shape that is
    not a tuple or list of ints, ValueError for a dtype name needing escaping, a negative dim or
    inputs of unequal lengths; errors name the entry.
    """
    cdef Py_ssize_t n = len(names)
    cdef Py_ssize_t i, k, ndim, name_len, dtype_len
    cdef const char* name_utf8
    cdef const char* dtype_utf8
    cdef char* out
    cdef _Buf buf
    cdef bint slow
    cdef int64_t* dims = NULL
    cdef Py_ssize_t dims_cap = 0
    cdef int64_t* p
    if not (len(dtype_names) == len(shapes) == begins.shape[0] == ends.shape[0] == n):
        raise ValueError(
            f"names, dtype_names, shapes, begins and ends must have equal lengths, got {n}, "
            f"{len(dtype_names)}, {len(shapes)}, {begins.shape[0]}, {ends.shape[0]}"
        )
    buf.data = NULL
    buf.size = 0
    buf.cap = 0
    try:
        _grow(&buf, <size_t>n * 96)
        for i in range(n):
            name = names[i]
            dtype = dtype_names[i]
            shape = shapes[i]
            if not PyUnicode_Check(name):
                raise TypeError(f"entry {i}: names must be str, got {type(name).__name__}")
            name_utf8 = PyUnicode_AsUTF8AndSize(name, &name_len)
            if not PyUnicode_Check(dtype):
                raise TypeError(
                    f"entry {i} ({name!r}): dtype names must be str, got {type(dtype).__name__}"
                )
            try:
                dtype_utf8 = PyUnicode_AsUTF8AndSize(dtype, &dtype_len)
            except UnicodeEncodeError:
                dtype_utf8 = b"\x00"  # any byte _plain_ascii rejects
                dtype_len = 1
            if not _plain_ascii(dtype_utf8, dtype_len):
                raise ValueError(
                    f"entry {i} ({name!r}): dtype name {dtype!r} is not printable ASCII "
                    "without quotes or backslashes"
                )
            if type(shape) is not tuple:
                if not isinstance(shape, (tuple, list)):
                    raise TypeError(
                        f"entry {i} ({name!r}): shape must be a tuple or list of ints, got "
                        f"{type(shape).__name__}"
                    )
                shape = tuple(shape)  # a tuple cannot change while dims call __index__
            ndim = PyTuple_GET_SIZE(shape)
            if ndim > dims_cap:
                p = <int64_t*>realloc(dims, <size_t>(ndim * 2) * sizeof(int64_t))
                if p == NULL:
                    raise MemoryError()
                dims = p
                dims_cap = ndim * 2
            slow = False
            for k in range(ndim):
                d = (<tuple>shape)[k]
                slow = slow or not PyLong_CheckExact(d)
                dims[k] = _dim(d, i, name)
            if slow and not (len(names) == len(dtype_names) == len(shapes) == n):
                raise RuntimeError("names, dtype_names or shapes changed size during the call")
            if buf.size + _ENTRY_ROOM + 6 * <size_t>name_len + <size_t>dtype_len + (
                2 + <size_t>ndim
            ) * _INT_ROOM > buf.cap:
                _grow(&buf, _ENTRY_ROOM + 6 * <size_t>name_len + <size_t>dtype_len + (
                    2 + <size_t>ndim
                ) * _INT_ROOM)
            out = buf.data + buf.size
            out[0] = c','
            out = _put_json_string(out + 1, name_utf8, name_len)
            out = _put_bytes(out, b':{"dtype":"', 11)
            out = _put_bytes(out, dtype_utf8, <size_t>dtype_len)
            out = _put_bytes(out, b'","shape":[', 11)
            for k in range(ndim):
                if k:
                    out[0] = c','
                    out += 1
                out = _put_int(out, dims[k])
            out = _put_bytes(out, b'],"data_offsets":[', 18)
            out = _put_int(out, begins[i])
            out[0] = c','
            out = _put_int(out + 1, ends[i])
            out[0] = c']'
            out[1] = c'}'
            buf.size = <size_t>(out + 2 - buf.data)
        return PyBytes_FromStringAndSize(buf.data, <Py_ssize_t>buf.size)
    finally:
        free(buf.data)
        free(dims)


def array_nbytes(list arrays not None):
    """``arrays[i].nbytes`` for every array, as an int64 numpy array."""
    cdef Py_ssize_t n = len(arrays)
    cdef Py_ssize_t i
    cdef type ndarray = np.ndarray
    out = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] view = out
    for i in range(n):
        a = arrays[i]
        view[i] = a.nbytes
        if type(a) is not ndarray and len(arrays) != n:
            raise RuntimeError("arrays changed size during the call")
    return out


def array_addresses(list arrays not None):
    """The address of each numpy array's first byte, as an int64 numpy array; 0 for an empty
    array (its address means nothing). Reads the arrays' structs (no attribute lookups)."""
    cdef Py_ssize_t n = len(arrays)
    cdef Py_ssize_t i
    cdef type ndarray = np.ndarray
    cdef cnp.ndarray arr
    out = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] view = out
    for i in range(n):
        a = arrays[i]
        if not isinstance(a, ndarray):
            raise TypeError(f"arrays[{i}] is a {type(a).__name__}, not a numpy array")
        arr = <cnp.ndarray>a
        view[i] = 0 if cnp.PyArray_SIZE(arr) == 0 else <int64_t><size_t>cnp.PyArray_DATA(arr)
        if len(arrays) != n:
            raise RuntimeError("arrays changed size during the call")
    return out


def describe_arrays(list values not None, storable not None):
    """``(dtypes, nbytes, shapes)`` of `values` in one pass, when every value is exactly a
    numpy array whose dtype is in `storable`; None as soon as one is not (the caller converts
    those first). `nbytes` is an int64 array; `dtypes` and `shapes` are lists. Reads the arrays'
    structs through numpy's C API (no attribute lookups, one cache miss per array)."""
    cdef Py_ssize_t n = len(values)
    cdef Py_ssize_t i, k, nd
    cdef type ndarray = np.ndarray
    cdef cnp.ndarray arr
    cdef cnp.npy_intp* dims
    cdef tuple shape
    cdef object dim  # a Python int: the tuple takes a reference to it
    nbytes = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] sizes = nbytes
    cdef list dtypes = [None] * n
    cdef list shapes = [None] * n
    checked = None  # the last dtype found in `storable` (arrays of a state share a few)
    for i in range(n):
        a = values[i]
        if type(a) is not ndarray:
            return None
        arr = <cnp.ndarray>a
        d = <object>cnp.PyArray_DESCR(arr)
        if d is not checked:
            if d not in storable:
                return None
            checked = d
        dtypes[i] = d
        nd = cnp.PyArray_NDIM(arr)
        dims = cnp.PyArray_DIMS(arr)
        shape = PyTuple_New(nd)
        for k in range(nd):
            dim = dims[k]
            Py_INCREF(dim)  # PyTuple_SET_ITEM steals a reference
            PyTuple_SET_ITEM(shape, k, dim)
        shapes[i] = shape
        sizes[i] = cnp.PyArray_NBYTES(arr)
        if len(values) != n:
            raise RuntimeError("values changed size during the call")
    return dtypes, nbytes, shapes


from collections.abc import Mapping as _Mapping

cdef enum:
    _MAX_DEPTH = 200  # deeper states take the Python walk (no C recursion limit to hit)


cdef int _walk(object node, str base, str sep, list keys, list values, int depth) except -1:
    """Append the leaves under `node` (a dict, list or tuple) to `keys` / `values`, depth-first
    in insertion order. Returns 1 when the state needs the Python walk instead: a key that is
    not exactly a str, a mapping that is not a dict, or nesting deeper than _MAX_DEPTH."""
    cdef Py_ssize_t i
    cdef int found
    if depth > _MAX_DEPTH:
        return 1
    if type(node) is dict:
        for k, v in (<dict>node).items():
            if type(k) is not str:
                return 1
            found = _leaf_or_node(base + <str>k, v, sep, keys, values, depth)
            if found:
                return found
    else:
        for i in range(len(node)):
            found = _leaf_or_node(base + str(i), node[i], sep, keys, values, depth)
            if found:
                return found
    return 0


cdef int _leaf_or_node(str key, object v, str sep, list keys, list values,
                       int depth) except -1:
    if type(v) is ndarray_type:
        keys.append(key)
        values.append(v)
        return 0
    if type(v) is dict or isinstance(v, (list, tuple)):
        return _walk(v, key + sep, sep, keys, values, depth + 1)
    if isinstance(v, _Mapping):
        return 1
    keys.append(key)
    values.append(v)
    return 0


ndarray_type = np.ndarray


def flatten_plain(state, str sep not None):
    """``(keys, leaves)`` of a state made of dicts with str keys, lists and tuples, as
    shardkit.tensors.flatten would give them (keys joined with `sep`, lists indexed ``0, 1,
    ...``, depth-first in insertion order); None when the state needs that Python walk
    (another kind of mapping or key, or very deep nesting)."""
    if type(state) is not dict:
        return None
    cdef list keys = []
    cdef list values = []
    if _walk(state, "", sep, keys, values, 0):
        return None
    return keys, values
