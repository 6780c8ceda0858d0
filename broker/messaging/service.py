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

from txmq.constants import DEFAULT_MESSAGE_TYPES, PROP_PGROUP, PROP_TRAN_MSG, PROP_UNIQ_KEY
from txmq.store import Message, TxType
from txmq.wire import ErrorCode, TxmqError

from txmq.broker.fifo import message_group_of, pick_group_queue
from txmq.broker.scheduled.timing import asks_for_time
from txmq.broker.transactions.ids import known, split_with_offsets
from txmq.broker.transactions.service import MAX_NAME

from .types import (
    NATIVE_RULES,
    EndOutcome,
    MessageKind,
    Outgoing,
    PullResult,
    SendReceipt,
    SendRules,
    TxRef,
)

if TYPE_CHECKING:
    from txmq.broker.clock import Clock
    from txmq.broker.topics import TopicTable
    from txmq.broker.transactions.keeper import IndexKeeper
    from txmq.broker.transactions.service import TransactionService

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


def _receipts(reply: dict[str, Any]) -> list[SendReceipt]:
    rows = reply["results"] if "results" in reply else [reply]
    return [SendReceipt.of_row(r) for r in rows]


class Messaging:
    """What a front end may call: sends of every type, transactions, pulls and offsets (docs/architecture.md).

    Built by the core once the store is open, on the services it needs;
    it decides the rules above, so that a front end needs nothing else.
    """

    def __init__(self, topics: TopicTable, tx: TransactionService, keeper: IndexKeeper, clock: Clock,
                 send: Callable[[list[Message], bool], asyncio.Future], pull: Callable[..., Awaitable[dict[str, Any]]]) -> None:
        self._topics = topics
        self._tx = tx
        self._keeper = keeper
        self._clock = clock
        self._send = send  # BrokerCore.send: appends, and diverts what asks for a later delivery to the schedule
        self._pull = pull  # BrokerCore.pull: reads a queue, long-polling

    # ---- sending ---------------------------------------------------------------------------------------------
    def send(self, topic: str, items: Sequence[Outgoing], queue_id: int | None = None,
             rules: SendRules = NATIVE_RULES) -> asyncio.Future:
        """Store one message or a batch: a future of their receipts, in order (the planner above decides each one's type and queue).

        ``queue_id``: the queue the client chose (None or < 0: the broker
        chooses, round-robin); a FIFO message's queue is its group's, and a
        queue given with a group must be that one.
        """
        if not items:
            raise TxmqError("no message to send", ErrorCode.INVALID_FIELD)
        asked = queue_id if queue_id is not None and queue_id >= 0 else None
        if len(items) == 1 and items[0].properties.get(PROP_TRAN_MSG) == "true":
            o = items[0]
            if rules.message_groups:
                message_group_of(o.properties)  # refuses a transactional message with a message group
            return then(self.send_half(topic, asked, o.body, o.properties, o.born_ts), _one)
        topics = self._topics
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
        return then(self._send(msgs, len(msgs) == 1), _receipts)

    def _kind(self, topic: str, props: dict[str, str], rules: SendRules) -> MessageKind:
        """A plain message's type: DELAY when its properties ask for a later delivery (checked only where the protocol has
        topic types). A topic the send creates (auto-creation) accepts delayed messages too when the send is one."""
        if not rules.message_types or not asks_for_time(props):
            return MessageKind.NORMAL
        topics = self._topics
        if topics.auto_create and topics.queues(topic) is None:
            topics.ensure(topic, None, (*DEFAULT_MESSAGE_TYPES, "delay"))
        return MessageKind.DELAY

    # ---- transactions ----------------------------------------------------------------------------------------
    def send_half(self, topic: str, queue_id: int | None, body: bytes, props: dict[str, str], born_ts: int) -> asyncio.Future:
        """Store a half message (``props`` name its producer group, PGROUP): a future of its receipt.

        Waits at the index gate; a half sent again under an id pending in
        the same topic and group answers with the first one's receipt.
        """
        keeper = self._keeper
        if keeper.must_wait():  # right after a start, while the transaction index is built
            return then(keeper.when_ready(lambda: self._send_half(topic, queue_id, body, props, born_ts)),
                           lambda r: r if type(r) is SendReceipt else SendReceipt.of_row(r))
        return self._send_half(topic, queue_id, body, props, born_ts)

    def _send_half(self, topic: str, queue_id: int | None, body: bytes, props: dict[str, str], born_ts: int) -> Any:
        again = self._resent(topic, props)
        if again is not None:
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(again)
            return fut
        return then(self._tx.send_half(topic, queue_id, body, props, born_ts), SendReceipt.of_row)

    def _resent(self, topic: str, props: dict[str, str]) -> SendReceipt | None:
        tx_id = props.get(PROP_UNIQ_KEY)
        if not tx_id:
            return None
        p = self._tx.index.pending.get(tx_id)
        if p is None or p.topic != topic or p.group != props.get(PROP_PGROUP):
            return None
        return SendReceipt(tx_id, topic, p.queue_id, p.half_offset, p.cl_offset, half_offset=p.half_offset, resent=True)

    def end_transaction(self, group: str, tx_id: str, commit_log_offset: int, half_offset: int, state: str,
                        source: str = "producer") -> asyncio.Future:
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
        keeper = self._keeper

        def end() -> Any:
            return self._tx.end_transaction(group, tx_id, commit_log_offset, half_offset, state, source)

        result = keeper.when_ready(end) if keeper.must_wait() else end()
        return then(result, lambda r: EndOutcome.of_reply(tx_id, r))

    async def transaction_ref(self, text: str) -> TxRef | None:
        """The half copy a transaction id names (a protocol whose end of a transaction gives no offsets): None if none.

        A pending transaction's latest copy; a decided one's first (its end
        then answers with the outcome on record). The form
        ``<tx_id>:<commit-log offset>:<half offset>`` names the copy itself;
        it is taken apart only when no transaction has the whole text as its
        id (a native producer may choose ids with colons). Waits at the index
        gate.
        """
        keeper = self._keeper
        if keeper.must_wait():
            await keeper.when_ready(lambda: {})
        index = self._tx.index
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
            rec = self._tx.read_half(dec.origin)
        except TxmqError:
            return None
        return TxRef(text, rec.commit_log_offset, rec.queue_offset)

    # ---- consuming -------------------------------------------------------------------------------------------
    async def pull(self, topic: str, queue_id: int, offset: int, max_count: int, max_bytes: int, wait_ms: int) -> PullResult:
        """A queue's messages from ``offset`` on, waiting up to ``wait_ms`` for the first."""
        return PullResult.of_reply(await self._pull(topic, queue_id, offset, max_count, max_bytes, wait_ms))

    def topic_queues(self, topic: str) -> int | None:
        """The topic's queue count, or None for a topic the broker does not have."""
        return self._topics.queues(topic)

    def now_ms(self) -> int:
        return int(self._clock() * 1000)
