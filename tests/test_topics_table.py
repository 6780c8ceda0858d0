"""The topic table across restarts: topics.json written before topics had message types, deleted topics, writes that fail."""

from __future__ import annotations

import json
import logging

import pytest
from conftest import arun
from wireclient import RawClient

from txmq.broker.testing import running_broker
from txmq.broker.topics import TopicTable
from txmq.wire import ErrorCode, TxmqError


async def _ops(b, *calls):
    c = await RawClient.open(b.address)
    try:
        return [await c.req(op, fields) for op, fields in calls]
    finally:
        await c.close()


def test_a_topics_json_without_message_types_loads_and_its_topics_accept_normal_and_transaction(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "topics.json").write_text(json.dumps({"orders": 2, "audit": 8}))

    async def go():
        async with running_broker(data) as b:
            return await _ops(b, ("list_topics", {}), ("describe_topic", {"topic": "orders"}),
                              ("send", {"topic": "orders", "body": b"plain"}),
                              ("send", {"topic": "orders", "body": b"tx", "properties": {"TRAN_MSG": "true", "PGROUP": "g"}}))

    (c1, listed), (c2, described), (c3, _), (c4, _) = arun(go())
    assert (c1, c2, c3, c4) == (0, 0, 0, 0)
    assert [(t["topic"], t["queues"], t["message_types"]) for t in listed["topics"]] == [
        ("audit", 8, ["normal", "transaction"]), ("orders", 2, ["normal", "transaction"])]
    assert described["queues"] == 2 and described["message_types"] == ["normal", "transaction"]
    # the file keeps its form: only queue counts while no topic has other types
    assert json.loads((data / "topics.json").read_text()) == {"orders": 2, "audit": 8}


def test_message_types_and_deletions_survive_a_restart_and_a_deleted_topic_stays_deleted(tmp_path):
    data = tmp_path / "data"

    async def first():
        async with running_broker(data) as b:
            return await _ops(b, ("create_topic", {"topic": "fifo-ish", "queues": 3, "message_types": ["normal", "fifo"]}),
                              ("create_topic", {"topic": "gone", "queues": 6}),
                              ("send", {"topic": "gone", "body": b"kept", "queue_id": 5}),
                              ("delete_topic", {"topic": "gone"}))

    assert [code for code, _ in arun(first())] == [0, 0, 0, 0]
    doc = json.loads((data / "topics.json").read_text())
    assert doc["fifo-ish"] == 3 and doc["txmq:message_types"] == {"fifo-ish": ["normal", "fifo"]}
    assert doc["txmq:deleted"] == {"gone": 6} and "gone" not in doc

    async def second():
        async with running_broker(data) as b:
            listed = (await _ops(b, ("list_topics", {})))[0][1]["topics"]
            again = await _ops(b, ("create_topic", {"topic": "gone", "queues": 1}),
                               ("pull", {"topic": "gone", "queue_id": 5, "offset": 0}))
            return listed, again

    listed, ((c1, made), (c2, pulled)) = arun(second())
    # the log still holds the deleted topic's queue 5: the start did not bring the topic back
    assert [(t["topic"], t["queues"], t["message_types"]) for t in listed] == [("fifo-ish", 3, ["normal", "fifo"])]
    # created again, it has its stored queues and messages back
    assert (c1, made["created"], made["queues"]) == (0, True, 6)
    assert c2 == 0 and [m["body"] for m in pulled["messages"]] == [b"kept"]
    assert "txmq:deleted" not in json.loads((data / "topics.json").read_text())


def test_damaged_entries_of_topics_json_are_left_out_with_a_warning(tmp_path, caplog):
    path = tmp_path / "topics.json"
    path.write_text(json.dumps({"a": 2, "b": 1, "txmq:message_types": {"a": ["urgent"], "b": ["fifo"], "zz": ["normal"]},
                                "txmq:deleted": {"c": "many"}}))
    caplog.set_level(logging.WARNING)
    t = TopicTable(path, 4)
    assert (t.queues("a"), t.message_types("a")) == (2, ("normal", "transaction"))
    assert t.message_types("b") == ("fifo",)
    t.merge_from_store({"c": [0]})
    assert t.queues("c") == 4  # not kept out: its deletion did not read
    assert any("event=topics_entries_ignored" in r.getMessage() for r in caplog.records)


def test_a_failed_write_of_topics_json_changes_nothing(tmp_path, monkeypatch):
    t = TopicTable(tmp_path / "topics.json", 4, auto_create=False)
    t.ensure("keep", 2, ("normal",))

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("txmq.broker.topics.atomic_write_json", full)
    with pytest.raises(OSError):
        t.ensure("new", 1)
    with pytest.raises(OSError):
        t.update("keep", 5, ("normal", "transaction"))
    with pytest.raises(OSError):
        t.delete("keep")
    assert (t.queues("new"), t.queues("keep"), t.message_types("keep")) == (None, 2, ("normal",))
    with pytest.raises(TxmqError) as e:
        t.pick_queue("new", None)
    assert e.value.code == ErrorCode.NO_SUCH_TOPIC


def test_without_auto_creation_native_sends_to_an_unknown_topic_get_no_such_topic(tmp_path):
    async def go():
        async with running_broker(tmp_path / "data", auto_create_topics=False) as b:
            tx = {"TRAN_MSG": "true", "PGROUP": "g"}
            refused = await _ops(b, ("send", {"topic": "nope", "body": b"x"}),
                                 ("send_batch", {"topic": "nope", "messages": [{"body": b"a"}, {"body": b"b"}]}),
                                 ("send", {"topic": "nope", "body": b"x", "properties": tx}),
                                 ("hello", {}), ("broker_info", {}), ("list_topics", {}))
            made = await _ops(b, ("create_topic", {"topic": "nope", "queues": 1}), ("send", {"topic": "nope", "body": b"x"}),
                              ("send", {"topic": "nope", "body": b"y", "properties": tx}))
            return refused, made

    (s1, s2, s3, (_, hello), (_, info), (_, listed)), made = arun(go())
    for code, f in (s1, s2, s3):
        assert (code, f["name"], f["topic"]) == (int(ErrorCode.NO_SUCH_TOPIC), "NO_SUCH_TOPIC", "nope")
        assert "--no-auto-create-topics" in f["error"] and f["retriable"] is False
    assert "topic_message_types" in hello["features"] and info["auto_create_topics"] is False
    assert listed["topics"] == []
    assert [code for code, _ in made] == [0, 0, 0]
