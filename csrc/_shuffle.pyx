# cython: language_level=3
"""Byte shuffle fused with gather (save) and unshuffle fused with scatter (restore).

The kernels behind compressed (.skz) shards. A *piece* is a run of whole items of one item size
``s``; shuffling a piece of ``n`` items writes byte ``b`` of item ``i`` to ``out[b * n + i]`` (all
first bytes, then all second bytes, ...), which is what makes float weights compress.
``s == 1`` is a plain copy, so passing item size 1 everywhere turns shuffling off.

Sources and destinations are any C-contiguous buffers (numpy arrays, bytes, bytearrays, mmaps),
passed as a sequence and referenced by index from the piece table. Sources are requested
read-only (``PyBUF_SIMPLE``), so read-only mmaps work; their bytes are viewed untyped, so an array
of any dtype can be passed as is. Every piece is bounds-checked before the ``nogil`` loop starts.
"""

from cpython.buffer cimport (
    PyBUF_SIMPLE,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy

# SSE2 (always present on x86-64) transposes for 2-, 4- and 8-byte items, 16 items per step:
# networks of byte/word unpack instructions, which compilers do not find on their own. Other
# targets compile the stubs and take the scalar loops instead. Large unshuffles use
# non-temporal (streaming) stores: a restore writes each output byte once and does not read it
# back soon, and skipping the read-for-ownership of every destination cache line halves the
# memory traffic of the writes (measured 12 -> 26 GB/s into arrays not in cache).
cdef extern from *:
    """
    #if defined(__SSE2__) || defined(_M_X64)
    #include <emmintrin.h>
    #define SHARDKIT_SSE2 1
    /* The shuffles read their sources once, usually from memory, not cache: asking for the
       bytes 4 KiB ahead measured 1.5x faster (2- and 4-byte items) than the hardware
       prefetcher alone. A prefetch never faults, so reading ahead past the end is harmless. */
    static inline void shardkit_prefetch(const unsigned char* p) {
        _mm_prefetch((const char*)p + 4096, _MM_HINT_T0);
    }
    static inline void shardkit_store(unsigned char* p, __m128i v, int nt) {
        if (nt) _mm_stream_si128((__m128i*)p, v); else _mm_storeu_si128((__m128i*)p, v);
    }
    static inline void shardkit_sfence(void) { _mm_sfence(); }
    /* 16 items of 2 bytes at src -> 16 bytes into each of the 2 planes dst + b * stride. */
    static inline void shardkit_shuffle2x16(const unsigned char* src, unsigned char* dst,
                                            long long stride) {
        __m128i a0 = _mm_loadu_si128((const __m128i*)src);
        __m128i a1 = _mm_loadu_si128((const __m128i*)(src + 16));
        __m128i m = _mm_set1_epi16(0x00FF);
        _mm_storeu_si128((__m128i*)dst, _mm_packus_epi16(_mm_and_si128(a0, m),
                                                         _mm_and_si128(a1, m)));
        _mm_storeu_si128((__m128i*)(dst + stride), _mm_packus_epi16(_mm_srli_epi16(a0, 8),
                                                                    _mm_srli_epi16(a1, 8)));
    }
    /* 16 items of 4 bytes at src -> 16 bytes into each of the 4 planes dst + b * stride. */
    static inline void shardkit_shuffle4x16(const unsigned char* src, unsigned char* dst,
                                            long long stride) {
        __m128i a0 = _mm_loadu_si128((const __m128i*)src);
        __m128i a1 = _mm_loadu_si128((const __m128i*)(src + 16));
        __m128i a2 = _mm_loadu_si128((const __m128i*)(src + 32));
        __m128i a3 = _mm_loadu_si128((const __m128i*)(src + 48));
        __m128i t0 = _mm_unpacklo_epi8(a0, a1), t1 = _mm_unpackhi_epi8(a0, a1);
        __m128i t2 = _mm_unpacklo_epi8(a2, a3), t3 = _mm_unpackhi_epi8(a2, a3);
        __m128i u0 = _mm_unpacklo_epi8(t0, t1), u1 = _mm_unpackhi_epi8(t0, t1);
        __m128i u2 = _mm_unpacklo_epi8(t2, t3), u3 = _mm_unpackhi_epi8(t2, t3);
        __m128i v0 = _mm_unpacklo_epi8(u0, u1), v1 = _mm_unpackhi_epi8(u0, u1);
        __m128i w0 = _mm_unpacklo_epi8(u2, u3), w1 = _mm_unpackhi_epi8(u2, u3);
        _mm_storeu_si128((__m128i*)dst, _mm_unpacklo_epi64(v0, w0));
        _mm_storeu_si128((__m128i*)(dst + stride), _mm_unpackhi_epi64(v0, w0));
        _mm_storeu_si128((__m128i*)(dst + 2 * stride), _mm_unpacklo_epi64(v1, w1));
        _mm_storeu_si128((__m128i*)(dst + 3 * stride), _mm_unpackhi_epi64(v1, w1));
    }
    /* One round of the 8-vector network: out[2k], out[2k+1] = unpack lo, hi (in[k], in[k+4]).
       On the 128 bytes seen as one array it rotates each byte's 7-bit index left by one bit, so
       4 rounds turn 16 items x 8 bytes into 8 planes x 16 bytes and 3 rounds undo that. */
    static inline void shardkit_round8(__m128i* v) {
        __m128i t[8];
        int k;
        for (k = 0; k < 4; k++) {
            t[2 * k] = _mm_unpacklo_epi8(v[k], v[k + 4]);
            t[2 * k + 1] = _mm_unpackhi_epi8(v[k], v[k + 4]);
        }
        for (k = 0; k < 8; k++) v[k] = t[k];
    }
    /* 16 items of 8 bytes at src -> 16 bytes into each of the 8 planes dst + b * stride. */
    static inline void shardkit_shuffle8x16(const unsigned char* src, unsigned char* dst,
                                            long long stride) {
        __m128i v[8];
        int k;
        for (k = 0; k < 8; k++) v[k] = _mm_loadu_si128((const __m128i*)(src + 16 * k));
        shardkit_round8(v); shardkit_round8(v); shardkit_round8(v); shardkit_round8(v);
        for (k = 0; k < 8; k++) _mm_storeu_si128((__m128i*)(dst + k * stride), v[k]);
    }
    /* The inverses: 16 bytes from each plane src + b * stride -> 16 items at dst (with `nt`,
       dst must be 16-byte aligned). */
    static inline void shardkit_unshuffle2x16(const unsigned char* src, unsigned char* dst,
                                              long long stride, int nt) {
        __m128i p0 = _mm_loadu_si128((const __m128i*)src);
        __m128i p1 = _mm_loadu_si128((const __m128i*)(src + stride));
        shardkit_store(dst, _mm_unpacklo_epi8(p0, p1), nt);
        shardkit_store(dst + 16, _mm_unpackhi_epi8(p0, p1), nt);
    }
    static inline void shardkit_unshuffle4x16(const unsigned char* src, unsigned char* dst,
                                              long long stride, int nt) {
        __m128i p0 = _mm_loadu_si128((const __m128i*)src);
        __m128i p1 = _mm_loadu_si128((const __m128i*)(src + stride));
        __m128i p2 = _mm_loadu_si128((const __m128i*)(src + 2 * stride));
        __m128i p3 = _mm_loadu_si128((const __m128i*)(src + 3 * stride));
        __m128i x0 = _mm_unpacklo_epi8(p0, p1), x1 = _mm_unpackhi_epi8(p0, p1);
        __m128i y0 = _mm_unpacklo_epi8(p2, p3), y1 = _mm_unpackhi_epi8(p2, p3);
        shardkit_store(dst, _mm_unpacklo_epi16(x0, y0), nt);
        shardkit_store(dst + 16, _mm_unpackhi_epi16(x0, y0), nt);
        shardkit_store(dst + 32, _mm_unpacklo_epi16(x1, y1), nt);
        shardkit_store(dst + 48, _mm_unpackhi_epi16(x1, y1), nt);
    }
    static inline void shardkit_unshuffle8x16(const unsigned char* src, unsigned char* dst,
                                              long long stride, int nt) {
        __m128i v[8];
        int k;
        for (k = 0; k < 8; k++) v[k] = _mm_loadu_si128((const __m128i*)(src + k * stride));
        shardkit_round8(v); shardkit_round8(v); shardkit_round8(v);
        for (k = 0; k < 8; k++) shardkit_store(dst + 16 * k, v[k], nt);
    }
    static inline void shardkit_copy16(const unsigned char* src, unsigned char* dst, int nt) {
        shardkit_store(dst, _mm_loadu_si128((const __m128i*)src), nt);
    }
    #else
    #define SHARDKIT_SSE2 0
    static inline void shardkit_prefetch(const unsigned char* p) {}
    static inline void shardkit_sfence(void) {}
    static inline void shardkit_shuffle2x16(const unsigned char* s, unsigned char* d,
                                            long long n) {}
    static inline void shardkit_shuffle4x16(const unsigned char* s, unsigned char* d,
                                            long long n) {}
    static inline void shardkit_shuffle8x16(const unsigned char* s, unsigned char* d,
                                            long long n) {}
    static inline void shardkit_unshuffle2x16(const unsigned char* s, unsigned char* d,
                                              long long n, int nt) {}
    static inline void shardkit_unshuffle4x16(const unsigned char* s, unsigned char* d,
                                              long long n, int nt) {}
    static inline void shardkit_unshuffle8x16(const unsigned char* s, unsigned char* d,
                                              long long n, int nt) {}
    static inline void shardkit_copy16(const unsigned char* s, unsigned char* d, int nt) {}
    #endif
    """
    const bint SHARDKIT_SSE2
    void shardkit_sfence() noexcept nogil
    void shardkit_prefetch(const uint8_t* p) noexcept nogil
    void shardkit_shuffle2x16(const uint8_t* src, uint8_t* dst, long long stride) noexcept nogil
    void shardkit_shuffle4x16(const uint8_t* src, uint8_t* dst, long long stride) noexcept nogil
    void shardkit_shuffle8x16(const uint8_t* src, uint8_t* dst, long long stride) noexcept nogil
    void shardkit_unshuffle2x16(const uint8_t* src, uint8_t* dst, long long stride,
                                int nt) noexcept nogil
    void shardkit_unshuffle4x16(const uint8_t* src, uint8_t* dst, long long stride,
                                int nt) noexcept nogil
    void shardkit_unshuffle8x16(const uint8_t* src, uint8_t* dst, long long stride,
                                int nt) noexcept nogil
    void shardkit_copy16(const uint8_t* src, uint8_t* dst, int nt) noexcept nogil

# Unshuffles writing at least this many bytes use streaming stores (smaller ones keep their
# output in cache, where a caller reading a small tensor next wants it).
NT_MIN_BYTES = 256 * 1024
cdef int64_t _NT_MIN = NT_MIN_BYTES


# ---------------------------------------------------------------- shuffle / unshuffle of one piece
# Shuffle: n items at src (contiguous) -> s planes of n bytes, plane b at dst + b * stride.
# Unshuffle: the inverse, reading `n` items starting at plane offset 0 of planes `stride` apart.
# Fixed item sizes get their own loops: SSE2 blocks of 16 items, then scalar loops (written so
# the compiler unrolls the inner byte loop) for the rest and on other targets.

cdef inline void _shuffle2(const uint8_t* src, uint8_t* dst, int64_t n,
                           int64_t stride) noexcept nogil:
    cdef int64_t i = 0
    cdef uint8_t* d0 = dst
    cdef uint8_t* d1 = dst + stride
    cdef uint16_t v
    if SHARDKIT_SSE2:
        while i + 16 <= n:
            shardkit_prefetch(src + 2 * i)
            shardkit_shuffle2x16(src + 2 * i, dst + i, stride)
            i += 16
    while i < n:
        memcpy(&v, src + 2 * i, 2)
        d0[i] = <uint8_t>v
        d1[i] = <uint8_t>(v >> 8)
        i += 1


cdef inline void _shuffle4(const uint8_t* src, uint8_t* dst, int64_t n,
                           int64_t stride) noexcept nogil:
    cdef int64_t i = 0
    cdef uint8_t* d0 = dst
    cdef uint8_t* d1 = dst + stride
    cdef uint8_t* d2 = dst + 2 * stride
    cdef uint8_t* d3 = dst + 3 * stride
    cdef uint32_t v
    if SHARDKIT_SSE2:
        while i + 16 <= n:
            shardkit_prefetch(src + 4 * i)
            shardkit_prefetch(src + 4 * i + 32)
            shardkit_shuffle4x16(src + 4 * i, dst + i, stride)
            i += 16
    while i < n:
        memcpy(&v, src + 4 * i, 4)
        d0[i] = <uint8_t>v
        d1[i] = <uint8_t>(v >> 8)
        d2[i] = <uint8_t>(v >> 16)
        d3[i] = <uint8_t>(v >> 24)
        i += 1


cdef inline void _swap_blocks(uint64_t* r, int i, int k, uint64_t mask) noexcept nogil:
    # Swap the k-byte blocks r[i][b + k] <-> r[i + k][b] for the bytes b that `mask` selects.
    cdef uint64_t t = ((r[i] >> (8 * k)) ^ r[i + k]) & mask
    r[i + k] ^= t
    r[i] ^= t << (8 * k)


cdef inline void _transpose8x8(uint64_t* r) noexcept nogil:
    # Byte b of r[i] <-> byte i of r[b], in three rounds (blocks of 1, 2, 4 bytes).
    cdef uint64_t m1 = 0x00FF00FF00FF00FFULL
    cdef uint64_t m2 = 0x0000FFFF0000FFFFULL
    cdef uint64_t m4 = 0x00000000FFFFFFFFULL
    _swap_blocks(r, 0, 1, m1)
    _swap_blocks(r, 2, 1, m1)
    _swap_blocks(r, 4, 1, m1)
    _swap_blocks(r, 6, 1, m1)
    _swap_blocks(r, 0, 2, m2)
    _swap_blocks(r, 1, 2, m2)
    _swap_blocks(r, 4, 2, m2)
    _swap_blocks(r, 5, 2, m2)
    _swap_blocks(r, 0, 4, m4)
    _swap_blocks(r, 1, 4, m4)
    _swap_blocks(r, 2, 4, m4)
    _swap_blocks(r, 3, 4, m4)


cdef inline void _shuffle8(const uint8_t* src, uint8_t* dst, int64_t n,
                           int64_t stride) noexcept nogil:
    # SSE2: 16 items at a time; elsewhere 8 at a time (one 8x8 byte transpose in registers,
    # then one 8-byte store per plane).
    cdef int64_t i = 0
    cdef int b
    cdef uint64_t r[8]
    if SHARDKIT_SSE2:
        while i + 16 <= n:
            shardkit_prefetch(src + 8 * i)
            shardkit_prefetch(src + 8 * i + 64)
            shardkit_shuffle8x16(src + 8 * i, dst + i, stride)
            i += 16
    while i + 8 <= n:
        memcpy(r, src + 8 * i, 64)
        _transpose8x8(r)
        for b in range(8):
            memcpy(dst + b * stride + i, &r[b], 8)
        i += 8
    while i < n:
        for b in range(8):
            dst[b * stride + i] = src[8 * i + b]
        i += 1


cdef inline void _shuffle_any(const uint8_t* src, uint8_t* dst, int64_t n, int64_t s,
                              int64_t stride) noexcept nogil:
    cdef int64_t i, b
    cdef uint8_t* d
    for b in range(s):
        d = dst + b * stride
        for i in range(n):
            d[i] = src[i * s + b]


cdef inline void _unshuffle2_from(const uint8_t* src, uint8_t* dst, int64_t i, int64_t n,
                                  int64_t stride) noexcept nogil:
    cdef const uint8_t* s0 = src
    cdef const uint8_t* s1 = src + stride
    cdef uint16_t v
    while i < n:
        v = <uint16_t>s0[i] | (<uint16_t>s1[i] << 8)
        memcpy(dst + 2 * i, &v, 2)
        i += 1


cdef inline void _unshuffle4_from(const uint8_t* src, uint8_t* dst, int64_t i, int64_t n,
                                  int64_t stride) noexcept nogil:
    cdef const uint8_t* s0 = src
    cdef const uint8_t* s1 = src + stride
    cdef const uint8_t* s2 = src + 2 * stride
    cdef const uint8_t* s3 = src + 3 * stride
    cdef uint32_t v
    while i < n:
        v = (<uint32_t>s0[i] | (<uint32_t>s1[i] << 8) | (<uint32_t>s2[i] << 16)
             | (<uint32_t>s3[i] << 24))
        memcpy(dst + 4 * i, &v, 4)
        i += 1


cdef inline void _unshuffle8_from(const uint8_t* src, uint8_t* dst, int64_t i, int64_t n,
                                  int64_t stride) noexcept nogil:
    # Byte stores into the item (not an 8x8 transpose): the compiler vectorises this form.
    cdef const uint8_t* s0 = src
    cdef const uint8_t* s1 = src + stride
    cdef const uint8_t* s2 = src + 2 * stride
    cdef const uint8_t* s3 = src + 3 * stride
    cdef const uint8_t* s4 = src + 4 * stride
    cdef const uint8_t* s5 = src + 5 * stride
    cdef const uint8_t* s6 = src + 6 * stride
    cdef const uint8_t* s7 = src + 7 * stride
    cdef uint8_t* p
    while i < n:
        p = dst + 8 * i
        p[0] = s0[i]
        p[1] = s1[i]
        p[2] = s2[i]
        p[3] = s3[i]
        p[4] = s4[i]
        p[5] = s5[i]
        p[6] = s6[i]
        p[7] = s7[i]
        i += 1


cdef inline int64_t _unaligned_items(uint8_t* dst, int64_t s, int64_t n) noexcept nogil:
    # Items to write before dst + s * i is 16-byte aligned, for streaming stores; -1 when no
    # item boundary is (dst not aligned to the item size).
    cdef int64_t mis = <int64_t>(<uintptr_t>dst & 15)
    if mis == 0:
        return 0
    if mis % s:
        return -1
    return min((16 - mis) // s, n)


cdef inline void _unshuffle(const uint8_t* src, uint8_t* dst, int64_t n, int64_t s,
                            int64_t stride, bint nt) noexcept nogil:
    cdef int64_t i = 0
    cdef int64_t head = 0
    if not SHARDKIT_SSE2 or s not in (1, 2, 4, 8):
        nt = False
    if nt:
        head = _unaligned_items(dst, s, n)
        nt = head >= 0
    if s == 1:
        if not nt:
            memcpy(dst, src, <size_t>n)
            return
        memcpy(dst, src, <size_t>head)
        i = head
        while i + 16 <= n:
            shardkit_copy16(src + i, dst + i, 1)
            i += 16
        shardkit_sfence()
        memcpy(dst + i, src + i, <size_t>(n - i))
    elif s == 2:
        if nt:
            _unshuffle2_from(src, dst, 0, head, stride)
            i = head
        if SHARDKIT_SSE2:
            while i + 16 <= n:
                shardkit_unshuffle2x16(src + i, dst + 2 * i, stride, nt)
                i += 16
            if nt:
                shardkit_sfence()
        _unshuffle2_from(src, dst, i, n, stride)
    elif s == 4:
        if nt:
            _unshuffle4_from(src, dst, 0, head, stride)
            i = head
        if SHARDKIT_SSE2:
            while i + 16 <= n:
                shardkit_unshuffle4x16(src + i, dst + 4 * i, stride, nt)
                i += 16
            if nt:
                shardkit_sfence()
        _unshuffle4_from(src, dst, i, n, stride)
    elif s == 8:
        if nt:
            _unshuffle8_from(src, dst, 0, head, stride)
            i = head
        if SHARDKIT_SSE2:
            while i + 16 <= n:
                shardkit_unshuffle8x16(src + i, dst + 8 * i, stride, nt)
                i += 16
            if nt:
                shardkit_sfence()
        _unshuffle8_from(src, dst, i, n, stride)
    else:
        _unshuffle_any(src, dst, n, s, stride)


cdef inline void _unshuffle_any(const uint8_t* src, uint8_t* dst, int64_t n, int64_t s,
                                int64_t stride) noexcept nogil:
    cdef int64_t i, b
    cdef const uint8_t* p
    for b in range(s):
        p = src + b * stride
        for i in range(n):
            dst[i * s + b] = p[i]


cdef inline void _shuffle(const uint8_t* src, uint8_t* dst, int64_t n, int64_t s,
                          int64_t stride) noexcept nogil:
    if s == 1:
        memcpy(dst, src, <size_t>n)
    elif s == 2:
        _shuffle2(src, dst, n, stride)
    elif s == 4:
        _shuffle4(src, dst, n, stride)
    elif s == 8:
        _shuffle8(src, dst, n, stride)
    else:
        _shuffle_any(src, dst, n, s, stride)


# ---------------------------------------------------------------- buffer tables

cdef class _Buffers:
    """Py_buffers of a sequence of objects, held for the duration of one kernel call."""
    cdef Py_buffer* views
    cdef Py_ssize_t count
    cdef Py_ssize_t acquired

    def __cinit__(self, objects, bint writable, str role):
        cdef Py_ssize_t k
        cdef int flags = PyBUF_SIMPLE | (PyBUF_WRITABLE if writable else 0)
        self.count = len(objects)
        self.acquired = 0
        self.views = <Py_buffer*>calloc(max(self.count, 1), sizeof(Py_buffer))
        if self.views == NULL:
            raise MemoryError()
        for k in range(self.count):
            try:
                PyObject_GetBuffer(objects[k], &self.views[k], flags)
            except (BufferError, ValueError, TypeError) as e:
                raise ValueError(
                    f"{role} {k} ({type(objects[k]).__name__}) is not a C-contiguous"
                    f"{' writable' if writable else ''} buffer: {e}"
                ) from None
            self.acquired += 1

    def __dealloc__(self):
        cdef Py_ssize_t k
        if self.views != NULL:
            for k in range(self.acquired):
                PyBuffer_Release(&self.views[k])
            free(self.views)


# ---------------------------------------------------------------- public kernels

def gather_shuffle(sources, const int64_t[::1] src_index, const int64_t[::1] src_offset,
                   const int64_t[::1] length, const int64_t[::1] itemsize,
                   uint8_t[::1] dst, const int64_t[::1] dst_offset):
    """Copy piece k = ``sources[src_index[k]][src_offset[k] : src_offset[k] + length[k]]``
    into ``dst[dst_offset[k] : dst_offset[k] + length[k]]``, byte-shuffled by ``itemsize[k]``.

    ``length[k]`` must be a multiple of ``itemsize[k]``; pieces must not overlap in ``dst``.
    Raises ValueError (before writing anything) for mismatched tables or out-of-range pieces.
    """
    cdef Py_ssize_t m = src_index.shape[0]
    cdef Py_ssize_t k
    cdef int64_t j, off, ln, s, doff
    if (src_offset.shape[0] != m or length.shape[0] != m or itemsize.shape[0] != m
            or dst_offset.shape[0] != m):
        raise ValueError("gather_shuffle: the piece tables must all have the same length")
    cdef _Buffers bufs = _Buffers(sources, False, "source")
    cdef Py_ssize_t nsrc = bufs.count
    cdef int64_t dst_len = dst.shape[0]
    for k in range(m):
        j = src_index[k]
        off = src_offset[k]
        ln = length[k]
        s = itemsize[k]
        doff = dst_offset[k]
        if j < 0 or j >= nsrc:
            raise ValueError(f"gather_shuffle: piece {k} names source {j}, have {nsrc}")
        if s < 1 or ln < 0 or ln % s != 0:
            raise ValueError(f"gather_shuffle: piece {k} has length {ln}, not a whole number "
                             f"of {s}-byte items")
        if off < 0 or off + ln > bufs.views[j].len:
            raise ValueError(f"gather_shuffle: piece {k} reads bytes [{off}, {off + ln}) of "
                             f"source {j}, which has {bufs.views[j].len}")
        if doff < 0 or doff + ln > dst_len:
            raise ValueError(f"gather_shuffle: piece {k} writes bytes [{doff}, {doff + ln}) of "
                             f"a {dst_len}-byte destination")
    cdef uint8_t* out = &dst[0] if dst_len > 0 else NULL
    with nogil:
        for k in range(m):
            ln = length[k]
            if ln == 0:
                continue
            s = itemsize[k]
            _shuffle(<const uint8_t*>bufs.views[src_index[k]].buf + src_offset[k],
                     out + dst_offset[k], ln // s, s, ln // s)


def unshuffle_scatter(const uint8_t[::1] src, const int64_t[::1] src_offset,
                      const int64_t[::1] n_items, const int64_t[::1] itemsize,
                      const int64_t[::1] item_begin, const int64_t[::1] item_count,
                      dests, const int64_t[::1] dst_index, const int64_t[::1] dst_offset):
    """Inverse of gather_shuffle, also for part of a piece.

    Piece k is the shuffled image of ``n_items[k]`` items of ``itemsize[k]`` bytes starting at
    ``src[src_offset[k]]``; its items ``item_begin[k] .. item_begin[k] + item_count[k]`` are
    written unshuffled (in item order) to ``dests[dst_index[k]]`` starting at byte
    ``dst_offset[k]``. Raises ValueError (before writing anything) for out-of-range pieces.
    """
    cdef Py_ssize_t m = src_offset.shape[0]
    cdef Py_ssize_t k
    cdef int64_t j, off, n, s, ib, ic, doff
    if (n_items.shape[0] != m or itemsize.shape[0] != m or item_begin.shape[0] != m
            or item_count.shape[0] != m or dst_index.shape[0] != m or dst_offset.shape[0] != m):
        raise ValueError("unshuffle_scatter: the piece tables must all have the same length")
    cdef _Buffers bufs = _Buffers(dests, True, "destination")
    cdef Py_ssize_t ndst = bufs.count
    cdef int64_t src_len = src.shape[0]
    for k in range(m):
        off = src_offset[k]
        n = n_items[k]
        s = itemsize[k]
        ib = item_begin[k]
        ic = item_count[k]
        j = dst_index[k]
        doff = dst_offset[k]
        if s < 1 or n < 0 or ib < 0 or ic < 0 or ib + ic > n:
            raise ValueError(f"unshuffle_scatter: piece {k} asks for items [{ib}, {ib + ic}) "
                             f"of {n} items of {s} bytes")
        if off < 0 or off + n * s > src_len:
            raise ValueError(f"unshuffle_scatter: piece {k} spans bytes [{off}, {off + n * s}) "
                             f"of a {src_len}-byte source")
        if j < 0 or j >= ndst:
            raise ValueError(f"unshuffle_scatter: piece {k} names destination {j}, have {ndst}")
        if doff < 0 or doff + ic * s > bufs.views[j].len:
            raise ValueError(f"unshuffle_scatter: piece {k} writes bytes [{doff}, "
                             f"{doff + ic * s}) of destination {j}, which has "
                             f"{bufs.views[j].len}")
    cdef const uint8_t* inp = &src[0] if src_len > 0 else NULL
    with nogil:
        for k in range(m):
            ic = item_count[k]
            if ic == 0:
                continue
            s = itemsize[k]
            _unshuffle(inp + src_offset[k] + item_begin[k],
                       <uint8_t*>bufs.views[dst_index[k]].buf + dst_offset[k], ic, s,
                       n_items[k], ic * s >= _NT_MIN)
