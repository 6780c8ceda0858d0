"""`txmq stats`: the live view fitted to the terminal, its groups, and --filter on counter names."""

import os
import pty
import select
import signal
import subprocess
import time

import pytest

from clihelpers import cli_argv, cli_env, err, lines, ok, one, out, start_broker, txmq, wait_for


def _frame_lines(doc, prev=None, dt=1.0, width=120, height=35):
    """The lines one frame of the live view takes on a terminal of width x height (rendered as rich draws it)."""
    from rich.console import Console

    from txmq.cli.commands.stats import watch_frame

    console = Console(force_terminal=True, width=width, height=height, color_system=None, record=True)
    frame = watch_frame(doc, prev, dt, "txmq stats @ 127.0.0.1:10911, every 1s  (Ctrl-C to stop)", width, height)
    with console.capture() as cap:
        console.print(frame)
    return cap.get().rstrip("\n").split("\n")


def _busy_broker_stats(n: int = 150):
    """A stats reply with many counters and gauges, nested ones among them, as a busy broker's."""
    counters = {f"rmq_requests_{i}": i * 10 for i in range(n // 3)}
    counters.update({f"errors_code_{i}": i for i in range(n // 3)})
    counters.update({"messages_sent": 1000, "half_stored": 40, "check_passes": 7, "checkpoints": 9,
                     "flush_seconds_avg": 0.002, "flush_seconds_max": 0.01})
    gauges = {"pending": 3, "pending_by_topic": {f"topic-{i}": i for i in range(n // 3)},
              "last_check_pass": {"at": 1795653929123, "walked": 3}, "connections": 2, "damaged": {"places": [], "damaged": 0}}
    return {"counters": counters, "gauges": gauges}


def test_a_live_stats_frame_of_a_busy_broker_fits_a_120_by_35_terminal_title_first():
    doc = _busy_broker_stats()
    prev = {"counters": {k: v - 5 if isinstance(v, int) else v for k, v in doc["counters"].items()}, "gauges": {}}
    shown = _frame_lines(doc, prev)
    assert len(shown) <= 34, len(shown)  # the last line stays free: the terminal never scrolls
    assert shown[0].startswith("txmq stats @"), shown[0]
    assert all(len(line) <= 120 for line in shown), max(shown, key=len)
    assert "more: narrow with --filter" in "\n".join(shown)
    assert "transactions" in shown[1] and "pending" in "\n".join(shown)  # the first group's rows are on screen
    assert "5.0/s" in "\n".join(shown)  # counters with their rate


def test_a_live_stats_frame_shows_every_counter_by_group_when_they_fit():
    doc = {"counters": {"messages_sent": 5, "half_stored": 2, "check_passes": 4, "checkpoints": 3, "rmq_requests": 1,
                        "flush_seconds_max": 0.5, "something_new": 1},
           "gauges": {"pending": 2, "connections": 1, "last_check_pass": {"at": 1795653929123}}}
    shown = _frame_lines(doc, height=35)
    text = "\n".join(shown)
    heads = [line.split()[0] for line in shown[1:] if len(line.split()) == 1]
    assert heads == ["transactions", "store", "checks", "messages", "connections", "rocketmq", "other"], shown
    for name in ("messages_sent", "half_stored", "check_passes", "checkpoints", "rmq_requests", "flush_seconds_max",
                 "something_new", "pending", "connections", "last_check_pass.at"):
        assert name in text, name
    assert "2026-11-26T00:45:29.123Z" in text and "more" not in text


@pytest.mark.parametrize("height", [6, 10, 20])
def test_a_live_stats_frame_fits_short_terminals_too(height):
    shown = _frame_lines(_busy_broker_stats(), width=80, height=height)
    assert len(shown) <= height - 1 and all(len(line) <= 80 for line in shown), shown


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = start_broker(tmp_path_factory.mktemp("cli-stats"))
    ok(txmq("send", "st-t", "x", "--tx", "--group", "st", broker=b.address))
    wait_for(lambda: (one(txmq("stats", "-o", "json", broker=b.address))["gauges"].get("last_check_pass") or {}).get("at"),
             what="a check pass")
    yield b
    b.stop()


def _names(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _names(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def test_stats_filter_keeps_the_matching_counters_and_gauges_in_every_output(broker):
    doc = one(txmq("stats", "--filter", "check*", "-o", "json", broker=broker.address))
    names = list(_names(doc["counters"])) + list(_names(doc["gauges"]))
    assert names and all(n.startswith("check") for n in names), names
    assert "checkpoints" in names and "pending" not in names
    doc = one(txmq("stats", "-f", "pending", "-f", "last_check_pass.at", "-o", "json", broker=broker.address))
    names = list(_names(doc["counters"])) + list(_names(doc["gauges"]))
    assert "pending" in names and "last_check_pass.at" in names and "oldest_pending_age_s.st" in names
    assert all("pending" in n or n == "last_check_pass.at" for n in names), names
    table = out(ok(txmq("stats", "--filter", "*_seconds_*", "-o", "table", broker=broker.address)))
    assert {line.split()[1] for line in table.splitlines()[1:]} == {
        "flush_seconds_avg", "flush_seconds_max", "checkpoint_seconds_avg", "checkpoint_seconds_max", "decision_seconds_sum",
        "scheduled_lateness_seconds_avg", "scheduled_lateness_seconds_max"}
    rows = lines(ok(txmq("stats", "--watch", "--count", "2", "--interval", "100ms", "--filter", "half_stored",
                         broker=broker.address)))
    assert len(rows) == 2 and all(r["counters"] == {"half_stored": 1} for r in rows), rows
    assert all(r["gauges"] == {} for r in rows)


def test_stats_filter_matching_nothing_says_so_and_exits_0(broker):
    r = ok(txmq("stats", "--filter", "no_such_counter", "-o", "table", broker=broker.address))
    assert out(r) == "" and "no counter or gauge matches --filter 'no_such_counter'" in err(r)
    assert one(txmq("stats", "--filter", "no_such_counter", "-o", "json", broker=broker.address)) == {"counters": {}, "gauges": {}}


def test_stats_watch_in_a_120_by_35_terminal_keeps_its_title_on_screen_and_out_of_the_scrollback(broker):
    pyte = pytest.importorskip("pyte", reason="pyte (a terminal emulator) is not installed")
    columns, rows = 120, 35
    master, slave = pty.openpty()
    import fcntl
    import struct
    import termios

    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    env = {**cli_env(broker.address), "COLUMNS": str(columns), "LINES": str(rows), "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    p = subprocess.Popen(cli_argv("stats", "--watch", "--interval", "200ms"), stdin=slave, stdout=slave, stderr=slave,
                         env=env, close_fds=True)
    os.close(slave)
    screen = pyte.HistoryScreen(columns, rows, history=10_000)
    stream = pyte.ByteStream(screen)

    def pump(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:
                    return
                if not data:
                    return
                stream.feed(data)

    try:
        pump(2.5)  # a dozen refreshes
        p.send_signal(signal.SIGINT)
        pump(2)
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    assert len(screen.history.top) == 0  # nothing was pushed into the scrollback
    assert screen.display[0].startswith("txmq stats @ "), screen.display
    assert "transactions" in screen.display[1]


class Terminal:
    """A terminal as far as the live view needs one: printing with autowrap (a line that fills the width leaves
    the cursor past its last column until the next character wraps it), CR, LF (scrolling into the scrollback
    at the bottom; LF returns to column 0, as a tty's ONLCR makes it), cursor up, erase line."""

    def __init__(self, columns: int, rows: int) -> None:
        self.columns, self.rows = columns, rows
        self.screen = [[" "] * columns for _ in range(rows)]
        self.history: list[str] = []
        self.y = self.x = 0
        self.pending_wrap = False

    def _linefeed(self) -> None:
        self.x, self.pending_wrap = 0, False
        if self.y == self.rows - 1:
            self.history.append("".join(self.screen.pop(0)).rstrip())
            self.screen.append([" "] * self.columns)
        else:
            self.y += 1

    def feed(self, text: str) -> None:
        import re

        for token in re.split(r"(\x1b\[[0-9;?]*[A-Za-z])", text):
            if token.startswith("\x1b["):
                arg, op = token[2:-1], token[-1]
                if op == "A":
                    self.y, self.pending_wrap = max(0, self.y - int(arg or 1)), False
                elif op == "K" and arg == "2":
                    self.screen[self.y] = [" "] * self.columns
                continue
            for ch in token:
                if ch == "\r":
                    self.x, self.pending_wrap = 0, False
                elif ch == "\n":
                    self._linefeed()
                elif ch >= " ":
                    if self.pending_wrap:
                        self._linefeed()
                    self.screen[self.y][self.x] = ch
                    if self.x == self.columns - 1:
                        self.pending_wrap = True
                    else:
                        self.x += 1

    def lines(self) -> list[str]:
        return self.history + ["".join(row).rstrip() for row in self.screen]


@pytest.mark.parametrize("rows", [12, 30])
def test_ctrl_c_at_a_live_stats_view_leaves_its_last_frame_once_whatever_the_width(rows):
    """The terminal echoes ^C where the cursor waits; a frame whose last line filled the width had it wrap and
    scroll, and the view, redrawn as it stops, left its top lines (the title) on screen twice."""
    import io

    from rich.console import Console

    from txmq.cli.commands.stats import LiveView

    doc = _busy_broker_stats(90)
    prev = {"counters": {k: v - 5 if isinstance(v, int) else v for k, v in doc["counters"].items()}, "gauges": {}}
    for columns in range(60, 131):
        buf = io.StringIO()
        console = Console(file=buf, force_terminal=True, width=columns, height=rows, color_system=None, legacy_windows=False)
        term = Terminal(columns, rows)
        term.feed("".join(f"earlier output {i}\n" for i in range(rows + 5)) + "$ txmq stats --watch\n")
        view = LiveView(console)
        for i in range(2):
            view.show(doc, prev if i else None, 1.0, f"txmq stats @ 127.0.0.1:10911, every 1s, frame {i}  (Ctrl-C to stop)")
        term.feed(buf.getvalue())
        buf.seek(0), buf.truncate()
        term.feed("^C")  # the tty's echo of Ctrl-C, at the cursor
        view.stop()
        term.feed(buf.getvalue() + "$ ")
        shown = term.lines()
        titles = [i for i, line in enumerate(shown) if line.startswith("txmq stats @")]
        assert len(titles) == 1, (columns, shown[-rows - 3:])
        assert shown[titles[0]].startswith("txmq stats @ 127.0.0.1:10911, every 1s, frame 1"), (columns, shown[titles[0]])
        assert "^C" not in "\n".join(shown[titles[0]:]), (columns, shown[-rows:])  # erased by the last redraw
        assert shown[-1] == "$" and shown[-2] != "", (columns, shown[-rows:])  # the prompt right under the last frame


def test_a_count_beside_its_places_is_shown_under_its_maps_name():
    """gauges.damaged is {"damaged": N, "places": [...]}: the count is shown as `damaged`, not `damaged.damaged`."""
    from txmq.cli.commands.stats import _rows, _select, _table

    doc = {"counters": {"messages_sent": 1}, "gauges": {"damaged": {"damaged": 2, "places": []}, "recovery": {"damaged": 0}}}
    names = [r[1] for r in _rows(doc, None, 0.0)]
    assert "damaged" in names and "damaged.damaged" not in names and "recovery.damaged" in names, names
    assert _select(doc, ("damaged",))["gauges"] == {"damaged": {"damaged": 2, "places": []}, "recovery": {"damaged": 0}}
    assert _select(doc, ("damaged.damaged",))["gauges"] == {"damaged": {"damaged": 2}}  # the wire's dotted name still filters
    from rich.console import Console

    from txmq.cli.console import THEME

    console = Console(width=120, color_system=None, theme=THEME)
    with console.capture() as cap:
        console.print(_table(doc, None, 0.0))
    assert "damaged.damaged" not in cap.get() and " damaged " in cap.get()
