"""The writable commit log: segment files, batched writes with rollback, fsync bookkeeping.

Preallocation: the active segment's file is extended with zeros
(``posix_fallocate``) a chunk ahead of the data, so most fdatasyncs do not
change the file's size (on ext4 a size change costs a journal commit: ~185
us instead of ~130 us per fdatasync after a small write). Only the last
segment has such a zero tail: a segment is cut back to its data before the
next one is created, and when the store closes. Recovery cuts the zero tail
a crash left (docs/store-format.md, "Preallocated space").

Threading: the owner thread writes, reads, truncates and deletes; a worker
thread may run ``capture_sync`` / ``synced`` (under the store's lock) and
fdatasync the captured fds (without it). Segment fds are therefore never
closed while a sync might be using them: ``retire`` parks them until the
store knows no sync is in flight.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Sequence

from .codec import HEADER, HEADER_SIZE, MAGIC, check_header, check_record
from .errors import FULL_ERRNOS, CorruptRecordError, StoreFullError
from .files import fsync_dir, list_numbered, offset_name
from .segments import CHUNK, ZERO_HEADER, LogView, Segment, nonzero_end, resync, walk_segment

_log = logging.getLogger("txmq.store")
_SIZE_MAGIC = struct.Struct("<II")
AFTER_FAILED_FSYNC = "after a failed fsync"
AT_START = "at start"
_TAIL_WINDOW = 64 << 10  # first guess at how far from a segment's end its last record starts


class CommitLog(LogView):
    def __init__(self, directory: str, segment_size: int = 1 << 30, preallocate: int = 0) -> None:
        self.dir = directory
        self.segment_size = segment_size
        self.preallocate = preallocate  # bytes of zeros kept allocated past the data (0: none)
        self._no_prealloc_below = (-1, 0)  # (segment start, data length): after a failure, no new try before
        self._prealloc_failing = False
        self._cut_back: list[Segment] = []  # segments cut back to their data since the last capture_sync
        self._segs: list[Segment] = []
        self._starts: list[int] = []
        self.durable = 0  # fsynced up to here
        self.dir_dirty = False  # a segment was created since the last directory fsync
        self._retired: list[int] = []  # fds of deleted segments, closed once no sync uses them
        # Why the data past durable must be written again before an fsync may call it durable, or None:
        # AFTER_FAILED_FSYNC (the page cache may hold it in clean pages that never reach the disk), or
        # AT_START (this process read it from a page cache another one may have failed to write).
        self.rewrite_before_sync: str | None = None
        self.sync_error: str | None = None  # why the last fsync of the log failed, until one succeeds

    # ---- state -------------------------------------------------------------
    @property
    def segments(self) -> list[Segment]:
        return self._segs

    @property
    def min_offset(self) -> int:
        return self._segs[0].start if self._segs else 0

    @property
    def end(self) -> int:
        return self._segs[-1].end if self._segs else 0

    def _readable_end(self) -> int:
        return self.end

    # ---- opening -----------------------------------------------------------
    def open_files(self) -> None:
        """Open every segment file as found (lengths from the files); create the first if none."""
        os.makedirs(self.dir, exist_ok=True)
        for start in list_numbered(self.dir):
            path = os.path.join(self.dir, offset_name(start))
            fd = os.open(path, os.O_RDWR)
            self._add(Segment(start, path, fd, os.fstat(fd).st_size))
        if not self._segs:
            self._add(self._create(0))
            self.dir_dirty = True

    def _add(self, seg: Segment) -> None:
        self._segs.append(seg)
        self._starts.append(seg.start)

    def _create(self, start: int) -> Segment:
        path = os.path.join(self.dir, offset_name(start))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        return Segment(start, path, fd, 0)

    # ---- writing -----------------------------------------------------------
    def write_batch(self, groups: Sequence[tuple[int, bytes]]) -> list[tuple[Segment, int, bool]]:
        """Write each (start offset, bytes) group with one pwrite; nothing is published yet.

        The first group continues the current segment when it starts at its
        end; every other group goes to a new segment file. On any OSError
        every byte written is rolled back (files truncated, new files
        removed) before the error propagates, as StoreFullError when the
        disk or quota is full.
        """
        done: list[tuple[Segment, int, bool]] = []
        cur = self._segs[-1]
        had = cur.alloc
        try:
            last = len(groups) - 1
            for i, (start, data) in enumerate(groups):
                if not done and start == cur.end:
                    seg, old, new = cur, cur.length, False
                else:
                    # the previous segment is sealed before the next exists: a reader never sees them overlap
                    if done:
                        self._cut_back_to_data(done[-1][0], done[-1][1] + len(groups[i - 1][1]))
                    else:
                        self._cut_back_to_data(cur, cur.length)
                    seg, old, new = self._create(start), 0, True
                done.append((seg, old, new))
                if i == last and self.preallocate and old + len(data) > seg.alloc:
                    self._reserve(seg, old + len(data))
                _pwrite_all(seg.fd, data, old)
        except OSError as exc:
            self._rollback(done)
            if cur.alloc < had:  # cut back for a new segment that is gone again: its zeros back (sparse)
                _quietly(os.ftruncate, cur.fd, had)
                cur.alloc = had
            if exc.errno in FULL_ERRNOS:
                raise StoreFullError(f"commit log write failed: {os.strerror(exc.errno)}") from exc
            raise
        return [(seg, old + len(data), new) for (seg, old, new), (_, data) in zip(done, groups)]

    def _reserve(self, seg: Segment, need: int) -> None:
        """Extend seg's file with zeros to ``preallocate`` bytes past need (never past the segment size).

        A failure (a full disk, a file system without fallocate) is not an
        error: the write goes on without preallocation, and preallocation is
        tried again only after another ``preallocate`` bytes of data.

        What a failed fallocate did allocate is given back at once: ext4
        keeps the blocks it found before it ran out (and grows the file over
        them), which on a nearly full disk is every free block, leaving none
        for the consume queues, the checkpoint or the index; the write then
        extends the file by its own bytes only, until the disk is really full.
        """
        target = min(need + self.preallocate, max(self.segment_size, need))
        if target <= seg.alloc or (seg.start, need) < self._no_prealloc_below:
            return
        try:  # the file's size now: writes without preallocation may have grown it past alloc
            had = max(seg.alloc, os.fstat(seg.fd).st_size)
        except OSError:
            return  # the write says what is wrong with the file
        if target <= had:
            seg.alloc = had
            return
        try:
            os.posix_fallocate(seg.fd, had, target - had)
            seg.alloc = target
            self._prealloc_failing = False
        except OSError as exc:
            if not self._prealloc_failing:  # once per spell
                _log.warning("event=preallocation_failed segment=%s error=%r msg=%s", offset_name(seg.start), exc,
                             "'writing without preallocated space (fdatasync is slower); tried again every preallocate bytes'")
            self._prealloc_failing = True
            self._no_prealloc_below = (seg.start, need + self.preallocate)
            # Back to the size it had: frees the blocks the failed call kept (past the old size, and on
            # file systems that keep them past the end without growing the file, XFS's, those too).
            seg.alloc = had
            try:
                os.ftruncate(seg.fd, had)
            except OSError:  # kept, then: zeros all the same, cut when the segment is sealed or closed
                try:
                    seg.alloc = max(had, os.fstat(seg.fd).st_size)
                except OSError:
                    pass

    def _cut_back_to_data(self, seg: Segment, length: int) -> None:
        """Cut seg's preallocated zeros after length off (it is about to be sealed, or the store closes)."""
        if seg.alloc > length:
            os.ftruncate(seg.fd, length)
            seg.alloc = length
            self._cut_back.append(seg)  # the next sync makes the new size durable

    def release_space(self) -> None:
        """Cut the active segment back to its data, durably: a closed log has no zero tail."""
        if self._segs:
            seg = self._segs[-1]
            if seg.alloc > seg.length:
                self._cut_back_to_data(seg, seg.length)
                os.fdatasync(seg.fd)

    def _rollback(self, done: list[tuple[Segment, int, bool]]) -> None:
        for seg, old, new in reversed(done):
            try:
                if new:
                    os.close(seg.fd)
                    os.unlink(seg.path)
                else:  # bytes past the data must be zeros: cut what was written, then the zeros back (sparse)
                    os.ftruncate(seg.fd, old)
                    if seg.alloc > old:
                        alloc, seg.alloc = seg.alloc, old
                        os.ftruncate(seg.fd, alloc)
                        seg.alloc = alloc
            except OSError:
                pass  # bytes past the published end are overwritten or cut by recovery

    def publish(self, written: list[tuple[Segment, int, bool]], store_ts: int) -> None:
        """Under the store lock: make a successful write_batch visible."""
        for seg, length, new in written:
            seg.length = length
            seg.last_ts = store_ts
            if new:
                self._add(seg)
                self.dir_dirty = True

    # ---- syncing -----------------------------------------------------------
    def capture_sync(self) -> tuple[int, list[int], bool]:
        """Under the store lock: (target offset, fds to fdatasync, whether to fsync the dir)."""
        target = self.end
        fds = []
        for seg in reversed(self._segs):
            if seg.end <= self.durable:
                break
            fds.append(seg.fd)
        if self._cut_back:  # sealed segments cut back to their data: their new size before the directory
            cut, self._cut_back = self._cut_back, []
            fds[:0] = [seg.fd for seg in cut if seg.fd not in fds and any(s is seg for s in self._segs)]
        dir_dirty, self.dir_dirty = self.dir_dirty, False
        return target, fds, dir_dirty

    def sync_failed(self, error: BaseException, dir_dirty: bool) -> None:
        """An fsync of what was captured failed: capture the directory again, write the unsynced data again first."""
        if dir_dirty:
            self.dir_dirty = True
        self.rewrite_before_sync = AFTER_FAILED_FSYNC
        self.sync_error = str(error)

    def unsynced_segments(self, target: int) -> tuple[int, list[Segment]]:
        """Under the store lock: durable, and the segments holding data between it and target."""
        start = self.durable
        return start, [seg for seg in self._segs if seg.end > start and seg.start < target]

    @staticmethod
    def rewrite_unsynced(start: int, segs: list[Segment], target: int, why: str) -> int:
        """Check every record in [start, target) of segs and write its bytes again; returns the bytes written.

        After a failed fdatasync Linux reports the error once and may mark the
        pages it could not write clean (they stay readable in the page cache
        until evicted). A later fdatasync then succeeds without writing them,
        and would claim records durable that are not on disk. Writing the
        same bytes again makes the pages dirty, so the next fdatasync that
        succeeds has really written them. The bytes written are the bytes
        checked (one read per chunk: its records' CRCs and own offsets are
        checked in that buffer, then that buffer is written), so a page
        evicted meanwhile cannot slip stale bytes in. A record that does not
        check is lost: that raises CorruptRecordError naming it, and nothing
        past it may be called durable. At start (``why`` AT_START) the bytes
        are copied as they read: recovery has just read them and skipped
        what it found damaged.

        In the sync's thread, with the sync lock held: the owner thread only
        appends past target meanwhile, and no segment fd is closed.
        """
        check = why != AT_START
        written = 0
        for seg in segs:
            pos, hi = max(start, seg.start), min(target, seg.end)
            want = CHUNK
            while pos < hi:
                n = min(want, hi - pos)
                buf = os.pread(seg.fd, n, pos - seg.start)
                good, why_bad, need = _checked_prefix(buf, pos) if check else (len(buf), None, 0)
                if good == 0:
                    if why_bad is None and need <= hi - pos and need > n:  # one record longer than the chunk
                        want = need
                        continue
                    raise CorruptRecordError(
                        f"the record at offset {pos} does not read back ({why_bad or 'cut short'}) {why}: the disk lost it; "
                        "nothing from there on is acknowledged; restart the broker to keep the log up to it")
                _pwrite_all(seg.fd, buf[:good] if good < len(buf) else buf, pos - seg.start)
                pos += good
                written += good
                want = CHUNK
        return written

    def synced(self, target: int) -> int:
        """Under the store lock: the log is fsynced up to target."""
        if target > self.durable:
            self.durable = target
        return self.durable

    def retire(self, fd: int, no_sync_running: bool) -> None:
        if no_sync_running:
            os.close(fd)
        else:
            self._retired.append(fd)

    def close_retired(self) -> None:
        """Called with no sync running (holding the store's sync lock)."""
        while self._retired:
            os.close(self._retired.pop())

    # ---- truncating and deleting ---------------------------------------------
    def truncate(self, offset: int, quarantine: str | None = None) -> tuple[int, int]:
        """Cut the log at offset (recovery): shorten its segment, remove later ones.

        Returns (bytes dropped, zero bytes cut from the last segment's end).
        Zeros at the end of the segment cut are preallocated space, not
        data, and are neither counted as dropped nor copied: all of them
        when nothing but zeros follows offset; else those after both the
        last non-zero byte and the record at offset (as far as its header
        tells its size), when they are at least 8 (where a record would
        have its size and magic). With ``quarantine`` (a
        directory), nothing else is lost: later segments are moved there and
        the cut bytes are copied there first.
        """
        dropped = zeros = 0
        while len(self._segs) > 1 and self._segs[-1].start > offset:
            seg = self._segs[-1]
            dropped += seg.length
            self._remove(len(self._segs) - 1, quarantine, "")
        seg = self._segs[-1]
        keep = max(offset - seg.start, 0)
        if keep < seg.length:
            data_end = nonzero_end(seg.fd, keep, seg.length)
            if data_end > keep:
                head = os.pread(seg.fd, 8, keep)
                if len(head) == 8 and _SIZE_MAGIC.unpack(head)[1] == MAGIC:  # the record's size, as it claims
                    data_end = min(max(data_end, keep + _SIZE_MAGIC.unpack(head)[0]), seg.length)
                if seg.length - data_end < len(ZERO_HEADER):  # too short to be preallocated space: part of the tail
                    data_end = seg.length
            zeros = seg.length - data_end
            dropped += data_end - keep
            if quarantine is not None and data_end > keep:
                _copy_range(seg.fd, keep, data_end - keep, quarantine, f"commitlog-{offset_name(seg.start + keep)}")
            os.ftruncate(seg.fd, keep)
            os.fsync(seg.fd)
            seg.length = keep
        seg.alloc = seg.length
        if self.dir_dirty:
            fsync_dir(self.dir)
            self.dir_dirty = False
        return dropped, zeros

    def cut_zero_tail(self, seg: Segment, length: int) -> bool:
        """Cut seg to length if every byte after it is zero (a crash before a sealed segment was cut back)."""
        if not 0 <= length < seg.length or nonzero_end(seg.fd, length, seg.length) > length:
            return False
        os.ftruncate(seg.fd, length)
        os.fsync(seg.fd)
        seg.length = seg.alloc = length
        return True

    def records_end_at(self, seg: Segment, offset: int) -> bool | None:
        """Whether seg's records, walked from its start, end exactly at offset (True), run past it (False),
        or cannot tell (None: damage, or nothing but zeros, before it)."""
        end = seg.start
        for at, res in walk_segment(seg, seg.start, offset, validate_only=True):
            if type(res) is str:
                return None
            end = at + res  # type: ignore[operator]
        if end == offset:
            return True
        return False if end > offset else None

    def cut_overlap(self, seg: Segment, length: int, quarantine: str | None) -> int:
        """Cut seg's bytes past length, which overlap the next segment (copied to quarantine first); the bytes cut."""
        n = seg.length - length
        if n <= 0:
            return 0
        if quarantine is not None:
            _copy_range(seg.fd, length, n, quarantine, f"commitlog-{offset_name(seg.start + length)}-overlap")
        os.ftruncate(seg.fd, length)
        os.fsync(seg.fd)
        seg.length = seg.alloc = length
        return n

    def set_aside(self, seg: Segment, quarantine: str | None) -> None:
        """Take a file that is not a segment of this log out of it (into quarantine when it holds bytes)."""
        self._remove(self._segs.index(seg), quarantine, "-stray")
        fsync_dir(self.dir)
        self.dir_dirty = False

    def _remove(self, i: int, quarantine: str | None, suffix: str) -> None:
        """Forget segment i and move its file to quarantine (commitlog-<start><suffix>), or unlink it when empty or none."""
        seg = self._segs.pop(i)
        del self._starts[i]
        os.close(seg.fd)
        if quarantine is not None and seg.length:
            os.makedirs(quarantine, exist_ok=True)
            os.replace(seg.path, os.path.join(quarantine, f"commitlog-{offset_name(seg.start)}{suffix}"))
        else:
            os.unlink(seg.path)
        self.dir_dirty = True

    def delete_front(self, count: int) -> list[Segment]:
        """Under the store lock: forget the first count segments and unlink their files."""
        gone = self._segs[:count]
        del self._segs[:count]
        del self._starts[:count]
        for seg in gone:
            os.unlink(seg.path)
        return gone

    def last_store_ts(self, seg: Segment) -> int | None:
        """store_ts of the last record in seg (None if it is empty or has no valid tail)."""
        if seg.last_ts is None and seg.length:
            seg.last_ts = _find_last_ts(seg)
        return seg.last_ts

    def close(self) -> None:
        self.close_retired()
        for seg in self._segs:
            os.close(seg.fd)
        self._segs.clear()
        self._starts.clear()


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except OSError:
        pass  # recovery cuts whatever is past the data


def _copy_range(fd: int, pos: int, length: int, directory: str, name: str) -> None:
    """Copy length bytes of fd from pos into directory/name (durably), in 1 MiB pieces."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < length:
            data = os.pread(fd, min(1 << 20, length - done), pos + done)
            if not data:
                break
            _pwrite_all(out, data, done)
            done += len(data)
        os.fsync(out)
    finally:
        os.close(out)
    fsync_dir(directory)


def _checked_prefix(buf: bytes, offset: int) -> tuple[int, str | None, int]:
    """(bytes of whole valid records at buf's start, why the next is invalid or None, size the next one needs)."""
    p, end = 0, len(buf)
    mv = memoryview(buf)
    while p < end:
        if end - p < HEADER_SIZE:
            return p, None, HEADER_SIZE
        total = check_header(buf, p, offset + p)
        if type(total) is str:
            return p, total, 0
        if total > end - p:
            return p, None, total
        size = check_record(buf, p, offset + p, mv)
        if type(size) is str:
            return p, size, 0
        p += size
    return p, None, 0


def _pwrite_all(fd: int, data: bytes, pos: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n


def _find_last_ts(seg: Segment) -> int | None:
    """Find the segment's last record by resynchronising near its end and walking to the end.

    The window grows until a chain of valid records ends exactly at the
    segment's end; memory stays bounded because the walk reads in chunks.
    """
    window = _TAIL_WINDOW
    while True:
        pos = seg.start if window >= seg.length else resync(seg, seg.end - window)
        last = None
        if pos is not None:
            for offset, res in walk_segment(seg, pos, seg.end, validate_only=True):
                if type(res) is str:
                    last = None
                    break
                last = offset
        if last is not None:
            head = os.pread(seg.fd, HEADER.size, last - seg.start)
            return HEADER.unpack(head)[10]
        if window >= seg.length:
            return None
        window = min(window * 4 if window < CHUNK else window * 2, seg.length)
