"""Torn writes at the broker level: a restart on a torn directory drops exactly the torn record, says so, and serves.

tests/test_store_recovery.py covers the store's recovery byte by byte; here
the same damage is put under a whole broker: it must start, report the cut
(log event ``recovery_truncated`` and ``stats`` gauges ``recovery``), serve
everything before the torn record, and reuse the torn record's place. The
checkpoint is set back to just before the last record, as after a crash that
came between a write and the next checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from conftest import arun
from txmq.broker.testing import running_broker
from txmq.store import StoreReader
from txmq.store.checkpoint import Checkpoint, write_checkpoint
from wireclient import RawClient

pytestmark = pytest.mark.fault

T = "torn"
REASONS = ("torn header", "torn record", "bad magic", "bad size", "crc mismatch", "bad lengths", "offset mismatch", "bad tx_type")


class Events(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def events():
    h = Events()
    lg = logging.getLogger("txmq")
    lg.addHandler(h)
    yield h
    lg.removeHandler(h)


def broker(data: Path):
    return running_broker(data, check_interval_s=3600)


def last_record(data: Path):
    reader = StoreReader(data)
    try:
        rec = list(reader.scan())[-1]
        seg_start, path, _ = reader.segments()[-1]
        return rec, Path(path), seg_start
    finally:
        reader.close()


def crash_before_last(data: Path, rec) -> None:
    """Pretend the broker died before checkpointing the last record."""
    write_checkpoint(data / "checkpoint", Checkpoint(rec.commit_log_offset, rec.commit_log_offset))


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    """20 plain messages on queue 0 of T; the last record is the 20th."""
    data = tmp_path_factory.mktemp("torn") / "base"

    async def go():
        async with broker(data) as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": T, "queues": 1})
            for i in range(20):
                await c.ok("send", {"topic": T, "queue_id": 0, "body": f"m{i:02d}".encode()})
            await c.close()

    arun(go())
    rec, _, _ = last_record(data)
    assert rec.body == b"m19"
    crash_before_last(data, rec)
    return data, rec


async def serve_after_damage(data: Path, rec) -> dict:
    async with broker(data) as b:
        c = await RawClient.open(b.address)
        r = await c.ok("pull", {"topic": T, "queue_id": 0, "offset": 0, "max_count": 100})
        bodies = [m["body"] for m in r["messages"]]
        assert bodies == [f"m{i:02d}".encode() for i in range(19)]  # exactly the torn record is gone
        new = await c.ok("send", {"topic": T, "queue_id": 0, "body": b"after"})
        assert (new["queue_offset"], new["commit_log_offset"]) == (19, rec.commit_log_offset)  # its place is reused
        gauges = (await c.ok("stats"))["gauges"]
        await c.close()
        return gauges["recovery"]


def test_torn_last_record_cut_at_every_byte_is_dropped_and_reported(plain_dir, tmp_path, events):
    base, rec = plain_dir
    for keep in range(0, rec.size):
        d = tmp_path / f"cut{keep}"
        shutil.copytree(base, d)
        _, seg, seg_start = last_record(d)
        os.truncate(seg, rec.commit_log_offset - seg_start + keep)
        events.lines.clear()
        recovery = arun(serve_after_damage(d, rec))
        if keep == 0:  # the write never started: a clean log one record shorter, nothing to report
            assert recovery["dropped_bytes"] == 0 and recovery["reason"] is None
            assert not [ln for ln in events.lines if "recovery_truncated" in ln]
        else:
            assert recovery["dropped_bytes"] == keep and recovery["truncated_at"] == rec.commit_log_offset, (keep, recovery)
            assert recovery["reason"].startswith("torn") and str(rec.commit_log_offset) in recovery["reason"]
            logged = [ln for ln in events.lines if "event=recovery_truncated" in ln]
            assert len(logged) == 1 and f"dropped_bytes={keep} " in logged[0] and f"at={rec.commit_log_offset}" in logged[0]
        shutil.rmtree(d)


def test_flipped_byte_anywhere_in_the_last_record_drops_exactly_it(plain_dir, tmp_path, events):
    base, rec = plain_dir
    for pos in range(rec.size):
        d = tmp_path / f"flip{pos}"
        shutil.copytree(base, d)
        _, seg, seg_start = last_record(d)
        with open(seg, "r+b") as f:
            at = rec.commit_log_offset - seg_start + pos
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x01]))
        events.lines.clear()
        recovery = arun(serve_after_damage(d, rec))
        assert recovery["dropped_bytes"] == rec.size and recovery["truncated_at"] == rec.commit_log_offset, (pos, recovery)
        assert recovery["reason"].startswith(REASONS), recovery["reason"]
        assert [ln for ln in events.lines if "event=recovery_truncated" in ln]
        shutil.rmtree(d)


def test_torn_rollback_op_leaves_the_transaction_pending_with_one_outcome(tmp_path):
    """The rollback was never durable, so the transaction is pending again; it still gets exactly one outcome."""
    data = tmp_path / "data"
    tx = {"TRAN_MSG": "true", "PGROUP": "g"}

    async def first():
        async with broker(data) as b:
            c = await RawClient.open(b.address)
            h = await c.ok("send", {"topic": T, "body": b"tx", "properties": tx})
            await c.ok("end_transaction", {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                           "half_offset": h["half_offset"], "state": "rollback"})
            await c.close()
            return h

    h = arun(first())
    rec, seg, seg_start = last_record(data)
    assert rec.topic == "RMQ_SYS_TRANS_OP_HALF_TOPIC" and rec.tx_type == 3
    crash_before_last(data, rec)
    os.truncate(seg, rec.commit_log_offset - seg_start + rec.size // 2)

    async def second():
        async with broker(data) as b:
            c = await RawClient.open(b.address)
            assert (await c.ok("tx_offsets"))["pending"] == 1
            end = {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"], "half_offset": h["half_offset"]}
            assert (await c.ok("end_transaction", {**end, "state": "rollback"}))["status"] == "ok"
            code, f = await c.req("end_transaction", {**end, "state": "commit"})
            assert f["name"] == "TX_CONFLICT"
            assert (await c.ok("pull", {"topic": T, "queue_id": 0, "offset": 0}))["messages"] == []
            await c.close()

    arun(second())


def test_torn_half_message_is_unknown_after_restart(tmp_path):
    data = tmp_path / "data"

    async def first():
        async with broker(data) as b:
            c = await RawClient.open(b.address)
            await c.ok("send", {"topic": T, "body": b"before"})
            h = await c.ok("send", {"topic": T, "body": b"tx", "properties": {"TRAN_MSG": "true", "PGROUP": "g"}})
            await c.close()
            return h

    h = arun(first())
    rec, seg, seg_start = last_record(data)
    assert rec.topic == "RMQ_SYS_TRANS_HALF_TOPIC"
    crash_before_last(data, rec)
    os.truncate(seg, rec.commit_log_offset - seg_start + 30)

    async def second():
        async with broker(data) as b:
            c = await RawClient.open(b.address)
            assert (await c.ok("tx_offsets"))["pending"] == 0
            code, f = await c.req("end_transaction", {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                                      "half_offset": h["half_offset"], "state": "commit"})
            assert f["name"] == "TX_NOT_FOUND"
            await c.close()

    arun(second())
