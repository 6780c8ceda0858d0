"""txmq bench tx|send|consume: throughput and latency against a broker."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from txmq.defaults import MAX_BUSY_POLL_S

from .. import exitcodes
from ..common import DEFAULT_BROKER, BrokerOpt, CliError, check_choice, choices, OutputOpt, TokenOpt, parse_address, parse_duration, run
from ..console import Output, default_output, emit_json, err, esc, new_table, out, print_table

EPILOG = (
    "Examples:\n\n"
    "  txmq bench tx --embedded --flush sync --connections 32 --messages 50000\n\n"
    "  txmq bench send --batch 64 --duration 10s -o json\n\n"
    "  txmq bench tx --mix commit=8,rollback=1,unknown=1 --rate 5000\n\n"
    "  txmq bench consume --messages 200000"
)


def _mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for part in text.split(","):
        k, _, v = part.partition("=")
        k = k.strip()
        if k not in ("commit", "rollback", "unknown"):
            raise CliError(f"--mix: unknown state {k!r} (commit, rollback, unknown)", exitcodes.USAGE)
        try:
            mix[k] = float(v or 1)
        except ValueError:
            raise CliError(f"--mix: bad weight {v!r}", exitcodes.USAGE) from None
    if not mix or sum(mix.values()) <= 0:
        raise CliError("--mix needs at least one positive weight", exitcodes.USAGE)
    return mix


def bench(
    mode: Annotated[str, typer.Argument(help="tx (half + end transaction, wire level), tx-client (transactions through the client library's TransactionProducer), send (plain sends), or consume (pulls).", autocompletion=choices("tx", "tx-client", "send", "consume"))],
    broker: BrokerOpt = DEFAULT_BROKER,
    token: TokenOpt = None,
    embedded: Annotated[bool, typer.Option(help="Start a broker in a subprocess on a temporary data directory.")] = False,
    flush: Annotated[str, typer.Option(help="Flush mode of the --embedded broker: sync or async.", autocompletion=choices("sync", "async"))] = "async",
    connections: Annotated[int, typer.Option("--connections", "-c", min=1, max=4096, help="Connections.")] = 4,
    inflight: Annotated[int, typer.Option("--inflight", "-n", min=1, max=100_000, help="Requests in flight per connection.")] = 64,
    messages: Annotated[Optional[int], typer.Option("--messages", "-m", min=1, help="Transactions or messages to complete [default: 100000 unless --duration].", show_default=False)] = None,
    duration: Annotated[Optional[str], typer.Option("--duration", "-d", help="Run for this long instead (e.g. 10s).", show_default=False)] = None,
    size: Annotated[int, typer.Option(min=0, max=4 << 20, help="Body size in bytes.")] = 256,
    batch: Annotated[int, typer.Option(min=1, max=10_000, help="send: messages per send_batch; consume: messages per pull.")] = 1,
    mix: Annotated[str, typer.Option(help="tx: weights of the end states, e.g. commit=8,rollback=1,unknown=1 (a checker answers unknowns).")] = "commit=1",
    rate: Annotated[Optional[float], typer.Option(min=1, help="Limit to this many units per second (open loop), to measure latency below saturation.", show_default=False)] = None,
    topic: Annotated[str, typer.Option(help="Topic to use.")] = "bench",
    end: Annotated[str, typer.Option(help="tx-client: pipelined (send_in_transaction returns once the end is queued, the library's default) or wait (each call waits for the end's reply).", autocompletion=choices("pipelined", "wait"))] = "pipelined",
    busy_poll: Annotated[str, typer.Option(help="tx-client: the producers' busy_poll, e.g. 1ms (spin on the socket for a reply "
                                            "while one connection of the process is busy; docs/client.md, \"Busy polling\"); 0 = off, as by default.")] = "0",
    output: OutputOpt = None,
) -> None:
    """Measure throughput and latency percentiles (p50, p90, p99, p99.9, max) per operation."""
    from txmq.client.bench import Bench, BenchConfig, EmbeddedBroker

    from ..console import note, warn

    check_choice(mode, ("tx", "tx-client", "send", "consume"), "'MODE'")
    check_choice(end, ("pipelined", "wait"), "'--end'")
    if mode == "tx-client" and rate:
        raise CliError("--rate applies to tx, send and consume, not tx-client (producers send back to back)", exitcodes.USAGE)
    check_choice(flush, ("sync", "async"), "'--flush'")
    if not embedded:
        parse_address(broker)
    dur = parse_duration(duration) if duration else None
    poll_s = parse_duration(busy_poll)
    if poll_s and mode != "tx-client":
        raise CliError("--busy-poll applies to tx-client", exitcodes.USAGE)
    if poll_s > MAX_BUSY_POLL_S:
        raise CliError(f"--busy-poll must be at most {MAX_BUSY_POLL_S * 1000:g}ms", exitcodes.USAGE)
    if messages is None and dur is None:
        messages = 100_000
    output = output or default_output()
    cfg = BenchConfig(mode=mode, address=broker, token=token, connections=connections, inflight=inflight, messages=messages,
                      duration=dur, size=size, batch=batch, topic=topic, mix=_mix(mix), rate=rate)

    def go(progress) -> dict:
        async def main() -> dict:
            if mode == "tx-client":
                from txmq.client.bench_client import ClientBench

                res = await ClientBench(cfg, end, progress, busy_poll=poll_s).run()
                res["busy_poll_s"] = poll_s
                return res
            return await Bench(cfg, progress, warn=warn, note=note).run()

        if embedded:
            with EmbeddedBroker(flush) as eb:
                cfg.address = eb.address
                c0 = eb.cpu_seconds()
                res = run(main())
                res["broker_cpu_s"] = round(eb.cpu_seconds() - c0, 3)
                res["broker_rss_mb"] = round(eb.rss_mb(), 1)
                res["flush"] = flush
                return res
        res = run(main())
        res["flush"] = flush_mode
        return res

    flush_mode = None
    if not embedded:  # a broker answers there (not another service, not refusing the token) before the run starts
        from ..client_ops import call

        flush_mode = call(broker, token, "broker_info", {}).get("flush")

    try:
        if output is Output.table and err.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(TextColumn(f"bench {mode}"), BarColumn(), TextColumn("{task.completed:,.0f}"), TimeElapsedColumn(), console=err, transient=True) as p:
                task = p.add_task("run", total=messages or None)
                res = go(lambda done, total: p.update(task, completed=done))
        else:
            res = go(None)
    except (ConnectionError, OSError) as e:
        raise CliError(f"broker unreachable at {cfg.address}: {e}", exitcodes.UNREACHABLE) from None
    if output is not Output.table:
        emit_json(res)
    else:
        _table(res)
    if res["errors"]:
        raise typer.Exit(exitcodes.PARTIAL)


def _table(res: dict) -> None:
    """The summary line and a latency table, drawn as every command's tables are (plain text in a pipe)."""
    out.print(f"[bold]{res['mode']}[/bold] flush={res.get('flush')} connections={res['connections']} inflight={res['inflight']} "
              f"size={res['size']} batch={res['batch']}: [ok]{res['throughput']:,.0f} {res['unit']}[/ok] "
              f"({res['completed']:,} in {res['elapsed_s']}s)")
    t = new_table()
    t.add_column("OPERATION")
    for label in ("COUNT", "P50 MS", "P90 MS", "P99 MS", "P99.9 MS", "MAX MS"):
        t.add_column(label, justify="right", no_wrap=True)
    for op, p in res["latency_ms"].items():
        if p.get("count"):
            t.add_row(esc(op), f"{p['count']:,}", *(str(p[k]) for k in ("p50", "p90", "p99", "p999", "max")))
    print_table(t)
    if res["errors"]:
        err.print(f"[err]errors:[/err] {res['errors']}")


def register(app: typer.Typer) -> None:
    app.command("bench", epilog=EPILOG)(bench)
