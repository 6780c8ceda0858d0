"""txmq send --message-group and txmq groups update --fifo through the real `txmq` entry point against a broker process."""

from __future__ import annotations

import pytest

from clihelpers import USAGE, err, lines, ok, one, start_broker, txmq

from txmq.broker.fifo import queue_of_group


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = start_broker(tmp_path_factory.mktemp("cli-fifo"))
    yield b
    b.stop()


def run(b, *args, **kw):
    return txmq(*args, broker=b.address, **kw)


def test_send_with_a_message_group_goes_to_the_groups_queue_and_stdin_lines_name_their_own(broker):
    ok(run(broker, "topics", "create", "cli-fifo", "--queues", "4", "--message-types", "normal,fifo"))
    r = one(run(broker, "send", "cli-fifo", "first", "--message-group", "order-7", "-o", "json"))
    assert r["queue_id"] == queue_of_group("order-7", 4)
    feed = "order-1\ta\norder-2\tb\norder-1\tc\nno-tab-here\n\t empty group\norder-2\td\n"
    res = run(broker, "send", "cli-fifo", "--message-group", "-", "-o", "jsonl", input=feed)
    assert res.returncode != 0
    rows = lines(res)
    assert [(x["line"], x["queue_id"]) for x in rows] == [(1, queue_of_group("order-1", 4)), (2, queue_of_group("order-2", 4)),
                                                          (3, queue_of_group("order-1", 4)), (6, queue_of_group("order-2", 4))]
    assert "line 4: no tab" in err(res) and "line 5: a message group must not be empty" in err(res)
    stored = lines(ok(run(broker, "read", "cli-fifo", "-o", "jsonl")))
    by_group: dict[str, list] = {}
    for m in sorted(stored, key=lambda m: (m["queue_id"], m["queue_offset"])):
        by_group.setdefault(m["properties"].get("__SHARDINGKEY"), []).append(m["body"])
    assert by_group == {"order-7": ["first"], "order-1": ["a", "c"], "order-2": ["b", "d"]}


@pytest.mark.parametrize("args, words", [
    (["x", "--message-group", " "], "white space"),
    (["x", "--message-group", "g", "--tx", "--group", "p"], "does not go with --tx"),
    (["x", "--message-group", "g", "--queue", "1"], "leave --queue out"),
    (["x", "--message-group", "-"], "pipe lines on stdin"),
    (["x", "--message-group", "g", "--delay", "30s"], "does not go with --delay or --deliver-at"),
    (["x", "--message-group", "-", "--deliver-at", "2030-01-01T00:00:00Z"], "does not go with --delay or --deliver-at"),
])
def test_bad_message_group_options_are_usage_errors(broker, args, words):
    r = run(broker, "send", "cli-fifo", *args)
    assert r.returncode == USAGE and words in err(r), err(r)


def test_a_topic_without_fifo_refuses_a_message_group_and_says_how_to_accept_it(broker):
    ok(run(broker, "topics", "create", "cli-plain"))
    r = run(broker, "send", "cli-plain", "x", "--message-group", "g")
    assert r.returncode != 0 and "txmq topics update cli-plain --message-types normal,fifo,transaction" in err(r)


def test_groups_update_marks_a_group_fifo_and_list_and_describe_show_it(broker):
    r = one(run(broker, "groups", "update", "cli-fifo-group", "--fifo", "-o", "json"))
    assert (r["fifo"], r["changed"], r["old"]) == (True, True, {"fifo": False})
    rows = {g["group"]: g for g in lines(ok(run(broker, "groups", "list")))}
    assert rows["cli-fifo-group"]["fifo"] is True
    assert one(run(broker, "groups", "describe", "cli-fifo-group", "-o", "json"))["fifo"] is True
    table = ok(run(broker, "groups", "describe", "cli-fifo-group", "-o", "table"))
    assert "FIFO (each queue in order)" in err(table)
    assert one(run(broker, "groups", "update", "cli-fifo-group", "--no-fifo", "-o", "json"))["fifo"] is False
    r = run(broker, "groups", "update", "cli-fifo-group")
    assert r.returncode == USAGE and "--fifo or --no-fifo" in err(r)
    # kept across a restart
    ok(run(broker, "groups", "update", "cli-fifo-group", "--fifo"))
    broker.stop()
    broker.start()
    assert one(run(broker, "groups", "describe", "cli-fifo-group", "-o", "json"))["fifo"] is True
