"""Recovery on open: validate the unindexed tail of the log, cut it at the first bad
record, and bring every consume queue back in line with the log.

See docs/store-format.md, "Recovery". The log before the checkpoint's
consume-queue offset is trusted; only what follows is read. If a record
shows that a queue lost entries the checkpoint claimed were on disk (its
queue offset is past the queue's end, or before its first file), the whole
log is re-read from its first byte, which rebuilds every queue.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .checkpoint import Checkpoint
from .codec import Record, tag_hash
from .commitlog import CommitLog
from .consumequeue import ENTRY_SIZE, ConsumeQueue

_FLUSH_PENDING = 1 << 20  # entries held in memory during recovery before writing them out


class _NeedFullScan(Exception):
    pass


@dataclass(slots=True)
class Recovered:
    dropped_bytes: int = 0
    reason: str | None = None
    truncated_at: int | None = None
    redispatched: int = 0
    cq_entries_dropped: int = 0
    scanned_from: int = 0


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
            if not q.isdigit() or not os.path.isdir(os.path.join(tdir, q)):
                continue
            cq, orphans = ConsumeQueue.load(root, topic, int(q))
            dropped += cq.repair_files(orphans)
            queues[(topic, int(q))] = cq
    return queues, dropped


def recover(
    log: CommitLog,
    queues: dict[tuple[str, int], ConsumeQueue],
    ckpt: Checkpoint | None,
    root: str,
    per_file: int,
) -> Recovered:
    """Validate and re-dispatch from the checkpoint; cut the log and the queues at the first bad record."""
    out = Recovered()
    segs = log.segments
    for a, b in zip(segs, segs[1:]):
        if a.end != b.start:  # a segment went missing (or shrank): the log ends at the gap
            out.dropped_bytes = log.truncate(a.end)
            out.reason = f"segment gap at {a.end}: next segment starts at {b.start}"
            out.truncated_at = a.end
            break
    log_min, files_end = segs[0].start, segs[-1].end
    if ckpt is None or ckpt.cq_offset < log_min or not queues:
        start = log_min  # no checkpoint, or no queues at all (removed to force a rebuild)
    elif ckpt.cq_offset <= files_end:
        start = ckpt.cq_offset
    else:  # the log was cut from outside: re-read at least its last segment
        start = segs[-1].start
    out.scanned_from = start
    try:
        end, reason = _dispatch(log, queues, start, root, per_file, out, full=start == log_min)
    except _NeedFullScan:
        out.scanned_from = log_min
        end, reason = _dispatch(log, queues, log_min, root, per_file, out, full=True)
    if end < files_end:
        out.dropped_bytes += log.truncate(end)
        out.reason = reason
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
) -> tuple[int, str | None]:
    """Walk the log from start, putting each record into its queue; (end of valid log, reason)."""
    since_flush = 0
    for offset, rec in log._walk(start, 1 << 62):
        if type(rec) is str:
            return offset, rec
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
        elif q != cq.next:  # the queue lost entries the checkpoint said it had
            if not full:
                raise _NeedFullScan
            out.cq_entries_dropped += cq.reset(q)
        cq.append(offset, rec.size, tag_hash(rec.properties.get("TAGS")))
        out.redispatched += 1
        since_flush += 1
        if since_flush >= _FLUSH_PENDING:
            flush_all(queues, per_file, fsync=False)
            since_flush = 0
    return log.end, None  # a clean walk went through the last segment


def flush_all(queues: dict[tuple[str, int], ConsumeQueue], per_file: int, fsync: bool) -> None:
    """Write every queue's pending entries (single-threaded use: recovery)."""
    for cq in queues.values():
        plan = cq.plan_flush()
        if plan is not None:
            base, data, last = plan
            new = cq.write(base, data, last, per_file)
            cq.commit_flush(base, len(data) // ENTRY_SIZE, new)
        if fsync and (cq.unsynced or not cq.dir_synced):
            cq.fsync()
