"""A repeated end_transaction is answered "already" only once the first outcome is durable.

decide() enters the outcome in the index and releases the deciding gate in
`shape`, after the write but before the fsync. A duplicate waiting on the
gate (or arriving later) must wait for the first outcome's records to be
durable (sync flush: fsynced) before it is told "already committed"; when
that fsync fails, the duplicate gets the error too, never "already".
"""
import asyncio
import errno

from txhelpers import G, arun, half_fields
from txmq.broker.testing import running_broker
from txmq.wire import TxmqError
from wireclient import RawClient


def test_duplicate_commit_is_not_acknowledged_when_the_first_one_fails_to_fsync(tmp_path):
    data = tmp_path / "data"

    async def go():
        async with running_broker(data, check_interval_s=3600, flush="sync", flush_interval_s=3600) as b:
            core = b.core
            c = await RawClient.open(b.address)
            h = await c.ok("send", half_fields())

            # The fsync fails whichever thread runs it: the Python one (Store.sync) or the compiled
            # one, whose result the loop hands to Store.end_sync.
            def broken_sync(block=True):
                raise OSError(errno.EIO, "fsync failed")
            real_sync, real_end = core.store.sync, core.store.end_sync
            core.store.sync = broken_sync
            core.store.end_sync = lambda job, error: real_end(job, OSError(errno.EIO, "fsync failed"))
            try:
                f1 = core.tx.end_transaction(G, h["tx_id"], h["commit_log_offset"], h["half_offset"], "commit", "producer")
                f2 = core.tx.end_transaction(G, h["tx_id"], h["commit_log_offset"], h["half_offset"], "commit", "check")
                r = await asyncio.gather(f1, f2, return_exceptions=True)
            finally:
                core.store.sync, core.store.end_sync = real_sync, real_end
            await c.close()
            return r

    first, second = arun(go())
    assert isinstance(first, TxmqError), first  # the producer is told the commit failed to flush...
    # ...and so is the duplicate: nothing was fsynced, so it is not "already committed":
    assert isinstance(second, TxmqError), f"duplicate answered {second} although the outcome is not durable"
