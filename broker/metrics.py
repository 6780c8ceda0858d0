"""Broker counters.

Plain integers on the hot path (a dict increment costs ~50 ns); the
Prometheus endpoint and `txmq stats` read snapshots of them.
"""

from __future__ import annotations

from collections import Counter


class Durations:
    """How long something took, each time: count, total, longest and a histogram (seconds)."""

    BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, float("inf"))

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        self.buckets = self.BUCKETS
        self.hist = [0] * len(self.buckets)

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        if seconds > self.max:
            self.max = seconds
        for i, b in enumerate(self.buckets):
            if seconds <= b:
                self.hist[i] += 1
                break

    def observe_n(self, seconds: float, n: int) -> None:
        """n events that each took about ``seconds`` (a batch measured once)."""
        self.count += n
        self.total += seconds * n
        if seconds > self.max:
            self.max = seconds
        for i, b in enumerate(self.buckets):
            if seconds <= b:
                self.hist[i] += n
                break

    def snapshot(self, count_key: str, prefix: str) -> dict[str, int | float]:
        return {count_key: self.count, f"{prefix}_seconds_avg": round(self.total / self.count, 6) if self.count else 0.0,
                f"{prefix}_seconds_max": round(self.max, 6)}


class Metrics:
    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        # The fsyncs that acknowledge sends (group commit, a lone client's inline fsync) apart from the
        # checkpoint cycles, which also write the consume queues and the checkpoint file: a 40 ms
        # checkpoint is not a send waiting 40 ms.
        self.flush = Durations()
        self.checkpoint = Durations()
        # time from half to decision, seconds, histogram buckets
        self.decision_buckets = (0.005, 0.05, 0.5, 5, 60, 600, 3600, 86400, float("inf"))
        self.decision_hist = [0] * len(self.decision_buckets)
        self.decision_sum = 0.0

    def inc(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def decided(self, seconds: float) -> None:
        self.decision_sum += seconds
        for i, b in enumerate(self.decision_buckets):
            if seconds <= b:
                self.decision_hist[i] += 1
                break

    def snapshot(self) -> dict[str, int | float]:
        snap: dict[str, int | float] = dict(self.counters)
        snap.update(self.flush.snapshot("flushes", "flush"))
        snap.update(self.checkpoint.snapshot("checkpoints", "checkpoint"))
        snap["decisions"] = sum(self.decision_hist)
        snap["decision_seconds_sum"] = round(self.decision_sum, 6)
        return snap
