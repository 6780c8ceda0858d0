"""FIFO messages: a message group (``__SHARDINGKEY``), checked, and the queue every message of it goes to.

A message group is stored as RocketMQ's proxy stores it, in the property
``__SHARDINGKEY`` (MessageConst.PROPERTY_SHARDING_KEY), whichever front end
sent it. Its queue is chosen as RocketMQ 5's proxy chooses it
(SendMessageActivity.SendMessageQueueSelector): Guava's
``Hashing.consistentHash(group.hashCode(), queues)``, with Java's
``String.hashCode``. So a group keeps its queue while the topic's queue
count stays, and a topic moved between txmq and RocketMQ places a group in
the same queue id. Consumers of a FIFO group then receive each queue in
order (broker/messaging/consumption.py; docs/rocketmq.md, "FIFO messages").
"""

from __future__ import annotations

from txmq.constants import PROP_DELAY, PROP_SHARDING_KEY, PROP_TRAN_MSG
from txmq.wire import ErrorCode, TxmqError

from .scheduled.timing import TIMER_PROPERTIES, asks_for_time

MAX_GROUP_BYTES = 64  # RocketMQ's proxy: maxMessageGroupSize, a group of this many UTF-8 bytes or more is refused

__all__ = ["MAX_GROUP_BYTES", "PROP_SHARDING_KEY", "group_problem", "java_string_hash", "consistent_hash",
           "queue_of_group", "message_group_of"]


def group_problem(group: str) -> str | None:
    """Why group is not a message group RocketMQ's proxy takes (None when it is one)."""
    if not group or not group.strip():
        return "a message group must not be empty or white space only"
    try:
        size = len(group.encode("utf-8"))
    except UnicodeEncodeError:
        return "a message group must be valid UTF-8 text"
    if size >= MAX_GROUP_BYTES:
        return f"a message group must be shorter than {MAX_GROUP_BYTES} bytes (UTF-8): this one has {size}"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in group):
        return "a message group must not hold control characters"
    return None


def java_string_hash(text: str) -> int:
    """Java's ``String.hashCode``: over UTF-16 code units, 32-bit signed."""
    h = 0
    raw = text.encode("utf-16-be", "surrogatepass")
    for i in range(0, len(raw), 2):
        h = (31 * h + ((raw[i] << 8) | raw[i + 1])) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


_M64 = (1 << 64) - 1


def consistent_hash(key: int, buckets: int) -> int:
    """Guava's ``Hashing.consistentHash(long, int)``: a bucket in [0, buckets) that few keys change when buckets grows."""
    if buckets <= 0:
        raise ValueError("buckets must be positive")
    state = key & _M64
    candidate = 0
    while True:
        state = (2862933555777941757 * state + 1) & _M64  # Guava's LinearCongruentialGenerator
        top = state >> 33
        top = top - (1 << 31) if top & 0x80000000 else top  # (int) (state >>> 33)
        nxt = int((candidate + 1) / ((top + 1) / 2147483648.0))
        if 0 <= nxt < buckets:
            candidate = nxt
        else:
            return candidate


def queue_of_group(group: str, queues: int) -> int:
    """The queue of a topic with ``queues`` queues that the messages of group go to."""
    return consistent_hash(java_string_hash(group), queues)


def message_group_of(props: dict[str, str]) -> str | None:
    """A native send's message group (``__SHARDINGKEY``), checked; None for a message without one.

    A transactional message with a message group is refused, as RocketMQ 5's
    clients refuse it ("Transactional message should not set messageGroup"),
    and so is one with a delivery time (``TIMER_DELIVER_MS``,
    ``TIMER_DELAY_SEC``, ``TIMER_DELAY_MS`` or ``DELAY``): FIFO and DELAY are
    two message types, and RocketMQ 5's clients refuse that pair too.
    """
    group = props.get(PROP_SHARDING_KEY)
    if group is None:
        return None
    problem = group_problem(group)
    if problem is not None:
        raise TxmqError(f"{problem} ({PROP_SHARDING_KEY})", ErrorCode.INVALID_FIELD)
    if props.get(PROP_TRAN_MSG) == "true":
        raise TxmqError("a transactional message cannot have a message group: FIFO and transactional messages are two "
                        "types, as in RocketMQ 5 (its clients refuse the pair)", ErrorCode.INVALID_FIELD)
    if asks_for_time(props):
        timed = next((k for k in (*TIMER_PROPERTIES, PROP_DELAY) if k in props), "a schedule property")
        raise TxmqError(f"a message with a message group ({PROP_SHARDING_KEY}) cannot also have a delivery time ({timed}): "
                        "FIFO and delayed messages are two types, as in RocketMQ 5 (its clients refuse the pair)",
                        ErrorCode.INVALID_FIELD)
    return group


def pick_group_queue(topics, topic: str, group: str, queue_id: int | None) -> int:
    """The queue of a native FIFO send: the group's, in a topic that accepts FIFO messages.

    A topic a FIFO send creates (auto-creation on) accepts normal, FIFO and
    transactional messages; an existing topic must list ``fifo`` in its
    message types (``txmq topics update T --message-types ...``), as RocketMQ
    requires of a topic. A ``queue_id`` given with a message group must be
    the group's queue.
    """
    from txmq.constants import DEFAULT_MESSAGE_TYPES, MESSAGE_TYPES

    n = topics.queues(topic)
    if n is None:
        if not topics.auto_create:
            topics.pick_queue(topic, None, "fifo")  # raises NO_SUCH_TOPIC, worded as for any send
        kinds = set(DEFAULT_MESSAGE_TYPES) | {"fifo"}
        n, _ = topics.ensure(topic, None, tuple(t for t in MESSAGE_TYPES if t in kinds))
    types = topics.message_types(topic)
    if "fifo" not in types:
        raise TxmqError(f"topic {topic} does not accept fifo messages (a message group): it accepts {', '.join(types)} "
                        f"(txmq topics update {topic} --message-types {','.join(t for t in MESSAGE_TYPES if t in types or t == 'fifo')})",
                        ErrorCode.MESSAGE_TYPE_NOT_ACCEPTED, topic=topic, message_type="fifo", message_types=list(types))
    qid = queue_of_group(group, n)
    if queue_id is not None and queue_id >= 0 and queue_id != qid:
        raise TxmqError(f"queue {queue_id} is not the queue of message group {group!r} (queue {qid} of topic {topic}): "
                        "leave the queue out, the group chooses it", ErrorCode.INVALID_FIELD)
    return qid
