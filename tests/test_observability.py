"""Observability: the Prometheus endpoint (--metrics-port) and structured logs (--log-format json).

One broker subprocess is driven through every kind of event the metrics
and logs report -- plain sends; commits and rollbacks by the producer, by check-back
answers and by the operator; an UNKNOW answer; a discard after max checks;
a replay; config changes -- with the check service paced by the test
(``tx_check_now`` for check-backs, a short interval only while a discard is
wanted) so every figure is exact. The endpoint is scraped with urllib and
parsed with prometheus_client's parser; ``txmq stats`` must show the same
counters. The stderr log must be one JSON object per line, with an event
for every operator action and every discard -- even when a producer group
name is built to forge log fields.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request

import pytest

from brokerproc import BrokerProcess, free_port
from conftest import arun
from faultload import PipeClient
from clihelpers import txmq
from txmq.broker.logs import JsonFormatter, KeyValueFormatter, _KV

pytestmark = pytest.mark.slow

EVIL = "obs c\nevent=forged level=error tx_id=\"x\" group='y'"  # a legal producer group name that tries to forge log fields
PG = "obs-p"  # a group with no producer online: its transactions are decided by the producer call or the operator


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def prom_name(key: str) -> tuple[str, dict]:
    """The Prometheus sample that shows the `txmq stats` counter key."""
    for kind in ("committed", "rolled_back"):
        for source in ("producer", "check", "operator"):
            if key == f"{kind}_{source}":
                return f"txmq_{kind}_total", {"source": source}
    return f"txmq_{key}_total", {}


def half(group: str, body: bytes, topic: str = "obs") -> dict:
    return {"topic": topic, "body": body, "properties": {"TRAN_MSG": "true", "PGROUP": group}}


def end(h: dict, group: str, state: str, from_check: bool = False) -> dict:
    return {"group": group, "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"], "half_offset": h["half_offset"],
            "state": state, "from_check": from_check}


def test_metrics_endpoint_stats_and_json_logs_cover_every_event(tmp_path):
    mport = free_port()
    b = BrokerProcess(tmp_path / "data", "--metrics-port", str(mport), "--log-format", "json", "--flush", "sync",
                      "--check-interval", "1h", "--transaction-timeout", "0s", "--max-checks", "1")
    b.start()
    ids: dict[str, str] = {}
    try:
        async def drive() -> None:
            admin = await PipeClient.open(b.address)
            pushes: asyncio.Queue = asyncio.Queue()
            checker = await PipeClient.open(b.address, on_push=pushes.put_nowait)
            await checker.ok("hello", {"producer_groups": [EVIL]})
            for i in range(3):
                await admin.ok("send", {"topic": "obs", "body": f"plain{i}".encode()})
            # the producer decides
            p1, p2, p3 = [await admin.ok("send", half(PG, f"p{i}".encode())) for i in range(3)]
            await admin.ok("end_transaction", end(p1, PG, "commit"))
            await admin.ok("end_transaction", end(p2, PG, "rollback"))
            await admin.ok("end_transaction", end(p3, PG, "unknown"))
            ids["pending"] = p3["tx_id"]
            # check-backs decide, driven one at a time by the operator
            for name, state in (("A", "commit"), ("B", "rollback"), ("C", "unknown")):
                h = await checker.ok("send", half(EVIL, name.encode()))
                ids[name] = h["tx_id"]
                await admin.ok("tx_check_now", {"tx_id": h["tx_id"]})
                push = await asyncio.wait_for(pushes.get(), 5)
                pf = push.fields
                assert pf["tx_id"] == h["tx_id"] and pf["group"] == EVIL
                await checker.ok("end_transaction", {**end(pf, EVIL, state, True), "tx_id": pf["tx_id"]})
            # C was checked once (max checks 1) and answered UNKNOW: the next pass discards it
            await admin.ok("config_set", {"key": "check_interval_s", "value": 0.1})
            for _ in range(100):
                if (await admin.ok("discard_list"))["discarded"]:
                    break
                await asyncio.sleep(0.05)
            await admin.ok("config_set", {"key": "check_interval_s", "value": 3600})
            assert [d["tx_id"] for d in (await admin.ok("discard_list"))["discarded"]] == [ids["C"]]
            r = await admin.ok("discard_replay", {"to": "commit", "refs": [{"tx_id": ids["C"]}]})
            assert r["results"][0]["status"] == "ok"
            # the operator decides
            d, e = await admin.ok("send", half(PG, b"D")), await admin.ok("send", half(PG, b"E"))
            ids["D"], ids["E"] = d["tx_id"], e["tx_id"]
            assert (await admin.ok("tx_resolve", {"action": "commit", "refs": [{"tx_id": d["tx_id"]}]}))["results"][0]["status"] == "ok"
            assert (await admin.ok("tx_resolve", {"action": "rollback", "refs": [{"half_offset": e["half_offset"]}]}))["results"][0]["status"] == "ok"
            pulled = await admin.ok("pull", {"topic": "obs", "queue_id": 0, "offset": 0, "max_count": 100})
            assert pulled["messages"]
            await admin.close()
            await checker.close()

        arun(drive())
        m = scrape(mport)
        for _ in range(50):  # the broker handles the clients' hang-ups on its loop, after they returned
            if m.get(("txmq_connections", ())) == 0:
                break
            time.sleep(0.05)
            m = scrape(mport)
        val = lambda name, **labels: m.get((name, tuple(sorted(labels.items()))))  # noqa: E731
        assert val("txmq_committed_total", source="producer") == 1
        assert val("txmq_rolled_back_total", source="producer") == 1
        assert val("txmq_committed_total", source="check") == 1
        assert val("txmq_rolled_back_total", source="check") == 1
        assert val("txmq_committed_total", source="operator") == 2  # D, and C replayed to commit
        assert val("txmq_rolled_back_total", source="operator") == 1
        assert val("txmq_checks_sent_total") == 3 and val("txmq_checks_answered_total") == 3
        assert val("txmq_unknown_answers_total") == 2
        assert val("txmq_discarded_total") == 1 and val("txmq_replayed_total") == 1
        assert val("txmq_half_stored_total") == 8 and val("txmq_messages_sent_total") == 3
        assert val("txmq_pending_half_messages", topic="obs") == 1 and val("txmq_pending_transactions") == 1
        assert val("txmq_decision_seconds_count") == 7
        assert val("txmq_decision_seconds_bucket", le="+Inf") == 7
        assert val("txmq_bytes_appended_total") == val("txmq_commit_log_max_offset") > 0
        assert val("txmq_records_appended_total") > 0
        assert val("txmq_flush_latency_seconds_count") > 0 and val("txmq_flush_latency_seconds_sum") > 0
        assert val("txmq_log_sync_failing") == 0
        assert val("txmq_connections") == 0  # everyone hung up
        assert val("txmq_connections_accepted_total") >= 2
        assert val("txmq_recovery_dropped_bytes") == 0
        assert val("txmq_check_passes_total") >= 1
        for _ in range(50):  # checkpoint cycles come every --flush-interval (0.5 s): the first may still be due
            if val("txmq_checkpoint_seconds_count"):
                break
            time.sleep(0.1)
            m = scrape(mport)
        assert val("txmq_checkpoint_seconds_count") > 0 and val("txmq_checkpoint_seconds_max") > 0
        # `txmq stats` shows the same counters
        st = json.loads(txmq("stats", "-o", "json", broker=b.address).stdout)
        c = st["counters"]
        for key in ("checks_sent", "checks_answered", "unknown_answers", "discarded", "replayed", "half_stored", "messages_sent",
                    "committed_producer", "rolled_back_producer", "committed_check", "rolled_back_check", "committed_operator",
                    "rolled_back_operator", "bytes_appended", "records_appended", "check_passes"):
            name, labels = prom_name(key)
            assert c.get(key, 0) == val(name, **labels), key
        assert c["decisions"] == val("txmq_decision_seconds_count") == 7
        assert c["flushes"] >= val("txmq_flush_latency_seconds_count")
        assert c["checkpoints"] >= val("txmq_checkpoint_seconds_count") and c["checkpoint_seconds_max"] > 0
        assert st["gauges"]["pending_by_topic"] == {"obs": 1}
        assert b.stop() == 0
    finally:
        b.kill()

    lines = [ln for ln in b.log.read_text().splitlines() if ln.strip()]
    events = []
    for ln in lines:
        obj = json.loads(ln)  # every line is one JSON object
        assert isinstance(obj, dict) and {"ts", "level", "logger"} <= set(obj), ln
        events.append(obj)
    by = lambda name: [e for e in events if e.get("event") == name]  # noqa: E731
    assert not by("forged")
    assert [e["tx_id"] for e in by("operator_check_now")] == [ids["A"], ids["B"], ids["C"]]
    assert all(e["group"] == EVIL for e in by("operator_check_now"))
    (disc,) = by("discard")
    assert disc["tx_id"] == ids["C"] and disc["group"] == EVIL and disc["reason"] == "max-checks" and disc["level"] == "warning"
    (replay,) = by("discard_replay")
    assert replay["tx_id"] == ids["C"] and replay["to"] == "commit"
    assert sorted(e["tx_id"] for e in by("operator_commit")) == sorted([ids["C"], ids["D"]])
    assert [e["tx_id"] for e in by("operator_rollback")] == [ids["E"]]
    assert [(e["key"], e["new"]) for e in by("config_set")] == [("check_interval_s", "0.1"), ("check_interval_s", "3600.0")]
    assert by("listening") and by("shutdown_done")


@pytest.mark.parametrize("value", [EVIL, "plain", "", "a=b", "tab\there", "quote'\"both", "uni\u00e9\u2028sep", "back\\slash\\"])
def test_log_lines_keep_hostile_values_in_one_line_and_one_field(value):
    """Values from clients (groups, transaction ids) cannot split a log line or forge a field, in either format."""
    rec = logging.LogRecord("txmq.check", logging.WARNING, __file__, 1, "event=discard tx_id=%s group=%s checks=%d reason=%s",
                            (value, value, 3, "max-checks"), None)
    kv = KeyValueFormatter().format(rec)
    assert "\n" not in kv and "\r" not in kv and "\u2028" not in kv
    pairs = dict(_KV.findall(kv))
    assert pairs["event"] == "discard" and pairs["checks"] == "3" and pairs["reason"] == "max-checks"
    assert json.loads(pairs["group"]) == value if pairs["group"].startswith('"') else pairs["group"] == value
    j = json.loads(JsonFormatter().format(rec))
    assert (j["event"], j["tx_id"], j["group"], j["checks"], j["reason"]) == ("discard", value, value, "3", "max-checks")
    rec2 = logging.LogRecord("txmq.broker", logging.INFO, __file__, 1, "event=recovery_truncated dropped_bytes=%d reason=%r at=%s",
                             (40, "torn record: 40 of 76 bytes at 100", 100), None)
    j2 = json.loads(JsonFormatter().format(rec2))
    assert j2["reason"] == "torn record: 40 of 76 bytes at 100" and j2["dropped_bytes"] == "40"
    assert dict(_KV.findall(KeyValueFormatter().format(rec2)))["at"] == "100"
    free = logging.LogRecord("txmq.x", logging.INFO, __file__, 1, "a message with no fields %s", ("here",), None)
    assert json.loads(JsonFormatter().format(free))["msg"] == "a message with no fields here"


def test_stats_walks_the_pending_transactions_in_a_worker_thread_not_on_the_event_loop(tmp_path, monkeypatch):
    """At a million pending the walk takes ~100 ms: the loop serves other clients meanwhile."""
    import threading

    from txmq.broker.testing import running_broker
    from txmq.broker.transactions.index import TxIndex
    from wireclient import RawClient

    threads: list[int] = []
    real = TxIndex.pending_summary

    def recording(self):
        threads.append(threading.get_ident())
        return real(self)

    monkeypatch.setattr(TxIndex, "pending_summary", recording)

    async def go() -> None:
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            for topic in ("a", "a", "b"):
                await c.ok("send", {"topic": topic, "body": b"x", "properties": {"TRAN_MSG": "true", "PGROUP": "g"}})
            st = await c.ok("stats")
            await c.close()
            assert st["gauges"]["pending_by_topic"] == {"a": 2, "b": 1} and st["gauges"]["pending"] == 3
            assert set(st["gauges"]["oldest_pending_age_s"]) == {"g"}
            assert threads and threading.get_ident() not in threads

    arun(go())
