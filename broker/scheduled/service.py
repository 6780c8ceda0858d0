"""The schedule's service: delayed and timed messages sent, delivered when due, cancelled (RocketMQ's timer).

The index (``timers.db``, the rows in memory, the window) is the keeper's
(keeper.py), the listings and gauges the admin's (admin.py).

How a scheduled message lives (docs/scheduled.md):

1. ``send`` (called by ``BrokerCore.send`` for a message whose properties
   ask for a later time, so every front end gets it): the message is
   appended to ``RMQ_SYS_TXMQ_TIMER`` queue 0 with ``REAL_TOPIC``,
   ``REAL_QID``, ``TIMER_OUT_MS`` (its due time) and a ``UNIQ_KEY``; it is
   acknowledged as any send, once durable under the flush mode. Right after
   the write its row enters the index (the keeper's ``added``, and the
   window if it is due soon).
2. The index: the keeper (keeper.py).
3. Delivery: the delivery task pops what is due, reads the scheduled
   records, and appends each to its real topic with its id, keys, tag,
   properties and born time, plus ``TIMER_DELIVER_MS``, ``TIMER_ENQUEUE_MS``,
   ``TIMER_DEQUEUE_MS`` and ``TXMQ_SCHEDULED_FROM`` (the scheduled record's
   commit-log offset), many in one append.
4. Cancel (a client's recall, an operator's ``txmq scheduled cancel``): a
   cancel record, durable as a send; the row leaves the index once written.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from txmq.constants import (
    PROP_DELAY,
    PROP_REAL_QID,
    PROP_REAL_TOPIC,
    PROP_SCHEDULE_CANCEL,
    PROP_SCHEDULED_FROM,
    PROP_TIMER_DELAY_MS,
    PROP_TIMER_DELAY_SEC,
    PROP_TIMER_DELIVER_MS,
    PROP_TIMER_DEQUEUE_MS,
    PROP_TIMER_ENQUEUE_MS,
    PROP_TIMER_OUT_MS,
    PROP_UNIQ_KEY,
    SCHEDULE_TOPIC,
)
from txmq.store import AppendResult, Message, Record, Store, TxType
from txmq.store.damage import Damage
from txmq.txids import TxIds
from txmq.wire import ErrorCode, TxmqError

from ..indexlife import cancel_and_wait
from ..metrics import Durations
from ..records import msg_id
from .admin import ScheduleAdmin
from .keeper import READ_STEP, TimerKeeper, read_records, row_of
from .timing import DEFAULT_LEVELS_MS, asks_for_time, due_ms, fmt_delay

if TYPE_CHECKING:
    from ..appender import Appender
    from ..clock import Clock
    from ..flush import DiskState, Flusher
    from ..metrics import Metrics
    from ..topics import TopicTable

log = logging.getLogger("txmq.scheduled")

DELIVER_BATCH = 4096  # messages delivered in one append
DELIVER_BYTES = 8 << 20  # ... and at most about this many bytes of records read for it (large messages: fewer per append)
TICK_S = 0.05  # the longest the delivery task sleeps (it wakes at the next due time if sooner)
RETRY_S = 1.0  # after a failed delivery (a full disk, say), the wait before the next attempt
# Delivered and cancelled copies drop what asked for the delay: a message sent again (a dead-letter copy)
# is not delayed a second time.
_DROPPED_SET = frozenset({PROP_REAL_TOPIC, PROP_REAL_QID, PROP_TIMER_OUT_MS, PROP_DELAY, PROP_TIMER_DELAY_SEC, PROP_TIMER_DELAY_MS})


def is_scheduled_message(rec: Record) -> bool:
    """A scheduled record (a message waiting for, or already past, its due time), not a cancel or another system record:
    what a lookup by commit-log offset shows, as RocketMQ shows a delayed message in SCHEDULE_TOPIC_XXXX."""
    return rec.topic == SCHEDULE_TOPIC and row_of(rec) is not None


class ScheduleService:
    """Scheduled messages: the send path, the delivery task and cancels; the index is the keeper's, listings the admin's."""

    def __init__(self, appender: Appender, store: Store, topics: TopicTable, flusher: Flusher, disk: DiskState, metrics: Metrics,
                 clock: Clock, data_dir: Path, max_delay_s: float,
                 delay_levels_ms: tuple[int, ...] = DEFAULT_LEVELS_MS) -> None:
        self.appender = appender
        self.store = store
        self.topics = topics
        self.flusher = flusher
        self.disk = disk
        self.metrics = metrics
        self.clock = clock
        self.data_dir = data_dir
        self.max_delay_ms = int(max_delay_s * 1000)
        self.delay_levels_ms = delay_levels_ms  # RocketMQ 4's DELAY levels 1..n (broker start --message-delay-level)
        # A level is the operator's own delay and is kept even beyond --max-delay, which bounds the times clients
        # choose (TIMER_*), as RocketMQ's timerMaxDelaySec does (docs/scheduled.md, "Delay levels and --max-delay").
        beyond = [i + 1 for i, d in enumerate(delay_levels_ms) if d > self.max_delay_ms]
        if beyond:
            log.warning("event=delay_levels_beyond_max_delay levels=%s longest=%s max_delay=%s msg=%s", ",".join(map(str, beyond)),
                        fmt_delay(max(delay_levels_ms)), fmt_delay(self.max_delay_ms),
                        "'DELAY sends of those levels and RocketMQ 4 consumer retries wait their level's delay, longer than "
                        "--max-delay, which bounds only TIMER_* times (as RocketMQ does)'")
        self.new_id = TxIds()
        self.new_id = TxIds()
        self.lateness = Durations()  # delivery time minus due time, seconds
        self.keeper = TimerKeeper(store, flusher, disk, metrics, clock, data_dir)
        self.keeper.on_ready = self._start_delivery
        self.admin = ScheduleAdmin(self.keeper, store, clock, self.lateness)
        self._deliver_task: asyncio.Task | None = None

    # ---- what the broker core uses -------------------------------------------------------
    @property
    def ready(self) -> asyncio.Event:
        """Set once the index is built (or failed to be): deliveries, cancels and listings go."""
        return self.keeper.ready

    @property
    def error(self) -> TxmqError | None:
        """Why the index could not be built."""
        return self.keeper.error

    @property
    def count(self) -> int:
        """Messages scheduled and not yet delivered or cancelled."""
        return self.keeper.count

    def start(self) -> None:
        """Build the index in the background; the delivery task starts once it is ready."""
        self.keeper.start()

    async def stop(self) -> None:
        """Stop delivering, then leave the file reflecting the whole log and close it."""
        await cancel_and_wait(self._deliver_task)
        await self.keeper.stop()

    def protect_from(self) -> int:
        """Retention keeps every segment from the lowest scheduled record on (0 until the index is built)."""
        return self.keeper.protect_from()

    def listing(self, topic: str | None, after: tuple[int, int] | None, limit: int, bodies: bool = False) -> Any:
        """ScheduleAdmin.listing."""
        return self.admin.listing(topic, after, limit, bodies)

    def gauges(self) -> dict[str, Any]:
        """ScheduleAdmin.gauges."""
        return self.admin.gauges()

    # ---- the send path -------------------------------------------------------------
    def send(self, msgs: Sequence[Message], single: bool, then: Callable[[Any], Any] | None = None) -> asyncio.Future:
        """Append plain and scheduled messages together; the receipts as ``BrokerCore.send`` gives them.

        A scheduled message's receipt names its real topic and queue, its id
        and ``deliver_at_ms``; its ``queue_offset`` is -1 (it has none until
        delivered) and ``commit_log_offset`` is the scheduled record's.
        """
        now = int(self.clock() * 1000)
        out: list[Message] = []
        info: list[tuple[int, str, int, str] | None] = []
        for m in msgs:
            p = m.properties
            due = due_ms(p, now, self.max_delay_ms, self.delay_levels_ms) if asks_for_time(p) else None
            if due is None or due <= now:  # no delay, or due already: delivered now
                out.append(m)
                info.append(None)
                continue
            props = dict(p)
            uniq = props.get(PROP_UNIQ_KEY) or self.new_id()
            props[PROP_UNIQ_KEY] = uniq
            props[PROP_REAL_TOPIC] = m.topic
            props[PROP_REAL_QID] = str(m.queue_id)
            props[PROP_TIMER_OUT_MS] = str(due)
            out.append(Message(SCHEDULE_TOPIC, 0, TxType.NORMAL, m.born_ts, props, m.body))
            info.append((due, m.topic, m.queue_id, uniq))

        def shape(results: list[AppendResult]) -> dict[str, Any]:
            rows = []
            scheduled = 0
            for m, r, i in zip(out, results, info):
                if i is None:
                    rows.append({"msg_id": msg_id(m.properties, r.commit_log_offset), "topic": m.topic, "queue_id": m.queue_id,
                                 "queue_offset": r.queue_offset, "commit_log_offset": r.commit_log_offset})
                    continue
                due, topic, qid, uniq = i
                self.keeper.add(r.commit_log_offset, due, topic, uniq)
                scheduled += 1
                rows.append({"msg_id": uniq, "topic": topic, "queue_id": qid, "queue_offset": -1,
                             "commit_log_offset": r.commit_log_offset, "deliver_at_ms": due})
            c = self.metrics.counters
            c["messages_sent"] += len(results)
            c["messages_scheduled"] += scheduled
            reply = rows[0] if single else {"results": rows}
            return reply if then is None else then(reply)

        return self.appender.submit(out, shape)


    # ---- delivery --------------------------------------------------------------------
    def _start_delivery(self) -> None:
        self._deliver_task = asyncio.get_running_loop().create_task(self._deliver_loop(), name="txmq-timers-deliver")

    async def _deliver_loop(self) -> None:
        keeper = self.keeper
        heap = keeper.heap
        while True:
            now = int(self.clock() * 1000)
            batch: list[tuple[int, int]] = []
            while heap and heap[0][0] <= now and len(batch) < DELIVER_BATCH:
                due, off = heapq.heappop(heap)
                if off in keeper.gone:
                    keeper.gone.discard(off)
                    continue
                if off in keeper.cancelling:  # its cancel is being written: back in the window if that fails
                    keeper.parked.add(off)
                    continue
                batch.append((due, off))
            if batch:
                try:
                    await self._deliver(batch, now)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if not isinstance(exc, TxmqError):
                        log.exception("event=timers_deliver_failed")
                    else:
                        log.warning("event=timers_deliver_failed error=%r retry_s=%s", exc.message, RETRY_S)
                    await asyncio.sleep(RETRY_S)
                await asyncio.sleep(0)
                continue
            if keeper.window_low():
                keeper.refill.set()
            wait = TICK_S if not heap else min(TICK_S, max(0.0, (heap[0][0] - now) / 1000))
            keeper.wake.clear()
            try:
                await asyncio.wait_for(keeper.wake.wait(), wait)
            except asyncio.TimeoutError:
                pass

    def poke(self) -> None:
        """Look at the window now (tests that move an injected clock)."""
        self.keeper.wake.set()

    async def _deliver(self, batch: list[tuple[int, int]], now: int) -> None:
        """Append the due messages of batch to their real topics; back in the window if the append fails."""
        store, keeper = self.store, self.keeper
        records: list[Record | None] = []
        size = 0
        while len(records) < len(batch) and size < DELIVER_BYTES:
            for rec in read_records(store, [off for _, off in batch[len(records):len(records) + READ_STEP]]):
                if size >= DELIVER_BYTES:  # enough for one append
                    break
                records.append(rec)
                size += rec.size if rec is not None else 0
        if len(records) < len(batch):  # the rest goes back to the window, for the next append
            for entry in batch[len(records):]:
                keeper.back(entry)
            del batch[len(records):]
        msgs: list[Message] = []
        sent: list[tuple[int, int]] = []
        dropped, now_s, queues = _DROPPED_SET, str(now), {}
        for (due, off), rec in zip(batch, records):
            if rec is None or rec.topic != SCHEDULE_TOPIC or PROP_REAL_TOPIC not in rec.properties:
                if rec is not None:
                    store.damage.report(Damage(off, "schedule", f"the index names a record of topic {rec.topic}, not a scheduled one"))
                keeper.remove(off, False)  # nothing deliverable there: not retried forever
                continue
            src = rec.properties
            topic = src[PROP_REAL_TOPIC]
            try:
                qid = int(src.get(PROP_REAL_QID, "0"))
            except ValueError:
                qid = 0
            p = {k: v for k, v in src.items() if k not in dropped}
            p[PROP_TIMER_DELIVER_MS] = str(due)
            p[PROP_TIMER_ENQUEUE_MS] = str(rec.store_ts)
            p[PROP_TIMER_DEQUEUE_MS] = now_s
            p[PROP_SCHEDULED_FROM] = str(off)
            n = queues.get(topic)
            if n is None:
                n, _ = self.topics.ensure(topic)  # a topic deleted meanwhile comes back, as for a commit
                queues[topic] = n
            msgs.append(Message(topic, qid % n, TxType.NORMAL, rec.born_ts, p, rec.body))
            sent.append((due, off))
        if not msgs:
            return
        inflight = keeper.inflight
        inflight.update(off for _, off in sent)

        def shape(results: list[AppendResult]) -> int:
            for _due, off in sent:
                inflight.discard(off)
                keeper.remove(off, False)
            # one observation per batch: its due times are close (the batch is what was due at one look)
            self.lateness.observe_n(max(0.0, self.clock() * 1000 - sent[0][0]) / 1000, len(sent))
            self.metrics.counters["scheduled_delivered"] += len(sent)
            return len(sent)

        try:
            await self.appender.submit(msgs, shape, durable=False)
        except BaseException:
            for due, off in sent:
                if off in inflight:  # not written: back in the window
                    inflight.discard(off)
                    keeper.back((due, off))
            raise


    # ---- cancels --------------------------------------------------------------------------
    async def cancel(self, message_id: str, topic: str | None = None) -> dict[str, Any]:
        """Cancel the scheduled message(s) with this id (of this topic): a cancel record each, durable as a send."""
        keeper = self.keeper
        await keeper.wait_ready()
        async with keeper.lock:
            got = await keeper.run(keeper.db.by_msg_id, message_id)
            keeper.restore(got.bad)  # rebuilt from their records: into ``added``, taken from there just below
            # after the lookup's await: a row delivered meanwhile has left ``added`` (and is in ``removed``)
            rows = [r for r in keeper.added.values() if r[3] == message_id]
            rows += [r for r in got.rows if r[0] not in keeper.removed and r[0] not in keeper.added]
            if topic is not None:
                rows = [r for r in rows if r[2] == topic]
            rows = [r for r in rows if r[0] not in keeper.cancelling]
            if not rows:
                where = f" of topic {topic}" if topic else ""
                raise TxmqError(f"no scheduled message with id {message_id!r}{where}: delivered already, cancelled, or never "
                                "scheduled", ErrorCode.NO_SUCH_MESSAGE, msg_id=message_id)
            busy = [r for r in rows if r[0] in keeper.inflight]
            if len(busy) == len(rows):
                raise TxmqError(f"scheduled message {message_id!r} is being delivered now: too late to cancel it",
                                ErrorCode.NO_SUCH_MESSAGE, msg_id=message_id)
            rows = [r for r in rows if r[0] not in keeper.inflight]
            msgs = [Message(SCHEDULE_TOPIC, 0, TxType.NORMAL, int(self.clock() * 1000),
                            {PROP_UNIQ_KEY: message_id, PROP_SCHEDULE_CANCEL: str(off), PROP_REAL_TOPIC: t}, b"")
                    for off, _due, t, _uniq in rows]
            offs = [r[0] for r in rows]
            keeper.cancelling.update(offs)

            def shape(results: list[AppendResult]) -> dict[str, Any]:
                for off, due, _t, _u in rows:
                    keeper.cancelling.discard(off)
                    popped = off in keeper.parked
                    keeper.parked.discard(off)
                    keeper.remove(off, (due, off) < keeper.bound and not popped)
                self.metrics.counters["scheduled_cancelled"] += len(rows)
                return {"msg_id": message_id, "cancelled": [
                    {"topic": t, "deliver_at_ms": due, "commit_log_offset": off} for off, due, t, _u in rows]}

            fut = self.appender.submit(msgs, shape)
        try:
            return await fut
        except BaseException:
            for off in offs:
                if off in keeper.cancelling:  # not written: still scheduled (popped meanwhile: back in the window)
                    keeper.cancelling.discard(off)
                    if off in keeper.parked:
                        keeper.parked.discard(off)
                        keeper.back((next(r[1] for r in rows if r[0] == off), off))
            raise

