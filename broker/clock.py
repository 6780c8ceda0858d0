"""Injected time, so the check service can be tested by advancing a clock."""

from __future__ import annotations

import time


class Clock:
    """Wall-clock seconds since the epoch (what record timestamps use)."""

    def __call__(self) -> float:
        return time.time()


class ManualClock(Clock):
    """A clock tests move by hand."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
