"""Broker lifecycle: open the store, rebuild the transaction index, serve through the front ends, shut down.

``Broker.serve(sock, shutdown)`` takes an already-bound socket for the
native protocol (broker/native/) and an awaitable shutdown signal, so tests
bind 127.0.0.1:0 and never race for a port. Shutdown order (the reverse of
start): the front ends stop accepting and let in-flight requests finish
(bounded by shutdown_timeout_s), stop the check service, flush and close
the store, the front ends close their connections.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import socket
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Protocol

from txmq.store.damage import Damage
from txmq.store.files import fsync_dir
from txmq.wire import ErrorCode, TxmqError

from .clock import Clock
from .config import FRAME_OVERHEAD, BrokerConfig, read_settings_file
from .core import BrokerCore, speedups_in_use
from .native.server import NativeFrontend
from .transactions.indexcheck import check_decisions
from .transactions.indexfile import DB_FILE, IndexFileError, TxDatabase, damaged_index, remove_db
from .transactions.index import TxIndex, agrees, log_position, replay_steps

log = logging.getLogger("txmq.broker")

JANITOR_INTERVAL_S = 60.0
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


# Descriptors the default connection limits leave to the broker's own files, whatever clients do: at most
# half of RLIMIT_NOFILE. At start, with both ports and the metrics endpoint, the broker holds ~35 (Python,
# uvloop, gRPC's pollers and eventfds, the LOCK file, one commit-log segment, txindex.db with its WAL and
# shm); then one more per commit-log segment, per consume-queue file read, per file being replaced at that
# moment (the checkpoint, offsets.json, topics.json, txcheck.json, config.json: a temporary file, then the
# directory), per Prometheus scrape, and one for each connection past a limit while it is being closed.
FD_RESERVE = 512
FD_LIMIT_WANTED = 65536  # the soft RLIMIT_NOFILE `txmq broker start` raises itself to (within the hard limit)


def fd_soft_limit() -> int:
    """The soft RLIMIT_NOFILE (an unlimited one counts as 2**24)."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft > 1 << 24:
        soft = 1 << 24
    return soft


def fd_budget(fd_limit: int) -> int:
    """The descriptors both ports' connections may take together by default: fd_limit minus FD_RESERVE (at most half)."""
    return max(1, fd_limit - min(FD_RESERVE, fd_limit // 2))


def connection_limits(fd_limit: int, rocketmq: bool, max_connections: int | None = None,
                      rocketmq_max_connections: int | None = None) -> tuple[int, int | None]:
    """(native cap, RocketMQ front end's cap or None): the caps given, else shares of fd_budget(fd_limit).

    The native port alone gets the whole budget; with the RocketMQ front end
    each port gets half, and a cap that is given leaves the rest to the
    other port (at least 1). Connections past a cap are closed as soon as
    accepted, so with the default caps a flood on either port is refused
    before the other port, the store, the index, the checkpoints or the
    check service run out of descriptors.
    """
    budget = fd_budget(fd_limit)
    if not rocketmq:
        return (budget if max_connections is None else max_connections), None
    if max_connections is None and rocketmq_max_connections is None:
        rocketmq_max_connections = max(1, budget // 2)
    if max_connections is None:
        max_connections = max(1, budget - rocketmq_max_connections)
    if rocketmq_max_connections is None:
        rocketmq_max_connections = max(1, budget - max_connections)
    return max_connections, rocketmq_max_connections


def raise_fd_limit(wanted: int = FD_LIMIT_WANTED) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE towards wanted, within the hard limit (as the JVM does); returns (before, after)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return soft, target
        except (ValueError, OSError):
            pass
    return soft, soft


class Frontend(Protocol):
    """A protocol's front end (broker/native/, broker/rocketmq/): it translates requests into the services' calls."""

    async def start(self) -> None: ...  # the broker serves: requests go through
    async def stop(self) -> None: ...  # first at shutdown: no new requests, those in flight finish; once
    async def close(self) -> None: ...  # last, once the core stopped: what is still open is closed



def _close_index(writer: TxDatabase, db: TxDatabase | None) -> None:
    writer.close()
    if db is not None:
        db.close()

class Broker:
    def __init__(self, config: BrokerConfig, clock: Clock | None = None) -> None:
        config = config.validated()
        self.fd_limit = fd_soft_limit()
        rocketmq = config.rocketmq_port is not None
        native, rmq = connection_limits(self.fd_limit, rocketmq, config.max_connections, config.rocketmq_max_connections)
        config = replace(config, max_connections=native, rocketmq_max_connections=rmq)
        if native + (rmq or 0) > fd_budget(self.fd_limit):
            log.warning("event=fd_budget_exceeded max_connections=%d rocketmq_max_connections=%d fd_limit=%d fd_reserve=%d msg=%s",
                        native, rmq or 0, self.fd_limit, self.fd_limit - fd_budget(self.fd_limit),
                        "'connections may take the descriptors the store needs: its writes then fail with EMFILE'")
        self.config = config
        self.core = BrokerCore(config, clock)
        self.native: NativeFrontend | None = None  # built by serve() with its socket
        self.ready = asyncio.Event()
        self._janitor: asyncio.Task | None = None
        self._indexer: asyncio.Task | None = None
        self._index_flusher: asyncio.Task | None = None
        self._writer: TxDatabase | None = None  # the index file's connection for flushes (worker thread)
        self._flush_lock = asyncio.Lock()
        # Index writes run in one thread of their own at a lower CPU priority
        # (Linux nice applies per thread): on a busy machine the event loop
        # and the log's fsyncs go first, the index catches up in between.
        self._index_pool = ThreadPoolExecutor(1, "txmq-index", initializer=_lower_priority)
        self._flush_failing: str | bool = False  # "disk" (full) or "error" while index flushes fail
        self.frontends: list[Frontend] = []  # RocketMQ's gRPC service when attached (main, testing), then the native one (serve)

    async def start(self) -> None:
        core = self.core
        t0 = time.perf_counter()
        # Read before the store is opened: a damaged config.json refuses the start with nothing locked.
        stored = read_settings_file(core.data_dir / "config.json", self.config.check_overrides)
        core.open(stored)  # the store, then every collaborator: topics, offsets, flusher, appender, tx, check, admin
        await core.start()
        loop = asyncio.get_running_loop()
        self._indexer = loop.create_task(self._build_index(t0), name="txmq-txindex")
        self._janitor = loop.create_task(self._janitor_loop(), name="txmq-janitor")
        log.info("event=store_ready took_s=%.3f", time.perf_counter() - t0)

    async def _build_index(self, t0: float) -> None:
        """Load the transaction index while plain traffic is served.

        The pending rows come from the index file and only the op, discard
        and half records written after its last flush are read; with no
        usable file (missing, damaged, another version, not this log's),
        every transactional record is read and the file is written anew as
        it goes. The file is checked as it is loaded, in a fixed amount of
        work (``_check_index``); a damaged row, or a decision of the log the
        rows do not hold, makes it unusable as well. Transactional
        operations wait for this (core.tx_ready); the check service starts
        after it. Batches alternate with other work, so sends and pulls are
        answered from the first moment.
        """
        core = self.core
        loop = asyncio.get_running_loop()
        checked = (0, 0)  # rows, decisions
        try:
            db, why = await loop.run_in_executor(None, self._open_index)
            index = TxIndex(db, store=core.store)
            core.tx.index = index
            starts = None
            if why is None:
                try:
                    await loop.run_in_executor(self._index_pool, index.load_pending, db.pending_rows())
                    index.discarded = await loop.run_in_executor(self._index_pool, db.count_discarded)
                    rows, decisions = await loop.run_in_executor(self._index_pool, self._check_index, db)
                    checked = (len(index.pending) + rows, decisions)
                    starts = db.meta["queues"]
                except (sqlite3.DatabaseError, IndexFileError) as exc:
                    if (isinstance(exc, sqlite3.DatabaseError) and not damaged_index(exc)) or getattr(exc, "io", False):
                        raise  # unreadable now (I/O, a full disk): not known to be damaged, kept
                    # Pages past the header are damaged (a meta that reads fine says nothing of them), a row's
                    # values no longer match its checksum, or a decision in the log is not in the rows: derived
                    # data only, rebuilt from the log.
                    await loop.run_in_executor(self._index_pool, db.close)
                    why = f"damaged ({exc})"
                    checked = (0, 0)
                    db = await loop.run_in_executor(None, self._new_index)
                    index = TxIndex(db, store=core.store)
                    core.tx.index = index
            if why is not None:
                # A new data directory has nothing to rebuild: not worth a warning.
                (log.warning if core.store.max_offset > 0 else log.info)("event=txindex_rebuild reason=%r", why)
            self._writer = db.writer()
            replayed = 0
            damaged: list[int] = []

            def on_damage(offset: int, why: str) -> None:
                # The index is built around a damaged record; the service stays up. Whether or not
                # recovery already reported the place, its commit may need repairing (below).
                core.store.damage.report(Damage(offset, "transaction index", why))
                if len(damaged) < MAX_COMMIT_REPAIRS:
                    damaged.append(offset)

            for replayed in replay_steps(core.store, index, starts, on_damage=on_damage):  # noqa: B007 (its last value is logged below)
                if len(index.dirty or ()) >= INDEX_FLUSH_ROWS:
                    # A long replay or a whole rebuild: memory stays bounded. The file records how far the
                    # replay got, not the log's end: a crash now resumes from there.
                    await self._flush_index(upto=index.replay_end)
                await asyncio.sleep(0)
            report = core.recovery
            if report is not None and report.scanned_from < core.store.max_offset:
                await core.tx.repair_commits(core.store.scan(report.scanned_from))
            # A commit writes its message and then its op record in one write: if the op record
            # is the damaged one, its message ends right before it, within the largest message a
            # client may send. Finding it keeps the transaction committed instead of re-checking it
            # into a second delivery.
            window = core.config.max_body + core.config.max_properties + FRAME_OVERHEAD
            for offset in damaged:
                # from a stored record: never one forged in a body, and other damage in the window is walked past
                start = core.store.record_start_from(max(0, offset - window))
                if start is not None and start < offset:
                    await core.tx.repair_commits(core.store.scan_range(start, offset))
            await self._flush_index()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Transactional requests get this error instead of waiting forever;
            # plain traffic goes on. The log is not touched: fix the cause, restart.
            if getattr(exc, "io", False) or isinstance(exc, OSError):  # e.g. a full disk: no traceback
                log.error("event=txindex_rebuild_failed error=%r msg=%s", exc, "'transactional operations are unavailable until a restart'")
            else:
                log.exception("event=txindex_rebuild_failed")
            core.tx_error = TxmqError(f"the transaction index could not be rebuilt ({exc!r}); transactional operations are unavailable until a restart", ErrorCode.STORE_ERROR)
            core.tx_ready.set()
            return
        # The pending transactions can be millions of long-lived objects:
        # take them out of the cyclic GC's reach so full collections don't stall the loop.
        gc.freeze()
        core.tx_ready.set()
        core.check.start()
        self._index_flusher = loop.create_task(self._index_flush_loop(), name="txmq-txindex-flush")
        log.info("event=broker_ready pending=%d index=%s records_read=%d took_s=%.3f rows_checked=%d decisions_checked=%d",
                 len(index.pending), "loaded" if starts is not None else "rebuilt", replayed, time.perf_counter() - t0, *checked)

    def _check_index(self, db: TxDatabase) -> tuple[int, int]:
        """What a start checks of a loaded index file besides its pending rows: (rows, decisions) checked.

        The checksums of the newest rows and of a sample, and the log's last
        decisions against their rows (docs/store-format.md, "Checksums"). In
        the index thread, before any transactional request (nothing else
        uses db). IndexFileError when a row is damaged or disagrees.
        """
        rows = db.check_rows(START_CHECK_NEWEST, START_CHECK_SAMPLED)
        meta, counts = db.meta, {"decisions": 0}
        for _at, tx_id, why in check_decisions(db, self.core.store, meta["applied_to"], meta.get("log_min", 0), counts,
                                               first=meta["queues"]["op"] - START_CHECK_DECISIONS, damaged_rows=True):
            raise IndexFileError(f"transaction {tx_id}: {why}")
        return rows, counts["decisions"]

    def _open_index(self) -> tuple[TxDatabase, str | None]:
        """The index file and None if it fits the log, else a new empty one and why the old one was dropped."""
        data_dir = self.core.data_dir
        why = "no index file"
        try:
            if not (data_dir / DB_FILE).exists():
                raise IndexFileError(why)  # opening would create an empty one, which fits no log but an empty one
            db = TxDatabase(data_dir / DB_FILE)
            why = agrees(self.core.store, db.meta)
            if why is None:
                return db, None
            db.close()
        except IndexFileError as exc:
            if exc.io:  # not damaged, unreadable now (a full disk): kept for the next start
                raise
            why = str(exc)
        return self._new_index(), why

    def _new_index(self) -> TxDatabase:
        """A new, empty index file in place of the old one (derived data only: the log has everything it held)."""
        data_dir = self.core.data_dir
        remove_db(data_dir)
        for stale in data_dir.glob("txindex.snap*"):  # the snapshot files of older versions
            stale.unlink(missing_ok=True)
        fsync_dir(data_dir)
        return TxDatabase(data_dir / DB_FILE)

    async def _flush_index(self, upto: int | None = None) -> None:
        """Write the index rows changed since the last flush, once the log is durable past them.

        The changes and the log position (``applied_to``) are taken together,
        between appends; the pending rows among them are made a slice at a
        time, the loop serving requests in between, so a row may be ahead of
        applied_to (a check copy written meanwhile). The file is written in
        a worker thread as one SQLite transaction once the log is durable
        past the last slice: it reflects every record before applied_to and
        none that is not on disk (a power cut can never leave it ahead of
        the log), and a start's replay from applied_to brings the rows that
        are ahead to the same state again.
        """
        async with self._flush_lock:
            core = self.core
            index = core.tx.index
            changed = index.capture()
            try:
                meta = log_position(core.store, upto)  # no await since the capture: every change before this is in changed
                if index.damaged:  # a lookup met a damaged row: the next start rebuilds the file (agrees)
                    meta["damaged"] = index.damaged
                store_min = core.store.min_offset
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
                waiter = core.flusher.wait_synced(core.store.max_offset)  # past every record the rows reflect
                if waiter is not None:
                    await waiter
                rows = itertools.chain(pending, index.decided_rows(changed))
                await asyncio.get_running_loop().run_in_executor(self._index_pool, self._writer.flush, rows, meta, prune)
            except BaseException as exc:
                index.flush_failed(changed)
                if not isinstance(exc, Exception):
                    raise
                if core.disk.failed("index", exc):  # a full disk is logged once, broker-wide
                    self._flush_failing = self._flush_failing or "disk"
                elif self._flush_failing != "error":
                    log.error("event=txindex_flush_failed error=%r", exc)  # once per failing spell
                    self._flush_failing = "error"
                core.metrics.inc("index_flush_errors")
                return
            if self._flush_failing == "error":
                log.info("event=txindex_flush_recovered")
            self._flush_failing = False
            core.disk.ok("index")
            # Decisions on disk leave memory, a slice at a time: 15,000 at once held the loop 3-5 ms.
            items = iter(changed.items())  # changed is this flush's own: nothing adds to it meanwhile
            while True:
                part = dict(itertools.islice(items, FLUSHED_SLICE))
                index.flushed(part)
                if len(part) < FLUSHED_SLICE:
                    break
                await asyncio.sleep(0)

    async def _index_flush_loop(self) -> None:
        """Flush the index every INDEX_FLUSH_S, sooner when many rows changed (a check pass)."""
        index = self.core.tx.index
        waited = 0.0
        while True:
            await asyncio.sleep(INDEX_FLUSH_POLL_S)
            waited += INDEX_FLUSH_POLL_S
            if index.dirty and (waited >= INDEX_FLUSH_S or len(index.dirty) >= INDEX_FLUSH_ROWS):
                waited = 0.0
                try:
                    await self._flush_index()
                except Exception:
                    log.exception("event=txindex_flush_failed")

    async def serve(self, sock: socket.socket, shutdown: asyncio.Event | None = None) -> None:
        """Start, accept on sock until shutdown is set, then stop."""
        await self.start()
        self.native = NativeFrontend(self.core, sock)
        self.frontends.append(self.native)
        for frontend in self.frontends:
            await frontend.start()
        host, port = sock.getsockname()[:2]
        cfg = self.config
        rmq = "" if cfg.rocketmq_max_connections is None else f" rocketmq_max_connections={cfg.rocketmq_max_connections}"
        log.info("event=listening host=%s port=%d flush=%s data_dir=%s speedups=%s max_connections=%d%s fd_limit=%d", host, port,
                 cfg.flush, self.core.data_dir, speedups_in_use(), cfg.max_connections, rmq, self.fd_limit)
        self.ready.set()
        try:
            await (shutdown or asyncio.Event()).wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        log.info("event=shutdown_begin connections=%d inflight=%d", len(self.native.state.connections), len(self.native.state.inflight))
        self.core.draining = True
        self.core.wake_all_pollers()  # long polls answer now
        for frontend in self.frontends:
            try:
                await frontend.stop()
            except Exception:
                log.exception("event=frontend_stop_failed")
        for task in (self._janitor, self._indexer, self._index_flusher):
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        await self.core.check.stop()
        await self._final_flush()
        await self.core.stop()  # refuses new work, flushes, closes the store
        for frontend in self.frontends:
            await frontend.close()
        log.info("event=shutdown_done")

    async def _final_flush(self) -> None:
        """Leave the index file reflecting the whole log: the next start reads nothing after it."""
        core = self.core
        writer = self._writer
        if writer is None:
            return
        try:
            if core.tx_ready.is_set() and core.tx_error is None:
                t0 = time.perf_counter()
                await self._flush_index()
                await asyncio.get_running_loop().run_in_executor(self._index_pool, writer.checkpoint)
                log.info("event=txindex_flushed applied_to=%d took_s=%.3f", writer.meta.get("applied_to", 0), time.perf_counter() - t0)
        except Exception:  # only a slower next start
            log.exception("event=txindex_flush_failed")
        finally:
            # In the index thread, after whatever still runs there: a flush or a load whose task was cancelled at
            # its await (a stop during the start) goes on in that thread, and closing its connection under it
            # crashes the process.
            db = core.tx.index.db if core.tx is not None else None
            await asyncio.get_running_loop().run_in_executor(self._index_pool, _close_index, writer, db)

    async def _janitor_loop(self) -> None:
        """Retention: delete expired segments, never one holding an undecided half message."""
        await self.core.tx_ready.wait()  # the protected offset comes from the index
        if self.core.tx_error is not None:
            return
        while True:
            await asyncio.sleep(JANITOR_INTERVAL_S)
            core = self.core
            core.store.config = replace(core.store.config, retention_s=core.check.settings.retention_s)
            pend = core.tx.index.pending.values()
            protect = min((p.origin_cl_offset for p in pend), default=core.store.max_offset)
            try:
                deleted = await asyncio.get_running_loop().run_in_executor(None, core.store.delete_expired, core.clock(), protect)
            except Exception:
                log.exception("event=retention_failed")
                continue
            if deleted:
                log.info("event=retention_deleted files=%d", len(deleted))


def _lower_priority() -> None:
    import os

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), INDEX_WRITER_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: normal priority
        pass


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def install_uvloop() -> str:
    """Use uvloop when it loads; fall back to asyncio's loop otherwise."""
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        return "uvloop"
    except Exception:  # not installed or not supported on this platform
        return "asyncio"
