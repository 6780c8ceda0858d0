"""The remoting front end's handlers on a stand-in messaging service: no store, no broker, no socket.

Each request code's handler reads the header, calls ``front.messaging``
(``txmq.broker.messaging.Messaging``) and words its typed answer
(SendReceipt, EndOutcome, PullResult) as RocketMQ 4's response: these
tests give it an in-memory ``Messaging`` with only the calls it makes, and
check the words.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from txmq.broker.config import BrokerConfig
from txmq.broker.messaging import ROCKETMQ4_RULES, EndOutcome, EndStatus, PullResult, PullStatus, SendReceipt
from txmq.broker.remoting import messages
from txmq.broker.remoting import protocol as p
from txmq.broker.remoting.clients import ClientTable
from txmq.broker.remoting.handlers import HANDLERS, Then, error_response
from txmq.broker.remoting.messages import MessageFormatError, encode_maps, offset_msg_id
from txmq.store import TxType
from txmq.wire import ErrorCode, TxmqError

STORE_ADDR = b"\x7f\x00\x00\x01"
PORT = 10911


class FakeMetrics:
    def __init__(self) -> None:
        self.counters: dict[str, int] = {}

    def inc(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n


class FakeMessaging:
    """The calls of Messaging the sending, transaction and pulling handlers make, answering what a test sets."""

    def __init__(self) -> None:
        self.config = BrokerConfig()
        self.metrics = FakeMetrics()
        self.queues: dict[str, int] = {"T": 4}
        self.calls: list[tuple[str, tuple]] = []
        self.receipts: list[SendReceipt] = []
        self.outcome: EndOutcome | None = None
        self.pulled: PullResult | None = None
        self.offsets: dict[tuple[str, str, int], int] = {}
        self.auto_create_topics = True

    def now_ms(self) -> int:
        return 1_700_000_000_000

    def topic_queues(self, topic: str) -> int | None:
        return self.queues.get(topic)

    def send(self, topic: str, items: list, queue_id: int | None = None, rules: Any = None) -> Any:
        self.calls.append(("send", (topic, list(items), queue_id, rules)))
        return _done(list(self.receipts))

    def end_transaction(self, group: str, tx_id: str, cl: int, half: int, state: str, source: str = "producer") -> Any:
        self.calls.append(("end_transaction", (group, tx_id, cl, half, state, source)))
        return _done(self.outcome)

    async def pull(self, topic: str, queue_id: int, offset: int, max_count: int, max_bytes: int, wait_ms: int) -> PullResult:
        self.calls.append(("pull", (topic, queue_id, offset, max_count, max_bytes, wait_ms)))
        assert self.pulled is not None
        return self.pulled

    def set_offset(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        self.offsets[group, topic, queue_id] = offset

    def error_of(self, exc: BaseException) -> TxmqError:
        return TxmqError(f"internal error: {exc!r}", ErrorCode.INTERNAL)


async def _value(v: Any) -> Any:
    return v


def _done(v: Any) -> Any:
    """What the services answer with: an awaitable of the result (a future on the broker's loop)."""
    return _value(v)


class FakeConnection:
    conn_id = 1
    peer = "127.0.0.1:40000"
    local_host = "127.0.0.1"
    store_addr = STORE_ADDR
    client_language, client_version = "JAVA", 409

    def __init__(self) -> None:
        self.client_ids: set[str] = set()
        self.sent: list[p.Command] = []

    def writable(self) -> bool:
        return True

    def request(self, cmd: p.Command) -> None:
        self.sent.append(cmd)


class FakeFront:
    port = PORT
    broker_name = "txmq"
    cluster_name = "txmq"
    stopping = False

    def __init__(self) -> None:
        self.messaging = FakeMessaging()
        self.operations = SimpleNamespace()
        self.clients = ClientTable(self)
        self.connections: set = set()
        self.inflight: set = set()
        self._opaque = 0

    def next_opaque(self) -> int:
        self._opaque += 1
        return self._opaque


def answer(front: FakeFront, cmd: p.Command) -> p.Command | None:
    """The response the connection writes for cmd: the handler's, or error_response's for what it raised."""
    messaging = front.messaging
    try:
        result = HANDLERS[cmd.code](front, FakeConnection(), cmd)
    except Exception as exc:
        return error_response(messaging, cmd, exc)
    if result is None or isinstance(result, p.Command):
        return result

    async def finish() -> p.Command | None:
        try:
            if isinstance(result, Then):
                return result.fn(await result.fut)
            return await result
        except Exception as exc:
            return error_response(messaging, cmd, exc)

    return asyncio.run(finish())


def req(code: int, ext: dict[str, str], body: bytes = b"") -> p.Command:
    return p.request(code, 7, ext, body)


# ---- sending ------------------------------------------------------------------------------------
def test_a_single_send_hands_one_message_over_and_answers_its_receipt():
    front = FakeFront()
    front.messaging.receipts = [SendReceipt("ID1", "T", 2, 41, 9000)]
    props = p.encode_properties({"TAGS": "a", "WAIT": "true", "UNIQ_KEY": "U1"})
    r = answer(front, req(p.SEND_MESSAGE, {"producerGroup": "pg", "topic": "T", "queueId": "2", "properties": props,
                                           "bornTimestamp": "123", "flag": "5"}, b"hello"))
    assert r.code == p.SUCCESS, r.remark
    assert r.ext["msgId"] == offset_msg_id(STORE_ADDR, PORT, 9000)
    assert (r.ext["queueId"], r.ext["queueOffset"]) == ("2", "41")
    [(name, (topic, items, qid, rules))] = front.messaging.calls
    assert (name, topic, qid, rules) == ("send", "T", 2, ROCKETMQ4_RULES)
    [o] = items
    assert o.body == b"hello" and o.born_ts == 123
    # as RocketMQ's broker stores a message sent alone: no WAIT, the cluster's name, the flag kept
    assert o.properties == {"TAGS": "a", "UNIQ_KEY": "U1", "CLUSTER": "txmq", messages.PROP_FLAG: "5"}


def test_a_send_v2_with_no_born_time_takes_the_services_clock():
    front = FakeFront()
    front.messaging.receipts = [SendReceipt("ID1", "T", 0, 0, 77)]
    r = answer(front, req(p.SEND_MESSAGE_V2, {"a": "pg", "b": "T", "e": "-1", "i": ""}, b"x"))
    assert r.code == p.SUCCESS, r.remark
    [(_, (_, [o], qid, _))] = front.messaging.calls
    assert o.born_ts == front.messaging.now_ms() and qid == -1


def test_a_batch_hands_every_message_over_and_answers_their_ids_in_order():
    front = FakeFront()
    front.messaging.receipts = [SendReceipt("A", "T", 1, 10, 500), SendReceipt("B", "T", 1, 11, 600)]
    body = p.encode_batch([(b"one", {"KEYS": "k1"}, 0), (b"two", {"KEYS": "k2"}, 3)])
    r = answer(front, req(p.SEND_BATCH_MESSAGE, {"producerGroup": "pg", "topic": "T", "queueId": "1", "properties": ""}, body))
    assert r.code == p.SUCCESS, r.remark
    assert r.ext["msgId"] == f"{offset_msg_id(STORE_ADDR, PORT, 500)},{offset_msg_id(STORE_ADDR, PORT, 600)}"
    assert (r.ext["queueId"], r.ext["queueOffset"]) == ("1", "10")
    [(_, (topic, items, qid, rules))] = front.messaging.calls
    assert (topic, qid, rules) == ("T", 1, ROCKETMQ4_RULES)
    assert [(o.body, o.properties) for o in items] == [(b"one", {"KEYS": "k1", "CLUSTER": "txmq"}),
                                                       (b"two", {"KEYS": "k2", "CLUSTER": "txmq", messages.PROP_FLAG: "3"})]


def test_a_transactional_message_in_a_batch_is_refused_before_the_service_is_called():
    front = FakeFront()
    body = p.encode_batch([(b"one", {"TRAN_MSG": "true"}, 0)])
    r = answer(front, req(p.SEND_BATCH_MESSAGE, {"producerGroup": "pg", "topic": "T", "properties": ""}, body))
    assert r.code == p.MESSAGE_ILLEGAL and "batch" in r.remark
    assert front.messaging.calls == []


def test_a_half_send_is_marked_transactional_and_answers_the_half_offsets():
    """SEND_MESSAGE with sysFlag TRANSACTION_PREPARED: a half message of the producer group; the client ends it with
    the msgId (the half copy's commit-log offset) and queueOffset (its half offset) it is answered."""
    front = FakeFront()
    front.messaging.receipts = [SendReceipt("U9", "T", 3, 17, 123456, half_offset=17)]
    r = answer(front, req(p.SEND_MESSAGE, {"producerGroup": "pg", "topic": "T", "queueId": "3", "sysFlag": str(p.TRANSACTION_PREPARED_TYPE),
                                           "properties": p.encode_properties({"UNIQ_KEY": "U9"})}, b"order"))
    assert r.code == p.SUCCESS, r.remark
    assert r.ext["msgId"] == offset_msg_id(STORE_ADDR, PORT, 123456)
    assert (r.ext["queueId"], r.ext["queueOffset"]) == ("3", "17")
    assert "transactionId" not in r.ext  # as RocketMQ 4.9.8's broker answers
    [(_, (_, [o], _, _))] = front.messaging.calls
    assert o.properties["TRAN_MSG"] == "true" and o.properties["PGROUP"] == "pg"


# ---- ending transactions ----------------------------------------------------------------------------
@pytest.mark.parametrize("outcome, remark", [
    (EndOutcome("U9", EndStatus.DECIDED, "committed"), "transaction U9 committed"),
    (EndOutcome("U9", EndStatus.ALREADY, "rolled_back", "check"), "transaction U9 was already rolled_back (by check)"),
    (EndOutcome("U9", EndStatus.UNCHANGED, "pending"),
     "transaction U9 stays pending: the resolution is neither COMMIT nor ROLLBACK"),
])
def test_end_transaction_answers_the_outcome_in_its_remark(outcome, remark):
    front = FakeFront()
    front.messaging.outcome = outcome
    r = answer(front, req(p.END_TRANSACTION, {"producerGroup": "pg", "commitLogOffset": "123456", "tranStateTableOffset": "17",
                                              "commitOrRollback": "8", "msgId": "U9"}))
    assert (r.code, r.remark) == (p.SUCCESS, remark)


@pytest.mark.parametrize("kind, state", [("8", "commit"), ("12", "rollback"), ("0", "unknown")])
def test_end_transaction_hands_the_state_the_offsets_and_the_source_over(kind, state):
    front = FakeFront()
    front.messaging.outcome = EndOutcome("U9", EndStatus.DECIDED, "committed")
    answer(front, req(p.END_TRANSACTION, {"producerGroup": "pg", "commitLogOffset": "5", "tranStateTableOffset": "6",
                                          "commitOrRollback": kind, "transactionId": "U9", "msgId": "OTHER",
                                          "fromTransactionCheck": "true"}))
    assert front.messaging.calls == [("end_transaction", ("pg", "U9", 5, 6, state, "check"))]


# ---- pulling --------------------------------------------------------------------------------------------
def _stored(offset: int, tags: str) -> dict[str, Any]:
    return {"topic": "T", "queue_id": 0, "queue_offset": offset, "commit_log_offset": 1000 + offset, "tx_type": 0, "born_ts": 1,
            "store_ts": 2, "prepared_offset": -1, "properties": {"TAGS": tags}, "body": b"m%d" % offset}


def pull(front: FakeFront, result: PullResult, offset: int = 5, **ext: str) -> p.Command:
    front.messaging.pulled = result
    return answer(front, req(p.PULL_MESSAGE, {"consumerGroup": "cg", "topic": "T", "queueId": "0", "queueOffset": str(offset),
                                              "maxMsgNums": "32", "sysFlag": "0", **ext}))


def test_a_pull_that_found_messages_answers_them_and_the_next_offset():
    front = FakeFront()
    found = [_stored(5, "a"), _stored(6, "b")]
    r = pull(front, PullResult(PullStatus.FOUND, found, 7, 0, 9))
    assert r.code == p.SUCCESS
    assert (r.ext["nextBeginOffset"], r.ext["minOffset"], r.ext["maxOffset"]) == ("7", "0", "9")
    assert r.body == encode_maps(found, STORE_ADDR, PORT)


@pytest.mark.parametrize("status, code, next_offset", [
    (PullStatus.NO_MESSAGE, p.PULL_NOT_FOUND, "5"),  # the client pulls again from where it was
    (PullStatus.OFFSET_TOO_SMALL, p.PULL_OFFSET_MOVED, "2"),  # to the queue's first message
    (PullStatus.OFFSET_OVERFLOW, p.PULL_OFFSET_MOVED, "9"),  # to the queue's end
    (PullStatus.NO_QUEUE, p.PULL_NOT_FOUND, "0"),
])
def test_each_pull_status_has_its_response_code_and_next_offset(status, code, next_offset):
    r = pull(FakeFront(), PullResult(status, [], 5, 2, 9))
    assert r.code == code, r.remark
    assert r.ext["nextBeginOffset"] == next_offset
    assert (r.ext["minOffset"], r.ext["maxOffset"]) == ("2", "9")


def test_a_pull_whose_messages_the_subscription_filters_out_is_retried_from_past_them():
    front = FakeFront()
    r = pull(front, PullResult(PullStatus.FOUND, [_stored(5, "a")], 6, 0, 9), sysFlag=str(p.PULL_SUBSCRIPTION), subscription="b || c")
    assert (r.code, r.ext["nextBeginOffset"]) == (p.PULL_RETRY_IMMEDIATELY, "6")
    r = pull(front, PullResult(PullStatus.FOUND, [_stored(5, "a"), _stored(6, "c")], 7, 0, 9), sysFlag=str(p.PULL_SUBSCRIPTION),
             subscription="b || c")
    assert r.code == p.SUCCESS and r.body == encode_maps([_stored(6, "c")], STORE_ADDR, PORT)


def _with_props(offset: int, **props: str) -> dict[str, Any]:
    m = _stored(offset, "t")
    m["properties"] = {"TAGS": "t", **props}
    return m


def test_a_pull_with_a_sql92_subscription_answers_the_messages_whose_properties_match():
    front = FakeFront()
    found = [_with_props(5, a="1", region="eu"), _with_props(6, a="7", region="eu"), _with_props(7, region="us")]
    r = pull(front, PullResult(PullStatus.FOUND, found, 8, 0, 9), sysFlag=str(p.PULL_SUBSCRIPTION), expressionType="SQL92",
             subscription="a > 5 OR region = 'us'")
    assert r.code == p.SUCCESS and r.body == encode_maps(found[1:], STORE_ADDR, PORT)
    r = pull(front, PullResult(PullStatus.FOUND, found[:1], 6, 0, 9), sysFlag=str(p.PULL_SUBSCRIPTION), expressionType="SQL92",
             subscription="a IS NULL")
    assert (r.code, r.ext["nextBeginOffset"]) == (p.PULL_RETRY_IMMEDIATELY, "6")


def test_a_pull_uses_the_sql92_subscription_of_the_groups_heartbeat():
    front = FakeFront()
    front.messaging.ensure_topic = lambda *a: None
    front.messaging.register_consumer = lambda *a: None
    hb = {"clientID": "c1", "consumerDataSet": [{"groupName": "cg", "messageModel": "CLUSTERING", "subscriptionDataSet": [
        {"topic": "T", "subString": "region IN ('eu')", "expressionType": "SQL92"}]}]}
    assert answer(front, req(p.HEART_BEAT, {}, json.dumps(hb).encode())).code == p.SUCCESS
    found = [_with_props(5, region="eu"), _with_props(6, region="us")]
    r = pull(front, PullResult(PullStatus.FOUND, found, 7, 0, 9), expressionType="SQL92")
    assert r.code == p.SUCCESS and r.body == encode_maps(found[:1], STORE_ADDR, PORT)


def test_a_malformed_sql92_subscription_is_a_parse_failure_when_checked_and_when_pulled():
    front = FakeFront()
    body = json.dumps({"clientId": "c1", "group": "cg", "subscriptionData": {
        "topic": "T", "subString": "a BETWEEN 5 AND", "expressionType": "SQL92"}}).encode()
    r = answer(front, req(p.CHECK_CLIENT_CONFIG, {}, body))
    assert r.code == p.SUBSCRIPTION_PARSE_FAILED and "does not compile" in r.remark
    ok_body = body.replace(b"a BETWEEN 5 AND", b"a BETWEEN 5 AND 6")
    assert answer(front, req(p.CHECK_CLIENT_CONFIG, {}, ok_body)).code == p.SUCCESS
    r = pull(front, PullResult(PullStatus.FOUND, [_with_props(5, a="1")], 6, 0, 9), sysFlag=str(p.PULL_SUBSCRIPTION),
             expressionType="SQL92", subscription="a >")
    assert r.code == p.SUBSCRIPTION_PARSE_FAILED
    assert front.messaging.calls == []  # refused before reading


def test_a_pull_with_an_expression_type_txmq_does_not_serve_is_refused():
    r = pull(FakeFront(), PullResult(PullStatus.NO_MESSAGE, [], 5, 0, 9), sysFlag=str(p.PULL_SUBSCRIPTION), expressionType="CLASS",
             subscription="x")
    assert r.code == p.INVALID_PARAMETER


def test_a_pull_carrying_the_groups_offset_commits_it_without_waiting():
    front = FakeFront()
    pull(front, PullResult(PullStatus.NO_MESSAGE, [], 5, 0, 9), sysFlag=str(p.PULL_COMMIT_OFFSET), commitOffset="4")
    assert front.messaging.offsets == {("cg", "T", 0): 4}


def test_a_pull_of_a_topic_the_broker_does_not_have_is_topic_not_exist():
    front = FakeFront()
    r = answer(front, req(p.PULL_MESSAGE, {"consumerGroup": "cg", "topic": "Nope", "queueId": "0", "queueOffset": "0"}))
    assert r.code == p.TOPIC_NOT_EXIST and "Nope" in r.remark
    assert front.messaging.calls == []


# ---- errors ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("code, rmq", [
    (ErrorCode.INVALID_FIELD, p.INVALID_PARAMETER),
    (ErrorCode.INVALID_TOPIC, p.INVALID_PARAMETER),
    (ErrorCode.NO_SUCH_QUEUE, p.INVALID_PARAMETER),
    (ErrorCode.BODY_TOO_LARGE, p.MESSAGE_ILLEGAL),
    (ErrorCode.MESSAGE_TYPE_NOT_ACCEPTED, p.MESSAGE_ILLEGAL),
    (ErrorCode.SYSTEM_TOPIC, p.NO_PERMISSION),
    (ErrorCode.AUTH_FAILED, p.NO_PERMISSION),
    (ErrorCode.NO_SUCH_TOPIC, p.TOPIC_NOT_EXIST),
    (ErrorCode.STORE_FULL, p.SERVICE_NOT_AVAILABLE),
    (ErrorCode.SHUTTING_DOWN, p.SYSTEM_BUSY),
    (ErrorCode.BUSY, p.SYSTEM_BUSY),
    (ErrorCode.TX_NOT_FOUND, p.SYSTEM_ERROR),  # the others: SYSTEM_ERROR, with txmq's code in the remark
])
def test_error_response_maps_txmq_codes_to_rocketmq_response_codes(code, rmq):
    m = FakeMessaging()
    r = error_response(m, req(p.SEND_MESSAGE, {}), TxmqError("why", code))
    assert (r.code, r.remark) == (rmq, f"{code.name}: why")
    assert r.flag & p.RESPONSE_FLAG and r.opaque == 7
    assert m.metrics.counters == {"remoting_errors": 1}


def test_error_response_words_unreadable_messages_bodies_and_the_services_own_errors():
    m = FakeMessaging()
    cmd = req(p.SEND_MESSAGE, {})
    r = error_response(m, cmd, MessageFormatError("the batch body holds no message"))
    assert (r.code, r.remark) == (p.MESSAGE_ILLEGAL, "the batch body holds no message")
    r = error_response(m, cmd, p.BodyError("not a JSON object"))
    assert (r.code, r.remark) == (p.INVALID_PARAMETER, "INVALID_FIELD: not a JSON object")
    r = error_response(m, cmd, RuntimeError("a bug"))  # the service words it (Messaging.error_of)
    assert r.code == p.SYSTEM_ERROR and r.remark == "INTERNAL: internal error: RuntimeError('a bug')"
    assert m.metrics.counters == {"remoting_errors": 3}


@pytest.mark.parametrize("code, ext, says", [
    (p.PULL_MESSAGE, {"consumerGroup": "cg", "topic": "T", "queueId": "x", "queueOffset": "0"}, "'queueId' is not an integer"),
    (p.PULL_MESSAGE, {"topic": "T", "queueId": "0", "queueOffset": "0"}, "'consumerGroup' is missing"),
    (p.PULL_MESSAGE, {"consumerGroup": "cg", "topic": "T", "queueId": "0", "queueOffset": "-1"}, "'queueOffset' must be between 0"),
    (p.SEND_MESSAGE, {"producerGroup": "pg", "topic": "T", "queueId": "100000"}, "'queueId' must be between -1"),
    (p.SEND_MESSAGE, {"producerGroup": "pg", "topic": "T", "bornTimestamp": "soon"}, "'bornTimestamp' is not an integer"),
    (p.END_TRANSACTION, {"producerGroup": "pg", "commitLogOffset": "1", "tranStateTableOffset": "2", "commitOrRollback": "4",
                         "msgId": "U"}, "commitOrRollback must be 8 (commit), 12 (rollback) or 0 (unknown), not 4"),
    (p.END_TRANSACTION, {"producerGroup": "pg", "commitLogOffset": "1", "tranStateTableOffset": "2", "commitOrRollback": "8"},
     "the transaction is not named"),
    (p.UPDATE_CONSUMER_OFFSET, {"consumerGroup": "bad group", "topic": "T", "queueId": "0", "commitOffset": "1"}, "not a group name"),
])
def test_bad_header_fields_are_invalid_parameter_and_reach_no_service(code, ext, says):
    front = FakeFront()
    r = answer(front, req(code, ext, b"x"))
    assert r.code == p.INVALID_PARAMETER, r.remark
    assert r.remark.startswith("INVALID_FIELD: ") and says in r.remark, r.remark
    assert front.messaging.calls == []


# ---- what the front end takes of the broker ---------------------------------------------------------------------
def test_the_tx_types_the_stored_message_encoding_writes_are_the_stores():
    assert (messages.TX_NORMAL, messages.TX_PREPARED, messages.TX_COMMIT) == (TxType.NORMAL, TxType.PREPARED, TxType.COMMIT)


def test_a_json_header_is_written_with_its_keys_in_the_order_rocketmqs_fastjson_writes_them():
    """Apache's Java client (fastjson) reads a header in sorted key order on its fast path; any other order takes a
    reflective slow path its JIT then compiles."""
    import struct

    for remark in ("", "why"):
        frame = p.encode(p.response(req(p.SEND_MESSAGE, {}), p.SUCCESS, ext={"msgId": "X", "queueId": "1"}, remark=remark))
        (_, mark) = struct.unpack_from(">ii", frame)
        header = frame[8 : 8 + (mark & 0xFFFFFF)]
        keys = [k for k, _ in json.loads(header, object_pairs_hook=lambda pairs: pairs)]
        assert keys == sorted(keys) and {"code", "extFields", "flag", "language", "opaque", "serializeTypeCurrentRPC", "version"} <= set(keys)
        assert ("remark" in keys) == bool(remark)
