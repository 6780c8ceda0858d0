"""After a full disk, every writer that met it writes again on its own, so the broker says disk_ok without new traffic."""

import asyncio
import errno

from txmq.broker.testing import running_broker

from conftest import arun, eventually


async def _full_then_freed(core, writer, flush, where: str) -> None:
    """Make writer.flush meet a full disk once through flush() with nothing new to write, free the disk, and wait for disk_ok."""
    real = writer.flush
    full = [True]

    def failing(*args, **kw):
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kw)

    writer.flush = failing
    assert await flush() is False  # a meta-only flush (a window load's, the build's last) meets the full disk
    assert core.disk.full and where in core.disk.failing
    full[0] = False  # space returns; nothing is sent meanwhile
    # the writer retries every second on its own; 20 s is the upper bound, not the margin
    await eventually(lambda: not core.disk.full, timeout=20, what=f"{where} to write again")


def test_a_schedule_flush_that_failed_with_nothing_to_write_is_retried_until_it_succeeds(tmp_path):
    """The schedule's window loads flush its meta every WINDOW_S/2 (30 s); a failure there must not wait for the next one."""

    async def go():
        async with running_broker(tmp_path / "d") as b:
            sched = b.core.scheduled.keeper
            await asyncio.wait_for(sched.ready.wait(), 30)
            assert not sched.added and not sched.removed
            await _full_then_freed(b.core, sched.db, sched.flush, "timers")

    arun(go())


def test_a_transaction_index_flush_that_failed_with_nothing_dirty_is_retried_until_it_succeeds(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            keeper = b.core.keeper
            await asyncio.wait_for(keeper.ready.wait(), 30)
            assert not b.core.tx.index.dirty
            await _full_then_freed(b.core, keeper._writer, keeper.flush, "index")

    arun(go())
