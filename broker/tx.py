"""Transactional messages: half sends, end transaction, operator resolve and replay.

The half message, the end transaction and "one outcome per transaction"
(docs/transactions.md). All
state changes go through the TxIndex right after the records are written
(before waiting for durability), so the index always matches the log.
"""

from __future__ import annotations

import asyncio
import logging
import os
from functools import partial
from typing import Any

from txmq.constants import (
    DISCARD_TOPIC,
    HALF_TOPIC,
    OP_TAG,
    OP_TOPIC,
    PROP_CHECK_TIMES,
    PROP_DECIDED_BY,
    PROP_DELAY,
    PROP_DISCARD_REASON,
    PROP_HALF_CL_OFFSET,
    PROP_ORIGIN_CL_OFFSET,
    PROP_PGROUP,
    PROP_PREPARED_QUEUE_OFFSET,
    PROP_REAL_QID,
    PROP_REAL_TOPIC,
    PROP_REPLAYED,
    PROP_TAGS,
    PROP_TRAN_MSG,
    PROP_UNIQ_KEY,
)
from txmq.store import AppendResult, CorruptRecordError, Message, Record, StoreError, TxType
from txmq.wire import ErrorCode, TxmqError

from .txindex import Decided, Outcome, PendingTx, TxIndex

log = logging.getLogger("txmq.tx")

class TxIds:
    """Transaction ids: 16 random hex digits per broker run + a 16-digit counter.

    Unique across restarts (the random prefix) and ~20x cheaper than uuid4.
    """

    def __init__(self) -> None:
        self.prefix = os.urandom(8).hex().upper()
        self.n = 0

    def __call__(self) -> str:
        self.n += 1
        return f"{self.prefix}{self.n:016X}"


HALF_CACHE_ENTRIES = 32768


def as_record(msg: Message, res: AppendResult) -> Record:
    return Record(
        commit_log_offset=res.commit_log_offset, size=res.size, topic=msg.topic, queue_id=msg.queue_id,
        queue_offset=res.queue_offset, tx_type=msg.tx_type, born_ts=msg.born_ts, store_ts=res.store_ts,
        prepared_offset=msg.prepared_offset, properties=msg.properties, body=msg.body,
    )


def half_copy(rec: Record, **props: str) -> Message:
    """A new copy of a half record for the half queue (check-back or replay)."""
    p = dict(rec.properties)
    copy_properties(p, rec.commit_log_offset)
    p.update(props)
    return Message(HALF_TOPIC, 0, TxType.PREPARED, rec.born_ts, p, rec.body)


def copy_properties(props: dict[str, str], cl_offset: int) -> None:
    """Turn the properties of the half record at cl_offset (in place) into a copy's.

    A copy keeps its first copy's origin and never inherits a discard
    reason. It keeps the replay mark (``TXMQ_REPLAYED``: the offset of the
    discard record a replay re-opened): a rebuild that starts past the
    replay's own copy must still see that the discard was undone, and the
    offset makes sure a mark re-opens that discard only, not a later one.
    """
    if PROP_ORIGIN_CL_OFFSET not in props:
        props[PROP_ORIGIN_CL_OFFSET] = str(cl_offset)
    if PROP_DISCARD_REASON in props:
        del props[PROP_DISCARD_REASON]


class TransactionService:
    def __init__(self, core, index: TxIndex) -> None:
        self.core = core
        self.index = index
        self.new_tx_id = TxIds()
        self._deciding: dict[str, asyncio.Future] = {}
        self._sending: set[str] = set()  # tx ids of half messages submitted but not yet written
        # Recently stored half records by commit-log offset, so the common
        # end_transaction needs no read. Bounded by two generations of plain
        # dicts: when the young one is full it becomes the old one and the
        # previous old one is dropped whole. Every operation is O(1) with no
        # per-insert eviction (an OrderedDict's cost more, and popping the
        # oldest of a plain dict that had many deletions is O(n)).
        self._half_young: dict[int, Record] = {}
        self._half_old: dict[int, Record] = {}

    def remember(self, rec: Record) -> None:
        young = self._half_young
        young[rec.commit_log_offset] = rec
        if len(young) >= HALF_CACHE_ENTRIES // 2:
            self._half_old, self._half_young = young, {}

    def _cached_half(self, cl_offset: int) -> Record | None:
        rec = self._half_young.get(cl_offset)
        return rec if rec is not None else self._half_old.get(cl_offset)

    def _forget_half(self, cl_offset: int) -> None:
        self._half_young.pop(cl_offset, None)
        self._half_old.pop(cl_offset, None)

    def outcomes_known_since(self) -> int | None:
        """When the oldest record still in the log was stored (ms): outcomes are on record for transactions since then.

        Retention deletes a transaction's records and its row in the index
        file together (never while it is pending).
        """
        store = self.core.store
        if store.min_offset >= store.max_offset:
            return None
        try:
            return store.read(store.min_offset).store_ts
        except (CorruptRecordError, StoreError, ValueError):
            return None

    # ---- step 1: half messages --------------------------------------------
    def send_half(self, topic: str, queue_id: int | None, body: bytes, props: dict[str, str], born_ts: int) -> asyncio.Future:
        group = props.get(PROP_PGROUP)
        if not group:
            raise TxmqError("a transactional message needs a producer group (PGROUP)", ErrorCode.INVALID_FIELD)
        core = self.core
        qid = core.pick_queue(topic, queue_id)
        props = dict(props)
        props.pop(PROP_DELAY, None)  # delay levels do not apply to transactional messages
        tx_id = props.get(PROP_UNIQ_KEY)
        if not tx_id:
            tx_id = self.new_tx_id()  # unique by construction: no lookup of the decided ones on disk
            taken = tx_id in self.index.pending or tx_id in self._sending
        else:
            taken = tx_id in self._deciding or tx_id in self._sending or self.index.outcome(tx_id) is not None
        if taken:
            raise TxmqError(f"transaction id {tx_id} is already in use", ErrorCode.INVALID_FIELD)
        self._sending.add(tx_id)
        props[PROP_UNIQ_KEY] = tx_id
        props[PROP_TRAN_MSG] = "true"
        props[PROP_REAL_TOPIC] = topic
        props[PROP_REAL_QID] = str(qid)
        msg = Message(HALF_TOPIC, 0, TxType.PREPARED, born_ts, props, body)

        def shape(results: list[AppendResult]) -> dict[str, Any]:
            res = results[0]
            rec = as_record(msg, res)
            self.index.apply_half(rec)
            self._sending.discard(tx_id)
            self.remember(rec)
            core.metrics.counters["half_stored"] += 1
            return {
                "msg_id": tx_id, "tx_id": tx_id, "topic": topic, "queue_id": qid,
                "half_offset": res.queue_offset, "commit_log_offset": res.commit_log_offset,
            }

        fut = core.append([msg], shape)
        fut.add_done_callback(lambda _f: self._sending.discard(tx_id))  # also when the write failed
        return fut

    # ---- step 3: end transaction ------------------------------------------
    def read_half(self, cl_offset: int) -> Record:
        rec = self._cached_half(cl_offset)
        if rec is not None:
            return rec
        store = self.core.store
        if cl_offset < store.min_offset:
            # Retention deleted it, and the transaction's outcome with it: an
            # explicit error, never a second decision (docs/transactions.md).
            raise TxmqError(f"no half message at commit-log offset {cl_offset}: the log now starts at {store.min_offset} "
                            "(older records and their outcomes were deleted by retention)", ErrorCode.TX_NOT_FOUND)
        if cl_offset >= store.max_offset:
            raise TxmqError(f"no half message at commit-log offset {cl_offset}", ErrorCode.TX_NOT_FOUND)
        try:
            rec = store.read(cl_offset)
        except (CorruptRecordError, StoreError, ValueError):
            raise TxmqError(f"no message starts at commit-log offset {cl_offset}", ErrorCode.TX_NOT_FOUND) from None
        if rec.topic != HALF_TOPIC or rec.tx_type != TxType.PREPARED:
            raise TxmqError(f"the message at commit-log offset {cl_offset} is not a half message (topic {rec.topic})", ErrorCode.TX_NOT_HALF)
        return rec

    def end_transaction(
        self, group: str, tx_id: str, cl_offset: int, half_offset: int, state: str, source: str
    ) -> dict[str, Any] | asyncio.Future:
        rec = self.read_half(cl_offset)
        props = rec.properties
        if props.get(PROP_PGROUP) != group:
            raise TxmqError(f"producer group {group!r} does not match the half message's group {props.get(PROP_PGROUP)!r}", ErrorCode.TX_GROUP_MISMATCH)
        if rec.queue_offset != half_offset:
            raise TxmqError(f"half offset {half_offset} does not match the half message's offset {rec.queue_offset}", ErrorCode.TX_OFFSET_MISMATCH)
        if props.get(PROP_UNIQ_KEY) != tx_id:
            raise TxmqError(f"transaction id {tx_id!r} does not match the half message's {props.get(PROP_UNIQ_KEY)!r}", ErrorCode.TX_ID_MISMATCH)
        m = self.core.metrics.counters
        if source == "check":
            m["checks_answered"] += 1
        if state == "unknown":
            m["unknown_answers"] += 1
            p = self.index.pending.get(tx_id)
            if p is not None and source == "check":
                p.last_check_result = "unknown"
            out = self.index.outcome(tx_id)
            return {"status": "noop", "outcome": (out or Outcome.PENDING).label}
        if state not in ("commit", "rollback"):
            raise TxmqError(f"state must be commit, rollback or unknown, not {state!r}", ErrorCode.INVALID_FIELD)
        if source == "check":
            p = self.index.pending.get(tx_id)
            if p is not None:
                p.last_check_result = state
        return self.decide(rec, state == "commit", source)

    def decide(self, rec: Record, commit: bool, source: str, allow_discarded: bool = False) -> asyncio.Future:
        """Commit or roll back the transaction of half record `rec`, at most once.

        Returns a future of the reply. The outcome is entered in the index
        as soon as the records are written, before the fsync, so a
        concurrent duplicate sees it; a duplicate that arrives while the
        write is pending waits for it (``_deciding``).
        """
        tx_id = rec.properties[PROP_UNIQ_KEY]
        inflight = self._deciding.get(tx_id)
        if inflight is not None:
            return asyncio.ensure_future(self._decide_after(inflight, rec, commit, source, allow_discarded))
        loop = self.core.appender._loop
        want = Outcome.COMMITTED if commit else Outcome.ROLLED_BACK
        d = None if tx_id in self.index.pending else self.index.lookup(tx_id)
        if d is not None and not (allow_discarded and d.outcome is Outcome.DISCARDED):
            fut = loop.create_future()
            if d.outcome is want:
                # The first outcome may still be on its way to the disk (sync
                # flush): "already" is only as true as that record is durable.
                waiter = self.core.flusher.wait_durable(d.cl_offset + 1)
                if waiter is None:
                    fut.set_result(self._already(d))
                else:
                    waiter.add_done_callback(partial(self._already_durable, fut, d))
            else:
                verb = "commit" if commit else "roll back"
                fut.set_exception(TxmqError(f"cannot {verb} transaction {tx_id}: it was already {d.outcome.label.replace('_', ' ')}",
                                            ErrorCode.TX_CONFLICT, outcome=d.outcome.label))
            return fut
        if d is None and tx_id not in self.index.pending:
            fut = loop.create_future()
            fut.set_exception(TxmqError(f"transaction {tx_id} is not known to the broker", ErrorCode.TX_NOT_FOUND))
            return fut
        msgs = []
        if commit:
            msgs.append(self._rebuild(rec))
        msgs.append(self._op(rec, commit, source))
        gate = loop.create_future()
        self._deciding[tx_id] = gate

        def shape(results: list[AppendResult]) -> dict[str, Any]:
            self.index.apply_op(as_record(msgs[-1], results[-1]))
            self._release(tx_id, gate)
            self._forget_half(rec.commit_log_offset)
            self._count_decision(rec, commit, source)
            reply: dict[str, Any] = {"status": "ok", "outcome": want.label}
            if commit:
                c = results[0]
                reply.update(commit_log_offset=c.commit_log_offset, queue_offset=c.queue_offset,
                             topic=msgs[0].topic, queue_id=msgs[0].queue_id)
            return reply

        fut = self.core.append(msgs, shape)
        fut.add_done_callback(lambda _f: self._release(tx_id, gate))  # the write failed: let waiters retry
        return fut

    def _already_durable(self, fut: asyncio.Future, d: Decided, waiter: asyncio.Future) -> None:
        if fut.done():
            return
        exc = waiter.exception()
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(self._already(d))

    def _release(self, tx_id: str, gate: asyncio.Future) -> None:
        if self._deciding.get(tx_id) is gate:
            del self._deciding[tx_id]
        if not gate.done():
            gate.set_result(None)

    async def _decide_after(self, inflight: asyncio.Future, rec: Record, commit: bool, source: str, allow_discarded: bool) -> dict[str, Any]:
        await asyncio.shield(inflight)
        return await self.decide(rec, commit, source, allow_discarded)

    async def repair_commits(self, records) -> int:
        """Re-append the op record of commits whose op was lost.

        Commit appends the rebuilt message and then its op record in one
        write; a torn tail (power loss in async mode) can keep the first and
        lose the second. Consumers may already have seen the message, so the
        transaction is committed: record that, rather than let a check-back
        commit it a second time. Called at start on the tail recovery scanned.
        """
        repaired = 0
        for rec in records:
            if rec.tx_type != TxType.COMMIT or rec.topic == OP_TOPIC or rec.prepared_offset < 0:
                continue
            tx_id = rec.properties.get(PROP_UNIQ_KEY)
            if not tx_id or tx_id not in self.index.pending:
                continue
            try:
                half = self.read_half(rec.prepared_offset)
            except TxmqError:
                continue
            op = self._op(half, True, "recovery")
            await self.core.append([op], lambda results, op=op: self.index.apply_op(as_record(op, results[0])))
            log.warning("event=commit_repaired tx_id=%s commit_offset=%d", tx_id, rec.commit_log_offset)
            repaired += 1
        return repaired

    def _already(self, d: Decided) -> dict[str, Any]:
        return {"status": "already", "outcome": d.outcome.label, "decided_by": d.decided_by}

    def _count_decision(self, rec: Record, commit: bool, source: str) -> None:
        m = self.core.metrics
        m.counters[f"{'committed' if commit else 'rolled_back'}_{source}"] += 1
        m.decided(max(0.0, self.core.clock() - rec.born_ts / 1000.0))
        if source == "operator":
            log.info("event=operator_%s tx_id=%s group=%s topic=%s", "commit" if commit else "rollback",
                     rec.properties.get(PROP_UNIQ_KEY), rec.properties.get(PROP_PGROUP), rec.properties.get(PROP_REAL_TOPIC))

    def _rebuild(self, rec: Record) -> Message:
        """The original message: real topic and queue restored, the transactional flag cleared."""
        p = dict(rec.properties)
        topic = p.get(PROP_REAL_TOPIC) or ""
        qid = int(p.get(PROP_REAL_QID) or 0)
        p.pop(PROP_TRAN_MSG, None)
        p.pop(PROP_REPLAYED, None)
        p.pop(PROP_DISCARD_REASON, None)
        p[PROP_PREPARED_QUEUE_OFFSET] = str(rec.queue_offset)
        n, _ = self.core.topics.ensure(topic)
        if qid >= n:
            qid = qid % n
        return Message(topic, qid, TxType.COMMIT, rec.born_ts, p, rec.body, prepared_offset=rec.commit_log_offset)

    def _op(self, rec: Record, commit: bool, source: str) -> Message:
        p = rec.properties
        props = {
            PROP_TAGS: OP_TAG,
            PROP_UNIQ_KEY: p[PROP_UNIQ_KEY],
            PROP_PGROUP: p.get(PROP_PGROUP, ""),
            PROP_REAL_TOPIC: p.get(PROP_REAL_TOPIC, ""),
            PROP_HALF_CL_OFFSET: str(rec.commit_log_offset),
            PROP_DECIDED_BY: source,
            PROP_CHECK_TIMES: p.get(PROP_CHECK_TIMES, "0"),
        }
        body = str(rec.queue_offset).encode()
        kind = TxType.COMMIT if commit else TxType.ROLLBACK
        return Message(OP_TOPIC, 0, kind, int(self.core.clock() * 1000), props, body, prepared_offset=rec.commit_log_offset)

    # ---- discard (used by the check service) ------------------------------
    def discard_message(self, rec: Record, reason: str) -> Message:
        p = dict(rec.properties)
        p.setdefault(PROP_ORIGIN_CL_OFFSET, str(rec.commit_log_offset))
        p[PROP_DISCARD_REASON] = reason
        return Message(DISCARD_TOPIC, 0, TxType.PREPARED, rec.born_ts, p, rec.body)

    # ---- operator: resolve -------------------------------------------------
    def find(self, ref: dict[str, Any]) -> Record:
        """The half record a REF names: tx_id, half_offset, or commit_log_offset."""
        idx = self.index
        if ref.get("tx_id") is not None:
            tx_id = str(ref["tx_id"])
            p = idx.pending.get(tx_id)
            if p is not None:
                return self.read_half(p.cl_offset)
            d = idx.lookup(tx_id)
            if d is None:
                raise TxmqError(f"no transaction with id {tx_id} (never stored, or deleted by retention)", ErrorCode.TX_NOT_FOUND)
            if d.outcome is Outcome.DISCARDED:
                raise TxmqError(f"transaction {tx_id} was discarded; use `txmq discard replay`", ErrorCode.TX_CONFLICT, outcome=d.outcome.label)
            return self._decided_half(tx_id, d)
        if ref.get("commit_log_offset") is not None:
            return self.read_half(int(ref["commit_log_offset"]))
        if ref.get("half_offset") is not None:
            ho = int(ref["half_offset"])
            entries = self.core.store.cq_entries(HALF_TOPIC, 0, ho, 1)
            if not entries:
                raise TxmqError(f"no half message at half offset {ho}", ErrorCode.TX_NOT_FOUND)
            return self.read_half(entries[0][0])
        raise TxmqError("a ref needs tx_id, half_offset or commit_log_offset", ErrorCode.INVALID_FIELD)

    def _decided_half(self, tx_id: str, d: Decided) -> Record:
        entries = self.core.store.cq_entries(HALF_TOPIC, 0, d.half_offset, 1)
        if entries:
            try:
                rec = self.read_half(entries[0][0])
                if rec.properties.get(PROP_UNIQ_KEY) == tx_id:
                    return rec
            except TxmqError:
                pass
        raise _AlreadyDecided(d)

    async def resolve(self, action: str, refs: list[dict[str, Any]], dry_run: bool) -> list[dict[str, Any]]:
        commit = action == "commit"
        out = []
        for ref in refs:
            row: dict[str, Any] = {"ref": ref, "tx_id": ref.get("tx_id")}
            try:
                rec = self.find(ref)
                row["tx_id"] = tx_id = rec.properties[PROP_UNIQ_KEY]
                d = None if tx_id in self.index.pending else self.index.lookup(tx_id)
                if dry_run:
                    row.update(self._dry(d, commit, tx_id))
                else:
                    r = await self.decide(rec, commit, "operator")
                    row.update(status="ok" if r["status"] == "ok" else "already",
                               message=f"{'committed' if commit else 'rolled back'}" if r["status"] == "ok" else f"already {r['outcome'].replace('_', ' ')}")
            except _AlreadyDecided as e:
                same = e.d.outcome is (Outcome.COMMITTED if commit else Outcome.ROLLED_BACK)
                row.update(status="already" if same else "conflict", message=f"already {e.d.outcome.label.replace('_', ' ')}")
            except TxmqError as e:
                row.update(status={ErrorCode.TX_CONFLICT: "conflict", ErrorCode.TX_NOT_FOUND: "not_found"}.get(e.code, "error"), message=e.message)
            out.append(row)
        return out

    async def resolve_where(self, action: str, group: str, topic: str | None, min_age_ms: int, after: int, limit: int,
                            dry_run: bool) -> tuple[list[dict[str, Any]], int | None]:
        """Decide up to `limit` pending transactions of `group` (by half offset above `after`) as they are now.

        Returns their results (as ``resolve``'s, each ``ref`` its tx id) once
        every decision is durable, and the cursor for the next batch (None
        when this batch was the last). The decisions of one batch go to the
        log together (group commit), not one fsync each.
        """
        page = self.matching(group, topic, min_age_ms, after, limit)
        cursor = page[-1].half_offset if len(page) >= limit else None
        results = await asyncio.gather(*(self.resolve(action, [{"tx_id": p.tx_id}], dry_run) for p in page))
        return [dict(r[0], ref=r[0]["tx_id"]) for r in results], cursor

    @staticmethod
    def _dry(d: Decided | None, commit: bool, tx_id: str) -> dict[str, Any]:
        if d is None:
            return {"status": "ok", "message": f"would {'commit' if commit else 'roll back'} (dry run)"}
        same = d.outcome is (Outcome.COMMITTED if commit else Outcome.ROLLED_BACK)
        return {"status": "already" if same else "conflict", "message": f"already {d.outcome.label.replace('_', ' ')}"}

    # ---- operator: the discard topic ---------------------------------------
    def discarded(self, limit: int, after: int = -1) -> list[dict[str, Any]]:
        return [{"tx_id": tx_id, "topic": d.topic, "group": d.group, "checks": d.checks,
                 "discarded_at": d.decided_at, "discard_offset": d.half_offset,
                 "reason": d.decided_by, "commit_log_offset": d.cl_offset}
                for tx_id, d in self.index.discarded_rows(limit, after)]

    async def replay(self, to: str, refs: list[dict[str, Any]] | None, all_: bool, dry_run: bool) -> list[dict[str, Any]]:
        if all_:
            refs = [{"tx_id": r["tx_id"]} for r in self.discarded(10**9)]
        out = []
        for ref in refs or []:
            row: dict[str, Any] = {"ref": ref, "tx_id": ref.get("tx_id")}
            try:
                tx_id, d = self._find_discarded(ref)
                row["tx_id"] = tx_id
                if d is None or d.outcome is not Outcome.DISCARDED:
                    state = self.index.outcome(tx_id)
                    row.update(status="conflict", message=f"not in the discard topic (it is {state.label if state is not None else 'unknown'})")
                elif dry_run:
                    row.update(status="ok", message=f"would replay to {to} (dry run)")
                else:
                    try:
                        rec = self.core.store.read(d.cl_offset)
                    except (CorruptRecordError, StoreError, ValueError):
                        raise TxmqError(f"the discard record of {tx_id} at {d.cl_offset} is gone (retention)", ErrorCode.TX_NOT_FOUND) from None
                    if to == "half":
                        msg = half_copy(rec, **{PROP_CHECK_TIMES: "0", PROP_REPLAYED: str(d.cl_offset)})
                        await self.core.append([msg], partial(self._replayed, msg))
                    else:
                        await self.decide(self._half_of_discard(rec), True, "operator", allow_discarded=True)
                    self.core.metrics.inc("replayed")
                    log.info("event=discard_replay tx_id=%s to=%s", tx_id, to)
                    row.update(status="ok", message=f"replayed to {to}")
            except TxmqError as e:
                row.update(status={ErrorCode.TX_CONFLICT: "conflict", ErrorCode.TX_NOT_FOUND: "not_found"}.get(e.code, "error"), message=e.message)
            out.append(row)
        return out

    def _half_of_discard(self, rec: Record) -> Record:
        """The half record a discard record was copied from (so the op names a half offset)."""
        origin = rec.properties.get(PROP_ORIGIN_CL_OFFSET)
        if origin is not None:
            try:
                half = self.read_half(int(origin))
                if half.properties.get(PROP_UNIQ_KEY) == rec.properties.get(PROP_UNIQ_KEY):
                    return half
            except (TxmqError, ValueError):
                pass  # deleted by retention: commit from the discard copy itself
        return rec

    def _replayed(self, msg: Message, results: list[AppendResult]) -> None:
        rec = as_record(msg, results[0])
        self.index.apply_half(rec)
        self.remember(rec)

    def _find_discarded(self, ref: dict[str, Any]) -> tuple[str, Decided | None]:
        if ref.get("tx_id") is not None:
            tx_id = str(ref["tx_id"])
            if tx_id in self.index.pending:
                return tx_id, None
            d = self.index.lookup(tx_id)
            if d is None:
                raise TxmqError(f"no transaction with id {tx_id}", ErrorCode.TX_NOT_FOUND)
            return tx_id, d
        if ref.get("discard_offset") is not None:
            off = int(ref["discard_offset"])
            found = self.index.discarded_at(off)
            if found is not None:
                return found
            raise TxmqError(f"no discarded transaction at discard offset {off}", ErrorCode.TX_NOT_FOUND)
        raise TxmqError("a ref needs tx_id or discard_offset", ErrorCode.INVALID_FIELD)

    # ---- listing -----------------------------------------------------------
    def pending_rows(self, group: str | None, topic: str | None, min_age_ms: int, limit: int, next_check,
                     after: int = -1) -> tuple[list[dict[str, Any]], int, int | None]:
        """A page of pending transactions by half offset above ``after``: (rows, total matching, cursor or None at the end)."""
        now_ms = int(self.core.clock() * 1000)
        page = self.matching(group, topic, min_age_ms, after, limit + 1)
        rows = [p.as_dict(now_ms, next_check(p)) for p in page[:limit]]
        total = sum(1 for _ in self._matching_iter(group, topic, min_age_ms, -1, now_ms))
        return rows, total, (page[limit - 1].half_offset if len(page) > limit else None)

    def matching(self, group: str | None, topic: str | None, min_age_ms: int, after: int, limit: int) -> list[PendingTx]:
        """At most limit pending transactions matching, by half offset above ``after`` (the index keeps them in that order)."""
        now_ms = int(self.core.clock() * 1000)
        out: list[PendingTx] = []
        for p in self._matching_iter(group, topic, min_age_ms, after, now_ms):
            out.append(p)
            if len(out) >= limit:
                break
        return out

    def _matching_iter(self, group: str | None, topic: str | None, min_age_ms: int, after: int, now_ms: int):
        pending = self.index.pending
        for half_offset, tx_id in self.index.by_half.items():
            if half_offset <= after:
                continue
            p = pending.get(tx_id)
            if p is None:
                continue
            if group and p.group != group:
                continue
            if topic and p.topic != topic:
                continue
            if min_age_ms and p.age_ms(now_ms) < min_age_ms:  # the broker's store time, not the producer's clock
                continue
            yield p


class _AlreadyDecided(Exception):
    def __init__(self, d: Decided) -> None:
        self.d = d
