"""The Store: one commit log plus its consume queues, in one data directory.

The owner thread opens the store, appends and reads. ``sync`` and
``checkpoint`` run in worker threads (group commit), possibly two at once:
they take ``_lock`` only to capture or publish state, never across an
fsync. ``_sync_lock`` serialises fsyncs of the log with each other and with
closing segment fds; ``_ckpt_lock`` keeps one checkpoint at a time. A
checkpoint holds ``_sync_lock`` only for its own log fsync, so syncs that
acknowledge sends go on while it writes the consume queues and the
checkpoint file.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import msgpack

from .checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from .codec import EMPTY_PROPS, HEADER, HEADER_SIZE, TAGS_PROPERTY, Message, RawCopy, Record, encode_raw, tag_hash
from .commitlog import AT_START, CommitLog
from .consumequeue import ENTRY, ENTRY_SIZE, ConsumeQueue, Entry, pick_entries, record_start_from, stored_record_at
from .damage import Damage, DamageLog
from .errors import FULL_ERRNOS, RecordTooLargeError, StoreError, StoreLockedError
from .files import atomic_write_bytes, fsync_dir, fsync_path
from .model import AppendResult, GetResult, GetStatus, RecoveryReport, StoreConfig
from .queuerepair import QueueRepairs
from .recovery import MANIFEST, flush_all, load_queues, manifest_bytes, read_manifest, recover

_log = logging.getLogger("txmq.store")
_pack_entry = ENTRY.pack
_HEADER_UNPACK = HEADER.unpack_from
QUARANTINE_DIR = "quarantine"  # bytes recovery will not use are moved here, never deleted
_MAX_QUEUE_ID = (1 << 31) - 1
_MAX_TOPIC_BYTES = (1 << 16) - 1


# After a failed fsync every retry reads and writes again all that was appended past the durable offset
# (Store._fsync_log); past this many bytes, appends are refused until a sync succeeds.
UNSYNCED_AFTER_FAILURE_LIMIT = 256 << 20
# Bytes of consume-queue entries (20 each) held in memory because their files could not be written or fsynced,
# past which appends are refused until a checkpoint writes them (a few million messages).
CQ_HELD_LIMIT = 64 << 20


class SyncJob:
    """What one fsync of the log covers (Store.begin_sync): the log's end then, its descriptors, the directory."""

    __slots__ = ("log", "target", "fds", "dir_dirty")

    def __init__(self, log: CommitLog, target: int, fds: list[int], dir_dirty: bool) -> None:
        self.log = log
        self.target = target
        self.fds = fds
        self.dir_dirty = dir_dirty


class Store:
    def __init__(
        self,
        data_dir: str | os.PathLike,
        config: StoreConfig = StoreConfig(),  # noqa: B008 (a frozen dataclass)
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.data_dir = os.fspath(data_dir)
        self.config = config
        self._clock = clock
        self._log: CommitLog | None = None
        self._queues: dict[tuple[str, int], ConsumeQueue] = {}
        self._dirty: set[ConsumeQueue] = set()  # queues with pending entries
        self._cq_held = 0  # entries recovery could not write (a full disk) and the checkpoints have not written yet
        self._cq_backlog = False  # consume-queue entries held after failed writes are over CQ_HELD_LIMIT: appends refused
        self._topic_bytes: dict[str, bytes] = {}
        # A RawCopy's topic, keyed by its UTF-8 bytes: no decode per copy.
        self._topic_names: dict[bytes, str] = {}
        # One packer for the owner thread's appends: msgpack.packb builds a new
        # Packer on every call, which costs more than packing a small map.
        self._pack_props = msgpack.Packer(use_bin_type=True).pack
        self._lock = threading.Lock()  # state shared with the sync/checkpoint thread
        self._sync_lock = threading.Lock()  # one fsync of the log at a time (sync, or a checkpoint's first step)
        self._ckpt_lock = threading.Lock()  # one checkpoint at a time
        self._lock_fd: int | None = None
        self._last_ckpt: Checkpoint | None = None  # what the checkpoint file holds
        self._limit = min(config.max_record_size, config.segment_size)
        self._cq_root = os.path.join(self.data_dir, "consumequeue")
        self.damage = DamageLog()  # damaged records met since open (recovery and reads)
        self._manifest_queues = -1  # queues listed in the manifest file
        self._manifest_failing = False
        self._repairs = QueueRepairs()  # damaged consume-queue entries met by reads, rebuilt from the log
        self._cq_repaired: set[tuple[ConsumeQueue, int]] = set()  # queue files rewritten in place, for the next checkpoint to fsync

    def __enter__(self) -> Store:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- lifecycle ---------------------------------------------------------
    def open(self, rebuild: bool = False) -> RecoveryReport:
        """Lock the directory and recover it (docs/store-format.md, "Recovery").

        A damaged tail is cut and reported, never raised; only a held lock
        (StoreLockedError) or an I/O error (OSError) fails the open. With
        ``rebuild`` the whole log is re-read and every consume queue checked
        against it (what ``txmq store repair`` does).
        """
        if self._log is not None:
            raise StoreError("store is already open")
        t0 = time.perf_counter()
        os.makedirs(self.data_dir, exist_ok=True)
        self._lock_fd = _take_lock(os.path.join(self.data_dir, "LOCK"))
        try:
            log = CommitLog(os.path.join(self.data_dir, "commitlog"), self.config.segment_size, self.config.preallocate)
            log.open_files()
            self._log = log
            queues, dropped = load_queues(self._cq_root)
            ckpt = self._last_ckpt = read_checkpoint(self._checkpoint_path)
            rec = recover(log, queues, ckpt, self._cq_root, self.config.cq_entries_per_file,
                          quarantine=os.path.join(self.data_dir, QUARANTINE_DIR), rebuild=rebuild,
                          manifest=read_manifest(self._manifest_path))
            for offset, why, length in rec.damaged:
                self.damage.report(Damage(offset, "log", why, length))
            for why in rec.queue_problems:
                _log.warning("event=consume_queue_rebuilt reason=%r", why)
            self._queues = queues
            log.durable = max(log.min_offset, min(ckpt.log_offset, log.end)) if ckpt else log.min_offset
            # What the last run wrote past its checkpoint may sit in the page cache in pages that process
            # failed to write (a failed fsync marks them clean): the first sync writes it again.
            log.rewrite_before_sync = AT_START
            held = flush_all(queues, self.config.cq_entries_per_file)
            self._dirty = {cq for cq in queues.values() if cq.needs_flush}  # what a full disk held back
            if held:
                self._cq_held = held
                _log.warning("event=consume_queue_entries_held entries=%d msg=%r", held,
                             "no space to write the consume-queue entries of the records recovered past the checkpoint: "
                             "they are held in memory and served from there, and a checkpoint writes them once there is space")
            try:
                self.checkpoint()
            except OSError as exc:
                if exc.errno not in FULL_ERRNOS:
                    raise
                # A full disk: open all the same, so the broker can serve reads and run the retention that frees
                # space; each checkpoint cycle tries again (and writes the manifest once the queues are on disk).
                _log.warning("event=checkpoint_deferred error=%r", exc)
            else:
                self._write_manifest()
        except BaseException:
            self._release()
            raise
        return RecoveryReport(
            dropped_bytes=rec.dropped_bytes,
            reason=rec.reason,
            truncated_at=rec.truncated_at,
            redispatched=rec.redispatched,
            cq_entries_dropped=rec.cq_entries_dropped + dropped,
            segments=len(log.segments),
            max_offset=log.end,
            scanned_from=min(rec.scanned_from, log.end),
            damaged=len(rec.damaged),
            queues_rebuilt=rec.queue_problems,
            preallocated=rec.preallocated,
            duration_s=time.perf_counter() - t0,
        )

    def close(self) -> None:
        """Flush, checkpoint and release the lock. Safe to call twice."""
        if self._log is None:
            return
        try:
            self.checkpoint()
            self._write_manifest()
            with self._sync_lock:  # a closed log has no zero tail: older versions read it unchanged
                try:
                    self._log.release_space()
                except OSError as exc:  # the zeros stay; the next open cuts them
                    _log.warning("event=preallocation_kept error=%r", exc)
        finally:
            self._release()

    def _release(self) -> None:
        with self._ckpt_lock, self._sync_lock:  # no checkpoint writing queues, no fsync running (this order, as checkpoint)
            if self._log is not None:
                self._log.close()
            for cq in self._queues.values():
                cq.close()
            self._log = None
            self._queues = {}
            self._dirty = set()
            self._cq_held, self._cq_backlog = 0, False
            self._repairs = QueueRepairs()
            self._cq_repaired = set()
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None

    @property
    def _checkpoint_path(self) -> str:
        return os.path.join(self.data_dir, "checkpoint")

    def _open_log(self) -> CommitLog:
        log = self._log
        if log is None:
            raise StoreError("store is not open")
        return log

    # ---- offsets -----------------------------------------------------------
    @property
    def durable_offset(self) -> int:
        return self._open_log().durable

    @property
    def max_offset(self) -> int:
        return self._open_log().end

    @property
    def min_offset(self) -> int:
        return self._open_log().min_offset

    # ---- appending ---------------------------------------------------------
    def append(self, msgs: Sequence[Message | RawCopy]) -> list[AppendResult]:
        """Append msgs as records: one pwrite per segment touched, page cache on return.

        Queue offsets and store_ts are assigned here; consume-queue entries
        are buffered in memory until the next checkpoint. Raises
        RecordTooLargeError before writing anything, StoreFullError (after
        rolling the whole batch back) when the disk is full.
        """
        log = self._open_log()
        if not msgs:
            return []
        if log.rewrite_before_sync is not None and log.end - log.durable > UNSYNCED_AFTER_FAILURE_LIMIT:
            raise StoreError(f"the last fsync of the log failed and {log.end - log.durable} bytes wait to be made durable "
                             f"(at most {UNSYNCED_AFTER_FAILURE_LIMIT} are taken meanwhile): nothing was written; "
                             "the broker retries the fsync every cycle")
        if self._cq_backlog:
            raise StoreError(f"the consume-queue files could not be written, and more than {CQ_HELD_LIMIT} bytes of their "
                             "entries wait in memory: nothing was written; the broker writes them again every checkpoint")
        store_ts = int(self._clock() * 1000)
        seg_size, limit = self.config.segment_size, self._limit
        queues, topics, pack = self._queues, self._topic_bytes, self._pack_props
        cur = log.segments[-1]
        pos, used = cur.end, cur.length
        group_start = pos
        groups: list[tuple[int, bytes]] = []
        parts: list[bytes] = []
        nexts: dict[tuple[str, int], int] = {}
        results: list[AppendResult] = []
        # Consume-queue entries of the batch, packed per queue, with their count.
        entries: dict[tuple[str, int], bytearray] = {}
        for m in msgs:
            if type(m) is RawCopy:
                src = m.source
                _, _, _, _, tx_type, _, tlen, qid, _, born, _, prep, plen, _ = m.header or _HEADER_UNPACK(src)
                tb = bytes(src[HEADER_SIZE : HEADER_SIZE + tlen])
                topic = self._topic_names.get(tb)
                if topic is None:
                    topic = self._raw_topic(tb)
                pb, tags = m.props, m.tags
                body, bstart = src, HEADER_SIZE + tlen + plen  # the body is body[bstart:]
            else:
                topic, qid, props, body = m.topic, m.queue_id, m.properties, m.body
                tx_type, born, prep = m.tx_type, m.born_ts, m.prepared_offset
                tb = topics.get(topic)
                if tb is None:
                    tb = self._topic(topic)
                pb = pack(props) if props else EMPTY_PROPS
                tags = props.get(TAGS_PROPERTY) if props else None
                bstart = 0
            total = HEADER_SIZE + len(tb) + len(pb) + len(body) - bstart
            if total > limit:
                raise RecordTooLargeError(f"record of {total} bytes exceeds the limit of {limit} bytes")
            if used + total > seg_size and used:
                groups.append((group_start, b"".join(parts)))
                parts = []
                group_start, used = pos, 0
            key = (topic, qid)
            q = nexts.get(key)
            if q is None:
                cq = queues.get(key)
                q = cq.next if cq is not None else _check_queue_id(qid)
            nexts[key] = q + 1
            buf = entries.get(key)
            if buf is None:
                buf = entries[key] = bytearray()
            buf += _pack_entry(pos, total, tag_hash(tags) if tags else 0)
            # The compiled encoder when it was built (codec's end), else its Python twin.
            parts.append(encode_raw(pos, tx_type, tb, qid, q, born, store_ts, prep, pb, body, bstart))
            results.append(AppendResult(pos, total, q, store_ts))
            pos += total
            used += total
        groups.append((group_start, b"".join(parts)))
        written = log.write_batch(groups)
        with self._lock:
            log.publish(written, store_ts)
            dirty = self._dirty
            for key, buf in entries.items():
                cq = queues.get(key)
                if cq is None:
                    cq = queues[key] = ConsumeQueue(self._cq_root, key[0], key[1])
                cq.pending += buf
                cq.next = nexts[key]
                dirty.add(cq)
        return results

    def _raw_topic(self, tb: bytes) -> str:
        topic = str(tb, "utf-8")
        if len(self._topic_names) > 100_000:
            self._topic_names.clear()
        self._topic_names[tb] = topic
        return topic

    def _topic(self, topic: str) -> bytes:
        if not topic or "/" in topic or "\0" in topic or topic in (".", ".."):
            raise ValueError(f"invalid topic name {topic!r}")
        tb = topic.encode()
        if len(tb) > _MAX_TOPIC_BYTES:
            raise ValueError("topic name too long")
        if len(self._topic_bytes) > 100_000:
            self._topic_bytes.clear()
        self._topic_bytes[topic] = tb
        return tb

    # ---- durability --------------------------------------------------------
    @property
    def rewrite_pending(self) -> bool:
        """The next sync first writes the unsynced data again (after a failed fsync): a job for a worker thread."""
        log = self._log
        return log is not None and log.rewrite_before_sync is not None

    @property
    def sync_error(self) -> str | None:
        """Why the last fsync of the log failed, while no fsync has succeeded since (nothing past durable is acknowledged)."""
        log = self._log
        return log.sync_error if log is not None else None

    def sync(self, block: bool = True) -> int | None:
        """fsync the log up to what was written when called; returns the durable offset.

        Safe from a worker thread while the owner thread appends and reads.
        With ``block=False``, None at once when another fsync of the log runs.
        """
        job = self.begin_sync(block=block)
        if job is None:
            return None
        try:
            self.run_sync(job)
        except OSError as exc:
            return self.end_sync(job, exc)  # raises it, publishing nothing
        except BaseException:
            self._sync_lock.release()
            raise
        return self.end_sync(job, None)

    # ---- sync in steps, for a caller that runs the fsyncs elsewhere ----------------------------
    # (broker/flush.py hands them to a C thread that never takes the GIL.) begin_sync takes the sync
    # lock (on the event loop: without blocking) and end_sync releases it, in the same thread; between
    # the two the descriptors stay open (a segment retired meanwhile is closed by end_sync).
    def begin_sync(self, block: bool = False) -> SyncJob | None:
        """Capture what to fsync for everything appended so far; None when another fsync of the log runs (unless block)."""
        if not self._sync_lock.acquire(blocking=block):
            return None
        try:
            log = self._open_log()
            with self._lock:
                target, fds, dir_dirty = log.capture_sync()
        except BaseException:
            self._sync_lock.release()
            raise
        return SyncJob(log, target, fds, dir_dirty)

    def run_sync(self, job: SyncJob) -> None:
        """The fsyncs of begin_sync's capture, in any thread (the fallback when they cannot be handed over)."""
        self._fsync_log(job.log, job.fds, job.dir_dirty, job.target)

    def end_sync(self, job: SyncJob, error: OSError | None) -> int:
        """After the fsyncs of begin_sync's capture (error: why they failed): the durable offset; releases the lock."""
        try:
            if error is not None:
                job.log.sync_failed(error, job.dir_dirty)  # the C thread's fsyncs; _fsync_log's own recorded it already
                raise error
            with self._lock:
                durable = job.log.synced(job.target)
            job.log.close_retired()
            return durable
        finally:
            self._sync_lock.release()

    def _fsync_log(self, log: CommitLog, fds: list[int], dir_dirty: bool, target: int) -> None:
        """fdatasync the captured fds (and the directory); first, when needed, write the unsynced data again."""
        try:
            why = log.rewrite_before_sync
            if why is not None:
                with self._lock:
                    start, segs = log.unsynced_segments(target)
                written = log.rewrite_unsynced(start, segs, target, why)
                if written:
                    _log.warning("event=log_rewritten reason=%r from=%d to=%d bytes=%d", why, start, target, written)
            for fd in fds:
                os.fdatasync(fd)
            if dir_dirty:
                fsync_dir(log.dir)
        except BaseException as exc:
            if isinstance(exc, (OSError, StoreError)):
                log.sync_failed(exc, dir_dirty)
            elif dir_dirty:
                log.dir_dirty = True
            raise
        log.rewrite_before_sync = None
        log.sync_error = None

    def checkpoint(self, on_synced: Callable[[int], None] | None = None) -> None:
        """sync(), write and fsync buffered consume-queue entries, then replace the checkpoint file.

        ``on_synced(durable)`` is called as soon as the log is fsynced, before
        the consume queues and the checkpoint file are written: a caller
        waiting only for the log need not wait for the rest.
        """
        log = self._open_log()
        per_file = self.config.cq_entries_per_file
        with self._ckpt_lock:
            done: list = []
            plans: list = []
            repaired: set[tuple[ConsumeQueue, int]] = set()
            failed: OSError | None = None
            queue_stage = False
            try:
                with self._sync_lock:  # only for the log's fsync: syncs of later sends go on beside the rest
                    with self._lock:
                        target, fds, dir_dirty = log.capture_sync()
                        plans = [(cq, cq.plan_flush()) for cq in self._dirty]
                        self._dirty = set()
                        repaired, self._cq_repaired = self._cq_repaired, set()
                    self._fsync_log(log, fds, dir_dirty, target)
                    with self._lock:
                        durable = log.synced(target)
                if on_synced is not None:
                    on_synced(durable)
                # Entries count as flushed (read from their files, no longer held in memory) only once
                # fsynced. A queue whose write or fsync fails keeps them pending, and the next checkpoint
                # writes them again, at the same places, before its fsync: a failed fsync may have marked
                # their pages clean without writing them, and the next fsync would then succeed without
                # them while the checkpoint file claimed them (docs/reliability.md, "A failed fsync").
                # The other queues go on; the checkpoint file waits until every queue is written.
                for cq, plan in plans:
                    try:
                        new = cq.write_synced(plan, per_file)
                    except OSError as exc:
                        failed = failed or exc
                    else:
                        if plan is not None:
                            done.append((cq, plan[0], len(plan[1]) // ENTRY_SIZE, new))
                self._sync_repaired(repaired)
                queue_stage = True  # reached the end: the backlog below is this cycle's
            finally:
                with self._lock:
                    for cq, base, count, new in done:
                        cq.commit_flush(base, count, new)
                    self._cq_repaired |= repaired  # not fsynced (the log's fsync failed): the next checkpoint's
                    if self._cq_held and failed is None and done:
                        _log.info("event=consume_queue_entries_written entries=%d", self._cq_held)
                        self._cq_held = 0
                    for cq, _ in plans:
                        if cq.needs_flush:
                            self._dirty.add(cq)
                    if queue_stage:
                        # While queue files cannot be written, what waits for them is bounded like the log's
                        # backlog after a failed fsync: past the limit appends are refused until a cycle succeeds.
                        held = sum(len(cq.pending) for cq in self._dirty) if failed is not None else 0
                        self._cq_backlog = held > CQ_HELD_LIMIT
            if failed is not None:
                raise failed
            ckpt = Checkpoint(target, target)
            if ckpt != self._last_ckpt:  # an unchanged checkpoint costs no fsyncs
                write_checkpoint(self._checkpoint_path, ckpt)
                self._last_ckpt = ckpt
            if len(self._queues) != self._manifest_queues:  # a new queue: list it (ends are written at close)
                self._write_manifest()
        with self._sync_lock:
            log.close_retired()

    @staticmethod
    def _sync_repaired(repaired: set[tuple[ConsumeQueue, int]]) -> None:
        """fsync the queue files that reads rewrote entries of (emptying the set as they are done).

        A failure is logged and not retried: a failed fsync may leave the
        pages clean and unwritten, and an entry still damaged on disk after a
        restart is rebuilt again by the read that meets it.
        """
        while repaired:
            cq, start = repaired.pop()
            try:
                fsync_path(cq._path(start))
            except FileNotFoundError:  # deleted by retention since
                pass
            except OSError as exc:
                _log.warning("event=consume_queue_repair_not_synced topic=%s queue_id=%d file=%d error=%r",
                             cq.topic, cq.queue_id, start, exc)

    @property
    def _manifest_path(self) -> str:
        return os.path.join(self.data_dir, MANIFEST)

    def _write_manifest(self) -> None:
        """List every queue and its flushed end, so an open notices a queue lost or cut from outside."""
        with self._lock:
            data = manifest_bytes(self._queues, self._open_log().min_offset)
            count = len(self._queues)
        try:
            atomic_write_bytes(self._manifest_path, data)
        except OSError as exc:  # a full disk: the check is weaker until the next write, nothing else
            if not self._manifest_failing:  # once per spell, not every checkpoint
                _log.warning("event=manifest_write_failed error=%r", exc)
            self._manifest_failing = True
            return
        self._manifest_failing = False
        self._manifest_queues = count

    # ---- reading -----------------------------------------------------------
    def read(self, offset: int) -> Record:
        return self._open_log().read(offset)

    def read_many(self, offsets: Sequence[int], raw: bool = False) -> list[Record] | list[memoryview]:
        """The records at offsets; with raw, (validated bytes, unpacked header) pairs for RawCopy."""
        return self._open_log().read_many(offsets, raw)

    def read_record(self, offset: int) -> Record:
        """The record that starts at offset, for an offset a client gave (``stored_record_at``)."""
        return stored_record_at(self, offset)

    def record_start_from(self, offset: int, queues: list[tuple[str, int]] | None = None) -> int | None:
        """The first offset >= offset where a stored record starts (``consumequeue.record_start_from``)."""
        return record_start_from(self, offset, queues)

    def scan(self, start: int = 0, end: int | None = None) -> Iterator[Record]:
        """Records from start (a record boundary, or below the log's start) up to end, in order.

        A damaged record is skipped and reported once (``damage``).
        """
        log = self._open_log()
        return log._scan(start, log.end if end is None else end, self._log_damage)

    def scan_range(self, start: int, end: int) -> Iterator[Record]:
        """Valid records whose offset is in [start, end); start may be any byte position (resynchronises).

        A damaged record is skipped and reported (``damage``), and the walk
        goes on after it. Give a start where a record starts
        (``record_start_from``) when the records matter: a search of the
        bytes could take a record forged inside a message body for one.
        """
        log = self._open_log()
        return log._scan_range(max(start, log.min_offset), min(end, log.end), self._log_damage)

    def _log_damage(self, offset: int, reason: str, length: int) -> None:
        self.damage.report(Damage(offset, "log", reason, length))

    def queues(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for topic, qid in sorted(self._queues):
            out.setdefault(topic, []).append(qid)
        return out

    def queue_max_offset(self, topic: str, queue_id: int) -> int:
        cq = self._queues.get((topic, queue_id))
        return cq.next if cq is not None else 0

    def queue_min_offset(self, topic: str, queue_id: int) -> int:
        cq = self._queues.get((topic, queue_id))
        if cq is None:
            return 0
        with self._lock:
            return cq.min_offset(self._open_log().min_offset)

    def cq_entries(self, topic: str, queue_id: int, start: int, max_count: int) -> list[Entry]:
        """(commit-log offset, size, tag hash) for queue offsets [start, start + max_count).

        Offsets that have no entry (past the end, or before the queue's first
        file) are left out, so the list may start later than start.
        """
        cq = self._queues.get((topic, queue_id))
        if cq is None or max_count <= 0:
            return []
        with self._lock:
            return cq.entries(start, start + max_count)

    def read_queue_raw(self, topic: str, queue_id: int, queue_offset: int, max_count: int,
                       max_bytes: int) -> tuple[bytes, int] | None:
        """The records of queue offsets [queue_offset, ...) as stored, back to back, and their count: at least one,
        up to max_count and max_bytes (a raw pull).

        Each record is checked as ``get_messages`` checks it (CRC, its own
        offset, this queue's record at that queue offset, the entry's size).
        None when the offset is outside the queue or anything is not plain:
        ``get_messages`` then answers, and reports, repairs or skips it.
        """
        log = self._open_log()
        cq = self._queues.get((topic, queue_id))
        if cq is None or max_count < 1:
            return None
        with self._lock:
            lo, hi = cq.min_offset(log.min_offset), cq.next
            if not lo <= queue_offset < hi:
                return None
            raw = cq.read_raw(queue_offset, min(queue_offset + max_count, hi))
        tb = self._topic_bytes.get(topic)
        if tb is None:
            tb = topic.encode()
        return log.read_queue_raw(raw, max_bytes, self._limit, tb, queue_id, queue_offset)

    def get_messages(
        self, topic: str, queue_id: int, queue_offset: int, max_count: int = 32, max_bytes: int = 1 << 20
    ) -> GetResult:
        """Records of queue offsets [queue_offset, ...): at least one entry, up to max_count and max_bytes.

        An entry that does not lead to its record is rebuilt from the log
        (``queuerepair``) and the record served; one whose record is damaged
        is skipped (``skipped``, ``damage``). While a rebuild goes on past
        this read's step, the batch stops before the entries it rebuilds
        (``repairing``): read again.
        """
        log = self._open_log()
        cq = self._queues.get((topic, queue_id))
        if cq is None:
            return GetResult(GetStatus.NO_QUEUE, [], 0, 0, 0)
        with self._lock:
            lo, hi = cq.min_offset(log.min_offset), cq.next
            if queue_offset < lo or queue_offset >= hi:
                raw = b""
            else:
                raw = cq.read_raw(queue_offset, min(queue_offset + max(max_count, 1), hi))
        if queue_offset < lo:
            return GetResult(GetStatus.OFFSET_TOO_SMALL, [], lo, lo, hi)
        if queue_offset >= hi:
            status = GetStatus.NO_MESSAGE if queue_offset == hi else GetStatus.OFFSET_OVERFLOW
            return GetResult(status, [], hi, lo, hi)
        entries = pick_entries(ENTRY.iter_unpack(raw), max_bytes)
        records, bad = log.read_queue(topic, queue_id, queue_offset, entries)
        if not bad:
            return GetResult(GetStatus.FOUND, records, queue_offset + len(entries), lo, hi)
        rewritten, stop = self._repairs.meet(self, cq, queue_offset, entries, bad)
        if rewritten:
            with self._lock:
                raw = cq.read_raw(queue_offset, queue_offset + len(entries))
            entries = pick_entries(ENTRY.iter_unpack(raw), max_bytes)
            records, bad = log.read_queue(topic, queue_id, queue_offset, entries)
        if stop is not None:
            del entries[stop - queue_offset :]
            records = [r for r in records if r.queue_offset < stop]
            bad = [b for b in bad if b[0] < stop]
        for _q, off, why in bad:
            self.damage.report(Damage(off, f"queue {topic}/{queue_id}", why))
        return GetResult(GetStatus.FOUND, records, queue_offset + len(entries), lo, hi, bad, stop is not None)

    def _rewrite_entries(self, cq: ConsumeQueue, changes: list[tuple[int, Entry]]) -> set[int]:
        """Write rebuilt entries in place (the next checkpoint fsyncs them); returns the queue offsets written.

        Entries not on disk yet (``pending``, which a checkpoint may be
        writing out meanwhile) are left as they are.
        """
        with self._lock:
            on_disk = [(q, e) for q, e in changes if cq.base <= q < cq.flushed]
            try:
                starts = cq.rewrite(on_disk)
            except OSError as exc:
                _log.warning("event=consume_queue_repair_failed topic=%s queue_id=%d error=%r", cq.topic, cq.queue_id, exc)
                return set()
            self._cq_repaired.update((cq, s) for s in starts)
        return {q for q, _ in on_disk}

    # ---- retention ---------------------------------------------------------
    def delete_expired(self, now: float, protect_from: int) -> list[str]:
        """Delete leading segments older than retention_s and ending at or before protect_from.

        Never deletes the current segment. Also deletes leading consume-queue
        files whose entries all point below the new start of the log.
        Returns the deleted files' paths relative to the data directory.
        """
        log = self._open_log()
        cutoff_ms = (now - self.config.retention_s) * 1000
        segs = log.segments
        count = 0
        while count < len(segs) - 1:
            seg = segs[count]
            ts = log.last_store_ts(seg) if seg.length else -1
            if seg.end > protect_from or ts is None or ts >= cutoff_ms:
                break
            count += 1
        if not count:
            return []
        deleted: list[str] = []
        with self._lock:
            gone = log.delete_front(count)
            log_min = log.min_offset
            for cq in self._queues.values():
                deleted += cq.delete_files_below(log_min)
        idle = self._sync_lock.acquire(blocking=False)
        try:
            for seg in gone:
                log.retire(seg.fd, no_sync_running=idle)
        finally:
            if idle:
                self._sync_lock.release()
        self._write_manifest()  # the log's new start: not mistaken for files removed by hand
        root = self.data_dir
        return [os.path.relpath(s.path, root) for s in gone] + [os.path.relpath(p, root) for p in deleted]


def _check_queue_id(qid: int) -> int:
    if not 0 <= qid <= _MAX_QUEUE_ID:
        raise ValueError(f"queue id {qid} out of range")
    return 0


def _take_lock(path: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreLockedError(f"{path} is held by another process") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
