"""timers.db checked against the commit log: what a start checks of its meta (``agrees``) and, row by row, what
``txmq store verify`` reports (``check_file``).

Like ``broker/transactions/indexcheck.py`` for ``txindex.db``: read-only,
on a broker's ``Store`` or on a ``StoreReader`` (verify reads a data
directory a broker may be writing: the file is read in one SQLite read
transaction, rows and ``applied_to`` of one flush, and the log only below
``applied_to``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import msgpack

from .. import sqlitefile
from txmq.constants import PROP_REAL_TOPIC, PROP_SCHEDULE_CANCEL, PROP_SCHEDULED_FROM, PROP_TIMER_OUT_MS, PROP_UNIQ_KEY, SCHEDULE_TOPIC
from txmq.store.codec import H_CRC, H_OFFSET, H_SIZE

from .indexfile import DB_FILE, TimerDatabase, TimerFileError, meta_problem

ROWS_LISTED = 20  # rows that disagree with the log, listed one by one; the rest are counted


def agrees(store: Any, meta: dict[str, Any]) -> str | None:
    """None if timers.db's meta values fit the log, else why not (a start then rebuilds the file from the log).

    ``applied_to`` must be within the log and where a record starts (or the
    log's end): a value raised on disk lands inside a record, and a replay
    from there would skip the scheduled records and deliveries in between.
    ``boundary`` must still be the record it names, below ``applied_to``.
    """
    try:
        if meta.get("damaged"):
            return "timers.db: a broker found a damaged row in it that it could not rebuild from the log"
        applied = meta["applied_to"]
        if type(applied) is not int or not 0 <= applied <= store.max_offset:
            return f"timers.db reflects the log up to {applied!r}, and the log ends at {store.max_offset}"
        if applied < store.max_offset:
            try:
                _raw, head = store.read_many([applied], raw=True)[0]
                if head[H_OFFSET] != applied:
                    raise ValueError(head[H_OFFSET])
            except Exception:
                return f"timers.db's applied_to {applied} is not where a record of the log starts"
        boundary = meta.get("boundary")
        if boundary is not None:
            try:
                _raw, head = store.read_many([boundary[0]], raw=True)[0]
            except Exception:
                return f"timers.db: no record at its boundary offset {boundary[0]}"
            if head[H_CRC] != boundary[1] or head[H_OFFSET] + head[H_SIZE] > applied:
                return f"timers.db: the record at its boundary offset {boundary[0]} is another one"
        return None
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        return f"timers.db: unreadable meta ({exc!r})"


def check_file(data_dir: Path, reader: Any, in_damage: Callable[[int], bool] = lambda _off: False
               ) -> tuple[list[tuple[str, int | None, str]], dict[str, Any] | None]:
    """Every problem of ``timers.db`` against the log, read-only: ([(kind, commit-log offset, detail)], summary).

    Kinds: ``schedule_index`` (the file: unreadable, SQLite's integrity
    check, its meta checksum, its meta against the log, its row count) and
    ``schedule_row`` (a row whose checksum does not match, that disagrees
    with its scheduled record, whose message the log delivered or
    cancelled, or that names no scheduled record; a scheduled record below
    ``applied_to`` the log neither delivered nor cancelled that has no
    row). A record in a damaged range of the log (``in_damage``) is the
    log's problem, not the file's. The summary is None without a file.
    """
    path = data_dir / DB_FILE
    if not path.exists():
        return [], None
    doc: dict[str, Any] = {"integrity": None, "meta_checksum": None, "applied_to": None, "rows": 0, "rows_damaged": 0,
                           "records_checked": 0}
    try:
        db = TimerDatabase(path, readonly=True)
    except TimerFileError as e:
        return [("schedule_index", None, f"{DB_FILE} cannot be read: {e}")], doc
    problems: list[tuple[str, int | None, str]] = []
    rows: list[tuple[int | None, str]] = []
    try:
        conn = db.conn
        conn.execute("BEGIN")  # rows and meta of one flush, while a broker writes
        meta = db.meta = sqlitefile.read_meta(conn)
        doc["applied_to"] = meta.get("applied_to")
        try:
            bad = [r[0] for r in conn.execute("PRAGMA integrity_check(5)").fetchall() if r[0] != "ok"]
        except Exception as e:  # noqa: BLE001 - pages too damaged to walk
            bad = [str(e)]
        doc["integrity"] = "ok" if not bad else "; ".join(bad)
        if bad:
            problems.append(("schedule_index", None, f"{DB_FILE} has damaged pages (SQLite's integrity check: {'; '.join(bad)})"))
        why = meta_problem(meta)
        doc["meta_checksum"] = "ok" if why is None else ("missing" if "meta_crc" not in meta else "mismatch")
        if why is not None:
            problems.append(("schedule_index", None, why))
        why = agrees(reader, meta)
        if why is not None:
            problems.append(("schedule_index", meta.get("applied_to") if type(meta.get("applied_to")) is int else None, why))
            return problems, doc
        try:
            counts = db.counts()
            doc["rows"] = counts["table"]
            if len(set(counts.values())) > 1:
                problems.append(("schedule_index", None, f"{DB_FILE}'s indexes disagree with its table ({counts}): a damaged page"))
            if "rows" in meta and meta["rows"] != counts["table"]:
                problems.append(("schedule_index", None, f"{DB_FILE} holds {counts['table']} rows, its meta says {meta['rows']}: rows "
                                 "were lost or added on disk"))
            doc["records_checked"] = _check_rows(db, reader, meta["applied_to"], in_damage, rows)
        except Exception as e:  # noqa: BLE001 - a damaged file
            if not bad:
                problems.append(("schedule_index", None, f"{DB_FILE} is unreadable ({e})"))
    except Exception as e:  # noqa: BLE001 - a damaged file
        problems.append(("schedule_index", None, f"{DB_FILE} is unreadable ({e})"))
    finally:
        db.close()
    doc["rows_damaged"] = len(rows)
    for off, detail in rows[:ROWS_LISTED]:
        problems.append(("schedule_row", off, f"{DB_FILE}: {detail}"))
    if len(rows) > ROWS_LISTED:
        problems.append(("schedule_row", None, f"{DB_FILE}: {len(rows) - ROWS_LISTED} more rows that disagree with the log"))
    return problems, doc


def _check_rows(db: TimerDatabase, reader: Any, applied: int, in_damage: Callable[[int], bool],
                out: list[tuple[int | None, str]]) -> int:
    """Every row against the log below ``applied_to``, and every scheduled record there against the rows; records read.

    One read of the log from its first scheduled record: memory holds the
    scheduled records not (yet) delivered or cancelled, as the file does.
    """
    pack = msgpack.Packer(use_bin_type=True).pack
    lo = reader.queue_min_offset(SCHEDULE_TOPIC, 0)
    first = reader.cq_entries(SCHEDULE_TOPIC, 0, lo, 1)
    pending: dict[int, tuple] = {}  # scheduled record -> the row it gives, until its delivered copy or cancel record
    n = 0
    if first:
        for rec in reader.scan(max(first[0][0], reader.min_offset), applied):
            n += 1
            p = rec.properties
            if rec.topic == SCHEDULE_TOPIC:
                target = p.get(PROP_SCHEDULE_CANCEL)
                if target is None:
                    try:
                        pending[rec.commit_log_offset] = (rec.commit_log_offset, int(p[PROP_TIMER_OUT_MS]), p[PROP_REAL_TOPIC],
                                                          p.get(PROP_UNIQ_KEY) or "")
                    except (KeyError, ValueError):
                        pass
                    continue
            else:
                target = p.get(PROP_SCHEDULED_FROM)
                if target is None:
                    continue
            try:
                pending.pop(int(target), None)
            except ValueError:
                pass
    for stored in db.stored_rows():
        off, row = stored[0], stored[:4]
        if type(off) is int and off >= applied:  # written ahead of applied_to during a start's replay: the next replay confirms it
            continue
        own = sqlitefile.row_matches(stored, pack)
        expected = pending.pop(off, None)
        if expected is not None:
            if not own:
                out.append((off, f"row of the scheduled record at {off} (msg_id {stored[3]!r}): its checksum does not match its "
                                 "values (a start rebuilds it from the record)"))
            elif tuple(expected) != tuple(row):
                out.append((off, f"row of the scheduled record at {off}: holds {list(row[1:])}, the record says {list(expected[1:])}"))
            continue
        if type(off) is int and in_damage(off):
            continue
        what = _record_kind(reader, off)
        if what is None:
            what = "the log delivered or cancelled its message below applied_to (it would be delivered again)"
        damaged = "its checksum does not match its values; " if not own else ""
        out.append((off if type(off) is int else None, f"row cl_offset={off!r} msg_id={stored[3]!r}: {damaged}{what}"))
    for off, row in sorted(pending.items()):
        if not in_damage(off):
            out.append((off, f"the scheduled record at {off} (msg_id {row[3]!r}, due_ms {row[1]}) has no row, and the log has no "
                             "delivered copy or cancel of it: a start rebuilds the row from the record"))
    return n


def _record_kind(reader: Any, off: Any) -> str | None:
    """What is wrong with the record a row names that no scheduled record of the scan gave (None: it is a scheduled record)."""
    if type(off) is not int or off < 0:
        return "it names no record of the log"
    try:
        rec = reader.read_many([off])[0]
    except Exception:  # noqa: BLE001 - no record starts there
        return "it names no record of the log"
    if rec.topic == SCHEDULE_TOPIC and PROP_SCHEDULE_CANCEL not in rec.properties:
        return None
    return f"it names a record of topic {rec.topic}, not a scheduled one"
