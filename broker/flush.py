"""Group commit: one fsync, off the event loop, acknowledges every append before it.

In ``sync`` mode a send is acknowledged only once its record is fsynced.
Appends that arrive while an fsync runs wait for the next one, so under load
one fsync covers a whole batch of requests (group commit). In ``async``
mode the log is fsynced every ``interval`` seconds and acknowledgements
don't wait; records are still written to the OS before the reply, so a
killed broker process loses nothing that was acknowledged, only a crashed
machine can.

Consume queues and the checkpoint are written every ``interval`` in both
modes (they can be rebuilt from the log). Consumer offsets ride along: a
commit_offset reply waits for the next cycle that persisted them.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import queue
import threading
import time
from functools import partial
from typing import Any, Callable

from txmq.store import Store, StoreError, StoreFullError
from txmq.store.errors import FULL_ERRNOS
from txmq.store.store import SyncJob
from txmq.wire import ErrorCode, TxmqError

log = logging.getLogger("txmq.flush")
_disk_log = logging.getLogger("txmq.broker")



def is_disk_full(exc: BaseException) -> bool:
    """exc says the data directory's disk (or quota, or file size limit) is full."""
    if isinstance(exc, StoreFullError):
        return True
    if isinstance(exc, TxmqError):
        return exc.code == ErrorCode.STORE_FULL
    if isinstance(exc, OSError):
        return exc.errno in FULL_ERRNOS
    # SQLite (the index file) says so in words.
    return type(exc).__name__ == "OperationalError" and "disk is full" in str(exc)


class DiskState:
    """A full disk, logged once per change of state whatever part of the broker meets it.

    Each writer (the flusher, the check service, the index flush) reports
    its failures and its next success. The first full-disk failure logs
    ``event=disk_full``; ``event=disk_ok`` follows once every writer that
    met it has written again. Nothing in between is logged again.
    """

    def __init__(self) -> None:
        self.failing: dict[str, str] = {}  # writer -> the error it met

    @property
    def full(self) -> bool:
        return bool(self.failing)

    def failed(self, where: str, exc: BaseException) -> bool:
        """Note exc if it is a full disk (True); anything else is the caller's to report (False)."""
        if not is_disk_full(exc):
            return False
        if not self.failing:
            _disk_log.error("event=disk_full where=%s error=%r msg=%s", where, exc,
                            "'writes are refused (STORE_FULL) until space is freed; reads go on; acknowledged data is safe'")
        self.failing.setdefault(where, repr(exc))
        return True

    def ok(self, where: str) -> None:
        """where wrote successfully."""
        if self.failing and self.failing.pop(where, None) is not None and not self.failing:
            _disk_log.warning("event=disk_ok where=%s msg=%s", where, "'writes work again'")


FD_ERRNOS = (errno.EMFILE, errno.ENFILE)
FD_PROBE_S = 1.0  # while out of descriptors: how often to look whether some are free again
FD_HEADROOM = 16  # descriptors that must open at once for "free again"


def is_out_of_descriptors(exc: BaseException) -> bool:
    """exc says the process (EMFILE) or the system (ENFILE) has no file descriptor left."""
    for e in (exc, exc.__cause__):
        if isinstance(e, OSError) and e.errno in FD_ERRNOS:
            return True
    return False


def descriptors_free(n: int) -> bool:
    """Whether n more descriptors can be opened right now (they are closed again at once)."""
    fds: list[int] = []
    try:
        for _ in range(n):
            fds.append(os.open(os.devnull, os.O_RDONLY))
        return True
    except OSError:
        return False
    finally:
        for fd in fds:
            os.close(fd)


class DescriptorState:
    """No file descriptor left, met by a request (a new topic's files, a segment, a queue file), logged once per change of state.

    The first failure logs ``event=fds_exhausted``; ``event=fds_available``
    follows once FD_HEADROOM descriptors can be opened again, which is
    looked at every FD_PROBE_S meanwhile (a failed request is not retried,
    so no success would say it). Nothing in between is logged again; every
    failure is counted (``fd_exhausted_errors``). The flusher and the check
    service log their own failures once per spell too.
    """

    def __init__(self) -> None:
        self.since: float | None = None  # monotonic time of the first failure of this spell
        self.errors = 0  # failures in this spell
        self._probe: asyncio.TimerHandle | None = None

    def failed(self, where: str, exc: BaseException) -> bool:
        """Note exc if it is a lack of descriptors (True); anything else is the caller's to report (False)."""
        if not is_out_of_descriptors(exc):
            return False
        self.errors += 1
        if self.since is None:
            self.since = time.monotonic()
            _disk_log.error("event=fds_exhausted where=%s error=%r msg=%s", where, exc,
                            "'no file descriptor left: requests that open a file fail (STORE_ERROR); logged once until some are free'")
            self._schedule()
        return True

    def _schedule(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): the next failure on the loop schedules it
            return
        if self._probe is None:
            self._probe = loop.call_later(FD_PROBE_S, self._look)

    def _look(self) -> None:
        self._probe = None
        if self.since is None:
            return
        if not descriptors_free(FD_HEADROOM):
            self._schedule()
            return
        _disk_log.warning("event=fds_available failed_requests=%d took_s=%.1f", self.errors, time.monotonic() - self.since)
        self.since, self.errors = None, 0

    def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None


def _settle(fut: asyncio.Future, ok: bool, value: Any) -> None:
    if not fut.done():
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)


class FsyncThread:
    """The one thread that runs fsync cycles, handed jobs without an executor.

    ``loop.run_in_executor`` costs the event loop a concurrent Future, a work
    item, the executor's locks and semaphore, and a second future chained to
    the first, on every group-commit cycle: in sync mode under load that was
    ~15% of the loop thread's busy time. Here a job is one queue put, and its
    result one ``call_soon_threadsafe``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "txmq-fsync") -> None:
        self._loop = loop
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """fn(*args) in the thread; the future resolves with its result or exception on the loop."""
        fut = self._loop.create_future()
        self._jobs.put((fn, args, fut))
        return fut

    def _main(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, fut = job
            try:
                res, ok = fn(*args), True
            except BaseException as exc:  # handed to the awaiting coroutine, which decides
                res, ok = exc, False
            try:
                self._loop.call_soon_threadsafe(_settle, fut, ok, res)
            except RuntimeError:  # the loop is closed: nobody waits any more
                return

    def shutdown(self) -> None:
        """Stop after the jobs already handed over; wait for the thread."""
        self._jobs.put(None)
        self._thread.join()


def native_fsyncer() -> Any:
    """The compiled GIL-free fsync thread (broker/_fsyncer.pyx), or None: not built, TXMQ_PURE_PYTHON, or it cannot start."""
    if os.environ.get("TXMQ_PURE_PYTHON"):
        return None
    try:
        from ._fsyncer import Fsyncer
    except ImportError:
        return None
    try:
        return Fsyncer()
    except OSError as exc:
        log.warning("event=native_fsync_unavailable error=%r", exc)
        return None


class Flusher:
    def __init__(
        self,
        store: Store,
        sync: bool,
        interval_s: float = 0.5,
        on_persist: Callable[[], None] | None = None,
        observe: Callable[[float], None] | None = None,
        observe_checkpoint: Callable[[float], None] | None = None,
        disk: DiskState | None = None,
        count_error: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.disk = disk or DiskState()
        self._count_error = count_error  # every failed fsync or checkpoint cycle (the flush_errors counter)
        # Stages failing now ("sync": the fsyncs that acknowledge sends; "checkpoint": the checkpoint
        # thread's cycles) -> [logged as flush_failed, failed cycles]: each spell is logged once.
        self._failing: dict[str, list] = {}
        self.sync_mode = sync
        self.interval_s = interval_s
        self._on_persist = on_persist  # e.g. ConsumerOffsets.persist, run in the flush thread
        self._observe = observe  # seconds of each fsync that acknowledges sends (group commit, inline)
        self._observe_checkpoint = observe_checkpoint  # seconds of each cycle in the checkpoint thread
        self._thread: FsyncThread | None = None  # started with the loop: the fsyncs that acknowledge sends
        # Checkpoint cycles (queues, checkpoint file, consumer offsets) run in a thread of their own, so a
        # slow one (each file's write and fsync, and the GIL between them while the loop is busy: 10-40 ms
        # under load) never holds up the fsyncs that acknowledge sends.
        self._ckpt_thread: FsyncThread | None = None
        self._ckpt: asyncio.Future | None = None  # the checkpoint cycle running, if any
        self._next_ckpt = 0.0
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self._persist_waiters: list[asyncio.Future] = []
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task | None = None
        self.durable = store.durable_offset
        self._busy = False  # a threaded fsync is running
        self.lone_client: Callable[[], bool] = lambda: True  # set by the core: at most one client waiting?
        self._inline_scheduled = False
        # The group-commit fsyncs run in a C thread when it is built (broker/_fsyncer.pyx): a Python
        # thread waits for the GIL before and after every fdatasync while the loop is busy, which under
        # load made a 0.3 ms fdatasync a 1-3 ms cycle. _thread stays for the rest (and the fallback).
        self._native: Any = None
        self._native_job: SyncJob | None = None  # handed to the C thread, its sync lock held by the loop
        self._native_dir_fd = -1
        self._native_wait: asyncio.Future | None = None
        self._fallback: asyncio.Future | None = None  # a job the C thread refused, fsynced in the Python thread

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = FsyncThread(self._loop)
        self._ckpt_thread = FsyncThread(self._loop, "txmq-checkpoint")
        if self.sync_mode:
            self._native = native_fsyncer()
            if self._native is not None:
                self._loop.add_reader(self._native.fileno(), self._native_done)
        self._task = self._loop.create_task(self._run(), name="txmq-flusher")

    @property
    def fsync_thread(self) -> str:
        """Where the fsyncs that acknowledge sends run: "native" (the C thread) or "python"."""
        return "native" if self._native is not None else "python"

    def wait_synced(self, end_offset: int) -> asyncio.Future | None:
        """Like wait_durable, in either flush mode: for state that must never get ahead of the log."""
        if end_offset <= self.durable:
            return None
        fut = self._loop.create_future()
        self._waiters.append((end_offset, fut))
        self._wake.set()
        return fut

    def wait_durable(self, end_offset: int) -> asyncio.Future | None:
        """A future resolved once the log is fsynced past end_offset; None if nothing to wait for."""
        if not self.sync_mode or end_offset <= self.durable:
            return None
        fut = self._loop.create_future()
        self._waiters.append((end_offset, fut))
        if not self._busy and len(self._waiters) == 1 and self.lone_client():
            # One client with one request in flight and an idle flusher:
            # handing the fsync to the thread and back costs two wake-ups
            # (~100 us, as much as the fsync), so do it on the loop (+20% for
            # a client sending back to back). With more clients the thread
            # keeps fsync off the loop and group commit batches them (inline
            # there doubled p50 latency at moderate load).
            if not self._inline_scheduled:
                self._inline_scheduled = True
                self._loop.call_soon(self._sync_inline)
        else:
            self._wake.set()
        return fut

    def _sync_inline(self) -> None:
        self._inline_scheduled = False
        if self._busy or not self._waiters:
            if self._waiters:
                self._wake.set()
            return
        if self.store.rewrite_pending:  # after a failed fsync: reading and writing the log again is a thread's job
            self._wake.set()
            return
        t0 = time.perf_counter()
        try:
            durable = self.store.sync(block=False)  # never waits on the loop for a checkpoint's fsync
        except (StoreError, OSError):
            self._wake.set()  # let the flusher's loop report and fail the waiters
            return
        if durable is None:
            self._wake.set()
            return
        if self._observe:
            self._observe(time.perf_counter() - t0)
        self._resolve(durable, ())

    def wait_persisted(self) -> asyncio.Future:
        """Resolved after the next cycle that ran on_persist (consumer offsets)."""
        fut = asyncio.get_running_loop().create_future()
        self._persist_waiters.append(fut)
        self._wake.set()
        return fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        self._next_ckpt = loop.time() + self.interval_s
        while True:
            ckpt_wanted = self._ckpt is None and bool(self._persist_waiters)
            if not self._waiters and not ckpt_wanted and not self._stopping:
                timeout = max(0.0, self._next_ckpt - loop.time()) if self._ckpt is None else None
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
            self._wake.clear()
            if self._stopping:
                if not await self._final_cycle():
                    return
                if not self._waiters and not self._persist_waiters:
                    return
                continue
            if self._ckpt is None and (loop.time() >= self._next_ckpt or self._persist_waiters):
                self._start_checkpoint(loop.time() >= self._next_ckpt)
            if self._waiters:
                await self._sync_cycle()

    async def _sync_cycle(self) -> None:
        """One fsync of the log in the fsync thread (group commit: every send appended so far)."""
        t0 = time.perf_counter()
        self._busy = True
        try:
            assert self._thread is not None
            job = self._native_submit()
            if job is None:
                durable = await self._thread.run(self.store.sync)
            else:
                wait = self._native_wait = self._loop.create_future()
                durable = await wait
        except (StoreError, OSError) as exc:
            self._busy = False
            self._cycle_failed("sync", exc)
            self._fail_all(TxmqError(f"flush failed: {exc}", ErrorCode.STORE_ERROR), [])
            await asyncio.sleep(0.05)
            return
        self._busy = False
        if self._observe:
            self._observe(time.perf_counter() - t0)
        if self._failing:
            self._cycle_ok("sync")
        self._resolve(durable, ())

    def _cycle_failed(self, stage: str, exc: BaseException) -> None:
        """Count a failed cycle; log it once per failing spell of its stage (a full disk: once broker-wide, DiskState)."""
        if self._count_error is not None:
            self._count_error()
        full = self.disk.failed("flush", exc)
        spell = self._failing.get(stage)
        if spell is not None:
            spell[1] += 1
            return
        self._failing[stage] = [not full, 1]
        if not full:
            event = "flush_failed" if isinstance(exc, (StoreError, OSError)) else "checkpoint_failed"
            log.error("event=%s stage=%s error=%r msg=%s", event, stage, exc,
                      "'retried every cycle; logged once until a cycle succeeds (counter flush_errors)'")

    def _cycle_ok(self, stage: str) -> None:
        spell = self._failing.pop(stage, None)
        if spell is not None and spell[0]:
            log.warning("event=flush_recovered stage=%s failed_cycles=%d", stage, spell[1])

    def _native_submit(self) -> SyncJob | None:
        """Hand this cycle's fsyncs to the C thread; None to run them in the Python thread instead.

        None when there is no C thread, when a checkpoint is fsyncing the log
        (its thread holds the sync lock; Store.sync waits for it there, never
        on the loop), or when the job cannot be handed over (then its fsyncs
        run in the Python thread and it ends there too).
        """
        native = self._native
        if native is None:
            return None
        job = self.store.begin_sync()
        if job is None:
            return None
        if self.store.rewrite_pending:  # the data past durable is written again before its fsync: in Python (Store.run_sync)
            self._native_job = job
            self._native_fallback(job, None)
            return job
        dir_fd = -1
        try:
            if job.dir_dirty:
                dir_fd = os.open(job.log.dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            native.submit(job.fds, dir_fd)
        except Exception as exc:
            if dir_fd >= 0:
                os.close(dir_fd)
            self._native_job = job
            self._native_fallback(job, exc)
            return job
        self._native_job, self._native_dir_fd = job, dir_fd
        return job

    def _native_fallback(self, job: SyncJob, why: BaseException | None) -> None:
        """The job's fsyncs in the Python thread, ended on the loop as usual: the C thread did not take it (why), or
        an earlier fsync failed (why None) and Store.run_sync writes the unsynced data again first."""
        if why is not None:
            log.warning("event=native_fsync_fallback error=%r", why)
        assert self._thread is not None

        def done(fut: asyncio.Future) -> None:
            self._fallback = None
            if fut.cancelled():  # not known to have run: never claimed durable
                exc: BaseException | None = OSError(errno.EIO, "fsync cancelled")
            else:
                exc = fut.exception()
            self._native_finish(exc if isinstance(exc, OSError) or exc is None else OSError(errno.EIO, str(exc)))

        self._fallback = self._thread.run(self.store.run_sync, job)
        self._fallback.add_done_callback(done)

    def _native_done(self) -> None:
        """The eventfd is readable: the C thread finished the job (or a stale wake-up, ignored)."""
        native = self._native
        res = native.collect() if native is not None else None
        if res is None or self._native_job is None:
            return
        try:
            if self._native_dir_fd >= 0:
                fd, self._native_dir_fd = self._native_dir_fd, -1
                os.close(fd)
        finally:
            self._native_finish(OSError(res, os.strerror(res)) if res else None)

    def _native_finish(self, error: OSError | None) -> None:
        """End the job (publish the durable offset, release the sync lock) and wake the cycle awaiting it.

        Runs whether or not the cycle still waits: the lock is released
        even when the flusher was cancelled meanwhile.
        """
        job, self._native_job = self._native_job, None
        wait, self._native_wait = self._native_wait, None
        assert job is not None
        try:
            durable = self.store.end_sync(job, error)
        except BaseException as exc:
            if wait is not None and not wait.done():
                wait.set_exception(exc)
            return
        if wait is not None and not wait.done():
            wait.set_result(durable)

    async def _close_native(self) -> None:
        """Stopping: let a job handed over finish and end it, then free the thread and its eventfd.

        A job in the Python fallback is awaited too: its ending (which
        releases the store's sync lock) runs on the loop, and the store's
        close takes that lock next.
        """
        if self._fallback is not None:
            await asyncio.wait({self._fallback})
            await asyncio.sleep(0)  # its done callback ends the job
        native = self._native
        if native is None:
            return
        self._loop.remove_reader(native.fileno())
        native.halt()  # returns once a job handed over is done
        self._native_done()  # ends that job, if any
        self._native = None
        native.close()

    def _start_checkpoint(self, checkpoint: bool) -> None:
        """A checkpoint cycle (or, for offset commits alone, a sync and the offsets) in the checkpoint thread."""
        assert self._ckpt_thread is not None
        persist_waiters, self._persist_waiters = self._persist_waiters, []
        fut = self._ckpt_thread.run(self._full_cycle, checkpoint)
        self._ckpt = fut
        fut.add_done_callback(partial(self._checkpoint_done, checkpoint, persist_waiters, time.perf_counter()))

    def _checkpoint_done(self, checkpoint: bool, persist_waiters: list[asyncio.Future], t0: float, fut: asyncio.Future) -> None:
        self._ckpt = None
        self._wake.set()  # the loop may start the next one, or finish stopping
        if checkpoint:
            # the next one an interval from now; after a failure too: sends keep being fsynced meanwhile
            self._next_ckpt = self._loop.time() + self.interval_s
        exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
        if exc is not None:
            self._cycle_failed("checkpoint", exc)
            err = TxmqError(f"flush failed: {exc}", ErrorCode.STORE_ERROR)
            for w in persist_waiters:
                if not w.done():
                    w.set_exception(err)
            return
        if self._observe_checkpoint:
            self._observe_checkpoint(time.perf_counter() - t0)
        if checkpoint:
            self.disk.ok("flush")
            if self._failing:
                self._cycle_ok("checkpoint")
        self._resolve(fut.result(), persist_waiters)

    async def _final_cycle(self) -> bool:
        """Stopping: after a checkpoint in progress, one last full cycle; False once it failed (waiters told)."""
        if self._ckpt is not None:
            await asyncio.wait({self._ckpt})
            await asyncio.sleep(0)  # its done callback runs first
        assert self._ckpt_thread is not None
        persist_waiters, self._persist_waiters = self._persist_waiters, []
        t0 = time.perf_counter()
        try:
            durable = await self._ckpt_thread.run(self._full_cycle, True)
        except (StoreError, OSError) as exc:
            self._cycle_failed("checkpoint", exc)
            self._fail_all(TxmqError(f"flush failed: {exc}", ErrorCode.STORE_ERROR), persist_waiters)
            return False
        if self._observe_checkpoint:
            self._observe_checkpoint(time.perf_counter() - t0)
        self._resolve(durable, persist_waiters)
        return True

    def _resolve(self, durable: int, persist_waiters) -> None:
        if durable > self.durable:
            self.durable = durable
        waiters = self._waiters
        while waiters and waiters[0][0] <= durable:
            _, fut = waiters.popleft()
            if not fut.done():
                fut.set_result(durable)
        for fut in persist_waiters:
            if not fut.done():
                fut.set_result(durable)

    def _full_cycle(self, checkpoint: bool) -> int:
        if checkpoint:
            # the sends waiting for the log are answered once it is fsynced, not after the queues and checkpoint file
            self.store.checkpoint(self._synced_early)
        durable = self.store.sync()
        if self._on_persist is not None:
            self._on_persist()
        return durable

    def _synced_early(self, durable: int) -> None:
        """In the fsync thread: the log is fsynced up to durable; resolve its waiters on the loop now."""
        if self._waiters:
            try:
                self._loop.call_soon_threadsafe(self._resolve, durable, ())
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def _fail_all(self, err: TxmqError, persist_waiters: list[asyncio.Future]) -> None:
        while self._waiters:
            _, fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(err)
        for fut in persist_waiters:
            if not fut.done():
                fut.set_exception(err)

    async def stop(self) -> None:
        """Flush everything, run a last checkpoint, stop the thread."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:
                await self._task
            except Exception:  # already logged by the loop
                log.exception("event=flusher_crashed")
        await self._close_native()
        if self._thread is not None:
            self._thread.shutdown()
        if self._ckpt_thread is not None:
            self._ckpt_thread.shutdown()
