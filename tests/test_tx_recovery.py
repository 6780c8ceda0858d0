"""A commit whose op record was torn away is still one outcome after restart."""

from __future__ import annotations

import os

from conftest import arun
from txmq.broker.testing import running_broker
from txmq.store import StoreReader
from wireclient import RawClient


def test_commit_without_its_op_record_is_repaired_not_committed_twice(tmp_path):
    data = tmp_path / "data"

    async def first():
        async with running_broker(data, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            h = await c.ok("send", {"topic": "t", "body": b"m", "properties": {"TRAN_MSG": "true", "PGROUP": "g"}})
            await c.ok("end_transaction", {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                           "half_offset": h["half_offset"], "state": "commit"})
            await c.close()
            return h

    h = arun(first())
    # cut the op record (the last record) as a torn write would, and forget the checkpoint
    reader = StoreReader(data)
    last = list(reader.scan())[-1]
    assert last.topic == "RMQ_SYS_TRANS_OP_HALF_TOPIC"
    seg_start, path, _ = reader.segments()[-1]
    os.truncate(path, last.commit_log_offset - seg_start + 10)
    os.remove(data / "checkpoint")

    async def second():
        async with running_broker(data, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            assert (await c.ok("tx_offsets"))["pending"] == 0
            r = await c.ok("end_transaction", {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                               "half_offset": h["half_offset"], "state": "commit", "from_check": True})
            assert r["status"] == "already"
            msgs = []
            for q in range(4):
                msgs += (await c.ok("pull", {"topic": "t", "queue_id": q, "offset": 0}))["messages"]
            assert len(msgs) == 1
            await c.close()

    arun(second())
