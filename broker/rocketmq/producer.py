"""SendMessage, EndTransaction and RecallMessage, translated into the messaging service's calls (broker/messaging/).

A send becomes ``Messaging.send``, whose planner makes it a normal,
delayed, FIFO or (a TRANSACTION message, alone) half message, with txmq's
limits checked on the way (convert.py), then the topic: TOPIC_NOT_FOUND
if the broker does not know it, and RocketMQ 5's topic types (routes.py). An end transaction becomes
``Messaging.end_transaction``, the same call every front end makes, so one
transaction has one outcome whichever protocol ended it.

Ids (docs/rocketmq.md, "Ids"), as RocketMQ's proxy and broker give them:

- ``message_id``: the SDK's message id is stored as ``UNIQ_KEY``; for a
  transactional message that is txmq's transaction id (``tx_id``), which
  ``txmq inspect half`` and ``txmq resolve`` show and take.
- ``transaction_id`` in a receipt: the message id, for a normal message
  as for a transactional one (RocketMQ's broker answers every send with
  the message's ``UNIQ_KEY`` as its transaction id). EndTransaction finds
  the transaction's half copy by it in the index; it still takes
  ``<tx_id>:<commit-log offset>:<half offset>``, the form txmq gave before
  (broker/transactions/ids.py).
- The producer group is the topic (``PGROUP`` = topic; clients.py).
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING

from txmq.constants import PROP_PGROUP, PROP_TRAN_MSG, is_system_topic
from txmq.wire import ErrorCode, TxmqError

from ..messaging import MAX_NAME, ROCKETMQ5_RULES, Outgoing
from ..topics import check_topic_name

from . import convert, routes
from .pb import definition_pb2 as d
from .pb import service_pb2 as s
from .status import OK_STATUS, Code, RmqError, of_error, ok

if TYPE_CHECKING:
    from ..messaging import Messaging

RECALL_BROKER_NAME = "txmq"  # the broker name in the recall handles this broker gives
MAX_BATCH = 1024  # messages in one SendMessage (txmq's send_batch takes more; RocketMQ's SDKs send a few)


def topic_of(resource: d.Resource, what: str = "topic") -> str:
    """A user topic's name from a Resource, or RmqError(ILLEGAL_TOPIC)."""
    name = resource.name
    if resource.resource_namespace:
        raise RmqError(Code.ILLEGAL_TOPIC, "namespaces (resource_namespace) are not supported by txmq: leave it empty")
    try:
        topic = check_topic_name(name)
    except TxmqError as exc:
        raise RmqError(Code.ILLEGAL_TOPIC, f"{what}: {exc.message}") from None
    if is_system_topic(topic):
        raise RmqError(Code.ILLEGAL_TOPIC, f"topic {topic} is a system topic and cannot be used by clients")
    return topic


async def send_message(messaging: Messaging, req: s.SendMessageRequest) -> s.SendMessageResponse:
    msgs = req.messages
    if not msgs:
        raise RmqError(Code.BAD_REQUEST, "no message to send")
    if len(msgs) > MAX_BATCH:
        raise RmqError(Code.BAD_REQUEST, f"at most {MAX_BATCH} messages in one SendMessage")
    topic = topic_of(msgs[0].topic)
    cfg = messaging.config
    # GZIP bodies are inflated one by one up to --max-body: the batch as a whole is held to --max-frame,
    # as a native send_batch is by its frame (a 4 MB request of 1,024 bombs would inflate to 4 GiB)
    budget = cfg.max_frame
    out = []
    for m in msgs:
        limit = min(cfg.max_body, budget)
        try:
            o = convert.from_message(m, limit, cfg.max_properties)
        except RmqError as exc:
            if exc.code == Code.MESSAGE_BODY_TOO_LARGE and limit < cfg.max_body:
                raise RmqError(Code.MESSAGE_BODY_TOO_LARGE, f"the bodies of one SendMessage exceed {cfg.max_frame} bytes "
                               "(--max-frame), inflated") from None
            raise
        budget -= len(o.body)
        out.append(o)
    if len(msgs) > 1 and any(m.topic.name != msgs[0].topic.name for m in msgs):
        raise RmqError(Code.BAD_REQUEST, "the messages of one SendMessage must have the same topic")
    # after the messages' own checks, as RocketMQ's proxy builds them before it looks the topic up (ProducerProcessor)
    routes.check_send(messaging, topic, msgs)  # TOPIC_NOT_FOUND, the topic's message types (broker/rocketmq/routes.py)
    transactional = any(o.transactional for o in out)
    if transactional and len(out) > 1:
        raise RmqError(Code.BAD_REQUEST, "transactional messages cannot be sent in a batch")
    now = messaging.now_ms()
    items = []
    for o in out:
        props = o.properties
        if o.transactional:  # RocketMQ 5 producers have no group: the topic is it (as RocketMQ's proxy does)
            props = {**props, PROP_TRAN_MSG: "true", PROP_PGROUP: topic}
        items.append(Outgoing(o.body, props, o.born_ts or now))
    receipts = await messaging.send(topic, items, None, ROCKETMQ5_RULES)
    resp = s.SendMessageResponse()
    for r in receipts:
        # RocketMQ: transaction_id is the message's UNIQ_KEY, whatever its type (for a half, its tx_id)
        e = resp.entries.add(status=OK_STATUS, message_id=r.msg_id, transaction_id=r.msg_id, offset=r.queue_offset)
        if r.scheduled:  # RecallMessage takes this back to cancel it
            e.recall_handle = recall_handle(topic, r.deliver_at_ms, r.msg_id)
    resp.status.CopyFrom(OK_STATUS)
    return resp


def recall_handle(topic: str, deliver_at_ms: int, message_id: str) -> str:
    """A scheduled message's recall handle, in RocketMQ's form (RecallMessageHandle.HandleV1: URL-safe Base64 of
    "v1 TOPIC BROKER_NAME DELIVER_MS MESSAGE_ID")."""
    raw = " ".join(("v1", topic, RECALL_BROKER_NAME, str(deliver_at_ms), message_id))
    return base64.urlsafe_b64encode(raw.encode()).decode()


def parse_recall_handle(handle: str) -> tuple[str, str]:
    """(topic, message id) of a recall handle; BAD_REQUEST for one that is not."""
    try:
        items = base64.urlsafe_b64decode(handle.encode() + b"=" * (-len(handle) % 4)).decode().split(" ")
    except (ValueError, UnicodeError):
        items = []
    if len(items) < 5 or items[0] != "v1" or not items[1] or not items[4]:
        raise RmqError(Code.BAD_REQUEST, "recall_handle is not one a SendMessage of a DELAY message answered")
    return items[1], items[4]


async def recall_message(messaging: Messaging, req: s.RecallMessageRequest) -> s.RecallMessageResponse:
    """RocketMQ 5's RecallMessage: cancel a scheduled message by the recall handle its send answered."""
    topic = topic_of(req.topic)
    handle_topic, message_id = parse_recall_handle(req.recall_handle)
    if handle_topic != topic:
        raise RmqError(Code.BAD_REQUEST, f"the recall handle is of topic {handle_topic}, not {topic}")
    await messaging.cancel_scheduled(message_id, topic)
    return s.RecallMessageResponse(status=ok(), message_id=message_id)


def send_failed(req: s.SendMessageRequest, exc: BaseException) -> s.SendMessageResponse:
    """The answer when a send failed: the status in the response and in one entry per message."""
    st = of_error(exc)
    resp = s.SendMessageResponse(status=st)
    for m in req.messages:
        e = resp.entries.add()
        e.status.CopyFrom(st)
        e.message_id = m.system_properties.message_id
    return resp


_STATES = {d.COMMIT: "commit", d.ROLLBACK: "rollback"}


async def end_transaction(messaging: Messaging, req: s.EndTransactionRequest) -> s.EndTransactionResponse:
    topic = topic_of(req.topic)
    state = _STATES.get(req.resolution, "unknown")  # RocketMQ: anything but COMMIT / ROLLBACK leaves it pending
    source = "check" if req.source == d.SOURCE_SERVER_CHECK else "producer"
    text = req.transaction_id or req.message_id
    if not text:
        raise RmqError(Code.INVALID_TRANSACTION_ID, "transaction_id is empty")
    if len(text) > MAX_NAME + 40:  # an id of at most MAX_NAME characters and two offsets of at most 19 digits
        raise RmqError(Code.INVALID_TRANSACTION_ID, f"transaction_id is longer than {MAX_NAME + 40} characters")
    ref = await messaging.transaction_ref(text)
    if ref is None:
        raise RmqError(Code.INVALID_TRANSACTION_ID, f"no transaction {text!r} is known to the broker")
    tx_id = ref.tx_id
    if len(tx_id) > MAX_NAME:  # no transaction has a longer id
        raise RmqError(Code.BAD_REQUEST, f"field 'tx_id' is longer than {MAX_NAME} characters")
    if req.message_id and req.message_id != tx_id:
        raise RmqError(Code.INVALID_TRANSACTION_ID,
                       f"message_id {req.message_id!r} is not the message of transaction_id {req.transaction_id!r}")
    try:
        outcome = await messaging.end_transaction(topic, tx_id, ref.commit_log_offset, ref.half_offset, state, source)
    except TxmqError as exc:
        if exc.code == ErrorCode.TX_GROUP_MISMATCH:
            raise RmqError(Code.INVALID_TRANSACTION_ID, f"transaction {tx_id} was not sent to topic {topic} by a RocketMQ "
                           f"client (its producer group is not the topic): {exc.message}") from None
        if exc.code == ErrorCode.TX_CONFLICT:
            raise RmqError(Code.INVALID_TRANSACTION_ID, exc.message) from None
        raise
    return s.EndTransactionResponse(status=ok(outcome.remark()))
