"""Damage found in a data directory: reported once per place, counted, never fatal to a read.

A record whose bytes no longer validate (bit rot, a byte changed by hand, a
consume-queue entry pointing nowhere) is skipped by every reader: the good
records around it are served, and the place is reported here once, with its
commit-log offset and the reason the codec gives. Memory stays bounded: the
first ``keep`` places are remembered in full (for ``txmq broker status`` and
``txmq store verify``), later ones only counted.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

log = logging.getLogger("txmq.store")


@dataclass(frozen=True, slots=True)
class Damage:
    offset: int  # commit-log offset where the damage starts
    where: str  # what found it: "log" (recovery), "queue TOPIC/QID", "index"
    reason: str  # e.g. "crc mismatch at 12345"
    length: int | None = None  # bytes skipped, when known (a damaged range of the log)


class DamageLog:
    """Places found damaged since the store was opened (thread-safe)."""

    def __init__(self, keep: int = 1000) -> None:
        self.keep = keep
        self.count = 0
        self.places: dict[int, Damage] = {}  # by commit-log offset: one report per place, whoever finds it
        self._overflow: set[int] = set()  # seen past keep: only to report each once
        self._lock = threading.Lock()

    def report(self, damage: Damage) -> bool:
        """Record damage; True (and one log line) the first time this place is seen."""
        key = damage.offset
        with self._lock:
            if key in self.places or key in self._overflow:
                return False
            self.count += 1
            if len(self.places) < self.keep:
                self.places[key] = damage
            elif len(self._overflow) < 100 * self.keep:
                self._overflow.add(key)
        extra = f" length={damage.length}" if damage.length is not None else ""
        log.warning("event=record_damaged where=%s offset=%d%s reason=%r action=skipped", damage.where.replace(" ", ":"), damage.offset, extra, damage.reason)
        return True

    def summary(self) -> dict:
        with self._lock:
            places = sorted(self.places.values(), key=lambda d: d.offset)
            return {
                "damaged": self.count,
                "places": [{"offset": d.offset, "where": d.where, "reason": d.reason, "length": d.length} for d in places[:100]],
            }
