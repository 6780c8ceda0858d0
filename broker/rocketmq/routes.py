"""Topics as RocketMQ's clients see them: whether a route exists, and the message types each topic accepts.

- ``route_queues``: QueryRoute and QueryAssignment. A topic the broker
  does not know is TOPIC_NOT_FOUND, as RocketMQ 5's proxy answers a topic
  without a route (status.topic_not_found: TopicRouteService throws
  MQClientException TOPIC_NOT_EXIST, which the proxy answers 40402), so a
  5.x producer's start and a consumer's assignment fail until the topic is
  created (``txmq topics create``). --auto-create-topics does not apply
  here: it is the native and RocketMQ 4 (remoting) front ends' behaviour.
- ``check_receive``: ReceiveMessage on a topic the broker does not know is
  TOPIC_NOT_FOUND.
- ``check_send``: SendMessage. An unknown topic is
  MESSAGE_PROPERTY_CONFLICT_WITH_TYPE with expected type UNSPECIFIED, as
  RocketMQ 5's proxy answers it: ProducerProcessor.sendMessage checks the
  first message's type against the topic's (enableTopicMessageTypeCheck,
  on by default) before it looks the route up, and the type of a topic
  its metadata service does not know is UNSPECIFIED, which
  DefaultTopicMessageTypeValidator refuses whatever the message (the
  SDKs never get there: their route of the topic failed first). Then each
  message's type, derived as
  RocketMQ's proxy derives it (TopicMessageType.parseFromMessageProperty:
  transactional, else a delivery time makes it DELAY, else a message group
  FIFO, else NORMAL), must be one the topic accepts
  (MESSAGE_PROPERTY_CONFLICT_WITH_TYPE otherwise, as the proxy's
  DefaultTopicMessageTypeValidator). Every type a topic accepts is
  delivered: FIFO messages go to their group's queue (broker/fifo.py),
  DELAY messages are scheduled for their delivery_timestamp
  (broker/scheduled/).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from txmq.constants import TOPIC_RE

from .convert import check_group_and_time
from .pb import definition_pb2 as d
from .status import topic_not_found, type_conflict

if TYPE_CHECKING:
    from ..messaging import Messaging

# txmq's names of message types (broker/topics.py) -> RocketMQ's MessageType, in a route's accept_message_types.
PB_TYPES = {"normal": d.NORMAL, "fifo": d.FIFO, "delay": d.DELAY, "transaction": d.TRANSACTION}
# What RocketMQ's proxy takes a topic it does not know to accept (TopicMessageType.UNSPECIFIED): no message's type.
UNKNOWN_TOPIC_TYPES = ("unspecified",)


def route_queues(m: Messaging, topic: str) -> int:
    """The topic's queue count for a route; TOPIC_NOT_FOUND if the broker does not know it (never created here)."""
    n = m.topic_queues(topic)
    if n is None:
        raise topic_not_found(topic)
    return n


def accept_types(m: Messaging, topic: str) -> list[int]:
    """A route's accept_message_types: the topic's message types, in RocketMQ's order (NORMAL, FIFO, DELAY, TRANSACTION)."""
    return [PB_TYPES[t] for t in m.topic_types(topic)]


def check_receive(m: Messaging, topic: str) -> None:
    """A valid topic name the broker does not know (a bad name is the receive's own ILLEGAL_TOPIC)."""
    if TOPIC_RE.match(topic) and m.topic_queues(topic) is None:
        raise topic_not_found(topic)


def message_type(m: d.Message) -> str:
    """The type RocketMQ's proxy gives a message it is sent: transaction, delay, fifo or normal."""
    sp = m.system_properties
    if sp.message_type == d.TRANSACTION:
        return "transaction"
    if sp.HasField("delivery_timestamp") or sp.message_type == d.DELAY:
        return "delay"
    if sp.HasField("message_group") or sp.message_type == d.FIFO:
        return "fifo"
    return "normal"  # a LITE or PRIORITY message was refused before (convert.py: UNSUPPORTED)


def check_send(m: Messaging, topic: str, msgs: Iterable[d.Message]) -> None:
    """The topic exists and accepts each message's type."""
    if m.topic_queues(topic) is None:
        first = next(iter(msgs), None)
        raise type_conflict(UNKNOWN_TOPIC_TYPES, "normal" if first is None else message_type(first))
    accepted = m.topic_types(topic)
    for msg in msgs:
        check_group_and_time(msg.system_properties)  # FIFO and DELAY at once: refused whatever the topic accepts
        kind = message_type(msg)
        if kind not in accepted:
            raise type_conflict(accepted, kind)
