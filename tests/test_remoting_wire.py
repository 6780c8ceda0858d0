"""The remoting front end (--remoting-port) at the frame level: framing, bad frames, limits, sends, pulls, transactions.

The client is tests/remotingwire.py, written from RocketMQ's documented frames. No installable client
exposes RocketMQ 4's transactions, so the transactional tests are here: commit, rollback, an orphan resolved
by CHECK_TRANSACTION_STATE, a oneway end lost with its connection and recovered by a check-back, and a
4.x transaction resolved with `txmq resolve`.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import socket
import struct
import time
from hashlib import sha1

from conftest import arun, eventually

from clihelpers import ok, out, txmq
from remotingwire import (
    CHECK_TRANSACTION_STATE,
    COMMIT,
    CONSUMER_SEND_MSG_BACK,
    GET_CONSUMER_LIST_BY_GROUP,
    GET_MAX_OFFSET,
    GET_MIN_OFFSET,
    GET_ROUTEINFO_BY_TOPIC,
    LOCK_BATCH_MQ,
    NOTIFY_CONSUMER_IDS_CHANGED,
    QUERY_CONSUMER_OFFSET,
    ROLLBACK,
    SEARCH_OFFSET_BY_TIMESTAMP,
    SEND_BATCH_MESSAGE,
    UNLOCK_BATCH_MQ,
    UPDATE_CONSUMER_OFFSET,
    VIEW_MESSAGE_BY_ID,
    Cmd,
    RemotingClient,
    decode_messages,
    encode,
    offset_of,
    properties,
)
from txmq.broker.testing import running_broker

TX = dict(transaction_timeout_s=0.5, check_interval_s=0.3)


def with_broker(tmp_path, test, **overrides):
    async def main():
        async with running_broker(tmp_path / "data", **{"remoting_port": 0, **overrides}) as b:
            await test(b)
    arun(main())


async def pull_all(c: RemotingClient, group: str, topic: str, queues: int = 4) -> list[dict]:
    msgs = []
    for q in range(queues):
        r = await c.pull(group, topic, q, 0)
        if r.code == 0:
            msgs += decode_messages(r.body)
    return msgs


# ---- framing -------------------------------------------------------------------------------------
def test_a_route_names_this_broker_at_the_remoting_port_in_json_and_in_the_binary_header(tmp_path):
    async def test(b):
        for serialize in (0, 1):
            c = await RemotingClient.connect(b.remoting_address, serialize)
            r = await c.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "Routed"})
            assert r.code == 0 and r.flag & 1 and r.serialize == serialize
            route = json.loads(r.body)
            assert route["queueDatas"][0]["writeQueueNums"] == 4 and route["queueDatas"][0]["perm"] == 6
            assert route["brokerDatas"][0]["brokerAddrs"] == {"0": b.remoting_address}
            await c.close()
        assert b.core.info()["listeners"]["remoting"]["port"] == b.remoting_port
    with_broker(tmp_path, test)


def test_a_request_code_txmq_does_not_serve_gets_request_code_not_supported_naming_it_and_the_connection_goes_on(tmp_path):
    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        r = await c.request(9999, {"x": "1"})
        assert r.code == 3 and "9999" in r.remark
        assert (await c.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "StillServed"})).code == 0
        await c.close()
    with_broker(tmp_path, test)


def test_a_malformed_frame_closes_that_connection_only(tmp_path):
    async def test(b):
        good = await RemotingClient.connect(b.remoting_address)
        bad_frames = [
            struct.pack(">ii", 4 + 5, 5) + b"{nope",  # a JSON header that is not JSON
            struct.pack(">ii", 4 + 2, 100) + b"{}",  # a header longer than its frame
            struct.pack(">ii", 4 + 2, (9 << 24) | 2) + b"{}",  # an unknown serialize type
            struct.pack(">i", 1 << 30),  # a frame longer than --max-frame: refused before it is buffered
            struct.pack(">ii", 4 + 13, (1 << 24) | 13) + struct.pack(">hbhii", 105, 0, 0, 1, 0),  # a binary header cut short
        ]
        for frame in bad_frames:
            reader, writer = await asyncio.open_connection("127.0.0.1", b.remoting_port)
            writer.write(frame)
            data = await asyncio.wait_for(reader.read(), 5)  # the broker says why, then closes
            assert data, frame
            (n,) = struct.unpack_from(">i", data)
            from remotingwire import decode
            resp = decode(data[4 : 4 + n])
            assert resp.code != 0 and resp.remark
            writer.close()
        assert (await good.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "Unharmed"})).code == 0
        assert b.core.metrics.counters["remoting_malformed_frames"] == len(bad_frames)
        await good.close()
    with_broker(tmp_path, test)


def test_connections_past_the_remoting_cap_are_refused_at_once_with_system_busy(tmp_path):
    async def test(b):
        held = [await RemotingClient.connect(b.remoting_address) for _ in range(2)]
        reader, writer = await asyncio.open_connection("127.0.0.1", b.remoting_port)
        data = await asyncio.wait_for(reader.read(), 5)
        (n,) = struct.unpack_from(">i", data)
        from remotingwire import decode
        resp = decode(data[4 : 4 + n])
        assert resp.code == 2 and "--remoting-max-connections" in resp.remark
        writer.close()
        assert (await held[0].request(GET_ROUTEINFO_BY_TOPIC, {"topic": "Capped"})).code == 0
        for c in held:
            await c.close()
    with_broker(tmp_path, test, remoting_max_connections=2)


def _sign(ext: dict, body: bytes, secret: str) -> dict:
    ext = {k: str(v) for k, v in ext.items()}
    ext["AccessKey"] = "any"
    content = "".join(v for _k, v in sorted(ext.items())).encode() + body
    ext["Signature"] = base64.b64encode(hmac.new(secret.encode(), content, sha1).digest()).decode()
    return ext


def test_with_an_auth_token_only_requests_signed_with_it_are_served(tmp_path):
    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        r = await c.request(GET_ROUTEINFO_BY_TOPIC, _sign({"topic": "Signed"}, b"", "s3cret"))
        assert r.code == 0
        unsigned = await RemotingClient.connect(b.remoting_address)
        r = await unsigned.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "Signed"})
        assert r.code == 16 and "--auth-token" in r.remark
        await asyncio.wait_for(unsigned.closed.wait(), 5)
        wrong = await RemotingClient.connect(b.remoting_address)
        r = await wrong.request(GET_ROUTEINFO_BY_TOPIC, _sign({"topic": "Signed"}, b"", "other"))
        assert r.code == 16
        # before a signed request, frames are held to --max-preauth-frame
        reader, writer = await asyncio.open_connection("127.0.0.1", b.remoting_port)
        writer.write(struct.pack(">i", 128 << 10))
        assert await asyncio.wait_for(reader.read(), 5)
        writer.close()
        await c.close()
    with_broker(tmp_path, test, auth_token="s3cret")


# ---- sends and reads ----------------------------------------------------------------------------------
def test_sends_give_offset_message_ids_that_view_message_by_id_reads_back_and_honour_the_chosen_queue(tmp_path):
    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        for v2 in (False, True):
            r = await c.send("Ids", b"hello", props={"UNIQ_KEY": f"U-{v2}", "TAGS": "t", "KEYS": "a b"}, queue_id=2, v2=v2)
            assert r.code == 0 and r.ext["queueId"] == "2", r
            assert len(r.ext["msgId"]) == 32 and "transactionId" not in r.ext  # as RocketMQ 4.9.8's broker answers
            v = await c.request(VIEW_MESSAGE_BY_ID, {"offset": offset_of(r.ext["msgId"])})
            [m] = decode_messages(v.body)
            assert m["body"] == b"hello" and m["topic"] == "Ids" and m["queue_id"] == 2
            assert m["properties"]["UNIQ_KEY"] == f"U-{v2}" and m["properties"]["KEYS"] == "a b"
            assert m["offset_msg_id"] == r.ext["msgId"]
            assert m["queue_offset"] == int(r.ext["queueOffset"])
        r = await c.send("Ids", b"x", queue_id=7)
        assert r.code == 29 and "queue 7" in r.remark
        r = await c.send("RMQ_SYS_TRANS_HALF_TOPIC", b"x")
        assert r.code == 16
        r = await c.send("Ids", b"x" * ((4 << 20) + 1))
        assert r.code == 13
        await c.close()
    with_broker(tmp_path, test)


def test_a_delayed_messages_offset_id_views_its_scheduled_record_with_its_due_time(tmp_path):
    """As RocketMQ shows a delayed message in SCHEDULE_TOPIC_XXXX by its send's offset id (mqadmin queryMsgById, the
    client's viewMessage): txmq's scheduled record, its real topic and due time; other system records stay refused."""
    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        r = await c.send("Later", b"in an hour", props={"UNIQ_KEY": "U-later", "KEYS": "k", "DELAY": "18"}, queue_id=1)
        assert r.code == 0, r
        v = await c.request(VIEW_MESSAGE_BY_ID, {"offset": offset_of(r.ext["msgId"])})
        assert v.code == 0, v
        [m] = decode_messages(v.body)
        props = m["properties"]
        assert m["topic"] == "RMQ_SYS_TXMQ_TIMER" and m["body"] == b"in an hour"
        assert props["REAL_TOPIC"] == "Later" and props["REAL_QID"] == "1" and props["DELAY"] == "18"
        assert m["born_ts"] + 7_200_000 <= int(props["TIMER_OUT_MS"]) <= m["store_ts"] + 7_200_000  # level 18: 2 h by default
        # a half message's record is not a message to view
        h = await c.send("Later", b"half", props={"UNIQ_KEY": "U-half", "TRAN_MSG": "true", "PGROUP": "g"})
        assert h.code == 0, h
        v = await c.request(VIEW_MESSAGE_BY_ID, {"offset": offset_of(h.ext["msgId"])})
        assert v.code == 1 and "system topic" in v.remark, v
        await c.close()
    with_broker(tmp_path, test)


def test_a_batch_is_stored_as_its_messages_in_one_queue(tmp_path):
    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        body = b""
        for i in range(3):
            props = properties({"UNIQ_KEY": f"B{i}"}).encode()
            mb = f"m{i}".encode()
            size = 20 + len(mb) + 2 + len(props)
            body += struct.pack(">iiiii", size, 0, 0, 0, len(mb)) + mb + len(props).to_bytes(2, "big") + props
        r = await c.request(SEND_BATCH_MESSAGE, {"a": "pg", "b": "Batched", "c": "TBW102", "d": 4, "e": 1, "f": 0, "g": 0, "h": 0,
                                                 "i": "", "m": "true"}, body)
        assert r.code == 0 and len(r.ext["msgId"].split(",")) == 3
        msgs = decode_messages((await c.pull("g", "Batched", 1, 0)).body)
        assert [(m["body"], m["properties"]["UNIQ_KEY"]) for m in msgs] == [(b"m0", "B0"), (b"m1", "B1"), (b"m2", "B2")]
        await c.close()
    with_broker(tmp_path, test)


def test_a_suspended_pull_is_answered_when_a_message_arrives(tmp_path):
    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        await c.send("Polled", b"first", queue_id=0)
        r = await c.pull("g", "Polled", 0, 1)  # nothing new, no suspension
        assert r.code == 19 and r.ext["nextBeginOffset"] == "1"
        t0 = time.monotonic()
        waiting = asyncio.ensure_future(c.pull("g", "Polled", 0, 1, suspend_ms=60_000))
        await asyncio.sleep(0.3)
        other = await RemotingClient.connect(b.remoting_address)
        await other.send("Polled", b"second", queue_id=0)
        r = await waiting
        assert r.code == 0 and time.monotonic() - t0 < 30  # woken, not answered at the 60 s suspension's end
        assert [m["body"] for m in decode_messages(r.body)] == [b"second"] and r.ext["nextBeginOffset"] == "2"
        r = await c.pull("g", "Polled", 0, 99)
        assert r.code == 21 and r.ext["nextBeginOffset"] == "2"  # past the end: the offset moved
        await c.close()
        await other.close()
    with_broker(tmp_path, test)


def test_consumer_offsets_are_txmqs_own_and_queue_positions_are_answered(tmp_path):
    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        for i in range(3):
            await c.send("Offs", f"m{i}".encode(), queue_id=0)
        r = await c.request(QUERY_CONSUMER_OFFSET, {"consumerGroup": "og", "topic": "Offs", "queueId": 0})
        assert r.code == 0 and r.ext["offset"] == "0"  # no offset yet, and the queue still holds its first message
        assert (await c.request(UPDATE_CONSUMER_OFFSET, {"consumerGroup": "og", "topic": "Offs", "queueId": 0, "commitOffset": 2})).code == 0
        assert (await c.request(QUERY_CONSUMER_OFFSET, {"consumerGroup": "og", "topic": "Offs", "queueId": 0})).ext["offset"] == "2"
        assert b.core.offsets.get("og", "Offs", 0) == 2
        assert (await c.request(GET_MAX_OFFSET, {"topic": "Offs", "queueId": 0})).ext["offset"] == "3"
        assert (await c.request(GET_MIN_OFFSET, {"topic": "Offs", "queueId": 0})).ext["offset"] == "0"
        r = await c.request(SEARCH_OFFSET_BY_TIMESTAMP, {"topic": "Offs", "queueId": 0, "timestamp": int(time.time() * 1000) + 60_000})
        assert r.ext["offset"] == "3"
        assert (await c.request(GET_MAX_OFFSET, {"topic": "Offs", "queueId": 9})).code == 29
        await c.close()
    with_broker(tmp_path, test)


def test_consumers_of_a_group_are_listed_and_told_when_it_changes(tmp_path):
    async def test(b):
        c1 = await RemotingClient.connect(b.remoting_address)
        await c1.heartbeat("client-1", consumers={"cg": ["Rebal"]})
        c2 = await RemotingClient.connect(b.remoting_address)
        await c2.heartbeat("client-2", consumers={"cg": ["Rebal"]})
        n = await c1.next_pushed()
        assert n.code == NOTIFY_CONSUMER_IDS_CHANGED and n.ext["consumerGroup"] == "cg" and n.flag & 2
        r = await c1.request(GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": "cg"})
        assert json.loads(r.body)["consumerIdList"] == ["client-1", "client-2"]
        assert b.core.consumer_registry.online("cg") == 2
        assert b.core.topics.queues("%RETRY%cg") == 1  # the group's retry topic, as RocketMQ's broker creates it
        await c2.close()
        n = await c1.next_pushed()
        assert n.code == NOTIFY_CONSUMER_IDS_CHANGED
        # the broker learns of the close on c2's connection: through front-end workers, c2's may be another process's
        # than c1's, so c1's request can come first
        deadline = time.monotonic() + 10
        while True:
            r = await c1.request(GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": "cg"})
            if json.loads(r.body)["consumerIdList"] != ["client-1", "client-2"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        assert json.loads(r.body)["consumerIdList"] == ["client-1"]
        await c1.close()
    with_broker(tmp_path, test)


def test_a_queue_lock_is_held_by_one_client_until_it_unlocks_or_goes_away(tmp_path):
    async def test(b):
        a, c = await RemotingClient.connect(b.remoting_address), await RemotingClient.connect(b.remoting_address)
        assert (await a.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "Locked"})).code == 0  # the route creates it: 4 queues
        await a.heartbeat("A", consumers={"og": ["Locked"]})
        await c.heartbeat("C", consumers={"og": ["Locked"]})

        def body(cid, qs):
            return json.dumps({"consumerGroup": "og", "clientId": cid, "mqSet": [{"topic": "Locked", "brokerName": "txmq", "queueId": q}
                                                                                 for q in qs]}).encode()

        r = await a.request(LOCK_BATCH_MQ, {}, body("A", [0, 1, 9]))  # queue 9 does not exist: not locked
        assert sorted(m["queueId"] for m in json.loads(r.body)["lockOKMQSet"]) == [0, 1]
        r = await c.request(LOCK_BATCH_MQ, {}, body("C", [1, 2]))
        assert [m["queueId"] for m in json.loads(r.body)["lockOKMQSet"]] == [2]
        await a.request(UNLOCK_BATCH_MQ, {}, body("A", [1]))
        r = await c.request(LOCK_BATCH_MQ, {}, body("C", [1]))
        assert [m["queueId"] for m in json.loads(r.body)["lockOKMQSet"]] == [1]
        await a.close()
        await asyncio.sleep(0.2)
        r = await c.request(LOCK_BATCH_MQ, {}, body("C", [0]))  # A's connection closed: its lock went with it
        assert [m["queueId"] for m in json.loads(r.body)["lockOKMQSet"]] == [0]
        await c.close()
    with_broker(tmp_path, test)


def test_a_message_sent_back_goes_to_the_retry_topic_then_past_its_retries_to_the_dead_letter_topic(tmp_path):
    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        r = await c.send("Failing", b"poison", props={"UNIQ_KEY": "P1"}, queue_id=0)
        cl = offset_of(r.ext["msgId"])
        r = await c.request(CONSUMER_SEND_MSG_BACK, {"offset": cl, "group": "fg", "delayLevel": 0, "originMsgId": "P1",
                                                     "originTopic": "Failing", "maxReconsumeTimes": 1})
        assert r.code == 0
        # level 3 is 300 ms here: nothing in the retry topic before it, the message after it, scheduled that far ahead
        assert (await c.pull("fg", "%RETRY%fg", 0, 0)).code != 0
        [retry] = decode_messages((await c.pull("fg", "%RETRY%fg", 0, 0, suspend_ms=5000)).body)
        assert retry["body"] == b"poison" and retry["reconsume_times"] == 1
        props = retry["properties"]
        # due 300 ms after the broker took the send; stored (TIMER_ENQUEUE_MS) a clock reading later, so up to 300 ms before it
        assert props["RETRY_TOPIC"] == "Failing" and 150 < int(props["TIMER_DELIVER_MS"]) - int(props["TIMER_ENQUEUE_MS"]) <= 300
        assert retry["properties"]["UNIQ_KEY"] == "P1"
        # sent back again (its delivery's marks with it): past its retries, into the dead-letter topic at once
        r = await c.request(CONSUMER_SEND_MSG_BACK, {"offset": retry["cl_offset"], "group": "fg", "delayLevel": 0, "maxReconsumeTimes": 1})
        assert r.code == 0, r.remark
        [dead] = decode_messages((await c.pull("fg", "%DLQ%fg", 0, 0)).body)
        assert dead["body"] == b"poison" and dead["reconsume_times"] == 2
        assert not {"DELAY", "TIMER_DELAY_MS", "TIMER_DELIVER_MS", "TXMQ_SCHEDULED_FROM"} & dead["properties"].keys()
        await c.close()
    with_broker(tmp_path, test, message_delay_levels_ms=(0, 0, 300))


# ---- transactions -------------------------------------------------------------------------------------
def test_a_committed_half_is_delivered_and_a_rolled_back_one_never_is(tmp_path):
    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        await c.heartbeat("p1", producers=["txg"])
        h1 = await c.send_half("TxTopic", b"commit-me", "txg", "TX-C")
        h2 = await c.send_half("TxTopic", b"roll-me-back", "txg", "TX-R")
        assert h1.code == 0 and "transactionId" not in h1.ext  # the client ends it with the msgId it sent
        assert await pull_all(c, "cg", "TxTopic") == []  # a half message is not delivered
        c.end("txg", h1, COMMIT, "TX-C")
        c.end("txg", h2, ROLLBACK, "TX-R")
        await asyncio.sleep(0.3)
        msgs = await pull_all(c, "cg", "TxTopic")
        assert [m["body"] for m in msgs] == [b"commit-me"]
        assert msgs[0]["properties"]["UNIQ_KEY"] == "TX-C" and "TRAN_MSG" not in msgs[0]["properties"]
        # one outcome per transaction: a late opposite end (not oneway here) is refused, nothing changes
        r = await c.end("txg", h1, ROLLBACK, "TX-C", oneway=False)
        assert r.code == 1 and "TX_CONFLICT" in r.remark
        assert len(await pull_all(c, "cg", "TxTopic")) == 1
        await c.close()
    with_broker(tmp_path, test, **TX)


def test_an_orphan_half_is_resolved_through_check_transaction_state_over_the_groups_live_connection(tmp_path):
    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        await c.heartbeat("p1", producers=["orph"])
        h = await c.send_half("Orphans", b"orphan", "orph", "TX-O")
        check = await c.next_pushed(timeout=10)
        assert check.code == CHECK_TRANSACTION_STATE and check.flag & 2  # oneway, as RocketMQ's broker sends it
        assert check.ext["msgId"] == check.ext["transactionId"] == "TX-O"
        assert int(check.ext["commitLogOffset"]) >= offset_of(h.ext["msgId"])
        assert offset_of(check.ext["offsetMsgId"]) == int(check.ext["commitLogOffset"])
        [m] = decode_messages(check.body)
        assert m["topic"] == "Orphans" and m["body"] == b"orphan" and m["properties"]["UNIQ_KEY"] == "TX-O"
        assert m["queue_id"] == int(h.ext["queueId"]) and m["sys_flag"] & 4
        c.end_check("orph", check, COMMIT)  # oneway: its effect is waited for
        await eventually(lambda: b.core.metrics.counters.get("committed_check") == 1, what="the check's commit")
        assert [x["body"] for x in await pull_all(c, "cg", "Orphans")] == [b"orphan"]
        assert b.core.metrics.counters["committed_check"] == 1
        await c.close()
    with_broker(tmp_path, test, **TX)


def test_a_oneway_end_lost_with_its_connection_is_recovered_by_a_check_back_to_another_producer_of_the_group(tmp_path):
    async def test(b):
        first = await RemotingClient.connect(b.remoting_address)
        await first.heartbeat("p1", producers=["lost"])
        h = await first.send_half("LostEnds", b"lost-end", "lost", "TX-L")
        await first.close()  # the producer went away before its END_TRANSACTION left
        await asyncio.sleep(1.0)
        assert "TX-L" in b.core.tx.index.pending  # no producer online: not checked, not counted
        assert b.core.tx.index.pending["TX-L"].checks == 0
        second = await RemotingClient.connect(b.remoting_address, serialize=1)  # another client, binary headers
        await second.heartbeat("p2", producers=["lost"])
        check = await second.next_pushed(timeout=10)
        assert check.code == CHECK_TRANSACTION_STATE and check.serialize == 1 and check.ext["transactionId"] == "TX-L"
        second.end_check("lost", check, COMMIT)  # oneway: its effect is waited for
        await eventually(lambda: "TX-L" not in b.core.tx.index.pending, what="the check's commit")
        assert [x["body"] for x in await pull_all(second, "cg", "LostEnds")] == [b"lost-end"]
        assert h.code == 0
        await second.close()
    with_broker(tmp_path, test, **TX)


def test_a_4x_transaction_is_resolved_with_txmq_resolve_and_a_late_producer_end_changes_nothing(tmp_path):
    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        h = await c.send_half("Resolved", b"by-operator", "nobody-online", "TX-OP")
        await c.close()
        loop = asyncio.get_running_loop()
        r = await loop.run_in_executor(None, lambda: txmq("resolve", "TX-OP", "--commit", broker=b.address, subprocess_=True))
        ok(r)
        again = await RemotingClient.connect(b.remoting_address)
        assert [x["body"] for x in await pull_all(again, "cg", "Resolved")] == [b"by-operator"]
        r = await again.end("nobody-online", h, ROLLBACK, "TX-OP", oneway=False)
        assert r.code == 1 and "TX_CONFLICT" in r.remark
        pending = await loop.run_in_executor(None, lambda: txmq("inspect", "half", "-o", "json", broker=b.address, subprocess_=True))
        assert "TX-OP" not in out(pending)
        await again.close()
    with_broker(tmp_path, test, transaction_timeout_s=3600)


def test_a_raw_socket_frame_split_across_writes_is_reassembled(tmp_path):
    async def test(b):
        frame = encode(Cmd(GET_ROUTEINFO_BY_TOPIC, 7, 0, {"topic": "Split"}))
        loop = asyncio.get_running_loop()

        def talk() -> bytes:
            with socket.create_connection(("127.0.0.1", b.remoting_port), timeout=5) as s:
                for i in range(len(frame)):
                    s.sendall(frame[i : i + 1])
                head = s.recv(4, socket.MSG_WAITALL)
                (n,) = struct.unpack(">i", head)
                return s.recv(n, socket.MSG_WAITALL)

        from remotingwire import decode
        resp = decode(await loop.run_in_executor(None, talk))
        assert resp.code == 0 and resp.opaque == 7
    with_broker(tmp_path, test)


def test_a_message_sent_with_txmqs_own_protocol_is_pulled_by_a_remoting_client(tmp_path):
    async def test(b):
        loop = asyncio.get_running_loop()
        r = await loop.run_in_executor(None, lambda: txmq("send", "Native", "from-native", "--queue", "1", "--key", "nk",
                                                          broker=b.address, subprocess_=True))
        ok(r)
        c = await RemotingClient.connect(b.remoting_address)
        [m] = decode_messages((await c.pull("g", "Native", 1, 0)).body)
        assert m["body"] == b"from-native" and m["topic"] == "Native" and m["properties"].get("KEYS") == "nk"
        await c.close()
    with_broker(tmp_path, test)


def test_the_java_producers_template_topic_is_routed_but_never_created(tmp_path):
    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        r = await c.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "TBW102"})
        assert r.code == 0 and json.loads(r.body)["queueDatas"][0]["writeQueueNums"] == 4
        assert b.core.topics.queues("TBW102") is None
        await c.close()
    with_broker(tmp_path, test)


def test_random_frames_close_their_connections_and_the_broker_keeps_serving(tmp_path):
    import random

    rnd = random.Random(30)

    async def test(b):
        for i in range(60):
            kind = rnd.choice([0, 1, 2])
            header = bytes(rnd.getrandbits(8) for _ in range(rnd.randint(0, 80)))
            if kind == 1:  # a JSON header with fields of the wrong types
                header = json.dumps({"code": rnd.choice(["x", 1.5, None, [1]]), "opaque": rnd.randint(-9, 9),
                                     "extFields": rnd.choice([[1], "s", {"k": [1]}])}).encode()
            body = bytes(rnd.getrandbits(8) for _ in range(rnd.randint(0, 40)))
            frame = struct.pack(">ii", 4 + len(header) + len(body), ((i % 3) << 24) | len(header)) + header + body
            reader, writer = await asyncio.open_connection("127.0.0.1", b.remoting_port)
            writer.write(frame)
            try:
                await asyncio.wait_for(reader.read(), 5)
            except (ConnectionError, asyncio.TimeoutError):  # a frame that happens to be a command is answered, not closed
                pass
            writer.close()
        c = await RemotingClient.connect(b.remoting_address)
        assert (await c.send("AfterFuzz", b"ok")).code == 0
        await c.close()
    with_broker(tmp_path, test)


# ---- bad input and bounded memory ------------------------------------------------------------------
async def _refusal(port: int, frame: bytes):
    """Send one raw frame on a fresh connection; the broker's one response before it closes the connection."""
    from remotingwire import decode
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(frame)
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert data, "the connection was closed without a response saying why"
    (n,) = struct.unpack_from(">i", data)
    return decode(data[4 : 4 + n])


def test_a_json_header_nested_too_deeply_gets_a_reason_and_closes_that_connection_only(tmp_path):
    async def test(b):
        good = await RemotingClient.connect(b.remoting_address)
        for header in (b"[" * 200_000, b'{"code":105,"remark":' + b"[" * 200_000 + b"}"):
            resp = await _refusal(b.remoting_port, struct.pack(">ii", 4 + len(header), len(header)) + header)
            assert resp.code == 1 and "nested" in resp.remark
        assert b.core.metrics.counters["remoting_malformed_frames"] == 2
        assert (await good.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "StillServed"})).code == 0
        await good.close()
    with_broker(tmp_path, test)


def _batch(*messages: tuple[bytes, dict]) -> bytes:
    body = b""
    for mb, props in messages:
        pb = properties(props).encode()
        body += struct.pack(">iiiii", 20 + len(mb) + 2 + len(pb), 0, 0, 0, len(mb)) + mb + len(pb).to_bytes(2, "big") + pb
    return body


def test_each_message_of_a_batch_is_held_to_the_property_limits_of_a_single_send(tmp_path):
    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        head = {"a": "pg", "b": "BatchProps", "c": "TBW102", "d": 4, "e": 0, "f": 0, "g": 0, "h": 0, "i": "", "m": "true"}
        for props in ({f"k{i}": "v" for i in range(300)}, {"big": "x" * 5000}):  # 256 entries, --max-properties 4096
            r = await c.request(SEND_BATCH_MESSAGE, head, _batch((b"ok", {"UNIQ_KEY": "A"}), (b"bad", props)))
            assert r.code == 13 and "properties" in r.remark
        assert b.core.store.queue_max_offset("BatchProps", 0) == 0  # nothing of a refused batch is stored
        r = await c.request(SEND_BATCH_MESSAGE, head, _batch((b"ok", {"UNIQ_KEY": "A"}), (b"fine", {"k": "v"})))
        assert r.code == 0
        await c.close()
    with_broker(tmp_path, test, max_properties=4096)


def test_a_compressed_body_is_inflated_within_max_body_and_one_cut_short_or_inflating_past_it_is_refused(tmp_path):
    import zlib

    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        whole = zlib.compress(b"payload " * 1000)
        assert (await c.send("Zipped", whole, queue_id=0, sys_flag=1)).code == 0
        [m] = decode_messages((await c.pull("zg", "Zipped", 0, 0)).body)
        assert m["body"] == b"payload " * 1000
        r = await c.send("Zipped", whole[: len(whole) // 2], queue_id=0, sys_flag=1)  # a stream that does not end
        assert r.code == 13 and "cut short" in r.remark
        bomb = zlib.compress(b"\0" * (64 << 20), 9)  # 64 KiB that inflate to 64 MiB: stopped at --max-body
        r = await c.send("Zipped", bomb, queue_id=0, sys_flag=1)
        assert r.code == 13 and "--max-body" in r.remark
        assert b.core.store.queue_max_offset("Zipped", 0) == 1
        await c.close()
    with_broker(tmp_path, test)


def test_suspended_pulls_end_with_their_connection_instead_of_waiting_out_their_timeout(tmp_path):
    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        assert (await c.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "Quiet"})).code == 0
        pulls = [asyncio.ensure_future(c.pull("qg", "Quiet", q, 0, suspend_ms=25_000)) for q in range(4)]
        for _ in range(100):
            if b.core.polls.waiting() == 4:
                break
            await asyncio.sleep(0.02)
        assert b.core.polls.waiting() == 4
        await c.close()
        for p in pulls:
            p.cancel()
        for _ in range(100):
            if not b.core.polls.waiting() and not b.remoting.inflight:
                break
            await asyncio.sleep(0.02)
        assert not b.core.polls.waiting() and not b.remoting.inflight  # not 25 s later
    with_broker(tmp_path, test)


def test_only_a_live_consumer_of_the_group_takes_queue_locks(tmp_path):
    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        assert (await c.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "Guarded"})).code == 0
        await c.heartbeat("member", consumers={"lg": ["Guarded"]})
        mqs = [{"topic": "Guarded", "brokerName": "txmq", "queueId": q} for q in range(4)]
        for group, cid in (("lg", "stranger"), ("no-such-group", "member"), ("g" * 5000, "x" * 5000)):
            r = await c.request(LOCK_BATCH_MQ, {}, json.dumps({"consumerGroup": group, "clientId": cid, "mqSet": mqs}).encode())
            assert r.code == 0 and json.loads(r.body)["lockOKMQSet"] == []
        assert b.remoting.clients.locks == {}
        r = await c.request(LOCK_BATCH_MQ, {}, json.dumps({"consumerGroup": "lg", "clientId": "member", "mqSet": mqs}).encode())
        assert len(json.loads(r.body)["lockOKMQSet"]) == 4
        await c.close()
    with_broker(tmp_path, test)


def test_a_pull_committing_an_offset_for_a_name_no_group_can_have_is_refused_and_commits_nothing(tmp_path):
    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        assert (await c.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "Offsets"})).code == 0
        from remotingwire import PULL_MESSAGE
        r = await c.request(PULL_MESSAGE, {"consumerGroup": "bad group\n", "topic": "Offsets", "queueId": 0, "queueOffset": 0,
                                           "maxMsgNums": 1, "sysFlag": 1, "commitOffset": 5})
        assert r.code == 29 and "group" in r.remark
        assert b.core.offsets.get("bad group\n", "Offsets", 0) is None
        await c.close()
    with_broker(tmp_path, test)


def test_a_heartbeat_subscribing_a_topic_name_or_expression_past_their_lengths_is_refused(tmp_path):
    async def test(b):
        c = await RemotingClient.connect(b.remoting_address)
        from remotingwire import HEART_BEAT
        for topic, expr in (("t" * 5000, "*"), ("T", "a || " * 2000)):
            data = {"clientID": "hb", "consumerDataSet": [{"groupName": "hg", "messageModel": "CLUSTERING",
                                                           "subscriptionDataSet": [{"topic": topic, "subString": expr}]}]}
            r = await c.request(HEART_BEAT, {}, json.dumps(data).encode())
            assert r.code == 29 and "subscription" in r.remark
        assert b.remoting.clients.consumers == {}
        await c.close()
    with_broker(tmp_path, test)


def test_a_retry_waits_the_delay_of_level_3_plus_its_reconsume_times_from_the_one_level_table():
    from txmq.broker.config import BrokerConfig, parse_delay_levels
    from txmq.broker.messaging.naming import retry_delay_ms
    from txmq.constants import MESSAGE_DELAY_LEVEL

    levels = parse_delay_levels(MESSAGE_DELAY_LEVEL)
    assert BrokerConfig().message_delay_levels_ms == levels
    assert [retry_delay_ms(levels, t, 0) for t in (0, 1, 15, 99)] == [10_000, 30_000, 7_200_000, 7_200_000]
    assert retry_delay_ms(levels, -5, 0) == 10_000  # a RECONSUME_TIME property below 0 counts as 0
    assert retry_delay_ms(levels, 0, 1) == 1_000 and retry_delay_ms((0,), 7, 0) == 0
    assert parse_delay_levels("100ms 2s 1m 1h 1d") == (100, 2000, 60_000, 3_600_000, 86_400_000)
    for bad in ("", "1x", "-1s", "1.5s", "4d", "1s " * 65):
        try:
            parse_delay_levels(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted")


def test_remoting_connections_count_in_broker_status_stats_and_prometheus(tmp_path):
    from txmq.broker.prom import BrokerCollector

    async def test(b):
        held = [await RemotingClient.connect(b.remoting_address) for _ in range(3)]
        assert (await held[0].request(GET_ROUTEINFO_BY_TOPIC, {"topic": "Counted"})).code == 0
        await asyncio.sleep(0.05)
        info = b.core.info()
        assert info["remoting_connections"] == 3 and info["connections"] >= 3
        gauges = (await b.core.stats())["gauges"]
        assert gauges["remoting_connections"] == 3 and gauges["connections"] == info["connections"]
        assert "remoting_partial_frame_bytes" in gauges
        prom = {m.name: m for m in BrokerCollector(b.core).collect()}
        assert prom["txmq_remoting_connections"].samples[0].value == 3
        assert prom["txmq_connections"].samples[0].value == info["connections"]
        assert prom["txmq_remoting_max_connections"].samples[0].value == b.remoting.max_connections > 0
        assert prom["txmq_remoting_requests"].samples[0].value >= 1
        for c in held:
            await c.close()
        await eventually(lambda: b.core.info()["remoting_connections"] == 0, what="the closed connections to be forgotten")
    with_broker(tmp_path, test)


def _ports_two_apart() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 3:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port - 2))
        except OSError:
            continue
        return port
    raise RuntimeError("no two free ports two apart")


def test_with_the_vip_channel_the_port_minus_2_serves_the_same_front_end(tmp_path):
    port = _ports_two_apart()

    async def test(b):
        assert b.core.info()["listeners"]["remoting"]["vip_port"] == port - 2
        vip = await RemotingClient.connect(f"127.0.0.1:{port - 2}")
        r = await vip.send("ViaVip", b"vip", queue_id=0)
        assert r.code == 0
        main = await RemotingClient.connect(b.remoting_address)
        [m] = decode_messages((await main.pull("vg", "ViaVip", 0, 0)).body)
        assert m["body"] == b"vip"
        assert b.core.info()["remoting_connections"] == 2
        await vip.close()
        await main.close()
    with_broker(tmp_path, test, remoting_port=port, remoting_vip_channel=True)


def test_the_vip_channel_needs_the_remoting_port():
    from txmq.broker.config import BrokerConfig

    for kwargs, why in (({"remoting_vip_channel": True}, "needs --remoting-port"),
                        ({"remoting_vip_channel": True, "remoting_port": 9878, "port": 9876}, "--remoting-port - 2")):
        try:
            BrokerConfig(**kwargs).validated()
        except ValueError as exc:
            assert why in str(exc)
        else:
            raise AssertionError(kwargs)
