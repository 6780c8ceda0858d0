"""What a migration will do: read from txmq (native protocol) and from the target (its name server and broker),
and put together as one plan, which `txmq migrate --dry-run` prints and every run starts with.

Per queue of every user topic, the copy range is ``[start, end)``: ``end`` the queue's end when the plan was
made, ``start`` the lowest position of the consumer groups that committed offsets in the topic (a queue a group
never committed in counts from its first retained message, where its consumers would start). Messages below
``start`` were consumed by every group: not copied. A topic no group consumes is copied whole (its retained
messages), so that nothing is lost for a group that has not started yet.

A group's retry topic ``%RETRY%<group>`` is moved like any topic, with the group's position in it (a queue it never
committed in: from its first retained message, all of it waiting for redelivery), so that the group's consumers on
the target receive each pending retry once; its scheduled retries (due later) are scheduled messages like any. A
dead-letter topic ``%DLQ%<group>`` is copied whole, without offsets (no group consumes it), unless ``dead_letters``
is off.
"""

from __future__ import annotations

import time
from typing import Any

from ..connection import Client
from ..rocketmq4 import RocketMQ4, TargetUnreachable, delay_levels

RETRY_PREFIX = "%RETRY%"  # broker/messaging/naming.py: a group's retry topic
DLQ_PREFIX = "%DLQ%"  # and its dead-letter topic
PAGE = 1000


def kind_of(topic: str) -> str:
    """``retry`` (a group's retry topic), ``dlq`` (its dead-letter topic) or ``topic``."""
    if topic.startswith(RETRY_PREFIX):
        return "retry"
    if topic.startswith(DLQ_PREFIX):
        return "dlq"
    return "topic"


async def read_source(client: Client) -> dict[str, Any]:
    """Everything the plan needs from txmq, read once."""
    info = await client.request("broker_info", {})
    rows = (await client.request("list_topics", {}))["topics"]
    topics = {r["topic"]: r for r in rows if not r.get("system")}
    queues: dict[str, list[dict[str, Any]]] = {}
    if topics:
        offs = await client.request("queue_offsets", {"topics": sorted(topics)})
        queues = {t["topic"]: t["queues"] for t in offs["topics"]}
    groups = []
    for g in (await client.request("list_groups", {}))["groups"]:
        try:
            groups.append(await client.request("describe_group", {"group": g["group"]}))
        except Exception as exc:  # a group that vanished between the two requests
            if getattr(exc, "code", None) == 41:
                continue
            raise
    scheduled = await _all_pages(client, "list_scheduled", "after", "messages")
    pending = await read_pending(client)
    return {"info": info, "topics": topics, "queues": queues, "groups": groups, "scheduled": scheduled, "pending": pending}


async def read_pending(client: Client) -> list[dict[str, Any]]:
    return await _all_pages(client, "tx_pending", "after_half_offset", "transactions")


async def _all_pages(client: Client, op: str, after_field: str, rows_field: str) -> list[dict[str, Any]]:
    """Every row of a paged native listing: PAGE at a time, each request after the last page's cursor."""
    out: list[dict[str, Any]] = []
    fields: dict[str, Any] = {"limit": PAGE}
    while True:
        page = await client.request(op, fields)
        out += page[rows_field]
        cursor = page.get("cursor")
        if cursor is None:
            return out
        fields = {"limit": PAGE, after_field: cursor}


async def read_target(target: RocketMQ4, topics: list[str], broker_name: str | None) -> dict[str, Any]:
    """The target's brokers, the routes of the topics, and the settings of the broker topics are created on."""
    brokers = await target.cluster()
    masters = {n: b for n, b in brokers.items() if b.master}
    if broker_name is not None and broker_name not in masters:
        raise ValueError(f"the target has no broker {broker_name!r} with a master (brokers: {', '.join(masters) or 'none'})")
    chosen = broker_name or (sorted(masters)[0] if masters else None)
    routes = {}
    for t in topics:
        routes[t] = await target.route(t)
    config: dict[str, str] = {}
    if chosen is not None:
        config = await target.broker_config(masters[chosen].master or "")
    ends: dict[tuple[str, int], int] = {}
    for t, r in routes.items():
        if r is None:
            continue
        name = chosen if chosen in r.queues else next(iter(sorted(r.queues)), None)
        b = r.brokers.get(name or "") or masters.get(name or "")
        if b is None or not b.master:
            continue
        for q in range(r.queues.get(name or "", 0)):
            try:
                ends[(t, q)] = await target.max_offset(b.master, t, q)
            except TargetUnreachable:
                raise
            except Exception:
                ends[(t, q)] = 0
    return {"brokers": brokers, "chosen": chosen, "routes": routes, "config": config, "ends": ends}


def choose_level(levels_s: list[float], remaining_ms: int) -> tuple[int | None, int]:
    """The smallest delay level (1-based) whose delay is not shorter than ``remaining_ms``, and how late that is
    (ms); 0 for a message already due; None when it is past the longest level."""
    if remaining_ms <= 0:
        return 0, 0
    for i, s in enumerate(levels_s):
        if s * 1000 >= remaining_ms:
            return i + 1, int(s * 1000 - remaining_ms)
    return None, 0


def build(src: dict[str, Any], tgt: dict[str, Any], namesrv: str, source_address: str, follow: bool,
          now_ms: int | None = None, dead_letters: bool = True) -> dict[str, Any]:
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    problems: list[str] = []
    not_moved: list[dict[str, Any]] = []
    chosen = tgt["chosen"]
    brokers = tgt["brokers"]
    if chosen is None:
        problems.append("the target's name server knows no broker with a master: nothing can be written")
    # every group's position per queue, from its committed offsets
    positions: dict[tuple[str, int], dict[str, int]] = {}
    by_group: dict[str, dict[str, Any]] = {}

    def place(group: str, t: str, q: int, p: int, hi: int) -> None:
        positions.setdefault((t, q), {})[group] = p
        entry = by_group[group]["topics"].setdefault(t, {"backlog": 0, "queues": {}})
        entry["queues"][str(q)] = p
        entry["backlog"] += hi - p

    for g in src["groups"]:
        by_group[g["group"]] = {"group": g["group"], "consumers": g.get("consumers", 0), "fifo": bool(g.get("fifo")), "topics": {}}
        for row in g.get("queues") or []:
            t = row["topic"]
            if kind_of(t) == "dlq" or t not in src["topics"]:  # dead letters: no group's position counts, all of them move
                continue
            p = row["committed"]
            p = row["min_offset"] if p is None else min(max(p, row["min_offset"]), row["max_offset"])
            place(g["group"], t, row["queue_id"], p, row["max_offset"])
        if g.get("consumers"):
            problems.append(f"group {g['group']} has {g['consumers']} live consumer(s) on txmq: stop them first, or they consume "
                            "messages the migration also moves (--force to go on anyway)")
    # a retry topic's group waits for every retry it has not consumed: in a queue it never committed in, from the first
    # retained one (where a RocketMQ consumer starts a retry topic), so that its offset on the target is set there too
    for t in sorted(src["topics"]):
        if kind_of(t) != "retry":
            continue
        owner = t[len(RETRY_PREFIX):]
        for qrow in src["queues"].get(t, []):
            if owner not in positions.get((t, qrow["queue_id"]), {}):
                by_group.setdefault(owner, {"group": owner, "consumers": 0, "fifo": False, "topics": {}})
                place(owner, t, qrow["queue_id"], qrow["min_offset"], qrow["max_offset"])
    groups_out = [{**g, "backlog": sum(v["backlog"] for v in g["topics"].values())} for g in by_group.values()]
    topics_out = []
    queues_out = []
    for name, t in sorted(src["topics"].items()):
        kind = kind_of(name)
        if kind == "dlq" and not dead_letters:
            not_moved.append({"what": f"topic {name}", "why": "a consumer group's dead-letter topic (--no-dead-letters)",
                              "messages": t.get("messages", 0)})
            continue
        route = tgt["routes"].get(name)
        n = t["queues"]
        tq = None
        action = "create"
        broker = chosen
        if route is not None:
            broker = chosen if chosen in route.queues else next(iter(sorted(route.queues)), chosen)
            tq = route.queues.get(broker or "", 0)
            action = "exists" if tq >= n else "too_few_queues"
            if tq < n:
                problems.append(f"topic {name} exists on the target with {tq} queue(s) on broker {broker}, fewer than its {n} on txmq: "
                                f"give it {n} (mqadmin updateTopic -t {name} -r {n} -w {n}) and run again")
        addr = brokers[broker].master if broker in brokers else None
        grouped = any((name, q) in positions for q in range(n))
        backlog = 0
        for qrow in src["queues"].get(name, []):
            q = qrow["queue_id"]
            lo, hi = qrow["min_offset"], qrow["max_offset"]
            pos = positions.get((name, q), {})
            start = min(pos.values()) if pos else (hi if grouped else lo)
            if not grouped:
                start = lo
            start = max(start, lo)
            queues_out.append({"topic": name, "queue_id": q, "min": lo, "max": hi, "start": start, "end": hi, "positions": pos,
                               "target_base": tgt["ends"].get((name, q), 0)})
            backlog += hi - start
            if tgt["ends"].get((name, q), 0) > 0:
                problems_note = (f"topic {name} queue {q} already holds {tgt['ends'][(name, q)]} message(s) on the target: consumers of "
                                 "the migrated groups start at the migration's first message there")
                not_moved.append({"what": f"{name} queue {q} on the target", "why": problems_note})
        topics_out.append({"topic": name, "kind": kind, "queues": n, "message_types": t.get("message_types"), "messages": t.get("messages", 0),
                           "target_queues": tq, "action": action, "broker": broker, "address": addr, "backlog": backlog,
                           "consumed_by": sorted({g for (tt, _q), pos in positions.items() if tt == name for g in pos})})
        if not grouped and backlog and kind == "topic":
            not_moved.append({"what": f"topic {name}", "why": "no consumer group has committed offsets in it: every retained message "
                              "is copied, and no offsets are committed"})
    levels = delay_levels(tgt["config"])
    scheduled_out = []
    moved_topics = {t["topic"] for t in topics_out}
    for m in src["scheduled"]:
        if kind_of(m["topic"]) == "dlq" and m["topic"] not in moved_topics:
            continue
        level, late = choose_level(levels, m["deliver_at_ms"] - now_ms)
        row = {"msg_id": m["msg_id"], "topic": m["topic"], "kind": kind_of(m["topic"]), "queue_id": m["queue_id"],
               "deliver_at_ms": m["deliver_at_ms"],
               "commit_log_offset": m["commit_log_offset"], "level": level, "late_ms": late}
        scheduled_out.append(row)
        if level is None and not follow:
            problems.append(f"scheduled message {m['msg_id']} ({m['topic']}) is due in {(m['deliver_at_ms'] - now_ms) / 1000:.0f} s, "
                            f"past the target's longest delay level ({levels[-1] if levels else 0:g} s): move it with --follow")
    pending_out = [{"tx_id": p["tx_id"], "group": p["group"], "topic": p["topic"], "queue_id": p.get("queue_id"), "age_s": p.get("age_s"),
                    "half_offset": p.get("half_offset")} for p in src["pending"]]
    info = src["info"]
    return {
        "source": {"address": source_address, "broker_id": info.get("broker_id"), "version": info.get("version"),
                   "data_dir": info.get("data_dir")},
        "target": {"namesrv": namesrv, "broker": chosen, "address": brokers[chosen].master if chosen in brokers else None,
                   "brokers": [{"name": b.name, "cluster": b.cluster, "addresses": {str(k): v for k, v in b.addresses.items()}}
                               for b in brokers.values()],
                   "delay_levels_s": levels, "auto_create_topics": tgt["config"].get("autoCreateTopicEnable"),
                   "max_message_size": int(tgt["config"].get("maxMessageSize") or 4 << 20)},
        "made_at_ms": now_ms,
        "follow": follow,
        "dead_letters": dead_letters,
        "topics": topics_out,
        "queues": queues_out,
        "groups": groups_out,
        "scheduled": scheduled_out,
        "pending": pending_out,
        "not_moved": not_moved,
        "problems": problems,
        "totals": {"topics": len(topics_out), "queues": len(queues_out), "backlog": sum(t["backlog"] for t in topics_out),
                   "groups": len(groups_out), "scheduled": len(scheduled_out), "pending": len(pending_out),
                   # what a consumer failed: retries waiting in retry topics and scheduled; dead letters copied
                   "retries": sum(t["backlog"] for t in topics_out if t["kind"] == "retry"),
                   "scheduled_retries": sum(1 for m in scheduled_out if m["kind"] == "retry"),
                   "dead_letters": sum(t["backlog"] for t in topics_out if t["kind"] == "dlq")},
    }
