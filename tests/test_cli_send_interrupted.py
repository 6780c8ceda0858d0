"""`txmq send` of stdin lines stopped by Ctrl-C: every transaction it started is ended or named with the command that
ends it, and Ctrl-C while it waits on stdin always ends it at once with exit 130."""

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import threading
import time

import pytest

from clihelpers import cli_argv, cli_env, lines, ok, start_broker, txmq

INTERRUPTED = 130
TX_ID = re.compile(r"tx_id ([0-9A-F]{32})")


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = start_broker(tmp_path_factory.mktemp("send-interrupted"), "--check-interval", "1h")
    yield b
    b.stop()


class _BulkTxSend:
    """`txmq send TOPIC --tx --group G --state commit -o jsonl` fed 200,000 lines, its rows and stderr read as they come."""

    def __init__(self, address: str, group: str) -> None:
        self.p = subprocess.Popen(
            cli_argv("send", "t-interrupted", "--tx", "--group", group, "--state", "commit", "-o", "jsonl"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=cli_env(address),
        )
        self.rows: list[dict] = []
        self.stderr = b""
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._feed, self._read_rows, self._read_stderr)]
        for t in self._threads:
            t.start()

    def _feed(self) -> None:
        try:
            self.p.stdin.write(b"".join(b"order-%d\n" % i for i in range(200_000)))
            self.p.stdin.close()
        except (BrokenPipeError, OSError):  # it stopped reading: Ctrl-C
            pass

    def _read_rows(self) -> None:
        for line in self.p.stdout:
            self.rows.append(json.loads(line))

    def _read_stderr(self) -> None:
        self.stderr = self.p.stderr.read()

    def wait_rows(self, n: int) -> None:
        deadline = time.monotonic() + 30
        while len(self.rows) < n:
            assert self.p.poll() is None and time.monotonic() < deadline, self.stderr.decode()
            time.sleep(0.002)

    def interrupt(self) -> tuple[int, float, str]:
        """Ctrl-C; (exit code, seconds to the exit, stderr)."""
        started = time.monotonic()
        self.p.send_signal(signal.SIGINT)
        try:
            code = self.p.wait(20)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()
        took = time.monotonic() - started
        for t in self._threads:
            t.join(10)
        return code, took, self.stderr.decode()


def _pending(address: str, group: str) -> set[str]:
    return {r["tx_id"] for r in lines(ok(txmq("inspect", "half", "--group", group, "-o", "jsonl", broker=address)))}


def _resolve_command(stderr: str) -> list[str]:
    (cmd,) = [ln.strip() for ln in stderr.splitlines() if ln.strip().startswith("txmq resolve ")]
    return shlex.split(cmd)


def test_ctrl_c_during_a_bulk_tx_send_leaves_no_transaction_pending_unnamed(broker):
    run = _BulkTxSend(broker.address, "g-ctrl-c")
    run.wait_rows(2000)
    code, _, e = run.interrupt()
    assert code == INTERRUPTED, e
    assert "stopped (interrupted)" in e and "Traceback" not in e, e
    assert run.rows and all(r["state"] == "committed" for r in run.rows)
    left = _pending(broker.address, "g-ctrl-c")
    named = set(TX_ID.findall(e))
    assert left <= named, f"{len(left - named)} pending transactions not named: {e[-2000:]}"
    if named:
        assert named <= set(_resolve_command(e)), e
    assert not named & {r["tx_id"] for r in run.rows}  # a printed row is an ended transaction


def test_transactions_a_bulk_tx_send_could_not_end_are_named_with_the_command_that_ends_them(tmp_path):
    b = start_broker(tmp_path, "--check-interval", "1h")
    try:
        run = _BulkTxSend(b.address, "g-stalled")
        run.wait_rows(1000)
        os.kill(b.pid, signal.SIGSTOP)  # nothing in flight gets an answer now
        try:
            time.sleep(0.2)
            code, took, e = run.interrupt()
        finally:
            os.kill(b.pid, signal.SIGCONT)
        assert code == INTERRUPTED, e
        assert took < 10, took
        named = set(TX_ID.findall(e))
        assert named, e
        assert "not ended" in e and "Traceback" not in e, e
        printed_lines = {r["line"] for r in run.rows}
        named_lines = {int(n) for n in re.findall(r"^  line (\d+): tx_id", e, re.M)}
        assert len(named_lines) == len(named) and not named_lines & printed_lines

        def settled() -> set[str]:  # the broker reads what the stopped command had sent, then holds still
            before = _pending(b.address, "g-stalled")
            time.sleep(0.3)
            return before if before == _pending(b.address, "g-stalled") else set()

        deadline = time.monotonic() + 20
        while not (left := settled()) and time.monotonic() < deadline:
            pass
        assert left and left <= named

        argv = _resolve_command(e)
        assert argv[:4] == ["txmq", "resolve", "--commit", "--yes"] and set(argv) >= named, argv
        r = txmq(*argv[1:], "-o", "jsonl", broker=None)
        statuses = {row["status"] for row in lines(r)}
        assert statuses <= {"ok", "already", "not_found"}, r.stderr.decode()
        assert _pending(b.address, "g-stalled") == set()
    finally:
        b.stop()


def test_ctrl_c_while_send_waits_on_stdin_always_exits_130_at_once(broker):
    for i in range(20):
        ignored = i % 2 == 1  # as a background job of a script starts: SIGINT ignored
        p = subprocess.Popen(
            cli_argv("send", "t-waiting", "-", "-o", "jsonl"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=cli_env(broker.address),
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else None,
        )
        try:
            p.stdin.write(b"first\n")
            p.stdin.flush()
            assert json.loads(p.stdout.readline())["line"] == 1  # it waits on stdin now
            if i % 4 >= 2:  # more lines arrive as Ctrl-C does
                p.stdin.write(b"more\n" * (50 * i))
                p.stdin.flush()
            time.sleep((i % 5) * 0.003)
            started = time.monotonic()
            p.send_signal(signal.SIGINT)
            _, e = p.communicate(timeout=15)
            took = time.monotonic() - started
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        e = e.decode()
        assert p.returncode == INTERRUPTED, (i, e)
        assert took < 10, (i, took)
        assert "stopped (interrupted)" in e and "Traceback" not in e and "never awaited" not in e, (i, e)


def test_a_ctrl_c_just_before_the_event_loop_runs_is_not_lost(monkeypatch):
    from txmq.cli.common import run_interruptible

    set_event_loop = asyncio.set_event_loop

    def ctrl_c_then_set_event_loop(loop):  # between taking SIGINT and running the loop
        if loop is not None:
            os.kill(os.getpid(), signal.SIGINT)
        set_event_loop(loop)

    monkeypatch.setattr(asyncio, "set_event_loop", ctrl_c_then_set_event_loop)

    async def waits_on_stdin():
        await asyncio.sleep(30)

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_interruptible(waits_on_stdin())
    assert time.monotonic() - started < 10
