# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled versions of ``checkcopy.patch_properties`` and ``checkcopy.check_push``.

Optional, like ``txmq.store._speedups``: ``checkcopy`` uses these when the
extension was built and its own Python functions otherwise (or when
``TXMQ_PURE_PYTHON`` is set). They give the same bytes for every input the callers pass (bytes, int64s);
``tests/test_speedups.py`` holds them equal with hypothesis. Every byte
constant (map keys, the frame prefix) comes from ``checkcopy`` through
``configure``, so the wire layout is written down once, in Python.

A check pass calls each once per pending transaction: a million times over
a million pending. In Python each is ~15,000 instructions of small
operations (finds, slices, a struct pack with 26 arguments, a join of 13
parts); here each is one allocation and a few memcpy.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.stdio cimport snprintf
from libc.string cimport memcpy, memcmp


cdef extern from "string.h" nogil:
    void *memmem(const void *haystack, size_t haystacklen, const void *needle, size_t needlelen)


# Set by configure(): every byte string checkcopy's Python code uses.
cdef bytes K_TAGS, K_CHECK, K_ORIGIN, PREFIX, K_TX_ID, CONST_TAIL, K_PROPS, K_BODY
cdef tuple FIRST_COPY_SLOW = ()
cdef list INT_KEYS = []
cdef int MSG_INDEX = -1  # the one key of INT_KEYS followed by a map header, not an int64
cdef bint configured = False


def configure(bytes k_tags not None, bytes k_check not None, bytes k_origin not None, tuple first_copy_slow not None,
              bytes prefix not None, bytes k_tx_id not None, list int_keys not None, int msg_index,
              bytes const_tail not None, bytes k_props not None, bytes k_body not None):
    global K_TAGS, K_CHECK, K_ORIGIN, FIRST_COPY_SLOW, PREFIX, K_TX_ID, INT_KEYS, MSG_INDEX, CONST_TAIL, K_PROPS, K_BODY, configured
    if len(int_keys) != 9 or msg_index != 2:
        raise ValueError("check_push expects 9 keys, the third of them the message map")
    if not all(type(k) is bytes for k in (*first_copy_slow, *int_keys)):
        raise TypeError("every key must be bytes")
    if len(k_check) > 64 or len(k_origin) > 64:
        raise ValueError("property keys this long do not fit the fixed buffers")
    K_TAGS, K_CHECK, K_ORIGIN, FIRST_COPY_SLOW = k_tags, k_check, k_origin, first_copy_slow
    PREFIX, K_TX_ID, INT_KEYS, MSG_INDEX = prefix, k_tx_id, list(int_keys), msg_index
    CONST_TAIL, K_PROPS, K_BODY = const_tail, k_props, k_body
    configured = True


cdef inline bint _find(const unsigned char *b, Py_ssize_t n, bytes k) noexcept:
    return memmem(b, n, PyBytes_AS_STRING(k), PyBytes_GET_SIZE(k)) != NULL


cdef inline bint _endswith(const unsigned char *b, Py_ssize_t end, const char *s, Py_ssize_t n) noexcept:
    return end >= n and memcmp(b + end - n, s, n) == 0


cdef inline Py_ssize_t _str_digits(char *out, int64_t v) noexcept:
    """msgpack of str(v): a fixstr header (at most 20 characters) and the digits; returns its length."""
    cdef int k = snprintf(out + 1, 24, "%lld", <long long>v)
    out[0] = <char>(0xA0 | k)
    return k + 1


cdef inline char *_put_be(char *o, int width, uint64_t n) noexcept:
    """n as a big-endian integer of width bytes; returns the end."""
    cdef int i
    for i in range(width):
        o[i] = <char>(n >> (8 * (width - 1 - i)))
    return o + width


cdef inline Py_ssize_t _sized(char *o, unsigned char marker, int width, uint64_t n) noexcept:
    """A msgpack marker byte, then n as a big-endian integer of width bytes; returns 1 + width."""
    o[0] = <char>marker
    _put_be(o + 1, width, n)
    return 1 + width


cdef inline Py_ssize_t _map_header(char *out, uint64_t n) noexcept:
    if n < 16:
        out[0] = <char>(0x80 | n)  # fixmap
        return 1
    return _sized(out, 0xDE, 2, n) if n < 0x10000 else _sized(out, 0xDF, 4, n)


cdef inline Py_ssize_t _check_entry(char *out, int64_t n) noexcept:
    """K_CHECK + msgpack of str(n)."""
    cdef Py_ssize_t kl = PyBytes_GET_SIZE(K_CHECK)
    memcpy(out, PyBytes_AS_STRING(K_CHECK), kl)
    return kl + _str_digits(out + kl, n)


cdef object _join3(const char *a, Py_ssize_t an, const unsigned char *b, Py_ssize_t bn, const char *c, Py_ssize_t cn):
    out = PyBytes_FromStringAndSize(NULL, an + bn + cn)
    cdef char *o = PyBytes_AS_STRING(out)
    memcpy(o, a, an)
    memcpy(o + an, b, bn)
    memcpy(o + an + bn, c, cn)
    return out


def patch_properties(object raw, object cl_offset_, object origin_, object checks_now_, object checks_new_):
    """checkcopy.patch_properties: the check copy's packed properties, or None for the dict path."""
    cdef Py_buffer view
    cdef const unsigned char *b
    cdef Py_ssize_t n, cut, start, hl, nl, ol
    cdef int64_t cl_offset, origin, checks_now, checks_new
    cdef uint64_t entries
    cdef char now[96]
    cdef char tail[192]
    cdef char head[5]
    if not configured:
        raise RuntimeError("txmq.broker._speedups.configure() was not called")
    try:
        cl_offset, origin, checks_now, checks_new = cl_offset_, origin_, checks_now_, checks_new_
    except OverflowError:  # not an int64: the dict path (its result is what the Python version would give)
        return None
    PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE)
    try:
        b = <const unsigned char *>view.buf
        n = view.len
        if _find(b, n, K_TAGS):
            return None
        if checks_now > 0:
            nl = _check_entry(now, checks_now)
            cut = n - nl
            if _endswith(b, n, now, nl):
                ol = PyBytes_GET_SIZE(K_ORIGIN)
                memcpy(tail, PyBytes_AS_STRING(K_ORIGIN), ol)
                ol += _str_digits(tail + ol, origin)
                if _endswith(b, cut, tail, ol):
                    nl = _check_entry(now, checks_new)
                    if 0x80 <= b[0] <= 0x8F:
                        return _join3(NULL, 0, b, cut, now, nl)
                    if not _parse_map(b, n, &entries, &start):
                        return None
                    hl = _map_header(head, entries)
                    return _join3(head, hl, b + start, cut - start if cut > start else 0, now, nl)
        if not _parse_map(b, n, &entries, &start):
            return None
        for k in FIRST_COPY_SLOW:
            if _find(b, n, <bytes>k):
                return None
        if entries + 2 > 0xFFFFFFFF:
            return None
        hl = _map_header(head, entries + 2)
        ol = PyBytes_GET_SIZE(K_ORIGIN)
        memcpy(tail, PyBytes_AS_STRING(K_ORIGIN), ol)
        ol += _str_digits(tail + ol, cl_offset)
        ol += _check_entry(tail + ol, checks_new)
        return _join3(head, hl, b + start, n - start, tail, ol)
    finally:
        PyBuffer_Release(&view)


cdef inline bint _parse_map(const unsigned char *b, Py_ssize_t n, uint64_t *entries, Py_ssize_t *start) noexcept:
    if n < 1:
        return False
    if 0x80 <= b[0] <= 0x8F:
        entries[0] = b[0] & 0x0F
        start[0] = 1
        return True
    if b[0] == 0xDE and n >= 3:
        entries[0] = (<uint64_t>b[1] << 8) | b[2]
        start[0] = 3
        return True
    if b[0] == 0xDF and n >= 5:
        entries[0] = (<uint64_t>b[1] << 24) | (<uint64_t>b[2] << 16) | (<uint64_t>b[3] << 8) | b[4]
        start[0] = 5
        return True
    return False


cdef inline char *_put_bytes(char *o, bytes s) noexcept:
    cdef Py_ssize_t n = PyBytes_GET_SIZE(s)
    memcpy(o, PyBytes_AS_STRING(s), n)
    return o + n


cdef inline Py_ssize_t _str_header(char *o, Py_ssize_t n) noexcept:
    if n < 32:
        o[0] = <char>(0xA0 | n)  # fixstr
        return 1
    if n < 0x100:
        return _sized(o, 0xD9, 1, n)
    return _sized(o, 0xDA, 2, n) if n < 0x10000 else _sized(o, 0xDB, 4, n)


cdef inline Py_ssize_t _bin_header(char *o, Py_ssize_t n) noexcept:
    if n < 0x100:
        return _sized(o, 0xC4, 1, n)
    return _sized(o, 0xC5, 2, n) if n < 0x10000 else _sized(o, 0xC6, 4, n)


def check_push(bytes group_packed not None, str tx_id not None, int64_t cl, int64_t qoff, int64_t size, int64_t born, int64_t store_ts,
               int64_t prep, object props_raw, object body):
    """checkcopy.check_push: the whole check_transaction push frame, length prefix included."""
    cdef Py_buffer pv, bv
    cdef Py_ssize_t txn, payload, i
    cdef const char *txs
    cdef char txh[5]
    cdef char bh[5]
    cdef Py_ssize_t txhl, bhl
    cdef int64_t vals[9]
    cdef char *o
    if not configured:
        raise RuntimeError("txmq.broker._speedups.configure() was not called")
    txs = PyUnicode_AsUTF8AndSize(tx_id, &txn)
    if txn > 0xFFFFFFFF:
        raise ValueError("tx_id too long")
    txhl = _str_header(txh, txn)
    vals[0] = cl; vals[1] = qoff; vals[2] = 0; vals[3] = qoff; vals[4] = cl
    vals[5] = size; vals[6] = born; vals[7] = store_ts; vals[8] = prep
    PyObject_GetBuffer(props_raw, &pv, PyBUF_SIMPLE)
    try:
        PyObject_GetBuffer(body, &bv, PyBUF_SIMPLE)
        try:
            if bv.len > 0xFFFFFFFF:
                raise ValueError("body too long")
            bhl = _bin_header(bh, bv.len)
            payload = (PyBytes_GET_SIZE(PREFIX) + PyBytes_GET_SIZE(group_packed) + PyBytes_GET_SIZE(K_TX_ID) + 2 * (txhl + txn)
                       + PyBytes_GET_SIZE(CONST_TAIL) + PyBytes_GET_SIZE(K_PROPS) + pv.len + PyBytes_GET_SIZE(K_BODY) + bhl + bv.len)
            for i in range(9):
                payload += PyBytes_GET_SIZE(<bytes>INT_KEYS[i]) + (1 if i == MSG_INDEX else 9)
            if payload > 0xFFFFFFFF:
                raise ValueError("frame too long")
            out = PyBytes_FromStringAndSize(NULL, 4 + payload)
            o = PyBytes_AS_STRING(out)
            o = _put_be(o, 4, payload)  # the frame's length prefix
            o = _put_bytes(o, PREFIX)
            o = _put_bytes(o, group_packed)
            o = _put_bytes(o, K_TX_ID)
            memcpy(o, txh, txhl); o += txhl
            memcpy(o, txs, txn); o += txn
            for i in range(9):
                o = _put_bytes(o, <bytes>INT_KEYS[i])
                if i == MSG_INDEX:
                    o[0] = <char>0x8C  # the message: a map of 12
                    o += 1
                else:
                    o[0] = <char>0xD3  # int64
                    o = _put_be(o + 1, 8, <uint64_t>vals[i])
            o = _put_bytes(o, CONST_TAIL)
            memcpy(o, txh, txhl); o += txhl
            memcpy(o, txs, txn); o += txn
            o = _put_bytes(o, K_PROPS)
            memcpy(o, pv.buf, pv.len); o += pv.len
            o = _put_bytes(o, K_BODY)
            memcpy(o, bh, bhl); o += bhl
            memcpy(o, bv.buf, bv.len)
            return out
        finally:
            PyBuffer_Release(&bv)
    finally:
        PyBuffer_Release(&pv)
