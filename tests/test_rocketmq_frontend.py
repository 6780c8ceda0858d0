"""RocketMQ 5's gRPC service (broker/rocketmq/): routes, settings, sends, transactions and check-backs.

A plain grpc.aio client with txmq's generated stubs talks to an in-process
broker (``running_broker(..., rocketmq_port=0)``); what it sends is read
back with txmq's native consumer and operator calls, so both protocols are
held to one store and one transaction index. The official SDKs' scenarios
are in tests/test_rocketmq_sdk_*.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import zlib

import pytest

grpc = pytest.importorskip("grpc", reason="the rocketmq extra (grpcio) is not installed")

from conftest import arun  # noqa: E402

from txmq.broker.rocketmq import missing_dependency  # noqa: E402

if missing_dependency():
    pytest.skip(missing_dependency(), allow_module_level=True)

from brokerproc import free_port  # noqa: E402

from txmq.broker.rocketmq import clients as rmq_clients  # noqa: E402
from txmq.broker.rocketmq.convert import body_digest  # noqa: E402
from txmq.broker.rocketmq.pb import definition_pb2 as d  # noqa: E402
from txmq.broker.rocketmq.pb import service_pb2 as s  # noqa: E402
from txmq.broker.rocketmq.pb import service_pb2_grpc as g  # noqa: E402
from txmq.broker.testing import running_broker  # noqa: E402
from txmq.client import Consumer  # noqa: E402

OK = d.Code.Value("OK")
MD = (("x-mq-client-id", "test-client@1"), ("x-mq-language", "PYTHON"))


def message(topic: str, body: bytes, message_id: str, kind: int = d.NORMAL, tag: str | None = None, keys=(), props=None) -> d.Message:
    m = d.Message(body=body)
    m.topic.name = topic
    sp = m.system_properties
    sp.message_id = message_id
    sp.message_type = kind
    sp.body_encoding = d.IDENTITY
    sp.born_timestamp.FromMilliseconds(1_700_000_000_000)
    if tag:
        sp.tag = tag
    sp.keys.extend(keys)
    for k, v in (props or {}).items():
        m.user_properties[k] = v
    return m


def producer_settings(*topics: str, language: int = d.PYTHON) -> s.TelemetryCommand:
    cmd = s.TelemetryCommand()
    st = cmd.settings
    st.client_type = d.PRODUCER
    st.request_timeout.seconds = 3
    st.user_agent.language = language
    for t in topics:
        st.publishing.topics.add(name=t)
    st.publishing.max_body_size = 128 << 20
    st.publishing.validate_message_type = True
    return cmd


class Telemetry:
    """A client's Telemetry stream: write commands, read what the broker pushes."""

    def __init__(self, stub: g.MessagingServiceStub, client_id: str = "test-client@1") -> None:
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.call = stub.Telemetry(self._requests(), metadata=(("x-mq-client-id", client_id),))

    async def _requests(self):
        while True:
            cmd = await self.outbox.get()
            if cmd is None:
                return
            yield cmd

    async def send(self, cmd: s.TelemetryCommand) -> None:
        await self.outbox.put(cmd)

    async def read(self, timeout: float = 10.0) -> s.TelemetryCommand:
        return await asyncio.wait_for(self.call.read(), timeout)

    async def close(self) -> None:
        await self.outbox.put(None)
        self.call.cancel()


def with_frontend(tmp_path, body, topics=(), **overrides):
    """Run ``body(broker, stub, channel)`` against an in-process broker with its gRPC port; ``topics`` are created
    first, as an operator would (RocketMQ 5's clients get TOPIC_NOT_FOUND for a topic the broker does not know)."""
    async def go():
        async with running_broker(tmp_path / "data", rocketmq_port=0, **overrides) as b:
            for t in topics:
                b.core.create_topic(t, None, None)
            async with grpc.aio.insecure_channel(b.rocketmq_address) as ch:
                await body(b, g.MessagingServiceStub(ch), ch)

    arun(go())


async def native_read(b, topic: str, n: int, timeout: float = 5.0, at_least: int = 0) -> list:
    """Up to n messages of topic, read for at most timeout seconds; past that, only until at_least have come (an upper
    bound of 30 s more for a loaded machine: what is there is read, however slow, and only the absent ones cost time)."""
    got = []
    async with Consumer("native-readers", topic, address=b.address, wait_ms=200) as c:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(got) < n and (loop.time() < deadline or (len(got) < at_least and loop.time() < deadline + 30)):
            got += await c.poll(0.2)
    return got


async def wait_for(pred, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


# ---- routes and settings ---------------------------------------------------------------
def test_route_names_this_endpoint_with_queues_accepting_normal_and_transaction(tmp_path):
    async def body(b, stub, ch):
        r = await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="orders")), metadata=MD)
        assert r.status.code == OK
        assert [q.id for q in r.message_queues] == [0, 1, 2, 3]
        q = r.message_queues[0]
        assert q.topic.name == "orders" and q.permission == d.READ_WRITE and q.broker.id == 0
        assert list(q.accept_message_types) == [d.NORMAL, d.TRANSACTION]
        assert [(a.host, a.port) for a in q.broker.endpoints.addresses] == [("127.0.0.1", b.rocketmq_port)]
        # The endpoints the client reached the broker by come back as they were.
        asked = d.Endpoints(scheme=d.DOMAIN_NAME, addresses=[d.Address(host="mq.example", port=8081)])
        r = await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="orders"), endpoints=asked), metadata=MD)
        assert r.message_queues[0].broker.endpoints == asked
        a = await stub.QueryAssignment(s.QueryAssignmentRequest(topic=d.Resource(name="orders"), group=d.Resource(name="g1")), metadata=MD)
        assert a.status.code == OK and [x.message_queue.id for x in a.assignments] == [-1]
        for bad in ("bad topic!", "RMQ_SYS_TRANS_HALF_TOPIC", ""):
            r = await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name=bad)), metadata=MD)
            assert r.status.code == d.ILLEGAL_TOPIC, bad
        h = await stub.Heartbeat(s.HeartbeatRequest(client_type=d.PRODUCER), metadata=MD)
        assert h.status.code == OK

    with_frontend(tmp_path, body, topics=("orders",))


def test_settings_handshake_answers_as_rocketmq_does_and_registers_the_producer_under_its_topics(tmp_path):
    async def body(b, stub, ch):
        t = Telemetry(stub)
        await t.send(producer_settings("orders", "audit"))
        reply = await t.read()
        assert reply.status.code == OK and reply.WhichOneof("command") == "settings"
        st = reply.settings
        assert st.publishing.max_body_size == b.core.config.max_body > 0
        assert st.backoff_policy.max_attempts > 0 and st.backoff_policy.WhichOneof("strategy") == "exponential_backoff"
        assert st.backoff_policy.exponential_backoff.multiplier > 1
        assert [x.name for x in st.publishing.topics] == ["orders", "audit"]
        assert not st.metric.on
        await wait_for(lambda: b.core.registry.online("orders") == 1 and b.core.registry.online("audit") == 1)
        # A consumer's settings: batch size and long polling set.
        c = Telemetry(stub, "consumer@1")
        cmd = s.TelemetryCommand()
        cmd.settings.client_type = d.SIMPLE_CONSUMER
        cmd.settings.user_agent.language = d.NODE_JS
        cmd.settings.subscription.group.name = "g1"
        cmd.settings.subscription.subscriptions.add(topic=d.Resource(name="orders"))
        await c.send(cmd)
        reply = await c.read()
        sub = reply.settings.subscription
        assert reply.status.code == OK and sub.receive_batch_size > 0 and sub.long_polling_timeout.seconds > 0 and not sub.fifo
        assert reply.settings.backoff_policy.WhichOneof("strategy") == "exponential_backoff"
        await wait_for(lambda: b.core.consumer_registry.online("g1") == 1)
        # Closing the streams takes them out of the registries: no producer online any more.
        await t.close()
        await c.close()
        await wait_for(lambda: b.core.registry.online("orders") == 0 and b.core.consumer_registry.online("g1") == 0)

    with_frontend(tmp_path, body)


# ---- sending -------------------------------------------------------------------------------
def test_a_normal_send_is_read_by_the_native_consumer_with_its_id_tag_keys_and_properties(tmp_path):
    async def body(b, stub, ch):
        m = message("orders", b"hello", "01AAAA0000000000000000000000000001", tag="created", keys=["k1", "k2"], props={"shop": "7"})
        r = await stub.SendMessage(s.SendMessageRequest(messages=[m]), metadata=MD)
        assert r.status.code == OK and len(r.entries) == 1
        e = r.entries[0]
        assert e.status.code == OK and e.message_id == "01AAAA0000000000000000000000000001"
        assert e.transaction_id == e.message_id  # as RocketMQ's broker answers every send
        (got,) = await native_read(b, "orders", 1)
        assert got.body == b"hello" and got.msg_id == e.message_id and got.queue_offset == e.offset
        assert got.tags == "created" and got.keys == "k1 k2" and got.properties["shop"] == "7"
        assert got.born_ts == 1_700_000_000_000
        # and the front end's counters are on the Prometheus endpoint
        from txmq.broker.prom import BrokerCollector

        samples = {smp.name: smp.value for fam in BrokerCollector(b.core).collect() for smp in fam.samples}
        assert samples["txmq_rmq_messages_sent_total"] == 1 and samples["txmq_rmq_requests_total"] >= 1
        assert samples["txmq_rmq_malformed_requests_total"] == 0

    with_frontend(tmp_path, body, topics=("orders",))


def test_a_batch_goes_to_one_queue_and_mixed_topics_or_transactions_in_it_are_refused(tmp_path):
    async def body(b, stub, ch):
        msgs = [message("orders", b"m%d" % i, f"ID{i}") for i in range(3)]
        r = await stub.SendMessage(s.SendMessageRequest(messages=msgs), metadata=MD)
        assert r.status.code == OK and [e.message_id for e in r.entries] == ["ID0", "ID1", "ID2"]
        assert [e.transaction_id for e in r.entries] == ["ID0", "ID1", "ID2"]
        assert sorted(m.body for m in await native_read(b, "orders", 3)) == [b"m0", b"m1", b"m2"]
        mixed = [message("orders", b"a", "X1"), message("audit", b"b", "X2")]
        r = await stub.SendMessage(s.SendMessageRequest(messages=mixed), metadata=MD)
        assert r.status.code == d.BAD_REQUEST and [e.status.code for e in r.entries] == [d.BAD_REQUEST] * 2
        tx = [message("orders", b"a", "Y1", d.TRANSACTION), message("orders", b"b", "Y2", d.TRANSACTION)]
        r = await stub.SendMessage(s.SendMessageRequest(messages=tx), metadata=MD)
        assert r.status.code == d.BAD_REQUEST

    with_frontend(tmp_path, body, topics=("orders",))


def test_a_batch_of_gzip_bodies_is_held_to_the_frame_limit_once_inflated(tmp_path):
    async def body(b, stub, ch):
        bomb = zlib.compress(b"\0" * (1 << 20), 9)  # ~1 KB on the wire, 1 MiB inflated

        def gz(i: int) -> d.Message:
            m = message("bombs", bomb, f"G{i}")
            m.system_properties.body_encoding = d.GZIP
            return m

        r = await stub.SendMessage(s.SendMessageRequest(messages=[gz(i) for i in range(200)]), metadata=MD)
        assert r.status.code == d.MESSAGE_BODY_TOO_LARGE and "--max-frame" in r.status.message, r.status
        assert b.core.store.max_offset == 0  # nothing was written
        r = await stub.SendMessage(s.SendMessageRequest(messages=[gz(i) for i in range(4)]), metadata=MD)
        assert r.status.code == OK  # 4 MiB inflated: under the 8 MiB frame

    with_frontend(tmp_path, body, topics=("bombs",))


def test_an_unknown_client_type_and_an_invalid_born_time_get_a_status_not_an_internal_error(tmp_path):
    async def body(b, stub, ch):
        t = Telemetry(stub)
        cmd = producer_settings("orders")
        cmd.settings.client_type = 99
        await t.send(cmd)
        assert (await t.read()).status.code == d.UNRECOGNIZED_CLIENT_TYPE
        await t.close()
        m = message("orders", b"x", "B1")
        m.system_properties.born_timestamp.seconds = 1 << 62
        r = await stub.SendMessage(s.SendMessageRequest(messages=[m]), metadata=MD)
        assert r.status.code == d.BAD_REQUEST and "born_timestamp" in r.status.message, r.status
        assert b.core.metrics.counters.get("rmq_internal_errors", 0) == 0

    with_frontend(tmp_path, body, topics=("orders",))


def test_limits_and_reserved_properties_get_rocketmqs_codes(tmp_path):
    async def body(b, stub, ch):
        async def code(m: d.Message) -> int:
            return (await stub.SendMessage(s.SendMessageRequest(messages=[m]), metadata=MD)).status.code

        assert await code(message("orders", b"x" * 2049, "A1")) == d.MESSAGE_BODY_TOO_LARGE
        assert await code(message("orders", b"", "A2")) == d.MESSAGE_BODY_EMPTY
        assert await code(message("orders", b"x", "A3", props={"UNIQ_KEY": "mine"})) == d.ILLEGAL_MESSAGE_PROPERTY_KEY
        assert await code(message("orders", b"x", "A4", props={"TXMQ_DECIDED_BY": "me"})) == d.ILLEGAL_MESSAGE_PROPERTY_KEY
        assert await code(message("orders", b"x", "A5", props={"p": "v" * 2000})) == d.MESSAGE_PROPERTIES_TOO_LARGE
        assert await code(message("orders", b"x", "A6", tag="a|b")) == d.ILLEGAL_MESSAGE_TAG
        assert await code(message("orders", b"x", "A7", keys=["two words"])) == d.ILLEGAL_MESSAGE_KEY
        assert await code(message("RMQ_SYS_TRANS_OP_HALF_TOPIC", b"x", "A8")) == d.ILLEGAL_TOPIC
        assert await code(message("orders", b"x" * 2048, "A9")) == OK

    with_frontend(tmp_path, body, topics=("orders",), max_body=2048, max_properties=1024)


def test_unsupported_features_and_rpcs_answer_the_unsupported_code(tmp_path):
    async def body(b, stub, ch):
        # (delay and FIFO messages: tests/test_rocketmq_topics.py, by the topic's message types)
        for m in (message("orders", b"x", "L1", d.LITE), message("orders", b"x", "P1", d.PRIORITY)):
            r = await stub.SendMessage(s.SendMessageRequest(messages=[m]), metadata=MD)
            assert r.status.code == d.UNSUPPORTED and "not supported" in r.status.message
        r = await stub.RecallMessage(s.RecallMessageRequest(topic=d.Resource(name="orders"), recall_handle="h"), metadata=MD)
        assert r.status.code == d.BAD_REQUEST and "recall_handle" in r.status.message  # served: tests/test_rocketmq_topics.py
        for call in (stub.UpdateOffset(s.UpdateOffsetRequest(), metadata=MD), stub.GetOffset(s.GetOffsetRequest(), metadata=MD),
                     stub.QueryOffset(s.QueryOffsetRequest(), metadata=MD), stub.SyncLiteSubscription(s.SyncLiteSubscriptionRequest(), metadata=MD)):
            assert (await call).status.code == d.UNSUPPORTED
        got = [x async for x in stub.PullMessage(s.PullMessageRequest(), metadata=MD)]
        assert [x.status.code for x in got] == [d.UNSUPPORTED]
        assert (await native_read(b, "orders", 1, timeout=0.5)) == []

    with_frontend(tmp_path, body, topics=("orders",))


def test_malformed_input_gets_an_error_status_and_the_broker_keeps_serving(tmp_path):
    async def body(b, stub, ch):
        for method in ("SendMessage", "EndTransaction", "QueryRoute", "AckMessage"):
            raw = ch.unary_unary(f"/apache.rocketmq.v2.MessagingService/{method}")
            reply = await raw(b"\xff\xff\xff\xff", metadata=MD)
            assert reply  # a response message with a status, not a transport error
            assert getattr(s, f"{method}Response").FromString(reply).status.code == d.BAD_REQUEST
        # Bytes that are no TelemetryCommand: an error status on the stream, which stays usable.
        raw_stream = ch.stream_stream("/apache.rocketmq.v2.MessagingService/Telemetry")
        call = raw_stream(metadata=MD)
        await call.write(b"\xff\xff\xff")
        first = s.TelemetryCommand.FromString(await asyncio.wait_for(call.read(), 5))
        assert first.status.code == d.BAD_REQUEST
        await call.write(producer_settings("orders").SerializeToString())
        second = s.TelemetryCommand.FromString(await asyncio.wait_for(call.read(), 5))
        assert second.status.code == OK and second.settings.publishing.max_body_size > 0
        await call.done_writing()
        # Larger than the largest message the broker accepts: refused by gRPC itself.
        huge = message("orders", b"x" * (b.core.config.max_body + b.core.config.max_properties + 8192), "H1")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.SendMessage(s.SendMessageRequest(messages=[huge]), metadata=MD)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Bytes that are not HTTP/2 at all, on a connection of their own.
        reader, writer = await asyncio.open_connection("127.0.0.1", b.rocketmq_port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)) * 64)
        await writer.drain()
        await asyncio.wait_for(reader.read(), 10)  # the broker ends that connection
        writer.close()
        # Telemetry without a client id.
        t = stub.Telemetry(iter([producer_settings("orders")]))
        refused = await asyncio.wait_for(t.read(), 5)
        assert refused.status.code == d.CLIENT_ID_REQUIRED
        r = await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="orders")), metadata=MD)
        assert r.status.code == OK
        r = await stub.SendMessage(s.SendMessageRequest(messages=[message("orders", b"still", "S1")]), metadata=MD)
        assert r.status.code == OK

    with_frontend(tmp_path, body, topics=("orders",), max_body=4096, max_properties=1024)


# ---- transactions ----------------------------------------------------------------------------
async def send_half(stub, topic: str, body: bytes, message_id: str) -> s.SendResultEntry:
    r = await stub.SendMessage(s.SendMessageRequest(messages=[message(topic, body, message_id, d.TRANSACTION)]), metadata=MD)
    assert r.status.code == OK, r.status
    (e,) = r.entries
    assert e.message_id == message_id and e.transaction_id == message_id  # RocketMQ's transaction id is the message id
    return e


async def end(stub, topic: str, e: s.SendResultEntry, resolution: int, source: int = d.SOURCE_CLIENT, message_id: str | None = None):
    req = s.EndTransactionRequest(topic=d.Resource(name=topic), message_id=e.message_id if message_id is None else message_id,
                                  transaction_id=e.transaction_id, resolution=resolution, source=source)
    return await stub.EndTransaction(req, metadata=MD)


def test_a_transactional_send_is_pending_under_its_topic_as_group_then_committed_or_rolled_back(tmp_path):
    async def body(b, stub, ch):
        core = b.core
        e1 = await send_half(stub, "orders", b"one", "TX000001")
        e2 = await send_half(stub, "orders", b"two", "TX000002")
        rows, total, _ = core.admin.pending_rows(None, None, 0, 100, core.check.next_check_at, -1)  # txmq inspect half
        assert total == 2 and {r["tx_id"] for r in rows} == {"TX000001", "TX000002"}
        assert {r["group"] for r in rows} == {"orders"}  # the topic is the producer group
        assert await native_read(b, "orders", 1, timeout=0.5) == []  # consumers do not see half messages
        r = await end(stub, "orders", e1, d.COMMIT)
        assert r.status.code == OK
        r = await end(stub, "orders", e2, d.ROLLBACK)
        assert r.status.code == OK
        got = await native_read(b, "orders", 2, timeout=1.0, at_least=1)
        assert [m.body for m in got] == [b"one"] and got[0].msg_id == "TX000001"
        assert core.tx.index.lookup("TX000001").decided_by == "producer"
        # One outcome per transaction: a repeat is OK, the opposite is refused with the reason.
        assert (await end(stub, "orders", e1, d.COMMIT)).status.code == OK
        r = await end(stub, "orders", e2, d.COMMIT)
        assert r.status.code == d.INVALID_TRANSACTION_ID and "rolled back" in r.status.message
        # Another topic, another message id, an unknown transaction: refused.
        assert (await end(stub, "audit", e1, d.COMMIT)).status.code == d.INVALID_TRANSACTION_ID
        assert (await end(stub, "orders", e1, d.COMMIT, message_id="OTHER")).status.code == d.INVALID_TRANSACTION_ID
        bogus = s.SendResultEntry(message_id="NOPE", transaction_id="NOPE")
        assert (await end(stub, "orders", bogus, d.COMMIT)).status.code == d.INVALID_TRANSACTION_ID

    with_frontend(tmp_path, body, topics=("orders",))


def test_a_half_message_sent_again_with_its_id_gets_the_first_receipt_until_it_is_decided(tmp_path):
    async def body(b, stub, ch):
        first = await send_half(stub, "orders", b"once", "TX0000RS")
        again = await send_half(stub, "orders", b"once", "TX0000RS")  # the SDK's retry after a lost answer
        assert again.transaction_id == first.transaction_id and again.offset == first.offset
        assert len(b.core.tx.index.pending) == 1
        assert (await end(stub, "orders", again, d.COMMIT)).status.code == OK
        r = await stub.SendMessage(s.SendMessageRequest(messages=[message("orders", b"once", "TX0000RS", d.TRANSACTION)]), metadata=MD)
        assert r.status.code == d.BAD_REQUEST and "already in use" in r.status.message
        assert [m.body for m in await native_read(b, "orders", 2, timeout=1.0, at_least=1)] == [b"once"]

    with_frontend(tmp_path, body, topics=("orders",))


def test_an_operator_resolves_an_sdk_transaction_and_the_sdk_end_then_agrees_or_is_refused(tmp_path):
    async def body(b, stub, ch):
        core = b.core
        e = await send_half(stub, "orders", b"op", "TX0000OP")
        res = await core.admin.resolve("rollback", [{"tx_id": "TX0000OP"}], False)  # txmq resolve --rollback
        assert res[0]["status"] == "ok"
        r = await end(stub, "orders", e, d.COMMIT)
        assert r.status.code == d.INVALID_TRANSACTION_ID
        assert (await end(stub, "orders", e, d.ROLLBACK)).status.code == OK
        # The receipt's transaction id is what the operator's commands take.
        e2 = await send_half(stub, "orders", b"by id", "TX0000ID")
        res = await core.admin.resolve("commit", [{"tx_id": e2.transaction_id}], False)  # txmq resolve --commit TX0000ID
        assert [(x["tx_id"], x["status"]) for x in res] == [("TX0000ID", "ok")]
        assert (await end(stub, "orders", e2, d.COMMIT)).status.code == OK
        assert [m.body for m in await native_read(b, "orders", 1)] == [b"by id"]

    with_frontend(tmp_path, body, topics=("orders",))


def legacy_id(core, tx_id: str) -> str:
    """The transaction id txmq gave SDK producers before RocketMQ's form: the id and the latest half copy's offsets."""
    p = core.tx.index.pending[tx_id]
    return f"{tx_id}:{p.cl_offset}:{p.half_offset}"


def test_end_transaction_takes_the_message_id_as_transaction_id_and_the_older_form_with_offsets(tmp_path):
    async def body(b, stub, ch):
        core = b.core
        # RocketMQ's form: the receipt's transaction id, the message id
        e = await send_half(stub, "orders", b"new form", "TX0000NEW")
        assert (await end(stub, "orders", e, d.COMMIT)).status.code == OK
        assert core.tx.index.lookup("TX0000NEW").outcome.label == "committed"
        # the form txmq gave before, <tx_id>:<commit-log offset>:<half offset>, from an SDK that still holds one
        e = await send_half(stub, "orders", b"old form", "TX0000OLD")
        old = s.SendResultEntry(message_id="TX0000OLD", transaction_id=legacy_id(core, "TX0000OLD"))
        assert (await end(stub, "orders", old, d.ROLLBACK)).status.code == OK
        assert core.tx.index.lookup("TX0000OLD").outcome.label == "rolled_back"
        # either form names the one transaction afterwards: the same outcome again is OK, the other one refused
        for form in (old, e):
            assert (await end(stub, "orders", form, d.ROLLBACK)).status.code == OK
            r = await end(stub, "orders", form, d.COMMIT)
            assert r.status.code == d.INVALID_TRANSACTION_ID and "rolled back" in r.status.message
        # the older form with another message id, or offsets of no half copy of it, is refused
        assert (await end(stub, "orders", old, d.ROLLBACK, message_id="OTHER")).status.code == d.INVALID_TRANSACTION_ID
        e = await send_half(stub, "orders", b"bad offsets", "TX0000BAD")
        wrong = s.SendResultEntry(message_id="TX0000BAD", transaction_id="TX0000BAD:0:0")
        assert (await end(stub, "orders", wrong, d.COMMIT)).status.code == d.INVALID_TRANSACTION_ID
        assert "TX0000BAD" in core.tx.index.pending
        # an id that itself looks like the older form names its own transaction, never another one
        e = await send_half(stub, "orders", b"colons", "order:7:1")
        assert (await end(stub, "orders", e, d.COMMIT)).status.code == OK
        assert core.tx.index.lookup("order:7:1").outcome.label == "committed"
        e = await send_half(stub, "orders", b"colons, older form", "order:7:2")
        old = s.SendResultEntry(message_id="order:7:2", transaction_id=legacy_id(core, "order:7:2"))
        assert (await end(stub, "orders", old, d.COMMIT)).status.code == OK
        assert sorted(m.body for m in await native_read(b, "orders", 3)) == [b"colons", b"colons, older form", b"new form"]

    with_frontend(tmp_path, body, topics=("orders",))


def test_check_back_goes_over_telemetry_and_a_server_check_answer_decides_it(tmp_path):
    async def body(b, stub, ch):
        core = b.core
        t = Telemetry(stub)
        await t.send(producer_settings("orders"))
        assert (await t.read()).status.code == OK
        await wait_for(lambda: core.registry.online("orders") == 1)
        e = await send_half(stub, "orders", b"check me", "TX0000CK")
        # UNKNOWN (resolution 0) from the client: stays pending, the checks go on.
        cmd = await t.read()
        rec = cmd.recover_orphaned_transaction_command
        assert rec.transaction_id == e.transaction_id == "TX0000CK"  # as RocketMQ's broker: the message id, not a copy's offsets
        m = rec.message
        assert m.topic.name == "orders" and m.body == b"check me" and m.system_properties.message_id == "TX0000CK"
        assert m.user_properties["__transactionId__"] == "TX0000CK"
        assert m.system_properties.message_type == d.TRANSACTION and m.system_properties.body_encoding == d.IDENTITY
        assert m.system_properties.body_digest == body_digest(b"check me", d.PYTHON)
        assert m.system_properties.body_digest.checksum == f"{zlib.crc32(b'check me'):08X}"
        unknown = s.SendResultEntry(message_id="TX0000CK", transaction_id=rec.transaction_id)
        r = await end(stub, "orders", unknown, d.TRANSACTION_RESOLUTION_UNSPECIFIED, d.SOURCE_SERVER_CHECK)
        assert r.status.code == OK and "pending" in r.status.message
        assert "TX0000CK" in core.tx.index.pending
        cmd = await t.read()  # checked again
        again = cmd.recover_orphaned_transaction_command
        assert again.message.system_properties.message_id == "TX0000CK"
        answer = s.SendResultEntry(message_id="TX0000CK", transaction_id=again.transaction_id)
        r = await end(stub, "orders", answer, d.COMMIT, d.SOURCE_SERVER_CHECK)
        assert r.status.code == OK
        assert core.tx.index.lookup("TX0000CK").decided_by == "check"
        assert [m.body for m in await native_read(b, "orders", 1)] == [b"check me"]
        # The first end of the producer, arriving late: the same outcome, OK; the opposite, refused.
        assert (await end(stub, "orders", e, d.COMMIT)).status.code == OK
        assert (await end(stub, "orders", e, d.ROLLBACK)).status.code == d.INVALID_TRANSACTION_ID
        await t.close()

    with_frontend(tmp_path, body, topics=("orders",), check_interval_s=0.05, transaction_timeout_s=0)


def test_a_producer_that_sends_a_half_to_a_topic_not_in_its_settings_gets_its_check_backs(tmp_path):
    async def body(b, stub, ch):
        t = Telemetry(stub)  # the same client id as the sends (MD)
        await t.send(producer_settings("orders"))
        await t.read()
        await send_half(stub, "audit", b"elsewhere", "TX0000EW")
        assert b.core.registry.online("audit") == 1
        cmd = await t.read()
        assert cmd.recover_orphaned_transaction_command.message.topic.name == "audit"
        await t.close()

    with_frontend(tmp_path, body, topics=("orders", "audit"), check_interval_s=0.05, transaction_timeout_s=0)


def test_without_an_open_stream_no_check_is_spent_and_max_checks_discards_for_replay(tmp_path):
    async def body(b, stub, ch):
        core = b.core
        await send_half(stub, "orders", b"orphan", "TX0000NP")
        await asyncio.sleep(0.3)
        p = core.tx.index.pending["TX0000NP"]
        assert p.checks == 0 and p.last_check_result == "no producer online"
        # A producer stream that never answers: checked until max checks, then discarded.
        t = Telemetry(stub)
        await t.send(producer_settings("orders"))
        await t.read()
        await wait_for(lambda: "TX0000NP" not in core.tx.index.pending, 10)
        d_ = core.tx.index.lookup("TX0000NP")
        assert d_.outcome.label == "discarded" and d_.decided_by == "max-checks"
        res = await core.admin.replay("half", [{"tx_id": "TX0000NP"}], False, False)  # txmq discard replay
        assert res[0]["status"] == "ok" and "TX0000NP" in core.tx.index.pending
        await t.close()

    with_frontend(tmp_path, body, topics=("orders",), check_interval_s=0.05, transaction_timeout_s=0, max_checks=2)


def test_settings_sent_just_before_the_client_half_closes_are_still_answered(tmp_path):
    async def body(b, stub, ch):
        call = stub.Telemetry(iter([producer_settings("orders")]), metadata=MD)  # writes, then ends its side at once
        replies = [r async for r in call]
        assert [r.WhichOneof("command") for r in replies] == ["settings"] and replies[0].status.code == OK
        assert await call.code() == grpc.StatusCode.OK
        await wait_for(lambda: b.core.registry.online("orders") == 0)

    with_frontend(tmp_path, body)


def test_a_telemetry_stream_that_does_not_read_is_closed_and_leaves_the_registry(tmp_path, monkeypatch):
    monkeypatch.setattr(rmq_clients, "MAX_QUEUED_BYTES", 4096)

    async def body(b, stub, ch):
        core = b.core
        fe = b.broker.frontends[0]
        client = fe.service.clients.touch("slow@1")
        client.topics = ("orders",)
        stream = rmq_clients.TelemetryStream(core.messaging, client, "test")
        stream.register()
        assert core.registry.online("orders") == 1
        big = s.TelemetryCommand(status=d.Status(code=OK, message="x" * 1500))
        assert stream.offer(big) and stream.offer(big)
        assert not stream.writable()  # past half the budget: no check-backs offered to it
        assert not stream.offer(big)  # past the budget: closed
        assert stream.closed.is_set() and core.registry.online("orders") == 0
        assert core.metrics.counters["rmq_telemetry_overflows"] == 1

    with_frontend(tmp_path, body)


def test_auth_token_requires_rocketmqs_signature_made_with_it(tmp_path):
    import hmac
    from hashlib import sha1

    async def body(b, stub, ch):
        r = await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="orders")), metadata=MD)
        assert r.status.code == d.UNAUTHORIZED
        when = "20261123T101010Z"
        sig = hmac.new(b"s3cret", when.encode(), sha1).hexdigest()
        md = MD + (("x-mq-date-time", when),
                   ("authorization", f"MQv2-HMAC-SHA1 Credential=any, SignedHeaders=x-mq-date-time, Signature={sig}"))
        r = await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="orders")), metadata=md)
        assert r.status.code == OK
        bad = MD + (("x-mq-date-time", when), ("authorization", "MQv2-HMAC-SHA1 Credential=any, SignedHeaders=x-mq-date-time, Signature=00"))
        assert (await stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="orders")), metadata=bad)).status.code == d.UNAUTHORIZED

    with_frontend(tmp_path, body, topics=("orders",), auth_token="s3cret")


# ---- start-up --------------------------------------------------------------------------------
def _start(tmp_path, *args: str, prelude: str = "") -> subprocess.CompletedProcess:
    code = (f"{prelude}\nimport sys\nfrom txmq.cli.main import main\n"
            f"sys.argv = ['txmq', 'broker', 'start', '--data-dir', {str(tmp_path / 'data')!r}, '--port', '{free_port()}', *{list(args)!r}]\n"
            "main()\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_start_with_rocketmq_port_without_the_extra_exits_9(tmp_path):
    r = _start(tmp_path, "--rocketmq-port", str(free_port()), prelude="import sys; sys.modules['grpc'] = None  # as if grpcio were not installed")
    assert r.returncode == 9, r.stderr
    assert "--rocketmq-port" in r.stderr and "[rocketmq]" in r.stderr


def test_tls_options_go_together_and_a_taken_port_ends_the_start(tmp_path):
    r = _start(tmp_path, "--rocketmq-port", str(free_port()), "--rocketmq-tls-cert", str(tmp_path / "c.pem"))
    assert r.returncode == 2 and "go together" in r.stderr
    r = _start(tmp_path, "--rocketmq-port", str(free_port()), "--rocketmq-tls-cert", str(tmp_path / "c.pem"),
               "--rocketmq-tls-key", str(tmp_path / "k.pem"))
    assert r.returncode == 1 and "cannot read --rocketmq-tls-key" in r.stderr
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        r = _start(tmp_path, "--rocketmq-port", str(taken.getsockname()[1]))
    assert r.returncode == 1 and "--rocketmq-port" in r.stderr


def test_tls_serves_with_the_given_certificate(tmp_path):
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)

    async def go():
        async with running_broker(tmp_path / "data", rocketmq_port=0, rocketmq_tls_cert=cert, rocketmq_tls_key=key) as b:
            b.core.create_topic("orders", None, None)
            creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
            async with grpc.aio.secure_channel(b.rocketmq_address, creds) as ch:
                r = await g.MessagingServiceStub(ch).QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="orders")), metadata=MD)
                assert r.status.code == OK
            async with grpc.aio.insecure_channel(b.rocketmq_address) as ch:  # plain text is not served on a TLS port
                with pytest.raises(grpc.aio.AioRpcError):
                    await g.MessagingServiceStub(ch).QueryRoute(s.QueryRouteRequest(topic=d.Resource(name="orders")), metadata=MD, timeout=3)

    arun(go())


@pytest.mark.parametrize("language, form", [(d.PYTHON, "{:08X}"), (d.NODE_JS, "{}"), (d.GOLANG, "{:x}"), (d.JAVA, "{:X}"),
                                            (d.LANGUAGE_UNSPECIFIED, "{:X}")])
def test_body_digest_is_written_as_each_sdk_compares_it(language, form):
    body = b"\x00" * 13  # its CRC32 has a leading zero digit: where the forms differ
    crc = zlib.crc32(body)
    assert crc < 0x10000000
    dg = body_digest(body, language)
    assert dg.type == d.CRC32 and dg.checksum == form.format(crc)


def test_a_clients_language_comes_from_its_settings_else_from_its_language_header(tmp_path):
    async def body(b, stub, ch):
        clients = b.broker.frontends[0].settings.clients
        for cid, header in (("py@1", "PYTHON"), ("node@1", "HTTP"), ("go@1", "GOLANG"), ("other@1", "COBOL")):
            r = await stub.Heartbeat(s.HeartbeatRequest(client_type=d.SIMPLE_CONSUMER), metadata=(("x-mq-client-id", cid), ("x-mq-language", header)))
            assert r.status.code == OK
        assert [clients.language(c) for c in ("py@1", "node@1", "go@1", "other@1", "never@1")] == [
            d.PYTHON, d.NODE_JS, d.GOLANG, d.LANGUAGE_UNSPECIFIED, d.LANGUAGE_UNSPECIFIED]
        t = Telemetry(stub, "py@1")
        await t.send(producer_settings("orders", language=d.JAVA))  # the settings win over the header
        await t.read()
        assert clients.language("py@1") == d.JAVA
        await t.close()

    with_frontend(tmp_path, body)


def test_keys_and_message_ids_with_any_white_space_or_nul_are_refused(tmp_path):
    async def body(b, stub, ch):
        async def code(m: d.Message) -> int:
            return (await stub.SendMessage(s.SendMessageRequest(messages=[m]), metadata=MD)).status.code

        for keys in (["em\u2003space"], ["\t"], [""], ["nul\0"], ["ok", "no\u00a0break"]):
            assert await code(message("orders", b"x", f"K{len(keys[-1])}", keys=keys)) == d.ILLEGAL_MESSAGE_KEY, keys
        for mid in ("id\u3000x", "id\nx", "id\0x", "x" * 129):
            assert await code(message("orders", b"x", mid)) == d.ILLEGAL_MESSAGE_ID, mid
        assert await code(message("orders", b"x", "0A1B-c_d:e.f", keys=["order-1", "user_2"])) == OK
        assert (await native_read(b, "orders", 1))[0].keys == "order-1 user_2"

    with_frontend(tmp_path, body, topics=("orders",))


def test_a_requests_headers_are_parsed_once_per_rpc_and_never_seen_by_another():
    from txmq.broker.rocketmq.service import client_id_of, metadata

    class Context:
        def __init__(self, client_id: str) -> None:
            self.reads = 0
            self.headers = (("x-mq-client-id", client_id), ("x-mq-language", "PYTHON"), ("bin-bin", b"\x00"))

        def invocation_metadata(self):
            self.reads += 1
            return self.headers

    async def rpc(ctx: Context, other: Context) -> tuple[str, str, dict]:
        first = metadata(ctx)
        cid = client_id_of(ctx)
        assert metadata(ctx) is first and ctx.reads == 1  # the server's check and the service share one parse
        other_cid = client_id_of(other)  # another context in the same task is parsed for itself
        return cid, other_cid, first

    async def main():
        a, b, c, e = Context("client-a"), Context("client-b"), Context("client-c"), Context("client-e")
        (ca, cb, md), (cc, ce, _) = await asyncio.gather(rpc(a, b), rpc(c, e))  # two RPCs at once, one task each
        assert (ca, cb, cc, ce) == ("client-a", "client-b", "client-c", "client-e")
        assert md == {"x-mq-client-id": "client-a", "x-mq-language": "PYTHON"}  # binary headers left out
        assert client_id_of(a) == "client-a" and a.reads == 2  # a new RPC (here: another task) reads its own

    arun(main())
