"""The schedule's index in a live broker: timers.db built at start, the rows in memory, the window, flushes, close.

Like broker/transactions/keeper.py for the transaction index, on the life
both share (broker/indexlife.py: build, replay from ``applied_to``, flushes
after the log's fsync and their retries, the last flush and close). This is
the schedule's part of it (docs/scheduled.md):

- The rows: ``timers.db`` (indexfile.py) holds the rows not yet delivered
  or cancelled; memory holds the rows written since the last flush
  (``added``), the rows delivered or cancelled since (``removed``), and the
  *window*: every row whose (due_ms, cl_offset) is below ``bound``, in a
  heap, at most ``WINDOW_ROWS`` loaded at once and due within
  ``WINDOW_S``. Memory does not grow with what is scheduled further ahead.
- The build: the file is checked against the log (its meta, its rows'
  checksums, the log's last stretch below ``applied_to``: ``_check_start``)
  or rebuilt from the log's first scheduled record; then the log is
  replayed from ``applied_to``: a scheduled record adds its row, a cancel
  record or a delivered copy (``TXMQ_SCHEDULED_FROM``) removes it.
- Crash consistency: the file is written only once the log is fsynced past
  what it reflects (``applied_to``); a delivered copy lost with a torn tail
  is delivered again, one that survived is never delivered twice.
- Damaged rows: rebuilt from the scheduled records they name, at start,
  when a read meets them, and by the walk after a start that read only part
  of the rows.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from txmq.constants import PROP_REAL_TOPIC, PROP_SCHEDULE_CANCEL, PROP_SCHEDULED_FROM, PROP_TIMER_OUT_MS, PROP_UNIQ_KEY, SCHEDULE_TOPIC
from txmq.store import Record, Store
from txmq.store.codec import H_CRC, H_OFFSET
from txmq.store.consumequeue import first_entry_from
from txmq.store.damage import Damage
from txmq.store.files import fsync_dir

from ..indexlife import FlushJob, IndexLife, Steps, replay_in_steps
from .indexcheck import agrees
from .indexfile import DB_FILE, Checked, Row, TimerDatabase, TimerFileError, damaged, io_error, meta_problem, remove_db

if TYPE_CHECKING:
    from ..clock import Clock
    from ..flush import DiskState, Flusher
    from ..metrics import Metrics

log = logging.getLogger("txmq.scheduled")

WINDOW_S = 60.0  # rows due within this are held in memory
WINDOW_ROWS = 100_000  # at most this many loaded from the file at once (a burst due together is loaded in parts)
FLUSH_S = 1.0  # the file is written every FLUSH_S, or as soon as FLUSH_ROWS rows changed
FLUSH_ROWS = 100_000
READ_STEP = 16  # records read at once (a delivery, a listing): at most this many large ones held before the bound is seen
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


class _Found(NamedTuple):
    """What ``_open``'s checks found in a file it kept: its table's rows, rows whose checksum was read, damaged rows."""

    rows: int
    read: int
    bad: list[tuple]
    walk: bool  # rows were left unread: the walk after the start reads them


def row_of(rec: Record) -> Row | None:
    """The row a scheduled record gives (None: it lacks its due time or topic)."""
    p = rec.properties
    try:
        return (rec.commit_log_offset, int(p[PROP_TIMER_OUT_MS]), p[PROP_REAL_TOPIC], p.get(PROP_UNIQ_KEY) or "")
    except (KeyError, ValueError):
        return None


def read_records(store: Store, offs: list[int]) -> list[Record | None]:
    """The scheduled records at offs; None (reported as damage) for one that cannot be read."""
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


class TimerKeeper(IndexLife):
    """The schedule's index: timers.db built at start, the rows changed since its last flush, the window, flushes, close."""

    name = "timers"
    disk_name = "timers"
    errors_metric = "timers_flush_errors"
    failure = "the schedule's index could not be built"
    effect = "scheduled messages are stored but not delivered until a restart"
    build_task = "txmq-timers-build"
    flush_task = "txmq-timers-flush"
    loop_retry_s = 1.0  # after a failed window load (a full disk, say), the wait before the next attempt

    def __init__(self, store: Store, flusher: Flusher, disk: DiskState, metrics: Metrics, clock: Clock, data_dir: Path) -> None:
        super().__init__(store, flusher, disk, metrics, log, thread="txmq-timers")
        self.clock = clock
        self.data_dir = data_dir
        self.db: TimerDatabase | None = None  # used in the index thread only (``run``), one use at a time
        # ``lock``: a flush, a window load, a cancel's lookup and write: one at a time
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
        self.wake = asyncio.Event()  # the delivery task looks at the window
        self.refill = asyncio.Event()  # the flush task loads more of the window
        self.on_ready: Callable[[], None] = lambda: None  # what starts once the index is ready (the delivery task)
        self._found: _Found | None = None  # what the start's checks found in a kept file
        self._checked: dict[str, int] = {"rows_checked": 0, "records_checked": 0}

    # ---- the index in memory ---------------------------------------------------------
    def add(self, off: int, due: int, topic: str, uniq: str) -> None:
        self.added[off] = (off, due, topic, uniq)
        self.count += 1
        self.back((due, off))

    def back(self, entry: tuple[int, int]) -> None:
        """Put a row in the window if it belongs there (below ``bound``); one at or above it is loaded in its turn."""
        if entry < self.bound:
            heap = self.heap
            heapq.heappush(heap, entry)
            if heap[0] == entry:
                self.wake.set()
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

    def remove(self, off: int, in_window: bool) -> None:
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
                    self.add(rec.commit_log_offset, int(p[PROP_TIMER_OUT_MS]), p[PROP_REAL_TOPIC], p.get(PROP_UNIQ_KEY) or "")
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
        self.remove(off, False)  # the replay runs before the window is loaded

    # ---- the build (IndexLife._build) ---------------------------------------------------
    async def _load(self) -> Steps:
        """Open timers.db and check it against the log (or a new one, rebuilt); the replay from where the file ends."""
        store = self.store
        db, start, why, found = await self.run(self._open)
        self.db, self._found = db, found
        if why is None:
            why = await self._check_start(db, start, found, self._checked)
            if why is not None:  # the file cannot be made to agree with the log: a new one, rebuilt from it
                await self.run(db.close)
                db = self.db = await self.run(self._new_file)
                # Sends made meanwhile are in the log below ``end`` (taken right below, with no await in
                # between) and the replay adds them again: the state starts empty.
                self.added, self.removed, self.rewritten, self.count, self.file_min = {}, set(), set(), 0, None
                start = self._first_scheduled()
        if why is not None:
            (log.warning if start < store.max_offset else log.info)("event=timers_rebuild reason=%r from=%d", why, start)
        return replay_in_steps(store.scan(start, store.max_offset), self._replay, REPLAY_STEP)

    async def _on_ready(self, t0: float, replayed: int) -> None:
        self.ready.set()
        await self.load_window()
        checked = self._checked
        log.info("event=timers_ready scheduled=%d window=%d records_read=%d rows_checked=%d records_checked=%d took_s=%.3f",
                 self.count, len(self.heap), replayed, checked["rows_checked"], checked["records_checked"], time.perf_counter() - t0)
        self.on_ready()
        if self._found is not None and self._found.walk:
            self._tasks.append(asyncio.get_running_loop().create_task(self._walk_rows(), name="txmq-timers-walk"))

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
                    row = row_of(rec)
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
        have = await self.run(db.present, want + list(marks))
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
                    row = row_of(rec)
            if row is not None and row[3] == stored[3] and (row[1] == stored[1] or row[2] == stored[2]):
                fixed.append(row)
            else:
                lost.append(stored)
        for n, row in enumerate(fixed):
            if n < LISTED_ROWS:
                log.warning("event=timer_row_repaired cl_offset=%d msg_id=%r due_ms=%d topic=%r msg=%s", row[0], row[3], row[1], row[2],
                            "'a row of timers.db whose checksum did not match is rebuilt from its scheduled record in the log'")
        return fixed, lost

    def restore(self, bad: list[tuple], push: bool = True) -> list[Row]:
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
                self.back(entry)
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
        after = -1
        try:
            while True:
                async with self.lock:
                    got: Checked = await self.run(self.db.rows_after, after, WALK_ROWS)
                    self.restore(got.bad)
                if got.last is None:
                    return
                after = got.last[0]
                await asyncio.sleep(WALK_PAUSE_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a read failing (a full disk, a damaged page): the rows are read as they come due
            log.warning("event=timers_walk_failed error=%r", exc)

    # ---- the file --------------------------------------------------------------------

    # ---- flushes (IndexLife.flush) ---------------------------------------------------------
    # Write the rows added and removed since the last flush, once the log is durable past them.
    def _dirty(self) -> int:
        return len(self.added) + len(self.removed)

    def _flush_every(self) -> tuple[float, int]:
        return FLUSH_S, FLUSH_ROWS

    def _capture(self) -> tuple[dict[int, Row], set[int], set[int]] | None:
        if self.db is None:
            return None
        added, removed = self.added, self.removed
        self.added, self.removed = {}, set()
        return added, removed, self.rewritten & added.keys()

    async def _prepare(self, changes: tuple[dict[int, Row], set[int], set[int]], upto: int | None) -> FlushJob:
        db = self.db
        added, removed, _rewritten = changes
        meta: dict[str, Any] = {"applied_to": self.store.max_offset if upto is None else upto}
        meta["boundary"] = self._boundary() if upto is None else None
        if db.bad_rows:
            meta["damaged"] = db.bad_rows
        return db.flush, (added.values(), removed, meta)

    def _keep(self, changes: tuple[dict[int, Row], set[int], set[int]]) -> None:
        # the changes stay for the next flush (a row added then removed meanwhile cancels out, unless the
        # file holds a damaged row of it: that one is deleted)
        added, removed, rewritten = changes
        for off, row in added.items():
            if off in self.removed:
                if off not in rewritten:
                    self.removed.discard(off)
            else:
                self.added[off] = row
        self.removed |= removed

    async def _flushed(self, changes: tuple[dict[int, Row], set[int], set[int]], result: tuple[int, int | None]) -> None:
        n, lo = result
        self.rewritten -= changes[2]  # written again: the file holds them as they are
        # what the file holds, plus what was written since the flush's capture (rows rebuilt over damaged ones are in it)
        self.count = n + len(self.added) - len(self.removed) - len(self.rewritten)
        self.file_min = lo

    async def _wait_turn(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.refill.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def _between_flushes(self) -> bool:
        if self.refill.is_set() or self.window_low():
            self.refill.clear()
            await self.load_window()
            return True
        return False

    # ---- the window --------------------------------------------------------------------------
    async def load_window(self) -> None:
        """Load the rows due within WINDOW_S past ``bound`` into the heap (after a flush: the file holds every older change)."""
        async with self.lock:
            await self.flush_locked()
            now = int(self.clock() * 1000)
            horizon = now + int(WINDOW_S * 1000)
            limit = max(1, WINDOW_ROWS - len(self.heap))
            bound = self.bound
            got = await self.run(self.db.due_rows, bound, horizon, limit)
            if self.bound != bound:  # sends meanwhile filled the window and lowered its bound (_shrink): it is full
                return
            rows, last = got.rows, got.last
            read = len(rows) + len(got.bad)
            new_bound = (horizon, 0) if read < limit or last is None else (last[1], last[0] + 1)
            if new_bound < bound:
                new_bound = bound
            # damaged rows rebuilt from their records: into ``added`` (the next flush writes them again), and into
            # the window below through it, or at once if they are due before the part loaded now
            fixed = self.restore(got.bad, push=False)
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
            self.wake.set()


    def window_low(self) -> bool:
        """The window should take more rows: it reaches less than half its span ahead, and holds less than half its rows."""
        now = int(self.clock() * 1000)
        return self.bound[0] < now + int(WINDOW_S * 500) and len(self.heap) < WINDOW_ROWS // 2

    # ---- delivery --------------------------------------------------------------------

    # ---- shutdown (IndexLife.stop) ------------------------------------------------------------
    async def _before_final_flush(self) -> None:
        for _ in range(3):  # deliveries submitted by the cancelled task are written (their index updates) first
            await asyncio.sleep(0)

    def _checkpointed(self) -> TimerDatabase | None:
        return self.db

    def _close_files(self) -> None:
        self.db.close()

    # ---- retention ----------------------------------------------------------------------------
    def protect_from(self) -> int:
        """Retention keeps every segment from the lowest scheduled record on (0 until the index is built)."""
        if not self.ready.is_set() or self.error is not None:
            return 0
        lows = [o for o in (self.file_min, min(self.added, default=None)) if o is not None]
        return min(lows, default=self.store.max_offset)
