"""What the broker's SQLite index files share: opening, meta and its checksum, checksummed rows, flushes, checkpoints.

The transaction index (``txindex.db``, broker/transactions/indexfile.py)
and the schedule's index (``timers.db``, broker/scheduled/indexfile.py)
are both derived data written the same way: WAL mode with
``synchronous=NORMAL`` (a power cut may lose the last flushes, never
corrupt the file; the log replay from ``applied_to`` restores what they
held), a ``meta(key, value)`` table of JSON values (integers as they are),
optionally under a checksum of its own (``meta_crc``, timers.db), rows
whose last column is the CRC-32 of the msgpack array of their other
columns (written by ``insert_rows``, checked by ``split_checked`` and
``row_matches``), and flushes of one SQLite transaction each. Read-only
connections (offline inspection) open a file no broker has open with
``immutable=1``, which creates no -wal/-shm files. How such a file lives
in a running broker (built, replayed, flushed, closed) is
broker/indexlife.py's.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
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


def open_file(path: Path, readonly: bool, schema: str, error: type[Exception]) -> tuple[sqlite3.Connection, dict[str, Any]]:
    """A connection (``connect``) and the file's meta values; ``error`` if SQLite fails (its ``io`` set when the
    file could not be read or written now) or a read-only file has no meta; ValueError from a meta value that is
    not JSON. Nothing stays open when it raises."""
    conn = None
    try:
        conn = connect(path, readonly, schema)
        meta = read_meta(conn)
    except sqlite3.Error as exc:
        close(conn)
        err = error(f"{path}: {exc}")
        err.io = io_error(exc)  # type: ignore[attr-defined]
        raise err from None
    except BaseException:
        close(conn)
        raise
    if not meta and readonly:
        close(conn)
        raise error(f"{path}: empty")
    return conn, meta


def read_meta(conn: sqlite3.Connection) -> dict[str, Any]:
    return {k: (json.loads(v) if isinstance(v, str) else v) for k, v in conn.execute("SELECT key, value FROM meta")}


def write_meta(conn: sqlite3.Connection, meta: dict[str, Any], checksum: bool = False) -> None:
    """Write the meta values; with ``checksum`` their ``meta_crc`` too (``meta_checksum``)."""
    if checksum:
        meta = dict(meta, meta_crc=meta_checksum(meta))
    conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                     [(k, v if isinstance(v, int) else json.dumps(v)) for k, v in meta.items()])


def meta_checksum(meta: dict[str, Any]) -> int:
    """CRC-32 of the meta values other than ``meta_crc`` (keys sorted, compact JSON: the same bytes however they were read)."""
    body = {k: v for k, v in meta.items() if k != "meta_crc"}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def meta_problem(meta: dict[str, Any], name: str) -> str | None:
    """Why the meta values of the file ``name`` cannot be trusted (None: their checksum matches).

    A meta value changed on disk (``applied_to`` raised by one bit) would
    have a start replay from the wrong place; a file without ``meta_crc``
    (written before it had one) is not confirmed either.
    """
    crc = meta.get("meta_crc")
    if crc is None:
        return f"{name} has no meta checksum (written by an older txmq): its applied_to is not confirmed"
    if crc != meta_checksum(meta):
        shown = ", ".join(f"{k}={meta.get(k)!r}" for k in ("applied_to", "rows"))
        return f"{name}'s meta checksum does not match its values ({shown}): they were changed on disk"
    return None


# ---- checksummed rows: the last column is the CRC-32 of ``pack`` of the others ----------
def row_matches(stored: tuple, pack: Callable[[Any], bytes]) -> bool:
    """Whether a stored row's checksum (its last column) matches its other columns."""
    return zlib.crc32(pack(stored[:-1])) == stored[-1]


def split_checked(stored: list[tuple], pack: Callable[[Any], bytes]) -> tuple[list[tuple], list[tuple]]:
    """(the rows whose checksum matches, without it; the stored rows whose checksum does not, with it), in order.

    One pass over the batch without a Python call per row when every checksum matches (a start checks a
    million rows this way).
    """
    rows = [r[:-1] for r in stored]
    if list(map(zlib.crc32, map(pack, rows))) == [r[-1] for r in stored]:
        return rows, []
    crc32 = zlib.crc32
    good, bad = [], []
    for r, row in zip(stored, rows):
        if crc32(pack(row)) == r[-1]:
            good.append(row)
        else:
            bad.append(r)
    return good, bad


def sampled_rows(conn: sqlite3.Connection, select: str, table: str, key: str, newest: int, sampled: int,
                 runs: int = 16) -> Iterator[list[tuple]]:
    """What a start reads to check rows' checksums in a time that does not grow with the file: the ``newest`` rows
    by ``key``, then ``sampled`` others in ``runs`` runs from random places, a list of stored rows at a time."""
    yield conn.execute(f"{select} ORDER BY {key} DESC LIMIT ?", (newest,)).fetchall()
    top = conn.execute(f"SELECT max({key}) FROM {table}").fetchone()[0]
    if top is not None and sampled > 0:
        per = max(1, sampled // runs)
        for _ in range(runs):
            at = random.randint(0, top)  # noqa: S311 - a sample, not a secret
            yield conn.execute(f"{select} WHERE {key} >= ? ORDER BY {key} LIMIT ?", (at, per)).fetchall()


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
