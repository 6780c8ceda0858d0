"""Consume queues: one index per (topic, queue id) into the commit log.

A queue is a sequence of fixed 20-byte entries; entry ``i`` is the record
with queue offset ``i``. Layout (little-endian, docs/store-format.md)::

    0  8  commit_log_offset  i64
    8  4  size               u32, record size
    12 8  tag_hash           i64, tag_hash(TAGS property), 0 when none

Files live in ``consumequeue/TOPIC/QID/`` and are named by the 20-digit queue
offset of their first entry. Files are contiguous: a file's entries run up
to the next file's name. New entries are kept in memory (``pending``) and
written by the store's checkpoint; ``flushed`` is the queue offset where
the entries on disk end.

This class does no locking of its own: the Store calls it under its lock
wherever a checkpoint thread may run concurrently.
"""

from __future__ import annotations

import os
import struct

from .codec import HEADER_SIZE
from .errors import CorruptRecordError
from .files import fsync_dir, fsync_path, list_numbered, offset_name

ENTRY = struct.Struct(
    "<"
    "q"  # 0  commit_log_offset
    "I"  # 8  size
    "q"  # 12 tag_hash
)
ENTRY_SIZE = ENTRY.size
assert ENTRY_SIZE == 20
_VERIFY_ENTRIES = 1024  # entries read at once while recovery compares entries

Entry = tuple[int, int, int]


def pick_entries(entries, max_bytes: int) -> list[tuple[int, int]]:
    """(offset, size) of the leading entries whose records fit max_bytes (at least one).

    A size no record can have (past the segment size: a garbage entry) counts
    as nothing here; the read then reports the entry as damaged.
    """
    out: list[tuple[int, int]] = []
    total = 0
    for off, size, _ in entries:
        cost = size if size < (1 << 31) else 0
        if out and total + cost > max_bytes:
            break
        out.append((off, size))
        total += cost
    return out


class ConsumeQueue:
    __slots__ = (
        "topic", "queue_id", "dir", "starts", "flushed", "pending", "next",
        "unsynced", "dir_synced", "_rfds", "_min_cache", "_vcache", "_vstart",
    )  # fmt: skip

    def __init__(self, root: str, topic: str, queue_id: int, base: int = 0) -> None:
        self.topic = topic
        self.queue_id = queue_id
        self.dir = os.path.join(root, topic, str(queue_id))
        self.starts: list[int] = []  # first queue offset of each file on disk
        self.flushed = base  # entries on disk end here
        self.pending = bytearray()  # entries [flushed, next), not yet on disk
        self.next = base  # the queue offset the next record gets
        self.unsynced: set[int] = set()  # files written or truncated since their last fsync
        self.dir_synced = False
        self._rfds: dict[int, int] = {}
        self._min_cache: tuple[int, int, int] | None = None  # (log min, base, queue min)
        self._vcache = b""
        self._vstart = 0

    # ---- loading -----------------------------------------------------------
    @classmethod
    def load(cls, root: str, topic: str, queue_id: int) -> tuple[ConsumeQueue, list[int]]:
        """The queue as found on disk, and the starts of files that break contiguity.

        Entries end at the first gap between files; a trailing partial entry
        is not counted. Nothing is changed on disk (see ``repair_files``).
        """
        cq = cls(root, topic, queue_id)
        cq.dir_synced = True
        orphans: list[int] = []
        expected = None
        for start in list_numbered(cq.dir):
            if expected is not None and start != expected:
                orphans.append(start)
                continue
            cq.starts.append(start)
            expected = start + os.stat(cq._path(start)).st_size // ENTRY_SIZE
        if cq.starts:
            cq.flushed = cq.next = expected  # type: ignore[assignment]
        return cq, orphans

    def repair_files(self, orphans: list[int]) -> int:
        """Delete files past a gap and cut partial entries; returns entries dropped."""
        dropped = 0
        for start in orphans:
            path = self._path(start)
            dropped += os.stat(path).st_size // ENTRY_SIZE
            os.unlink(path)
            self.dir_synced = False
        for i, start in enumerate(self.starts):
            end = self.starts[i + 1] if i + 1 < len(self.starts) else self.flushed
            path = self._path(start)
            if os.stat(path).st_size != (end - start) * ENTRY_SIZE:
                os.truncate(path, (end - start) * ENTRY_SIZE)
                self.unsynced.add(start)
        return dropped

    def reload(self) -> None:
        """Re-read the file list and sizes (read-only use: StoreReader, while a broker writes)."""
        starts: list[int] = []
        expected = 0
        for start in list_numbered(self.dir):
            if starts and start != expected:
                break
            try:
                size = os.stat(self._path(start)).st_size
            except FileNotFoundError:  # deleted by retention meanwhile
                if starts:
                    break
                continue
            starts.append(start)
            expected = start + size // ENTRY_SIZE
        for s in [s for s in self._rfds if s not in starts]:
            self._close_fd(s)
        self.starts = starts
        self.flushed = self.next = expected
        self._min_cache = None

    # ---- properties ------------------------------------------------------
    @property
    def base(self) -> int:
        """First queue offset that has an entry (on disk or pending)."""
        return self.starts[0] if self.starts else self.flushed

    def _path(self, start: int) -> str:
        return os.path.join(self.dir, offset_name(start))

    def _file_of(self, index: int) -> int:
        """Position in starts of the file holding on-disk entry index."""
        lo, hi = 0, len(self.starts) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.starts[mid] <= index:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ---- appending and flushing -------------------------------------------
    def append(self, cl_offset: int, size: int, tag: int) -> None:
        self.pending += ENTRY.pack(cl_offset, size, tag)
        self.next += 1

    def plan_flush(self) -> tuple[int, bytes, int | None] | None:
        """Under the store lock: (first index, entry bytes, last file start) to write, or None."""
        if not self.pending:
            return None
        return self.flushed, bytes(self.pending), (self.starts[-1] if self.starts else None)

    def write(self, base: int, data: bytes, last_start: int | None, per_file: int) -> list[int]:
        """Write entries [base, ...) into their files (no lock needed); returns new file starts.

        The caller fsyncs the files in ``unsynced`` and the directory later
        (``fsync``) and publishes the result with ``commit_flush``.
        """
        if not self.dir_synced:
            os.makedirs(self.dir, exist_ok=True)
        new: list[int] = []
        index, off, n = base, 0, len(data) // ENTRY_SIZE
        while index < base + n:
            if last_start is not None and index - last_start < per_file:
                file_start = last_start
            else:
                file_start = index
                new.append(index)
                self.dir_synced = False  # a new file: its name is durable only once the directory is fsynced
            count = min(per_file - (index - file_start), base + n - index)
            fd = os.open(self._path(file_start), os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                view = memoryview(data)[off : off + count * ENTRY_SIZE]
                pos = (index - file_start) * ENTRY_SIZE
                while view:
                    written = os.pwrite(fd, view, pos)
                    view, pos = view[written:], pos + written
            finally:
                os.close(fd)
            self.unsynced.add(file_start)
            index, off, last_start = index + count, off + count * ENTRY_SIZE, file_start
        return new

    @property
    def needs_flush(self) -> bool:
        """Entries to write, or files (or the directory) written and not fsynced yet."""
        return bool(self.pending) or bool(self.unsynced) or not self.dir_synced

    def write_synced(self, plan: tuple[int, bytes, int | None] | None, per_file: int) -> list[int]:
        """Write a ``plan_flush`` result (None: nothing new) and fsync all that is unsynced; returns the new file starts.

        Raises OSError. Publish with ``commit_flush`` only once this returned:
        entries count as flushed only when fsynced (a failed fsync may leave
        their pages marked clean and unwritten, so they are written again).
        """
        new = self.write(*plan, per_file) if plan is not None else []
        if self.unsynced or not self.dir_synced:
            self.fsync()
        return new

    def fsync(self) -> None:
        """fsync files written since the last call, and the directory chain when new."""
        for start in sorted(self.unsynced):
            try:
                fsync_path(self._path(start))
            except FileNotFoundError:  # deleted since (truncated away, or retention)
                pass
        self.unsynced.clear()
        if not self.dir_synced:
            os.makedirs(self.dir, exist_ok=True)
            fsync_dir(self.dir)
            fsync_dir(os.path.dirname(self.dir))
            fsync_dir(os.path.dirname(os.path.dirname(self.dir)))
            self.dir_synced = True

    def commit_flush(self, base: int, count: int, new_starts: list[int]) -> None:
        """Under the store lock: entries [base, base + count) are now on disk."""
        if self.flushed != base:  # truncated meanwhile (recovery only): keep what's pending
            return
        del self.pending[: count * ENTRY_SIZE]
        self.flushed += count
        for s in new_starts:
            if not self.starts or s > self.starts[-1]:
                self.starts.append(s)

    # ---- reading -----------------------------------------------------------
    def read_raw(self, start: int, stop: int) -> bytes:
        """Raw entries [start, stop), clamped to [base, next) (caller holds the store lock)."""
        start, stop = max(start, self.base), min(stop, self.next)
        if start >= stop:
            return b""
        parts = []
        i = start
        if i < self.flushed:
            k = self._file_of(i)
            while i < min(stop, self.flushed):
                file_start = self.starts[k]
                file_end = self.starts[k + 1] if k + 1 < len(self.starts) else self.flushed
                upto = min(stop, file_end)
                parts.append(self._pread(file_start, (i - file_start) * ENTRY_SIZE, (upto - i) * ENTRY_SIZE))
                i, k = upto, k + 1
        if i < stop:
            parts.append(bytes(self.pending[(i - self.flushed) * ENTRY_SIZE : (stop - self.flushed) * ENTRY_SIZE]))
        return b"".join(parts) if len(parts) > 1 else parts[0]

    def entries(self, start: int, stop: int) -> list[Entry]:
        return list(ENTRY.iter_unpack(self.read_raw(start, stop)))

    def last_offset(self) -> int:
        """Commit-log offset of the queue's last entry, -1 when it has none."""
        e = self.entry(self.next - 1)
        return e[0] if e is not None else -1

    def entry(self, index: int) -> Entry | None:
        """One entry, for recovery's comparisons (reads ahead, so sequential calls are cheap)."""
        if not self.base <= index < self.next:
            return None
        if index >= self.flushed:
            return ENTRY.unpack_from(self.pending, (index - self.flushed) * ENTRY_SIZE)
        rel = index - self._vstart
        if not 0 <= rel < len(self._vcache) // ENTRY_SIZE:
            self._vcache = self.read_raw(index, min(index + _VERIFY_ENTRIES, self.flushed))
            self._vstart, rel = index, 0
        return ENTRY.unpack_from(self._vcache, rel * ENTRY_SIZE)

    def _pread(self, file_start: int, pos: int, n: int) -> bytes:
        fd = self._rfds.get(file_start)
        if fd is None:
            fd = self._rfds[file_start] = os.open(self._path(file_start), os.O_RDONLY)
        data = os.pread(fd, n, pos)
        return data if len(data) == n else data + bytes(n - len(data))

    def min_offset(self, log_min: int) -> int:
        """First queue offset whose entry points at or past log_min (the log's first byte)."""
        cached = self._min_cache
        if cached is not None and cached[0] == log_min and cached[1] == self.base:
            return cached[2]
        lo, hi = self.base, self.next
        while lo < hi:  # entries are sorted by commit-log offset
            mid = (lo + hi) // 2
            e = ENTRY.unpack(self.read_raw(mid, mid + 1))
            if e[0] >= log_min:
                hi = mid
            else:
                lo = mid + 1
        self._min_cache = (log_min, self.base, lo)
        return lo

    def rewrite(self, entries: list[tuple[int, Entry]]) -> list[int]:
        """Write entries in place, as (queue offset, entry) pairs below ``flushed``; returns the starts of the files written.

        Under the store lock (a checkpoint may be writing later entries of the
        last file meanwhile: other bytes). For entries rebuilt from the log
        after a read found them damaged; the caller has the files fsynced.
        """
        fds: dict[int, int] = {}
        try:
            for q, e in entries:
                if not self.base <= q < self.flushed:
                    raise ValueError(f"queue offset {q} is not on disk in {self.dir}")
                start = self.starts[self._file_of(q)]
                fd = fds.get(start)
                if fd is None:
                    fd = fds[start] = os.open(self._path(start), os.O_WRONLY)
                if os.pwrite(fd, ENTRY.pack(*e), (q - start) * ENTRY_SIZE) != ENTRY_SIZE:
                    raise OSError(f"short write of queue entry {q} in {self.dir}")
        finally:
            for fd in fds.values():
                os.close(fd)
            self._vcache = b""
            self._min_cache = None
        return list(fds)

    # ---- truncating and deleting -------------------------------------------
    def truncate(self, index: int) -> int:
        """Drop entries from index on; returns how many were dropped.

        The file holding index is cut, not deleted, even when that leaves it
        empty: the queue's next offset is its last file's name plus its
        entries, and must survive a reopen.
        """
        index = max(index, self.base)
        dropped = max(self.next - index, 0)
        self._vcache = b""
        self._min_cache = None
        if index >= self.flushed:
            del self.pending[(index - self.flushed) * ENTRY_SIZE :]
            self.next = min(self.next, index)
            return dropped
        self.pending.clear()
        k = self._file_of(index)
        for s in self.starts[k + 1 :]:
            self._close_fd(s)
            os.unlink(self._path(s))
            self.dir_synced = False
        del self.starts[k + 1 :]
        os.truncate(self._path(self.starts[k]), (index - self.starts[k]) * ENTRY_SIZE)
        self.unsynced.add(self.starts[k])
        self.flushed = self.next = index
        return dropped

    def reset(self, index: int) -> int:
        """Drop every entry and start the queue afresh at index (recovery: log lost its head)."""
        dropped = self.next - self.base
        for s in self.starts:
            self._close_fd(s)
            os.unlink(self._path(s))
            self.dir_synced = False
        self.starts = []
        self.pending.clear()
        self.flushed = self.next = index
        self._vcache = b""
        self._min_cache = None
        return dropped

    def delete_files_below(self, log_min: int) -> list[str]:
        """Delete leading files (never the last) whose entries all point below log_min."""
        deleted: list[str] = []
        while len(self.starts) > 1 and self.starts[1] <= self.flushed:
            last = ENTRY.unpack(self.read_raw(self.starts[1] - 1, self.starts[1]))
            if last[0] >= log_min:
                break
            start = self.starts.pop(0)
            self._close_fd(start)
            os.unlink(self._path(start))
            deleted.append(self._path(start))
        if deleted:
            self._min_cache = None
            self._vcache = b""
        return deleted

    def _close_fd(self, start: int) -> None:
        fd = self._rfds.pop(start, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for fd in self._rfds.values():
            os.close(fd)
        self._rfds.clear()

    def drop_bad_tail(self, log_end: int) -> int:
        """Cut trailing entries that point at or past log_end or cannot be entries; returns how many."""
        i = self.next
        while i > self.base:
            lo = max(self.base, i - _VERIFY_ENTRIES)
            raw = self.read_raw(lo, i)
            for j in range(i - lo - 1, -1, -1):
                off, size, _ = ENTRY.unpack_from(raw, j * ENTRY_SIZE)
                if off >= 0 and size >= HEADER_SIZE and off + size <= log_end:
                    return self.truncate(lo + j + 1) if lo + j + 1 < self.next else 0
            i = lo
        return self.truncate(self.base) if self.next > self.base else 0


def stored_record_at(store, offset: int):
    """The record that starts at offset (a Store or StoreReader), checked against its consume-queue entry.

    ``read`` validates the bytes at offset, and a message body can hold any
    bytes, including a valid record whose offset field names the place it
    sits at: an offset inside another record's body, as a client may give,
    would read back a record nobody stored. Every stored record has its
    entry in its queue (topic, queue id, queue offset) pointing at it, and
    a forged one does not. Raises CorruptRecordError when it does not.
    """
    rec = store.read(offset)
    entry = store.cq_entries(rec.topic, rec.queue_id, rec.queue_offset, 1)
    if not entry or entry[0][0] != offset:
        raise CorruptRecordError(f"no stored record starts at {offset}: the bytes there lie inside another record")
    return rec


def first_entry_from(store, topic: str, queue_id: int, offset: int) -> int:
    """The first queue offset of (topic, queue_id) whose record starts at or after the commit-log offset.

    A binary search (a consume queue is sorted by commit-log offset), on a
    Store or a StoreReader; the queue's end when every record is before it.
    """
    lo, hi = store.queue_min_offset(topic, queue_id), store.queue_max_offset(topic, queue_id)
    while lo < hi:
        mid = (lo + hi) // 2
        e = store.cq_entries(topic, queue_id, mid, 1)
        if e and e[0][0] < offset:
            lo = mid + 1
        else:
            hi = mid
    return lo


def record_start_from(store, offset: int, queues: list[tuple[str, int]] | None = None) -> int | None:
    """The first offset >= offset where a stored record starts, found by the consume queues (None: none).

    On a Store or a StoreReader. Every record has its entry in its queue,
    so this is where a sequential walk would find the next record, without
    reading the log in between; unlike a resynchronising search of the
    bytes, it never takes a record forged inside a message body for a
    stored one. A binary search per queue; a damaged record is passed over
    (the next one is looked for, up to 16 times). ``queues``: the (topic,
    queue id) pairs to search, for a caller asking many times (listing them
    reads directories).
    """
    if queues is None:
        queues = all_queues(store)
    for _ in range(16):  # past a few damaged records at most: then no answer
        best = None
        for topic, qid in queues:
            e = store.cq_entries(topic, qid, first_entry_from(store, topic, qid, offset), 1)
            if e and e[0][0] >= offset and (best is None or e[0][0] < best):
                best = e[0][0]
        if best is None:
            return None
        try:
            stored_record_at(store, best)
        except (CorruptRecordError, ValueError, OSError):  # damaged (or an entry that does not fit): the next one
            offset = best + 1
            continue
        return best
    return None


def all_queues(store) -> list[tuple[str, int]]:
    """Every (topic, queue id) of a Store or StoreReader."""
    return [(topic, qid) for topic, qids in store.queues().items() for qid in qids]
