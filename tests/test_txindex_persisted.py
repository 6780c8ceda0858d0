"""The persisted transaction index (txindex.db) always agrees with a rebuild from the log alone.

Random runs of a real broker: half messages, ends (commit, rollback,
unknown, duplicates and conflicts), check passes that send check-backs and
discard after max checks, replays of discards, index flushes at random
points, and restarts, clean or as after SIGKILL (no flush after the last
one). A flush may also run in the background while the other operations go
on: its pending rows are taken one per turn of the loop, so a check pass or
an end between two of them leaves rows ahead of the position the flush
records, which a start's replay must bring back to the same state. After
every start, and at the end, what the running broker's index
says of every transaction (pending fields, or outcome and who decided it)
equals what a rebuild from the commit log alone says.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from unittest import mock

from conftest import arun
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tx_recovery import _full_view, _index_view, _tx, crash_on_exit
from txmq.broker.transactions import keeper as keeper_module
from txmq.broker.clock import ManualClock
from txmq.broker.testing import running_broker
from wireclient import RawClient

TX = {"TRAN_MSG": "true", "PGROUP": "g"}

op = st.one_of(
    st.tuples(st.just("half")),
    st.tuples(st.just("half")),
    st.tuples(st.just("pass")),
    st.tuples(st.just("end"), st.integers(0, 20), st.sampled_from(["commit", "rollback", "unknown"])),
    st.tuples(st.just("pass")),
    st.tuples(st.just("replay"), st.integers(0, 20), st.sampled_from(["half", "commit"])),
    st.tuples(st.just("flush")),
    st.tuples(st.just("bgflush")),
    st.tuples(st.just("restart"), st.booleans()),
)


async def _run(data: Path, ops: list[tuple]) -> list[str]:
    with mock.patch.object(keeper_module, "CAPTURE_SLICE", 1):  # a turn of the loop between any two pending rows
        return await _run_ops(data, ops)


async def _run_ops(data: Path, ops: list[tuple]) -> list[str]:
    clock = ManualClock()
    background: list[asyncio.Future] = []
    halves: list[dict] = []
    problems: list[str] = []

    async def start():
        ctx = running_broker(data, clock=clock, check_interval_s=3600, max_checks=2)
        b = await ctx.__aenter__()
        c = await RawClient.open(b.address)
        await c.ok("hello", {"producer_groups": ["g"]})  # check-backs go to this connection, never answered
        return ctx, b, c

    def check(b, when: str) -> None:
        full = _full_view(data)
        live = _index_view(b.core.tx.index, full[0].keys())
        if live != full:
            problems.append(f"{when}: live {live} != rebuilt {full}")

    ctx, b, c = await start()
    try:
        for o in ops:
            if o[0] == "half":
                halves.append(await c.ok("send", {"topic": "t", "body": b"m", "properties": TX}))
            elif o[0] == "end" and halves:
                h = halves[o[1] % len(halves)]
                await c.req("end_transaction", {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                                "half_offset": h["half_offset"], "state": o[2]})
            elif o[0] == "pass":
                clock.advance(10)
                await b.core.check.run_pass()
            elif o[0] == "replay" and halves:
                h = halves[o[1] % len(halves)]
                await c.req("discard_replay", {"to": o[2], "refs": [{"tx_id": h["tx_id"]}]})
            elif o[0] == "flush":
                await b.core.keeper.flush()
            elif o[0] == "bgflush":
                background.append(asyncio.ensure_future(b.core.keeper.flush()))
                await asyncio.sleep(0)  # it captures now; its rows are taken while the next operations run
            elif o[0] == "restart":
                await asyncio.gather(*background)  # the file holds what those flushes wrote, rows ahead included
                background.clear()
                if o[1]:
                    crash_on_exit(b)
                await c.close()
                await ctx.__aexit__(None, None, None)
                ctx, b, c = await start()
                check(b, f"after a {'crash' if o[1] else 'clean stop'}")
        await asyncio.gather(*background)
        check(b, "at the end")
    finally:
        await c.close()
        await ctx.__aexit__(None, None, None)
    return problems


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=4, max_size=40))
def test_the_persisted_index_agrees_with_a_rebuild_from_the_log(ops):
    tmp = Path(tempfile.mkdtemp(prefix="txmq-idx-"))
    try:
        assert arun(_run(tmp / "data", ops)) == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_flush_of_thousands_of_decisions_writes_every_row_and_empties_memory(tmp_path):
    """More rows than one multi-row INSERT and more decisions than one slice of the loop's clean-up."""
    from txmq.broker.transactions.keeper import FLUSHED_SLICE
    from txmq.broker.transactions.indexfile import ROWS_PER_INSERT

    n = max(FLUSHED_SLICE, ROWS_PER_INSERT) * 2 + 7
    data = tmp_path / "d"

    async def go():
        async with running_broker(data, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            for i in range(n):
                h = await c.ok("send", {"topic": "t", "body": b"m", "properties": TX})
                await c.ok("end_transaction", {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                               "half_offset": h["half_offset"], "state": "commit" if i % 3 else "rollback"})
            await b.core.keeper.flush()
            assert not b.core.tx.index.decided  # every decision on disk, none left in memory
            live = _index_view(b.core.tx.index, _full_view(data)[0].keys())
            await c.close()
            return live

    live = arun(go())
    full = _full_view(data)
    assert live == full
    assert len(full[0]) == n


def test_a_flush_whose_rows_are_taken_while_a_check_pass_and_ends_run_restarts_to_the_same_index(tmp_path, monkeypatch):
    """Rows taken one per turn of the loop while check copies and decisions are written; then a crash."""
    monkeypatch.setattr(keeper_module, "CAPTURE_SLICE", 1)
    data = tmp_path / "data"
    clock = ManualClock()
    taken: list[int] = []  # half offsets of the pending rows the flush took

    async def go() -> None:
        async with running_broker(data, clock=clock, check_interval_s=3600, max_checks=5) as b:
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": ["g"]})  # check-backs come here, never answered
            halves = [await c.ok("send", {"topic": "t", "body": b"m%d" % i, "properties": TX}) for i in range(40)]
            index = b.core.tx.index
            real_rows = index.pending_rows

            def spy(items):
                rows = real_rows(items)
                taken.extend(r[5] for r in rows)  # the row's half_offset column
                return rows

            monkeypatch.setattr(index, "pending_rows", spy)
            flush = asyncio.ensure_future(b.core.keeper.flush())
            await asyncio.sleep(0)  # captured: 40 pending, the half queue at 40
            clock.advance(10)
            await b.core.check.run_pass()  # a new copy of each pending half, while the rows are being taken
            for h in halves[-5:]:  # decided after their rows were taken as pending
                await c.ok("end_transaction", {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                               "half_offset": h["half_offset"], "state": "commit"})
            await flush
            crash_on_exit(b)  # nothing written after this flush: the start replays from its position
            await c.close()
        # rows on both sides of the check pass: some as of the capture, some ahead of it
        assert min(taken) < 40 <= max(taken), taken
        async with running_broker(data, clock=clock, check_interval_s=3600, max_checks=5) as b:
            full = _full_view(data)
            assert _index_view(b.core.tx.index, full[0].keys()) == full

    arun(go())


def test_a_crash_during_the_rebuild_at_start_resumes_from_the_last_flush_and_loses_no_transaction(tmp_path, monkeypatch):
    """The flushes of a long replay record how far it got, not the log's end."""
    import shutil

    from txmq.store import bulk

    data, crashed = tmp_path / "data", tmp_path / "crashed"
    clock = ManualClock()

    async def fill() -> None:
        async with running_broker(data, clock=clock, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            halves = [await c.ok("send", {"topic": "t", "body": b"m", "properties": TX}) for _ in range(3000)]
            for h in halves[::3]:  # some decided, so the replay writes decisions too
                await c.ok("end_transaction", {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                               "half_offset": h["half_offset"], "state": "commit"})
            await c.close()

    arun(fill())
    for p in data.glob("txindex.db*"):
        p.unlink()  # a first start on an older data directory: the whole index is built from the log
    monkeypatch.setattr(keeper_module, "INDEX_FLUSH_ROWS", 100)
    monkeypatch.setattr(bulk, "ENTRIES_PER_READ", 500)
    real_flush = keeper_module.IndexKeeper.flush
    copies: list[int] = []

    async def flush_then_copy(self, upto=None):
        await real_flush(self, upto)
        if not self.ready.is_set() and not copies:  # the first flush in the middle of the replay: what a kill leaves
            copies.append(len(self.tx.index.pending))
            shutil.copytree(data, crashed, ignore=shutil.ignore_patterns("LOCK"))

    monkeypatch.setattr(keeper_module.IndexKeeper, "flush", flush_then_copy)

    async def start(d) -> None:
        async with running_broker(d, clock=clock, check_interval_s=3600) as b:
            await b.core.keeper.ready.wait()
            full = _full_view(d)
            assert len(b.core.tx.index.pending) == 2000
            assert _index_view(b.core.tx.index, full[0].keys()) == full

    arun(start(data))
    assert copies, "no flush in the middle of the replay"
    monkeypatch.setattr(keeper_module.IndexKeeper, "flush", real_flush)
    arun(start(crashed))  # from the file that flush left, and the log


def test_a_damaged_last_transactional_record_leaves_transactions_available_at_every_start(tmp_path):
    """The index's boundary record is the last one that reads back valid, not a damaged one after it."""
    data = tmp_path / "data"

    async def fill() -> dict:
        async with running_broker(data, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            await _tx(c, "commit")
            last = await c.ok("send", {"topic": "t", "body": b"y" * 100, "properties": TX})
            await c.close()
            return last

    last = arun(fill())
    seg = sorted((data / "commitlog").iterdir())[0]
    with open(seg, "r+b") as f:  # inside what the checkpoint vouches for: no recovery reads it again
        f.seek(last["commit_log_offset"] + 40)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))

    async def start() -> None:
        async with running_broker(data, check_interval_s=3600) as b:
            await b.core.keeper.ready.wait()
            assert b.core.keeper.error is None, b.core.keeper.error
            c = await RawClient.open(b.address)
            h = await _tx(c, "commit")
            assert b.core.tx.index.outcome(h["tx_id"]) is not None
            await c.close()
            await b.core.keeper.flush()
            assert b.core.keeper._flush_failing is False

    arun(start())
    arun(start())  # the file the first start wrote fits the log: no rebuild, no failure


def test_a_flush_that_cannot_take_the_log_position_keeps_its_rows_for_the_next_flush(tmp_path, monkeypatch):
    async def go() -> None:
        async with running_broker(tmp_path / "data", check_interval_s=3600) as b:
            await b.core.keeper.ready.wait()
            await b.core.keeper.flush()
            c = await RawClient.open(b.address)
            h = await _tx(c, "commit")
            await c.close()
            real = keeper_module.log_position

            def fails(*a, **kw):
                raise OSError("read failed")

            monkeypatch.setattr(keeper_module, "log_position", fails)
            await b.core.keeper.flush()
            assert b.core.keeper._flush_failing == "error"
            assert h["tx_id"] in b.core.tx.index.dirty  # handed back, not dropped
            monkeypatch.setattr(keeper_module, "log_position", real)
            await b.core.keeper.flush()
            assert b.core.keeper._flush_failing is False and h["tx_id"] not in b.core.tx.index.decided  # on disk now
            assert b.core.tx.index.outcome(h["tx_id"]) is not None  # read back from the file

    arun(go())


def test_an_index_file_with_a_damaged_page_behind_a_good_header_is_rebuilt_at_start(tmp_path):
    import os
    import sqlite3

    data = tmp_path / "data"

    async def fill() -> list[dict]:
        async with running_broker(data, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            sent = [await c.ok("send", {"topic": "t", "body": b"m", "properties": TX}) for _ in range(300)]
            for h in sent[::2]:
                await c.ok("end_transaction", {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                               "half_offset": h["half_offset"], "state": "commit"})
            await c.close()
            return sent

    sent = arun(fill())
    db = sqlite3.connect(data / "txindex.db")
    root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'tx'").fetchone()[0]
    page = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    with open(data / "txindex.db", "r+b") as f:  # the meta table (and so the start's check of it) is fine
        f.seek((root - 1) * page + 8)
        f.write(os.urandom(page - 8))

    async def start() -> None:
        async with running_broker(data, check_interval_s=3600) as b:
            await b.core.keeper.ready.wait()
            assert b.core.keeper.error is None, b.core.keeper.error
            assert len(b.core.tx.index.pending) == 150
            assert all(b.core.tx.index.outcome(h["tx_id"]) is not None for h in sent[::2])

    arun(start())
    arun(start())


def test_an_index_whose_every_transactional_record_is_damaged_is_kept_at_the_next_start(tmp_path, caplog):
    import logging

    from txmq.constants import HALF_TOPIC, OP_TOPIC
    from txmq.store import StoreReader

    data = tmp_path / "data"

    async def fill() -> None:
        async with running_broker(data, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            await _tx(c, "commit")
            await c.ok("send", {"topic": "t", "body": b"plain"})
            await c.close()

    arun(fill())
    with StoreReader(data) as r:
        tx_records = [rec for rec in r.scan() if rec.topic in (HALF_TOPIC, OP_TOPIC)]
    for rec in tx_records:
        seg = sorted((data / "commitlog").iterdir())[0]
        with open(seg, "r+b") as f:
            f.seek(rec.commit_log_offset + rec.size - 1)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 1]))
    for p in data.glob("txindex.db*"):
        p.unlink()

    async def start() -> None:
        async with running_broker(data, check_interval_s=3600) as b:
            await b.core.keeper.ready.wait()
            assert b.core.keeper.error is None

    arun(start())  # builds the index around the damage: no boundary record can be written
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        arun(start())
    assert not [r for r in caplog.records if "txindex_rebuild" in r.getMessage()], [r.getMessage() for r in caplog.records]
