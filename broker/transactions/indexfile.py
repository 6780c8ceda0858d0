"""The persisted transaction index: one row per transaction, in SQLite (``DATA/txindex.db``).

The commit log stays the only source of truth; this file is an index of it,
like a consume queue, and is rebuilt from the log when it is missing, from
another version, damaged, or does not match the log.

What it holds: the state of every transaction whose first half message is
still in the log, as of one commit-log offset ``applied_to``: every op,
discard and half record below that offset is reflected, none at or after
it. A start loads the pending rows (what the check service needs in
memory) and reads only the transactional records from ``applied_to`` on;
decided transactions stay on disk and are looked up by transaction id or
by their first copy's commit-log offset when a late end transaction, a
check answer or an operator asks about them.

Why SQLite (the standard library's ``sqlite3``): each flush of the index is
one SQLite transaction that writes the changed rows and the new
``applied_to`` together, so the file is always exactly the index of a
prefix of the log, whatever the moment of a crash (WAL mode; a power cut
may lose the last flushes, never mix them). It gives the B-tree by
transaction id, a partial index over the pending rows and range deletes
for retention without hand-written file formats, and readers in other
processes (``txmq inspect --data-dir``) see a consistent snapshot while the
broker writes. Cost measured on the development VM: ~4 us per changed row
written (in a thread off the event loop), ~8 us per lookup by id, ~110
bytes per transaction on disk.

Every row carries a checksum (``crc``, version 2): SQLite checks its own
page structure, not the values in a row, and one flipped bit in a row's
``state`` turned a committed transaction into an unknown one whose id a
producer's resend could use again. Each read of a row checks it: the
pending rows a start loads, a bounded set of other rows at start
(``check_rows``), every lookup. A mismatch raises ``DamagedRow``.

Schema (``docs/store-format.md`` describes it for people):

- ``meta(key, value)``: ``version``, ``applied_to``, ``queues`` (the op,
  discard and half queues' ends at ``applied_to``, JSON), ``boundary``
  (commit-log offset and CRC of the last transactional record below
  ``applied_to``, JSON, or null), ``log_min`` (rows of transactions whose
  first copy is below it were deleted with their records by retention).
- ``tx``: one row per transaction, keyed by ``origin``, the commit-log
  offset of its first half copy (unique, and increasing with time, so
  retention deletes a range), and ``crc``, the CRC-32 of the msgpack array
  of its other columns (bin for bytes, str for text; ``TxDatabase.checked``).
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any, Iterable, Iterator

import msgpack

from .. import sqlitefile

log = logging.getLogger("txmq.txdb")

DB_FILE = "txindex.db"
VERSION = 2
# Read-only connections (`txmq store verify`, `inspect --data-dir`) also read version 1, whose rows have
# no checksum; a broker rebuilds such a file from the log.
READABLE_VERSIONS = (1, 2)

# Row layout, in the table's column order. A pending row describes the
# transaction's latest half copy (half_offset, cl_offset, stored_ts,
# checks); a decided row the record that decided it (cl_offset) and the
# half offset it names (the decided copy's; for a discard, the discard
# queue offset), with decided_at / decided_by set.
# ``pending`` packs the fields only a pending row has (msgpack: queue id,
# born_ts, first_stored_ts, stored_ts, immunity_s), null in decided rows:
# one column instead of five nullable ones halves SQLite's cost per row.
COLUMNS = ("origin", "tx_id", "state", "decided_at", "decided_by", "half_offset", "cl_offset", "grp", "topic", "checks", "pending")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tx (
    origin INTEGER PRIMARY KEY,
    tx_id TEXT NOT NULL,
    state INTEGER NOT NULL,
    decided_at INTEGER,
    decided_by TEXT,
    half_offset INTEGER NOT NULL,
    cl_offset INTEGER NOT NULL,
    grp TEXT NOT NULL,
    topic TEXT NOT NULL,
    checks INTEGER NOT NULL,
    pending BLOB,
    crc INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS tx_by_id ON tx (tx_id);
CREATE INDEX IF NOT EXISTS tx_pending ON tx (half_offset) WHERE state = 0;
CREATE INDEX IF NOT EXISTS tx_discarded ON tx (half_offset) WHERE state = 3;
"""

STORED = (*COLUMNS, "crc")
_INSERT = f"INSERT OR REPLACE INTO tx ({', '.join(STORED)}) VALUES ({', '.join('?' * len(STORED))})"
# Rows go in as multi-row INSERTs: executemany steps once per row, and the sqlite3 module gives up
# the GIL around every step and takes it back after, so a flush of 15,000 rows made 15,000 GIL
# hand-overs with the event loop (measured: loop stalls of 5-13 ms during each flush at 14,600 tx/s).
# A statement of ROWS_PER_INSERT rows binds them all at once (SQLite >= 3.32 takes 32,766 variables,
# older ones 999).
ROWS_PER_INSERT = 256 if sqlite3.sqlite_version_info >= (3, 32) else 999 // len(STORED)
_INSERT_MANY = f"INSERT OR REPLACE INTO tx ({', '.join(STORED)}) VALUES " + ", ".join(
    ["(" + ", ".join("?" * len(STORED)) + ")"] * ROWS_PER_INSERT)


class IndexFileError(Exception):
    """The index file cannot be used (damaged, another version, not for this log): rebuild it from the log.

    ``io`` is true when SQLite could not read or write it (an I/O error, a
    full disk): the file is not known to be damaged and is kept.
    """

    io = False


class DamagedRow(IndexFileError):
    """A row whose checksum does not match its values (or that a lookup by id found under another id).

    ``row`` holds the values as read (``COLUMNS``): the records they name
    may still give the transaction's state back (``index.decision_from_log``).
    """

    def __init__(self, row: tuple, why: str) -> None:
        super().__init__(f"row origin={row[0]} tx_id={row[1]!r}: {why}")
        self.row = row


damaged_index = sqlitefile.damaged


def db_files(data_dir: Path) -> list[Path]:
    return sqlitefile.db_files(data_dir, DB_FILE)


def remove_db(data_dir: Path) -> None:
    sqlitefile.remove_files(data_dir, DB_FILE)


class TxDatabase:
    """A connection to ``txindex.db``: the writer's (the broker) or a read-only one (``txmq inspect --data-dir``).

    SQLite connections are not shared between threads at the same time:
    the broker keeps one for lookups on its event loop and one for flushes
    in a worker thread (``writer()``); WAL lets them run concurrently.
    """

    def __init__(self, path: Path, readonly: bool = False) -> None:
        self.path = path
        self.readonly = readonly
        self._pack = msgpack.Packer(use_bin_type=True).pack  # one per connection: a connection serves one thread at a time
        self.conn, self.meta = sqlitefile.open_file(path, readonly, _SCHEMA, IndexFileError)
        if not self.meta:
            self.meta = {"version": VERSION, "applied_to": 0, "queues": {"op": 0, "discard": 0, "half": 0}, "boundary": None, "log_min": 0}
            self._write_meta(self.conn, self.meta)
        elif self.meta.get("version") not in (READABLE_VERSIONS if readonly else (VERSION,)):
            version = self.meta.get("version")
            self.close()
            old = ", whose rows carry no checksum" if version == 1 else ""
            raise IndexFileError(f"{path}: version {version!r}{old}; this broker reads version {VERSION}")
        self.checksums = self.meta.get("version", VERSION) >= 2
        self._select = f"SELECT {', '.join(STORED if self.checksums else COLUMNS)} FROM tx"

    def writer(self) -> TxDatabase:
        """A second connection to the same file, for a flushing thread."""
        return TxDatabase(self.path)

    def close(self) -> None:
        if getattr(self, "conn", None) is not None:
            sqlitefile.close(self.conn)
            self.conn = None  # type: ignore[assignment]

    # ---- meta ----------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        return sqlitefile.read_meta(self.conn)

    @staticmethod
    def _write_meta(conn: sqlite3.Connection, meta: dict[str, Any]) -> None:
        sqlitefile.write_meta(conn, meta)

    # ---- reading ---------------------------------------------------------------
    def checked(self, stored: tuple) -> tuple:
        """A row as read (``STORED``) without its checksum (``COLUMNS``), once the checksum matches; raises DamagedRow."""
        if not self.checksums:
            return stored
        if not sqlitefile.row_matches(stored, self._pack):
            raise DamagedRow(stored[:-1], "checksum mismatch")
        return stored[:-1]

    def checked_many(self, stored: list[tuple]) -> list[tuple]:
        """``checked`` for a batch, without a Python call per row (a start loads a million pending rows this way)."""
        if not self.checksums:
            return stored
        rows, bad = sqlitefile.split_checked(stored, self._pack)
        if bad:
            raise DamagedRow(bad[0][:-1], "checksum mismatch")  # the first damaged one
        return rows

    def pending_rows(self) -> Iterator[tuple]:
        """Every pending row, in the order of its latest copy's half offset, with the meta it goes with.

        One read transaction: a reader in another process sees rows and
        ``applied_to`` of the same flush. A damaged row raises DamagedRow.
        """
        cur = self.conn.execute(f"{self._select} WHERE state = 0 ORDER BY half_offset")
        while True:
            rows = cur.fetchmany(4096)
            if not rows:
                return
            yield from self.checked_many(rows)

    def rows(self) -> Iterator[tuple]:
        """Every row as stored (``STORED``, or ``COLUMNS`` for version 1), by origin, unchecked (``store verify``)."""
        cur = self.conn.execute(f"{self._select} ORDER BY origin")
        while True:
            rows = cur.fetchmany(4096)
            if not rows:
                return
            yield from rows

    def check_rows(self, newest: int, sampled: int, runs: int = 16) -> int:
        """Check the checksums of the newest rows and of ``sampled`` others, in ``runs`` runs from random places.

        What a start checks beyond the pending rows, in a time that does not
        grow with the history. Returns how many rows were read; a damaged
        row raises DamagedRow.
        """
        if not self.checksums:
            return 0
        return sum(len(self.checked_many(part)) for part in sqlitefile.sampled_rows(self.conn, self._select, "tx", "origin", newest, sampled, runs))

    def snapshot(self) -> None:
        """Start a read transaction (readers: meta and rows of one flush)."""
        self.conn.execute("BEGIN")
        self.meta = self._meta()

    def end_snapshot(self) -> None:
        try:
            self.conn.execute("COMMIT")
        except sqlite3.Error:
            pass

    def by_tx_id(self, tx_id: str) -> tuple | None:
        """The newest row of this transaction id (ids are unique while their records are in the log); DamagedRow if damaged."""
        stored = self.conn.execute(f"{self._select} WHERE tx_id = ? ORDER BY origin DESC LIMIT 1", (tx_id,)).fetchone()
        if stored is None:
            return None
        row = self.checked(stored)
        if row[1] != tx_id:  # the id index led to another row
            raise DamagedRow(row, f"a lookup of the id {tx_id!r} found it")
        return row

    def discarded(self, after: int = -1, limit: int = 1000) -> list[tuple]:
        """Discarded rows by discard-queue offset (``half_offset`` of a discarded row), from after+1."""
        return self.checked_many(
            self.conn.execute(f"{self._select} WHERE state = 3 AND half_offset > ? ORDER BY half_offset LIMIT ?", (after, limit)).fetchall())

    def discarded_at(self, discard_offset: int) -> tuple | None:
        stored = self.conn.execute(f"{self._select} WHERE state = 3 AND half_offset = ?", (discard_offset,)).fetchone()
        return None if stored is None else self.checked(stored)

    def count_discarded(self) -> int:
        return self.conn.execute("SELECT count(*) FROM tx WHERE state = 3").fetchone()[0]

    # ---- writing (the writer connection, in one thread at a time) --------------
    def flush(self, rows: Iterable[tuple], meta: dict[str, Any], prune_below: int | None = None) -> None:
        """Write changed rows and the meta they bring the file to, as one SQLite transaction."""
        conn = self.conn
        with sqlitefile.write_transaction(conn):
            sqlitefile.insert_rows(conn, rows, self._pack, ROWS_PER_INSERT, _INSERT, _INSERT_MANY)
            if prune_below is not None:
                # Retention deleted the records of transactions whose first copy is below it.
                conn.execute("DELETE FROM tx WHERE origin < ? AND state != 0", (prune_below,))
            self._write_meta(conn, meta)
        self.meta = dict(self.meta, **meta)

    def checkpoint(self) -> None:
        """Fold the WAL into the main file (at a clean shutdown: a smaller directory, a faster next open)."""
        sqlitefile.checkpoint(self.conn, log, "txindex_checkpoint_failed")

