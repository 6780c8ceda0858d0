"""FIFO messages through the RocketMQ 5 gRPC front end: sends with a message group, FIFO groups' settings,
assignments and receives, and what is refused (transactional FIFO, bad groups, lite topics).

A plain grpc.aio client with txmq's generated stubs talks to an in-process broker (tests/test_rocketmq_frontend.py's
helpers); tests/test_rocketmq_sdk_*.py run the official SDKs against it.
"""

from __future__ import annotations

import pytest

grpc = pytest.importorskip("grpc", reason="the rocketmq extra (grpcio) is not installed")

from txmq.broker.rocketmq import missing_dependency  # noqa: E402

if missing_dependency():
    pytest.skip(missing_dependency(), allow_module_level=True)

from test_rocketmq_frontend import MD, OK, Telemetry, message, with_frontend  # noqa: E402
from test_rocketmq_topics import native, receive, receive_request  # noqa: E402

from txmq.broker.fifo import queue_of_group  # noqa: E402
from txmq.broker.rocketmq import convert  # noqa: E402
from txmq.broker.rocketmq.pb import definition_pb2 as d  # noqa: E402
from txmq.broker.rocketmq.pb import service_pb2 as s  # noqa: E402
from txmq.store import Record, TxType  # noqa: E402

T = "fifo-orders"
G = "fifo-consumers"


def fifo(topic: str, body: bytes, mid: str, group: str) -> d.Message:
    m = message(topic, body, mid, d.FIFO)
    m.system_properties.message_group = group
    return m


async def fifo_topic(b, queues: int = 4) -> None:
    code, _ = await native(b, "create_topic", {"topic": T, "queues": queues, "message_types": ["normal", "fifo"]})
    assert code == 0


def messages_of(responses: list[s.ReceiveMessageResponse]) -> list[d.Message]:
    return [r.message for r in responses if r.WhichOneof("content") == "message"]


def test_fifo_sends_go_to_the_groups_queue_and_are_delivered_with_their_group_and_type(tmp_path):
    async def body(b, stub, ch):
        await fifo_topic(b)
        route = await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name=T)), metadata=MD)
        assert all(d.FIFO in q.accept_message_types for q in route.message_queues)
        for i in range(6):
            group = f"order-{i % 2}"
            r = await stub.SendMessage(s.SendMessageRequest(messages=[fifo(T, f"{group}:{i}".encode(), f"ID{i}", group)]),
                                       metadata=MD)
            assert r.status.code == OK, r.status
        got = messages_of(await receive(stub, receive_request(T, "plain", 0.5)))
        assert len(got) == 6
        for group in ("order-0", "order-1"):
            q = queue_of_group(group, 4)
            mine = [m for m in got if m.system_properties.message_group == group]
            assert [m.body.decode() for m in mine] == [f"{group}:{i}" for i in range(6) if f"order-{i % 2}" == group]
            assert all(m.system_properties.message_type == d.FIFO and m.system_properties.queue_id == q for m in mine)
            assert [dict(m.user_properties) for m in mine] == [{"__SHARDINGKEY": group}] * len(mine)  # as RocketMQ 5

    with_frontend(tmp_path, body)


def test_a_delivered_message_carries_the_properties_rocketmqs_proxy_delivers_as_user_properties():
    """RocketMQ's proxy leaves only its broker's system properties (MessageConst.STRING_HASH_SET) out of a delivered
    message's user_properties: a FIFO message's __SHARDINGKEY is in them as well as in message_group, and so are a
    transactional message's CHECK_IMMUNITY_TIME_IN_SECONDS and TRANSACTION_CHECK_TIMES; txmq's own TXMQ_ ones are not."""
    props = {"shop": "7", "__SHARDINGKEY": "order-1", "TAGS": "t", "KEYS": "k1 k2", "UNIQ_KEY": "ID1", "PGROUP": "pg",
             "TIMER_DELIVER_MS": "1700000000000", "__BORNHOST": "10.0.0.1:1", "TXMQ_SCHEDULED_FROM": "12"}
    rec = Record(4096, 0, T, 2, 5, TxType.NORMAL, 1_700_000_000_000, 1_700_000_000_001, -1, props, b"x")
    m = convert.record_to_message(rec)
    assert dict(m.user_properties) == {"shop": "7", "__SHARDINGKEY": "order-1"}
    assert (m.system_properties.message_group, m.system_properties.tag, list(m.system_properties.keys)) == ("order-1", "t",
                                                                                                            ["k1", "k2"])
    tx = {"TRAN_MSG": "true", "UNIQ_KEY": "TX1", "PGROUP": T, "CHECK_IMMUNITY_TIME_IN_SECONDS": "30",
          "TRANSACTION_CHECK_TIMES": "2", "TRAN_PREPARED_QUEUE_OFFSET": "9", "REAL_TOPIC": T, "REAL_QID": "1"}
    m = convert.record_to_message(Record(8192, 0, T, 1, 0, TxType.NORMAL, 1, 2, 9, tx, b"y"))
    assert m.system_properties.message_type == d.TRANSACTION
    assert dict(m.user_properties) == {"CHECK_IMMUNITY_TIME_IN_SECONDS": "30", "TRANSACTION_CHECK_TIMES": "2",
                                       "__transactionId__": "TX1"}
    assert convert.user_properties(props) == {"shop": "7", "__SHARDINGKEY": "order-1"}
    # a send still may not set them: the message group and the transaction's settings have their own fields
    for name in ("__SHARDINGKEY", "CHECK_IMMUNITY_TIME_IN_SECONDS", "TRANSACTION_CHECK_TIMES"):
        with pytest.raises(convert.RmqError) as e:
            convert.from_message(message(T, b"z", "ID2", props={name: "v"}), 1024, 1024)
        assert e.value.code == d.ILLEGAL_MESSAGE_PROPERTY_KEY


@pytest.mark.parametrize("group, kind, code", [
    ("", d.FIFO, d.ILLEGAL_MESSAGE_GROUP),
    ("  ", d.FIFO, d.ILLEGAL_MESSAGE_GROUP),
    ("g" * 64, d.FIFO, d.ILLEGAL_MESSAGE_GROUP),
    ("bad\x01", d.FIFO, d.ILLEGAL_MESSAGE_GROUP),
    ("g1", d.TRANSACTION, d.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
])
def test_bad_message_groups_and_transactional_fifo_messages_are_refused_and_nothing_is_stored(tmp_path, group, kind, code):
    async def body(b, stub, ch):
        await native(b, "create_topic", {"topic": T, "message_types": ["normal", "fifo", "transaction"]})
        m = message(T, b"x", "BAD1", kind)
        if group:
            m.system_properties.message_group = group
        r = await stub.SendMessage(s.SendMessageRequest(messages=[m]), metadata=MD)
        assert r.status.code == code, r.status
        assert all(b.core.store.queue_max_offset(T, q) == 0 for q in range(4))

    with_frontend(tmp_path, body)


def test_a_fifo_groups_settings_say_fifo_its_assignment_names_every_queue_and_lite_limits_are_set(tmp_path):
    async def body(b, stub, ch):
        await fifo_topic(b, queues=3)
        code, _ = await native(b, "update_group", {"group": G, "fifo": True})
        assert code == 0
        for group, want in ((G, True), ("concurrent", False)):
            c = Telemetry(stub, f"{group}@1")
            cmd = s.TelemetryCommand()
            cmd.settings.client_type = d.PUSH_CONSUMER
            cmd.settings.user_agent.language = d.NODE_JS
            cmd.settings.subscription.group.name = group
            cmd.settings.subscription.subscriptions.add(topic=d.Resource(name=T))
            await c.send(cmd)
            sub = (await c.read()).settings.subscription
            assert sub.fifo is want
            # a LitePushConsumer checks these before it asks (without them: "length exceeded max length 0")
            assert sub.max_lite_topic_size > 0 and sub.lite_subscription_quota > 0
            await c.close()
            a = await stub.QueryAssignment(s.QueryAssignmentRequest(topic=d.Resource(name=T), group=d.Resource(name=group)),
                                           metadata=MD)
            ids = [x.message_queue.id for x in a.assignments]
            assert ids == ([0, 1, 2] if want else [-1])

    with_frontend(tmp_path, body)


def test_a_fifo_group_receives_a_queue_in_order_one_batch_at_a_time_through_grpc(tmp_path):
    async def body(b, stub, ch):
        await fifo_topic(b, queues=1)
        await native(b, "update_group", {"group": G, "fifo": True})
        for i in range(4):
            await stub.SendMessage(s.SendMessageRequest(messages=[fifo(T, f"m{i}".encode(), f"ID{i}", "one")]), metadata=MD)
        req = receive_request(T, G, 0.3)
        req.batch_size = 2
        first = messages_of(await receive(stub, req))
        assert [m.body for m in first] == [b"m0", b"m1"]
        assert messages_of(await receive(stub, req)) == []  # blocked: m0 and m1 are in flight
        ack = s.AckMessageRequest(group=d.Resource(name=G), topic=d.Resource(name=T))
        for m in first:
            ack.entries.add(message_id=m.system_properties.message_id, receipt_handle=m.system_properties.receipt_handle)
        assert (await stub.AckMessage(ack, metadata=MD)).status.code == OK
        assert [m.body for m in messages_of(await receive(stub, req))] == [b"m2", b"m3"]

    with_frontend(tmp_path, body)


def test_lite_and_priority_messages_are_refused_as_unsupported_with_a_message_saying_so(tmp_path):
    async def body(b, stub, ch):
        for field, value, kind, what in (("lite_topic", "lt-1", d.LITE, "lite topics"),
                                         ("priority", 3, d.PRIORITY, "message priorities")):
            m = message("plain", b"x", "U1", kind)
            setattr(m.system_properties, field, value)
            r = await stub.SendMessage(s.SendMessageRequest(messages=[m]), metadata=MD)
            assert r.status.code == d.UNSUPPORTED and what in r.status.message
        r = await stub.SyncLiteSubscription(s.SyncLiteSubscriptionRequest(), metadata=MD)
        assert r.status.code == d.UNSUPPORTED and "lite topics" in r.status.message

    with_frontend(tmp_path, body)


def test_a_fifo_message_that_cannot_be_converted_holds_back_the_rest_of_its_queue_in_the_batch(tmp_path, monkeypatch):
    from txmq.broker.rocketmq import consumer

    real = consumer.convert.record_to_message

    def convert(rec, **kw):
        if rec.body == b"m0":
            raise ValueError("unconvertible")
        return real(rec, **kw)

    monkeypatch.setattr(consumer.convert, "record_to_message", convert)

    async def body(b, stub, ch):
        await fifo_topic(b, queues=1)
        await native(b, "update_group", {"group": G, "fifo": True})
        for i in range(3):
            await stub.SendMessage(s.SendMessageRequest(messages=[fifo(T, f"m{i}".encode(), f"ID{i}", "one")]), metadata=MD)
        req = receive_request(T, G, 0.3)
        req.batch_size = 3
        assert messages_of(await receive(stub, req)) == []  # m1, m2 never go out ahead of m0
        assert messages_of(await receive(stub, req)) == []  # m0 is in flight (to no client): the queue waits
        pop = next(f for f in b.broker.frontends if hasattr(f, "service")).service.receive.pop
        assert pop.in_flight(G, T)[0] == {"committed": 0, "next": 3, "unsettled": 3, "in_flight": 1}

    with_frontend(tmp_path, body)
