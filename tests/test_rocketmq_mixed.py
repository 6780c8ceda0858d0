"""RocketMQ SDK clients and txmq's own tools on the same broker: SDK transactions are txmq transactions.

An SDK producer's transaction left UNKNOWN is resolved with `txmq resolve`; one discarded after max checks is
replayed with `txmq discard replay`; messages an SDK producer sent are read with `txmq read` / `txmq consume`;
a message sent with txmq's native client reaches the SDK's SimpleConsumer. The SDK is the official Python SDK
(tests/sdkenv.py), run in a subprocess of its own environment.
"""

from __future__ import annotations

import json
import zlib

import pytest

from clihelpers import lines, ok, txmq, wait_for
from sdkenv import create_topics, python_scenario, python_sdk_python, start_rocketmq_broker

LOW_CRC_BODY = "low-crc-3"  # zlib.crc32 = 0x0da7074e
assert zlib.crc32(LOW_CRC_BODY.encode()) < 0x10000000

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first test may build the SDK environment


@pytest.fixture(scope="module")
def sdk_python():
    return python_sdk_python()


@pytest.fixture(scope="module")
def broker(sdk_python, tmp_path_factory):
    b, endpoint = start_rocketmq_broker(tmp_path_factory.mktemp("mixed"))
    yield b, endpoint
    b.stop()


def _pending(b, topic: str) -> list[dict]:
    return lines(ok(txmq("inspect", "half", "--topic", topic, "-o", "jsonl", broker=b.address)))


def test_sdk_transaction_left_unknown_is_resolved_with_txmq_resolve(sdk_python, broker, tmp_path):
    b, endpoint = broker
    topic = "MixedResolve"
    create_topics(b, topic)
    r = python_scenario(sdk_python, "half", tmp_path / "home", "--endpoint", endpoint, "--topic", topic)
    body = r["body"]
    # the producer shut down without ending it: pending, visible to txmq's tools
    (row,) = wait_for(lambda: _pending(b, topic), what="the SDK's half message in `txmq inspect half`")
    assert row["topic"] == topic
    assert lines(ok(txmq("read", topic, "-o", "jsonl", broker=b.address))) == []
    # the transaction id the SDK's receipt carries (RocketMQ's: the message id) is the one txmq's commands show and take
    transaction_id = r["sent"]["transaction_id"]
    assert row["tx_id"] == transaction_id == r["sent"]["message_id"]
    doc = json.loads(ok(txmq("inspect", "tx", transaction_id, "-o", "json", broker=b.address)).stdout)
    assert (doc["tx_id"], doc["state"], doc["group"]) == (transaction_id, "pending", topic)

    res = lines(ok(txmq("resolve", transaction_id, "--commit", "--yes", "-o", "jsonl", broker=b.address)))
    assert [(x["tx_id"], x["status"]) for x in res] == [(transaction_id, "ok")]
    assert _pending(b, topic) == []
    (m,) = lines(ok(txmq("read", topic, "-o", "jsonl", broker=b.address)))
    assert m["body"] == body
    assert m["tags"] == "sdk-half"
    assert "k-half" in (m["keys"] if isinstance(m["keys"], str) else " ".join(m["keys"]))
    assert m["properties"].get("origin") == "python-sdk"

    # and the SDK's consumer gets it once
    got = python_scenario(sdk_python, "receive", tmp_path / "home2", "--endpoint", endpoint, "--topic", topic,
                          "--group", "mixed-resolve", "--expect", "1")
    assert [x["body"] for x in got["received"]] == [body]
    assert got["received"][0]["message_id"] == r["sent"]["message_id"]
    assert got["received"][0]["properties"].get("__transactionId__") == transaction_id


def test_sdk_transaction_discarded_after_max_checks_is_replayed_with_txmq_discard_replay(sdk_python, tmp_path):
    b, endpoint = start_rocketmq_broker(tmp_path / "broker", "--max-checks", "2")
    try:
        topic = "MixedDiscard"
        create_topics(b, topic)
        # the producer stays online answering UNKNOWN until it was asked twice
        r = python_scenario(sdk_python, "half", tmp_path / "home", "--endpoint", endpoint, "--topic", topic, "--wait-checks", "2")
        assert r["checked_enough"], f"the broker did not ask the SDK producer twice: {r['checks']}"
        assert all(c["message_id"] == r["sent"]["message_id"] for c in r["checks"])

        def discarded():
            return [d for d in lines(ok(txmq("discard", "list", "-o", "jsonl", broker=b.address))) if d["topic"] == topic]

        (d,) = wait_for(discarded, timeout=20, what="the SDK's transaction in `txmq discard list`")
        assert d["reason"] == "max-checks"
        assert _pending(b, topic) == []
        assert lines(ok(txmq("read", topic, "-o", "jsonl", broker=b.address))) == []

        res = lines(ok(txmq("discard", "replay", d["tx_id"], "--to", "commit", "--yes", "-o", "jsonl", broker=b.address)))
        assert [x["status"] for x in res] == ["ok"]
        (m,) = lines(ok(txmq("read", topic, "-o", "jsonl", broker=b.address)))
        assert m["body"] == r["body"]
    finally:
        b.stop()


def test_sdk_sent_messages_are_read_with_txmq_read_and_consume(sdk_python, broker, tmp_path):
    b, endpoint = broker
    topic = "MixedSdkToNative"
    create_topics(b, topic)
    r = python_scenario(sdk_python, "send", tmp_path / "home", "--endpoint", endpoint, "--topic", topic, "--count", "3",
                        "--body", "py")
    bodies = [s["body"] for s in r["sent"]]
    assert all(s["transaction_id"] == s["message_id"] for s in r["sent"]), r["sent"]  # a normal send's receipt, as RocketMQ's
    stored = lines(ok(txmq("read", topic, "-o", "jsonl", broker=b.address)))
    assert sorted(m["body"] for m in stored) == sorted(bodies)
    for m in stored:
        i = m["body"].rsplit("-", 1)[1]
        assert m["tags"] == "sdk-tag"
        assert f"key-{i}" in (m["keys"] if isinstance(m["keys"], str) else " ".join(m["keys"]))
        assert m["properties"].get("origin") == "python-sdk"
        assert m["properties"].get("n") == i
    consumed = lines(ok(txmq("consume", topic, "--group", "native-audit", "-o", "jsonl", broker=b.address)))
    assert sorted(m["body"] for m in consumed) == sorted(bodies)


def test_native_client_messages_reach_the_sdk_simple_consumer(sdk_python, broker, tmp_path):
    b, endpoint = broker
    topic = "MixedNativeToSdk"
    ok(txmq("send", topic, "native-plain", "--tag", "native", "--key", "nk1", "--prop", "origin=txmq", broker=b.address))
    ok(txmq("send", topic, "native-tx", "--tx", "--group", "native-shop", "--state", "commit", broker=b.address))
    ok(txmq("send", topic, "native-rolled-back", "--tx", "--group", "native-shop", "--state", "rollback", broker=b.address))
    # its CRC32 is below 0x10000000: written as 8 hex digits for the Python SDK, whose digest check pads to 8
    ok(txmq("send", topic, LOW_CRC_BODY, broker=b.address))
    got = python_scenario(sdk_python, "receive", tmp_path / "home", "--endpoint", endpoint, "--topic", topic,
                          "--group", "sdk-reads-native", "--expect", "3")
    received = {m["body"]: m for m in got["received"]}
    assert sorted(received) == sorted(["native-plain", "native-tx", LOW_CRC_BODY])
    plain = received["native-plain"]
    assert plain["tag"] == "native"
    assert plain["keys"] == ["nk1"]
    assert plain["properties"].get("origin") == "txmq"
    assert all(not m["corrupted"] and m["message_id"] for m in got["received"])


def test_orphan_of_a_crashed_sdk_producer_is_resolved_by_another_producer_of_its_topic(sdk_python, broker, tmp_path):
    b, endpoint = broker
    topic = "MixedCrashedProducer"
    create_topics(b, topic)
    body = f"orphan-of-crash-{topic}"
    r = python_scenario(sdk_python, "half", tmp_path / "home", "--endpoint", endpoint, "--topic", topic, "--body", body, "--crash")
    (row,) = wait_for(lambda: _pending(b, topic), what="the crashed producer's half message in `txmq inspect half`")
    assert lines(ok(txmq("read", topic, "-o", "jsonl", broker=b.address))) == []
    # the topic is the SDK producers' group: a new producer of the topic is asked about the orphan and commits it
    c = python_scenario(sdk_python, "checker", tmp_path / "home2", "--endpoint", endpoint, "--topic", topic, "--body", body)
    assert c["checked"], c["checks"]
    assert c["checks"][0]["message_id"] == r["sent"]["message_id"]
    wait_for(lambda: _pending(b, topic) == [], what="the transaction to be decided")
    (m,) = lines(ok(txmq("read", topic, "-o", "jsonl", broker=b.address)))
    assert m["body"] == body and m["tx_id"] == row["tx_id"]
