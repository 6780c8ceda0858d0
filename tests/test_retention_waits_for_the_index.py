"""Retention never deletes an undecided half message, even while the index is still being built at start.

The retention janitor protects the segments holding pending transactions
(core.tx.index.pending). At start the index is read from txindex.db or
rebuilt from the log; until it is ready the janitor deletes nothing, so a
half message past retention is moved to the discard topic by the next
check pass instead of being lost."""
import asyncio

import txmq.broker.server as server
from txmq.broker.transactions import keeper
from txhelpers import T, arun, half_fields
from txmq.broker.transactions.indexfile import remove_db
from txmq.broker.clock import ManualClock
from txmq.broker.testing import running_broker
from wireclient import RawClient


import pytest


@pytest.mark.parametrize("snap", [False, True], ids=["rebuild", "snapshot"])
@pytest.mark.parametrize("slow", [False, True], ids=["control-index-ready", "index-still-building"])
def test_retention_keeps_a_pending_half_while_the_index_is_built(tmp_path, monkeypatch, slow, snap):
    data = tmp_path / "data"
    clock = ManualClock()
    kw = dict(clock=clock, check_interval_s=3600, retention_s=5, segment_size=4096)

    async def first():
        async with running_broker(data, **kw) as b:
            c = await RawClient.open(b.address)
            h = await c.ok("send", half_fields())  # no producer online: it stays pending
            clock.advance(1)
            for _ in range(40):  # roll a few segments
                await c.ok("send", {"topic": T, "body": b"x" * 400})
            await c.close()
            return h

    arun(first())
    if not snap:
        remove_db(data)  # the index rebuilt from the log alone
    clock.advance(3600)  # the first segment is past retention; the half in it is still undecided

    async def slow_build(self, t0, _orig=keeper.IndexKeeper._build):
        await asyncio.sleep(0.5)  # a big log: the rebuild takes a while
        return await _orig(self, t0)

    monkeypatch.setattr(server, "JANITOR_INTERVAL_S", 0.1)
    if slow:
        monkeypatch.setattr(keeper.IndexKeeper, "_build", slow_build)

    async def second():
        async with running_broker(data, **kw) as b:
            c = await RawClient.open(b.address)
            offs = await c.ok("tx_offsets")
            try:
                r = await b.core.check.run_pass()  # past retention: it must be moved to the discard topic
            except Exception as e:
                r = repr(e)
            await c.close()
            return offs, r

    offs, r = arun(second())
    assert offs["pending"] == 1, f"the undecided half message was deleted by retention before the index knew it: {offs}"
    assert isinstance(r, dict) and r["discarded"] == 1, f"check pass: {r}"
