"""txmq store verify|repair: check a data directory for damage, and heal it the way a broker start does.

``verify`` is strictly read-only: it takes no lock and creates or changes no
file (the transaction index is opened the way ``inspect --data-dir`` opens
it), so it may run beside a broker. ``repair`` takes the directory's lock
(a running broker makes it refuse), runs the recovery a broker start runs
with a full consume-queue rebuild, and removes ``txindex.db`` when it does
not fit the log (the broker rebuilds it at start). Bytes recovery cuts are
moved to ``quarantine/``, never deleted. docs/cli.md, "txmq store".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator

import typer

from .. import exitcodes
from ..common import CliError, OutputOpt
from ..console import Output, emit_json, emit_line, err, new_table, note, print_table, resolve_output

app = typer.Typer(help="Check a data directory for damage (verify) and heal it (repair).", no_args_is_help=True)

DataDirOpt = Annotated[
    Path,
    typer.Option("--data-dir", "-d", envvar="TXMQ_DATA_DIR", help="The data directory to check.", show_default=False),
]

_FAR = 1 << 62
_BATCH = 4096  # queue entries read per get_messages call
_BATCH_BYTES = 32 << 20
JSON_FILES = ("config.json", "txcheck.json", "offsets.json")
_QUIET = ("txmq.store", "txmq.check", "txmq.txdb")  # loggers of what these commands call: they report what those would log


def _problem(kind: str, offset: int | None, detail: str, repair: str, length: int | None = None) -> dict[str, Any]:
    return {"kind": kind, "offset": offset, "length": length, "detail": detail, "repair": repair}


@contextlib.contextmanager
def _quiet_store_log() -> Iterator[None]:
    """The store logs each damaged place; these commands report them themselves."""
    loggers = [logging.getLogger(name) for name in _QUIET]
    was = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, w in zip(loggers, was):
            lg.disabled = w


def _check_dir(path: Path) -> None:
    if not (path / "commitlog").is_dir():
        raise CliError(f"{path} is not a txmq data directory (no commitlog/ in it)", exitcodes.NOT_FOUND)


def broker_running(path: Path) -> bool:
    """Whether a process holds the directory's LOCK (tested with a shared lock; nothing is written)."""
    import fcntl

    try:
        fd = os.open(path / "LOCK", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing releases a lock we got
    return False


# ---- verify ------------------------------------------------------------------
def verify_dir(path: Path) -> dict[str, Any]:
    """Every problem of a data directory, read-only: the document `txmq store verify -o json` prints."""
    with _quiet_store_log():
        return _verify(path)


@dataclass
class _Log:
    """The commit log as recovery would see it: where it cuts, what it skips, what the records hold."""

    segs: list[tuple[int, int]]  # (start offset, bytes of data) per segment file
    resync_below: int  # the checkpoint's fsynced offset: damage below it is skipped, past it the log is cut
    cut_at: int | None = None
    cut_why: str = ""
    gaps: dict[int, int] = field(default_factory=dict)  # segment gaps below resync_below: offset -> length
    damaged: list[tuple[int, int, str]] = field(default_factory=list)  # (offset, length, reason) inside the log
    records: int = 0
    log_ends: dict[tuple[str, int], int] = field(default_factory=dict)  # per queue: 1 + the highest queue offset a record has
    data_end: int = 0
    valid_end: int = 0
    preallocated: int = 0


def _verify(path: Path) -> dict[str, Any]:
    from txmq.store import StoreReader

    segs = _segments(path / "commitlog")
    problems, resync_below = _checkpoint_problems(path, segs)
    log = _Log(segs, resync_below)
    problems += _segment_problems(path / "commitlog", log)
    reader = StoreReader(path)
    try:
        _scan_records(reader, log)
        problems += _damage_problems(reader, log)
        in_damage = _damage_lookup(log)
        queues = reader.queues()
        keys = [(t, q) for t, qids in queues.items() for q in qids]
        entry_problems, folded = _queue_entry_problems(reader, keys, in_damage)
        problems += entry_problems
        _count_entries_into_damage(problems, folded)
        problems += _queue_length_problems(path, reader, keys, log)
        problems += _queue_file_problems(path, keys)
        index_problems, index_doc = _index_problems(path, reader, lambda off: in_damage(off) is not None)
        problems.extend(index_problems)
        schedule_problems, schedule_doc = _schedule_problems(path, reader, lambda off: in_damage(off) is not None)
        problems.extend(schedule_problems)
    finally:
        reader.close()
    problems += _json_file_problems(path)
    doc = _verify_doc(path, problems, log, len(keys), index_doc)
    doc["schedule"] = schedule_doc
    return doc


def _segments(cl_dir: Path) -> list[tuple[int, int]]:
    from txmq.store.files import list_numbered, offset_name

    return [(s, (cl_dir / offset_name(s)).stat().st_size) for s in list_numbered(cl_dir)]


def _checkpoint_problems(path: Path, segs: list[tuple[int, int]]) -> tuple[list[dict[str, Any]], int]:
    """The checkpoint's problems, and its fsynced offset (_FAR without one: recovery then checks the whole log)."""
    from txmq.store.checkpoint import CHECKPOINT, read_checkpoint

    problems: list[dict[str, Any]] = []
    ck_path = path / "checkpoint"
    ckpt = read_checkpoint(ck_path)
    files_end = segs[-1][0] + segs[-1][1] if segs else 0
    if not ck_path.exists():
        problems.append(_problem("checkpoint", None, "checkpoint is missing: recovery checks the whole log", "rewritten"))
    elif ckpt is None:
        size = ck_path.stat().st_size
        why = f"{size} bytes, expected {CHECKPOINT.size}" if size != CHECKPOINT.size else "CRC mismatch"
        problems.append(_problem("checkpoint", None, f"checkpoint is damaged ({why}): recovery checks the whole log", "rewritten"))
    elif segs and (ckpt.log_offset > files_end or ckpt.cq_offset > files_end):
        problems.append(_problem("checkpoint", max(ckpt.log_offset, ckpt.cq_offset),
                                 f"checkpoint points past the end of the log ({files_end})", "rewritten"))
    return problems, ckpt.log_offset if ckpt is not None else _FAR


def _segment_problems(cl_dir: Path, log: _Log) -> list[dict[str, Any]]:
    """Segments are contiguous, or recovery cuts the log (a gap in the unsynced tail, an overlap) or skips a gap below it."""
    from txmq.store.files import offset_name

    problems: list[dict[str, Any]] = []
    segs = log.segs
    for i, ((a, alen), (b, _)) in enumerate(zip(segs, segs[1:])):
        a_end = a + alen
        if a_end > b and _zeros_from(cl_dir / offset_name(a), b - a):
            segs[i] = (a, b - a)  # preallocated zeros a crash left in a sealed segment: the next start cuts them
            continue
        if a_end > b:
            log.cut_at, log.cut_why = a_end, f"segment overlap at {b}: previous segment ends at {a_end}"
            break
        if a_end < b:
            if a_end >= log.resync_below:
                log.cut_at, log.cut_why = a_end, f"segment gap at {a_end}: next segment starts at {b}"
                break
            log.gaps[a_end] = b - a_end
            problems.append(_problem("segment_gap", a_end, f"segment gap at {a_end}: next segment starts at {b}",
                                     "kept: readers skip it (the records it held are lost)", b - a_end))
    return problems


def _scan_records(reader: Any, log: _Log) -> None:
    """Count the records up to where recovery cuts, and each queue's highest offset in the log."""
    # zeros after the last segment's data are space the broker preallocated, not a torn tail
    log.data_end, log.preallocated = reader.files_end, reader.preallocated
    # after the files' end: a broker writing meanwhile moves both, and the valid end read first
    # would trail the files' end read second (a torn tail of 0 bytes, on a healthy log)
    log.valid_end = reader.max_offset
    if log.segs and log.preallocated:
        log.segs[-1] = (log.segs[-1][0], log.segs[-1][1] - log.preallocated)
    for rec in reader.scan():
        if log.cut_at is not None and rec.commit_log_offset >= log.cut_at:
            break
        log.records += 1
        key = (rec.topic, rec.queue_id)
        if rec.queue_offset >= log.log_ends.get(key, 0):
            log.log_ends[key] = rec.queue_offset + 1


def _damage_problems(reader: Any, log: _Log) -> list[dict[str, Any]]:
    """Damaged ranges inside the log (readers skip them) and the torn tail recovery cuts."""
    problems: list[dict[str, Any]] = []
    for d in sorted(reader.damage.places.values(), key=lambda d: d.offset):
        if log.cut_at is not None and d.offset >= log.cut_at:
            continue
        if d.offset >= log.resync_below:  # recovery does not resynchronise in the unsynced tail
            log.cut_at, log.cut_why = d.offset, d.reason
            continue
        log.damaged.append((d.offset, d.length or 0, d.reason))
    if log.cut_at is None and log.valid_end < log.data_end:
        log.cut_at = log.valid_end
        log.cut_why = "the last segment ends inside a record (a torn write)"
    if reader.damage.count > len(reader.damage.places):
        problems.append(_problem("damaged_range", None, f"{reader.damage.count - len(reader.damage.places)} more damaged places not listed",
                                 "kept: readers skip them"))
    for off, length, reason in log.damaged:
        if off in log.gaps:
            continue
        problems.append(_problem("damaged_range", off, reason, "kept: readers skip it (the records in it are lost)", length))
    cut_at = log.cut_at
    tail = sum(max(0, s + n - max(s, cut_at)) for s, n in log.segs) if cut_at is not None else 0
    if cut_at is not None and (tail or cut_at != log.valid_end):  # 0 bytes past the valid end: a write that landed meanwhile
        problems.append(_problem("torn_tail", cut_at, f"{tail} bytes after the last valid record: {log.cut_why}",
                                 "the log is cut there; the bytes are moved to quarantine/", tail))
    return problems


def _damage_lookup(log: _Log) -> Callable[[int], int | None]:
    """The start of the damaged range or segment gap a log offset falls in, or None."""
    ranges = sorted([(o, n) for o, n, _ in log.damaged] + list(log.gaps.items()))
    starts = [o for o, _ in ranges]

    def in_damage(off: int) -> int | None:
        i = bisect_right(starts, off) - 1
        if i >= 0 and off < ranges[i][0] + max(ranges[i][1], 1):
            return ranges[i][0]
        return None

    return in_damage


def _queue_entry_problems(reader: Any, keys: list[tuple[str, int]], in_damage: Callable[[int], int | None]
                          ) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """Queue entries that do not lead to their record, and per damaged range the entries that lead into it."""
    problems: list[dict[str, Any]] = []
    folded: dict[int, int] = {}  # damaged range -> queue entries that lead into it
    for topic, qid in keys:
        bad, unreadable = _walk_queue(reader, topic, qid, in_damage, folded)
        if unreadable is not None:
            problems.append(unreadable)
        for run in _runs(bad):
            first, last = run[0], run[-1]
            span = f"entry {first[0]}" if len(run) == 1 else f"entries {first[0]}-{last[0]} ({len(run)})"
            problems.append(_problem("queue_entries", first[1], f"queue {topic}/{qid} {span} do not lead to their record: {first[2]}",
                                     "queue rebuilt from the log"))
    return problems, folded


def _walk_queue(reader: Any, topic: str, qid: int, in_damage: Callable[[int], int | None], folded: dict[int, int]
                ) -> tuple[list[tuple[int, int, str]], dict[str, Any] | None]:
    """One queue's entries that lead nowhere but into no damaged range (queue offset, log offset, why), and the
    problem that ended the walk early, if one did; entries into a damaged range are counted in ``folded``."""
    lo, hi = reader.queue_min_offset(topic, qid), reader.queue_max_offset(topic, qid)
    bad: list[tuple[int, int, str]] = []
    q = lo
    while q < hi:
        try:
            res = reader.get_messages(topic, qid, q, _BATCH, _BATCH_BYTES)
        except Exception as e:  # noqa: BLE001 - reported, and the walk of this queue ends
            return bad, _problem("queue_entries", None, f"queue {topic}/{qid}: cannot read entry {q}: {e}", "queue rebuilt from the log")
        if res.next_offset <= q:
            break
        for sq, off, why in res.skipped:
            d = in_damage(off)
            if d is not None:
                folded[d] = folded.get(d, 0) + 1
            else:
                bad.append((sq, off, why))
        q = res.next_offset
    return bad, None


def _count_entries_into_damage(problems: list[dict[str, Any]], folded: dict[int, int]) -> None:
    for p in problems:
        if p["kind"] in ("damaged_range", "segment_gap") and p["offset"] in folded:
            n = folded[p["offset"]]
            p["detail"] += f"; {n} queue entr{'y leads' if n == 1 else 'ies lead'} into it"


def _queue_length_problems(path: Path, reader: Any, keys: list[tuple[str, int]], log: _Log) -> list[dict[str, Any]]:
    """A log whose first segments were removed, and queues shorter than the manifest says they were or than the log's records need."""
    from txmq.store.recovery import MANIFEST, read_manifest

    problems: list[dict[str, Any]] = []
    segs = log.segs
    manifest, was_min = read_manifest(str(path / MANIFEST))
    if segs and was_min is not None and segs[0][0] > was_min:
        problems.append(_problem("log_start", was_min, f"the log starts at {segs[0][0]}, it started at {was_min} at the last close: "
                                 "its first segment files were removed", "kept: the new start is recorded (the records in them are lost)",
                                 segs[0][0] - was_min))
    present = set(keys)
    short: dict[tuple[str, int], list[str]] = {}
    for key, n in manifest.items():
        if key not in present or reader.queue_max_offset(*key) < n:
            short.setdefault(key, []).append(f"it had {n} entries at the last close")
    for key, n in log.log_ends.items():
        if key not in present or reader.queue_max_offset(*key) < n:
            short.setdefault(key, []).append(f"the log holds its records up to queue offset {n - 1}")
    for (topic, qid), whys in sorted(short.items()):
        if (topic, qid) in present:
            kind, what = "queue_short", f"ends at {reader.queue_max_offset(topic, qid)}"
        else:
            kind, what = "queue_missing", "is missing"
        problems.append(_problem(kind, None, f"queue {topic}/{qid} {what}: " + "; ".join(whys), "queue rebuilt from the log"))
    return problems


def _queue_file_problems(path: Path, keys: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Consume-queue files are contiguous and hold whole entries."""
    from txmq.store.consumequeue import ENTRY_SIZE, ConsumeQueue
    from txmq.store.files import offset_name

    problems: list[dict[str, Any]] = []
    for topic, qid in keys:
        cq_dir = path / "consumequeue" / topic / str(qid)
        if not cq_dir.is_dir():
            continue
        cq, orphans = ConsumeQueue.load(str(path / "consumequeue"), topic, qid)
        cq.close()
        if orphans:
            problems.append(_problem("queue_files", None, f"queue {topic}/{qid}: {len(orphans)} file(s) after a gap between files",
                                     "removed (entries only; the queue is rebuilt from the log)"))
        if cq.starts:
            last = cq_dir / offset_name(cq.starts[-1])
            if last.stat().st_size % ENTRY_SIZE:
                problems.append(_problem("queue_files", None, f"queue {topic}/{qid}: {last.name} ends inside an entry",
                                         "the partial entry is cut"))
    return problems


def _json_file_problems(path: Path) -> list[dict[str, Any]]:
    """The JSON files: the manifest and txcheck.json are healed, the others a start refuses."""
    from txmq.store.recovery import MANIFEST

    problems: list[dict[str, Any]] = []
    for name in (MANIFEST, *JSON_FILES):
        p = path / name
        if not p.exists():
            continue
        refused = "left alone: the broker refuses to start with it; fix or move it by hand"
        try:
            json.loads(p.read_bytes())
        except (OSError, ValueError) as e:
            if name == MANIFEST:
                fix = "rewritten (it is only a check)"
            elif name == "txcheck.json":
                fix = "moved aside as txcheck.json.corrupt-<time> (the check progress restarts at 0)"
            else:
                fix = refused
            problems.append(_problem("file", None, f"{name} is not JSON ({e})", fix))
            continue
        why = _refused_by_the_broker(name, p)  # JSON, and what the broker's start reads from it
        if why is not None:
            problems.append(_problem("file", None, why, refused))
    return problems


def _verify_doc(path: Path, problems: list[dict[str, Any]], log: _Log, queues: int, index_doc: dict[str, Any] | None) -> dict[str, Any]:
    from txmq.store.store import QUARANTINE_DIR

    qdir = path / QUARANTINE_DIR
    quarantine = sorted(({"name": f.name, "bytes": f.stat().st_size} for f in qdir.iterdir() if f.is_file()),
                        key=lambda f: f["name"]) if qdir.is_dir() else []
    order = {o: i for i, o in enumerate(("torn_tail", "segment_gap", "segment_overlap", "damaged_range"))}
    problems.sort(key=lambda p: (p["offset"] is None, p["offset"] or 0, order.get(p["kind"], 9)))
    segs = log.segs
    return {
        "ok": not problems,
        "problems": problems,
        "records": log.records,
        "segments": len(segs),
        "queues": queues,
        "log": {"min_offset": segs[0][0] if segs else 0, "end": log.data_end, "valid_end": log.valid_end, "preallocated": log.preallocated},
        "quarantine": quarantine,
        "broker_running": broker_running(path),
        "index": index_doc,
    }


def _zeros_from(path: Path, pos: int) -> bool:
    """Every byte of the file from pos on is zero."""
    from txmq.store.segments import nonzero_end

    fd = os.open(path, os.O_RDONLY)
    try:
        return nonzero_end(fd, pos, os.fstat(fd).st_size) == pos
    finally:
        os.close(fd)


def _runs(bad: list[tuple[int, int, str]]) -> list[list[tuple[int, int, str]]]:
    """Consecutive queue offsets with the same kind of reason, grouped."""
    out: list[list[tuple[int, int, str]]] = []
    for item in bad:
        if out and item[0] == out[-1][-1][0] + 1 and _reason_kind(item[2]) == _reason_kind(out[-1][-1][2]):
            out[-1].append(item)
        else:
            out.append([item])
    return out


def _reason_kind(reason: str) -> str:
    return re.sub(r"\d+", "N", reason)


def _refused_by_the_broker(name: str, p: Path) -> str | None:
    """Why a start refuses a JSON file (its own loader says), or None: config.json and offsets.json are checked."""
    from txmq.store.errors import DataFileError

    try:
        if name == "config.json":
            from txmq.broker.config import read_settings_file

            read_settings_file(p)
        elif name == "offsets.json":
            from txmq.store.offsets import ConsumerOffsets

            ConsumerOffsets(p)
    except DataFileError as e:
        return str(e)
    return None


_INDEX_ROWS_LISTED = 20  # rows that disagree with the log, listed one by one; the rest are counted


def _index_problems(path: Path, reader: Any, in_damage: Callable[[int], bool] = lambda _off: False
                    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Whether txindex.db is sound, fits the log and agrees with it row by row (read-only, as `inspect --data-dir` opens it).

    SQLite's integrity check (every page, and every index against its
    table), the meta against the log (what a start checks), then every row
    against its checksum and the record it names, and every commit or
    rollback record against its transaction's row (indexcheck.py). Returns
    the problems and the document's ``index`` summary (None without a file).
    """
    from txmq.broker.transactions.indexcheck import check_decisions, check_rows
    from txmq.broker.transactions.indexfile import DB_FILE, IndexFileError, TxDatabase
    from txmq.broker.transactions.index import agrees

    if not (path / DB_FILE).exists():
        return [], None
    fix = "removed (the broker rebuilds it from the log at start)"
    doc: dict[str, Any] = {"version": None, "checksums": False, "integrity": None, "rows": 0, "rows_damaged": 0, "decisions_checked": 0}
    try:
        db = TxDatabase(path / DB_FILE, readonly=True)
    except IndexFileError as e:
        return [_problem("index", None, f"{DB_FILE} cannot be read: {e}", fix)], doc
    problems: list[dict[str, Any]] = []
    bad_rows: list[tuple[int | None, str]] = []
    try:
        db.snapshot()
        doc.update(version=db.meta.get("version"), checksums=db.checksums)
        try:
            bad = [r[0] for r in db.conn.execute("PRAGMA integrity_check(5)").fetchall() if r[0] != "ok"]
        except Exception as e:  # noqa: BLE001 - pages too damaged to walk
            bad = [str(e)]
        doc["integrity"] = "ok" if not bad else "; ".join(bad)
        if bad:
            problems.append(_problem("index", None, f"{DB_FILE} has damaged pages (SQLite's integrity check: {'; '.join(bad)})", fix))
        why = agrees(reader, db.meta)
        if why is not None:
            problems.append(_problem("index", None, f"{DB_FILE} does not fit the log: {why}", fix))
        else:
            try:
                for row, detail in check_rows(db, reader, in_damage):
                    bad_rows.append((row[0] if isinstance(row[0], int) else None, f"row of transaction {row[1]!r} (first copy at {row[0]}): {detail}"))
                doc["rows"] = db.conn.execute("SELECT count(*) FROM tx").fetchone()[0]
                counts: dict[str, int] = {}
                for at, tx_id, detail in check_decisions(db, reader, db.meta["applied_to"], db.meta.get("log_min", 0), counts):
                    bad_rows.append((at, f"transaction {tx_id!r}: {detail}"))
                doc["decisions_checked"] = counts["decisions"]
            except Exception as e:  # noqa: BLE001 - a damaged file
                if not bad:
                    problems.append(_problem("index", None, f"{DB_FILE} is unreadable ({e})", fix))
        db.end_snapshot()
    except Exception as e:  # noqa: BLE001 - a damaged file
        problems.append(_problem("index", None, f"{DB_FILE} does not fit the log: unreadable ({e})", fix))
    finally:
        db.close()
    doc["rows_damaged"] = len(bad_rows)
    for off, detail in bad_rows[:_INDEX_ROWS_LISTED]:
        problems.append(_problem("index_row", off, f"{DB_FILE}: {detail}", fix))
    if len(bad_rows) > _INDEX_ROWS_LISTED:
        problems.append(_problem("index_row", None, f"{DB_FILE}: {len(bad_rows) - _INDEX_ROWS_LISTED} more rows that disagree with the log", fix))
    return problems, doc


def _schedule_problems(path: Path, reader: Any, in_damage: Callable[[int], bool] = lambda _off: False
                       ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Whether timers.db is sound and agrees with the log, row by row (broker/scheduled/indexcheck.py)."""
    from txmq.broker.scheduled.indexcheck import check_file

    found, doc = check_file(path, reader, in_damage)
    fix = "removed (the broker rebuilds it from the log at start)"
    return [_problem(kind, off, detail, fix) for kind, off, detail in found], doc


# ---- output ------------------------------------------------------------------
def _problem_table(problems: list[dict[str, Any]], with_repair: bool = True) -> None:
    from rich.markup import escape

    t = new_table()
    for label in ("KIND", "OFFSET", "DETAIL", *(("REPAIR",) if with_repair else ())):
        t.add_column(label, overflow="fold")
    for p in problems:
        off = "-" if p["offset"] is None else str(p["offset"])
        cells = [p["kind"], off, escape(p["detail"])] + ([escape(p["repair"])] if with_repair else [])
        t.add_row(*cells)
    print_table(t)


def _emit(doc: dict[str, Any], output: Output) -> None:
    if output is Output.json:
        emit_json(doc)
    else:
        emit_line(doc)


def _summary_line(doc: dict[str, Any]) -> str:
    return f"{doc['records']} records in {doc['segments']} segment(s), {doc['queues']} queue(s)"


def _print_verify(doc: dict[str, Any]) -> None:
    if doc["problems"]:
        _problem_table(doc["problems"])
    if doc["quarantine"]:
        total = sum(f["bytes"] for f in doc["quarantine"])
        note(f"quarantine/ holds {len(doc['quarantine'])} file(s), {total} bytes cut by an earlier recovery (nothing reads them)")
    if doc["broker_running"]:
        note("a broker is running on this directory: its newest records may still be being written")
    n = len(doc["problems"])
    if n:
        err.print(f"[warn]{n} problem{'s' if n != 1 else ''}[/warn] ({_summary_line(doc)}); `txmq store repair` heals what the REPAIR column says")
    else:
        err.print(f"[ok]clean[/ok]: {_summary_line(doc)}")


@app.command(epilog="""Examples:

  txmq store verify --data-dir /var/lib/txmq

  txmq store verify -d /var/lib/txmq -o json | jq '.problems[] | .kind'

Keys: ok, problems (each: kind, offset, length, detail, repair), records, segments, queues,
log (min_offset, end, valid_end), quarantine (name, bytes), broker_running, index (null without
txindex.db; version, checksums, integrity, rows, rows_damaged, decisions_checked), schedule (null
without timers.db; integrity, meta_checksum, applied_to, rows, rows_damaged, records_checked).
Exit 0 when clean, 10 when problems were found, 5 when D is not a data directory.""")
def verify(data_dir: DataDirOpt, output: OutputOpt = None) -> None:
    """Check a data directory for damage, read-only (safe beside a running broker)."""
    _check_dir(data_dir)
    out_fmt = resolve_output(output)
    doc = verify_dir(data_dir)
    if out_fmt is Output.table:
        _print_verify(doc)
    else:
        _emit(doc, out_fmt)
    if not doc["ok"]:
        raise typer.Exit(exitcodes.DATA_PROBLEM)


# ---- repair ------------------------------------------------------------------
_FIXED_BY_OPEN = {"torn_tail", "segment_overlap", "checkpoint", "queue_entries", "queue_missing", "queue_short", "queue_files"}


def _plan(problems: list[dict[str, Any]]) -> list[str]:
    kinds = {p["kind"] for p in problems}
    plan: list[str] = []
    for p in problems:
        if p["kind"] == "torn_tail":
            plan.append(f"cut the log at {p['offset']} and move {p['length']} bytes to quarantine/")
    if kinds & _FIXED_BY_OPEN:
        plan.append("re-read the whole log and rebuild every consume queue that disagrees with it, then write a new checkpoint")
    if kinds & {"index", "index_row"}:
        plan.append("remove txindex.db (the broker rebuilds it from the log at start)")
    if kinds & {"schedule_index", "schedule_row"}:
        plan.append("remove timers.db (the broker rebuilds it from the log at start)")
    if any(p["kind"] == "file" and p["detail"].startswith("txcheck.json") for p in problems):
        plan.append("move txcheck.json aside as txcheck.json.corrupt-<time>")
    if "log_start" in kinds:
        plan.append("record the log's new start in cqmanifest.json (the removed segments' records are lost)")
    left = [p for p in problems if p["kind"] in ("damaged_range", "segment_gap")]
    if left:
        plan.append(f"keep {len(left)} damaged range(s) inside the log as they are: readers skip them, nothing can bring their records back")
    for p in problems:
        if p["kind"] == "file" and not p["detail"].startswith(("txcheck.json", "cqmanifest.json")):
            plan.append(f"leave {p['detail'].split(' ', 1)[0]} alone: fix or move it by hand")
    return plan


def _confirm(yes: bool) -> None:
    import sys

    if yes:
        return
    if not (sys.stdin.isatty() and err.is_terminal):
        raise CliError("refusing to repair without a terminal to confirm on: pass --yes (or --dry-run to preview)", exitcodes.USAGE)
    from ..common import NOT_CONFIRMED, confirm

    if not confirm("Repair this data directory?"):
        raise CliError(NOT_CONFIRMED, exitcodes.ERROR)


def _locked(path: Path) -> CliError:
    return CliError(f"{path} is in use by a running broker: stop it first (nothing was changed)", exitcodes.IN_USE)


@app.command(epilog="""Examples:

  txmq store repair --data-dir /var/lib/txmq --dry-run

  txmq store repair -d /var/lib/txmq --yes

Keys: dry_run, problems (as verify), plan, and after a repair: quarantined_bytes, cut_at, reason,
damaged_ranges, queues_rebuilt, redispatched, cq_entries_dropped, index_removed, timers_removed, moved_aside, remaining
(the problems verify still finds). Exit 0 when done (or nothing to do), 11 when a broker holds the
directory, 5 when D is not a data directory.""")
def repair(
    data_dir: DataDirOpt,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Show what verify finds and what repair would do; change nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    output: OutputOpt = None,
) -> None:
    """Heal a data directory as a broker start does, with a full queue rebuild (the broker must be stopped)."""
    _check_dir(data_dir)
    out_fmt = resolve_output(output)
    found = verify_dir(data_dir)
    plan = _plan(found["problems"])
    doc: dict[str, Any] = {"dry_run": dry_run, "problems": found["problems"], "plan": plan}
    if dry_run or found["ok"]:
        if found["broker_running"]:
            doc["plan"] = plan = ["nothing while a broker runs: stop it first", *plan]
        if out_fmt is Output.table:
            if found["problems"]:
                _problem_table(found["problems"])
            for step in plan:
                err.print(f"would {step}" if not step.startswith("nothing") else step)
            if found["ok"]:
                err.print(f"[ok]nothing to repair[/ok]: {_summary_line(found)}")
        else:
            _emit(doc, out_fmt)
        return
    if found["broker_running"]:
        raise _locked(data_dir)
    _confirm(yes)
    doc.update(_run_repair(data_dir, found))
    if out_fmt is Output.table:
        _print_repair(doc)
    else:
        _emit(doc, out_fmt)


def _run_repair(path: Path, found: dict[str, Any]) -> dict[str, Any]:
    from txmq.broker.transactions.indexfile import DB_FILE, remove_db
    from txmq.store import Store, StoreLockedError, StoreReader

    before = {f["name"]: f["bytes"] for f in found["quarantine"]}
    with _quiet_store_log():
        store = Store(path)
        try:
            rep = store.open(rebuild=True)
        except StoreLockedError:
            raise _locked(path) from None
        store.close()
        index_removed = False
        if (path / DB_FILE).exists():
            with StoreReader(path) as reader:
                bad, _ = _index_problems(path, reader)
            if bad:
                remove_db(path)
                index_removed = True
        from txmq.broker.scheduled.indexfile import remove_db as remove_timers_db

        with StoreReader(path) as reader:
            timers_bad, _ = _schedule_problems(path, reader)
        if timers_bad:
            remove_timers_db(path)
        moved_aside = []
        if any(p["kind"] == "file" and p["detail"].startswith("txcheck.json") for p in found["problems"]):
            from txmq.broker.transactions.check import CheckProgress

            CheckProgress(path / "txcheck.json", repair=True)
            moved_aside.append("txcheck.json")
    after = verify_dir(path)
    now = {f["name"]: f["bytes"] for f in after["quarantine"]}
    return {
        "quarantined_bytes": sum(n for name, n in now.items() if before.get(name) != n),
        "cut_at": rep.truncated_at,
        "reason": rep.reason,
        "damaged_ranges": rep.damaged,
        "queues_rebuilt": rep.queues_rebuilt,
        "redispatched": rep.redispatched,
        "cq_entries_dropped": rep.cq_entries_dropped,
        "index_removed": index_removed,
        "timers_removed": bool(timers_bad),
        "moved_aside": moved_aside,
        "remaining": after["problems"],
    }


def _print_repair(doc: dict[str, Any]) -> None:
    lines = []
    if doc["cut_at"] is not None:
        lines.append(f"log cut at {doc['cut_at']} ({doc['reason']}): {doc['quarantined_bytes']} bytes moved to quarantine/")
    if doc["damaged_ranges"]:
        lines.append(f"{doc['damaged_ranges']} damaged range(s) inside the log skipped (kept as they are)")
    lines.append(f"consume queues rebuilt from the log: {doc['redispatched']} entries written, {doc['cq_entries_dropped']} dropped")
    for why in doc["queues_rebuilt"]:
        lines.append(f"  because {why}")
    if doc["index_removed"]:
        lines.append("txindex.db removed: the broker rebuilds it at start")
    if doc.get("timers_removed"):
        lines.append("timers.db removed: the broker rebuilds it at start")
    for name in doc["moved_aside"]:
        lines.append(f"{name} moved aside")
    for line in lines:
        err.print(line, markup=False)
    if doc["remaining"]:
        _problem_table(doc["remaining"])
        n = len(doc["remaining"])
        err.print(f"[ok]repaired[/ok]; {n} problem{'s' if n != 1 else ''} remain (see REPAIR: repair cannot change them)")
    else:
        err.print("[ok]repaired[/ok]: verify finds nothing")


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="store")
