"""Operators' bulk commands: listings that never stop silently, server-side bulk resolve, summaries, the oldest-pending gauge."""

import asyncio
import json

import pytest

from brokerproc import free_port
from conftest import arun
from faultload import PipeClient
from clihelpers import CONFLICT, OK, PARTIAL, UNREACHABLE, err, lines, ok, out, shell, start_broker, txmq

PAGE = 1000


@pytest.fixture(scope="module")
def broker_proc(tmp_path_factory):
    mport = free_port()
    # no check-backs during the module: pending transactions stay as they are
    b = start_broker(tmp_path_factory.mktemp("cli-bulk"), "--check-interval", "1h", "--metrics-port", str(mport))
    b.metrics_port = mport
    yield b
    b.stop()


@pytest.fixture(scope="module")
def broker(broker_proc):
    return broker_proc.address


def run(broker, *args, **kw):
    return txmq(*args, broker=broker, **kw)


def pend_many(broker: str, group: str, n: int, topic: str = "t-bulk") -> list[dict]:
    """n transactions left pending, sent over one pipelined connection."""

    async def go() -> list[dict]:
        c = await PipeClient.open(broker)
        try:
            out = []
            for i in range(0, n, 200):
                out += await asyncio.gather(*[
                    c.ok("send", {"topic": topic, "body": b"x", "properties": {"TRAN_MSG": "true", "PGROUP": group}})
                    for _ in range(min(200, n - i))])
            return out
        finally:
            await c.close()

    return arun(go())


def test_listings_in_a_pipe_stream_every_row_in_pages(broker):
    sent = pend_many(broker, "page", PAGE + 7)
    sent.sort(key=lambda s: s["half_offset"])  # a listing is in half-queue order, whatever order the replies came in
    rows = lines(ok(run(broker, "inspect", "half", "--group", "page")))
    assert [r["tx_id"] for r in rows] == [s["tx_id"] for s in sent]
    doc = json.loads(out(ok(run(broker, "inspect", "half", "--group", "page", "-o", "json"))))
    assert len(doc) == PAGE + 7 and doc[-1]["tx_id"] == sent[-1]["tx_id"]


def test_a_limit_that_cuts_a_listing_is_said_on_stderr_in_every_format(broker):
    pend_many(broker, "cut", 5)
    for fmt in ("jsonl", "json", "table"):
        r = ok(run(broker, "inspect", "half", "--group", "cut", "--limit", "2", "-o", fmt))
        assert "showing 2 of 5 pending transactions (--limit)" in err(r), fmt
    r = ok(run(broker, "inspect", "half", "--group", "cut", "--limit", "5"))
    assert "showing" not in err(r) and len(lines(r)) == 5


def test_the_readme_recipe_rolls_back_every_pending_transaction_past_one_page(broker):
    pend_many(broker, "recipe", PAGE + 3)
    r = shell("txmq inspect half --group recipe -o jsonl | txmq resolve --rollback - --yes", broker, timeout=120)
    assert r.returncode == 0, err(r)
    rows = lines(r)
    assert len(rows) == PAGE + 3 and all(x["status"] == "ok" for x in rows)
    assert lines(ok(run(broker, "inspect", "half", "--group", "recipe"))) == []


def test_oldest_pending_age_per_group_is_a_gauge_in_stats_and_prometheus(broker_proc):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    broker = broker_proc.address
    pend_many(broker, "aged", 1)
    st = json.loads(out(ok(run(broker, "stats", "-o", "json"))))
    assert st["gauges"]["oldest_pending_age_s"]["aged"] >= 0
    text = urllib.request.urlopen(f"http://127.0.0.1:{broker_proc.metrics_port}/metrics", timeout=5).read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("txmq_oldest_pending_age_seconds", (("group", "aged"),))] >= 0


def test_resolve_by_group_is_decided_by_the_broker_in_batches(broker):
    old = pend_many(broker, "where", 1203, topic="t-where")
    other = pend_many(broker, "where", 2, topic="t-where-other")
    dry = run(broker, "resolve", "--rollback", "--group", "where", "--topic", "t-where", "--dry-run")
    assert dry.returncode == OK, err(dry)
    assert len(lines(dry)) == 1203 and {r["status"] for r in lines(dry)} == {"ok"}
    assert "1203 would be rolled back, 0 already, 0 failed" in err(dry)
    assert len(lines(ok(run(broker, "inspect", "half", "--group", "where")))) == 1205
    # several transactions without --yes and no terminal: refused, nothing done
    assert run(broker, "resolve", "--rollback", "--group", "where", "--topic", "t-where").returncode == 2
    r = run(broker, "resolve", "--rollback", "--group", "where", "--topic", "t-where", "--yes")
    assert r.returncode == OK, err(r)
    rows = lines(r)
    assert sorted(x["tx_id"] for x in rows) == sorted(s["tx_id"] for s in old)
    assert all(x["status"] == "ok" and x["ref"] == x["tx_id"] for x in rows)
    assert "1203 rolled back, 0 already, 0 failed" in err(r)
    left = lines(ok(run(broker, "inspect", "half", "--group", "where")))
    assert [x["tx_id"] for x in left] == [s["tx_id"] for s in other]
    # the one a stale listing would name is decided the same way: already; the other way: conflict
    c = run(broker, "resolve", "--commit", old[0]["tx_id"])
    assert c.returncode == CONFLICT
    nothing = ok(run(broker, "resolve", "--rollback", "--group", "where", "--topic", "t-where", "--yes"))
    assert "nothing to resolve" in err(nothing)


def test_resolve_by_group_refuses_refs_and_topic_without_group(broker):
    assert run(broker, "resolve", "--rollback", "--group", "g", "1").returncode == 2
    assert run(broker, "resolve", "--rollback", "--older-than", "1m").returncode == 2


def test_bulk_resolve_ends_with_a_summary_line_on_stderr(broker):
    sent = pend_many(broker, "summ", 3)
    refs = "\n".join([sent[0]["tx_id"], sent[1]["tx_id"], "NO-SUCH-TX"]) + "\n"
    r = run(broker, "resolve", "--rollback", "-", "--yes", input=refs)
    assert r.returncode == PARTIAL
    assert "2 rolled back, 0 already, 1 failed, 0 not attempted" in err(r)


def _stop_a_bulk_resolve(tmp_path, stop):
    """Start `resolve --rollback -` on 3000 REFs, call stop(broker, process) once rows come out; (exit, stderr, rows printed)."""
    import signal  # noqa: F401
    import subprocess
    import threading
    import time

    from clihelpers import cli_argv, cli_env

    b = start_broker(tmp_path, "--check-interval", "1h")
    try:
        sent = pend_many(b.address, "stop", 3000)
        p = subprocess.Popen(cli_argv("resolve", "--rollback", "-", "--yes", "-o", "jsonl"), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(b.address))
        got: list[bytes] = []
        th = threading.Thread(target=lambda: got.extend(p.stdout))
        th.start()
        p.stdin.write("".join(s["tx_id"] + "\n" for s in sent).encode())
        p.stdin.close()
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            time.sleep(0.002)
        stop(b, p)
        code = p.wait(30)
        th.join(5)
        return code, p.stderr.read().decode(), len(got)
    finally:
        b.kill()


def test_bulk_resolve_after_a_lost_broker_says_what_was_done_and_exits_3(tmp_path):
    code, e, n = _stop_a_bulk_resolve(tmp_path, lambda b, p: b.kill())
    if n == 3000:
        pytest.skip("the broker finished before it was killed")
    assert code == UNREACHABLE, e
    assert "stopped (broker lost)" in e and "not attempted" in e and "to resume" in e
    assert f"{n} rolled back" in e


def test_bulk_resolve_after_ctrl_c_says_what_was_done(tmp_path):
    import signal

    code, e, n = _stop_a_bulk_resolve(tmp_path, lambda b, p: p.send_signal(signal.SIGINT))
    if n == 3000:
        pytest.skip("the command finished before Ctrl-C")
    assert code == 130, e
    assert "stopped (interrupted)" in e and f"{n} rolled back" in e and "to resume" in e


def test_send_of_stdin_lines_ends_with_a_summary_line(broker):
    r = run(broker, "send", "t-sum-send", "-", input="a\nb\n\nc\n")
    assert r.returncode == OK, err(r)
    assert len(lines(r)) == 3 and "3 sent, 0 failed, 0 not attempted" in err(r)


def test_send_of_stdin_lines_after_ctrl_c_says_what_was_sent_and_exits_130(broker):
    import signal
    import subprocess

    from clihelpers import cli_argv, cli_env

    p = subprocess.Popen(cli_argv("send", "t-sum-int", "-", "-o", "jsonl"), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(broker))
    try:
        p.stdin.write(b"a\nb\nc\n")
        p.stdin.flush()  # stdin stays open: the command waits for more lines
        got = [json.loads(p.stdout.readline()) for _ in range(3)]
        assert sorted(r["line"] for r in got) == [1, 2, 3]
        p.send_signal(signal.SIGINT)
        _, e = p.communicate(timeout=15)  # never p.wait() with output still to read: a full pipe would hold the exit up
        code = p.returncode
        e = e.decode()
    finally:
        if p.poll() is None:
            p.kill()
    assert code == 130, e
    assert "stopped (interrupted): 3 sent, 0 failed" in e and "input read up to line 3" in e and "to resume" in e, e
    assert "Traceback" not in e


class _StallingBroker:
    """A broker that says hello and answers the first `answers` requests after it, then reads nothing more, as a
    stalled broker process would: a client with data still to write can then never finish closing its connection."""

    def __init__(self, answers: int) -> None:
        import socket
        import threading

        self.answers = answers
        self.stalled = threading.Event()  # set once the request after the answered ones has arrived
        self.sock = socket.socket()
        # a fixed receive buffer (the accepted socket inherits it): no window that grows to take what the client writes
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.conn = None
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        from txmq import wire

        conn, _ = self.sock.accept()
        self.conn = conn
        dec = wire.FrameDecoder()
        left = self.answers
        n = 0
        while not self.stalled.is_set():
            data = conn.recv(1 << 16)
            if not data:
                return
            for payload in dec.feed(data):
                f = wire.parse_payload(payload)
                if f.op == "hello":
                    conn.sendall(wire.reply(f.id, {"version": "stalling", "protocol": 1, "broker_id": "stalling", "flush": "sync"}))
                elif left:
                    left -= 1
                    n += 100
                    conn.sendall(wire.reply(f.id, {"msg_id": f"M{n}", "topic": f.fields.get("topic", ""), "queue_id": 0,
                                                   "queue_offset": n // 100 - 1, "commit_log_offset": n}))
                else:
                    self.stalled.set()  # from here on nothing is read: the rest stays in the client's buffers
                    break

    def close(self) -> None:
        for s in (self.conn, self.sock):
            if s is not None:
                s.close()


def _interrupted_send(broker: str, big_lines: int = 0, preexec=None):
    """`send t-sum-int - -o jsonl` with stdin kept open: 3 lines, their results, then `big_lines` lines of 128 KiB,
    then Ctrl-C; (exit code, stderr, seconds from Ctrl-C to the exit)."""
    import signal
    import subprocess
    import time

    from clihelpers import cli_argv, cli_env

    p = subprocess.Popen(cli_argv("send", "t-sum-int", "-", "-o", "jsonl"), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(broker), preexec_fn=preexec)
    try:
        p.stdin.write(b"a\nb\nc\n")
        p.stdin.flush()  # stdin stays open: the command waits for more lines
        got = [json.loads(p.stdout.readline()) for _ in range(3)]
        assert sorted(r["line"] for r in got) == [1, 2, 3]
        if big_lines:
            p.stdin.write((b"x" * (128 << 10) + b"\n") * big_lines)
            p.stdin.flush()  # read by the command, all but the last few sent: far more than the socket buffers hold
        started = time.monotonic()
        p.send_signal(signal.SIGINT)
        _, e = p.communicate(timeout=15)
        code = p.returncode
        took = time.monotonic() - started
        e = e.decode()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return code, e, took


def test_send_of_stdin_lines_exits_130_on_ctrl_c_even_if_the_connection_never_finishes_closing():
    b = _StallingBroker(answers=3)
    try:
        code, e, took = _interrupted_send(b.address, big_lines=200)
    finally:
        b.close()
    assert b.stalled.is_set()
    assert code == 130, e
    assert "stopped (interrupted): 3 sent, 0 failed, up to " in e and " unconfirmed " in e and "to resume" in e, e
    assert "Traceback" not in e and "Task was destroyed" not in e, e
    assert took < 10, took  # the grace after Ctrl-C is 1.5 s; without it, no exit at all


def test_send_of_stdin_lines_stops_on_ctrl_c_when_started_with_sigint_ignored(broker):
    import signal

    # as a background job of a non-interactive shell starts: SIGINT ignored (asyncio.run alone would never see it)
    code, e, _ = _interrupted_send(broker, preexec=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert code == 130, e
    assert "stopped (interrupted): 3 sent, 0 failed" in e and "input read up to line 3" in e, e


def test_bulk_resolve_stops_on_ctrl_c_when_started_with_sigint_ignored_and_the_broker_never_answers():
    import signal
    import subprocess

    from clihelpers import cli_argv, cli_env

    b = _StallingBroker(answers=0)
    try:
        p = subprocess.Popen(cli_argv("resolve", "--rollback", "-", "--yes", "-o", "jsonl"), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(b.address),
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        try:
            p.stdin.write(b"TX-1\nTX-2\nTX-3\n")
            p.stdin.close()
            assert b.stalled.wait(15)  # the request is sent and will never be answered
            p.send_signal(signal.SIGINT)
            code = p.wait(15)
            e = p.stderr.read().decode()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    finally:
        b.close()
    assert code == 130, e
    assert "stopped (interrupted): 0 rolled back, 0 already, 0 failed, 0 not attempted, 3 unconfirmed" in e, e
    assert "Traceback" not in e, e


async def _hanging_cleanup():
    """A command whose clean-up after Ctrl-C never ends (as a connection close that never completes)."""
    loop = asyncio.get_running_loop()
    try:
        await loop.create_future()
    finally:
        await asyncio.shield(loop.create_future())


def test_ctrl_c_raises_keyboard_interrupt_once_the_grace_for_clean_up_is_over():
    import os
    import signal
    import time

    from txmq.cli.common import run_interruptible

    async def main():
        asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGINT)
        await _hanging_cleanup()

    before = signal.getsignal(signal.SIGINT)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_interruptible(main(), grace=0.3)
    assert 0.25 < time.monotonic() - t0 < 10
    assert signal.getsignal(signal.SIGINT) == before  # put back as it was


def test_a_second_ctrl_c_raises_keyboard_interrupt_at_once():
    import os
    import signal
    import time

    from txmq.cli.common import run_interruptible

    async def main():
        loop = asyncio.get_running_loop()
        loop.call_soon(os.kill, os.getpid(), signal.SIGINT)
        loop.call_later(0.1, os.kill, os.getpid(), signal.SIGINT)
        await _hanging_cleanup()

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_interruptible(main(), grace=60)
    assert time.monotonic() - t0 < 30


def test_a_command_that_ends_before_ctrl_c_returns_its_result():
    from txmq.cli.common import run_interruptible

    async def main():
        return 42

    assert run_interruptible(main()) == 42


def _resolve_with_open_stdin(broker: str, first: list[str], then=None, *args: str):
    """`resolve --rollback - --yes -o jsonl ARGS` fed `first` (lines) with stdin left open; once their rows are out,
    then(process) (Ctrl-C, more input); (exit code, stdout rows, stderr)."""
    import subprocess
    import threading
    import time

    from clihelpers import cli_argv, cli_env

    p = subprocess.Popen(cli_argv("resolve", "--rollback", "-", "--yes", "-o", "jsonl", *args), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(broker))
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend(p.stdout))
    reader.start()
    try:
        p.stdin.write("".join(line + "\n" for line in first).encode())
        p.stdin.flush()  # and stdin stays open: more lines may come
        deadline = time.monotonic() + 15
        while len(got) < len(first) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(got) == len(first), f"no rows while stdin is open: {got}"  # resolved as they arrived
        then(p)
        e = p.stderr.read().decode()
        code = p.wait(15)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        reader.join(5)
    return code, [json.loads(x) for x in got], e


def test_resolve_of_stdin_decides_lines_as_they_arrive_and_ctrl_c_prints_the_summary_and_exits_130(broker):
    import signal

    sent = pend_many(broker, "stream-int", 3)
    code, rows, e = _resolve_with_open_stdin(broker, [s["tx_id"] for s in sent], lambda p: p.send_signal(signal.SIGINT))
    assert code == 130, e
    assert {r["tx_id"] for r in rows} == {s["tx_id"] for s in sent} and {r["status"] for r in rows} == {"ok"}
    assert ("stopped (interrupted): 3 rolled back, 0 already, 0 failed, 0 not attempted, stdin read up to line 3; "
            "to resume, run the same command again") in e, e
    assert "Traceback" not in e, e
    left = {r["tx_id"] for r in lines(ok(run(broker, "inspect", "half", "--group", "stream-int")))}
    assert not left


def test_resolve_of_stdin_stops_at_a_bad_line_and_says_what_it_resolved_before(broker):
    sent = pend_many(broker, "stream-bad", 2)

    def bad_line_then_eof(p):
        p.stdin.write(b"two tokens\n")
        p.stdin.close()

    code, rows, e = _resolve_with_open_stdin(broker, [s["tx_id"] for s in sent], bad_line_then_eof)
    assert code == 2, e
    assert len(rows) == 2 and {r["status"] for r in rows} == {"ok"}
    assert "stopped (error: stdin line 3: expected one REF per line" in e and "2 rolled back" in e, e
    assert e.splitlines()[-1].startswith("error: stdin line 3: "), e


def test_resolve_of_many_stdin_lines_at_once_keeps_their_order_and_counts_them_all(broker):
    from txmq.cli.commands._bulk import STREAM_BATCH

    sent = pend_many(broker, "stream-many", STREAM_BATCH * 2 + 5)
    text = "".join(s["tx_id"] + "\n" for s in sent)
    r = run(broker, "resolve", "--rollback", "-", "--yes", "-o", "jsonl", input=text)
    assert r.returncode == OK, err(r)
    assert [x["ref"] for x in lines(r)] == [s["tx_id"] for s in sent]  # in input order
    assert f"{len(sent)} rolled back, 0 already, 0 failed, 0 not attempted" in err(r)
