"""The writable commit log: segment files, batched writes with rollback, fsync bookkeeping.

Threading: the owner thread writes, reads, truncates and deletes; a worker
thread may run ``capture_sync`` / ``synced`` (under the store's lock) and
fdatasync the captured fds (without it). Segment fds are therefore never
closed while a sync might be using them: ``retire`` parks them until the
store knows no sync is in flight.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from .codec import HEADER
from .errors import StoreFullError
from .files import fsync_dir, list_numbered, offset_name
from .segments import CHUNK, LogView, Segment, resync, walk_segment

_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_TAIL_WINDOW = 64 << 10  # first guess at how far from a segment's end its last record starts


class CommitLog(LogView):
    def __init__(self, directory: str) -> None:
        self.dir = directory
        self._segs: list[Segment] = []
        self._starts: list[int] = []
        self.durable = 0  # fsynced up to here
        self.dir_dirty = False  # a segment was created since the last directory fsync
        self._retired: list[int] = []  # fds of deleted segments, closed once no sync uses them

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
        try:
            for start, data in groups:
                cur = self._segs[-1]
                if not done and start == cur.end:
                    seg, old, new = cur, cur.length, False
                else:
                    seg, old, new = self._create(start), 0, True
                done.append((seg, old, new))
                _pwrite_all(seg.fd, data, old)
        except OSError as exc:
            self._rollback(done)
            if exc.errno in _FULL_ERRNOS:
                raise StoreFullError(f"commit log write failed: {os.strerror(exc.errno)}") from exc
            raise
        return [(seg, old + len(data), new) for (seg, old, new), (_, data) in zip(done, groups)]

    def _rollback(self, done: list[tuple[Segment, int, bool]]) -> None:
        for seg, old, new in reversed(done):
            try:
                if new:
                    os.close(seg.fd)
                    os.unlink(seg.path)
                else:
                    os.ftruncate(seg.fd, old)
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
        dir_dirty, self.dir_dirty = self.dir_dirty, False
        return target, fds, dir_dirty

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
    def truncate(self, offset: int, quarantine: str | None = None) -> int:
        """Cut the log at offset (recovery): shorten its segment, remove later ones; returns bytes dropped.

        With ``quarantine`` (a directory), nothing is lost: later segments are
        moved there and the cut bytes are copied there first.
        """
        dropped = 0
        while len(self._segs) > 1 and self._segs[-1].start > offset:
            seg = self._segs.pop()
            self._starts.pop()
            dropped += seg.length
            os.close(seg.fd)
            if quarantine is not None and seg.length:
                os.makedirs(quarantine, exist_ok=True)
                os.replace(seg.path, os.path.join(quarantine, f"commitlog-{offset_name(seg.start)}"))
            else:
                os.unlink(seg.path)
            self.dir_dirty = True
        seg = self._segs[-1]
        keep = max(offset - seg.start, 0)
        if keep < seg.length:
            dropped += seg.length - keep
            if quarantine is not None:
                _copy_range(seg.fd, keep, seg.length - keep, quarantine, f"commitlog-{offset_name(seg.start + keep)}")
            os.ftruncate(seg.fd, keep)
            os.fsync(seg.fd)
            seg.length = keep
        if self.dir_dirty:
            fsync_dir(self.dir)
            self.dir_dirty = False
        return dropped

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
