# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Commit-log records straight into the `messages` table's Arrow buffers, in one C loop.

Optional, like the store's speed-ups: ``txmq.spark.fastrows`` uses it when
built and the pure-Python path (decode to Records, then
``rows.records_to_batch``) otherwise; tests/test_spark_fastrows.py holds
the two equal. The record layout is ``store/codec.py``'s; the column rules
are ``spark/rows.py``'s (this file only computes them faster).

``walk(buf, pos, limit, base, check_offsets, max_rows, max_bytes, slow_int)``
reads back-to-back records of ``buf`` from ``pos``: each must be whole, have
the magic, a good CRC and (with ``check_offsets``) the commit-log offset
``base + its position``. It stops at the first record starting at or after
``limit``, at ``max_rows`` rows or ``max_bytes`` of bodies, at a record that
is cut by the end of ``buf``, or at one that is not valid (or whose
properties are not a plain msgpack map of strings): the caller's Python
path takes over there. Returns (rows, next position, why it stopped,
buffers).
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcmp, memcpy, memset

import sys

if sys.byteorder != "little":
    raise ImportError("txmq.spark._columns assumes a little-endian machine")


cdef extern from "zlib.h":
    unsigned long crc32(unsigned long crc, const unsigned char *buf, unsigned int length) nogil

cdef enum:
    HEADER_SIZE = 68
    MAGIC = 0x314D5854
    N_TX = 4

# why walk stopped
STOP_LIMIT = 0  # the next record starts at or after limit (or buf ends exactly there)
STOP_MORE = 1  # the next record is cut by the end of buf: read on from next position
STOP_INVALID = 2  # the next record is not valid here: the Python path decides
STOP_FULL = 3  # max_rows or max_bytes reached

cdef int64_t TS_LO = -62135596800000
cdef int64_t TS_HI = 253402300800000

cdef struct Buf:
    char *p
    size_t len
    size_t cap

cdef int _grow(Buf *b, size_t need) except -1:
    cdef size_t cap
    cdef char *q
    if b.len + need <= b.cap:
        return 0
    cap = b.cap * 2 if b.cap else 4096
    while cap < b.len + need:
        cap *= 2
    q = <char *>realloc(b.p, cap)
    if q == NULL:
        raise MemoryError()
    b.p = q
    b.cap = cap
    return 0

cdef inline int _put(Buf *b, const void *src, size_t n) except -1:
    _grow(b, n)
    memcpy(b.p + b.len, src, n)
    b.len += n
    return 0

cdef inline int _i32(Buf *b, int32_t v) except -1:
    return _put(b, &v, 4)

cdef inline int _i64(Buf *b, int64_t v) except -1:
    return _put(b, &v, 8)

cdef inline int _bit(Buf *b, Py_ssize_t i, bint v) except -1:
    if <size_t>(i // 8) >= b.len:
        _grow(b, 1)
        b.p[b.len] = 0
        b.len += 1
    if v:
        b.p[i // 8] |= <char>(1 << (i % 8))
    return 0

cdef inline uint32_t _u32(const unsigned char *p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v

cdef inline int64_t _r64(const unsigned char *p) noexcept nogil:
    cdef int64_t v
    memcpy(&v, p, 8)
    return v

cdef struct Str:  # a string column: offsets (int32, n + 1), data, validity
    Buf off
    Buf data
    Buf valid

cdef int _str(Str *s, Py_ssize_t row, const unsigned char *p, Py_ssize_t n) except -1:
    """Append a value (p NULL: null) as row `row`."""
    cdef int32_t end
    if p != NULL:
        _put(&s.data, p, n)
    end = <int32_t>s.data.len
    _i32(&s.off, end)
    _bit(&s.valid, row, p != NULL)
    return 0

cdef object _bytes(Buf *b):
    if b.p == NULL:
        return b""
    return PyBytes_FromStringAndSize(b.p, b.len)

cdef inline Py_ssize_t _mp_str(const unsigned char *p, Py_ssize_t avail, const unsigned char **out,
                               Py_ssize_t *n) noexcept nogil:
    """A msgpack str at p: the bytes it takes (its data at *out, *n long), or -1 when it is not a str within avail."""
    cdef unsigned char c
    cdef Py_ssize_t h
    if avail < 1:
        return -1
    c = p[0]
    if 0xa0 <= c <= 0xbf:
        n[0], h = c & 0x1f, 1
    elif c == 0xd9 and avail >= 2:
        n[0], h = p[1], 2
    elif c == 0xda and avail >= 3:
        n[0], h = (p[1] << 8) | p[2], 3
    elif c == 0xdb and avail >= 5:
        n[0], h = (<Py_ssize_t>p[1] << 24) | (p[2] << 16) | (p[3] << 8) | p[4], 5
    else:
        return -1
    if h + n[0] > avail:
        return -1
    out[0] = p + h
    return h + n[0]


cdef int _sv(Str *s, const unsigned char *p, Py_ssize_t n) except -1:
    """Append a value to a string column that has no nulls."""
    cdef int32_t end
    _put(&s.data, p, n)
    end = <int32_t>s.data.len
    _i32(&s.off, end)
    return 0


cdef inline bint _eq(const unsigned char *p, Py_ssize_t n, const char *lit, Py_ssize_t ln) noexcept nogil:
    return n == ln and memcmp(p, lit, ln) == 0

cdef object _int(const unsigned char *p, Py_ssize_t n, object slow_int):
    """An int32 column's value from a property (None when absent / not a number / out of range), as rows._int."""
    cdef int64_t v = 0
    cdef Py_ssize_t i = 0
    cdef bint neg = False
    if p == NULL:
        return None
    if n > 0 and (p[0] == 45 or p[0] == 43):  # - +
        neg = p[0] == 45
        i = 1
    if n - i < 1 or n - i > 10:
        return slow_int(PyBytes_FromStringAndSize(<const char *>p, n))
    while i < n:
        if not (48 <= p[i] <= 57):
            return slow_int(PyBytes_FromStringAndSize(<const char *>p, n))
        v = v * 10 + (p[i] - 48)
        i += 1
    if neg:
        v = -v
    if v < -2147483648 or v > 2147483647:
        return None
    return v


def walk(object buf, Py_ssize_t pos, Py_ssize_t limit, int64_t base, bint check_offsets, Py_ssize_t max_rows,
         Py_ssize_t max_bytes, object slow_int):
    cdef Py_buffer view
    cdef const unsigned char *b
    cdef const unsigned char *p
    cdef const unsigned char *q
    cdef const unsigned char *end
    cdef const unsigned char *k
    cdef const unsigned char *v
    cdef const unsigned char *pg
    cdef const unsigned char *uk
    cdef const unsigned char *rt
    cdef const unsigned char *rq
    cdef const unsigned char *tg
    cdef const unsigned char *ky
    cdef const unsigned char *ct
    cdef Py_ssize_t pgn = 0, ukn = 0, rtn = 0, rqn = 0, tgn = 0, kyn = 0, ctn = 0
    cdef Py_ssize_t n = 0, avail, kl = 0, vl = 0, entries, j, body_bytes = 0, used
    cdef bint bad
    cdef uint32_t total, plen, blen
    cdef uint16_t tlen
    cdef int32_t qid, mapend = 0, i32
    cdef int64_t off, born, prep
    cdef unsigned char tx, c
    cdef int kind  # 0 normal 1 half 2 commit 3 op 4 rollback-op 5 discard
    cdef int stop = STOP_LIMIT
    cdef Buf clo, size, qidb, qoff, bornb, store, prepb, prepv, body_off, body, map_off, rqid, rqidv, chk, chkv
    cdef Str topic, kinds, pgroup, txid, rtopic, tags, keys, mkeys, mvals
    cdef object iv
    memset(&clo, 0, sizeof(Buf)); memset(&size, 0, sizeof(Buf)); memset(&qidb, 0, sizeof(Buf))
    memset(&qoff, 0, sizeof(Buf)); memset(&bornb, 0, sizeof(Buf)); memset(&store, 0, sizeof(Buf))
    memset(&prepb, 0, sizeof(Buf)); memset(&prepv, 0, sizeof(Buf)); memset(&body_off, 0, sizeof(Buf))
    memset(&body, 0, sizeof(Buf)); memset(&map_off, 0, sizeof(Buf)); memset(&rqid, 0, sizeof(Buf))
    memset(&rqidv, 0, sizeof(Buf)); memset(&chk, 0, sizeof(Buf)); memset(&chkv, 0, sizeof(Buf))
    memset(&topic, 0, sizeof(Str)); memset(&kinds, 0, sizeof(Str)); memset(&pgroup, 0, sizeof(Str))
    memset(&txid, 0, sizeof(Str)); memset(&rtopic, 0, sizeof(Str)); memset(&tags, 0, sizeof(Str))
    memset(&keys, 0, sizeof(Str)); memset(&mkeys, 0, sizeof(Str)); memset(&mvals, 0, sizeof(Str))
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        b = <const unsigned char *>view.buf
        _i32(&body_off, 0); _i32(&map_off, 0)
        _i32(&topic.off, 0); _i32(&kinds.off, 0); _i32(&pgroup.off, 0); _i32(&txid.off, 0); _i32(&rtopic.off, 0)
        _i32(&tags.off, 0); _i32(&keys.off, 0); _i32(&mkeys.off, 0); _i32(&mvals.off, 0)
        while True:
            if pos >= limit:
                stop = STOP_LIMIT
                break
            if n >= max_rows or body_bytes >= max_bytes:
                stop = STOP_FULL
                break
            avail = view.len - pos
            if avail < HEADER_SIZE:
                stop = STOP_MORE if avail > 0 or limit > pos else STOP_LIMIT
                break
            p = b + pos
            total = _u32(p)
            if _u32(p + 4) != MAGIC or total < HEADER_SIZE:
                stop = STOP_INVALID
                break
            if <Py_ssize_t>total > avail:
                stop = STOP_MORE
                break
            off = _r64(p + 12)
            tx = p[20]
            memcpy(&tlen, p + 22, 2)
            memcpy(&qid, p + 24, 4)
            plen = _u32(p + 60)
            blen = _u32(p + 64)
            if ((check_offsets and off != base + pos) or tx >= N_TX
                    or <uint64_t>total != <uint64_t>HEADER_SIZE + tlen + plen + blen
                    or crc32(0, p + 12, total - 12) != _u32(p + 8)):
                stop = STOP_INVALID
                break
            # the properties: a msgpack map of str -> str, or the Python path decides
            q = p + HEADER_SIZE + tlen
            end = q + plen
            if plen < 1:
                stop = STOP_INVALID
                break
            c = q[0]
            if 0x80 <= c <= 0x8f:
                entries, q = c & 0x0f, q + 1
            elif c == 0xde and plen >= 3:
                entries, q = (q[1] << 8) | q[2], q + 3
            elif c == 0xdf and plen >= 5:
                entries, q = (<Py_ssize_t>q[1] << 24) | (q[2] << 16) | (q[3] << 8) | q[4], q + 5
            else:
                stop = STOP_INVALID
                break
            # check the whole map before writing anything of this record
            k = q
            bad = False
            for j in range(entries):
                used = _mp_str(k, end - k, &v, &vl)
                if used < 0:
                    bad = True
                    break
                k += used
                used = _mp_str(k, end - k, &v, &vl)
                if used < 0:
                    bad = True
                    break
                k += used
            if bad or k != end:
                stop = STOP_INVALID
                break
            pg = uk = rt = rq = tg = ky = ct = NULL
            for j in range(entries):
                q += _mp_str(q, end - q, &k, &kl)
                q += _mp_str(q, end - q, &v, &vl)
                _sv(&mkeys, k, kl)
                _sv(&mvals, v, vl)
                if _eq(k, kl, "PGROUP", 6):
                    pg, pgn = v, vl
                elif _eq(k, kl, "UNIQ_KEY", 8):
                    uk, ukn = v, vl
                elif _eq(k, kl, "REAL_TOPIC", 10):
                    rt, rtn = v, vl
                elif _eq(k, kl, "REAL_QID", 8):
                    rq, rqn = v, vl
                elif _eq(k, kl, "TAGS", 4):
                    tg, tgn = v, vl
                elif _eq(k, kl, "KEYS", 4):
                    ky, kyn = v, vl
                elif _eq(k, kl, "TRANSACTION_CHECK_TIMES", 23):
                    ct, ctn = v, vl
            mapend += <int32_t>entries
            _i32(&map_off, mapend)
            # kind, from the topic and tx_type (schema.record_kind)
            q = p + HEADER_SIZE
            if _eq(q, tlen, "RMQ_SYS_TRANS_HALF_TOPIC", 24):
                kind = 1
            elif _eq(q, tlen, "TRANS_CHECK_MAX_TIME_TOPIC", 26) or _eq(q, tlen, "TRANS_CHECK_MAXTIME_TOPIC", 25):
                kind = 5
            elif _eq(q, tlen, "RMQ_SYS_TRANS_OP_HALF_TOPIC", 27):
                kind = 4 if tx == 3 else 3
            else:
                kind = 2 if tx == 2 else 0
            _i64(&clo, off)
            _i32(&size, <int32_t>total)
            _str(&topic, n, q, tlen)
            _i32(&qidb, qid)
            _i64(&qoff, _r64(p + 28))
            if kind == 0:
                _str(&kinds, n, <const unsigned char *>"normal", 6)
            elif kind == 1:
                _str(&kinds, n, <const unsigned char *>"half", 4)
            elif kind == 2:
                _str(&kinds, n, <const unsigned char *>"commit", 6)
            elif kind == 3:
                _str(&kinds, n, <const unsigned char *>"op", 2)
            elif kind == 4:
                _str(&kinds, n, <const unsigned char *>"rollback-op", 11)
            else:
                _str(&kinds, n, <const unsigned char *>"discard", 7)
            _str(&pgroup, n, pg, pgn)
            _str(&txid, n, uk if (kind != 0 and uk != NULL and ukn > 0) else NULL, ukn)
            _str(&rtopic, n, rt, rtn)
            iv = _int(rq, rqn, slow_int)
            _i32(&rqid, 0 if iv is None else <int32_t>iv)
            _bit(&rqidv, n, iv is not None)
            _str(&tags, n, tg, tgn)
            _str(&keys, n, ky, kyn)
            q = p + HEADER_SIZE + tlen + plen
            _put(&body, q, blen)
            body_bytes += blen
            _i32(&body_off, <int32_t>body.len)
            born = _r64(p + 36)
            _i64(&bornb, TS_LO if born < TS_LO else (TS_HI - 1 if born >= TS_HI else born))
            _i64(&store, _r64(p + 44))
            iv = _int(ct, ctn, slow_int)
            if iv is None and (kind == 1 or kind == 5):
                iv = 0
            _i32(&chk, 0 if iv is None else <int32_t>iv)
            _bit(&chkv, n, iv is not None)
            prep = _r64(p + 52)
            _i64(&prepb, prep if prep >= 0 else 0)
            _bit(&prepv, n, prep >= 0)
            n += 1
            pos += total
        return (n, pos, stop, {
            "commit_log_offset": _bytes(&clo), "size": _bytes(&size), "queue_id": _bytes(&qidb),
            "queue_offset": _bytes(&qoff), "born": _bytes(&bornb), "store": _bytes(&store),
            "prepared": (_bytes(&prepb), _bytes(&prepv)), "real_qid": (_bytes(&rqid), _bytes(&rqidv)),
            "check": (_bytes(&chk), _bytes(&chkv)), "body": (_bytes(&body_off), _bytes(&body)),
            "map_offsets": _bytes(&map_off),
            "topic": (_bytes(&topic.off), _bytes(&topic.data), None),
            "kind": (_bytes(&kinds.off), _bytes(&kinds.data), None),
            "producer_group": (_bytes(&pgroup.off), _bytes(&pgroup.data), _bytes(&pgroup.valid)),
            "tx_id": (_bytes(&txid.off), _bytes(&txid.data), _bytes(&txid.valid)),
            "real_topic": (_bytes(&rtopic.off), _bytes(&rtopic.data), _bytes(&rtopic.valid)),
            "tags": (_bytes(&tags.off), _bytes(&tags.data), _bytes(&tags.valid)),
            "keys": (_bytes(&keys.off), _bytes(&keys.data), _bytes(&keys.valid)),
            "map_keys": (_bytes(&mkeys.off), _bytes(&mkeys.data), None),
            "map_values": (_bytes(&mvals.off), _bytes(&mvals.data), None),
        })
    finally:
        PyBuffer_Release(&view)
        free(clo.p); free(size.p); free(qidb.p); free(qoff.p); free(bornb.p); free(store.p); free(prepb.p); free(prepv.p)
        free(body_off.p); free(body.p); free(map_off.p); free(rqid.p); free(rqidv.p); free(chk.p); free(chkv.p)
        free(topic.off.p); free(topic.data.p); free(topic.valid.p); free(kinds.off.p); free(kinds.data.p)
        free(kinds.valid.p); free(pgroup.off.p); free(pgroup.data.p); free(pgroup.valid.p); free(txid.off.p)
        free(txid.data.p); free(txid.valid.p); free(rtopic.off.p); free(rtopic.data.p); free(rtopic.valid.p)
        free(tags.off.p); free(tags.data.p); free(tags.valid.p); free(keys.off.p); free(keys.data.p); free(keys.valid.p)
        free(mkeys.off.p); free(mkeys.data.p); free(mkeys.valid.p); free(mvals.off.p); free(mvals.data.p)
        free(mvals.valid.p)
