"""A producer group whose every producer is gone: its transactions wait without spending checks; check-backs
resume when a producer of the group comes back. Real time, real client library (txmq.client).

tests/test_tx.py proves the same with an injected clock; here the check
service runs on its own every 0.2 s, so this also covers its timing loop and
the registry's reaction to a producer's connection closing.
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import arun
from txmq.broker.testing import running_broker
from txmq.client import LocalTransactionState, Message, TransactionListener, TransactionProducer
from wireclient import RawClient

pytestmark = [pytest.mark.fault, pytest.mark.slow]

G = "orphans"
H = "alive"
INTERVAL = 0.2
MAX_CHECKS = 2


class Answer(TransactionListener):
    def __init__(self, execute: LocalTransactionState, check: LocalTransactionState) -> None:
        self.execute, self.check, self.checked = execute, check, []

    async def execute_local_transaction(self, message, arg):
        return self.execute

    async def check_local_transaction(self, message):
        self.checked.append(message.tx_id)
        return self.check


async def wait_until(pred, timeout: float, what: str):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        v = await pred()
        if v:
            return v
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_orphaned_group_spends_no_checks_and_resumes_when_a_producer_returns(tmp_path):
    async def go():
        async with running_broker(tmp_path / "data", check_interval_s=INTERVAL, transaction_timeout_s=0.5, max_checks=MAX_CHECKS) as b:
            admin = await RawClient.open(b.address)
            gone = Answer(LocalTransactionState.UNKNOW, LocalTransactionState.UNKNOW)
            async with TransactionProducer(G, gone, b.address) as p:
                r = await p.send_in_transaction(Message("orders", b"orphaned order"))
                assert await r.end == "pending"
            # every producer of G is gone now; a producer of another group stays
            other = Answer(LocalTransactionState.UNKNOW, LocalTransactionState.ROLLBACK_MESSAGE)
            async with TransactionProducer(H, other, b.address) as ph:
                rh = await ph.send_in_transaction(Message("orders", b"other group"))
                passes0 = (await admin.ok("stats"))["counters"].get("check_passes", 0)
                await asyncio.sleep(12 * INTERVAL)  # many passes, more than MAX_CHECKS of them
                stats = await admin.ok("stats")
                assert stats["counters"]["check_passes"] - passes0 >= 6
                pend = await admin.ok("tx_pending", {"group": G})
                assert pend["total"] == 1
                row = pend["transactions"][0]
                assert row["tx_id"] == r.tx_id and row["checks"] == 0, row
                assert row["last_check_result"] == "no producer online"
                assert (await admin.ok("discard_list"))["discarded"] == []  # no check was spent, so none ran out
                off = await admin.ok("tx_offsets")
                assert off["half"]["progress"] <= r.half_offset  # the progress waits at the orphan
                # the live group was checked meanwhile (past the orphan in the half queue) and rolled back
                assert other.checked == [rh.tx_id]
                assert (await admin.ok("tx_pending", {"group": H}))["total"] == 0
                assert gone.checked == []
                assert stats["counters"].get("checks_sent", 0) == 1

            back = Answer(LocalTransactionState.UNKNOW, LocalTransactionState.COMMIT_MESSAGE)
            async with TransactionProducer(G, back, b.address):
                async def decided():
                    return (await admin.ok("tx_pending", {"group": G}))["total"] == 0
                await wait_until(decided, 5.0, "the returning producer's check-back")
                assert back.checked == [r.tx_id]
            msgs = []
            for q in range(4):
                msgs += (await admin.ok("pull", {"topic": "orders", "queue_id": q, "offset": 0}))["messages"]
            assert [m["body"] for m in msgs] == [b"orphaned order"]
            c = (await admin.ok("stats"))["counters"]
            assert c["checks_sent"] == 2 and c["checks_answered"] == 2
            assert c["committed_check"] == 1 and c["rolled_back_check"] == 1
            await admin.close()

    arun(go())
