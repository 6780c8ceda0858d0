"""Broker lifecycle: open the store, rebuild the transaction index, serve, shut down.

``Broker.serve(sock, shutdown)`` takes an already-bound socket and an
awaitable shutdown signal, so tests bind 127.0.0.1:0 and never race for a
port. Shutdown order (the reverse of start): stop accepting, let in-flight
requests finish (bounded by shutdown_timeout_s), stop the check service,
close connections, flush and close the store.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import time
from dataclasses import replace

from txmq.constants import DISCARD_TOPIC, HALF_TOPIC, OP_TOPIC
from txmq.store import atomic_write_json, read_json
from txmq.store.files import fsync_dir
from txmq.wire import ErrorCode, TxmqError

from .check import CheckProgress, CheckService
from .clock import Clock
from .config import BrokerConfig, CheckSettings
from .connection import BrokerConnection
from .core import BrokerCore, speedups_in_use
from .tx import TransactionService
from .txindex import (
    SNAPSHOT_FILE, TxIndex, boundary_ok, fork_snapshot, load_snapshot, rebuild_steps, save_snapshot, snapshot_header,
)

log = logging.getLogger("txmq.broker")

JANITOR_INTERVAL_S = 60.0
SNAPSHOT_POLL_S = 5.0  # how often the background snapshot looks at how much was written


class ServerState:
    def __init__(self) -> None:
        self.connections: set[BrokerConnection] = set()
        self.inflight: set[asyncio.Future] = set()


class Broker:
    def __init__(self, config: BrokerConfig, clock: Clock | None = None) -> None:
        self.config = config
        self.core = BrokerCore(config, clock)
        self.state = ServerState()
        self.server: asyncio.AbstractServer | None = None
        self.ready = asyncio.Event()
        self._janitor: asyncio.Task | None = None
        self._indexer: asyncio.Task | None = None
        self._snapshotter: asyncio.Task | None = None
        self._snapshot_base = 0  # op + discard + half records the loaded snapshot covers

    def _settings(self) -> CheckSettings:
        """Defaults < config.json (set live) < explicit start options."""
        path = self.core.data_dir / "config.json"
        settings = CheckSettings.from_dict(read_json(path, {}))
        for key in self.config.check_overrides:
            settings = settings.with_value(key, getattr(self.config.check, key))
        atomic_write_json(path, settings.to_dict())
        return settings

    async def start(self) -> None:
        core = self.core
        t0 = time.perf_counter()
        core.open()
        settings = self._settings()
        progress = CheckProgress(core.data_dir / "txcheck.json")
        index = TxIndex()
        self._log_end_at_open = core.store.max_offset
        core.tx = TransactionService(core, index)
        core.check = CheckService(core, core.tx, progress, core.data_dir / "config.json", settings)
        core.store.config = replace(core.store.config, retention_s=settings.retention_s)
        await core.start()
        loop = asyncio.get_running_loop()
        self._indexer = loop.create_task(self._build_index(progress, t0), name="txmq-txindex")
        self._janitor = loop.create_task(self._janitor_loop(), name="txmq-janitor")
        if self.config.index_snapshot_records > 0:
            self._snapshotter = loop.create_task(self._snapshot_loop(), name="txmq-txindex-snapshot")
        log.info("event=store_ready took_s=%.3f", time.perf_counter() - t0)

    async def _build_index(self, progress: CheckProgress, t0: float) -> None:
        """Rebuild the transaction index from the log while plain traffic is served.

        Transactional operations wait for it (core.tx_ready); the check
        service starts after it. Batches alternate with other work, so sends
        and pulls are answered from the first moment.
        """
        core = self.core
        # The index is millions of long-lived objects made in one go, with no
        # cycles among them: the cyclic GC would traverse them again and again
        # as they pile up (full collections are triggered by growth), for
        # nothing. It is off while they are made, and they are frozen after.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            loop = asyncio.get_running_loop()
            path = core.data_dir / SNAPSHOT_FILE
            for stale in core.data_dir.glob(SNAPSHOT_FILE + ".bg.*"):  # a background snapshot cut short
                stale.unlink(missing_ok=True)
            snap = await loop.run_in_executor(None, load_snapshot, path, self._log_end_at_open, progress.op)
            starts = None
            if snap is not None and boundary_ok(core.store, snap[1]):
                core.tx.index, header = snap
                starts = header["queues"]
                self._snapshot_base = sum(starts.values())
                log.info("event=txindex_loaded source=snapshot log_end=%d records_after=%d", header["log_end"],
                         self._tx_records() - self._snapshot_base)
            elif path.exists():
                # Not for this log (cut below it after a crash, or another
                # version): never to be trusted later either.
                log.warning("event=txindex_snapshot_ignored path=%s", path)
                path.unlink(missing_ok=True)
                fsync_dir(core.data_dir)
            # Everything after the snapshot (with none: every op and half record).
            for _ in rebuild_steps(core.store, progress.half, progress.op, core.tx.index, starts=starts):
                await asyncio.sleep(0)
            index = core.tx.index
            report = core.recovery
            if report is not None and report.scanned_from < core.store.max_offset:
                await core.tx.repair_commits(core.store.scan(report.scanned_from))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Transactional requests get this error instead of waiting forever;
            # plain traffic goes on. The log is not touched: fix the cause, restart.
            log.exception("event=txindex_rebuild_failed")
            core.tx_error = TxmqError(f"the transaction index could not be rebuilt ({exc!r}); transactional operations are unavailable until a restart", ErrorCode.STORE_ERROR)
            core.tx_ready.set()
            return
        finally:
            if gc_was_enabled:
                gc.enable()
        # The index can hold millions of long-lived objects: take them out of
        # the cyclic GC's reach so full collections don't stall the loop.
        gc.freeze()
        core.tx_ready.set()
        core.check.start()
        log.info("event=broker_ready pending=%d decided=%d took_s=%.3f", len(index.pending), len(index.decided), time.perf_counter() - t0)

    async def serve(self, sock: socket.socket, shutdown: asyncio.Event | None = None) -> None:
        """Start, accept on sock until shutdown is set, then stop."""
        await self.start()
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: BrokerConnection(self.core, self.state), sock=sock, backlog=2048)
        host, port = sock.getsockname()[:2]
        log.info("event=listening host=%s port=%d flush=%s data_dir=%s speedups=%s", host, port, self.config.flush, self.core.data_dir,
                 speedups_in_use())
        self.ready.set()
        try:
            await (shutdown or asyncio.Event()).wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        log.info("event=shutdown_begin connections=%d inflight=%d", len(self.state.connections), len(self.state.inflight))
        self.core.draining = True
        self.core.wake_all_pollers()  # long polls answer now
        if self.server is not None:
            self.server.close()
        if self.state.inflight:
            await asyncio.wait(list(self.state.inflight), timeout=self.config.shutdown_timeout_s)
        for task in (self._janitor, self._indexer, self._snapshotter):
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        await self.core.check.stop()
        self._save_snapshot()
        await self.core.stop()  # refuses new work, flushes, closes the store
        for conn in list(self.state.connections):
            conn.close()
        if self.server is not None:
            try:
                await asyncio.wait_for(self.server.wait_closed(), 2.0)
            except (asyncio.TimeoutError, Exception):
                pass
        log.info("event=shutdown_done")

    def _save_snapshot(self) -> None:
        """Leave the index for a fast next start (see txindex.save_snapshot)."""
        core = self.core
        if not core.tx_ready.is_set() or core.tx_error is not None or self.state.inflight or core.appender._batch:
            return
        t0 = time.perf_counter()
        try:
            p = core.check.progress
            save_snapshot(core.data_dir / SNAPSHOT_FILE, core.tx.index, snapshot_header(core.store, core.tx.index, p.half, p.op))
        except Exception:  # only a slower next start
            log.exception("event=txindex_snapshot_failed")
            return
        log.info("event=txindex_snapshot entries=%d took_s=%.3f", len(core.tx.index.pending) + len(core.tx.index.decided), time.perf_counter() - t0)

    def _tx_records(self) -> int:
        """Op, discard and half records written so far (their queues' ends)."""
        return sum(self.core.store.queue_max_offset(t, 0) for t in (HALF_TOPIC, OP_TOPIC, DISCARD_TOPIC))

    async def _snapshot_loop(self) -> None:
        """Snapshot the index in the background once enough transactional records were written.

        Bounds what a start after a crash reads beyond the snapshot (see
        ``BrokerConfig.index_snapshot_records``). The snapshot is written by
        a forked child (``fork_snapshot``) and put in place only once the log
        is fsynced past it, so a crash can never leave a snapshot ahead of
        the log it describes.
        """
        core = self.core
        await core.tx_ready.wait()
        if core.tx_error is not None:
            return
        # Counted from the snapshot this start loaded (from nothing without
        # one): a start that had to read many records snapshots soon, so a
        # crash loop does not make every start read more than the last.
        last = self._snapshot_base
        while True:
            await asyncio.sleep(SNAPSHOT_POLL_S)
            if self._tx_records() - last < self.config.index_snapshot_records:
                continue
            if core.check.passing:
                # A pass re-appends every due half message (a million records
                # for a million pending): snapshotting meanwhile would copy
                # the pages the pass is rewriting and take the other core
                # from it. The next poll after the pass takes the snapshot.
                continue
            last = self._tx_records()
            t0 = time.perf_counter()
            try:
                await self._background_snapshot()
            except Exception:  # only a slower start after a crash
                log.exception("event=txindex_snapshot_failed")
            # The child's work grows with the index (every decided transaction
            # is in it): rest as long as it took, so that snapshots never take
            # more than half of a core however fast records arrive.
            await asyncio.sleep(time.perf_counter() - t0)

    async def _background_snapshot(self) -> None:
        core = self.core
        loop = asyncio.get_running_loop()
        path = core.data_dir / SNAPSHOT_FILE
        # Named after this broker: a child left running by a killed broker
        # must not write into the next broker's file.
        tmp = core.data_dir / f"{SNAPSHOT_FILE}.bg.{os.getpid()}"
        p = core.check.progress
        t0 = time.perf_counter()
        header = snapshot_header(core.store, core.tx.index, p.half, p.op)  # taken with the fork: no await between
        pid = fork_snapshot(tmp, core.tx.index, header)
        forked = time.perf_counter() - t0
        reaped = loop.run_in_executor(None, os.waitpid, pid, 0)  # the one wait for this child
        try:
            _, status = await asyncio.shield(reaped)
        except asyncio.CancelledError:  # shutting down: the clean shutdown writes its own snapshot
            os.kill(pid, signal.SIGKILL)
            try:
                await reaped
            finally:
                tmp.unlink(missing_ok=True)
            raise
        if status != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"snapshot child exited with status {status}")
        try:
            waiter = core.flusher.wait_synced(header["log_end"])
            if waiter is not None:
                await waiter
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(core.data_dir)
        log.info("event=txindex_snapshot background=1 entries=%d log_end=%d fork_s=%.3f took_s=%.3f",
                 header["pending"] + header["decided"], header["log_end"], forked, time.perf_counter() - t0)

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
