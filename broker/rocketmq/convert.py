"""Stored txmq messages <-> RocketMQ 5 ``Message`` protos (apache.rocketmq.v2, definition.proto).

One place for the mapping, used by the producer side (SendMessage, the
check-back push) and the receive side (ReceiveMessage):

| RocketMQ ``Message``                        | txmq record                                          |
| ------------------------------------------- | ---------------------------------------------------- |
| ``topic.name``                              | topic (a transaction's real topic, ``REAL_TOPIC``)   |
| ``system_properties.message_id``            | ``UNIQ_KEY`` (else ``msg_id``: the commit-log offset in 16 hex digits) |
| ``system_properties.tag``                   | ``TAGS``                                             |
| ``system_properties.keys``                  | ``KEYS`` (joined with a space, as RocketMQ does)     |
| ``system_properties.born_timestamp``        | ``born_ts`` (ms)                                     |
| ``system_properties.store_timestamp``       | ``store_ts`` (ms)                                    |
| ``system_properties.queue_id`` / ``queue_offset`` | queue id / queue offset (``REAL_QID`` for a half) |
| ``system_properties.message_type``          | TRANSACTION for a transactional message (half, or committed), DELAY for one with ``TIMER_DELIVER_MS`` or ``DELAY``, FIFO for one with a message group, else NORMAL |
| ``system_properties.message_group``         | ``__SHARDINGKEY`` (a FIFO message's group, as RocketMQ's proxy stores it) |
| ``system_properties.delivery_timestamp``    | ``TIMER_DELIVER_MS`` (a DELAY message's delivery time) |
| ``system_properties.orphaned_transaction_recovery_duration`` | ``CHECK_IMMUNITY_TIME_IN_SECONDS`` |
| ``system_properties.body_digest``           | CRC32 of the body (see ``body_digest``)              |
| ``user_properties``                         | every other property but RocketMQ's broker's system properties (MessageConst.STRING_HASH_SET) and txmq's ``TXMQ_`` ones, as RocketMQ's proxy delivers them: so also ``__SHARDINGKEY`` (a FIFO message's group), ``CHECK_IMMUNITY_TIME_IN_SECONDS``, ``TRANSACTION_CHECK_TIMES`` when the message has them. A send may set none of RocketMQ's or txmq's property names (``SYSTEM_PROPERTIES``) |
| ``user_properties["__transactionId__"]``    | ``UNIQ_KEY`` of a transactional message (half, or committed): its transaction id, as RocketMQ's broker stores it on the half message and keeps it on the committed one |

A send whose type the topic does not accept is refused before this module
sees it (routes.py: MESSAGE_PROPERTY_CONFLICT_WITH_TYPE). A DELAY message's
``delivery_timestamp`` becomes ``TIMER_DELIVER_MS``, which the core's send
schedules (broker/scheduled/); a delivered one shows it again as
``delivery_timestamp`` with message type DELAY. A message group (FIFO) is
checked as RocketMQ's proxy checks it (ILLEGAL_MESSAGE_GROUP) and stored as
``__SHARDINGKEY``; a transactional message with a group or a delivery time
is refused, and so is a message with both a group and a delivery time
(MESSAGE_PROPERTY_CONFLICT_WITH_TYPE), as RocketMQ 5's clients refuse these
pairs. Lite topics and priorities are refused with RocketMQ's UNSUPPORTED
code: txmq does not deliver them.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Any, Mapping

from ..fifo import group_problem
from ..messaging import CheckBack, Record
from ..records import msg_id_of
from txmq.constants import (
    PROP_CHECK_IMMUNITY,
    PROP_CHECK_TIMES,
    PROP_DELAY,
    PROP_KEYS,
    PROP_PGROUP,
    PROP_PREPARED_QUEUE_OFFSET,
    PROP_REAL_QID,
    PROP_REAL_TOPIC,
    PROP_SHARDING_KEY,
    PROP_TAGS,
    PROP_TIMER_DELIVER_MS,
    PROP_TRAN_MSG,
    PROP_UNIQ_KEY,
)

from .pb import definition_pb2 as d
from .status import Code, RmqError, unsupported

KEY_SEPARATOR = " "  # RocketMQ joins a message's keys with a space in its KEYS property
TXMQ_PREFIX = "TXMQ_"
# RocketMQ's MessageConst.PROPERTY_TRANSACTION_ID. Its broker stores it on a half message (the UNIQ_KEY)
# and the commit keeps it; not being one of MessageConst's system properties, its proxy delivers it as a
# user property, where SDK applications read the transaction id of what they consume.
TRANSACTION_ID_PROPERTY = "__transactionId__"

# Property names a client may not set as user properties: txmq's (docs/transactions.md)
# and RocketMQ's own system properties (MessageConst), which the broker or the
# SDK's system_properties own. They are not delivered as user properties either.
SYSTEM_PROPERTIES = frozenset({
    PROP_TRAN_MSG, PROP_PGROUP, PROP_REAL_TOPIC, PROP_REAL_QID, PROP_UNIQ_KEY, PROP_CHECK_TIMES, PROP_CHECK_IMMUNITY,
    PROP_PREPARED_QUEUE_OFFSET, PROP_TAGS, PROP_KEYS, PROP_DELAY,
    "WAIT", "MSG_REGION", "TRACE_ON", "RETRY_TOPIC", "ORIGIN_MESSAGE_ID", "RECONSUME_TIME", "MAX_RECONSUME_TIMES",
    "MIN_OFFSET", "MAX_OFFSET", "BUYER_ID", "CORRECTION_FLAG", "MQ2_FLAG", "TRANSFER_FLAG", "CLUSTER",
    "__SHARDINGKEY", "__STARTDELIVERTIME", "TIMER_DELIVER_MS", "TIMER_DELAY_SEC", "TIMER_DELAY_MS", "TIMER_OUT_MS",
    "TIMER_ENQUEUE_MS", "TIMER_DEQUEUE_MS", "TIMER_ROLL_TIMES", "__BORNHOST", "INNER_NUM", "INNER_MULTI_DISPATCH",
    "INNER_MULTI_QUEUE_OFFSET", "POP_CK", "POP_CK_OFFSET", "1ST_POP_TIME", "TRACE_CONTEXT", "__RECALL_HANDLE",
    "__PRIORITY", "__LITE_TOPIC",
})



# What RocketMQ's proxy leaves out of a delivered message's user_properties (GrpcConverter.buildUserAttributes): its
# broker's system properties, MessageConst.STRING_HASH_SET, and nothing else. So __SHARDINGKEY (a FIFO message's
# group, also system_properties.message_group), CHECK_IMMUNITY_TIME_IN_SECONDS and TRANSACTION_CHECK_TIMES (on a
# transactional message that has them), TRACE_CONTEXT and the like are delivered as user properties, though a
# send may not set them (SYSTEM_PROPERTIES). txmq's own TXMQ_ properties are left out too. DLQ_ORIGIN_TOPIC and
# DLQ_ORIGIN_MESSAGE_ID, which the newest proxies move into system_properties.dead_letter_queue, stay user
# properties here, where the SDKs before it read them.
HIDDEN_ON_DELIVERY = frozenset({
    "TRACE_ON", "MSG_REGION", PROP_KEYS, PROP_TAGS, "WAIT", PROP_DELAY, "RETRY_TOPIC", PROP_REAL_TOPIC, PROP_REAL_QID,
    PROP_TRAN_MSG, PROP_PGROUP, "MIN_OFFSET", "MAX_OFFSET", "BUYER_ID", "ORIGIN_MESSAGE_ID", "TRANSFER_FLAG",
    "CORRECTION_FLAG", "MQ2_FLAG", "RECONSUME_TIME", PROP_UNIQ_KEY, "MAX_RECONSUME_TIMES", "CONSUME_START_TIME",
    "POP_CK", "POP_CK_OFFSET", "1ST_POP_TIME", PROP_PREPARED_QUEUE_OFFSET, "DUP_INFO", "EXTEND_UNIQ_INFO",
    "INSTANCE_ID", "CORRELATION_ID", "REPLY_TO_CLIENT", "TTL", "ARRIVE_TIME", "PUSH_REPLY_TIME", "CLUSTER", "MSG_TYPE",
    "INNER_MULTI_QUEUE_OFFSET", "TIMER_DELAY_MS", "TIMER_DELAY_SEC", "TIMER_DELIVER_MS", "TIMER_ENQUEUE_MS",
    "TIMER_DEQUEUE_MS", "TIMER_ROLL_TIMES", "TIMER_OUT_MS", "TIMER_DEL_UNIQKEY", "TIMER_DELAY_LEVEL", "__BORNHOST",
    "BORN_TIMESTAMP", "__CRC32#",
})


# White space (str.isspace's: re's \s is the same Unicode class) or NUL, refused in keys and message ids.
_SPACE_OR_NUL = re.compile(r"[\s\0]")


def is_system_property(name: str) -> bool:
    """A name a send may not use as a user property."""
    return name in SYSTEM_PROPERTIES or name.startswith(TXMQ_PREFIX)


def is_hidden_on_delivery(name: str) -> bool:
    """A stored property a delivered message does not carry in its user_properties (as RocketMQ's proxy delivers it)."""
    return name in HIDDEN_ON_DELIVERY or name.startswith(TXMQ_PREFIX)


# ---- delivery: stored record -> Message --------------------------------------------
def body_digest(body: bytes, language: int = d.LANGUAGE_UNSPECIFIED) -> d.Digest:
    """The CRC32 body digest in the form the client's SDK compares it in.

    RocketMQ's SDKs check a delivered body against ``body_digest`` and
    count a mismatch as a corrupted message, but they do not write the CRC32
    the same way: the Java SDK (and RocketMQ's own tools) as upper-case hex
    without leading zeros (``Long.toHexString``), the Python SDK as 8
    upper-case hex digits, the Node.js SDK in decimal, the Go SDK as
    lower-case hex without leading zeros. The client's language comes from
    its Telemetry settings (``user_agent.language``); unknown clients get
    the Java form.
    """
    crc = zlib.crc32(body) & 0xFFFFFFFF
    if language == d.PYTHON:
        text = f"{crc:08X}"
    elif language == d.NODE_JS:
        text = str(crc)
    elif language == d.GOLANG:
        text = f"{crc:x}"
    else:
        text = f"{crc:X}"
    return d.Digest(type=d.CRC32, checksum=text)


def user_properties(props: Mapping[str, str]) -> dict[str, str]:
    """A delivered message's user_properties, from its stored properties."""
    return {k: v for k, v in props.items() if not is_hidden_on_delivery(k)}


def message_type_of(props: Mapping[str, str], prepared_offset: int = -1) -> int:
    """TRANSACTION for a half message or a committed transactional message (it keeps its half offset), DELAY for a
    delayed or timed one (``TIMER_DELIVER_MS`` or ``DELAY``, as RocketMQ's proxy reads them), else NORMAL."""
    if props.get(PROP_TRAN_MSG) == "true" or PROP_PREPARED_QUEUE_OFFSET in props or prepared_offset >= 0:
        return d.TRANSACTION
    if PROP_TIMER_DELIVER_MS in props or PROP_DELAY in props:
        return d.DELAY
    return d.NORMAL


def to_message(
    topic: str,
    queue_id: int,
    queue_offset: int | None,
    message_id: str,
    born_ts: int,
    store_ts: int | None,
    props: Mapping[str, str],
    body: bytes,
    *,
    message_type: int | None = None,
    language: int = d.LANGUAGE_UNSPECIFIED,
    store_host: str = "",
    delivery_attempt: int | None = None,
    receipt_handle: str | None = None,
    invisible_duration_ms: int | None = None,
) -> d.Message:
    """A RocketMQ ``Message`` for one stored message (its real topic and queue for a half message)."""
    msg = d.Message(body=bytes(body))
    msg.topic.name = topic
    for k, v in props.items():
        if not is_hidden_on_delivery(k):
            msg.user_properties[k] = v
    sp = msg.system_properties
    sp.message_id = message_id
    tag = props.get(PROP_TAGS)
    if tag:
        sp.tag = tag
    keys = props.get(PROP_KEYS)
    if keys:
        sp.keys.extend(k for k in keys.split(KEY_SEPARATOR) if k)
    sp.body_digest.CopyFrom(body_digest(msg.body, language))
    sp.body_encoding = d.IDENTITY
    sp.message_type = message_type_of(props) if message_type is None else message_type
    group = props.get(PROP_SHARDING_KEY)
    if group:
        sp.message_group = group
        if sp.message_type == d.NORMAL:
            sp.message_type = d.FIFO
    if sp.message_type == d.TRANSACTION:
        tx_id = props.get(PROP_UNIQ_KEY)
        if tx_id:
            msg.user_properties[TRANSACTION_ID_PROPERTY] = tx_id
    sp.born_timestamp.FromMilliseconds(_proto_ms(born_ts))  # a native producer may have said anything
    if store_ts is not None:
        sp.store_timestamp.FromMilliseconds(_proto_ms(store_ts))
    deliver_ms = props.get(PROP_TIMER_DELIVER_MS)
    if deliver_ms:
        try:
            sp.delivery_timestamp.FromMilliseconds(_proto_ms(int(deliver_ms)))
        except ValueError:
            pass
    if store_host:
        sp.store_host = store_host
    sp.queue_id = int(queue_id)
    if queue_offset is not None:
        sp.queue_offset = int(queue_offset)
    immunity = props.get(PROP_CHECK_IMMUNITY)
    if immunity:
        try:
            sp.orphaned_transaction_recovery_duration.seconds = int(immunity)
        except ValueError:
            pass
    if delivery_attempt is not None:
        sp.delivery_attempt = int(delivery_attempt)
    if receipt_handle is not None:
        sp.receipt_handle = receipt_handle
    if invisible_duration_ms is not None:
        sp.invisible_duration.FromMilliseconds(int(invisible_duration_ms))
    return msg


def record_to_message(rec: Record, **kw: Any) -> d.Message:
    """A RocketMQ ``Message`` for a record read from a consume queue (what ReceiveMessage delivers).

    ``kw``: ``language``, ``store_host``, ``delivery_attempt``,
    ``receipt_handle``, ``invisible_duration_ms`` as for ``to_message``.
    """
    props = rec.properties
    message_id = msg_id_of(rec)
    return to_message(rec.topic, rec.queue_id, rec.queue_offset, message_id, rec.born_ts, rec.store_ts, props, rec.body,
                      message_type=message_type_of(props, rec.prepared_offset), **kw)


def half_to_message(cb: CheckBack, **kw: Any) -> d.Message:
    """The message of a check-back as its producer sent it: real topic and queue, the transaction id as its message id."""
    return to_message(cb.topic, cb.queue_id, None, cb.tx_id, cb.born_ts, cb.store_ts, cb.properties, cb.body,
                      message_type=d.TRANSACTION, **kw)


# ---- sending: Message -> what the core stores ---------------------------------------
@dataclass(slots=True)
class Outgoing:
    """One message of a SendMessage request, checked, as txmq's send handler takes it."""

    topic: str
    body: bytes
    properties: dict[str, str]
    born_ts: int | None
    transactional: bool
    message_id: str  # "" when the client gave none: txmq names the message
    message_group: str | None = None  # a FIFO message's group (also in properties as __SHARDINGKEY)


def from_message(msg: d.Message, max_body: int, max_properties: int) -> Outgoing:
    """Check one message of a SendMessage request and turn it into txmq's properties.

    Raises RmqError with RocketMQ's code for what is wrong (the limits are
    txmq's: --max-body, --max-properties).
    """
    sp = msg.system_properties
    check_group_and_time(sp)
    group = _message_group(sp)
    if sp.HasField("lite_topic") or sp.message_type == d.LITE:
        raise unsupported("lite topics")
    if sp.HasField("priority") or sp.message_type == d.PRIORITY:
        raise unsupported("message priorities")
    if sp.message_type not in (d.MESSAGE_TYPE_UNSPECIFIED, d.NORMAL, d.FIFO, d.DELAY, d.TRANSACTION):
        raise unsupported(f"message type {sp.message_type}")
    body = _body(msg, max_body)
    if not body:
        raise RmqError(Code.MESSAGE_BODY_EMPTY, "the message body is empty")
    props: dict[str, str] = {}
    for k, v in msg.user_properties.items():
        if not k:
            raise RmqError(Code.ILLEGAL_MESSAGE_PROPERTY_KEY, "a user property name is empty")
        if is_system_property(k):
            raise RmqError(Code.ILLEGAL_MESSAGE_PROPERTY_KEY, f"user property {k!r} is a reserved system property name")
        props[k] = v
    if sp.HasField("tag"):
        tag = sp.tag
        if not tag.strip() or "|" in tag or any(c in tag for c in "\r\n\t\0"):
            raise RmqError(Code.ILLEGAL_MESSAGE_TAG, f"tag {tag!r} must be non-blank, without '|' or control characters")
        props[PROP_TAGS] = tag
    if sp.keys:
        for k in sp.keys:
            if not k or _SPACE_OR_NUL.search(k):
                raise RmqError(Code.ILLEGAL_MESSAGE_KEY, f"key {k!r} must be non-blank and hold no white space")
        props[PROP_KEYS] = KEY_SEPARATOR.join(sp.keys)
    message_id = sp.message_id
    if message_id:
        if len(message_id) > 128 or _SPACE_OR_NUL.search(message_id):
            raise RmqError(Code.ILLEGAL_MESSAGE_ID, "message_id must be at most 128 characters, without white space")
        props[PROP_UNIQ_KEY] = message_id
    transactional = sp.message_type == d.TRANSACTION
    if group is not None:
        props[PROP_SHARDING_KEY] = group
    if sp.HasField("delivery_timestamp"):
        if transactional:  # as RocketMQ's clients refuse it before sending
            raise RmqError(Code.BAD_REQUEST, "a transactional message cannot have a delivery_timestamp")
        props[PROP_TIMER_DELIVER_MS] = str(delivery_ms(sp.delivery_timestamp))
    elif sp.message_type == d.DELAY:
        raise RmqError(Code.ILLEGAL_DELIVERY_TIME, "a DELAY message needs a delivery_timestamp")
    if sp.HasField("orphaned_transaction_recovery_duration"):
        seconds = sp.orphaned_transaction_recovery_duration.seconds
        if transactional and seconds > 0:
            props[PROP_CHECK_IMMUNITY] = str(seconds)
    size = sum(len(k.encode()) + len(v.encode()) for k, v in props.items())
    if size > max_properties:
        raise RmqError(Code.MESSAGE_PROPERTIES_TOO_LARGE,
                       f"properties of {size} bytes (keys and values, UTF-8) exceed the {max_properties}-byte limit")
    if len(props) > 256:
        raise RmqError(Code.MESSAGE_PROPERTIES_TOO_LARGE, "at most 256 properties")
    try:
        born = sp.born_timestamp.ToMilliseconds() if sp.HasField("born_timestamp") else None
    except ValueError:  # seconds or nanos outside what a protobuf Timestamp allows
        raise RmqError(Code.BAD_REQUEST, "born_timestamp is not a valid timestamp (years 1 to 9999)") from None
    return Outgoing(msg.topic.name, body, props, born if born and born > 0 else None, transactional, message_id, group)


def check_group_and_time(sp: d.SystemProperties) -> None:
    """A message is FIFO (a message group) or DELAY (a delivery time), never both: RocketMQ 5's clients refuse the pair.

    Checked before the topic's message types (routes.check_send), so the
    sender learns of the pair rather than of one of its two types.
    """
    fifo = sp.HasField("message_group") or sp.message_type == d.FIFO
    delay = sp.HasField("delivery_timestamp") or sp.message_type == d.DELAY
    if fifo and delay:
        raise RmqError(Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE, "a message cannot have both a message group (FIFO) and a "
                       "delivery time (DELAY): they are two message types, and RocketMQ 5's clients refuse the pair too")


def _message_group(sp: d.SystemProperties) -> str | None:
    """A FIFO message's group, checked as RocketMQ's proxy checks it (SendMessageActivity.validateMessageGroup)."""
    if not sp.HasField("message_group"):
        if sp.message_type == d.FIFO:
            raise RmqError(Code.ILLEGAL_MESSAGE_GROUP, "a FIFO message needs a message group (message_group)")
        return None
    group = sp.message_group
    if sp.message_type == d.TRANSACTION:
        raise RmqError(Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE, "a transactional message cannot have a message group: "
                       "FIFO and transactional are two message types (RocketMQ 5's clients refuse the pair too)")
    problem = group_problem(group)
    if problem is not None:
        raise RmqError(Code.ILLEGAL_MESSAGE_GROUP, problem)
    return group


# What a protobuf Timestamp holds (0001-01-01 to 9999-12-31); FromMilliseconds refuses the rest.
_PROTO_MS_MAX = 253_402_300_799_999
_PROTO_S_MAX = _PROTO_MS_MAX // 1000


def delivery_ms(ts: Any) -> int:
    """A send's delivery_timestamp in epoch ms.

    RocketMQ's Python SDK (5.1.2) writes the time in milliseconds into the
    Timestamp's ``seconds``: a value past year 9999 that no valid Timestamp
    holds, so such a ``seconds`` (with no nanos) is read as milliseconds.
    Anything else out of a Timestamp's range is ILLEGAL_DELIVERY_TIME.
    """
    seconds, nanos = ts.seconds, ts.nanos
    if seconds > _PROTO_S_MAX and nanos == 0 and seconds <= _PROTO_MS_MAX:
        return seconds
    if not (0 <= seconds <= _PROTO_S_MAX) or not (0 <= nanos < 1_000_000_000):
        raise RmqError(Code.ILLEGAL_DELIVERY_TIME, "delivery_timestamp is not a valid timestamp (1970 to 9999)")
    return seconds * 1000 + nanos // 1_000_000


def _proto_ms(ms: int) -> int:
    """A record's time for a protobuf Timestamp: clamped to 1970 .. 9999 (a message is never refused for it)."""
    return min(max(0, int(ms)), _PROTO_MS_MAX)


def _body(msg: d.Message, max_body: int) -> bytes:
    body = msg.body
    enc = msg.system_properties.body_encoding
    if enc == d.GZIP:
        inflater = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib header
        try:
            out = inflater.decompress(body, max_body + 1)
        except zlib.error as exc:
            raise RmqError(Code.BAD_REQUEST, f"the GZIP body cannot be inflated ({exc})") from None
        if len(out) > max_body or inflater.unconsumed_tail:
            raise RmqError(Code.MESSAGE_BODY_TOO_LARGE, f"the inflated body exceeds the {max_body}-byte limit")
        return out
    if enc not in (d.ENCODING_UNSPECIFIED, d.IDENTITY):
        raise unsupported(f"body encoding {enc}")
    if len(body) > max_body:
        raise RmqError(Code.MESSAGE_BODY_TOO_LARGE, f"body of {len(body)} bytes exceeds the {max_body}-byte limit")
    return body
