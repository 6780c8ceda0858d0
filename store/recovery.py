"""Recovery on open: validate the unindexed tail of the log, cut it at the first bad
record, and bring every consume queue back in line with the log.

See docs/store-format.md, "Recovery". The log before the checkpoint's
consume-queue offset is trusted; only what follows is read. If a record
shows that a queue lost entries the checkpoint claimed were on disk (its
queue offset is past the queue's end, or before its first file), the whole
log is re-read from its first byte, which rebuilds every queue.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from .checkpoint import Checkpoint
from .codec import HEADER_SIZE, Record, tag_hash
from .commitlog import CommitLog
from .consumequeue import ENTRY_SIZE, ConsumeQueue
from .errors import FULL_ERRNOS, CorruptRecordError

_FAR = 1 << 62
_FLUSH_PENDING = 1 << 20  # entries held in memory during recovery before writing them out


class _NeedFullScan(Exception):
    pass


@dataclass(slots=True)
class Recovered:
    dropped_bytes: int = 0
    reason: str | None = None
    truncated_at: int | None = None
    redispatched: int = 0
    preallocated: int = 0  # zero bytes after the last record (space the writer had reserved), cut
    cq_entries_dropped: int = 0
    scanned_from: int = 0
    damaged: list[tuple[int, str, int]] = field(default_factory=list)  # (offset, reason, bytes skipped)
    queue_problems: list[str] = field(default_factory=list)  # why the queues were rebuilt from the log


def load_queues(root: str) -> tuple[dict[tuple[str, int], ConsumeQueue], int]:
    """Every consume queue under root, repaired at the file level; and entries dropped doing so."""
    queues: dict[tuple[str, int], ConsumeQueue] = {}
    dropped = 0
    os.makedirs(root, exist_ok=True)
    for topic in sorted(os.listdir(root)):
        tdir = os.path.join(root, topic)
        if not os.path.isdir(tdir):
            continue
        for q in os.listdir(tdir):
            if not (q.isascii() and q.isdigit()) or not os.path.isdir(os.path.join(tdir, q)):
                continue
            cq, orphans = ConsumeQueue.load(root, topic, int(q))
            dropped += cq.repair_files(orphans)
            queues[(topic, int(q))] = cq
    return queues, dropped


MANIFEST = "cqmanifest.json"  # in the data directory: every queue and its end at the last clean close


def read_manifest(path: str) -> tuple[dict[tuple[str, int], int], int | None]:
    """The queues the manifest lists with their ends, and the log's start then; empty when missing or unreadable.

    The manifest is only a check: without it recovery trusts the queues it finds.
    """
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(64 << 20))
        log_min = doc.get("log_min")
        return {(str(t), int(q)): int(n) for t, q, n in doc["queues"]}, (int(log_min) if log_min is not None else None)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, OverflowError):  # 1e400 is a float inf
        return {}, None


def manifest_bytes(queues: dict[tuple[str, int], ConsumeQueue], log_min: int) -> bytes:
    """Each queue's end as flushed to disk (a lower bound of its entries at any later open) and the log's start."""
    rows = [[t, q, cq.flushed] for (t, q), cq in sorted(queues.items())]
    return json.dumps({"version": 1, "log_min": log_min, "queues": rows}, separators=(",", ":")).encode()


def queue_problems(log: CommitLog, queues: dict[tuple[str, int], ConsumeQueue], manifest: dict[tuple[str, int], int]) -> list[str]:
    """Why the consume queues on disk disagree with the log (empty: they agree as far as a cheap check sees).

    Checks that every queue the manifest lists is there with at least the
    entries it had, and that each queue's last entry points at that
    queue's record with that queue offset. A problem makes recovery re-read
    the whole log, which rebuilds the queues from it.
    """
    out: list[str] = []
    for key, n in manifest.items():
        cq = queues.get(key)
        if cq is None:
            out.append(f"queue {key[0]}/{key[1]} is missing ({n} entries at the last close)")
        elif cq.next < n:
            out.append(f"queue {key[0]}/{key[1]} ends at {cq.next}, it had {n} entries at the last close")
    for (topic, qid), cq in queues.items():
        e = cq.entry(cq.next - 1) if cq.next > cq.base else None
        if e is None or 0 <= e[0] < log.min_offset:
            continue
        if e[0] < 0 or e[0] >= log.end:
            out.append(f"queue {topic}/{qid}: its last entry {cq.next - 1} points outside the log ({e[0]})")
            continue
        if log._seg_at(e[0]) is None:
            # Into a segment that went missing in the middle of the log (reported as damage): its records are
            # gone, and re-reading the log cannot bring them back. Rebuilding would find the same entry at
            # every start and re-read the whole log each time.
            continue
        try:
            rec = log.read(e[0])
        except CorruptRecordError:
            continue  # a damaged record: readers skip it; nothing to rebuild the queue from
        if rec.topic != topic or rec.queue_id != qid or rec.queue_offset != cq.next - 1 or rec.size != e[1]:
            out.append(f"queue {topic}/{qid}: its last entry {cq.next - 1} points at another record ({rec.topic}/{rec.queue_id}:{rec.queue_offset})")
    return out


def recover(
    log: CommitLog,
    queues: dict[tuple[str, int], ConsumeQueue],
    ckpt: Checkpoint | None,
    root: str,
    per_file: int,
    quarantine: str | None = None,
    rebuild: bool = False,
    manifest: tuple[dict[tuple[str, int], int], int | None] | None = None,
) -> Recovered:
    """Validate and re-dispatch from the checkpoint; skip damage inside the log, cut a torn tail.

    Damage below the checkpoint's fsynced offset (or anywhere, without a
    checkpoint) that a valid record follows - a flipped byte, a missing
    middle segment - is skipped: the walk resynchronises at the next valid
    record and the range is reported in ``damaged``. What no valid record
    follows is the tail a crash tore: the log is cut there, and with
    ``quarantine`` the cut bytes and later segments are moved there, never
    deleted. ``rebuild`` re-reads the whole log (queues that disagree with
    it are rebuilt).
    """
    out = Recovered()
    if manifest is not None:
        ends, was_min = manifest
        if was_min is not None and log.segments[0].start > was_min:
            # retention rewrites the manifest after it deletes: a start that moved otherwise is a file removed by hand
            out.damaged.append((was_min, f"the log starts at {log.segments[0].start}, it started at {was_min} at the last close: "
                                         "its first segment files were removed", log.segments[0].start - was_min))
        if not rebuild:
            out.queue_problems = queue_problems(log, queues, ends)
            rebuild = bool(out.queue_problems)
    segs = log.segments
    resync_below = ckpt.log_offset if ckpt is not None else _FAR
    i = 0
    while i + 1 < len(segs):
        a, b = segs[i], segs[i + 1]
        i += 1
        if a.end > b.start and log.cut_zero_tail(a, b.start - a.start):
            continue  # a crash before a sealed segment's preallocated zeros were cut off: cut them now
        if a.end > b.start:
            # The writer starts a segment where the last one's records end, so one of the two is not
            # the log's: a stray file named inside a's range (empty, or a's records run past its
            # start), or stray bytes after a's last record. Either is set aside, and the rest kept.
            if b.length == 0 or log.records_end_at(a, b.start) is False:
                why = f"{b.path} (starts inside the segment before it) is not part of the log: set aside"
                out.damaged.append((b.start, why, b.length))
                log.set_aside(b, quarantine)
                i -= 1  # a against the segment after b
                continue
            n = log.cut_overlap(a, b.start - a.start, quarantine)
            out.damaged.append((b.start, f"segment overlap at {b.start}: the {n} bytes of the segment before it past "
                                         "that were cut (set aside)", n))
            continue
        if a.end < b.start:
            why = f"segment gap at {a.end}: next segment starts at {b.start}"
            if a.end >= resync_below:  # a gap in the unsynced tail: the log ends there
                out.dropped_bytes, _ = log.truncate(a.end, quarantine)
                out.reason = why
                out.truncated_at = a.end
                break
            out.damaged.append((a.end, why, b.start - a.end))  # a segment went missing: skipped, the rest kept
    segs = log.segments
    log_min, files_end = segs[0].start, segs[-1].end
    if rebuild or ckpt is None or ckpt.cq_offset < log_min or not queues:
        start = log_min  # no checkpoint, or no queues at all (removed to force a rebuild)
    elif ckpt.cq_offset <= files_end:
        start = ckpt.cq_offset
    else:  # the log was cut from outside: re-read at least its last segment
        start = segs[-1].start
    out.scanned_from = start
    try:
        end, reason = _dispatch(log, queues, start, root, per_file, out, start == log_min, resync_below)
    except _NeedFullScan:
        out.scanned_from = log_min
        end, reason = _dispatch(log, queues, log_min, root, per_file, out, True, resync_below)
    if end < log.end:
        # Zeros from end to the file's end are preallocated space (docs/store-format.md): cut, not
        # reported; anything else there is a torn tail, moved to quarantine (its trailing zeros are not).
        dropped, out.preallocated = log.truncate(end, quarantine)
        if dropped:
            out.dropped_bytes += dropped
            out.reason = out.reason or reason
            out.truncated_at = end
    for cq in queues.values():
        out.cq_entries_dropped += cq.drop_bad_tail(end)
    return out


def _dispatch(
    log: CommitLog,
    queues: dict[tuple[str, int], ConsumeQueue],
    start: int,
    root: str,
    per_file: int,
    out: Recovered,
    full: bool,
    resync_below: int,
) -> tuple[int, str | None]:
    """Walk the log from start, putting each record into its queue; (end of valid log, reason).

    Past a damaged range, a queue's next record may skip the queue offsets
    whose records the range held: those get entries pointing at the range
    (readers report them as damaged and move on), so every later record
    keeps its queue offset.
    """
    since_flush = 0
    pos = start
    hole_at = -1  # start of the last damaged range
    holes = 0  # queue offsets the damaged ranges can account for (at most one record per 68 bytes)
    while True:
        for offset, rec in log._walk(pos, _FAR):
            if type(rec) is str:
                # resync only onto a record at or below the fsynced offset: past it, a hole is a torn tail
                nxt = log.next_valid(offset + 1, resync_below + 1) if offset < resync_below else None
                if nxt is None and offset < resync_below <= log.end:
                    # Damage in the fsynced part with nothing valid after it up to the checkpoint's
                    # offset (a record boundary): never cut what was acknowledged. The range is
                    # skipped and the log goes on at the checkpoint's offset, so no later record
                    # reuses a log offset or a queue offset that readers may already have passed.
                    nxt = resync_below
                if nxt is None:
                    return offset, rec
                if not any(d[0] == offset for d in out.damaged[-64:]):
                    out.damaged.append((offset, rec, nxt - offset))
                hole_at = offset
                holes += (nxt - offset) // HEADER_SIZE + 1
                pos = nxt
                break
            assert isinstance(rec, Record)
            key = (rec.topic, rec.queue_id)
            q = rec.queue_offset
            cq = queues.get(key)
            if cq is None:
                if q and not full:
                    raise _NeedFullScan
                cq = queues[key] = ConsumeQueue(root, rec.topic, rec.queue_id, q)
            if cq.base <= q < cq.next:
                e = cq.entry(q)
                if e is not None and e[0] == offset and e[1] == rec.size:
                    continue  # already indexed
                out.cq_entries_dropped += cq.truncate(q)
            elif q > cq.next and q - cq.next <= holes and hole_at >= cq.last_offset():
                holes -= q - cq.next
                while cq.next < q:
                    cq.append(hole_at, HEADER_SIZE, 0)
            elif q != cq.next:  # the queue lost entries the checkpoint said it had
                if not full:
                    raise _NeedFullScan
                out.cq_entries_dropped += cq.reset(q)
            cq.append(offset, rec.size, tag_hash(rec.properties.get("TAGS")))
            out.redispatched += 1
            since_flush += 1
            if since_flush >= _FLUSH_PENDING:
                flush_all(queues, per_file)  # on a full disk: held, up to its bound
                since_flush = 0
        else:
            return log.end, None  # a clean walk went through the last segment


# Entries (20 bytes each) recovery may hold in memory when the disk is full; more fails the start, as a
# full rebuild of a large log on a full disk would otherwise fill the memory instead.
HELD_ON_FULL_DISK = 64 << 20


def flush_all(queues: dict[tuple[str, int], ConsumeQueue], per_file: int) -> int:
    """Write and fsync every queue's pending entries (single-threaded use: recovery); returns the entries held back.

    Entries count as flushed only once fsynced, as in ``Store.checkpoint``.
    On a full disk a queue's entries stay pending in memory, where reads
    find them, and are held back: the store's checkpoints write them once
    there is space. A broker killed on a full disk must still start, or it
    could never run the retention that frees the space. Up to
    HELD_ON_FULL_DISK bytes of entries: past that the full-disk error is
    raised, and the start fails as it must without space.
    """
    held = 0  # bytes of entries held back so far (a running total: thousands of queues may fail in turn)
    for cq in queues.values():
        plan = cq.plan_flush()
        try:
            new = cq.write_synced(plan, per_file)
        except OSError as exc:
            if exc.errno not in FULL_ERRNOS or held + len(cq.pending) > HELD_ON_FULL_DISK:
                raise
            held += len(cq.pending)
            continue
        if plan is not None:
            cq.commit_flush(plan[0], len(plan[1]) // ENTRY_SIZE, new)
    return held // ENTRY_SIZE
