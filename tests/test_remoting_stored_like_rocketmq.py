"""What a 4.x send stores and answers, as RocketMQ 4.9.8's broker does (seen side by side in
tests/test_differential_rocketmq.py): a message sent alone loses the client's WAIT=true and gains CLUSTER; a
batch's messages keep WAIT and gain CLUSTER; no send response carries a transactionId; a group's retry topic has one
queue however it is first named."""

from __future__ import annotations

import json
import struct

from conftest import arun

from remotingwire import GET_ROUTEINFO_BY_TOPIC, SEND_BATCH_MESSAGE, RemotingClient, decode_messages, properties
from txmq.broker.testing import running_broker


def with_client(tmp_path, test):
    async def main():
        async with running_broker(tmp_path / "data", remoting_port=0) as b:
            c = await RemotingClient.connect(b.remoting_address)
            try:
                await test(b, c)
            finally:
                await c.close()
    arun(main())


def test_a_message_sent_alone_is_stored_without_wait_and_with_the_cluster(tmp_path):
    async def test(b, c):
        for v2 in (False, True):
            r = await c.send("Alone", b"x", props={"WAIT": "true", "UNIQ_KEY": f"U{v2}", "TAGS": "t"}, queue_id=0, v2=v2)
            assert r.code == 0 and "transactionId" not in r.ext
        msgs = decode_messages((await c.pull("g", "Alone", 0, 0)).body)
        assert [m["properties"] for m in msgs] == [{"UNIQ_KEY": "UFalse", "TAGS": "t", "CLUSTER": "txmq"},
                                                   {"UNIQ_KEY": "UTrue", "TAGS": "t", "CLUSTER": "txmq"}]
    with_client(tmp_path, test)


def test_a_half_message_is_answered_without_a_transaction_id(tmp_path):
    async def test(b, c):
        h = await c.send_half("Halves", b"tx", "pg", "TX-NO-ID")
        assert h.code == 0 and "transactionId" not in h.ext and len(h.ext["msgId"]) == 32
        c.end("pg", h, 8, "TX-NO-ID")  # ended by the msgId the client sent, as RocketMQ's client does
        r = await c.pull("g", "Halves", int(h.ext["queueId"]), 0, suspend_ms=20_000)  # answered when the commit lands
        [m] = decode_messages(r.body)
        assert m["body"] == b"tx" and m["properties"]["CLUSTER"] == "txmq" and "WAIT" not in m["properties"]
    with_client(tmp_path, test)


def test_a_batchs_messages_keep_wait_and_gain_the_cluster(tmp_path):
    async def test(b, c):
        body = b""
        for i in range(2):
            props = properties({"UNIQ_KEY": f"B{i}", "WAIT": "true"}).encode()
            mb = f"m{i}".encode()
            body += struct.pack(">iiiii", 20 + len(mb) + 2 + len(props), 0, 0, 0, len(mb)) + mb + len(props).to_bytes(2, "big") + props
        r = await c.request(SEND_BATCH_MESSAGE, {"a": "pg", "b": "Batch", "c": "TBW102", "d": 4, "e": 0, "f": 0, "g": 0, "h": 0,
                                                 "i": "", "m": "true"}, body)
        assert r.code == 0 and "transactionId" not in r.ext
        msgs = decode_messages((await c.pull("g", "Batch", 0, 0)).body)
        assert [m["properties"] for m in msgs] == [{"UNIQ_KEY": "B0", "WAIT": "true", "CLUSTER": "txmq"},
                                                   {"UNIQ_KEY": "B1", "WAIT": "true", "CLUSTER": "txmq"}]
    with_client(tmp_path, test)


def test_a_groups_retry_topic_routed_before_its_first_heartbeat_has_one_queue(tmp_path):
    async def test(b, c):
        # the Java consumer asks the route of %RETRY%<group> (it subscribes to it) before or after its heartbeat
        for topic in ("%RETRY%early-group", "%DLQ%early-group"):
            r = await c.request(GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
            assert r.code == 0 and json.loads(r.body)["queueDatas"][0]["readQueueNums"] == 1
            assert b.core.topics.queues(topic) == 1
        await c.heartbeat("client-1", consumers={"early-group": ["Orders"]})
        assert b.core.topics.queues("%RETRY%early-group") == 1
    with_client(tmp_path, test)
