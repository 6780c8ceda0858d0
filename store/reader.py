"""StoreReader: a read-only view of a data directory, safe while a broker writes it.

It takes no lock and changes nothing. Each call looks at the files again:
new segments are opened, deleted ones forgotten, and the log's tail is
validated record by record from where the last call stopped (from the
checkpoint's fsynced offset the first time), so ``max_offset`` is always the
end of the last complete valid record and a torn tail is never returned.

Consume-queue files lag the log (the broker writes them at checkpoints), so
the reader also indexes, in memory, the records after the checkpoint's
consume-queue offset; consume-queue entries pointing at or past the
validated end are ignored.

The writer preallocates zeros after the data of the last segment
(docs/store-format.md, "Preallocated space"): there, at or past the
checkpoint's fsynced offset, a place where no record starts (size and magic
zero) is the end of the data, not damage, and is not searched past.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

from .checkpoint import CHECKPOINT, Checkpoint, decode_checkpoint, read_checkpoint
from .codec import Record, tag_hash
from .consumequeue import ENTRY, ENTRY_SIZE, ConsumeQueue, Entry, pick_entries, record_start_from, stored_record_at
from .damage import Damage, DamageLog
from .errors import CorruptRecordError
from .files import list_numbered, offset_name
from .model import GetResult, GetStatus
from .segments import LogView, Segment, nonzero_end, zero_at

_FAR = 1 << 62


class StoreReader(LogView):
    """A read-only view of a data directory (see the module's docstring).

    ``known_end``: (offset, end) of the last record another reader of the
    same files validated (``last_record``; the Spark driver that planned
    the partitions passes it to each task). When a valid record still
    starts at that offset and ends there, the first validation starts at
    its end instead of at the checkpoint's fsynced offset, so a task does
    not re-read the whole log of a directory copied without its
    checkpoint; otherwise (the log was cut back, or written again) it is
    ignored. Records are checked one by one as they are read either way.
    """

    def __init__(self, data_dir: str | os.PathLike, known_end: tuple[int, int] | None = None) -> None:
        self.data_dir = os.fspath(data_dir)
        self._cl_dir = os.path.join(self.data_dir, "commitlog")
        self._cq_root = os.path.join(self.data_dir, "consumequeue")
        self._segs: list[Segment] = []
        self._starts: list[int] = []
        self._valid_end: int | None = None
        self._last_record: tuple[int, int] | None = None  # (offset, end) of the last valid record found
        self._dead_tail: tuple[int, int, int] | None = None  # (offset, last segment's start, end) with nothing valid after
        self._cqs: dict[tuple[str, int], ConsumeQueue] = {}
        self._overlay: dict[tuple[str, int], tuple[int, bytearray]] = {}
        self._overlay_pos: int | None = None
        self._files_end: tuple[tuple[int, int, int], int] | None = None  # ((start, length, from), data end) of the last segment
        self.damage = DamageLog()
        if known_end is not None:
            self._refresh_segments()
            if self._ends_a_record(*known_end):
                self._valid_end, self._last_record = known_end[1], known_end
        self._refresh()

    def _ends_a_record(self, offset: int, end: int) -> bool:
        """Whether a valid record starts at offset and ends at end (one read)."""
        seg = self._seg_at(offset) if 0 <= offset < end else None
        if seg is None or end > seg.end:
            return False
        try:
            rec = self._read_one(seg, offset, None)
        except (CorruptRecordError, OSError):
            return False
        return offset + rec.size == end

    @property
    def last_record(self) -> tuple[int, int] | None:
        """(offset, end) of the last valid record, for another reader's ``known_end``; None for an empty log."""
        self._refresh()
        return self._last_record

    def close(self) -> None:
        for seg in self._segs:
            os.close(seg.fd)
        self._segs, self._starts = [], []
        for cq in self._cqs.values():
            cq.close()
        self._cqs.clear()
        self._valid_end = self._last_record = None

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- keeping up with the writer ------------------------------------------
    def _refresh(self) -> None:
        self._refresh_segments()
        segs = self._segs
        if not segs:
            self._valid_end = 0
            return
        end = self._valid_end
        if end is None or end < segs[0].start or end > segs[-1].end:
            end = self._trusted_start(lambda c: c.log_offset)
            self._last_record = None
        pos = end
        while True:
            for offset, res in self._walk(pos, _FAR, validate_only=True):
                if type(res) is str:
                    last = segs[-1]
                    if offset >= last.start and zero_at(last.fd, offset - last.start, last.length) and offset >= self._fsynced():
                        pos = -1  # preallocated space after the data: the end, with nothing to search
                        break
                    # Damage inside the log (a valid record follows) is skipped;
                    # nothing valid after it is the tail a writer is still writing.
                    tail = (offset, segs[-1].start, segs[-1].end)
                    nxt = None if tail == self._dead_tail else self.next_valid(offset + 1, _FAR)
                    if nxt is None:  # searched once; again only when the files change
                        self._dead_tail = tail
                    pos = nxt if nxt is not None else -1
                    break
                end = offset + res  # type: ignore[operator]
                self._last_record = (offset, end)
            else:
                break
            if pos < 0:
                break
        self._valid_end = end

    def _fsynced(self) -> int:
        """The checkpoint's fsynced log offset now (0 without a valid checkpoint), read quietly."""
        try:
            with open(os.path.join(self.data_dir, "checkpoint"), "rb") as f:
                ckpt = decode_checkpoint(f.read(CHECKPOINT.size + 1))
        except OSError:
            return 0
        return ckpt.log_offset if ckpt is not None else 0

    def _refresh_segments(self) -> None:
        known = {seg.start: seg for seg in self._segs}
        # The old last segment may have grown, or been cut back to its data, before the writer
        # rolled: measured after the listing, since the writer cuts before it creates the next.
        was_last = self._segs[-1] if self._segs else None
        segs: list[Segment] = []
        for start in list_numbered(self._cl_dir):
            seg = known.pop(start, None)
            if seg is None:
                path = os.path.join(self._cl_dir, offset_name(start))
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:  # deleted by retention meanwhile
                    continue
                seg = Segment(start, path, fd, os.fstat(fd).st_size)
            segs.append(seg)
        for seg in known.values():
            os.close(seg.fd)
        if was_last is not None and was_last.start not in known:
            was_last.length = os.fstat(was_last.fd).st_size
        if segs:
            segs[-1].length = os.fstat(segs[-1].fd).st_size
        for a, b in zip(segs, segs[1:]):
            # a sealed segment whose preallocated zeros a crash left (the writer's next open cuts them)
            if a.end > b.start and nonzero_end(a.fd, b.start - a.start, a.length) == b.start - a.start:
                a.length = b.start - a.start
        self._segs = segs
        self._starts = [seg.start for seg in segs]

    def _trusted_start(self, pick) -> int:
        """A record boundary to start validating or indexing from, per the checkpoint."""
        ckpt: Checkpoint | None = read_checkpoint(os.path.join(self.data_dir, "checkpoint"))
        lo, hi = self._segs[0].start, self._segs[-1].end
        if ckpt is None or pick(ckpt) < lo:
            return lo
        return pick(ckpt) if pick(ckpt) <= hi else self._segs[-1].start

    def _readable_end(self) -> int:
        if self._valid_end is None:
            self._refresh()
        return self._valid_end  # type: ignore[return-value]

    # ---- the log -----------------------------------------------------------
    @property
    def max_offset(self) -> int:
        """End of the last complete valid record."""
        self._refresh()
        return self._valid_end  # type: ignore[return-value]

    @property
    def min_offset(self) -> int:
        self._refresh_segments()
        return self._segs[0].start if self._segs else 0

    @property
    def files_end(self) -> int:
        """End of the last segment's data: above max_offset when its tail is torn or damaged.

        Zeros after the last non-zero byte past the valid end (the space a
        writer preallocates) are not counted; they are read once per change
        of the files.
        """
        self._refresh()
        if not self._segs:
            return 0
        last = self._segs[-1]
        lo = min(max((self._valid_end or 0) - last.start, 0), last.length)
        key = (last.start, last.length, lo)
        if self._files_end is None or self._files_end[0] != key:
            self._files_end = (key, last.start + nonzero_end(last.fd, lo, last.length))
        return self._files_end[1]

    @property
    def preallocated(self) -> int:
        """Zero bytes after the data at the end of the last segment file (space a writer reserved)."""
        end = self.files_end
        return self._segs[-1].end - end if self._segs else 0

    def segments(self) -> list[tuple[int, str, int]]:
        """(start offset, path, length) of each segment; the last length stops at the valid end."""
        self._refresh()
        end = self._valid_end or 0
        return [(s.start, s.path, max(0, min(s.length, end - s.start))) for s in self._segs if s.start <= end]

    def read(self, offset: int) -> Record:
        if offset >= self._readable_end():
            self._refresh()
        return super().read(offset)

    def record_start_from(self, offset: int, queues: list[tuple[str, int]] | None = None) -> int | None:
        """The first offset >= offset where a stored record starts (``consumequeue.record_start_from``)."""
        return record_start_from(self, offset, queues)

    def read_record(self, offset: int) -> Record:
        """The record that starts at offset, for an offset a user gave (``stored_record_at``)."""
        return stored_record_at(self, offset)

    def read_many(self, offsets: Sequence[int], raw: bool = False) -> list[Record] | list[memoryview]:
        if offsets and max(offsets) >= self._readable_end():
            self._refresh()
        return super().read_many(offsets, raw)

    def scan(self, start: int = 0, end: int | None = None) -> Iterator[Record]:
        self._refresh()
        stop = self._valid_end if end is None else min(end, self._valid_end)  # type: ignore[type-var]
        return self._scan(start, stop, self._log_damage)  # type: ignore[arg-type]

    def _log_damage(self, offset: int, reason: str, length: int) -> None:
        self.damage.report(Damage(offset, "log", reason, length))

    def scan_range(self, start: int, end: int, on_damage: Callable[[int, str, int], None] | None = None) -> Iterator[Record]:
        """Every valid record whose offset is in [start, end); start may be any byte position.

        Resynchronises to the first record boundary at or after start (magic,
        header, CRC and own offset must all check out), so contiguous ranges
        partition the log exactly. Records past the validated end are not
        returned. A damaged record raises CorruptRecordError, or with
        ``on_damage`` is reported as (offset, reason, bytes skipped) and skipped.
        """
        self._refresh()
        return self._scan_range(start, min(end, self._valid_end), on_damage)  # type: ignore[type-var]

    # ---- consume queues ------------------------------------------------------
    def _index_tail(self) -> None:
        """Index, in memory, records the consume-queue files may not have yet."""
        self._refresh()
        end = self._valid_end
        pos = self._overlay_pos
        if not self._segs or end is None:
            return
        if pos is None or pos < self._segs[0].start or pos > end:
            self._overlay.clear()
            pos = self._trusted_start(lambda c: c.cq_offset)
        overlay = self._overlay
        for offset, rec in self._walk(pos, end):
            if type(rec) is str:
                break
            assert isinstance(rec, Record)
            key = (rec.topic, rec.queue_id)
            q = rec.queue_offset
            ov = overlay.get(key)
            if ov is None or q != ov[0] + len(ov[1]) // ENTRY_SIZE:
                if ov is not None and q < ov[0] + len(ov[1]) // ENTRY_SIZE:
                    continue
                ov = overlay[key] = (q, bytearray())
            ov[1].extend(ENTRY.pack(offset, rec.size, tag_hash(rec.properties.get("TAGS"))))
            pos = rec.end_offset
        self._overlay_pos = end

    def _disk_queue(self, key: tuple[str, int]) -> ConsumeQueue | None:
        cq = self._cqs.get(key)
        if cq is None:
            if not os.path.isdir(os.path.join(self._cq_root, key[0], str(key[1]))):
                return None
            cq = self._cqs[key] = ConsumeQueue(self._cq_root, key[0], key[1])
        cq.reload()
        return cq

    def _bounds(self, key: tuple[str, int]) -> tuple[int, int] | None:
        """(first, end) queue offsets with an entry, disk and memory together; None if no queue."""
        self._index_tail()
        cq = self._disk_queue(key)
        ov = self._overlay.get(key)
        if cq is None and ov is None:
            return None
        end = self._valid_end or 0
        first = hi = 0
        if cq is not None:
            first, hi = cq.base, cq.next
            while hi > first:  # ignore entries past the validated end
                off, size, _ = ENTRY.unpack(cq.read_raw(hi - 1, hi))
                if off + size <= end:
                    break
                hi -= 1
        if ov is not None and cq is not None and cq.next > ov[0]:  # now on disk: forget it
            cut = min(cq.next, ov[0] + len(ov[1]) // ENTRY_SIZE) - ov[0]
            ov = self._overlay[key] = (ov[0] + cut, ov[1][cut * ENTRY_SIZE :])
        if ov is not None:
            ov_first, ov_end = ov[0], ov[0] + len(ov[1]) // ENTRY_SIZE
            if cq is None or cq.next == cq.base:
                first, hi = ov_first, ov_end
            elif ov_first <= hi:
                hi = max(hi, ov_end)
        return first, hi

    def _entries(
        self, key: tuple[str, int], start: int, stop: int, bounds: tuple[int, int] | None = None
    ) -> list[Entry]:
        """Entries [start, stop) from disk then memory; bounds from _bounds (computed if not given)."""
        if bounds is None:
            bounds = self._bounds(key)
            if bounds is None:
                return []
        first, hi = bounds
        start, stop = max(start, first), min(stop, hi)
        if start >= stop:
            return []
        cq = self._cqs.get(key)
        raw = b""
        disk_end = start
        if cq is not None and cq.base <= start < cq.next:
            raw = cq.read_raw(start, stop)
            disk_end = start + len(raw) // ENTRY_SIZE
        ov = self._overlay.get(key)
        if disk_end < stop and ov is not None and ov[0] <= disk_end:
            a = (disk_end - ov[0]) * ENTRY_SIZE
            raw += bytes(ov[1][a : a + (stop - disk_end) * ENTRY_SIZE])
        end = self._valid_end or 0
        out = []
        for e in ENTRY.iter_unpack(raw):
            if e[0] + e[1] > end:
                break
            out.append(e)
        return out

    def queues(self) -> dict[str, list[int]]:
        self._index_tail()
        keys = set(self._overlay)
        if os.path.isdir(self._cq_root):
            for topic in os.listdir(self._cq_root):
                tdir = os.path.join(self._cq_root, topic)
                if os.path.isdir(tdir):
                    keys.update((topic, int(q)) for q in os.listdir(tdir) if q.isascii() and q.isdigit())
        out: dict[str, list[int]] = {}
        for topic, qid in sorted(keys):
            out.setdefault(topic, []).append(qid)
        return out

    def queue_max_offset(self, topic: str, queue_id: int) -> int:
        bounds = self._bounds((topic, queue_id))
        return bounds[1] if bounds else 0

    def queue_min_offset(self, topic: str, queue_id: int) -> int:
        bounds = self._bounds((topic, queue_id))
        if bounds is None:
            return 0
        return self._min_in(topic, queue_id, bounds)

    def _min_in(self, topic: str, queue_id: int, bounds: tuple[int, int]) -> int:
        log_min = self._segs[0].start if self._segs else 0
        lo, hi = bounds
        while lo < hi:  # entries are sorted by commit-log offset
            mid = (lo + hi) // 2
            e = self._entries((topic, queue_id), mid, mid + 1, bounds)
            if e and e[0][0] >= log_min:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def cq_entries(self, topic: str, queue_id: int, start: int, max_count: int) -> list[Entry]:
        return self._entries((topic, queue_id), start, start + max(max_count, 0))

    def get_messages(
        self, topic: str, queue_id: int, queue_offset: int, max_count: int = 32, max_bytes: int = 1 << 20
    ) -> GetResult:
        bounds = self._bounds((topic, queue_id))
        if bounds is None:
            return GetResult(GetStatus.NO_QUEUE, [], 0, 0, 0)
        lo, hi = self._min_in(topic, queue_id, bounds), bounds[1]
        if queue_offset < lo:
            return GetResult(GetStatus.OFFSET_TOO_SMALL, [], lo, lo, hi)
        if queue_offset >= hi:
            status = GetStatus.NO_MESSAGE if queue_offset == hi else GetStatus.OFFSET_OVERFLOW
            return GetResult(status, [], hi, lo, hi)
        stop = queue_offset + max(max_count, 1)
        picked = pick_entries(self._entries((topic, queue_id), queue_offset, stop, bounds), max_bytes)
        if not picked:
            raise CorruptRecordError(f"queue {topic}/{queue_id} has no entry at {queue_offset}")
        records, bad = self.read_queue(topic, queue_id, queue_offset, picked)
        for _q, off, why in bad:
            self.damage.report(Damage(off, f"queue {topic}/{queue_id}", why))
        return GetResult(GetStatus.FOUND, records, queue_offset + len(picked), lo, hi, bad)
