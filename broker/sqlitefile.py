"""What the broker's SQLite index files share: opening, meta, checksummed rows, flushes, checkpoints.

The transaction index (``txindex.db``, broker/transactions/indexfile.py)
and the schedule's index (``timers.db``, broker/scheduled/indexfile.py)
are both derived data written the same way: WAL mode with
``synchronous=NORMAL`` (a power cut may lose the last flushes, never
corrupt the file; the log replay from ``applied_to`` restores what they
held), a ``meta(key, value)`` table of JSON values (integers as they are),
rows carrying the CRC-32 of the msgpack array of their other columns, and
flushes of one SQLite transaction each. Read-only connections (offline
inspection) open a file no broker has open with ``immutable=1``, which
creates no -wal/-shm files.
"""

from __future__ import annotations

import itertools
import json
import logging
import sqlite3
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SUFFIXES = ("", "-wal", "-shm", "-journal")


def damaged(exc: sqlite3.DatabaseError) -> bool:
    """Whether SQLite says the file's content is damaged (not an I/O error or a full disk, which may pass)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_FORMAT)
    return not isinstance(exc, sqlite3.OperationalError)  # no code (older Python): what I/O errors are not


def io_error(exc: sqlite3.Error) -> bool:
    """Whether SQLite could not read or write the file now (the file is not known to be damaged).

    SQLITE_IOERR (and its extended codes, e.g. a -shm file that cannot grow), SQLITE_FULL,
    SQLITE_CANTOPEN (e.g. too many open files).
    """
    return ((getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF) in (10, 13, 14)


def db_files(data_dir: Path, name: str) -> list[Path]:
    """The file and the ones SQLite keeps beside it."""
    return [data_dir / (name + sfx) for sfx in SUFFIXES]


def remove_files(data_dir: Path, name: str) -> None:
    for p in db_files(data_dir, name):
        p.unlink(missing_ok=True)


def connect(path: Path, readonly: bool, schema: str) -> sqlite3.Connection:
    """A connection in autocommit mode; the writer's in WAL mode with ``schema`` created; raises sqlite3.Error."""
    if readonly:
        # No WAL file: no broker has the file open, and a clean stop folded
        # everything into it. immutable=1 then reads it without creating the
        # -wal/-shm files a WAL reader needs (inspection leaves the data
        # directory as it was). With a WAL, a broker is writing: read through it.
        flags = "mode=ro" if Path(f"{path}-wal").exists() else "mode=ro&immutable=1"
        return sqlite3.connect(f"file:{path}?{flags}", uri=True, isolation_level=None, check_same_thread=False)
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a power cut may lose the last flushes, never
        # corrupt the file; the log replay from applied_to restores what they held.
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(schema)
    except BaseException:
        conn.close()
        raise
    return conn


def close(conn: sqlite3.Connection | None) -> None:
    if conn is not None:
        try:
            conn.close()
        except sqlite3.Error:
            pass


def read_meta(conn: sqlite3.Connection) -> dict[str, Any]:
    return {k: (json.loads(v) if isinstance(v, str) else v) for k, v in conn.execute("SELECT key, value FROM meta")}


def write_meta(conn: sqlite3.Connection, meta: dict[str, Any]) -> None:
    conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                     [(k, v if isinstance(v, int) else json.dumps(v)) for k, v in meta.items()])


@contextmanager
def write_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """One SQLite transaction: committed at the end of the block, rolled back if it raises."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
        raise


def insert_rows(conn: sqlite3.Connection, rows: Iterable[tuple], pack: Callable[[Any], bytes], per_insert: int,
                insert_one: str, insert_many: str) -> None:
    """Insert rows with their checksum (CRC-32 of ``pack(row)``) appended, ``per_insert`` rows to a statement.

    ``insert_many`` binds ``per_insert`` rows at once: executemany steps once
    per row, and the sqlite3 module gives up the GIL around every step, a
    hand-over with the event loop each time. The rest go through
    ``insert_one`` with executemany.
    """
    crc32 = zlib.crc32
    it = iter(rows)
    while True:
        chunk = [(*row, crc32(pack(row))) for row in itertools.islice(it, per_insert)]
        if len(chunk) < per_insert:
            if chunk:
                conn.executemany(insert_one, chunk)
            return
        conn.execute(insert_many, list(itertools.chain.from_iterable(chunk)))


def checkpoint(conn: sqlite3.Connection, log: logging.Logger, event: str) -> None:
    """Fold the WAL into the main file; a failure is logged as ``event``."""
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    except sqlite3.Error as exc:
        log.warning("event=%s error=%r", event, exc)
