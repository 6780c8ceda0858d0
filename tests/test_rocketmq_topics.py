"""Topics as RocketMQ's gRPC clients see them: unknown topics (never auto-created here), routes, message types, long polls.

A plain grpc.aio client with txmq's generated stubs (the helpers of tests/test_rocketmq_frontend.py) talks to
an in-process broker; topics are created and inspected with native requests.
"""

from __future__ import annotations

import asyncio
import time

import pytest

grpc = pytest.importorskip("grpc", reason="the rocketmq extra (grpcio) is not installed")

from txmq.broker.rocketmq import missing_dependency  # noqa: E402

if missing_dependency():
    pytest.skip(missing_dependency(), allow_module_level=True)

from test_rocketmq_frontend import MD, OK, message, native_read, with_frontend  # noqa: E402
from remotingwire import RemotingClient  # noqa: E402
from wireclient import RawClient  # noqa: E402

from txmq.broker.rocketmq.pb import definition_pb2 as d  # noqa: E402
from txmq.broker.rocketmq.pb import service_pb2 as s  # noqa: E402

TOPIC_NOT_FOUND = 40402
CONFLICT_WITH_TYPE = 40014


def not_found_text(topic: str) -> str:
    """What RocketMQ's proxy answers for a topic without a route (TopicRouteService, MQClientException, FAQUrl)."""
    return (f"CODE: 17  DESC: No topic route info in name server for the topic: {topic}\n"
            "For more information, please visit the url, https://rocketmq.apache.org/docs/bestPractice/06FAQ")


def unknown_topic_send_text(actual: str) -> str:
    """What RocketMQ 5's proxy answers a SendMessage to a topic it does not know: it checks the message's type against
    the topic's first (enableTopicMessageTypeCheck, on by default), and an unknown topic's type is UNSPECIFIED."""
    return f"TopicMessageType validate failed, the expected type is UNSPECIFIED, but actual type is {actual}"


def receive_request(topic: str, group: str = "g", poll_s: float = 1.0, queue_id: int = -1) -> s.ReceiveMessageRequest:
    req = s.ReceiveMessageRequest(group=d.Resource(name=group), batch_size=16, auto_renew=False)
    req.message_queue.topic.name = topic
    req.message_queue.id = queue_id
    req.filter_expression.type = d.TAG
    req.filter_expression.expression = "*"
    req.invisible_duration.seconds = 30
    req.long_polling_timeout.FromMilliseconds(int(poll_s * 1000))
    return req


async def receive(stub, req, timeout: float = 30.0) -> list[s.ReceiveMessageResponse]:
    return [x async for x in stub.ReceiveMessage(req, metadata=MD, timeout=timeout)]


async def native(b, op: str, fields: dict) -> tuple[int, dict]:
    c = await RawClient.open(b.address)
    try:
        return await c.req(op, fields)
    finally:
        await c.close()


# ---- unknown topics ------------------------------------------------------------------------
def test_without_auto_creation_route_send_and_receive_of_an_unknown_topic_are_refused_as_rocketmq_5_refuses_them(tmp_path):
    async def body(b, stub, ch):
        r = await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="nowhere")), metadata=MD)
        assert (r.status.code, r.status.message) == (TOPIC_NOT_FOUND, not_found_text("nowhere"))
        assert list(r.message_queues) == []
        a = await stub.QueryAssignment(s.QueryAssignmentRequest(topic=d.Resource(name="nowhere"), group=d.Resource(name="g")),
                                       metadata=MD)
        assert (a.status.code, a.status.message) == (TOPIC_NOT_FOUND, not_found_text("nowhere"))
        r = await stub.SendMessage(s.SendMessageRequest(messages=[message("nowhere", b"x", "N1")]), metadata=MD)
        assert (r.status.code, r.status.message) == (CONFLICT_WITH_TYPE, unknown_topic_send_text("NORMAL"))
        assert [e.status.code for e in r.entries] == [CONFLICT_WITH_TYPE]
        tx = message("nowhere", b"x", "N2", d.TRANSACTION)
        r = await stub.SendMessage(s.SendMessageRequest(messages=[tx]), metadata=MD)
        assert (r.status.code, r.status.message) == (CONFLICT_WITH_TYPE, unknown_topic_send_text("TRANSACTION"))
        got = await receive(stub, receive_request("nowhere"))
        assert [(x.status.code, x.status.message) for x in got] == [(TOPIC_NOT_FOUND, not_found_text("nowhere"))]
        code, listed = await native(b, "list_topics", {})
        assert code == 0 and listed["topics"] == []  # nothing was created
        # created by the operator, the same requests go through
        await native(b, "create_topic", {"topic": "nowhere", "queues": 2})
        r = await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="nowhere")), metadata=MD)
        assert r.status.code == OK and [q.id for q in r.message_queues] == [0, 1]
        r = await stub.SendMessage(s.SendMessageRequest(messages=[message("nowhere", b"x", "N3")]), metadata=MD)
        assert r.status.code == OK
        assert [m.body for m in await native_read(b, "nowhere", 1)] == [b"x"]

    with_frontend(tmp_path, body, auto_create_topics=False)


def test_a_deleted_topic_has_no_route_without_auto_creation(tmp_path):
    async def body(b, stub, ch):
        await native(b, "create_topic", {"topic": "brief", "queues": 1})
        r = await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="brief")), metadata=MD)
        assert r.status.code == OK
        code, _ = await native(b, "delete_topic", {"topic": "brief"})
        assert code == 0
        r = await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="brief")), metadata=MD)
        assert (r.status.code, r.status.message) == (TOPIC_NOT_FOUND, not_found_text("brief"))

    with_frontend(tmp_path, body, auto_create_topics=False)


def test_with_auto_creation_a_route_assignment_or_send_of_an_unknown_topic_is_refused_and_creates_nothing(tmp_path):
    """RocketMQ 5 answers a topic without a route NotFound (40402) whatever its broker's autoCreateTopicEnable says, so a
    5.x producer's start fails, and a send to it MESSAGE_PROPERTY_CONFLICT_WITH_TYPE (40014); the native and RocketMQ 4
    (remoting) front ends still create a topic on its first send."""
    async def body(b, stub, ch):
        r = await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="fresh")), metadata=MD)
        assert (r.status.code, r.status.message) == (TOPIC_NOT_FOUND, not_found_text("fresh"))
        assert list(r.message_queues) == []
        a = await stub.QueryAssignment(s.QueryAssignmentRequest(topic=d.Resource(name="fresh"), group=d.Resource(name="g")),
                                       metadata=MD)
        assert (a.status.code, a.status.message) == (TOPIC_NOT_FOUND, not_found_text("fresh"))
        r = await stub.SendMessage(s.SendMessageRequest(messages=[message("fresh", b"x", "F1")]), metadata=MD)
        assert (r.status.code, r.status.message) == (CONFLICT_WITH_TYPE, unknown_topic_send_text("NORMAL"))
        fifo = message("fresh", b"x", "F2", d.FIFO)
        fifo.system_properties.message_group = "g1"
        r = await stub.SendMessage(s.SendMessageRequest(messages=[fifo]), metadata=MD)
        assert (r.status.code, r.status.message) == (CONFLICT_WITH_TYPE, unknown_topic_send_text("FIFO"))
        code, listed = await native(b, "list_topics", {})
        assert code == 0 and listed["topics"] == []
        assert b.core.store.max_offset == 0  # nothing was written either
        # the other front ends create a topic on its first send, as before
        code, _ = await native(b, "send", {"topic": "by-native", "body": b"n"})
        assert code == 0 and b.core.topics.queues("by-native") == 4
        rc = await RemotingClient.connect(b.remoting_address)
        try:
            assert (await rc.send("by-remoting", b"r")).code == 0
        finally:
            await rc.close()
        assert b.core.topics.queues("by-remoting") == 4
        for topic in ("by-native", "by-remoting"):  # and then gRPC clients find them
            r = await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name=topic)), metadata=MD)
            assert r.status.code == OK and [q.id for q in r.message_queues] == [0, 1, 2, 3]

    with_frontend(tmp_path, body, remoting_port=0)


def test_a_created_topic_without_messages_has_a_route_and_a_receive_long_polls(tmp_path):
    async def body(b, stub, ch):
        r = await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="fresh")), metadata=MD)
        assert r.status.code == OK and [q.id for q in r.message_queues] == [0, 1, 2, 3]
        code, listed = await native(b, "list_topics", {})
        assert [(t["topic"], t["queues"], t["messages"]) for t in listed["topics"]] == [("fresh", 4, 0)]
        t0 = time.monotonic()
        got = await receive(stub, receive_request("fresh", poll_s=1.0))
        took = time.monotonic() - t0
        assert [x.status.code for x in got] == [d.MESSAGE_NOT_FOUND]
        assert took >= 0.9, f"answered after {took:.3f}s: no long poll"

    with_frontend(tmp_path, body, topics=("fresh",))


def test_a_receive_on_a_topic_with_no_message_yet_long_polls_instead_of_failing(tmp_path):
    """What RocketMQ's simple-consumer example does on a topic nothing was sent to: receive in a loop. Each call
    waits its long polling timeout; none fails."""
    async def body(b, stub, ch):
        r = await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="quiet")), metadata=MD)
        assert r.status.code == OK
        calls, codes = 0, set()
        loop = asyncio.get_running_loop()
        end = loop.time() + 3.0
        while loop.time() < end:
            calls += 1
            for x in await receive(stub, receive_request("quiet", poll_s=0.5, queue_id=r.message_queues[0].id)):
                codes.add(x.status.code)
        assert codes == {d.MESSAGE_NOT_FOUND}
        assert calls <= 8, f"{calls} receives in 3 s: they do not wait"

    with_frontend(tmp_path, body, topics=("quiet",))


def test_a_receive_on_a_created_topic_long_polls_and_wakes_on_a_send_without_auto_creation(tmp_path):
    async def body(b, stub, ch):
        await native(b, "create_topic", {"topic": "made", "queues": 2})
        waiting = asyncio.ensure_future(receive(stub, receive_request("made", poll_s=60)))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        r = await stub.SendMessage(s.SendMessageRequest(messages=[message("made", b"wake", "W1")]), metadata=MD)
        assert r.status.code == OK
        got = await asyncio.wait_for(waiting, 30)  # woken by the send, not the 60 s poll's end
        assert [x.message.body for x in got if x.HasField("message")] == [b"wake"]

    with_frontend(tmp_path, body, auto_create_topics=False)


# ---- message types -------------------------------------------------------------------------
def test_a_route_carries_the_topics_message_types(tmp_path):
    async def body(b, stub, ch):
        await native(b, "create_topic", {"topic": "typed", "queues": 2, "message_types": ["transaction", "fifo"]})
        r = await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="typed")), metadata=MD)
        assert [list(q.accept_message_types) for q in r.message_queues] == [[d.FIFO, d.TRANSACTION]] * 2
        await native(b, "update_topic", {"topic": "typed", "message_types": ["normal", "fifo", "delay", "transaction"]})
        r = await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="typed")), metadata=MD)
        assert list(r.message_queues[0].accept_message_types) == [d.NORMAL, d.FIFO, d.DELAY, d.TRANSACTION]
        a = await stub.QueryAssignment(s.QueryAssignmentRequest(topic=d.Resource(name="typed"), group=d.Resource(name="g")),
                                       metadata=MD)
        assert list(a.assignments[0].message_queue.accept_message_types) == [d.NORMAL, d.FIFO, d.DELAY, d.TRANSACTION]

    with_frontend(tmp_path, body)


def _delay(topic: str, mid: str) -> d.Message:
    m = message(topic, b"later", mid, d.DELAY)
    m.system_properties.delivery_timestamp.FromMilliseconds(int(time.time() * 1000) + 60_000)
    return m


def _fifo(topic: str, mid: str) -> d.Message:
    m = message(topic, b"in-order", mid, d.FIFO)
    m.system_properties.message_group = "g1"
    return m


def test_a_send_of_a_type_the_topic_does_not_accept_is_refused_as_rocketmqs_proxy_refuses_it(tmp_path):
    async def body(b, stub, ch):
        await native(b, "create_topic", {"topic": "only-tx", "message_types": ["transaction"]})
        await native(b, "create_topic", {"topic": "only-normal", "message_types": ["normal"]})

        async def status(m):
            r = await stub.SendMessage(s.SendMessageRequest(messages=[m]), metadata=MD)
            return r.status.code, r.status.message

        assert await status(message("only-tx", b"x", "T1")) == (
            CONFLICT_WITH_TYPE, "TopicMessageType validate failed, the expected type is TRANSACTION, but actual type is NORMAL")
        assert await status(message("only-normal", b"x", "T2", d.TRANSACTION)) == (
            CONFLICT_WITH_TYPE, "TopicMessageType validate failed, the expected type is NORMAL, but actual type is TRANSACTION")
        # a topic that accepts what every topic accepted so far: normal and transaction
        assert await status(_delay("orders", "T3")) == (
            CONFLICT_WITH_TYPE, "TopicMessageType validate failed, the expected type is [NORMAL, TRANSACTION], but actual type is DELAY")
        assert (await status(_fifo("orders", "T4")))[0] == CONFLICT_WITH_TYPE
        # a batch is refused whole when one message does not fit
        r = await stub.SendMessage(s.SendMessageRequest(messages=[message("only-normal", b"a", "T5"), _fifo("only-normal", "T6")]),
                                   metadata=MD)
        assert r.status.code == CONFLICT_WITH_TYPE
        for topic in ("only-tx", "only-normal", "orders"):
            assert await native_read(b, topic, 1, timeout=0.5) == []
        assert (await status(message("only-normal", b"fine", "T7")))[0] == OK

    with_frontend(tmp_path, body, topics=("orders",))


def test_fifo_and_delay_messages_on_a_topic_that_accepts_them_are_both_delivered(tmp_path):
    async def body(b, stub, ch):
        await native(b, "create_topic", {"topic": "wide", "message_types": ["normal", "fifo", "delay"]})
        r = await stub.SendMessage(s.SendMessageRequest(messages=[_fifo("wide", "W2")]), metadata=MD)
        assert r.status.code == OK and r.entries[0].message_id == "W2"
        r = await stub.SendMessage(s.SendMessageRequest(messages=[_delay("wide", "W1")]), metadata=MD)
        assert r.status.code == OK and r.entries[0].recall_handle  # scheduled, due in 60 s
        assert b.core.scheduled.gauges()["scheduled"] == 1
        got = await native_read(b, "wide", 2, timeout=1.0, at_least=1)
        assert [(m.body, m.properties.get("__SHARDINGKEY")) for m in got] == [(b"in-order", "g1")]

    with_frontend(tmp_path, body)


@pytest.mark.parametrize("kind", [d.FIFO, d.DELAY, d.NORMAL])
def test_a_message_with_both_a_message_group_and_a_delivery_time_is_refused_whatever_the_topic_accepts(tmp_path, kind):
    async def body(b, stub, ch):
        await native(b, "create_topic", {"topic": "wide", "message_types": ["normal", "fifo", "delay"]})
        await native(b, "create_topic", {"topic": "only-fifo", "message_types": ["fifo"]})
        for topic in ("wide", "only-fifo"):
            m = message(topic, b"both", "B1", kind)
            m.system_properties.message_group = "g1"
            m.system_properties.delivery_timestamp.FromMilliseconds(int(time.time() * 1000) + 60_000)
            r = await stub.SendMessage(s.SendMessageRequest(messages=[m]), metadata=MD)
            assert r.status.code == d.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE, r.status
            assert "both a message group (FIFO) and a delivery time (DELAY)" in r.status.message
            assert await native_read(b, topic, 1, timeout=0.3) == []
        assert b.core.scheduled.gauges()["scheduled"] == 0

    with_frontend(tmp_path, body)


def test_delay_message_is_scheduled_and_recalled_by_its_recall_handle(tmp_path):
    async def body(b, stub, ch):
        await native(b, "create_topic", {"topic": "wide", "message_types": ["normal", "delay"]})
        r = await stub.SendMessage(s.SendMessageRequest(messages=[_delay("wide", "W1")]), metadata=MD)
        assert r.status.code == OK and r.entries[0].message_id == "W1" and r.entries[0].recall_handle
        assert await native_read(b, "wide", 1, timeout=0.5) == []  # due in 60 s
        assert b.core.scheduled.gauges()["scheduled"] == 1
        handle = r.entries[0].recall_handle
        wrong = await stub.RecallMessage(s.RecallMessageRequest(topic=d.Resource(name="other"), recall_handle=handle), metadata=MD)
        assert wrong.status.code == d.BAD_REQUEST
        got = await stub.RecallMessage(s.RecallMessageRequest(topic=d.Resource(name="wide"), recall_handle=handle), metadata=MD)
        assert got.status.code == OK and got.message_id == "W1"
        again = await stub.RecallMessage(s.RecallMessageRequest(topic=d.Resource(name="wide"), recall_handle=handle), metadata=MD)
        assert again.status.code == d.MESSAGE_NOT_FOUND
        assert b.core.scheduled.gauges()["scheduled"] == 0
        m = _delay("wide", "W3")
        m.system_properties.delivery_timestamp.FromMilliseconds(int(time.time() * 1000) + 30 * 86_400_000)
        far = await stub.SendMessage(s.SendMessageRequest(messages=[m]), metadata=MD)
        assert far.status.code == d.ILLEGAL_DELIVERY_TIME and "at most 3d" in far.status.message

    with_frontend(tmp_path, body)


def test_native_sends_respect_the_topics_message_types_too(tmp_path):
    async def body(b, stub, ch):
        await native(b, "create_topic", {"topic": "plain", "message_types": ["normal"]})
        code, f = await native(b, "send", {"topic": "plain", "body": b"x", "properties": {"TRAN_MSG": "true", "PGROUP": "g"}})
        assert (code, f["name"], f["message_type"], f["message_types"]) == (45, "MESSAGE_TYPE_NOT_ACCEPTED", "transaction", ["normal"])
        code, _ = await native(b, "send", {"topic": "plain", "body": b"y"})
        assert code == 0

    with_frontend(tmp_path, body)
