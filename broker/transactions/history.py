"""One transaction's history (``tx_history``, ``txmq inspect tx``) and what holds the half progress back.

Synchronous and reading the store only through its read API (``read``,
``read_many``, ``cq_entries``, queue bounds), so the CLI runs it on a data
directory offline (``txmq inspect tx --data-dir``), read-only.

Nothing here scans the whole log. A transaction is found by the index
(pending entry, or its row by transaction id), and its records by targeted
reads: the first half copy at the row's origin offset, the op or discard
record at the offset the index keeps, the committed message by binary
search of its queue for the record just before the op record (they are
written together). Only the check copies have no index: they are found by
reading the half queue between the first copy's half offset and the latest
copy's (for a discarded transaction, up to the discard record), at most
``max_scan`` records.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from txmq.constants import (
    DISCARD_TOPIC,
    HALF_TOPIC,
    OP_TOPIC,
    PROP_CHECK_TIMES,
    PROP_DECIDED_BY,
    PROP_DISCARD_REASON,
    PROP_REAL_QID,
    PROP_REPLAYED,
    PROP_UNIQ_KEY,
)
from txmq.store import CorruptRecordError, Record, StoreError
from txmq.store.consumequeue import first_entry_from

from .index import Outcome, PendingTx, TxIndex, _int

SCAN_BATCH = 512
DEFAULT_MAX_SCAN = 100_000
_READ_ERRORS = (CorruptRecordError, StoreError, ValueError, OSError)


def _read(store, cl: int) -> Record | None:
    try:
        return store.read_record(cl)  # never a record forged inside a message body (offsets may come from a client)
    except _READ_ERRORS:
        return None


def find_tx_id(store, tx_id: str | None = None, half_offset: int | None = None, commit_log_offset: int | None = None) -> str | None:
    """The transaction id a reference names: a tx id as is; a half offset or a commit-log offset by one record read.

    A commit-log offset may be any of the transaction's records: a half
    copy, the op record, the discard record or the committed message.
    """
    if tx_id is not None:
        return tx_id
    if half_offset is not None:
        entries = store.cq_entries(HALF_TOPIC, 0, half_offset, 1) if half_offset < store.queue_max_offset(HALF_TOPIC, 0) else []
        if not entries:
            return None
        rec = _read(store, entries[0][0])
    elif commit_log_offset is not None:
        rec = _read(store, commit_log_offset)
        if rec is not None and rec.topic not in (HALF_TOPIC, OP_TOPIC, DISCARD_TOPIC) and rec.prepared_offset < 0:
            return None  # a plain message
    else:
        return None
    return rec.properties.get(PROP_UNIQ_KEY) or None if rec is not None else None


class History:
    """Drive ``steps()`` to the end (the broker serves other work between steps), then read ``doc``."""

    def __init__(self, store, index: TxIndex, tx_id: str, now_ms: int, max_scan: int = DEFAULT_MAX_SCAN,
                 next_check_at: Callable[[PendingTx], int | None] | None = None, summary: bool = False) -> None:
        self.store, self.index, self.tx_id, self.now_ms = store, index, tx_id, now_ms
        self.max_scan, self.next_check_at, self.summary = max_scan, next_check_at, summary
        self.doc: dict[str, Any] | None = None

    def steps(self) -> Iterator[None]:
        store, idx, tx_id = self.store, self.index, self.tx_id
        p = idx.pending.get(tx_id)
        d = None if p is not None else idx.lookup(tx_id)
        if p is None and d is None:
            return
        doc: dict[str, Any] = {
            "tx_id": tx_id,
            "state": (Outcome.PENDING if p is not None else d.outcome).label,  # type: ignore[union-attr]
            "group": p.group if p is not None else d.group,  # type: ignore[union-attr]
            "topic": p.topic if p is not None else d.topic,  # type: ignore[union-attr]
            "checks": p.checks if p is not None else d.checks,  # type: ignore[union-attr]
            "decided_by": None if p is not None else d.decided_by,  # type: ignore[union-attr]
            "decided_at": None if p is not None else d.decided_at,  # type: ignore[union-attr]
            "origin_commit_log_offset": p.origin_cl_offset if p is not None else d.origin,  # type: ignore[union-attr]
            "last_check_at": p.last_check_at if p is not None else None,
            "last_check_result": p.last_check_result if p is not None else None,
            "next_check_at": self.next_check_at(p) if p is not None and self.next_check_at is not None else None,
        }
        self.doc = doc
        if self.summary:
            return
        events: list[dict[str, Any]] = []
        doc.update(queue_id=p.queue_id if p is not None else None, message=None, events=events, scanned=0,
                   scan_truncated=False)
        origin = _read(store, doc["origin_commit_log_offset"]) if doc["origin_commit_log_offset"] >= 0 else None
        if origin is None or origin.topic != HALF_TOPIC:
            doc["note"] = "the first half copy is no longer in the log (retention)"
            origin = None
        else:
            props = origin.properties
            if doc["queue_id"] is None:
                doc["queue_id"] = _int(props.get(PROP_REAL_QID), 0)
            doc["born_at"] = origin.born_ts
            events.append(self._copy_event("half", origin))
        # ---- the deciding record, and the discard a replay to commit undid (its op names it: TXMQ_REPLAYED)
        op = _read(store, d.cl_offset) if d is not None and d.outcome is not Outcome.DISCARDED else None
        if op is not None and op.topic != OP_TOPIC:
            op = None
        replayed = _int(op.properties.get(PROP_REPLAYED), -1) if op is not None else -1
        # ---- where the check copies can be: after the first copy, up to the latest one
        end_ho: int | None = None
        if p is not None:
            end_ho = p.half_offset
        elif d.outcome is Outcome.DISCARDED:  # type: ignore[union-attr]
            end_ho = first_entry_from(store, HALF_TOPIC, 0, d.cl_offset) - 1  # type: ignore[union-attr]
        elif replayed >= 0:  # committed from the discard topic: the copies before its discard record
            end_ho = first_entry_from(store, HALF_TOPIC, 0, replayed) - 1
        else:
            end_ho = d.half_offset  # type: ignore[union-attr]
        copies: list[dict[str, Any]] = []
        if origin is not None and end_ho is not None and end_ho > origin.queue_offset:
            yield from self._scan(origin.queue_offset + 1, end_ho, copies)
        mark = origin.properties.get(PROP_REPLAYED) if origin is not None else None
        for c in copies:
            m = c.pop("_mark")
            if m is not None and m != mark:  # a replay from the discard topic: its discard, then the replay
                disc = _read(store, _int(m, -1)) if m != "1" else None
                if disc is not None and disc.topic == DISCARD_TOPIC:
                    events.append(self._discard_event(disc))
                c["event"] = "replay"
                c["by"] = "operator"
                c["to"] = "half"
                mark = m
            events.append(c)
        # ---- the outcome
        if d is not None and d.outcome is Outcome.DISCARDED:
            disc = _read(store, d.cl_offset)
            events.append(self._discard_event(disc) if disc is not None else
                          {"event": "discard", "at": d.decided_at, "by": "check", "reason": d.decided_by, "checks": d.checks,
                           "discard_offset": d.discard_offset, "commit_log_offset": d.cl_offset, "half_offset": None})
        elif d is not None:
            if op is not None:
                action = "commit" if d.outcome is Outcome.COMMITTED else "rollback"
                if replayed >= 0:  # `discard replay --to commit`: the discard it undid, then the replay (this op record)
                    disc = _read(store, replayed)
                    if disc is not None and disc.topic == DISCARD_TOPIC and disc.properties.get(PROP_UNIQ_KEY) == tx_id:
                        events.append(self._discard_event(disc))
                    events.append({"event": "replay", "at": op.store_ts, "by": "operator", "to": action,
                                   "half_offset": None, "commit_log_offset": op.commit_log_offset, "checks": None, "answer": None})
                decided_ho = _int(op.body.decode("ascii", "replace") if op.body else None, -1)
                ev = {"event": action, "at": op.store_ts, "by": op.properties.get(PROP_DECIDED_BY, "producer"),
                      "op_offset": op.queue_offset, "commit_log_offset": op.commit_log_offset, "half_offset": decided_ho,
                      "half_commit_log_offset": op.prepared_offset, "checks": _int(op.properties.get(PROP_CHECK_TIMES), 0)}
                if ev["by"] == "check":  # the answer to the check-back of the copy it names
                    for c in events:
                        if c["event"] in ("check", "replay") and c["half_offset"] == decided_ho:
                            c["answer"] = action
                events.append(ev)
                if d.outcome is Outcome.COMMITTED:
                    msg = self._committed(op, doc["topic"], doc["queue_id"])
                    if msg is not None:
                        doc["message"] = {"topic": msg.topic, "queue_id": msg.queue_id, "queue_offset": msg.queue_offset,
                                          "commit_log_offset": msg.commit_log_offset}
                        events.append({"event": "message", "at": msg.store_ts, "topic": msg.topic, "queue_id": msg.queue_id,
                                       "queue_offset": msg.queue_offset, "commit_log_offset": msg.commit_log_offset})
            else:
                events.append({"event": "commit" if d.outcome is Outcome.COMMITTED else "rollback", "at": d.decided_at,
                               "by": d.decided_by, "commit_log_offset": d.cl_offset, "half_offset": d.half_offset})
        elif p is not None and p.last_check_result is not None:
            # What the broker knows of the latest check-back (memory only): on the copy it was sent for.
            last = next((c for c in reversed(events) if c["event"] in ("check", "replay")), None)
            if last is not None and last["half_offset"] == p.half_offset:
                last["answer"] = p.last_check_result
        events.sort(key=lambda e: e["at"] or 0)  # stable: a decision before the message it committed (same write)

    def _copy_event(self, kind: str, rec: Record) -> dict[str, Any]:
        return {"event": kind, "at": rec.store_ts, "by": "producer" if kind == "half" else "check",
                "half_offset": rec.queue_offset, "commit_log_offset": rec.commit_log_offset,
                "checks": _int(rec.properties.get(PROP_CHECK_TIMES), 0), "answer": None}

    @staticmethod
    def _discard_event(rec: Record) -> dict[str, Any]:
        return {"event": "discard", "at": rec.store_ts, "by": "check",
                "reason": rec.properties.get(PROP_DISCARD_REASON, "max-checks"),
                "checks": _int(rec.properties.get(PROP_CHECK_TIMES), 0), "discard_offset": rec.queue_offset,
                "commit_log_offset": rec.commit_log_offset, "half_offset": None}

    def _scan(self, start: int, end: int, copies: list[dict[str, Any]]) -> Iterator[None]:
        """The half records in [start, end] that are copies of this transaction (at most max_scan read)."""
        store, doc, tx_id = self.store, self.doc, self.tx_id
        assert doc is not None
        off = max(start, store.queue_min_offset(HALF_TOPIC, 0))
        while off <= end:
            n = min(SCAN_BATCH, end - off + 1, self.max_scan - doc["scanned"])
            if n <= 0:
                doc["scan_truncated"] = True
                return
            entries = store.cq_entries(HALF_TOPIC, 0, off, n)
            if not entries:
                return
            try:
                recs = store.read_many([e[0] for e in entries])
            except _READ_ERRORS:
                recs = [r for r in (_read(store, e[0]) for e in entries) if r is not None]
            doc["scanned"] += len(entries)
            for rec in recs:
                if rec.properties.get(PROP_UNIQ_KEY) == tx_id:
                    ev = self._copy_event("check", rec)
                    ev["_mark"] = rec.properties.get(PROP_REPLAYED)
                    copies.append(ev)
            off += len(entries)
            yield None

    def _committed(self, op: Record, topic: str, qid: int) -> Record | None:
        """The committed message: written in one batch just before its op record, so the record ending where the op starts.

        Binary search of the real queue by commit-log offset (log2 n entry
        reads); for an op re-recorded at start (``recovery``) the message is
        further back: up to 64 entries before are tried.
        """
        store = self.store
        queues = store.queues().get(topic, [])
        order = [qid] + [q for q in queues if q != qid] if qid in queues else list(queues)
        for q in order:
            i = first_entry_from(store, topic, q, op.commit_log_offset) - 1
            lo = max(store.queue_min_offset(topic, q), i - 63)
            while i >= lo:
                e = store.cq_entries(topic, q, i, 1)
                if not e:
                    break
                rec = _read(store, e[0][0])
                if rec is not None and rec.prepared_offset == op.prepared_offset and rec.prepared_offset >= 0:
                    return rec
                if op.properties.get(PROP_DECIDED_BY) != "recovery":
                    break  # not just before the op: not in this queue
                i -= 1
        return None


def history(store, index: TxIndex, tx_id: str, now_ms: int, **kw: Any) -> dict[str, Any] | None:
    """The whole history at once (offline use, tests)."""
    h = History(store, index, tx_id, now_ms, **kw)
    for _ in h.steps():
        pass
    return h.doc


def held_by(index: TxIndex, progress: int, half_max: int, now_ms: int, timeout_s: float,
            online: Callable[[str], int] | None = None) -> dict[str, Any] | None:
    """The pending transaction the half progress cannot pass, and why; None when nothing holds it back.

    ``online`` (a running broker's registry) gives the live producers of a
    group; without it (offline) that part of the reason is left out.
    """
    if progress >= half_max:
        return None
    first = index.first_undecided_half()
    if first is None:
        return None
    p = index.pending.get(index.by_half.get(first, ""))
    if p is None:
        return None
    age_ms = p.age_ms(now_ms)
    immunity_s = p.immunity_s if p.immunity_s is not None else timeout_s
    if p.last_check_result is not None and p.last_check_result.startswith("unreadable"):
        reason = p.last_check_result
    elif age_ms < immunity_s * 1000:
        reason = f"waiting for its transaction timeout ({(immunity_s * 1000 - age_ms) / 1000:.1f}s left)"
    elif online is not None and online(p.group) == 0:
        reason = f"no producer of group {p.group} online"
    elif p.checks > 0:
        reason = f"checked {p.checks} times, " + ("answered unknown" if p.last_check_result == "unknown" else "no answer yet")
    else:
        reason = "waiting for its first check-back (the next check pass)"
    return {"tx_id": p.tx_id, "group": p.group, "topic": p.topic, "half_offset": p.half_offset,
            "age_s": round(age_ms / 1000.0, 3), "checks": p.checks, "last_check_result": p.last_check_result, "reason": reason}
