"""Starting a quiet SparkSession for `txmq spark-export`, and what it needs first.

Nothing here imports pyspark at module level: the CLI imports this module to
check the dependencies before Spark is touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
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
        # the JVM's temporary files (Spark's local folders among them) in the folder of the log configuration, which
        # is removed at the end even when the JVM is killed (Ctrl-C) and its own clean-up never runs
        conf["spark.driver.extraJavaOptions"] = (f"-Dlog4j2.configurationFile=file:{log4j_path}"
                                                 f" -Djava.io.tmpdir={os.path.dirname(log4j_path)}")
    return conf


class SparkStartError(Exception):
    """The SparkSession could not start; log is the end of the JVM's output."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(message)
        self.message = message
        self.log = log


# ---- the driver JVM's class-data archive --------------------------------------------------------
# A Spark driver loads about 20,000 classes from some 250 jars on every start, and each lookup searches the jars in
# order: on a 2-core machine that is most of Spark's 3.5 s start-up and of the first query's warm-up. Java's
# application class-data sharing (AppCDS) maps the classes a previous run loaded from one archive instead. The first
# session started with archive=True records them (-XX:ArchiveClassesAtExit, written when the JVM exits: the caller's
# Session.stop(final=True) ends the JVM and publishes the file); later ones map it (-XX:SharedArchiveFile). An archive
# the JVM does not accept (another JVM build, another class path) is ignored by the JVM itself, which then runs as
# it would without one. The archive is named after what it depends on, so an upgrade of Java or PySpark makes a new one.
CLASS_ARCHIVE_ENV = "TXMQ_SPARK_CLASS_ARCHIVE"  # 0: never use or make one
_ARCHIVE_FLAGS = ("-Xshare", "SharedArchiveFile", "ArchiveClassesAtExit", "-XX:+RecordDynamicDumpInfo")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "txmq" / "spark"


def _java_executable() -> str | None:
    home = os.environ.get("JAVA_HOME")
    exe = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return os.path.realpath(exe) if exe and os.path.exists(exe) else None


def _spark_home() -> str:
    """The Spark installation whose jars the driver loads: SPARK_HOME when set, else PySpark's own."""
    import pyspark

    home = os.environ.get("SPARK_HOME")
    return home if home else str(Path(pyspark.__file__).parent)


def class_archive_path() -> Path | None:
    """Where this Java and this PySpark keep their archive (None: no java found)."""
    import hashlib

    import pyspark

    java = _java_executable()
    if java is None:
        return None
    jars = Path(_spark_home()) / "jars"
    try:
        names = sorted(os.listdir(jars))
    except OSError:
        names = []
    # the launcher, the JVM itself and its base archive (a dynamic archive extends it): a JDK updated in place
    # changes the last two, and the JVM would refuse the old archive on every run
    home = Path(java).parent.parent
    parts = [java, pyspark.__version__, str(jars), *names]
    for f in (Path(java), home / "lib" / "server" / "libjvm.so", home / "lib" / "server" / "classes.jsa"):
        try:
            st = os.stat(f)
        except OSError:
            continue
        parts += [str(f), str(st.st_mtime_ns), str(st.st_size)]
    key = "\0".join(parts)
    return cache_dir() / f"driver-{pyspark.__version__}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsa"


def archive_options(settings: dict[str, str]) -> tuple[str | None, Path | None, Path | None]:
    """(JVM flags to add, the archive being recorded (to publish), its final path) for a session with these settings."""
    if os.environ.get(CLASS_ARCHIVE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None, None, None
    if any(f in _java_options(settings) for f in _ARCHIVE_FLAGS):
        return None, None, None  # the user chose the JVM's sharing settings
    final = class_archive_path()
    if final is None:
        return None, None, None
    if final.is_file() and final.stat().st_size > 0:
        try:
            os.utime(final)  # in use: kept by other versions' clean-up
        except OSError:
            pass
        return f"-XX:SharedArchiveFile={final}", None, final
    if settings.get("spark.driver.extraClassPath"):
        return None, None, None  # an archive of that class path: every run without it would be refused it
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None, None, None
    if not os.access(final.parent, os.W_OK | os.X_OK):  # the JVM could not write it: every run would try again
        return None, None, None
    _remove_abandoned_recordings(final.parent)
    recording = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    if any(p != recording for p in final.parent.glob(f"{final.name}.tmp-*")):
        return None, None, None  # another export, still running, records it: this one need not pay for it too
    try:
        # claimed while this process records (the JVM writes the file as it exits): an empty file until then
        with open(recording, "wb"):
            pass
    except OSError:
        return None, None, None
    return f"-XX:ArchiveClassesAtExit={recording}", recording, final


def _java_options(settings: dict[str, str]) -> str:
    """The driver JVM's options the settings give (Spark puts defaultJavaOptions before extraJavaOptions)."""
    return f"{settings.get('spark.driver.defaultJavaOptions', '')} {settings.get('spark.driver.extraJavaOptions', '')}"


def _remove_abandoned_recordings(directory: Path) -> None:
    """Recordings whose process is gone (killed, or stopped without final=True) are never published."""
    for tmp in directory.glob("driver-*.jsa.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            tmp.unlink(missing_ok=True)


UNUSED_ARCHIVE_S = 7 * 86400  # another installation's archive not used for this long is removed
DYNAMIC_ARCHIVE_MAGIC = 0xF00BABA8  # the first 4 bytes (little-endian) of a dynamic class-data archive


def publish_archive(recording: Path, final: Path) -> bool:
    """Move a complete recording into place, removing archives no installation has used for a week."""
    try:
        with open(recording, "rb") as f:
            if int.from_bytes(f.read(4), "little") != DYNAMIC_ARCHIVE_MAGIC:
                return False
        now = time.time()
        for old in final.parent.glob("driver-*.jsa"):
            try:
                if old.name != final.name and now - old.stat().st_mtime > UNUSED_ARCHIVE_S:
                    old.unlink(missing_ok=True)
            except OSError:  # removed meanwhile (another export cleaning up), or not ours to remove
                pass
        os.replace(recording, final)  # readers map either the old file or the whole new one
        return True
    except OSError:
        return False
    finally:
        recording.unlink(missing_ok=True)


@dataclass
class Session:
    spark: object  # pyspark.sql.SparkSession
    created: bool  # False when an active session was reused (then it is not stopped)
    startup_s: float
    log_path: str | None  # where the JVM's own output went, if redirected
    archive_recording: Path | None = None  # the class-data archive this JVM writes when it exits
    archive_final: Path | None = None

    def stop(self, final: bool = False) -> None:
        """Stop Spark. final: this process starts no other session, so the JVM may exit now; it then writes the
        class-data archive it records (a few seconds, once per Java and PySpark version)."""
        if not self.created:
            return
        self.spark.stop()  # type: ignore[attr-defined]
        if final and self.archive_recording is not None and self.archive_final is not None:
            _exit_jvm(self.spark, self.archive_recording, self.archive_final)

    def kill(self) -> None:
        """End Spark at once (Ctrl-C; --follow once its streams have stopped): the driver JVM and every process under
        it (Python daemons and workers) are killed, not stopped in order. An orderly stop waits for running tasks, and Spark's Python planners cannot be
        cancelled: after Ctrl-C an export took up to 38 s to exit. No class-data archive is recorded. A session this
        did not create (reused) is left running."""
        if not self.created:
            return
        from pyspark import SparkContext

        server = getattr(SparkContext._active_spark_context, "_accumulatorServer", None)
        if server is not None:  # the JVM's connection to it ends with the JVM: no traceback on stderr for that
            server.handle_error = lambda *_: None
            server.server_shutdown = True
        proc = getattr(SparkContext._gateway, "proc", None)
        if proc is not None:
            end_process_tree(proc)
        _forget_spark()
        if self.archive_recording is not None:
            self.archive_recording.unlink(missing_ok=True)
        cleanup(self)  # the log and the JVM's temporary files: nothing names them after an interruption


def process_tree(root: int) -> list[int]:
    """root and every process under it, parents first (Linux: /proc; elsewhere root alone)."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return [root]
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    tree, i = [root], 0
    while i < len(tree):
        tree.extend(children.get(tree[i], ()))
        i += 1
    return tree


def process_running(pid: int) -> bool:
    """Whether pid is a process that still runs (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def end_process_tree(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGKILL proc (the driver JVM: it ignores SIGINT, PySpark starts it so) and every process under it, then wait
    until they are gone (bounded): none of them writes afterwards. The JVM's Python daemons would end on their own once
    it is gone, but a task's worker may still be writing output."""
    pids = process_tree(proc.pid)
    for pid in pids:  # parents first: the JVM starts no new worker meanwhile
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + timeout_s
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    for pid in pids[1:]:  # not our children: reaped by init, so watched for in /proc
        while process_running(pid) and time.monotonic() < deadline:
            time.sleep(0.01)


def _forget_spark() -> None:
    """Drop PySpark's handles on a JVM that is gone, so that nothing calls it and a new session starts a new one."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    SparkContext._gateway = None
    SparkContext._jvm = None
    SparkContext._active_spark_context = None
    SparkSession._instantiatedSession = None
    SparkSession._activeSession = None


def _spark_launches(before: set[int]) -> list[int]:
    """This process's children that were not in `before` and run Spark (spark-submit, or the JVM it became)."""
    found = []
    me = os.getpid()
    for pid in process_tree(me)[1:]:
        if pid in before:
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me and (b"spark-submit" in cmd or b"org.apache.spark" in cmd):
            found.append(pid)
    return found


def _children() -> set[int]:
    me = os.getpid()
    return {pid for pid in process_tree(me) if pid != me}


def _exit_jvm(spark, recording: Path, final: Path, timeout_s: float = 120.0) -> None:
    """End the driver JVM (it writes the archive as it exits), wait for it, then publish the archive. Ctrl-C while
    it writes (or a JVM that takes longer than timeout_s) ends the JVM at once, without an archive: the next run
    records one."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if proc is None:
        recording.unlink(missing_ok=True)
        return
    code = None
    try:
        try:
            spark._jvm.java.lang.System.exit(0)  # type: ignore[attr-defined]
        except Exception:
            pass  # the connection ends with the JVM
        code = proc.wait(timeout=timeout_s)
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        end_process_tree(proc)  # the JVM ignores SIGINT (PySpark starts it so): it would go on writing after we are gone
    finally:
        SparkContext._gateway = None
        SparkContext._jvm = None
        if code == 0:  # an archive is complete only once the JVM has exited normally
            publish_archive(recording, final)
        else:
            recording.unlink(missing_ok=True)


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


def driver_settings(defaults: dict[str, str], conf: dict[str, str], archive: bool = False, quick_jit: bool = False
                    ) -> tuple[dict[str, str], Path | None, Path | None]:
    """(the session's settings, the class-data archive being recorded, its final path): conf over the defaults, with
    the driver JVM's options of both kept (the log configuration, then the user's), and those `start` adds."""
    settings = {**defaults, **conf}
    key = "spark.driver.extraJavaOptions"
    if key in defaults and key in conf:
        settings[key] = f"{defaults[key]} {conf[key]}".strip()
    flag, recording, final = archive_options(settings) if archive else (None, None, None)
    if quick_jit and "Tiered" not in _java_options(settings):
        flag = f"{flag or ''} -XX:TieredStopAtLevel=1".strip()
    if flag:
        settings[key] = f"{flag} {settings.get(key, '')}".strip()
    return settings, recording, final


def start(master: str, conf: dict[str, str] | None = None, quiet: bool = True, archive: bool = False,
          quick_jit: bool = False) -> Session:
    """Reuse the active SparkSession, or start one: quiet logs, no UI, UTC session time zone.

    archive: map the driver JVM's class-data archive, or record one (see above; the caller then ends with
    ``Session.stop(final=True)``, else nothing is recorded).
    quick_jit: the driver JVM compiles with its quick compiler only (-XX:TieredStopAtLevel=1), for a short run
    whose JVM plans and aggregates but moves no bulk of rows: in a 1,000,000-record export the transactions
    table took 4.4 s instead of 5.0 s, while the messages table pushed through Spark's writer took 9.3 s instead of
    7.9 s. Not where the settings already choose the JIT.

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
    settings, recording, final = driver_settings(default_conf(master, log4j), conf or {}, archive, quick_jit)
    builder = SparkSession.builder.master(master)
    for k, v in settings.items():
        builder = builder.config(k, v)
    before = _children()
    try:
        with _output_to(log_path) if log_path else contextlib.nullcontext():
            spark = builder.getOrCreate()
    except KeyboardInterrupt:  # Ctrl-C while Spark starts: the JVM (which ignores SIGINT) must not outlive us
        _abandon_start(before, recording, tmp)
        raise
    except Exception as e:
        tail = log_tail(log_path)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        raise SparkStartError(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__, tail) from e
    spark.sparkContext.setLogLevel("WARN")
    return Session(spark, True, time.perf_counter() - t0, log_path, recording, final)


def _abandon_start(before: set[int], recording: Path | None, tmp: str | None) -> None:
    """After Ctrl-C in the middle of a start: kill the JVM being launched (PySpark only keeps it once its gateway
    answers; before that it is found as the new spark-submit child), drop the half-made context, remove our files.
    Without this the JVM, orphaned, ran on (minutes, waiting for a driver that was gone)."""
    from pyspark import SparkContext

    proc = getattr(SparkContext._gateway, "proc", None)
    if proc is not None:
        end_process_tree(proc)
    for pid in _spark_launches(before):
        end_process_tree(_Adopted(pid))
    _forget_spark()
    if recording is not None:
        recording.unlink(missing_ok=True)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


class _Adopted:
    """A child process known by its pid only, waited for as a Popen would be (for end_process_tree)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout or 0)
        while True:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return 0
            if done:
                return status
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.01)


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
