"""txmq broker start|status."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from txmq import defaults
from txmq.constants import DEFAULT_HOST, DEFAULT_PORT, MESSAGE_DELAY_LEVEL

from .. import exitcodes
from ..common import DEFAULT_BROKER, BrokerOpt, CliError, check_choice, choices, OutputOpt, TokenOpt, parse_duration
from ..console import Output, default_output, kv_table, warn

if TYPE_CHECKING:
    from txmq.broker.config import BrokerConfig, CheckSettings

app = typer.Typer(help="Run a broker or ask one how it is.", no_args_is_help=True)


def _duration(seconds: float) -> str:
    """A default duration as an option takes it: the smallest unit that makes it a whole number below 1000 (500ms, 60s, 72h)."""
    for unit, n in (("ms", 0.001), ("s", 1), ("m", 60), ("h", 3600)):
        value = seconds / n
        if value == int(value) and value < 1000:
            return f"{int(value)}{unit}"
    return f"{seconds:g}"


@app.command(
    epilog="Examples:\n\n  txmq broker start\n\n  txmq broker start --data-dir /var/lib/txmq --flush sync\n\n"
    "  txmq broker start --check-interval 30s --transaction-timeout 10s --max-checks 5\n\n"
    "  txmq broker start --rocketmq-port 8081\n\n"
    "  txmq broker start --remoting-port 9876        # RocketMQ 4 clients: namesrvAddr 127.0.0.1:9876\n\n"
    "  txmq broker start --no-auto-create-topics      # topics only by `txmq topics create`"
)
def start(
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir", "-d", envvar="TXMQ_DATA_DIR", help="Data directory [default: ~/.local/share/txmq].", show_default=False)] = None,
    host: Annotated[Optional[str], typer.Option(help=f"Address to listen on [default: {DEFAULT_HOST}]. Another address without --auth-token draws a warning.", show_default=False)] = None,
    port: Annotated[int, typer.Option(help="Port to listen on.", min=1, max=65535)] = DEFAULT_PORT,
    flush: Annotated[str, typer.Option(help="sync: acknowledge after fsync (group commit); async: fsync every --flush-interval.", autocompletion=choices("sync", "async"))] = defaults.FLUSH,
    flush_interval: Annotated[str, typer.Option(help="Async flush interval (1ms to 1h).")] = _duration(defaults.FLUSH_INTERVAL_S),
    check_interval: Annotated[Optional[str], typer.Option(help=f"Check-back interval [default: {_duration(defaults.CHECK_INTERVAL_S)}].", show_default=False)] = None,
    transaction_timeout: Annotated[Optional[str], typer.Option("--transaction-timeout", "--timeout", help=f"Check immunity of a new half message [default: {_duration(defaults.TRANSACTION_TIMEOUT_S)}].", show_default=False)] = None,
    max_checks: Annotated[Optional[int], typer.Option(help=f"Checks before a transaction is discarded [default: {defaults.MAX_CHECKS}].", show_default=False)] = None,
    retention: Annotated[Optional[str], typer.Option(help=f"Log retention [default: {_duration(defaults.RETENTION_S)}].", show_default=False)] = None,
    auth_token: Annotated[Optional[str], typer.Option(envvar="TXMQ_AUTH_TOKEN", help="Shared secret clients must present.", show_default=False)] = None,
    metrics_port: Annotated[Optional[int], typer.Option(help="Also serve Prometheus metrics at http://HOST:PORT/metrics, HOST being --host's address "
                                                     "(README, \"Metrics\").", show_default=False, min=1, max=65535)] = None,
    log_format: Annotated[str, typer.Option(help="kv (key=value) or json.", autocompletion=choices("kv", "json"))] = "kv",
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error.", autocompletion=choices("debug", "info", "warning", "error"))] = "info",
    segment_size: Annotated[int, typer.Option(help="Commit-log segment size in bytes.", hidden=True, min=1 << 16, max=1 << 40)] = defaults.SEGMENT_SIZE,
    max_frame: Annotated[int, typer.Option(help="Largest frame accepted, bytes.", min=1024, max=(1 << 32) - 1)] = defaults.MAX_FRAME,
    max_body: Annotated[int, typer.Option(help="Largest message body accepted, bytes.", min=0, max=(1 << 32) - 1)] = defaults.MAX_BODY,
    max_properties: Annotated[int, typer.Option(help="Largest total of one message's property keys and values (UTF-8), bytes; "
                                                "--max-frame must hold --max-body + --max-properties + 4096.")] = defaults.MAX_PROPERTIES,
    max_preauth_frame: Annotated[int, typer.Option(help="With --auth-token: largest frame accepted before a successful hello, bytes.")] = defaults.MAX_PREAUTH_FRAME,
    auth_timeout: Annotated[str, typer.Option(help="Time a new connection has to send its first request (with --auth-token: a "
                                              "successful hello) before it is closed; 0 = no limit. Connections that said hello may idle forever. "
                                              "On --rocketmq-port: the time to finish TLS and HTTP/2's handshake (0: gRPC's 2 minutes).")] = _duration(defaults.AUTH_TIMEOUT_S),
    frame_timeout: Annotated[str, typer.Option(help="Time a frame may take from its first byte to its last before the connection "
                                               "is closed; 0 = no limit.")] = _duration(defaults.FRAME_TIMEOUT_S),
    max_connections: Annotated[Optional[int], typer.Option(help="Open connections at most; more are accepted and closed at once with "
                                                           "a BUSY reply [default: RLIMIT_NOFILE minus 512 descriptors kept for the "
                                                           "broker's own files (at most half of it), or half of that with "
                                                           "--rocketmq-port, or what --rocketmq-max-connections leaves of it; the broker "
                                                           "first raises its soft RLIMIT_NOFILE to the hard limit, up to 65536].",
                                                           show_default=False)] = None,
    max_connections_per_ip: Annotated[int, typer.Option(help="Open connections at most from one remote address; 0 = no limit.")] = defaults.MAX_CONNECTIONS_PER_IP,
    partial_frame_budget: Annotated[int, typer.Option(help="Bytes all connections together may hold in frames still being received; "
                                                      "a connection whose frame would pass it is closed with a BUSY reply.")] = defaults.PARTIAL_FRAME_BUDGET,
    rocketmq_port: Annotated[Optional[int], typer.Option(help="Also serve Apache RocketMQ 5's gRPC service (its official SDKs) on this port, "
                                                         "same host as --host; needs the extra txmq[rocketmq] (docs/rocketmq.md).",
                                                         show_default=False, min=1, max=65535)] = None,
    rocketmq_max_connections: Annotated[Optional[int], typer.Option(help="With --rocketmq-port: open connections to that port at "
                                                                    "most, counted before any authentication; more are accepted and "
                                                                    "closed at once [default: (RLIMIT_NOFILE - 512) / 2, the other half "
                                                                    "going to --max-connections, or what a given --max-connections "
                                                                    "leaves of RLIMIT_NOFILE - 512].", show_default=False, min=1)] = None,
    rocketmq_tls_cert: Annotated[Optional[Path], typer.Option(help="With --rocketmq-port: serve it over TLS with this certificate "
                                                              "chain (PEM); needs --rocketmq-tls-key.", show_default=False)] = None,
    rocketmq_tls_key: Annotated[Optional[Path], typer.Option(help="With --rocketmq-port: the TLS private key (PEM) of "
                                                             "--rocketmq-tls-cert.", show_default=False)] = None,
    remoting_port: Annotated[Optional[int], typer.Option(help="Also serve Apache RocketMQ 4's remoting protocol (its 4.x clients, "
                                                         "the C++ client and its bindings) on this port, same host as --host: it answers "
                                                         "the name server's requests and the broker's, so clients take host:port as their "
                                                         "namesrvAddr (docs/remoting.md).", show_default=False, min=1, max=65535)] = None,
    remoting_max_connections: Annotated[Optional[int], typer.Option(help="With --remoting-port: open connections to that port at "
                                                                    "most; more are accepted and closed at once [default: an equal "
                                                                    "share of RLIMIT_NOFILE - 512 with the other ports].",
                                                                    show_default=False, min=1)] = None,
    remoting_vip_channel: Annotated[bool, typer.Option(help="With --remoting-port: also serve it on --remoting-port - 2, the "
                                                       "\"VIP channel\" Java clients before 4.5.1 send to by default "
                                                       "(docs/remoting.md).")] = False,
    message_delay_level: Annotated[str, typer.Option(help="RocketMQ's messageDelayLevel: the delay of each delay level, 1 first, "
                                                     "separated by spaces (ms, s, m, h, d); a RocketMQ 4 consumer's retry waits "
                                                     "level 3 + its reconsume times.")] = MESSAGE_DELAY_LEVEL,
    busy_poll: Annotated[str, typer.Option(help="After a lone client's request or reply, keep one CPU spinning at the lowest "
                                            "priority (SCHED_IDLE) this long, so the next request or the end of an fsync finds it "
                                            "awake instead of halted; costs only idle CPU; 0 = off, at most 100ms "
                                            "(docs/architecture.md, \"Busy polling\").")] = _duration(defaults.BUSY_POLL_S),
    auto_create_topics: Annotated[bool, typer.Option("--auto-create-topics/--no-auto-create-topics",
                                                     help="Create a topic the first time a native or RocketMQ 4 send or route names it "
                                                     "(RocketMQ 5 gRPC clients get TOPIC_NOT_FOUND whatever this says, as on RocketMQ 5); "
                                                     "with --no-auto-create-topics such requests are refused until `txmq topics create`.")] = defaults.AUTO_CREATE_TOPICS,
    max_delay: Annotated[str, typer.Option(help="The furthest ahead a timed message (TIMER_*, --delay, --deliver-at, a gRPC "
                                           "delivery_timestamp) may be due (RocketMQ's default: 3 days); a send due later is "
                                           "refused. DELAY levels wait their --message-delay-level delay, as in RocketMQ "
                                           "(docs/scheduled.md).")] = _duration(defaults.MAX_DELAY_S),
    frontend_processes: Annotated[str, typer.Option(envvar="TXMQ_FRONTEND_PROCESSES",
                                                     help="With --rocketmq-port or --remoting-port: serve them from this many worker "
                                                     "processes (0 to 64), which hold the connections (gRPC, HTTP/2, TLS; remoting's TCP) "
                                                     "and relay each RPC, or each connection's bytes, to the broker process, the only one "
                                                     "that opens the data directory; 0: the broker process serves them itself; auto: none "
                                                     "below 4 cores, else one per core beyond two, at most 4 (docs/architecture.md, "
                                                     "\"Front-end workers\").")] = "auto",
    index_snapshot_records: Annotated[Optional[int], typer.Option(min=0, hidden=True, help="Deprecated, no effect: the transaction index is flushed to txindex.db every second.", show_default=False)] = None,
) -> None:
    """Run a broker in the foreground until SIGINT/SIGTERM (logs on stderr)."""
    from txmq.broker.config import BrokerConfig, default_data_dir

    _check_start_options(flush, log_format, log_level, data_dir)
    relayable = rocketmq_port is not None or remoting_port is not None
    workers = _frontend_processes(frontend_processes) if relayable else 0  # a bad value: before any set-up
    _start_logging(log_format, log_level, index_snapshot_records)
    check, overrides = _check_settings_from_options(check_interval, transaction_timeout, retention, max_checks)
    config = BrokerConfig(
        data_dir=data_dir or default_data_dir(), host=host or DEFAULT_HOST, port=port, flush=flush,
        flush_interval_s=parse_duration(flush_interval), check=check, check_overrides=overrides,
        auth_token=auth_token or None, metrics_port=metrics_port, segment_size=segment_size,
        max_frame=max_frame, max_body=max_body, max_properties=max_properties, max_preauth_frame=max_preauth_frame,
        auth_timeout_s=parse_duration(auth_timeout), frame_timeout_s=parse_duration(frame_timeout),
        max_connections=max_connections, max_connections_per_ip=max_connections_per_ip, partial_frame_budget=partial_frame_budget,
        rocketmq_port=rocketmq_port, rocketmq_tls_cert=rocketmq_tls_cert, rocketmq_tls_key=rocketmq_tls_key,
        rocketmq_max_connections=rocketmq_max_connections,
        remoting_port=remoting_port, remoting_max_connections=remoting_max_connections, remoting_vip_channel=remoting_vip_channel,
        message_delay_levels_ms=_delay_levels(message_delay_level),
        busy_poll_s=parse_duration(busy_poll), auto_create_topics=auto_create_topics, max_delay_s=parse_duration(max_delay),
        frontend_processes=workers,
    )
    _run_broker(config)


def _frontend_processes(text: str) -> int:
    from txmq.broker.config import auto_frontend_processes

    if text.strip().lower() == "auto":
        return auto_frontend_processes()
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 64:
        raise CliError(f"--frontend-processes must be auto or a number from 0 to 64, not {text!r}", exitcodes.USAGE)
    return n


def _delay_levels(text: str) -> tuple[int, ...]:
    from txmq.broker.config import parse_delay_levels

    try:
        return parse_delay_levels(text)
    except ValueError as exc:
        raise CliError(str(exc), exitcodes.USAGE) from None


def _check_start_options(flush: str, log_format: str, log_level: str, data_dir: Path | None) -> None:
    """The checks of `broker start`'s options that come before anything is logged."""
    check_choice(flush, ("sync", "async"), "'--flush'")
    check_choice(log_format, ("kv", "json"), "'--log-format'")
    if log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        check_choice(log_level, ("debug", "info", "warning", "error"), "'--log-level'")
    if data_dir is not None and data_dir.exists() and not data_dir.is_dir():
        raise CliError(f"data directory {data_dir} is not a directory", exitcodes.NOT_FOUND)


def _start_logging(log_format: str, log_level: str, index_snapshot_records: int | None) -> None:
    import logging

    from txmq.broker import logs

    logs.setup(log_format, log_level)
    if index_snapshot_records is not None:
        logging.getLogger("txmq.broker").warning("event=deprecated_option option=--index-snapshot-records msg=%s",
                                                 "'no effect: the transaction index is flushed to txindex.db every second'")


def _check_settings_from_options(check_interval: str | None, transaction_timeout: str | None, retention: str | None,
                                 max_checks: int | None) -> tuple[CheckSettings, tuple[str, ...]]:
    """The check settings the options give, over the defaults, and the names of those they give."""
    from txmq.broker.config import CheckSettings

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
    return check, tuple(overrides)


def _run_broker(config: BrokerConfig) -> None:
    """Serve until a signal; a broker that cannot start is a usage error, a missing extra or an error, each with its exit code."""
    from txmq.broker.main import InvalidConfig, MissingDependency, StartError, run

    try:
        run(config)  # txmq.broker.main: fd limit, uvloop, GC, bind, metrics, serve until a signal, clean shutdown
    except InvalidConfig as e:
        raise CliError(str(e), exitcodes.USAGE) from None
    except MissingDependency as e:  # --rocketmq-port without the rocketmq extra
        raise CliError(str(e), exitcodes.MISSING_DEPENDENCY) from None
    except StartError as e:  # cannot listen, the data directory in use, a damaged file of it
        from ._ports import explain_in_use

        raise CliError(explain_in_use(str(e)) or str(e)) from None


def _workers(rows: list | None) -> str:
    """2 of 2 up (pids 6180 6181), 3 remoting connections, 1 restart"""
    if not rows:
        return "-"
    up = [r for r in rows if r.get("alive")]
    restarts = sum(r.get("restarts", 0) for r in rows)
    text = f"{len(up)} of {len(rows)} up (pids {' '.join(str(r['pid']) for r in up)})" if up else f"0 of {len(rows)} up"
    conns = sum(r.get("connections") or 0 for r in rows)  # remoting connections they hold (absent: an older broker)
    text += f", {conns} remoting connection{'s' if conns != 1 else ''}" if conns else ""
    return text + (f", {restarts} restart{'s' if restarts != 1 else ''}" if restarts else "")


def _listeners(listeners: dict | None) -> str:
    """native 127.0.0.1:9876, rocketmq 127.0.0.1:8081 (tls), metrics http://127.0.0.1:9100/metrics"""
    if not listeners:
        return "-"
    parts = []
    for name, v in listeners.items():
        host, port = v.get("host", ""), v.get("port")
        address = f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
        if "path" in v:
            address = f"http://{address}{v['path']}"
        parts.append(f"{name} {address}" + (" (tls)" if v.get("tls") else ""))
    from rich.markup import escape

    return escape(", ".join(parts))


@app.command(epilog="Examples:\n\n  txmq broker status\n\n  txmq broker status -o json | jq .uptime_s")
def status(broker: BrokerOpt = DEFAULT_BROKER, token: TokenOpt = None, output: OutputOpt = None) -> None:
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
        "fsync_thread": info.get("fsync_thread", "unknown"),
        "log_sync_error": info.get("log_sync_error"),  # set while the log cannot be fsynced (docs/reliability.md)
        "busy_poll": info.get("busy_poll", "unknown"), "busy_poll_window_us": info.get("busy_poll_window_us"),
        "damaged_records": info.get("damaged_records", 0),
        "auto_create_topics": info.get("auto_create_topics"),  # null: a broker older than the option (it creates them)
        # every port it listens on: native, and rocketmq and metrics when started with them (null: an older broker)
        "listeners": info.get("listeners"),
        # the worker processes serving --rocketmq-port and --remoting-port with --frontend-processes (null: an older broker)
        "frontend_workers": info.get("frontend_workers"),
        # the check settings in effect (start options, else config.json, else the defaults)
        **{k: check.get(k) for k in ("check_interval_s", "transaction_timeout_s", "max_checks", "retention_s")},
        "rtt_ms": round(rtt_ms, 2),
        "messages_sent": counters.get("messages_sent", 0), "half_stored": counters.get("half_stored", 0),
    }
    if output is Output.table:  # durations as they are typed (1m, 72h), the uptime as an age; -o json keeps seconds
        from ..console import fmt_age, fmt_duration

        shown = {k.removesuffix("_s") if k.endswith("_s") else k: v for k, v in row.items()}
        kv_table(shown, output, title=f"txmq broker at {broker}",
                 formatters={"listeners": _listeners, "frontend_workers": _workers, "uptime": fmt_age,
                             **{k: fmt_duration for k in ("check_interval", "transaction_timeout", "retention")}})
    else:
        kv_table(row, output, title=f"txmq broker at {broker}", formatters={"listeners": _listeners, "frontend_workers": _workers})
    if row["log_sync_error"]:
        warn(f"the last fsync of the commit log failed ({row['log_sync_error']}); nothing past durable_offset "
             "is acknowledged until one succeeds (docs/reliability.md, \"A failed fsync\")")
