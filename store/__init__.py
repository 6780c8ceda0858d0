"""txmq.store: the durable append-only store (commit log + consume queues).

Plain synchronous Python with no dependency on the rest of txmq; the byte
format and directory layout are in docs/store-format.md.
"""

from .codec import (
    HEADER_SIZE,
    MAGIC,
    Message,
    RawCopy,
    Record,
    TxType,
    check_record,
    decode_record,
    encode_record,
    record_problem,
    split_raw,
    tag_hash,
)
from .errors import (
    CorruptRecordError,
    RecordTooLargeError,
    StoreError,
    StoreFullError,
    StoreLockedError,
)
from .files import atomic_write_bytes, atomic_write_json, read_json
from .model import AppendResult, GetResult, GetStatus, RecoveryReport, StoreConfig
from .offsets import ConsumerOffsets
from .reader import StoreReader
from .store import Store

__all__ = [
    "HEADER_SIZE",
    "MAGIC",
    "AppendResult",
    "ConsumerOffsets",
    "CorruptRecordError",
    "GetResult",
    "GetStatus",
    "Message",
    "RawCopy",
    "Record",
    "RecordTooLargeError",
    "RecoveryReport",
    "Store",
    "StoreConfig",
    "StoreError",
    "StoreFullError",
    "StoreLockedError",
    "StoreReader",
    "TxType",
    "atomic_write_bytes",
    "atomic_write_json",
    "check_record",
    "decode_record",
    "encode_record",
    "read_json",
    "record_problem",
    "split_raw",
    "tag_hash",
]
