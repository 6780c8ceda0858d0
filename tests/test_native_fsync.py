"""Group-commit fsyncs in the compiled thread that never takes the GIL (broker/_fsyncer.pyx).

The loop captures what to fsync (Store.begin_sync, taking the sync lock
without blocking), the C thread runs fdatasync and signals an eventfd, and
the loop ends the job (Store.end_sync: the durable offset, the lock
released). A failure reaches the waiting sends; a checkpoint holding the
lock, or a job the thread cannot take, falls back to the Python thread.
"""

from __future__ import annotations

import asyncio
import errno
import os
import select
import threading

import pytest

from conftest import arun
from flushhelpers import fail_next_end_sync, open_store, run_flusher
from txmq.store import Message, Store, TxType
from txmq.wire import TxmqError

fsyncer = pytest.importorskip("txmq.broker._fsyncer", reason="txmq.broker._fsyncer not built on this machine")


def wait_done(f, timeout=5.0):
    assert select.select([f.fileno()], [], [], timeout)[0], "no completion signalled"
    return f.collect()


def test_fsyncer_reports_each_jobs_errno_once_done(tmp_path):
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY)
    pipe_r, pipe_w = os.pipe()  # fdatasync of a pipe fails with EINVAL
    f = fsyncer.Fsyncer()
    try:
        assert f.collect() is None  # nothing handed over
        os.write(fd, b"x")
        f.submit([fd])
        with pytest.raises(RuntimeError):
            f.submit([fd])  # one job at a time, until its result is collected
        assert wait_done(f) == 0
        assert f.collect() is None  # collected once
        f.submit([fd, pipe_w])
        assert wait_done(f) == errno.EINVAL
        with pytest.raises(ValueError):
            f.submit([fd] * (fsyncer.MAX_FDS + 1))
    finally:
        f.close()
        for d in (fd, pipe_r, pipe_w):
            os.close(d)
    with pytest.raises(ValueError):
        f.fileno()


def test_fsyncer_halt_finishes_the_job_handed_over(tmp_path):
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY)
    f = fsyncer.Fsyncer()
    try:
        f.submit([fd], os.open(tmp_path, os.O_RDONLY))
        f.halt()
        assert f.collect() == 0
        with pytest.raises(OSError):
            f.submit([fd])  # halted: takes no more
    finally:
        f.close()
        os.close(fd)


def appended(store: Store) -> int:
    return store.append([Message("T", 0, TxType.NORMAL, 1, {}, b"x" * 64)])[-1].end_offset


def test_group_commit_fsyncs_in_the_compiled_thread(tmp_path):
    store = open_store(tmp_path)
    calls = []
    real_sync = store.sync
    store.sync = lambda: calls.append(1) or real_sync()  # type: ignore[method-assign]

    async def body(flusher):
        assert flusher._native is not None
        names = {open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")}
        assert "txmq-fdatasync" in names
        for _ in range(3):
            end = appended(store)
            durable = await asyncio.wait_for(flusher.wait_durable(end), 5)
            assert durable >= end and store.durable_offset >= end
        assert calls == []  # the Python fsync thread was not used
        assert not store._sync_lock.locked()

    run_flusher(store, body)


def test_a_failed_fsync_fails_the_waiting_sends_and_releases_the_sync_lock(tmp_path):
    store = open_store(tmp_path)
    fail_next_end_sync(store)

    async def body(flusher):
        end = appended(store)
        with pytest.raises(TxmqError, match="flush failed"):
            await asyncio.wait_for(flusher.wait_durable(end), 5)
        assert store.durable_offset < end
        assert not store._sync_lock.locked()
        end = appended(store)  # the next cycle fsyncs both
        assert await asyncio.wait_for(flusher.wait_durable(end), 5) >= end

    run_flusher(store, body)


def test_group_commit_waits_in_the_python_thread_while_a_checkpoint_holds_the_sync_lock(tmp_path):
    store = open_store(tmp_path)
    held = threading.Event()
    release = threading.Event()

    def checkpoint_fsync():  # as Store.checkpoint holds the lock for its log fsync
        with store._sync_lock:
            held.set()
            release.wait(10)

    async def body(flusher):
        t = threading.Thread(target=checkpoint_fsync)
        t.start()
        try:
            assert held.wait(5)
            end = appended(store)
            waiter = flusher.wait_durable(end)
            await asyncio.sleep(0.1)
            assert not waiter.done()  # the loop did not block, and nothing claimed durability
            release.set()
            assert await asyncio.wait_for(waiter, 5) >= end
        finally:
            release.set()
            t.join()

    run_flusher(store, body)


class RefusingFsyncer:
    """The compiled fsyncer, except that it takes no job (as when its thread has died)."""

    def __init__(self, real) -> None:
        self.real = real

    def submit(self, fds, dir_fd=-1):
        raise OSError(errno.EPIPE, "fsync thread stopped")

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_job_the_compiled_thread_refuses_is_fsynced_in_the_python_thread(tmp_path):
    store = open_store(tmp_path)

    async def body(flusher):
        flusher._native = RefusingFsyncer(flusher._native)
        end = appended(store)
        assert await asyncio.wait_for(flusher.wait_durable(end), 5) >= end
        assert store.durable_offset >= end and not store._sync_lock.locked()

    run_flusher(store, body)


def test_broker_info_says_where_the_acknowledging_fsyncs_run(tmp_path):
    from txmq.broker.testing import running_broker
    from wireclient import RawClient

    async def info(flush):
        async with running_broker(tmp_path / flush, flush=flush) as b:
            c = await RawClient.open(b.address)
            try:
                return (await c.ok("broker_info"))["fsync_thread"]
            finally:
                await c.close()

    assert arun(info("sync")) == "native"
    assert arun(info("async")) == "python"
