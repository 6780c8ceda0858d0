"""Errors the store raises. Expected outcomes of reads are statuses (GetStatus), not errors."""

from __future__ import annotations

import errno

# The errnos of a write that found no space: a full disk, a quota, a file size limit (RLIMIT_FSIZE).
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class StoreError(Exception):
    """Base class of every error raised by txmq.store."""


class StoreFullError(StoreError):
    """A write failed with ENOSPC, EDQUOT or EFBIG.

    The failed batch was rolled back completely (file truncated back, queue
    offsets and consume-queue state untouched), so a later append works once
    space returns.
    """


class StoreLockedError(StoreError):
    """Another process (or another Store object) holds the data directory's LOCK."""


class RecordTooLargeError(StoreError):
    """A message would encode to more than max_record_size (or segment_size) bytes."""


class CorruptRecordError(StoreError):
    """No valid record starts at the offset that was asked for."""


class DataFileError(StoreError):
    """A file of the data directory is damaged and cannot be used as it is; the message names it and says what to do."""
