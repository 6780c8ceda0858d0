# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled versions of the record codec's two per-record hot paths.

Optional: ``txmq.store.codec`` uses these when the extension was built
(``pip install`` compiles it with Cython when a C compiler and zlib's header
are present) and its own Python code otherwise, or when ``TXMQ_PURE_PYTHON``
is set. Both give the same bytes and the same answers for every input the store
passes (bytes, int64 fields, a body_start inside the body):
``tests/test_speedups.py`` holds them equal with hypothesis. The record
layout is documented in ``codec.py`` and ``docs/store-format.md``; nothing
here decides it, it only writes and checks it faster.

Why native code at all: a check pass appends a copy of every pending half
message and first validates the record it copies. In Python each of those is
some 30 bytecode-level operations (struct pack/unpack, four CRC calls,
slices, a join); here each is one call. Multi-byte fields are little-endian
on disk; the module refuses to load on a big-endian machine.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

import sys

if sys.byteorder != "little":
    raise ImportError("txmq.store._speedups assumes a little-endian machine")


cdef extern from "zlib.h":
    unsigned long crc32(unsigned long crc, const unsigned char *buf, unsigned int len) nogil


cdef enum:
    HEADER_SIZE = 68
    MAGIC = 0x314D5854


cdef inline uint32_t _u32(const unsigned char *p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v


cdef inline int64_t _i64(const unsigned char *p) noexcept nogil:
    cdef int64_t v
    memcpy(&v, p, 8)
    return v


cdef inline void _put32(unsigned char *p, uint32_t v) noexcept nogil:
    memcpy(p, &v, 4)


cdef inline void _put64(unsigned char *p, int64_t v) noexcept nogil:
    memcpy(p, &v, 8)


cdef int N_TX = 0  # the number of TxType values (configure)


def configure(int n_tx):
    global N_TX
    N_TX = n_tx


def valid_header(object buf, Py_ssize_t pos, int64_t expected_offset, object mv):
    """codec.valid_header: the 14 header fields if buf[pos:] holds a valid record (CRC included), else None."""
    cdef Py_buffer view
    cdef const unsigned char *p
    cdef uint32_t total, magic, crc, plen, blen
    cdef uint16_t tlen
    cdef int32_t qid
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        if pos < 0 or view.len - pos < HEADER_SIZE:
            return None
        p = <const unsigned char *>view.buf + pos
        total = _u32(p)
        magic = _u32(p + 4)
        crc = _u32(p + 8)
        memcpy(&tlen, p + 22, 2)
        memcpy(&qid, p + 24, 4)
        plen = _u32(p + 60)
        blen = _u32(p + 64)
        if (magic != MAGIC or _i64(p + 12) != expected_offset or p[20] >= N_TX
                or <uint64_t>total != <uint64_t>HEADER_SIZE + tlen + plen + blen or view.len - pos < <Py_ssize_t>total):
            return None
        if crc32(0, p + 12, total - 12) != crc:
            return None
        return (total, magic, crc, _i64(p + 12), p[20], p[21], tlen, qid, _i64(p + 28), _i64(p + 36), _i64(p + 44),
                _i64(p + 52), plen, blen)
    finally:
        PyBuffer_Release(&view)


def encode_raw(int64_t pos, unsigned char tx_type, bytes tb not None, int32_t qid, int64_t q, int64_t born, int64_t store_ts,
                  int64_t prep, bytes pb not None, object body, Py_ssize_t body_start):
    """codec.encode_raw: one whole record (header, topic, properties, body[body_start:]) as bytes."""
    cdef Py_buffer bv
    cdef Py_ssize_t plen = len(pb), blen, total
    cdef uint16_t tlen
    if len(tb) > 0xFFFF:
        raise ValueError("topic too long to encode")
    tlen = <uint16_t>len(tb)
    cdef unsigned char *o
    PyObject_GetBuffer(body, &bv, PyBUF_SIMPLE)
    try:
        if body_start < 0 or body_start > bv.len:
            raise ValueError("body_start outside the body")
        blen = bv.len - body_start
        total = HEADER_SIZE + tlen + plen + blen
        if total > 0xFFFFFFFF:
            raise ValueError("record too large to encode")
        out = PyBytes_FromStringAndSize(NULL, total)
        o = <unsigned char *>PyBytes_AS_STRING(out)
        _put64(o + 12, pos)
        o[20] = tx_type
        o[21] = 0
        memcpy(o + 22, &tlen, 2)
        memcpy(o + 24, &qid, 4)
        _put64(o + 28, q)
        _put64(o + 36, born)
        _put64(o + 44, store_ts)
        _put64(o + 52, prep)
        _put32(o + 60, <uint32_t>plen)
        _put32(o + 64, <uint32_t>blen)
        memcpy(o + HEADER_SIZE, PyBytes_AS_STRING(tb), tlen)
        memcpy(o + HEADER_SIZE + tlen, PyBytes_AS_STRING(pb), plen)
        memcpy(o + HEADER_SIZE + tlen + plen, <const unsigned char *>bv.buf + body_start, blen)
        _put32(o, <uint32_t>total)
        _put32(o + 4, MAGIC)
        _put32(o + 8, <uint32_t>crc32(0, o + 12, <unsigned int>(total - 12)))
        return out
    finally:
        PyBuffer_Release(&bv)
