"""Wire handlers for consumer groups, reading by time and message lookups (the operator's calls: messaging/operations.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from txmq.constants import canonical_topic

from .operations import HANDLERS, Front, Reply, _bad, opt_bool, opt_int, opt_str, req_int, req_str

if TYPE_CHECKING:
    from .connection import BrokerConnection


def _queue_ids(f: dict) -> list[int] | None:
    v = f.get("queue_ids")
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > 1024 or not all(type(q) is int and 0 <= q <= 1023 for q in v):
        raise _bad("field 'queue_ids' must be a list of queue ids (0 to 1023)")
    return v


def _topic(f: dict, key: str = "topic") -> str:
    return canonical_topic(req_str(f, key))


def list_groups(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    return front.operations.list_groups()


def describe_group(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    topic = opt_str(f, "topic")
    return front.operations.describe_group(req_str(f, "group"), canonical_topic(topic) if topic else None)


def reset_offsets(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    group, topic, to = req_str(f, "group"), _topic(f), req_str(f, "to")
    if to not in ("earliest", "latest", "offset", "time"):
        raise _bad("field 'to' must be earliest, latest, offset or time")
    offset = req_int(f, "offset") if to == "offset" else None
    time_ms = req_int(f, "time_ms") if to == "time" else None
    return front.operations.reset_offsets(group, topic, to, offset, time_ms, _queue_ids(f), opt_bool(f, "dry_run"),
                                          opt_bool(f, "force"))


def update_group(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    fifo = f.get("fifo")
    if fifo is not None and not isinstance(fifo, bool):
        raise _bad("field 'fifo' must be true or false")
    return front.operations.update_group(req_str(f, "group"), fifo)


def offsets_for_time(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    return front.operations.offsets_for_time(_topic(f), req_int(f, "time_ms"), _queue_ids(f))


def get_message(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    msg_id, off = opt_str(f, "msg_id"), opt_int(f, "commit_log_offset", None)
    if msg_id is None and off is None:
        raise _bad("one of the fields 'msg_id' and 'commit_log_offset' is required")
    return front.operations.get_message(msg_id, off)


def find_messages(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    topic = opt_str(f, "topic")
    ops = front.operations
    return ops.find_messages(
        req_str(f, "key"), canonical_topic(topic) if topic else None, req_int(f, "since_ms"),
        opt_int(f, "until_ms", None), opt_int(f, "limit", 100, 1, 10_000),
        opt_int(f, "max_scan", ops.FIND_SCAN, 1, ops.FIND_MAX_SCAN),
    )


HANDLERS.update({
    "list_groups": list_groups,
    "describe_group": describe_group,
    "reset_offsets": reset_offsets,
    "update_group": update_group,
    "offsets_for_time": offsets_for_time,
    "get_message": get_message,
    "find_messages": find_messages,
})
