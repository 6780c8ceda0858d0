"""Reading the commit log: segment files, chunked walks, coalesced preads.

Shared by the writing Store and the read-only StoreReader. Nothing here reads
a whole segment into memory: sequential walks read CHUNK bytes at a time (or
one record, when a record is larger), and random reads pread only the byte
ranges asked for, merging neighbours into one call.
"""

from __future__ import annotations

import os
import struct
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence

from . import codec
from .codec import (H_QUEUE_ID, H_QUEUE_OFFSET, H_SIZE, H_TOPIC_LEN, HEADER_SIZE, MAGIC, Record, check_header, check_record,
                    decode, valid_header)
from .errors import CorruptRecordError

CHUNK = 1 << 20  # bytes per sequential read
FIRST_READ = 64 << 10  # a walk's first read: a reader's walk from the end of the data often meets zeros
GAP = 16 << 10  # read through holes up to this size rather than issue another pread
SPAN = 1 << 20  # largest coalesced random read (one record may be larger)
GUESS = 4096  # bytes read at an offset whose record size is unknown
# A raw pull reads through holes up to this size: one pread costs about what copying 8 KiB from the page cache does.
RAW_GAP = 8 << 10
_ENTRY = struct.Struct("<qIq")  # a consume-queue entry (consumequeue.ENTRY): commit-log offset, size, tag hash
_MAGIC_BYTES = MAGIC.to_bytes(4, "little")
_U32 = struct.Struct("<I")
ZERO_HEADER = bytes(8)  # where a record would start: no size, no magic (preallocated space)


def zero_at(fd: int, file_pos: int, file_len: int) -> bool:
    """No record starts at file_pos: its size and magic (8 bytes, fewer at the file's end) are zero."""
    head = os.pread(fd, min(8, file_len - file_pos), file_pos) if file_pos < file_len else b""
    return head == ZERO_HEADER[: len(head)]


def nonzero_end(fd: int, lo: int, hi: int) -> int:
    """The end of the last byte that is not zero in file positions [lo, hi), or lo when they all are.

    Reads backwards from hi in growing pieces, so a file that ends with data
    costs one small read and a zero tail is read once.
    """
    piece = 4096
    while hi > lo:
        n = min(piece, hi - lo)
        data = os.pread(fd, n, hi - n)  # short when the file is shorter than we were told: nothing there
        stripped = data.rstrip(b"\0")
        if stripped:
            return hi - n + len(stripped)
        hi -= n
        piece = min(piece * 4, CHUNK)
    return lo


class Segment:
    """One commit-log file: its global start offset, open fd, and the length in use."""

    __slots__ = ("start", "path", "fd", "length", "last_ts", "alloc")

    def __init__(self, start: int, path: str, fd: int, length: int) -> None:
        self.start = start
        self.path = path
        self.fd = fd
        self.length = length
        self.last_ts: int | None = None  # store_ts of its last record, once known
        self.alloc = length  # the file's size: the writer preallocates zeros past length (docs/store-format.md)

    @property
    def end(self) -> int:
        return self.start + self.length

    def __repr__(self) -> str:
        return f"Segment({self.start}, {self.length})"


def walk_segment(
    seg: Segment, pos: int, stop: int, validate_only: bool = False
) -> Iterator[tuple[int, Record | int | str]]:
    """Walk the records of seg from global offset pos (a record boundary).

    Yields (offset, Record) - or (offset, size) when validate_only - for every
    valid record starting before stop, and ends cleanly at stop or at the
    segment's end. At an invalid record it yields (offset, reason) and ends.
    """
    fd, start, seg_len = seg.fd, seg.start, seg.length
    base = pos - start  # file position of buf[0]
    buf = b""
    mv = memoryview(buf)
    p = 0
    check = check_record if validate_only else decode
    chunk = FIRST_READ
    while True:
        rpos = base + p
        offset = start + rpos
        if rpos >= seg_len or offset >= stop:
            return
        avail = len(buf) - p
        have_more = base + len(buf) < seg_len
        if have_more:
            need = HEADER_SIZE
            if avail >= HEADER_SIZE:
                need = _U32.unpack_from(buf, p)[0]
                if need > avail:  # check the header before trusting its size
                    total = check_header(buf, p, offset)
                    need = total if type(total) is int else 0
            if avail < need:
                want = min(max(chunk, need - avail), seg_len - base - len(buf))
                chunk = CHUNK
                data = os.pread(fd, want, base + len(buf))
                if not data:  # the file is shorter than we were told
                    seg_len = base + len(buf)
                    continue
                buf = buf[p:] + data if avail else data
                mv = memoryview(buf)
                base, p = rpos, 0
                continue
        res = check(buf, p, offset, mv)
        if type(res) is str:
            yield offset, res
            return
        yield offset, res
        p += res if validate_only else res.size


def resync(seg: Segment, pos: int, limit: int | None = None) -> int | None:
    """The first offset >= pos in seg where a valid record starts, or None.

    Looks for the magic, then checks the header (own offset == position) and
    only then reads and CRC-checks the whole candidate. With ``limit`` (a
    global offset) the search stops once no candidate below it is left, so
    it never reads on through a preallocated zero tail it was not asked about.
    """
    fd, start, seg_len = seg.fd, seg.start, seg.length
    base = pos - start
    if base >= seg_len:
        return None
    buf = os.pread(fd, min(CHUNK, seg_len - base), base)
    cand = 0  # candidates below this index of buf are ruled out
    while True:
        idx = buf.find(_MAGIC_BYTES, cand + 4)
        c = idx - 4
        if idx >= 0 and len(buf) - c < HEADER_SIZE and base + len(buf) < seg_len:
            idx = -1  # candidate header cut by the chunk: refill, then look again
        if idx < 0:
            if base + len(buf) >= seg_len:
                return None
            keep = max(cand, len(buf) - HEADER_SIZE)
            if limit is not None and start + base + keep >= limit:
                return None
            data = os.pread(fd, min(CHUNK, seg_len - base - len(buf)), base + len(buf))
            if not data:
                return None
            buf = buf[keep:] + data
            base, cand = base + keep, 0
            continue
        total = check_header(buf, c, start + base + c)
        if type(total) is int:
            if len(buf) - c < total and base + c + total <= seg_len:
                more = os.pread(fd, total - (len(buf) - c), base + len(buf))
                buf = buf[c:] + more
                base, cand, c = base + c, 0, 0
            if type(check_record(buf, c, start + base + c)) is int:
                return start + base + c
        cand = c + 1


class LogView:
    """Record reads over a sorted list of segments (subclasses keep the list current)."""

    _segs: list[Segment]
    _starts: list[int]

    def _readable_end(self) -> int:  # records must start below this
        raise NotImplementedError

    def _seg_at(self, offset: int) -> Segment | None:
        i = bisect_right(self._starts, offset) - 1
        if i < 0:
            return None
        seg = self._segs[i]
        return seg if offset < seg.end else None

    def _seg_index(self, offset: int) -> int:
        return max(bisect_right(self._starts, offset) - 1, 0)

    # ---- random reads ----------------------------------------------------
    def read(self, offset: int) -> Record:
        """The record starting at offset; CorruptRecordError if no valid record starts there."""
        seg = self._seg_at(offset) if offset < self._readable_end() else None
        if seg is None:
            raise CorruptRecordError(f"no record at {offset}: outside the log")
        return self._read_one(seg, offset, None)

    def _read_one(self, seg: Segment, offset: int, data: bytes | None, raw: bool = False) -> Record | memoryview:
        fpos = offset - seg.start
        if data is None:
            data = os.pread(seg.fd, min(GUESS, seg.length - fpos), fpos)
        total = check_header(data, 0, offset)
        if type(total) is int and total > len(data) and fpos + total <= seg.length:
            data += os.pread(seg.fd, total - len(data), fpos + len(data))
        if raw:
            h = valid_header(data, 0, offset, None)
            if h is None:
                problem = check_record(data, 0, offset)
                raise CorruptRecordError(problem if type(problem) is str else f"bad record at {offset}")
            return memoryview(data)[: h[H_SIZE]], h
        rec = decode(data, 0, offset)
        if type(rec) is str:
            raise CorruptRecordError(rec)
        return rec

    def read_many(self, offsets: Sequence[int], raw: bool = False) -> list[Record] | list[memoryview]:
        """The records at offsets (in that order), read with as few preads as possible.

        With raw, each is a pair: the record's bytes (CRC checked, not
        decoded) and its unpacked header (``codec.HEADER`` fields), for
        Store.append's RawCopy, which then needs no second unpack.
        """
        end = self._readable_end()
        order = sorted(range(len(offsets)), key=offsets.__getitem__)
        out: list = [None] * len(offsets)
        i = 0
        while i < len(order):
            first = offsets[order[i]]
            seg = self._seg_at(first) if first < end else None
            if seg is None:
                raise CorruptRecordError(f"no record at {first}: outside the log")
            j = i + 1
            while j < len(order):
                o = offsets[order[j]]
                if o >= seg.end or o - offsets[order[j - 1]] > GAP or o - first > SPAN:
                    break
                j += 1
            last = offsets[order[j - 1]]
            fpos = first - seg.start
            chunk = os.pread(seg.fd, min(last - first + GUESS, seg.length - fpos), fpos)
            mv = memoryview(chunk)
            for k in range(i, j):
                o = offsets[order[k]]
                pos = o - first
                if raw:
                    h = valid_header(chunk, pos, o, mv)
                    rec = (mv[pos : pos + h[H_SIZE]], h) if h is not None else self._read_one(seg, o, None, True)
                else:
                    rec = decode(chunk, pos, o, mv)
                    if type(rec) is str:  # cut by the chunk (a big record) or really bad
                        rec = self._read_one(seg, o, None)
                out[order[k]] = rec
            i = j
        return out

    def read_queue_raw(self, entries: bytes, max_bytes: int, max_record: int, topic: bytes, queue_id: int,
                       first_q: int) -> tuple[bytes, int] | None:
        """The records of packed consume-queue entries (for queue offsets first_q, first_q + 1, ...) as stored, back
        to back, with their count: the leading entries whose sizes fit max_bytes (at least one), none claiming more
        than max_record bytes (a garbage entry: nothing that large is allocated).

        None when any of them is not plain: an entry outside the log, a
        record that does not check (size, magic, lengths, its own offset,
        tx_type, CRC) or is not this queue's record at that queue offset, a
        failed read. The caller then reads with ``read_queue``, which
        reports, repairs or skips what is wrong. One compiled call when the
        speed-ups are built (``_speedups.read_queue_raw``), else
        ``read_queue_raw_py``, which answers the same.
        """
        fn = getattr(codec.speedups, "read_queue_raw", None)
        if fn is None:
            return self.read_queue_raw_py(entries, max_bytes, max_record, topic, queue_id, first_q)
        segs = [(seg.start, seg.start + seg.length, seg.fd) for seg in self._segs]
        return fn(entries, max_bytes, max_record, segs, self._readable_end(), topic, queue_id, first_q, RAW_GAP, SPAN)

    def read_queue_raw_py(self, entries: bytes, max_bytes: int, max_record: int, topic: bytes, queue_id: int,
                          first_q: int, gap: int = RAW_GAP, span: int = SPAN) -> tuple[bytes, int] | None:
        """read_queue_raw in Python (no compiled speed-ups): the same answers (holes up to gap read through, runs of at
        most span bytes)."""
        picked: list[tuple[int, int]] = []
        total = 0
        for off, size, _ in _ENTRY.iter_unpack(memoryview(entries)[: len(entries) // 20 * 20]):
            if size > max_record:  # a garbage entry: the usual read reports it
                if not picked:
                    return None
                break
            if picked and total + size > max_bytes:
                break
            picked.append((off, size))
            total += size
        if not picked or not self._segs or len(topic) > 0xFFFF:
            return None
        end = self._readable_end()
        parts: list = []
        i = 0
        try:
            while i < len(picked):
                off, size = picked[i]
                seg = self._seg_at(off)
                if seg is None or size < HEADER_SIZE or off + size > min(seg.end, end):
                    return None
                limit = min(seg.end, end)
                run_end = off + size
                j = i + 1
                while j < len(picked):
                    o, sz = picked[j]
                    if o < run_end or sz < HEADER_SIZE or o + sz > limit or o - run_end > gap or o + sz - off > span:
                        break
                    run_end = o + sz
                    j += 1
                chunk = os.pread(seg.fd, run_end - off, off - seg.start)
                if len(chunk) != run_end - off:
                    return None
                mv = memoryview(chunk)
                for k in range(i, j):
                    o, sz = picked[k]
                    pos = o - off
                    h = valid_header(chunk, pos, o, mv)
                    if (h is None or h[H_SIZE] != sz or h[H_QUEUE_ID] != queue_id or h[H_QUEUE_OFFSET] != first_q + k
                            or h[H_TOPIC_LEN] != len(topic) or mv[pos + HEADER_SIZE : pos + HEADER_SIZE + len(topic)] != topic):
                        return None
                    parts.append(mv[pos : pos + sz])
                i = j
        except OSError:  # the usual read meets it again and says so
            return None
        return b"".join(parts), len(picked)

    def read_queue(self, topic: str, queue_id: int, first_q: int, entries: Sequence[tuple[int, int]]) -> tuple[list[Record], list[tuple[int, int, str]]]:
        """The records of consume-queue entries first_q, first_q + 1, ... (given as (offset, size) pairs).

        An entry that does not lead to this queue's record with that queue
        offset and that size (a damaged record, an entry pointing outside the
        log, a garbage entry) is skipped and reported as (queue offset, commit-log
        offset, reason) in the second list, so one bad record never holds
        back the good ones around it. Neighbouring records are read with one
        pread (holes up to GAP, runs up to SPAN).
        """
        end = self._readable_end()
        good: list[Record] = []
        bad: list[tuple[int, int, str]] = []
        run: list[tuple[int, int, int]] = []  # (queue offset, offset, size) of one coalesced read
        run_seg: Segment | None = None
        run_end = 0

        def read_run() -> None:
            first = run[0][1]
            chunk = os.pread(run_seg.fd, run_end - first, first - run_seg.start)  # type: ignore[union-attr]
            mv = memoryview(chunk)
            for q, o, size in run:
                rec = decode(chunk, o - first, o, mv)
                if type(rec) is str:
                    bad.append((q, o, rec))
                elif rec.topic != topic or rec.queue_id != queue_id or rec.queue_offset != q:
                    bad.append((q, o, f"queue entry {topic}/{queue_id}:{q} points at another record ({rec.topic}/{rec.queue_id}:{rec.queue_offset}) at {o}"))
                elif rec.size != size:
                    bad.append((q, o, f"queue entry {topic}/{queue_id}:{q} has size {size}, its record at {o} has {rec.size}"))
                else:
                    good.append(rec)

        for i, (o, size) in enumerate(entries):
            q = first_q + i
            seg = self._seg_at(o) if 0 <= o < end else None
            if seg is None or size < HEADER_SIZE or o + size > min(seg.end, end):
                if seg is None:
                    why = f"no record at {o}: outside the log"
                else:
                    why = f"queue entry {topic}/{queue_id}:{q} has an impossible size {size} at {o}"
                bad.append((q, o, why))
                continue
            if run and (seg is not run_seg or o - run_end > GAP or o + size - run[0][1] > SPAN or o < run_end):
                read_run()
                run = []
            if not run:
                run_seg = seg
            run.append((q, o, size))
            run_end = o + size
        if run:
            read_run()
        return good, bad

    # ---- sequential reads ------------------------------------------------
    def _walk(
        self, start: int, stop: int, validate_only: bool = False
    ) -> Iterator[tuple[int, Record | int | str]]:
        """walk_segment over every segment from start (a boundary) to stop.

        A gap between segments yields (end of the first, "segment gap at N").
        """
        segs = self._segs
        i = self._seg_index(start)
        pos = start
        while i < len(segs) and pos < stop:
            seg = segs[i]
            if pos < seg.start:
                yield pos, f"segment gap at {pos}: next segment starts at {seg.start}"
                return
            for item in walk_segment(seg, pos, stop, validate_only):
                yield item
                if type(item[1]) is str:
                    return
            pos = seg.end
            i += 1

    def next_valid(self, pos: int, stop: int) -> int | None:
        """The first offset in [pos, stop) where a valid record starts (resynchronising), or None."""
        for seg in self._segs[self._seg_index(pos):]:
            if seg.start >= stop:
                return None
            if seg.end <= pos:
                continue
            found = resync(seg, max(pos, seg.start), stop)
            if found is not None:
                return found if found < stop else None
        return None

    def _scan(self, start: int, end: int, on_damage: Callable[[int, str, int], None] | None = None) -> Iterator[Record]:
        """Records from start (a boundary) to end, in order.

        A damaged record raises CorruptRecordError; with ``on_damage`` it is
        reported as (offset, reason, bytes skipped) instead and the walk
        resynchronises at the next valid record (every record carries its
        own offset, so a match is never a body that embeds record bytes).
        """
        first = self._segs[0].start if self._segs else 0
        pos = max(start, first)
        while pos < end:
            for offset, rec in self._walk(pos, end):
                if type(rec) is str:
                    if on_damage is None:
                        raise CorruptRecordError(rec)
                    nxt = self.next_valid(offset + 1, end)
                    on_damage(offset, rec, (end if nxt is None else nxt) - offset)
                    pos = end if nxt is None else nxt
                    break
                yield rec  # type: ignore[misc]
            else:
                return

    def _scan_range(self, start: int, end: int, on_damage: Callable[[int, str, int], None] | None = None) -> Iterator[Record]:
        """Records starting in [start, end); start may be any byte position.

        end must not exceed the readable end (callers clamp it), so every
        invalid record met here is damage and raises CorruptRecordError;
        with ``on_damage`` it is reported as (offset, reason, bytes skipped)
        instead and the walk goes on at the next valid record. Contiguous
        ranges still partition the log: a record after the damage that
        starts at or past end is the next range's, which finds it by
        resynchronising from its own start.
        """
        segs = self._segs
        if not segs:
            return
        start = max(start, segs[0].start)
        i = self._seg_index(start)
        while i < len(segs) and start < end:
            seg = segs[i]
            pos = start if start > seg.start else seg.start
            if pos > seg.start:
                found = resync(seg, pos)
                if found is None:
                    start = seg.end
                    i += 1
                    continue
                pos = found
            resume = None
            for offset, rec in walk_segment(seg, pos, end):
                if type(rec) is str:  # before the readable end: damage, not a torn tail
                    if on_damage is None:
                        raise CorruptRecordError(rec)
                    nxt = self.next_valid(offset + 1, end)
                    resume = end if nxt is None else nxt
                    on_damage(offset, rec, resume - offset)
                    break
                yield rec  # type: ignore[misc]
            if resume is not None:
                start = resume  # a record boundary (or end): resync finds it where it is
                if start < end:
                    i = self._seg_index(start)
                continue
            start = seg.end
            i += 1
