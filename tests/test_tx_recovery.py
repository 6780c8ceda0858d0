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
    # The log moves on (a transaction decided, another left pending) and the
    # broker dies without a new snapshot: the next start loads the old one and
    # reads only what was written after it, and gets what a full rebuild gets.
    async def append_and_crash():
        async with running_broker(data, clock=clock, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": ["g"]})
            await c.ok("send", {"topic": "t", "body": b"later"})
            for state in ("commit", "unknown"):
                h = await c.ok("send", {"topic": "t", "body": b"after", "properties": {"TRAN_MSG": "true", "PGROUP": "g"}})
                await c.ok("end_transaction", {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                               "half_offset": h["half_offset"], "state": state})
            await c.close()
            b.broker._save_snapshot = lambda: None  # as if killed: no new snapshot
    arun(append_and_crash())
    prog = CheckProgress(data / "txcheck.json")
    full = _index_view(rebuild(StoreReader(data), prog.half, prog.op))
    assert full != live
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        assert arun(restart()) == full
    assert "source=snapshot" in caplog.text and "records_after=0" not in caplog.text
    # A snapshot ahead of the log (as after a crash that cut the log's tail)
    # is not used, and is removed so that no later start trusts it either.
    from txmq.broker.txindex import load_snapshot, save_snapshot

    idx, header = load_snapshot(data / SNAPSHOT_FILE, 1 << 60, 0)
    save_snapshot(data / SNAPSHOT_FILE, idx, {**header, "log_end": 1 << 50})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        async def restart_crashed():
            async with running_broker(data, clock=clock, check_interval_s=3600) as b:
                b.broker._save_snapshot = lambda: None
                return _index_view(b.core.tx.index), (data / SNAPSHOT_FILE).exists()
        view, snap_left = arun(restart_crashed())
    assert view == full and not snap_left
    assert "event=txindex_snapshot_ignored" in caplog.text and "source=snapshot" not in caplog.text
    # ... and a snapshot whose boundary record is not the log's is not used either.
    arun(restart())  # a clean shutdown leaves a good snapshot
    idx, header = load_snapshot(data / SNAPSHOT_FILE, 1 << 60, 0)
    save_snapshot(data / SNAPSHOT_FILE, idx, {**header, "boundary": [header["boundary"][0], header["boundary"][1] ^ 1]})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        assert arun(restart()) == full
    assert "event=txindex_snapshot_ignored" in caplog.text


def test_background_snapshot_bounds_what_a_start_after_a_crash_reads(tmp_path, caplog, monkeypatch):
    """Once enough transactional records were written, a forked child snapshots the index;
    a start after a crash loads it and reads only what came after, and gets a full rebuild's index."""
    import asyncio
    import logging

    from txmq.broker import server
    from txmq.broker.check import CheckProgress
    from txmq.broker.txindex import SNAPSHOT_FILE, rebuild

    monkeypatch.setattr(server, "SNAPSHOT_POLL_S", 0.02)
    data = tmp_path / "data"

    async def tx(c, state: str) -> None:
        h = await c.ok("send", {"topic": "t", "body": b"x", "properties": {"TRAN_MSG": "true", "PGROUP": "g"}})
        await c.ok("end_transaction", {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                       "half_offset": h["half_offset"], "state": state})

    async def run_and_crash():
        async with running_broker(data, check_interval_s=3600, index_snapshot_records=8) as b:
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": ["g"]})
            for state in ("commit", "rollback", "commit", "unknown", "commit"):
                await tx(c, state)  # 9 records: 5 halves, 4 ops
            for _ in range(250):
                if (data / SNAPSHOT_FILE).exists():
                    break
                await asyncio.sleep(0.02)
            assert (data / SNAPSHOT_FILE).exists(), "no background snapshot"
            assert not list(data.glob(SNAPSHOT_FILE + ".bg*"))
            for state in ("commit", "unknown"):  # after the snapshot: 3 records, below the threshold
                await tx(c, state)
            await c.close()
            b.broker._save_snapshot = lambda: None  # as if killed: no snapshot at shutdown

    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        arun(run_and_crash())
    assert "background=1" in caplog.text
    prog = CheckProgress(data / "txcheck.json")
    full = _index_view(rebuild(StoreReader(data), prog.half, prog.op))

    async def restart():
        async with running_broker(data, check_interval_s=3600) as b:
            return _index_view(b.core.tx.index), len(b.core.tx.index.pending)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        view, pending = arun(restart())
    assert view == full and pending == 2
    assert "source=snapshot" in caplog.text and "records_after=3" in caplog.text


def test_stop_while_a_background_snapshot_is_being_written(tmp_path, monkeypatch):
    """A clean shutdown during a background snapshot kills the child, removes its file,
    and still ends with its own snapshot (found by review: the cancellation used to be lost)."""
    import asyncio
    import time

    from txmq.broker import server, txindex

    real_save = txindex.save_snapshot

    def slow_save(*a, **k):
        if "tmp" in k:  # the forked child's call: long enough to be caught by the stop
            time.sleep(5)
        return real_save(*a, **k)

    monkeypatch.setattr(txindex, "save_snapshot", slow_save)
    monkeypatch.setattr(server, "SNAPSHOT_POLL_S", 0.02)
    forked: list[int] = []
    real_fork = server.fork_snapshot
    monkeypatch.setattr(server, "fork_snapshot", lambda *a: forked.append(real_fork(*a)) or forked[-1])
    data = tmp_path / "data"

    async def main() -> float:
        ctx = running_broker(data, check_interval_s=3600, index_snapshot_records=2)
        b = await ctx.__aenter__()
        c = await RawClient.open(b.address)
        await c.ok("hello", {"producer_groups": ["g"]})
        for _ in range(3):
            await c.ok("send", {"topic": "t", "body": b"x", "properties": {"TRAN_MSG": "true", "PGROUP": "g"}})
        for _ in range(250):
            if forked:
                break
            await asyncio.sleep(0.02)
        assert forked, "no background snapshot was started"
        await asyncio.sleep(0.2)
        await c.close()
        t0 = time.perf_counter()
        await asyncio.wait_for(ctx.__aexit__(None, None, None), 4)
        return time.perf_counter() - t0

    assert arun(main()) < 4
    assert not list(data.glob("txindex.snap.bg*"))
    assert (data / "txindex.snap").exists()  # the shutdown's own
    for pid in forked:  # reaped: no such child any more
        try:
            os.waitpid(pid, os.WNOHANG)
            raise AssertionError(f"child {pid} was not reaped")
        except ChildProcessError:
            pass


def test_a_replayed_transaction_checked_again_is_still_pending_after_a_crash(tmp_path):
    """Found by review: check copies dropped the replay mark, so a rebuild that started past the
    replay's own copy saw the discard and then only stale-looking copies, and said "discarded"."""
    from txmq.broker.clock import ManualClock

    data = tmp_path / "data"
    clock = ManualClock()

    async def first():
        async with running_broker(data, clock=clock, check_interval_s=3600, max_checks=1, index_snapshot_records=0) as b:
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
            b.broker._save_snapshot = lambda: None  # as if killed
            return tx

    tx = arun(first())

    async def restart():
        async with running_broker(data, clock=clock, check_interval_s=3600, index_snapshot_records=0) as b:
            return b.core.tx.index.outcome(tx).label

    assert arun(restart()) == "pending"


def test_a_half_the_check_service_cannot_read_holds_the_progress(tmp_path):
    """Found by review: an unreadable pending half was skipped and the progress moved past it,
    so a rebuild after a crash (which reads halves from the progress) would forget it."""
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
