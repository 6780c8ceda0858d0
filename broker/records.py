"""A stored record as clients see it: its message id and its wire map.

The native protocol (pull, lookups), the RocketMQ front end and the CLI's
offline commands show records the same way, so the id rule lives once here.
"""

from __future__ import annotations

from typing import Any

from txmq.constants import PROP_UNIQ_KEY
from txmq.store import Record


def msg_id(properties: dict[str, str], commit_log_offset: int) -> str:
    """The UNIQ_KEY property, or the commit-log offset in 16 hex digits (docs/protocol.md)."""
    return properties.get(PROP_UNIQ_KEY) or f"{commit_log_offset:016X}"


def msg_id_of(rec: Record) -> str:
    return msg_id(rec.properties, rec.commit_log_offset)


def record_to_map(rec: Record) -> dict[str, Any]:
    return {
        "topic": rec.topic,
        "queue_id": rec.queue_id,
        "queue_offset": rec.queue_offset,
        "commit_log_offset": rec.commit_log_offset,
        "size": rec.size,
        "msg_id": msg_id_of(rec),
        "born_ts": rec.born_ts,
        "store_ts": rec.store_ts,
        "tx_type": int(rec.tx_type),
        "prepared_offset": rec.prepared_offset,
        "properties": rec.properties,
        "body": rec.body,
    }
