"""Records -> `messages` rows: kinds, filters, and Arrow record batches.

Runs on the executors, once per record, so the loops are C-level (map,
chain, accumulate) where they can be: building a batch costs about as much
as decoding its records. Imports pyarrow lazily and pyspark not at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate, chain, repeat
from operator import attrgetter

from txmq.constants import (
    PROP_CHECK_TIMES,
    PROP_KEYS,
    PROP_PGROUP,
    PROP_REAL_QID,
    PROP_REAL_TOPIC,
    PROP_TAGS,
    PROP_UNIQ_KEY,
)
from txmq.store import Record

from .schema import DISCARD, HALF, NORMAL, record_kind


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


def records_to_batch(recs: Sequence[Record], arrow_schema):
    """A pyarrow RecordBatch of `messages` rows (as record_row builds them), column by column."""
    import pyarrow as pa

    def col(name: str) -> list:
        return list(map(_get[name], recs))

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
