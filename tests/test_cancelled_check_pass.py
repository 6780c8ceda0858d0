"""A check pass cancelled while its append is in flight leaves the index matching the log.

CheckService.stop() (at shutdown) cancels a pass that may be awaiting its
discard or check-copy append. The batch is written anyway, so its `shape`
must still run (Appender._settle_written) and enter the records in the
index: otherwise the clean-shutdown snapshot would persist an index that
does not match the log."""
import asyncio

from txhelpers import G, arun, half_fields
from txmq.broker.clock import ManualClock
from txmq.broker.testing import running_broker
from txmq.broker.transactions.index import rebuild
from wireclient import RawClient


def test_a_cancelled_pass_still_enters_its_discard_in_the_index(tmp_path):
    clock = ManualClock()
    data = tmp_path / "data"

    async def go():
        async with running_broker(data, clock=clock, check_interval_s=3600, max_checks=1) as b:
            core = b.core
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": [G]})
            h = await c.ok("send", half_fields())
            clock.advance(10)
            await core.check.run_pass()
            clock.advance(10)
            t = asyncio.ensure_future(core.check.run_pass())  # will discard (checks == max_checks)
            await asyncio.sleep(0)   # the pass submits its discard append...
            t.cancel()               # ...and is cancelled (as CheckService.stop() does at shutdown)
            try:
                await t
            except asyncio.CancelledError:
                pass
            await asyncio.sleep(0.05)
            live = core.tx.index.outcome(h["tx_id"])
            rebuilt = rebuild(core.store).outcome(h["tx_id"])
            await c.close()
            return live, rebuilt

    live, rebuilt = arun(go())
    assert rebuilt is live, f"runtime {live.name}, rebuild {rebuilt.name}"
