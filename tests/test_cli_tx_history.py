"""One transaction's history (inspect tx), what holds the half progress back (inspect offsets), and the checker's discard lines."""

import json
import subprocess

import pytest

from conftest import arun
from faultload import PipeClient
from clihelpers import CONFLICT, NOT_FOUND, cli_argv, cli_env, err, lines, ok, one, out, start_broker, txmq, wait_for


@pytest.fixture(scope="module")
def broker_proc(tmp_path_factory):
    b = start_broker(tmp_path_factory.mktemp("cli-txh"))
    yield b
    b.stop()


@pytest.fixture(scope="module")
def broker(broker_proc):
    return broker_proc.address


def run(broker, *args, **kw):
    return txmq(*args, broker=broker, **kw)


def pend(broker, group, body="x", topic="t-txh"):
    return one(run(broker, "send", topic, body, "--tx", "--group", group, "-o", "json"))


def test_inspect_tx_shows_check_backs_decision_by_check_and_the_committed_message(broker, broker_proc):
    sent = pend(broker, "hist", "order-7", topic="t-hist")
    ok(run(broker, "checker", "--group", "hist", "--answer", "unknown", "--limit", "1", "--idle-exit", "20s", timeout=40))
    ok(run(broker, "checker", "--group", "hist", "--answer", "commit", "--limit", "1", "--idle-exit", "20s", timeout=40))
    doc = one(run(broker, "inspect", "tx", sent["tx_id"], "-o", "json"))
    assert doc["tx_id"] == sent["tx_id"] and doc["state"] == "committed" and doc["decided_by"] == "check"
    assert doc["group"] == "hist" and doc["topic"] == "t-hist" and doc["origin_commit_log_offset"] == sent["commit_log_offset"]
    kinds = [e["event"] for e in doc["events"]]
    assert kinds == ["half", "check", "check", "commit", "message"], kinds
    half, c1, c2, commit, message = doc["events"]
    assert (half["half_offset"], half["commit_log_offset"], half["checks"]) == (sent["half_offset"], sent["commit_log_offset"], 0)
    assert (c1["checks"], c2["checks"]) == (1, 2) and c2["answer"] == "commit"
    assert commit["by"] == "check" and commit["half_offset"] == c2["half_offset"]
    assert commit["half_commit_log_offset"] == c2["commit_log_offset"]
    consumed = lines(ok(run(broker, "consume", "t-hist", "--group", "hist-audit")))
    assert [m["tx_id"] for m in consumed] == [sent["tx_id"]]
    assert doc["message"] == {"topic": "t-hist", "queue_id": consumed[0]["queue_id"], "queue_offset": consumed[0]["queue_offset"],
                              "commit_log_offset": message["commit_log_offset"]}
    assert 0 < doc["scanned"] and doc["scan_truncated"] is False
    # the same transaction by a half offset, and by the commit-log offset of any of its records
    assert one(run(broker, "inspect", "tx", str(c1["half_offset"]), "-o", "json"))["tx_id"] == sent["tx_id"]
    for cl in (message["commit_log_offset"], commit["commit_log_offset"], c1["commit_log_offset"]):
        assert one(run(broker, "inspect", "tx", str(cl), "--commit-log-offset", "-o", "json"))["tx_id"] == sent["tx_id"]
    table = out(ok(run(broker, "inspect", "tx", sent["tx_id"], "-o", "table")))
    assert "committed" in table and "answer: commit" in table and "EVENT" in table
    # offline, read-only, beside the running broker: the same timeline
    offline = wait_for(lambda: (d := one(run(broker, "inspect", "tx", sent["tx_id"], "--data-dir", str(broker_proc.data_dir), "-o", "json")))
                       and [e["event"] for e in d["events"]] == kinds and d, what="the offline history")
    assert offline["message"] == doc["message"] and offline["decided_by"] == "check"


def test_inspect_tx_of_an_unknown_transaction_exits_5(broker, broker_proc):
    r = run(broker, "inspect", "tx", "NO-SUCH-TX")
    assert r.returncode == NOT_FOUND and "no transaction" in err(r)
    r = run(broker, "inspect", "tx", "999999999")
    assert r.returncode == NOT_FOUND
    r = run(broker, "inspect", "tx", "NO-SUCH-TX", "--data-dir", str(broker_proc.data_dir))
    assert r.returncode == NOT_FOUND and "no transaction" in err(r)


def test_inspect_offsets_says_which_transaction_holds_the_half_progress(broker, broker_proc):
    pend(broker, "held", "stuck", topic="t-held")
    pend(broker, "held", "more", topic="t-held")

    def held():
        d = one(run(broker, "inspect", "offsets", "-o", "json"))
        return d if d["held_by"] is not None and "online" in d["held_by"]["reason"] else None

    doc = wait_for(held, what="held_by with no producer online")
    first = lines(ok(run(broker, "inspect", "half")))[0]
    h = doc["held_by"]
    assert doc["half"]["progress"] < doc["half"]["max"]
    assert h["tx_id"] == first["tx_id"] and h["half_offset"] == first["half_offset"]
    assert set(h) == {"tx_id", "group", "topic", "half_offset", "age_s", "checks", "last_check_result", "reason"}
    assert h["reason"] == f"no producer of group {first['group']} online"
    assert "held by " + first["tx_id"] in out(ok(run(broker, "inspect", "offsets", "-o", "table")))
    off = one(run(broker, "inspect", "offsets", "--data-dir", str(broker_proc.data_dir), "-o", "json"))
    assert off["held_by"]["tx_id"] == first["tx_id"] and "online" not in off["held_by"]["reason"]


def test_checker_reports_a_transaction_it_answered_unknown_when_it_is_discarded(tmp_path):
    b = start_broker(tmp_path)
    try:
        ok(txmq("config", "set", "max-checks", "1", broker=b.address))
        sent = pend(b.address, "gone", "maybe", topic="t-gone")
        p = subprocess.run(cli_argv("checker", "--group", "gone", "--answer", "unknown", "--idle-exit", "8s", "-o", "jsonl"),
                           capture_output=True, timeout=60, env=cli_env(b.address), stdin=subprocess.DEVNULL)
        assert p.returncode == 0, p.stderr.decode()
        rows = [json.loads(x) for x in p.stdout.decode().splitlines() if x.strip()]
        assert [(r["event"], r["answer"], r["status"]) for r in rows] == [("checked", "unknown", "noop"),
                                                                          ("discarded", "unknown", "discarded")], rows
        assert rows[1]["tx_id"] == sent["tx_id"] and rows[1]["outcome"] == "discarded" and "discard replay" in rows[1]["message"]
        # its history: the discard, then (after a replay) the replay copy
        ok(txmq("config", "set", "max-checks", "15", broker=b.address))
        ok(txmq("discard", "replay", sent["tx_id"], "--to", "half", broker=b.address))
        doc = one(txmq("inspect", "tx", sent["tx_id"], "-o", "json", broker=b.address))
        assert doc["state"] == "pending"
        kinds = [e["event"] for e in doc["events"]]
        assert kinds[:2] == ["half", "check"] and "discard" in kinds and kinds[-1] == "replay", kinds
        disc = next(e for e in doc["events"] if e["event"] == "discard")
        assert disc["reason"] == "max-checks" and disc["checks"] == 1
    finally:
        b.stop()


def test_an_all_digit_transaction_id_is_a_transaction_id_for_inspect_resolve_and_replay(broker):
    # the broker's ids are 32 hex digits; a run whose random prefix drew no letter gives ids like this one
    tx_id = "2786730268822456" + "0" * 15 + "1"

    async def go():
        c = await PipeClient.open(broker)
        try:
            return await c.ok("send", {"topic": "t-digits", "body": b"x",
                                       "properties": {"TRAN_MSG": "true", "PGROUP": "digits", "UNIQ_KEY": tx_id}})
        finally:
            await c.close()

    sent = arun(go())
    assert sent["tx_id"] == tx_id
    assert one(run(broker, "inspect", "tx", tx_id, "-o", "json"))["state"] == "pending"
    rows = lines(ok(run(broker, "resolve", "--commit", tx_id, "-o", "jsonl")))
    assert [(r["tx_id"], r["status"]) for r in rows] == [(tx_id, "ok")], rows
    rows = lines(ok(run(broker, "resolve", "--commit", "-", "-o", "jsonl", input=f"{tx_id}\n")))
    assert [(r["tx_id"], r["status"]) for r in rows] == [(tx_id, "already")], rows
    r = run(broker, "discard", "replay", tx_id, "--to", "half", "-o", "jsonl")
    assert r.returncode == CONFLICT and "it is committed" in err(r) and lines(r)[0]["ref"] == tx_id, err(r)


@pytest.mark.parametrize("tx_id", ["7F3AC0DE", "12345", "2786730268822456" + "0" * 15 + "1", "+5", "-3", "null", "-",
                                   "{x", "[1]", "a b", '"q"', "x[/y]", "it's"])
def test_a_transaction_id_written_as_a_ref_argument_reads_back_as_that_id(tx_id):
    import shlex

    from txmq.cli.commands._bulk import parse_ref, ref_argument

    (word,) = shlex.split(ref_argument(tx_id))
    assert parse_ref(word, "REF", "half_offset") == (tx_id, {"tx_id": tx_id})


def test_inspect_tx_reads_refs_as_resolve_does(broker):
    sent = pend(broker, "short-id")
    short = "12345"

    async def go():
        c = await PipeClient.open(broker)
        try:
            return await c.ok("send", {"topic": "t-txh", "body": b"x", "properties": {"TRAN_MSG": "true", "PGROUP": "g", "UNIQ_KEY": short}})
        finally:
            await c.close()

    arun(go())
    assert one(run(broker, "inspect", "tx", json.dumps(short), "-o", "json"))["tx_id"] == short  # a JSON string: an id
    assert one(run(broker, "inspect", "tx", f"+{sent['half_offset']}", "-o", "json"))["tx_id"] == sent["tx_id"]
    row = json.dumps({"tx_id": sent["tx_id"], "half_offset": 999999})  # a row of `inspect half -o jsonl`: its tx_id
    assert one(run(broker, "inspect", "tx", row, "-o", "json"))["tx_id"] == sent["tx_id"]


def test_a_transaction_named_with_its_half_copy_offsets_is_found_by_inspect_tx_and_resolve(broker, broker_proc):
    # <tx_id>:<commit-log offset>:<half offset>: the transaction id txmq's gRPC front end gave SDK producers before
    # it gave RocketMQ's (the message id), still in their logs
    sent = pend(broker, "older-form", "named with offsets", topic="t-older")
    older = f"{sent['tx_id']}:{sent['commit_log_offset']}:{sent['half_offset']}"
    assert one(run(broker, "inspect", "tx", older, "-o", "json"))["tx_id"] == sent["tx_id"]
    rows = lines(ok(run(broker, "resolve", "--rollback", older, "-o", "jsonl")))
    assert [(r["ref"], r["tx_id"], r["status"]) for r in rows] == [(older, sent["tx_id"], "ok")], rows
    doc = wait_for(lambda: (d := one(run(broker, "inspect", "tx", older, "--data-dir", str(broker_proc.data_dir), "-o", "json")))
                   and d["state"] == "rolled_back" and d, what="the offline history")
    assert doc["tx_id"] == sent["tx_id"]
    # an id of that shape is its own transaction's, never taken apart
    own = f"{sent['tx_id']}:1:2"

    async def go():
        c = await PipeClient.open(broker)
        try:
            return await c.ok("send", {"topic": "t-older", "body": b"x", "properties": {"TRAN_MSG": "true", "PGROUP": "g", "UNIQ_KEY": own}})
        finally:
            await c.close()

    assert arun(go())["tx_id"] == own
    assert one(run(broker, "inspect", "tx", own, "-o", "json"))["state"] == "pending"
    rows = lines(ok(run(broker, "resolve", "--commit", own, "-o", "jsonl")))
    assert [(r["tx_id"], r["status"]) for r in rows] == [(own, "ok")], rows
    assert one(run(broker, "inspect", "tx", sent["tx_id"], "-o", "json"))["state"] == "rolled_back"


def test_a_discarded_transaction_replayed_to_commit_keeps_its_checks_the_discard_and_the_replay(tmp_path):
    b = start_broker(tmp_path)
    try:
        ok(txmq("config", "set", "max-checks", "3", broker=b.address))
        sent = pend(b.address, "kept", "audit-me", topic="t-kept")
        ok(txmq("checker", "--group", "kept", "--answer", "unknown", "--limit", "3", "--idle-exit", "20s", broker=b.address, timeout=60))
        wait_for(lambda: one(txmq("inspect", "tx", sent["tx_id"], "-o", "json", broker=b.address))["state"] == "discarded",
                 what="the discard after 3 checks")
        (row,) = lines(ok(txmq("discard", "replay", sent["tx_id"], "--to", "commit", "--yes", "-o", "jsonl", broker=b.address)))
        assert row["status"] == "ok", row

        def audited(doc):
            assert doc["state"] == "committed" and doc["decided_by"] == "operator" and doc["checks"] == 3, doc
            kinds = [e["event"] for e in doc["events"]]
            assert kinds == ["half", "check", "check", "check", "discard", "replay", "commit", "message"], kinds
            by_kind = {e["event"]: e for e in doc["events"]}
            assert [e["checks"] for e in doc["events"] if e["event"] == "check"] == [1, 2, 3]
            assert by_kind["discard"]["reason"] == "max-checks" and by_kind["discard"]["checks"] == 3
            assert by_kind["replay"]["by"] == "operator" and by_kind["replay"]["to"] == "commit"
            assert by_kind["commit"]["by"] == "operator" and by_kind["commit"]["checks"] == 3
            assert doc["message"]["topic"] == "t-kept"

        audited(one(txmq("inspect", "tx", sent["tx_id"], "-o", "json", broker=b.address)))
        assert b.stop() == 0
        # the same from the data directory (the index file and the log), with no broker running
        audited(one(txmq("inspect", "tx", sent["tx_id"], "--data-dir", str(b.data_dir), "-o", "json")))
    finally:
        b.stop()


def test_absolute_times_are_iso_8601_utc_with_a_zone_in_every_command(broker):
    import datetime
    import re

    sent = one(run(broker, "send", "t-times", "x", "--tx", "--group", "times", "--state", "commit", "-o", "json"))
    doc = one(run(broker, "inspect", "tx", sent["tx_id"], "-o", "json"))
    iso = re.compile(r"\b(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)(?=\s|$)")

    def utc_ms(text: str) -> int:
        return int(datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)

    table = out(ok(run(broker, "inspect", "tx", sent["tx_id"], "-o", "table")))
    shown = [utc_ms(m) for m in iso.findall(table)]
    assert shown == [e["at"] for e in doc["events"]], table  # each event's time, in UTC, to the millisecond
    config = out(ok(run(broker, "config", "get", "-o", "table")))
    since = one(run(broker, "config", "get", "-o", "json"))["outcomes_known_since"]
    assert [utc_ms(m) for m in iso.findall(config)] == [since], config
    def stats_after_a_check_pass() -> str | None:
        text = out(ok(run(broker, "stats", "-o", "table")))
        return text if "last_check_pass.at" in text else None

    stats = wait_for(stats_after_a_check_pass, what="a check pass")
    at = next(line for line in stats.splitlines() if "last_check_pass.at" in line)
    assert iso.search(at), at
    for text in (table, config, stats):  # no time without its zone
        assert not re.search(r"\d\d:\d\d:\d\d(?!\.\d{3}Z)", text), text
