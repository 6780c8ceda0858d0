"""The schedule: delayed and timed messages stored, indexed, delivered when due, cancelled (RocketMQ's timer).

How a scheduled message lives (docs/scheduled.md):

1. ``send`` (called by ``BrokerCore.send`` for a message whose properties
   ask for a later time, so every front end gets it): the message is
   appended to ``RMQ_SYS_TXMQ_TIMER`` queue 0 with ``REAL_TOPIC``,
   ``REAL_QID``, ``TIMER_OUT_MS`` (its due time) and a ``UNIQ_KEY``; it is
   acknowledged as any send, once durable under the flush mode. Right after
   the write its row enters the index (``added``, and the window if it is
   due soon).
2. The index: ``timers.db`` (indexfile.py) holds the rows not yet
   delivered; memory holds the rows written since the last flush
   (``added``), the rows delivered or cancelled since (``removed``), and the
   *window*: every row whose (due_ms, cl_offset) is below ``bound``, in a
   heap, at most ``WINDOW_ROWS`` loaded at once and due within
   ``WINDOW_S``. Memory does not grow with what is scheduled further ahead.
3. Delivery: the delivery task pops what is due, reads the scheduled
   records, and appends each to its real topic with its id, keys, tag,
   properties and born time, plus ``TIMER_DELIVER_MS``, ``TIMER_ENQUEUE_MS``,
   ``TIMER_DEQUEUE_MS`` and ``TXMQ_SCHEDULED_FROM`` (the scheduled record's
   commit-log offset), many in one append.
4. Crash consistency: the file is written only once the log is fsynced
   past what it reflects (``applied_to``), and a start replays the log from
   there: a scheduled record adds its row, a cancel record or a delivered
   copy (``TXMQ_SCHEDULED_FROM``) removes it. A delivered copy lost with a
   torn tail is delivered again; one that survived is never delivered twice.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

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
from txmq.store.codec import H_CRC, H_OFFSET, H_SIZE
from txmq.store.damage import Damage
from txmq.store.files import fsync_dir
from txmq.txids import TxIds
from txmq.wire import ErrorCode, TxmqError

from ..metrics import Durations
from ..records import msg_id
from .indexfile import DB_FILE, TimerDatabase, TimerFileError, damaged, remove_db
from .timing import DEFAULT_LEVELS_MS, asks_for_time, due_ms, fmt_delay

if TYPE_CHECKING:
    from ..appender import Appender
    from ..clock import Clock
    from ..flush import DiskState, Flusher
    from ..metrics import Metrics
    from ..topics import TopicTable

log = logging.getLogger("txmq.scheduled")

WINDOW_S = 60.0  # rows due within this are held in memory
WINDOW_ROWS = 100_000  # at most this many loaded from the file at once (a burst due together is loaded in parts)
FLUSH_S = 1.0  # the file is written every FLUSH_S, or as soon as FLUSH_ROWS rows changed
FLUSH_ROWS = 100_000
DELIVER_BATCH = 4096  # messages delivered in one append
DELIVER_BYTES = 8 << 20  # ... and at most about this many bytes of records read for it (large messages: fewer per append)
READ_STEP = 16  # records read at once (a delivery, a listing): at most this many large ones held before the bound is seen
TICK_S = 0.05  # the longest the delivery task sleeps (it wakes at the next due time if sooner)
RETRY_S = 1.0  # after a failed delivery (a full disk, say), the wait before the next attempt
REPLAY_STEP = 2048  # records replayed between two turns of the loop
# Delivered and cancelled copies drop what asked for the delay: a message sent again (a dead-letter copy)
# is not delayed a second time.
_DROPPED_SET = frozenset({PROP_REAL_TOPIC, PROP_REAL_QID, PROP_TIMER_OUT_MS, PROP_DELAY, PROP_TIMER_DELAY_SEC, PROP_TIMER_DELAY_MS})


class ScheduleService:
    """Scheduled messages: the send path, the index and its file, the delivery task, cancels and listings."""

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
        self.ready = asyncio.Event()  # the file is loaded and the log replayed: deliveries, cancels and listings go
        self.error: TxmqError | None = None  # why the index could not be built
        self.lateness = Durations()  # delivery time minus due time, seconds
        self.db: TimerDatabase | None = None
        self._pool = ThreadPoolExecutor(1, "txmq-timers")  # every use of db, one at a time
        self._lock = asyncio.Lock()  # a flush, a window load, a cancel's lookup and write: one at a time
        self.added: dict[int, tuple[int, int, str, str]] = {}  # cl_offset -> row, written to the log, not yet to the file
        self.removed: set[int] = set()  # rows delivered or cancelled, still in the file
        self.heap: list[tuple[int, int]] = []  # the window: (due_ms, cl_offset)
        self.bound: tuple[int, int] = (0, 0)  # every row below it is in the window; none at or above it is
        self.gone: set[int] = set()  # rows of the window cancelled (left in the heap, skipped when popped)
        self.inflight: set[int] = set()  # rows being delivered now
        self.cancelling: set[int] = set()  # rows whose cancel record is being written
        self.parked: set[int] = set()  # rows of cancelling popped from the window meanwhile (back in it if the cancel fails)
        self.count = 0  # rows scheduled and not yet delivered or cancelled
        self.file_min: int | None = None  # the lowest scheduled record's commit-log offset in the file (retention)
        self._wake = asyncio.Event()
        self._refill = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._flush_failing = False

    # ---- the send path -------------------------------------------------------------
    def send(self, msgs: Sequence[Message], single: bool) -> asyncio.Future:
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
                self._add(r.commit_log_offset, due, topic, uniq)
                scheduled += 1
                rows.append({"msg_id": uniq, "topic": topic, "queue_id": qid, "queue_offset": -1,
                             "commit_log_offset": r.commit_log_offset, "deliver_at_ms": due})
            c = self.metrics.counters
            c["messages_sent"] += len(results)
            c["messages_scheduled"] += scheduled
            return rows[0] if single else {"results": rows}

        return self.appender.submit(out, shape)

    # ---- the index in memory ---------------------------------------------------------
    def _add(self, off: int, due: int, topic: str, uniq: str) -> None:
        self.added[off] = (off, due, topic, uniq)
        self.count += 1
        self._back((due, off))

    def _back(self, entry: tuple[int, int]) -> None:
        """Put a row in the window if it belongs there (below ``bound``); one at or above it is loaded in its turn."""
        if entry < self.bound:
            heap = self.heap
            heapq.heappush(heap, entry)
            if heap[0] == entry:
                self._wake.set()
            if len(heap) > WINDOW_ROWS:
                self._shrink()

    def _shrink(self) -> None:
        """Keep the soonest half of the window and lower ``bound`` to the first row let go (sends due soon, in a burst)."""
        heap = self.heap
        heap.sort()  # a sorted list is a heap; in place: the delivery task holds this list
        keep = WINDOW_ROWS // 2
        self.bound = heap[keep]
        self.gone.difference_update(off for _, off in heap[keep:])  # let go: removed rows, not loaded again
        del heap[keep:]

    def _remove(self, off: int, in_window: bool) -> None:
        if self.added.pop(off, None) is None:
            self.removed.add(off)
        self.count -= 1
        if in_window:
            self.gone.add(off)

    def _replay(self, rec: Record) -> None:
        """Apply one record of the log to the index (a start's replay)."""
        p = rec.properties
        if rec.topic == SCHEDULE_TOPIC:
            target = p.get(PROP_SCHEDULE_CANCEL)
            if target is None:
                try:
                    self._add(rec.commit_log_offset, int(p[PROP_TIMER_OUT_MS]), p[PROP_REAL_TOPIC], p.get(PROP_UNIQ_KEY) or "")
                except (KeyError, ValueError):
                    self.store.damage.report(Damage(rec.commit_log_offset, "schedule", "a scheduled record without its due time or topic"))
                return
        else:
            target = p.get(PROP_SCHEDULED_FROM)
            if target is None:
                return
        try:
            off = int(target)
        except ValueError:
            return
        self._remove(off, False)  # the replay runs before the window is loaded

    # ---- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._build(), name="txmq-timers-build"))

    async def _build(self) -> None:
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        store = self.store
        replayed = 0
        try:
            db, start, why = await loop.run_in_executor(self._pool, self._open)
            self.db = db
            if why is not None:
                (log.warning if start < store.max_offset else log.info)("event=timers_rebuild reason=%r from=%d", why, start)
            end = store.max_offset
            for rec in store.scan(start, end):
                self._replay(rec)
                replayed += 1
                if replayed % REPLAY_STEP == 0:
                    if len(self.added) + len(self.removed) >= FLUSH_ROWS:
                        await self._flush(upto=rec.commit_log_offset)
                    await asyncio.sleep(0)
            await self._flush()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if getattr(exc, "io", False) or isinstance(exc, OSError):  # e.g. a full disk: one line, no traceback
                log.error("event=timers_rebuild_failed error=%r msg=%s", exc, "'scheduled messages are stored but not delivered "
                          "until a restart'")
            else:
                log.exception("event=timers_rebuild_failed")
            self.error = TxmqError(f"the schedule's index could not be built ({exc!r}); scheduled messages are stored but not "
                                   "delivered until a restart", ErrorCode.STORE_ERROR)
            self.ready.set()
            return
        self.ready.set()
        await self._load_window()
        log.info("event=timers_ready scheduled=%d window=%d records_read=%d took_s=%.3f", self.count, len(self.heap), replayed,
                 time.perf_counter() - t0)
        self._tasks.append(loop.create_task(self._deliver_loop(), name="txmq-timers-deliver"))
        self._tasks.append(loop.create_task(self._flush_loop(), name="txmq-timers-flush"))

    def _open(self) -> tuple[TimerDatabase, int, str | None]:
        """The file and where the replay starts; a new file and the log's first scheduled record if the old one does not fit."""
        path = self.data_dir / DB_FILE
        why = "no index file"
        if path.exists():
            try:
                db = TimerDatabase(path)
                why = self._agrees(db.meta)
                if why is None:
                    n, lo, _first = db.count_and_min()
                    self.count, self.file_min = n, lo
                    return db, db.meta["applied_to"], None
                db.close()
            except TimerFileError as exc:
                if exc.io:
                    raise
                why = str(exc)
            except Exception as exc:
                if not (isinstance(exc, sqlite3.DatabaseError) and damaged(exc)):
                    raise
                why = f"damaged ({exc})"
        remove_db(self.data_dir)
        fsync_dir(self.data_dir)
        db = TimerDatabase(path)
        return db, self._first_scheduled(), why

    def _first_scheduled(self) -> int:
        """Where a rebuild reads from: the first scheduled record still in the log (the log's end if there is none)."""
        store = self.store
        lo = store.queue_min_offset(SCHEDULE_TOPIC, 0)
        entries = store.cq_entries(SCHEDULE_TOPIC, 0, lo, 1)
        return min(entries[0][0], store.max_offset) if entries else store.max_offset

    def _agrees(self, meta: dict[str, Any]) -> str | None:
        try:
            if meta.get("damaged"):
                return "a broker found a damaged row in it"
            applied = meta["applied_to"]
            if not 0 <= applied <= self.store.max_offset:
                return f"it reflects the log up to {applied}, and the log ends at {self.store.max_offset}"
            boundary = meta.get("boundary")
            if boundary is not None:
                try:
                    _raw, head = self.store.read_many([boundary[0]], raw=True)[0]
                except Exception:
                    return f"no record at its boundary offset {boundary[0]}"
                if head[H_CRC] != boundary[1] or head[H_OFFSET] + head[H_SIZE] > applied:
                    return f"the record at its boundary offset {boundary[0]} is another one"
            return None
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            return f"unreadable meta ({exc!r})"

    def _boundary(self) -> list[int] | None:
        """[commit-log offset, CRC] of the last record of the schedule's queue (on the loop, between appends)."""
        store = self.store
        n = store.queue_max_offset(SCHEDULE_TOPIC, 0)
        if n <= 0:
            return None
        entries = store.cq_entries(SCHEDULE_TOPIC, 0, n - 1, 1)
        if not entries:
            return None
        try:
            _raw, head = store.read_many([entries[0][0]], raw=True)[0]
        except Exception:
            return None
        return [entries[0][0], head[H_CRC]]

    async def stop(self) -> None:
        """Stop delivering, then leave the file reflecting the whole log and close it."""
        for task in self._tasks:
            if not task.done():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        for _ in range(3):  # deliveries submitted by the cancelled task are written (their index updates) first
            await asyncio.sleep(0)
        db = self.db
        if db is None:
            return
        try:
            if self.ready.is_set() and self.error is None and await self._flush():
                await asyncio.get_running_loop().run_in_executor(self._pool, db.checkpoint)
        except Exception:
            log.exception("event=timers_flush_failed")
        finally:
            await asyncio.get_running_loop().run_in_executor(self._pool, db.close)
            self._pool.shutdown(wait=False)

    # ---- the file --------------------------------------------------------------------
    async def _flush(self, upto: int | None = None) -> bool:
        async with self._lock:
            return await self._flush_locked(upto)

    async def _flush_locked(self, upto: int | None = None) -> bool:
        """Write the rows added and removed since the last flush, once the log is durable past them."""
        db = self.db
        if db is None:
            return False
        added, removed = self.added, self.removed
        self.added, self.removed = {}, set()
        store = self.store
        meta: dict[str, Any] = {"applied_to": store.max_offset if upto is None else upto}
        meta["boundary"] = self._boundary() if upto is None else None
        if db.bad_rows:
            meta["damaged"] = db.bad_rows
        loop = asyncio.get_running_loop()
        try:
            waiter = self.flusher.wait_synced(store.max_offset)
            if waiter is not None:
                await waiter
            await loop.run_in_executor(self._pool, db.flush, added.values(), removed, meta)
            n, lo, _first = await loop.run_in_executor(self._pool, db.count_and_min)
        except BaseException as exc:
            # the changes stay for the next flush (a row added then removed meanwhile cancels out)
            for off, row in added.items():
                if off in self.removed:
                    self.removed.discard(off)
                else:
                    self.added[off] = row
            self.removed |= removed
            if not isinstance(exc, Exception):
                raise
            if not self.disk.failed("timers", exc) and not self._flush_failing:
                log.error("event=timers_flush_failed error=%r", exc)
            self._flush_failing = True
            self.metrics.inc("timers_flush_errors")
            return False
        if self._flush_failing:
            log.info("event=timers_flush_recovered")
        self._flush_failing = False
        self.disk.ok("timers")
        # what the file holds, plus what was written since the flush's capture
        self.count = n + len(self.added) - len(self.removed)
        self.file_min = lo
        return True

    async def _load_window(self) -> None:
        """Load the rows due within WINDOW_S past ``bound`` into the heap (after a flush: the file holds every older change)."""
        async with self._lock:
            await self._flush_locked()
            now = int(self.clock() * 1000)
            horizon = now + int(WINDOW_S * 1000)
            limit = max(1, WINDOW_ROWS - len(self.heap))
            bound = self.bound
            rows = await asyncio.get_running_loop().run_in_executor(self._pool, self.db.due_rows, bound, horizon, limit)
            if self.bound != bound:  # sends meanwhile filled the window and lowered its bound (_shrink): it is full
                return
            new_bound = (horizon, 0) if len(rows) < limit else (rows[-1][1], rows[-1][0] + 1)
            if new_bound < bound:
                new_bound = bound
            removed, heap, busy = self.removed, self.heap, self.inflight | self.parked
            for off, due, _topic, _uniq in rows:
                if off not in removed and off not in busy:
                    heap.append((due, off))
            # rows written since the flush, not in the file yet
            for off, due, _topic, _uniq in self.added.values():
                if bound <= (due, off) < new_bound and off not in busy:
                    heap.append((due, off))
            heapq.heapify(heap)
            self.bound = new_bound
            self._wake.set()

    async def _flush_loop(self) -> None:
        waited = 0.0
        while True:
            try:
                await asyncio.wait_for(self._refill.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
            waited += 0.1
            try:
                if self._refill.is_set() or self._window_low():
                    self._refill.clear()
                    waited = 0.0
                    await self._load_window()
                elif (self.added or self.removed) and (waited >= FLUSH_S or len(self.added) + len(self.removed) >= FLUSH_ROWS):
                    waited = 0.0
                    await self._flush()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("event=timers_flush_failed")
                await asyncio.sleep(RETRY_S)

    def _window_low(self) -> bool:
        """The window should take more rows: it reaches less than half its span ahead, and holds less than half its rows."""
        now = int(self.clock() * 1000)
        return self.bound[0] < now + int(WINDOW_S * 500) and len(self.heap) < WINDOW_ROWS // 2

    # ---- delivery --------------------------------------------------------------------
    async def _deliver_loop(self) -> None:
        heap = self.heap
        while True:
            now = int(self.clock() * 1000)
            batch: list[tuple[int, int]] = []
            while heap and heap[0][0] <= now and len(batch) < DELIVER_BATCH:
                due, off = heapq.heappop(heap)
                if off in self.gone:
                    self.gone.discard(off)
                    continue
                if off in self.cancelling:  # its cancel is being written: back in the window if that fails
                    self.parked.add(off)
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
            if self._window_low():
                self._refill.set()
            wait = TICK_S if not heap else min(TICK_S, max(0.0, (heap[0][0] - now) / 1000))
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except asyncio.TimeoutError:
                pass

    def poke(self) -> None:
        """Look at the window now (tests that move an injected clock)."""
        self._wake.set()

    async def _deliver(self, batch: list[tuple[int, int]], now: int) -> None:
        """Append the due messages of batch to their real topics; back in the window if the append fails."""
        store = self.store
        records: list[Record | None] = []
        size = 0
        while len(records) < len(batch) and size < DELIVER_BYTES:
            for rec in self._read([off for _, off in batch[len(records):len(records) + READ_STEP]]):
                if size >= DELIVER_BYTES:  # enough for one append
                    break
                records.append(rec)
                size += rec.size if rec is not None else 0
        if len(records) < len(batch):  # the rest goes back to the window, for the next append
            for entry in batch[len(records):]:
                self._back(entry)
            del batch[len(records):]
        msgs: list[Message] = []
        sent: list[tuple[int, int]] = []
        dropped, now_s, queues = _DROPPED_SET, str(now), {}
        for (due, off), rec in zip(batch, records):
            if rec is None or rec.topic != SCHEDULE_TOPIC or PROP_REAL_TOPIC not in rec.properties:
                if rec is not None:
                    store.damage.report(Damage(off, "schedule", f"the index names a record of topic {rec.topic}, not a scheduled one"))
                self._remove(off, False)  # nothing deliverable there: not retried forever
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
        inflight = self.inflight
        inflight.update(off for _, off in sent)

        def shape(results: list[AppendResult]) -> int:
            for _due, off in sent:
                inflight.discard(off)
                self._remove(off, False)
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
                    self._back((due, off))
            raise

    def _read(self, offs: list[int]) -> list[Record | None]:
        """The scheduled records at offs; None (reported as damage) for one that cannot be read."""
        store = self.store
        try:
            return list(store.read_many(offs))
        except Exception:
            records: list[Record | None] = []
            for off in offs:
                try:
                    records.append(store.read_record(off))
                except Exception as exc:
                    store.damage.report(Damage(off, "schedule", f"the scheduled record cannot be read ({exc})"))
                    records.append(None)
            return records

    # ---- the operator's and the clients' requests -----------------------------------
    async def _when_ready(self) -> TimerDatabase:
        await self.ready.wait()
        if self.error is not None:
            raise self.error
        assert self.db is not None
        return self.db

    async def cancel(self, message_id: str, topic: str | None = None) -> dict[str, Any]:
        """Cancel the scheduled message(s) with this id (of this topic): a cancel record each, durable as a send."""
        db = await self._when_ready()
        loop = asyncio.get_running_loop()
        async with self._lock:
            stored = await loop.run_in_executor(self._pool, db.by_msg_id, message_id)
            # after the lookup's await: a row delivered meanwhile has left ``added`` (and is in ``removed``)
            rows = [r for r in self.added.values() if r[3] == message_id]
            rows += [r for r in stored if r[0] not in self.removed]
            if topic is not None:
                rows = [r for r in rows if r[2] == topic]
            rows = [r for r in rows if r[0] not in self.cancelling]
            if not rows:
                where = f" of topic {topic}" if topic else ""
                raise TxmqError(f"no scheduled message with id {message_id!r}{where}: delivered already, cancelled, or never "
                                "scheduled", ErrorCode.NO_SUCH_MESSAGE, msg_id=message_id)
            busy = [r for r in rows if r[0] in self.inflight]
            if len(busy) == len(rows):
                raise TxmqError(f"scheduled message {message_id!r} is being delivered now: too late to cancel it",
                                ErrorCode.NO_SUCH_MESSAGE, msg_id=message_id)
            rows = [r for r in rows if r[0] not in self.inflight]
            msgs = [Message(SCHEDULE_TOPIC, 0, TxType.NORMAL, int(self.clock() * 1000),
                            {PROP_UNIQ_KEY: message_id, PROP_SCHEDULE_CANCEL: str(off), PROP_REAL_TOPIC: t}, b"")
                    for off, _due, t, _uniq in rows]
            offs = [r[0] for r in rows]
            self.cancelling.update(offs)

            def shape(results: list[AppendResult]) -> dict[str, Any]:
                for off, due, _t, _u in rows:
                    self.cancelling.discard(off)
                    popped = off in self.parked
                    self.parked.discard(off)
                    self._remove(off, (due, off) < self.bound and not popped)
                self.metrics.counters["scheduled_cancelled"] += len(rows)
                return {"msg_id": message_id, "cancelled": [
                    {"topic": t, "deliver_at_ms": due, "commit_log_offset": off} for off, due, t, _u in rows]}

            fut = self.appender.submit(msgs, shape)
        try:
            return await fut
        except BaseException:
            for off in offs:
                if off in self.cancelling:  # not written: still scheduled (popped meanwhile: back in the window)
                    self.cancelling.discard(off)
                    if off in self.parked:
                        self.parked.discard(off)
                        self._back((next(r[1] for r in rows if r[0] == off), off))
            raise

    async def listing(self, topic: str | None, after: tuple[int, int] | None, limit: int) -> dict[str, Any]:
        """Scheduled messages by due time (a page from ``after``), counts per topic, and the totals."""
        db = await self._when_ready()
        loop = asyncio.get_running_loop()
        async with self._lock:
            await self._flush_locked()
            rows = await loop.run_in_executor(self._pool, db.listing, topic, after or (-1, -1), limit)
            summary = await loop.run_in_executor(self._pool, db.summary)
        out = []
        for i in range(0, len(rows), READ_STEP):  # a few records at a time: a page of large messages is not held whole
            part = rows[i:i + READ_STEP]
            for (off, due, t, uniq), rec in zip(part, self._read([r[0] for r in part])):
                p = rec.properties if rec is not None else {}
                try:
                    qid = int(p.get(PROP_REAL_QID, 0) or 0)
                except ValueError:
                    qid = 0
                out.append({"msg_id": uniq, "topic": t, "deliver_at_ms": due, "commit_log_offset": off, "queue_id": qid,
                            "tags": p.get("TAGS"), "keys": p.get("KEYS"), "born_ts": rec.born_ts if rec is not None else None,
                            "store_ts": rec.store_ts if rec is not None else None, "size": rec.size if rec is not None else None})
        by_topic = {t: {"scheduled": n, "first_due_ms": first} for t, (n, first) in sorted(summary.items())}
        total = sum(v["scheduled"] for t, v in by_topic.items() if topic is None or t == topic)
        # cursor: where the next page starts (``after``), None after the last one
        return {"messages": out, "by_topic": by_topic, "total": total,
                "cursor": [out[-1]["deliver_at_ms"], out[-1]["commit_log_offset"]] if len(out) == limit else None}

    # ---- what the operators see ----------------------------------------------------------
    def gauges(self) -> dict[str, Any]:
        """Scheduled messages, and how late the most overdue one is (0 when nothing due waits)."""
        now = int(self.clock() * 1000)
        heap = self.heap
        try:  # the metrics thread reads it too: the heap may empty meanwhile
            lag = max(0, now - heap[0][0]) / 1000 if heap and self.ready.is_set() else 0.0
        except IndexError:
            lag = 0.0
        return {"scheduled": max(0, self.count), "scheduled_lag_s": round(lag, 3),
                "scheduled_index": "ready" if self.ready.is_set() and self.error is None else ("failed" if self.error else "building"),
                **self.lateness.snapshot("scheduled_deliveries_timed", "scheduled_lateness")}

    def protect_from(self) -> int:
        """Retention keeps every segment from the lowest scheduled record on (0 until the index is built)."""
        if not self.ready.is_set() or self.error is not None:
            return 0
        lows = [o for o in (self.file_min, min(self.added, default=None)) if o is not None]
        return min(lows, default=self.store.max_offset)
