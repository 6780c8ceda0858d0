"""Starting a quiet SparkSession for `txmq spark-export`, and what it needs first.

Nothing here imports pyspark at module level: the CLI imports this module to
check the dependencies before Spark is touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

INSTALL_HINT = "install txmq with its spark extra: pip install '.[spark]' in a checkout, or 'dist/txmq-...whl[spark]' (README, Install)"
MIN_PYSPARK = (4, 0)

# WARN for Spark itself; the few warnings every local run prints are not worth showing.
LOG4J2 = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
logger.native.name = org.apache.hadoop.util.NativeCodeLoader
logger.native.level = error
logger.utils.name = org.apache.spark.util.Utils
logger.utils.level = error
logger.parquet.name = org.apache.parquet
logger.parquet.level = error
"""


def missing_dependency() -> str | None:
    """Why pyspark (with pyarrow) cannot be used, or None when it can."""
    if getattr(sys, "frozen", False):  # the single executable (docs/binary.md) never carries Spark's Python side
        return ("spark-export is not part of the single executable (it needs PySpark and Java 17+): install txmq with the spark "
                "extra, pip install 'dist/txmq-...whl[spark]' or '.[spark]' in a checkout (README, Install), and run "
                "`txmq spark-export --data-dir DIR --out OUT` there; it reads the same data directory")
    missing = []
    for mod in ("pyspark", "pyarrow"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        return f"spark-export needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed: {INSTALL_HINT}"
    import pyspark

    version = tuple(int(x) for x in pyspark.__version__.split(".")[:2] if x.isdigit())
    if version < MIN_PYSPARK:
        return f"spark-export needs pyspark 4.0 or newer (Python data sources), found {pyspark.__version__}: pip install -U 'txmq[spark]'"
    return None


def missing_java() -> str | None:
    """Why Spark's JVM cannot start, or None when a java is found (JAVA_HOME first, then PATH)."""
    home = os.environ.get("JAVA_HOME")
    if home:
        exe = Path(home) / "bin" / "java"
        if os.access(exe, os.X_OK):
            return None
        return f"JAVA_HOME is {home}, but {exe} is not there: point JAVA_HOME at a Java 17+ installation, or unset it to use the java on PATH"
    if shutil.which("java"):
        return None
    return (
        "spark-export needs Java 17 or newer (Spark runs on the JVM), and no `java` is on PATH and JAVA_HOME is not set: "
        "install a JDK/JRE (e.g. apt install openjdk-17-jre-headless) and put java on PATH or set JAVA_HOME"
    )


def is_local(master: str) -> bool:
    return master == "local" or master.startswith("local[") or master.startswith("local-cluster[")


def default_conf(master: str, log4j_path: str | None) -> dict[str, str]:
    conf = {
        "spark.app.name": "txmq spark-export",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.session.timeZone": "UTC",
    }
    if is_local(master):
        conf["spark.sql.shuffle.partitions"] = str(max(2, min(16, os.cpu_count() or 2)))
    if log4j_path:
        conf["spark.driver.extraJavaOptions"] = f"-Dlog4j2.configurationFile=file:{log4j_path}"
    return conf


class SparkStartError(Exception):
    """The SparkSession could not start; log is the end of the JVM's output."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(message)
        self.message = message
        self.log = log


@dataclass
class Session:
    spark: object  # pyspark.sql.SparkSession
    created: bool  # False when an active session was reused (then it is not stopped)
    startup_s: float
    log_path: str | None  # where the JVM's own output went, if redirected

    def stop(self) -> None:
        if self.created:
            self.spark.stop()  # type: ignore[attr-defined]


@contextlib.contextmanager
def _output_to(path: str) -> Iterator[None]:
    """Point fds 1 and 2 at path while the JVM starts: it inherits them, we get ours back."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def start(master: str, conf: dict[str, str] | None = None, quiet: bool = True) -> Session:
    """Reuse the active SparkSession, or start one: quiet logs, no UI, UTC session time zone.

    With quiet, the JVM's stdout/stderr (Spark's log, Python worker output)
    go to a file in a temp directory (Session.log_path) instead of the
    terminal, and the log level is WARN.
    """
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyspark\..*")
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return Session(active, False, 0.0, None)
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="txmq-spark-") if quiet else None
    log4j = log_path = None
    if tmp:
        log4j = os.path.join(tmp, "log4j2.properties")
        Path(log4j).write_text(LOG4J2)
        log_path = os.path.join(tmp, "spark.log")
    if is_local(master):
        # Python workers must import txmq: use this interpreter unless told otherwise.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    settings = {**default_conf(master, log4j), **(conf or {})}
    builder = SparkSession.builder.master(master)
    for k, v in settings.items():
        builder = builder.config(k, v)
    try:
        with _output_to(log_path) if log_path else contextlib.nullcontext():
            spark = builder.getOrCreate()
    except Exception as e:
        tail = log_tail(log_path)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        raise SparkStartError(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__, tail) from e
    spark.sparkContext.setLogLevel("WARN")
    return Session(spark, True, time.perf_counter() - t0, log_path)


def log_tail(path: str | None, lines: int = 20) -> str:
    """The last lines of the JVM's output file, for an error message."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def cleanup(session: Session) -> None:
    """Remove the temp directory holding the log4j config and the JVM output."""
    if session.log_path:
        shutil.rmtree(os.path.dirname(session.log_path), ignore_errors=True)
