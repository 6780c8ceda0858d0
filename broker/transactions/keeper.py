"""The transaction index's lifecycle in a live broker: txindex.db loaded or rebuilt, flushed, closed.

At start the index is built while plain traffic is served; transactional
requests wait at the keeper's gate until then (or fail, if it failed), and
the check service starts after it. The changed rows are flushed every
second; at shutdown the file is left reflecting the whole log. The life
itself (build, replay from ``applied_to``, flushes after the log's fsync
and their retries, the last flush and close) is broker/indexlife.py's,
shared with the schedule's index; this is the transaction index's part.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from txmq.store import RecoveryReport, Store
from txmq.store.damage import Damage
from txmq.store.files import fsync_dir

from ..indexlife import FlushJob, IndexLife, Steps
from .index import TxIndex, agrees, log_position, replay_steps
from .indexcheck import check_decisions
from .indexfile import DB_FILE, IndexFileError, TxDatabase, damaged_index, remove_db

if TYPE_CHECKING:
    from ..flush import DiskState, Flusher
    from ..metrics import Metrics
    from .check import CheckService
    from .service import TransactionService

log = logging.getLogger("txmq.broker")

# The index file is flushed every INDEX_FLUSH_S, or as soon as INDEX_FLUSH_ROWS
# rows changed: what a start after a crash reads beyond it, and the decisions
# memory holds meanwhile (~300 bytes each), stay bounded by these.
INDEX_FLUSH_S = 1.0
INDEX_FLUSH_ROWS = 100_000
FLUSHED_SLICE = 2048  # decisions dropped from memory between two turns of the loop after a flush
# Changed pending rows turned into tuples between two turns of the loop: a check pass over a million pending
# changes them all, and 100,000 at once held the loop ~50 ms.
CAPTURE_SLICE = 4096
MAX_COMMIT_REPAIRS = 1000  # damaged transactional records whose committed message is looked for at start
# What a start checks of the index file besides the pending rows, in a fixed amount (its time does not grow
# with the history): the checksums of the newest rows and of a random sample of the others, and the log's
# last decisions (op records) against their rows: those a producer's resend is likely to meet, lost rows
# included. Every other row's checksum is checked when a lookup reads it.
START_CHECK_NEWEST = 4096
START_CHECK_SAMPLED = 4096
START_CHECK_DECISIONS = 4096


class IndexKeeper(IndexLife):
    """Builds the transaction index at start, flushes it while the broker runs, and closes it at shutdown."""

    name = "txindex"
    disk_name = "index"
    errors_metric = "index_flush_errors"
    failure = "the transaction index could not be rebuilt"
    effect = "transactional operations are unavailable until a restart"
    build_task = "txmq-txindex"
    flush_task = "txmq-txindex-flush"

    def __init__(self, tx: TransactionService, check: CheckService, store: Store, flusher: Flusher, disk: DiskState, metrics: Metrics,
                 data_dir: Path, recovery: RecoveryReport | None, largest_message: int) -> None:
        super().__init__(store, flusher, disk, metrics, log, thread="txmq-index", nice=True)
        self.tx = tx  # its index is replaced by the one built here
        self.check = check  # started once the index is ready
        self.data_dir = data_dir
        self.recovery = recovery  # the tail the store's recovery scanned: commits there may need repair
        self.largest_message = largest_message  # a record's largest size on the wire (body, properties, framing)
        # Transactional requests queued behind ready and not yet run: while
        # any are, later ones queue too, so a connection's requests keep their
        # order across the moment the index becomes ready.
        self.queued: int = 0
        self._writer: TxDatabase | None = None  # the index file's connection for flushes (worker thread)
        self._starts: dict[str, int] | None = None  # the queues' offsets the replay started from (None: rebuilt)
        self._checked = (0, 0)  # rows, decisions checked at start
        self._damaged: list[int] = []  # damaged transactional records met by the replay (their commits may need repair)

    # ---- the gate transactional requests pass -------------------------------
    def must_wait(self) -> bool:
        """Whether a transactional request must wait (``when_ready``); raises ``error`` once the build failed."""
        if self.error is not None:
            raise self.error
        return not self.ready.is_set() or self.queued > 0

    def when_ready(self, call: Callable[[], Any]) -> Awaitable[Any]:
        """Run a transactional operation once the index is built (only right after a start).

        Counted in ``queued`` from now until it runs: callers send later
        requests here too while the count is non-zero, so requests that arrive
        just after the index became ready do not overtake the ones still waking
        up (the waiters resume in arrival order, one loop iteration later).
        """
        self.queued += 1
        return self._run_when_ready(call)

    async def _run_when_ready(self, call: Callable[[], Any]) -> Any:
        try:
            await self.wait_ready()
            result = call()
        finally:
            self.queued -= 1
        return result if isinstance(result, dict) else await result

    # ---- start ---------------------------------------------------------------
    async def _load(self) -> Steps:
        """Load the transaction index while plain traffic is served.

        The pending rows come from the index file and only the op, discard
        and half records written after its last flush are read; with no
        usable file (missing, damaged, another version, not this log's),
        every transactional record is read and the file is written anew as
        it goes. The file is checked as it is loaded, in a fixed amount of
        work (``_check_file``); a damaged row, or a decision of the log the
        rows do not hold, makes it unusable as well. Transactional
        operations wait for this (``ready``); the check service starts
        after it. Batches alternate with other work, so sends and pulls are
        answered from the first moment.
        """
        store = self.store
        loop = asyncio.get_running_loop()
        db, why = await loop.run_in_executor(None, self._open)
        index = TxIndex(db, store=store)
        self.tx.index = index
        if why is None:
            try:
                await self.run(index.load_pending, db.pending_rows())
                index.discarded = await self.run(db.count_discarded)
                rows, decisions = await self.run(self._check_file, db)
                self._checked = (len(index.pending) + rows, decisions)
                self._starts = db.meta["queues"]
            except (sqlite3.DatabaseError, IndexFileError) as exc:
                if (isinstance(exc, sqlite3.DatabaseError) and not damaged_index(exc)) or getattr(exc, "io", False):
                    raise  # unreadable now (I/O, a full disk): not known to be damaged, kept
                # Pages past the header are damaged (a meta that reads fine says nothing of them), a row's
                # values no longer match its checksum, or a decision in the log is not in the rows: derived
                # data only, rebuilt from the log.
                await self.run(db.close)
                why = f"damaged ({exc})"
                self._checked = (0, 0)
                db = await loop.run_in_executor(None, self._new_file)
                index = TxIndex(db, store=store)
                self.tx.index = index
        if why is not None:
            # A new data directory has nothing to rebuild: not worth a warning.
            (log.warning if store.max_offset > 0 else log.info)("event=txindex_rebuild reason=%r", why)
        self._writer = db.writer()
        damaged = self._damaged

        def on_damage(offset: int, why: str) -> None:
            # The index is built around a damaged record; the service stays up. Whether or not
            # recovery already reported the place, its commit may need repairing (_after_replay).
            store.damage.report(Damage(offset, "transaction index", why))
            if len(damaged) < MAX_COMMIT_REPAIRS:
                damaged.append(offset)

        return ((n, index.replay_end) for n in replay_steps(store, index, self._starts, on_damage=on_damage))

    async def _after_replay(self) -> None:
        store = self.store
        report = self.recovery
        if report is not None and report.scanned_from < store.max_offset:
            await self.tx.repair_commits(store.scan(report.scanned_from))
        # A commit writes its message and then its op record in one write: if the op record
        # is the damaged one, its message ends right before it, within the largest message a
        # client may send. Finding it keeps the transaction committed instead of re-checking it
        # into a second delivery.
        for offset in self._damaged:
            # from a stored record: never one forged in a body, and other damage in the window is walked past
            start = store.record_start_from(max(0, offset - self.largest_message))
            if start is not None and start < offset:
                await self.tx.repair_commits(store.scan_range(start, offset))

    async def _on_ready(self, t0: float, replayed: int) -> None:
        index = self.tx.index
        # The pending transactions can be millions of long-lived objects:
        # take them out of the cyclic GC's reach so full collections don't stall the loop.
        gc.freeze()
        self.ready.set()
        self.check.start()
        log.info("event=broker_ready pending=%d index=%s records_read=%d took_s=%.3f rows_checked=%d decisions_checked=%d",
                 len(index.pending), "loaded" if self._starts is not None else "rebuilt", replayed, time.perf_counter() - t0,
                 *self._checked)

    def _check_file(self, db: TxDatabase) -> tuple[int, int]:
        """What a start checks of a loaded index file besides its pending rows: (rows, decisions) checked.

        The checksums of the newest rows and of a sample, and the log's last
        decisions against their rows (docs/store-format.md, "Checksums"). In
        the index thread, before any transactional request (nothing else
        uses db). IndexFileError when a row is damaged or disagrees.
        """
        rows = db.check_rows(START_CHECK_NEWEST, START_CHECK_SAMPLED)
        meta, counts = db.meta, {"decisions": 0}
        for _at, tx_id, why in check_decisions(db, self.store, meta["applied_to"], meta.get("log_min", 0), counts,
                                               first=meta["queues"]["op"] - START_CHECK_DECISIONS, damaged_rows=True):
            raise IndexFileError(f"transaction {tx_id}: {why}")
        return rows, counts["decisions"]

    def _open(self) -> tuple[TxDatabase, str | None]:
        """The index file and None if it fits the log, else a new empty one and why the old one was dropped."""
        why = "no index file"
        try:
            if not (self.data_dir / DB_FILE).exists():
                raise IndexFileError(why)  # opening would create an empty one, which fits no log but an empty one
            db = TxDatabase(self.data_dir / DB_FILE)
            why = agrees(self.store, db.meta)
            if why is None:
                return db, None
            db.close()
        except IndexFileError as exc:
            if exc.io:  # not damaged, unreadable now (a full disk): kept for the next start
                raise
            why = str(exc)
        return self._new_file(), why

    def _new_file(self) -> TxDatabase:
        """A new, empty index file in place of the old one (derived data only: the log has everything it held)."""
        data_dir = self.data_dir
        remove_db(data_dir)
        for stale in data_dir.glob("txindex.snap*"):  # the snapshot files of older versions
            stale.unlink(missing_ok=True)
        fsync_dir(data_dir)
        return TxDatabase(data_dir / DB_FILE)

    # ---- flushes ---------------------------------------------------------------
    # flush(upto): write the index rows changed since the last flush, once the log is durable past them
    # (IndexLife.flush). The changes and the log position (``applied_to``) are taken together, between
    # appends; the pending rows among them are made a slice at a time, the loop serving requests in
    # between, so a row may be ahead of applied_to (a check copy written meanwhile). The file is written
    # in the index thread as one SQLite transaction once the log is durable past the last slice: it
    # reflects every record before applied_to and none that is not on disk (a power cut can never leave
    # it ahead of the log), and a start's replay from applied_to brings the rows that are ahead to the
    # same state again. A failed flush leaves the rows changed for the next one.
    def _dirty(self) -> int:
        return len(self.tx.index.dirty or ())

    def _flush_every(self) -> tuple[float, int]:
        return INDEX_FLUSH_S, INDEX_FLUSH_ROWS

    def _capture(self) -> dict:
        return self.tx.index.capture()

    async def _prepare(self, changed: dict, upto: int | None) -> FlushJob:
        store = self.store
        index = self.tx.index
        meta = log_position(store, upto)  # no await since the capture: every change before this is in changed
        if index.damaged:  # a lookup met a damaged row: the next start rebuilds the file (agrees)
            meta["damaged"] = index.damaged
        store_min = store.min_offset
        prune = store_min if store_min > self._writer.meta.get("log_min", 0) else None
        if prune is not None:
            meta["log_min"] = prune
        pending: list[tuple] = []
        items = iter(changed.items())  # changed is this flush's own: nothing adds to it meanwhile
        while True:
            part = list(itertools.islice(items, CAPTURE_SLICE))
            pending += index.pending_rows(part)
            if len(part) < CAPTURE_SLICE:
                break
            await asyncio.sleep(0)
        return self._writer.flush, (itertools.chain(pending, index.decided_rows(changed)), meta, prune)

    def _keep(self, changed: dict) -> None:
        self.tx.index.flush_failed(changed)

    async def _flushed(self, changed: dict, _result: Any) -> None:
        # Decisions on disk leave memory, a slice at a time: 15,000 at once held the loop 3-5 ms.
        index = self.tx.index
        items = iter(changed.items())  # changed is this flush's own: nothing adds to it meanwhile
        while True:
            part = dict(itertools.islice(items, FLUSHED_SLICE))
            index.flushed(part)
            if len(part) < FLUSHED_SLICE:
                break
            await asyncio.sleep(0)

    # ---- shutdown ----------------------------------------------------------------
    # stop(): stop building and flushing, stop the check service, then leave the file reflecting the whole
    # log and close it (IndexLife.stop).
    async def _before_final_flush(self) -> None:
        await self.check.stop()

    def _checkpointed(self) -> TxDatabase | None:
        return self._writer

    def _close_files(self) -> None:
        self._writer.close()
        db = self.tx.index.db
        if db is not None:
            db.close()
