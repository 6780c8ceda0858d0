"""The operator's request codes on --remoting-port (what Apache's mqadmin asks), at the frame level, without Java.

Each request is answered in the layout RocketMQ 4.9.8's broker writes (fastjson bodies, read here with
tests/fastjson_text.py), from the broker's own services. tests/test_mqadmin_txmq.py runs Apache's mqadmin itself.
"""

from __future__ import annotations

import asyncio
import json

from conftest import arun, eventually

from clihelpers import out, txmq
from fastjson_text import loads, mq
from remotingwire import GET_ROUTEINFO_BY_TOPIC, HEART_BEAT, RemotingClient, offset_of
from txmq.broker.remoting import admin
from txmq.broker.testing import running_broker

QUERY_MESSAGE, UPDATE_BROKER_CONFIG, GET_BROKER_CONFIG, GET_BROKER_RUNTIME_INFO = 12, 25, 26, 28
UPDATE_AND_CREATE_TOPIC, GET_BROKER_CLUSTER_INFO, GET_TOPIC_STATS_INFO, GET_CONSUMER_CONNECTION_LIST = 17, 106, 202, 203
GET_CONSUME_STATS, DELETE_TOPIC_IN_BROKER, DELETE_TOPIC_IN_NAMESRV = 208, 215, 216
RESET_CONSUMER_CLIENT_OFFSET, INVOKE_BROKER_TO_RESET_OFFSET, QUERY_TOPIC_CONSUME_BY_WHO = 220, 222, 300
SUCCESS, SYSTEM_ERROR, REQUEST_CODE_NOT_SUPPORTED, TOPIC_NOT_EXIST, QUERY_NOT_FOUND, INVALID_PARAMETER = 0, 1, 3, 17, 22, 29
CONSUMER_NOT_ONLINE = 206


def with_broker(tmp_path, test, **overrides):
    async def main():
        async with running_broker(tmp_path / "data", **{"remoting_port": 0, **overrides}) as b:
            c = await RemotingClient.connect(b.remoting_address)
            try:
                await test(b, c)
            finally:
                await c.close()
    arun(main())


async def send(c: RemotingClient, topic: str, body: bytes, keys: str = "", queue_id: int = 0):
    props = {"KEYS": keys} if keys else {}
    r = await c.send(topic, body, props=props, queue_id=queue_id)
    assert r.code == SUCCESS, r.remark
    return r


async def consumer_heartbeat(c: RemotingClient, group: str, topics: dict[str, str], consume_type: str = "CONSUME_PASSIVELY",
                             client_id: str = "10.0.0.9@consumer-1"):
    data = {"clientID": client_id, "producerDataSet": [],
            "consumerDataSet": [{"groupName": group, "consumeType": consume_type, "messageModel": "CLUSTERING",
                                 "consumeFromWhere": "CONSUME_FROM_FIRST_OFFSET", "unitMode": False,
                                 "subscriptionDataSet": [{"topic": t, "subString": e} for t, e in topics.items()]}]}
    r = await c.request(HEART_BEAT, {}, json.dumps(data).encode())
    assert r.code == SUCCESS, r.remark


# ---- cluster and broker --------------------------------------------------------------------------
def test_cluster_info_names_one_broker_master_at_the_remoting_port(tmp_path):
    async def test(b, c):
        r = await c.request(GET_BROKER_CLUSTER_INFO)
        assert r.code == SUCCESS
        info = loads(r.body)
        assert info == {"brokerAddrTable": {"txmq": {"brokerAddrs": {0: b.remoting_address}, "brokerName": "txmq", "cluster": "txmq"}},
                        "clusterAddrTable": {"txmq": ["txmq"]}}
    with_broker(tmp_path, test)


def test_runtime_info_gives_the_figures_mqadmin_reads_from_the_broker(tmp_path):
    async def test(b, c):
        await send(c, "Figures", b"x")
        r = await c.request(GET_BROKER_RUNTIME_INFO)
        assert r.code == SUCCESS
        table = loads(r.body)["table"]
        # clusterList (and -m) and brokerStatus read these
        for key in ("putTps", "getTransferedTps", "sendThreadPoolQueueSize", "pullThreadPoolQueueSize", "brokerVersionDesc",
                    "sendThreadPoolQueueHeadWaitTimeMills", "pullThreadPoolQueueHeadWaitTimeMills", "pageCacheLockTimeMills",
                    "earliestMessageTimeStamp", "commitLogDiskRatio", "msgPutTotalTodayNow", "msgPutTotalTodayMorning",
                    "msgPutTotalYesterdayMorning", "msgGetTotalTodayNow", "msgGetTotalTodayMorning", "msgGetTotalYesterdayMorning"):
            assert isinstance(table[key], str), key
        assert all(isinstance(v, str) for v in table.values())
        assert len(table["putTps"].split()) == 3 and float(table["putTps"].split()[0]) >= 0
        assert table["msgPutTotalTodayNow"] == "1" and table["brokerVersion"] == "409"
        assert int(table["earliestMessageTimeStamp"]) > 0 and int(table["commitLogMaxOffset"]) > 0
        assert 0 <= float(table["commitLogDiskRatio"]) <= 1
    with_broker(tmp_path, test)


def test_the_put_rate_is_sampled_once_a_second_once_asked_for(tmp_path):
    async def test(b, c):
        await c.request(GET_BROKER_RUNTIME_INFO)  # starts the sampling
        for _ in range(5):
            await send(c, "Rates", b"x")
        counts = admin._counts(b.remoting)
        await eventually(lambda: len(counts.samples) >= 2 and counts.samples[-1][1] >= 5, what="a sample after the sends")
        r = await c.request(GET_BROKER_RUNTIME_INFO)
        assert float(loads(r.body)["table"]["putTps"].split()[0]) > 0
    with_broker(tmp_path, test)


def test_broker_config_gives_rocketmqs_names_with_txmqs_values(tmp_path):
    async def test(b, c):
        r = await c.request(GET_BROKER_CONFIG)
        assert r.code == SUCCESS
        props = admin.parse_properties(r.body.decode())
        assert props["transactionCheckInterval"] == "2500" and props["transactionTimeOut"] == "1500"
        assert props["transactionCheckMax"] == "7" and props["brokerName"] == "txmq" and props["brokerClusterName"] == "txmq"
        assert props["listenPort"] == str(b.remoting_port) and props["flushDiskType"] == "ASYNC_FLUSH"
        assert props["messageDelayLevel"].split()[:3] == ["1s", "5s", "10s"]
        assert loads(r.ext["version"])["counter"] == 0
    with_broker(tmp_path, test, check_interval_s=2.5, transaction_timeout_s=1.5, max_checks=7)


def test_update_broker_config_retunes_the_check_service_live_and_persists_it(tmp_path):
    async def test(b, c):
        body = "transactionCheckInterval=5000\ntransactionTimeOut=12000\ntransactionCheckMax=3\n"
        r = await c.request(UPDATE_BROKER_CONFIG, {}, body.encode())
        assert r.code == SUCCESS, r.remark
        s = b.core.check.settings
        assert (s.check_interval_s, s.transaction_timeout_s, s.max_checks) == (5.0, 12.0, 3)
        stored = json.loads((tmp_path / "data" / "config.json").read_text())  # as `txmq config set` persists it
        assert stored["check_interval_s"] == 5.0 and stored["transaction_timeout_s"] == 12.0 and stored["max_checks"] == 3
        got = await asyncio.to_thread(txmq, "config", "get", "-o", "json", broker=b.address, subprocess_=True)
        assert json.loads(out(got))["max_checks"] == 3  # what `txmq config get` shows
        props = admin.parse_properties((await c.request(GET_BROKER_CONFIG)).body.decode())
        assert props["transactionCheckInterval"] == "5000" and props["transactionCheckMax"] == "3"
        assert loads((await c.request(GET_BROKER_CONFIG)).ext["version"])["counter"] == 1
    with_broker(tmp_path, test)


def test_update_broker_config_refuses_what_it_cannot_change_and_changes_nothing(tmp_path):
    async def test(b, c):
        before = b.core.check.settings
        for body, words in (("brokerPermission=4\n", "brokerPermission"),
                            ("transactionCheckInterval=5000\nflushDiskType=SYNC_FLUSH\n", "flushDiskType"),
                            ("transactionCheckInterval=5000\ntransactionCheckMax=0\n", "max_checks"),
                            ("transactionTimeOut=soon\n", "whole number")):
            r = await c.request(UPDATE_BROKER_CONFIG, {}, body.encode())
            assert r.code == INVALID_PARAMETER and words in r.remark, (body, r.remark)
        assert b.core.check.settings == before
        assert not (tmp_path / "data" / "config.json").exists()
    with_broker(tmp_path, test)


def test_properties_are_read_as_java_writes_them():
    assert admin.parse_properties("# comment\n a = 1\nb:2\nc 3\n\n!x\nd=e\\=f\\\\g\n") == {"a": "1", "b": "2", "c": "3", "d": "e=f\\g"}
    assert admin.parse_properties("transactionCheckMax=5\n") == {"transactionCheckMax": "5"}
    assert admin.parse_properties("k=a=b\n") == {"k": "a=b"}


# ---- topics --------------------------------------------------------------------------------------
def test_update_and_create_topic_changes_the_queue_count_of_a_topic_that_exists(tmp_path):
    async def test(b, c):
        for n in (3, 6):
            r = await c.request(UPDATE_AND_CREATE_TOPIC, {"topic": "Grown", "readQueueNums": n, "writeQueueNums": n, "perm": 6})
            assert r.code == SUCCESS, r.remark
            assert b.core.topics.queues("Grown") == n
    with_broker(tmp_path, test)


def test_topic_stats_give_each_queues_offsets_and_last_store_time(tmp_path):
    async def test(b, c):
        for i in range(3):
            await send(c, "Stats", b"m%d" % i, queue_id=1)
        r = await c.request(GET_TOPIC_STATS_INFO, {"topic": "Stats"})
        assert r.code == SUCCESS
        table = loads(r.body)["offsetTable"]
        assert set(table) == {mq("txmq", "Stats", q) for q in range(4)}
        assert table[mq("txmq", "Stats", 1)]["maxOffset"] == 3 and table[mq("txmq", "Stats", 1)]["minOffset"] == 0
        assert table[mq("txmq", "Stats", 1)]["lastUpdateTimestamp"] > 0 and table[mq("txmq", "Stats", 0)]["lastUpdateTimestamp"] == 0
        r = await c.request(GET_TOPIC_STATS_INFO, {"topic": "Nowhere"})
        assert r.code == TOPIC_NOT_EXIST and r.remark == "topic[Nowhere] not exist"
    with_broker(tmp_path, test)


def test_delete_topic_takes_it_out_of_the_table_and_is_refused_while_transactions_are_pending(tmp_path):
    async def test(b, c):
        await send(c, "Doomed", b"x")
        for code in (DELETE_TOPIC_IN_BROKER, DELETE_TOPIC_IN_NAMESRV):  # mqadmin deleteTopic sends both
            r = await c.request(code, {"topic": "Doomed", "clusterName": "txmq"})
            assert r.code == SUCCESS, r.remark
        assert b.core.topics.queues("Doomed") is None
        half = await c.send_half("Pending", b"tx", "pg", "TX-ADMIN-1")
        assert half.code == SUCCESS
        r = await c.request(DELETE_TOPIC_IN_BROKER, {"topic": "Pending"})
        assert r.code == SYSTEM_ERROR and "TOPIC_IN_USE" in r.remark
        assert b.core.topics.queues("Pending") is not None
        r = await c.request(DELETE_TOPIC_IN_BROKER, {"topic": "RMQ_SYS_TRANS_HALF_TOPIC"})
        assert r.code != SUCCESS
    with_broker(tmp_path, test)


# ---- consumer groups -------------------------------------------------------------------------------
def test_consume_stats_give_the_groups_offsets_against_each_queues_end(tmp_path):
    async def test(b, c):
        for i in range(3):
            await send(c, "Progress", b"m%d" % i, queue_id=0)
        await c.request(15, {"consumerGroup": "cg", "topic": "Progress", "queueId": 0, "commitOffset": 2})
        r = await c.request(GET_CONSUME_STATS, {"consumerGroup": "cg"})
        assert r.code == SUCCESS
        stats = loads(r.body)
        q0 = stats["offsetTable"][mq("txmq", "Progress", 0)]
        assert (q0["brokerOffset"], q0["consumerOffset"]) == (3, 2) and q0["lastTimestamp"] > 0
        assert stats["offsetTable"][mq("txmq", "Progress", 3)] == {"brokerOffset": 0, "consumerOffset": 0, "lastTimestamp": 0}
        empty = loads((await c.request(GET_CONSUME_STATS, {"consumerGroup": "nobody"})).body)
        assert empty["offsetTable"] == {}
        # a topic its live consumers no longer subscribe to is left out, as RocketMQ's broker does
        await consumer_heartbeat(c, "cg", {"Elsewhere": "*"})
        assert loads((await c.request(GET_CONSUME_STATS, {"consumerGroup": "cg"})).body)["offsetTable"] == {}
    with_broker(tmp_path, test)


def test_consumer_connections_list_each_client_with_its_subscriptions(tmp_path):
    async def test(b, c):
        r = await c.request(GET_CONSUMER_CONNECTION_LIST, {"consumerGroup": "cg"})
        assert r.code == CONSUMER_NOT_ONLINE and r.remark == "the consumer group[cg] not online"
        await consumer_heartbeat(c, "cg", {"Orders": "TagA || TagB", "%RETRY%cg": "*"}, consume_type="CONSUME_ACTIVELY")
        r = await c.request(GET_CONSUMER_CONNECTION_LIST, {"consumerGroup": "cg"})
        assert r.code == SUCCESS
        cc = loads(r.body)
        [conn] = cc["connectionSet"]
        assert conn["clientId"] == "10.0.0.9@consumer-1" and conn["language"] == "JAVA" and conn["clientAddr"].startswith("127.0.0.1:")
        assert cc["consumeType"] == "CONSUME_ACTIVELY" and cc["messageModel"] == "CLUSTERING"
        assert cc["consumeFromWhere"] == "CONSUME_FROM_FIRST_OFFSET"
        sub = cc["subscriptionTable"]["Orders"]
        assert sub["tagsSet"] == ["TagA", "TagB"] and sub["codeSet"] == [2598919, 2598920] and sub["expressionType"] == "TAG"
        assert cc["subscriptionTable"]["%RETRY%cg"]["subString"] == "*"
        r = await c.request(QUERY_TOPIC_CONSUME_BY_WHO, {"topic": "Orders"})
        assert loads(r.body) == {"groupList": ["cg"]}
    with_broker(tmp_path, test)


def test_consumer_connections_show_a_sql92_subscription_with_its_expression_type(tmp_path):
    async def test(b, c):
        data = {"clientID": "10.0.0.9@consumer-1", "producerDataSet": [],
                "consumerDataSet": [{"groupName": "cg", "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
                                     "consumeFromWhere": "CONSUME_FROM_FIRST_OFFSET", "unitMode": False,
                                     "subscriptionDataSet": [{"topic": "Orders", "subString": "a > 1", "expressionType": "SQL92"}]}]}
        assert (await c.request(HEART_BEAT, {}, json.dumps(data).encode())).code == SUCCESS
        sub = loads((await c.request(GET_CONSUMER_CONNECTION_LIST, {"consumerGroup": "cg"})).body)["subscriptionTable"]["Orders"]
        assert (sub["expressionType"], sub["subString"], sub["tagsSet"], sub["codeSet"]) == ("SQL92", "a > 1", [], [])
    with_broker(tmp_path, test)


def test_java_hash_is_strings_hash_code():
    assert [admin.java_hash(s) for s in ("", "TagA", "a", "é", "hello world", "😀")] == [0, 2598919, 97, 233, 1794106052, 1772899]


def test_reset_offset_commits_and_tells_the_live_consumers_or_answers_not_online(tmp_path):
    async def test(b, c):
        for i in range(4):
            await send(c, "Rewind", b"m%d" % i, queue_id=0)
        head = {"topic": "Rewind", "group": "cg", "timestamp": 0, "isForce": "true"}
        r = await c.request(INVOKE_BROKER_TO_RESET_OFFSET, head)
        assert r.code == SYSTEM_ERROR and "not exist" in r.remark  # the group has no offset in the topic
        for q in range(4):
            await c.request(15, {"consumerGroup": "cg", "topic": "Rewind", "queueId": q, "commitOffset": 4 if q == 0 else 0})
        r = await c.request(INVOKE_BROKER_TO_RESET_OFFSET, head)
        assert r.code == CONSUMER_NOT_ONLINE and "Consumer not online" in r.remark  # mqadmin then resets offset by offset
        assert b.core.offsets.get("cg", "Rewind", 0) == 4
        consumer = await RemotingClient.connect(b.remoting_address)
        try:
            await consumer_heartbeat(consumer, "cg", {"Rewind": "*"})
            r = await c.request(INVOKE_BROKER_TO_RESET_OFFSET, head)
            assert r.code == SUCCESS, r.remark
            assert loads(r.body)["offsetTable"][mq("txmq", "Rewind", 0)] == 0
            assert b.core.offsets.get("cg", "Rewind", 0) == 0
            while True:
                pushed = await consumer.next_pushed()
                if pushed.code == RESET_CONSUMER_CLIENT_OFFSET:
                    break
            assert pushed.flag & 2 and pushed.ext == {"topic": "Rewind", "group": "cg", "timestamp": "0", "isForce": "true"}
            assert loads(pushed.body)["offsetTable"][mq("txmq", "Rewind", 0)] == 0
            # not forced: a queue the group is behind the time in keeps its offset
            await c.request(15, {"consumerGroup": "cg", "topic": "Rewind", "queueId": 0, "commitOffset": 1})
            r = await c.request(INVOKE_BROKER_TO_RESET_OFFSET, {**head, "timestamp": -1, "isForce": "false"})
            assert loads(r.body)["offsetTable"][mq("txmq", "Rewind", 0)] == 1
            r = await c.request(INVOKE_BROKER_TO_RESET_OFFSET, {**head, "timestamp": -1})
            assert loads(r.body)["offsetTable"][mq("txmq", "Rewind", 0)] == 4
        finally:
            await consumer.close()
    with_broker(tmp_path, test)


# ---- messages ------------------------------------------------------------------------------------
def test_query_message_finds_a_topics_messages_by_key(tmp_path):
    async def test(b, c):
        await send(c, "Keyed", b"one", keys="order-1 shared")
        await send(c, "Keyed", b"two", keys="order-2 shared")
        await send(c, "Other", b"three", keys="shared")
        head = {"topic": "Keyed", "key": "shared", "maxNum": 32, "beginTimestamp": 0, "endTimestamp": (1 << 63) - 1}
        r = await c.request(QUERY_MESSAGE, {**head, "_UNIQUE_KEY_QUERY": "false"})
        assert r.code == SUCCESS and int(r.ext["indexLastUpdatePhyoffset"]) > 0
        from remotingwire import decode_messages

        assert sorted(m["body"] for m in decode_messages(r.body)) == [b"one", b"two"]
        r = await c.request(QUERY_MESSAGE, {**head, "key": "order-2"})
        assert [m["body"] for m in decode_messages(r.body)] == [b"two"]
        for miss in ({**head, "key": "order-3"}, {**head, "topic": "Nowhere"}):
            r = await c.request(QUERY_MESSAGE, miss)
            assert r.code == QUERY_NOT_FOUND and r.remark == "can not find message, maybe time range not correct"
    with_broker(tmp_path, test)


def test_view_message_answers_an_offset_id_from_a_send(tmp_path):
    async def test(b, c):
        r = await send(c, "Viewed", b"seen", keys="v1")
        from remotingwire import VIEW_MESSAGE_BY_ID, decode_messages

        v = await c.request(VIEW_MESSAGE_BY_ID, {"offset": offset_of(r.ext["msgId"])})
        [m] = decode_messages(v.body)
        assert m["body"] == b"seen" and m["offset_msg_id"] == r.ext["msgId"]
        r = await c.request(QUERY_TOPIC_CONSUME_BY_WHO, {"topic": "Viewed"})  # what queryMsgById asks next
        assert r.code == SUCCESS and loads(r.body) == {"groupList": []}
    with_broker(tmp_path, test)


def test_an_unserved_request_code_is_answered_not_supported_naming_it(tmp_path):
    async def test(b, c):
        r = await c.request(201)
        assert r.code == REQUEST_CODE_NOT_SUPPORTED
        assert "201 (GET_ALL_SUBSCRIPTIONGROUP_CONFIG)" in r.remark
        r = await c.request(9999)
        assert r.code == REQUEST_CODE_NOT_SUPPORTED and "request code 9999 is not supported" in r.remark
        assert (await c.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "StillServed"})).code == SUCCESS
    with_broker(tmp_path, test)
