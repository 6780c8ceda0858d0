"""Names shared by the broker, the client, the CLI and the Spark reader.

Topic and property names follow RocketMQ's so that operators who know it
recognise them (docs/transactions.md, "The system topics").
"""

from __future__ import annotations

import re

HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
OP_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
OP_TAG = "d"
DISCARD_TOPIC = "TRANS_CHECK_MAX_TIME_TOPIC"
# RocketMQ's logs (and the seeds) spell it this way; accepted wherever a topic is named.
DISCARD_TOPIC_ALIAS = "TRANS_CHECK_MAXTIME_TOPIC"

# Message properties.
PROP_TRAN_MSG = "TRAN_MSG"
PROP_PGROUP = "PGROUP"
PROP_REAL_TOPIC = "REAL_TOPIC"
PROP_REAL_QID = "REAL_QID"
PROP_UNIQ_KEY = "UNIQ_KEY"
PROP_CHECK_TIMES = "TRANSACTION_CHECK_TIMES"
PROP_CHECK_IMMUNITY = "CHECK_IMMUNITY_TIME_IN_SECONDS"
PROP_PREPARED_QUEUE_OFFSET = "TRAN_PREPARED_QUEUE_OFFSET"
PROP_TAGS = "TAGS"
PROP_KEYS = "KEYS"
PROP_DELAY = "DELAY"
PROP_SHARDING_KEY = "__SHARDINGKEY"  # a FIFO message's message group (RocketMQ's MessageConst.PROPERTY_SHARDING_KEY)
# RocketMQ's broker setting messageDelayLevel, its default: the delay of each level, DELAY=1 ... DELAY=18.
MESSAGE_DELAY_LEVEL = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
# txmq's own additions (prefixed so they never collide with user properties).
PROP_DECIDED_BY = "TXMQ_DECIDED_BY"  # producer | check | operator, on op records
PROP_HALF_CL_OFFSET = "TXMQ_HALF_CL_OFFSET"  # on op records: commit-log offset of the decided half copy
PROP_ORIGIN_CL_OFFSET = "TXMQ_ORIGIN_CL_OFFSET"  # on check copies / discards: the first half record
PROP_DISCARD_REASON = "TXMQ_DISCARD_REASON"  # max-checks | retention
PROP_REPLAYED = "TXMQ_REPLAYED"  # on a half copy put back from the discard topic, and on the op record of a replay to commit

# Delayed and timed messages (docs/scheduled.md). RocketMQ's property names (MessageConst): a send carrying one
# of the first four is scheduled; the delivered message carries TIMER_DELIVER_MS (its due time, epoch ms),
# TIMER_ENQUEUE_MS (when it was stored) and TIMER_DEQUEUE_MS (when it was delivered).
SCHEDULE_TOPIC = "RMQ_SYS_TXMQ_TIMER"
PROP_TIMER_DELIVER_MS = "TIMER_DELIVER_MS"
PROP_TIMER_DELAY_SEC = "TIMER_DELAY_SEC"
PROP_TIMER_DELAY_MS = "TIMER_DELAY_MS"
PROP_TIMER_ENQUEUE_MS = "TIMER_ENQUEUE_MS"
PROP_TIMER_DEQUEUE_MS = "TIMER_DEQUEUE_MS"
PROP_TIMER_OUT_MS = "TIMER_OUT_MS"  # on the scheduled record: its due time, as RocketMQ's timer topic records carry it
PROP_SCHEDULED_FROM = "TXMQ_SCHEDULED_FROM"  # on a delivered message: the commit-log offset of its scheduled record
PROP_SCHEDULE_CANCEL = "TXMQ_SCHEDULE_CANCEL"  # on a cancel record: the commit-log offset of the scheduled record

SYSTEM_TOPICS = frozenset({HALF_TOPIC, OP_TOPIC, DISCARD_TOPIC})

# The message types a topic may accept (RocketMQ's: NORMAL, FIFO, DELAY, TRANSACTION), in this order everywhere,
# and what a topic accepts unless created or updated with others: what every topic accepted before topics had types.
MESSAGE_TYPES = ("normal", "fifo", "delay", "transaction")
DEFAULT_MESSAGE_TYPES = ("normal", "transaction")

TOPIC_RE = re.compile(r"^[%|a-zA-Z0-9_-]{1,127}\Z")  # \Z: `$` would let a trailing newline through

DEFAULT_PORT = 10911
DEFAULT_HOST = "127.0.0.1"
DEFAULT_QUEUES = 4
# Where the broker listens, and the client and the CLI connect, when no address is given.
DEFAULT_ADDRESS = f"{DEFAULT_HOST}:{DEFAULT_PORT}"


def canonical_topic(name: str) -> str:
    """Map the discard topic's alias to its real name; other names unchanged."""
    return DISCARD_TOPIC if name == DISCARD_TOPIC_ALIAS else name


def is_system_topic(name: str) -> bool:
    name = canonical_topic(name)
    return name in SYSTEM_TOPICS or name.startswith("RMQ_SYS_")
