"""Topics as RocketMQ's clients see them: whether a route exists, and the message types each topic accepts.

- ``route_queues``: QueryRoute and QueryAssignment. A topic the broker
  does not know is created when it auto-creates topics (the default, as a
  first send would), so that a consumer's receives find it and long-poll;
  otherwise TOPIC_NOT_FOUND, as RocketMQ's proxy answers a topic without a
  route (status.topic_not_found).
- ``check_receive``: ReceiveMessage on a topic the broker does not know is
  TOPIC_NOT_FOUND, whatever auto-creation says (the route came first).
- ``check_send``: SendMessage. TOPIC_NOT_FOUND for an unknown topic when
  topics are not auto-created; then each message's type, derived as
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
    from txmq.broker.core import BrokerCore

# txmq's names of message types (broker/topics.py) -> RocketMQ's MessageType, in a route's accept_message_types.
PB_TYPES = {"normal": d.NORMAL, "fifo": d.FIFO, "delay": d.DELAY, "transaction": d.TRANSACTION}


def route_queues(core: BrokerCore, topic: str) -> int:
    """The topic's queue count for a route: created now if unknown and topics are auto-created, else TOPIC_NOT_FOUND."""
    n = core.topics.queues(topic)
    if n is None:
        if not core.topics.auto_create:
            raise topic_not_found(topic)
        n, _ = core.topics.ensure(topic)
    return n


def accept_types(core: BrokerCore, topic: str) -> list[int]:
    """A route's accept_message_types: the topic's message types, in RocketMQ's order (NORMAL, FIFO, DELAY, TRANSACTION)."""
    return [PB_TYPES[t] for t in core.topics.message_types(topic)]


def check_receive(core: BrokerCore, topic: str) -> None:
    """A valid topic name the broker does not know (a bad name is the receive's own ILLEGAL_TOPIC)."""
    if TOPIC_RE.match(topic) and core.topics.queues(topic) is None:
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
    return "normal"  # a LITE or PRIORITY message is refused later (convert.py: UNSUPPORTED)


def check_send(core: BrokerCore, topic: str, msgs: Iterable[d.Message]) -> None:
    """The topic exists (or will be created by the send) and accepts each message's type."""
    if core.topics.queues(topic) is None and not core.topics.auto_create:
        raise topic_not_found(topic)
    accepted = core.topics.message_types(topic)
    for m in msgs:
        check_group_and_time(m.system_properties)  # FIFO and DELAY at once: refused whatever the topic accepts
        kind = message_type(m)
        if kind not in accepted:
            raise type_conflict(accepted, kind)
