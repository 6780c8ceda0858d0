"""What a person sees at a terminal (run through a pseudo-terminal)."""

import os
import pty
import re
import select
import subprocess
import time

import pytest

from clihelpers import cli_argv, cli_env, lines, ok, out, start_broker, txmq


def run_in_pty(args, env, columns=120, timeout=20.0) -> str:
    """Run txmq with stdout and stderr on a pseudo-terminal of `columns` columns; the screen text, colours stripped."""
    master, slave = pty.openpty()
    import fcntl
    import struct
    import termios

    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {**env, "COLUMNS": str(columns), "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    p = subprocess.Popen(cli_argv(*args), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([master], [], [], 0.2)
        if r:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif p.poll() is not None:
            break
    p.wait(5)
    os.close(master)
    text = b"".join(chunks).decode("utf-8", "replace")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "")


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = start_broker(tmp_path_factory.mktemp("tty"), "--check-interval", "60s", "--transaction-timeout", "60s")
    yield b
    b.stop()


def test_transaction_ids_are_never_wrapped_at_120_columns(broker):
    long_group = "group-with-a-rather-long-name-" + "x" * 40
    sent = [lines(ok(txmq("send", "topic-with-a-long-name-" + "y" * 30, "b", "--tx", "--group", long_group, broker=broker.address)))[0]
            for _ in range(2)]
    screen = run_in_pty(["inspect", "half", "--group", long_group], cli_env(broker.address))
    for s in sent:
        assert s["tx_id"] in screen, screen
        assert str(s["half_offset"]) in screen


def _visible_lines(raw: str) -> list[str]:
    """What each terminal line ends up showing: a carriage return or an erase-line starts the line over."""
    shown = []
    for physical in raw.replace("\r\n", "\n").split("\n"):
        buf = ""
        for tok in re.split(r"(\x1b\[[0-9;?]*[A-Za-z]|\r)", physical):
            if tok in ("\r", "\x1b[2K"):
                buf = ""
            elif not tok.startswith("\x1b"):
                buf += tok
        shown.append(buf)
    return shown


def test_consume_follow_prints_messages_on_their_own_lines_not_onto_the_spinner(broker):
    import signal

    for i in range(3):
        ok(txmq("send", "follow-t", f"early-{i}", broker=broker.address))
    master, slave = pty.openpty()
    env = {**cli_env(broker.address), "COLUMNS": "100", "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    p = subprocess.Popen(cli_argv("consume", "follow-t", "--group", "g-follow", "--follow"), stdin=subprocess.DEVNULL,
                         stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + 4
    sent_late = False
    while time.monotonic() < deadline:
        r, _, _ = select.select([master], [], [], 0.1)
        if r:
            try:
                chunks.append(os.read(master, 65536))
            except OSError:
                break
        if not sent_late and time.monotonic() > deadline - 2.5:
            for i in range(3):
                ok(txmq("send", "follow-t", f"late-{i}", broker=broker.address))
            sent_late = True
    p.send_signal(signal.SIGINT)
    p.wait(10)
    while True:
        r, _, _ = select.select([master], [], [], 0.2)
        if not r:
            break
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    shown = _visible_lines(b"".join(chunks).decode("utf-8", "replace"))
    for body in [f"early-{i}" for i in range(3)] + [f"late-{i}" for i in range(3)]:
        mine = [line for line in shown if body in line]
        assert mine, (body, shown)
        assert all("following" not in line for line in mine), mine


def test_pending_transactions_checked_with_no_producer_keep_each_row_on_one_line_at_120_columns(tmp_path):
    from clihelpers import wait_for

    b = start_broker(tmp_path)  # checks every second, transactions due at once: "no producer online" soon
    try:
        sent = [lines(ok(txmq("send", "orders", f"o{i}", "--tx", "--group", "shop", broker=b.address)))[0] for i in range(3)]
        wait_for(lambda: all(r["last_check_result"] == "no producer online"
                             for r in lines(ok(txmq("inspect", "half", "-o", "jsonl", broker=b.address)))),
                 what="a check pass that found no producer")
        screen = run_in_pty(["inspect", "half"], cli_env(b.address), columns=120)
    finally:
        b.stop()
    shown = [line for line in screen.splitlines() if line.strip()]
    assert len(shown) == 2 + len(sent), screen  # the header, its rule, a line per transaction: nothing folded
    for s in sent:
        row = next(line for line in shown if s["tx_id"] in line)
        assert len(row.rstrip()) <= 120 and "no producer" in row and "shop" in row, screen


def test_tables_in_a_pipe_have_no_box_drawing(broker):
    r = ok(txmq("bench", "send", "--messages", "50", "-o", "table", broker=broker.address))
    text = out(r)
    assert not re.search("[\u2500-\u257f]", text), text  # no box-drawing characters: plain aligned text
    header = next(line for line in text.splitlines() if line.startswith("OPERATION"))
    assert header.split() == ["OPERATION", "COUNT", "P50", "MS", "P90", "MS", "P99", "MS", "P99.9", "MS", "MAX", "MS"], text
    assert re.search(r"^send\s+50\s", text, re.M), text


def test_a_table_wider_than_the_terminal_keeps_every_column_and_whole_ids(broker):
    """At 80 columns a listing with ids and times does not fit even with its free text folded: rich would cut the
    ids and drop whole columns; it is printed whole instead, its lines left to the terminal to wrap."""
    sent = lines(ok(txmq("send", "narrow-terminal-topic", "x", "--delay", "1h", "--tag", "t1", broker=broker.address)))[0]
    screen = run_in_pty(["inspect", "scheduled", "--topic", "narrow-terminal-topic"], cli_env(broker.address), columns=80)
    flat = screen.replace("\n", "")  # the terminal wraps long lines
    assert sent["msg_id"] in flat, screen
    for column in ("MSG ID", "TOPIC", "DUE", "TAG", "KEYS", "STORED"):
        assert column in flat, (column, screen)
    assert "narrow-terminal-topic" in flat and "t1" in flat, screen
