"""Broker counters.

Plain integers on the hot path (a dict increment costs ~50 ns); the
Prometheus endpoint and `txmq stats` read snapshots of them.
"""

from __future__ import annotations

from collections import Counter


class Metrics:
    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.flush_count = 0
        self.flush_seconds_total = 0.0
        self.flush_seconds_max = 0.0
        self.flush_buckets = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, float("inf"))
        self.flush_hist = [0] * len(self.flush_buckets)
        # time from half to decision, seconds, histogram buckets
        self.decision_buckets = (0.005, 0.05, 0.5, 5, 60, 600, 3600, 86400, float("inf"))
        self.decision_hist = [0] * len(self.decision_buckets)
        self.decision_sum = 0.0

    def inc(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def flush_latency(self, seconds: float) -> None:
        self.flush_count += 1
        self.flush_seconds_total += seconds
        if seconds > self.flush_seconds_max:
            self.flush_seconds_max = seconds
        for i, b in enumerate(self.flush_buckets):
            if seconds <= b:
                self.flush_hist[i] += 1
                break

    def decided(self, seconds: float) -> None:
        self.decision_sum += seconds
        for i, b in enumerate(self.decision_buckets):
            if seconds <= b:
                self.decision_hist[i] += 1
                break

    def snapshot(self) -> dict[str, int | float]:
        snap: dict[str, int | float] = dict(self.counters)
        snap["flushes"] = self.flush_count
        snap["flush_seconds_avg"] = round(self.flush_seconds_total / self.flush_count, 6) if self.flush_count else 0.0
        snap["flush_seconds_max"] = round(self.flush_seconds_max, 6)
        snap["decisions"] = sum(self.decision_hist)
        snap["decision_seconds_sum"] = round(self.decision_sum, 6)
        return snap
