"""After a full disk, every writer that met it writes again on its own, so the broker says disk_ok without new traffic."""

import asyncio
import errno

from txmq.broker.testing import running_broker

from conftest import arun


def test_a_schedule_flush_that_failed_with_nothing_to_write_is_retried_until_it_succeeds(tmp_path):
    """The schedule's window loads flush its meta every WINDOW_S/2 (30 s); a failure there must not wait for the next one."""

    async def go():
        async with running_broker(tmp_path / "d") as b:
            sched = b.core.scheduled
            await asyncio.wait_for(sched.ready.wait(), 30)
            db = sched.db
            real = db.flush
            full = [True]

            def flush(*args, **kw):
                if full[0]:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real(*args, **kw)

            db.flush = flush
            assert not sched.added and not sched.removed
            assert await sched._flush() is False  # a meta-only flush (as a window load does) meets the full disk
            assert b.core.disk.full and "timers" in b.core.disk.failing
            full[0] = False  # space returns; nothing is sent, no window is due for 30 s
            for _ in range(200):  # the flush loop retries every FLUSH_S (1 s); 20 s is the upper bound, not the margin
                if not b.core.disk.full:
                    break
                await asyncio.sleep(0.1)
            assert not b.core.disk.full, b.core.disk.failing

    arun(go())


def test_a_transaction_index_flush_that_failed_with_nothing_dirty_is_retried_until_it_succeeds(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            keeper = b.core.keeper
            await asyncio.wait_for(keeper.ready.wait(), 30)
            writer = keeper._writer
            real = writer.flush
            full = [True]

            def flush(*args, **kw):
                if full[0]:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real(*args, **kw)

            writer.flush = flush
            assert not b.core.tx.index.dirty
            assert await keeper.flush() is False
            assert b.core.disk.full and "index" in b.core.disk.failing
            full[0] = False
            for _ in range(200):  # retried every INDEX_FLUSH_S (1 s); 20 s is the upper bound, not the margin
                if not b.core.disk.full:
                    break
                await asyncio.sleep(0.1)
            assert not b.core.disk.full, b.core.disk.failing

    arun(go())
