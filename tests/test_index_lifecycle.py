"""The life of a SQLite index behind the log (broker/indexlife.py, broker/sqlitefile.py), on a real directory, no broker.

A small index of its own drives it: the log is a list of (key, value) records (record i at offset i), the index
file ``notes.db`` maps each key to its last value, its rows carry their checksum and its meta ``applied_to`` and its
checksum, as txindex.db and timers.db do.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from pathlib import Path
from typing import Any

import msgpack
import pytest
from conftest import arun, eventually

from txmq.broker import sqlitefile
from txmq.broker.flush import DiskState
from txmq.broker.indexlife import FlushJob, IndexLife, Steps, replay_in_steps
from txmq.broker.metrics import Metrics

DB = "notes.db"
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS note (key INTEGER PRIMARY KEY, value TEXT NOT NULL, crc INTEGER NOT NULL);
"""
INSERT = "INSERT OR REPLACE INTO note (key, value, crc) VALUES (?, ?, ?)"
INSERT_MANY = "INSERT OR REPLACE INTO note (key, value, crc) VALUES (?, ?, ?), (?, ?, ?)"
log = logging.getLogger("txmq.test.notes")


class FileError(Exception):
    io = False


class Rec:
    def __init__(self, offset: int, key: int, value: str) -> None:
        self.commit_log_offset, self.key, self.value = offset, key, value


class Log:
    """The commit log: record i at offset i."""

    def __init__(self) -> None:
        self.records: list[Rec] = []

    def append(self, key: int, value: str) -> None:
        self.records.append(Rec(len(self.records), key, value))

    @property
    def max_offset(self) -> int:
        return len(self.records)

    def scan(self, start: int, end: int):
        return iter(self.records[start:end])


class Flusher:
    """Every record is durable at once (the lifecycle waits on wait_synced before a write)."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def wait_synced(self, offset: int):
        self.asked.append(offset)
        return None


class NotesFile:
    def __init__(self, path: Path) -> None:
        self.pack = msgpack.Packer(use_bin_type=True).pack
        self.conn, self.meta = sqlitefile.open_file(path, False, SCHEMA, FileError)
        if not self.meta:
            self.meta = {"applied_to": 0}
            sqlitefile.write_meta(self.conn, self.meta, checksum=True)

    def check(self) -> tuple[list[tuple], list[tuple]]:
        return sqlitefile.split_checked(self.conn.execute("SELECT key, value, crc FROM note ORDER BY key").fetchall(), self.pack)

    def flush(self, rows: list[tuple], meta: dict[str, Any]) -> int:
        with sqlitefile.write_transaction(self.conn):
            sqlitefile.insert_rows(self.conn, rows, self.pack, 2, INSERT, INSERT_MANY)
            sqlitefile.write_meta(self.conn, dict(self.meta, **meta), checksum=True)
        self.meta = dict(self.meta, **meta)
        return len(rows)

    def checkpoint(self) -> None:
        sqlitefile.checkpoint(self.conn, log, "notes_checkpoint_failed")

    def close(self) -> None:
        sqlitefile.close(self.conn)


class NotesKeeper(IndexLife):
    name = "notes"
    disk_name = "notes"
    errors_metric = "notes_flush_errors"
    failure = "the notes could not be built"
    effect = "notes are unavailable until a restart"
    build_task = "notes-build"
    flush_task = "notes-flush"

    def __init__(self, data_dir: Path, store: Log, flush_s: float = 3600.0) -> None:
        self.disk_state = DiskState()
        super().__init__(store, Flusher(), self.disk_state, Metrics(), log, thread="notes")
        self.data_dir = data_dir
        self.flush_s = flush_s
        self.db: NotesFile | None = None
        self.dirty: dict[int, str] = {}
        self.why: str | None = None  # why the file was rebuilt
        self.replayed: int | None = None
        self.fail_writes = 0  # the next writes that raise

    async def _load(self) -> Steps:
        path = self.data_dir / DB
        start, self.why = 0, "no index file"
        if path.exists():
            db = await self.run(NotesFile, path)
            _good, bad = await self.run(db.check)
            self.why = sqlitefile.meta_problem(db.meta, DB) or (f"{len(bad)} damaged row(s)" if bad else None)
            if self.why is None:
                self.db, start = db, db.meta["applied_to"]
            else:
                await self.run(db.close)
        if self.db is None:
            sqlitefile.remove_files(self.data_dir, DB)
            self.db = await self.run(NotesFile, path)
        return replay_in_steps(self.store.scan(start, self.store.max_offset), self._apply, 3)

    def _apply(self, rec: Rec) -> None:
        self.dirty[rec.key] = rec.value

    async def _on_ready(self, t0: float, replayed: int) -> None:
        self.replayed = replayed
        self.ready.set()

    def _dirty(self) -> int:
        return len(self.dirty)

    def _flush_every(self) -> tuple[float, int]:
        return self.flush_s, 1000

    def _capture(self) -> dict[int, str] | None:
        if self.db is None:
            return None
        changes, self.dirty = self.dirty, {}
        return changes

    async def _prepare(self, changes: dict[int, str], upto: int | None) -> FlushJob:
        meta = {"applied_to": self.store.max_offset if upto is None else upto}
        return self._write, (sorted(changes.items()), meta)

    def _write(self, rows: list[tuple], meta: dict[str, Any]) -> int:
        if self.fail_writes:
            self.fail_writes -= 1
            raise sqlite3.OperationalError("disk I/O error")
        return self.db.flush(rows, meta)

    def _keep(self, changes: dict[int, str]) -> None:
        self.dirty = {**changes, **self.dirty}

    def _checkpointed(self) -> NotesFile | None:
        return self.db

    def _close_files(self) -> None:
        self.db.close()


def _rows(data_dir: Path) -> tuple[dict[int, str], dict[str, Any]]:
    conn = sqlite3.connect(data_dir / DB)
    try:
        return dict(conn.execute("SELECT key, value FROM note")), sqlitefile.read_meta(conn)
    finally:
        conn.close()


def _log(n: int, first: int = 0) -> Log:
    store = Log()
    for i in range(first, first + n):
        store.append(i % 7, f"v{i}")
    return store


async def _built(data_dir: Path, store: Log, **kw: Any) -> NotesKeeper:
    keeper = NotesKeeper(data_dir, store, **kw)
    keeper.start()
    await asyncio.wait_for(keeper.ready.wait(), 30)
    return keeper


def test_a_new_directory_builds_the_index_from_the_whole_log_and_the_stop_leaves_the_file_reflecting_it(tmp_path):
    store = _log(20)

    async def main():
        keeper = await _built(tmp_path, store)
        assert keeper.error is None and keeper.state() == "ready" and keeper.why == "no index file"
        assert keeper.replayed == 20
        store.append(3, "late")  # written after the build: the stop's flush takes it
        keeper.dirty[3] = "late"
        await keeper.stop()

    arun(main())
    rows, meta = _rows(tmp_path)
    assert rows == {k: v for k, v in ((r.key, r.value) for r in store.records)}
    assert meta["applied_to"] == 21 and sqlitefile.meta_problem(meta, DB) is None
    assert not (tmp_path / f"{DB}-wal").exists() or (tmp_path / f"{DB}-wal").stat().st_size == 0  # checkpointed


def test_a_start_replays_only_the_records_from_the_files_applied_to(tmp_path):
    store = _log(20)

    async def main():
        await (await _built(tmp_path, store)).stop()
        for i in range(5):
            store.append(100 + i, f"new{i}")
        keeper = await _built(tmp_path, store)
        assert keeper.why is None and keeper.replayed == 5
        await keeper.stop()

    arun(main())
    rows, meta = _rows(tmp_path)
    assert meta["applied_to"] == 25 and all(rows[100 + i] == f"new{i}" for i in range(5)) and rows[6] == "v13"


def test_a_long_replay_flushes_on_the_way_with_applied_to_where_it_got(tmp_path):
    store = _log(10)
    seen: list[int] = []

    class Small(NotesKeeper):
        def _flush_every(self) -> tuple[float, int]:
            return 3600.0, 2  # any two changed rows are "many"

        async def _prepare(self, changes, upto):
            seen.append(upto)
            return await super()._prepare(changes, upto)

    async def main():
        keeper = Small(tmp_path, store)
        keeper.start()
        await asyncio.wait_for(keeper.ready.wait(), 30)
        await keeper.stop()

    arun(main())
    assert seen[:3] == [2, 5, 8]  # the offset of the last record of each step of 3: replayed again by a start from there
    assert seen[-1] is None and _rows(tmp_path)[1]["applied_to"] == 10


def test_a_failed_flush_keeps_its_rows_is_logged_once_and_is_retried_until_it_succeeds(tmp_path, caplog):
    store = _log(4)

    async def main():
        keeper = await _built(tmp_path, store, flush_s=0.2)
        store.append(50, "x")
        keeper.dirty[50] = "x"
        keeper.fail_writes = 3
        await eventually(lambda: keeper.metrics.counters["notes_flush_errors"] == 3, what="three failed flushes")
        assert keeper.dirty == {50: "x"} and keeper.flush_failing()
        await eventually(lambda: not keeper.flush_failing() and not keeper.dirty, what="the retry")
        assert _rows(tmp_path)[0][50] == "x"
        keeper.fail_writes = 1  # nothing changed: a failed flush is retried all the same
        await keeper.flush()
        assert keeper.flush_failing()
        await eventually(lambda: not keeper.flush_failing(), what="the retry with nothing changed")
        await keeper.stop()

    with caplog.at_level(logging.INFO, logger=log.name):
        arun(main())
    assert caplog.text.count("event=notes_flush_failed") == 2  # once per failing spell
    assert caplog.text.count("event=notes_flush_recovered") == 2


def test_a_full_disk_is_noted_broker_wide_and_cleared_by_the_next_flush(tmp_path):
    store = _log(4)

    async def main():
        keeper = await _built(tmp_path, store, flush_s=0.2)

        def full(*_args):
            raise sqlite3.OperationalError("database or disk is full")

        real = keeper._write
        keeper._write = full
        keeper.dirty[1] = "y"
        assert not await keeper.flush()
        assert "notes" in keeper.disk_state.failing
        keeper._write = real
        await eventually(lambda: not keeper.disk_state.failing, what="disk_ok")
        await keeper.stop()

    arun(main())
    assert _rows(tmp_path)[0][1] == "y"


def test_a_row_changed_on_disk_fails_its_checksum_and_the_file_is_rebuilt_from_the_log(tmp_path):
    store = _log(14)

    async def main():
        await (await _built(tmp_path, store)).stop()
        conn = sqlite3.connect(tmp_path / DB)
        conn.execute("UPDATE note SET value = 'forged' WHERE key = 3")  # its crc stays the old value's
        conn.commit()
        conn.close()
        db = NotesFile(tmp_path / DB)
        good, bad = db.check()
        db.close()
        assert [r[:2] for r in bad] == [(3, "forged")] and len(good) == 6
        keeper = await _built(tmp_path, store)
        assert keeper.why == "1 damaged row(s)" and keeper.replayed == 14
        await keeper.stop()

    arun(main())
    assert _rows(tmp_path)[0][3] == "v10"


def test_an_applied_to_changed_on_disk_fails_the_meta_checksum_and_the_file_is_rebuilt(tmp_path):
    store = _log(14)

    async def main():
        await (await _built(tmp_path, store)).stop()
        conn = sqlite3.connect(tmp_path / DB)
        conn.execute("UPDATE meta SET value = 13 WHERE key = 'applied_to'")
        conn.commit()
        conn.close()
        keeper = await _built(tmp_path, store)
        assert "meta checksum does not match its values (applied_to=13" in keeper.why and keeper.replayed == 14
        await keeper.stop()

    arun(main())
    assert _rows(tmp_path)[1]["applied_to"] == 14


def test_a_build_that_fails_sets_the_error_and_ready(tmp_path, caplog):
    class Broken(NotesKeeper):
        async def _load(self) -> Steps:
            raise OSError(28, "No space left on device")

    async def main():
        keeper = Broken(tmp_path, _log(3))
        keeper.start()
        await asyncio.wait_for(keeper.ready.wait(), 30)
        assert keeper.state() == "failed"
        with pytest.raises(Exception) as e:
            await keeper.wait_ready()
        assert "the notes could not be built" in str(e.value) and "notes are unavailable until a restart" in str(e.value)
        await keeper.stop()

    arun(main())
    assert "event=notes_rebuild_failed" in caplog.text and "Traceback" not in caplog.text
