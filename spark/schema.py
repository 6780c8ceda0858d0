"""The two tables of `txmq spark-export`: their schemas and the record kinds.

The column lists are the contract documented in docs/spark.md; keep the two
in step. ``record_kind`` follows the record-kinds table of
docs/store-format.md ("What the transaction records look like").
"""

from __future__ import annotations

from txmq.constants import DISCARD_TOPIC, DISCARD_TOPIC_ALIAS, HALF_TOPIC, OP_TOPIC

# Record kinds (the `kind` column).
NORMAL = "normal"
HALF = "half"
COMMIT = "commit"
OP = "op"
ROLLBACK_OP = "rollback-op"
DISCARD = "discard"
KINDS = (NORMAL, HALF, COMMIT, OP, ROLLBACK_OP, DISCARD)
TX_KINDS = (HALF, COMMIT, OP, ROLLBACK_OP, DISCARD)  # records that belong to a transaction

# Transaction outcomes (the `outcome` column).
COMMITTED = "committed"
ROLLED_BACK = "rolled_back"
PENDING = "pending"
DISCARDED = "discarded"
REPLAYED = "replayed"  # discarded, put back on the half queue, pending again
OUTCOMES = (COMMITTED, ROLLED_BACK, PENDING, DISCARDED, REPLAYED)

_TX_COMMIT = 2  # TxType.COMMIT
_TX_ROLLBACK = 3  # TxType.ROLLBACK
_BY_TOPIC = {HALF_TOPIC: HALF, DISCARD_TOPIC: DISCARD, DISCARD_TOPIC_ALIAS: DISCARD}


def record_kind(topic: str, tx_type: int) -> str:
    """The `kind` of a record, from its topic and tx_type."""
    kind = _BY_TOPIC.get(topic)
    if kind is not None:
        return kind
    if topic == OP_TOPIC:
        return ROLLBACK_OP if tx_type == _TX_ROLLBACK else OP
    return COMMIT if tx_type == _TX_COMMIT else NORMAL


# (name, Spark SQL type, nullable) of each column, in order.
MESSAGE_COLUMNS: tuple[tuple[str, str, bool], ...] = (
    ("commit_log_offset", "bigint", False),
    ("size", "int", False),
    ("topic", "string", False),
    ("queue_id", "int", False),
    ("queue_offset", "bigint", False),
    ("kind", "string", False),
    ("producer_group", "string", True),  # PGROUP
    ("tx_id", "string", True),  # UNIQ_KEY, on transaction records only
    ("real_topic", "string", True),  # REAL_TOPIC
    ("real_queue_id", "int", True),  # REAL_QID
    ("tags", "string", True),  # TAGS
    ("keys", "string", True),  # KEYS
    ("properties", "map<string,string>", False),
    ("body", "binary", False),
    ("born_at", "timestamp", False),
    ("stored_at", "timestamp", False),
    ("check_count", "int", True),  # TRANSACTION_CHECK_TIMES
    ("prepared_offset", "bigint", True),  # -1 in the log reads as null
)

TRANSACTION_COLUMNS: tuple[tuple[str, str, bool], ...] = (
    ("tx_id", "string", False),
    ("producer_group", "string", True),
    ("real_topic", "string", True),
    ("first_half_at", "timestamp", True),
    ("first_half_offset", "bigint", True),
    ("outcome", "string", False),
    ("decided_at", "timestamp", True),
    ("decided_by", "string", True),
    ("checks", "int", False),
    ("time_to_decision_ms", "bigint", True),
    ("committed_offset", "bigint", True),
)

# The transaction life-cycle events (the `transaction_events` table): one row per half, op or discard record.
TX_EVENT_COLUMNS: tuple[tuple[str, str, bool], ...] = (
    ("event", "string", False),  # half | check | replay | commit | rollback | discard
    ("tx_id", "string", True),
    ("producer_group", "string", True),
    ("real_topic", "string", True),
    ("real_queue_id", "int", True),
    ("at", "timestamp", False),  # store time of the record
    ("by", "string", True),  # producer (half, commit, rollback) | check | operator | recovery; null on discard
    ("reason", "string", True),  # a discard's reason: max-checks | retention
    ("checks", "int", True),  # check-backs spent when the record was written
    ("commit_log_offset", "bigint", False),
    ("first_half_offset", "bigint", True),  # the transaction's first half record (null on commit/rollback)
    ("decided_half_offset", "bigint", True),  # commit/rollback: the half copy the decision names
    ("source_topic", "string", False),
    ("queue_offset", "bigint", False),
)
TX_EVENT_FIELDS = tuple(c[0] for c in TX_EVENT_COLUMNS)
TX_EVENTS = ("half", "check", "replay", "commit", "rollback", "discard")

MESSAGE_FIELDS = tuple(c[0] for c in MESSAGE_COLUMNS)
TRANSACTION_FIELDS = tuple(c[0] for c in TRANSACTION_COLUMNS)


def _struct(columns):
    from pyspark.sql.types import (
        BinaryType,
        IntegerType,
        LongType,
        MapType,
        StringType,
        StructField,
        StructType,
        TimestampType,
    )

    types = {
        "bigint": LongType(), "int": IntegerType(), "string": StringType(), "binary": BinaryType(),
        "timestamp": TimestampType(), "map<string,string>": MapType(StringType(), StringType(), False),
    }  # fmt: skip
    return StructType([StructField(name, types[t], nullable) for name, t, nullable in columns])


def messages_schema():
    """The `messages` table as a pyspark StructType (imports pyspark)."""
    return _struct(MESSAGE_COLUMNS)


def transactions_schema():
    """The `transactions` table as a pyspark StructType (imports pyspark)."""
    return _struct(TRANSACTION_COLUMNS)


def tx_events_schema():
    """The `transaction_events` table as a pyspark StructType (imports pyspark)."""
    return _struct(TX_EVENT_COLUMNS)
