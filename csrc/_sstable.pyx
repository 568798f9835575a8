"""The entries of one block of a LevelDB / TensorFlow table (``tsl/lib/io/block.cc``).

A block holds entries ``varint32 shared, varint32 unshared, varint32 value_length,
key[shared:], value``, each key sharing `shared` leading bytes with the previous one; restart
points store their key whole. A 50,000-entry ``.index`` spends about 30 ms walking its blocks in
Python (three varints, a key built from two slices and a value slice per entry); here each key
and value is one bytes object made from the block's memory.
"""

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Resize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy


cdef inline Py_ssize_t _varint32(const unsigned char* p, Py_ssize_t pos, Py_ssize_t limit,
                                 uint32_t* out, int* err) noexcept nogil:
    """Decode the varint32 at `pos` like table.get_varint(bits=32): err 1 truncated or
    overlong, 2 out of range."""
    cdef uint64_t result = 0
    cdef int shift = 0
    cdef unsigned char b
    while pos < limit:
        b = p[pos]
        pos += 1
        result |= (<uint64_t>(b & 0x7F)) << shift
        if not b & 0x80:
            if result >> 32:
                err[0] = 2
                return pos
            out[0] = <uint32_t>result
            return pos
        shift += 7
        if shift >= 39:
            break
    err[0] = 1
    return pos


def block_entries(const unsigned char[::1] block, Py_ssize_t limit, restarts):
    """(keys, values) of the entries in ``block[:limit]`` (the restart array follows `limit`;
    `restarts`, the restart offsets, sorted, the first 0). ValueError saying which entry is
    bad: a malformed varint, a key sharing more bytes than the previous key has or sharing any
    at a restart point, an entry running past `limit`."""
    return _walk(block, limit, restarts, None, None, None)


def block_framed(const unsigned char[::1] block, Py_ssize_t limit, restarts, bytes prefix,
                 bytearray out, list lengths):
    """The keys of the entries in ``block[:limit]`` (as `block_entries`, the same checks),
    their values appended to `out`, each after `prefix` (so that one protobuf parse of `out`
    reads them all), and their lengths appended to `lengths`. After a ValueError the contents
    of `out` and `lengths` are unspecified."""
    return _walk(block, limit, restarts, prefix, out, lengths)[0]


cdef tuple _walk(const unsigned char[::1] block, Py_ssize_t limit, restarts, bytes prefix,
                 bytearray out, list lengths):
    """`block_entries`, or with `out` `block_framed` (values left None)."""
    cdef Py_ssize_t n = block.shape[0]
    if limit < 0 or limit + 3 > n:
        raise ValueError(f"limit {limit} leaves no room for the restart array")
    cdef const unsigned char* p = &block[0] if n else NULL
    cdef list keys = []
    cdef list values = []
    cdef Py_ssize_t pos = 0, at, end, stop, ri = 0
    cdef Py_ssize_t nrestarts = len(restarts)
    cdef Py_ssize_t next_restart = restarts[0] if nrestarts else -1
    cdef uint32_t shared, unshared, length
    cdef int err = 0
    cdef bytes last = b""
    cdef bytes key
    cdef Py_ssize_t last_len = 0
    cdef bint at_restart
    cdef bint framed = out is not None
    cdef Py_ssize_t plen = PyBytes_GET_SIZE(prefix) if framed else 0
    cdef Py_ssize_t used = PyByteArray_GET_SIZE(out) if framed else 0
    cdef Py_ssize_t room = used
    cdef char* dst
    while pos < limit:
        at = pos
        shared, unshared, length = p[pos], p[pos + 1], p[pos + 2]
        if shared < 0x80 and unshared < 0x80 and length < 0x80:
            pos += 3
        else:
            pos = _varint32(p, pos, limit, &shared, &err)
            if not err:
                pos = _varint32(p, pos, limit, &unshared, &err)
            if not err:
                pos = _varint32(p, pos, limit, &length, &err)
            if err:
                what = "truncated or overlong varint32" if err == 1 else "varint32 out of range"
                raise ValueError(f"bad entry at byte {at} ({what})")
        while ri < nrestarts and next_restart < at:
            ri += 1
            next_restart = restarts[ri] if ri < nrestarts else -1
        at_restart = next_restart == at
        if shared and (shared > last_len or at_restart):
            raise ValueError(
                f"entry at byte {at} shares {shared} bytes with the previous key of "
                f"{last_len} bytes" + (" at a restart point" if at_restart else ""))
        end = pos + unshared
        stop = end + length
        if stop > limit:
            raise ValueError(f"entry at byte {at} runs past the block")
        key = PyBytes_FromStringAndSize(NULL, shared + unshared)
        if shared:
            memcpy(PyBytes_AS_STRING(key), PyBytes_AS_STRING(last), shared)
        if unshared:
            memcpy(PyBytes_AS_STRING(key) + shared, p + pos, unshared)
        keys.append(key)
        if framed:
            if used + plen + length > room:
                room = 2 * room + plen + length + 4096
                PyByteArray_Resize(out, room)
            dst = PyByteArray_AS_STRING(out)
            memcpy(dst + used, PyBytes_AS_STRING(prefix), plen)
            if length:
                memcpy(dst + used + plen, p + end, length)
            used += plen + length
            lengths.append(length)
        else:
            values.append(PyBytes_FromStringAndSize(<const char*>(p + end), length))
        pos = stop
        last = key
        last_len = PyBytes_GET_SIZE(key)
    if framed and room != used:
        PyByteArray_Resize(out, used)
    return keys, values
