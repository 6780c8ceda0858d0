"""groups list|describe|reset, read, message get|find through the real `txmq` entry point against a broker process."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from clihelpers import CONFLICT, NOT_FOUND, USAGE, err, lines, ok, one, start_broker, txmq


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = start_broker(tmp_path_factory.mktemp("cli-groups"))
    yield b.address
    b.stop()


def run(broker, *args, **kw):
    return txmq(*args, broker=broker, **kw)


def send_lines(broker, topic, n, *extra):
    body = "".join(f"{topic}-{i}\n" for i in range(n))
    return lines(ok(run(broker, "send", topic, "--queue", "0", *extra, input=body)))


def test_groups_describe_shows_committed_max_and_lag_per_queue(broker):
    send_lines(broker, "g-desc", 5)
    ok(run(broker, "consume", "g-desc", "--group", "gd", "--limit", "3", "-q", "0"))
    d = one(run(broker, "groups", "describe", "gd", "-o", "json"))
    assert d["group"] == "gd" and d["topics"] == ["g-desc"] and d["consumers"] == 0
    q0 = [q for q in d["queues"] if q["queue_id"] == 0][0]
    assert (q0["committed"], q0["max_offset"], q0["lag"]) == (3, 5, 2)
    assert [q for q in d["queues"] if q["queue_id"] == 1][0]["committed"] is None
    assert d["total_lag"] == 2
    listed = {g["group"]: g for g in lines(ok(run(broker, "groups", "list")))}
    assert listed["gd"]["topics"] == ["g-desc"] and listed["gd"]["lag"] == 2


def test_groups_lag_counts_a_queue_never_committed_from_where_the_group_starts_reading_it(broker):
    # queue 0: 5 messages, 3 consumed and committed; queue 1: 4 messages the group never read (a new
    # consumer of the group starts it at its first message still stored, the queue's min offset)
    send_lines(broker, "g-lag", 5)
    ok(run(broker, "send", "g-lag", "--queue", "1", input="".join(f"q1-{i}\n" for i in range(4))))
    ok(run(broker, "consume", "g-lag", "--group", "gl", "--limit", "3", "-q", "0"))
    d = one(run(broker, "groups", "describe", "gl", "-o", "json"))
    by_q = {q["queue_id"]: q for q in d["queues"]}
    assert (by_q[0]["committed"], by_q[0]["lag"]) == (3, 2)
    assert (by_q[1]["committed"], by_q[1]["min_offset"], by_q[1]["max_offset"], by_q[1]["lag"]) == (None, 0, 4, 4)
    assert d["total_lag"] == 6
    listed = {g["group"]: g for g in lines(ok(run(broker, "groups", "list")))}
    assert listed["gl"]["lag"] == 6
    # what is left to read is what a consumer of the group then reads
    read = lines(ok(run(broker, "consume", "g-lag", "--group", "gl")))
    assert len(read) == 6
    listed = {g["group"]: g for g in lines(ok(run(broker, "groups", "list")))}
    assert listed["gl"]["lag"] == 0


def test_groups_describe_unknown_group_is_not_found(broker):
    r = run(broker, "groups", "describe", "no-such-group")
    assert r.returncode == NOT_FOUND and "no consumer group" in err(r)


def test_groups_update_refuses_a_group_name_with_a_space_with_a_usage_error_and_stores_nothing(broker):
    r = run(broker, "groups", "update", "bad group", "--fifo")
    assert r.returncode == USAGE and "'bad group' is not a group name" in err(r) and not r.stdout
    assert "bad group" not in {g["group"] for g in lines(ok(run(broker, "groups", "list")))}


def test_groups_reset_dry_run_plans_and_changes_nothing(broker):
    send_lines(broker, "g-dry", 4)
    ok(run(broker, "consume", "g-dry", "--group", "gdry", "-q", "0"))
    plan = one(run(broker, "groups", "reset", "gdry", "--topic", "g-dry", "--to", "earliest", "--dry-run", "-o", "json"))
    q0 = [q for q in plan["queues"] if q["queue_id"] == 0][0]
    assert plan["dry_run"] is True and (q0["old"], q0["new"]) == (4, 0)
    d = one(run(broker, "groups", "describe", "gdry", "-o", "json"))
    assert [q for q in d["queues"] if q["queue_id"] == 0][0]["committed"] == 4


def test_groups_reset_without_yes_and_no_terminal_is_refused(broker):
    send_lines(broker, "g-noyes", 1)
    r = run(broker, "groups", "reset", "gx", "--topic", "g-noyes", "--to", "earliest")
    assert r.returncode == USAGE and "--yes" in err(r)


def test_groups_reset_to_earliest_offset_and_latest_moves_what_consume_reads(broker):
    send_lines(broker, "g-reset", 6)
    ok(run(broker, "consume", "g-reset", "--group", "gr", "-q", "0"))
    ok(run(broker, "groups", "reset", "gr", "--topic", "g-reset", "--to", "earliest", "--queue", "0", "--yes"))
    assert [m["queue_offset"] for m in lines(ok(run(broker, "consume", "g-reset", "--group", "gr", "-q", "0")))] == list(range(6))
    ok(run(broker, "groups", "reset", "gr", "--topic", "g-reset", "--to", "4", "--queue", "0", "--yes"))
    assert [m["queue_offset"] for m in lines(ok(run(broker, "consume", "g-reset", "--group", "gr", "-q", "0")))] == [4, 5]
    res = lines(ok(run(broker, "groups", "reset", "gr", "--topic", "g-reset", "--to", "999", "--yes", "-q", "0")))
    assert res[0]["new"] == 6  # kept within the queue's max
    ok(run(broker, "groups", "reset", "gr", "--topic", "g-reset", "--to", "earliest", "--yes"))
    ok(run(broker, "groups", "reset", "gr", "--topic", "g-reset", "--to", "latest", "--yes"))
    assert lines(ok(run(broker, "consume", "g-reset", "--group", "gr"))) == []


def test_groups_reset_to_time_finds_first_message_stored_at_or_after_it(broker):
    first = send_lines(broker, "g-time", 3)
    time.sleep(1.2)
    mark = time.time()
    time.sleep(0.05)
    send_lines(broker, "g-time", 2)
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(mark)) + f".{int(mark * 1000) % 1000:03d}Z"
    res = lines(ok(run(broker, "groups", "reset", "gt", "--topic", "g-time", "--to", iso, "--yes", "-q", "0")))
    assert res[0]["new"] == len(first)
    res = lines(ok(run(broker, "groups", "reset", "gt", "--topic", "g-time", "--to", "1h", "--yes", "-q", "0")))
    assert res[0]["new"] == 0
    got = lines(ok(run(broker, "read", "g-time", "--from", iso)))
    assert [m["body"] for m in got] == ["g-time-0", "g-time-1"]


def test_groups_reset_with_live_consumer_is_refused_unless_forced(broker):
    from txmq.client.consumer import Consumer

    send_lines(broker, "g-live", 2)

    async def go():
        c = Consumer("glive", "g-live", broker, auto_commit=False)
        await c.start()
        try:
            listed = {g["group"]: g for g in lines(await asyncio.to_thread(run, broker, "groups", "list"))}
            refused = await asyncio.to_thread(run, broker, "groups", "reset", "glive", "--topic", "g-live", "--to", "latest", "--yes")
            forced = await asyncio.to_thread(run, broker, "groups", "reset", "glive", "--topic", "g-live", "--to", "latest", "--yes", "--force")
        finally:
            await c.close(commit=False)
        return listed, refused, forced

    listed, refused, forced = asyncio.run(go())
    assert listed["glive"]["consumers"] == 1
    assert refused.returncode == CONFLICT and "live consumer" in err(refused)
    assert forced.returncode == 0 and "may overwrite" in err(forced)


def test_groups_reset_unknown_topic_is_not_found_and_bad_position_is_usage(broker):
    assert run(broker, "groups", "reset", "g", "--topic", "nope-topic", "--to", "earliest", "--yes").returncode == NOT_FOUND
    r = run(broker, "groups", "reset", "g", "--topic", "nope-topic", "--to", "yesterday", "--yes")
    assert r.returncode == USAGE and "bad position" in err(r)


def test_read_prints_messages_without_committing_and_stops_at_the_end(broker):
    send_lines(broker, "r-all", 5)
    got = lines(ok(run(broker, "read", "r-all")))
    assert [m["body"] for m in got] == [f"r-all-{i}" for i in range(5)]
    assert set(got[0]) >= {"topic", "queue_id", "queue_offset", "commit_log_offset", "msg_id", "body", "stored_at"}
    assert [m["body"] for m in lines(ok(run(broker, "read", "r-all", "--from", "3", "-q", "0")))] == ["r-all-3", "r-all-4"]
    assert len(lines(ok(run(broker, "read", "r-all", "--count", "2")))) == 2
    assert len(lines(ok(run(broker, "read", "r-all", "--from", "36500d")))) == 5  # from before 1970: from the start
    assert lines(ok(run(broker, "message", "find", "--key", "nothing-has-it", "--since", "36500d"))) == []
    assert lines(ok(run(broker, "read", "r-all", "--from", "latest"))) == []
    assert all(g["group"] for g in lines(ok(run(broker, "groups", "list"))))
    assert "r-all" not in json.dumps(lines(ok(run(broker, "groups", "list"))))  # nothing committed
    assert len(one(run(broker, "read", "r-all", "-o", "json"))) == 5


def test_read_unknown_topic_is_not_found(broker):
    assert run(broker, "read", "r-missing").returncode == NOT_FOUND


def test_message_get_by_offset_id_returns_the_message(broker):
    sent = lines(ok(run(broker, "send", "m-get", "payload", "--key", "kk")))[0]
    m = one(run(broker, "message", "get", sent["msg_id"], "-o", "json"))
    assert (m["body"], m["commit_log_offset"], m["keys"]) == ("payload", sent["commit_log_offset"], "kk")
    r = run(broker, "message", "get", "7FFFFFFFFFFFFFF0")
    assert r.returncode == NOT_FOUND


def test_message_get_of_a_producer_chosen_16_hex_id_finds_that_message_not_the_record_at_that_offset(broker):
    for i in range(3):  # records at low offsets, so the id below could name one if read as an offset
        ok(run(broker, "send", "m-uniq", f"filler{i}"))
    chosen = "000000000000001F"
    sent = lines(ok(run(broker, "send", "m-uniq", "mine", "--prop", f"UNIQ_KEY={chosen}")))[0]
    assert sent["msg_id"] == chosen and sent["commit_log_offset"] != 0x1F
    m = one(run(broker, "message", "get", chosen, "-o", "json"))
    assert (m["body"], m["msg_id"]) == ("mine", chosen)
    r = run(broker, "message", "get", "00000000000000FF")  # an id neither an offset nor a key names
    assert r.returncode == NOT_FOUND and "no message with id" in err(r), err(r)


def test_message_get_by_transaction_id_looks_it_up(broker):
    sent = one(run(broker, "send", "m-tx", "txbody", "--tx", "--group", "shop", "--state", "commit", "-o", "json"))
    m = one(run(broker, "message", "get", sent["msg_id"], "-o", "json"))
    assert m["body"] == "txbody" and m["tx_id"] == sent["tx_id"]


def test_message_find_by_key_within_a_time_window(broker):
    ok(run(broker, "send", "m-find", "one", "--key", "order-7", "--key", "x"))
    ok(run(broker, "send", "m-find", "two", "--key", "order-8"))
    ok(run(broker, "send", "m-find2", "three", "--key", "order-7"))
    got = lines(ok(run(broker, "message", "find", "--key", "order-7")))
    assert sorted(m["body"] for m in got) == ["one", "three"]
    got = lines(ok(run(broker, "message", "find", "--key", "order-7", "--topic", "m-find")))
    assert [m["body"] for m in got] == ["one"]
    assert lines(ok(run(broker, "message", "find", "--key", "order-7", "--since", "1ms"))) == []
    r = run(broker, "message", "find", "--key", "order-7", "--max-scan", "1")
    assert r.returncode == 0 and "max-scan" in err(r)


def test_new_requests_refused_by_an_older_broker_give_a_clear_error():
    from txmq.cli.client_ops import cli_error
    from txmq.wire import ErrorCode, TxmqError

    e = cli_error(TxmqError("unknown operation 'list_groups'", ErrorCode.UNKNOWN_OPERATION), "h:1")
    assert "older txmq" in e.message and "list_groups" in e.message
