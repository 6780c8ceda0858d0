"""The consumption service: consumption with invisible durations ("POP") over txmq's consume queues and consumer groups.

Every front end that hands messages to consumer groups by invisible
durations calls this one service (the RocketMQ 5 front end's
ReceiveMessage, AckMessage, ChangeInvisibleDuration and
ForwardMessageToDeadLetterQueue); the core builds it once (``core.consumption``)
on the collaborators it reads and writes (the store's queues, the consumer
offsets, the topic table, the Appender, the long polls), never on the core.
``ConsumptionService.receive`` hands messages of a topic to the consumers of a group,
each message to one consumer at a time, for an invisible duration; ``ack``
settles one, ``change_invisible`` gives it a new duration (and a new receipt
handle), and a message whose duration runs out is received again with its
delivery attempt one higher, or, after the group's maximum attempts, is
written to the group's dead-letter topic ``%DLQ%<group>`` (docs/rocketmq.md,
"Receiving"; the group and topic names: broker/messaging/naming.py).

State, per (group, topic, queue):

- ``committed``: the lowest queue offset not yet acknowledged, kept in the
  broker's consumer offsets (``ConsumerOffsets``, offsets.json), so ``txmq
  groups describe`` shows the group; a new group starts at the queue's
  first message;
- ``next``: the first offset never handed out since the broker started;
- ``slots``: one per offset in [committed, next) still unsettled: in
  flight (its deadline, attempt and the version its receipt handle names),
  ready to be received again, or being moved to the dead-letter topic.

The window [committed, next) is bounded (``PopConfig.max_window`` per queue,
``max_slots`` over all groups): a queue whose window is full hands out no
new message until the oldest is acknowledged or given up. In-flight state
(deadlines, attempts, handles) is in memory only: after a restart the
unsettled messages from the committed offset on are delivered again
(at-least-once) with attempts counted from 1.

What is settled above the committed offset (acknowledged out of order,
dead-lettered) is not delivered again after a restart or a crash: a queue
whose settled set changed is handed to the consumer offsets as ranges
(``ConsumerOffsets.set_acked``) within half a flush interval, and a persist
of the offsets is asked for, which writes them to acks.json after the log's
fsync and offsets.json (store/offsets.py; docs/store-format.md). An
acknowledgement answered a flush interval before a crash is therefore on
disk. Acknowledging in order costs nothing more: only the committed offset
moves. After a restart a queue's state starts from the committed offset and
its ranges: the offsets between them are received again, those in them are
not.

FIFO groups (``fifo(group)``: groups.json, ``txmq groups update G --fifo``)
receive each queue in order, as RocketMQ's POP with order=true: a queue
whose last batch still has a message in flight or being dead-lettered
(``QueueState.held``) hands out nothing; otherwise a receive takes its
unsettled messages in offset order, then new ones, and that batch holds
the queue until each of it is settled or ready again. The unit is the
queue, not the message group (RocketMQ's ConsumerOrderInfoManager); an
acknowledgement that frees a queue wakes the waiting receives. A receive
that takes a queue's ready messages makes the handles of those it leaves
stale (they come again after the ones taken); a message forwarded to the
dead-letter topic holds its queue until the write ends, even from ready; a
group just marked FIFO holds each queue for what it has in flight
(``Subscription.fifo``). After a restart the unsettled messages come again
in offset order.

Costs: receiving, acknowledging or changing a message is O(log n) (one heap
push per in-flight deadline); expiries are popped from the heap lazily, so
no operation walks the in-flight set. Messages are read through the store's
consume queues, the native consumers' read path: only committed messages are
ever in a topic's queues (half messages live in the half topic until their
commit), so none is delivered before its commit.
"""

from __future__ import annotations

import asyncio
import base64
import heapq
import itertools
import logging
import os
import struct
import time
import zlib
from array import array
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..records import msg_id_of
from txmq.constants import PROP_TRAN_MSG, PROP_UNIQ_KEY, TOPIC_RE, is_system_topic
from ..scheduled.timing import RESERVED
from txmq.store import GetStatus, Message, Record, TxType

from .naming import MAX_GROUP, dlq_topic, is_group_name
from .sqlfilter import Predicate

if TYPE_CHECKING:
    from ..appender import Appender
    from ..longpoll import LongPolls
    from ..topics import TopicTable
    from txmq.store import ConsumerOffsets, Store

log = logging.getLogger("txmq.broker.rocketmq")  # the logger (and its event names) the operators' filters know
PROP_DLQ_ORIGIN_TOPIC = "DLQ_ORIGIN_TOPIC"
PROP_DLQ_ORIGIN_MESSAGE_ID = "DLQ_ORIGIN_MESSAGE_ID"
PROP_DLQ_ORIGIN_QUEUE = "TXMQ_DLQ_ORIGIN_QUEUE"  # "<queue id>:<queue offset>" of the message given up
PROP_DLQ_ATTEMPTS = "TXMQ_DLQ_ATTEMPTS"  # deliveries the message had
PROP_DLQ_REASON = "TXMQ_DLQ_REASON"  # max-attempts | consumer

# Slot states.
INFLIGHT, READY, MOVING = 1, 2, 3

_HANDLE = struct.Struct("<BIQIqH")  # format 1, epoch, version, queue id, queue offset, attempt
_HANDLE_FORMAT = 1
MAX_HANDLE_CHARS = 512


class PopError(Exception):
    """A refused request; ``code`` is the name of RocketMQ's status code (apache.rocketmq.v2.Code)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class PopConfig:
    max_window: int = 10_000  # offsets per (group, topic, queue) between the committed offset and the first never handed out
    max_slots: int = 1_000_000  # unsettled messages over all groups
    max_subscriptions: int = 10_000  # (group, topic) pairs with state in memory
    max_batch: int = 1024  # largest batch_size accepted; batches above serve_batch are served serve_batch at a time
    serve_batch: int = 256
    max_bytes: int = 8 << 20  # bodies per receive (at least one message is always served)
    scan_per_receive: int = 4096  # records read and filtered out per step before yielding to the loop
    default_max_attempts: int = 16
    min_invisible_s: float = 1.0
    max_invisible_s: float = 12 * 3600.0
    default_invisible_s: float = 60.0  # a receive that names none (auto_renew: the renewal step)
    max_renew_s: float = 3 * 3600.0  # auto_renew keeps a message invisible this long at most
    max_poll_s: float = 60.0
    dlq_retry_s: float = 5.0  # a dead-letter write that failed is tried again after this


class Slot:
    """One unsettled message: its state, deliveries so far and the version its current receipt handle names."""

    __slots__ = ("state", "attempt", "version", "deadline", "invisible_s", "renew_until", "client")

    def __init__(self) -> None:
        self.state = READY
        self.attempt = 0
        self.version = 0
        self.deadline = 0.0
        self.invisible_s = 0.0
        self.renew_until = 0.0  # auto_renew: renewed while the client lives, until then
        self.client: str | None = None


class QueueState:
    __slots__ = ("qid", "committed", "next", "stored", "slots", "ready", "dirty", "held")

    def __init__(self, qid: int, start: int) -> None:
        self.qid = qid
        self.committed = start  # lowest offset not acknowledged
        self.next = start  # first offset never handed out
        self.stored = start  # what was last written to the consumer offsets (an operator's reset differs)
        self.slots: dict[int, Slot] = {}
        self.ready: deque[int] = deque()  # offsets to deliver again (checked against the slot's state when taken)
        self.dirty = False  # settled above the committed offset since its ranges were last handed to the consumer offsets
        self.held: set[int] = set()  # FIFO groups: offsets handed out whose slot may still be in flight or moving (blocks the queue)


class Subscription:
    """A group's state on one topic: its queues, the heap of in-flight deadlines and the receives waiting."""

    __slots__ = ("group", "topic", "queues", "heap", "live", "waiters", "rr", "used", "fifo")

    def __init__(self, group: str, topic: str) -> None:
        self.group = group
        self.topic = topic
        self.queues: dict[int, QueueState] = {}
        self.heap: list[tuple[float, int, int, int]] = []  # (deadline, version, queue id, offset); stale entries skipped
        self.live = 0  # in-flight slots (the heap entries that are not stale)
        self.waiters: set[asyncio.Future] = set()
        self.rr = 0
        self.used = 0.0
        self.fifo = False  # received as a FIFO group last time (a change to FIFO holds the queues for what is in flight)

    def slot_count(self) -> int:
        return sum(len(q.slots) for q in self.queues.values())


@dataclass(slots=True)
class Delivery:
    """A message handed to a consumer."""

    record: Record
    receipt_handle: str
    attempt: int  # 1 on the first delivery
    invisible_s: float


@dataclass(frozen=True, slots=True)
class Handle:
    epoch: int
    version: int
    queue_id: int
    offset: int
    attempt: int
    topic: str


def encode_handle(h: Handle) -> str:
    raw = _HANDLE.pack(_HANDLE_FORMAT, h.epoch, h.version, h.queue_id, h.offset, h.attempt) + h.topic.encode()
    raw += struct.pack("<I", zlib.crc32(raw))
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def decode_handle(text: object) -> Handle | None:
    """The handle text names, or None when it is not one this broker writes (never raises)."""
    if not isinstance(text, str) or not (_HANDLE.size < len(text) <= MAX_HANDLE_CHARS):
        return None
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError):
        return None
    if len(raw) < _HANDLE.size + 5 or struct.unpack_from("<I", raw, len(raw) - 4)[0] != zlib.crc32(raw[:-4]):
        return None
    fmt, epoch, version, qid, offset, attempt = _HANDLE.unpack_from(raw)
    if fmt != _HANDLE_FORMAT:
        return None
    try:
        topic = raw[_HANDLE.size : -4].decode()
    except UnicodeDecodeError:
        return None
    return Handle(epoch, version, qid, offset, attempt, topic)


def parse_tags(expression: str | None) -> frozenset[str] | None:
    """A TAG filter: None for every message ("" or "*"), else the tags "a||b" names."""
    expr = (expression or "").strip()
    if expr in ("", "*"):
        return None
    if len(expr) > 4096:
        raise PopError("ILLEGAL_FILTER_EXPRESSION", "tag expression longer than 4096 characters")
    tags = frozenset(t.strip() for t in expr.split("||"))
    if "" in tags or "*" in tags and len(tags) > 1:
        raise PopError("ILLEGAL_FILTER_EXPRESSION", f"tag expression {expr!r} is not '*' or tags joined by '||'")
    return None if "*" in tags else tags


def check_group(group: str) -> str:
    if not is_group_name(group):
        raise PopError("ILLEGAL_CONSUMER_GROUP", f"consumer group {(group or '')[:200]!r} must be 1 to {MAX_GROUP} of the characters "
                       "%a-zA-Z0-9_- (its retry and dead-letter topics %RETRY%<group> and %DLQ%<group> are topic names)")
    return group


class ConsumptionService:
    """Receive, acknowledge, change invisible durations and dead-letter messages for consumer groups.

    Runs on the event loop (every method but the waits is synchronous, so
    two receives never take the same message). Its collaborators: the
    store (its consume queues are read), the consumer offsets (committed
    offsets and settled ranges), the topic table, the Appender (writes to
    the dead-letter topics), the long polls (woken by appends);
    ``draining()`` and ``shutting_down()``: the broker refuses new requests
    (receives answer at once) and appends; ``persist()``: a future done
    when the consumer offsets are next on disk; settled ranges are handed
    over within half of ``flush_interval_s``.

    ``max_attempts(group)`` gives a group's maximum deliveries (the
    default when it returns None); ``client_alive(client_id)`` says whether a
    client that asked for auto-renewal still lives (no renewal without it);
    the front end serving the consumers gives both (``attach``).
    """

    def __init__(self, store: Store, offsets: ConsumerOffsets, topics: TopicTable, appender: Appender, polls: LongPolls,
                 config: PopConfig | None = None, *,
                 draining: Callable[[], bool] = lambda: False,
                 shutting_down: Callable[[], bool] = lambda: False,
                 persist: Callable[[], asyncio.Future] | None = None,
                 flush_interval_s: float = 1.0,
                 now: Callable[[], float] = time.monotonic,
                 max_attempts: Callable[[str], int | None] | None = None,
                 client_alive: Callable[[str], bool] | None = None,
                 fifo: Callable[[str], bool] | None = None) -> None:
        self.store = store
        self.offsets = offsets
        self.topics = topics
        self.appender = appender
        self.polls = polls
        self.draining = draining
        self.shutting_down = shutting_down
        self.persist = persist
        self.flush_interval_s = flush_interval_s
        self.config = config or PopConfig()
        self.now = now
        self._max_attempts = max_attempts
        # fifo(group): the group receives each queue in order, one batch in flight per queue ("FIFO groups" above)
        self.fifo = fifo or (lambda group: False)
        self.client_alive = client_alive
        self.epoch = int.from_bytes(os.urandom(4), "little")
        self._versions = itertools.count(1)
        self.subs: dict[tuple[str, str], Subscription] = {}
        self.slots = 0  # over all subscriptions
        self._tasks: set[asyncio.Task] = set()
        self.closed = False
        # Long polls: the receives waiting per topic, and one future per topic among the long polls
        # (an append to one of its queues wakes it) standing for all of them, whatever their number.
        self._topic_waiters: dict[str, set[asyncio.Future]] = {}
        self._armed: dict[str, tuple[asyncio.Future, int]] = {}
        self.counters: dict[str, int] = {"delivered": 0, "redelivered": 0, "acked": 0, "changed": 0, "expired": 0,
                                         "renewed": 0, "released": 0, "dead_lettered": 0, "filtered": 0,
                                         "restored_settled": 0, "fifo_blocked": 0}
        # Queues whose settled ranges changed, and the timer that hands them to the consumer offsets.
        self._dirty: list[tuple[Subscription, QueueState]] = []
        self._persist_timer: asyncio.TimerHandle | None = None
        self._acks_checked = False

    # ---- settings --------------------------------------------------------
    def attach(self, *, max_attempts: Callable[[str], int | None] | None = None,
               client_alive: Callable[[str], bool] | None = None) -> None:
        """What the front end serving the consumers knows (each given one replaces the one before): a group's maximum
        deliveries, and whether a client that asked for auto-renewal still lives."""
        if max_attempts is not None:
            self._max_attempts = max_attempts
        if client_alive is not None:
            self.client_alive = client_alive

    def max_attempts(self, group: str) -> int:
        n = self._max_attempts(group) if self._max_attempts is not None else None
        return n if isinstance(n, int) and n > 0 else self.config.default_max_attempts

    def check_invisible(self, seconds: float | None, receive: bool) -> float:
        c = self.config
        if seconds is None:
            return c.default_invisible_s
        lo = c.min_invisible_s if receive else 0.0
        if not (lo <= seconds <= c.max_invisible_s):
            raise PopError("ILLEGAL_INVISIBLE_TIME",
                           f"invisible duration {seconds:g} s is not between {lo:g} s and {c.max_invisible_s:g} s")
        return float(seconds)

    # ---- state -----------------------------------------------------------
    def _topic_queues(self, topic: str) -> int:
        if not topic or not TOPIC_RE.match(topic):
            raise PopError("ILLEGAL_TOPIC", f"topic {topic!r} must match ^[%|a-zA-Z0-9_-]{{1,127}}$")
        n = self.topics.queues(topic)
        if n is None or is_system_topic(topic):
            raise PopError("TOPIC_NOT_FOUND", f"no topic {topic!r} on the broker")
        return n

    def _sub(self, group: str, topic: str, create: bool = True) -> Subscription | None:
        key = (group, topic)
        sub = self.subs.get(key)
        if sub is None and create:
            if len(self.subs) >= self.config.max_subscriptions:
                self._evict_idle()
                if len(self.subs) >= self.config.max_subscriptions:
                    raise PopError("TOO_MANY_REQUESTS",
                                   f"{len(self.subs)} group and topic pairs hold messages in flight: the limit")
            sub = self.subs[key] = Subscription(group, topic)
            if not self._acks_checked:
                self._acks_checked = True
                problem = getattr(self.offsets, "acks_problem", None)
                if problem:
                    log.warning("event=rmq_acks_unusable reason=%r msg=%s", problem,
                                "'messages acknowledged past the committed offsets before the restart are delivered again'")
        if sub is not None:
            sub.used = self.now()
        return sub

    def _evict_idle(self) -> None:
        """Forget the subscriptions with nothing unsettled and nobody waiting (their offsets are in the consumer offsets)."""
        idle = [k for k, s in self.subs.items() if not s.waiters and s.slot_count() == 0]
        idle.sort(key=lambda k: self.subs[k].used)
        for k in idle[: max(1, len(idle) // 2)]:
            del self.subs[k]

    def _queue(self, sub: Subscription, qid: int) -> QueueState:
        """The queue's state, (re)started from the consumer offsets when an operator moved them (txmq groups reset)."""
        q = sub.queues.get(qid)
        stored = self.offsets.get(sub.group, sub.topic, qid)
        if q is not None and stored == q.stored:
            return q
        if q is not None:  # reset from outside: what was in flight is forgotten, its handles refused
            self._drop_all(sub, q)
        start = stored if stored is not None else self.store.queue_min_offset(sub.topic, qid)
        q = sub.queues[qid] = QueueState(qid, start)
        if stored is None:
            self.offsets.commit(sub.group, sub.topic, qid, start, keep_acked=True)
        else:
            self._restore(sub, q)
        return q

    def _restore(self, sub: Subscription, q: QueueState) -> None:
        """The ranges settled past the committed offset before a restart (acks.json): skipped; the offsets between them come again."""
        acked = self.offsets.acked(sub.group, sub.topic, q.qid)
        if not acked:
            return
        c = self.config
        hi = min(self.store.queue_max_offset(sub.topic, q.qid), q.committed + c.max_window)
        pos, skipped = q.committed, 0
        it = iter(acked)
        for start, end in zip(it, it):
            start, end = max(start, pos), min(end, hi)
            if start >= end:
                if start >= hi:
                    break
                continue
            if self.slots + (start - pos) > c.max_slots:
                break
            for off in range(pos, start):  # in offset order, as _take_new makes slots (_settled relies on it)
                q.slots[off] = Slot()
                q.ready.append(off)
            self.slots += start - pos
            skipped += end - start
            pos = end
        q.next = pos
        self.counters["restored_settled"] += skipped
        self._advance(sub, q)

    def _drop_all(self, sub: Subscription, q: QueueState) -> None:
        for slot in q.slots.values():
            if slot.state == INFLIGHT:
                sub.live -= 1
            slot.version = 0
        self.slots -= len(q.slots)
        q.slots.clear()
        q.ready.clear()

    def _remove(self, sub: Subscription, q: QueueState, offset: int) -> None:
        slot = q.slots.pop(offset, None)
        if slot is None:
            return
        if slot.state == INFLIGHT:
            sub.live -= 1
        slot.version = 0
        self.slots -= 1
        if offset in q.held:  # FIFO: the last of its queue's batch settled frees the queue for a waiting receive
            q.held.discard(offset)
            if not self._blocked(q):
                self._wake(sub)
        if offset == q.committed:
            self._advance(sub, q)  # the committed offset covers it: no range to keep
        elif not q.dirty:
            self._mark(sub, q)

    def _advance(self, sub: Subscription, q: QueueState) -> None:
        full = q.next - q.committed >= self.config.max_window
        c, slots, end = q.committed, q.slots, q.next
        if not slots:
            c = end
        else:
            while c < end and c not in slots:
                c += 1
        if c != q.committed:
            q.committed = q.stored = c
            self.offsets.commit(sub.group, sub.topic, q.qid, c, keep_acked=True)
            if full:
                self._wake(sub)

    def _wake(self, sub: Subscription) -> None:
        for fut in sub.waiters:
            if not fut.done():
                fut.set_result(None)

    # ---- settled ranges on disk -------------------------------------------
    def _mark(self, sub: Subscription, q: QueueState) -> None:
        """q settled an offset past its committed one: its ranges go to the consumer offsets within half a flush interval."""
        q.dirty = True
        self._dirty.append((sub, q))
        if self._persist_timer is None and not self.closed:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a synchronous caller): close() hands them over
                return
            # Half an interval, so that with the persist cycle's own time an acknowledgement answered one
            # flush interval before a crash is on disk; the regular checkpoint alone can take longer than that.
            self._persist_timer = loop.call_later(self.flush_interval_s / 2, self._persist_settled)

    def _persist_settled(self) -> None:
        self._persist_timer = None
        self.capture_settled()
        if self.persist is None or self.shutting_down():
            return
        self.persist().add_done_callback(_retrieve)  # a failed persist is the flusher's to log

    def capture_settled(self) -> None:
        """Hand the settled ranges of the queues changed since the last call to the consumer offsets, which persist them."""
        dirty, self._dirty = self._dirty, []
        offsets = self.offsets
        for sub, q in dirty:
            q.dirty = False
            if self.subs.get((sub.group, sub.topic)) is not sub or sub.queues.get(q.qid) is not q:
                continue  # forgotten since: reset from outside, or idle (its committed offset then covers all it settled)
            if offsets.get(sub.group, sub.topic, q.qid) != q.stored:
                continue  # moved from outside: that commit dropped the ranges, and the next access starts the queue over
            offsets.set_acked(sub.group, sub.topic, q.qid, _settled(q))

    def _push(self, sub: Subscription, q: QueueState, offset: int, slot: Slot) -> None:
        heapq.heappush(sub.heap, (slot.deadline, slot.version, q.qid, offset))
        if len(sub.heap) > 2 * sub.live + 1024:  # stale entries (acked, changed) dominate: rebuild, amortised O(1)
            sub.heap = [(s.deadline, s.version, qs.qid, off) for qs in sub.queues.values()
                        for off, s in qs.slots.items() if s.state == INFLIGHT]
            heapq.heapify(sub.heap)

    def _handle(self, sub: Subscription, q: QueueState, offset: int, slot: Slot) -> str:
        return encode_handle(Handle(self.epoch, slot.version, q.qid, offset, slot.attempt, sub.topic))

    # ---- expiry ----------------------------------------------------------
    def _expire(self, sub: Subscription, now: float) -> list[tuple[QueueState, int, Slot]]:
        """Settle the deadlines that passed: renew (auto_renew, client alive), make ready, or pick for the DLQ."""
        heap, moving = sub.heap, []
        limit = self.max_attempts(sub.group)
        while heap and heap[0][0] <= now:
            deadline, version, qid, offset = heapq.heappop(heap)
            q = sub.queues.get(qid)
            slot = q.slots.get(offset) if q is not None else None
            if slot is None or slot.version != version or slot.state != INFLIGHT:
                continue
            if slot.client is not None and now < slot.renew_until and self.client_alive is not None \
                    and self.client_alive(slot.client):
                slot.deadline = now + slot.invisible_s
                self.counters["renewed"] += 1
                self._push(sub, q, offset, slot)
                continue
            sub.live -= 1
            self.counters["expired"] += 1
            if slot.attempt >= limit:
                slot.state = MOVING
                moving.append((q, offset, slot))
            else:
                slot.state = READY
                q.ready.append(offset)
                if len(q.ready) > 2 * len(q.slots) + 64:  # offsets made ready more than once
                    q.ready = deque(sorted({o for o in q.ready if (s := q.slots.get(o)) is not None and s.state == READY}))
        return moving

    # ---- receiving -------------------------------------------------------
    async def receive(self, group: str, topic: str, queue_id: int, tags: frozenset[str] | Predicate | None, batch: int,
                      invisible_s: float | None, poll_s: float, *, auto_renew: bool = False,
                      client_id: str | None = None) -> list[Delivery]:
        """Up to batch messages of topic for group, waiting up to poll_s for one; [] when none came.

        tags: None for every message, the tags of a TAG filter, or the predicate of a SQL92 one over a message's
        properties (sqlfilter.compile_sql).

        queue_id -1 takes from any queue; a queue id starts there and goes on
        to the topic's other queues, as RocketMQ's POP does per broker.
        """
        check_group(group)
        n = self._topic_queues(topic)
        c = self.config
        if not (-1 <= queue_id < n):
            raise PopError("BAD_REQUEST", f"queue {queue_id} does not exist: topic {topic} has {n} queues (ids 0 to {n - 1}, or -1 for any)")
        if not (1 <= batch <= c.max_batch):
            raise PopError("BAD_REQUEST", f"batch size {batch} is not between 1 and {c.max_batch}")
        if not (0 <= poll_s <= c.max_poll_s):
            raise PopError("ILLEGAL_POLLING_TIME", f"long polling timeout {poll_s:g} s is not between 0 and {c.max_poll_s:g} s")
        inv = self.check_invisible(invisible_s, receive=True)
        renew_s = c.max_renew_s if auto_renew and client_id and self.client_alive is not None else 0.0
        batch = min(batch, c.serve_batch)
        until = self.now() + poll_s
        while True:
            if self.closed or self.draining():
                return []
            sub = self._sub(group, topic)
            now = self.now()
            moving = self._expire(sub, now)
            if moving:
                self._spawn(self._dead_letter(sub, moving, "max-attempts"))
            n = self.topics.queues(topic) or n
            out: list[Delivery] = []
            fifo = self.fifo(group)
            if fifo and not sub.fifo:
                self._hold_in_flight(sub)
            sub.fifo = fifo
            more = self._take(sub, n, queue_id, tags, batch, inv, now, renew_s, client_id, out, fifo)
            if out:
                return out
            if more:  # read a full step of filtered-out records: go on after other work
                await asyncio.sleep(0)
                continue
            remaining = until - self.now()
            if remaining < 0.001:
                return []
            await self._wait(sub, n, remaining)

    def _take(self, sub: Subscription, n: int, queue_id: int, tags: frozenset[str] | Predicate | None, batch: int, inv: float,
              now: float, renew_s: float, client: str | None, out: list[Delivery], fifo: bool = False) -> bool:
        """Fill out from the queues, starting at queue_id (or the next in turn); True when the scan step ran out.

        ``fifo``: a queue with messages in flight (or being dead-lettered) is
        skipped; from the others, the unsettled messages in offset order, then
        new ones: each queue's part of the batch is in flight together, and
        the queue stays blocked until every message of it is settled or
        ready again (RocketMQ's POP with order=true: ConsumerOrderInfoManager
        blocks the queue, not a message group).
        """
        match = None
        if tags is not None and not isinstance(tags, frozenset):  # a SQL92 filter: over the properties
            match, tags = tags, None
        start = queue_id if queue_id >= 0 else sub.rr % n
        sub.rr = start + 1
        budget = [self.config.scan_per_receive, self.config.max_bytes]
        for i in range(n):
            q = self._queue(sub, (start + i) % n)
            if fifo:
                if self._blocked(q):
                    self.counters["fifo_blocked"] += 1
                    continue
                if q.ready:
                    q.ready = deque(sorted({o for o in q.ready if (s := q.slots.get(o)) is not None and s.state == READY}))
                mark = len(out)
            self._take_ready(sub, q, tags, batch, inv, now, renew_s, client, out, budget, match)
            if len(out) < batch and not (fifo and q.ready):
                self._take_new(sub, q, tags, batch, inv, now, renew_s, client, out, budget, match)
            if fifo and len(out) > mark:
                q.held.update(dl_offset(dl) for dl in out[mark:])
                for off in q.ready:  # the queue was handed out again from its head: handles of the rest are stale
                    if (s := q.slots.get(off)) is not None and s.state == READY:
                        s.version = next(self._versions)
            if len(out) >= batch or budget[0] <= 0 or budget[1] <= 0:
                break
        return not out and budget[0] <= 0

    @staticmethod
    def _hold_in_flight(sub: Subscription) -> None:
        """A group just marked FIFO: each queue waits for what it has in flight or being moved (handed out concurrently)."""
        for q in sub.queues.values():
            q.held.update(off for off, s in q.slots.items() if s.state != READY)

    @staticmethod
    def _blocked(q: QueueState) -> bool:
        """FIFO: whether a message handed out from q is still in flight or being moved to the dead-letter topic."""
        held = q.held
        if held:
            slots = q.slots
            for off in [o for o in held if (s := slots.get(o)) is None or s.state == READY]:
                held.discard(off)
        return bool(held)

    def _deliver(self, sub: Subscription, q: QueueState, offset: int, slot: Slot, rec: Record, inv: float, now: float,
                 renew_s: float, client: str | None, out: list[Delivery]) -> None:
        slot.attempt += 1
        slot.version = next(self._versions)
        slot.state = INFLIGHT
        slot.deadline = now + inv
        slot.invisible_s = inv
        slot.client = client if renew_s else None
        slot.renew_until = now + renew_s
        sub.live += 1
        self._push(sub, q, offset, slot)
        out.append(Delivery(rec, self._handle(sub, q, offset, slot), slot.attempt, inv))

    def _take_ready(self, sub: Subscription, q: QueueState, tags, batch, inv, now, renew_s, client, out, budget,
                    match: Predicate | None = None) -> None:
        ready, store = q.ready, self.store
        while ready and len(out) < batch and budget[1] > 0:
            offset = ready.popleft()
            slot = q.slots.get(offset)
            if slot is None or slot.state != READY:
                continue
            res = store.get_messages(sub.topic, q.qid, offset, 1, self.config.max_bytes)
            if res.repairing:  # its damaged entry is being rebuilt from the log: again after other work
                ready.appendleft(offset)
                budget[0] = 0
                return
            rec = res.records[0] if res.records and res.records[0].queue_offset == offset else None
            if rec is None or (tags is not None and rec.tags not in tags) or (match is not None and not match(rec.properties)):
                # gone (retention, damage) or no longer subscribed
                self._remove(sub, q, offset)
                continue
            budget[1] -= len(rec.body)
            self.counters["redelivered"] += 1
            self._deliver(sub, q, offset, slot, rec, inv, now, renew_s, client, out)

    def _take_new(self, sub: Subscription, q: QueueState, tags, batch, inv, now, renew_s, client, out, budget,
                  match: Predicate | None = None) -> None:
        c, store = self.config, self.store
        while len(out) < batch and budget[0] > 0 and budget[1] > 0:
            room = min(c.max_window - (q.next - q.committed), c.max_slots - self.slots)
            if room <= 0:
                return
            want = batch - len(out) if tags is None and match is None else min(budget[0], 256)
            res = store.get_messages(sub.topic, q.qid, q.next, min(room, want), budget[1])
            if res.status is GetStatus.OFFSET_TOO_SMALL or res.status is GetStatus.OFFSET_OVERFLOW:
                # retention deleted the start (or the queue is shorter than the offset): go on from the queue's first (last) entry
                lo = res.next_offset
                for off in [o for o in q.slots if o < lo] if res.status is GetStatus.OFFSET_TOO_SMALL else list(q.slots):
                    self._remove(sub, q, off)
                q.next = lo
                q.committed = max(q.committed, lo) if res.status is GetStatus.OFFSET_TOO_SMALL else lo
                self._advance(sub, q)
                q.stored = q.committed
                self.offsets.commit(sub.group, sub.topic, q.qid, q.committed, keep_acked=True)
                continue
            if res.status is not GetStatus.FOUND:
                return
            nxt = res.next_offset
            for rec in res.records:
                if len(out) >= batch or budget[1] <= 0:
                    nxt = rec.queue_offset
                    break
                budget[0] -= 1
                if tags is not None and rec.tags not in tags or match is not None and not match(rec.properties):
                    self.counters["filtered"] += 1
                    continue
                slot = Slot()
                q.slots[rec.queue_offset] = slot
                self.slots += 1
                budget[1] -= len(rec.body)
                self.counters["delivered"] += 1
                self._deliver(sub, q, rec.queue_offset, slot, rec, inv, now, renew_s, client, out)
            if res.repairing:  # damaged entries at nxt are being rebuilt from the log: the receive goes on after other work
                budget[0] = 0
            if nxt <= q.next:
                return
            q.next = nxt
            self._advance(sub, q)

    async def _wait(self, sub: Subscription, n: int, remaining: float) -> None:
        """Until a message is appended to the topic, one is settled or made ready, a deadline passes, or remaining."""
        if sub.heap:
            remaining = min(remaining, max(0.001, sub.heap[0][0] - self.now()))
        fut = asyncio.get_running_loop().create_future()
        topic = sub.topic
        self._topic_waiters.setdefault(topic, set()).add(fut)
        sub.waiters.add(fut)
        self._arm(topic, n)
        try:
            await asyncio.wait((fut,), timeout=remaining)
        finally:
            sub.waiters.discard(fut)
            waiters = self._topic_waiters.get(topic)
            if waiters is not None:
                waiters.discard(fut)
                if not waiters:
                    del self._topic_waiters[topic]
                    self._disarm(topic)

    def _arm(self, topic: str, n: int) -> None:
        """One future among the long polls on each queue of topic, woken by an append to one of them."""
        armed = self._armed.get(topic)
        if armed is not None and not armed[0].done() and armed[1] >= n:
            return
        if armed is not None:
            self._disarm(topic)
        fut = asyncio.get_running_loop().create_future()
        self._armed[topic] = (fut, n)
        self.polls.watch(topic, n, fut)
        fut.add_done_callback(lambda f: self._fired(topic, f, n))

    def _fired(self, topic: str, fut: asyncio.Future, n: int) -> None:
        armed = self._armed.get(topic)
        if armed is not None and armed[0] is fut:
            del self._armed[topic]
        self.polls.unwatch(topic, n, fut)
        for w in self._topic_waiters.get(topic, ()):
            if not w.done():
                w.set_result(None)

    def _disarm(self, topic: str) -> None:
        armed = self._armed.pop(topic, None)
        if armed is not None:
            self.polls.unwatch(topic, armed[1], armed[0])
            if not armed[0].done():
                armed[0].cancel()

    # ---- settling --------------------------------------------------------
    def _find(self, group: str, topic: str, handle: str) -> tuple[Subscription, QueueState, int, Slot]:
        h = decode_handle(handle)
        if h is None:
            raise PopError("INVALID_RECEIPT_HANDLE", "malformed receipt handle")
        if topic and h.topic != topic:
            raise PopError("INVALID_RECEIPT_HANDLE", f"the receipt handle is for topic {h.topic!r}, not {topic!r}")
        if h.epoch != self.epoch:
            raise PopError("INVALID_RECEIPT_HANDLE", "the receipt handle is from before the broker restarted: the message is delivered again")
        sub = self.subs.get((group, h.topic))
        q = sub.queues.get(h.queue_id) if sub is not None else None
        if q is not None and self.offsets.get(group, h.topic, h.queue_id) != q.stored:
            q = self._queue(sub, h.queue_id)  # an operator moved the offset: what was in flight is forgotten
        slot = q.slots.get(h.offset) if q is not None else None
        if slot is None or slot.version != h.version or slot.state == MOVING:
            raise PopError("INVALID_RECEIPT_HANDLE", "the receipt handle is stale: the message was acknowledged, "
                           "received again or given another invisible duration since, or the handle is another group's")
        assert sub is not None and q is not None
        return sub, q, h.offset, slot

    def ack(self, group: str, topic: str, handle: str) -> None:
        """Settle the message handle names (in flight, or expired and not yet received again)."""
        sub, q, offset, _ = self._find(group, topic, handle)
        self._remove(sub, q, offset)
        self.counters["acked"] += 1

    def change_invisible(self, group: str, topic: str, handle: str, invisible_s: float) -> str:
        """Make the message invisible for invisible_s from now; returns its new receipt handle (the old one is refused)."""
        sub, q, offset, slot = self._find(group, topic, handle)
        inv = self.check_invisible(invisible_s, receive=False)
        if slot.state != INFLIGHT:
            sub.live += 1
        slot.state = INFLIGHT
        slot.version = next(self._versions)
        slot.deadline = self.now() + inv
        slot.invisible_s = inv
        slot.client = None  # the consumer took charge of the duration: no renewal
        self._push(sub, q, offset, slot)
        if self.fifo(group):
            q.held.add(offset)  # in flight again: its queue waits for it
        self.counters["changed"] += 1
        self._wake(sub)  # a waiting receive recomputes when to look again
        return self._handle(sub, q, offset, slot)

    def release(self, group: str, topic: str, deliveries: list[Delivery], *, unsent: bool) -> None:
        """Messages a receive took but did not hand to the client.

        ``unsent`` (the stream ended before them): ready again at once, the
        attempt not counted; RocketMQ's proxy nacks what it cannot write.
        Otherwise (written to no client because it cannot be converted): it
        stays in flight for its invisible duration without renewal, so its
        attempts run out and it goes to the dead-letter topic, as a message
        a client never acknowledges does. A stale delivery (settled since)
        is left alone.
        """
        for dl in reversed(deliveries) if unsent else deliveries:  # back to the front of the ready queues, in order
            try:
                sub, q, offset, slot = self._find(group, topic, dl.receipt_handle)
            except PopError:
                continue
            if slot.state != INFLIGHT:
                continue
            if not unsent:
                slot.client = None
                continue
            slot.attempt -= 1
            slot.version = next(self._versions)  # the handle nobody saw is refused from now on
            slot.state = READY
            sub.live -= 1
            q.ready.appendleft(offset)
            self.counters["released"] += 1
            self._wake(sub)

    async def forward_to_dlq(self, group: str, topic: str, handle: str) -> None:
        """Write the message to %DLQ%<group> (durable), then settle it."""
        sub, q, offset, slot = self._find(group, topic, handle)
        if slot.state == INFLIGHT:
            sub.live -= 1
        slot.state = MOVING
        if self.fifo(group):
            q.held.add(offset)  # expired and receivable before: its queue waits for the write (a failed one makes it ready again)
        if not await self._dead_letter(sub, [(q, offset, slot)], "consumer"):
            raise PopError("INTERNAL_SERVER_ERROR", "the message could not be written to the dead-letter topic; it is received again")

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _dead_letter(self, sub: Subscription, items: list[tuple[QueueState, int, Slot]], reason: str) -> bool:
        """Append the MOVING slots' messages to the group's dead-letter topic, then settle them.

        On failure they become receivable again (``reason`` consumer) or are
        tried again after ``dlq_retry_s`` (max-attempts).
        """
        topic = dlq_topic(sub.group)
        msgs, done = [], []
        for q, offset, slot in items:
            res = self.store.get_messages(sub.topic, q.qid, offset, 1, self.config.max_bytes)
            rec = res.records[0] if res.records and res.records[0].queue_offset == offset else None
            if rec is None:  # gone: nothing to move
                self._remove(sub, q, offset)
                continue
            # not the broker's own marks: a delivered delayed message's TXMQ_SCHEDULED_FROM on this copy would
            # count its delivery twice in the next start's replay of the log
            props = {k: v for k, v in rec.properties.items() if k != PROP_TRAN_MSG and k not in RESERVED}
            props.update({PROP_DLQ_ORIGIN_TOPIC: sub.topic, PROP_DLQ_ORIGIN_MESSAGE_ID: msg_id_of(rec),
                          PROP_DLQ_ORIGIN_QUEUE: f"{q.qid}:{offset}", PROP_DLQ_ATTEMPTS: str(slot.attempt),
                          PROP_DLQ_REASON: reason})
            props.setdefault(PROP_UNIQ_KEY, msg_id_of(rec))
            msgs.append(Message(topic, 0, TxType.NORMAL, rec.born_ts, props, rec.body))
            done.append((q, offset, slot))
        if not msgs:
            return True
        try:
            if not TOPIC_RE.match(topic):
                raise PopError("ILLEGAL_CONSUMER_GROUP", f"the dead-letter topic {topic!r} would be longer than 127 characters")
            self.topics.ensure(topic, 1)
            await self.appender.submit(msgs)
        except Exception as exc:
            log.warning("event=rmq_dead_letter_failed group=%s topic=%s messages=%d error=%r", sub.group, sub.topic, len(msgs), exc)
            for q, offset, slot in done:
                if q.slots.get(offset) is not slot or slot.state != MOVING:
                    continue
                if reason == "consumer":
                    slot.state = READY
                    q.ready.append(offset)
                else:
                    slot.state = INFLIGHT
                    slot.deadline = self.now() + self.config.dlq_retry_s
                    sub.live += 1
                    self._push(sub, q, offset, slot)
            self._wake(sub)
            return False
        for q, offset, slot in done:
            if q.slots.get(offset) is slot:
                self._remove(sub, q, offset)
        self.counters["dead_lettered"] += len(done)
        log.info("event=rmq_dead_lettered group=%s topic=%s messages=%d reason=%s", sub.group, sub.topic, len(done), reason)
        return True

    # ---- lifecycle and state --------------------------------------------
    async def close(self) -> None:
        """Answer the waiting receives, finish the dead-letter writes under way, hand over the settled ranges."""
        self.closed = True
        for sub in self.subs.values():
            self._wake(sub)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        if self._persist_timer is not None:
            self._persist_timer.cancel()
            self._persist_timer = None
        self.capture_settled()  # the broker's last flush writes them

    def in_flight(self, group: str, topic: str) -> dict[int, dict[str, Any]]:
        """Per queue: committed, next, unsettled messages and how many are in flight (for status and tests)."""
        sub = self.subs.get((group, topic))
        if sub is None:
            return {}
        return {qid: {"committed": q.committed, "next": q.next, "unsettled": len(q.slots),
                      "in_flight": sum(1 for s in q.slots.values() if s.state == INFLIGHT)}
                for qid, q in sorted(sub.queues.items())}

    def stats(self) -> dict[str, Any]:
        return {"subscriptions": len(self.subs), "unsettled": self.slots, **self.counters}


def dl_offset(dl: Delivery) -> int:
    return dl.record.queue_offset


def _settled(q: QueueState) -> array:
    """The ranges settled in q's window past its committed offset, flat: [start0, end0, ...], ends exclusive."""
    out = array("q")
    prev = q.committed
    for off in sorted(q.slots):  # made in offset order already: sorted() only checks the run
        if off > prev:
            out.append(prev)
            out.append(off)
        prev = max(prev, off + 1)
    if q.next > prev:
        out.append(prev)
        out.append(q.next)
    return out


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
