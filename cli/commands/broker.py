"""txmq broker start|status."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import exitcodes
from ..common import BrokerOpt, CliError, OutputOpt, TokenOpt, parse_duration, stop_event
from ..console import default_output, kv_table

app = typer.Typer(help="Run a broker or ask one how it is.", no_args_is_help=True)


@app.command(
    epilog="Examples:\n\n  txmq broker start\n\n  txmq broker start --data-dir /var/lib/txmq --flush sync\n\n"
    "  txmq broker start --check-interval 30s --transaction-timeout 10s --max-checks 5"
)
def start(
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir", "-d", envvar="TXMQ_DATA_DIR", help="Data directory [default: ~/.local/share/txmq].", show_default=False)] = None,
    host: Annotated[Optional[str], typer.Option(help="Address to listen on [default: 127.0.0.1]. Another address without --auth-token draws a warning.", show_default=False)] = None,
    port: Annotated[int, typer.Option(help="Port to listen on.", min=1, max=65535)] = 10911,
    flush: Annotated[str, typer.Option(help="sync: acknowledge after fsync (group commit); async: fsync every --flush-interval.")] = "async",
    flush_interval: Annotated[str, typer.Option(help="Async flush interval.")] = "500ms",
    check_interval: Annotated[Optional[str], typer.Option(help="Check-back interval [default: 60s].", show_default=False)] = None,
    transaction_timeout: Annotated[Optional[str], typer.Option("--transaction-timeout", "--timeout", help="Check immunity of a new half message [default: 6s].", show_default=False)] = None,
    max_checks: Annotated[Optional[int], typer.Option(help="Checks before a transaction is discarded [default: 15].", show_default=False)] = None,
    retention: Annotated[Optional[str], typer.Option(help="Log retention [default: 72h].", show_default=False)] = None,
    auth_token: Annotated[Optional[str], typer.Option(envvar="TXMQ_AUTH_TOKEN", help="Shared secret clients must present.", show_default=False)] = None,
    metrics_port: Annotated[Optional[int], typer.Option(help="Serve Prometheus metrics on 127.0.0.1:PORT (same host as --host).", show_default=False, min=1, max=65535)] = None,
    log_format: Annotated[str, typer.Option(help="kv (key=value) or json.")] = "kv",
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error.")] = "info",
    segment_size: Annotated[int, typer.Option(help="Commit-log segment size in bytes.", hidden=True, min=1 << 16, max=1 << 40)] = 1 << 30,
    max_frame: Annotated[int, typer.Option(help="Largest frame accepted, bytes.", min=1024, max=(1 << 32) - 1)] = 8 << 20,
    max_body: Annotated[int, typer.Option(help="Largest message body accepted, bytes.", min=0, max=(1 << 32) - 1)] = 4 << 20,
    max_properties: Annotated[int, typer.Option(help="Largest total of one message's property keys and values (UTF-8), bytes; "
                                                "--max-frame must hold --max-body + --max-properties + 4096.")] = 64 << 10,
    max_preauth_frame: Annotated[int, typer.Option(help="With --auth-token: largest frame accepted before a successful hello, bytes.")] = 64 << 10,
    auth_timeout: Annotated[str, typer.Option(help="Time a new connection has to send its first request (with --auth-token: a "
                                              "successful hello) before it is closed; 0 = no limit. Connections that said hello may idle forever.")] = "10s",
    frame_timeout: Annotated[str, typer.Option(help="Time a frame may take from its first byte to its last before the connection "
                                               "is closed; 0 = no limit.")] = "60s",
    max_connections: Annotated[Optional[int], typer.Option(help="Open connections at most; more are accepted and closed at once with "
                                                           "a BUSY reply [default: RLIMIT_NOFILE minus 512 descriptors kept for the "
                                                           "broker's own files (at most half of it); the broker first raises its soft "
                                                           "RLIMIT_NOFILE to the hard limit, up to 65536].", show_default=False)] = None,
    max_connections_per_ip: Annotated[int, typer.Option(help="Open connections at most from one remote address; 0 = no limit.")] = 0,
    partial_frame_budget: Annotated[int, typer.Option(help="Bytes all connections together may hold in frames still being received; "
                                                      "a connection whose frame would pass it is closed with a BUSY reply.")] = 256 << 20,
    index_snapshot_records: Annotated[Optional[int], typer.Option(min=0, hidden=True, help="Deprecated, no effect: the transaction index is flushed to txindex.db every second.", show_default=False)] = None,
) -> None:
    """Run a broker in the foreground until SIGINT/SIGTERM (logs on stderr)."""
    import asyncio
    import logging

    from txmq.broker.config import BrokerConfig, CheckSettings, default_data_dir
    from txmq.broker.server import Broker, bind, install_uvloop, raise_fd_limit
    from txmq.store import StoreLockedError
    from txmq.store.errors import DataFileError

    from .. import logs

    if flush not in ("sync", "async"):
        raise CliError(f"--flush must be sync or async, not {flush!r}", exitcodes.USAGE)
    if log_format not in ("kv", "json"):
        raise CliError("--log-format must be kv or json", exitcodes.USAGE)
    if log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise CliError(f"--log-level must be debug, info, warning or error, not {log_level!r}", exitcodes.USAGE)
    if data_dir is not None and data_dir.exists() and not data_dir.is_dir():
        raise CliError(f"data directory {data_dir} is not a directory", exitcodes.NOT_FOUND)
    logs.setup(log_format, log_level)
    log = logging.getLogger("txmq.broker")
    if index_snapshot_records is not None:
        log.warning("event=deprecated_option option=--index-snapshot-records msg=%s", "'no effect: the transaction index is flushed to txindex.db every second'")
    check = CheckSettings()
    overrides = []
    try:
        for key, val in (("check_interval_s", check_interval), ("transaction_timeout_s", transaction_timeout), ("retention_s", retention)):
            if val is not None:
                check = check.with_value(key, parse_duration(val))
                overrides.append(key)
        if max_checks is not None:
            check = check.with_value("max_checks", max_checks)
            overrides.append("max_checks")
    except ValueError as e:
        raise CliError(str(e), exitcodes.USAGE) from None
    if host is not None and host not in ("127.0.0.1", "localhost", "::1") and not auth_token:
        log.warning("event=insecure_listen host=%s msg=%s", host, "'listening beyond loopback without --auth-token: anyone who can reach the port can send, commit and roll back'")
    config = BrokerConfig(
        data_dir=data_dir or default_data_dir(), host=host or "127.0.0.1", port=port, flush=flush,
        flush_interval_s=parse_duration(flush_interval), check=check, check_overrides=tuple(overrides),
        auth_token=auth_token or None, metrics_port=metrics_port, segment_size=segment_size,
        max_frame=max_frame, max_body=max_body, max_properties=max_properties, max_preauth_frame=max_preauth_frame,
        auth_timeout_s=parse_duration(auth_timeout), frame_timeout_s=parse_duration(frame_timeout),
        max_connections=max_connections, max_connections_per_ip=max_connections_per_ip, partial_frame_budget=partial_frame_budget,
    )
    try:
        config.validated()
    except ValueError as e:
        raise CliError(str(e), exitcodes.USAGE) from None
    fds_before, fds = raise_fd_limit()
    if fds != fds_before:
        log.info("event=fd_limit_raised from=%d to=%d", fds_before, fds)
    loop_name = install_uvloop()
    import gc

    # Fewer, cheaper collections: the broker allocates a few objects per
    # request, almost none of them in cycles (measured: -20% CPU per check-back).
    gc.set_threshold(50_000, 50, 100)
    try:
        sock = bind(config.host, config.port)
    except OSError as e:
        raise CliError(f"cannot listen on {config.host}:{config.port}: {e.strerror or e}") from None

    async def main() -> None:
        shutdown = stop_event()
        broker = Broker(config)
        log.info("event=starting loop=%s data_dir=%s", loop_name, config.data_dir)
        metrics = None
        if config.metrics_port is not None:
            from txmq.broker.prom import serve_metrics

            metrics = serve_metrics(broker.core, config.host, config.metrics_port)
        try:
            await broker.serve(sock, shutdown)
        finally:
            if metrics is not None:
                metrics.shutdown()

    try:
        asyncio.run(main())
    except StoreLockedError as e:
        raise CliError(f"data directory {config.data_dir} is in use by another broker ({e})") from None
    except DataFileError as e:  # a damaged file of the data directory: the message names it and what to do
        raise CliError(f"cannot start: {e}") from None


@app.command(epilog="Examples:\n\n  txmq broker status\n\n  txmq broker status -o json | jq .uptime_s")
def status(broker: BrokerOpt = "127.0.0.1:10911", token: TokenOpt = None, output: OutputOpt = None) -> None:
    """Whether a broker answers at --broker, and its basic figures."""
    from ..client_ops import connect
    from ..common import run

    async def go() -> tuple[dict, dict, float]:
        async with connect(broker, token) as c:
            info = await c.request("broker_info", {})
            # one request's round trip on the open connection (not connecting, importing or printing)
            t0 = time.perf_counter()
            check = await c.request("config_get", {})
            return info, check, (time.perf_counter() - t0) * 1000

    info, check, rtt_ms = run(go())
    output = output or default_output()
    counters = info.pop("counters", {})
    row = {
        "status": "up", "address": broker, "version": info["version"], "uptime_s": info["uptime_s"],
        "flush": info["flush"], "data_dir": info["data_dir"], "connections": info["connections"],
        "topics": info["topics"], "max_offset": info["max_offset"], "durable_offset": info["durable_offset"],
        "producer_groups": info["producer_groups"], "auth": info["auth"], "speedups": info.get("speedups", "unknown"),
        "damaged_records": info.get("damaged_records", 0),
        # the check settings in effect (start options, else config.json, else the defaults)
        **{k: check.get(k) for k in ("check_interval_s", "transaction_timeout_s", "max_checks", "retention_s")},
        "rtt_ms": round(rtt_ms, 2),
        "messages_sent": counters.get("messages_sent", 0), "half_stored": counters.get("half_stored", 0),
    }
    kv_table(row, output, title=f"txmq broker at {broker}")
