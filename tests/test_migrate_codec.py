"""The pieces of `txmq migrate` that need no RocketMQ: the batch encoding (read back by txmq's own remoting front
end), fastjson bodies, the progress file and the offset mapping, and the scheduled listing with bodies."""

from __future__ import annotations

import asyncio
import json
import os

from txmq.broker.remoting.messages import decode_batch
from txmq.client.migrate.mover import for_target
from txmq.client.migrate.state import State, target_offset
from txmq.remoting_codec import encode_batch, load_fastjson


def test_a_batch_body_is_read_back_by_the_remoting_front_end_message_by_message():
    msgs = [(b"a" * 300, {"KEYS": "k1 k2", "TAGS": "T", "UNIQ_KEY": "U1", "p": "ü"}, 0), (b"", {}, 7), (b"\x00\x01", {"UNIQ_KEY": "U3"}, -1)]
    assert decode_batch(encode_batch(msgs)) == [(f, b, p) for b, p, f in msgs]


def test_fastjson_integer_keys_are_read_outside_strings_only():
    body = b'{"brokerAddrTable":{"b":{"brokerAddrs":{0:"127.0.0.1:10911",1:"x,2:y"},"cluster":"C"}}}'
    assert load_fastjson(body) == {"brokerAddrTable": {"b": {"brokerAddrs": {"0": "127.0.0.1:10911", "1": "x,2:y"}, "cluster": "C"}}}


def test_what_txmq_adds_is_not_carried_to_the_target_and_the_flag_is():
    props, flag = for_target({"UNIQ_KEY": "U", "KEYS": "k", "TXMQ_RMQ_FLAG": "5", "TXMQ_SCHEDULED_FROM": "9", "TRAN_MSG": "true",
                              "REAL_TOPIC": "x", "TIMER_DELIVER_MS": "1", "TIMER_ENQUEUE_MS": "2", "user": "v"})
    assert props == {"UNIQ_KEY": "U", "KEYS": "k", "TIMER_ENQUEUE_MS": "2", "user": "v"} and flag == 5


def test_a_group_starts_at_the_copy_of_its_first_unconsumed_message():
    qs = {"runs": []}
    for src, tgt in [(0, 100), (1, 101), (2, 102), (4, 103), (5, 107)]:  # 3 not copied; another producer's messages at 104-106
        State.add_run(qs, src, src + 1, tgt)
    assert qs["runs"] == [[0, 3, 100], [4, 5, 103], [5, 6, 107]]
    assert [target_offset(qs["runs"], p, 50) for p in (0, 2, 3, 4, 5, 6, 9)] == [100, 102, 103, 103, 107, 108, 108]
    assert target_offset([], 7, 50) == 50


def test_the_progress_file_is_replaced_whole(tmp_path):
    path = tmp_path / "s.json"
    plan = {"queues": [{"topic": "t", "queue_id": 0, "start": 3}]}
    st = State.new(path, {"broker_id": "/d"}, "ns:9876", plan)
    st.save()
    st.data["queues"]["t/0"]["next"] = 10
    st.save()
    assert json.loads(path.read_text())["queues"]["t/0"]["next"] == 10
    assert State.load(path).data["queues"]["t/0"]["next"] == 10
    assert os.listdir(tmp_path) == ["s.json"]


def test_the_scheduled_listing_gives_bodies_and_properties_when_asked(tmp_path):
    from txmq.broker.testing import running_broker
    from txmq.client import Client

    async def main():
        async with running_broker(tmp_path / "data") as b:
            async with Client(b.address) as c:
                await c.request("create_topic", {"topic": "s", "message_types": ["normal", "delay"]})
                await c.request("send", {"topic": "s", "body": b"later", "properties": {"TIMER_DELAY_MS": "600000", "KEYS": "k"}})
                plain = await c.request("list_scheduled", {})
                full = await c.request("list_scheduled", {"bodies": True})
                return c.hello["features"], plain["messages"][0], full["messages"][0]

    features, plain, full = asyncio.run(main())
    assert "scheduled_bodies" in features
    assert "body" not in plain and "properties" not in plain
    assert full["body"] == b"later" and full["properties"]["KEYS"] == "k" and full["properties"]["REAL_TOPIC"] == "s"
