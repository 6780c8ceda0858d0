"""The lifecycle of a SQLite index file behind the commit log, in a live broker: built at start, flushed, closed.

The transaction index (``txindex.db``, broker/transactions/keeper.py) and
the schedule's index (``timers.db``, broker/scheduled/keeper.py) live the
same way; ``IndexLife`` is that life, each keeper the index's own part:

1. Build (``start``): in the background, while plain traffic is served,
   the keeper opens its file (or a new one, when the file is missing,
   damaged or does not fit the log) and replays the log from the file's
   ``applied_to``, a step at a time, the loop serving requests in between.
   A replay that changed many rows (a whole rebuild) flushes on the way,
   with ``applied_to`` where the replay got to: a crash then resumes from
   there. Then a flush, and ``ready`` is set. A build that fails sets
   ``error`` (the index's requests get it instead of waiting forever) and
   ``ready``; the log is not touched: fix the cause, restart.
2. Flushes: every ``flush_s``, or as soon as ``flush_rows`` rows changed,
   the changed rows are written, in the index's own thread, as one SQLite
   transaction, once the log is fsynced past every record they reflect (a
   power cut never leaves the file ahead of the log). A failed flush keeps
   its rows changed; it is logged once per failing spell (a full disk is
   logged broker-wide, by ``DiskState``) and retried every ``flush_s``,
   even with no row changed: the broker says ``disk_ok`` only once one
   succeeds.
3. Stop: the tasks are cancelled, a last flush leaves the file reflecting
   the whole log (the next start replays nothing), the WAL is folded into
   the file, and the file is closed in its thread, after whatever still
   runs there.

The file's format (meta, checksummed rows, one transaction per flush) is
broker/sqlitefile.py's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from txmq.wire import ErrorCode, TxmqError

if TYPE_CHECKING:
    from txmq.store import Store

    from .flush import DiskState, Flusher
    from .metrics import Metrics

FLUSH_POLL_S = 0.1  # how often the flush task looks whether a flush is due
WRITER_NICE = 10  # the index thread's CPU priority, when it is lowered

Steps = Iterable[tuple[int, "int | None"]]  # (records replayed so far, where the replay got to: None, no flush there)
FlushJob = tuple[Callable[..., Any], tuple]  # what a flush runs in the index thread: (function, its arguments)


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task (if any and still running) and wait until it has ended, whatever it raised."""
    if task is not None and not task.done():
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass


class IndexLife:
    """An index file's life in a live broker: built at start, flushed while the broker runs, closed at shutdown.

    A keeper subclasses it with its index's own parts: how the file is
    opened and checked and the log replayed (``_load``), what a flush
    takes and writes (``_capture``, ``_prepare``, ``_keep``,
    ``_flushed``), what a ready index starts (``_on_ready``), and what a
    stop closes (``_close_files``).
    """

    name: str  # its log events: {name}_rebuild_failed, {name}_flush_failed, {name}_flush_recovered, {name}_flushed
    disk_name: str  # where DiskState notes its full-disk failures
    errors_metric: str  # the counter of failed flushes
    failure: str  # the build's error: "<failure> (<why>); <effect>"
    effect: str  # what is unavailable when the build failed
    build_task: str  # the tasks' names
    flush_task: str
    loop_retry_s: float = 0.0  # after the flush task's turn raised, the wait before the next one

    def __init__(self, store: Store, flusher: Flusher, disk: DiskState, metrics: Metrics, log: logging.Logger, *,
                 thread: str, nice: bool = False) -> None:
        self.store = store
        self.flusher = flusher
        self.disk = disk
        self.metrics = metrics
        self.log = log
        self.ready: asyncio.Event = asyncio.Event()  # set once the index is built (or failed to be)
        self.error: TxmqError | None = None  # why it failed
        self.lock = asyncio.Lock()  # a flush (and what a keeper needs to run apart from one): one at a time
        # Index writes run in one thread of their own; with nice at a lower CPU priority (Linux nice applies per
        # thread): on a busy machine the event loop and the log's fsyncs go first, the index catches up in between.
        self._pool = ThreadPoolExecutor(1, thread, initializer=lower_priority if nice else None)
        self._flush_failing: str | bool = False  # "disk" (full) or "error" while flushes fail
        self._build_task: asyncio.Task | None = None
        self._flush_task: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []  # the keeper's own, started once the index is ready

    # ---- what a keeper gives ----------------------------------------------------
    async def _load(self) -> Steps:
        """Open the file (or a new one) and check it; the replay of the log from its ``applied_to``, in steps."""
        raise NotImplementedError

    async def _after_replay(self) -> None:
        """What the build does after the replay, before its last flush."""

    async def _on_ready(self, t0: float, replayed: int) -> None:
        """Set ``ready`` and start what a ready index serves (before the flush task starts)."""
        raise NotImplementedError

    def _dirty(self) -> int:
        """Rows changed since the last flush."""
        raise NotImplementedError

    def _flush_every(self) -> tuple[float, int]:
        """(flush_s, flush_rows): read at each turn (tests change them)."""
        raise NotImplementedError

    def _capture(self) -> Any:
        """Take the changes a flush writes (None: nothing can be flushed, no file)."""
        raise NotImplementedError

    async def _prepare(self, changes: Any, upto: int | None) -> FlushJob:
        """What the index thread runs to write changes (no await before the meta is taken: it goes with the capture)."""
        raise NotImplementedError

    def _keep(self, changes: Any) -> None:
        """A flush failed: its changes stay for the next one."""
        raise NotImplementedError

    async def _flushed(self, changes: Any, result: Any) -> None:
        """A flush succeeded (``result``: what its job returned)."""

    async def _between_flushes(self) -> bool:
        """The flush task's turn, before it looks at the flush: True if it wrote the file (the flush clock restarts)."""
        return False

    async def _wait_turn(self, seconds: float) -> None:
        """The flush task's pause between two turns."""
        await asyncio.sleep(seconds)

    async def _before_final_flush(self) -> None:
        """After the tasks are cancelled, before the last flush."""

    def _checkpointed(self) -> Any:
        """The file the last flush folds the WAL of (None: no file)."""
        raise NotImplementedError

    def _close_files(self) -> None:
        """Close the file's connections (in the index thread)."""
        raise NotImplementedError

    # ---- the gate -----------------------------------------------------------------
    async def wait_ready(self) -> None:
        """Wait until the index is built; raises ``error`` if it failed."""
        await self.ready.wait()
        if self.error is not None:
            raise self.error

    def state(self) -> str:
        """``building``, ``ready`` or ``failed``."""
        return "ready" if self.ready.is_set() and self.error is None else ("failed" if self.error else "building")

    # ---- build --------------------------------------------------------------------
    def start(self, t0: float | None = None) -> None:
        """Build the index in the background; ``t0`` (perf_counter) is when the broker's start began (now if None)."""
        t0 = time.perf_counter() if t0 is None else t0
        self._build_task = asyncio.get_running_loop().create_task(self._build(t0), name=self.build_task)

    async def run(self, job: Callable[..., Any], *args: Any) -> Any:
        """Run job in the index thread (every use of the file, one at a time)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, job, *args)

    async def _build(self, t0: float) -> None:
        replayed = 0
        try:
            steps = await self._load()
            for replayed, upto in steps:  # noqa: B007 (its last value goes to _on_ready)
                if upto is not None and self._dirty() >= self._flush_every()[1]:
                    # A long replay or a whole rebuild: memory stays bounded. The file records how far the
                    # replay got, not the log's end: a crash now resumes from there.
                    await self.flush(upto=upto)
                await asyncio.sleep(0)
            await self._after_replay()
            await self.flush()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The index's requests get this error instead of waiting forever; plain traffic goes on.
            # The log is not touched: fix the cause, restart.
            if getattr(exc, "io", False) or isinstance(exc, OSError):  # e.g. a full disk: one line, no traceback
                self.log.error("event=%s_rebuild_failed error=%r msg='%s'", self.name, exc, self.effect)
            else:
                self.log.exception("event=%s_rebuild_failed", self.name)
            self.error = TxmqError(f"{self.failure} ({exc!r}); {self.effect}", ErrorCode.STORE_ERROR)
            self.ready.set()
            return
        await self._on_ready(t0, replayed)
        self._flush_task = asyncio.get_running_loop().create_task(self._flush_loop(), name=self.flush_task)

    # ---- flushes --------------------------------------------------------------------
    async def flush(self, upto: int | None = None) -> bool:
        """Write the rows changed since the last flush, once the log is durable past them (``flush_locked``)."""
        async with self.lock:
            return await self.flush_locked(upto)

    async def flush_locked(self, upto: int | None = None) -> bool:
        """``flush`` with ``lock`` held: False if it failed (its changes stay for the next one) or there is no file.

        ``upto``: the ``applied_to`` the file gets (a replay's progress); None, the log's end.
        """
        changes = self._capture()
        if changes is None:
            return False
        try:
            job, args = await self._prepare(changes, upto)
            waiter = self.flusher.wait_synced(self.store.max_offset)  # past every record the rows reflect
            if waiter is not None:
                await waiter
            result = await self.run(job, *args)
        except BaseException as exc:
            self._keep(changes)
            if not isinstance(exc, Exception):
                raise
            self._flush_failed(exc)
            return False
        self._flush_ok()
        await self._flushed(changes, result)
        return True

    def flush_failing(self) -> bool:
        return bool(self._flush_failing)

    def _flush_failed(self, exc: Exception) -> None:
        if self.disk.failed(self.disk_name, exc):  # a full disk is logged once, broker-wide
            self._flush_failing = self._flush_failing or "disk"
        elif self._flush_failing != "error":
            self.log.error("event=%s_flush_failed error=%r", self.name, exc)  # once per failing spell
            self._flush_failing = "error"
        self.metrics.inc(self.errors_metric)

    def _flush_ok(self) -> None:
        if self._flush_failing == "error":
            self.log.info("event=%s_flush_recovered", self.name)
        self._flush_failing = False
        self.disk.ok(self.disk_name)

    async def _flush_loop(self) -> None:
        """Flush every flush_s, sooner when flush_rows rows changed; a failed flush is retried with nothing changed too."""
        waited = 0.0
        while True:
            await self._wait_turn(FLUSH_POLL_S)
            waited += FLUSH_POLL_S
            try:
                if await self._between_flushes():
                    waited = 0.0
                    continue
                flush_s, flush_rows = self._flush_every()
                dirty = self._dirty()
                # a failed flush is retried with nothing dirty too: the broker says disk_ok only once it succeeds
                if (dirty or self._flush_failing) and (waited >= flush_s or dirty >= flush_rows):
                    waited = 0.0
                    await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.log.exception("event=%s_flush_failed", self.name)
                if self.loop_retry_s:
                    await asyncio.sleep(self.loop_retry_s)

    # ---- shutdown ---------------------------------------------------------------------
    async def stop(self) -> None:
        """Stop building and flushing, then leave the file reflecting the whole log and close it."""
        for task in (self._build_task, self._flush_task, *self._tasks):
            await cancel_and_wait(task)
        await self._before_final_flush()
        await self._final_flush()

    async def _final_flush(self) -> None:
        """Leave the file reflecting the whole log (the next start reads nothing after it), then close it."""
        writer = self._checkpointed()
        if writer is None:
            return
        try:
            if self.ready.is_set() and self.error is None:
                t0 = time.perf_counter()
                if not await self.flush():  # logged by flush: the next start replays more of the log, nothing else
                    return
                await self.run(writer.checkpoint)
                self.log.info("event=%s_flushed applied_to=%d took_s=%.3f", self.name, writer.meta.get("applied_to", 0),
                              time.perf_counter() - t0)
        except Exception:  # only a slower next start
            self.log.exception("event=%s_flush_failed", self.name)
        finally:
            # In the index thread, after whatever still runs there: a flush or a load whose task was cancelled at
            # its await (a stop during the start) goes on in that thread, and closing its connection under it
            # crashes the process.
            await self.run(self._close_files)
            self._pool.shutdown(wait=False)


def replay_in_steps(records: Iterable[Any], apply: Callable[[Any], None], step: int) -> Iterator[tuple[int, int | None]]:
    """Apply each record, yielding (records so far, the last one's offset) every ``step`` records and (total, None) at the end."""
    n = 0
    for rec in records:
        apply(rec)
        n += 1
        if n % step == 0:
            yield n, rec.commit_log_offset
    yield n, None


def lower_priority() -> None:
    """Lower the calling thread's CPU priority (WRITER_NICE); normal priority where that is not possible."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: normal priority
        pass
