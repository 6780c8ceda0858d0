"""A PySpark Python Data Source over a txmq data directory: the `messages` table.

    from txmq.spark.source import TxmqDataSource
    spark.dataSource.register(TxmqDataSource)
    df = spark.read.format("txmq").load("/var/lib/txmq")

Planning (on the driver) lists the commit-log segments and cuts each into
byte ranges of ``partitionBytes`` (default 64 MiB). Ranges need not fall on
record boundaries: an executor reads its range with
``StoreReader.scan_range``, which starts at the first valid record at or
after the range's start and returns every record *starting* in the range, so
neighbouring ranges partition the log exactly. Reads are chunked; nothing
holds a whole segment in memory. The plan stops at the end of the last
complete record, so a live broker's torn tail is never read.

Options (all optional): ``partitionBytes`` (bytes, or e.g. ``16MiB``),
``topics`` (comma-separated; keeps records of those topics and transaction
records whose REAL_TOPIC is one of them), ``since`` / ``until`` (store time,
ms since the epoch or ISO 8601; naive times are UTC), ``kinds``
(comma-separated record kinds), ``endOffset`` (read the log only up to this
commit-log offset: a fixed snapshot of a live log), ``batchRows`` (rows per
Arrow batch).
Filters are applied on the executors before rows are built.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from txmq.constants import canonical_topic
from txmq.store import Record, StoreReader
from txmq.store.consumequeue import all_queues

from . import fastrows
from .options import parse_size, parse_time_ms
from .rows import BATCH_BYTES, record_filter, records_to_batch
from .schema import KINDS, messages_schema

DEFAULT_PARTITION_BYTES = 64 << 20
DEFAULT_BATCH_ROWS = 32768


@dataclass(frozen=True, slots=True)
class ReadOptions:
    data_dir: str
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    topics: frozenset[str] | None = None
    since_ms: int | None = None
    until_ms: int | None = None
    kinds: frozenset[str] | None = None
    end_offset: int | None = None
    batch_rows: int = DEFAULT_BATCH_ROWS
    # With a directory: damaged records are skipped, each reported there as a JSON line
    # ({offset, reason, bytes}) and logged; without: a damaged record fails the read with its offset.
    damage_report: str | None = None

    @classmethod
    def from_options(cls, options) -> "ReadOptions":
        opts = {str(k).lower(): v for k, v in dict(options).items()}
        path = opts.get("path")
        if not path:
            raise ValueError('the txmq source needs a data directory: spark.read.format("txmq").load(DIR)')
        topics = _csv(opts.get("topics"))
        kinds = _csv(opts.get("kinds"))
        if kinds and not kinds <= set(KINDS):
            raise ValueError(f"unknown record kind(s) {sorted(kinds - set(KINDS))}: use {', '.join(KINDS)}")
        pb = parse_size(opts.get("partitionbytes", DEFAULT_PARTITION_BYTES))
        if pb < 4096:
            raise ValueError("partitionBytes must be at least 4096")
        return cls(
            data_dir=os.path.abspath(_local_path(str(path))),
            partition_bytes=pb,
            topics=frozenset(canonical_topic(t) for t in topics) if topics else None,
            since_ms=parse_time_ms(opts.get("since")),
            until_ms=parse_time_ms(opts.get("until")),
            kinds=frozenset(kinds) if kinds else None,
            end_offset=int(opts["endoffset"]) if opts.get("endoffset") not in (None, "") else None,
            batch_rows=max(1, int(opts.get("batchrows", DEFAULT_BATCH_ROWS))),
            damage_report=str(opts["damagereport"]) if opts.get("damagereport") else None,
        )


def _csv(v) -> set[str]:
    return {x.strip() for x in str(v).split(",") if x.strip()} if v else set()


def _local_path(path: str) -> str:
    """The data directory is read with plain file calls: accept file: URIs, refuse others."""
    if path.startswith("file://"):
        return path[len("file://") :]
    if path.startswith("file:"):
        return path[len("file:") :]
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path):
        raise ValueError(f"the txmq source reads a local or mounted directory, not {path!r}")
    return path


class TxmqPartition(InputPartition):
    """Records starting in [start, end) of one segment (global commit-log offsets).

    ``log_end`` is (offset, end) of the last record the driver validated
    when it planned the partitions: the task's reader starts its own
    validation there if that record is still there.
    """

    def __init__(self, path: str, segment_start: int, start: int, end: int, log_end: tuple[int, int] | None = None) -> None:
        super().__init__((segment_start, start, end))
        self.path = path
        self.segment_start = segment_start
        self.start = start
        self.end = end
        self.log_end = log_end


def plan_partitions(
    data_dir: str, partition_bytes: int = DEFAULT_PARTITION_BYTES, end_offset: int | None = None
) -> list[TxmqPartition]:
    """Split the log up to its last complete record (or end_offset) by segment and byte range.

    Each segment is cut into ranges of about partition_bytes, each cut moved
    to the next record start the consume queues know, so every task starts
    at a stored record (StoreReader.record_start_from).
    """
    parts = []
    with StoreReader(data_dir) as reader:
        segments = reader.segments()
        log_end = reader.last_record
        queues = all_queues(reader)
        for seg_start, path, length in segments:
            if end_offset is not None:
                length = max(0, min(length, end_offset - seg_start))
            if length <= 0:
                continue
            seg_end = seg_start + length
            step = -(-length // -(-length // partition_bytes))  # equal ranges of at most partition_bytes
            cuts = [seg_start]
            for lo in range(step, length, step):
                # A task starting inside a record would search the bytes for the next one and could take
                # a record forged inside a message body for a stored one: cut where a record starts.
                at = reader.record_start_from(seg_start + lo, queues)
                if at is not None and at >= seg_end:
                    break  # no record starts in the rest of this segment
                cut = seg_start + lo if at is None else at
                if cut > cuts[-1]:
                    cuts.append(cut)
            cuts.append(seg_end)
            for lo, hi in zip(cuts, cuts[1:]):
                if hi > lo:
                    parts.append(TxmqPartition(path, seg_start, lo, hi, log_end))
    return parts


def has_commit_log(data_dir: str) -> bool:
    return os.path.isdir(os.path.join(data_dir, "commitlog"))


def read_records(opts: ReadOptions, start: int, end: int, log_end: tuple[int, int] | None = None) -> Iterator[Record]:
    """Records starting in [start, end), filtered by opts; log_end: the last record the driver validated (offset, end)."""
    keep = record_filter(opts.topics, opts.since_ms, opts.until_ms, opts.kinds)
    on_damage = damage_reporter(opts.damage_report, start) if opts.damage_report else None
    with StoreReader(opts.data_dir, known_end=log_end) as reader:
        if keep is None:
            yield from reader.scan_range(start, end, on_damage)
        else:
            for rec in reader.scan_range(start, end, on_damage):
                if keep(rec):
                    yield rec


def damage_reporter(directory: str, start: int):
    """on_damage for scan_range: log the damaged record and append it to this partition's file in directory."""
    path = os.path.join(directory, f"damage-{start}-{os.getpid()}.jsonl")

    def report(offset: int, reason: str, skipped: int) -> None:
        logging.getLogger("txmq.spark").warning("event=record_damaged offset=%d reason=%r skipped_bytes=%d", offset, reason, skipped)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"offset": offset, "reason": reason, "bytes": skipped}) + "\n")

    return report


def read_damage_reports(directory: str) -> list[dict]:
    """Every damaged record reported in directory, once each (a table read twice reports it twice), by offset."""
    seen: dict[int, dict] = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("damage-") and name.endswith(".jsonl"):
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        d = json.loads(line)
                        if d["offset"] not in seen or d["bytes"] > seen[d["offset"]]["bytes"]:
                            seen[d["offset"]] = d
    return [seen[o] for o in sorted(seen)]


# ---- the data source ---------------------------------------------------------
class TxmqReader(DataSourceReader):
    def __init__(self, opts: ReadOptions, schema) -> None:
        self.opts = opts
        self.schema = schema

    def partitions(self) -> list[InputPartition]:
        opts = self.opts
        return plan_partitions(opts.data_dir, opts.partition_bytes, opts.end_offset)  # type: ignore[return-value]

    def read(self, partition: InputPartition):
        if not isinstance(partition, TxmqPartition):  # an empty log plans no partition
            return iter(())
        return self._batches(partition)

    def _batches(self, part: TxmqPartition):
        from pyspark.sql.pandas.types import to_arrow_schema

        arrow_schema = to_arrow_schema(self.schema, timezone="UTC")
        if fastrows.columns is None:
            return self._python(part.start, part.end, part.log_end, arrow_schema)
        return self._fast(part, arrow_schema)

    def _fast(self, part: TxmqPartition, arrow_schema):
        """Segment bytes straight into Arrow columns (compiled); the Python path from any record it leaves."""
        opts = self.opts
        start = part.start
        if not fastrows.record_at(part.path, part.segment_start, start):
            # not a record start (a cut by bytes): the store's reader finds the first record at or after it
            on_damage = damage_reporter(opts.damage_report, part.start) if opts.damage_report else None
            with StoreReader(opts.data_dir, known_end=part.log_end) as reader:
                first = next(iter(reader.scan_range(part.start, part.end, on_damage)), None)
            if first is None:
                return
            start = first.commit_log_offset
        keep = fastrows.arrow_filter(opts.topics, opts.since_ms, opts.until_ms, opts.kinds)
        prev = None  # the last record the walk took
        for batch, at, done in fastrows.walk_segment(part.path, part.segment_start, start, part.end,
                                                     opts.batch_rows, BATCH_BYTES, arrow_schema):
            if batch is not None:
                prev = batch.column(0)[-1].as_py()
                if keep is not None:
                    batch = keep(batch)
                if batch.num_rows:
                    yield batch
            elif not done:
                # A record the compiled walk does not take (damaged, torn): the Python path reads on as it would
                # have, from the last good record (started at the bad one, it would take it for bytes to resync over).
                yield from self._python(start if prev is None else prev, part.end, part.log_end, arrow_schema, at)
                return

    def _python(self, start: int, end: int, log_end, arrow_schema, skip_before: int = -1):
        n = self.opts.batch_rows
        records = read_records(self.opts, start, end, log_end)
        if skip_before >= 0:
            records = (r for r in records if r.commit_log_offset >= skip_before)
        try:
            while True:
                # Records and their dicts hold no cycles: the cyclic GC only costs time
                # here (~15%), so it is paused while a batch is read and built.
                enabled = gc.isenabled()
                gc.disable()
                try:
                    recs: list[Record] = []
                    size = 0
                    for rec in records:
                        recs.append(rec)
                        size += rec.size
                        if len(recs) >= n or size >= BATCH_BYTES:  # binary columns use 32-bit offsets
                            break
                    batch = records_to_batch(recs, arrow_schema) if recs else None
                finally:
                    if enabled:
                        gc.enable()
                if batch is None:
                    return
                yield batch
        finally:
            records.close()


class TxmqDataSource(DataSource):
    """`spark.read.format("txmq").load(DATA_DIR)`: the commit log as the `messages` table; with option broker, the
    broker's queues read over the wire (batch and streaming, txmq.spark.brokersource)."""

    @classmethod
    def name(cls) -> str:
        return "txmq"

    def _through_broker(self) -> bool:
        opts = {str(k).lower() for k, v in dict(self.options).items() if v not in (None, "")}
        if opts & {"broker", "context"}:
            if "path" in opts:
                raise ValueError("give the txmq source a broker (option broker) or a data directory (load(DIR)), not both")
            return True
        return False

    def schema(self):
        table = str(dict((str(k).lower(), v) for k, v in dict(self.options).items()).get("table") or "messages").lower()
        if table == "transaction_events":
            from .schema import tx_events_schema

            return tx_events_schema()
        return messages_schema()

    def streamReader(self, schema):
        from .broker import BrokerOptions
        from .brokersource import TxmqStreamReader

        if not self._through_broker():
            raise ValueError('a txmq stream reads through a broker: spark.readStream.format("txmq").option("broker", "HOST:PORT")')
        return TxmqStreamReader(BrokerOptions.from_options(self.options, streaming=True), schema)

    def reader(self, schema):
        if self._through_broker():
            from .broker import BrokerOptions
            from .brokersource import TxmqBrokerReader

            return TxmqBrokerReader(BrokerOptions.from_options(self.options), schema)
        if str(dict((str(k).lower(), v) for k, v in dict(self.options).items()).get("table") or "messages").lower() != "messages":
            raise ValueError("option table=transaction_events needs a broker (option broker)")
        opts = ReadOptions.from_options(self.options)
        if not has_commit_log(opts.data_dir):
            raise FileNotFoundError(f"no txmq commit log under {opts.data_dir} (expected {opts.data_dir}/commitlog)")
        return TxmqReader(opts, schema)
