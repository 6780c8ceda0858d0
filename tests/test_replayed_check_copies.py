"""Check copies of a replayed transaction do not re-open a later discard on rebuild.

Every copy of a replayed transaction keeps TXMQ_REPLAYED, whose value is the
commit-log offset of the discard record the replay re-opened
(service.copy_properties): a stale check copy written after a later discard
(`check_now` racing a pass) names the old discard, not the new one, so a
rebuild from the log agrees with the running broker that it is discarded."""
import asyncio

from txhelpers import G, arun, half_fields
from txmq.broker.clock import ManualClock
from txmq.broker.testing import running_broker
from txmq.broker.transactions.index import Outcome, rebuild
from wireclient import RawClient


def test_a_stale_check_copy_of_a_replayed_tx_does_not_reopen_it_on_rebuild(tmp_path):
    clock = ManualClock()

    async def go():
        async with running_broker(tmp_path / "data", clock=clock, check_interval_s=3600, max_checks=1) as b:
            core = b.core
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": [G]})
            h = await c.ok("send", half_fields())
            tx = h["tx_id"]
            for _ in range(2):  # one check, then discarded (max_checks=1)
                clock.advance(10)
                await core.check.run_pass()
            assert core.tx.index.outcome(tx) is Outcome.DISCARDED
            await c.ok("discard_replay", {"to": "half", "refs": [{"tx_id": tx}]})
            clock.advance(10)
            assert (await core.check.run_pass())["checked"] == 1  # check copy, keeps TXMQ_REPLAYED
            clock.advance(10)
            t_pass = asyncio.ensure_future(core.check.run_pass())      # collects + submits the discard
            t_now = asyncio.ensure_future(core.check.check_now(tx))    # operator "check now", same iteration
            r, _ = await asyncio.gather(t_pass, t_now)
            assert r["discarded"] == 1
            live = core.tx.index.outcome(tx)
            rebuilt = rebuild(core.store).outcome(tx)
            await c.close()
            return live, rebuilt

    live, rebuilt = arun(go())
    assert live is Outcome.DISCARDED
    assert rebuilt is live, f"runtime {live.name}, rebuild {rebuilt.name}"
