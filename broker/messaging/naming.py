"""The topics a consumer group owns, named as RocketMQ names them, and the group names that keep them topic names.

A consumer group's messages to consume again go through its retry topic
``%RETRY%<group>`` (RocketMQ 4's consumers send them back there) and the
messages it gave up on to its dead-letter topic ``%DLQ%<group>``, whichever
front end it consumes through. Both must be topic names (at most 127
characters of ``%|a-zA-Z0-9_-``), so a group name is at most
``MAX_GROUP`` = 127 - len("%RETRY%") = 120 characters: RocketMQ's group
length limit (the limit of a new group's settings too, broker/groupconfig.py).

The characters: RocketMQ's topic and group characters ``%|a-zA-Z0-9_-``,
which RocketMQ 4's broker takes (``bar=True``); RocketMQ 5's gRPC proxy
refuses ``|`` in a resource name, and so do txmq's gRPC consumers.
"""

from __future__ import annotations

import re

from txmq.constants import TOPIC_RE

# The properties of a message sent back for another delivery (RocketMQ's MessageConst names).
PROP_RECONSUME_TIME = "RECONSUME_TIME"  # deliveries before this one
PROP_RETRY_TOPIC = "RETRY_TOPIC"  # the topic it was first sent to
PROP_ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"  # the id of the message a retry copies
PROP_MAX_RECONSUME_TIMES = "MAX_RECONSUME_TIMES"  # deliveries before it goes to the dead-letter topic

MAX_RECONSUME_TIMES = 16  # RocketMQ's default maxReconsumeTimes
RETRY_FIRST_DELAY_LEVEL = 3  # RocketMQ's broker: a consumer's retry waits delay level 3 + its reconsume times

RETRY_PREFIX = "%RETRY%"
DLQ_PREFIX = "%DLQ%"
MAX_TOPIC = 127  # TOPIC_RE's length
MAX_GROUP = MAX_TOPIC - len(RETRY_PREFIX)  # so that %RETRY%<group> (and the shorter %DLQ%<group>) is a topic name
_GROUP_RE = re.compile(rf"^[%a-zA-Z0-9_-]{{1,{MAX_GROUP}}}\Z")  # \Z: `$` would let a trailing newline through


def retry_topic(group: str) -> str:
    return RETRY_PREFIX + group


def dlq_topic(group: str) -> str:
    return DLQ_PREFIX + group


def is_group_name(group: object, *, bar: bool = False) -> bool:
    """Whether group is 1 to MAX_GROUP characters of %a-zA-Z0-9_- (and ``|`` with ``bar``): its retry and dead-letter
    topics are then topic names."""
    if not isinstance(group, str):
        return False
    if bar:
        return 0 < len(group) <= MAX_GROUP and TOPIC_RE.match(RETRY_PREFIX + group) is not None
    return _GROUP_RE.match(group) is not None


def retry_delay_ms(levels_ms: tuple[int, ...], reconsume_times: int, asked_level: int) -> int:
    """How long a message sent back for its ``reconsume_times``-th retry waits: the delay of level ``asked_level``, or of
    level 3 + ``reconsume_times`` when the client asks none (0), as RocketMQ's broker picks it; a level past the table is
    its last (``--message-delay-level``, BrokerConfig.message_delay_levels_ms: the one table of level delays)."""
    level = asked_level if asked_level > 0 else RETRY_FIRST_DELAY_LEVEL + max(reconsume_times, 0)
    return levels_ms[min(level, len(levels_ms)) - 1]
