"""Write the `messages` and `transactions` tables of a data directory with Spark.

``export(spark, ExportOptions(...))`` does the work for `txmq spark-export`;
it prints nothing. Each table goes to its own folder under ``out``. Both
tables read the log up to the same offset (its end when the export began),
so they describe one moment of a live broker.

A local ``out`` is never left half written (``--mode append`` excepted):
the tables are written to a sibling ``OUT.tmp-<pid>`` and renamed into
place once every one is complete; a failure or an interruption removes it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from txmq.constants import canonical_topic
from txmq.store import StoreReader

from .arrowwrite import CODEC_CONF
from .formats import DEFAULT_FORMAT, export_format
from .schema import MESSAGE_FIELDS, TRANSACTION_FIELDS, TX_KINDS
from .source import DEFAULT_PARTITION_BYTES, TxmqDataSource, has_commit_log, plan_partitions, read_damage_reports
from .transactions import transactions

TABLES = ("messages", "transactions")
# A small export on a local master is read by the driver itself (below, "Small exports"): a log of up to this many
# bytes, or through a broker up to DRIVER_READ_RECORDS records (and this many bytes of Arrow batches).
DRIVER_READ_BYTES = 64 << 20
DRIVER_READ_RECORDS = 100_000
MODES = {"error": "errorifexists", "overwrite": "overwrite", "append": "append"}
# --partition-by names that mean a different column in each table
_ALIASES = {
    "messages": {"date": "date", "topic": "topic"},
    "transactions": {"date": "date", "topic": "real_topic"},
}
_TIME_COLUMN = {"messages": "stored_at", "transactions": "first_half_at"}
_FIELDS = {"messages": MESSAGE_FIELDS, "transactions": TRANSACTION_FIELDS}


@dataclass(frozen=True)
class ExportOptions:
    data_dir: str
    out: str
    fmt: str = DEFAULT_FORMAT  # a name in formats.EXPORT_FORMATS
    tables: tuple[str, ...] = TABLES
    since_ms: int | None = None  # store time, inclusive
    until_ms: int | None = None  # store time, exclusive
    topics: tuple[str, ...] = ()
    partition_by: tuple[str, ...] = ()
    mode: str = "error"
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    skip_damaged: bool = False  # skip damaged records (listed in the result) instead of failing at the first
    broker: str | None = None  # read through this broker (HOST:PORT) instead of data_dir
    report: str | None = None  # also write the transactions report (HTML) here
    token: str | None = None
    # "arrow": the messages table as Parquet written by the executors from the reader's Arrow batches (spark/arrowwrite.py)
    # where it applies (Parquet, no partition_by, a local out); "spark": always Spark's own writer
    parquet_writer: str = "arrow"
    # On a local master, an export this small (log bytes; through a broker, DRIVER_READ_RECORDS records) is read by
    # the driver instead of Spark's Python data source; 0: never
    driver_read_bytes: int = DRIVER_READ_BYTES


@dataclass
class TableResult:
    name: str
    path: str
    rows: int
    seconds: float


@dataclass
class ExportResult:
    tables: list[TableResult] = field(default_factory=list)
    end_offset: int = 0  # the log was read up to here
    log_bytes: int = 0  # bytes of log in [min offset, end_offset)
    bytes_read: int = 0  # log bytes scanned, over every pass
    segments: int = 0
    partitions: int = 0  # read partitions per pass
    seconds: float = 0.0
    damaged: list[dict] = field(default_factory=list)  # with skip_damaged: {offset, reason, bytes} of each skipped
    report: dict | None = None  # with opts.report: the report's figures
    rows_planned: int = 0  # through a broker: the queue offsets planned (records before the filters)
    queues: int = 0  # through a broker: the queues read


def table_path(out: str, table: str) -> str:
    return out.rstrip("/") + "/" + table if "://" in out else os.path.join(out, table)


def partition_columns(table: str, names: tuple[str, ...]) -> list[str]:
    """The columns a table is partitioned by; ValueError for a name it does not have."""
    cols = []
    for name in names:
        col = _ALIASES[table].get(name, name)
        if col != "date" and col not in _FIELDS[table]:
            raise ValueError(f"--partition-by {name}: the {table} table has no such column (use date, topic or one of its columns)")
        if col in ("properties", "body"):
            raise ValueError(f"--partition-by {name}: cannot partition by a map or binary column")
        cols.append(col)
    return cols


def check_options(opts: ExportOptions) -> None:
    """Raise ValueError / FileNotFoundError / FileExistsError before any Spark work."""
    export_format(opts.fmt)
    if opts.mode not in MODES:
        raise ValueError(f"--mode must be one of {', '.join(MODES)}")
    if not opts.tables or not set(opts.tables) <= set(TABLES):
        raise ValueError("--table must be messages, transactions or all")
    if opts.since_ms is not None and opts.until_ms is not None and opts.since_ms >= opts.until_ms:
        raise ValueError("--since must be before --until")
    for t in opts.tables:
        partition_columns(t, opts.partition_by)
    if opts.broker is not None:
        from .broker import parse_broker

        parse_broker(opts.broker)
    elif not has_commit_log(opts.data_dir):
        raise FileNotFoundError(f"{opts.data_dir} is not a txmq data directory (no commitlog/ in it)")
    if opts.mode == "error" and "://" not in opts.out:
        for t in opts.tables:
            p = table_path(opts.out, t)
            if os.path.exists(p):
                raise FileExistsError(f"{p} already exists: use --mode overwrite or --mode append")


def _for_format(df, fmt: str):
    """df as the format holds it: for one with text columns only (CSV: neither maps nor binary), properties as a
    JSON object string, body as base64."""
    if not export_format(fmt).text_columns:
        return df
    from pyspark.sql import functions as F

    cols = []
    for name in df.columns:
        if name == "properties":
            cols.append(F.to_json(F.col(name)).alias(name))
        elif name == "body":  # Spark's base64 may wrap lines MIME-style: keep it on one line
            cols.append(F.regexp_replace(F.base64(F.col(name)), r"[\r\n]", "").alias(name))
        else:
            cols.append(F.col(name))
    return df.select(*cols)


def _write(df, table: str, opts: ExportOptions) -> tuple[str, int]:
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    cols = partition_columns(table, opts.partition_by)
    if "date" in cols:
        df = df.withColumn("date", F.to_date(F.col(_TIME_COLUMN[table])))
    obs = Observation(f"txmq_{table}")
    fmt = export_format(opts.fmt)
    df = _for_format(df, fmt.name).observe(obs, F.count(F.lit(1)).alias("rows"))
    w = df.write.format(fmt.name).mode(MODES[opts.mode])
    if cols:
        w = w.partitionBy(*cols)
    if fmt.options:
        w = w.options(**fmt.options)
    if fmt.table_options.get(table):
        w = w.options(**fmt.table_options[table])
    path = table_path(opts.out, table)
    w.save(path)
    return path, int(obs.get["rows"])


def export(spark, opts: ExportOptions, on_table: Callable[[str], None] | None = None) -> ExportResult:
    """Write the tables named in opts; on_table(name) is called as each one starts."""
    check_options(opts)
    t0 = time.perf_counter()
    if opts.broker is not None:
        return _export_through_broker(spark, opts, on_table, t0)
    with StoreReader(opts.data_dir) as reader:
        end = reader.max_offset
        segments = reader.segments()
    parts = plan_partitions(opts.data_dir, opts.partition_bytes, end)
    res = ExportResult(
        end_offset=end, segments=len(segments), partitions=len(parts),
        log_bytes=sum(p.end - p.start for p in parts),
    )  # fmt: skip
    topics = tuple(sorted({canonical_topic(t) for t in opts.topics}))

    # Executors report skipped records as files in a local directory: complete on a local master (and
    # on a cluster for executors on this machine; each executor also logs every one it skips).
    damage_dir = tempfile.mkdtemp(prefix="txmq-damage-") if opts.skip_damaged else None
    counting = threading.Lock()

    def options_for(**extra) -> dict[str, str]:
        options = {"path": opts.data_dir, "partitionBytes": str(opts.partition_bytes), "endOffset": str(end), **extra}
        if damage_dir:
            options["damageReport"] = damage_dir
        with counting:  # the tables are planned side by side
            res.bytes_read += res.log_bytes
        return options

    try:
        _run(spark, opts, options_for, topics, res, on_table, damage_dir,
             driver_reads=opts.driver_read_bytes > 0 and _local_master(spark) and res.log_bytes <= opts.driver_read_bytes)
    finally:
        if damage_dir:
            shutil.rmtree(damage_dir, ignore_errors=True)
    res.seconds = time.perf_counter() - t0
    return res


def broker_options(opts: ExportOptions) -> dict[str, str]:
    return {"broker": opts.broker or "", **({"token": opts.token} if opts.token else {})}


def _export_through_broker(spark, opts: ExportOptions, on_table, t0: float) -> ExportResult:
    """Both tables from one plan: every queue read up to the offsets it had when the export began."""
    import json

    from .broker import BrokerOptions, plan_batch

    topics = tuple(sorted({canonical_topic(t) for t in opts.topics}))
    base = broker_options(opts)
    if topics:
        base["topics"] = ",".join(topics)
    ranges, info = plan_batch(BrokerOptions.from_options(base))
    ends: dict[str, dict[str, int]] = {}
    for r in ranges:
        q = ends.setdefault(r.topic, {})
        q[str(r.queue_id)] = max(q.get(str(r.queue_id), 0), r.end)
    res = ExportResult(partitions=len(ranges), rows_planned=info["rows"], queues=info["queues"])

    def options_for(**extra) -> dict[str, str]:
        options = {**base, **extra}
        if ends:
            options["endingOffsets"] = json.dumps(ends)
            options["startingOffsets"] = "earliest"
        else:  # nothing stored: read nothing, whatever arrives meanwhile
            options["startingOffsets"] = "latest"
        return options

    _run(spark, opts, options_for, topics, res, on_table,
         driver_reads=opts.driver_read_bytes > 0 and _local_master(spark) and res.rows_planned <= DRIVER_READ_RECORDS)
    res.seconds = time.perf_counter() - t0
    return res


# ---- small exports: read by the driver ---------------------------------------------------
# Spark reads a Python data source through Python processes it starts one after the other, each a new interpreter
# importing PySpark and txmq: finding data sources, creating the source, planning its read, then the workers reading
# it (and the same again for the messages table's writing tasks). On 2 busy cores that took 15 to 25 s of an export
# of 1,000 records, whatever their number. A small export on a local master is read by the driver instead, with the
# same reader: the messages table written from its Arrow batches by the driver (as a task writes it), the
# transactions table computed by Spark from a DataFrame made of the batches (spark.createDataFrame: no Python worker).
def _local_master(spark) -> bool:
    """Whether Spark runs in this process's JVM alone (local, local[N]; not local-cluster, whose executors are other
    JVMs: there the reading stays theirs)."""
    master = spark.sparkContext.master
    return master == "local" or master.startswith("local[")


def read_in_driver(options: dict[str, str], max_bytes: int):
    """The txmq source's rows for `options` as one Arrow table, read in this process; None when they would take more
    than max_bytes (the caller then lets Spark read them)."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema

    from .schema import messages_schema

    schema = messages_schema()
    arrow_schema = to_arrow_schema(schema, timezone="UTC")
    reader = TxmqDataSource(options).reader(schema)
    batches, size = [], 0
    for part in reader.partitions():
        for batch in reader.read(part):
            if not batch.num_rows:
                continue
            batch = batch.cast(arrow_schema) if batch.schema != arrow_schema else batch
            size += batch.nbytes
            if size > max_bytes:
                return None
            batches.append(batch)
    # at least one (empty) batch: PySpark cannot make a DataFrame of a table without chunks
    return pa.Table.from_batches(batches or [pa.RecordBatch.from_pylist([], schema=arrow_schema)], arrow_schema)


def _run(spark, opts: ExportOptions, options_for: Callable[..., dict[str, str]], topics: tuple[str, ...],
         res: ExportResult, on_table: Callable[[str], None] | None, damage_dir: str | None = None,
         driver_reads: bool = False) -> None:
    """Write the tables and the report from the source options_for(**extra) gives, staged where the output is local.
    driver_reads: the export is small enough for the driver to read (above, "small exports")."""
    # The first registration in a session is also its first SQL work (0.7 s on 2 cores): made when a table first
    # loads the source, so that the messages table written from Arrow (which needs none) starts without waiting for it.
    registering = threading.Lock()
    registered: list[bool] = []

    def load(**extra):
        options = options_for(**extra)
        if driver_reads:
            table = read_in_driver(options, opts.driver_read_bytes)
            if table is not None:
                from .schema import messages_schema

                return spark.createDataFrame(table, schema=messages_schema())
        with registering:  # the tables load side by side
            if not registered:
                spark.dataSource.register(TxmqDataSource)
                registered.append(True)
        return spark.read.format("txmq").options(**options).load()

    staging = staging_path(opts)
    if staging:
        shutil.rmtree(staging, ignore_errors=True)  # left by a process killed with SIGKILL that had our pid
        os.makedirs(os.path.dirname(staging), exist_ok=True)
    write_opts = replace(opts, out=staging, mode="error") if staging else opts
    try:
        _export_tables(spark, opts, write_opts, load, options_for, topics, res, on_table, driver_reads)
        _write_report(opts, load, topics, res, on_table)
        if damage_dir:
            res.damaged = read_damage_reports(damage_dir)
        if staging:
            _publish(staging, opts)
    except BaseException:  # a failure or Ctrl-C leaves no partial output behind
        if staging:
            _cancel(spark, opts.tables)  # tasks still writing would recreate it
        raise
    finally:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)


def staging_path(opts: ExportOptions) -> str | None:
    """Where a local export writes before it is complete: OUT.tmp-<pid> beside OUT (None: written in place)."""
    if "://" in opts.out or opts.mode == "append":
        return None
    return f"{os.path.abspath(opts.out).rstrip(os.sep)}.tmp-{os.getpid()}"


def _publish(staging: str, opts: ExportOptions) -> None:
    """Rename the complete tables into place (OUT itself when it does not exist yet)."""
    if not os.path.exists(opts.out):
        os.rename(staging, opts.out)
        return
    for table in opts.tables:
        src, dst = os.path.join(staging, table), table_path(opts.out, table)
        if os.path.exists(dst):
            if opts.mode == "error":
                raise FileExistsError(f"{dst} already exists: use --mode overwrite or --mode append")
            os.rename(dst, src + ".old")  # removed with the staging folder
        os.rename(src, dst)


def arrow_writes_messages(opts: ExportOptions, codec_name: str | None) -> bool:
    """Whether the messages table is written by the executors from Arrow batches (spark/arrowwrite.py) under the
    session's Parquet codec `codec_name` (None: Spark's default); where not, Spark's writer writes it."""
    from . import arrowwrite

    return opts.parquet_writer == "arrow" and arrowwrite.applies(opts.fmt, opts.partition_by, opts.out, codec_name)


def _write_arrow(spark, options: dict[str, str], opts: ExportOptions, in_driver: bool = False) -> int:
    """The messages table written by the executors (in_driver: by this process) from Arrow batches (where
    arrow_writes_messages): the rows written."""
    from . import arrowwrite
    from .schema import messages_schema

    path = table_path(opts.out, "messages")
    local = arrowwrite.local_folder(path)
    assert local is not None
    if opts.mode == "error" and os.path.exists(local):
        raise FileExistsError(f"{path} already exists: use --mode overwrite or --mode append")
    if opts.mode == "overwrite":
        shutil.rmtree(local, ignore_errors=True)
    return arrowwrite.write(spark, options, messages_schema(), local, no_dictionary=("body",), in_driver=in_driver)


def _cancel(spark, tables: tuple[str, ...]) -> None:
    """Cancel the export's Spark jobs (its tables' job groups), not other work sharing the session."""
    for table in tables:
        try:
            spark.sparkContext.cancelJobGroup(f"txmq-{table}")
        except BaseException:  # the JVM is going away (Ctrl-C): nothing is left to cancel
            pass


def _export_tables(spark, opts: ExportOptions, write_opts: ExportOptions, load, options_for, topics: tuple[str, ...],
                   res: ExportResult, on_table: Callable[[str], None] | None, driver_reads: bool = False) -> None:
    """Write the tables, side by side when there are two, each in a thread of its own.

    The messages table keeps the executors' Python busy, the transactions table is mostly the driver's: planning, the
    aggregation's code generation and, in a fresh session, the start of Spark's Python planners. Run one after the
    other they add up; side by side a 1,000,000-record export took 0.7 s less on 2 cores. Each runs in its own Spark
    job group (named ``txmq-<table>``: progress displays tell the stages apart). A failure cancels the other table.
    """

    def one(table: str) -> TableResult:
        # In a thread of its own: the job group is the JVM thread's, and PySpark reuses JVM threads for other Python
        # threads, the caller's among them (their jobs would join the export's group): cleared when the table is done.
        spark.sparkContext.setJobGroup(f"txmq-{table}", f"txmq spark-export: {table}")
        try:
            return write_table(table)
        finally:
            spark.sparkContext._jsc.clearJobGroup()

    def write_table(table: str) -> TableResult:
        t1 = time.perf_counter()
        if table == "messages":
            filters = {"topics": ",".join(topics)} if topics else {}
            if opts.since_ms is not None:
                filters["since"] = str(opts.since_ms)
            if opts.until_ms is not None:
                filters["until"] = str(opts.until_ms)
            if arrow_writes_messages(write_opts, spark.conf.get(CODEC_CONF, None)):
                rows = _write_arrow(spark, options_for(**filters), write_opts, in_driver=driver_reads)
            else:
                _, rows = _write(load(**filters), table, write_opts)
        else:
            df = _filter_transactions(transactions(load(kinds=",".join(TX_KINDS))), opts, topics)
            _, rows = _write(df, table, write_opts)
        return TableResult(table, table_path(opts.out, table), rows, time.perf_counter() - t1)

    if on_table:
        for table in opts.tables:
            on_table(table)
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    pool = ThreadPoolExecutor(max_workers=len(opts.tables), thread_name_prefix="txmq-export")
    futures = [pool.submit(one, t) for t in opts.tables]
    waiting = True
    try:
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        res.tables.extend(f.result() for f in futures)
    except KeyboardInterrupt:
        # Not waiting for the tables' threads: a table still being planned (Spark's Python planners cannot be
        # cancelled) held Ctrl-C up for seconds. The caller ends Spark (the CLI kills its JVM), which ends them.
        waiting = False
        _cancel(spark, opts.tables)
        raise
    except BaseException:
        _cancel(spark, opts.tables)  # the other table stops too
        raise
    finally:
        pool.shutdown(wait=waiting, cancel_futures=True)


def _write_report(opts: ExportOptions, load, topics: tuple[str, ...], res: ExportResult,
                  on_table: Callable[[str], None] | None) -> None:
    """The transactions report (spark/report.py) at opts.report, written whole (a temporary file renamed)."""
    if not opts.report:
        return
    from . import report

    if on_table:
        on_table("report")
    records = load(kinds=",".join(TX_KINDS))
    figs = report.figures(records, _filter_transactions(transactions(records), opts, topics))
    meta = {"source": f"broker {opts.broker}" if opts.broker else opts.data_dir, "topics": list(topics) or "all",
            "since_ms": opts.since_ms, "until_ms": opts.until_ms,
            "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    doc = report.render(figs, "txmq transactions", meta)
    tmp = f"{opts.report}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(doc)
    os.replace(tmp, opts.report)
    res.report = figs


def _filter_transactions(df, opts: ExportOptions, topics: tuple[str, ...]):
    """Transactions whose real topic is one of topics and whose first half is in [since, until)."""
    from pyspark.sql import functions as F

    if topics:
        df = df.where(F.col("real_topic").isin(*topics))
    at = F.unix_millis(F.col("first_half_at"))
    if opts.since_ms is not None:
        df = df.where(at >= F.lit(opts.since_ms))
    if opts.until_ms is not None:
        df = df.where(at < F.lit(opts.until_ms))
    return df


# ---- --follow: keep the tables current from the broker's streams -------------------------
@dataclass
class FollowResult:
    rows: dict[str, int] = field(default_factory=dict)  # rows written (messages) / events folded (transactions), this run
    batches: int = 0
    seconds: float = 0.0


def follow(spark, opts: ExportOptions, checkpoint: str, interval_s: float = 1.0, stop=None,
           on_batch: Callable[[str, int], None] | None = None) -> FollowResult:
    """Stream the broker into the tables under opts.out until stop() is true (or Ctrl-C); resumes from checkpoint.

    `messages` is appended by Spark's file sink (exactly once per row, from
    the checkpoint); `transactions` is kept current from the
    transaction_events stream (``transactions.current_transactions``).
    """
    from .transactions import current_transactions

    check_options(opts)
    if opts.broker is None:
        raise ValueError("--follow reads through a broker: give --broker")
    fmt = export_format(opts.fmt)
    if "transactions" in opts.tables and not fmt.follow_transactions:
        raise ValueError("--follow keeps the transactions table in parquet: use --format parquet or --table messages")
    spark.dataSource.register(TxmqDataSource)
    t0 = time.perf_counter()
    res = FollowResult(rows=dict.fromkeys(opts.tables, 0))
    topics = tuple(sorted({canonical_topic(t) for t in opts.topics}))
    base = {**broker_options(opts), "startingOffsets": "earliest"}
    if topics:
        base["topics"] = ",".join(topics)
    queries = []
    try:
        if "messages" in opts.tables:
            df = spark.readStream.format("txmq").options(**base).load()
            if opts.since_ms is not None:
                df = df.where(f"stored_at >= timestamp_millis({int(opts.since_ms)})")
            if opts.until_ms is not None:
                df = df.where(f"stored_at < timestamp_millis({int(opts.until_ms)})")
            cols = partition_columns("messages", opts.partition_by)
            if "date" in cols:
                from pyspark.sql import functions as F

                df = df.withColumn("date", F.to_date(F.col("stored_at")))
            w = (_for_format(df, fmt.name).writeStream.format(fmt.name).option("path", table_path(opts.out, "messages"))
                 .option("checkpointLocation", os.path.join(checkpoint, "messages")).trigger(processingTime=f"{interval_s} seconds"))
            if cols:
                w = w.partitionBy(*cols)
            if fmt.options:
                w = w.options(**fmt.options)
            queries.append(("messages", w.start()))
        if "transactions" in opts.tables:
            ev = spark.readStream.format("txmq").options(**base).option("table", "transaction_events").load()
            path = table_path(opts.out, "transactions")

            def fold(batch, batch_id: int) -> None:
                current_transactions(spark, batch, path)

            queries.append(("transactions", ev.writeStream.foreachBatch(fold)
                            .option("checkpointLocation", os.path.join(checkpoint, "transactions"))
                            .trigger(processingTime=f"{interval_s} seconds").start()))
        seen: dict[str, set] = {name: set() for name, _ in queries}

        def account() -> None:
            """Count the micro-batches finished since the last look (each once)."""
            for name, q in queries:
                for p in q.recentProgress:
                    if p["batchId"] not in seen[name] and p["numInputRows"]:
                        seen[name].add(p["batchId"])
                        res.rows[name] += p["numInputRows"]
                        res.batches += 1
                        if on_batch:
                            on_batch(name, p["numInputRows"])

        try:
            while True:
                for _, q in queries:
                    if q.exception() is not None:
                        raise RuntimeError(str(q.exception()))
                account()
                if stop is not None and stop():
                    break
                time.sleep(0.2)
        except KeyboardInterrupt:  # the way to stop following: the checkpoint has where to resume
            pass
    finally:
        for _, q in queries:
            try:
                q.stop()
            except BaseException:
                pass
        res.seconds = time.perf_counter() - t0
    try:  # what finished between the last look and the stop is in the sink: count it too
        account()
    except Exception:
        pass
    return res
