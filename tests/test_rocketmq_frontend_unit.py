"""The RocketMQ 5 front end's producer side against a fake messaging service: no store, no broker, no gRPC server.

SendMessage, EndTransaction and RecallMessage (broker/rocketmq/producer.py)
read RocketMQ's protobuf requests, hand them to the messaging service and
word its typed answers (receipts, end-of-transaction outcomes) as RocketMQ
5's proxy does.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

pytest.importorskip("grpc")

from txmq.broker.config import BrokerConfig  # noqa: E402
from txmq.broker.messaging import ROCKETMQ5_RULES, EndOutcome, EndStatus, SendReceipt, TxRef  # noqa: E402
from txmq.broker.rocketmq import producer  # noqa: E402
from txmq.broker.rocketmq.pb import definition_pb2 as d  # noqa: E402
from txmq.broker.rocketmq.pb import service_pb2 as s  # noqa: E402
from txmq.broker.rocketmq.status import Code, RmqError  # noqa: E402
from txmq.wire import ErrorCode, TxmqError  # noqa: E402


class FakeMessaging:
    """The calls the producer side makes, recorded; the answers set by each test."""

    def __init__(self) -> None:
        self.config = BrokerConfig()
        self.known = {"orders": ("normal", "transaction", "fifo", "delay")}
        self.auto_create_topics = True
        self.calls: list[tuple] = []
        self.receipts: list[SendReceipt] = []
        self.ref: TxRef | None = None
        self.outcome: EndOutcome | None = None
        self.end_error: TxmqError | None = None

    def topic_queues(self, topic):
        return 4 if topic in self.known else None

    def topic_types(self, topic):
        return self.known.get(topic, ("normal", "transaction"))

    def now_ms(self):
        return 1_700_000_000_000

    async def send(self, topic, items, queue_id=None, rules=None, word=None):
        self.calls.append(("send", topic, list(items), queue_id, rules))
        return self.receipts

    async def transaction_ref(self, text):
        self.calls.append(("transaction_ref", text))
        return self.ref

    async def end_transaction(self, group, tx_id, cl, half, state, source="producer", word=None):
        self.calls.append(("end_transaction", group, tx_id, cl, half, state, source))
        if self.end_error is not None:
            raise self.end_error
        return self.outcome

    async def cancel_scheduled(self, msg_id, topic):
        self.calls.append(("cancel_scheduled", msg_id, topic))
        return {"msg_id": msg_id}


def message(topic="orders", body=b"hi", **system) -> d.Message:
    m = d.Message(body=body)
    m.topic.name = topic
    m.system_properties.message_id = system.pop("message_id", "M1")
    for k, v in system.items():
        setattr(m.system_properties, k, v)
    return m


def run(coro):
    return asyncio.run(coro)


def test_a_send_hands_the_planner_the_message_with_rocketmq_5s_rules_and_answers_the_receipt():
    fake = FakeMessaging()
    fake.receipts = [SendReceipt("M1", "orders", 2, 41, 900)]
    resp = run(producer.send_message(fake, s.SendMessageRequest(messages=[message()])))
    assert resp.status.code == d.OK
    (e,) = resp.entries
    assert (e.message_id, e.transaction_id, e.offset, e.recall_handle) == ("M1", "M1", 41, "")
    (_, topic, items, qid, rules), = fake.calls
    assert (topic, qid, rules) == ("orders", None, ROCKETMQ5_RULES) and items[0].body == b"hi"


def test_a_transactional_send_is_a_half_of_the_topics_group_and_answers_its_half_offset():
    fake = FakeMessaging()
    fake.receipts = [SendReceipt("TX1", "orders", 1, 5, 777, half_offset=5)]
    resp = run(producer.send_message(fake, s.SendMessageRequest(messages=[message(message_type=d.TRANSACTION)])))
    (e,) = resp.entries
    assert (e.transaction_id, e.offset) == ("TX1", 5)
    props = fake.calls[0][2][0].properties
    assert props["TRAN_MSG"] == "true" and props["PGROUP"] == "orders"  # RocketMQ 5 producers have no group: the topic


def test_a_scheduled_send_answers_a_recall_handle_that_recall_message_takes_back():
    fake = FakeMessaging()
    fake.receipts = [SendReceipt("D1", "orders", 0, -1, 88, deliver_at_ms=1_700_000_060_000)]
    delayed = message(message_type=d.DELAY)
    delayed.system_properties.delivery_timestamp.FromMilliseconds(1_700_000_060_000)
    resp = run(producer.send_message(fake, s.SendMessageRequest(messages=[delayed])))
    handle = resp.entries[0].recall_handle
    assert producer.parse_recall_handle(handle) == ("orders", "D1")
    req = s.RecallMessageRequest(recall_handle=handle)
    req.topic.name = "orders"
    assert run(producer.recall_message(fake, req)).message_id == "D1"
    assert fake.calls[-1] == ("cancel_scheduled", "D1", "orders")


def test_an_unknown_topic_is_refused_before_the_service_stores_anything():
    fake = FakeMessaging()
    with pytest.raises(RmqError) as e:
        run(producer.send_message(fake, s.SendMessageRequest(messages=[message(topic="nowhere")])))
    assert e.value.code == Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE and "UNSPECIFIED" in e.value.message
    assert fake.calls == []


def test_a_batch_with_two_topics_or_a_transactional_message_is_refused():
    fake = FakeMessaging()
    fake.known["other"] = ("normal",)
    with pytest.raises(RmqError) as e:
        run(producer.send_message(fake, s.SendMessageRequest(messages=[message(), message(topic="other")])))
    assert e.value.code == Code.BAD_REQUEST and "same topic" in e.value.message
    with pytest.raises(RmqError) as e:
        run(producer.send_message(fake, s.SendMessageRequest(messages=[message(), message(message_type=d.TRANSACTION)])))
    assert e.value.code == Code.BAD_REQUEST and "batch" in e.value.message
    assert fake.calls == []


def test_bodies_inflated_past_max_frame_are_refused_as_too_large():
    fake = FakeMessaging()
    fake.config = replace(BrokerConfig(), max_frame=10_000, max_body=8_000)
    msgs = [message(body=b"x" * 6_000), message(body=b"y" * 6_000)]
    with pytest.raises(RmqError) as e:
        run(producer.send_message(fake, s.SendMessageRequest(messages=msgs)))
    assert e.value.code == Code.MESSAGE_BODY_TOO_LARGE and "--max-frame" in e.value.message


@pytest.mark.parametrize("outcome, says", [
    (EndOutcome("T", EndStatus.DECIDED, "committed"), "transaction T committed"),
    (EndOutcome("T", EndStatus.ALREADY, "committed", "check"), "transaction T was already committed (by check)"),
    (EndOutcome("T", EndStatus.UNCHANGED, "pending"), "transaction T stays pending: the resolution is neither COMMIT nor ROLLBACK"),
])
def test_an_end_transaction_finds_the_half_by_id_and_words_each_outcome(outcome, says):
    fake = FakeMessaging()
    fake.ref = TxRef("T", 500, 4)
    fake.outcome = outcome
    req = s.EndTransactionRequest(transaction_id="T", message_id="T", resolution=d.COMMIT, source=d.SOURCE_SERVER_CHECK)
    req.topic.name = "orders"
    resp = run(producer.end_transaction(fake, req))
    assert (resp.status.code, resp.status.message) == (d.OK, says)
    assert fake.calls[-1] == ("end_transaction", "orders", "T", 500, 4, "commit", "check")


def test_an_end_transaction_of_an_unknown_or_foreign_transaction_is_an_invalid_transaction_id():
    fake = FakeMessaging()
    req = s.EndTransactionRequest(transaction_id="nope", resolution=d.ROLLBACK)
    req.topic.name = "orders"
    with pytest.raises(RmqError) as e:
        run(producer.end_transaction(fake, req))
    assert e.value.code == Code.INVALID_TRANSACTION_ID and "no transaction 'nope'" in e.value.message
    fake.ref = TxRef("T", 1, 2)
    fake.end_error = TxmqError("producer group mismatch", ErrorCode.TX_GROUP_MISMATCH)
    req = s.EndTransactionRequest(transaction_id="T", resolution=d.ROLLBACK)
    req.topic.name = "orders"
    with pytest.raises(RmqError) as e:
        run(producer.end_transaction(fake, req))
    assert e.value.code == Code.INVALID_TRANSACTION_ID and "not sent to topic orders by a RocketMQ client" in e.value.message


def test_a_message_id_that_is_not_the_transactions_is_refused():
    fake = FakeMessaging()
    fake.ref = TxRef("T", 1, 2)
    req = s.EndTransactionRequest(transaction_id="T", message_id="OTHER", resolution=d.COMMIT)
    req.topic.name = "orders"
    with pytest.raises(RmqError) as e:
        run(producer.end_transaction(fake, req))
    assert e.value.code == Code.INVALID_TRANSACTION_ID and "is not the message of" in e.value.message
    assert not any(c[0] == "end_transaction" for c in fake.calls)


def test_a_namespace_or_a_system_topic_is_an_illegal_topic():
    r = d.Resource(name="orders", resource_namespace="ns")
    with pytest.raises(RmqError) as e:
        producer.topic_of(r)
    assert e.value.code == Code.ILLEGAL_TOPIC
    with pytest.raises(RmqError) as e:
        producer.topic_of(d.Resource(name="RMQ_SYS_TRANS_HALF_TOPIC"))
    assert e.value.code == Code.ILLEGAL_TOPIC


def test_the_fake_has_what_the_real_service_has():
    """The fake stands in for Messaging: every call the producer side makes exists on the real service."""
    from txmq.broker.messaging import Messaging

    for name in ("topic_queues", "topic_types", "auto_create_topics", "now_ms", "send", "transaction_ref", "end_transaction",
                 "cancel_scheduled", "config"):
        assert hasattr(Messaging, name), name
