"""Records -> `messages` Arrow batches in compiled code (``spark/_columns.pyx``), with the Python path as fallback.

``columns`` is the compiled module, or None (not built, or
``TXMQ_PURE_PYTHON`` set): callers then use ``rows.records_to_batch``.
Both give the same rows (tests/test_spark_fastrows.py). Used by the
data-directory reader (segment bytes) and by the broker mode's raw pulls
(records as stored, back to back).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from .rows import _int

try:
    from txmq.store.codec import optional_speedups
except ImportError:  # pragma: no cover
    optional_speedups = None  # type: ignore[assignment]


def _load():
    if os.environ.get("TXMQ_PURE_PYTHON"):
        return None
    try:
        from . import _columns
    except ImportError:
        return None
    return _columns


columns = _load()
STOP_LIMIT, STOP_MORE, STOP_INVALID, STOP_FULL = 0, 1, 2, 3
CHUNK = 8 << 20
MAX_RECORD = 256 << 20  # far above --max-body and --max-properties together


def _slow_int(raw: bytes) -> int | None:
    """rows._int for the values the compiled parser leaves to Python (signs, spaces, underscores, odd digits)."""
    try:
        return _int(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None


def to_batch(n: int, b: dict, arrow_schema):
    """The RecordBatch of walk()'s buffers, in the `messages` schema."""
    import pyarrow as pa

    buf = pa.py_buffer
    t = arrow_schema.types

    def fixed(typ, data, valid=None):
        return pa.Array.from_buffers(typ, n, [buf(valid) if valid is not None else None, buf(data)])

    def string(col, rows=n):
        off, data, valid = b[col]
        return pa.Array.from_buffers(pa.string(), rows, [buf(valid) if valid is not None else None, buf(off), buf(data)])

    entries = len(b["map_keys"][0]) // 4 - 1
    ms = pa.timestamp("ms", tz="UTC")
    arrays = [
        fixed(pa.int64(), b["commit_log_offset"]),
        fixed(pa.int32(), b["size"]),
        string("topic"),
        fixed(pa.int32(), b["queue_id"]),
        fixed(pa.int64(), b["queue_offset"]),
        string("kind"),
        string("producer_group"),
        string("tx_id"),
        string("real_topic"),
        fixed(pa.int32(), *b["real_qid"]),
        string("tags"),
        string("keys"),
        pa.MapArray.from_arrays(pa.Array.from_buffers(pa.int32(), n + 1, [None, buf(b["map_offsets"])]),
                                string("map_keys", rows=entries), string("map_values", rows=entries), type=t[12]),
        pa.Array.from_buffers(pa.binary(), n, [None, buf(b["body"][0]), buf(b["body"][1])]),
        fixed(ms, b["born"]).cast(t[14]),
        fixed(ms, b["store"]).cast(t[15]),
        fixed(pa.int32(), *b["check"]),
        fixed(pa.int64(), *b["prepared"]),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=arrow_schema)


def arrow_filter(topics: frozenset[str] | None, since: int | None, until: int | None,
                 kinds: frozenset[str] | None) -> Callable | None:
    """rows.record_filter as a vectorised filter of `messages` batches, or None when there are none."""
    if topics is None and since is None and until is None and kinds is None:
        return None
    import pyarrow as pa
    import pyarrow.compute as pc

    def apply(batch):
        mask = None

        def both(m):
            return m if mask is None else pc.and_(mask, m)

        ts_type = batch.schema.field("stored_at").type
        if since is not None:
            mask = both(pc.greater_equal(batch.column("stored_at"), pa.scalar(since, pa.timestamp("ms", tz="UTC")).cast(ts_type)))
        if until is not None:
            mask = both(pc.less(batch.column("stored_at"), pa.scalar(until, pa.timestamp("ms", tz="UTC")).cast(ts_type)))
        if topics is not None:
            vs = pa.array(sorted(topics), pa.string())
            m = pc.or_(pc.is_in(batch.column("topic"), value_set=vs),
                       pc.fill_null(pc.is_in(batch.column("real_topic"), value_set=vs), False))
            mask = both(m)
        if kinds is not None:
            mask = both(pc.is_in(batch.column("kind"), value_set=pa.array(sorted(kinds), pa.string())))
        return batch.filter(mask)

    return apply


def record_at(path: str, segment_start: int, pos: int) -> bool:
    """Whether a whole valid record (magic, CRC, its own offset) starts at commit-log offset pos of this segment."""
    from txmq.store.codec import HEADER_SIZE, valid_header

    try:
        with open(path, "rb", buffering=0) as f:
            head = os.pread(f.fileno(), HEADER_SIZE, pos - segment_start)
            if len(head) < HEADER_SIZE:
                return False
            data = os.pread(f.fileno(), int.from_bytes(head[:4], "little"), pos - segment_start)
    except OSError:
        return False
    return valid_header(data, 0, pos, None) is not None


def walk_segment(path: str, segment_start: int, pos: int, end: int, batch_rows: int, batch_bytes: int,
                 arrow_schema) -> Iterator[tuple[object | None, int, bool]]:
    """(batch or None, next offset, done) over the records of one segment file from the record at pos, up to end.

    done False with a None batch: the record at the returned offset is not
    valid here (damaged, torn, the log cut back): the caller's Python path
    reads on from there.
    """
    assert columns is not None
    fd = os.open(path, os.O_RDONLY)
    try:
        need = 0  # bytes of a record larger than the next read would be
        while pos < end:
            want = max(min(CHUNK, end - pos), need)
            data = os.pread(fd, want, pos - segment_start)
            n, nxt, stop, bufs = columns.walk(data, 0, end - pos, pos, True, batch_rows, batch_bytes, _slow_int)
            if n:
                yield to_batch(n, bufs, arrow_schema), pos + nxt, False
            pos += nxt
            need = 0
            if stop == STOP_LIMIT:
                break
            if stop == STOP_MORE and nxt == 0:
                if len(data) < want:  # the file ends inside this record: torn, or cut back meanwhile
                    yield None, pos, False
                    return
                need = int.from_bytes(data[:4], "little")  # the record goes past this read: read it whole
                if need > MAX_RECORD:  # not a size a stored record has: the Python path says what it is
                    yield None, pos, False
                    return
                continue
            if stop in (STOP_FULL, STOP_MORE):
                continue
            yield None, pos, False  # STOP_INVALID
            return
        yield None, pos, True
    finally:
        os.close(fd)


def raw_batches(raw, arrow_schema, batch_rows: int, batch_bytes: int):
    """Batches of records stored back to back in raw (a raw pull's reply); raises ValueError on an invalid one."""
    assert columns is not None
    pos = 0
    while pos < len(raw):
        n, nxt, stop, bufs = columns.walk(raw, pos, len(raw), 0, False, batch_rows, batch_bytes, _slow_int)
        if n:
            yield to_batch(n, bufs, arrow_schema)
        pos = nxt
        if stop in (STOP_INVALID, STOP_MORE) and pos < len(raw):
            raise ValueError(f"record {pos} bytes into a raw pull reply is not valid")
        if stop == STOP_LIMIT:
            break
