"""Consumer groups and reading without a group: the admin operations behind
`txmq groups`, `txmq read` and `txmq message` (docs/protocol.md, "Consumer
groups and lookups").

Everything here reads the consume queues and the commit log through the
store; nothing scans the whole log. A time is turned into a queue offset by
binary search over the queue's entries and their records' `store_ts`; a
lookup by key reads only the records stored in a bounded time window, up to
a bounded number of records.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from txmq.constants import PROP_KEYS, PROP_UNIQ_KEY, is_system_topic
from txmq.wire import ErrorCode, TxmqError

from .records import msg_id_of, record_to_map

log = logging.getLogger("txmq.broker")

OFFSET_ID = re.compile(r"[0-9A-Fa-f]{16}")
MAX_SCAN = 1_000_000  # records one find_messages may read, at most
DEFAULT_SCAN = 100_000
FIND_MAX_BYTES = 16 << 20  # message bodies one find_messages reply carries, at most (the client takes 64 MiB frames)
SCAN_BATCH = 256


# ---- live consumers -------------------------------------------------------
def live_consumers(core, group: str) -> int:
    reg = getattr(core, "consumer_registry", None)
    return reg.online(group) if reg is not None else 0


# ---- positions --------------------------------------------------------------
def queue_bounds(core, topic: str, q: int) -> tuple[int, int]:
    return core.store.queue_min_offset(topic, q), core.store.queue_max_offset(topic, q)


def _store_ts_at(core, topic: str, q: int, index: int) -> int | None:
    """store_ts of the record at queue offset index, or None when it cannot be read (damaged)."""
    entries = core.store.cq_entries(topic, q, index, 1)
    if not entries:
        return None
    try:
        return core.store.read(entries[0][0]).store_ts
    except Exception:  # a damaged record: the caller steps over it
        return None


def offset_for_time(core, topic: str, q: int, time_ms: int) -> int:
    """The queue offset of the first message stored at or after time_ms (the queue's end when none).

    Binary search over the queue's entries: about 2 * log2(messages) reads.
    A record that cannot be read is stepped over to the next one.
    """
    lo, hi = queue_bounds(core, topic, q)
    while lo < hi:
        mid = (lo + hi) // 2
        probe = mid
        ts = _store_ts_at(core, topic, q, probe)
        while ts is None and probe + 1 < hi:
            probe += 1
            ts = _store_ts_at(core, topic, q, probe)
        if ts is None:  # nothing readable in [mid, hi)
            hi = mid
        elif ts >= time_ms:
            hi = mid
        else:
            lo = probe + 1
    return lo


def known_topic(core, topic: str) -> int:
    n = core.topics.queues(topic)
    if n is None:
        raise TxmqError(f"no topic {topic!r} on the broker", ErrorCode.NO_SUCH_QUEUE)
    return n


def check_queues(n: int, topic: str, queue_ids: list[int] | None) -> list[int]:
    if queue_ids is None:
        return list(range(n))
    for q in queue_ids:
        if q >= n:
            raise TxmqError(f"queue {q} does not exist: topic {topic} has {n} queues", ErrorCode.NO_SUCH_QUEUE)
    return sorted(set(queue_ids))


def offsets_for_time(core, topic: str, time_ms: int, queue_ids: list[int] | None) -> dict[str, Any]:
    n = known_topic(core, topic)
    return {"offsets": {str(q): offset_for_time(core, topic, q, time_ms) for q in check_queues(n, topic, queue_ids)}}


# ---- groups ---------------------------------------------------------------
def queue_lag(committed: int | None, lo: int, hi: int) -> int:
    """What the group has left to read in a queue holding [lo, hi): from its committed offset, or, in a queue it
    never committed, from where its consumers start one (the queue's first message still stored: a txmq consumer's
    default ``from_="earliest"``, and RocketMQ's pop consumption), so every queue of the topic counts."""
    return max(0, hi - max(lo if committed is None else committed, lo))


def _queue_rows(core, group: str, topic: str, committed: dict[int, int]) -> list[dict[str, Any]]:
    n = core.topics.queues(topic) or 0
    rows = []
    for q in range(max(n, max(committed, default=-1) + 1)):
        lo, hi = queue_bounds(core, topic, q)
        off = committed.get(q)
        rows.append({"topic": topic, "queue_id": q, "committed": off, "min_offset": lo, "max_offset": hi,
                     "lag": queue_lag(off, lo, hi)})
    return rows


def list_groups(core) -> dict[str, Any]:
    by_group = core.offsets.all()
    live = core.consumer_registry.groups() if getattr(core, "consumer_registry", None) else {}
    settings = core.group_config
    out = []
    for g in sorted(set(by_group) | set(live) | set(settings.configured())):
        topics = by_group.get(g, {})
        lag = sum(r["lag"] for t, qs in topics.items() for r in _queue_rows(core, g, t, qs))
        out.append({"group": g, "topics": sorted(topics), "consumers": live.get(g, 0), "lag": lag,
                    "fifo": settings.fifo(g)})
    return {"groups": out}


def describe_group(core, group: str, topic: str | None) -> dict[str, Any]:
    topics = core.offsets.all().get(group, {})
    consumers = live_consumers(core, group)
    if not topics and not consumers and group not in core.group_config.configured():
        raise TxmqError(f"no consumer group {group!r}: it never committed an offset, has no live consumer and no settings",
                        ErrorCode.NO_SUCH_GROUP)
    names = sorted(topics) if topic is None else [topic]
    queues = [r for t in names for r in _queue_rows(core, group, t, topics.get(t, {}))]
    return {"group": group, "consumers": consumers, "topics": names, "queues": queues,
            "total_lag": sum(r["lag"] for r in queues), "fifo": core.group_config.fifo(group)}


def update_group(core, group: str, fifo: bool | None) -> dict[str, Any]:
    """Change a consumer group's settings (groups.json, written before the answer); a group need not exist yet.

    ``fifo``: its consumers receive each queue in order, one batch in flight
    per queue (RocketMQ's consumeMessageOrderly; broker/messaging/consumption.py).
    """
    reply = core.group_config.update(group, fifo=fifo)
    if reply["changed"]:
        log.info("event=group_updated group=%s fifo=%s old_fifo=%s", group, reply["fifo"], reply["old"]["fifo"])
    return reply


async def reset_offsets(core, group: str, topic: str, to: str, offset: int | None, time_ms: int | None,
                        queue_ids: list[int] | None, dry_run: bool, force: bool) -> dict[str, Any]:
    n = known_topic(core, topic)
    qs = check_queues(n, topic, queue_ids)
    consumers = live_consumers(core, group)
    if consumers and not force and not dry_run:
        raise TxmqError(
            f"group {group!r} has {consumers} live consumer connection(s): they commit their own positions and "
            "would overwrite the reset; stop them first, or force it", ErrorCode.GROUP_ACTIVE, consumers=consumers)
    plan = []
    for q in qs:
        lo, hi = queue_bounds(core, topic, q)
        if to == "earliest":
            new = lo
        elif to == "latest":
            new = hi
        elif to == "offset":
            new = min(max(offset, lo), hi)
        else:
            new = offset_for_time(core, topic, q, time_ms)
        old = core.offsets.get(group, topic, q)
        plan.append({"topic": topic, "queue_id": q, "old": old, "new": new, "min_offset": lo, "max_offset": hi,
                     "lag": hi - new})
    if not dry_run:
        for row in plan:
            core.offsets.commit(group, topic, row["queue_id"], row["new"])
        await core.flusher.wait_persisted()
    return {"group": group, "topic": topic, "dry_run": dry_run, "consumers": consumers, "queues": plan}


# ---- messages -------------------------------------------------------------
def get_message(core, msg_id: str | None, cl_offset: int | None) -> dict[str, Any]:
    """A message by its commit-log offset (an offset message id names one): one read, no scan."""
    if cl_offset is None:
        if msg_id is None or not OFFSET_ID.fullmatch(msg_id):
            raise TxmqError(f"message id {msg_id!r} does not name a commit-log offset (16 hex digits); a transactional "
                            "message's id is its transaction id: look it up as a key", ErrorCode.INVALID_FIELD)
        cl_offset = int(msg_id, 16)
    store = core.store
    if not (store.min_offset <= cl_offset < store.max_offset):
        raise TxmqError(f"no message at commit-log offset {cl_offset} (the log holds {store.min_offset} to {store.max_offset})",
                        ErrorCode.NO_SUCH_MESSAGE)
    try:
        rec = store.read_record(cl_offset)  # never a record forged inside a message body
    except Exception:
        raise TxmqError(f"no message starts at commit-log offset {cl_offset}", ErrorCode.NO_SUCH_MESSAGE) from None
    if is_system_topic(rec.topic):
        raise TxmqError(f"commit-log offset {cl_offset} holds a record of system topic {rec.topic}, not a message",
                        ErrorCode.NO_SUCH_MESSAGE)
    if msg_id is not None and msg_id_of(rec).upper() != msg_id.upper():  # an id a producer chose (UNIQ_KEY), not an offset
        raise TxmqError(f"the message at commit-log offset {cl_offset} has id {msg_id_of(rec)}, not {msg_id}",
                        ErrorCode.NO_SUCH_MESSAGE)
    return {"message": record_to_map(rec)}


def _matches(props: dict[str, str], key: str) -> bool:
    if props.get(PROP_UNIQ_KEY) == key:
        return True
    keys = props.get(PROP_KEYS)
    return bool(keys) and key in keys.split(" ")


async def find_messages(core, key: str, topic: str | None, since_ms: int, until_ms: int | None, limit: int,
                        max_scan: int) -> dict[str, Any]:
    """Messages whose KEYS hold key (or whose UNIQ_KEY is key), stored in [since_ms, until_ms).

    Per queue, the start is found by binary search on store_ts; then at most
    max_scan records in all are read, in batches, yielding to the loop
    between batches. ``truncated`` says the scan stopped before the window's end.
    """
    if topic is not None:
        known_topic(core, topic)
        names = [topic]
    else:
        names = [t for t in sorted(core.topics.all()) if not is_system_topic(t)]
    found: list[dict[str, Any]] = []
    scanned = found_bytes = 0
    truncated = False
    for t in names:
        for q in range(core.topics.queues(t) or 0):
            await asyncio.sleep(0)  # a binary search per queue: thousands of queues must not hold the loop
            pos = offset_for_time(core, t, q, since_ms)
            end = core.store.queue_max_offset(t, q)
            while pos < end and len(found) < limit:
                if scanned >= max_scan:
                    truncated = True
                    break
                res = core.store.get_messages(t, q, pos, min(SCAN_BATCH, max_scan - scanned), 4 << 20)
                if not res.records and res.next_offset <= pos and not res.repairing:
                    break
                stop = False
                for rec in res.records:
                    if until_ms is not None and rec.store_ts >= until_ms:
                        stop = True
                        break
                    scanned += 1
                    if _matches(rec.properties, key):
                        found.append(record_to_map(rec))
                        found_bytes += len(rec.body)
                        if found_bytes >= FIND_MAX_BYTES:  # one reply frame stays a size a client takes
                            truncated = True
                            break
                        if len(found) >= limit:
                            break
                if stop or truncated:
                    break
                pos = res.next_offset if res.next_offset > pos or res.repairing else pos + 1
                await asyncio.sleep(0)
            if truncated or len(found) >= limit:
                break
        if truncated or len(found) >= limit:
            break
    found.sort(key=lambda m: m["store_ts"])
    return {"messages": found, "scanned": scanned, "truncated": truncated, "since_ms": since_ms}
