"""Damage to timers.db, the schedule's index, done with sqlite3 while the broker is stopped: no delayed message is lost
or delivered twice, the damage is logged naming timers.db, and `txmq store verify` reports it.

The broker processes run on a clock the test sets (a file their `time.time` reads, through a `sitecustomize` on
PYTHONPATH): a message is due exactly when the test moves that clock, whatever the machine's load.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Iterator

import pytest
from brokerproc import BrokerProcess
from conftest import arun, eventually

from txmq.broker.clock import ManualClock
from txmq.broker.scheduled import keeper as sched_keeper
from txmq.broker.scheduled.indexfile import DB_FILE, meta_checksum
from txmq.broker.testing import running_broker
from txmq.client import Producer
from txmq.client.connection import Client

T0 = 1_900_000_000.0  # the brokers' clock at the start of each test (s)
TOPIC = "orders"

_HOOK = '''
import os, time
_path = os.environ.get("TXMQ_TEST_CLOCK_FILE")
if _path:
    _real = time.time

    def _clock():
        try:
            with open(_path) as f:
                return float(f.read())
        except (OSError, ValueError):
            return _real()

    time.time = _clock
'''


class Brokers:
    """Broker processes on one data directory, on a clock the test moves."""

    def __init__(self, tmp_path: Path) -> None:
        hook = tmp_path / "clockhook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(_HOOK)
        self.clock_file = tmp_path / "clock"
        self.set_clock(T0)
        self.data = tmp_path / "data"
        env = {"TXMQ_TEST_CLOCK_FILE": str(self.clock_file),
               "PYTHONPATH": os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)}
        self.proc = BrokerProcess(self.data, "--flush", "sync", env=env)

    def set_clock(self, t: float) -> None:
        tmp = self.clock_file.with_suffix(".tmp")
        tmp.write_text(repr(t))
        os.replace(tmp, self.clock_file)

    @property
    def address(self) -> str:
        return self.proc.address

    def log(self) -> str:
        return self.proc.log.read_text()


async def _send(address: str, prefix: str, n: int, due_s: float, topic: str = TOPIC) -> None:
    async with Producer(address) as p:
        for i in range(n):
            await p.send(topic, f"{prefix}{i}".encode(), properties={"TIMER_DELIVER_MS": str(int((due_s + i / 1000) * 1000))})


async def _bodies(address: str, topic: str = TOPIC) -> list[bytes]:
    async with Client(address) as c:
        out = []
        for q in range(4):
            offset = 0
            while True:
                r = await c.request("pull", {"topic": topic, "queue_id": q, "offset": offset, "max_count": 1000})
                out += [m["body"] for m in r["messages"]]
                if not r["messages"]:
                    break
                offset = r["next_offset"]
        return out


async def _gauges(address: str) -> dict:
    async with Client(address) as c:
        return (await c.request("stats"))["gauges"]


def _wait(what, cond, timeout: float = 60.0):
    """Poll until cond() gives a true value (the timeout is only an upper bound for a broken build)."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)


def _settled(address: str) -> list[bytes]:
    """Every delivered body, once the schedule is built and holds nothing any more."""
    def done():
        g = arun(_gauges(address))
        return g["scheduled_index"] == "ready" and g["scheduled"] == 0
    _wait("an empty schedule", done)
    return arun(_bodies(address))


def _figures(got: list[bytes], sent: list[bytes]) -> tuple[int, int]:
    """(lost, duplicated)."""
    counts: dict[bytes, int] = {}
    for b in got:
        counts[b] = counts.get(b, 0) + 1
    lost = sum(1 for b in sent if b not in counts)
    dup = sum(n - 1 for n in counts.values() if n > 1) + sum(n for b, n in counts.items() if b not in set(sent))
    return lost, dup


@contextlib.contextmanager
def _db(data: Path) -> Iterator[sqlite3.Connection]:
    """A connection to timers.db, closed at the end (the change folded into the file, no -wal left)."""
    conn = sqlite3.connect(data / DB_FILE, isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


def _meta(data: Path) -> dict:
    with _db(data) as conn:
        return {k: (json.loads(v) if isinstance(v, str) else v) for k, v in conn.execute("SELECT key, value FROM meta")}


def _rows(data: Path) -> int:
    conn = sqlite3.connect(f"file:{data / DB_FILE}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT count(*) FROM timer").fetchone()[0]
    except sqlite3.Error:
        return -1
    finally:
        conn.close()


def _log_end(data: Path) -> int:
    from txmq.store import StoreReader

    with StoreReader(data) as r:
        return r.max_offset


def _verify(data: Path) -> dict:
    from txmq.cli.commands.store import verify_dir

    return verify_dir(data)


# ---- applied_to raised on disk -------------------------------------------------------------
def _raised_by_one_bit(applied: int) -> int:
    """applied_to with its lowest clear bit from 4 KiB on set (93,729 -> 97,825 in the case this reproduces)."""
    b = 12
    while applied & (1 << b):
        b += 1
    return applied | (1 << b)


@pytest.mark.parametrize("raise_by", ["one_bit", "32KiB"])
def test_applied_to_raised_on_disk_after_a_kill_loses_and_repeats_nothing(tmp_path, raise_by):
    """timers.db reflecting an earlier part of the log (as a SIGKILL or a power cut leaves it), its applied_to raised."""
    b = Brokers(tmp_path)
    b.proc.start()
    arun(_send(b.address, "a", 300, T0 + 100))  # due once the test moves the clock
    b.proc.stop()
    older = tmp_path / "older.db"
    shutil.copy(b.data / DB_FILE, older)  # the file as of this point of the log
    applied = _meta(b.data)["applied_to"]
    raised = _raised_by_one_bit(applied) if raise_by == "one_bit" else applied + (32 << 10)

    b.proc.start()
    arun(_send(b.address, "b", 60, T0 + 7200))  # scheduled right after the older file's applied_to
    b.set_clock(T0 + 200)
    _wait("the a-messages", lambda: len(arun(_bodies(b.address))) >= 300)  # their delivered copies follow
    arun(_send(b.address, "c", 60, T0 + 7200))
    while _log_end(b.data) < raised + 4096:  # the raised applied_to falls inside the log
        arun(_send(b.address, "pad", 50, 0, topic="padding"))
    b.proc.kill()

    for sfx in ("", "-wal", "-shm"):
        Path(f"{b.data / DB_FILE}{sfx}").unlink(missing_ok=True)
    shutil.copy(older, b.data / DB_FILE)
    with _db(b.data) as conn:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'applied_to'", (raised,))
    problems = _verify(b.data)["problems"]

    b.set_clock(T0 + 10_000)  # every message is due
    seen = len(b.log())
    b.proc.start()
    got = _settled(b.address)
    b.proc.stop()
    sent = [f"{p}{i}".encode() for p, n in (("a", 300), ("b", 60), ("c", 60)) for i in range(n)]
    assert _figures(got, sent) == (0, 0)
    assert any(p["kind"] == "schedule_index" and "meta checksum" in p["detail"] for p in problems)
    log = b.log()[seen:]
    assert "event=timers_rebuild" in log and "timers.db's meta checksum does not match" in log
    assert "where=log" not in log  # nothing blamed on the log


@pytest.mark.parametrize("damage", ["row_deleted", "row_checksum_broken"])
def test_a_row_deleted_or_damaged_on_disk_after_a_kill_is_rebuilt_from_the_log_at_start(tmp_path, damage):
    b = Brokers(tmp_path)
    b.proc.start()
    arun(_send(b.address, "m", 200, T0 + 100))
    _wait("the rows in timers.db", lambda: _rows(b.data) == 200)
    b.proc.kill()

    with _db(b.data) as conn:
        victim = conn.execute("SELECT cl_offset FROM timer ORDER BY due_ms LIMIT 1 OFFSET 77").fetchone()[0]
        if damage == "row_deleted":
            conn.execute("DELETE FROM timer WHERE cl_offset = ?", (victim,))
        else:
            conn.execute("UPDATE timer SET crc = crc + 1 WHERE cl_offset = ?", (victim,))
    kinds = [(p["kind"], p["offset"]) for p in _verify(b.data)["problems"]]

    b.set_clock(T0 + 1000)
    seen = len(b.log())
    b.proc.start()
    got = _settled(b.address)
    b.proc.stop()
    assert _figures(got, [f"m{i}".encode() for i in range(200)]) == (0, 0)
    assert ("schedule_row", victim) in kinds
    log = b.log()[seen:]
    event = "timer_row_missing" if damage == "row_deleted" else "timer_row_repaired"
    assert f"event={event} cl_offset={victim}" in log
    assert "event=timers_rebuild" not in log  # the row alone was rebuilt: no full rebuild
    b.proc.start()  # the file was written again: a clean start, nothing more delivered
    assert not [p for p in _verify(b.data)["problems"] if p["kind"].startswith("schedule")]
    assert _figures(_settled(b.address), [f"m{i}".encode() for i in range(200)]) == (0, 0)
    b.proc.stop()


# ---- in-process brokers, an injected clock ---------------------------------------------------
async def _all(core, topic: str = TOPIC) -> list[bytes]:
    out = []
    for q in range(core.topics.queues(topic) or 0):
        out += [m["body"] for m in (await core.pull(topic, q, 0, 10_000, 64 << 20, 0))["messages"]]
    return out


async def _until(what: str, cond, timeout: float = 30.0):
    """conftest.eventually, named what is awaited first."""
    return await eventually(cond, timeout=timeout, what=what, every=0.01)


async def _delivered(core, clock: ManualClock, seconds: float, n: int) -> list[bytes]:
    """Move the injected clock, then wait until n messages of the topic are delivered."""
    clock.advance(seconds)
    core.scheduled.poke()

    async def enough():
        got = await _all(core)
        return got if len(got) >= n else None

    return await _until(f"{n} deliveries", enough)


async def _schedule(address: str, n: int, start_s: float, prefix: str = "m") -> None:
    async with Producer(address) as p:
        for i in range(n):
            await p.send(TOPIC, f"{prefix}{i}".encode(), properties={"TIMER_DELIVER_MS": str(int(start_s * 1000) + i)})


def test_a_row_lost_further_back_than_the_look_back_rebuilds_the_whole_file(data_dir, monkeypatch, caplog):
    monkeypatch.setattr(sched_keeper, "LOOK_BACK_RECORDS", 10)

    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock) as b:
            await _schedule(b.address, 100, T0 + 60)
        with _db(data_dir) as conn:
            conn.execute("DELETE FROM timer WHERE cl_offset = (SELECT min(cl_offset) FROM timer)")
        async with running_broker(data_dir, clock=clock) as b:
            await _until("the schedule's index", lambda: b.core.scheduled.gauges()["scheduled_index"] == "ready")
            assert b.core.scheduled.gauges()["scheduled"] == 100
            got = await _delivered(b.core, clock, 120, 100)
            assert b.core.scheduled.gauges()["scheduled"] == 0
        assert sorted(got) == sorted(f"m{i}".encode() for i in range(100))

    arun(main())
    assert "timers.db holds 99 rows" in caplog.text and "event=timers_rebuild" in caplog.text


def test_a_file_without_a_meta_checksum_is_rebuilt_not_refused(data_dir, caplog):
    """A timers.db an older txmq wrote (no meta_crc, no rows): its applied_to is not trusted."""
    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock) as b:
            await _schedule(b.address, 30, T0 + 60)
            await _delivered(b.core, clock, 60.010, 11)  # m0..m10
        with _db(data_dir) as conn:
            conn.execute("DELETE FROM meta WHERE key IN ('meta_crc', 'rows')")
            applied = conn.execute("SELECT value FROM meta WHERE key = 'applied_to'").fetchone()[0]
            conn.execute("UPDATE meta SET value = ? WHERE key = 'applied_to'", (applied - 1,))  # wherever: unconfirmed
        async with running_broker(data_dir, clock=clock) as b:
            await _until("the schedule's index", lambda: b.core.scheduled.gauges()["scheduled_index"] == "ready")
            assert b.core.scheduled.gauges()["scheduled"] == 19
            got = await _delivered(b.core, clock, 60, 30)
        assert sorted(got) == sorted(f"m{i}".encode() for i in range(30))
        meta = _meta(data_dir)
        assert meta["meta_crc"] == meta_checksum(meta) and meta["rows"] == 0

    arun(main())
    assert "timers.db has no meta checksum" in caplog.text


def _limit_start_check(monkeypatch) -> None:
    """A start that reads no row's checksum, no record of the log before applied_to and no row after it: damage is met
    when a row is read (as a row damaged while the broker runs is)."""
    for name in ("START_CHECK_ALL", "START_CHECK_FIRST_DUE", "START_CHECK_NEWEST", "START_CHECK_SAMPLED", "LOOK_BACK_RECORDS",
                 "WALK_ROWS"):
        monkeypatch.setattr(sched_keeper, name, 0)


def test_a_damaged_row_met_while_running_is_rebuilt_from_its_record_and_delivered_once_on_time(data_dir, monkeypatch, caplog):
    _limit_start_check(monkeypatch)

    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock) as b:
            await _schedule(b.address, 20, T0 + 600)
        with _db(data_dir) as conn:  # its due time damaged: due 500 s earlier, and its checksum no longer matches
            victim = conn.execute("SELECT cl_offset FROM timer ORDER BY due_ms LIMIT 1 OFFSET 5").fetchone()[0]
            conn.execute("UPDATE timer SET due_ms = due_ms - 500000 WHERE cl_offset = ?", (victim,))
        async with running_broker(data_dir, clock=clock) as b:
            clock.advance(200)  # past the damaged row's time, before the message's
            b.core.scheduled.poke()
            await _until("the repair", lambda: f"event=timer_row_repaired cl_offset={victim}" in caplog.text)
            sched = b.core.scheduled.keeper
            assert not [e for e in sched.heap if e[1] == victim] and sched.added[victim][1] == int((T0 + 600) * 1000) + 5
            assert await _all(b.core) == []
            got = await _delivered(b.core, clock, 500, 20)
            await _until("the flush", lambda: not sched.added and not sched.removed)
        assert sorted(got) == sorted(f"m{i}".encode() for i in range(20))
        assert not [p for p in _verify(data_dir)["problems"] if p["kind"].startswith("schedule")]

    arun(main())


def test_a_row_rebuilt_over_a_damaged_one_and_delivered_before_the_next_flush_is_not_delivered_again(data_dir, monkeypatch):
    """The file still holds the damaged row when the message is delivered: the delivery deletes it all the same."""
    _limit_start_check(monkeypatch)
    monkeypatch.setattr(sched_keeper, "FLUSH_S", 3600.0)  # no flush between the repair and the delivery but the stop's

    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock) as b:
            await _schedule(b.address, 20, T0 + 60)
        with _db(data_dir) as conn:
            victim = conn.execute("SELECT cl_offset FROM timer ORDER BY due_ms LIMIT 1 OFFSET 5").fetchone()[0]
            conn.execute("UPDATE timer SET crc = crc + 1 WHERE cl_offset = ?", (victim,))
        async with running_broker(data_dir, clock=clock) as b:
            await _delivered(b.core, clock, 61, 20)  # the window load meets the row, rebuilds it, and it is delivered
        monkeypatch.setattr(sched_keeper, "START_CHECK_ALL", 16_384)  # a start that checks every row's checksum
        async with running_broker(data_dir, clock=clock) as b:
            await _until("the schedule's index", lambda: b.core.scheduled.gauges()["scheduled_index"] == "ready")
            clock.advance(60)
            sched = b.core.scheduled
            sched.poke()
            await _until("an empty schedule", lambda: sched.gauges()["scheduled"] == 0 and not sched.keeper.heap
                         and not sched.keeper.inflight)
            got = await _all(b.core)
        assert sorted(got) == sorted(f"m{i}".encode() for i in range(20))

    arun(main())


def test_the_walk_after_the_start_finds_a_row_whose_time_was_damaged_later_and_it_is_delivered_on_time(data_dir, monkeypatch, caplog):
    _limit_start_check(monkeypatch)
    monkeypatch.setattr(sched_keeper, "WALK_ROWS", 7)  # the walk reads every row, 7 at a time
    monkeypatch.setattr(sched_keeper, "WALK_PAUSE_S", 0)

    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock) as b:
            await _schedule(b.address, 20, T0 + 60)
        with _db(data_dir) as conn:  # due a day later as stored: no window would read it in time
            victim = conn.execute("SELECT cl_offset FROM timer ORDER BY due_ms LIMIT 1 OFFSET 5").fetchone()[0]
            conn.execute("UPDATE timer SET due_ms = due_ms + 86400000 WHERE cl_offset = ?", (victim,))
        async with running_broker(data_dir, clock=clock) as b:
            await _until("the repair", lambda: f"event=timer_row_repaired cl_offset={victim}" in caplog.text)
            got = await _delivered(b.core, clock, 60.1, 20)
        assert sorted(got) == sorted(f"m{i}".encode() for i in range(20))

    arun(main())


def test_a_damaged_row_no_record_rebuilds_counts_in_the_lag_and_the_next_start_rebuilds_the_file(data_dir, monkeypatch, caplog):
    _limit_start_check(monkeypatch)

    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock) as b:
            await _schedule(b.address, 20, T0 + 60)
        with _db(data_dir) as conn:  # its cl_offset damaged: the row names no scheduled record any more
            conn.execute("UPDATE timer SET cl_offset = cl_offset + 3 WHERE cl_offset = "
                         "(SELECT cl_offset FROM timer ORDER BY due_ms LIMIT 1 OFFSET 5)")
        async with running_broker(data_dir, clock=clock) as b:
            await _delivered(b.core, clock, 90, 19)
            await _until("the damaged row", lambda: "event=timer_row_damaged" in caplog.text)
            g = b.core.scheduled.gauges()
            assert g["scheduled"] == 1 and g["scheduled_lag_s"] >= 29.9  # due 30 s ago and not delivered
        async with running_broker(data_dir, clock=clock) as b:
            got = await _delivered(b.core, clock, 1, 20)
            await _until("no lag", lambda: b.core.scheduled.gauges()["scheduled_lag_s"] == 0)
        assert sorted(got) == sorted(f"m{i}".encode() for i in range(20))

    arun(main())
    assert "event=timers_rebuild" in caplog.text


def test_store_verify_reports_each_kind_of_damage_to_timers_db(data_dir):
    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock) as b:
            await _schedule(b.address, 40, T0 + 60)
            await _delivered(b.core, clock, 60.005, 6)  # m0..m5
            await _schedule(b.address, 10, T0 + 600, prefix="late")

    arun(main())
    assert _verify(data_dir)["ok"] and _verify(data_dir)["schedule"]["rows"] == 44
    pristine = data_dir.parent / "pristine.db"
    shutil.copy(data_dir / DB_FILE, pristine)

    def damaged(sql: str, *args, recrc: bool = False) -> list[tuple[str, int | None, str]]:
        for sfx in ("-wal", "-shm"):
            Path(f"{data_dir / DB_FILE}{sfx}").unlink(missing_ok=True)
        shutil.copy(pristine, data_dir / DB_FILE)
        with _db(data_dir) as conn:
            conn.execute(sql, args)
            if recrc:  # the meta made consistent again: only the cross-check against the log can tell
                meta = {k: (json.loads(v) if isinstance(v, str) else v) for k, v in conn.execute("SELECT key, value FROM meta")}
                conn.execute("UPDATE meta SET value = ? WHERE key = 'meta_crc'", (meta_checksum(meta),))
        doc = _verify(data_dir)
        assert not doc["ok"]
        return [(p["kind"], p["offset"], p["detail"]) for p in doc["problems"]]

    with _db(data_dir) as conn:
        applied = conn.execute("SELECT value FROM meta WHERE key = 'applied_to'").fetchone()[0]
        first, second = [r[0] for r in conn.execute("SELECT cl_offset FROM timer ORDER BY cl_offset LIMIT 2")]
    found = damaged("UPDATE meta SET value = value + 4096 WHERE key = 'applied_to'")
    assert any("meta checksum does not match" in d for _k, _o, d in found)
    found = damaged("UPDATE meta SET value = value - 7 WHERE key = 'applied_to'", recrc=True)
    assert [(k, o) for k, o, d in found if "not where a record of the log starts" in d] == [("schedule_index", applied - 7)]
    found = damaged("DELETE FROM timer WHERE cl_offset = ?", first)
    assert ("schedule_row", first) in [(k, o) for k, o, _d in found]
    assert any("has no row" in d for _k, _o, d in found) and any("its meta says 44" in d for _k, _o, d in found)
    found = damaged("UPDATE timer SET crc = crc + 1 WHERE cl_offset = ?", second)
    assert [(k, o) for k, o, d in found if "checksum does not match" in d] == [("schedule_row", second)]
    found = damaged("INSERT INTO timer SELECT cl_offset - 1, due_ms, topic, msg_id, crc FROM timer WHERE cl_offset = ?", first)
    assert any(k == "schedule_row" and o == first - 1 for k, o, _d in found)
    found = damaged("DELETE FROM meta WHERE key = 'meta_crc'")
    assert any("no meta checksum" in d for _k, _o, d in found)

    from clihelpers import txmq  # `txmq store repair` removes a timers.db verify finds wrong: the broker rebuilds it

    r = txmq("store", "repair", "-d", str(data_dir), "--yes", "-o", "json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["timers_removed"] and "remove timers.db" in " ".join(doc["plan"])
    assert not (data_dir / DB_FILE).exists() and _verify(data_dir)["ok"]
