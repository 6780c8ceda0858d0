"""The moves of a migration: topics, the backlog (batch sends, per queue in order), consumer offsets, scheduled
messages, and with ``follow`` what arrives on txmq afterwards.

Exactly once per group: each queue's copy range ``[start, end)`` (plan.py) is copied once, in order, whatever the
groups' positions in it; each group's offset on the target is then committed at the copy of its own first
unconsumed message (`state.target_offset`), so that it skips, by its offset, the copies of what it had consumed.
A batch's range is written to the state file as in flight before it is sent and as confirmed (with the target
offset the broker stored it at) after; a resumed run sends an in-flight batch again and counts its messages as
possible duplicates, and never sends a confirmed one again.

Retry and dead-letter topics (``%RETRY%<group>``, ``%DLQ%<group>``) are sent one message at a time: a message's
reconsume count (``RECONSUME_TIME``, the deliveries it had) goes in the send's ``reconsumeTimes`` header, which the
target stores as the message's own (a 4.x consumer's ``getReconsumeTimes()``), as a Java producer sends to a retry
topic; a batch carries one count for all its messages.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from txmq.constants import PROP_UNIQ_KEY

from ..connection import Client
from ..rocketmq4 import RemotingError, RocketMQ4, TargetUnreachable
from .plan import DLQ_PREFIX, RETRY_PREFIX
from .state import State, qkey, target_offset

BATCH_COUNT = 512
BATCH_BYTES = 1 << 20
PULL_BYTES = 4 << 20
MAX_QUEUES_PER_ROUND = 64
RETRIABLE_CODES = (2, 14)  # SYSTEM_BUSY, SERVICE_NOT_AVAILABLE
PROP_SCHEDULED_FROM = "TXMQ_SCHEDULED_FROM"
PROP_FLAG = "TXMQ_RMQ_FLAG"
PROP_RECONSUME_TIME = "RECONSUME_TIME"  # broker/messaging/naming.py: the deliveries before this one
PROP_MAX_RECONSUME_TIMES = "MAX_RECONSUME_TIMES"
DEFAULT_MAX_RECONSUME_TIMES = 16  # RocketMQ's
KEPT_IN_DEAD_LETTERS = "TXMQ_DLQ_"  # why txmq gave a message up (reason, attempts, origin queue): kept for who inspects it
# Not carried to the target: what txmq's broker adds, what RocketMQ's broker adds again, and what would make the
# target treat a copy as a half message or delay it again.
DROP = {"MIN_OFFSET", "MAX_OFFSET", "CLUSTER", "WAIT", "TRAN_MSG", "REAL_TOPIC", "REAL_QID", "DELAY", "TIMER_DELAY_SEC",
        "TIMER_DELAY_MS", "TIMER_DELIVER_MS", "TIMER_OUT_MS"}


class MigrationError(Exception):
    """The migration cannot go on (the target refused something for good, or stayed away past the retry time)."""


def for_target(props: dict[str, str], dead_letter: bool = False) -> tuple[dict[str, str], int]:
    """A txmq message's properties as they are sent to the target, and its RocketMQ flag."""
    flag = 0
    out = {}
    for k, v in props.items():
        if k == PROP_FLAG:
            try:
                flag = int(v)
            except ValueError:
                flag = 0
        elif k not in DROP and (not k.startswith("TXMQ_") or (dead_letter and k.startswith(KEPT_IN_DEAD_LETTERS))):
            out[k] = v
    return out, flag


def one_by_one(topic: str) -> bool:
    """A retry or dead-letter topic: each message is sent with its own reconsume count."""
    return topic.startswith((RETRY_PREFIX, DLQ_PREFIX))


def reconsume_header(topic: str, props: dict[str, str]) -> tuple[int, int | None]:
    """Takes ``RECONSUME_TIME`` and ``MAX_RECONSUME_TIMES`` out of the properties (as a Java producer does for a retry
    topic): the send's ``reconsumeTimes``, and for a retry topic its ``maxReconsumeTimes``, at least one more than the
    count so that the target stores the retry there and does not move it to the dead-letter topic (the consumer's own
    limit decides that at its next failure, as on txmq)."""
    def number(name: str) -> int | None:
        v = props.pop(name, None)
        try:
            return max(0, int(v)) if v is not None else None
        except ValueError:
            return None

    times = number(PROP_RECONSUME_TIME) or 0
    limit = number(PROP_MAX_RECONSUME_TIMES)
    if not topic.startswith(RETRY_PREFIX):
        return times, None
    return times, max(DEFAULT_MAX_RECONSUME_TIMES if limit is None else limit, times + 1)


class PartialSend(Exception):
    """Messages sent one at a time: the first ``len(offsets)`` were stored (at those target offsets), then ``cause``;
    ``maybe_stored``, the source range of the one whose answer was lost (it may be stored), or None."""

    def __init__(self, offsets: list[int], cause: BaseException, maybe_stored: tuple[int, int] | None) -> None:
        super().__init__(str(cause))
        self.offsets, self.cause, self.maybe_stored = offsets, cause, maybe_stored


@dataclass
class Counters:
    moved: dict[str, int] = field(default_factory=dict)  # per topic, messages confirmed by the target in this run
    moved_bytes: dict[str, int] = field(default_factory=dict)
    forwarded: int = 0  # with follow: past the plan's end
    scheduled_moved: int = 0
    retention_skipped: int = 0
    duplicates_possible: int = 0  # in this run
    retries: int = 0


class Mover:
    def __init__(self, source: Client, target: RocketMQ4, state: State, *, batch_count: int = BATCH_COUNT,
                 batch_bytes: int = BATCH_BYTES, on_event: Callable[[dict[str, Any]], None] | None = None,
                 retry_for: float = 60.0, stop: asyncio.Event | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.source, self.target, self.state = source, target, state
        self.plan = state.data["plan"]
        self.batch_count = batch_count
        self.batch_bytes = min(batch_bytes, max(64 << 10, self.plan["target"]["max_message_size"] // 2))
        self.on_event = on_event or (lambda e: None)
        self.retry_for = retry_for
        self.clock = clock
        self.stop = stop or asyncio.Event()
        self.c = Counters()
        self.topics = {t["topic"]: t for t in self.plan["topics"]}
        self.queues = {qkey(q["topic"], q["queue_id"]): q for q in self.plan["queues"]}
        self.buffers: dict[str, list[dict[str, Any]]] = {}
        self.fetch_next: dict[str, int] = {}
        self.maybe_stored: dict[str, tuple[int, int]] = {}  # sent, then the connection failed: a resend may duplicate
        self.scheduled_plan = {m["commit_log_offset"]: m for m in self.plan["scheduled"]}
        self._failing_since: float | None = None  # since when the target has been failing, while it is
        for k, qs in state.data["queues"].items():
            if qs.get("inflight"):
                self.maybe_stored[k] = tuple(qs["inflight"])  # in flight when the last run stopped

    def emit(self, event: str, **fields: Any) -> None:
        self.on_event({"event": event, "ts_ms": int(time.time() * 1000), **fields})

    # ---- topics ------------------------------------------------------------------------------
    async def create_topics(self) -> None:
        for t in self.plan["topics"]:
            if t["action"] != "create":
                continue
            if t["address"] is None:
                raise MigrationError(f"no broker to create topic {t['topic']} on")
            await self._with_retries(lambda t=t: self.target.create_topic(t["address"], t["topic"], t["queues"]), f"creating {t['topic']}")
            t["action"] = "created"
            self.emit("topic_created", topic=t["topic"], queues=t["queues"], broker=t["broker"])
        self.state.save()

    # ---- the backlog, and forwarding -----------------------------------------------------------
    async def copy(self, follow: bool = False) -> bool:
        """Copy every queue up to its end (the plan's; with ``follow``, up to what txmq holds now). True if anything was sent."""
        ends = {k: q["end"] for k, q in self.queues.items()}
        if follow:
            ends = await self._current_ends()
        sent_any = False
        last_event = 0.0
        while not self.stop.is_set():
            active = [k for k, qs in self.state.data["queues"].items() if qs["next"] < ends.get(k, 0)]
            if not active:
                break
            active = active[:MAX_QUEUES_PER_ROUND]
            await asyncio.gather(*(self._fill(k, ends[k]) for k in active))
            batches = {}
            for k in active:
                b = self._take(k, ends[k])
                if b is not None:
                    batches[k] = b
                    self.state.data["queues"][k]["inflight"] = [b[0], b[1]]
            if not batches:
                break
            self.state.save()
            # reading ahead from txmq while the sends are out: its failure (txmq gone) is raised only once the sends'
            # answers are recorded, so that a batch the target confirmed is never left in flight (sent again, counted)
            prefetch = asyncio.gather(*(self._fill(k, ends[k], ahead=True) for k in batches), return_exceptions=True)
            try:
                results = await asyncio.gather(*(self._send(k, b) for k, b in batches.items()), return_exceptions=True)
                fetched = await prefetch
            except asyncio.CancelledError:  # Ctrl-C: what was confirmed before is written; this round stays in flight
                prefetch.cancel()
                self.state.save()
                raise
            source_failure = next((r for r in fetched if isinstance(r, BaseException)), None)
            failure = None
            for (k, b), r in zip(batches.items(), results):
                if isinstance(r, PartialSend):  # one at a time: those stored are confirmed, the rest sent again next round
                    done = b[2][:len(r.offsets)]
                    if done:
                        self._confirm(k, (b[0], done[-1]["queue_offset"] + 1, done), r.offsets, follow)
                        sent_any = True
                    self.buffers[k] = b[2][len(done):] + self.buffers.get(k, [])
                    if r.maybe_stored is not None:  # with what was in doubt before (a resumed run's batch in flight)
                        old = self.maybe_stored.get(k)
                        self.maybe_stored[k] = r.maybe_stored if old is None else (min(old[0], r.maybe_stored[0]),
                                                                                   max(old[1], r.maybe_stored[1]))
                    if k in self.maybe_stored and (done or r.maybe_stored is not None):
                        self.state.data["queues"][k]["inflight"] = list(self.maybe_stored[k])  # what a resumed run counts
                    failure = failure or r.cause
                    continue
                if isinstance(r, BaseException):
                    failure = failure or r
                    self.buffers[k] = b[2] + self.buffers.get(k, [])  # sent again next round
                    continue
                self._confirm(k, b, r, follow)
                sent_any = True
            # the confirmations are written with the next round's in-flight marks (one fsync a round), or below
            if source_failure is not None:
                self.state.save()
                raise source_failure
            if failure is not None:
                self.state.save()
                await self._after_failure(failure)
            else:
                self._failing_since = None  # the target answered: a later outage gets the whole retry time again
            now = time.monotonic()
            if now - last_event >= 1.0:
                last_event = now
                self.emit("progress", moved=dict(self.c.moved), moved_bytes=dict(self.c.moved_bytes),
                          duplicates_possible=self.state.data["duplicates_possible"])
        if sent_any:
            self.state.save()
        return sent_any

    async def _current_ends(self) -> dict[str, int]:
        topics = sorted({q["topic"] for q in self.queues.values()})
        if not topics:
            return {}
        offs = await self.source.request("queue_offsets", {"topics": topics})
        return {qkey(t["topic"], q["queue_id"]): q["max_offset"] for t in offs["topics"] for q in t["queues"]
                if qkey(t["topic"], q["queue_id"]) in self.queues}

    async def _fill(self, k: str, end: int, ahead: bool = False) -> None:
        """Pull from txmq into the queue's buffer until it holds a batch (two with ``ahead``) or reaches ``end``."""
        q = self.queues[k]
        qs = self.state.data["queues"][k]
        buf = self.buffers.setdefault(k, [])
        nxt = self.fetch_next.get(k, qs["next"])
        if buf:
            nxt = max(nxt, buf[-1]["queue_offset"] + 1)
        want = self.batch_count * (2 if ahead else 1)
        while len(buf) < want and nxt < end:
            r = await self.source.request("pull", {"topic": q["topic"], "queue_id": q["queue_id"], "offset": nxt,
                                                   "max_count": min(self.batch_count, end - nxt), "max_bytes": PULL_BYTES})
            status = r["status"]
            if status == "offset_too_small":  # retention deleted them since the plan
                skipped = r["min_offset"] - nxt
                self.c.retention_skipped += max(0, skipped)
                nxt = r["min_offset"]
                continue
            msgs = [m for m in r.get("messages", []) if m["queue_offset"] < end]
            if status != "found" or not msgs:
                if r.get("next_offset", nxt) > nxt:
                    nxt = r["next_offset"]
                    continue
                break
            buf.extend(msgs)
            nxt = msgs[-1]["queue_offset"] + 1
        self.fetch_next[k] = nxt

    def _take(self, k: str, end: int) -> tuple[int, int, list[dict[str, Any]]] | None:
        qs = self.state.data["queues"][k]
        buf = self.buffers.get(k) or []
        # drop what was confirmed already (a resumed queue's buffer starts at its next)
        while buf and buf[0]["queue_offset"] < qs["next"]:
            buf.pop(0)
        if not buf:
            nxt = self.fetch_next.get(k, qs["next"])
            if nxt > qs["next"]:  # nothing left to read below nxt (retention): move on
                qs["next"] = min(nxt, end)
            return None
        out, size = [], 0
        while buf and len(out) < self.batch_count:
            m = buf[0]
            if m["queue_offset"] >= end:
                break
            n = len(m["body"]) + 200
            if out and size + n > self.batch_bytes:
                break
            out.append(buf.pop(0))
            size += n
        if not out:
            return None
        return qs["next"], out[-1]["queue_offset"] + 1, out

    async def _send(self, k: str, b: tuple[int, int, list[dict[str, Any]]]) -> list[int]:
        """The batch sent; the target offset of each of its messages."""
        q = self.queues[k]
        t = self.topics[q["topic"]]
        dead = q["topic"].startswith(DLQ_PREFIX)
        msgs = []
        for m in b[2]:
            props, flag = for_target(m.get("properties") or {}, dead)
            if m.get("msg_id"):  # sent without a client id (txmq's native producers): the id they were given, kept
                props.setdefault(PROP_UNIQ_KEY, m["msg_id"])
            msgs.append((m["body"], props, flag))
        if one_by_one(q["topic"]):
            return await self._send_each(t["address"], q["topic"], q["queue_id"], b[2], msgs)
        try:
            receipt = await self.target.send_batch(t["address"], q["topic"], q["queue_id"], msgs)
        except TargetUnreachable as exc:
            if exc.sent:  # it may have been stored: sending it again may duplicate it
                self.maybe_stored[k] = (b[0], b[1])
            raise
        return [receipt.queue_offset + i for i in range(len(msgs))]

    async def _send_each(self, address: str, topic: str, queue_id: int, source: list[dict[str, Any]],
                         msgs: list[tuple[bytes, dict[str, str], int]]) -> list[int]:
        """One send per message, in order, each with its reconsume count; PartialSend when one fails."""
        offsets: list[int] = []
        for m, (body, props, flag) in zip(source, msgs):
            times, limit = reconsume_header(topic, props)
            try:
                r = await self.target.send(address, topic, queue_id, body, props, flag, reconsume_times=times, max_reconsume_times=limit)
            except Exception as exc:
                sent = isinstance(exc, TargetUnreachable) and exc.sent
                raise PartialSend(offsets, exc, (m["queue_offset"], m["queue_offset"] + 1) if sent else None) from None
            offsets.append(r.queue_offset)
        return offsets

    def _confirm(self, k: str, b: tuple[int, int, list[dict[str, Any]]], offsets: list[int], follow: bool) -> None:
        """The target stored the batch's messages at ``offsets``."""
        qs = self.state.data["queues"][k]
        q = self.queues[k]
        src_start, src_end, msgs = b
        dup = self.maybe_stored.pop(k, None)
        if dup is not None:
            n = sum(1 for m in msgs if dup[0] <= m["queue_offset"] < dup[1])
            self.c.duplicates_possible += n
            self.state.data["duplicates_possible"] += n
            if dup[1] > src_end:  # the rest of the range in doubt is still to be sent (a batch sent one at a time, in part)
                self.maybe_stored[k] = (max(dup[0], src_end), dup[1])
        for m, off in zip(msgs, offsets):
            State.add_run(qs, m["queue_offset"], m["queue_offset"] + 1, off)
            origin = (m.get("properties") or {}).get(PROP_SCHEDULED_FROM)
            if origin is not None and origin.isdigit() and int(origin) in self.scheduled_plan:
                self.state.data["scheduled"]["moved"][origin] = {"how": "backlog", "msg_id": m["msg_id"]}
        qs["skipped"] += (src_end - src_start) - len(msgs)
        qs["next"] = src_end
        qs["inflight"] = None
        self.c.moved[q["topic"]] = self.c.moved.get(q["topic"], 0) + len(msgs)
        self.c.moved_bytes[q["topic"]] = self.c.moved_bytes.get(q["topic"], 0) + sum(len(m["body"]) for m in msgs)
        if follow and src_end > q["end"]:
            self.c.forwarded += sum(1 for m in msgs if m["queue_offset"] >= q["end"])

    async def _after_failure(self, exc: BaseException) -> None:
        if isinstance(exc, TargetUnreachable) or (isinstance(exc, RemotingError) and exc.code in RETRIABLE_CODES):
            if self._failing_since is None:
                self._failing_since = self.clock()
            started = self._failing_since
            if self.clock() - started > self.retry_for:
                raise MigrationError(f"the target stayed unavailable for {self.retry_for:g} s: {exc}") from None
            self.c.retries += 1
            self.emit("retrying", reason=str(exc), may_duplicate=sum(e - s for s, e in self.maybe_stored.values()))
            try:
                await asyncio.wait_for(self.stop.wait(), min(2.0, 0.1 * 2 ** min(self.c.retries, 5)))
            except asyncio.TimeoutError:
                pass
            return
        if isinstance(exc, RemotingError):
            raise MigrationError(str(exc)) from None
        raise exc

    async def _with_retries(self, fn: Callable[[], Any], what: str) -> Any:
        started = time.monotonic()
        while True:
            try:
                return await fn()
            except RemotingError as exc:
                if not (isinstance(exc, TargetUnreachable) or exc.code in RETRIABLE_CODES) or time.monotonic() - started > self.retry_for:
                    raise MigrationError(f"{what}: {exc}") from None
                self.c.retries += 1
                await asyncio.sleep(0.5)

    # ---- consumer offsets ----------------------------------------------------------------------
    def group_offsets(self) -> list[dict[str, Any]]:
        """Each group's offset on the target, per queue: at the copy of its first unconsumed message."""
        out = []
        for k, q in self.queues.items():
            qs = self.state.data["queues"][k]
            for g, p in sorted(q["positions"].items()):
                tgt = q["target_base"] if p <= q["start"] else target_offset(qs["runs"], p, q["target_base"])
                out.append({"group": g, "topic": q["topic"], "queue_id": q["queue_id"], "source_offset": p, "target_offset": tgt})
        return out

    async def commit_offsets(self) -> list[dict[str, Any]]:
        rows = self.group_offsets()
        for r in rows:
            addr = self.topics[r["topic"]]["address"]
            await self._with_retries(lambda r=r, addr=addr: self.target.update_offset(addr, r["group"], r["topic"], r["queue_id"],
                                                                                       r["target_offset"]), f"committing {r['group']}'s offset")
        self.state.data["offsets_committed"] = True
        self.state.data["committed"] = rows
        self.state.save()
        self.emit("offsets_committed", groups=sorted({r["group"] for r in rows}), queues=len(rows))
        return rows

    # ---- scheduled messages (without follow) -----------------------------------------------------
    async def move_scheduled(self, levels_s: list[float]) -> dict[str, Any]:
        """Each scheduled message of the plan, sent with the smallest delay level not earlier than its due time."""
        from .plan import choose_level

        sched = self.state.data["scheduled"]
        moved = sched["moved"]
        for off in sched.get("inflight") or []:
            if str(off) not in moved:
                self.maybe_stored[f"s{off}"] = (off, off + 1)
        todo = {off for off in self.scheduled_plan if str(off) not in moved}
        left: list[dict[str, Any]] = []
        seen: set[int] = set()
        after = None
        while todo - seen and not self.stop.is_set():
            fields: dict[str, Any] = {"limit": 100, "bodies": True}
            if after is not None:
                fields["after"] = after
            page = await self.source.request("list_scheduled", fields)
            group = []
            for m in page["messages"]:
                off = m["commit_log_offset"]
                if off in todo and off not in seen:
                    seen.add(off)
                    group.append(m)
            ready = []
            for m in group:
                level, late = choose_level(levels_s, m["deliver_at_ms"] - int(time.time() * 1000))
                if level is None:
                    left.append({"msg_id": m["msg_id"], "topic": m["topic"], "deliver_at_ms": m["deliver_at_ms"],
                                 "why": "past the target's longest delay level: move it with --follow"})
                    continue
                ready.append((m, level, late))
            if ready:
                sched["inflight"] = [m["commit_log_offset"] for m, _l, _late in ready]
                self.state.save()
                await asyncio.gather(*(self._send_scheduled(m, level, late) for m, level, late in ready))
                sched["inflight"] = []
                self.state.save()
            after = page.get("cursor")
            if after is None:
                break
        missing = todo - seen - {int(o) for o in moved}
        if missing and not self.stop.is_set():
            await self._delivered_meanwhile(missing)
        gone = [self.scheduled_plan[o] for o in missing if str(o) not in moved]
        return {"moved": self.c.scheduled_moved, "left": left, "gone": [{"msg_id": m["msg_id"], "topic": m["topic"]} for m in gone]}

    async def _send_scheduled(self, m: dict[str, Any], level: int, late: int) -> None:
        props, flag = for_target(m.get("properties") or {})
        props.setdefault(PROP_UNIQ_KEY, m["msg_id"])
        times, limit = reconsume_header(m["topic"], props) if one_by_one(m["topic"]) else (0, None)  # a scheduled retry
        if level:
            props["DELAY"] = str(level)
        t = self.topics.get(m["topic"])
        if t is None or t["address"] is None:
            raise MigrationError(f"scheduled message {m['msg_id']}: topic {m['topic']} is not on the target")
        key = f"s{m['commit_log_offset']}"
        try:
            await self._with_retries(lambda: self.target.send(t["address"], m["topic"], m["queue_id"], m["body"] or b"", props, flag,
                                                              reconsume_times=times, max_reconsume_times=limit),
                                     f"sending scheduled message {m['msg_id']}")
        except MigrationError:
            self.maybe_stored[key] = (0, 1)
            raise
        if self.maybe_stored.pop(key, None) is not None:
            self.c.duplicates_possible += 1
            self.state.data["duplicates_possible"] += 1
        self.state.data["scheduled"]["moved"][str(m["commit_log_offset"])] = {"how": "delay_level", "level": level, "late_ms": late,
                                                                              "msg_id": m["msg_id"]}
        self.c.scheduled_moved += 1
        self.emit("scheduled_moved", msg_id=m["msg_id"], topic=m["topic"], level=level, late_ms=late)

    async def _delivered_meanwhile(self, missing: set[int]) -> None:
        """Scheduled messages of the plan that txmq delivered since (past each queue's end): sent on as they are."""
        for q in self.queues.values():
            if not missing:
                return
            if not any(self.scheduled_plan[o]["topic"] == q["topic"] for o in missing):
                continue
            offs = await self.source.request("queue_offsets", {"topics": [q["topic"]]})
            end = next((r["max_offset"] for t in offs["topics"] for r in t["queues"] if r["queue_id"] == q["queue_id"]), q["end"])
            nxt = q["end"]
            while nxt < end and missing:
                r = await self.source.request("pull", {"topic": q["topic"], "queue_id": q["queue_id"], "offset": nxt, "max_count": 256})
                if r["status"] != "found":
                    break
                for m in r["messages"]:
                    origin = (m.get("properties") or {}).get(PROP_SCHEDULED_FROM, "")
                    if origin.isdigit() and int(origin) in missing:
                        missing.discard(int(origin))
                        await self._send_scheduled(m | {"commit_log_offset": int(origin), "topic": q["topic"], "queue_id": q["queue_id"]}, 0, 0)
                nxt = r["next_offset"]

    # ---- the summary ---------------------------------------------------------------------------
    def per_group(self) -> dict[str, dict[str, int]]:
        """Per group and topic: the copied messages it receives (at or after its position, up to the plan's end)."""
        out: dict[str, dict[str, int]] = {}
        for k, q in self.queues.items():
            runs = self.state.data["queues"][k]["runs"]
            for g, p in q["positions"].items():
                n = sum(max(0, min(e, q["end"]) - max(s, p)) for s, e, _t in runs)
                out.setdefault(g, {})[q["topic"]] = out.get(g, {}).get(q["topic"], 0) + n
        return out

    def totals(self) -> dict[str, Any]:
        copied = {}
        for k, q in self.queues.items():
            runs = self.state.data["queues"][k]["runs"]
            copied[q["topic"]] = copied.get(q["topic"], 0) + sum(e - s for s, e, _t in runs)
        return {"copied_per_topic": copied, "consumed_not_copied": sum(q["start"] - q["min"] for q in self.queues.values()),
                "duplicates_possible": self.state.data["duplicates_possible"], "moved_this_run": sum(self.c.moved.values()),
                "forwarded_this_run": self.c.forwarded, "retention_skipped": self.c.retention_skipped, "retries": self.c.retries}
