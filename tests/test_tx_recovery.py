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


def _index_view(idx):
    pend = {t: (p.half_offset, p.cl_offset, p.checks, p.group, p.topic) for t, p in idx.pending.items()}
    dec = {t: (d.outcome, d.decided_by, d.half_offset, d.cl_offset) for t, d in idx.decided.items()}
    return pend, dec, list(map(tuple, idx.ops_since_progress))


def test_clean_shutdown_snapshot_loads_the_same_index_and_a_stale_one_is_ignored(tmp_path, caplog):
    import logging

    from txmq.broker.clock import ManualClock
    from txmq.broker.txindex import SNAPSHOT_FILE, rebuild

    data = tmp_path / "data"
    clock = ManualClock()

    async def load(extra_send: bool):
        async with running_broker(data, clock=clock, check_interval_s=3600, max_checks=1) as b:
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": ["g"]})
            hs = [await c.ok("send", {"topic": "t", "body": b"m%d" % i, "properties": {"TRAN_MSG": "true", "PGROUP": "g"}}) for i in range(6)]
            for h, state in zip(hs, ["commit", "rollback", "unknown"]):
                await c.ok("end_transaction", {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                               "half_offset": h["half_offset"], "state": state})
            clock.advance(10)
            await b.core.check.run_pass()  # check copies for the undecided ones
            clock.advance(10)
            await b.core.check.run_pass()  # max_checks=1: discards
            view = _index_view(b.core.tx.index)
            await c.close()
            return view

    live = arun(load(False))
    assert (data / SNAPSHOT_FILE).exists()
    reader = StoreReader(data)
    from txmq.broker.check import CheckProgress

    prog = CheckProgress(data / "txcheck.json")
    assert _index_view(rebuild(reader, prog.half, prog.op)) == live

    async def restart():
        async with running_broker(data, clock=clock, check_interval_s=3600) as b:
            return _index_view(b.core.tx.index)

    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        assert arun(restart()) == live
    assert "source=snapshot" in caplog.text
    # the log moves on without a clean shutdown: the snapshot no longer matches and is not used
    async def append_and_crash():
        async with running_broker(data, clock=clock, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            await c.ok("send", {"topic": "t", "body": b"later"})
            await c.close()
            b.broker._save_snapshot = lambda: None  # as if killed: no new snapshot
    arun(append_and_crash())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        assert arun(restart()) == live
    assert "source=snapshot" not in caplog.text
