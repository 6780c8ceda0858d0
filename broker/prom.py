"""Prometheus exposition (``--metrics-port``), built with prometheus_client.

A custom collector reads the broker's plain counters at scrape time, so
the hot path never touches prometheus_client. The scrape runs in
prometheus_client's HTTP thread; it reads dicts that the loop mutates,
which is safe for a snapshot under the GIL (copies are taken first).
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

SOURCES = ("producer", "check", "operator")
METRICS_PATH = "/metrics"  # prometheus_client's server answers any path; this is the one documented and logged


COUNTERS = (
    ("half_stored", "Half messages stored"),
    ("checks_sent", "Check-back requests sent to producers"),
    ("checks_answered", "Check-back answers received"),
    ("unknown_answers", "UNKNOW answers to end transaction (from producers and check-backs)"),
    ("discarded", "Transactions moved to the discard topic"),
    ("replayed", "Discarded transactions replayed"),
    ("messages_sent", "Plain messages stored"),
    ("messages_pulled", "Messages returned to consumers"),
    ("messages_scheduled", "Delayed and timed messages stored for a later delivery"),
    ("scheduled_delivered", "Delayed and timed messages delivered to their topics when due"),
    ("scheduled_cancelled", "Delayed and timed messages cancelled before they were due"),
    ("bytes_appended", "Bytes appended to the commit log"),
    ("records_appended", "Records appended to the commit log"),
    ("store_full_errors", "Appends refused because the disk was full"),
    ("flush_errors", "Failed fsync or checkpoint cycles (logged once per failing spell: event=flush_failed, event=flush_recovered)"),
    ("fd_exhausted_errors", "Requests failed for lack of a file descriptor (logged once per spell: event=fds_exhausted, event=fds_available)"),
    ("connections_accepted", "Client connections accepted"),
    ("auth_failures", "Connections refused for a wrong token"),
    ("connections_refused", "Connections closed as soon as accepted: --max-connections reached"),
    ("connections_refused_per_ip", "Connections closed as soon as accepted: --max-connections-per-ip reached for their address"),
    ("auth_timeouts", "Connections closed for no first request (hello, with a token) within --auth-timeout"),
    ("frame_timeouts", "Connections closed for a frame not complete within --frame-timeout"),
    ("partial_frame_refusals", "Connections closed because their partial frame would pass --partial-frame-budget"),
    ("check_passes", "Check-service passes over the half queue"),
    ("internal_errors", "Requests that met an error nothing expected (event=internal_error; a traceback for the first of each type)"),
    # the RocketMQ 5 gRPC front end (--rocketmq-port)
    ("rmq_requests", "RocketMQ front end: requests served (SendMessage, ReceiveMessage, AckMessage, EndTransaction, ...)"),
    ("rmq_malformed_requests", "RocketMQ front end: requests refused as malformed"),
    ("rmq_internal_errors", "RocketMQ front end: requests answered with an internal error"),
    ("rmq_messages_sent", "RocketMQ front end: messages stored from SendMessage"),
    ("rmq_messages_received", "RocketMQ front end: messages handed to ReceiveMessage"),
    ("rmq_messages_acked", "RocketMQ front end: messages acknowledged by AckMessage"),
    ("rmq_telemetry_streams", "RocketMQ front end: telemetry streams opened"),
    ("rmq_telemetry_overflows", "RocketMQ front end: telemetry streams closed because the client did not read"),
    # the RocketMQ 4 remoting front end (--remoting-port)
    ("remoting_requests", "Remoting front end: requests received"),
    ("remoting_errors", "Remoting front end: requests answered with an error"),
    ("remoting_unsupported_requests", "Remoting front end: requests of a code it does not serve"),
    ("remoting_oneway_failures", "Remoting front end: oneway requests that failed (nothing is answered)"),
    ("remoting_connections_accepted", "Remoting front end: connections accepted"),
    ("remoting_connections_refused", "Remoting front end: connections closed at once, --remoting-max-connections reached"),
    ("remoting_connections_refused_per_ip", "Remoting front end: connections closed at once, --max-connections-per-ip reached"),
    ("remoting_malformed_frames", "Remoting front end: connections closed for a frame that is not a command"),
    ("remoting_auth_failures", "Remoting front end: connections closed for a request not signed with --auth-token"),
    ("remoting_auth_timeouts", "Remoting front end: connections closed for no first request within --auth-timeout"),
    ("remoting_frame_timeouts", "Remoting front end: connections closed for a frame not complete within --frame-timeout"),
    ("remoting_partial_frame_refusals", "Remoting front end: connections closed, their partial frame would pass --partial-frame-budget"),
    ("remoting_checks_sent", "Remoting front end: CHECK_TRANSACTION_STATE requests sent"),
    ("remoting_consumer_notifications", "Remoting front end: NOTIFY_CONSUMER_IDS_CHANGED requests sent"),
    ("remoting_retried", "Remoting front end: messages sent back to a %RETRY% topic"),
    ("remoting_dead_lettered", "Remoting front end: messages sent back past their retries, into a %DLQ% topic"),
)


def _retry(fn, default):
    """Call fn, which iterates a dict the event loop may change meanwhile; a few tries, then default."""
    for _ in range(3):
        try:
            return fn()
        except RuntimeError:  # dictionary changed size during iteration
            continue
    return default


def _histogram(name: str, help_: str, bounds, counts, total: float) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, help_)
    buckets, acc = [], 0
    for b, n in zip(bounds, list(counts)):
        acc += n
        buckets.append(("+Inf" if b == float("inf") else str(b), acc))
    fam.add_metric([], buckets, total)
    return fam


class BrokerCollector:
    def __init__(self, core: Any) -> None:
        self.core = core

    def collect(self) -> Iterator[Any]:
        core = self.core
        if getattr(core, "keeper", None) is None:  # the store is not open yet (a start's recovery): nothing to show
            return
        c = dict(core.metrics.counters)
        pending = GaugeMetricFamily("txmq_pending_half_messages", "Pending (undecided) transactions, by real topic", labels=["topic"])
        by_topic, oldest_ts = core.tx.index.pending_summary()  # this runs in the metrics server's thread
        for topic, n in sorted(by_topic.items()):
            pending.add_metric([topic], n)
        yield pending
        yield GaugeMetricFamily("txmq_pending_transactions", "Pending (undecided) transactions, all topics", value=sum(by_topic.values()))
        oldest = GaugeMetricFamily("txmq_oldest_pending_age_seconds",
                                   "Age of the oldest pending transaction, by producer group (broker store time; absent when none)",
                                   labels=["group"])
        now_ms = int(core.clock() * 1000)
        for g, ts in sorted(oldest_ts.items()):
            oldest.add_metric([g], max(0, now_ms - ts) / 1000.0)
        yield oldest
        for name, help_ in (("committed", "Transactions committed, by who decided"), ("rolled_back", "Transactions rolled back, by who decided")):
            fam = CounterMetricFamily(f"txmq_{name}", help_, labels=["source"])
            for s in SOURCES:
                fam.add_metric([s], c.get(f"{name}_{s}", 0))
            yield fam
        for key, help_ in COUNTERS:
            yield CounterMetricFamily(f"txmq_{key}", help_, value=c.get(key, 0))
        errors = CounterMetricFamily("txmq_errors", "Error replies sent, by error name", labels=["code"])
        for key in sorted(k for k in c if k.startswith("errors_")):
            errors.add_metric([key[len("errors_"):].upper()], c[key])
        yield errors
        refused = CounterMetricFamily("txmq_refused", "Requests and connections refused, by front end and kind (auth, connection_limit, "
                                      "busy, timeout, bad_request; event=refused)", labels=["frontend", "kind"])
        for key in sorted(k for k in c if k.startswith("refused_")):
            frontend, _, kind = key[len("refused_"):].partition("_")
            refused.add_metric([frontend, kind], c[key])
        yield refused
        m = core.metrics
        yield _histogram("txmq_decision_seconds", "Time from a half message's birth to its commit or rollback",
                         m.decision_buckets, m.decision_hist, m.decision_sum)
        yield _histogram("txmq_flush_latency_seconds", "Duration of each fsync that acknowledges sends (group commit, inline)",
                         m.flush.buckets, m.flush.hist, m.flush.total)
        yield GaugeMetricFamily("txmq_flush_seconds_max", "Longest fsync that acknowledged sends", value=m.flush.max)
        yield _histogram("txmq_checkpoint_seconds", "Duration of each checkpoint cycle (log fsync, consume queues, checkpoint file)",
                         m.checkpoint.buckets, m.checkpoint.hist, m.checkpoint.total)
        yield GaugeMetricFamily("txmq_checkpoint_seconds_max", "Longest checkpoint cycle", value=m.checkpoint.max)
        gauges = core.connection_stats()
        yield GaugeMetricFamily("txmq_connections", "Open client connections, every front end", value=gauges["connections"])
        yield GaugeMetricFamily("txmq_remoting_connections", "Open connections to --remoting-port (and its VIP channel); 0 without it",
                                value=gauges.get("remoting_connections", 0))
        yield GaugeMetricFamily("txmq_remoting_max_connections",
                                "Remoting front end's connection limit (--remoting-max-connections, or derived from RLIMIT_NOFILE); 0 without --remoting-port",
                                value=core.config.remoting_max_connections or 0)
        yield GaugeMetricFamily("txmq_remoting_partial_frame_bytes", "Bytes held in partly received frames, remoting connections",
                                value=gauges.get("remoting_partial_frame_bytes", 0))
        yield GaugeMetricFamily("txmq_max_connections", "Connection limit (--max-connections, or derived from RLIMIT_NOFILE)",
                                value=core.config.max_connections or 0)
        yield GaugeMetricFamily("txmq_rocketmq_max_connections",
                                "RocketMQ front end's connection limit (--rocketmq-max-connections, or derived from RLIMIT_NOFILE); 0 without --rocketmq-port",
                                value=core.config.rocketmq_max_connections or 0)
        yield GaugeMetricFamily("txmq_partial_frame_bytes", "Bytes held in partly received frames, all connections",
                                value=gauges["partial_frame_bytes"])
        online = GaugeMetricFamily("txmq_producer_connections", "Live connections registered for check-backs, by producer group", labels=["group"])
        for g, n in sorted(_retry(core.registry.groups, {}).items()):
            online.add_metric([g], n)
        yield online
        rows = [row for status in core.worker_status for row in _retry(status, [])]
        if rows:  # --frontend-processes: one series per worker process (docs/architecture.md, "Front-end workers")
            up = GaugeMetricFamily("txmq_frontend_worker_up", "1 while the front-end worker process is connected to the broker",
                                   labels=["worker"])
            restarts = CounterMetricFamily("txmq_frontend_worker_restarts", "Times the front-end worker process was started again",
                                           labels=["worker"])
            relayed = CounterMetricFamily("txmq_frontend_worker_relayed_calls", "RPCs the worker process relayed to the broker "
                                          "(its current process)", labels=["worker"])
            cpu = GaugeMetricFamily("txmq_frontend_worker_cpu_seconds", "CPU time of the worker's current process", labels=["worker"])
            conns = GaugeMetricFamily("txmq_frontend_worker_connections", "RocketMQ 4 remoting connections the worker process holds",
                                      labels=["worker"])
            for row in rows:
                w = str(row["worker"])
                up.add_metric([w], 1 if row["alive"] else 0)
                restarts.add_metric([w], row["restarts"])
                relayed.add_metric([w], row["relayed"])
                cpu.add_metric([w], row["cpu_s"] or 0.0)
                conns.add_metric([w], row.get("connections", 0))
            yield from (up, restarts, relayed, cpu, conns)
        yield GaugeMetricFamily("txmq_commit_log_max_offset", "Written end of the commit log", value=core.store.max_offset)
        yield GaugeMetricFamily("txmq_commit_log_durable_offset", "fsynced end of the commit log", value=core.store.durable_offset)
        yield GaugeMetricFamily("txmq_log_sync_failing", "1 while the last fsync of the commit log failed and none succeeded since",
                                value=1 if core.store.sync_error is not None else 0)
        yield GaugeMetricFamily("txmq_damaged_records", "Damaged records skipped since start (each reported once in the log)",
                                value=core.store.damage.count)
        sched = getattr(core, "scheduled", None)
        if sched is not None:
            g = _retry(sched.gauges, {})
            yield GaugeMetricFamily("txmq_scheduled_messages", "Delayed and timed messages waiting for their time (not yet delivered "
                                    "or cancelled)", value=g.get("scheduled", 0))
            yield GaugeMetricFamily("txmq_scheduled_lag_seconds", "How long the most overdue scheduled message has been due and "
                                    "not delivered (0 when none waits)", value=g.get("scheduled_lag_s", 0.0))
            yield _histogram("txmq_scheduled_lateness_seconds", "Delivery time minus due time of each delivered scheduled message",
                             sched.lateness.buckets, sched.lateness.hist, sched.lateness.total)
        r = core.recovery
        yield GaugeMetricFamily("txmq_recovery_dropped_bytes", "Bytes of torn tail cut by recovery at this start",
                                value=r.dropped_bytes if r is not None else 0)


def serve_metrics(core: Any, host: str, port: int):
    """Start the HTTP endpoint in a thread; returns the server (``.server_port``; call ``.shutdown()``).

    Raises OSError when host:port cannot be bound.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector(core))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
