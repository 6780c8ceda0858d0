"""The `txmq` Spark source through a broker: batch and streaming reads over the wire protocol.

One broker process serves the data directory of test_spark's scenario (every
record kind, every transaction outcome); the reads through it must give the
rows the data-directory mode gives, and the bad cases must be clear errors.
One SparkSession (local[2]) for the module.
"""

from __future__ import annotations

import time

import pytest

from brokerproc import BrokerProcess, free_port
from test_spark import EXPECTED, run_scenario

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("sparkbroker") / "data"
    sent = run_scenario(d, plain=9)
    with BrokerProcess(d, "--check-interval", "1d") as b:  # no check pass adds copies while the tests read
        yield d, sent, b


def through(spark, address: str, **options):
    return spark.read.format("txmq").option("broker", address).options(**options).load()


def rows_of(df) -> list[dict]:
    return sorted((r.asDict() for r in df.collect()), key=lambda r: r["commit_log_offset"])


def fails_with(df_thunk, *words: str) -> str:
    with pytest.raises(Exception) as ei:
        df_thunk()
    text = str(ei.value)
    for w in words:
        assert w in text, text[-3000:]
    return text


# ---- batch ------------------------------------------------------------------------
def test_batch_through_the_broker_gives_the_rows_of_the_data_directory(spark, served):
    d, _, b = served
    direct = rows_of(spark.read.format("txmq").load(str(d)))
    wire = rows_of(through(spark, b.address))  # records as stored (raw pulls), decoded on the executors
    assert len(wire) == len(direct) > 20
    assert wire == direct
    assert rows_of(through(spark, b.address, rawPull="false")) == direct  # message maps, as older brokers answer


def test_transactions_table_through_the_broker_has_every_outcome(spark, served):
    from txmq.spark.transactions import transactions

    _, sent, b = served
    tx = {r.tx_id: r for r in transactions(through(spark, b.address)).collect()}
    for name, (outcome, by, checks) in EXPECTED.items():
        row = tx[sent["tx"][name]["tx_id"]]
        assert (row.outcome, row.decided_by, row.checks) == (outcome, by, checks), name


def test_topics_option_keeps_the_topics_records_and_their_transaction_records(spark, served):
    _, _, b = served
    rows = rows_of(through(spark, b.address, topics="audit"))
    assert rows and {r["topic"] for r in rows} == {"audit"}  # no transaction was for audit
    rows = rows_of(through(spark, b.address, topics="orders"))
    assert {r["topic"] for r in rows} >= {"orders", "RMQ_SYS_TRANS_HALF_TOPIC"}
    assert all(r["topic"] == "orders" or r["real_topic"] == "orders" for r in rows)
    pat = rows_of(through(spark, b.address, topicPattern="ord.*", transactionRecords="false"))
    assert pat and {r["topic"] for r in pat} == {"orders"}


def test_starting_and_ending_offsets_per_queue_and_by_store_time(spark, served):
    _, sent, b = served
    all_orders = [r for r in rows_of(through(spark, b.address, topics="orders", transactionRecords="false"))]
    q0 = sorted(r["queue_offset"] for r in all_orders if r["queue_id"] == 0)
    assert len(q0) >= 2
    df = through(spark, b.address, topics="orders", transactionRecords="false",
                 startingOffsets='{"orders": {"0": 1}}', endingOffsets='{"orders": {"0": 2, "1": 0, "2": 0, "3": 0}}')
    got = rows_of(df)
    assert [(r["queue_id"], r["queue_offset"]) for r in got] == [(0, 1)]
    latest = rows_of(through(spark, b.address, startingOffsets="latest"))
    assert latest == []
    # store time: everything stored from the discard pass on (the clock stood at T0 + 20 s)
    since = 1_700_000_020_000
    timed = rows_of(through(spark, b.address, startingTimestamp=str(since)))
    everything = rows_of(through(spark, b.address))
    assert timed and timed == [r for r in everything if r["stored_at"].timestamp() * 1000 >= since]


def test_min_partitions_splits_the_queues_into_more_tasks(spark, served):
    _, _, b = served
    df = through(spark, b.address, minPartitions="40")
    assert df.rdd.getNumPartitions() >= 30
    assert rows_of(df) == rows_of(through(spark, b.address))


def test_unreachable_broker_is_a_clear_error_not_a_hang(spark):
    port = free_port()
    t0 = time.monotonic()
    fails_with(lambda: through(spark, f"127.0.0.1:{port}").collect(), "cannot reach the txmq broker", str(port))
    assert time.monotonic() - t0 < 30


def test_unknown_topic_and_bad_options_are_refused_on_the_driver(spark, served):
    _, _, b = served
    fails_with(lambda: through(spark, b.address, topics="nosuch").collect(), "no topic nosuch")
    fails_with(lambda: through(spark, b.address, startingOffsets="{bad").collect(), "startingOffsets")
    fails_with(lambda: through(spark, b.address, startingOffsets='{"orders": {"9": 0}}').collect(), "queue 9 of orders")
    fails_with(lambda: through(spark, b.address, endingOffsets='{"orders": {"0": 999}}').collect(), "past the queue's end")


def test_bad_token_is_a_clear_error(spark, tmp_path):
    d = tmp_path / "data"
    with BrokerProcess(d, "--auth-token", "s3cret") as b:
        fails_with(lambda: through(spark, b.address, token="wrong").collect(), "refused the connection", "token is wrong")
        fails_with(lambda: through(spark, b.address).collect(), "needs a token")
        assert through(spark, b.address, token="s3cret").count() == 0


def test_the_context_option_takes_the_broker_and_token_of_a_saved_txmq_context(tmp_path, monkeypatch):
    """Option context reads the CLI's contexts file (no Spark needed); explicit options win; a bad file is a ValueError."""
    import json

    from txmq.spark.broker import BrokerOptions

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    f = tmp_path / "txmq" / "contexts.json"
    f.parent.mkdir()
    f.write_text(json.dumps({"current": None, "contexts": {"prod": {"broker": "10.0.0.5:10911", "token": "s3cret"}}}))
    opts = BrokerOptions.from_options({"context": "prod"})
    assert (opts.address, opts.token) == ("10.0.0.5:10911", "s3cret")
    opts = BrokerOptions.from_options({"context": "prod", "broker": "127.0.0.1:9876", "token": "mine"})
    assert (opts.address, opts.token) == ("127.0.0.1:9876", "mine")
    with pytest.raises(ValueError, match="no txmq context named 'staging'"):
        BrokerOptions.from_options({"context": "staging"})
    f.write_text("[1, 2]")
    with pytest.raises(ValueError, match="is damaged"):
        BrokerOptions.from_options({"context": "prod"})


# ---- data loss and a broker that goes away (no Spark needed) ------------------------
def _send_plain(address: str, topic: str, n: int, body: bytes = b"x" * 100) -> None:
    from txmq.client import SyncProducer

    with SyncProducer(address) as p:
        for i in range(0, n, 500):
            p.send_batch(topic, [body] * min(500, n - i), queue_id=0)


def offsets_of(chunk) -> list[int]:
    from txmq.spark.broker import RawRecords

    if isinstance(chunk, RawRecords):
        return list(range(chunk.first, chunk.first + chunk.count))
    return [m["queue_offset"] for m in chunk]


def test_raw_records_that_are_not_the_ones_asked_for_are_read_again_as_messages(tmp_path):
    """A raw pull's records are checked on the executor (topic, queue, consecutive queue offsets); the usual pull
    (which reports, repairs or skips a bad entry) reads any that are off."""
    from pyspark.sql.pandas.types import to_arrow_schema

    from txmq.spark import brokersource as bs
    from txmq.spark.broker import BrokerOptions, QueueRange, RawRecords, pull_range
    from txmq.spark.schema import messages_schema

    d = tmp_path / "data"
    with BrokerProcess(d) as b:
        _send_plain(b.address, "t", 5)
        opts = BrokerOptions.from_options({"broker": b.address, "topics": "t", "transactionRecords": "false"})
        (raw,) = list(pull_range(opts, QueueRange("t", 0, 0, 5)))
        assert isinstance(raw, RawRecords) and raw.count == 5
        schema = to_arrow_schema(messages_schema(), timezone="UTC")
        batches = list(bs.raw_to_batches(raw, schema))
        assert bs._the_records_asked_for(batches, QueueRange("t", 0, 0, 5), raw)
        assert not bs._the_records_asked_for(batches, QueueRange("t", 1, 0, 5), raw)  # another queue's
        assert not bs._the_records_asked_for(batches, QueueRange("u", 0, 0, 5), raw)  # another topic's
        shifted = RawRecords(raw.data, 1, 5)
        assert not bs._the_records_asked_for(batches, QueueRange("t", 0, 1, 6), shifted)  # other offsets
        torn = RawRecords(raw.data[:-3] + b"xyz", 0, 5)  # a record that does not decode: read again, same rows
        part = bs.QueuePartition(QueueRange("t", 0, 0, 5), None)
        original = bs.pull_range
        bs.pull_range = lambda o, r: iter([torn]) if o.raw else original(o, r)
        try:
            rows = [x for bt in bs.read_partition(opts, part, messages_schema()) for x in bt.column("queue_offset").to_pylist()]
        finally:
            bs.pull_range = original
        assert rows == [0, 1, 2, 3, 4]


def test_retention_deleted_offsets_fail_unless_fail_on_data_loss_is_false(tmp_path):
    from txmq.spark.broker import BrokerOptions, DataLossError, QueueRange, checked_ranges, pull_range

    d = tmp_path / "data"
    with BrokerProcess(d) as b:
        _send_plain(b.address, "t", 5)
        opts = BrokerOptions.from_options({"broker": b.address, "topics": "t", "transactionRecords": "false"})
        offsets = {"t": [{"queue_id": 0, "min_offset": 3, "max_offset": 5}]}  # as after retention deleted 0..2
        with pytest.raises(DataLossError, match="offsets 1 to 2 are no longer stored"):
            checked_ranges(offsets, {"t": {0: 1}}, {"t": {0: 5}}, opts)
        loose = BrokerOptions.from_options({"broker": b.address, "topics": "t", "failOnDataLoss": "false"})
        assert checked_ranges(offsets, {"t": {0: 1}}, {"t": {0: 5}}, loose)[0].start == 3
        # a range past what the queue holds (the broker lost its tail): an error, never fewer rows
        with pytest.raises(DataLossError, match="ends at offset 5 now, before 8"):
            list(pull_range(opts, QueueRange("t", 0, 0, 8)))


def test_a_broker_restarted_mid_read_is_reconnected_and_no_row_is_lost_or_repeated(tmp_path):
    from txmq.spark.broker import BrokerOptions, BrokerReadError, QueueRange, pull_range

    d = tmp_path / "data"
    b = BrokerProcess(d, "--flush", "sync").start()
    try:
        _send_plain(b.address, "t", 3000)
        opts = BrokerOptions.from_options({"broker": b.address, "pullCount": "500", "reconnectTimeout": "20"})
        seen = []
        it = pull_range(opts, QueueRange("t", 0, 0, 3000))
        seen += offsets_of(next(it))
        b.kill()  # SIGKILL mid-read, then the broker comes back on the same port
        b.start()
        for msgs in it:
            seen += offsets_of(msgs)
        assert seen == list(range(3000))
        # and one that does not come back: a clear error within reconnectTimeout
        quick = BrokerOptions.from_options({"broker": b.address, "pullCount": "500", "reconnectTimeout": "2"})
        it = pull_range(quick, QueueRange("t", 0, 0, 3000))
        next(it)
        b.kill()
        t0 = time.monotonic()
        with pytest.raises(BrokerReadError, match="went away while reading t queue 0 .* did not come back within 2s"):
            list(it)
        assert time.monotonic() - t0 < 15
    finally:
        b.kill()


# ---- streaming ---------------------------------------------------------------------
def _stream_to(spark, address: str, out: str, ckpt: str, **options):
    df = (spark.readStream.format("txmq").option("broker", address).option("startingOffsets", "earliest")
          .options(**options).load())
    q = (df.writeStream.format("parquet").option("path", out).option("checkpointLocation", ckpt)
         .trigger(availableNow=True).start())
    q.awaitTermination(120)
    progress = q.recentProgress
    q.stop()
    return progress


def test_stream_restarts_from_its_checkpoint_with_no_row_lost_or_repeated(spark, tmp_path):
    d = tmp_path / "data"
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    with BrokerProcess(d) as b:
        _send_plain(b.address, "s", 1000)
        progress = _stream_to(spark, b.address, out, ckpt, topics="s", maxOffsetsPerTrigger="300")
        batches = [p for p in progress if p["numInputRows"] > 0]
        assert [p["numInputRows"] for p in batches] == [300, 300, 300, 100]  # maxOffsetsPerTrigger
        assert spark.read.parquet(out).count() == 1000
        _send_plain(b.address, "s", 700)
        _stream_to(spark, b.address, out, ckpt, topics="s")  # restarted from the checkpoint
        offs = [r.queue_offset for r in spark.read.parquet(out).select("queue_offset").collect()]
        assert sorted(offs) == list(range(1700))


def test_transaction_events_stream_says_who_decided_each_transaction(spark, served, tmp_path):
    _, sent, b = served
    out = str(tmp_path / "events")
    _stream_to(spark, b.address, out, str(tmp_path / "ckpt"), table="transaction_events")
    ev = spark.read.parquet(out).collect()
    by_tx: dict[str, list] = {}
    for r in sorted(ev, key=lambda r: r.commit_log_offset):
        by_tx.setdefault(r.tx_id, []).append((r.event, r.by or r.reason))
    tid = {n: t["tx_id"] for n, t in sent["tx"].items()}
    assert by_tx[tid["A"]] == [("half", "producer"), ("commit", "producer")]
    assert by_tx[tid["B"]] == [("half", "producer"), ("rollback", "producer")]
    assert by_tx[tid["H"]] == [("half", "producer"), ("rollback", "operator")]
    assert by_tx[tid["D"]] == [("half", "producer"), ("check", "check"), ("commit", "check")]
    assert by_tx[tid["E"]] == [("half", "producer"), ("check", "check"), ("discard", "max-checks")]
    assert by_tx[tid["F"]] == [("half", "producer"), ("check", "check"), ("discard", "max-checks"), ("replay", "operator")]
    assert by_tx[tid["I"]][-1] == ("commit", "operator")
    assert by_tx[tid["C"]] == [("half", "producer")]


def test_keeping_a_transactions_table_current_from_the_events_stream(spark, served, tmp_path):
    from txmq.spark.transactions import current_transactions, transactions

    _, _, b = served
    table = str(tmp_path / "transactions")
    df = (spark.readStream.format("txmq").option("broker", b.address).option("table", "transaction_events")
          .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", "7").load())

    def upsert(batch, batch_id):
        current_transactions(spark, batch, table)

    q = (df.writeStream.foreachBatch(upsert).option("checkpointLocation", str(tmp_path / "ckpt"))
         .trigger(availableNow=True).start())
    q.awaitTermination(180)
    q.stop()
    kept = {r.tx_id: (r.outcome, r.decided_by, r.checks) for r in spark.read.parquet(table).collect()}
    batch = {r.tx_id: (r.outcome, r.decided_by, r.checks) for r in transactions(through(spark, b.address)).collect()}
    assert kept == batch and len(kept) == len(EXPECTED)


def test_a_stream_needs_a_broker(spark, tmp_path):
    def run():
        q = spark.readStream.format("txmq").load(str(tmp_path)).writeStream.format("console").start()
        try:
            q.awaitTermination(60)
        finally:
            q.stop()

    fails_with(run, "reads through a broker")



# ---- the CLI ------------------------------------------------------------------------
def _cli(*args: str) -> list[str]:
    import sys

    return [sys.executable, "-m", "txmq", *args]


def test_spark_export_through_the_broker_writes_both_tables_and_the_report(spark, served, tmp_path):
    import json
    import subprocess

    _, _, b = served
    out = tmp_path / "out"
    r = subprocess.run(_cli("spark-export", "--broker", b.address, "--out", str(out), "--master", "local[1]", "-o", "json",
                            "--report", str(tmp_path / "report.html")),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["broker"] == b.address and s["queues"] >= 8
    assert s["tables"]["messages"]["rows"] == through(spark, b.address).count() == spark.read.parquet(str(out / "messages")).count()
    assert s["tables"]["transactions"]["rows"] == len(EXPECTED)
    figs = s["report"]["figures"]
    want: dict = {}
    for outcome, by, _ in EXPECTED.values():
        want[(outcome, by or "-")] = want.get((outcome, by or "-"), 0) + 1
    assert {(o, w): n for o, w, n in figs["outcome_by_who"]} == want
    assert dict(map(tuple, figs["check_histogram"])) == {0: 4, 1: 5}
    # E, F, G and I were discarded once each; only E still is (F replayed, G and I committed since)
    discarded: dict = {}
    for _, _, outcome, n in figs["discards_per_hour"]:
        discarded[outcome] = discarded.get(outcome, 0) + n
    assert discarded == {"discarded": 1, "replayed": 1, "committed": 2}
    page = (tmp_path / "report.html").read_text()
    assert "Outcome by who decided" in page and "max-checks" in page and "http" not in page.split("<svg")[0]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "pip install" in page
    else:
        assert page.count("<svg") == 4


def test_spark_export_follow_keeps_the_tables_current_and_resumes_after_ctrl_c(spark, tmp_path):
    import json
    import signal
    import subprocess

    d, out, ckpt = tmp_path / "data", tmp_path / "out", tmp_path / "ckpt"

    def count() -> int:
        try:
            return spark.read.parquet(str(out / "messages")).count()
        except Exception:  # not written yet
            return 0

    def follow_until(n: int) -> dict:
        p = subprocess.Popen(_cli("spark-export", "--broker", b.address, "--out", str(out), "--follow", "--checkpoint",
                                  str(ckpt), "--interval", "0.5", "--table", "messages", "--master", "local[1]", "-o", "json"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 240
            while count() < n and time.monotonic() < deadline and p.poll() is None:
                time.sleep(1)
            p.send_signal(signal.SIGINT)
            stdout, stderr = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, stderr[-3000:]
        return json.loads(stdout)

    with BrokerProcess(d) as b:
        _send_plain(b.address, "f", 600)
        s = follow_until(600)
        assert s["follow"] and s["tables"]["messages"]["rows"] == 600
        _send_plain(b.address, "f", 400)
        s = follow_until(1000)
        assert s["tables"]["messages"]["rows"] == 400  # resumed where it stopped
        offs = sorted(r.queue_offset for r in spark.read.parquet(str(out / "messages")).collect())
        assert offs == list(range(1000))


def test_a_large_reply_arriving_in_pieces_is_received_whole_and_a_cut_one_is_a_lost_connection():
    """Pull replies of more than 256 KiB are received straight into their own buffer (no copies after the socket)."""
    import socket
    import threading

    from txmq import wire
    from txmq.spark.broker import WireClient

    records = bytes(range(256)) * 8192  # 2 MiB
    frame = wire.reply(5, {"status": "found", "records": records, "count": 3, "next_offset": 3})
    small = wire.reply(4, {"status": "no_message"})
    for cut in (False, True):
        a, b = socket.socketpair()
        c = object.__new__(WireClient)
        c.address, c.timeout, c.sock, c._buf = "test", 5.0, a, bytearray()
        a.settimeout(5.0)
        data = small + frame
        if cut:
            data = data[: len(data) - 1000]

        def feed(data=data, b=b):
            for i in range(0, len(data), 70_000):  # pieces that split the length prefix and the payload anywhere
                b.sendall(data[i : i + 70_000])
                time.sleep(0.001)
            b.close()

        th = threading.Thread(target=feed)
        th.start()
        try:
            if not cut:
                assert c.receive(5) == {"status": "found", "records": records, "count": 3, "next_offset": 3}
            else:
                with pytest.raises(ConnectionError, match="closed the connection"):
                    c.receive(5)
        finally:
            th.join()
            a.close()


def test_the_arrow_writer_through_the_broker_writes_the_rows_sparks_writer_writes(spark, served, tmp_path):
    from txmq.spark.export import ExportOptions, export

    _, _, b = served
    arrow = export(spark, ExportOptions("", str(tmp_path / "arrow"), broker=b.address))
    plain = export(spark, ExportOptions("", str(tmp_path / "spark"), broker=b.address, parquet_writer="spark"))
    for table in ("messages", "transactions"):
        a = spark.read.parquet(str(tmp_path / "arrow" / table))
        s = spark.read.parquet(str(tmp_path / "spark" / table))
        assert a.schema == s.schema
        key = "commit_log_offset" if table == "messages" else "tx_id"
        rows = lambda df: sorted((r.asDict() for r in df.collect()), key=lambda r: r[key])  # noqa: E731
        assert rows(a) == rows(s)
    assert [t.rows for t in arrow.tables] == [t.rows for t in plain.tables]
    assert arrow.tables[0].rows == through(spark, b.address).count() > 20
    # pyarrow wrote the one (its files carry the Arrow schema), Spark the other
    import pyarrow.parquet as pq

    for writer, key in (("arrow", b"ARROW:schema"), ("spark", b"org.apache.spark.sql.parquet.row.metadata")):
        files = [p for p in (tmp_path / writer / "messages").iterdir() if p.name.startswith("part-")]
        assert files and all(key in (pq.read_metadata(p).metadata or {}) for p in files)
    assert not (tmp_path / "arrow" / "messages" / "_temporary").exists()
