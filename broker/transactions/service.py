"""Transactional messages (RocketMQ's TransactionalMessageService): half sends, end transaction, decide, discard.

The half message, the end transaction and "one outcome per transaction"
(docs/transactions.md). All
state changes go through the TxIndex right after the records are written
(before waiting for durability), so the index always matches the log.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

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
from txmq.store import AppendResult, CorruptRecordError, Message, Record, Store, StoreError, TxType
from txmq.txids import TxIds
from txmq.wire import ErrorCode, TxmqError

from ..scheduled.timing import RESERVED, TIMER_PROPERTIES, asks_for_time
from .index import Decided, IndexRowDamaged, Outcome, PendingTx, TxIndex

if TYPE_CHECKING:
    from ..appender import Appender
    from ..clock import Clock
    from ..flush import Flusher
    from ..metrics import Metrics
    from ..topics import TopicTable

log = logging.getLogger("txmq.tx")
check_log = logging.getLogger("txmq.check")  # the discard event is the check service's

HALF_CACHE_ENTRIES = 32768
TIMED = (*TIMER_PROPERTIES, *RESERVED)  # refused on a half message
MAX_NAME = 255  # the longest transaction id or group a request field takes (native/operations.py: req_str)


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
    def __init__(self, appender: Appender, store: Store, topics: TopicTable, flusher: Flusher, metrics: Metrics, clock: Clock) -> None:
        self.appender = appender
        self.store = store
        self.topics = topics
        self.flusher = flusher
        self.metrics = metrics
        self.clock = clock
        self.index: TxIndex = TxIndex()  # empty until the keeper (keeper.py) has built the index file's
        self.new_tx_id = TxIds()
        self.deciding: dict[str, asyncio.Future] = {}  # tx ids whose outcome is being written now (a check pass leaves them alone)
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

    # ---- step 1: half messages --------------------------------------------
    def send_half(self, topic: str, queue_id: int | None, body: bytes, props: dict[str, str], born_ts: int,
                  then: Callable[[dict[str, Any]], Any] | None = None) -> asyncio.Future:
        group = props.get(PROP_PGROUP)
        if not group:
            raise TxmqError("a transactional message needs a producer group (PGROUP)", ErrorCode.INVALID_FIELD)
        # end_transaction, check answers and tx_history take ids and groups of at most 255 characters:
        # a longer one would make a transaction nobody can name
        if len(group) > MAX_NAME:
            raise TxmqError(f"producer group (PGROUP) is longer than {MAX_NAME} characters", ErrorCode.INVALID_FIELD)
        if len(props.get(PROP_UNIQ_KEY) or "") > MAX_NAME:
            raise TxmqError(f"transaction id (UNIQ_KEY) is longer than {MAX_NAME} characters", ErrorCode.INVALID_FIELD)
        if asks_for_time(props) and any(k in props for k in TIMED):
            # RocketMQ 5 refuses a delivery time on a transactional message (its clients, before sending)
            raise TxmqError("a transactional message cannot be timed (TIMER_DELIVER_MS, TIMER_DELAY_SEC, TIMER_DELAY_MS): "
                            "send it without, or schedule a plain message", ErrorCode.INVALID_FIELD)
        qid = self.topics.pick_queue(topic, queue_id, "transaction")
        props = dict(props)
        props.pop(PROP_DELAY, None)  # a delay level does not apply to a transactional message (RocketMQ 4's client strips it)
        tx_id = props.get(PROP_UNIQ_KEY)
        if not tx_id:
            tx_id = self.new_tx_id()  # unique by construction: no lookup of the decided ones on disk
            taken = tx_id in self.index.pending or tx_id in self._sending
        else:
            try:
                taken = tx_id in self.deciding or tx_id in self._sending or self.index.outcome(tx_id) is not None
            except IndexRowDamaged:
                taken = True  # a row holds this id, whatever its damaged values say
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
            self.metrics.counters["half_stored"] += 1
            reply = {
                "msg_id": tx_id, "tx_id": tx_id, "topic": topic, "queue_id": qid,
                "half_offset": res.queue_offset, "commit_log_offset": res.commit_log_offset,
            }
            return reply if then is None else then(reply)  # ``then``: the caller's mapping, as the append completes

        fut = self.appender.submit([msg], shape)
        fut.add_done_callback(lambda _f: self._sending.discard(tx_id))  # also when the write failed
        return fut

    # ---- step 3: end transaction ------------------------------------------
    def read_half(self, cl_offset: int) -> Record:
        rec = self._cached_half(cl_offset)
        if rec is not None:
            return rec
        store = self.store
        if cl_offset < store.min_offset:
            # Retention deleted it, and the transaction's outcome with it: an
            # explicit error, never a second decision (docs/transactions.md).
            raise TxmqError(f"no half message at commit-log offset {cl_offset}: the log now starts at {store.min_offset} "
                            "(older records and their outcomes were deleted by retention)", ErrorCode.TX_NOT_FOUND)
        if cl_offset >= store.max_offset:
            raise TxmqError(f"no half message at commit-log offset {cl_offset}", ErrorCode.TX_NOT_FOUND)
        try:
            rec = store.read_record(cl_offset)  # never a record forged inside a message body
        except (CorruptRecordError, StoreError, ValueError):
            raise TxmqError(f"no message starts at commit-log offset {cl_offset}", ErrorCode.TX_NOT_FOUND) from None
        if rec.topic != HALF_TOPIC or rec.tx_type != TxType.PREPARED:
            raise TxmqError(f"the message at commit-log offset {cl_offset} is not a half message (topic {rec.topic})", ErrorCode.TX_NOT_HALF)
        return rec

    def end_transaction(
        self, group: str, tx_id: str, cl_offset: int, half_offset: int, state: str, source: str
    ) -> dict[str, Any] | asyncio.Future:
        if state not in ("commit", "rollback", "unknown"):  # before the half is read: a bad request is refused as such
            raise TxmqError("field 'state' must be commit, rollback or unknown", ErrorCode.INVALID_FIELD)
        rec = self.read_half(cl_offset)
        props = rec.properties
        if props.get(PROP_PGROUP) != group:
            raise TxmqError(f"producer group {group!r} does not match the half message's group {props.get(PROP_PGROUP)!r}", ErrorCode.TX_GROUP_MISMATCH)
        if rec.queue_offset != half_offset:
            raise TxmqError(f"half offset {half_offset} does not match the half message's offset {rec.queue_offset}", ErrorCode.TX_OFFSET_MISMATCH)
        if props.get(PROP_UNIQ_KEY) != tx_id:
            raise TxmqError(f"transaction id {tx_id!r} does not match the half message's {props.get(PROP_UNIQ_KEY)!r}", ErrorCode.TX_ID_MISMATCH)
        m = self.metrics.counters
        if source == "check":
            m["checks_answered"] += 1
        if state == "unknown":
            m["unknown_answers"] += 1
            p = self.index.pending.get(tx_id)
            if p is not None and source == "check":
                p.last_check_result = "unknown"
            out = self.index.outcome(tx_id)
            return {"status": "noop", "outcome": (out or Outcome.PENDING).label}
        if source == "check":
            p = self.index.pending.get(tx_id)
            if p is not None:
                p.last_check_result = state
        return self.decide(rec, state == "commit", source)

    def decide(self, rec: Record, commit: bool, source: str, allow_discarded: bool = False,
               op_props: dict[str, str] | None = None) -> asyncio.Future:
        """Commit or roll back the transaction of half record `rec`, at most once.

        Returns a future of the reply. The outcome is entered in the index
        as soon as the records are written, before the fsync, so a
        concurrent duplicate sees it; a duplicate that arrives while the
        write is pending waits for it (``deciding``). ``op_props`` are set
        on the op record over the ones taken from `rec` (a replay's).
        """
        tx_id = rec.properties[PROP_UNIQ_KEY]
        inflight = self.deciding.get(tx_id)
        if inflight is not None:
            return asyncio.ensure_future(self._decide_after(inflight, rec, commit, source, allow_discarded, op_props))
        loop = self.appender.loop
        want = Outcome.COMMITTED if commit else Outcome.ROLLED_BACK
        d = None if tx_id in self.index.pending else self.index.lookup(tx_id)
        if d is not None and not (allow_discarded and d.outcome is Outcome.DISCARDED):
            fut = loop.create_future()
            if d.outcome is want:
                # The first outcome may still be on its way to the disk (sync
                # flush): "already" is only as true as that record is durable.
                waiter = self.flusher.wait_durable(d.cl_offset + 1)
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
        msgs.append(self._op(rec, commit, source, op_props))
        gate = loop.create_future()
        self.deciding[tx_id] = gate

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

        fut = self.appender.submit(msgs, shape)
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
        if self.deciding.get(tx_id) is gate:
            del self.deciding[tx_id]
        if not gate.done():
            gate.set_result(None)

    async def _decide_after(self, inflight: asyncio.Future, rec: Record, commit: bool, source: str, allow_discarded: bool,
                            op_props: dict[str, str] | None) -> dict[str, Any]:
        await asyncio.shield(inflight)
        return await self.decide(rec, commit, source, allow_discarded, op_props)

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
            await self.appender.submit([op], lambda results, op=op: self.index.apply_op(as_record(op, results[0])))
            log.warning("event=commit_repaired tx_id=%s commit_offset=%d", tx_id, rec.commit_log_offset)
            repaired += 1
        return repaired

    def _already(self, d: Decided) -> dict[str, Any]:
        return {"status": "already", "outcome": d.outcome.label, "decided_by": d.decided_by}

    def _count_decision(self, rec: Record, commit: bool, source: str) -> None:
        m = self.metrics
        m.counters[f"{'committed' if commit else 'rolled_back'}_{source}"] += 1
        m.decided(max(0.0, self.clock() - rec.born_ts / 1000.0))
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
        n, _ = self.topics.ensure(topic)
        if qid >= n:
            qid = qid % n
        return Message(topic, qid, TxType.COMMIT, rec.born_ts, p, rec.body, prepared_offset=rec.commit_log_offset)

    def _op(self, rec: Record, commit: bool, source: str, extra: dict[str, str] | None = None) -> Message:
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
        if extra:
            props.update(extra)
        body = str(rec.queue_offset).encode()
        kind = TxType.COMMIT if commit else TxType.ROLLBACK
        return Message(OP_TOPIC, 0, kind, int(self.clock() * 1000), props, body, prepared_offset=rec.commit_log_offset)

    # ---- discard and replay -------------------------------------------------
    def discard(self, items: list[tuple[PendingTx, str, Record]]) -> asyncio.Future:
        """Move transactions to the discard topic: (pending transaction, reason, its half record) each.

        The check service calls this for what it found checked ``max_checks``
        times or older than the retention. Each gets a discard record (a copy
        of its half record with ``TXMQ_DISCARD_REASON``), entered in the
        index as soon as it is written (``apply_discard``: a no-op for a
        transaction decided meanwhile, the first outcome wins).
        """
        index = self.index
        msgs = [self._discard_record(rec, reason) for _, reason, rec in items]

        def shape(results: list[AppendResult]) -> None:
            n = 0
            for (p, reason, _), msg, res in zip(items, msgs, results):
                was_pending = index.pending.get(p.tx_id) is p
                index.apply_discard(as_record(msg, res))  # a no-op if it was decided meanwhile
                if was_pending:
                    n += 1
                    check_log.warning("event=discard tx_id=%s group=%s topic=%s checks=%d reason=%s", p.tx_id, p.group, p.topic, p.checks, reason)
            self.metrics.counters["discarded"] += n

        return self.appender.submit(msgs, shape)

    @staticmethod
    def _discard_record(rec: Record, reason: str) -> Message:
        p = dict(rec.properties)
        p.setdefault(PROP_ORIGIN_CL_OFFSET, str(rec.commit_log_offset))
        p[PROP_DISCARD_REASON] = reason
        return Message(DISCARD_TOPIC, 0, TxType.PREPARED, rec.born_ts, p, rec.body)

    def replay_half(self, discard: Record, discard_cl_offset: int) -> asyncio.Future:
        """Re-open a discarded transaction (``txmq discard replay --to half``): a new half copy of its discard record.

        The copy has check count 0 and ``TXMQ_REPLAYED`` naming the discard
        record, so the index takes the transaction as pending again
        (``index.reopens``), now and in any later rebuild.
        """
        msg = half_copy(discard, **{PROP_CHECK_TIMES: "0", PROP_REPLAYED: str(discard_cl_offset)})

        def shape(results: list[AppendResult]) -> None:
            rec = as_record(msg, results[0])
            self.index.apply_half(rec)
            self.remember(rec)

        return self.appender.submit([msg], shape)

    def replay_commit(self, discard: Record, discard_cl_offset: int, half: Record) -> asyncio.Future:
        """Commit a discarded transaction (``txmq discard replay --to commit``) from its half record `half`.

        The op record keeps what the discard ended: the check count of the
        discard record (so the index row keeps the checks made) and
        ``TXMQ_REPLAYED`` naming the discard record, from which the
        transaction's history finds the discard and the replay again.
        """
        extra = {PROP_CHECK_TIMES: discard.properties.get(PROP_CHECK_TIMES, "0"), PROP_REPLAYED: str(discard_cl_offset)}
        return self.decide(half, True, "operator", allow_discarded=True, op_props=extra)
