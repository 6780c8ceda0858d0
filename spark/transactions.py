"""The `transactions` table, built from `messages` rows with Spark (one groupBy/agg).

One row per transaction id. The outcome follows the commit-log order exactly
as ``broker/transactions/index.py`` applies records (so it agrees with `txmq inspect`):

- an op record (kind ``op`` / ``rollback-op``) or a discard decides the
  transaction; a later one overrides an earlier one;
- a half copy after a decision is stale and ignored, except a copy marked
  ``TXMQ_REPLAYED`` after a *discard*, which makes it pending again.

So only the latest decision and the latest replayed copy matter:

==========================  =============================================
latest decision             outcome
==========================  =============================================
none                        ``pending`` (``replayed`` if a copy is marked)
op (commit)                 ``committed``
rollback-op                 ``rolled_back``
discard                     ``replayed`` if a replayed copy comes after
                            it, else ``discarded``
==========================  =============================================
"""

from __future__ import annotations

from txmq.constants import PROP_DECIDED_BY, PROP_DISCARD_REASON, PROP_REPLAYED

from .schema import (
    COMMIT,
    COMMITTED,
    DISCARD,
    DISCARDED,
    HALF,
    OP,
    PENDING,
    REPLAYED,
    ROLLBACK_OP,
    ROLLED_BACK,
    TRANSACTION_FIELDS,
    TX_KINDS,
)


def transactions(messages):
    """The `transactions` DataFrame from a `messages` DataFrame (all records, or only TX_KINDS).

    One groupBy over the transaction records, with conditional aggregates,
    so the log is scanned once and shuffled once (a join of per-kind
    aggregates would scan the source once per kind).
    """
    from pyspark.sql import functions as F

    col = F.col
    props = col("properties")
    off = col("commit_log_offset")
    kind = col("kind")
    is_half = kind == HALF
    is_decision = kind.isin(OP, ROLLBACK_OP, DISCARD)
    by = (
        F.when(kind == DISCARD, F.coalesce(props[PROP_DISCARD_REASON], F.lit("max-checks")))
        .otherwise(F.coalesce(props[PROP_DECIDED_BY], F.lit("producer")))
    )
    decision = F.struct(
        kind.alias("kind"), off.alias("offset"), col("stored_at").alias("at"), by.alias("by"),
        col("producer_group").alias("group"), col("real_topic").alias("topic"), col("check_count").alias("checks"),
    )  # fmt: skip
    half_off = F.when(is_half, off)  # min_by/max_by skip rows whose ordering is null
    per_tx = (
        messages.where(col("tx_id").isNotNull() & kind.isin(*TX_KINDS))
        .groupBy("tx_id")
        .agg(
            F.min_by("producer_group", half_off).alias("h_group"),
            F.min_by("real_topic", half_off).alias("h_topic"),
            F.min_by("stored_at", half_off).alias("first_half_at"),
            F.min(half_off).alias("first_half_offset"),
            F.max(F.when(is_half, col("check_count"))).alias("h_checks"),
            # The mark is on a replay's copy and every later copy of it (the
            # discard it undid, by offset; "1" in logs of older versions).
            F.max(F.when(is_half & props[PROP_REPLAYED].isNotNull(), off)).alias("last_replay"),
            F.max_by(decision, F.when(is_decision, off)).alias("d"),
            F.min(F.when(kind == COMMIT, off)).alias("committed_offset"),
            F.count(F.when(is_half | is_decision, True)).alias("events"),
        )
        .where(col("events") > 0)  # a commit record alone is not a transaction the broker knows
    )
    d = col("d")
    outcome = (
        F.when(d.isNull(), F.when(col("last_replay").isNotNull(), F.lit(REPLAYED)).otherwise(F.lit(PENDING)))
        .when(d["kind"] == OP, F.lit(COMMITTED))
        .when(d["kind"] == ROLLBACK_OP, F.lit(ROLLED_BACK))
        .when(F.coalesce(col("last_replay") > d["offset"], F.lit(False)), F.lit(REPLAYED))
        .otherwise(F.lit(DISCARDED))
    )
    decided = col("outcome").isin(COMMITTED, ROLLED_BACK, DISCARDED)
    return (
        per_tx.withColumn("outcome", outcome)
        .select(
            "tx_id",
            F.coalesce(col("h_group"), d["group"]).alias("producer_group"),
            F.coalesce(col("h_topic"), d["topic"]).alias("real_topic"),
            "first_half_at",
            "first_half_offset",
            "outcome",
            F.when(decided, d["at"]).alias("decided_at"),
            F.when(decided, d["by"]).alias("decided_by"),
            F.coalesce(col("h_checks"), d["checks"], F.lit(0)).cast("int").alias("checks"),
            F.when(decided, F.unix_millis(d["at"]) - F.unix_millis(col("first_half_at"))).alias("time_to_decision_ms"),
            "committed_offset",
        )
        .select(*TRANSACTION_FIELDS)
    )
