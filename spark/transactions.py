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


# ---- keeping a transactions table current from the transaction_events stream ---------
KEPT_EXTRA = ("decision_offset", "replay_offset", "d_event", "d_at", "d_by")  # bookkeeping columns of a kept table


def fold_events(events):
    """Per transaction, what a batch of `transaction_events` rows says (one groupBy), in the kept table's columns."""
    from pyspark.sql import functions as F

    col, ev, off = F.col, F.col("event"), F.col("commit_log_offset")
    is_half = ev == "half"
    is_copy = ev.isin("half", "check", "replay")
    is_decision = ev.isin("commit", "rollback", "discard")
    decision = F.struct(ev.alias("event"), off.alias("offset"), col("at").alias("at"),
                        F.coalesce(col("reason"), col("by")).alias("by"))
    return (
        events.where(col("tx_id").isNotNull())
        .groupBy("tx_id")
        .agg(
            F.min_by("producer_group", F.when(is_half, off)).alias("producer_group"),
            F.min_by("real_topic", F.when(is_half, off)).alias("real_topic"),
            F.min_by("at", F.when(is_half, off)).alias("first_half_at"),
            F.min(F.when(is_half, off)).alias("first_half_offset"),
            F.max(F.when(is_copy, col("checks"))).alias("checks"),
            F.max_by(decision, F.when(is_decision, off)).alias("d"),
            F.max(F.when(ev == "replay", off)).alias("replay_offset"),
            F.first(col("producer_group"), ignorenulls=True).alias("any_group"),
            F.first(col("real_topic"), ignorenulls=True).alias("any_topic"),
        )
    )


def current_transactions(spark, events_batch, table: str) -> int:
    """Fold one micro-batch of `transaction_events` into the `transactions` table kept (parquet) at table; its rows.

    Meant for ``foreachBatch`` of a ``table=transaction_events`` stream
    (docs/spark.md has the example). Each transaction's latest decision wins
    by commit-log offset, whatever order the batches bring them in, and
    folding the same batch twice (a batch replayed after a crash) changes
    nothing. The table has the `transactions` columns (``committed_offset``
    stays null: the committed message is not a transaction event) and two
    bookkeeping columns (``KEPT_EXTRA``: the latest decision and replay, which order later updates). It is
    rewritten whole beside ``table`` and renamed into place, so a reader
    never sees half of it: a local or mounted path.
    """
    import os
    import shutil

    from pyspark.sql import functions as F

    col = F.col
    n = fold_events(events_batch).select(
        "tx_id", F.coalesce("producer_group", "any_group").alias("producer_group"),
        F.coalesce("real_topic", "any_topic").alias("real_topic"), "first_half_at", "first_half_offset",
        col("checks").cast("int").alias("checks"), col("d.event").alias("d_event"), col("d.offset").alias("decision_offset"),
        col("d.at").alias("d_at"), col("d.by").alias("d_by"), "replay_offset",
    )
    if os.path.exists(table):
        old = spark.read.parquet(table).select(
            "tx_id", "producer_group", "real_topic", "first_half_at", "first_half_offset", "checks",
            F.when(col("decision_offset").isNotNull(), col("d_event")).alias("d_event"), "decision_offset",
            col("d_at"), col("d_by"), "replay_offset",
        )
        merged = old.unionByName(n).groupBy("tx_id").agg(
            F.min_by("producer_group", F.coalesce("first_half_offset", F.lit(1 << 62))).alias("producer_group"),
            F.min_by("real_topic", F.coalesce("first_half_offset", F.lit(1 << 62))).alias("real_topic"),
            F.min_by("first_half_at", "first_half_offset").alias("first_half_at"),
            F.min("first_half_offset").alias("first_half_offset"),
            F.max("checks").alias("checks"),
            F.max_by("d_event", "decision_offset").alias("d_event"),
            F.max("decision_offset").alias("decision_offset"),
            F.max_by("d_at", "decision_offset").alias("d_at"),
            F.max_by("d_by", "decision_offset").alias("d_by"),
            F.max("replay_offset").alias("replay_offset"),
        )
    else:
        merged = n
    outcome = (
        F.when(col("d_event").isNull(), F.when(col("replay_offset").isNotNull(), F.lit(REPLAYED)).otherwise(F.lit(PENDING)))
        .when(col("d_event") == "commit", F.lit(COMMITTED))
        .when(col("d_event") == "rollback", F.lit(ROLLED_BACK))
        .when(F.coalesce(col("replay_offset") > col("decision_offset"), F.lit(False)), F.lit(REPLAYED))
        .otherwise(F.lit(DISCARDED))
    )
    merged = merged.withColumn("outcome", outcome)
    decided = col("outcome").isin(COMMITTED, ROLLED_BACK, DISCARDED)
    result = merged.select(
        "tx_id", "producer_group", "real_topic", "first_half_at", "first_half_offset", "outcome",
        F.when(decided, col("d_at")).alias("decided_at"), F.when(decided, col("d_by")).alias("decided_by"),
        F.coalesce(col("checks"), F.lit(0)).cast("int").alias("checks"),
        F.when(decided, F.unix_millis(col("d_at")) - F.unix_millis(col("first_half_at"))).alias("time_to_decision_ms"),
        F.lit(None).cast("bigint").alias("committed_offset"),
        "decision_offset", "replay_offset", "d_event", "d_at", "d_by",
    )
    staging = f"{table.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    result.write.mode("overwrite").parquet(staging)
    rows = spark.read.parquet(staging).count()
    old_dir = f"{table.rstrip('/')}.old-{os.getpid()}"
    if os.path.exists(table):
        os.replace(table, old_dir)
    os.replace(staging, table)
    shutil.rmtree(old_dir, ignore_errors=True)
    return rows
