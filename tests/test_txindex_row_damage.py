"""A damaged row of txindex.db is found, and a committed transaction's id is never taken as new again.

One flipped bit in a committed row's state (SQLite stores the integer 1 as
the serial type 9 and 0 as 8, with no value bytes) makes the row read as
pending, and since the pending rows are found through a partial index that
still lacks it, the transaction read as unknown: SQLite's own structure is
intact apart from that index, so only its full integrity check saw it. The
rows carry a checksum: `txmq store verify` reports the row, a start that
reads it rebuilds the index from the log, a lookup that reads it takes the
outcome from the record the row names, and the producer's resend of the
same message id is refused instead of being committed and delivered twice.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

import pytest

from clihelpers import txmq
from txhelpers import arun, end, half_fields, pull_all
from txmq.broker.transactions import keeper as keeper_module
from txmq.broker.testing import running_broker
from txmq.broker.transactions.indexfile import DB_FILE
from wireclient import RawClient

DATA_PROBLEM = 10


def flip_state(db: Path, tx_id: str) -> None:
    """Turn tx_id's committed row (state 1) into a pending one (0) in the closed file, in place: one bit.

    A row of the tx table is a SQLite record: a header (its length, then a
    serial type per column) and the values. origin, the INTEGER PRIMARY KEY,
    is stored as NULL (type 0) and tx_id as text (type 2 * length + 13); the
    state's type comes next: 9, the constant 1 (8 is the constant 0), or 1,
    a one-byte integer, whose byte follows the id's in the values (the id's
    bytes follow the header right away, since NULL takes none).
    """
    raw = bytearray(db.read_bytes())
    key = tx_id.encode()
    flipped = 0
    at = raw.find(key)
    while at >= 0:
        for header in range(4, 40):
            start = at - header
            if start < 0 or raw[start] != header or raw[start + 1] != 0 or raw[start + 2] != 2 * len(key) + 13:
                continue
            if raw[start + 3] == 9:
                raw[start + 3] = 8
                flipped += 1
            elif raw[start + 3] == 1 and raw[at + len(key)] == 1:
                raw[at + len(key)] = 0
                flipped += 1
        at = raw.find(key, at + 1)
    assert flipped == 1, f"{flipped} committed rows of {tx_id} found"
    db.write_bytes(raw)


def verify(data: Path) -> tuple[int, dict]:
    r = txmq("store", "verify", "--data-dir", str(data), "-o", "json")
    return r.returncode, json.loads(r.stdout)


def fill(data: Path) -> dict:
    """ORDER-1 committed, ORDER-2 rolled back, ORDER-3 pending, a plain message; stopped cleanly (the WAL folded into the file)."""
    async def go() -> dict:
        async with running_broker(data, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            h1 = await c.ok("send", half_fields(b"paid", UNIQ_KEY="ORDER-1"))
            await c.ok("end_transaction", end(h1, "commit"))
            h2 = await c.ok("send", half_fields(b"cancelled", UNIQ_KEY="ORDER-2"))
            await c.ok("end_transaction", end(h2, "rollback"))
            h3 = await c.ok("send", half_fields(b"open", UNIQ_KEY="ORDER-3"))
            await c.ok("send", {"topic": "other", "body": b"plain"})
            await c.close()
            return {"ORDER-1": h1, "ORDER-2": h2, "ORDER-3": h3}

    return arun(go())


async def resend_and_commit_again(b, h1: dict) -> tuple[tuple[int, dict], tuple[int, dict], list[bytes]]:
    """The producer's resend of ORDER-1, its end transaction again, and the bodies consumers can pull."""
    c = await RawClient.open(b.address)
    resend = await c.req("send", half_fields(b"paid", UNIQ_KEY="ORDER-1"))
    if resend[0] == 0:  # accepted: the producer commits it as it did the first time
        await c.req("end_transaction", end(resend[1], "commit"))
    again = await c.req("end_transaction", end(h1, "commit"))
    bodies = [m["body"] for m in await pull_all(c)]
    await c.close()
    return resend, again, bodies


def test_verify_reports_a_committed_row_whose_state_byte_flipped(tmp_path):
    data = tmp_path / "data"
    fill(data)
    code, doc = verify(data)
    assert code == 0 and doc["ok"] is True, doc["problems"]
    assert doc["index"] == {"version": 2, "checksums": True, "integrity": "ok", "rows": 3, "rows_damaged": 0, "decisions_checked": 2}

    flip_state(data / DB_FILE, "ORDER-1")
    code, doc = verify(data)
    assert code == DATA_PROBLEM and doc["ok"] is False
    rows = [p for p in doc["problems"] if p["kind"] == "index_row"]
    assert len(rows) == 1 and "ORDER-1" in rows[0]["detail"] and "checksum mismatch" in rows[0]["detail"], doc["problems"]
    assert "is an op (commit) record" in rows[0]["detail"]  # what the log says of it
    assert any(p["kind"] == "index" and "integrity check" in p["detail"] for p in doc["problems"]), doc["problems"]
    assert doc["index"]["rows_damaged"] == 1 and doc["index"]["integrity"] != "ok"


def test_a_start_finds_the_flipped_row_rebuilds_the_index_and_refuses_the_resend(tmp_path, caplog):
    data = tmp_path / "data"
    halves = fill(data)
    flip_state(data / DB_FILE, "ORDER-1")

    async def start():
        async with running_broker(data, check_interval_s=3600) as b:
            outcome = b.core.tx.index.outcome("ORDER-1")
            return outcome.label if outcome else None, await resend_and_commit_again(b, halves["ORDER-1"])

    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        outcome, (resend, again, bodies) = arun(start())
    rebuilt = [r.getMessage() for r in caplog.records if "event=txindex_rebuild " in r.getMessage()]
    assert len(rebuilt) == 1 and "ORDER-1" in rebuilt[0] and "checksum mismatch" in rebuilt[0], rebuilt
    assert outcome == "committed"
    assert resend[0] != 0 and "already in use" in resend[1]["error"], resend
    assert again == (0, {"status": "already", "outcome": "committed", "decided_by": "producer"})
    assert bodies.count(b"paid") == 1, bodies
    code, doc = verify(data)
    assert code == 0, doc["problems"]  # the file the start wrote anew


def test_a_lookup_that_meets_a_damaged_row_takes_the_outcome_from_the_log(tmp_path, caplog, monkeypatch):
    """A row the start did not check (a large history: the start checks a fixed number) is checked when read."""
    data = tmp_path / "data"
    halves = fill(data)
    flip_state(data / DB_FILE, "ORDER-1")
    for name in ("START_CHECK_NEWEST", "START_CHECK_SAMPLED", "START_CHECK_DECISIONS"):
        monkeypatch.setattr(keeper_module, name, 0)

    async def start():
        async with running_broker(data, check_interval_s=3600) as b:
            return await resend_and_commit_again(b, halves["ORDER-1"])

    with caplog.at_level(logging.INFO):
        resend, again, bodies = arun(start())
    text = caplog.text
    assert "event=txindex_rebuild " not in text and "index=loaded" in text
    assert "event=txindex_row_damaged tx_id=ORDER-1" in text and "outcome=committed" in text
    assert resend[0] != 0 and "already in use" in resend[1]["error"], resend
    assert again == (0, {"status": "already", "outcome": "committed", "decided_by": "producer"})
    assert bodies.count(b"paid") == 1, bodies

    caplog.clear()  # the broker noted the damage in the file's meta: the next start rebuilds it
    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        arun(start())
    assert "event=txindex_rebuild " in caplog.text and "found a damaged row" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        arun(start())
    assert "event=txindex_rebuild " not in caplog.text and "index=loaded" in caplog.text


def test_a_damaged_row_whose_record_cannot_be_found_keeps_its_id_taken_and_refuses_a_decision(tmp_path, monkeypatch):
    data = tmp_path / "data"
    halves = fill(data)
    db = sqlite3.connect(data / DB_FILE)
    db.execute("UPDATE tx SET state = 2, cl_offset = 7 WHERE tx_id = 'ORDER-1'")  # the checksum is left as it was
    db.commit()
    db.close()
    for name in ("START_CHECK_NEWEST", "START_CHECK_SAMPLED", "START_CHECK_DECISIONS"):
        monkeypatch.setattr(keeper_module, name, 0)

    async def start():
        async with running_broker(data, check_interval_s=3600) as b:
            return await resend_and_commit_again(b, halves["ORDER-1"])

    resend, again, bodies = arun(start())
    assert resend[0] != 0 and "already in use" in resend[1]["error"], resend
    assert again[0] != 0 and again[1]["name"] == "STORE_ERROR" and "damaged" in again[1]["error"], again
    assert bodies.count(b"paid") == 1, bodies


def test_a_decision_whose_row_was_lost_is_found_by_verify_and_by_the_start(tmp_path, caplog):
    """A sound SQLite file without the committed transaction's row: the log's decisions are checked against the rows."""
    data = tmp_path / "data"
    halves = fill(data)
    db = sqlite3.connect(data / DB_FILE)
    db.execute("DELETE FROM tx WHERE tx_id = 'ORDER-1'")
    db.commit()
    db.close()
    code, doc = verify(data)
    assert code == DATA_PROBLEM
    (p,) = doc["problems"]
    assert p["kind"] == "index_row" and "ORDER-1" in p["detail"] and "no row holds the transaction" in p["detail"], p
    assert doc["index"]["integrity"] == "ok"

    async def start():
        async with running_broker(data, check_interval_s=3600) as b:
            return await resend_and_commit_again(b, halves["ORDER-1"])

    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        resend, again, bodies = arun(start())
    assert "event=txindex_rebuild " in caplog.text and "no row holds the transaction" in caplog.text
    assert resend[0] != 0 and "already in use" in resend[1]["error"], resend
    assert again[1]["status"] == "already"
    assert bodies.count(b"paid") == 1, bodies


def _to_version_1(db_path: Path) -> None:
    """The file as a broker of version 1 wrote it: rows without a checksum."""
    db = sqlite3.connect(db_path)
    db.execute("ALTER TABLE tx DROP COLUMN crc")
    db.execute("UPDATE meta SET value = 1 WHERE key = 'version'")
    db.commit()
    db.close()


@pytest.mark.parametrize("flipped", [False, True])
def test_a_version_1_index_file_is_checked_against_the_log_and_rebuilt_at_start(tmp_path, caplog, flipped):
    data = tmp_path / "data"
    halves = fill(data)
    _to_version_1(data / DB_FILE)
    if flipped:
        flip_state(data / DB_FILE, "ORDER-1")
    code, doc = verify(data)
    assert doc["index"]["version"] == 1 and doc["index"]["checksums"] is False
    if flipped:  # no checksum: the rows against the log find it
        assert code == DATA_PROBLEM
        details = [p["detail"] for p in doc["problems"] if p["kind"] == "index_row"]
        assert any("ORDER-1" in d and "pending, and the record" in d for d in details), details
        assert any("ORDER-1" in d and "its row says pending" in d for d in details), details
    else:
        assert code == 0 and doc["index"]["rows"] == 3, doc["problems"]

    async def start():
        async with running_broker(data, check_interval_s=3600) as b:
            return await resend_and_commit_again(b, halves["ORDER-1"])

    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        resend, again, bodies = arun(start())
    rebuilt = [r.getMessage() for r in caplog.records if "event=txindex_rebuild " in r.getMessage()]
    assert len(rebuilt) == 1 and "version 1, whose rows carry no checksum" in rebuilt[0], rebuilt
    assert resend[0] != 0 and again[1]["status"] == "already" and bodies.count(b"paid") == 1
    code, doc = verify(data)
    assert code == 0 and doc["index"]["version"] == 2 and doc["index"]["checksums"] is True


@pytest.mark.parametrize("crash", [False, True], ids=["clean-stop", "crash"])
def test_transactions_whose_copies_retention_deleted_are_not_taken_for_damage(tmp_path, caplog, crash):
    """Committed transactions whose first copies, then check copies, went with retention while their op records
    stayed: their rows are pruned, and neither the start's check of the last decisions nor verify reports them
    (after a crash the file's log_min may still be the older start of the log)."""
    from dataclasses import replace

    from test_tx_recovery import crash_on_exit
    from txhelpers import G
    from txmq.broker.clock import ManualClock

    data = tmp_path / "data"
    clock = ManualClock()
    kw = dict(clock=clock, check_interval_s=3600, retention_s=600, segment_size=4096)

    async def first() -> None:
        async with running_broker(data, **kw) as b:
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": [G]})
            halves = [await c.ok("send", half_fields(b"h" * 300, UNIQ_KEY=f"OLD-{i}")) for i in range(6)]
            for _ in range(12):
                await c.ok("send", {"topic": "other", "body": b"x" * 400})
            clock.advance(60)
            await b.core.check.run_pass()  # a check copy each, segments after the first copies
            copies = [b.core.tx.index.pending[h["tx_id"]] for h in halves]
            for _ in range(12):
                await c.ok("send", {"topic": "other", "body": b"x" * 400})
            for h, p in zip(halves, copies):  # decided through their check copies, segments later still
                await c.ok("end_transaction", end({**h, "commit_log_offset": p.cl_offset, "half_offset": p.half_offset}, "commit"))
            await c.ok("send", {"topic": "other", "body": b"x" * 400})
            await b.core.keeper.flush()
            op_start = min(b.core.tx.index.lookup(h["tx_id"]).cl_offset for h in halves)
            clock.advance(3600)
            store = b.core.store
            store.config = replace(store.config, retention_s=5)

            assert store.delete_expired(clock(), min(p.cl_offset for p in copies))  # the first copies
            assert max(h["commit_log_offset"] for h in halves) < store.min_offset <= min(p.cl_offset for p in copies)
            await b.core.keeper.flush()  # their rows are pruned
            assert store.delete_expired(clock(), op_start)  # the check copies, with no flush after
            assert max(p.cl_offset for p in copies) < store.min_offset <= op_start
            assert all(b.core.tx.index.lookup(h["tx_id"]) is None for h in halves)
            if crash:
                crash_on_exit(b)
            await c.close()

    arun(first())
    code, doc = verify(data)
    assert code == 0, doc["problems"]
    assert doc["index"]["decisions_checked"] == 6

    async def start() -> None:
        async with running_broker(data, **kw):
            pass

    with caplog.at_level(logging.INFO, logger="txmq.broker"):
        arun(start())
    assert "event=txindex_rebuild " not in caplog.text and "index=loaded" in caplog.text, caplog.text
