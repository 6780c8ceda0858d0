"""What operators see of the schedule: listings of the scheduled messages, and the gauges (docs/scheduled.md).

Like broker/transactions/admin.py for transactions. A listing reads
``timers.db`` after a flush (the file then holds every change), in the
keeper's thread and under its lock; rows found damaged there are rebuilt
from their records by the keeper. The operator's cancel is a client's
(ScheduleService.cancel: one cancel record).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from txmq.constants import PROP_REAL_QID

from .keeper import READ_STEP, read_records

if TYPE_CHECKING:
    from txmq.store import Store

    from ..clock import Clock
    from ..metrics import Durations
    from .keeper import TimerKeeper


class ScheduleAdmin:
    """The operator's view of the schedule: listings and gauges."""

    def __init__(self, keeper: TimerKeeper, store: Store, clock: Clock, lateness: Durations) -> None:
        self.keeper = keeper
        self.store = store
        self.clock = clock
        self.lateness = lateness  # delivery time minus due time, seconds (the delivery task observes it)

    async def listing(self, topic: str | None, after: tuple[int, int] | None, limit: int, bodies: bool = False) -> dict[str, Any]:
        """Scheduled messages by due time (a page from ``after``), counts per topic, and the totals; with ``bodies``
        each message's properties and body too (what a migration sends on)."""
        keeper = self.keeper
        await keeper.wait_ready()
        db = keeper.db
        async with keeper.lock:
            await keeper.flush_locked()
            got = await keeper.run(db.listing, topic, after or (-1, -1), limit)
            summary = await keeper.run(db.summary)
        keeper.restore(got.bad)  # listed from the next page on, once the next flush has written them again
        rows = got.rows
        out = []
        for i in range(0, len(rows), READ_STEP):  # a few records at a time: a page of large messages is not held whole
            part = rows[i:i + READ_STEP]
            for (off, due, t, uniq), rec in zip(part, read_records(self.store, [r[0] for r in part])):
                p = rec.properties if rec is not None else {}
                try:
                    qid = int(p.get(PROP_REAL_QID, 0) or 0)
                except ValueError:
                    qid = 0
                out.append({"msg_id": uniq, "topic": t, "deliver_at_ms": due, "commit_log_offset": off, "queue_id": qid,
                            "tags": p.get("TAGS"), "keys": p.get("KEYS"), "born_ts": rec.born_ts if rec is not None else None,
                            "store_ts": rec.store_ts if rec is not None else None, "size": rec.size if rec is not None else None})
                if bodies:
                    out[-1]["properties"] = dict(p)
                    out[-1]["body"] = rec.body if rec is not None else None
        by_topic = {t: {"scheduled": n, "first_due_ms": first} for t, (n, first) in sorted(summary.items())}
        total = sum(v["scheduled"] for t, v in by_topic.items() if topic is None or t == topic)
        # cursor: where the next page starts (``after``), None after the last one
        return {"messages": out, "by_topic": by_topic, "total": total,
                "cursor": [out[-1]["deliver_at_ms"], out[-1]["commit_log_offset"]] if len(out) == limit else None}

    def gauges(self) -> dict[str, Any]:
        """Scheduled messages, and how late the most overdue one is (0 when nothing due waits)."""
        keeper = self.keeper
        now = int(self.clock() * 1000)
        heap = keeper.heap
        try:  # the metrics thread reads it too: the heap may empty meanwhile
            first = heap[0][0] if heap and keeper.ready.is_set() else None
        except IndexError:
            first = None
        # a damaged row no record could rebuild is a message not delivered: it counts from the due time it holds
        unrepaired = min(list(keeper.unrepaired.values()), default=None)
        if unrepaired is not None and (first is None or unrepaired < first):
            first = unrepaired
        lag = max(0, now - first) / 1000 if first is not None else 0.0
        return {"scheduled": max(0, keeper.count), "scheduled_lag_s": round(lag, 3), "scheduled_index": keeper.state(),
                **self.lateness.snapshot("scheduled_deliveries_timed", "scheduled_lateness")}

