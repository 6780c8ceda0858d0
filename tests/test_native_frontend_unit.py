"""The native protocol's front end against a fake messaging service: no store, no broker, no sockets.

Each test drives the front end's handlers (through a `BrokerConnection` on a
transport that records its writes, where the framing matters) and checks
how it words the service's typed answers (receipts, end-of-transaction
outcomes, pull results, errors) in the native protocol (docs/protocol.md),
and what it hands the service.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from txmq import wire
from txmq.broker.config import BrokerConfig
from txmq.broker.messaging import (
    NATIVE_RULES,
    EndOutcome,
    EndStatus,
    PullResult,
    PullStatus,
    SendReceipt,
)
from txmq.broker.native import handlers  # noqa: F401  fills the operation table
from txmq.broker.native.connection import BrokerConnection
from txmq.broker.native.operations import HANDLERS
from txmq.broker.native.server import ServerState
from txmq.wire import ErrorCode, TxmqError


def done(value: Any) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut


class FakeMessaging:
    """What the native front end calls, recording each call; answers set by the test."""

    def __init__(self) -> None:
        self.config = BrokerConfig()
        self.metrics = SimpleNamespace(inc=lambda *a, **k: None, counters={})
        self.refusals = SimpleNamespace(note=lambda *a, **k: None)
        self.draining = False
        self.busy_poll_arm = None
        self.broker_id = "txmq-fake"
        self.calls: list[tuple] = []
        self.known_topics: dict[str, int] = {"orders": 4}
        self.receipts: list[SendReceipt] = []
        self.outcome: EndOutcome | None = None
        self.pulled: PullResult | None = None
        self.error: BaseException | None = None

    def now_ms(self) -> int:
        return 1_700_000_000_000

    def topic_queues(self, topic: str) -> int | None:
        return self.known_topics.get(topic)

    def send(self, topic, items, queue_id=None, rules=NATIVE_RULES, word=None):
        self.calls.append(("send", topic, list(items), queue_id, rules))
        if self.error is not None:
            raise self.error
        return done(self.receipts if word is None else word(self.receipts))

    def end_transaction(self, group, tx_id, cl, half, state, source="producer", word=None):
        self.calls.append(("end_transaction", group, tx_id, cl, half, state, source))
        return done(self.outcome if word is None else word(self.outcome))

    async def pull(self, *args):
        self.calls.append(("pull", *args))
        return self.pulled

    def register_producer(self, group, conn):
        self.calls.append(("register_producer", group))

    def register_consumer(self, group, conn):
        self.calls.append(("register_consumer", group))

    def forget_client(self, conn):
        self.calls.append(("forget_client",))

    def error_of(self, exc):
        return exc if isinstance(exc, TxmqError) else TxmqError(f"internal error: {type(exc).__name__}", ErrorCode.INTERNAL)


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.data = b""

    def write(self, data) -> None:  # type: ignore[override]
        self.data += bytes(data)

    def writelines(self, bufs) -> None:  # type: ignore[override]
        self.data += b"".join(bytes(b) for b in bufs)

    def is_closing(self) -> bool:
        return False

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 40000) if name == "peername" else default

    def frames(self) -> list[wire.Frame]:
        return [wire.parse_payload(p) for p in wire.FrameDecoder().feed(self.data)]


@pytest.fixture
def front() -> SimpleNamespace:
    m = FakeMessaging()
    return SimpleNamespace(messaging=m, operations=SimpleNamespace(), config=m.config)


def exchange(front: SimpleNamespace, op: str, fields: dict) -> wire.Frame:
    """One request through a connection; the frame it answers."""

    async def go() -> wire.Frame:
        conn = BrokerConnection(front, ServerState())
        t = RecordingTransport()
        conn.connection_made(t)
        conn.data_received(wire.request(7, op, fields))
        for _ in range(100):  # the replies of futures come within a few loop iterations
            if t.frames():
                break
            await asyncio.sleep(0)
        (frame,) = t.frames()
        assert frame.id == 7
        return frame

    return asyncio.run(go())


def test_a_send_hands_the_planner_the_message_and_answers_its_receipt(front):
    m = front.messaging
    m.receipts = [SendReceipt("M1", "orders", 2, 41, 9000)]
    frame = exchange(front, "send", {"topic": "orders", "body": b"hi", "properties": {"KEYS": "k"}, "queue_id": 2})
    assert (frame.kind, frame.op) == (wire.REPLY, 0)
    assert frame.fields == {"msg_id": "M1", "topic": "orders", "queue_id": 2, "queue_offset": 41, "commit_log_offset": 9000}
    (_, topic, items, qid, rules), = m.calls
    assert (topic, qid, rules) == ("orders", 2, NATIVE_RULES)
    assert (items[0].body, items[0].properties, items[0].born_ts) == (b"hi", {"KEYS": "k"}, m.now_ms())


def test_a_send_that_creates_its_topic_says_so(front):
    front.messaging.receipts = [SendReceipt("M1", "fresh", 0, 0, 10)]
    assert exchange(front, "send", {"topic": "fresh", "body": b"x"}).fields["topic_created"] is True


def test_a_half_message_is_answered_with_its_transaction_id_and_half_offset(front):
    front.messaging.receipts = [SendReceipt("TX1", "orders", 1, 5, 777, half_offset=5)]
    frame = exchange(front, "send", {"topic": "orders", "body": b"x", "properties": {"TRAN_MSG": "true", "PGROUP": "g"}})
    assert frame.fields == {"msg_id": "TX1", "tx_id": "TX1", "topic": "orders", "queue_id": 1, "half_offset": 5,
                            "commit_log_offset": 777}


def test_a_scheduled_message_is_answered_with_its_due_time(front):
    front.messaging.receipts = [SendReceipt("D1", "orders", 0, -1, 88, deliver_at_ms=1_700_000_060_000)]
    assert exchange(front, "send", {"topic": "orders", "body": b"x"}).fields["deliver_at_ms"] == 1_700_000_060_000


def test_a_batch_with_a_transactional_message_is_refused_before_the_service_is_called(front):
    frame = exchange(front, "send_batch", {"topic": "orders", "messages": [{"body": b"a"}, {"body": b"b", "properties": {"TRAN_MSG": "true"}}]})
    assert frame.op == ErrorCode.INVALID_FIELD
    assert front.messaging.calls == []


def test_a_batch_is_answered_with_every_receipt_in_order(front):
    front.messaging.receipts = [SendReceipt("A", "orders", 0, 1, 10), SendReceipt("B", "orders", 0, 2, 20)]
    frame = exchange(front, "send_batch", {"topic": "orders", "messages": [{"body": b"a"}, {"body": b"b"}]})
    assert [r["msg_id"] for r in frame.fields["results"]] == ["A", "B"]


@pytest.mark.parametrize("outcome, want", [
    (EndOutcome("T", EndStatus.DECIDED, "committed", committed=SendReceipt("T", "orders", 3, 12, 500)),
     {"status": "ok", "outcome": "committed", "commit_log_offset": 500, "queue_offset": 12, "topic": "orders", "queue_id": 3}),
    (EndOutcome("T", EndStatus.DECIDED, "rolled_back"), {"status": "ok", "outcome": "rolled_back"}),
    (EndOutcome("T", EndStatus.ALREADY, "committed", "check"), {"status": "already", "outcome": "committed", "decided_by": "check"}),
    (EndOutcome("T", EndStatus.UNCHANGED, "pending"), {"status": "noop", "outcome": "pending"}),
])
def test_each_end_of_transaction_outcome_is_worded_as_the_protocol_documents_it(front, outcome, want):
    front.messaging.outcome = outcome
    fields = {"group": "g", "tx_id": "T", "commit_log_offset": 500, "half_offset": 4, "state": "commit", "from_check": True}
    assert exchange(front, "end_transaction", fields).fields == want
    assert front.messaging.calls == [("end_transaction", "g", "T", 500, 4, "commit", "check")]


@pytest.mark.parametrize("status", list(PullStatus))
def test_a_pull_answers_each_status_with_its_offsets(front, status):
    msgs = [{"topic": "orders", "body": b"x"}] if status is PullStatus.FOUND else []
    front.messaging.pulled = PullResult(status, msgs, 9, 2, 30)
    frame = exchange(front, "pull", {"topic": "orders", "queue_id": 1, "offset": 8})
    assert frame.fields == {"status": status.value, "messages": msgs, "next_offset": 9, "min_offset": 2, "max_offset": 30}


def test_an_error_of_the_service_is_an_error_reply_with_its_code(front):
    front.messaging.error = TxmqError("topic orders does not accept delay messages", ErrorCode.MESSAGE_TYPE_NOT_ACCEPTED)
    frame = exchange(front, "send", {"topic": "orders", "body": b"x"})
    assert frame.op == ErrorCode.MESSAGE_TYPE_NOT_ACCEPTED and "delay" in frame.fields["error"]


@pytest.mark.parametrize("fields, code", [
    ({"body": b"x"}, ErrorCode.INVALID_TOPIC),
    ({"topic": "orders", "body": 5}, ErrorCode.INVALID_FIELD),
    ({"topic": "orders", "body": b"x" * (BrokerConfig().max_body + 1)}, ErrorCode.BODY_TOO_LARGE),
    ({"topic": "RMQ_SYS_TRANS_HALF_TOPIC", "body": b"x"}, ErrorCode.SYSTEM_TOPIC),
    ({"topic": "orders", "body": b"x", "properties": {"k": 1}}, ErrorCode.INVALID_FIELD),
])
def test_bad_fields_are_refused_and_the_service_is_not_called(front, fields, code):
    frame = exchange(front, "send", fields)
    assert frame.op == code, frame.fields
    assert front.messaging.calls == []


def test_hello_registers_the_connection_in_its_groups(front):
    frame = exchange(front, "hello", {"producer_groups": ["p1"], "consumer_groups": ["c1", "c2"]})
    assert frame.fields["broker_id"] == "txmq-fake"
    assert front.messaging.calls == [("register_producer", "p1"), ("register_consumer", "c1"), ("register_consumer", "c2")]


def test_every_operation_of_the_table_takes_the_front_end_the_connection_and_the_fields():
    import inspect

    for op, fn in HANDLERS.items():
        assert len(inspect.signature(fn).parameters) == 3, op
