# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled versions of the store's per-record hot paths.

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
slices, a join); here each is one call. A raw pull (``read_queue_raw``: the
records of a consume-queue range as stored, for Spark's executors) is one call
per pull, with no Python object per record. Multi-byte fields are
little-endian on disk; the module refuses to load on a big-endian machine.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy

import sys

if sys.byteorder != "little":
    raise ImportError("txmq.store._speedups assumes a little-endian machine")


cdef extern from "unistd.h" nogil:
    ssize_t pread(int fd, void *buf, size_t count, long offset)


cdef extern from "errno.h":
    int errno
    enum: EINTR


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



cdef int _pread_all(int fd, unsigned char *buf, int64_t n, int64_t pos) noexcept nogil:
    """0 once n bytes at pos are in buf; -1 on an error or an end of file before them."""
    cdef ssize_t got
    while n > 0:
        got = pread(fd, buf, <size_t>n, <long>pos)
        if got < 0:
            if errno == EINTR:
                continue
            return -1
        if got == 0:
            return -1
        buf += got
        n -= got
        pos += got
    return 0


def read_queue_raw(bytes entries not None, int64_t max_bytes, int64_t max_record, list segments not None, int64_t readable_end,
                   bytes topic not None, int32_t queue_id, int64_t first_q, int64_t gap, int64_t span):
    """LogView.read_queue_raw's work in one call: (records back to back, count), or None when any is not plain.

    ``entries`` are consume-queue entries (codec-independent 20-byte
    ``<qIq`` rows) for queue offsets first_q, first_q + 1, ...;
    ``segments`` the log's (start, end, fd) rows in order. The leading
    entries whose sizes fit max_bytes (at least one; none larger than
    max_record, the largest record the store takes: an entry claiming more
    is garbage, never allocated for) are read with one pread
    per run of neighbouring records (holes up to gap read through, runs up to
    span; adjacent records land in the reply with no copy), then each record
    is checked as ``read_queue`` does: size, magic, lengths, its own offset,
    tx_type, CRC, and that it is this queue's record at that queue offset.
    """
    cdef Py_ssize_t n = len(entries) // 20, nseg = len(segments), i, j, k = 0, s = 0, si
    cdef const unsigned char *e = <const unsigned char *>PyBytes_AS_STRING(entries)
    cdef const unsigned char *tp = <const unsigned char *>PyBytes_AS_STRING(topic)
    cdef Py_ssize_t tlen = len(topic)
    cdef int64_t total = 0, off, size, run_start, run_end, o, sz, seg_lo, seg_hi, pos, limit
    cdef uint32_t rsize
    cdef uint16_t rtlen
    cdef int32_t rqid
    cdef bint adjacent, ok = True
    cdef unsigned char *out
    cdef unsigned char *p
    cdef unsigned char *scratch = NULL
    cdef int64_t scratch_len = 0
    cdef int fd
    if n == 0 or nseg == 0 or tlen > 0xFFFF:
        return None
    for i in range(n):  # the entries that fit max_bytes, as consumequeue.pick_entries picks them
        size = _u32(e + 20 * i + 8)
        if size > max_record:  # a garbage entry: the usual read reports it
            if k == 0:
                return None
            break
        if k and total + size > max_bytes:
            break
        total += size
        k += 1
    cdef int64_t *starts = <int64_t *>malloc(nseg * 3 * sizeof(int64_t))
    if starts == NULL:
        raise MemoryError()
    try:
        for i in range(nseg):
            row = segments[i]
            starts[3 * i] = row[0]
            starts[3 * i + 1] = row[1]
            starts[3 * i + 2] = row[2]
        out_obj = PyBytes_FromStringAndSize(NULL, total)
        out = <unsigned char *>PyBytes_AS_STRING(out_obj)
        with nogil:
            i = 0
            pos = 0
            while i < k:
                off = _i64(e + 20 * i)
                size = _u32(e + 20 * i + 8)
                if s >= nseg or not starts[3 * s] <= off < starts[3 * s + 1]:
                    s = 0  # entries go forwards: a new search only when a run crosses into another segment
                    while s < nseg and not (starts[3 * s] <= off < starts[3 * s + 1]):
                        s += 1
                    if s == nseg:
                        ok = False
                        break
                seg_lo = starts[3 * s]
                seg_hi = starts[3 * s + 1]
                fd = <int>starts[3 * s + 2]
                limit = seg_hi if seg_hi < readable_end else readable_end
                if size < HEADER_SIZE or off + size > limit:
                    ok = False
                    break
                run_start = off
                run_end = off + size
                adjacent = True
                j = i + 1
                while j < k:
                    o = _i64(e + 20 * j)
                    sz = _u32(e + 20 * j + 8)
                    if o < run_end or sz < HEADER_SIZE or o + sz > limit or o - run_end > gap or o + sz - run_start > span:
                        break
                    if o != run_end:
                        adjacent = False
                    run_end = o + sz
                    j += 1
                if adjacent:  # straight into the reply
                    if _pread_all(fd, out + pos, run_end - run_start, run_start - seg_lo) < 0:
                        ok = False
                        break
                    pos += run_end - run_start
                else:
                    if run_end - run_start > scratch_len:
                        free(scratch)
                        scratch_len = run_end - run_start
                        scratch = <unsigned char *>malloc(scratch_len)
                        if scratch == NULL:
                            scratch_len = 0
                            ok = False
                            break
                    if _pread_all(fd, scratch, run_end - run_start, run_start - seg_lo) < 0:
                        ok = False
                        break
                    for si in range(i, j):
                        o = _i64(e + 20 * si)
                        sz = _u32(e + 20 * si + 8)
                        memcpy(out + pos, scratch + (o - run_start), sz)
                        pos += sz
                i = j
            if ok:
                pos = 0
                for i in range(k):  # every record checked where it landed in the reply
                    p = out + pos
                    off = _i64(e + 20 * i)
                    size = _u32(e + 20 * i + 8)
                    rsize = _u32(p)
                    memcpy(&rtlen, p + 22, 2)
                    memcpy(&rqid, p + 24, 4)
                    if (rsize != size or _u32(p + 4) != MAGIC or _i64(p + 12) != off or p[20] >= N_TX
                            or <uint64_t>rsize != <uint64_t>HEADER_SIZE + rtlen + _u32(p + 60) + _u32(p + 64)
                            or rtlen != tlen or rqid != queue_id or _i64(p + 28) != first_q + i
                            or memcmp(p + HEADER_SIZE, tp, tlen) != 0
                            or crc32(0, p + 12, <unsigned int>(rsize - 12)) != _u32(p + 8)):
                        ok = False
                        break
                    pos += size
        if not ok:
            return None
        return out_obj, k
    finally:
        free(starts)
        free(scratch)
