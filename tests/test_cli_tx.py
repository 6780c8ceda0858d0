"""Transactions through the CLI only: inspect, resolve (and the README pipelines), checker, discard."""

import json
import re
import signal
import subprocess
import time

import pytest

from clihelpers import (
    CONFLICT, NOT_FOUND, OK, PARTIAL, USAGE, cli_argv, cli_env, err, lines, needs_jq, ok, one, out, shell,
    start_broker, txmq, wait_for,
)

HALF_KEYS = {"tx_id", "half_offset", "commit_log_offset", "topic", "queue_id", "group", "born_at", "stored_at", "age_s", "checks",
             "last_check_at", "last_check_result", "next_check_at"}
REF_KEYS = {"ref", "tx_id", "status", "message"}


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = start_broker(tmp_path_factory.mktemp("cli-tx"))
    yield b.address
    b.stop()


def run(broker, *args, **kw):
    return txmq(*args, broker=broker, **kw)


def pend(broker, group, body="x", topic="t-tx"):
    """A transaction left pending (its producer 'died' after the half message)."""
    return one(run(broker, "send", topic, body, "--tx", "--group", group, "-o", "json"))


def pending_ids(broker, group):
    return [r["tx_id"] for r in lines(ok(run(broker, "inspect", "half", "--group", group)))]


def test_inspect_half(broker):
    a = pend(broker, "ih", "a", topic="t-ih1")
    b = pend(broker, "ih", "b", topic="t-ih2")
    rows = lines(ok(run(broker, "inspect", "half", "--group", "ih")))
    assert [r["tx_id"] for r in rows] == [a["tx_id"], b["tx_id"]]
    assert set(rows[0]) == HALF_KEYS
    r = rows[0]
    assert (r["half_offset"], r["commit_log_offset"], r["topic"], r["queue_id"], r["group"]) == (
        a["half_offset"], a["commit_log_offset"], "t-ih1", a["queue_id"], "ih")
    assert r["checks"] == 0 and r["age_s"] >= 0 and r["born_at"] > 0
    assert [x["tx_id"] for x in lines(ok(run(broker, "inspect", "half", "--group", "ih", "--topic", "t-ih2")))] == [b["tx_id"]]
    assert len(lines(ok(run(broker, "inspect", "half", "--group", "ih", "--limit", "1")))) == 1
    assert lines(ok(run(broker, "inspect", "half", "--group", "ih", "--older-than", "1h"))) == []
    doc = json.loads(out(ok(run(broker, "inspect", "half", "--group", "ih", "-o", "json"))))
    assert isinstance(doc, list) and len(doc) == 2
    table = out(ok(run(broker, "inspect", "half", "--group", "ih", "-o", "table", subprocess_=True)))
    assert a["tx_id"] in table and "\x1b[" not in table and "HALF OFFSET" in table


def test_inspect_offsets_and_op(broker):
    c = one(run(broker, "send", "t-io", "c", "--tx", "--group", "io", "--state", "commit", "-o", "json"))
    r = one(run(broker, "send", "t-io", "r", "--tx", "--group", "io", "--state", "rollback", "-o", "json"))
    offsets = one(run(broker, "inspect", "offsets", "-o", "json"))
    assert set(offsets) >= {"half", "op", "pending"}
    assert set(offsets["half"]) == {"progress", "max"} and set(offsets["op"]) == {"progress", "max"}
    assert offsets["op"]["max"] >= 2 and offsets["half"]["max"] >= 2 and offsets["pending"] >= 0
    ops = {o["tx_id"]: o for o in lines(ok(run(broker, "inspect", "op", "--from", "0", "--limit", "1000")))}
    assert ops[c["tx_id"]]["action"] == "commit" and ops[r["tx_id"]]["action"] == "rollback"
    assert ops[c["tx_id"]]["half_offset"] == c["half_offset"] and ops[c["tx_id"]]["decided_by"] == "producer"
    assert ops[c["tx_id"]]["half_commit_log_offset"] == c["commit_log_offset"]
    newest = lines(ok(run(broker, "inspect", "op", "--limit", "1")))
    assert [o["tx_id"] for o in newest] == [r["tx_id"]]
    assert "pending:" in out(ok(run(broker, "inspect", "offsets", "-o", "table")))


def test_inspect_op_table_shows_relative_ages(broker):
    one(run(broker, "send", "t-io-age", "c", "--tx", "--group", "io-age", "--state", "commit", "-o", "json"))
    table = out(ok(run(broker, "inspect", "op", "--limit", "1", "-o", "table", subprocess_=True)))
    assert "DECIDED" in table and (" ago" in table or " now" in table), table
    assert not re.search(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}", table), table  # no absolute time
    (row,) = lines(ok(run(broker, "inspect", "op", "--limit", "1", "-o", "jsonl")))
    assert isinstance(row["decided_at"], int)  # JSON keeps the epoch milliseconds


def test_resolve_each_kind_of_ref(broker):
    a, b, c = (pend(broker, "rs", body, topic="t-rs") for body in ("a", "b", "c"))
    (row,) = lines(ok(run(broker, "resolve", "--commit", str(a["half_offset"]))))
    assert set(row) == REF_KEYS and row == {"ref": str(a["half_offset"]), "tx_id": a["tx_id"], "status": "ok", "message": row["message"]}
    (row,) = lines(ok(run(broker, "resolve", "--rollback", b["tx_id"])))
    assert row["status"] == "ok" and row["tx_id"] == b["tx_id"]
    (row,) = lines(ok(run(broker, "resolve", "--commit", "--commit-log-offset", str(c["commit_log_offset"]))))
    assert row["status"] == "ok" and row["tx_id"] == c["tx_id"]
    assert pending_ids(broker, "rs") == []
    assert sorted(m["body"] for m in lines(ok(run(broker, "consume", "t-rs", "--group", "audit")))) == ["a", "c"]
    # the same decision again: already, exit 0
    (row,) = lines(ok(run(broker, "resolve", "--commit", a["tx_id"])))
    assert row["status"] == "already"
    # the opposite decision: conflict, exit 6, one line on stderr
    r = run(broker, "resolve", "--rollback", str(a["half_offset"]))
    assert r.returncode == CONFLICT and lines(r)[0]["status"] == "conflict"
    assert "already committed" in err(r) and err(r).count("\n") == 1
    # unknown REFs: not found, exit 5
    for ref in ("999999", "NO-SUCH-TX"):
        r = run(broker, "resolve", "--commit", ref)
        assert r.returncode == NOT_FOUND and lines(r)[0]["status"] == "not_found", err(r)
        assert ref in err(r)


def test_resolve_several_refs_needs_yes_and_reports_each(broker):
    a, b = pend(broker, "rb", "a"), pend(broker, "rb", "b")
    r = run(broker, "resolve", "--rollback", a["tx_id"], b["tx_id"])
    assert r.returncode == USAGE and "--yes" in err(r) and out(r) == ""
    dry = lines(ok(run(broker, "resolve", "--rollback", a["tx_id"], b["tx_id"], "--dry-run")))
    assert [x["status"] for x in dry] == ["ok", "ok"] and all("would" in x["message"] for x in dry)
    assert pending_ids(broker, "rb") == [a["tx_id"], b["tx_id"]]  # the dry run changed nothing
    r = run(broker, "resolve", "--rollback", a["tx_id"], b["tx_id"], "999999", "--yes")
    assert r.returncode == PARTIAL, err(r)
    assert [x["status"] for x in lines(r)] == ["ok", "ok", "not_found"]
    assert "1 of 3" in err(r)
    assert pending_ids(broker, "rb") == []
    r = run(broker, "resolve", "--commit", "1", "--rollback")
    assert r.returncode == USAGE


@needs_jq
def ages(broker, group):
    return {r["tx_id"]: r["age_s"] for r in lines(ok(run(broker, "inspect", "half", "--group", group)))}


def test_readme_pipeline_rolls_back_what_is_older_than_n(broker):
    old = pend(broker, "pj", "old")
    # old is past the threshold by the broker's own clock before new is sent, so it is always selected
    wait_for(lambda: ages(broker, "pj")[old["tx_id"]] >= 3, timeout=60, what="the first transaction to be 3 s old")
    sent_at = time.monotonic()
    new = pend(broker, "pj", "new")
    r = shell("txmq inspect half --group pj --older-than 3s -o jsonl | jq -r .tx_id | txmq resolve --rollback - --yes", broker)
    took = time.monotonic() - sent_at  # new's age when the pipeline listed is at most this
    assert r.returncode == OK, err(r)
    rolled = [(x["tx_id"], x["status"]) for x in lines(r)]
    if took < 3:  # new cannot have been 3 s old: exactly the old one goes
        assert rolled == [(old["tx_id"], "ok")]
        assert pending_ids(broker, "pj") == [new["tx_id"]]
    else:  # a machine slow enough that new aged past the threshold too: whatever went, went once and in order
        assert rolled in ([(old["tx_id"], "ok")], [(old["tx_id"], "ok"), (new["tx_id"], "ok")]), rolled
        if len(rolled) == 2:
            new = pend(broker, "pj", "new")
        assert pending_ids(broker, "pj") == [new["tx_id"]]
    # jq without -r prints JSON strings: accepted too
    r = shell("txmq inspect half --group pj -o jsonl | jq .tx_id | txmq resolve --rollback - --yes", broker)
    assert r.returncode == OK and [x["tx_id"] for x in lines(r)] == [new["tx_id"]]


def test_pipeline_without_jq_takes_json_lines(broker):
    a, b = pend(broker, "pn", "a", topic="t-pn"), pend(broker, "pn", "b", topic="t-pn")
    r = shell("txmq inspect half --group pn | txmq resolve --commit - --yes", broker)
    assert r.returncode == OK, err(r)
    assert [(x["ref"], x["status"]) for x in lines(r)] == [(a["tx_id"], "ok"), (b["tx_id"], "ok")]
    assert sorted(m["body"] for m in lines(ok(run(broker, "consume", "t-pn", "--group", "audit")))) == ["a", "b"]
    # nothing pending: nothing to do, not an error
    r = shell("txmq inspect half --group pn | txmq resolve --commit - --yes", broker)
    assert r.returncode == OK and out(r) == "" and "nothing" in err(r)
    # garbage on stdin is a usage error
    r = txmq("resolve", "--commit", "-", "--yes", broker=broker, input='{"half": 1}\n')
    assert r.returncode == USAGE and "tx_id" in err(r)


def test_resolve_takes_the_json_document_of_a_listing_on_stdin(broker):
    a, b = pend(broker, "pj", "a", topic="t-pj"), pend(broker, "pj", "b", topic="t-pj")
    r = shell("txmq inspect half --group pj -o json | txmq resolve --rollback - --yes", broker)
    assert r.returncode == OK, err(r)
    assert sorted((x["ref"], x["status"]) for x in lines(r)) == sorted([(a["tx_id"], "ok"), (b["tx_id"], "ok")])
    r = txmq("resolve", "--commit", "-", "--yes", broker=broker, input='[{"half": 1}]\n')
    assert r.returncode == USAGE and "stdin element 1" in err(r)
    r = txmq("resolve", "--commit", "-", "--yes", broker=broker, input='[1, 2\n')
    assert r.returncode == USAGE and "not a valid JSON document" in err(r)


def test_check_back_round_trip_driven_only_by_the_cli(broker):
    sent = pend(broker, "cb", "order-42", topic="t-cb")
    assert pending_ids(broker, "cb") == [sent["tx_id"]]
    r = ok(run(broker, "checker", "--group", "cb", "--answer", "commit", "--limit", "1", "--idle-exit", "20s", timeout=40))
    (answered,) = lines(r)
    assert answered["tx_id"] == sent["tx_id"] and answered["answer"] == "commit"
    assert answered["status"] == "ok" and answered["outcome"] == "committed" and answered["checks"] == 1
    assert pending_ids(broker, "cb") == []
    got = lines(ok(run(broker, "consume", "t-cb", "--group", "audit")))
    assert [(m["body"], m["tx_id"]) for m in got] == [("order-42", sent["tx_id"])]
    assert lines(ok(run(broker, "consume", "t-cb", "--group", "audit"))) == []  # shown once


def test_checker_exec_decides_per_message(broker, tmp_path):
    script = tmp_path / "decide.sh"
    script.write_text('#!/bin/sh\nmsg=$(cat)\ncase "$msg" in\n'
                      '  *\'"body":"paid"\'*) echo commit ;;\n'
                      '  *\'"body":"unpaid"\'*) echo ROLLBACK_MESSAGE ;;\n'
                      '  *) echo maybe ;;\nesac\n')
    script.chmod(0o755)
    ids = {pend(broker, "ce", body, topic="t-ce")["tx_id"]: body for body in ("paid", "unpaid", "odd")}
    r = ok(run(broker, "checker", "--group", "ce", "--exec", str(script), "--limit", "3", "--idle-exit", "20s", timeout=40))
    answers = {row["tx_id"]: row["answer"] for row in lines(r)}
    assert {ids[t]: a for t, a in answers.items()} == {"paid": "commit", "unpaid": "rollback", "odd": "unknown"}
    assert "printed 'maybe'" in err(r)
    assert [m["body"] for m in lines(ok(run(broker, "consume", "t-ce", "--group", "audit")))] == ["paid"]
    # the environment names the transaction
    odd = next(t for t, b in ids.items() if b == "odd")
    r = ok(run(broker, "checker", "--group", "ce", "--exec", 'test "$TXMQ_TX_ID" = ' + odd + ' && echo rollback',
               "--limit", "1", "--idle-exit", "20s", timeout=40))
    assert [(x["tx_id"], x["answer"], x["outcome"]) for x in lines(r)] == [(odd, "rollback", "rolled_back")]


def test_checker_stops_cleanly_on_sigterm(broker):
    p = subprocess.Popen(cli_argv("checker", "--group", "cs", "--answer", "rollback"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=cli_env(broker))
    try:
        assert b"checker for group cs" in p.stderr.readline()
        sent = pend(broker, "cs", "bye")
        row = json.loads(p.stdout.readline())
        assert row["tx_id"] == sent["tx_id"] and row["outcome"] == "rolled_back"
        p.send_signal(signal.SIGTERM)
        assert p.wait(15) == 0
        assert b"1 check-back(s) answered" in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()


def test_discard_list_and_replay(broker):
    ok(run(broker, "config", "set", "max-checks", "1"))
    try:
        a, b = pend(broker, "dd", "to-half", topic="t-dd"), pend(broker, "dd", "to-commit", topic="t-dd")
        ok(run(broker, "checker", "--group", "dd", "--answer", "unknown", "--limit", "2", "--idle-exit", "20s", timeout=40))

        def discarded():
            rows = [x for x in lines(ok(run(broker, "discard", "list"))) if x["group"] == "dd"]
            return rows if len(rows) == 2 else None

        rows = wait_for(discarded, what="both transactions in the discard topic")
        assert set(rows[0]) >= {"tx_id", "topic", "group", "checks", "discarded_at", "discard_offset"}
        assert {x["tx_id"] for x in rows} == {a["tx_id"], b["tx_id"]} and all(x["checks"] == 1 for x in rows)
        assert pending_ids(broker, "dd") == []
        r = run(broker, "resolve", "--commit", a["tx_id"])
        assert r.returncode == CONFLICT and "discard" in err(r)

        r = run(broker, "discard", "replay", "--all")
        assert r.returncode == USAGE and "--yes" in err(r)
        (row,) = lines(ok(run(broker, "discard", "replay", a["tx_id"], "--to", "half")))
        assert set(row) == REF_KEYS and row["status"] == "ok"
        (back,) = lines(ok(run(broker, "inspect", "half", "--group", "dd")))
        assert back["tx_id"] == a["tx_id"] and back["checks"] == 0
        off = next(x["discard_offset"] for x in rows if x["tx_id"] == b["tx_id"])
        (row,) = lines(ok(run(broker, "discard", "replay", str(off), "--to", "commit")))
        assert row["status"] == "ok" and row["tx_id"] == b["tx_id"]
        assert [m["body"] for m in lines(ok(run(broker, "consume", "t-dd", "--group", "audit")))] == ["to-commit"]
        r = run(broker, "discard", "replay", str(off))
        assert r.returncode in (NOT_FOUND, CONFLICT)
        ok(run(broker, "resolve", "--rollback", a["tx_id"]))
    finally:
        ok(run(broker, "config", "set", "max-checks", "15"))
