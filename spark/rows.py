"""Records -> `messages` rows: kinds, filters, and Arrow record batches.

Runs on the executors, once per record, so the loops are C-level (map,
chain, accumulate) where they can be: building a batch costs about as much
as decoding its records. Imports pyarrow lazily and pyspark not at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate, chain, repeat
from operator import attrgetter, itemgetter

from txmq.constants import (
    DISCARD_TOPIC,
    DISCARD_TOPIC_ALIAS,
    HALF_TOPIC,
    OP_TOPIC,
    PROP_DECIDED_BY,
    PROP_DISCARD_REASON,
    PROP_HALF_CL_OFFSET,
    PROP_ORIGIN_CL_OFFSET,
    PROP_REPLAYED,
    PROP_CHECK_TIMES,
    PROP_KEYS,
    PROP_PGROUP,
    PROP_REAL_QID,
    PROP_REAL_TOPIC,
    PROP_TAGS,
    PROP_UNIQ_KEY,
)
from txmq.store import Record

from .schema import _TX_ROLLBACK, DISCARD, HALF, NORMAL, record_kind

BATCH_BYTES = 64 << 20  # a batch's record bytes, far below Arrow's 2 GiB binary limit
_INT32 = range(-(1 << 31), 1 << 31)
# Spark's timestamps run from year 1 to year 9999; born_ts is whatever a producer said
_TS_MS = range(-62_135_596_800_000, 253_402_300_800_000)


def _int(v: str | None) -> int | None:
    """An int32 column's value from a producer-set property: None when absent, not a number or out of range."""
    if v is None:
        return None
    try:
        n = int(v)
    except ValueError:
        return None
    return n if n in _INT32 else None


def _ts(ms: int) -> int:
    """A producer's born_ts as a Spark timestamp can hold it: clamped to years 1 to 9999 (the column is not null)."""
    return ms if ms in _TS_MS else min(max(ms, _TS_MS.start), _TS_MS.stop - 1)


def record_filter(
    topics: frozenset[str] | None, since: int | None, until: int | None, kinds: frozenset[str] | None
) -> Callable[[Record], bool] | None:
    """A predicate for the source's filters (store time in ms), or None when there are none."""
    if topics is None and since is None and until is None and kinds is None:
        return None

    def keep(rec: Record) -> bool:
        if since is not None and rec.store_ts < since:
            return False
        if until is not None and rec.store_ts >= until:
            return False
        if topics is not None and rec.topic not in topics and rec.properties.get(PROP_REAL_TOPIC) not in topics:
            return False
        return kinds is None or _kind(rec.topic, rec.tx_type) in kinds

    return keep


_KINDS_OF_TOPIC: dict[str, tuple[str, ...]] = {}


def _kinds_of(topic: str) -> tuple[str, ...]:
    """The kind of a record of this topic, indexed by tx_type."""
    k = _KINDS_OF_TOPIC.get(topic)
    if k is None:
        if len(_KINDS_OF_TOPIC) > 10_000:
            _KINDS_OF_TOPIC.clear()
        k = _KINDS_OF_TOPIC[topic] = tuple(record_kind(topic, t) for t in range(4))
    return k


def _kind(topic: str, tx_type: int) -> str:
    return _kinds_of(topic)[tx_type]


def _ints(values) -> list[int | None]:
    out: list[int | None] = []
    for v in values:
        out.append(None if v is None else _int(v))
    return out


def record_row(rec: Record) -> tuple:
    """One `messages` row as plain Python values (timestamps as ms since the epoch)."""
    p = rec.properties
    kind = _kind(rec.topic, rec.tx_type)
    check = _int(p.get(PROP_CHECK_TIMES))
    return (
        rec.commit_log_offset, rec.size, rec.topic, rec.queue_id, rec.queue_offset, kind,
        p.get(PROP_PGROUP), (p.get(PROP_UNIQ_KEY) or None) if kind != NORMAL else None,
        p.get(PROP_REAL_TOPIC), _int(p.get(PROP_REAL_QID)), p.get(PROP_TAGS), p.get(PROP_KEYS),
        p, rec.body, _ts(rec.born_ts), rec.store_ts, 0 if check is None and kind in (HALF, DISCARD) else check,
        rec.prepared_offset if rec.prepared_offset >= 0 else None,
    )  # fmt: skip


_get = {name: attrgetter(name) for name in Record.__slots__}  # type: ignore[attr-defined]


_item = {name: itemgetter(name) for name in Record.__slots__}  # type: ignore[attr-defined]


def maps_to_batch(msgs: Sequence[dict], arrow_schema):
    """records_to_batch for records as the wire protocol's message maps (a pull reply): the same rows."""
    return records_to_batch(msgs, arrow_schema, _item)


def map_filter(
    topics: frozenset[str] | None, since: int | None, until: int | None, kinds: frozenset[str] | None
) -> Callable[[dict], bool] | None:
    """record_filter for message maps."""
    if topics is None and since is None and until is None and kinds is None:
        return None

    def keep(m: dict) -> bool:
        ts = m["store_ts"]
        if since is not None and ts < since:
            return False
        if until is not None and ts >= until:
            return False
        if topics is not None and m["topic"] not in topics and m["properties"].get(PROP_REAL_TOPIC) not in topics:
            return False
        return kinds is None or _kind(m["topic"], m["tx_type"]) in kinds

    return keep


def records_to_batch(recs: Sequence, arrow_schema, get: dict | None = None):
    """A pyarrow RecordBatch of `messages` rows (as record_row builds them), column by column."""
    import pyarrow as pa

    getters = _get if get is None else get

    def col(name: str) -> list:
        return list(map(getters[name], recs))

    def prop(key: str) -> list:
        return list(map(dict.get, props, repeat(key)))

    t = arrow_schema.types
    topics = col("topic")
    kinds = [_kinds_of(topic)[tx] for topic, tx in zip(topics, col("tx_type"))]
    props = col("properties")
    bodies = col("body")
    checks = _ints(prop(PROP_CHECK_TIMES))
    ms = pa.timestamp("ms", tz="UTC")
    arrays = [
        pa.array(col("commit_log_offset"), pa.int64()),
        pa.array(col("size"), pa.int32()),
        pa.array(topics, pa.string()),
        pa.array(col("queue_id"), pa.int32()),
        pa.array(col("queue_offset"), pa.int64()),
        pa.array(kinds, pa.string()),
        pa.array(prop(PROP_PGROUP), pa.string()),
        pa.array([(x or None) if k != NORMAL else None for x, k in zip(prop(PROP_UNIQ_KEY), kinds)], pa.string()),
        pa.array(prop(PROP_REAL_TOPIC), pa.string()),
        pa.array(_ints(prop(PROP_REAL_QID)), pa.int32()),
        pa.array(prop(PROP_TAGS), pa.string()),
        pa.array(prop(PROP_KEYS), pa.string()),
        pa.MapArray.from_arrays(
            pa.array([0, *accumulate(map(len, props))], pa.int32()),
            pa.array(list(chain.from_iterable(props)), pa.string()),
            pa.array(list(chain.from_iterable(map(dict.values, props))), pa.string()),
            type=t[12],
        ),
        pa.Array.from_buffers(
            pa.binary(), len(recs),
            [None, pa.array([0, *accumulate(map(len, bodies))], pa.int32()).buffers()[1], pa.py_buffer(b"".join(bodies))],
        ),
        pa.array(list(map(_ts, col("born_ts"))), pa.int64()).cast(ms).cast(t[14]),
        pa.array(col("store_ts"), pa.int64()).cast(ms).cast(t[15]),
        pa.array([0 if c is None and k in (HALF, DISCARD) else c for c, k in zip(checks, kinds)], pa.int32()),
        pa.array([p if p >= 0 else None for p in col("prepared_offset")], pa.int64()),
    ]  # fmt: skip
    return pa.RecordBatch.from_arrays(arrays, schema=arrow_schema)


def tx_event(m: dict) -> tuple | None:
    """One `transaction_events` row (timestamps in ms) from a half, op or discard record's message map, else None."""
    topic, p = m["topic"], m["properties"]
    checks = _int(p.get(PROP_CHECK_TIMES))
    origin = _int64(p.get(PROP_ORIGIN_CL_OFFSET))
    by = reason = decided = None
    if topic == HALF_TOPIC:
        if origin is None:
            event, by, origin = "half", "producer", m["commit_log_offset"]
        elif p.get(PROP_REPLAYED) is not None and not checks:
            event, by = "replay", "operator"  # a replay's copy starts at check count 0; later copies count up
        else:
            event, by = "check", "check"
        checks = checks or 0
    elif topic == OP_TOPIC:
        event = "rollback" if m["tx_type"] == _TX_ROLLBACK else "commit"
        by = p.get(PROP_DECIDED_BY, "producer")
        decided = _int64(p.get(PROP_HALF_CL_OFFSET))
        if decided is None and m["prepared_offset"] >= 0:
            decided = m["prepared_offset"]
    elif topic in (DISCARD_TOPIC, DISCARD_TOPIC_ALIAS):
        event, reason = "discard", p.get(PROP_DISCARD_REASON, "max-checks")
        checks = checks or 0
    else:
        return None
    return (event, p.get(PROP_UNIQ_KEY) or None, p.get(PROP_PGROUP), p.get(PROP_REAL_TOPIC), _int(p.get(PROP_REAL_QID)),
            m["store_ts"], by, reason, checks, m["commit_log_offset"], origin, decided, topic, m["queue_offset"])


def _int64(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def tx_events_batch(msgs: Sequence[dict], arrow_schema):
    """A pyarrow RecordBatch of `transaction_events` rows from message maps (records of other topics are left out)."""
    import pyarrow as pa

    rows = [r for r in map(tx_event, msgs) if r is not None]
    cols = list(zip(*rows)) if rows else [()] * len(arrow_schema)
    arrays = []
    for i, f in enumerate(arrow_schema):
        if pa.types.is_timestamp(f.type):
            arrays.append(pa.array(cols[i], pa.int64()).cast(pa.timestamp("ms", tz="UTC")).cast(f.type))
        else:
            arrays.append(pa.array(cols[i], f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=arrow_schema)
