"""A broker on a damaged data directory keeps serving: queues past a bad record, transactions around one."""

from __future__ import annotations

import os

import pytest

from txhelpers import T, arun, end, half_fields
from txmq.broker.testing import running_broker
from txmq.broker.transactions.indexfile import remove_db
from txmq.constants import OP_TOPIC
from txmq.store import StoreReader
from wireclient import RawClient


def flip(data_dir, offset: int) -> None:
    names = sorted(os.listdir(data_dir / "commitlog"))
    start = [int(n) for n in names if int(n) <= offset][-1]
    with open(data_dir / "commitlog" / f"{start:020d}", "r+b") as f:
        f.seek(offset - start)
        b = f.read(1)
        f.seek(offset - start)
        f.write(bytes([b[0] ^ 1]))


def test_a_damaged_record_does_not_wedge_its_queue_and_is_reported_once(tmp_path):
    data = tmp_path / "data"

    async def first():
        async with running_broker(data, flush="sync") as b:
            c = await RawClient.open(b.address)
            out = [await c.ok("send", {"topic": "t1", "queue_id": 0, "body": b"%d" % i}) for i in range(100)]
            await c.close()
            return out

    sent = arun(first())
    victim = sent[63]
    with StoreReader(data) as r:
        size = r.read(victim["commit_log_offset"]).size
    flip(data, victim["commit_log_offset"] + size - 30)

    async def second():
        async with running_broker(data, flush="sync") as b:
            c = await RawClient.open(b.address)
            await c.ok("send", {"topic": "t1", "queue_id": 0, "body": b"after"})
            bodies, offset = [], 0
            for _ in range(20):  # a consumer's loop: small batches, each one past the last
                r = await c.ok("pull", {"topic": "t1", "queue_id": 0, "offset": offset, "max_count": 16, "wait_ms": 0})
                bodies += [m["body"] for m in r["messages"]]
                if r["next_offset"] == offset:
                    break
                offset = r["next_offset"]
            info = await c.ok("broker_info", {})
            stats = await c.ok("stats", {})
            await c.close()
            return bodies, offset, info, stats

    bodies, offset, info, stats = arun(second())
    assert bodies == [b"%d" % i for i in range(100) if i != 63] + [b"after"]
    assert offset == 101
    assert info["damaged_records"] == 1
    places = stats["gauges"]["damaged"]["places"]
    assert [p["offset"] for p in places] == [victim["commit_log_offset"]]
    assert places[0]["reason"] == f"crc mismatch at {victim['commit_log_offset']}"


def _damage_op_record(data, also_before: bool = False):
    remove_db(data)  # the index is rebuilt from the log alone, which reads the damaged record
    with StoreReader(data) as reader:
        recs = list(reader.scan())
    op = [r for r in recs if r.topic == OP_TOPIC][0]
    flip(data, op.commit_log_offset + op.size - 1)
    if also_before:  # another damaged record in the window the commit repair reads back from the op record
        flip(data, recs[0].commit_log_offset + recs[0].size - 1)


@pytest.mark.parametrize("recovery_sees_it_first, other_damage_before", [(False, False), (True, False), (False, True)])
def test_a_damaged_op_record_leaves_transactions_available_and_its_commit_stays_single(tmp_path, recovery_sees_it_first,
                                                                                      other_damage_before):
    data = tmp_path / "data"

    async def first():
        async with running_broker(data, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            await c.ok("send", {"topic": T, "body": b"before"})  # a record the second damage may hit
            await c.ok("hello", {"producer_groups": ["g"]})
            h = await c.ok("send", half_fields(b"committed"))
            await c.ok("end_transaction", end(h, "commit"))
            h2 = await c.ok("send", half_fields(b"open"))
            await c.ok("send", {"topic": T, "body": b"after"})  # so the op is not the tail
            await c.close()
            return h, h2

    h, h2 = arun(first())
    _damage_op_record(data, also_before=other_damage_before)
    if recovery_sees_it_first:  # no checkpoint: recovery reads the whole log and reports the place before the index does
        os.unlink(data / "checkpoint")

    async def second():
        async with running_broker(data, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            again = await c.ok("end_transaction", end(h, "commit"))  # its commit message was found: committed
            other = await c.ok("end_transaction", end(h2, "rollback"))  # the rest of the service works
            r = await c.ok("pull", {"topic": T, "queue_id": h["queue_id"] if "queue_id" in h else 0, "offset": 0, "max_count": 100, "wait_ms": 0})
            info = await c.ok("broker_info", {})
            await c.close()
            return again, other, r, info

    again, other, r, info = arun(second())
    assert again["status"] == "already" and again["outcome"] == "committed"
    assert other["status"] == "ok"
    assert [m["body"] for m in r["messages"]].count(b"committed") <= 1
    assert info["damaged_records"] == 1  # the op record; the other is not read at start, and no made-up place is


def test_offline_inspection_builds_the_index_around_a_damaged_op_record(tmp_path):
    from clihelpers import err, txmq

    data = tmp_path / "data"

    async def first():
        async with running_broker(data, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            h = await c.ok("send", half_fields(b"committed"))
            await c.ok("end_transaction", end(h, "commit"))
            await c.ok("send", half_fields(b"open"))
            await c.ok("send", {"topic": T, "body": b"after"})
            await c.close()

    arun(first())
    _damage_op_record(data)  # and no index file: it is built from the log
    for what in ("half", "offsets", "tx"):
        args = ["inspect", what, "--data-dir", str(data), "-o", "json"] + (["0"] if what == "tx" else [])
        r = txmq(*args)
        assert r.returncode == 0 and "damaged record(s) skipped" in err(r) and "Traceback" not in err(r), (what, err(r))


def test_a_raw_pull_over_a_damaged_record_gets_the_usual_reply_which_skips_and_reports_it(tmp_path):
    data = tmp_path / "data"

    async def first():
        async with running_broker(data, flush="sync") as b:
            c = await RawClient.open(b.address)
            out = [await c.ok("send", {"topic": "t1", "queue_id": 0, "body": b"%d" % i}) for i in range(50)]
            await c.close()
            return out

    sent = arun(first())
    victim = sent[30]
    with StoreReader(data) as r:
        size = r.read(victim["commit_log_offset"]).size
    flip(data, victim["commit_log_offset"] + size - 1)

    async def second():
        async with running_broker(data, flush="sync") as b:
            c = await RawClient.open(b.address)
            pull = {"topic": "t1", "queue_id": 0, "max_count": 20, "raw": True}
            before = await c.ok("pull", {**pull, "offset": 0})
            over = await c.ok("pull", {**pull, "offset": 20})
            info = await c.ok("broker_info", {})
            await c.close()
            return before, over, info

    before, over, info = arun(second())
    assert before["count"] == 20 and before["next_offset"] == 20 and "messages" not in before
    with StoreReader(data) as r:
        assert before["records"] == b"".join(r.read_many([s["commit_log_offset"] for s in sent[:20]], raw=True)[i][0]
                                             for i in range(20))
    assert "records" not in over
    assert [m["body"] for m in over["messages"]] == [b"%d" % i for i in range(20, 40) if i != 30]
    assert over["next_offset"] == 40
    assert info["damaged_records"] == 1
