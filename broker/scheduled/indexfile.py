"""The schedule's on-disk index: one row per scheduled message not yet delivered or cancelled (``DATA/timers.db``).

Like ``txindex.db`` (broker/transactions/indexfile.py) it is derived data:
the commit log holds every scheduled record (topic ``RMQ_SYS_TXMQ_TIMER``),
every cancel record, and every delivered copy (which names its scheduled
record in ``TXMQ_SCHEDULED_FROM``), so the file is rebuilt from the log when
it is missing, damaged or does not fit the log. Each flush is one SQLite
transaction that writes the rows added, deletes the rows delivered or
cancelled and moves ``applied_to`` together: the file is always the index of
a prefix of the log, and it is written only once the log is fsynced past
``applied_to``.

Schema (docs/store-format.md, "timers.db"):

- ``meta(key, value)``: ``version``, ``applied_to`` (every record below it
  is reflected), ``boundary`` ([commit-log offset, CRC] of the last
  scheduled or cancel record below ``applied_to``, read back at start: a log
  cut below ``applied_to`` and written again does not end in it), ``damaged``
  (a broker met a damaged row: the next start rebuilds the file).
- ``timer``: ``cl_offset`` (the scheduled record, primary key), ``due_ms``,
  ``topic`` (the real topic), ``msg_id``, ``crc`` (CRC-32 of the msgpack
  array of the other four). Indexed by (due_ms, cl_offset) for the delivery
  window and by msg_id for cancels.
"""

from __future__ import annotations

import logging
import sqlite3
import zlib
from pathlib import Path
from typing import Any, Iterable

import msgpack

from txmq.broker import sqlitefile

log = logging.getLogger("txmq.scheduled")

DB_FILE = "timers.db"
VERSION = 1
ROWS_PER_INSERT = 200

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS timer (
    cl_offset INTEGER PRIMARY KEY,
    due_ms INTEGER NOT NULL,
    topic TEXT NOT NULL,
    msg_id TEXT NOT NULL,
    crc INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS timer_due ON timer (due_ms, cl_offset);
CREATE INDEX IF NOT EXISTS timer_id ON timer (msg_id);
"""
_INSERT = "INSERT OR REPLACE INTO timer (cl_offset, due_ms, topic, msg_id, crc) VALUES (?, ?, ?, ?, ?)"
_INSERT_MANY = "INSERT OR REPLACE INTO timer (cl_offset, due_ms, topic, msg_id, crc) VALUES " + ", ".join(["(?, ?, ?, ?, ?)"] * ROWS_PER_INSERT)

Row = tuple  # (cl_offset, due_ms, topic, msg_id)


class TimerFileError(Exception):
    """The file cannot be used (damaged, another version): rebuild it from the log. ``io``: unreadable now, kept."""

    io = False


damaged = sqlitefile.damaged


def remove_db(data_dir: Path) -> None:
    sqlitefile.remove_files(data_dir, DB_FILE)


class TimerDatabase:
    """A connection to ``timers.db``: the broker's (in its one worker thread) or a read-only one (offline inspection)."""

    def __init__(self, path: Path, readonly: bool = False) -> None:
        self.path = path
        self.readonly = readonly
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self.bad_rows = 0  # rows whose checksum did not match, skipped
        try:
            self.conn = sqlitefile.connect(path, readonly, _SCHEMA)
            self.meta = sqlitefile.read_meta(self.conn)
        except sqlite3.Error as exc:
            self.close()
            err = TimerFileError(f"{path}: {exc}")
            err.io = sqlitefile.io_error(exc)
            raise err from None
        if not self.meta:
            if readonly:
                self.close()
                raise TimerFileError(f"{path}: empty")
            self.meta = {"version": VERSION, "applied_to": 0, "boundary": None}
            self._write_meta(self.meta)
        elif self.meta.get("version") != VERSION:
            version = self.meta.get("version")
            self.close()
            raise TimerFileError(f"{path}: version {version!r}; this broker reads version {VERSION}")

    def close(self) -> None:
        if getattr(self, "conn", None) is not None:
            sqlitefile.close(self.conn)
            self.conn = None  # type: ignore[assignment]

    def _write_meta(self, meta: dict[str, Any]) -> None:
        sqlitefile.write_meta(self.conn, meta)

    # ---- reading -------------------------------------------------------------------
    def _checked(self, stored: list[tuple]) -> list[Row]:
        """Rows without their checksum; a row whose checksum does not match is left out and counted (``bad_rows``)."""
        pack, crc32 = self._pack, zlib.crc32
        out = []
        for r in stored:
            row = r[:4]
            if crc32(pack(row)) == r[4]:
                out.append(row)
            else:
                self.bad_rows += 1
                log.error("event=timer_row_damaged cl_offset=%r msg=%s", r[0], "'the next start rebuilds timers.db from the log'")
        return out

    def due_rows(self, after: tuple[int, int], before_ms: int, limit: int) -> list[Row]:
        """Rows with (due_ms, cl_offset) >= after and due_ms < before_ms, in due order, at most limit."""
        cur = self.conn.execute(
            "SELECT cl_offset, due_ms, topic, msg_id, crc FROM timer WHERE (due_ms, cl_offset) >= (?, ?) AND due_ms < ? "
            "ORDER BY due_ms, cl_offset LIMIT ?", (after[0], after[1], before_ms, limit))
        return self._checked(cur.fetchall())

    def by_msg_id(self, msg_id: str) -> list[Row]:
        return self._checked(self.conn.execute("SELECT cl_offset, due_ms, topic, msg_id, crc FROM timer WHERE msg_id = ?",
                                               (msg_id,)).fetchall())

    def listing(self, topic: str | None, after: tuple[int, int], limit: int) -> list[Row]:
        """Rows by due time from ``after`` (exclusive), of one topic or all."""
        sql = "SELECT cl_offset, due_ms, topic, msg_id, crc FROM timer WHERE (due_ms, cl_offset) > (?, ?)"
        args: list[Any] = [after[0], after[1]]
        if topic is not None:
            sql += " AND topic = ?"
            args.append(topic)
        sql += " ORDER BY due_ms, cl_offset LIMIT ?"
        args.append(limit)
        return self._checked(self.conn.execute(sql, args).fetchall())

    def summary(self) -> dict[str, tuple[int, int]]:
        """Per topic: (rows, earliest due_ms)."""
        return {t: (n, first) for t, n, first in self.conn.execute("SELECT topic, count(*), min(due_ms) FROM timer GROUP BY topic")}

    def count_and_min(self) -> tuple[int, int | None, int | None]:
        """(rows, lowest cl_offset, earliest due_ms)."""
        n, lo = self.conn.execute("SELECT count(*), min(cl_offset) FROM timer").fetchone()
        first = self.conn.execute("SELECT min(due_ms) FROM timer").fetchone()[0]
        return n, lo, first

    # ---- writing (the broker's worker thread) -----------------------------------
    def flush(self, added: Iterable[Row], removed: Iterable[int], meta: dict[str, Any]) -> None:
        """Insert the added rows, delete the removed ones and write meta, as one SQLite transaction."""
        conn = self.conn
        with sqlitefile.write_transaction(conn):
            sqlitefile.insert_rows(conn, added, self._pack, ROWS_PER_INSERT, _INSERT, _INSERT_MANY)
            conn.executemany("DELETE FROM timer WHERE cl_offset = ?", ((o,) for o in removed))
            self._write_meta(meta)
        self.meta = dict(self.meta, **meta)

    def checkpoint(self) -> None:
        sqlitefile.checkpoint(self.conn, log, "timers_checkpoint_failed")
