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
  cut below ``applied_to`` and written again does not end in it), ``rows``
  (how many rows the flush left), ``damaged`` (a broker met a row it could
  not rebuild from the log: the next start rebuilds the file), and
  ``meta_crc``, the CRC-32 of the others (``meta_checksum``): a meta value
  changed on disk (``applied_to`` raised by one bit) makes the file
  unconfirmed, and a start rebuilds it instead of replaying from the
  wrong place. A file without ``meta_crc`` (written by an older txmq) is
  unconfirmed too (broker/sqlitefile.py, ``meta_problem``).
- ``timer``: ``cl_offset`` (the scheduled record, primary key), ``due_ms``,
  ``topic`` (the real topic), ``msg_id``, ``crc`` (CRC-32 of the msgpack
  array of the other four). Indexed by (due_ms, cl_offset) for the delivery
  window and by msg_id for cancels.

Reads return the rows whose checksum matches and, apart, the stored rows
whose checksum does not (``Checked``): the keeper rebuilds those from
the records they name (keeper.py, ``_repair``).
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple

import msgpack

from .. import sqlitefile

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
SELECT = "SELECT cl_offset, due_ms, topic, msg_id, crc FROM timer"


class Checked(NamedTuple):
    """Rows read: those whose checksum matches (``Row``), the stored ones whose checksum does not (with it), the last read."""

    rows: list[Row]
    bad: list[tuple]
    last: tuple | None  # the last stored row read, checked or not (a page ends there)


meta_checksum = sqlitefile.meta_checksum


def meta_problem(meta: dict[str, Any]) -> str | None:
    """Why the meta values cannot be trusted (None: their checksum matches)."""
    return sqlitefile.meta_problem(meta, DB_FILE)


class TimerFileError(Exception):
    """The file cannot be used (damaged, another version): rebuild it from the log. ``io``: unreadable now, kept."""

    io = False


damaged = sqlitefile.damaged
io_error = sqlitefile.io_error


def remove_db(data_dir: Path) -> None:
    sqlitefile.remove_files(data_dir, DB_FILE)


class TimerDatabase:
    """A connection to ``timers.db``: the broker's (in its one worker thread) or a read-only one (offline inspection)."""

    def __init__(self, path: Path, readonly: bool = False) -> None:
        self.path = path
        self.readonly = readonly
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self.bad_rows = 0  # damaged rows that could not be rebuilt from the log (the next start rebuilds the file)
        try:
            self.conn, self.meta = sqlitefile.open_file(path, readonly, _SCHEMA, TimerFileError)
        except ValueError as exc:  # a meta value that is not JSON any more
            raise TimerFileError(f"{path}: unreadable meta ({exc})") from None
        if not self.meta:
            self.meta = {"version": VERSION, "applied_to": 0, "boundary": None, "rows": 0}
            self._write_meta({})
        elif self.meta.get("version") != VERSION:
            version = self.meta.get("version")
            self.close()
            raise TimerFileError(f"{path}: version {version!r}; this broker reads version {VERSION}")

    def close(self) -> None:
        if getattr(self, "conn", None) is not None:
            sqlitefile.close(self.conn)
            self.conn = None  # type: ignore[assignment]

    def _write_meta(self, changes: dict[str, Any]) -> None:
        """Write every meta value with ``changes`` applied, and their checksum (``meta`` is updated by the caller)."""
        sqlitefile.write_meta(self.conn, dict(self.meta, **changes), checksum=True)

    # ---- reading -------------------------------------------------------------------
    def _checked(self, stored: list[tuple]) -> Checked:
        """Rows without their checksum; a row whose checksum does not match is set apart (``Checked.bad``)."""
        rows, bad = sqlitefile.split_checked(stored, self._pack)
        return Checked(rows, bad, stored[-1] if stored else None)

    def due_rows(self, after: tuple[int, int], before_ms: int, limit: int) -> Checked:
        """Rows with (due_ms, cl_offset) >= after and due_ms < before_ms, in due order, at most limit."""
        cur = self.conn.execute(
            f"{SELECT} WHERE (due_ms, cl_offset) >= (?, ?) AND due_ms < ? ORDER BY due_ms, cl_offset LIMIT ?",
            (after[0], after[1], before_ms, limit))
        return self._checked(cur.fetchall())

    def by_msg_id(self, msg_id: str) -> Checked:
        return self._checked(self.conn.execute(f"{SELECT} WHERE msg_id = ?", (msg_id,)).fetchall())

    def listing(self, topic: str | None, after: tuple[int, int], limit: int) -> Checked:
        """Rows by due time from ``after`` (exclusive), of one topic or all."""
        sql = f"{SELECT} WHERE (due_ms, cl_offset) > (?, ?)"
        args: list[Any] = [after[0], after[1]]
        if topic is not None:
            sql += " AND topic = ?"
            args.append(topic)
        sql += " ORDER BY due_ms, cl_offset LIMIT ?"
        args.append(limit)
        return self._checked(self.conn.execute(sql, args).fetchall())

    def rows_after(self, after: int, limit: int) -> Checked:
        """Rows by scheduled record from ``after`` (exclusive): a walk over every row, a slice at a time."""
        return self._checked(self.conn.execute(f"{SELECT} WHERE cl_offset > ? ORDER BY cl_offset LIMIT ?", (after, limit)).fetchall())

    def stored_rows(self) -> Iterator[tuple]:
        """Every row as stored (with its checksum), by scheduled record, unchecked (``txmq store verify``)."""
        cur = self.conn.execute(f"{SELECT} ORDER BY cl_offset")
        while True:
            rows = cur.fetchmany(4096)
            if not rows:
                return
            yield from rows

    def check_rows(self, n: int, all_below: int, first_due: int, newest: int, sampled: int, runs: int = 16) -> tuple[int, list[tuple]]:
        """What a start checks of the rows' checksums: (rows read, the stored rows whose checksum does not match).

        Every row when there are at most ``all_below`` (``n``: the rows); otherwise the
        ``first_due`` rows due first (the next deliveries), the ``newest``
        by scheduled record, and ``sampled`` others in ``runs`` runs from
        random places: a time that does not grow with the schedule (the
        walk after the start reads the rest, ``rows_after``).
        """
        conn = self.conn
        if n <= all_below:
            got = self._checked(conn.execute(SELECT).fetchall())
            return len(got.rows) + len(got.bad), got.bad
        read, bad = 0, []
        parts = itertools.chain([conn.execute(f"{SELECT} ORDER BY due_ms, cl_offset LIMIT ?", (first_due,)).fetchall()],
                                sqlitefile.sampled_rows(conn, SELECT, "timer", "cl_offset", newest, sampled, runs))
        seen: set[int] = set()
        for part in parts:
            got = self._checked(part)
            read += len(part)
            bad += [r for r in got.bad if r[0] not in seen]
            seen.update(r[0] for r in got.bad)
        return read, bad

    def counts(self) -> dict[str, int]:
        """Rows as the table holds them, and as each index leads to them (SQLite keeps them equal unless a page is damaged)."""
        conn = self.conn
        return {"table": conn.execute("SELECT count(*) FROM timer NOT INDEXED").fetchone()[0],
                "timer_due": conn.execute("SELECT count(*) FROM timer INDEXED BY timer_due").fetchone()[0],
                "timer_id": conn.execute("SELECT count(*) FROM timer INDEXED BY timer_id").fetchone()[0]}

    def present(self, offs: list[int]) -> set[int]:
        """Which of these scheduled records have a row (whatever its checksum)."""
        out: set[int] = set()
        for i in range(0, len(offs), 500):
            part = offs[i:i + 500]
            out.update(r[0] for r in self.conn.execute(
                f"SELECT cl_offset FROM timer WHERE cl_offset IN ({', '.join('?' * len(part))})", part))
        return out

    def summary(self) -> dict[str, tuple[int, int]]:
        """Per topic: (rows, earliest due_ms)."""
        return {t: (n, first) for t, n, first in self.conn.execute("SELECT topic, count(*), min(due_ms) FROM timer GROUP BY topic")}

    def lowest(self) -> int | None:
        """The lowest scheduled record's commit-log offset (retention keeps the log from there)."""
        return self.conn.execute("SELECT min(cl_offset) FROM timer").fetchone()[0]

    # ---- writing (the broker's worker thread) -----------------------------------
    def flush(self, added: Iterable[Row], removed: Iterable[int], meta: dict[str, Any]) -> tuple[int, int | None]:
        """Insert the added rows, delete the removed ones and write meta, as one SQLite transaction: (rows, lowest cl_offset).

        ``rows`` (the count the flush leaves) goes into meta with the
        others, under their checksum: a start compares it with the table.
        """
        conn = self.conn
        with sqlitefile.write_transaction(conn):
            sqlitefile.insert_rows(conn, added, self._pack, ROWS_PER_INSERT, _INSERT, _INSERT_MANY)
            conn.executemany("DELETE FROM timer WHERE cl_offset = ?", ((o,) for o in removed))
            # apart: count(*) walks the smallest index, min() is one lookup (together they walk the whole table)
            n = conn.execute("SELECT count(*) FROM timer").fetchone()[0]
            lo = conn.execute("SELECT min(cl_offset) FROM timer").fetchone()[0]
            meta = dict(meta, rows=n)
            self._write_meta(meta)
        self.meta = dict(self.meta, **meta)
        return n, lo

    def checkpoint(self) -> None:
        sqlitefile.checkpoint(self.conn, log, "timers_checkpoint_failed")
