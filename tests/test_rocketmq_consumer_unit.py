"""The RocketMQ 5 front end's receive side against a fake consumption service: no store, no broker, no gRPC server.

ReceiveMessage, AckMessage, ChangeInvisibleDuration and
ForwardMessageToDeadLetterQueue (broker/rocketmq/consumer.py) read
RocketMQ's protobuf requests into calls of the consumption service
(broker/messaging/consumption.py) and word its answers (deliveries, new
receipt handles, refusals) as RocketMQ 5's proxy does. The fake records
every call and answers what each test sets; a long poll waits on an event
the test sets, never on the clock.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import time
import zlib

import pytest

pytest.importorskip("grpc")

from txmq.broker.messaging import consumption  # noqa: E402
from txmq.broker.messaging.consumption import ConsumptionService, Delivery, PopConfig, PopError  # noqa: E402
from txmq.broker.rocketmq import consumer  # noqa: E402
from txmq.broker.rocketmq.clients import Client, ClientTable  # noqa: E402
from txmq.broker.rocketmq.limits import Holds  # noqa: E402
from txmq.broker.rocketmq.pb import definition_pb2 as d  # noqa: E402
from txmq.broker.rocketmq.pb import service_pb2 as s  # noqa: E402
from txmq.broker.rocketmq.service import MessagingService  # noqa: E402
from txmq.broker.rocketmq.status import Code, RmqError  # noqa: E402
from txmq.constants import PROP_KEYS, PROP_SHARDING_KEY, PROP_TAGS, PROP_TRAN_MSG, PROP_UNIQ_KEY  # noqa: E402
from txmq.store import Record, TxType  # noqa: E402

G, T = "sdk-consumers", "orders"
PEER = "ipv4:10.0.0.7:50412"


class FakePop:
    """The consumption service calls the receive side makes, recorded; the answers set by each test."""

    check_invisible = ConsumptionService.check_invisible  # the real range check: it reads only ``config``

    def __init__(self) -> None:
        self.config = PopConfig()
        self.calls: list[tuple] = []
        self.deliveries: list[Delivery] = []
        self.receive_error: BaseException | None = None
        self.entered = asyncio.Event()  # a receive is in the service
        self.gate: asyncio.Event | None = None  # set: the receive waits for it (the long poll)
        self.ack_errors: dict[str, PopError] = {}
        self.change_error: PopError | None = None
        self.dlq_error: PopError | None = None
        self.fifo_groups: set[str] = set()
        self.attached: list[dict] = []
        self.closed = False

    def attach(self, *, max_attempts=None, client_alive=None) -> None:
        self.attached.append({"max_attempts": max_attempts, "client_alive": client_alive})

    async def receive(self, group, topic, queue_id, tags, batch, invisible_s, poll_s, *, auto_renew=False, client_id=None):
        self.calls.append(("receive", group, topic, queue_id, tags, batch, invisible_s, poll_s, auto_renew, client_id))
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.receive_error is not None:
            raise self.receive_error
        return list(self.deliveries)

    def ack(self, group, topic, handle) -> None:
        self.calls.append(("ack", group, topic, handle))
        if handle in self.ack_errors:
            raise self.ack_errors[handle]

    def change_invisible(self, group, topic, handle, invisible_s) -> str:
        self.calls.append(("change_invisible", group, topic, handle, invisible_s))
        if self.change_error is not None:
            raise self.change_error
        return handle + "+1"

    def release(self, group, topic, deliveries, *, unsent) -> None:
        self.calls.append(("release", group, topic, [dl.receipt_handle for dl in deliveries], unsent))

    def fifo(self, group) -> bool:
        return group in self.fifo_groups

    async def forward_to_dlq(self, group, topic, handle) -> None:
        self.calls.append(("forward_to_dlq", group, topic, handle))
        if self.dlq_error is not None:
            raise self.dlq_error

    async def close(self) -> None:
        self.closed = True

    def named(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]


class Counts:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def inc(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


class Refusals:
    def __init__(self) -> None:
        self.notes: list[tuple] = []
        self.internals: list[tuple] = []

    def note(self, frontend, kind, peer, reason) -> None:
        self.notes.append((frontend, kind, peer, reason))

    def internal(self, where, exc) -> None:
        self.internals.append((where, exc))


class FakeMessaging:
    """What the receive side reads of the messaging service: its consumption service, topics, counters, refusals."""

    def __init__(self) -> None:
        self.consumption: FakePop | None = FakePop()
        self.known = {T: 4}
        self.metrics = Counts()
        self.refusals = Refusals()

    def topic_queues(self, topic):
        return self.known.get(topic)


class Ctx:
    """A grpc.aio context as the receive side reads it: the client id header, the peer, the deadline."""

    def __init__(self, client_id: str = "host@1@0@abc", remaining: float | None = None, peer: str = PEER) -> None:
        self.client_id = client_id
        self.remaining = remaining
        self._peer = peer

    def invocation_metadata(self):
        return (("x-mq-client-id", self.client_id),) if self.client_id else ()

    def peer(self) -> str:
        return self._peer

    def time_remaining(self):
        return self.remaining


def run(coro):
    return asyncio.run(coro)


def frontend(fake: FakeMessaging | None = None, **kw) -> consumer.ReceiveFrontend:
    return consumer.ReceiveFrontend(fake or FakeMessaging(), **kw)


def receive_request(group=G, topic=T, queue_id=-1, expression="*", filter_type=d.TAG, batch=16,
                    invisible_s: float | None = 30.0, poll_s: float | None = 0.0, auto_renew=False) -> s.ReceiveMessageRequest:
    req = s.ReceiveMessageRequest(batch_size=batch, auto_renew=auto_renew)
    req.group.name = group
    req.message_queue.topic.name = topic
    req.message_queue.id = queue_id
    req.filter_expression.type = filter_type
    req.filter_expression.expression = expression
    if invisible_s is not None:
        req.invisible_duration.FromNanoseconds(int(invisible_s * 1e9))
    if poll_s is not None:
        req.long_polling_timeout.FromNanoseconds(int(poll_s * 1e9))
    return req


def record(queue_id=1, queue_offset=7, body=b"hello", **props) -> Record:
    return Record(commit_log_offset=4096 + queue_offset, size=100, topic=T, queue_id=queue_id, queue_offset=queue_offset,
                  tx_type=TxType.NORMAL, born_ts=1_700_000_000_000, store_ts=1_700_000_000_500, prepared_offset=-1,
                  properties=dict(props), body=body)


def delivery(handle="H1", attempt=1, invisible_s=30.0, **kw) -> Delivery:
    return Delivery(record(**kw), handle, attempt, invisible_s)


async def frames(fe: consumer.ReceiveFrontend, req: s.ReceiveMessageRequest, ctx: Ctx | None = None) -> list:
    return [r async for r in fe.receive(req, ctx or Ctx())]


def only_status(out: list) -> tuple[int, str]:
    (r,) = out
    assert r.WhichOneof("content") == "status"
    return r.status.code, r.status.message


# ---- ReceiveMessage: the request read into one service call ----------------------------------
def test_a_receive_hands_the_service_its_group_topic_queue_tags_batch_durations_and_client():
    fake = FakeMessaging()
    req = receive_request(queue_id=2, expression="a || b", batch=8, invisible_s=30.5, poll_s=15.0, auto_renew=True)
    out = run(frames(frontend(fake), req, Ctx(client_id="cid-1")))
    assert only_status(out) == (Code.MESSAGE_NOT_FOUND, "no new message")
    (call,) = fake.consumption.named("receive")
    assert call == ("receive", G, T, 2, frozenset({"a", "b"}), 8, 30.5, 15.0, True, "cid-1")


def test_a_receive_that_names_no_durations_or_filter_leaves_the_defaults_to_the_service():
    fake = FakeMessaging()
    req = receive_request(expression="", filter_type=d.FILTER_TYPE_UNSPECIFIED, invisible_s=None, poll_s=None)
    run(frames(frontend(fake), req, Ctx(client_id="")))
    (_, _, _, qid, tags, _, invisible, poll, renew, cid), = fake.consumption.calls
    assert (qid, tags, invisible, poll, renew, cid) == (-1, None, None, consumer.DEFAULT_POLL_S, False, None)


@pytest.mark.parametrize("asked, remaining, polls", [
    (300.0, None, 60.0),  # above the service's max_poll_s: that bound
    (30.0, 10.5, 10.0),  # the client's deadline, less the margin, comes first
    (30.0, 0.2, 0.0),  # a deadline closer than the margin: take what is there, never a negative wait
])
def test_the_long_polling_timeout_is_bounded_by_the_service_and_by_the_clients_deadline(asked, remaining, polls):
    fake = FakeMessaging()
    run(frames(frontend(fake), receive_request(poll_s=asked), Ctx(remaining=remaining)))
    assert fake.consumption.calls[0][7] == pytest.approx(polls)


@pytest.mark.parametrize("req, code, says", [
    (receive_request(poll_s=-1.0), Code.ILLEGAL_POLLING_TIME, "negative"),
    (receive_request(filter_type=d.SQL, expression="a >"), Code.ILLEGAL_FILTER_EXPRESSION, "does not compile"),
    (receive_request(filter_type=d.SQL, expression="a = NULL"), Code.ILLEGAL_FILTER_EXPRESSION, "IS NULL"),
    (receive_request(filter_type=7), Code.ILLEGAL_FILTER_EXPRESSION, "is not TAG"),
    (receive_request(expression="a||"), Code.ILLEGAL_FILTER_EXPRESSION, "joined by '||'"),
    (receive_request(expression="*||a"), Code.ILLEGAL_FILTER_EXPRESSION, "joined by '||'"),
    (receive_request(group="bad group"), Code.ILLEGAL_CONSUMER_GROUP, "consumer group"),
    (receive_request(group=""), Code.ILLEGAL_CONSUMER_GROUP, "consumer group"),
])
def test_a_malformed_receive_is_refused_with_rocketmqs_code_before_the_service_is_called(req, code, says):
    fake = FakeMessaging()
    got_code, message = only_status(run(frames(frontend(fake), req)))
    assert got_code == code and says in message
    assert fake.consumption.calls == []


def test_a_namespace_is_an_illegal_group_or_topic():
    fake = FakeMessaging()
    req = receive_request()
    req.group.resource_namespace = "ns"
    assert only_status(run(frames(frontend(fake), req)))[0] == Code.ILLEGAL_CONSUMER_GROUP
    req = receive_request()
    req.message_queue.topic.resource_namespace = "ns"
    assert only_status(run(frames(frontend(fake), req)))[0] == Code.ILLEGAL_TOPIC
    assert fake.consumption.calls == []


def test_an_unknown_topic_is_topic_not_found_in_the_proxys_words_and_an_illegal_name_is_left_to_the_service():
    fake = FakeMessaging()
    code, message = only_status(run(frames(frontend(fake), receive_request(topic="nowhere"))))
    assert code == Code.TOPIC_NOT_FOUND
    assert message.startswith("CODE: 17  DESC: No topic route info in name server for the topic: nowhere")
    assert fake.consumption.calls == []
    fake.consumption.receive_error = PopError("ILLEGAL_TOPIC", "topic 'a b' must match")
    assert only_status(run(frames(frontend(fake), receive_request(topic="a b"))))[0] == Code.ILLEGAL_TOPIC
    assert fake.consumption.calls[0][2] == "a b"


# ---- ReceiveMessage: the answer ----------------------------------------------------------------
def test_found_messages_stream_as_status_then_one_frame_each_then_the_delivery_timestamp():
    fake = FakeMessaging()
    fake.consumption.deliveries = [
        delivery("H1", attempt=1, queue_offset=7, **{PROP_UNIQ_KEY: "U7", PROP_TAGS: "a", PROP_KEYS: "k1 k2", "color": "red"}),
        delivery("H2", attempt=3, invisible_s=12.5, queue_offset=8, **{PROP_UNIQ_KEY: "U8"}),
    ]
    out = run(frames(frontend(fake), receive_request()))
    assert [r.WhichOneof("content") for r in out] == ["status", "message", "message", "delivery_timestamp"]
    assert (out[0].status.code, out[0].status.message) == (Code.OK, "OK")
    m1, m2 = out[1].message, out[2].message
    sp = m1.system_properties
    assert (m1.topic.name, m1.body, sp.message_id, sp.tag, list(sp.keys)) == (T, b"hello", "U7", "a", ["k1", "k2"])
    assert (sp.receipt_handle, sp.delivery_attempt, sp.invisible_duration.ToMilliseconds()) == ("H1", 1, 30_000)
    assert (sp.queue_id, sp.queue_offset, sp.message_type) == (1, 7, d.NORMAL)
    assert dict(m1.user_properties) == {"color": "red"}  # TAGS, KEYS and UNIQ_KEY are system properties only
    sp2 = m2.system_properties
    assert (sp2.receipt_handle, sp2.delivery_attempt, sp2.invisible_duration.ToMilliseconds()) == ("H2", 3, 12_500)
    assert out[3].delivery_timestamp.seconds > 0
    assert fake.metrics.counts == {"rmq_messages_received": 2}
    assert fake.consumption.named("release") == []


def test_a_fifo_message_carries_its_group_as_message_group_and_sharding_key_and_a_transactional_one_its_id():
    fake = FakeMessaging()
    fake.consumption.deliveries = [
        delivery("H1", **{PROP_UNIQ_KEY: "F1", PROP_SHARDING_KEY: "order-42"}),
        delivery("H2", queue_offset=9, **{PROP_UNIQ_KEY: "TX9", PROP_TRAN_MSG: "true", "PGROUP": "orders"}),
    ]
    out = run(frames(frontend(fake), receive_request()))
    fifo, tx = out[1].message, out[2].message
    assert (fifo.system_properties.message_type, fifo.system_properties.message_group) == (d.FIFO, "order-42")
    assert fifo.user_properties[PROP_SHARDING_KEY] == "order-42"  # as RocketMQ's proxy delivers it
    assert tx.system_properties.message_type == d.TRANSACTION and not tx.system_properties.HasField("message_group")
    assert dict(tx.user_properties) == {"__transactionId__": "TX9"}  # TRAN_MSG and PGROUP are the broker's


@pytest.mark.parametrize("language, checksum", [
    (d.PYTHON, f"{zlib.crc32(b'hello'):08X}"),
    (d.NODE_JS, str(zlib.crc32(b"hello"))),
    (d.GOLANG, f"{zlib.crc32(b'hello'):x}"),
    (d.JAVA, f"{zlib.crc32(b'hello'):X}"),
])
def test_the_body_digest_is_written_in_the_form_the_receiving_clients_sdk_compares(language, checksum):
    fake = FakeMessaging()
    fake.consumption.deliveries = [delivery()]
    clients = ClientTable()
    clients.clients["cid-1"] = Client("cid-1", language=language)
    out = run(frames(frontend(fake, clients=clients), receive_request(), Ctx(client_id="cid-1")))
    assert out[1].message.system_properties.body_digest == d.Digest(type=d.CRC32, checksum=checksum)


def test_a_service_refusal_is_the_only_frame_with_its_code_and_message():
    fake = FakeMessaging()
    fake.consumption.receive_error = PopError("BAD_REQUEST", "batch size 5000 is not between 1 and 1024")
    out = run(frames(frontend(fake), receive_request(batch=5000)))
    assert only_status(out) == (Code.BAD_REQUEST, "batch size 5000 is not between 1 and 1024")
    assert fake.consumption.calls[0][5] == 5000  # the batch goes to the service as asked: the service bounds it


# Every refusal the consumption service and the front end raise names a RocketMQ code: a misspelt name would
# silently answer INTERNAL_ERROR (consumer._code's fallback).
_POP_CODES = sorted(set(re.findall(r'PopError\(\s*"([A-Z_]+)"', inspect.getsource(consumption) + inspect.getsource(consumer))))
_PROXY_CODES = {"BAD_REQUEST": 40000, "ILLEGAL_TOPIC": 40002, "ILLEGAL_CONSUMER_GROUP": 40003,
                "ILLEGAL_FILTER_EXPRESSION": 40010, "ILLEGAL_INVISIBLE_TIME": 40011, "INVALID_RECEIPT_HANDLE": 40013,
                "ILLEGAL_POLLING_TIME": 40018, "TOPIC_NOT_FOUND": 40402, "TOO_MANY_REQUESTS": 42900,
                "INTERNAL_SERVER_ERROR": 50001, "UNSUPPORTED": 50500}


@pytest.mark.parametrize("name", _POP_CODES)
def test_every_refusal_of_the_consumption_service_is_answered_with_its_rocketmq_code(name):
    assert name in _PROXY_CODES, f"{name}: add it with the number RocketMQ's definition.proto gives it"
    fake = FakeMessaging()
    fake.consumption.receive_error = PopError(name, "why")
    assert only_status(run(frames(frontend(fake), receive_request()))) == (_PROXY_CODES[name], "why")
    assert consumer._code("NO_SUCH_CODE") == Code.INTERNAL_ERROR


def test_an_unexpected_error_is_a_status_frame_and_counted_never_a_broken_stream():
    fake = FakeMessaging()
    fake.consumption.receive_error = RuntimeError("boom")
    fe = frontend(fake)
    code, message = only_status(run(frames(fe, receive_request(poll_s=5.0))))
    assert (code, message) == (Code.INTERNAL_ERROR, "internal error: RuntimeError")
    (where, exc), = fake.refusals.internals
    assert where == "rocketmq.ReceiveMessage" and isinstance(exc, RuntimeError)
    assert fe.long_polls.open == 0  # its place among the long polls is given back


# ---- ReceiveMessage: long polls --------------------------------------------------------------------
def test_a_long_poll_holds_a_place_while_it_waits_and_gives_it_back_when_its_stream_ends():
    async def go():
        fake = FakeMessaging()
        fake.consumption.gate = asyncio.Event()
        fake.consumption.deliveries = [delivery()]
        fe = frontend(fake, long_polls=Holds("long polls", 4, 4, 4))
        task = asyncio.ensure_future(frames(fe, receive_request(poll_s=20.0), Ctx(client_id="c1")))
        await fake.consumption.entered.wait()
        assert (fe.long_polls.open, fe.long_polls.by_client, fe.long_polls.by_connection) == (1, {"c1": 1}, {PEER: 1})
        fake.consumption.gate.set()  # a message arrived
        out = await task
        assert [r.WhichOneof("content") for r in out] == ["status", "message", "delivery_timestamp"]
        assert (fe.long_polls.open, fe.long_polls.by_client, fe.long_polls.by_connection) == (0, {}, {})
        await frames(fe, receive_request(poll_s=0.0))  # a receive that does not wait takes no place
        assert fe.long_polls.open == 0 and fake.consumption.calls[-1][7] == 0.0

    run(go())


def test_with_the_long_polls_full_a_receive_takes_what_is_there_or_is_answered_polling_full():
    fake = FakeMessaging()
    fe = frontend(fake, long_polls=Holds("long polls", 1, 8, 8))
    assert fe.long_polls.take("c1", PEER) is None  # the client's one long poll is open
    code, message = only_status(run(frames(fe, receive_request(poll_s=20.0), Ctx(client_id="c1"))))
    assert code == Code.TOO_MANY_REQUESTS and message == "polling full: 1 long polls open for client c1, the limit per client"
    assert fake.consumption.calls[-1][7] == 0.0  # asked without waiting
    assert fake.refusals.notes == [("rocketmq", "busy", PEER, message)]
    fake.consumption.deliveries = [delivery()]
    out = run(frames(fe, receive_request(poll_s=20.0), Ctx(client_id="c1")))
    assert out[0].status.code == Code.OK and out[1].message.system_properties.receipt_handle == "H1"
    assert len(fake.refusals.notes) == 1 and fe.long_polls.open == 1  # only the one taken above


# ---- ReceiveMessage: what is not handed out goes back ------------------------------------------------
def test_messages_the_stream_never_wrote_are_released_at_once_in_order():
    async def go():
        fake = FakeMessaging()
        fake.consumption.deliveries = [delivery("H1", queue_offset=1), delivery("H2", queue_offset=2),
                                       delivery("H3", queue_offset=3)]
        stream = frontend(fake).receive(receive_request(), Ctx())
        assert (await stream.__anext__()).status.code == Code.OK
        assert (await stream.__anext__()).message.system_properties.receipt_handle == "H1"
        await stream.aclose()  # the client went away (cancelled, deadline, connection lost)
        assert fake.consumption.named("release") == [("release", G, T, ["H2", "H3"], True)]

    run(go())


def test_an_unconvertible_message_stays_in_flight_and_in_a_fifo_group_holds_back_the_rest_of_its_queue(monkeypatch):
    real = consumer.convert.record_to_message

    def convert(rec, **kw):
        if rec.queue_offset == 2:
            raise ValueError("unconvertible")
        return real(rec, **kw)

    monkeypatch.setattr(consumer.convert, "record_to_message", convert)
    batch = [delivery("A1", queue_id=0, queue_offset=1), delivery("A2", queue_id=0, queue_offset=2),
             delivery("B5", queue_id=1, queue_offset=5), delivery("A3", queue_id=0, queue_offset=3),
             delivery("A4", queue_id=0, queue_offset=4)]
    fake = FakeMessaging()
    fake.consumption.deliveries = batch
    out = run(frames(frontend(fake), receive_request()))
    assert [r.message.system_properties.receipt_handle for r in out[1:-1]] == ["A1", "B5", "A3", "A4"]
    assert fake.consumption.named("release") == [("release", G, T, ["A2"], False)]  # its attempts run out: dead-lettered
    fake = FakeMessaging()
    fake.consumption.deliveries = batch
    fake.consumption.fifo_groups.add(G)
    out = run(frames(frontend(fake), receive_request()))
    assert [r.message.system_properties.receipt_handle for r in out[1:-1]] == ["A1", "B5"]
    assert fake.consumption.named("release") == [("release", G, T, ["A2"], False), ("release", G, T, ["A3", "A4"], True)]


# ---- AckMessage -------------------------------------------------------------------------------------
def ack_request(*handles: str, group=G, topic=T) -> s.AckMessageRequest:
    req = s.AckMessageRequest(entries=[s.AckMessageEntry(message_id=f"M{i}", receipt_handle=h) for i, h in enumerate(handles)])
    req.group.name = group
    req.topic.name = topic
    return req


def test_an_ack_settles_each_entry_by_its_receipt_handle_and_echoes_the_entries():
    fake = FakeMessaging()
    resp = run(frontend(fake).ack(ack_request("H1", "H2"), Ctx()))
    assert (resp.status.code, resp.status.message) == (Code.OK, "OK")
    assert [(e.message_id, e.receipt_handle, e.status.code) for e in resp.entries] == [("M0", "H1", Code.OK), ("M1", "H2", Code.OK)]
    assert fake.consumption.calls == [("ack", G, T, "H1"), ("ack", G, T, "H2")]
    assert fake.metrics.counts == {"rmq_messages_acked": 2}


def test_an_ack_with_different_answers_is_multiple_results_and_a_single_entrys_refusal_is_the_answer():
    fake = FakeMessaging()
    stale = PopError("INVALID_RECEIPT_HANDLE", "the receipt handle is stale")
    fake.consumption.ack_errors = {"OLD": stale}
    resp = run(frontend(fake).ack(ack_request("OLD", "H2"), Ctx()))
    assert resp.status.code == Code.MULTIPLE_RESULTS and "1 of 2 entries failed" in resp.status.message
    assert [e.status.code for e in resp.entries] == [Code.INVALID_RECEIPT_HANDLE, Code.OK]
    assert fake.metrics.counts == {"rmq_messages_acked": 1}
    resp = run(frontend(fake).ack(ack_request("OLD"), Ctx()))
    assert (resp.status.code, resp.status.message) == (Code.INVALID_RECEIPT_HANDLE, "the receipt handle is stale")


def test_an_ack_whose_entries_all_get_the_same_refusal_answers_that_code_as_rocketmqs_proxy_does():
    # AckMessageActivity: MULTIPLE_RESULTS only when the entries' codes differ; one code for all is the answer.
    fake = FakeMessaging()
    fake.consumption.ack_errors = {h: PopError("INVALID_RECEIPT_HANDLE", "malformed receipt handle") for h in ("x", "y")}
    resp = run(frontend(fake).ack(ack_request("x", "y"), Ctx()))
    assert (resp.status.code, resp.status.message) == (Code.INVALID_RECEIPT_HANDLE, "malformed receipt handle")
    assert [e.status.code for e in resp.entries] == [Code.INVALID_RECEIPT_HANDLE] * 2


@pytest.mark.parametrize("req, code, says", [
    (ack_request(), Code.BAD_REQUEST, "no entries"),
    (ack_request(*["H"] * (consumer.MAX_ACK_ENTRIES + 1)), Code.BAD_REQUEST, "at most 1024 per request"),
    (ack_request("H1", group="bad group"), Code.ILLEGAL_CONSUMER_GROUP, "consumer group"),
])
def test_an_ack_without_entries_with_too_many_or_of_an_illegal_group_settles_nothing(req, code, says):
    fake = FakeMessaging()
    resp = run(frontend(fake).ack(req, Ctx()))
    assert resp.status.code == code and says in resp.status.message and len(resp.entries) == 0
    assert fake.consumption.calls == []


# ---- ChangeInvisibleDuration ----------------------------------------------------------------------------
def change_request(handle="H1", seconds: float = 45.25, group=G, topic=T) -> s.ChangeInvisibleDurationRequest:
    req = s.ChangeInvisibleDurationRequest(receipt_handle=handle, message_id="M1")
    req.group.name = group
    req.topic.name = topic
    req.invisible_duration.FromNanoseconds(int(seconds * 1e9))
    return req


def test_a_change_of_invisible_duration_answers_the_new_receipt_handle():
    fake = FakeMessaging()
    resp = run(frontend(fake).change_invisible_duration(change_request(seconds=45.25), Ctx()))
    assert (resp.status.code, resp.receipt_handle) == (Code.OK, "H1+1")
    assert fake.consumption.calls == [("change_invisible", G, T, "H1", 45.25)]


def test_a_refused_change_answers_the_requests_own_receipt_handle():
    fake = FakeMessaging()
    fake.consumption.change_error = PopError("INVALID_RECEIPT_HANDLE", "the receipt handle is stale")
    resp = run(frontend(fake).change_invisible_duration(change_request("OLD"), Ctx()))
    assert (resp.status.code, resp.status.message, resp.receipt_handle) == (
        Code.INVALID_RECEIPT_HANDLE, "the receipt handle is stale", "OLD")


@pytest.mark.parametrize("seconds", [-1.0, 12 * 3600 + 1])
def test_an_invisible_duration_out_of_range_is_refused_before_the_receipt_handle_is_looked_at(seconds):
    # ChangeInvisibleDurationActivity validates the duration (0 to 12 h) before it decodes the handle.
    fake = FakeMessaging()
    fake.consumption.change_error = PopError("INVALID_RECEIPT_HANDLE", "the receipt handle is stale")
    resp = run(frontend(fake).change_invisible_duration(change_request("OLD", seconds=seconds), Ctx()))
    assert resp.status.code == Code.ILLEGAL_INVISIBLE_TIME and "between 0 s and 43200 s" in resp.status.message
    assert resp.receipt_handle == "OLD" and fake.consumption.calls == []


def test_a_zero_invisible_duration_makes_the_message_visible_again_at_once():
    fake = FakeMessaging()
    resp = run(frontend(fake).change_invisible_duration(change_request(seconds=0.0), Ctx()))
    assert resp.status.code == Code.OK and fake.consumption.calls == [("change_invisible", G, T, "H1", 0.0)]


# ---- ForwardMessageToDeadLetterQueue -------------------------------------------------------------------
def dlq_request(handle="H1", group=G, topic=T) -> s.ForwardMessageToDeadLetterQueueRequest:
    req = s.ForwardMessageToDeadLetterQueueRequest(receipt_handle=handle, message_id="M1", delivery_attempt=3,
                                                   max_delivery_attempts=16)
    req.group.name = group
    req.topic.name = topic
    return req


@pytest.mark.parametrize("error, code", [
    (None, Code.OK),
    (PopError("INVALID_RECEIPT_HANDLE", "stale"), Code.INVALID_RECEIPT_HANDLE),
    (PopError("INTERNAL_SERVER_ERROR", "could not be written"), Code.INTERNAL_SERVER_ERROR),
])
def test_a_forward_to_the_dead_letter_queue_is_the_services_and_answers_its_outcome(error, code):
    fake = FakeMessaging()
    fake.consumption.dlq_error = error
    resp = run(frontend(fake).forward_to_dlq(dlq_request(), Ctx()))
    assert resp.status.code == code and resp.status.message == ("OK" if error is None else error.message)
    assert fake.consumption.calls == [("forward_to_dlq", G, T, "H1")]


def test_a_change_or_forward_with_a_namespace_is_refused_before_the_service():
    fake = FakeMessaging()
    req = change_request()
    req.group.resource_namespace = "ns"
    assert run(frontend(fake).change_invisible_duration(req, Ctx())).status.code == Code.ILLEGAL_CONSUMER_GROUP
    req = dlq_request()
    req.topic.resource_namespace = "ns"
    assert run(frontend(fake).forward_to_dlq(req, Ctx())).status.code == Code.ILLEGAL_TOPIC
    assert fake.consumption.calls == []


# ---- what the front end tells the service, and its end ---------------------------------------------------
def test_the_service_is_told_the_groups_attempts_and_whether_clients_live_once_per_service(monkeypatch):
    class Settings:
        clients = ClientTable()
        consumer_max_attempts = 5
        long_polls = Holds("long polls", 1, 1, 1)

    fake = FakeMessaging()
    fe = consumer.ReceiveFrontend(fake, Settings())
    assert fe.long_polls is Settings.long_polls
    run(frames(fe, receive_request()))
    run(frames(fe, receive_request()))
    (told,) = fake.consumption.attached
    assert told["max_attempts"](G) == 5
    Settings.clients.clients["live"] = Client("live", streams={object()}, last_seen=0.0)  # a Telemetry stream open
    Settings.clients.clients["gone"] = Client("gone", last_seen=time.monotonic() - consumer.CLIENT_ALIVE_S)  # only ages
    Settings.clients.clients["recent"] = Client("recent")  # a request just now
    alive = told["client_alive"]
    assert (alive("live"), alive("gone"), alive("recent"), alive("unknown")) == (True, False, True, False)
    fake.consumption = FakePop()  # the store opened again: a new service is told again
    run(frames(fe, receive_request()))
    assert len(fake.consumption.attached) == 1
    assert frontend(FakeMessaging()).pop.attached == [{"max_attempts": None, "client_alive": None}]  # no clients: no renewal


def test_close_closes_the_service_and_before_the_store_opened_there_is_none_to_close():
    fake = FakeMessaging()
    run(frontend(fake).close())
    assert fake.consumption.closed
    fake.consumption = None
    run(frontend(fake).close())


@pytest.mark.parametrize("rpc, req", [
    ("UpdateOffset", s.UpdateOffsetRequest()),
    ("GetOffset", s.GetOffsetRequest()),
    ("QueryOffset", s.QueryOffsetRequest()),
])
def test_the_pull_consumers_offset_rpcs_are_unsupported(rpc, req):
    with pytest.raises(RmqError) as e:
        run(getattr(MessagingService, rpc)(None, req, Ctx()))
    assert e.value.code == Code.UNSUPPORTED and "pull consumer" in e.value.message

    async def pull():
        return [r async for r in MessagingService.PullMessage(None, s.PullMessageRequest(), Ctx())]

    (resp,) = run(pull())
    assert resp.status.code == Code.UNSUPPORTED and "PullMessage" in resp.status.message


def test_the_fake_has_what_the_real_service_has():
    """The fake stands in for ConsumptionService: every call the receive side makes exists there, with its parameters."""
    real = ConsumptionService(None, None, None, None, None)  # type: ignore[arg-type]  # stores its collaborators only
    for name in ("config", "attach", "receive", "ack", "change_invisible", "release", "fifo", "forward_to_dlq", "close",
                 "check_invisible"):
        assert hasattr(real, name), name
        if name not in ("config", "fifo"):
            assert list(inspect.signature(getattr(real, name)).parameters) == \
                list(inspect.signature(getattr(FakePop(), name)).parameters), name
    from txmq.broker.messaging import Messaging

    for name in ("consumption", "topic_queues", "metrics", "refusals"):
        assert hasattr(Messaging, name), name
