"""txmq spark-export: the commit log as `messages` and `transactions` tables, through Spark.

pyspark is imported only inside the command, so `txmq --help` stays fast and
the rest of the CLI works without the `spark` extra.
"""

from __future__ import annotations

import signal
import threading
import time
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from txmq.spark.formats import DEFAULT_FORMAT, EXPORT_FORMATS, format_help

from .. import exitcodes
from ..common import CliError, OutputOpt, parse_duration
from ..console import Output, default_output, emit_document, err, esc, out

if TYPE_CHECKING:  # the export (pyspark, the store) is imported only when the command runs
    from txmq.spark.export import ExportOptions, ExportResult
    from txmq.spark.session import Session


# --format's choices: the export's formats (txmq.spark.formats, pyspark-free), in their order
Format = Enum("Format", [(f.name, f.name) for f in EXPORT_FORMATS], type=str, module=__name__)


class Table(str, Enum):
    messages = "messages"
    transactions = "transactions"
    all = "all"


class Mode(str, Enum):
    error = "error"
    overwrite = "overwrite"
    append = "append"


class ParquetWriter(str, Enum):
    arrow = "arrow"
    spark = "spark"


EPILOG = (
    "Examples:\n\n"
    "  txmq spark-export --data-dir /var/lib/txmq --out /tmp/txmq-tables\n\n"
    "  txmq spark-export --out out/ --table transactions --since 24h --format csv --mode overwrite\n\n"
    "  txmq spark-export --out out/ --topic orders --partition-by date -o json | jq .tables\n\n"
    "  txmq spark-export --data-dir /mnt/shared/txmq --out hdfs:///txmq --master yarn --conf spark.executor.instances=8\n\n"
    "Needs pyspark (pip install 'txmq\\[spark]') and Java 17+. See docs/spark.md for the table schemas."
)


def register(app: typer.Typer) -> None:
    app.command("spark-export", epilog=EPILOG)(spark_export)


def parse_when(text: str, now: float | None = None) -> int:
    """ms since the epoch from an ISO date/time (naive = local time) or a duration meaning "that long ago"."""
    s = text.strip()
    iso = s[:-1] + "+00:00" if s.endswith(("Z", "z")) else s
    try:
        # a bare number is seconds ago, as in every duration; Python also reads 20240501 as a date
        dt = None if s.replace(".", "", 1).isdigit() else datetime.fromisoformat(iso)
    except ValueError:
        dt = None
    if dt is not None:
        if dt.tzinfo is None:
            dt = dt.astimezone()  # a naive time is local time
        return int(dt.timestamp() * 1000)
    ago = s[: -len("ago")].strip() if s.endswith("ago") else s
    try:
        seconds = parse_duration(ago)
    except CliError:
        raise CliError(
            f"bad time {text!r}: use an ISO date or time (2024-05-01, 2024-05-01T12:00:00Z) or a duration ago (30m, 2h, 7d)",
            exitcodes.USAGE,
        ) from None
    return int(((time.time() if now is None else now) - seconds) * 1000)


def parse_conf(items: list[str]) -> dict[str, str]:
    conf = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CliError(f"bad --conf {item!r}: expected KEY=VALUE, e.g. spark.executor.memory=4g", exitcodes.USAGE)
        conf[key.strip()] = value
    return conf


def _split(items: list[str] | None) -> tuple[str, ...]:
    return tuple(x.strip() for item in items or [] for x in item.split(",") if x.strip())


def spark_export(
    out_path: Annotated[str, typer.Option("--out", help="Output folder (or URI, e.g. hdfs:///txmq): one folder per table under it.", show_default=False)],
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir", "-d", envvar="TXMQ_DATA_DIR", help="Data directory to read (default ~/.local/share/txmq). On a cluster it must be mounted at this path on every executor.", show_default=False)] = None,
    fmt: Annotated[Format, typer.Option("--format", help=format_help())] = Format[DEFAULT_FORMAT],
    table: Annotated[Table, typer.Option("--table", help="messages, transactions or all.")] = Table.all,
    master: Annotated[str, typer.Option("--master", help="Spark master: local[*] (embedded), local[N], spark://HOST:7077, yarn, k8s://...")] = "local[*]",
    since: Annotated[Optional[str], typer.Option("--since", help="Records stored at or after: ISO date/time (local time unless it has an offset) or a duration ago (1h, 7d).", show_default=False)] = None,
    until: Annotated[Optional[str], typer.Option("--until", help="Records stored before: same forms as --since.", show_default=False)] = None,
    topic: Annotated[Optional[list[str]], typer.Option("--topic", "-t", help="Only this topic (repeatable): its records and the transaction records whose real topic it is.", show_default=False)] = None,
    partition_by: Annotated[Optional[list[str]], typer.Option("--partition-by", help="Partition the output by these columns (repeatable or comma-separated): date, topic, or any column.", show_default=False)] = None,
    mode: Annotated[Mode, typer.Option("--mode", help="If a table folder exists: error, overwrite or append.")] = Mode.error,
    conf: Annotated[Optional[list[str]], typer.Option("--conf", "-c", help="Spark setting KEY=VALUE for the session (repeatable), e.g. spark.executor.memory=4g.", show_default=False)] = None,
    partition_bytes: Annotated[str, typer.Option("--partition-bytes", help="Commit-log bytes per read partition.")] = "64MiB",
    skip_damaged: Annotated[bool, typer.Option("--skip-damaged", help="Skip damaged records (listed in the summary) instead of failing at the first one.")] = False,
    # Named apart from the other commands' `broker`: a context's or TXMQ_BROKER's broker must not turn a data-directory
    # export into a read through a broker; only --broker on the command line does.
    via_broker: Annotated[Optional[str], typer.Option("--broker", "-b", help="Read through this broker (HOST:PORT) over the wire protocol instead of a data directory: executors need not see it. Only this option chooses it (not a context or TXMQ_BROKER).", show_default=False)] = None,
    token: Annotated[Optional[str], typer.Option("--token", envvar="TXMQ_AUTH_TOKEN", help="With --broker: the broker's auth token.", show_default=False)] = None,
    follow: Annotated[bool, typer.Option("--follow", help="With --broker: keep the tables current as messages arrive, until Ctrl-C; resumes from --checkpoint.")] = False,
    checkpoint: Annotated[Optional[Path], typer.Option("--checkpoint", help="With --follow: where the streams keep their offsets (a restart resumes there).", show_default=False)] = None,
    report: Annotated[Optional[Path], typer.Option("--report", help="Also write a self-contained HTML report of the transactions (charts need the report extra: matplotlib).", show_default=False)] = None,
    interval: Annotated[float, typer.Option("--interval", help="With --follow: seconds between micro-batches.")] = 1.0,
    parquet_writer: Annotated[ParquetWriter, typer.Option("--parquet-writer", help="arrow: the executors write the messages table's Parquet straight from Arrow batches (without --partition-by, to a local or mounted --out; else Spark's writer); spark: always Spark's writer.")] = ParquetWriter.arrow,
    output: OutputOpt = None,
) -> None:
    """Export the commit log as [key]messages[/key] and [key]transactions[/key] tables with PySpark."""
    _require_spark()
    output = output or default_output()
    broker = via_broker
    if follow and broker is None:
        raise CliError("--follow reads through a broker: give --broker HOST:PORT", exitcodes.USAGE)
    if follow and checkpoint is None:
        raise CliError("--follow needs --checkpoint DIR (where the streams keep their offsets)", exitcodes.USAGE)
    if follow and report is not None:
        raise CliError("--report is for a one-off export, not --follow", exitcodes.USAGE)
    if not follow and checkpoint is not None:
        raise CliError("--checkpoint is for --follow", exitcodes.USAGE)
    if follow and not 0.1 <= interval <= 86400:
        raise CliError("--interval must be between 0.1 and 86400 seconds", exitcodes.USAGE)
    opts = _export_options(out_path, data_dir, fmt, table, since, until, topic, partition_by,
                           Mode.append if follow else mode, partition_bytes, skip_damaged, broker, token, report,
                           parquet_writer.value)
    _check_export_options(opts)
    spark_conf = parse_conf(conf or [])
    t0 = time.perf_counter()
    if follow:
        assert checkpoint is not None
        _follow_with_spark(opts, master, spark_conf, str(checkpoint.expanduser().absolute()), interval, output, t0)
        return
    result, startup_s = _export_with_spark(opts, master, spark_conf)
    _report(_summary(opts, master, result, startup_s, time.perf_counter() - t0), output)


def _follow_with_spark(opts: ExportOptions, master: str, spark_conf: dict[str, str], checkpoint: str, interval: float,
                       output: Output, t0: float) -> None:
    """Run the streams until Ctrl-C, printing each micro-batch on stderr; then the summary (exit 0)."""
    from txmq.spark.export import follow, table_path

    _quiet_py4j()
    session = _start_spark(master, spark_conf)
    stopping = threading.Event()
    result = None

    def on_batch(table: str, rows: int) -> None:
        err.print(f"{table}: +{rows:,} {'rows' if table == 'messages' else 'events'}")

    # Ctrl-C sets the flag the loop looks at between micro-batches, rather than interrupting a call into Spark
    # anywhere (the summary would then miss the tables); the default handler is back once the streams stop. The
    # streams get FOLLOW_STOP_S to stop in order; then the JVM is killed (a micro-batch still being planned held the
    # stop up for seconds). Either way the checkpoint holds where the next run resumes: a batch cut short is read again.
    killer = threading.Timer(FOLLOW_STOP_S, session.kill)
    killer.daemon = True

    def on_ctrl_c(*_) -> None:
        if not stopping.is_set():
            stopping.set()
            killer.start()

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        try:
            result = follow(session.spark, opts, checkpoint, interval, stop=stopping.is_set, on_batch=on_batch)
        except KeyboardInterrupt:
            stopping.set()
        except (ValueError, FileExistsError) as e:
            raise CliError(str(e), exitcodes.USAGE) from None
        except Exception as e:
            if not stopping.is_set():  # after Ctrl-C: the JVM killed while the streams stopped, not a failure
                hint = f" (Spark's log: {session.log_path})" if session.log_path else ""
                raise CliError(f"spark-export --follow failed: {spark_error(e)}{hint}") from None
    finally:
        signal.signal(signal.SIGINT, previous)
        try:
            if session.archive_recording is None:
                session.kill()  # the streams have stopped: nothing is left to stop in order
                killer.cancel()
            else:  # the JVM must exit normally to write the class-data archive
                _stop_spark(session, exported=True)
        except (Exception, KeyboardInterrupt):
            pass
    s = {"broker": opts.broker, "out": opts.out, "format": opts.fmt, "master": master, "checkpoint": checkpoint,
         "follow": True, "batches": result.batches if result else 0,
         "tables": {t: {"path": table_path(opts.out, t), "rows" if t == "messages" else "events": n}
                    for t, n in (result.rows.items() if result else ())},
         "spark_startup_s": round(session.startup_s, 3), "total_s": round(time.perf_counter() - t0, 3)}
    if not emit_document(s, output):
        out.print(f"followed {esc(str(opts.broker))} -> {esc(opts.out)} for {s['total_s']:.1f}s; "
                  f"resume with the same --checkpoint {esc(checkpoint)}")


FOLLOW_STOP_S = 0.5  # after Ctrl-C, --follow's streams get this long to stop before the JVM is killed


def _require_spark() -> None:
    """pyspark and Java must be there (exit 9), before anything imports pyspark."""
    from txmq.spark import session as sess

    problem = sess.missing_dependency()
    if problem is None:
        problem = sess.missing_java()
    if problem is not None:
        raise CliError(problem, exitcodes.MISSING_DEPENDENCY)


def _export_options(out_path: str, data_dir: Optional[Path], fmt: Format, table: Table, since: Optional[str], until: Optional[str],
                    topic: Optional[list[str]], partition_by: Optional[list[str]], mode: Mode, partition_bytes: str,
                    skip_damaged: bool, broker: Optional[str] = None, token: Optional[str] = None,
                    report: Optional[Path] = None, parquet_writer: str = "arrow") -> ExportOptions:
    """The command's options as the export's ExportOptions: paths made absolute, times and sizes parsed (exit 2)."""
    from txmq.broker.config import default_data_dir
    from txmq.spark.export import ExportOptions
    from txmq.spark.options import parse_size

    try:
        pbytes = parse_size(partition_bytes)
    except ValueError as e:
        raise CliError(str(e), exitcodes.USAGE) from None
    return ExportOptions(
        data_dir=str((data_dir or default_data_dir()).expanduser().absolute()),
        out=_out_folder(out_path),
        fmt=fmt.value,
        tables=("messages", "transactions") if table is Table.all else (table.value,),
        since_ms=parse_when(since) if since else None,
        until_ms=parse_when(until) if until else None,
        topics=_split(topic),
        partition_by=_split(partition_by),
        mode=mode.value,
        partition_bytes=max(pbytes, 4096),
        skip_damaged=skip_damaged,
        broker=broker,
        token=token,
        report=str(report.expanduser().absolute()) if report else None,
        parquet_writer=parquet_writer,
    )


def _out_folder(out_path: str) -> str:
    """--out as the export takes it: a local path made absolute (also from a file: URI without a host, so that it is
    staged and checked as a local folder is), any other URI as it is."""
    from txmq.spark.arrowwrite import local_folder

    if out_path.startswith("file:"):
        return local_folder(out_path) or out_path
    return out_path if "://" in out_path else str(Path(out_path).expanduser().absolute())


def _check_export_options(opts: ExportOptions) -> None:
    """Before Spark starts: the options agree (exit 2), the data directory holds a commit log (exit 5), a table folder that
    --mode error would refuse is not there yet (exit 2)."""
    from txmq.spark.export import check_options

    try:
        check_options(opts)
    except FileNotFoundError as e:
        raise CliError(str(e), exitcodes.NOT_FOUND) from None
    except (ValueError, FileExistsError) as e:
        raise CliError(str(e), exitcodes.USAGE) from None


def _export_with_spark(opts: ExportOptions, master: str, spark_conf: dict[str, str]) -> tuple[ExportResult, float]:
    """Start Spark, export the tables, stop Spark, with a progress display on a terminal: (the export's result, Spark's
    start-up seconds). Ctrl-C ends it with one line, no py4j traceback and no temporary output left (exit 130)."""
    progress = _Progress(enabled=err.is_terminal)
    progress.begin("starting Spark")
    _quiet_py4j()
    try:
        session = _start_spark(master, spark_conf, quick_jit=_quick_jit(opts, master, spark_conf))  # Ctrl-C: JVM ended
        try:
            progress.watch(session.spark)
            result = _export_tables(session, opts, progress)
        except KeyboardInterrupt:  # the JVM and its workers killed, not stopped in order (that waited for them)
            progress.stop()
            session.kill()
            raise
        except BaseException:
            progress.stop()
            _stop_spark(session, exported=False)
            raise
        progress.stop()
        _stop_spark(session, exported=True)
    except KeyboardInterrupt:
        progress.stop()
        _clean_up_interrupted(opts)
        raise
    finally:
        progress.stop()
    return result, session.startup_s


def _quick_jit(opts: ExportOptions, master: str, spark_conf: dict[str, str]) -> bool:
    """Whether the driver JVM only plans and aggregates (the bulk written from Arrow by the Python workers), so that a
    quicker JIT start beats peak speed: an embedded master, a one-off export, the messages table not in Spark's writer
    (which also writes it when --conf names a Parquet codec pyarrow does not write)."""
    from txmq.spark.arrowwrite import CODEC_CONF
    from txmq.spark.export import arrow_writes_messages
    from txmq.spark.session import is_local

    return is_local(master) and ("messages" not in opts.tables or arrow_writes_messages(opts, spark_conf.get(CODEC_CONF)))


def _start_spark(master: str, spark_conf: dict[str, str], quick_jit: bool = False) -> Session:
    """Spark on master with the --conf settings; a failure to start is one error with the end of Spark's log."""
    from txmq.spark import session as sess

    try:
        return sess.start(master, spark_conf, archive=True, quick_jit=quick_jit)
    except sess.SparkStartError as e:
        lines = [ln for ln in e.log.splitlines() if ln.strip() and not ln.strip().startswith("at ")]
        log = "".join(f"\n  {ln.strip()}" for ln in lines[-8:])
        raise CliError(f"could not start Spark (master {master}): {e.message}{log}") from None
    except Exception as e:
        raise CliError(f"could not start Spark (master {master}): {_first_line(e)}") from None


def _export_tables(session: Session, opts: ExportOptions, progress: _Progress) -> ExportResult:
    """Run the export; a failure is one line (Spark's informative one) with where Spark's log is."""
    from txmq.spark.export import export

    try:
        return export(session.spark, opts, on_table=progress.table)
    except FileExistsError as e:  # created by someone else since the check
        raise CliError(str(e), exitcodes.USAGE) from None
    except KeyboardInterrupt:
        raise
    except Exception as e:
        hint = f" (Spark's log: {session.log_path})" if session.log_path else ""
        why = spark_error(e)
        if "CorruptRecordError" in why:
            hint += "; --skip-damaged exports every other record and lists the damaged ones"
        raise CliError(f"spark-export failed: {why}{hint}") from None


def _stop_spark(session: Session, exported: bool) -> None:
    """Stop Spark; after an export, also remove its temporary files. After a failure (or Ctrl-C) that failure is the one
    reported, not the stop's."""
    from txmq.spark import session as sess

    if session.archive_recording is not None and err.is_terminal:
        err.print("[dim]saving Spark's class-data archive: later runs start faster (once per Java and PySpark version;"
                  " Ctrl-C skips it)[/dim]")
    try:
        session.stop(final=True)  # the command starts no other session: the JVM may end (and write its class archive)
    except KeyboardInterrupt:  # Ctrl-C while Spark stops: the tables are in place (or the failure is reported)
        session.kill()
    except Exception:
        if exported:
            raise
    if exported:
        sess.cleanup(session)


def _clean_up_interrupted(opts: ExportOptions) -> None:
    """After Ctrl-C: remove the export's staging output and say what is left in --out."""
    from txmq.spark.export import staging_path

    staging = staging_path(opts)
    if staging:  # again, now that Spark is stopped: a task may have written after the first removal
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    err.print(f"[warn]interrupted: nothing written to {esc(str(opts.out))}[/warn]" if opts.mode != "append"
              else f"[warn]interrupted: {esc(str(opts.out))} may hold part of the appended rows[/warn]")


def _quiet_py4j() -> None:
    """py4j logs a traceback when Ctrl-C cuts a call to the JVM: the CLI says it in one line instead."""
    import logging

    for name in ("py4j", "py4j.java_gateway", "py4j.clientserver"):
        lg = logging.getLogger(name)
        lg.addHandler(logging.NullHandler())
        lg.propagate = False
    # py4j also logs through the root logger (logging.exception): drop what comes from its files
    logging.getLogger().addFilter(lambda rec: "py4j" not in (rec.pathname or ""))


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:500]
    return text[:500]


def spark_error(e: BaseException) -> str:
    """The informative line of a Spark failure: a Python worker's exception, or the JVM's message. The log's damage
    found by this process (a small export is read by the driver) reads as a worker's would: with its class."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if type(e).__module__.startswith("txmq.store"):
        return f"{type(e).__module__}.{type(e).__qualname__}: {lines[0] if lines else ''}"[:500]
    if "Traceback (most recent call last):" in lines:  # raised in a Python worker: its last line
        tb = lines[lines.index("Traceback (most recent call last):") + 1 :]
        tb = [ln for ln in tb if not ln.startswith(("at ", "File ", "^", "~"))]
        for ln in reversed(tb):
            if ":" in ln and not ln.startswith(("org.apache", "java.", "scala.", "py4j")):
                return ln[:500]
    useful = [ln.lstrip(": ") for ln in lines if not ln.startswith(("at ", "An error occurred while calling"))]
    return (useful[0] if useful else type(e).__name__)[:500]


def _summary(opts, master: str, result, startup_s: float, total_s: float) -> dict[str, Any]:
    s = _summary_of(opts, master, result, startup_s, total_s)
    if opts.report:
        s["report"] = {"path": opts.report, "figures": result.report}
    return s


def _summary_of(opts, master: str, result, startup_s: float, total_s: float) -> dict[str, Any]:
    if opts.broker is not None:
        return {
            "broker": opts.broker, "out": opts.out, "format": opts.fmt, "master": master,
            "tables": {t.name: {"rows": t.rows, "path": t.path, "seconds": round(t.seconds, 3)} for t in result.tables},
            "queues": result.queues, "records": result.rows_planned, "partitions": result.partitions,
            "spark_startup_s": round(startup_s, 3), "export_s": round(result.seconds, 3), "total_s": round(total_s, 3),
        }
    return {
        "data_dir": opts.data_dir,
        "out": opts.out,
        "format": opts.fmt,
        "master": master,
        "tables": {t.name: {"rows": t.rows, "path": t.path, "seconds": round(t.seconds, 3)} for t in result.tables},
        "bytes_read": result.bytes_read,
        "log_bytes": result.log_bytes,
        "end_offset": result.end_offset,
        "segments": result.segments,
        "partitions": result.partitions,
        "spark_startup_s": round(startup_s, 3),
        "export_s": round(result.seconds, 3),
        "total_s": round(total_s, 3),
        "damaged_records": len(result.damaged),
        "damaged": result.damaged,
    }


def _report(s: dict[str, Any], output: Output) -> None:
    if emit_document(s, output):
        return
    from rich.table import Table as RichTable
    from rich.text import Text

    source = s.get("data_dir") or f"broker {s['broker']}"
    t = RichTable(box=None, header_style="bold", show_edge=False, title=Text(f"exported {source} -> {s['out']} ({s['format']})"))
    for name in ("table", "rows", "seconds", "path"):
        t.add_column(name, justify="right" if name in ("rows", "seconds") else "left")
    for name, info in s["tables"].items():
        t.add_row(name, f"{info['rows']:,}", f"{info['seconds']:.1f}", esc(str(info["path"])))
    out.print(t)
    if s.get("report"):
        from txmq.spark.report import text

        out.print(Text(text(s["report"]["figures"])))
        out.print(f"report: [key]{esc(s['report']['path'])}[/key]")
    if "broker" in s:
        out.print(f"read [key]{s['records']:,}[/key] records from {s['queues']} queues ({s['partitions']} partitions per pass) "
                  f"in [key]{s['total_s']:.1f}s[/key]: Spark start-up {s['spark_startup_s']:.1f}s, export {s['export_s']:.1f}s")
        return
    out.print(
        f"read [key]{_mib(s['bytes_read'])}[/key] ({s['segments']} segments, {s['partitions']} partitions per pass) "
        f"in [key]{s['total_s']:.1f}s[/key]: Spark start-up {s['spark_startup_s']:.1f}s, export {s['export_s']:.1f}s"
    )
    if s["damaged"]:
        shown = ", ".join(str(d["offset"]) for d in s["damaged"][:10]) + (", ..." if len(s["damaged"]) > 10 else "")
        err.print(f"[warn]skipped {len(s['damaged'])} damaged record(s) at log offset(s) {shown}: "
                  f"`txmq store verify` lists them[/warn]")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n:,} bytes"


class _Progress:
    """A rich progress display on stderr (terminals only), fed by Spark's status tracker."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._progress = None
        self._label = ""
        self._tasks: dict[int, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._phase = None

    def begin(self, text: str) -> None:
        if not self.enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=err, transient=True,
        )  # fmt: skip
        self._progress.start()
        self._phase = self._progress.add_task(text, total=None)

    def table(self, name: str) -> None:
        self._label = name
        if self._progress is not None and self._phase is not None:
            self._progress.update(self._phase, description=f"{name}: planning")

    def watch(self, spark) -> None:
        if self._progress is None:
            return
        if self._phase is not None:
            self._progress.update(self._phase, description="Spark started")
        tracker = spark.sparkContext.statusTracker()
        self._thread = threading.Thread(target=self._poll, args=(tracker,), name="txmq-spark-progress", daemon=True)
        self._thread.start()

    def _poll(self, tracker) -> None:
        p = self._progress
        while not self._stop.wait(0.25):
            try:
                active = set(tracker.getActiveStageIds())
                for sid, task in self._tasks.items():
                    if sid not in active:
                        p.update(task, completed=p.tasks[task].total or 0)
                for sid in active:
                    info = tracker.getStageInfo(sid)
                    if info is None:
                        continue
                    task = self._tasks.get(sid)
                    if task is None:
                        label = self._table_of(tracker, sid) or self._label
                        task = self._tasks[sid] = p.add_task(f"{label}: stage {sid}", total=info.numTasks)
                    p.update(task, total=info.numTasks, completed=info.numCompletedTasks)
            except Exception:  # the JVM is going away: stop quietly
                return

    @staticmethod
    def _table_of(tracker, stage_id: int) -> str | None:
        """The table whose job group (spark/export.py runs each table in txmq-<table>) holds the stage."""
        for table in ("messages", "transactions"):
            for job in tracker.getJobIdsForGroup(f"txmq-{table}"):
                info = tracker.getJobInfo(job)
                if info is not None and stage_id in info.stageIds:
                    return table
        return None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
