"""spark-export and the txmq Spark source, on a real local SparkSession (local[2]).

One broker run (with an injected clock) writes a data directory holding every
kind of record and every transaction outcome; the tests export it and check
each table field by field against what was sent, against an independent
decode of the log, and against the broker's own transaction index.
"""

from __future__ import annotations

import base64
import json
import os
from datetime import datetime, timezone

import msgpack
import pytest

from conftest import arun
from txmq.broker.clock import ManualClock
from txmq.broker.testing import running_broker
from txmq.spark.formats import FORMATS
from wireclient import RawClient

pytestmark = pytest.mark.spark

G = "shop"
T = "orders"
T2 = "audit"
HALF = "RMQ_SYS_TRANS_HALF_TOPIC"
OP = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
DISCARD = "TRANS_CHECK_MAX_TIME_TOPIC"
T0 = 1_700_000_000.0  # the broker's clock starts here


def _spark_problem() -> str | None:
    from txmq.spark.session import missing_dependency, missing_java

    return missing_dependency() or missing_java()


def ts(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, timezone.utc)


def as_utc(v: datetime | None) -> datetime | None:
    """Spark returns naive local datetimes for timestamps: make them aware UTC."""
    return None if v is None else v.astimezone(timezone.utc)


# ---- the broker run ------------------------------------------------------------
def run_scenario(data_dir, segment_size: int | None = None, plain: int = 3) -> dict:
    """Plain messages and transactions of every outcome; returns what was sent and when."""
    clock = ManualClock(T0)
    kw = {"segment_size": segment_size} if segment_size else {}
    sent: dict = {"plain": [], "tx": {}, "checks": {}, "commits": {}}

    def now_ms() -> int:
        return int(clock() * 1000)

    async def go():
        async with running_broker(data_dir, clock=clock, check_interval_s=3600, max_checks=1, **kw) as b:
            p = await RawClient.open(b.address)
            await p.ok("hello", {"producer_groups": [G]})

            async def half(name: str, body: bytes, **props: str) -> dict:
                born = now_ms() - 5
                fields = {"topic": T, "body": body, "born_ts": born,
                          "properties": {"TRAN_MSG": "true", "PGROUP": G, "KEYS": f"k-{name}", "TAGS": "tx", **props}}
                h = await p.ok("send", fields)
                sent["tx"][name] = {**h, "born_ts": born, "stored_ts": now_ms(), "body": body, "props": fields["properties"]}
                return h

            def end(h: dict, state: str, from_check: bool = False) -> dict:
                return {"group": G, "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                        "half_offset": h["half_offset"], "state": state, "from_check": from_check}

            for i in range(plain):
                props = {"TAGS": f"tag{i % 2}", "KEYS": f"key-{i}", "color": "blue" if i % 2 else "red"}
                born = now_ms() - 100 - i
                topic = T if i % 2 == 0 else T2
                body = os.urandom(20 + i)
                r = await p.ok("send", {"topic": topic, "body": body, "properties": props, "born_ts": born})
                sent["plain"].append({**r, "body": body, "props": props, "born_ts": born, "stored_ts": now_ms()})

            a = await half("A", b"committed by the producer")
            r = await p.ok("end_transaction", end(a, "commit"))
            sent["commits"]["A"] = r
            sent["tx"]["A"]["decided_ms"] = now_ms()
            bb = await half("B", b"rolled back by the producer")
            await p.ok("end_transaction", end(bb, "rollback"))
            sent["tx"]["B"]["decided_ms"] = now_ms()
            h = await half("H", b"rolled back by an operator")
            await p.ok("tx_resolve", {"action": "rollback", "refs": [{"tx_id": h["tx_id"]}]})
            sent["tx"]["H"]["decided_ms"] = now_ms()
            for name in "DEFGI":
                await half(name, f"tx {name}".encode())

            clock.advance(10)  # past the transaction timeout: every undecided one is checked once
            r = await b.core.check.run_pass()
            assert r["checked"] == 5
            for _ in range(5):
                pf = (await p.wait_push()).fields
                name = next(n for n, t in sent["tx"].items() if t["tx_id"] == pf["tx_id"])
                sent["checks"][name] = {"commit_log_offset": pf["commit_log_offset"], "half_offset": pf["half_offset"], "stored_ts": now_ms()}
            d = sent["checks"]["D"]
            r = await p.ok("end_transaction", {"group": G, "tx_id": sent["tx"]["D"]["tx_id"], "commit_log_offset": d["commit_log_offset"],
                                               "half_offset": d["half_offset"], "state": "commit", "from_check": True})
            sent["commits"]["D"] = r
            sent["tx"]["D"]["decided_ms"] = now_ms()

            clock.advance(10)  # checked max_checks (1) times: E, F, G, I are discarded
            r = await b.core.check.run_pass()
            assert r["discarded"] == 4
            for name in "EFGI":
                sent["tx"][name]["decided_ms"] = now_ms()

            clock.advance(1)
            res = (await p.ok("discard_replay", {"to": "half", "refs": [{"tx_id": sent["tx"][n]["tx_id"]} for n in "FG"]}))["results"]
            assert [x["status"] for x in res] == ["ok", "ok"]
            res = (await p.ok("discard_replay", {"to": "commit", "refs": [{"tx_id": sent["tx"]["I"]["tx_id"]}]}))["results"]
            assert res[0]["status"] == "ok"
            sent["tx"]["I"]["decided_ms"] = now_ms()
            clock.advance(1)
            res = (await p.ok("tx_resolve", {"action": "commit", "refs": [{"tx_id": sent["tx"]["G"]["tx_id"]}]}))["results"]
            assert res[0]["status"] == "ok"
            sent["tx"]["G"]["decided_ms"] = now_ms()

            c = await half("C", b"still pending")
            assert (await p.ok("end_transaction", end(c, "unknown")))["status"] == "noop"
            await p.close()

    arun(go())
    return sent


EXPECTED = {  # name -> (outcome, decided_by, checks)
    "A": ("committed", "producer", 0),
    "B": ("rolled_back", "producer", 0),
    "H": ("rolled_back", "operator", 0),
    "D": ("committed", "check", 1),
    "E": ("discarded", "max-checks", 1),
    "F": ("replayed", None, 1),
    "G": ("committed", "operator", 1),
    "I": ("committed", "operator", 1),
    "C": ("pending", None, 0),
}


@pytest.fixture(scope="module")
def broker_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("spark") / "data"
    sent = run_scenario(d)
    return d, sent


def log_records(data_dir) -> list:
    from txmq.store import StoreReader

    with StoreReader(data_dir) as r:
        return list(r.scan())


def load(spark, data_dir, **options):
    from txmq.spark.source import TxmqDataSource

    spark.dataSource.register(TxmqDataSource)
    return spark.read.format("txmq").options(**options).load(str(data_dir))


def export_to(spark, data_dir, out, **kw):
    from txmq.spark.export import ExportOptions, export

    return export(spark, ExportOptions(str(data_dir), str(out), **kw))


# ---- the messages table ----------------------------------------------------------
def test_messages_match_the_log_field_by_field(spark, broker_dir):
    from txmq.constants import PROP_CHECK_TIMES, PROP_REAL_QID
    from txmq.spark.schema import MESSAGE_FIELDS, record_kind

    data_dir, _ = broker_dir
    rows = sorted(load(spark, data_dir).collect(), key=lambda r: r.commit_log_offset)
    recs = log_records(data_dir)
    assert [r.commit_log_offset for r in rows] == [r.commit_log_offset for r in recs]
    assert tuple(rows[0].asDict()) == MESSAGE_FIELDS
    for row, rec in zip(rows, recs):
        p = rec.properties
        kind = record_kind(rec.topic, rec.tx_type)
        check = p.get(PROP_CHECK_TIMES)
        assert row.asDict() == {
            "commit_log_offset": rec.commit_log_offset, "size": rec.size, "topic": rec.topic,
            "queue_id": rec.queue_id, "queue_offset": rec.queue_offset, "kind": kind,
            "producer_group": p.get("PGROUP"), "tx_id": p.get("UNIQ_KEY") if kind != "normal" else None,
            "real_topic": p.get("REAL_TOPIC"), "real_queue_id": int(p[PROP_REAL_QID]) if PROP_REAL_QID in p else None,
            "tags": p.get("TAGS"), "keys": p.get("KEYS"), "properties": p, "body": bytearray(rec.body),
            "born_at": row.born_at, "stored_at": row.stored_at,
            "check_count": int(check) if check is not None else (0 if kind in ("half", "discard") else None),
            "prepared_offset": rec.prepared_offset if rec.prepared_offset >= 0 else None,
        }, rec
        assert as_utc(row.born_at) == ts(rec.born_ts) and as_utc(row.stored_at) == ts(rec.store_ts)


def test_messages_match_what_was_sent(spark, broker_dir):
    data_dir, sent = broker_dir
    rows = {r.commit_log_offset: r for r in load(spark, data_dir).collect()}
    kinds = {}
    for r in rows.values():
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    # 3 plain; 9 first halves + 5 check copies + 2 replayed copies; commits of A, D, I, G;
    # ops of A D I G and rollback-ops of B H; discards of E F G I
    assert kinds == {"normal": 3, "half": 16, "commit": 4, "op": 4, "rollback-op": 2, "discard": 4}

    for s in sent["plain"]:
        r = rows[s["commit_log_offset"]]
        assert (r.kind, r.topic, r.queue_id, r.queue_offset) == ("normal", s["topic"], s["queue_id"], s["queue_offset"])
        assert r.properties == s["props"] and r.tags == s["props"]["TAGS"] and r.keys == s["props"]["KEYS"]
        assert r.tx_id is None and r.producer_group is None and r.check_count is None and r.prepared_offset is None
        assert bytes(r.body) == s["body"]
        assert r.size == 68 + len(s["topic"]) + len(msgpack.packb(s["props"])) + len(s["body"])
        assert as_utc(r.born_at) == ts(s["born_ts"]) and as_utc(r.stored_at) == ts(s["stored_ts"])

    for name, t in sent["tx"].items():
        r = rows[t["commit_log_offset"]]
        assert (r.kind, r.topic, r.queue_id, r.queue_offset) == ("half", HALF, 0, t["half_offset"])
        assert (r.tx_id, r.producer_group, r.real_topic, r.real_queue_id) == (t["tx_id"], G, T, t["queue_id"])
        assert (r.tags, r.keys, r.check_count, r.prepared_offset) == ("tx", f"k-{name}", 0, None)
        assert bytes(r.body) == t["body"] and r.properties["TRAN_MSG"] == "true"
        assert as_utc(r.born_at) == ts(t["born_ts"]) and as_utc(r.stored_at) == ts(t["stored_ts"])
    for name, c in sent["checks"].items():
        r = rows[c["commit_log_offset"]]
        assert (r.kind, r.queue_offset, r.tx_id, r.check_count) == ("half", c["half_offset"], sent["tx"][name]["tx_id"], 1)
        assert as_utc(r.stored_at) == ts(c["stored_ts"])
    for name, c in sent["commits"].items():
        r = rows[c["commit_log_offset"]]
        half_at = sent["checks"][name] if name == "D" else sent["tx"][name]
        assert (r.kind, r.topic, r.queue_id, r.queue_offset) == ("commit", T, c["queue_id"], c["queue_offset"])
        assert (r.tx_id, r.prepared_offset) == (sent["tx"][name]["tx_id"], half_at["commit_log_offset"])
        assert "TRAN_MSG" not in r.properties and bytes(r.body) == sent["tx"][name]["body"]

    ops = sorted((r for r in rows.values() if r.kind in ("op", "rollback-op")), key=lambda r: r.commit_log_offset)
    by = {(sent_name(sent, r.tx_id), r.kind, r.properties["TXMQ_DECIDED_BY"]) for r in ops}
    assert by == {("A", "op", "producer"), ("B", "rollback-op", "producer"), ("H", "rollback-op", "operator"),
                  ("D", "op", "check"), ("I", "op", "operator"), ("G", "op", "operator")}
    for r in ops:
        assert (r.topic, r.queue_id, r.tags) == (OP, 0, "d")
        assert rows[r.prepared_offset].tx_id == r.tx_id  # names the decided half (or discard) copy
    discards = [r for r in rows.values() if r.kind == "discard"]
    assert {sent_name(sent, r.tx_id) for r in discards} == set("EFGI")
    for r in discards:
        assert (r.topic, r.check_count, r.properties["TXMQ_DISCARD_REASON"], r.real_topic) == (DISCARD, 1, "max-checks", T)


def sent_name(sent: dict, tx_id: str) -> str:
    return next(n for n, t in sent["tx"].items() if t["tx_id"] == tx_id)


# ---- the transactions table ------------------------------------------------------
def test_transactions_match_what_happened(spark, broker_dir):
    from txmq.spark.schema import TRANSACTION_FIELDS
    from txmq.spark.source import TxmqDataSource
    from txmq.spark.transactions import transactions

    data_dir, sent = broker_dir
    spark.dataSource.register(TxmqDataSource)
    rows = {r.tx_id: r for r in transactions(load(spark, data_dir)).collect()}
    assert set(rows) == {t["tx_id"] for t in sent["tx"].values()}
    for name, (outcome, by, checks) in EXPECTED.items():
        t = sent["tx"][name]
        r = rows[t["tx_id"]]
        assert tuple(r.asDict()) == TRANSACTION_FIELDS
        assert (r.outcome, r.decided_by, r.checks) == (outcome, by, checks), name
        assert (r.producer_group, r.real_topic, r.first_half_offset) == (G, T, t["commit_log_offset"]), name
        assert as_utc(r.first_half_at) == ts(t["stored_ts"]), name
        if outcome in ("pending", "replayed"):
            assert (r.decided_at, r.time_to_decision_ms) == (None, None), name
        else:
            assert as_utc(r.decided_at) == ts(t["decided_ms"]), name
            assert r.time_to_decision_ms == t["decided_ms"] - t["stored_ts"], name
        c = sent["commits"].get(name)
        if name in ("G", "I"):  # committed by an operator: no reply to the producer, find it in the log
            commit = [m for m in load(spark, data_dir, kinds="commit").collect() if m.tx_id == t["tx_id"]]
            assert len(commit) == 1 and r.committed_offset == commit[0].commit_log_offset
        else:
            assert r.committed_offset == (c["commit_log_offset"] if c else None), name


def test_transaction_outcomes_agree_with_the_broker_index(spark, broker_dir):
    from txmq.broker.transactions.index import rebuild
    from txmq.spark.transactions import transactions
    from txmq.store import StoreReader

    data_dir, _ = broker_dir
    with StoreReader(data_dir) as reader:
        idx = rebuild(reader)
    rows = {r.tx_id: r for r in transactions(load(spark, data_dir)).collect()}
    assert set(rows) == set(idx.pending) | set(idx.decided)
    for tx_id, r in rows.items():
        if tx_id in idx.pending:
            assert r.outcome in ("pending", "replayed")
            assert r.decided_at is None
        else:
            d = idx.decided[tx_id]
            assert r.outcome == d.outcome.label
            assert (r.decided_by, as_utc(r.decided_at)) == (d.decided_by, ts(d.decided_at))
            assert (r.producer_group, r.real_topic) == (d.group, d.topic)


# ---- several segments, byte-range partitions, a torn tail --------------------------
def test_byte_range_partitions_cover_every_record_once(tmp_path):
    from txmq.spark.source import ReadOptions, TxmqReader, plan_partitions
    from txmq.store import Message, Store, StoreConfig, TxType

    with Store(tmp_path / "d", StoreConfig(segment_size=64 << 10)) as s:
        s.append([Message(f"t{i % 3}", i % 2, TxType.NORMAL, i, {"KEYS": str(i)}, os.urandom(i % 700)) for i in range(1500)])
    parts = plan_partitions(str(tmp_path / "d"), 5000)
    assert len({p.segment_start for p in parts}) > 3 and len(parts) > 2 * len({p.segment_start for p in parts})
    assert all(p.end - p.start <= 5000 + 1024 for p in parts)  # about the size asked: a cut moves to the next record
    starts = {r.commit_log_offset for r in log_records(tmp_path / "d")}
    assert {p.start for p in parts} <= starts | {p.segment_start for p in parts}
    reader = TxmqReader(ReadOptions(str(tmp_path / "d"), 5000), _messages_schema())
    got = [o for p in reader.partitions() for b in reader.read(p) for o in b.column("commit_log_offset").to_pylist()]
    assert got == [r.commit_log_offset for r in log_records(tmp_path / "d")]


def test_tasks_on_a_directory_without_checkpoint_do_not_each_validate_the_whole_log(tmp_path, monkeypatch):
    """The driver validates the log's end once; each task's reader starts its validation there.

    That is the store reader's path (the Python one); the compiled one starts at the record that begins each range
    and reads that range only, whatever the driver validated.
    """
    from txmq.spark import fastrows
    from txmq.spark.source import ReadOptions, TxmqReader
    from txmq.store import Message, Store, StoreConfig, TxType
    from txmq.store import reader as reader_module

    d = tmp_path / "d"
    with Store(d, StoreConfig(segment_size=64 << 10)) as s:
        s.append([Message("t", 0, TxType.NORMAL, i, {}, b"x" * 300) for i in range(1000)])
    os.unlink(d / "checkpoint")  # copied without it: nothing says where the fsynced part ends
    log_bytes = sum(os.path.getsize(d / "commitlog" / n) for n in os.listdir(d / "commitlog"))
    reader = TxmqReader(ReadOptions(str(d), 16 << 10), _messages_schema())
    parts = reader.partitions()
    assert len(parts) > 10 and all(p.log_end[1] == parts[-1].end for p in parts)
    read = [0]
    real_pread = os.pread

    def counting_pread(fd, n, pos):
        data = real_pread(fd, n, pos)
        read[0] += len(data)
        return data

    monkeypatch.setattr(reader_module.os, "pread", counting_pread)
    from txmq.store import segments as segments_module

    monkeypatch.setattr(segments_module.os, "pread", counting_pread)
    if fastrows.columns is not None:
        monkeypatch.setattr(fastrows.os, "pread", counting_pread)
        for p in parts:
            p.log_end = None
        got = [o for p in parts for b in reader.read(p) for o in b.column("commit_log_offset").to_pylist()]
        assert got == sorted(got) and len(got) == 1000
        assert read[0] < 2 * log_bytes, (read[0], log_bytes)  # each range once (and each first record twice)
        parts = reader.partitions()
        read[0] = 0
        monkeypatch.setattr(fastrows, "columns", None)
    got = [o for p in parts for b in reader.read(p) for o in b.column("commit_log_offset").to_pylist()]
    assert len(got) == 1000
    planned = read[0]
    read[0] = 0
    for p in parts:
        p.log_end = None  # each task on its own: validating from the log's first byte
    assert sum(len(b) for p in parts for b in reader.read(p)) == 1000
    # every task read the whole log again, where with the driver's end each reads about its own range
    assert read[0] > len(parts) * log_bytes > 4 * planned, (read[0], planned, log_bytes)


def test_arrow_batches_hold_the_same_rows_as_record_row(broker_dir):
    pytest.importorskip("pyspark")
    from pyspark.sql.pandas.types import to_arrow_schema

    from txmq.spark.rows import record_row, records_to_batch
    from txmq.spark.schema import MESSAGE_FIELDS

    data_dir, _ = broker_dir
    recs = log_records(data_dir)
    batch = records_to_batch(recs, to_arrow_schema(_messages_schema(), timezone="UTC"))
    got = batch.to_pylist()
    for row, rec in zip(got, recs):
        want = dict(zip(MESSAGE_FIELDS, record_row(rec)))
        want["born_at"], want["stored_at"] = ts(want["born_at"]), ts(want["stored_at"])
        want["properties"] = sorted(want["properties"].items())
        row["properties"] = sorted(row["properties"])
        assert row == want


def test_producer_set_values_a_column_cannot_hold_become_null_or_clamped_not_a_failed_batch(tmp_path):
    pytest.importorskip("pyspark")
    from pyspark.sql.pandas.types import to_arrow_schema

    from txmq.spark.rows import records_to_batch
    from txmq.store import Message, Store, TxType

    store = Store(tmp_path / "d")
    store.open()
    store.append([Message("t", 0, TxType.NORMAL, 1 << 62, {"REAL_QID": "99999999999", "TRANSACTION_CHECK_TIMES": "3000000000"}, b"x"),
                  Message("t", 0, TxType.NORMAL, -(1 << 62), {}, b"y"),
                  Message("t", 0, TxType.NORMAL, 1_700_000_000_000, {"REAL_QID": "3"}, b"z")])
    store.close()
    rows = records_to_batch(log_records(tmp_path / "d"), to_arrow_schema(_messages_schema(), timezone="UTC")).to_pylist()
    assert [r["real_queue_id"] for r in rows] == [None, None, 3]
    assert rows[0]["check_count"] is None
    assert [r["born_at"].year for r in rows] == [9999, 1, 2023]


def test_partitions_start_at_stored_records_never_at_records_forged_inside_a_body(tmp_path):
    import time as _time

    from txmq.spark.source import ReadOptions, plan_partitions, read_records
    from txmq.store import Message, Store, TxType
    from txmq.store.codec import HEADER_SIZE, encode_record

    store = Store(tmp_path / "d")
    store.open()
    first = store.append([Message("t", 0, TxType.NORMAL, 1, {}, b"first")])[0]
    # a body tiled with valid commit records of topic "orders", each at the offset it lands at
    body_at, total = first.commit_log_offset + first.size + HEADER_SIZE + 1 + 1, 60_000

    def forged(at: int, n: int) -> bytes:
        return encode_record(Message("orders", 0, TxType.COMMIT, 0, {"UNIQ_KEY": f"FAKE{n:06d}"}, b"phantom"), at, n,
                             int(_time.time() * 1000))

    size = len(forged(0, 0))
    body = b"\0" * (total % size)
    while len(body) < total:
        body += forged(body_at + len(body), len(body) // size)
    store.append([Message("t", 0, TxType.NORMAL, 1, {}, body)])
    store.append([Message("t", 0, TxType.NORMAL, 1, {}, b"last")])
    store.close()
    parts = plan_partitions(str(tmp_path / "d"), 4096)
    rows = [r for p in parts for r in read_records(ReadOptions(data_dir=str(tmp_path / "d")), p.start, p.end, p.log_end)]
    starts = {r.commit_log_offset for r in log_records(tmp_path / "d")}
    assert {p.start for p in parts} <= starts  # the cuts every 4096 bytes fell inside the body: each moved to a record
    assert [r.topic for r in rows] == ["t", "t", "t"], [r.topic for r in rows][:5]
    assert [r.body for r in rows] == [b"first", body, b"last"]


def _messages_schema():
    from txmq.spark.schema import messages_schema

    return messages_schema()


def test_several_segments_and_a_torn_tail_export_cleanly(spark, tmp_path):
    data_dir = tmp_path / "data"
    run_scenario(data_dir, segment_size=4096, plain=40)
    segs = sorted((data_dir / "commitlog").iterdir())
    assert len(segs) > 3
    before = log_records(data_dir)
    last = before[-1]
    seg = [s for s in segs if int(s.name) <= last.commit_log_offset][-1]
    os.truncate(seg, last.commit_log_offset - int(seg.name) + last.size // 2)  # cut the last record in half

    res = export_to(spark, data_dir, tmp_path / "out", partition_bytes=4096)
    rows = {t.name: t.rows for t in res.tables}
    assert rows["messages"] == len(before) - 1
    assert res.end_offset == last.commit_log_offset and res.segments == len(segs)
    got = spark.read.parquet(str(tmp_path / "out" / "messages")).select("commit_log_offset").collect()
    assert sorted(r[0] for r in got) == [r.commit_log_offset for r in before[:-1]]
    # the cut record was C's half: C is not in the log any more
    tx = spark.read.parquet(str(tmp_path / "out" / "transactions")).collect()
    assert len(tx) == rows["transactions"] == 8 and "pending" not in {r.outcome for r in tx}


def test_a_live_brokers_directory_exports_a_consistent_prefix(spark, tmp_path):
    import asyncio

    data_dir = tmp_path / "data"
    done: dict = {}

    async def go():
        async with running_broker(data_dir, check_interval_s=3600, segment_size=16384) as b:
            c = await RawClient.open(b.address)
            for i in range(50):
                await c.ok("send", {"topic": T, "body": os.urandom(100), "properties": {"KEYS": str(i)}})
            stop = asyncio.Event()

            async def keep_sending():
                i = 0
                while not stop.is_set():
                    await c.ok("send", {"topic": T2, "body": os.urandom(300), "properties": {"KEYS": f"live-{i}"}})
                    i += 1
                    await asyncio.sleep(0.02)
                done["sent_during"] = i

            sender = asyncio.create_task(keep_sending())
            try:
                done["res"] = await asyncio.to_thread(export_to, spark, data_dir, tmp_path / "out", tables=("messages",), partition_bytes=4096)
            finally:
                stop.set()
                await sender
            await c.close()

    arun(go())
    res = done["res"]
    assert done["sent_during"] > 0
    final = log_records(data_dir)
    prefix = [r.commit_log_offset for r in final if r.commit_log_offset < res.end_offset]
    got = sorted(r[0] for r in spark.read.parquet(str(tmp_path / "out" / "messages")).select("commit_log_offset").collect())
    assert got == prefix and res.tables[0].rows == len(prefix) >= 50


def test_a_damaged_record_fails_the_export_with_its_offset_or_is_skipped_and_listed(spark, tmp_path):
    from txmq.cli.commands.spark import spark_error
    from txmq.store import Message, Store, StoreConfig, TxType

    data_dir = tmp_path / "data"
    with Store(data_dir, StoreConfig(segment_size=8192)) as s:
        s.append([Message(T, 0, TxType.NORMAL, 1, {}, bytes(300)) for _ in range(60)])
    victim = log_records(data_dir)[30]
    seg = [p for p in sorted((data_dir / "commitlog").iterdir()) if int(p.name) <= victim.commit_log_offset][-1]
    with open(seg, "r+b") as f:  # flip a body byte: a CRC mismatch, not a torn tail
        f.seek(victim.commit_log_offset - int(seg.name) + victim.size - 1)
        f.write(b"\x01")
    with pytest.raises(Exception) as e:
        export_to(spark, data_dir, tmp_path / "out", tables=("messages",))
    assert spark_error(e.value) == f"txmq.store.errors.CorruptRecordError: crc mismatch at {victim.commit_log_offset}"
    # with skip_damaged: every other record, both tables, and the damaged one listed once
    res = export_to(spark, data_dir, tmp_path / "out2", skip_damaged=True, partition_bytes=4096)
    assert [d["offset"] for d in res.damaged] == [victim.commit_log_offset]
    assert res.damaged[0]["reason"] == f"crc mismatch at {victim.commit_log_offset}" and res.damaged[0]["bytes"] == victim.size
    got = sorted(r[0] for r in spark.read.parquet(str(tmp_path / "out2" / "messages")).select("commit_log_offset").collect())
    assert got == [r.commit_log_offset for r in log_records(data_dir) if r.commit_log_offset != victim.commit_log_offset]
    assert len(got) == 59


# ---- output formats ----------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_round_trips_through_spark(spark, broker_dir, tmp_path, fmt):
    from txmq.spark.export import _for_format
    from txmq.spark.formats import export_format
    from txmq.spark.schema import messages_schema, transactions_schema
    from txmq.spark.transactions import transactions

    data_dir, _ = broker_dir
    res = export_to(spark, data_dir, tmp_path, fmt=fmt)
    src = {"messages": load(spark, data_dir)}
    src["transactions"] = transactions(src["messages"])
    schemas = {"messages": messages_schema(), "transactions": transactions_schema()}
    for t in res.tables:
        expected = _for_format(src[t.name], fmt)
        reader = spark.read.format(fmt)
        if export_format(fmt).text_columns:
            reader = reader.options(**export_format(fmt).options).schema(expected.schema)
        elif fmt == "json":
            reader = reader.schema(schemas[t.name])
        back = reader.load(t.path)
        assert back.columns == expected.columns
        key = "commit_log_offset" if t.name == "messages" else "tx_id"
        got = sorted((r.asDict() for r in back.collect()), key=lambda r: r[key])
        want = sorted((r.asDict() for r in expected.collect()), key=lambda r: r[key])
        assert t.rows == len(want) > 0
        assert got == want, t.name
        if export_format(fmt).text_columns and t.name == "messages":
            raw = {r["commit_log_offset"]: r for r in (x.asDict() for x in src["messages"].collect())}
            for r in got:
                assert json.loads(r["properties"]) == raw[r["commit_log_offset"]]["properties"]
                assert base64.b64decode(r["body"]) == raw[r["commit_log_offset"]]["body"]


def test_the_arrow_writer_gives_the_table_sparks_writer_gives(spark, broker_dir, tmp_path):
    data_dir, _ = broker_dir
    arrow = export_to(spark, data_dir, tmp_path / "arrow", tables=("messages",), partition_bytes=4096)
    plain = export_to(spark, data_dir, tmp_path / "spark", tables=("messages",), parquet_writer="spark")
    a = spark.read.parquet(str(tmp_path / "arrow" / "messages"))
    b = spark.read.parquet(str(tmp_path / "spark" / "messages"))
    assert a.schema == b.schema
    assert arrow.tables[0].rows == plain.tables[0].rows == b.count() > 0
    rows = lambda df: sorted((r.asDict() for r in df.collect()), key=lambda r: r["commit_log_offset"])  # noqa: E731
    assert rows(a) == rows(b)
    # laid out as Spark lays a table out: part files, the _SUCCESS marker, no _temporary left behind
    names = sorted(p.name for p in (tmp_path / "arrow" / "messages").iterdir())
    assert "_SUCCESS" in names and "_temporary" not in names
    parts = [n for n in names if n != "_SUCCESS"]
    assert len(parts) > 1 and all(n.startswith("part-") and n.endswith(".snappy.parquet") for n in parts)
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_the_arrow_writer_keeps_the_schema_of_an_empty_table_and_appends_beside_older_files(spark, broker_dir, tmp_path):
    data_dir, _ = broker_dir
    res = export_to(spark, data_dir, tmp_path / "out", tables=("messages",), topics=("no-such-topic",))
    assert res.tables[0].rows == 0
    empty = spark.read.parquet(str(tmp_path / "out" / "messages"))
    assert empty.count() == 0 and empty.columns == list(messages_fields())
    res = export_to(spark, data_dir, tmp_path / "out", tables=("messages",), mode="append")
    both = spark.read.parquet(str(tmp_path / "out" / "messages"))
    assert both.count() == res.tables[0].rows > 0


def test_a_session_codec_is_used_and_one_pyarrow_cannot_write_falls_back_to_sparks_writer(spark, broker_dir, tmp_path):
    data_dir, _ = broker_dir
    spark.conf.set("spark.sql.parquet.compression.codec", "zstd")
    try:
        export_to(spark, data_dir, tmp_path / "zstd", tables=("messages",))
        assert all(n.endswith(".zstd.parquet") for n in os.listdir(tmp_path / "zstd" / "messages") if n.startswith("part-"))
        spark.conf.set("spark.sql.parquet.compression.codec", "lz4")  # Hadoop's LZ4 framing: Spark's writer
        res = export_to(spark, data_dir, tmp_path / "lz4", tables=("messages",))
        assert spark.read.parquet(str(tmp_path / "lz4" / "messages")).count() == res.tables[0].rows > 0
    finally:
        spark.conf.set("spark.sql.parquet.compression.codec", "snappy")


def messages_fields():
    from txmq.spark.schema import MESSAGE_FIELDS

    return MESSAGE_FIELDS


def test_partition_by_date_and_topic_and_filters(spark, broker_dir, tmp_path):
    data_dir, sent = broker_dir
    since = int(T0 * 1000)
    res = export_to(spark, data_dir, tmp_path, partition_by=("date", "topic"), topics=(T,), since_ms=since)
    m = spark.read.parquet(str(tmp_path / "messages"))
    assert {"date", "topic"} <= set(m.columns)
    rows = m.collect()
    # orders' plain messages, and every transaction record about orders (half, op, discard...)
    assert len(rows) == res.tables[0].rows == 2 + 16 + 4 + 6 + 4
    assert {str(r.date) for r in rows} == {datetime.fromtimestamp(T0, timezone.utc).date().isoformat()}
    assert {r.real_topic for r in rows if r.kind != "normal"} == {T}
    tx = spark.read.parquet(str(tmp_path / "transactions"))
    assert {"date", "real_topic"} <= set(tx.columns) and tx.count() == len(EXPECTED)
    later = export_to(spark, data_dir, tmp_path / "later", since_ms=int(T0 * 1000) + 15_000)
    counts = {t.name: t.rows for t in later.tables}
    assert counts["transactions"] == 1  # only C's half was stored after T0 + 15 s
    assert counts["messages"] == sum(1 for r in load(spark, data_dir).collect() if as_utc(r.stored_at) >= ts(int(T0 * 1000) + 15_000))


# ---- the command ---------------------------------------------------------------
def test_cli_exports_and_reports_a_json_summary(spark, broker_dir, tmp_path):
    from typer.testing import CliRunner

    from txmq.cli.commands.spark import spark_export
    from txmq.cli.common import CliError
    import typer

    app = typer.Typer()
    app.command("spark-export")(spark_export)
    app.command("noop")(lambda: None)  # keep it a group, as in the real app
    data_dir, _ = broker_dir
    out = tmp_path / "out"
    args = ["spark-export", "--data-dir", str(data_dir), "--out", str(out), "--format", "json", "-o", "json", "--table", "transactions"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["tables"] == {"transactions": {"rows": len(EXPECTED), "path": str(out / "transactions"), "seconds": s["tables"]["transactions"]["seconds"]}}
    assert s["bytes_read"] == s["log_bytes"] > 0 and s["format"] == "json"
    assert {"spark_startup_s", "export_s", "total_s", "segments", "partitions"} <= set(s)
    # the table exists now: --mode error refuses, overwrite replaces
    r = CliRunner().invoke(app, args)
    assert isinstance(r.exception, CliError) and r.exception.code == 2 and "--mode overwrite" in r.exception.message
    r = CliRunner().invoke(app, [*args, "--mode", "overwrite"])
    assert r.exit_code == 0, r.output
    # the spark session the tests use is still alive (the command reused it, did not stop it)
    assert spark.range(3).count() == 3


def test_since_and_until_accept_iso_times_and_durations():
    from txmq.cli.commands.spark import parse_when
    from txmq.cli.common import CliError

    assert parse_when("2024-05-01T00:00:00Z") == 1714521600000
    assert parse_when("2024-05-01T02:00:00+02:00") == 1714521600000
    assert parse_when("1h", now=10_000.0) == 6_400_000
    assert parse_when("90m ago", now=10_000.0) == 4_600_000
    assert parse_when("20000101", now=30_000_000.0) == 9_999_899_000  # a bare number is seconds, not a basic-format date
    assert parse_when("2024-05-01") == int(datetime(2024, 5, 1).astimezone().timestamp() * 1000)
    with pytest.raises(CliError) as e:
        parse_when("yesterday")
    assert e.value.code == 2


def test_a_file_uri_out_refuses_an_existing_messages_table_in_mode_error(spark, broker_dir, tmp_path):
    data_dir, _ = broker_dir
    out = f"file://{tmp_path / 'out'}"
    first = export_to(spark, data_dir, out, tables=("messages",))
    with pytest.raises(Exception) as e:  # as Spark's writer refuses it: the table is not written twice
        export_to(spark, data_dir, out, tables=("messages",))
    assert "already exists" in str(e.value) or "PATH_ALREADY_EXISTS" in str(e.value)
    assert spark.read.parquet(str(tmp_path / "out" / "messages")).count() == first.tables[0].rows > 0


def test_a_file_uri_out_with_a_host_is_left_to_spark_not_written_under_the_working_folder(
        spark, broker_dir, tmp_path, monkeypatch):
    data_dir, _ = broker_dir
    monkeypatch.chdir(tmp_path)  # a URI taken for a relative path would land in here
    out = f"file://localhost{tmp_path / 'out'}"
    with pytest.raises(Exception, match="Wrong FS"):  # Hadoop's local file system takes no host: Spark's error
        export_to(spark, data_dir, out, tables=("messages",))
    assert not (tmp_path / "localhost").exists()


def test_a_relative_out_appended_to_is_written_under_the_drivers_working_folder(spark, broker_dir, tmp_path, monkeypatch):
    data_dir, _ = broker_dir
    monkeypatch.chdir(tmp_path)  # the executors' working folder is the JVM's, not this one
    res = export_to(spark, data_dir, "rel", tables=("messages",), mode="append")
    assert spark.read.parquet(str(tmp_path / "rel" / "messages")).count() == res.tables[0].rows > 0
    assert sorted(p.name for p in (tmp_path / "rel" / "messages").iterdir() if p.name.startswith("_")) == ["_SUCCESS"]


@pytest.mark.parametrize("fmt", ["parquet", "json"])
def test_bytes_read_counts_one_pass_per_table_whichever_writer(spark, broker_dir, tmp_path, fmt):
    data_dir, _ = broker_dir
    res = export_to(spark, data_dir, tmp_path / "out", fmt=fmt)
    assert res.bytes_read == 2 * res.log_bytes > 0
    res = export_to(spark, data_dir, tmp_path / "one", fmt=fmt, tables=("messages",))
    assert res.bytes_read == res.log_bytes


@pytest.mark.parametrize("tables", [("transactions",), ("messages", "transactions")])
def test_an_export_leaves_the_callers_spark_job_group_alone(spark, broker_dir, tmp_path, tables):
    data_dir, _ = broker_dir
    sc = spark.sparkContext
    export_to(spark, data_dir, tmp_path / "out", tables=tables)
    before = set(sc.statusTracker().getJobIdsForGroup("txmq-transactions"))
    assert before  # the export's own jobs ran in its group
    assert spark.range(3).count() == 3  # the caller's next job is not one of the export's
    assert set(sc.statusTracker().getJobIdsForGroup("txmq-transactions")) == before


def test_a_failing_table_fails_the_export_with_its_error_and_leaves_no_output(spark, broker_dir, tmp_path, monkeypatch):
    from txmq.spark import export as ex

    data_dir, _ = broker_dir

    def broken(*a, **kw):
        raise ValueError("the transactions table cannot be planned")

    monkeypatch.setattr(ex, "_filter_transactions", broken)
    with pytest.raises(ValueError, match="cannot be planned"):
        export_to(spark, data_dir, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither table, no staging folder
    monkeypatch.undo()
    res = export_to(spark, data_dir, tmp_path / "out")  # the session goes on serving
    assert [t.rows > 0 for t in res.tables] == [True, True]


def test_a_failed_export_cancels_its_own_spark_jobs_not_the_callers(spark, broker_dir, tmp_path, monkeypatch):
    import threading
    import time

    from txmq.spark import export as ex

    data_dir, _ = broker_dir
    result: dict = {}

    def callers_job() -> None:
        try:
            result["rows"] = spark.sparkContext.parallelize([1, 2], 1).map(lambda x: time.sleep(6) or x).collect()
        except Exception as e:  # cancelled
            result["error"] = str(e)[:300]

    t = threading.Thread(target=callers_job)
    t.start()
    time.sleep(1.5)  # the caller's job is running
    monkeypatch.setattr(ex, "_filter_transactions", lambda *a, **kw: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        export_to(spark, data_dir, tmp_path / "out")
    t.join(60)
    assert result == {"rows": [1, 2]}


def test_a_table_failing_while_the_other_is_written_leaves_no_output_behind(spark, broker_dir, tmp_path, monkeypatch):
    import time

    from txmq.spark import export as ex

    data_dir, _ = broker_dir
    real = ex._write

    def slow_write(df, table, opts):  # the transactions table's tasks still running when the messages table fails
        from pyspark.sql import functions as F

        slow = F.udf(lambda v: time.sleep(0.5) or v, "string")
        return real(df.withColumn("tx_id", slow("tx_id")).repartition(2), table, opts)

    def failing_arrow(*a, **kw):
        time.sleep(3)
        raise OSError("no space left on device")

    monkeypatch.setattr(ex, "_write", slow_write)
    monkeypatch.setattr(ex, "_write_arrow", failing_arrow)
    with pytest.raises(OSError, match="no space"):
        export_to(spark, data_dir, tmp_path / "out")
    time.sleep(8)  # what the cancelled tasks would still write
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == []
