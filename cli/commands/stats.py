"""txmq stats: the broker's counters and gauges, once or refreshed live (--watch)."""

import time
from typing import Annotated, Any, Optional

import typer

from .. import exitcodes
from ..common import DEFAULT_BROKER, BrokerOpt, CliError, OutputOpt, TokenOpt, one_of, parse_duration, run, stop_event
from ..console import Output, emit_json, emit_line, esc, fmt_ts, interactive, new_table, note, out, print_table, resolve_output

EPILOG = """Examples:

  txmq stats

  txmq stats --watch                     # live view fitted to the terminal, by group, rates per second

  txmq stats --watch --filter 'check*' --filter pending

  txmq stats --watch --interval 5s -o jsonl >> stats.log

  txmq stats -o json | jq .gauges.pending

Keys: counters {...}, gauges {...} (with --watch in jsonl/json: one object per refresh, plus time_ms).
--filter PATTERN keeps the counters and gauges whose name (dotted: last_check_pass.at) matches:
a glob (*, ?, [...]) matches the whole name, other text any part of it; repeatable (any may match)."""


def register(app: typer.Typer) -> None:
    app.command("stats", epilog=EPILOG)(stats)


def stats(
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[str, typer.Option("--interval", "-i", help="Refresh interval with --watch.")] = "1s",
    limit: Annotated[Optional[int], typer.Option("--limit", "-l", help="With --watch: stop after this many refreshes.", show_default=False, min=1)] = None,
    filter_: Annotated[Optional[list[str]], typer.Option("--filter", metavar="PATTERN", help="Only counters and gauges whose name matches: a glob (check*, *_errors) or any part of it (pending); repeatable.", show_default=False)] = None,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
    count: Annotated[Optional[int], typer.Option("--count", "-c", hidden=True, show_default=False, min=1)] = None,  # --limit's older name
    filter_short: Annotated[Optional[list[str]], typer.Option("-f", hidden=True, show_default=False)] = None,  # --filter's older short name
) -> None:
    """Show the broker's counters (messages, transactions, checks) and gauges (pending, offsets)."""
    count = one_of(limit, count, "--limit", "--count")
    filter_ = [*(filter_ or ()), *(filter_short or ())] or None
    every = parse_duration(interval)
    if every <= 0:
        raise CliError("--interval must be more than 0", exitcodes.USAGE)
    patterns = tuple(filter_ or ())
    if any(not p for p in patterns):
        raise CliError("--filter needs a pattern: a glob such as 'check*', or part of a name", exitcodes.USAGE)
    out_fmt = resolve_output(output)
    if not watch:
        from ..client_ops import call

        doc = _select(call(broker, token, "stats", {}), patterns)
        if out_fmt is Output.json:
            emit_json(doc)
        elif out_fmt is Output.jsonl:
            emit_line(doc)
        else:
            if patterns and not _flat(doc["counters"]) and not _flat(doc["gauges"]):
                note(f"no counter or gauge matches {_said(patterns)}")
                return
            print_table(_table(doc, None, 0.0))
        return
    run(_watch(broker, token, every, count, out_fmt, patterns))


def _said(patterns: tuple[str, ...]) -> str:
    return " or ".join(f"--filter {p!r}" for p in patterns)


def matches(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether a (flattened) counter or gauge name passes --filter: no patterns, or one that matches it."""
    import fnmatch

    if not patterns:
        return True
    return any(fnmatch.fnmatchcase(name, p) if any(c in p for c in "*?[") else p in name for p in patterns)


def _select(reply: dict[str, Any], patterns: tuple[str, ...]) -> dict[str, Any]:
    """The stats reply's counters and gauges, those --filter keeps (nested maps keep their shape, empty ones go)."""

    def keep(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        kept: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, dict):
                inner = keep(v, f"{prefix}{k}.")
                if inner or (not v and matches(f"{prefix}{k}", patterns)):
                    kept[k] = inner
            elif matches(shown_name(prefix, k), patterns) or matches(f"{prefix}{k}", patterns):
                kept[k] = v
        return kept

    return {"counters": keep(reply.get("counters", {})), "gauges": keep(reply.get("gauges", {}))}


async def _watch(broker: str, token: str | None, every: float, count: int | None, out_fmt: Output,
                 patterns: tuple[str, ...] = ()) -> None:
    import asyncio

    from ..client_ops import connect

    stop = stop_event()
    live: LiveView | None = None
    prev: dict[str, Any] | None = None
    prev_t = 0.0
    n = 0
    async with connect(broker, token, reconnect=True) as c:
        if out_fmt is Output.table and interactive():
            live = LiveView(out)
        try:
            while not stop.is_set():
                doc = _select(await c.request("stats", {}), patterns)
                now = time.monotonic()
                if out_fmt is not Output.table:
                    emit_line({"time_ms": int(time.time() * 1000), **doc})
                elif live is not None:
                    title = (f"txmq stats @ {broker}, every {every:g}s, {fmt_ts(int(time.time() * 1000))}"
                             + (f", {_said(patterns)}" if patterns else "") + "  (Ctrl-C to stop)")
                    live.show(doc, prev, now - prev_t, title)
                else:
                    print_table(_table(doc, prev, now - prev_t))
                    out.print()
                prev, prev_t = doc, now
                n += 1
                if count is not None and n >= count:
                    break
                try:
                    await asyncio.wait_for(stop.wait(), every)
                except asyncio.TimeoutError:
                    pass
        finally:
            if live is not None:
                live.stop()


class LiveView:
    """The live view on a terminal: each frame fitted to the console's size and redrawn in place.

    Each frame is cut to the terminal's size (watch_frame), and Live crops
    anything past its height: a refresh redraws the same lines, never
    pushing the last frame into the scrollback. Between refreshes the
    cursor waits on an empty line under the frame (an echoed ``^C`` lands
    there); the last frame stays on screen without it.
    """

    def __init__(self, console: Any) -> None:
        from rich.live import Live

        self.console = console
        self.last: tuple[Any, ...] | None = None  # what the last frame was made of
        self.live = Live(console=console, auto_refresh=False, transient=False, vertical_overflow="crop")
        self.live.start()

    def show(self, doc: dict[str, Any], prev: dict[str, Any] | None, dt: float, title: str) -> None:
        width, height = self.console.size
        self.last = (doc, prev, dt, title, width, height)
        self.live.update(watch_frame(*self.last, cursor_line=True), refresh=True)

    def stop(self) -> None:
        if self.last is not None:
            self.live.update(watch_frame(*self.last), refresh=False)
        self.live.stop()


def shown_name(prefix: str, key: str) -> str:
    """A nested counter's or gauge's name as shown: dotted (last_check_pass.at), except a key that repeats its
    map's name, which is the map's own figure (gauges.damaged.damaged, the count beside its places: damaged)."""
    return prefix[:-1] if prefix and prefix[:-1].rpartition(".")[2] == key else f"{prefix}{key}"


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flat(v, f"{prefix}{k}."))
        else:
            flat[shown_name(prefix, k)] = v
    return flat


_NOT_RATES = ("_avg", "_max", "_min", "_mean")  # in `counters` on the wire, but levels, not running totals


def _table(doc: dict[str, Any], prev: dict[str, Any] | None, dt: float, title: str | None = None) -> Any:
    """Counters (with per-second rates once there is a previous sample) and gauges.

    Averages and maxima the broker reports among its counters are shown as
    gauges, without a rate; a gauge that repeats a counter's name is shown
    once; times (keys ending in ``_at`` or ``_ms`` holding epoch
    milliseconds) are shown as UTC times; lists as their length. (The live
    view on a terminal is `watch_frame`'s, which drops those lists.)
    """
    t = new_table(title)
    t.add_column("KIND", style="dim")
    t.add_column("NAME", style="key", no_wrap=True)
    t.add_column("VALUE", justify="right", no_wrap=True)
    if prev is not None:
        t.add_column("PER SECOND", justify="right")
    before = _flat(prev["counters"]) if prev else {}
    counters = _flat(doc["counters"])
    rows: list[tuple[str, str, Any]] = []
    for name, v in sorted(counters.items()):
        rows.append(("gauge" if name.endswith(_NOT_RATES) else "counter", name, v))
    for name, v in sorted(_flat(doc["gauges"]).items()):
        if name in counters:
            continue
        rows.append(("gauge", name, v))
    for kind, name, v in rows:
        cells = [kind, esc(name), esc(_num(v, name))]
        if prev is not None:
            rate = ""
            if kind == "counter" and isinstance(v, (int, float)) and name in before and dt > 0:
                r = (v - before[name]) / dt
                rate = f"{0.0 if abs(r) < 0.05 else r:,.1f}"
            cells.append(rate)
        t.add_row(*cells)
    return t


def _num(v: Any, name: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list):
        return f"{len(v)} (see -o json)" if v else "0"
    if isinstance(v, int) and name.endswith(("_at", ".at", "_ms")) and v > 10**11:  # epoch ms
        return fmt_ts(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.6g}"
    return str(v)


# The live view's groups: a name goes to the first group one of whose prefixes it starts with
# (longer prefixes first where they overlap: checkpoint_* is the store's, check_* the check service's).
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("transactions", ("pending", "oldest_pending", "half_", "committed", "rolled_back", "decision", "discard", "replayed",
                      "restored", "tx_")),
    ("store", ("checkpoint", "records_", "bytes_", "flush", "max_offset", "durable_offset", "recovery", "damaged", "index_",
               "store_", "segment", "retention")),
    ("checks", ("check", "last_check_pass")),
    ("messages", ("messages_", "acked", "delivered", "redelivered", "released", "renewed", "expired", "filtered",
                  "dead_lettered", "changed", "pop", "pull")),
    ("connections", ("connection", "partial_frame", "auth_", "frame_", "errors_", "fd_", "busy")),
    ("rocketmq", ("rmq_", "rocketmq")),
    ("scheduled", ("scheduled", "timers_")),
)
OTHER = "other"
_GAP = 3  # spaces between the live view's columns


def group_of(name: str) -> str:
    for group, prefixes in GROUPS:
        if name.startswith(prefixes):
            return group
    return OTHER


def _rows(doc: dict[str, Any], prev: dict[str, Any] | None, dt: float) -> list[tuple[str, str, str, str]]:
    """(group, name, value, rate) of every counter and gauge the live view shows, by group, then by name."""
    before = _flat(prev["counters"]) if prev else {}
    counters = _flat(doc["counters"])
    rows: list[tuple[str, str, str, str]] = []
    for name, v in counters.items():
        rate = ""
        if not name.endswith(_NOT_RATES) and isinstance(v, (int, float)) and name in before and dt > 0:
            r = (v - before[name]) / dt
            rate = f"{0.0 if abs(r) < 0.05 else r:,.1f}/s"
        rows.append((group_of(name), name, _num(v, name), rate))
    for name, v in _flat(doc["gauges"]).items():
        if name in counters or isinstance(v, list):  # a gauge repeating a counter, or a list of places (-o json)
            continue
        rows.append((group_of(name), name, _num(v, name), ""))
    order = {g: i for i, (g, _) in enumerate((*GROUPS, (OTHER, ())))}
    rows.sort(key=lambda r: (order[r[0]], r[1]))
    return rows


def watch_frame(doc: dict[str, Any], prev: dict[str, Any] | None, dt: float, title: str, width: int, height: int,
                cursor_line: bool = False) -> Any:
    """One frame of `stats --watch`: a title line, then the counters and gauges by group, in as many columns
    as the width takes, never taller than ``height`` - 1 lines (the last line stays free, so the terminal never
    scrolls); what does not fit is counted on the last line ("... N more: narrow with --filter").

    ``cursor_line``: the frame ends with an empty line, where the cursor waits between refreshes. A frame
    whose last line fills the width leaves the cursor past the last column, and the ``^C`` the terminal
    echoes there wraps onto a new line and scrolls: the live view, redrawn once more as it stops, would then
    start a line too low and leave the frame's top lines above it a second time.
    """
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text(title, style="bold", no_wrap=True, overflow="ellipsis")
    tail = (Text(""),) if cursor_line else ()
    rows = _rows(doc, prev, dt)
    if not rows:
        return Group(head, Text("no counter or gauge matches the filter" if "--filter" in title else "no counters yet", style="dim"),
                     *tail)
    room = max(2, height - 3)  # lines under the title (and above the cursor's)
    for ncols in range(max(1, (width + _GAP) // (12 + _GAP)), 0, -1):
        columns, more = _flow(rows, ncols, room)
        widths = [_width(col) for col in columns]
        if sum(widths) + _GAP * (len(columns) - 1) <= width or ncols == 1:
            break
    widths = [min(w, width) for w in widths]
    grid = Table.grid(padding=(0, _GAP, 0, 0))
    for w in widths:
        grid.add_column(width=w, no_wrap=True, overflow="crop")
    grid.add_row(*[Group(*_lines(col, w)) for col, w in zip(columns, widths)])
    return Group(head, grid, *tail)


def _flow(rows: list[tuple[str, str, str, str]], ncols: int, room: int) -> tuple[list[list[tuple[str, ...]]], int]:
    """The rows flowed down `ncols` columns of `room` lines, each group under its heading (repeated as
    "(cont.)" atop a column it goes on in; a heading never ends a column); the rows that did not fit,
    counted on a last line ("more") that takes a row's place."""
    columns: list[list[tuple[str, ...]]] = [[]]
    group = None
    shown = 0
    for g, name, value, rate in rows:
        col = columns[-1]
        new_group = g != group
        if len(col) + (2 if new_group else 1) > room:
            if len(columns) == ncols:
                break
            columns.append([])
            col = columns[-1]
            if not new_group:
                col.append(("head", f"{g} (cont.)"))
        if new_group:
            col.append(("head", g))
            group = g
        col.append(("row", name, value, rate))
        shown += 1
    more = len(rows) - shown
    if more:
        col = columns[-1]
        while len(col) >= room or (col and col[-1][0] == "head"):
            if col.pop()[0] == "row":
                more += 1
        col.append(("more", f"... {more} more: narrow with --filter"))
    return columns, more


def _width(col: list[tuple[str, ...]]) -> int:
    rows = [item for item in col if item[0] == "row"]
    name_w = max((len(r[1]) for r in rows), default=0)
    value_w = max((len(r[2]) for r in rows), default=0)
    rate_w = max((len(r[3]) for r in rows), default=0)
    text_w = max((len(item[1]) for item in col if item[0] != "row"), default=0)
    return max(name_w + 2 + value_w + (2 + rate_w if rate_w else 0), text_w)


def _lines(col: list[tuple[str, ...]], width: int) -> list[Any]:
    """A column's lines, each cut to `width`: NAME  VALUE  RATE, the values and rates right-aligned."""
    from rich.text import Text

    rows = [item for item in col if item[0] == "row"]
    value_w = max((len(r[2]) for r in rows), default=0)
    rate_w = max((len(r[3]) for r in rows), default=0)
    name_w = max(4, width - 2 - value_w - (2 + rate_w if rate_w else 0))
    out_lines = []
    for item in col:
        if item[0] == "head":
            out_lines.append(Text(item[1][:width], style="bold"))
        elif item[0] == "more":
            out_lines.append(Text(item[1][:width], style="dim"))
        else:
            _, name, value, rate = item
            name = name if len(name) <= name_w else name[: name_w - 1] + "\u2026"
            line = Text(name.ljust(name_w), style="key")
            line.append("  " + value.rjust(value_w))
            if rate_w:
                line.append("  " + rate.rjust(rate_w), style="dim")
            line.truncate(width)
            out_lines.append(line)
    return out_lines
