"""The `txmq` source's broker mode: batch and streaming readers that pull through the wire protocol.

    spark.read.format("txmq").option("broker", "HOST:PORT").load()
    spark.readStream.format("txmq").option("broker", "HOST:PORT").load()
    spark.readStream.format("txmq").option("broker", ...).option("table", "transaction_events").load()

A stream's offsets are every queue's next queue offset,
``{"orders": {"0": 1200, "1": 1187}, ...}``: Spark keeps them in its
checkpoint, so a restarted query reads on from the last committed batch and
a file sink gets every row exactly once. Planning and reading are in
``txmq.spark.broker`` (no pyspark there).
"""

from __future__ import annotations

import gc
from dataclasses import replace

from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition

from .broker import (
    TX_TOPICS,
    BrokerOptions,
    BrokerReadError,
    QueueRange,
    RawRecords,
    WireClient,
    checked_ranges,
    connect,
    plan_batch,
    pull_range,
    queue_offsets,
    resolve_offsets,
    split_ranges,
)
from . import fastrows
from .rows import BATCH_BYTES, map_filter, maps_to_batch, records_to_batch, tx_events_batch

try:  # pyspark 4.2+: read limits (maxOffsetsPerTrigger) and Trigger.AvailableNow
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows, SupportsTriggerAvailableNow
except ImportError:  # pragma: no cover - older pyspark: every trigger reads all that is there
    ReadAllAvailable = ReadMaxRows = None  # type: ignore[assignment,misc]

    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        pass


class QueuePartition(InputPartition):
    """One task: queue offsets [start, end) of one queue; ``topics`` the user topics a tx record must be for (None: any)."""

    def __init__(self, r: QueueRange, topics: frozenset[str] | None) -> None:
        super().__init__((r.topic, r.queue_id, r.start, r.end))
        self.range = r
        self.topics = topics


def _partitions(ranges: list[QueueRange], chosen: frozenset[str] | None) -> list[QueuePartition]:
    return [QueuePartition(r, chosen) for r in ranges]


def read_partition(opts: BrokerOptions, part: QueuePartition, schema):
    """Arrow record batches of one partition's rows (messages or transaction events)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    arrow_schema = to_arrow_schema(schema, timezone="UTC")
    build = tx_events_batch if opts.table == "transaction_events" else maps_to_batch
    keep = map_filter(part.topics, opts.since_ms, opts.until_ms, opts.kinds)
    vkeep = None
    for msgs in pull_range(opts, part.range):
        if isinstance(msgs, RawRecords):
            if vkeep is None:
                vkeep = fastrows.arrow_filter(part.topics, opts.since_ms, opts.until_ms, opts.kinds) or (lambda b: b)
            try:
                batches = list(raw_to_batches(msgs, arrow_schema))
            except (ValueError, BrokerReadError):  # a record that does not decode
                batches = []
            if not _the_records_asked_for(batches, part.range, msgs):
                # an entry that leads elsewhere: the usual pull reports, repairs or skips it
                sub = replace(part.range, start=msgs.first, end=msgs.first + msgs.count)
                batches = [maps_to_batch(m, arrow_schema) for m in pull_range(replace(opts, raw=False), sub) if len(m)]
            for batch in batches:
                batch = vkeep(batch)
                if batch.num_rows:
                    yield batch
            continue
        if keep is not None:
            msgs = [m for m in msgs if keep(m)]
        if not msgs:
            continue
        enabled = gc.isenabled()
        gc.disable()  # the maps hold no cycles: the cyclic GC only costs time here
        try:
            batch = build(msgs, arrow_schema)
        finally:
            if enabled:
                gc.enable()
        if batch.num_rows:
            yield batch


def _the_records_asked_for(batches: list, r: QueueRange, raw: RawRecords) -> bool:
    """Whether a raw pull's records are the queue's, at queue offsets raw.first, raw.first + 1, ... (vectorised)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if sum(b.num_rows for b in batches) != raw.count:
        return False
    expect = raw.first
    for b in batches:
        qo = b.column("queue_offset")
        if b.num_rows == 0:
            continue
        if qo[0].as_py() != expect or (b.num_rows > 1 and not pc.all(pc.equal(pc.pairwise_diff(qo), 1)).as_py()):
            return False
        if not pc.all(pc.equal(b.column("topic"), pa.scalar(r.topic))).as_py():
            return False
        if not pc.all(pc.equal(b.column("queue_id"), pa.scalar(r.queue_id, pa.int32()))).as_py():
            return False
        expect += b.num_rows
    return True


def raw_to_batches(raw: RawRecords, arrow_schema):
    """`messages` batches of a raw pull: compiled when built, else decoded record by record (the same rows)."""
    if fastrows.columns is not None:
        rows = 0
        for batch in fastrows.raw_batches(raw.data, arrow_schema, 1 << 30, BATCH_BYTES):
            rows += batch.num_rows
            yield batch
        if rows != raw.count:
            raise BrokerReadError(f"a raw pull from queue offset {raw.first} held {rows} records, not {raw.count}")
        return
    from txmq.store.codec import decode

    recs, pos, data = [], 0, raw.data
    mv = memoryview(data)
    for _ in range(raw.count):
        off = int.from_bytes(data[pos + 12 : pos + 20], "little", signed=True)
        rec = decode(data, pos, off, mv)
        if type(rec) is str:
            raise BrokerReadError(f"a record of a raw pull is not valid: {rec}")
        recs.append(rec)
        pos += rec.size
    if recs:
        yield records_to_batch(recs, arrow_schema)


def _chosen(opts: BrokerOptions, offsets: dict) -> frozenset[str] | None:
    """The user topics whose transaction records a read keeps (None: every topic's)."""
    if opts.topics is None and opts.pattern is None:
        return None
    return frozenset(t for t in offsets if t not in TX_TOPICS) | frozenset(opts.topics or ())


class TxmqBrokerReader(DataSourceReader):
    def __init__(self, opts: BrokerOptions, schema) -> None:
        self.opts = opts
        self.schema = schema

    def partitions(self):
        ranges, info = plan_batch(self.opts)
        return _partitions(ranges, _chosen(self.opts, dict.fromkeys(info["topics"]))) or [InputPartition(None)]

    def read(self, partition):
        if not isinstance(partition, QueuePartition):  # nothing to read
            return iter(())
        return read_partition(self.opts, partition, self.schema)


def _encode(offsets: dict[str, dict[int, int]]) -> dict:
    return {t: {str(q): o for q, o in sorted(qs.items())} for t, qs in sorted(offsets.items())}


def _decode(offsets: dict) -> dict[str, dict[int, int]]:
    return {t: {int(q): int(o) for q, o in qs.items()} for t, qs in (offsets or {}).items()}


class TxmqStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Committed messages (or transaction events) as they arrive; offsets are the queues' next offsets."""

    def __init__(self, opts: BrokerOptions, schema) -> None:
        self.opts = opts
        self.schema = schema
        self._client: WireClient | None = None
        self._until: dict[str, dict[int, int]] | None = None  # Trigger.AvailableNow: read up to here
        self._offsets = self._queues()  # fail at start, on the driver, when the broker cannot be read

    def __getstate__(self) -> dict:  # read() goes to the executors with the reader: not its connection
        return {**self.__dict__, "_client": None}

    def _queues(self, time_ms: int | None = None) -> dict[str, list[dict]]:
        for attempt in (0, 1):
            try:
                if self._client is None:
                    self._client = connect(self.opts)
                return queue_offsets(self._client, self.opts, time_ms)
            except ConnectionError as e:  # the broker restarted since the last batch: one new connection
                self._close()
                if attempt:
                    raise BrokerReadError(f"lost the broker at {self.opts.address}: {e}") from None
        raise AssertionError("unreachable")

    def _close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def initialOffset(self) -> dict:
        st = self.opts.starting
        offsets = self._queues(st[1]) if isinstance(st, tuple) else self._offsets
        return _encode(resolve_offsets(offsets, st, "latest"))

    def latestOffset(self, start: dict | None = None, limit=None) -> dict:
        self._offsets = offsets = self._queues()
        latest = {t: {q["queue_id"]: q["max_offset"] for q in qs} for t, qs in offsets.items()}
        if self._until is not None:  # AvailableNow: what was there when the query started
            latest = {t: {q: min(o, self._until.get(t, {}).get(q, 0)) for q, o in qs.items()} for t, qs in latest.items()}
        if start is None:
            return _encode(latest)
        begin = _decode(start)
        mins = {t: {q["queue_id"]: q["min_offset"] for q in qs} for t, qs in offsets.items()}
        # a queue the start does not know (new topic or queue) starts at its first stored message
        latest = {t: {q: max(o, begin.get(t, {}).get(q, mins[t][q])) for q, o in qs.items()} for t, qs in latest.items()}
        for t, qs in begin.items():  # a queue that went away keeps its offset
            for q, o in qs.items():
                latest.setdefault(t, {}).setdefault(q, o)
        if ReadMaxRows is not None and isinstance(limit, ReadMaxRows):
            latest = _rate_limit(begin, latest, mins, limit.max_rows)
        return _encode(latest)

    def getDefaultReadLimit(self):
        if self.opts.max_offsets_per_trigger is not None and ReadMaxRows is not None:
            return ReadMaxRows(self.opts.max_offsets_per_trigger)
        return ReadAllAvailable() if ReadAllAvailable is not None else None

    def prepareForTriggerAvailableNow(self) -> None:
        offsets = self._queues()
        self._until = {t: {q["queue_id"]: q["max_offset"] for q in qs} for t, qs in offsets.items()}

    def partitions(self, start: dict, end: dict):
        begin, stop = _decode(start), _decode(end)
        offsets = self._queues()
        ranges = checked_ranges(offsets, begin, stop, self.opts, streaming=True)
        ranges = [r for r in ranges if stop.get(r.topic, {}).get(r.queue_id) is not None]
        return _partitions(split_ranges(ranges, self.opts.min_partitions, self.opts.max_records_per_partition),
                           _chosen(self.opts, offsets))  # with topicPattern: the topics that match now

    def read(self, partition):
        return read_partition(self.opts, partition, self.schema)

    def commit(self, end: dict) -> None:
        pass  # nothing to acknowledge: offsets live in Spark's checkpoint

    def stop(self) -> None:
        self._close()


def _rate_limit(begin: dict[str, dict[int, int]], latest: dict[str, dict[int, int]], mins: dict[str, dict[int, int]],
                max_rows: int) -> dict[str, dict[int, int]]:
    """At most max_rows offsets in all, shared between the queues in proportion to what each has to read."""
    avail = {(t, q): o - max(begin.get(t, {}).get(q, mins.get(t, {}).get(q, o)), mins.get(t, {}).get(q, 0))
             for t, qs in latest.items() for q, o in qs.items()}
    total = sum(max(0, n) for n in avail.values())
    if total <= max_rows:
        return latest
    out = {t: dict(qs) for t, qs in latest.items()}
    left = max_rows
    for (t, q), n in sorted(avail.items()):
        if n <= 0:
            continue
        take = min(n, max(1, n * max_rows // total), left)
        lo = max(begin.get(t, {}).get(q, mins[t][q]), mins[t][q])
        out[t][q] = lo + take
        left -= take
    return out
