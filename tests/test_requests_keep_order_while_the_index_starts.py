"""Transactional requests that wait for the index (right after a start) keep their arrival order.

While the transaction index is being built, half messages wait for it. The
moment it is ready, the waiting requests resume one loop iteration later;
a request arriving in between must queue behind them, or a producer's
pipelined half messages are stored out of the order it sent them in.
"""

import asyncio

from txhelpers import G, arun
from txmq.broker.native import handlers
from txmq.broker.testing import running_broker


def half(i: int) -> dict:
    return {"topic": "t-order", "queue_id": 0, "body": b"m%d" % i, "properties": {"TRAN_MSG": "true", "PGROUP": G}}


def test_half_messages_arriving_as_the_index_becomes_ready_are_stored_in_arrival_order(tmp_path):
    async def go():
        async with running_broker(tmp_path / "data", check_interval_s=3600) as b:
            core = b.core
            core.keeper.ready.clear()  # as right after a start: the index is being built
            replies = [handlers.send(core, None, half(i)) for i in range(3)]
            core.keeper.ready.set()
            # arriving before the three waiters have resumed
            replies += [handlers.send(core, None, half(i)) for i in range(3, 6)]
            done = await asyncio.gather(*[r if not isinstance(r, dict) else asyncio.sleep(0, r) for r in replies])
            assert core.keeper.queued == 0
            return [r["half_offset"] for r in done], [r["commit_log_offset"] for r in done]

    half_offsets, cl_offsets = arun(go())
    assert half_offsets == sorted(half_offsets) and len(set(half_offsets)) == 6
    assert cl_offsets == sorted(cl_offsets)
