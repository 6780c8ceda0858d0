"""Apache RocketMQ's official Node.js SDK (rocketmq-client-nodejs, pinned in tests/sdkenv.py) against txmq's gRPC front end.

The SDK is `npm install`ed once into .cache/sdk-venvs/ and driven by tests/sdk/node_scenario.js; the broker
is a real `txmq broker start --rocketmq-port` process. Skipped where node/npm are missing or the package cannot
be installed; an installed SDK that misbehaves fails the test.
"""

from __future__ import annotations

import time

import pytest

from clihelpers import lines, ok, txmq
from sdkenv import create_topics, node_scenario, node_sdk_dir, self_signed_cert, start_rocketmq_broker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first test may build the SDK environment


@pytest.fixture(scope="module")
def sdk_node():
    return node_sdk_dir()


@pytest.fixture(scope="module")
def broker(sdk_node, tmp_path_factory):
    b, endpoint = start_rocketmq_broker(tmp_path_factory.mktemp("node-sdk"))
    yield b, endpoint
    b.stop()


def test_node_sdk_commit_rollback_and_check_back_deliver_exactly_the_committed_messages(sdk_node, broker, tmp_path):
    b, endpoint = broker
    topic, group = "NodeSdkTx", "node-sdk-consumers"
    create_topics(b, topic)
    r = node_scenario(sdk_node, "transactions", tmp_path / "home", "--endpoint", endpoint, "--topic", topic, "--group", group)
    sent = r["sent"]
    commit, orphan = f"commit-{topic}", f"orphan-{topic}"
    # the receipt's transaction id is the message id, as RocketMQ gives it
    for k in ("commit", "rollback", "orphan"):
        assert sent[k]["message_id"] and sent[k]["transaction_id"] == sent[k]["message_id"], sent

    assert r["orphan_checked"], f"no check-back reached the SDK's checker: {r['checks']}"
    orphan_checks = [c for c in r["checks"] if c["body"] == orphan]
    assert orphan_checks[0]["message_id"] == sent["orphan"]["message_id"]
    assert orphan_checks[0]["topic"] == topic
    assert orphan_checks[0]["properties"].get("__transactionId__") == sent["orphan"]["transaction_id"]

    received = r["received"]
    assert sorted(m["body"] for m in received) == sorted([commit, orphan]), received
    by_body = {m["body"]: m for m in received}
    assert by_body[commit]["message_id"] == sent["commit"]["message_id"]
    assert by_body[commit]["tag"] == "sdk"
    assert by_body[commit]["keys"] == ["k-commit"]
    assert by_body[commit]["properties"].get("origin") == "node-sdk"
    # RocketMQ's own Node.js SDK test asserts this against RocketMQ: the transaction id in __transactionId__
    assert by_body[commit]["properties"].get("__transactionId__") == sent["commit"]["transaction_id"]
    assert by_body[orphan]["properties"].get("__transactionId__") == sent["orphan"]["transaction_id"]
    for m in received:
        assert not m["corrupted"], f"the SDK's body digest check failed: {m}"
        assert m["delivery_attempt"] == 1
        assert m["has_receipt_handle"]

    assert lines(ok(txmq("inspect", "half", "--topic", topic, "-o", "jsonl", broker=b.address))) == []
    stored = lines(ok(txmq("read", topic, "-o", "jsonl", broker=b.address)))
    assert sorted(m["body"] for m in stored) == sorted([commit, orphan])


def test_node_sdk_messages_and_native_messages_cross_over(sdk_node, broker, tmp_path):
    b, endpoint = broker
    topic = "NodeCrossOver"
    create_topics(b, topic)
    r = node_scenario(sdk_node, "send", tmp_path / "home", "--endpoint", endpoint, "--topic", topic, "--count", "2", "--body", "node")
    bodies = sorted(s["body"] for s in r["sent"])
    assert all(s["transaction_id"] == s["message_id"] for s in r["sent"]), r["sent"]  # a normal send's receipt too
    stored = lines(ok(txmq("read", topic, "-o", "jsonl", broker=b.address)))
    assert sorted(m["body"] for m in stored) == bodies
    assert "__transactionId__" not in {k for m in stored for k in m["properties"]}
    assert {m["tags"] for m in stored} == {"sdk-tag"}
    assert {m["properties"].get("origin") for m in stored} == {"node-sdk"}

    ok(txmq("send", topic, "native-plain", "--tag", "native", "--prop", "origin=txmq", broker=b.address))
    got = node_scenario(sdk_node, "receive", tmp_path / "home2", "--endpoint", endpoint, "--topic", topic,
                        "--group", "node-reads-all", "--expect", "3")
    received = {m["body"]: m for m in got["received"]}
    assert sorted(received) == sorted([*bodies, "native-plain"])
    assert received["native-plain"]["tag"] == "native"
    assert received["native-plain"]["properties"].get("origin") == "txmq"
    assert all(not m["corrupted"] for m in got["received"])


def test_node_sdk_push_consumer_gets_a_failed_message_again(sdk_node, broker, tmp_path):
    b, endpoint = broker
    topic = "NodeSdkPush"
    for body in ("push-0", "push-1", "retry-me"):
        ok(txmq("send", topic, body, "--tag", "native", broker=b.address))
    r = node_scenario(sdk_node, "push", tmp_path / "home", "--endpoint", endpoint, "--topic", topic, "--group", "node-push",
                      "--expect", "3", "--fail-first", "retry-me")
    assert r["all_consumed"], r["deliveries"]
    by_body: dict[str, list] = {}
    for d in r["deliveries"]:
        by_body.setdefault(d["body"], []).append(d)
    assert sorted(by_body) == ["push-0", "push-1", "retry-me"]
    retry = by_body["retry-me"]
    assert [d["result"] for d in retry] == ["FAILURE", "SUCCESS"]
    assert retry[0]["delivery_attempt"] == 1 and retry[1]["delivery_attempt"] == 2
    assert retry[0]["message_id"] == retry[1]["message_id"]
    for body in ("push-0", "push-1"):
        assert [(d["result"], d["delivery_attempt"]) for d in by_body[body]] == [("SUCCESS", 1)]
    assert not any(d["corrupted"] for d in r["deliveries"])


def test_node_sdk_sends_and_receives_over_tls(sdk_node, tmp_path):
    cert, key = self_signed_cert(tmp_path / "tls")
    b, endpoint = start_rocketmq_broker(tmp_path / "broker", "--rocketmq-tls-cert", str(cert), "--rocketmq-tls-key", str(key))
    try:
        topic, roots = "NodeSdkTls", {"NODE_EXTRA_CA_CERTS": str(cert), "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(cert)}
        create_topics(b, topic)
        r = node_scenario(sdk_node, "send", tmp_path / "home", "--endpoint", endpoint, "--topic", topic, "--count", "2",
                          "--tls", "true", env=roots)
        bodies = sorted(x["body"] for x in r["sent"])
        assert sorted(m["body"] for m in lines(ok(txmq("read", topic, "-o", "jsonl", broker=b.address)))) == bodies
        got = node_scenario(sdk_node, "receive", tmp_path / "home2", "--endpoint", endpoint, "--topic", topic,
                            "--group", "node-tls", "--expect", "2", "--tls", "true", env=roots)
        assert sorted(m["body"] for m in got["received"]) == bodies
    finally:
        b.stop()


def test_node_sdk_signs_with_the_auth_token_as_secret_key_and_a_wrong_one_is_refused(sdk_node, tmp_path):
    token = "s3cret-token"
    b, endpoint = start_rocketmq_broker(tmp_path / "broker", "--auth-token", token)
    try:
        topic = "NodeSdkAuth"
        ok(txmq("topics", "create", topic, broker=b.address, env={"TXMQ_AUTH_TOKEN": token}))
        bad = node_scenario(sdk_node, "send", tmp_path / "home0", "--endpoint", endpoint, "--topic", topic, "--count", "1",
                            "--access-key", "app", "--secret-key", "wrong", "--deadline", "60000", allow_errors=True)
        assert bad["errors"] and "sent" not in bad, bad
        assert "40100" in bad["_sdk_log"], "the SDK was not refused with UNAUTHORIZED"
        r = node_scenario(sdk_node, "send", tmp_path / "home", "--endpoint", endpoint, "--topic", topic, "--count", "2",
                          "--access-key", "app", "--secret-key", token)
        stored = lines(ok(txmq("read", topic, "-o", "jsonl", broker=b.address, env={"TXMQ_AUTH_TOKEN": token})))
        assert sorted(m["body"] for m in stored) == sorted(x["body"] for x in r["sent"])
    finally:
        b.stop()


def test_node_sdk_delayed_messages_arrive_at_their_time(sdk_node, broker, tmp_path):
    b, endpoint = broker
    topic = "NodeSdkDelay"
    ok(txmq("topics", "create", topic, "--message-types", "normal,delay", broker=b.address))
    r = node_scenario(sdk_node, "delay", tmp_path / "home", "--endpoint", endpoint, "--topic", topic, "--group", "node-delay",
                      "--count", "3", "--delay-ms", "3000", "--expect", "3", "--await-duration", "1000", "--receive-wait", "20000")
    sent = {x["message_id"]: x for x in r["sent"]}
    got = r["received"]
    assert sorted(m["message_id"] for m in got) == sorted(sent)
    for m in got:
        due = sent[m["message_id"]]["due_ms"]
        assert m["delivery_timestamp"] == due
        assert due - 50 <= m["received_ms"] <= due + 2500, (m["received_ms"] - due, m)
        assert m["tag"] == "timeout"


def test_node_sdk_delayed_messages_due_while_the_broker_was_stopped_arrive_after_the_start(sdk_node, tmp_path):
    b, endpoint = start_rocketmq_broker(tmp_path / "broker")
    try:
        topic = "NodeSdkDelayDown"
        ok(txmq("topics", "create", topic, "--message-types", "normal,delay", broker=b.address))
        r = node_scenario(sdk_node, "delay", tmp_path / "home", "--endpoint", endpoint, "--topic", topic,
                          "--count", "2", "--delay-ms", "1500", "--expect", "0")
        b.stop()
        time.sleep(2.0)
        b.start()
        got = node_scenario(sdk_node, "receive", tmp_path / "home2", "--endpoint", endpoint, "--topic", topic,
                            "--group", "node-delay-down", "--expect", "2", "--await-duration", "1000", "--settle", "1000")
        assert sorted(m["message_id"] for m in got["received"]) == sorted(x["message_id"] for x in r["sent"])
    finally:
        b.stop()
