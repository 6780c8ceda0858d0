"""txmq topics [create|update|delete|describe] through the real `txmq` entry point against broker processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from pathlib import Path

import pytest

from clihelpers import CONFLICT, ERROR, NOT_FOUND, USAGE, err, lines, ok, one, start_broker, txmq


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = start_broker(tmp_path_factory.mktemp("cli-topics"))
    yield b.address
    b.stop()


@pytest.fixture(scope="module")
def strict_broker(tmp_path_factory):
    """A broker that creates topics only when told to (--no-auto-create-topics)."""
    b = start_broker(tmp_path_factory.mktemp("cli-topics-strict"), "--no-auto-create-topics")
    yield b.address
    b.stop()


def run(broker, *args, **kw):
    return txmq(*args, broker=broker, **kw)


def listed(broker, *args):
    return {t["topic"]: t for t in lines(ok(run(broker, "topics", *args)))}


def test_topics_create_update_describe_delete_round_trip(broker):
    made = one(run(broker, "topics", "create", "tp-round", "--queues", "2", "--message-types", "transaction,NORMAL", "-o", "json"))
    assert made == {"topic": "tp-round", "queues": 2, "message_types": ["normal", "transaction"], "created": True}
    ok(run(broker, "send", "tp-round", "a", "--queue", "1"))
    ok(run(broker, "send", "tp-round", "b", "--queue", "1"))
    d = one(run(broker, "topics", "describe", "tp-round", "-o", "json"))
    assert (d["topic"], d["queues"], d["message_types"], d["messages"], d["pending_transactions"]) == \
        ("tp-round", 2, ["normal", "transaction"], 2, 0)
    assert [(q["queue_id"], q["min_offset"], q["max_offset"], q["messages"]) for q in d["per_queue"]] == [(0, 0, 0, 0), (1, 0, 2, 2)]
    assert [q["queue_id"] for q in lines(ok(run(broker, "topics", "describe", "tp-round")))] == [0, 1]  # jsonl: one row per queue

    up = one(run(broker, "topics", "update", "tp-round", "--queues", "3", "-m", "normal", "-m", "delay", "-o", "json"))
    assert up == {"topic": "tp-round", "queues": 3, "message_types": ["normal", "delay"], "old_queues": 2,
                  "old_message_types": ["normal", "transaction"]}
    assert listed(broker)["tp-round"]["message_types"] == ["normal", "delay"]
    assert listed(broker)["tp-round"]["queues"] == 3

    gone = one(run(broker, "topics", "delete", "tp-round", "-o", "json"))
    assert gone == {"topic": "tp-round", "deleted": True, "queues": 3, "messages": 2, "pending_transactions": 0}
    assert "tp-round" not in listed(broker)
    r = run(broker, "topics", "describe", "tp-round")
    assert r.returncode == NOT_FOUND and "no topic 'tp-round'" in err(r)
    r = run(broker, "topics", "delete", "tp-round")
    assert r.returncode == NOT_FOUND


def test_topics_listing_keeps_its_keys_and_adds_the_message_types(broker):
    ok(run(broker, "send", "tp-list", "x"))
    row = listed(broker)["tp-list"]
    assert row == {"topic": "tp-list", "queues": 4, "messages": 1, "system": False, "message_types": ["normal", "transaction"]}
    system = listed(broker, "--system")["RMQ_SYS_TRANS_HALF_TOPIC"]
    assert system["system"] is True and system["message_types"] is None
    table = ok(run(broker, "topics", "-o", "table")).stdout.decode()
    assert "TYPES" in table and "normal,transaction" in table
    assert one(run(broker, "topics", "-o", "json")) == list(listed(broker).values())


@pytest.mark.parametrize("args,says", [
    (["create", "tp-bad", "--message-types", "normal,urgent"], "unknown message type 'urgent'"),
    (["create", "tp-bad", "--message-types", ","], "no message type given"),
    (["create", "tp-bad", "--queues", "0"], "'--queues': must be at least 1"),
    (["create", "tp-bad", "--queues", "1025"], "'--queues': must be at most 1024"),
    (["create", "bad topic!"], "invalid topic name"),
    (["create", "RMQ_SYS_TRANS_HALF_TOPIC"], "system topic"),
    (["update", "tp-bad"], "nothing to change"),
    (["update", "tp-bad", "-m", "sometimes"], "unknown message type"),
    (["describe"], "Missing argument 'TOPIC'"),
    (["delete", "tp-bad", "--nope"], "see 'txmq topics delete --help'"),
])
def test_topics_bad_input_is_a_usage_error(broker, args, says):
    r = run(broker, "topics", *args)
    assert r.returncode == USAGE, (r.returncode, err(r))
    assert says in err(r)
    assert "tp-bad" not in listed(broker)


def test_topics_create_of_an_existing_topic_is_a_conflict_and_changes_nothing(broker):
    ok(run(broker, "topics", "create", "tp-twice", "--queues", "2"))
    r = run(broker, "topics", "create", "tp-twice", "--queues", "8", "-m", "normal")
    assert r.returncode == CONFLICT
    assert "already exists (2 queues, message types normal,transaction)" in err(r) and "txmq topics update" in err(r)
    assert listed(broker)["tp-twice"]["queues"] == 2


def test_topics_update_of_an_unknown_topic_is_not_found(broker):
    r = run(broker, "topics", "update", "tp-never", "--queues", "8")
    assert r.returncode == NOT_FOUND and "no topic 'tp-never'" in err(r)
    assert "tp-never" not in listed(broker)


def test_topics_shrink_only_by_queues_that_never_held_a_message(broker):
    ok(run(broker, "topics", "create", "tp-shrink", "--queues", "6"))
    ok(run(broker, "send", "tp-shrink", "x", "--queue", "3"))
    r = run(broker, "topics", "update", "tp-shrink", "--queues", "2")
    assert r.returncode == CONFLICT and "queue 3 holds messages" in err(r)
    assert listed(broker)["tp-shrink"]["queues"] == 6
    assert one(run(broker, "topics", "update", "tp-shrink", "--queues", "4", "-o", "json"))["queues"] == 4
    r = run(broker, "send", "tp-shrink", "y", "--queue", "5")
    assert r.returncode == NOT_FOUND  # the queue is gone: NO_SUCH_QUEUE


def test_topics_delete_is_refused_while_transactions_are_pending_unless_forced(broker):
    ok(run(broker, "topics", "create", "tp-pending"))
    tx = one(run(broker, "send", "tp-pending", "half", "--tx", "--group", "tp-g", "-o", "json"))
    d = one(run(broker, "topics", "describe", "tp-pending", "-o", "json"))
    assert d["pending_transactions"] == 1 and sum(q["pending_transactions"] for q in d["per_queue"]) == 1
    r = run(broker, "topics", "delete", "tp-pending")
    assert r.returncode == CONFLICT and "1 pending transaction" in err(r) and "--topic tp-pending" in err(r)
    assert "tp-pending" in listed(broker)
    gone = one(run(broker, "topics", "delete", "tp-pending", "--force", "-o", "json"))
    assert gone["deleted"] is True and gone["pending_transactions"] == 1
    assert "tp-pending" not in listed(broker)
    # the transaction is still pending, and its commit brings the topic back with the message
    ok(run(broker, "resolve", "--commit", tx["tx_id"], "--yes"))
    assert [m["body"] for m in lines(ok(run(broker, "read", "tp-pending")))] == ["half"]


def test_a_send_of_a_type_the_topic_does_not_accept_is_a_conflict(broker):
    ok(run(broker, "topics", "create", "tp-plain", "-m", "normal"))
    r = run(broker, "send", "tp-plain", "x", "--tx", "--group", "tp-plain-g", "--state", "commit")
    assert r.returncode == CONFLICT and "does not accept transaction messages" in err(r)
    ok(run(broker, "send", "tp-plain", "y"))
    assert [m["body"] for m in lines(ok(run(broker, "read", "tp-plain")))] == ["y"]


def test_without_auto_creation_a_send_to_an_unknown_topic_is_not_found_until_created(strict_broker):
    r = run(strict_broker, "send", "tp-strict", "x")
    assert r.returncode == NOT_FOUND
    assert "no topic 'tp-strict'" in err(r) and "--no-auto-create-topics" in err(r)
    assert "tp-strict" not in listed(strict_broker)
    status = one(run(strict_broker, "broker", "status", "-o", "json"))
    assert status["auto_create_topics"] is False
    ok(run(strict_broker, "topics", "create", "tp-strict", "--queues", "1"))
    ok(run(strict_broker, "send", "tp-strict", "x"))
    assert listed(strict_broker)["tp-strict"]["messages"] == 1
    # a deleted topic is unknown again
    ok(run(strict_broker, "topics", "delete", "tp-strict"))
    assert run(strict_broker, "send", "tp-strict", "y").returncode == NOT_FOUND


def test_auto_creation_is_on_by_default(broker):
    assert one(run(broker, "broker", "status", "-o", "json"))["auto_create_topics"] is True


@contextlib.contextmanager
def broker_in_thread(data_dir):
    """An in-process broker on its own event loop in a thread (the CLI runs its own loop in this one)."""
    from txmq.broker.testing import running_broker

    ready, address, box = threading.Event(), [], {}

    async def serve():
        box["loop"], box["stop"] = asyncio.get_running_loop(), asyncio.Event()
        async with running_broker(data_dir) as b:
            address.append(b.address)
            ready.set()
            await box["stop"].wait()

    t = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    t.start()
    try:
        assert ready.wait(30), "the broker did not start"
        yield address[0]
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        t.join(30)


def test_topics_subcommands_against_a_broker_without_them_say_so(tmp_path, monkeypatch):
    """A broker that predates topic message types answers UNKNOWN_OPERATION and lists no `topic_message_types` feature."""
    from txmq.broker.native import handlers, operations

    for op in ("update_topic", "delete_topic", "describe_topic"):
        monkeypatch.delitem(operations.HANDLERS, op)
    monkeypatch.setattr(handlers, "FEATURES", [f for f in handlers.FEATURES if f != "topic_message_types"])
    with broker_in_thread(tmp_path / "data") as address:
        for args in (["describe", "x"], ["delete", "x"], ["update", "x", "--queues", "2"]):
            r = run(address, "topics", *args)
            assert r.returncode == ERROR and "older txmq" in err(r), err(r)
        r = run(address, "topics", "create", "old-types", "-m", "normal")
        assert r.returncode == ERROR and "does not support topic message types" in err(r)
        assert "old-types" not in listed(address)
        ok(run(address, "topics", "create", "old-plain"))  # without types the request is the one an older broker takes


def test_topics_json_of_a_broker_with_types_keeps_plain_queue_counts(broker, tmp_path):
    """What an older broker reads from the file: every topic's queue count as a plain integer; the types aside."""
    ok(run(broker, "topics", "create", "tp-file", "--queues", "3", "-m", "fifo,normal"))
    status = one(run(broker, "broker", "status", "-o", "json"))
    data = json.loads((Path(status["data_dir"]) / "topics.json").read_text())
    assert data["tp-file"] == 3
    assert data["txmq:message_types"]["tp-file"] == ["normal", "fifo"]
    assert all(isinstance(v, int) for k, v in data.items() if ":" not in k)


def test_a_send_that_creates_its_topic_says_so_on_stderr_once(broker):
    for args in (("send", "tp-typo", "x", "-o", "json"), ("send", "tp-typo-tx", "x", "--tx", "--group", "g-typo", "--state", "commit", "-o", "json")):
        r = ok(run(broker, *args))
        assert "tp-typo" in err(r) and "this send created it" in err(r), err(r)
        assert "topic_created" not in one(r)  # stdout's rows keep their keys
        again = ok(run(broker, *args))
        assert "created" not in err(again), err(again)
    ok(run(broker, "topics", "create", "tp-made", "-o", "json"))
    assert "created" not in err(ok(run(broker, "send", "tp-made", "x")))
