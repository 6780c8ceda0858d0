"""Damaged consume-queue entries, rebuilt from the commit log by the read that meets them.

Recovery checks only each queue's last entry at open: checking every entry
would make a start cost the whole history. An entry in the middle of a
queue that no longer leads to its record (a flipped byte, a zeroed page of
the file) is found by the read that meets it instead: ``read_queue`` checks
that each entry leads to a valid record of its queue, with its queue offset
and its size. A queue is sorted by commit-log offset, so the records of a
stretch of such entries lie between the record of the nearest good entry
before the stretch and that of the nearest good entry after it. That part
of the log is walked header to header (only the queue's own records are
decoded and CRC-checked), and the entries found are written in place; the
store's next checkpoint fsyncs them. A queue offset whose record is not
there (the record itself is damaged, or was in a lost segment) stays
skipped, and is remembered so later reads do not walk again.

A read walks at most ``STEP_BYTES`` and ``STEP_RECORDS`` of the log, so it
never holds the event loop long, however far apart a sparse queue's records
are. A walk that needs more goes on at the next read of the queue; reads
meanwhile stop at the stretch (``GetResult.repairing``). A crash before the
fsync leaves entries that are still damaged: the next read rebuilds them.
"""

from __future__ import annotations

import logging
import os
import time
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .codec import HEADER, HEADER_SIZE, MAGIC, TAGS_PROPERTY, Record, TxType, decode, tag_hash
from .consumequeue import ConsumeQueue, Entry
from .errors import CorruptRecordError
from .segments import LogView

_log = logging.getLogger("txmq.store")
STEP_BYTES = 4 << 20  # of the log read per read that meets damage
STEP_RECORDS = 8192  # record headers looked at per read (~0.4 us each)
_CHUNK = 256 << 10
_LOST_KEPT = 10_000  # ranges of lost queue offsets remembered; past that, a read of one walks again
_N_TX = len(TxType)
_unpack_header = HEADER.unpack_from


@dataclass(slots=True)
class _Walk:
    first: int  # queue offsets [first, last] are rebuilt
    last: int
    start: int  # from the log's records in [start, stop)
    stop: int
    pos: int  # where the walk goes on: a record boundary, or a place to resynchronise from
    expect: int  # the next queue offset looked for
    rewritten: int = 0
    lost: list[tuple[int, int]] = field(default_factory=list)
    steps: int = 0
    began: float = field(default_factory=time.perf_counter)


class StoreAccess(Protocol):
    """What a rebuild uses of the store (``txmq.store.store.Store``, which passes itself to ``meet``)."""

    def _open_log(self) -> LogView: ...

    def cq_entries(self, topic: str, queue_id: int, start: int, max_count: int) -> list[Entry]: ...

    def queue_min_offset(self, topic: str, queue_id: int) -> int: ...

    def _rewrite_entries(self, cq: ConsumeQueue, changes: list[tuple[int, Entry]]) -> set[int]: ...


class QueueRepairs:
    """The walks under way (one per queue at most) and the queue offsets known lost, for one open store."""

    def __init__(self) -> None:
        self._walks: dict[tuple[str, int], _Walk] = {}
        self._lost: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self._lost_ranges = 0

    def is_lost(self, key: tuple[str, int], q: int) -> bool:
        ranges = self._lost.get(key)
        if not ranges:
            return False
        i = bisect_right(ranges, (q, 1 << 62)) - 1
        return i >= 0 and q <= ranges[i][1]

    def meet(self, store: StoreAccess, cq: ConsumeQueue, first_q: int, entries: Sequence[tuple[int, int]],
             bad: list[tuple[int, int, str]]) -> tuple[int, int | None]:
        """A read of entries [first_q, ...) met ``bad``: rebuild what one step can.

        Returns (entries rewritten, the first of the read's queue offsets
        whose walk goes on at a later read, or None).
        """
        key = (cq.topic, cq.queue_id)
        todo = [(q, o) for q, o, _ in bad if not self.is_lost(key, q)]
        if not todo:
            return 0, None
        log = store._open_log()
        walk = self._walks.get(key)
        rewritten, todo = self._in_place(store, log, cq, todo, walk)
        skipped = {q for q, _, _ in bad}
        budget = [STEP_BYTES, STEP_RECORDS]
        for a, b in _runs([q for q, _ in todo]):
            while True:
                walk = self._walks.get(key)
                if walk is None:
                    walk = self._walks[key] = self._begin(store, log, cq, a, b, first_q, entries, skipped)
                before = walk.rewritten
                done = self._step(store, log, cq, walk, budget)
                rewritten += walk.rewritten - before
                if not done:
                    return rewritten, a
                self._finish(key, walk)
                if walk.first <= a and b <= walk.last:  # else it was another stretch's walk: now this one's
                    break
        return rewritten, None

    def _in_place(self, store: StoreAccess, log: LogView, cq: ConsumeQueue, todo: list[tuple[int, int]],
                  walk: _Walk | None) -> tuple[int, list[tuple[int, int]]]:
        """Entries whose record is where they point (their size is what changed): rewritten at once, no walk."""
        fixes: dict[int, Entry] = {}
        tried: dict[int, Record | str] = {}  # a zeroed page of entries points at offset 0 many times
        for q, o in todo:
            if walk is not None and walk.first <= q <= walk.last:
                continue
            rec = tried.get(o)
            if rec is None:
                rec = tried[o] = _read(log, o)
            if type(rec) is not str and rec.topic == cq.topic and rec.queue_id == cq.queue_id and rec.queue_offset == q:
                fixes[q] = (o, rec.size, tag_hash(rec.properties.get(TAGS_PROPERTY)))
        if not fixes:
            return 0, todo
        written = store._rewrite_entries(cq, list(fixes.items()))
        for a, b in _runs(sorted(fixes)):
            lost = [(q, q) for q in range(a, b + 1) if q not in written]
            self._remember((cq.topic, cq.queue_id), lost)
            _log.warning("event=consume_queue_entries_rebuilt topic=%s queue_id=%d first=%d last=%d rewritten=%d lost=%d "
                         "log_from=%d log_to=%d steps=0 ms=0.0", cq.topic, cq.queue_id, a, b, b - a + 1 - len(lost),
                         len(lost), fixes[a][0], fixes[b][0] + fixes[b][1])
        return len(written), [(q, o) for q, o in todo if q not in fixes]

    def _begin(self, store: StoreAccess, log: LogView, cq: ConsumeQueue, a: int, b: int, first_q: int,
               entries: Sequence[tuple[int, int]], skipped: set[int]) -> _Walk:
        """The walk for damaged queue offsets [a, b]: out to the nearest good entries on both sides.

        Entries are probed 1, 2, 4, ... away, so a long stretch costs few
        reads; a good entry further out only lengthens the walk (the records
        between are found again, and their entries left as they are).
        """
        topic, qid = cq.topic, cq.queue_id

        def good(g: int) -> tuple[int, int] | None:
            i = g - first_q
            if 0 <= i < len(entries):
                return None if g in skipped else entries[i]
            e = store.cq_entries(topic, qid, g, 1)
            if not e or e[0][0] < 0:
                return None
            found, _ = log.read_queue(topic, qid, g, [(e[0][0], e[0][1])])
            return (e[0][0], e[0][1]) if found else None

        lo, hi = store.queue_min_offset(topic, qid), cq.next
        first, start = min(lo, a), log.min_offset
        step, g = 1, a - 1
        while g >= lo:
            e = good(g)
            if e is not None:
                first, start = g + 1, e[0] + e[1]
                break
            if g == lo:
                break
            step *= 2
            g = max(a - step, lo)
        last, stop = max(hi - 1, b), log.end
        step, g = 1, b + 1
        while g < hi:
            e = good(g)
            if e is not None:
                last, stop = g - 1, e[0]
                break
            if g == hi - 1:
                break
            step *= 2
            g = min(b + step, hi - 1)
        return _Walk(first, last, start, stop, start, first)

    def _step(self, store: StoreAccess, log: LogView, cq: ConsumeQueue, walk: _Walk, budget: list[int]) -> bool:
        """Walk on within budget (bytes, headers), writing the entries found; True once the walk is over."""
        topic_b = cq.topic.encode()
        tlen, qid, first, last, stop = len(topic_b), cq.queue_id, walk.first, walk.last, walk.stop
        found: list[tuple[int, Entry]] = []
        pos = max(walk.pos, log.min_offset)  # retention may have deleted the segments the walk was in
        while pos < stop and budget[0] > 0 and budget[1] > 0 and (not found or found[-1][0] < last):
            seg = log._seg_at(pos)
            if seg is None:  # a segment missing in the middle of the log (recovery reported it): on after it
                i = bisect_right(log._starts, pos)
                pos = log._segs[i].start if i < len(log._segs) else stop
                continue
            buf = os.pread(seg.fd, min(_CHUNK, seg.end - pos, stop - pos), pos - seg.start)
            budget[0] -= len(buf)
            n, p, resume = len(buf), 0, None
            mv = memoryview(buf)
            while p + HEADER_SIZE <= n and budget[1] > 0:
                size, magic, _, own, tx, _, tl, q_id, q_off, _, _, _, plen, blen = _unpack_header(buf, p)
                off = pos + p
                if (magic != MAGIC or own != off or tx >= _N_TX or size != HEADER_SIZE + tl + plen + blen
                        or off + size > seg.end):
                    resume = self._resync(log, off, stop, budget)
                    break
                budget[1] -= 1
                if q_id == qid and tl == tlen and first <= q_off <= last:
                    if p + HEADER_SIZE + tl > n:
                        break  # read again from this record
                    if buf[p + HEADER_SIZE : p + HEADER_SIZE + tl] == topic_b:
                        rec = decode(buf, p, off, mv) if p + size <= n else _read(log, off)
                        if type(rec) is str:
                            resume = self._resync(log, off, stop, budget)
                            break
                        found.append((q_off, (off, size, tag_hash(rec.properties.get(TAGS_PROPERTY)))))
                        if q_off == last:  # the stretch's last record: nothing further to look for
                            p += size
                            break
                p += size
            if resume is None and p == 0 and budget[1] > 0:  # not even one header fits before stop or the segment's end
                resume = self._resync(log, pos, stop, budget)
            pos = resume if resume is not None else pos + p
        walk.pos = pos
        walk.steps += 1
        self._apply(store, cq, walk, found)
        if pos < stop and walk.expect <= last:
            return False
        if walk.expect <= walk.last:
            walk.lost.append((walk.expect, walk.last))
        return True

    def _resync(self, log: LogView, off: int, stop: int, budget: list[int]) -> int:
        """Where the walk goes on after a damaged record at off: the next valid record, searched within budget."""
        limit = min(stop, off + 1 + max(budget[0], _CHUNK))
        budget[0] -= limit - off
        nxt = log.next_valid(off + 1, limit)
        return nxt if nxt is not None else limit  # limit: a place to search on from at the next step

    def _apply(self, store: StoreAccess, cq: ConsumeQueue, walk: _Walk, found: list[tuple[int, Entry]]) -> None:
        """Write the found entries that differ from the queue's; queue offsets passed over are lost."""
        if not found:
            return
        lo = found[0][0]
        current = store.cq_entries(cq.topic, cq.queue_id, lo, found[-1][0] - lo + 1)
        base = lo + (found[-1][0] - lo + 1 - len(current))  # cq_entries leaves out offsets before the queue's start
        changes: list[tuple[int, Entry]] = []
        for q, e in found:
            if q < walk.expect:  # a record found twice (one forged inside a body): the first one is the queue's
                continue
            if q > walk.expect:
                walk.lost.append((walk.expect, q - 1))
            walk.expect = q + 1
            i = q - base
            if 0 <= i < len(current) and tuple(current[i]) != e:
                changes.append((q, e))
        if changes:
            written = store._rewrite_entries(cq, changes)
            walk.rewritten += len(written)
            walk.lost += [(q, q) for q, _ in changes if q not in written]

    def _finish(self, key: tuple[str, int], walk: _Walk) -> None:
        del self._walks[key]
        lost = sum(b - a + 1 for a, b in walk.lost)
        self._remember(key, walk.lost)
        _log.warning("event=consume_queue_entries_rebuilt topic=%s queue_id=%d first=%d last=%d rewritten=%d lost=%d "
                     "log_from=%d log_to=%d steps=%d ms=%.1f", key[0], key[1], walk.first, walk.last, walk.rewritten,
                     lost, walk.start, walk.stop, walk.steps, (time.perf_counter() - walk.began) * 1000)

    def _remember(self, key: tuple[str, int], lost: list[tuple[int, int]]) -> None:
        """Add ranges of lost queue offsets, kept sorted and disjoint (a later walk may pass over earlier ones)."""
        ranges = self._lost.setdefault(key, [])
        for a, b in lost:
            i = bisect_left(ranges, (a, -1))
            if i and ranges[i - 1][1] >= a - 1:
                i -= 1
            j = i
            while j < len(ranges) and ranges[j][0] <= b + 1:
                a, b = min(a, ranges[j][0]), max(b, ranges[j][1])
                j += 1
            if j == i and self._lost_ranges >= _LOST_KEPT:
                return
            ranges[i:j] = [(a, b)]
            self._lost_ranges += 1 - (j - i)


def _read(log: LogView, offset: int) -> Record | str:
    """The record at offset, or why there is none."""
    try:
        return log.read(offset)
    except (CorruptRecordError, ValueError, OSError) as exc:
        return str(exc)


def _runs(qs: list[int]) -> list[tuple[int, int]]:
    """Sorted queue offsets as (first, last) runs of consecutive ones."""
    out: list[tuple[int, int]] = []
    for q in qs:
        if out and q == out[-1][1] + 1:
            out[-1] = (out[-1][0], q)
        else:
            out.append((q, q))
    return out
