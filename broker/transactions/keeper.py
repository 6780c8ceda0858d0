"""The transaction index's lifecycle in a live broker: txindex.db loaded or rebuilt, flushed, closed.

At start the index is built while plain traffic is served; transactional
requests wait at the keeper's gate until then (or fail, if it failed), and
the check service starts after it. The changed rows are flushed every
second; at shutdown the file is left reflecting the whole log.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from txmq.store import RecoveryReport, Store
from txmq.store.damage import Damage
from txmq.store.files import fsync_dir
from txmq.wire import ErrorCode, TxmqError

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
INDEX_FLUSH_POLL_S = 0.1
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
INDEX_WRITER_NICE = 10


class IndexKeeper:
    """Builds the transaction index at start, flushes it while the broker runs, and closes it at shutdown."""

    def __init__(self, tx: TransactionService, check: CheckService, store: Store, flusher: Flusher, disk: DiskState, metrics: Metrics,
                 data_dir: Path, recovery: RecoveryReport | None, largest_message: int) -> None:
        self.tx = tx  # its index is replaced by the one built here
        self.check = check  # started once the index is ready
        self.store = store
        self.flusher = flusher
        self.disk = disk
        self.metrics = metrics
        self.data_dir = data_dir
        self.recovery = recovery  # the tail the store's recovery scanned: commits there may need repair
        self.largest_message = largest_message  # a record's largest size on the wire (body, properties, framing)
        self.ready: asyncio.Event = asyncio.Event()  # set once the index is built (or failed to be)
        self.error: TxmqError | None = None  # why it failed
        # Transactional requests queued behind ready and not yet run: while
        # any are, later ones queue too, so a connection's requests keep their
        # order across the moment the index becomes ready.
        self.queued: int = 0
        self._build_task: asyncio.Task | None = None
        self._flush_task: asyncio.Task | None = None
        self._writer: TxDatabase | None = None  # the index file's connection for flushes (worker thread)
        self._flush_lock = asyncio.Lock()
        # Index writes run in one thread of their own at a lower CPU priority
        # (Linux nice applies per thread): on a busy machine the event loop
        # and the log's fsyncs go first, the index catches up in between.
        self._pool = ThreadPoolExecutor(1, "txmq-index", initializer=_lower_priority)
        self._flush_failing: str | bool = False  # "disk" (full) or "error" while index flushes fail

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
            await self.ready.wait()
            if self.error is not None:
                raise self.error
            result = call()
        finally:
            self.queued -= 1
        return result if isinstance(result, dict) else await result

    # ---- start ---------------------------------------------------------------
    def start(self, t0: float) -> None:
        """Build the index in the background; ``t0`` (perf_counter) is when the broker's start began."""
        self._build_task = asyncio.get_running_loop().create_task(self._build(t0), name="txmq-txindex")

    async def _build(self, t0: float) -> None:
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
        checked = (0, 0)  # rows, decisions
        try:
            db, why = await loop.run_in_executor(None, self._open)
            index = TxIndex(db, store=store)
            self.tx.index = index
            starts = None
            if why is None:
                try:
                    await loop.run_in_executor(self._pool, index.load_pending, db.pending_rows())
                    index.discarded = await loop.run_in_executor(self._pool, db.count_discarded)
                    rows, decisions = await loop.run_in_executor(self._pool, self._check_file, db)
                    checked = (len(index.pending) + rows, decisions)
                    starts = db.meta["queues"]
                except (sqlite3.DatabaseError, IndexFileError) as exc:
                    if (isinstance(exc, sqlite3.DatabaseError) and not damaged_index(exc)) or getattr(exc, "io", False):
                        raise  # unreadable now (I/O, a full disk): not known to be damaged, kept
                    # Pages past the header are damaged (a meta that reads fine says nothing of them), a row's
                    # values no longer match its checksum, or a decision in the log is not in the rows: derived
                    # data only, rebuilt from the log.
                    await loop.run_in_executor(self._pool, db.close)
                    why = f"damaged ({exc})"
                    checked = (0, 0)
                    db = await loop.run_in_executor(None, self._new_file)
                    index = TxIndex(db, store=store)
                    self.tx.index = index
            if why is not None:
                # A new data directory has nothing to rebuild: not worth a warning.
                (log.warning if store.max_offset > 0 else log.info)("event=txindex_rebuild reason=%r", why)
            self._writer = db.writer()
            replayed = 0
            damaged: list[int] = []

            def on_damage(offset: int, why: str) -> None:
                # The index is built around a damaged record; the service stays up. Whether or not
                # recovery already reported the place, its commit may need repairing (below).
                store.damage.report(Damage(offset, "transaction index", why))
                if len(damaged) < MAX_COMMIT_REPAIRS:
                    damaged.append(offset)

            for replayed in replay_steps(store, index, starts, on_damage=on_damage):  # noqa: B007 (its last value is logged below)
                if len(index.dirty or ()) >= INDEX_FLUSH_ROWS:
                    # A long replay or a whole rebuild: memory stays bounded. The file records how far the
                    # replay got, not the log's end: a crash now resumes from there.
                    await self.flush(upto=index.replay_end)
                await asyncio.sleep(0)
            report = self.recovery
            if report is not None and report.scanned_from < store.max_offset:
                await self.tx.repair_commits(store.scan(report.scanned_from))
            # A commit writes its message and then its op record in one write: if the op record
            # is the damaged one, its message ends right before it, within the largest message a
            # client may send. Finding it keeps the transaction committed instead of re-checking it
            # into a second delivery.
            for offset in damaged:
                # from a stored record: never one forged in a body, and other damage in the window is walked past
                start = store.record_start_from(max(0, offset - self.largest_message))
                if start is not None and start < offset:
                    await self.tx.repair_commits(store.scan_range(start, offset))
            await self.flush()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Transactional requests get this error instead of waiting forever;
            # plain traffic goes on. The log is not touched: fix the cause, restart.
            if getattr(exc, "io", False) or isinstance(exc, OSError):  # e.g. a full disk: no traceback
                log.error("event=txindex_rebuild_failed error=%r msg=%s", exc, "'transactional operations are unavailable until a restart'")
            else:
                log.exception("event=txindex_rebuild_failed")
            self.error = TxmqError(f"the transaction index could not be rebuilt ({exc!r}); transactional operations are unavailable until a restart", ErrorCode.STORE_ERROR)
            self.ready.set()
            return
        # The pending transactions can be millions of long-lived objects:
        # take them out of the cyclic GC's reach so full collections don't stall the loop.
        gc.freeze()
        self.ready.set()
        self.check.start()
        self._flush_task = loop.create_task(self._flush_loop(), name="txmq-txindex-flush")
        log.info("event=broker_ready pending=%d index=%s records_read=%d took_s=%.3f rows_checked=%d decisions_checked=%d",
                 len(index.pending), "loaded" if starts is not None else "rebuilt", replayed, time.perf_counter() - t0, *checked)

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
    async def flush(self, upto: int | None = None) -> bool:
        """Write the index rows changed since the last flush, once the log is durable past them.

        The changes and the log position (``applied_to``) are taken together,
        between appends; the pending rows among them are made a slice at a
        time, the loop serving requests in between, so a row may be ahead of
        applied_to (a check copy written meanwhile). The file is written in
        a worker thread as one SQLite transaction once the log is durable
        past the last slice: it reflects every record before applied_to and
        none that is not on disk (a power cut can never leave it ahead of
        the log), and a start's replay from applied_to brings the rows that
        are ahead to the same state again. False if it failed (logged once
        per failing spell): the rows stay changed for the next flush.
        """
        async with self._flush_lock:
            store = self.store
            index = self.tx.index
            changed = index.capture()
            try:
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
                waiter = self.flusher.wait_synced(store.max_offset)  # past every record the rows reflect
                if waiter is not None:
                    await waiter
                rows = itertools.chain(pending, index.decided_rows(changed))
                await asyncio.get_running_loop().run_in_executor(self._pool, self._writer.flush, rows, meta, prune)
            except BaseException as exc:
                index.flush_failed(changed)
                if not isinstance(exc, Exception):
                    raise
                if self.disk.failed("index", exc):  # a full disk is logged once, broker-wide
                    self._flush_failing = self._flush_failing or "disk"
                elif self._flush_failing != "error":
                    log.error("event=txindex_flush_failed error=%r", exc)  # once per failing spell
                    self._flush_failing = "error"
                self.metrics.inc("index_flush_errors")
                return False
            if self._flush_failing == "error":
                log.info("event=txindex_flush_recovered")
            self._flush_failing = False
            self.disk.ok("index")
            # Decisions on disk leave memory, a slice at a time: 15,000 at once held the loop 3-5 ms.
            items = iter(changed.items())  # changed is this flush's own: nothing adds to it meanwhile
            while True:
                part = dict(itertools.islice(items, FLUSHED_SLICE))
                index.flushed(part)
                if len(part) < FLUSHED_SLICE:
                    break
                await asyncio.sleep(0)
            return True

    async def _flush_loop(self) -> None:
        """Flush the index every INDEX_FLUSH_S, sooner when many rows changed (a check pass)."""
        index = self.tx.index
        waited = 0.0
        while True:
            await asyncio.sleep(INDEX_FLUSH_POLL_S)
            waited += INDEX_FLUSH_POLL_S
            # a failed flush is retried with nothing dirty too: the broker says disk_ok only once it succeeds
            if (index.dirty or self._flush_failing) and (waited >= INDEX_FLUSH_S or len(index.dirty) >= INDEX_FLUSH_ROWS):
                waited = 0.0
                try:
                    await self.flush()
                except Exception:
                    log.exception("event=txindex_flush_failed")

    # ---- shutdown ----------------------------------------------------------------
    async def stop(self) -> None:
        """Stop building and flushing, stop the check service, then leave the file reflecting the whole log and close it."""
        for task in (self._build_task, self._flush_task):
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        await self.check.stop()
        await self._final_flush()

    async def _final_flush(self) -> None:
        """Leave the index file reflecting the whole log: the next start reads nothing after it."""
        writer = self._writer
        if writer is None:
            return
        try:
            if self.ready.is_set() and self.error is None:
                t0 = time.perf_counter()
                if not await self.flush():  # logged by flush: the next start replays more of the log, nothing else
                    return
                await asyncio.get_running_loop().run_in_executor(self._pool, writer.checkpoint)
                log.info("event=txindex_flushed applied_to=%d took_s=%.3f", writer.meta.get("applied_to", 0), time.perf_counter() - t0)
        except Exception:  # only a slower next start
            log.exception("event=txindex_flush_failed")
        finally:
            # In the index thread, after whatever still runs there: a flush or a load whose task was cancelled at
            # its await (a stop during the start) goes on in that thread, and closing its connection under it
            # crashes the process.
            await asyncio.get_running_loop().run_in_executor(self._pool, _close, writer, self.tx.index.db)


def _close(writer: TxDatabase, db: TxDatabase | None) -> None:
    writer.close()
    if db is not None:
        db.close()


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), INDEX_WRITER_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: normal priority
        pass
