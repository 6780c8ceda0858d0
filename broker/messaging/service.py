"""The messaging service: the one set of calls every front end makes, with every broker rule behind it once.

A front end reads its protocol, hands the request over in these terms and
words the answer (broker/messaging/types.py) in its protocol again. What a
send is (normal, transactional, delayed, FIFO), which queue it goes to, the
gate transactional requests wait at while the transaction index is built
after a start, the answer to a half message sent again, and what an end of
a transaction did are decided here and nowhere else:

- **The send planner** (``send``): a ``TRAN_MSG`` property makes a half
  message (alone: never in a batch); a message group (``__SHARDINGKEY``,
  where the protocol has them) chooses its queue and is never transactional
  or timed; a delivery time (``DELAY``, ``TIMER_*``) makes a scheduled
  message (the core's send diverts it to the schedule); every message's
  type must be one its topic accepts, where the protocol has topic types
  (``SendRules``).
- **The index gate**: right after a start the transaction index is being
  built; half messages and ends of transactions wait for it in arrival
  order (``IndexKeeper.when_ready``), and fail with its error if the build
  failed.
- **The idempotent half resend**: RocketMQ's clients send a half message
  again, under the same id, when its answer did not come in time, and the
  first may have been stored. A half whose id is pending in the same topic
  and producer group answers with the first one's receipt
  (``SendReceipt.resent``) and writes nothing; an id in use otherwise is
  refused (INVALID_FIELD).
- **The end of a transaction** answers an ``EndOutcome`` (decided, already,
  unchanged), and ``transaction_ref`` finds the half copy a transaction id
  names, for protocols whose ends name no offsets.

Results are futures (no task per request on the hot paths): the appends'
own futures, mapped to typed results by a done-callback.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

from txmq.constants import DEFAULT_MESSAGE_TYPES, PROP_PGROUP, PROP_TIMER_DELAY_MS, PROP_TRAN_MSG, PROP_UNIQ_KEY, is_system_topic
from txmq.store import Message, TxType
from txmq.wire import ErrorCode, TxmqError

from ..fifo import message_group_of, pick_group_queue
from ..groups import find_messages, offset_for_time
from ..scheduled.service import is_scheduled_message
from ..scheduled.timing import asks_for_time, without_schedule
from ..transactions.ids import known, split_with_offsets
from ..transactions.service import MAX_NAME

from .naming import (
    MAX_RECONSUME_TIMES,
    PROP_MAX_RECONSUME_TIMES,
    PROP_ORIGIN_MESSAGE_ID,
    PROP_RECONSUME_TIME,
    PROP_RETRY_TOPIC,
    dlq_topic,
    retry_delay_ms,
    retry_topic,
)
from .types import (
    NATIVE_RULES,
    EndOutcome,
    MessageKind,
    Outgoing,
    PullResult,
    SendReceipt,
    SendRules,
    SentBack,
    TxRef,
)

if TYPE_CHECKING:
    from ..config import BrokerConfig
    from .consumption import ConsumptionService
    from ..metrics import Metrics
    from ..refusals import Refusals
    from ..registry import PushTarget
    from txmq.store import Record

_STATES = ("commit", "rollback", "unknown")
_SOURCES = ("producer", "check")


def then(src: Any, fn: Callable[[Any], Any]) -> asyncio.Future:
    """A future of fn(result of src): src is a future, an awaitable, or a plain result. No task for a future: a
    done-callback maps it (what a front end uses to word a result without a task per request)."""
    if isinstance(src, asyncio.Future):
        out = src.get_loop().create_future()

        def done(f: asyncio.Future) -> None:
            if out.done():
                return
            if f.cancelled():
                out.cancel()
                return
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            try:
                out.set_result(fn(f.result()))
            except BaseException as e:  # noqa: BLE001  the mapping's own failure is the request's
                out.set_exception(e)

        src.add_done_callback(done)
        return out
    if isinstance(src, dict | list):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(fn(src))
        return fut
    return asyncio.ensure_future(_await_then(src, fn))


async def _await_then(src: Awaitable[Any], fn: Callable[[Any], Any]) -> Any:
    return fn(await src)


def _one(receipt: SendReceipt) -> list[SendReceipt]:
    return [receipt]


_of_row = SendReceipt.of_row


def _one_row(row: dict[str, Any]) -> list[SendReceipt]:
    return [_of_row(row)]


def _receipts(reply: dict[str, Any]) -> list[SendReceipt]:
    rows = reply["results"] if "results" in reply else [reply]
    return [_of_row(r) for r in rows]


class Messaging:
    """What a client-facing front end may call: sends of every type, transactions, consuming, topics and clients.

    Built by the core once the store is open (``BrokerCore.open``); it
    decides the rules above over the core's services, so that a front end
    needs nothing else. Besides its calls it hands a front end the broker's
    settings (``config``), counters (``metrics``) and refusal log
    (``refusals``), which are the broker's, not any one front end's.
    """

    def __init__(self, core: Any) -> None:  # BrokerCore (not imported: it imports this module)
        # Built with the core, before its store is open (front ends are built then, and bind their ports): the
        # services the core builds when it opens the store are looked up on it at each call.
        self._core = core
        self._clock = core.clock

    @property
    def config(self) -> BrokerConfig:
        return self._core.config

    @property
    def metrics(self) -> Metrics:
        return self._core.metrics

    @property
    def refusals(self) -> Refusals:
        return self._core.refusals

    # ---- sending ---------------------------------------------------------------------------------------------
    def send(self, topic: str, items: Sequence[Outgoing], queue_id: int | None = None,
             rules: SendRules = NATIVE_RULES, word: Callable[[list[SendReceipt]], Any] | None = None) -> asyncio.Future:
        """Store one message or a batch: a future of their receipts, in order (the planner above decides each one's type and queue).

        ``queue_id``: the queue the client chose (None or < 0: the broker
        chooses, round-robin); a FIFO message's queue is its group's, and a
        queue given with a group must be that one. ``word``: what the front
        end makes of the receipts (its protocol's answer); the future's
        result is then that, mapped in the same done-callback (no second
        future on the hot path).
        """
        n = len(items)
        if not n:
            raise TxmqError("no message to send", ErrorCode.INVALID_FIELD)
        asked = queue_id if queue_id is not None and queue_id >= 0 else None
        topics = self._core.topics
        if n == 1:  # the common case, without the batch's bookkeeping
            o = items[0]
            props = o.properties
            group = message_group_of(props) if rules.message_groups else None  # refuses a group with a delivery time
            if props.get(PROP_TRAN_MSG) == "true":  # a half message (message_group_of refused one with a group)
                return self._send_half_gated(topic, asked, o.body, props, o.born_ts, _one if word is None else lambda r: word([r]))
            if group is not None:
                qid = pick_group_queue(topics, topic, group, asked)
            else:
                qid = topics.pick_queue(topic, asked, self._kind(topic, props, rules).value)
            return self._core.send([Message(topic, qid, TxType.NORMAL, o.born_ts, props, o.body)], True,
                                   _one_row if word is None else lambda row: word([_of_row(row)]))
        queues: list[int | None] = []
        kinds: set[MessageKind] = set()
        for o in items:
            props = o.properties
            if props.get(PROP_TRAN_MSG) == "true":
                raise TxmqError("transactional messages cannot be sent in a batch", ErrorCode.INVALID_FIELD)
            group = message_group_of(props) if rules.message_groups else None  # refuses a group with a delivery time
            if group is not None:
                queues.append(pick_group_queue(topics, topic, group, asked))
                continue
            kinds.add(self._kind(topic, props, rules))
            queues.append(None)
        qid = 0
        if kinds:
            for kind in kinds - {MessageKind.NORMAL}:  # every type in the batch must be one the topic accepts
                topics.pick_queue(topic, 0, kind.value)
            first = MessageKind.NORMAL if MessageKind.NORMAL in kinds else MessageKind.DELAY
            qid = topics.pick_queue(topic, asked, first.value)
        msgs = [Message(topic, qid if q is None else q, TxType.NORMAL, o.born_ts, o.properties, o.body) for o, q in zip(items, queues)]
        return self._core.send(msgs, False, _receipts if word is None else lambda reply: word(_receipts(reply)))

    def _kind(self, topic: str, props: dict[str, str], rules: SendRules) -> MessageKind:
        """A plain message's type: DELAY when its properties ask for a later delivery (checked only where the protocol has
        topic types). A topic the send creates (auto-creation) accepts delayed messages too when the send is one."""
        if not rules.message_types or not asks_for_time(props):
            return MessageKind.NORMAL
        topics = self._core.topics
        if topics.auto_create and topics.queues(topic) is None:
            topics.ensure(topic, None, (*DEFAULT_MESSAGE_TYPES, "delay"))
        return MessageKind.DELAY

    # ---- transactions ----------------------------------------------------------------------------------------
    def send_half(self, topic: str, queue_id: int | None, body: bytes, props: dict[str, str], born_ts: int) -> asyncio.Future:
        """Store a half message (``props`` name its producer group, PGROUP): a future of its receipt.

        Waits at the index gate; a half sent again under an id pending in
        the same topic and group answers with the first one's receipt.
        """
        return self._send_half_gated(topic, queue_id, body, props, born_ts)

    def _send_half_gated(self, topic: str, queue_id: int | None, body: bytes, props: dict[str, str], born_ts: int,
                         word: Callable[[SendReceipt], Any] | None = None) -> Any:
        """A future of the half's receipt (or of ``word`` of it)."""
        keeper = self._core.keeper
        if keeper.must_wait():  # right after a start, while the transaction index is built
            return asyncio.ensure_future(keeper.when_ready(lambda: self._send_half(topic, queue_id, body, props, born_ts, word)))
        return self._send_half(topic, queue_id, body, props, born_ts, word)

    def _send_half(self, topic: str, queue_id: int | None, body: bytes, props: dict[str, str], born_ts: int,
                   word: Callable[[SendReceipt], Any] | None) -> asyncio.Future:
        again = self._resent(topic, props)
        if again is not None:
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(again if word is None else word(again))
            return fut
        return self._core.tx.send_half(topic, queue_id, body, props, born_ts, _of_row if word is None else lambda row: word(_of_row(row)))

    def _resent(self, topic: str, props: dict[str, str]) -> SendReceipt | None:
        tx_id = props.get(PROP_UNIQ_KEY)
        if not tx_id:
            return None
        p = self._core.tx.index.pending.get(tx_id)
        if p is None or p.topic != topic or p.group != props.get(PROP_PGROUP):
            return None
        return SendReceipt(tx_id, topic, p.queue_id, p.half_offset, p.cl_offset, half_offset=p.half_offset, resent=True)

    def end_transaction(self, group: str, tx_id: str, commit_log_offset: int, half_offset: int, state: str,
                        source: str = "producer", word: Callable[[EndOutcome], Any] | None = None) -> asyncio.Future:
        """Commit, roll back or leave (``unknown``) the transaction of the half copy at these offsets: a future of its EndOutcome.

        ``source``: producer, or check (an answer to a check-back). Waits at
        the index gate. Refusals: TX_GROUP_MISMATCH, TX_ID_MISMATCH,
        TX_OFFSET_MISMATCH, TX_NOT_FOUND, TX_NOT_HALF, TX_CONFLICT (the
        other outcome is on record).
        """
        if state not in _STATES:
            raise TxmqError("field 'state' must be commit, rollback or unknown", ErrorCode.INVALID_FIELD)
        if source not in _SOURCES:
            raise TxmqError("the source of an end of a transaction is producer or check", ErrorCode.INVALID_FIELD)
        if len(tx_id) > MAX_NAME:  # no transaction has a longer id
            raise TxmqError(f"field 'tx_id' is longer than {MAX_NAME} characters", ErrorCode.INVALID_FIELD)
        keeper = self._core.keeper

        def end() -> Any:
            return self._core.tx.end_transaction(group, tx_id, commit_log_offset, half_offset, state, source)

        result = keeper.when_ready(end) if keeper.must_wait() else end()
        of_reply = EndOutcome.of_reply
        return then(result, (lambda r: of_reply(tx_id, r)) if word is None else lambda r: word(of_reply(tx_id, r)))

    async def transaction_ref(self, text: str) -> TxRef | None:
        """The half copy a transaction id names (a protocol whose end of a transaction gives no offsets): None if none.

        A pending transaction's latest copy; a decided one's first (its end
        then answers with the outcome on record). The form
        ``<tx_id>:<commit-log offset>:<half offset>`` names the copy itself;
        it is taken apart only when no transaction has the whole text as its
        id (a native producer may choose ids with colons). Waits at the index
        gate.
        """
        keeper = self._core.keeper
        if keeper.must_wait():
            await keeper.when_ready(lambda: {})
        index = self._core.tx.index
        p = index.pending.get(text)
        if p is not None:
            return TxRef(text, p.cl_offset, p.half_offset)
        with_offsets = split_with_offsets(text)
        if with_offsets is not None and not known(index, text):
            return TxRef(*with_offsets)
        if len(text) > MAX_NAME:
            return None
        dec = index.lookup(text)
        if dec is None or dec.origin < 0:
            return None
        try:
            rec = self._core.tx.read_half(dec.origin)
        except TxmqError:
            return None
        return TxRef(text, rec.commit_log_offset, rec.queue_offset)

    # ---- consuming -------------------------------------------------------------------------------------------
    async def pull(self, topic: str, queue_id: int, offset: int, max_count: int, max_bytes: int, wait_ms: int) -> PullResult:
        """A queue's messages from ``offset`` on, waiting up to ``wait_ms`` for the first."""
        return PullResult.of_reply(await self._core.pull(topic, queue_id, offset, max_count, max_bytes, wait_ms))

    async def commit_offset(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        """Commit a consumer group's offset and wait until it is on disk (the next flush persists the offsets)."""
        await self._core.commit_offset(group, topic, queue_id, offset)

    def set_offset(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        """Commit a consumer group's offset without waiting for the disk (a oneway request's, or one a pull carries)."""
        self._core.offsets.commit(group, topic, queue_id, offset)

    def fetch_offsets(self, group: str, topic: str) -> dict[int, int]:
        """The group's committed offset of each queue of the topic that has one."""
        return self._core.fetch_offsets(group, topic)

    def consumer_offset(self, group: str, topic: str, queue_id: int) -> int | None:
        """The group's committed offset of the queue, None if it has none."""
        return self._core.offsets.get(group, topic, queue_id)

    def consumer_offsets(self) -> dict[str, dict[str, dict[int, int]]]:
        """Every group's committed offsets: {group: {topic: {queue: offset}}}."""
        return self._core.offsets.all()

    def is_fifo_group(self, group: str) -> bool:
        """Whether the consumer group receives each queue in order (``txmq groups update G --fifo``)."""
        return self._core.group_config.fifo(group)

    # ---- queues and stored messages ---------------------------------------------------------------------------
    def queue_bounds(self, topic: str, queue_id: int) -> tuple[int, int]:
        """[min_offset, max_offset) of a queue: its first message still stored, and one past its last."""
        return self._core.store.queue_min_offset(topic, queue_id), self._core.store.queue_max_offset(topic, queue_id)

    def log_bounds(self) -> tuple[int, int]:
        """[min_offset, max_offset) of the commit log."""
        return self._core.store.min_offset, self._core.store.max_offset

    def offset_for_time(self, topic: str, queue_id: int, time_ms: int) -> int:
        """The queue offset of the queue's first message stored at or after ``time_ms`` (its end when none)."""
        return offset_for_time(self._core, topic, queue_id, time_ms)

    def store_time_at(self, topic: str, queue_id: int, queue_offset: int) -> int | None:
        """When the queue's message at ``queue_offset`` was stored (ms), None when there is none or it cannot be read."""
        store = self._core.store
        entries = store.cq_entries(topic, queue_id, queue_offset, 1)
        if not entries:
            return None
        try:
            return int(store.read(entries[0][0]).store_ts)
        except Exception:  # noqa: BLE001  a damaged record: reported by the store's reads, not here
            return None

    def first_store_time(self) -> int | None:
        """When the oldest record in the log was stored (ms), None for an empty log or one that cannot be read."""
        store = self._core.store
        if store.max_offset <= store.min_offset:
            return None
        try:
            return int(store.read_record(store.min_offset).store_ts)
        except Exception:  # noqa: BLE001
            return None

    def read_message(self, commit_log_offset: int, scheduled: bool = False) -> Record:
        """The message stored at a commit-log offset (NO_SUCH_MESSAGE when none starts there, or a system topic's record
        is there); with ``scheduled``, a delayed message's scheduled record too (it names its real topic and due time)."""
        store = self._core.store
        cl = commit_log_offset
        if not store.min_offset <= cl < store.max_offset:
            raise TxmqError(f"no message at commit-log offset {cl} (the log holds {store.min_offset} to {store.max_offset})",
                            ErrorCode.NO_SUCH_MESSAGE)
        try:
            rec = store.read_record(cl)
        except Exception:  # noqa: BLE001  a forged, damaged or misaligned offset
            raise TxmqError(f"no message starts at commit-log offset {cl}", ErrorCode.NO_SUCH_MESSAGE) from None
        if is_system_topic(rec.topic) and not (scheduled and is_scheduled_message(rec)):
            raise TxmqError(f"commit-log offset {cl} holds a record of system topic {rec.topic}, not a message", ErrorCode.NO_SUCH_MESSAGE)
        return rec

    async def find_messages(self, key: str, topic: str | None, since_ms: int, until_ms: int | None, limit: int,
                            scan: int) -> list[dict[str, Any]]:
        """Messages whose KEYS hold ``key`` or whose id is it, stored in [since_ms, until_ms), reading at most ``scan``
        records (``txmq message find``; txmq keeps no key index)."""
        return (await find_messages(self._core, key, topic, since_ms, until_ms, limit, scan))["messages"]

    async def cancel_scheduled(self, msg_id: str, topic: str | None) -> dict[str, Any]:
        """Cancel a scheduled message before it is due (NO_SUCH_MESSAGE when none is scheduled under that id)."""
        return await self._core.scheduled.cancel(msg_id, topic)

    # ---- topics ------------------------------------------------------------------------------------------------
    def topic_queues(self, topic: str) -> int | None:
        """The topic's queue count, or None for a topic the broker does not have."""
        return self._core.topics.queues(topic)

    def topic_types(self, topic: str) -> tuple[str, ...]:
        """The message types a topic accepts (a topic not in the table: those it would be created with)."""
        return self._core.topics.message_types(topic)

    def topics(self) -> dict[str, int]:
        """Every topic, system ones too, with its queue count."""
        return self._core.topics.all()

    @property
    def auto_create_topics(self) -> bool:
        """Whether a send or route of an unknown topic creates it (``--no-auto-create-topics`` turns it off)."""
        return self._core.topics.auto_create

    def ensure_topic(self, topic: str, queues: int | None = None, message_types: tuple[str, ...] | None = None) -> tuple[int, bool]:
        """The topic's queue count, creating it (whatever auto-creation says) if missing: (queues, created)."""
        return self._core.topics.ensure(topic, queues, message_types)

    def create_topic(self, topic: str, queues: int | None, message_types: tuple[str, ...] | None) -> dict[str, Any]:
        return self._core.create_topic(topic, queues, message_types)

    def update_topic(self, topic: str, queues: int | None, message_types: tuple[str, ...] | None) -> dict[str, Any]:
        return self._core.update_topic(topic, queues, message_types)

    def delete_topic(self, topic: str, force: bool) -> dict[str, Any]:
        return self._core.delete_topic(topic, force)

    # ---- clients -------------------------------------------------------------------------------------------------
    def register_producer(self, group: str, target: PushTarget) -> None:
        """A connection of the producer group: check-backs of the group's transactions go to it (round-robin)."""
        self._core.registry.register(group, target)

    def unregister_producer(self, group: str, target: PushTarget) -> None:
        self._core.registry.unregister(group, target)

    def register_consumer(self, group: str, target: Any) -> None:
        """A connection of the consumer group (``txmq groups`` counts them)."""
        self._core.consumer_registry.register(group, target)

    def unregister_consumer(self, group: str, target: Any) -> None:
        self._core.consumer_registry.unregister(group, target)

    def forget_client(self, target: Any) -> None:
        """A connection closed: out of every producer and consumer group."""
        self._core.registry.unregister_all(target)
        self._core.consumer_registry.unregister_all(target)

    @property
    def consumption(self) -> ConsumptionService:
        """Receiving with invisible durations, acknowledging, retries and dead letters (broker/messaging/consumption.py)."""
        return self._core.consumption

    # ---- the broker's state, as a front end needs it -----------------------------------------------------------------
    @property
    def draining(self) -> bool:
        """The broker is stopping: refuse new requests, let in-flight ones finish."""
        return self._core.draining

    @property
    def shutting_down(self) -> bool:
        return self._core.shutting_down

    @property
    def broker_id(self) -> str:
        return self._core.broker_id

    @property
    def started_at(self) -> float:
        """When the broker started (s since the epoch)."""
        return self._core.started_at

    def error_of(self, exc: BaseException) -> TxmqError:
        """The error a client is answered for an exception of the broker's services (a full disk, a store error, a bug)."""
        return self._core.store_error(exc)

    @property
    def busy_poll_arm(self) -> Callable[[], None] | None:
        """What keeps a CPU spinning briefly for a lone client's next request (``--busy-poll``); None when off."""
        return self._core.busy_poll.arm

    def listening(self, name: str, host: str, port: int, **extra: Any) -> None:
        """A port the broker now listens on (``txmq broker status`` lists them)."""
        self._core.listening(name, host, port, **extra)

    def now_ms(self) -> int:
        return int(self._clock() * 1000)

    # ---- retries of what a consumer failed --------------------------------------------------------------------
    def send_back(self, group: str, commit_log_offset: int, delay_level: int = 0, max_times: int = MAX_RECONSUME_TIMES,
                  origin_msg_id: str = "") -> asyncio.Future:
        """A message its consumer failed (the record at ``commit_log_offset``), stored again for the group: a future of
        its ``SentBack``.

        Into the group's retry topic ``%RETRY%<group>``, due after
        ``retry_delay_ms`` (delay level ``delay_level``, or 3 + its retries
        when 0), with ``RECONSUME_TIME`` one higher; past ``max_times``
        retries, or with a negative delay level, into the dead-letter topic
        ``%DLQ%<group>`` (RocketMQ's rules; naming.py). Either topic is
        created with one queue when missing. A plain append, not the
        planner's: a committed transactional message's ``TRAN_MSG`` is only
        a property of the copy.
        """
        rec = self.read_message(commit_log_offset)
        props = without_schedule(rec.properties)  # the copy's own delay, not the original's (nor its delivery's marks)
        try:
            times = max(0, int(props.get(PROP_RECONSUME_TIME, "0")))  # a client's property: any text
        except ValueError:
            times = 0
        props.setdefault(PROP_RETRY_TOPIC, rec.topic)
        if origin_msg_id:
            props.setdefault(PROP_ORIGIN_MESSAGE_ID, origin_msg_id)
        props[PROP_RECONSUME_TIME] = str(times + 1)
        dead = times >= max_times or delay_level < 0
        if dead:
            topic = dlq_topic(group)
        else:
            topic = retry_topic(group)
            delay = retry_delay_ms(self.config.message_delay_levels_ms, times, delay_level)
            if delay > 0:
                props[PROP_TIMER_DELAY_MS] = str(delay)
            props[PROP_MAX_RECONSUME_TIMES] = str(max_times)
        self._core.topics.ensure(topic, 1)
        return self._core.send([Message(topic, 0, TxType.NORMAL, rec.born_ts, props, rec.body)], True,
                               lambda row: SentBack(_of_row(row), dead))
