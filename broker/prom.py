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


class BrokerCollector:
    def __init__(self, core: Any) -> None:
        self.core = core

    def collect(self) -> Iterator[Any]:
        core = self.core
        c = dict(core.metrics.counters)
        pending = GaugeMetricFamily("txmq_pending_half_messages", "Pending (undecided) transactions", labels=["topic"])
        by_topic: dict[str, int] = {}
        for p in list(core.tx.index.pending.values()):
            by_topic[p.topic] = by_topic.get(p.topic, 0) + 1
        for topic, n in by_topic.items():
            pending.add_metric([topic], n)
        yield pending
        for name, help_ in (("committed", "Transactions committed"), ("rolled_back", "Transactions rolled back")):
            fam = CounterMetricFamily(f"txmq_{name}", help_, labels=["source"])
            for s in SOURCES:
                fam.add_metric([s], c.get(f"{name}_{s}", 0))
            yield fam
        for key, help_ in (
            ("half_stored", "Half messages stored"),
            ("checks_sent", "Check-back requests sent"),
            ("checks_answered", "Check-back answers received"),
            ("unknown_answers", "UNKNOW answers to end transaction"),
            ("discarded", "Transactions moved to the discard topic"),
            ("replayed", "Discarded transactions replayed"),
            ("messages_sent", "Plain messages stored"),
            ("messages_pulled", "Messages returned to consumers"),
            ("bytes_appended", "Bytes appended to the commit log"),
            ("records_appended", "Records appended to the commit log"),
            ("store_full_errors", "Sends refused because the disk was full"),
        ):
            yield CounterMetricFamily(f"txmq_{key}", help_, value=c.get(key, 0))
        m = core.metrics
        hist = HistogramMetricFamily("txmq_decision_seconds", "Time from half message to decision")
        buckets, acc = [], 0
        for b, n in zip(m.decision_buckets, list(m.decision_hist)):
            acc += n
            buckets.append(("+Inf" if b == float("inf") else str(b), acc))
        hist.add_metric([], buckets, m.decision_sum)
        yield hist
        yield CounterMetricFamily("txmq_flushes", "fsync cycles", value=m.flush_count)
        yield CounterMetricFamily("txmq_flush_seconds", "Total time spent in fsync cycles", value=m.flush_seconds_total)
        yield GaugeMetricFamily("txmq_flush_seconds_max", "Longest fsync cycle", value=m.flush_seconds_max)
        yield GaugeMetricFamily("txmq_connections", "Open client connections", value=core.connections)
        yield GaugeMetricFamily("txmq_commit_log_max_offset", "Written end of the commit log", value=core.store.max_offset)


def serve_metrics(core: Any, host: str, port: int):
    """Start the HTTP endpoint in a thread; returns the server (call .shutdown())."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector(core))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
