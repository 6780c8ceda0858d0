"""Ctrl-C ends `txmq spark-export` at once: the driver JVM and its Python workers killed, not waited for.

Each test runs the CLI in a process group of its own and sends SIGINT to the
group, as a terminal does; PySpark starts the JVM ignoring SIGINT, so only the
command can end it. The work Ctrl-C meets is made to never end on its own (a
JVM call that sleeps for ten minutes, the way a Python planner cannot be
cancelled): an export that waited for it would not exit within the tests'
bounds, which are upper bounds only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.spark

EXIT_BOUND_S = 90  # upper bound after SIGINT on a loaded machine: waiting for the stuck work would take 600 s


def _spark_problem() -> str | None:
    from txmq.spark.session import missing_dependency, missing_java

    return missing_dependency() or missing_java()


def _cli_code(args: list[str], prelude: str = "") -> str:
    return ("import sys\n" f"{prelude}\n" f"sys.argv = ['txmq', *{args!r}]\n"
            "from txmq.cli.main import main\nmain()\n")


def _running(pid: int) -> bool:
    from txmq.spark.session import process_running  # no pyspark import: the module loads it lazily

    return process_running(pid)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                children.setdefault(int(f.read().rsplit(b")", 1)[1].split()[1]), []).append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _spark_jvm(root: int) -> int | None:
    """The driver JVM (SparkSubmit) under root, if it is running yet."""
    for pid in _descendants(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"org.apache.spark.deploy.SparkSubmit" in f.read():
                    return pid
        except OSError:
            continue
    return None


def _wait_for(cond, p: subprocess.Popen, what: str, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if p.poll() is not None:
            pytest.fail(f"the export ended before {what}: {p.stderr.read()}")
        time.sleep(0.01)
    pytest.fail(f"no {what} within {timeout}s")


def _interrupt(p: subprocess.Popen) -> tuple[int, str, float]:
    """SIGINT to the process group, as a terminal sends it: (exit code, stderr, seconds to exit)."""
    t0 = time.monotonic()
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=EXIT_BOUND_S)
    return p.returncode, err, time.monotonic() - t0


def _kill_left(p: subprocess.Popen, jvm: int | None) -> None:
    """Whatever a failing test left running."""
    if p.poll() is None:
        p.kill()
        p.wait()
    if jvm and _running(jvm):
        os.kill(jvm, signal.SIGKILL)


def _small_log(path) -> str:
    from txmq.spark.bench import write_log

    write_log(str(path), 300)  # with committed transactions: the transactions table has rows
    return str(path)


def test_ctrl_c_while_spark_starts_ends_its_jvm_and_leaves_no_temporary_files(tmp_path):
    if _spark_problem():
        pytest.skip(_spark_problem())
    data = _small_log(tmp_path / "data")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-c", _cli_code(["spark-export", "--data-dir", data, "--out", str(out),
                                                           "--master", "local[1]"])],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    jvm = None
    try:
        jvm = _wait_for(lambda: _spark_jvm(p.pid), p, "Spark's JVM started")
        rc, err, _ = _interrupt(p)
        assert rc == 130, err
        # the command waited for its JVM: gone as the command exits (it ran on, orphaned, for minutes)
        assert not _running(jvm)
        assert "Traceback" not in err, err
        assert not out.exists() and [q.name for q in tmp_path.iterdir() if ".tmp-" in q.name] == []
        assert [q.name for q in tmp.iterdir() if q.name.startswith("txmq-spark-")] == []  # log, JVM temporary files
    finally:
        _kill_left(p, jvm)


# A table whose planning never ends: a JVM call from the table's thread that sleeps for ten minutes
STUCK_PLANNING = """
import pathlib
import txmq.spark.export as ex
_real = ex._filter_transactions
def _stuck(df, *a, **kw):
    pathlib.Path(MARK).write_text("planning")
    df.sparkSession._jvm.java.lang.Thread.sleep(600000)
    return _real(df, *a, **kw)
ex._filter_transactions = _stuck
"""


def test_ctrl_c_while_a_table_is_planned_kills_the_jvm_instead_of_waiting_for_it(tmp_path):
    if _spark_problem():
        pytest.skip(_spark_problem())
    data = _small_log(tmp_path / "data")
    out = tmp_path / "out"
    mark = tmp_path / "mark"
    code = _cli_code(["spark-export", "--data-dir", data, "--out", str(out), "--master", "local[1]"],
                     prelude=f"MARK = {str(mark)!r}\n{STUCK_PLANNING}")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    jvm = None
    try:
        _wait_for(mark.exists, p, "the transactions table was planned")
        jvm = _spark_jvm(p.pid)
        assert jvm is not None
        rc, err, _ = _interrupt(p)
        assert rc == 130, err
        assert not _running(jvm)
        assert [ln for ln in err.splitlines() if ln.strip()] == [f"interrupted: nothing written to {out}"], err
        assert not out.exists() and [q.name for q in tmp_path.iterdir() if ".tmp-" in q.name] == []
    finally:
        _kill_left(p, jvm)


# --follow whose streams never stop: the stop (a JVM call) sleeps for ten minutes
STUCK_STREAMS = """
import pathlib
import txmq.spark.export as ex
def _follow(spark, opts, checkpoint, interval_s=1.0, stop=None, on_batch=None):
    pathlib.Path(MARK).write_text("following")
    while not stop():
        import time
        time.sleep(0.05)
    spark._jvm.java.lang.Thread.sleep(600000)  # the streams' stop
ex.follow = _follow
"""


def test_ctrl_c_during_follow_kills_the_jvm_when_the_streams_do_not_stop_in_time(tmp_path):
    if _spark_problem():
        pytest.skip(_spark_problem())
    out = tmp_path / "out"
    mark = tmp_path / "mark"
    code = _cli_code(["spark-export", "--broker", "127.0.0.1:1", "--out", str(out), "--follow", "--checkpoint",
                      str(tmp_path / "ckpt"), "--master", "local[1]", "-o", "json"],
                     prelude=f"MARK = {str(mark)!r}\n{STUCK_STREAMS}")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    jvm = None
    try:
        _wait_for(mark.exists, p, "the streams started")
        jvm = _spark_jvm(p.pid)
        assert jvm is not None
        rc, err, _ = _interrupt(p)
        assert rc == 0, err  # Ctrl-C is how --follow ends: the summary follows
        assert not _running(jvm)
        assert "Traceback" not in err and "failed" not in err, err
    finally:
        _kill_left(p, jvm)


def test_killing_a_process_tree_ends_every_process_under_it():
    from txmq.spark.session import end_process_tree, process_tree

    # a parent that ignores SIGINT (as PySpark starts the JVM) with a child of its own
    p = subprocess.Popen([sys.executable, "-c", "import signal, subprocess, sys, time\n"
                          "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                          "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                          "print(c.pid, flush=True)\ntime.sleep(600)\n"], stdout=subprocess.PIPE, text=True)
    try:
        child = int(p.stdout.readline())
        assert process_tree(p.pid) == [p.pid, child]
        end_process_tree(p)
        assert p.poll() is not None and not _running(child)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
