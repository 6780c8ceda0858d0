"""txmq stats: the broker's counters and gauges, once or refreshed live (--watch)."""

import time
from typing import Annotated, Any, Optional

import typer

from .. import exitcodes
from ..common import DEFAULT_BROKER, BrokerOpt, CliError, OutputOpt, TokenOpt, parse_duration, run, stop_event
from ..console import Output, emit_json, emit_line, esc, fmt_ts, interactive, new_table, out, print_table, resolve_output

EPILOG = """Examples:

  txmq stats

  txmq stats --watch                     # live view, rates per second; Ctrl-C to stop

  txmq stats --watch --interval 5s -o jsonl >> stats.log

  txmq stats -o json | jq .gauges.pending

Keys: counters {...}, gauges {...} (with --watch in jsonl/json: one object per refresh, plus time_ms)."""


def register(app: typer.Typer) -> None:
    app.command("stats", epilog=EPILOG)(stats)


def stats(
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[str, typer.Option("--interval", "-i", help="Refresh interval with --watch.")] = "1s",
    count: Annotated[Optional[int], typer.Option("--count", "-c", help="With --watch: stop after this many refreshes.", show_default=False, min=1)] = None,
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    output: OutputOpt = None,
) -> None:
    """Show the broker's counters (messages, transactions, checks) and gauges (pending, offsets)."""
    every = parse_duration(interval)
    if every <= 0:
        raise CliError("--interval must be more than 0", exitcodes.USAGE)
    out_fmt = resolve_output(output)
    if not watch:
        from ..client_ops import call

        doc = call(broker, token, "stats", {})
        doc = {"counters": doc.get("counters", {}), "gauges": doc.get("gauges", {})}
        if out_fmt is Output.json:
            emit_json(doc)
        elif out_fmt is Output.jsonl:
            emit_line(doc)
        else:
            print_table(_table(doc, None, 0.0))
        return
    run(_watch(broker, token, every, count, out_fmt))


async def _watch(broker: str, token: str | None, every: float, count: int | None, out_fmt: Output) -> None:
    import asyncio

    from ..client_ops import connect

    stop = stop_event()
    live = None
    prev: dict[str, Any] | None = None
    prev_t = 0.0
    n = 0
    async with connect(broker, token, reconnect=True) as c:
        if out_fmt is Output.table and interactive():
            from rich.live import Live

            live = Live(console=out, auto_refresh=False, transient=False, vertical_overflow="visible")
            live.start()
        try:
            while not stop.is_set():
                doc = await c.request("stats", {})
                now = time.monotonic()
                doc = {"counters": doc.get("counters", {}), "gauges": doc.get("gauges", {})}
                if out_fmt is not Output.table:
                    emit_line({"time_ms": int(time.time() * 1000), **doc})
                elif live is not None:
                    live.update(_table(doc, prev, now - prev_t, compact=True,
                                       title=f"txmq stats @ {broker} (every {every:g}s, Ctrl-C to stop)"), refresh=True)
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


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flat(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


_NOT_RATES = ("_avg", "_max", "_min", "_mean")  # in `counters` on the wire, but levels, not running totals


def _table(doc: dict[str, Any], prev: dict[str, Any] | None, dt: float, title: str | None = None, compact: bool = False) -> Any:
    """Counters (with per-second rates once there is a previous sample) and gauges.

    Averages and maxima the broker reports among its counters are shown as
    gauges, without a rate; a gauge that repeats a counter's name is shown
    once; times (keys ending in ``_at`` or ``_ms`` holding epoch
    milliseconds) are shown as UTC times; lists as their length. ``compact``
    (the live view) drops the lists of places only.
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
        if name in counters or (compact and isinstance(v, list)):
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
