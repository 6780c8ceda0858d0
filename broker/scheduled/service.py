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
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

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
from txmq.store.codec import H_CRC, H_OFFSET
from txmq.store.consumequeue import first_entry_from
from txmq.store.damage import Damage
from txmq.store.files import fsync_dir
from txmq.txids import TxIds
from txmq.wire import ErrorCode, TxmqError

from ..metrics import Durations
from ..records import msg_id
from .indexcheck import agrees
from .indexfile import DB_FILE, Checked, Row, TimerDatabase, TimerFileError, damaged, io_error, meta_problem, remove_db
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
# What a start checks of timers.db beyond its meta (docs/store-format.md, "Reading timers.db at start"), in a fixed
# amount of work: the checksums of every row of a file of at most START_CHECK_ALL rows, else of the rows due first, the
# newest and a sample (a walk after the start reads the others, WALK_ROWS at a time, WALK_PAUSE_S apart); and the
# log's last LOOK_BACK_RECORDS scheduled or cancel records below applied_to, within LOOK_BACK_BYTES of it, against
# the rows.
START_CHECK_ALL = 16_384
START_CHECK_FIRST_DUE = 4096
START_CHECK_NEWEST = 4096
START_CHECK_SAMPLED = 4096
WALK_ROWS = 4096
WALK_PAUSE_S = 0.05
LOOK_BACK_RECORDS = 4096
LOOK_BACK_BYTES = 16 << 20
LISTED_ROWS = 20  # rows restored or found damaged that are logged one by one; the rest are counted
# Delivered and cancelled copies drop what asked for the delay: a message sent again (a dead-letter copy)
# is not delayed a second time.
_DROPPED_SET = frozenset({PROP_REAL_TOPIC, PROP_REAL_QID, PROP_TIMER_OUT_MS, PROP_DELAY, PROP_TIMER_DELAY_SEC, PROP_TIMER_DELAY_MS})


class _Found(NamedTuple):
    """What ``_open``'s checks found in a file it kept: its table's rows, rows whose checksum was read, damaged rows."""

    rows: int
    read: int
    bad: list[tuple]
    walk: bool  # rows were left unread: the walk after the start reads them


def _row_of(rec: Record) -> Row | None:
    """The row a scheduled record gives (None: it lacks its due time or topic)."""
    p = rec.properties
    try:
        return (rec.commit_log_offset, int(p[PROP_TIMER_OUT_MS]), p[PROP_REAL_TOPIC], p.get(PROP_UNIQ_KEY) or "")
    except (KeyError, ValueError):
        return None


def is_scheduled_message(rec: Record) -> bool:
    """A scheduled record (a message waiting for, or already past, its due time), not a cancel or another system record:
    what a lookup by commit-log offset shows, as RocketMQ shows a delayed message in SCHEDULE_TOPIC_XXXX."""
    return rec.topic == SCHEDULE_TOPIC and _row_of(rec) is not None


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
        self.unrepaired: dict[int, int] = {}  # damaged rows no record could rebuild: cl_offset -> due_ms as stored (the lag)
        self.rewritten: set[int] = set()  # rows of ``added`` rebuilt from the log over a damaged row the file still holds
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
        # a row in ``added`` is not in the file, unless it is a damaged one rebuilt there (``rewritten``)
        if self.added.pop(off, None) is None or off in self.rewritten:
            self.removed.add(off)
            self.rewritten.discard(off)
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
        checked: dict[str, int] = {"rows_checked": 0, "records_checked": 0}
        try:
            db, start, why, found = await loop.run_in_executor(self._pool, self._open)
            self.db = db
            if why is None:
                why = await self._check_start(db, start, found, checked)
                if why is not None:  # the file cannot be made to agree with the log: a new one, rebuilt from it
                    await loop.run_in_executor(self._pool, db.close)
                    db = self.db = await loop.run_in_executor(self._pool, self._new_file)
                    # Sends made meanwhile are in the log below ``end`` (taken right below, with no await in
                    # between) and the replay adds them again: the state starts empty.
                    self.added, self.removed, self.rewritten, self.count, self.file_min = {}, set(), set(), 0, None
                    start = self._first_scheduled()
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
        log.info("event=timers_ready scheduled=%d window=%d records_read=%d rows_checked=%d records_checked=%d took_s=%.3f",
                 self.count, len(self.heap), replayed, checked["rows_checked"], checked["records_checked"], time.perf_counter() - t0)
        self._tasks.append(loop.create_task(self._deliver_loop(), name="txmq-timers-deliver"))
        self._tasks.append(loop.create_task(self._flush_loop(), name="txmq-timers-flush"))
        if found is not None and found.walk:
            self._tasks.append(loop.create_task(self._walk_rows(), name="txmq-timers-walk"))

    def _open(self) -> tuple[TimerDatabase, int, str | None, _Found | None]:
        """The file, where the replay starts, why it is rebuilt (None: it is not), and what the start's checks of it found.

        A file is used when its meta values pass their checksum and agree
        with the log (``_agrees``) and its indexes lead to as many rows as
        its table holds; the checksums of its rows are checked then (all of
        them up to START_CHECK_ALL rows, a fixed number beyond). Otherwise a
        new file, and the log's first scheduled record to rebuild it from.
        """
        path = self.data_dir / DB_FILE
        why = "no index file"
        if path.exists():
            db: TimerDatabase | None = None
            keep = False
            try:
                db = TimerDatabase(path)
                why = meta_problem(db.meta) or self._agrees(db.meta)
                if why is None:
                    counts = db.counts()
                    if len(set(counts.values())) > 1:
                        why = f"timers.db's indexes disagree with its table ({counts}): a damaged page"
                if why is None:
                    n = counts["table"]
                    read, bad = db.check_rows(n, START_CHECK_ALL, START_CHECK_FIRST_DUE, START_CHECK_NEWEST, START_CHECK_SAMPLED)
                    self.count, self.file_min = n, db.lowest()
                    keep = True
                    return db, db.meta["applied_to"], None, _Found(n, read, bad, walk=n > START_CHECK_ALL)
            except TimerFileError as exc:
                if exc.io:
                    raise
                why = str(exc)
            except sqlite3.DatabaseError as exc:
                if io_error(exc):  # unreadable now (a full disk, too many open files): not known to be damaged, kept
                    raise
                # damaged pages, or a file that does not have this broker's schema (no such index): derived data only
                why = f"timers.db is {'damaged' if damaged(exc) else 'unusable'} ({exc})"
            finally:
                if not keep and db is not None:
                    db.close()
        return self._new_file(), self._first_scheduled(), why, None

    def _new_file(self) -> TimerDatabase:
        """A new, empty timers.db in place of the old one (derived data only: the log has everything it held)."""
        remove_db(self.data_dir)
        fsync_dir(self.data_dir)
        return TimerDatabase(self.data_dir / DB_FILE)

    async def _check_start(self, db: TimerDatabase, applied: int, found: _Found, checked: dict[str, int]) -> str | None:
        """Make a file whose meta passed ``_open``'s checks agree with the log, or say why it cannot (it is rebuilt then).

        1. Damaged rows the row check found are rebuilt from the scheduled
           records they name (``_repair``); one that names none makes the
           file unusable.
        2. The look-back (``_look_back``): every scheduled record of the
           last stretch of log below ``applied_to`` must have a row or a
           delivered copy or cancel record after it; one that has neither
           gets its row back, from its record (logged, ``timer_row_missing``);
           a row whose message was delivered or cancelled there is deleted
           (``timer_row_stale``).
        3. The rows the table holds, with those, must be the rows the last
           flush left (``meta.rows``): a row gone further back than the
           look-back reaches cannot be told from one delivered, so the file
           is rebuilt from the log.
        """
        checked["rows_checked"] = found.read
        fixed, lost = self._repair(found.bad)
        if lost:
            return (f"timers.db: {len(lost)} damaged row(s) name no scheduled record of the log (the first: cl_offset="
                    f"{lost[0][0]!r} msg_id={lost[0][3]!r})")
        missing, stale, records = await self._look_back(db, applied)
        checked["records_checked"] = records
        rows, expected = found.rows + len(missing) - len(stale), db.meta.get("rows")
        if rows != expected:
            return (f"timers.db holds {found.rows} rows and the log's last {records} records account for {rows - found.rows:+d}, "
                    f"its meta says {expected}: rows were lost or added on disk")
        for row in fixed:
            self.added[row[0]] = row  # the next flush writes it again, with its checksum
            self.rewritten.add(row[0])
        for n, (off, row) in enumerate(sorted(missing.items())):
            if n < LISTED_ROWS:
                log.warning("event=timer_row_missing cl_offset=%d msg_id=%r due_ms=%d topic=%r msg=%s", off, row[3], row[1], row[2],
                            "'timers.db had no row for this scheduled record, and the log has no delivery or cancel of it: "
                            "the row is rebuilt from the log'")
            self.added[off] = row
            self.count += 1
        for n, (off, at) in enumerate(sorted(stale.items())):
            if n < LISTED_ROWS:
                log.warning("event=timer_row_stale cl_offset=%d delivered_or_cancelled_at=%d msg=%s", off, at,
                            "'timers.db still had a row for a message the log delivered or cancelled: the row is deleted'")
            self.removed.add(off)
            self.count -= 1
        if len(missing) + len(stale) > LISTED_ROWS:
            log.warning("event=timer_rows_restored missing=%d stale=%d msg=%s", len(missing), len(stale), "'only the first are listed'")
        return None

    def _look_back_start(self, applied: int) -> int | None:
        """Where the look-back starts: the schedule queue's LOOK_BACK_RECORDS-th record before ``applied_to``, within
        LOOK_BACK_BYTES of log below it (None: no scheduled record there, or the queue's entry leads to no record)."""
        store = self.store
        lo = store.queue_min_offset(SCHEDULE_TOPIC, 0)
        hi = first_entry_from(store, SCHEDULE_TOPIC, 0, applied)
        q = max(lo, hi - LOOK_BACK_RECORDS)
        if q >= hi:
            return None
        entry = store.cq_entries(SCHEDULE_TOPIC, 0, q, 1)
        if entry and applied - entry[0][0] > LOOK_BACK_BYTES:
            q = first_entry_from(store, SCHEDULE_TOPIC, 0, applied - LOOK_BACK_BYTES)
            entry = store.cq_entries(SCHEDULE_TOPIC, 0, q, 1) if q < hi else []
        if not entry:
            return None
        start = entry[0][0]
        try:
            _raw, head = store.read_many([start], raw=True)[0]
        except Exception:
            return None
        return start if head[H_OFFSET] == start and start < applied else None

    async def _look_back(self, db: TimerDatabase, applied: int) -> tuple[dict[int, Row], dict[int, int], int]:
        """The bounded check of the rows against the log's last stretch below ``applied_to``: (missing, stale, records read).

        ``missing``: scheduled records there with no row and no delivered
        copy or cancel record after them there (their rows, from the
        records). ``stale``: rows of messages delivered or cancelled there
        (the offset of the copy or cancel record). Records from
        ``applied_to`` on are the replay's.
        """
        start = self._look_back_start(applied)
        if start is None:
            return {}, {}, 0
        sched: dict[int, Row] = {}
        marks: dict[int, int] = {}  # scheduled record -> its delivered copy or cancel record
        n = 0
        for rec in self.store.scan(start, applied):
            n += 1
            if n % REPLAY_STEP == 0:
                await asyncio.sleep(0)
            p = rec.properties
            if rec.topic == SCHEDULE_TOPIC:
                target = p.get(PROP_SCHEDULE_CANCEL)
                if target is None:
                    row = _row_of(rec)
                    if row is not None:
                        sched[rec.commit_log_offset] = row
                    continue
            else:
                target = p.get(PROP_SCHEDULED_FROM)
                if target is None:
                    continue
            try:
                marks[int(target)] = rec.commit_log_offset
            except ValueError:
                continue
        want = [off for off in sched if off not in marks]
        have = await asyncio.get_running_loop().run_in_executor(self._pool, db.present, want + list(marks))
        missing = {off: sched[off] for off in want if off not in have}
        stale = {off: at for off, at in marks.items() if off in have}
        return missing, stale, n

    def _first_scheduled(self) -> int:
        """Where a rebuild reads from: the first scheduled record still in the log (the log's end if there is none)."""
        store = self.store
        lo = store.queue_min_offset(SCHEDULE_TOPIC, 0)
        entries = store.cq_entries(SCHEDULE_TOPIC, 0, lo, 1)
        return min(entries[0][0], store.max_offset) if entries else store.max_offset

    def _agrees(self, meta: dict[str, Any]) -> str | None:
        return agrees(self.store, meta)

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

    # ---- damaged rows ----------------------------------------------------------------
    def _repair(self, bad: list[tuple]) -> tuple[list[Row], list[tuple]]:
        """Rebuild damaged rows (stored, their checksum does not match) from the scheduled records they name.

        A row is taken back from its record when the record at its
        ``cl_offset`` is a scheduled record with the row's message id and
        its due time or topic (one column was damaged, or the checksum);
        otherwise (its ``cl_offset`` was damaged, or its id) no record is
        known to be its own. Returns (rows rebuilt, stored rows that
        could not be).
        """
        fixed: list[Row] = []
        lost: list[tuple] = []
        for stored in bad:
            off = stored[0]
            row = None
            if type(off) is int and 0 <= off < self.store.max_offset:
                try:
                    rec = self.store.read_many([off])[0]
                except Exception:
                    rec = None
                if rec is not None and rec.topic == SCHEDULE_TOPIC and PROP_SCHEDULE_CANCEL not in rec.properties:
                    row = _row_of(rec)
            if row is not None and row[3] == stored[3] and (row[1] == stored[1] or row[2] == stored[2]):
                fixed.append(row)
            else:
                lost.append(stored)
        for n, row in enumerate(fixed):
            if n < LISTED_ROWS:
                log.warning("event=timer_row_repaired cl_offset=%d msg_id=%r due_ms=%d topic=%r msg=%s", row[0], row[3], row[1], row[2],
                            "'a row of timers.db whose checksum did not match is rebuilt from its scheduled record in the log'")
        return fixed, lost

    def _restore(self, bad: list[tuple], push: bool = True) -> list[Row]:
        """Damaged rows met while running: rebuilt into ``added`` (and the window, with push) or, if no record
        rebuilds one, counted as undelivered (``unrepaired``, the lag) until the next start rebuilds timers.db."""
        if not bad:
            return []
        busy = self.removed.union(self.added, self.inflight, self.cancelling, self.unrepaired)
        bad = [r for r in bad if r[0] not in busy]
        fixed, lost = self._repair(bad)
        for row in fixed:
            self.added[row[0]] = row  # the next flush writes it again, with its checksum
            self.rewritten.add(row[0])
            entry = (row[1], row[0])
            if push and entry < self.bound and not any(o == row[0] for _, o in self.heap):
                self._back(entry)
        for stored in lost:
            self.unrepaired[stored[0]] = stored[1] if type(stored[1]) is int else 0
            if self.db is not None:
                self.db.bad_rows += 1  # recorded as ``damaged`` by the next flush: the next start rebuilds the file
            log.error("event=timer_row_damaged cl_offset=%r msg_id=%r due_ms=%r msg=%s", stored[0], stored[3], stored[1],
                      "'a row of timers.db whose checksum does not match names no scheduled record of the log: its message is "
                      "not delivered until the next start rebuilds timers.db from the log'")
        if fixed or lost:
            self.metrics.inc("timer_rows_damaged", len(fixed) + len(lost))
        return fixed

    async def _walk_rows(self) -> None:
        """After a start that checked only part of the rows: read every other row's checksum, a slice at a time."""
        after, loop = -1, asyncio.get_running_loop()
        try:
            while True:
                async with self._lock:
                    got: Checked = await loop.run_in_executor(self._pool, self.db.rows_after, after, WALK_ROWS)
                    self._restore(got.bad)
                if got.last is None:
                    return
                after = got.last[0]
                await asyncio.sleep(WALK_PAUSE_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a read failing (a full disk, a damaged page): the rows are read as they come due
            log.warning("event=timers_walk_failed error=%r", exc)

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
        rewritten = self.rewritten & added.keys()
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
            n, lo = await loop.run_in_executor(self._pool, db.flush, added.values(), removed, meta)
        except BaseException as exc:
            # the changes stay for the next flush (a row added then removed meanwhile cancels out, unless the
            # file holds a damaged row of it: that one is deleted)
            for off, row in added.items():
                if off in self.removed:
                    if off not in rewritten:
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
        self.rewritten -= rewritten  # written again: the file holds them as they are
        # what the file holds, plus what was written since the flush's capture (rows rebuilt over damaged ones are in it)
        self.count = n + len(self.added) - len(self.removed) - len(self.rewritten)
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
            got = await asyncio.get_running_loop().run_in_executor(self._pool, self.db.due_rows, bound, horizon, limit)
            if self.bound != bound:  # sends meanwhile filled the window and lowered its bound (_shrink): it is full
                return
            rows, last = got.rows, got.last
            read = len(rows) + len(got.bad)
            new_bound = (horizon, 0) if read < limit or last is None else (last[1], last[0] + 1)
            if new_bound < bound:
                new_bound = bound
            # damaged rows rebuilt from their records: into ``added`` (the next flush writes them again), and into
            # the window below through it, or at once if they are due before the part loaded now
            fixed = self._restore(got.bad, push=False)
            removed, heap, busy = self.removed, self.heap, self.inflight | self.parked
            for off, due, _topic, _uniq in rows:
                if off not in removed and off not in busy:
                    heap.append((due, off))
            # rows written since the flush, not in the file yet
            for off, due, _topic, _uniq in self.added.values():
                if bound <= (due, off) < new_bound and off not in busy:
                    heap.append((due, off))
            for off, due, _topic, _uniq in fixed:
                if (due, off) < bound and off not in busy and not any(o == off for _, o in heap):
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
                elif (self.added or self.removed or self._flush_failing) and (waited >= FLUSH_S or len(self.added) + len(self.removed) >= FLUSH_ROWS):
                    # a failed flush is retried every FLUSH_S even with no row to write: its meta write
                    # (a window load's, on a full disk) must succeed again before the broker says disk_ok
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
            got = await loop.run_in_executor(self._pool, db.by_msg_id, message_id)
            self._restore(got.bad)  # rebuilt from their records: into ``added``, taken from there just below
            # after the lookup's await: a row delivered meanwhile has left ``added`` (and is in ``removed``)
            rows = [r for r in self.added.values() if r[3] == message_id]
            rows += [r for r in got.rows if r[0] not in self.removed and r[0] not in self.added]
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

    async def listing(self, topic: str | None, after: tuple[int, int] | None, limit: int, bodies: bool = False) -> dict[str, Any]:
        """Scheduled messages by due time (a page from ``after``), counts per topic, and the totals; with ``bodies``
        each message's properties and body too (what a migration sends on)."""
        db = await self._when_ready()
        loop = asyncio.get_running_loop()
        async with self._lock:
            await self._flush_locked()
            got = await loop.run_in_executor(self._pool, db.listing, topic, after or (-1, -1), limit)
            summary = await loop.run_in_executor(self._pool, db.summary)
        self._restore(got.bad)  # listed from the next page on, once the next flush has written them again
        rows = got.rows
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
                if bodies:
                    out[-1]["properties"] = dict(p)
                    out[-1]["body"] = rec.body if rec is not None else None
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
            first = heap[0][0] if heap and self.ready.is_set() else None
        except IndexError:
            first = None
        # a damaged row no record could rebuild is a message not delivered: it counts from the due time it holds
        unrepaired = min(list(self.unrepaired.values()), default=None)
        if unrepaired is not None and (first is None or unrepaired < first):
            first = unrepaired
        lag = max(0, now - first) / 1000 if first is not None else 0.0
        return {"scheduled": max(0, self.count), "scheduled_lag_s": round(lag, 3),
                "scheduled_index": "ready" if self.ready.is_set() and self.error is None else ("failed" if self.error else "building"),
                **self.lateness.snapshot("scheduled_deliveries_timed", "scheduled_lateness")}

    def protect_from(self) -> int:
        """Retention keeps every segment from the lowest scheduled record on (0 until the index is built)."""
        if not self.ready.is_set() or self.error is not None:
            return 0
        lows = [o for o in (self.file_min, min(self.added, default=None)) if o is not None]
        return min(lows, default=self.store.max_offset)
