"""send, consume, topics, stats, config through the real `txmq` entry point against a broker process."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from clihelpers import (
    NOT_FOUND, USAGE, cli_argv, cli_env, err, lines, ok, one, out, start_broker, txmq,
)


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = start_broker(tmp_path_factory.mktemp("cli-messages"))
    yield b.address
    b.stop()


def run(broker, *args, **kw):
    return txmq(*args, broker=broker, **kw)


def test_send_one_message_prints_its_offsets_and_consume_shows_it(broker):
    sent = one(run(broker, "send", "m-one", "hello", "--tag", "created", "--key", "k1", "--key", "k2",
                   "--prop", "region=eu", "-o", "json"))
    assert set(sent) == {"msg_id", "topic", "queue_id", "queue_offset", "commit_log_offset"}
    assert sent["topic"] == "m-one"
    got = lines(ok(run(broker, "consume", "m-one", "--group", "g1")))
    assert len(got) == 1
    m = got[0]
    assert m["body"] == "hello" and m["tags"] == "created" and m["keys"] == "k1 k2"
    assert m["properties"]["region"] == "eu" and "TAGS" not in m["properties"]
    assert (m["queue_id"], m["queue_offset"], m["commit_log_offset"], m["msg_id"]) == (
        sent["queue_id"], sent["queue_offset"], sent["commit_log_offset"], sent["msg_id"])
    assert "tx_id" not in m


def test_send_stdin_lines_prints_each_acknowledgement(broker):
    body = "".join(f"line {i}\n" for i in range(1, 301)) + "\n"  # a trailing blank line is skipped
    r = ok(run(broker, "send", "m-lines", "--window", "32", input=body))
    rows = lines(r)
    assert sorted(x["line"] for x in rows) == list(range(1, 301))
    assert all(x["topic"] == "m-lines" for x in rows)
    got = lines(ok(run(broker, "consume", "m-lines", "--group", "g1")))
    assert sorted(m["body"] for m in got) == sorted(f"line {i}" for i in range(1, 301))
    # BODY '-' reads stdin too
    assert len(lines(ok(run(broker, "send", "m-lines", "-", input="a\nb\n")))) == 2


def test_send_table_in_a_pipe_has_no_colour_or_boxes(broker):
    r = ok(run(broker, "send", "m-table", "x", "-o", "table", subprocess_=True))
    text = out(r)
    assert "\x1b[" not in text and "─" not in text and "│" not in text
    assert "queue_offset" in text


def test_send_tx_states(broker):
    committed = one(run(broker, "send", "m-tx", "c", "--tx", "--group", "mg", "--state", "commit", "-o", "json"))
    assert set(committed) >= {"msg_id", "topic", "queue_id", "commit_log_offset", "tx_id", "half_offset", "state"}
    assert committed["state"] == "committed"
    rolled = one(run(broker, "send", "m-tx", "r", "--tx", "--group", "mg", "--state", "rollback", "-o", "json"))
    assert rolled["state"] == "rolled_back"
    pending = one(run(broker, "send", "m-tx", "p", "--tx", "--group", "mg", "-o", "json"))
    assert pending["state"] == "pending"
    got = lines(ok(run(broker, "consume", "m-tx", "--group", "g1")))
    assert [m["body"] for m in got] == ["c"] and got[0]["tx_id"] == committed["tx_id"]
    half = lines(ok(run(broker, "inspect", "half", "--group", "mg")))
    assert [h["tx_id"] for h in half] == [pending["tx_id"]]


def test_consume_commits_offsets_as_it_goes(broker):
    ok(run(broker, "send", "m-offsets", "-", input="".join(f"{i}\n" for i in range(10))))
    first = lines(ok(run(broker, "consume", "m-offsets", "--group", "c1", "--limit", "4")))
    rest = lines(ok(run(broker, "consume", "m-offsets", "--group", "c1")))
    assert len(first) == 4 and len(rest) == 6
    assert sorted(m["body"] for m in first + rest) == [str(i) for i in range(10)]
    assert lines(ok(run(broker, "consume", "m-offsets", "--group", "c1"))) == []
    # a new group from latest sees nothing old
    assert lines(ok(run(broker, "consume", "m-offsets", "--group", "c2", "--from", "latest"))) == []


def test_consume_follow_streams_and_stops_cleanly_on_sigterm(broker):
    p = subprocess.Popen(cli_argv("consume", "m-follow", "--group", "f1", "--follow"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=cli_env(broker))
    try:
        ok(run(broker, "send", "m-follow", "first"))
        row = json.loads(p.stdout.readline())
        assert row["body"] == "first"
        p.send_signal(signal.SIGTERM)
        assert p.wait(15) == 0, p.stderr.read().decode()
    finally:
        if p.poll() is None:
            p.kill()
    assert lines(ok(run(broker, "consume", "m-follow", "--group", "f1"))) == []  # its offset was committed


def test_consume_binary_body_is_base64(broker):
    ok(run(broker, "send", "m-bin", "-", input=b"\xff\xfe\x00ok\n"))
    (m,) = lines(ok(run(broker, "consume", "m-bin", "--group", "g1")))
    assert "body" not in m and m["body_base64"] == "//4Ab2s="


def test_consume_unknown_topic_is_not_found(broker):
    r = run(broker, "consume", "m-nope", "--group", "g1")
    assert r.returncode == NOT_FOUND and "m-nope" in err(r)


def test_topics(broker):
    ok(run(broker, "send", "m-topics", "x"))
    rows = lines(ok(run(broker, "topics")))
    t = next(r for r in rows if r["topic"] == "m-topics")
    assert t == {"topic": "m-topics", "queues": 4, "messages": 1, "system": False, "message_types": ["normal", "transaction"]}
    assert not any(r["system"] for r in rows)
    system = {r["topic"] for r in lines(ok(run(broker, "topics", "--system")))}
    assert "RMQ_SYS_TRANS_HALF_TOPIC" in system


def test_stats_once_and_watch(broker):
    doc = one(run(broker, "stats", "-o", "json"))
    assert set(doc) == {"counters", "gauges"} and doc["counters"]["messages_sent"] >= 1
    rows = lines(ok(run(broker, "stats", "--watch", "--count", "2", "--interval", "100ms")))
    assert len(rows) == 2 and all({"time_ms", "counters", "gauges"} <= set(r) for r in rows)


def test_config_get_and_set(broker):
    doc = one(run(broker, "config", "get", "-o", "json"))
    assert set(doc) == {"check_interval_s", "transaction_timeout_s", "max_checks", "retention_s", "outcomes_known_since"}
    assert doc["check_interval_s"] == 1.0
    # the window of known outcomes: the oldest record still in the log (the broker's fixture sent some)
    assert isinstance(doc["outcomes_known_since"], int) and doc["outcomes_known_since"] <= time.time() * 1000
    assert "outcomes-known-since" in out(ok(run(broker, "config", "get", "-o", "table")))
    r = run(broker, "config", "set", "outcomes-known-since", "1s")
    assert r.returncode == USAGE and "read-only" in err(r)
    changed = one(run(broker, "config", "set", "check-interval", "2s", "-o", "json"))
    assert changed == {"key": "check_interval_s", "old": 1.0, "new": 2.0}
    assert one(run(broker, "config", "set", "timeout", "1m30s", "-o", "json"))["new"] == 90.0
    assert one(run(broker, "config", "set", "retention", "72h", "-o", "json"))["new"] == 72 * 3600.0
    assert one(run(broker, "config", "set", "max-checks", "5", "-o", "json"))["new"] == 5
    assert one(run(broker, "config", "get", "transaction-timeout", "-o", "json")) == {"transaction_timeout_s": 90.0}
    table = out(ok(run(broker, "config", "get", "-o", "table")))
    assert "2s" in table and "1m30s" in table and "72h" in table
    text = out(ok(run(broker, "config", "set", "check-interval", "1", "-o", "table")))
    assert "2s -> 1s" in text
    ok(run(broker, "config", "set", "timeout", "0s"))
    ok(run(broker, "config", "set", "max-checks", "15"))


@pytest.mark.parametrize("args, needle", [
    (["config", "set", "check-interval", "soon"], "bad duration"),
    (["config", "set", "max-checks", "many"], "whole number"),
    (["config", "set", "colour", "red"], "unknown setting"),
    (["config", "set", "max-checks", "0"], "max_checks"),  # the broker's range check
    (["send", "m-x", "y", "--tx"], "--group"),
    (["send", "RMQ_SYS_TRANS_HALF_TOPIC", "y"], "system topic"),
    (["send", "bad topic!", "y"], "invalid topic"),
    (["send", "m-x", "y", "--prop", "novalue"], "KEY=VALUE"),
    (["send", "m-x", "y", "--state", "commit"], "--tx"),
    (["stats", "--watch", "--interval", "0s"], "interval"),
    (["consume", "RMQ_SYS_TRANS_OP_HALF_TOPIC", "--group", "g"], "system topic"),
])
def test_bad_input_is_a_usage_error(broker, args, needle):
    r = run(broker, *args)
    assert r.returncode == USAGE, err(r)
    assert needle in err(r) and err(r).count("\n") == 1 and "Traceback" not in err(r)


def test_send_tx_stdin_lines_pipeline_their_ends_and_report_each_outcome(broker):
    body = "".join(f"order {i}\n" for i in range(1, 201))
    r = ok(run(broker, "send", "m-tx-lines", "--tx", "--group", "shop", "--state", "commit", "--window", "4", input=body))
    rows = lines(r)
    assert sorted(x["line"] for x in rows) == list(range(1, 201))
    assert {x["state"] for x in rows} == {"committed"}  # printed once the end's reply arrived
    got = lines(ok(run(broker, "consume", "m-tx-lines", "--group", "g-tx")))
    assert sorted(m["body"] for m in got) == sorted(f"order {i}" for i in range(1, 201))


def test_stats_table_shows_levels_as_gauges_times_as_times_and_no_none(broker):
    text = out(ok(run(broker, "stats", "-o", "table")))
    rows = {line.split()[1]: line.split()[0] for line in text.splitlines()[1:] if len(line.split()) >= 3}
    assert rows.get("flush_seconds_avg") == "gauge" and rows.get("flush_seconds_max") == "gauge"
    assert "None" not in text and "[]" not in text
    assert sum(1 for line in text.splitlines() if line.split()[1:2] == ["check_passes"]) <= 1
    if "last_check_pass.at" in text:
        assert "Z" in next(line for line in text.splitlines() if "last_check_pass.at" in line)
