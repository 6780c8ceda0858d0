"""One function per wire operation: validate fields, call the core, shape the reply.

A handler returns a reply dict, or an awaitable of one. Field errors raise
TxmqError(INVALID_FIELD), which the connection turns into an error reply.
See docs/protocol.md for the operations.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from txmq import __version__
from txmq.constants import PROP_TRAN_MSG, canonical_topic, is_system_topic
from txmq.wire import PROTOCOL_VERSION, ErrorCode, TxmqError

from ..messaging import NATIVE_RULES, EndOutcome, Messaging, Operations, Outgoing, SendReceipt
from ..topics import MAX_QUEUES, message_types_of
from .operations import HANDLERS, Front, Handler, Reply, _bad, body_of, opt_bool, opt_int, opt_str, props_of, refs_of, req_int, req_str, user_topic

if TYPE_CHECKING:
    from .connection import BrokerConnection

# What this broker supports beyond protocol 1's first requests (additive, in `hello`):
# "config_set_dry_run": config_set takes dry_run and answers what the change would discard;
# "topic_message_types": create_topic takes message_types, update_topic, delete_topic and describe_topic exist,
# list_topics' rows carry message_types (an older broker would create a topic without the types it was given).
# "message_group": a send's __SHARDINGKEY property is its message group (FIFO): the group chooses the queue;
# update_group marks a consumer group FIFO, and list_groups / describe_group carry fifo.
# "scheduled_messages": sends with TIMER_DELIVER_MS / TIMER_DELAY_SEC / TIMER_DELAY_MS / DELAY are delivered when due,
# and cancel_scheduled and list_scheduled exist (an older broker would deliver such a send at once).
# "queue_offsets": the queue_offsets request (every queue's offsets, system topics too; what Spark plans reads with);
# "pull_raw": pull takes raw and may answer with the records as stored (what Spark's executors decode).
# "scheduled_bodies": list_scheduled takes bodies and then gives each message's properties and body (txmq migrate).
FEATURES = ["config_set_dry_run", "topic_message_types", "message_group", "scheduled_messages", "queue_offsets", "pull_raw",
            "scheduled_bodies"]


# ---- session ---------------------------------------------------------------
def hello(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    for key in ("producer_groups", "consumer_groups"):
        groups = f.get(key) or []
        if (not isinstance(groups, list) or len(groups) > 64
                or not all(isinstance(g, str) and 0 < len(g) <= 255 for g in groups)):
            raise _bad(f"field {key!r} must be a list of at most 64 group names (1 to 255 characters)")
    # a repeated hello adds groups, up to MAX_GROUPS_PER_CONN (broker/registry.py) for the connection
    m = front.messaging
    for g in f.get("producer_groups") or []:
        m.register_producer(g, conn)
    for g in f.get("consumer_groups") or []:
        m.register_consumer(g, conn)
    conn.client_id = opt_str(f, "client_id") or conn.client_id
    return {"version": __version__, "protocol": PROTOCOL_VERSION, "broker_id": m.broker_id, "flush": m.config.flush,
            "features": FEATURES}


def heartbeat(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    return {"time_ms": int(time.time() * 1000)}


def broker_info(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    return front.operations.info()


# ---- sending ---------------------------------------------------------------
def send(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    messaging = front.messaging
    topic = user_topic(f)
    body = body_of(f, messaging.config.max_body)
    props = props_of(f, messaging.config.max_properties)
    qid = opt_int(f, "queue_id", None, -1, 1023)
    born = opt_int(f, "born_ts", None) or messaging.now_ms()
    created = messaging.topic_queues(topic) is None  # rare: the reply says this send created the topic
    return messaging.send(topic, [Outgoing(body, props, born)], qid, NATIVE_RULES, _created_row if created else _first_row)


def receipt_row(r: SendReceipt) -> dict[str, Any]:
    """A send's receipt as the native protocol answers it (docs/protocol.md, "send")."""
    msg_id, topic, queue_id, queue_offset, cl, deliver_at_ms, half_offset, _resent = r  # once per message: no attribute lookups
    if half_offset is not None:
        return {"msg_id": msg_id, "tx_id": msg_id, "topic": topic, "queue_id": queue_id, "half_offset": half_offset,
                "commit_log_offset": cl}
    row = {"msg_id": msg_id, "topic": topic, "queue_id": queue_id, "queue_offset": queue_offset, "commit_log_offset": cl}
    if deliver_at_ms is not None:
        row["deliver_at_ms"] = deliver_at_ms
    return row


def _first_row(receipts: list[SendReceipt]) -> dict[str, Any]:
    return receipt_row(receipts[0])


def _created_row(receipts: list[SendReceipt]) -> dict[str, Any]:
    """The reply of a send that created its topic, with ``topic_created``: an operator may not have meant to."""
    return {**receipt_row(receipts[0]), "topic_created": True}


def _batch_rows(receipts: list[SendReceipt]) -> dict[str, Any]:
    return {"results": [receipt_row(r) for r in receipts]}


def _created_batch_rows(receipts: list[SendReceipt]) -> dict[str, Any]:
    return {**_batch_rows(receipts), "topic_created": True}


def send_batch(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    topic = user_topic(f)
    items = f.get("messages")
    if not isinstance(items, list) or not items or len(items) > 10_000:
        raise _bad("field 'messages' must be a non-empty list of at most 10000 messages")
    messaging = front.messaging
    cfg = messaging.config
    created = messaging.topic_queues(topic) is None
    asked = opt_int(f, "queue_id", None, -1, 1023)
    now = messaging.now_ms()
    out = []
    for m in items:
        if not isinstance(m, dict):
            raise _bad("each message must be a map")
        props = props_of(m, cfg.max_properties)
        if props.get(PROP_TRAN_MSG) == "true":
            raise _bad("transactional messages cannot be sent in a batch")
        out.append(Outgoing(body_of(m, cfg.max_body), props, opt_int(m, "born_ts", None) or now))
    return messaging.send(topic, out, asked, NATIVE_RULES, _created_batch_rows if created else _batch_rows)


# ---- transactions ----------------------------------------------------------
def end_transaction(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    state = req_str(f, "state")  # commit, rollback or unknown: the service checks it
    source = "check" if opt_bool(f, "from_check") else "producer"
    return front.messaging.end_transaction(req_str(f, "group"), req_str(f, "tx_id"), req_int(f, "commit_log_offset"),
                                           req_int(f, "half_offset"), state, source, end_row)


def end_row(o: EndOutcome) -> dict[str, Any]:
    """An end of a transaction's outcome as the native protocol answers it (docs/protocol.md, "end_transaction")."""
    row: dict[str, Any] = {"status": o.status.value, "outcome": o.outcome}
    if o.decided_by is not None:
        row["decided_by"] = o.decided_by
    c = o.committed
    if c is not None:
        row.update(commit_log_offset=c.commit_log_offset, queue_offset=c.queue_offset, topic=c.topic, queue_id=c.queue_id)
    return row


# ---- consuming -------------------------------------------------------------
def pull(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    topic = canonical_topic(req_str(f, "topic"))
    args = (topic, req_int(f, "queue_id", 0, 1023), req_int(f, "offset"), opt_int(f, "max_count", 32, 1, 10_000),
            opt_int(f, "max_bytes", 1 << 20, 1, 64 << 20), opt_int(f, "wait_ms", 0, 0, 1 << 31))
    if opt_bool(f, "raw"):
        reply = _pull_raw(front, *args[:5])
        if reply is not None:
            return reply
    return _pulled(front.messaging, args)


async def _pulled(messaging: Messaging, args: tuple) -> dict[str, Any]:
    r = await messaging.pull(*args)
    return {"status": r.status.value, "messages": r.messages, "next_offset": r.next_offset, "min_offset": r.min_offset,
            "max_offset": r.max_offset}


def _pull_raw(front: Front, topic: str, queue_id: int, offset: int, max_count: int, max_bytes: int) -> dict | None:
    """A pull answered with the records as stored, back to back (``records``), each checked as the usual pull checks it
    (CRC, its own offset, this queue's record at that queue offset); None when anything is not plain (no such queue,
    out of range, a record that does not check): the usual pull answers, and reports, repairs or skips it. The reader
    checks the records' topic, queue and queue offsets again (and asks without raw when one is off)."""
    n = front.messaging.topic_queues(topic)
    if n is None or queue_id >= n:
        return None
    ops = front.operations
    got = ops.read_raw(topic, queue_id, offset, max_count, max_bytes)
    if got is None:
        return None
    data, count = got
    ops.count_pulled(count)
    lo, hi = front.messaging.queue_bounds(topic, queue_id)
    return {"status": "found", "records": data, "count": count, "next_offset": offset + count, "min_offset": lo, "max_offset": hi}


def queue_offsets(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    """Every queue's [min_offset, max_offset) of the named topics (default: every topic, with system), and with
    time_ms the offset of each queue's first message stored at or after it: one request to plan a bulk read."""
    names = f.get("topics")
    if names is not None and (not isinstance(names, list) or len(names) > 10_000
                              or not all(isinstance(t, str) and 0 < len(t) <= 255 for t in names)):
        raise _bad("field 'topics' must be a list of topic names")
    time_ms = opt_int(f, "time_ms", None, -(1 << 62))
    m = front.messaging
    table = m.topics()
    if names is None:
        names = [t for t in sorted(table) if opt_bool(f, "system") or not is_system_topic(t)]
    missing = sorted({t for t in names if canonical_topic(t) not in table})
    if missing:
        raise TxmqError(f"no topic {', '.join(missing)} on the broker", ErrorCode.NO_SUCH_TOPIC, topic=missing[0])
    rows = front.operations.queue_offsets(list(dict.fromkeys(canonical_topic(t) for t in names)), time_ms)
    for row in rows:
        row["system"] = is_system_topic(row["topic"])
    return {"broker_id": m.broker_id, "max_offset": m.log_bounds()[1],
            "topics": [{"topic": r["topic"], "system": r["system"], "queues": r["queues"]} for r in rows]}


async def _commit_offset(messaging: Messaging, group: str, topic: str, queue_id: int, offset: int) -> dict:
    await messaging.commit_offset(group, topic, queue_id, offset)
    return {}


def commit_offset(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    group, offset = req_str(f, "group"), req_int(f, "offset")
    topic, queue_id = canonical_topic(req_str(f, "topic")), req_int(f, "queue_id", 0, 1023)
    n = front.messaging.topic_queues(topic)
    if n is None or queue_id >= n:  # offsets of queues that do not exist would fill every group listing
        raise TxmqError(f"topic {topic} has no queue {queue_id}" if n is not None else f"no topic {topic}",
                        ErrorCode.NO_SUCH_QUEUE)
    return _commit_offset(front.messaging, group, topic, queue_id, offset)


def fetch_offsets(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    offsets = front.messaging.fetch_offsets(req_str(f, "group"), canonical_topic(req_str(f, "topic")))
    return {"offsets": {str(q): off for q, off in offsets.items()}}  # msgpack map keys are strings


def _message_types(f: dict) -> tuple[str, ...] | None:
    return None if f.get("message_types") is None else message_types_of(f["message_types"])


def create_topic(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    return front.messaging.create_topic(user_topic(f), opt_int(f, "queues", None, 1, MAX_QUEUES), _message_types(f))


def update_topic(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    topic = user_topic(f)
    queues, types = opt_int(f, "queues", None, 1, MAX_QUEUES), _message_types(f)
    if queues is None and types is None:
        raise _bad("give queues, message_types or both")
    return front.messaging.update_topic(topic, queues, types)


def delete_topic(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    return front.messaging.delete_topic(user_topic(f), opt_bool(f, "force"))


def describe_topic(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    return front.operations.describe_topic(user_topic(f))


def list_topics(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    return {"topics": front.operations.list_topics(opt_bool(f, "system"))}


# ---- administration --------------------------------------------------------
def tx_pending(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    topic = opt_str(f, "topic")
    ops = front.operations
    rows, total, cursor = ops.pending_rows(
        opt_str(f, "group"), canonical_topic(topic) if topic else None,
        opt_int(f, "min_age_ms", 0), opt_int(f, "limit", 1000, 1, 10_000_000), ops.next_check_at,
        opt_int(f, "after_half_offset", -1, -1),
    )
    return {"transactions": rows, "total": total, "cursor": cursor}


def tx_offsets(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    return front.operations.tx_offsets()


def tx_history(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    import asyncio

    refs = [k for k in ("tx_id", "half_offset", "commit_log_offset") if f.get(k) is not None]
    if len(refs) != 1:
        raise _bad("give one of tx_id, half_offset, commit_log_offset")
    h = front.operations.history(opt_str(f, "tx_id"), opt_int(f, "half_offset", None), opt_int(f, "commit_log_offset", None),
                                 opt_int(f, "max_scan", Operations.HISTORY_SCAN, 1, 10_000_000), opt_bool(f, "summary"))

    async def run() -> dict:
        if h is not None:
            for _ in h.steps():
                await asyncio.sleep(0)  # other requests are served between batches of the bounded scan
        if h is None or h.doc is None:
            what = f"{refs[0]} {f[refs[0]]}"
            raise TxmqError(f"no transaction at {what} (never stored, not a transactional record, or deleted by retention)",
                            ErrorCode.TX_NOT_FOUND)
        return h.doc

    return run()


def tx_resolve(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    action = req_str(f, "action")
    if action not in ("commit", "rollback"):
        raise _bad("field 'action' must be commit or rollback")
    refs = refs_of(f, ("tx_id", "half_offset", "commit_log_offset"))

    async def run() -> dict:
        return {"results": await front.operations.resolve(action, refs, opt_bool(f, "dry_run"))}

    return run()


def tx_resolve_where(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    action = req_str(f, "action")
    if action not in ("commit", "rollback"):
        raise _bad("field 'action' must be commit or rollback")
    group = req_str(f, "group")
    topic = opt_str(f, "topic")
    args = (group, canonical_topic(topic) if topic else None, opt_int(f, "min_age_ms", 0),
            opt_int(f, "after_half_offset", -1, -1), opt_int(f, "limit", 500, 1, 1000), opt_bool(f, "dry_run"))

    async def run() -> dict:
        results, cursor = await front.operations.resolve_where(action, *args)
        return {"results": results, "cursor": cursor}

    return run()


def tx_check_now(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    return front.operations.check_now(req_str(f, "tx_id"))


def discard_list(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    limit = opt_int(f, "limit", 1000, 1, 10_000_000)
    rows = front.operations.discarded(limit + 1, opt_int(f, "after_discard_offset", -1, -1))
    return {"discarded": rows[:limit], "cursor": rows[limit - 1]["discard_offset"] if len(rows) > limit else None}


def discard_replay(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    to = req_str(f, "to")
    if to not in ("half", "commit"):
        raise _bad("field 'to' must be half or commit")
    all_ = opt_bool(f, "all")
    refs = None if all_ else refs_of(f, ("tx_id", "discard_offset"))

    async def run() -> dict:
        return {"results": await front.operations.replay(to, refs, all_, opt_bool(f, "dry_run"))}

    return run()


def config_get(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    ops = front.operations
    return {**ops.check_settings.to_dict(), "outcomes_known_since": ops.outcomes_known_since()}


def config_set(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    key = req_str(f, "key")
    value = f.get("value")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TxmqError("field 'value' must be a number", ErrorCode.INVALID_CONFIG)
    if opt_bool(f, "dry_run"):  # additive: what the change would discard or delete, nothing applied
        ops = front.operations  # the counts come from the index: after it is built
        return ops.after_index(lambda: _setting(ops.preview_setting, key, value))
    old, new = _setting(front.operations.set_setting, key, value)
    return {"key": key, "old": old, "new": new}


def _setting(fn: Callable[[str, Any], Any], key: str, value: Any) -> Any:
    try:
        return fn(key, value)
    except KeyError:
        raise TxmqError(f"unknown setting {key!r}: one of check_interval_s, transaction_timeout_s, max_checks, retention_s", ErrorCode.INVALID_CONFIG) from None
    except ValueError as e:
        raise TxmqError(str(e), ErrorCode.INVALID_CONFIG) from None


def stats(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    return front.operations.stats()


# ---- scheduled messages ------------------------------------------------------
def cancel_scheduled(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    topic = opt_str(f, "topic")
    return front.operations.cancel_scheduled(req_str(f, "msg_id"), canonical_topic(topic) if topic else None)


def list_scheduled(front: Front, conn: BrokerConnection, f: dict) -> Reply:
    topic = opt_str(f, "topic")
    after = f.get("after")
    if after is not None and not (isinstance(after, list) and len(after) == 2 and all(type(x) is int for x in after)):
        raise _bad("field 'after' must be [deliver_at_ms, commit_log_offset], as a listing's 'cursor' gives it")
    bodies = opt_bool(f, "bodies")
    return front.operations.list_scheduled(canonical_topic(topic) if topic else None, tuple(after) if after else None,
                                           opt_int(f, "limit", 100 if bodies else 1000, 1, 1000 if bodies else 100_000), bodies)


def _needs_index(handler: Handler) -> Handler:
    def gated(front: Front, conn: BrokerConnection, f: dict) -> Reply:
        return front.operations.after_index(lambda: handler(front, conn, f))

    gated.__name__ = handler.__name__
    return gated


HANDLERS.update({
    "hello": hello,
    "heartbeat": heartbeat,
    "broker_info": broker_info,
    "send": send,
    "send_batch": send_batch,
    "end_transaction": end_transaction,  # the messaging service waits at the index gate
    "pull": pull,
    "queue_offsets": queue_offsets,
    "commit_offset": commit_offset,
    "fetch_offsets": fetch_offsets,
    "create_topic": create_topic,
    "update_topic": _needs_index(update_topic),
    "delete_topic": _needs_index(delete_topic),
    "describe_topic": _needs_index(describe_topic),
    "list_topics": list_topics,
    "tx_pending": _needs_index(tx_pending),
    "tx_offsets": _needs_index(tx_offsets),
    "tx_resolve": _needs_index(tx_resolve),
    "tx_resolve_where": _needs_index(tx_resolve_where),
    "tx_check_now": _needs_index(tx_check_now),
    "tx_history": _needs_index(tx_history),
    "discard_list": _needs_index(discard_list),
    "discard_replay": _needs_index(discard_replay),
    "config_get": config_get,
    "config_set": config_set,
    "stats": _needs_index(stats),
    "cancel_scheduled": cancel_scheduled,
    "list_scheduled": list_scheduled,
})
