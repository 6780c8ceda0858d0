"""A commit whose op record was torn away is still one outcome after restart."""

from __future__ import annotations

import json
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


def _index_view(idx, tx_ids):
    """What the index says of each transaction: pending fields, or the outcome and who decided it."""
    out = {}
    for t in sorted(tx_ids):
        p = idx.pending.get(t)
        if p is not None:
            out[t] = ("pending", p.half_offset, p.cl_offset, p.checks, p.group, p.topic, p.origin_cl_offset)
        else:
            d = idx.lookup(t)
            out[t] = None if d is None else (d.outcome.label, d.decided_by, d.half_offset, d.cl_offset, d.group, d.topic)
    return out, idx.discarded


def _full_view(data):
    """The index a rebuild from the log alone gives."""
    from txmq.broker.transactions.index import rebuild

    reader = StoreReader(data)
    try:
        idx = rebuild(reader)
        return _index_view(idx, idx.pending.keys() | idx.decided.keys())
    finally:
        reader.close()


def crash_on_exit(b) -> None:
    """Make the broker's stop leave the index file as a SIGKILL would: no flush after this point."""
    async def no_flush() -> None:
        pass

    if b.core.keeper._flush_task is not None:
        b.core.keeper._flush_task.cancel()
    b.core.keeper._final_flush = no_flush


async def _tx(c, state: str, body: bytes = b"x") -> dict:
    h = await c.ok("send", {"topic": "t", "body": body, "properties": {"TRAN_MSG": "true", "PGROUP": "g"}})
    await c.ok("end_transaction", {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                   "half_offset": h["half_offset"], "state": state})
    return h


def test_the_index_file_loads_the_index_a_rebuild_gives_and_one_that_does_not_fit_the_log_is_rebuilt(tmp_path, caplog):
    import logging
    import sqlite3

    from txmq.broker.clock import ManualClock
    from txmq.broker.transactions.indexfile import DB_FILE

    data = tmp_path / "data"
    clock = ManualClock()

    async def load():
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
            await c.close()
            return [h["tx_id"] for h in hs]

    ids = arun(load())
    assert (data / DB_FILE).exists()
    full = _full_view(data)
    assert set(full[0]) == set(ids) and full[1] == 4  # the 4 left undecided were discarded

    async def restart(crash: bool = False):
        async with running_broker(data, clock=clock, check_interval_s=3600) as b:
            if crash:
                crash_on_exit(b)
            return _index_view(b.core.tx.index, full_ids())

    def full_ids():
        return set(_full_view(data)[0])

    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        assert arun(restart()) == full
    assert "index=loaded records_read=0" in caplog.text
    # The log moves on (a transaction decided, another left pending) and the
    # broker dies before its next flush: the next start loads the file and
    # reads only what was written after it, and gets what a full rebuild gets.
    async def append_and_crash():
        async with running_broker(data, clock=clock, check_interval_s=3600) as b:
            crash_on_exit(b)
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": ["g"]})
            await c.ok("send", {"topic": "t", "body": b"later"})
            for state in ("commit", "unknown"):
                await _tx(c, state, b"after")
            await c.close()
    arun(append_and_crash())
    full = _full_view(data)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        assert arun(restart(crash=True)) == full
    assert "index=loaded records_read=3" in caplog.text
    # A file ahead of the log (as after a crash that cut the log's tail) is
    # not used: the index is rebuilt from the log, and the file written anew.
    def set_meta(key, value):
        db = sqlite3.connect(data / DB_FILE)
        db.execute("UPDATE meta SET value = ? WHERE key = ?", (value, key))
        db.commit()
        db.close()

    arun(restart())  # a clean shutdown: the file reflects the whole log
    set_meta("applied_to", 1 << 50)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        assert arun(restart()) == full
    assert "event=txindex_rebuild " in caplog.text and "index=rebuilt" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        assert arun(restart()) == full  # ... and the new file is used again
    assert "index=loaded records_read=0" in caplog.text
    # ... nor is one whose boundary record is not the log's,
    db = sqlite3.connect(data / DB_FILE)
    (boundary,) = db.execute("SELECT value FROM meta WHERE key = 'boundary'").fetchone()
    db.close()
    cl, crc = json.loads(boundary)
    set_meta("boundary", json.dumps([cl, crc ^ 1]))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        assert arun(restart()) == full
    assert "index=rebuilt" in caplog.text
    # ... nor a damaged file.
    with open(data / DB_FILE, "r+b") as f:
        f.write(b"garbage" * 20)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        assert arun(restart()) == full
    assert "index=rebuilt" in caplog.text
    # Lost altogether: rebuilt from the log alone.
    from txmq.broker.transactions.indexfile import remove_db

    remove_db(data)
    assert arun(restart()) == full


def test_a_start_after_a_crash_reads_only_the_records_after_the_last_flush(tmp_path, caplog):
    import logging

    data = tmp_path / "data"

    async def run_and_crash():
        async with running_broker(data, check_interval_s=3600) as b:
            crash_on_exit(b)
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": ["g"]})
            for state in ("commit", "rollback", "commit", "unknown", "commit"):
                await _tx(c, state)  # 9 records: 5 halves, 4 ops
            await b.core.keeper.flush()
            assert not b.core.tx.index.decided  # flushed decisions leave memory
            assert b.core.tx.index.lookup(next(iter(b.core.tx.index.pending))) is None
            for state in ("commit", "unknown"):  # after the flush: 3 records
                await _tx(c, state)
            await c.close()

    arun(run_and_crash())
    full = _full_view(data)

    async def restart():
        async with running_broker(data, check_interval_s=3600) as b:
            return _index_view(b.core.tx.index, full[0]), len(b.core.tx.index.pending)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        view, pending = arun(restart())
    assert view == full and pending == 2
    assert "index=loaded records_read=3" in caplog.text


def test_a_replayed_transaction_checked_again_is_still_pending_after_a_crash(tmp_path):
    """Check copies keep the replay mark: a start that reads past the replay's own copy
    (from the index file, or from the progress) still sees the discard undone."""
    from txmq.broker.clock import ManualClock

    data = tmp_path / "data"
    clock = ManualClock()

    async def first():
        async with running_broker(data, clock=clock, check_interval_s=3600, max_checks=1) as b:
            crash_on_exit(b)
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": ["g"]})
            h = await c.ok("send", {"topic": "t", "body": b"m", "properties": {"TRAN_MSG": "true", "PGROUP": "g"}})
            tx = h["tx_id"]
            clock.advance(10)
            await b.core.check.run_pass()  # a check copy
            clock.advance(10)
            await b.core.check.run_pass()  # max_checks=1: discarded
            assert b.core.tx.index.outcome(tx).label == "discarded"
            await c.ok("discard_replay", {"to": "half", "refs": [{"tx_id": tx}]})
            assert b.core.tx.index.outcome(tx).label == "pending"
            clock.advance(10)
            await b.core.check.run_pass()  # a check copy of the replayed copy; the progress passes the replay's copy
            assert b.core.check.progress.half > 2
            await c.close()
            return tx

    tx = arun(first())

    async def restart():
        async with running_broker(data, clock=clock, check_interval_s=3600) as b:
            return b.core.tx.index.outcome(tx).label

    assert arun(restart()) == "pending"


def test_a_half_the_check_service_cannot_read_holds_the_progress(tmp_path):
    """An unreadable pending half is not skipped: the progress stays before it, and the next
    readable pass checks it and moves on."""
    from txmq.broker.clock import ManualClock
    from txmq.store import CorruptRecordError

    clock = ManualClock()

    async def go():
        async with running_broker(tmp_path / "data", clock=clock, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": ["g"]})
            hs = [await c.ok("send", {"topic": "t", "body": b"m%d" % i, "properties": {"TRAN_MSG": "true", "PGROUP": "g"}})
                  for i in range(3)]
            bad = hs[1]["commit_log_offset"]
            store = b.core.store
            real = store.read_many

            def read_many(offsets, raw=False):
                if bad in offsets:
                    raise CorruptRecordError(f"crc mismatch at {bad}")
                return real(offsets, raw)

            store.read_many = read_many
            clock.advance(10)
            r = await b.core.check.run_pass()
            assert (r["checked"], r["unreadable"]) == (2, 1)
            assert b.core.check.progress.half == hs[1]["half_offset"]  # not past the unreadable one
            p = b.core.tx.index.pending[hs[1]["tx_id"]]
            assert p.last_check_result.startswith("unreadable") and p.checks == 0
            store.read_many = real  # readable again: the next pass checks it and moves on
            clock.advance(10)
            r = await b.core.check.run_pass()
            assert r["unreadable"] == 0 and p.checks == 1
            assert b.core.check.progress.half > hs[2]["half_offset"]
            await c.close()

    arun(go())
