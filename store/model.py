"""Typed results and settings of the store (what its methods take and return)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from .codec import Record


@dataclass(frozen=True, slots=True)
class StoreConfig:
    segment_size: int = 1 << 30  # bytes per commit-log segment file
    cq_entries_per_file: int = 300_000  # 20-byte entries per consume-queue file
    retention_s: float = 72 * 3600  # age after which whole segments may be deleted
    max_record_size: int = 16 << 20  # largest encoded record accepted by append()
    # zeros kept allocated past the active segment's data, so an fdatasync rarely changes the file's size (0: none)
    preallocate: int = 8 << 20


@dataclass(slots=True)  # not frozen: a frozen init costs 5x, on the hot path (treat as read-only)
class AppendResult:
    commit_log_offset: int
    size: int
    queue_offset: int
    store_ts: int

    @property
    def end_offset(self) -> int:
        return self.commit_log_offset + self.size


class GetStatus(Enum):
    FOUND = "found"
    NO_MESSAGE = "no_message"  # offset == max: nothing new yet
    OFFSET_OVERFLOW = "offset_overflow"  # offset > max
    OFFSET_TOO_SMALL = "offset_too_small"  # offset < min: deleted by retention
    NO_QUEUE = "no_queue"  # no consume queue for (topic, queue id)


@dataclass(frozen=True, slots=True)
class GetResult:
    status: GetStatus
    records: list[Record] = field(default_factory=list)
    next_offset: int = 0  # queue offset to ask for next
    min_offset: int = 0
    max_offset: int = 0
    # entries skipped because their record is damaged: (queue offset, commit-log offset, reason);
    # next_offset is past them, so a consumer moves on
    skipped: list[tuple[int, int, str]] = field(default_factory=list)
    # damaged entries at next_offset are being rebuilt from the log, a bounded step per read: read again
    # (records may be empty, with next_offset where the read started)
    repairing: bool = False


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    dropped_bytes: int  # commit-log bytes cut off at the first invalid record
    reason: str | None  # why, e.g. "crc mismatch at 12345"; None when nothing was dropped
    truncated_at: int | None  # commit-log offset the log was cut at, if it was
    redispatched: int  # consume-queue entries (re)written from the log
    cq_entries_dropped: int  # consume-queue entries removed (past the end, mismatched, partial)
    segments: int  # commit-log segment files after recovery
    max_offset: int  # end of the log after recovery
    scanned_from: int  # recovery validated every record from here to max_offset (the unverified tail)
    duration_s: float
    damaged: int = 0  # damaged ranges inside the log, skipped (each reported in Store.damage)
    queues_rebuilt: list[str] = field(default_factory=list)  # why the consume queues were re-read from the log
    preallocated: int = 0  # zero bytes after the last record (preallocated space a crash left), cut
