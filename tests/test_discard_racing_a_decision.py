"""A check pass's discard racing a commit of the same transaction.

The producer's answer to a check-back arrives in the same loop iteration as
the pass step that collects discards. The pass leaves a transaction alone
while its outcome is being written (TransactionService.deciding), so no
discard record follows the op record in the log: the running index and a
rebuild from the log agree on "committed", and after a restart the
transaction is not listed as discarded nor committed a second time by a
replay.
"""
import asyncio

from txhelpers import G, arun, half_fields, pull_all
from txmq.broker.transactions.indexfile import remove_db
from txmq.broker.clock import ManualClock
from txmq.broker.testing import running_broker
from txmq.broker.transactions.index import Outcome, rebuild
from wireclient import RawClient


def test_commit_racing_a_discard_agrees_with_a_rebuild(tmp_path):
    data = tmp_path / "data"
    clock = ManualClock()

    async def first():
        async with running_broker(data, clock=clock, check_interval_s=3600, max_checks=1) as b:
            core = b.core
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": [G]})
            h = await c.ok("send", half_fields())
            clock.advance(10)
            assert (await core.check.run_pass())["checked"] == 1
            pf = (await c.wait_push()).fields  # the check-back for the copy (checks=1 == max_checks)
            clock.advance(10)
            loop = asyncio.get_running_loop()
            box = {}
            # The producer's answer to the check-back is handled in the same loop
            # iteration as the step of the check pass that collects discards.
            loop.call_soon(lambda: box.setdefault("end", core.tx.end_transaction(
                G, pf["tx_id"], pf["commit_log_offset"], pf["half_offset"], "commit", "check")))
            r = await asyncio.ensure_future(core.check.run_pass())
            reply = await box["end"]
            assert reply["status"] == "ok" and reply["outcome"] == "committed"
            assert r["discarded"] == 0  # the pass leaves a transaction alone while its outcome is being written
            live = core.tx.index.outcome(h["tx_id"])
            rebuilt = rebuild(core.store).outcome(h["tx_id"])
            assert len(await pull_all(c)) == 1
            await c.close()
            return h, live, rebuilt

    h, live, rebuilt = arun(first())
    assert live is Outcome.COMMITTED
    # The index must agree with what a restart computes from the log:
    assert rebuilt is live, f"runtime index says {live.name}, rebuild from the log says {rebuilt.name}"


def test_after_restart_a_replay_does_not_commit_a_second_time(tmp_path):
    data = tmp_path / "data"
    clock = ManualClock()

    async def first():
        async with running_broker(data, clock=clock, check_interval_s=3600, max_checks=1) as b:
            core = b.core
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": [G]})
            h = await c.ok("send", half_fields())
            clock.advance(10)
            await core.check.run_pass()
            pf = (await c.wait_push()).fields
            clock.advance(10)
            loop = asyncio.get_running_loop()
            box = {}
            loop.call_soon(lambda: box.setdefault("end", core.tx.end_transaction(
                G, pf["tx_id"], pf["commit_log_offset"], pf["half_offset"], "commit", "check")))
            await asyncio.ensure_future(core.check.run_pass())
            assert (await box["end"])["outcome"] == "committed"
            assert len(await pull_all(c)) == 1
            await c.close()
            return h

    h = arun(first())
    remove_db(data)  # the index rebuilt from the log alone

    async def second():
        async with running_broker(data, clock=clock, check_interval_s=3600, max_checks=1) as b:
            c = await RawClient.open(b.address)
            lst = (await c.ok("discard_list", {}))["discarded"]
            r = await c.ok("discard_replay", {"to": "commit", "refs": [{"tx_id": h["tx_id"]}]})
            msgs = await pull_all(c)
            await c.close()
            return lst, r, msgs

    lst, r, msgs = arun(second())
    assert len(msgs) == 1, f"committed message delivered {len(msgs)} times (replay result {r})"
    assert [x["tx_id"] for x in lst] == [], f"a committed transaction is listed as discarded after restart: {lst}"
