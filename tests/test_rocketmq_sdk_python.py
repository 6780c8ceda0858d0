"""Apache RocketMQ's official Python SDK (rocketmq-python-client, pinned in tests/sdkenv.py) against txmq's gRPC front end.

The SDK runs in a virtual environment of its own (built once, cached under .cache/sdk-venvs/) and in a
subprocess (tests/sdk/python_scenario.py); the broker is a real `txmq broker start --rocketmq-port` process.
Skipped only when the SDK cannot be installed; an installed SDK that misbehaves fails the test.
"""

from __future__ import annotations

import json

import pytest

from clihelpers import lines, ok, txmq
from sdkenv import create_topics, python_scenario, python_sdk_python, self_signed_cert, start_rocketmq_broker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first test may build the SDK environment


@pytest.fixture(scope="module")
def sdk_python():
    return python_sdk_python()


@pytest.fixture(scope="module")
def broker(sdk_python, tmp_path_factory):
    b, endpoint = start_rocketmq_broker(tmp_path_factory.mktemp("py-sdk"))
    yield b, endpoint
    b.stop()


def test_python_sdk_commit_rollback_and_check_back_deliver_exactly_the_committed_messages(sdk_python, broker, tmp_path):
    b, endpoint = broker
    topic, group = "PySdkTx", "py-sdk-consumers"
    create_topics(b, topic)
    r = python_scenario(sdk_python, "transactions", tmp_path / "home", "--endpoint", endpoint, "--topic", topic, "--group", group)
    sent = r["sent"]
    commit, rollback, orphan = f"commit-{topic}", f"rollback-{topic}", f"orphan-{topic}"

    # every send got one receipt with the SDK's own message id, which is also its transaction id, as RocketMQ gives it
    for k in ("commit", "rollback", "orphan"):
        assert sent[k]["message_id"] and sent[k]["transaction_id"] == sent[k]["message_id"], sent
    assert len({sent[k]["message_id"] for k in sent}) == 3

    # (3) the orphan (no end sent) was asked about over the producer's Telemetry stream, with its own message
    assert r["orphan_checked"], f"no check-back reached the SDK's TransactionChecker: {r['checks']}"
    orphan_checks = [c for c in r["checks"] if c["body"] == orphan]
    assert orphan_checks[0]["topic"] == topic
    assert orphan_checks[0]["message_id"] == sent["orphan"]["message_id"]
    assert orphan_checks[0]["properties"].get("__transactionId__") == sent["orphan"]["transaction_id"]

    # (4) the SimpleConsumer got the committed one and the check-back-committed one, once each, nothing else
    received = r["received"]
    assert sorted(m["body"] for m in received) == sorted([commit, orphan]), f"({rollback} was rolled back) {received}"
    by_body = {m["body"]: m for m in received}
    assert by_body[commit]["message_id"] == sent["commit"]["message_id"]
    assert by_body[orphan]["message_id"] == sent["orphan"]["message_id"]
    assert by_body[commit]["tag"] == "sdk"
    assert by_body[commit]["keys"] == ["k-commit"]
    assert by_body[commit]["properties"].get("origin") == "python-sdk"
    # a committed message carries its transaction id in the __transactionId__ property, as RocketMQ delivers it
    assert by_body[commit]["properties"].get("__transactionId__") == sent["commit"]["transaction_id"]
    assert by_body[orphan]["properties"].get("__transactionId__") == sent["orphan"]["transaction_id"]
    for m in received:
        assert m["topic"] == topic
        assert not m["corrupted"], f"the SDK's body digest check failed: {m}"
        assert m["delivery_attempt"] == 1
        assert m["has_receipt_handle"]

    # the broker agrees: nothing pending for the topic, exactly the two committed messages stored under it
    assert [t for t in lines(ok(txmq("inspect", "half", "--topic", topic, "-o", "jsonl", broker=b.address)))] == []
    stored = lines(ok(txmq("read", topic, "-o", "jsonl", broker=b.address)))
    assert sorted(m["body"] for m in stored) == sorted([commit, orphan])


def _send_native(b, topic: str, *bodies: str) -> None:
    for body in bodies:
        ok(txmq("send", topic, body, "--tag", "native", broker=b.address))


def test_python_sdk_push_consumer_gets_a_failed_message_again_with_the_next_delivery_attempt(sdk_python, broker, tmp_path):
    b, endpoint = broker
    topic = "PySdkPush"
    _send_native(b, topic, "push-0", "push-1", "retry-me")
    r = python_scenario(sdk_python, "push", tmp_path / "home", "--endpoint", endpoint, "--topic", topic, "--group", "py-push",
                        "--expect", "3", "--fail-first", "retry-me")
    assert r["all_consumed"], r["deliveries"]
    by_body: dict[str, list] = {}
    for d in r["deliveries"]:
        by_body.setdefault(d["body"], []).append(d)
    assert sorted(by_body) == ["push-0", "push-1", "retry-me"]
    assert [(d["result"], d["delivery_attempt"]) for d in by_body["retry-me"]] == [("FAILURE", 1), ("SUCCESS", 2)]
    assert len({d["message_id"] for d in by_body["retry-me"]}) == 1
    for body in ("push-0", "push-1"):
        assert [(d["result"], d["delivery_attempt"]) for d in by_body[body]] == [("SUCCESS", 1)]
    assert not any(d["corrupted"] for d in r["deliveries"])
    # everything acked: the group is caught up
    r2 = python_scenario(sdk_python, "receive", tmp_path / "home2", "--endpoint", endpoint, "--topic", topic, "--group", "py-push",
                         "--expect", "0", "--settle", "1")
    assert r2["received"] == []


def test_python_sdk_change_invisible_duration_brings_a_message_back_under_a_new_receipt_handle(sdk_python, broker, tmp_path):
    b, endpoint = broker
    topic = "PySdkInvisible"
    _send_native(b, topic, "come-back")
    r = python_scenario(sdk_python, "invisible", tmp_path / "home", "--endpoint", endpoint, "--topic", topic, "--group", "py-inv")
    (first,) = r["first"]
    assert (first["body"], first["delivery_attempt"]) == ("come-back", 1)
    assert r["handle_changed"]
    (again,) = r["again"]
    assert (again["body"], again["message_id"], again["delivery_attempt"]) == ("come-back", first["message_id"], 2)
    # 1 s and a receive, against the 30 s it was first made invisible for: the bound leaves a loaded machine its time
    assert r["again_after_s"] < 20, "the message was invisible for 30 s, not the 1 s it was changed to"
    assert r["rest"] == []


def test_python_sdk_sends_and_receives_over_tls(sdk_python, tmp_path):
    cert, key = self_signed_cert(tmp_path / "tls")
    b, endpoint = start_rocketmq_broker(tmp_path / "broker", "--rocketmq-tls-cert", str(cert), "--rocketmq-tls-key", str(key))
    try:
        topic, roots = "PySdkTls", {"GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(cert)}
        create_topics(b, topic)
        r = python_scenario(sdk_python, "send", tmp_path / "home", "--endpoint", endpoint, "--topic", topic, "--count", "2",
                            "--tls", env=roots)
        bodies = sorted(x["body"] for x in r["sent"])
        assert sorted(m["body"] for m in lines(ok(txmq("read", topic, "-o", "jsonl", broker=b.address)))) == bodies
        got = python_scenario(sdk_python, "receive", tmp_path / "home2", "--endpoint", endpoint, "--topic", topic,
                              "--group", "py-tls", "--expect", "2", "--tls", env=roots)
        assert sorted(m["body"] for m in got["received"]) == bodies
    finally:
        b.stop()


def test_python_sdk_signs_with_the_auth_token_as_secret_key_and_a_wrong_one_is_refused(sdk_python, tmp_path):
    token = "s3cret-token"
    b, endpoint = start_rocketmq_broker(tmp_path / "broker", "--auth-token", token)
    try:
        topic = "PySdkAuth"
        ok(txmq("topics", "create", topic, broker=b.address, env={"TXMQ_AUTH_TOKEN": token}))
        bad = python_scenario(sdk_python, "send", tmp_path / "home0", "--endpoint", endpoint, "--topic", topic, "--count", "1",
                              "--access-key", "app", "--secret-key", "wrong", "--deadline", "60", allow_errors=True)
        assert bad["errors"] and "sent" not in bad, bad
        assert "40100" in bad["_sdk_log"], "the SDK was not refused with UNAUTHORIZED"
        # the broker says so too: a line with the SDK's address and the reason (throttled), and a count
        refused = [ln for ln in b.log.read_text(errors="replace").splitlines() if "event=refused frontend=rocketmq kind=auth " in ln]
        assert refused and "peer=ipv4:127.0.0.1:" in refused[0] and "the request is not signed with the broker's --auth-token" in refused[0]
        stats = json.loads(ok(txmq("stats", "-o", "json", "-f", "refused_*", broker=b.address, env={"TXMQ_AUTH_TOKEN": token})).stdout)
        assert stats["counters"]["refused_rocketmq_auth"] >= 1, stats
        r = python_scenario(sdk_python, "send", tmp_path / "home", "--endpoint", endpoint, "--topic", topic, "--count", "2",
                            "--access-key", "app", "--secret-key", token)
        stored = lines(ok(txmq("read", topic, "-o", "jsonl", broker=b.address, env={"TXMQ_AUTH_TOKEN": token})))
        assert sorted(m["body"] for m in stored) == sorted(x["body"] for x in r["sent"])
    finally:
        b.stop()


def test_python_sdk_delay_and_fifo_messages_fail_fast_and_the_producer_goes_on(sdk_python, broker, tmp_path):
    b, endpoint = broker
    topic = "PySdkUnsupported"
    create_topics(b, topic)
    r = python_scenario(sdk_python, "unsupported", tmp_path / "home", "--endpoint", endpoint, "--topic", topic)
    for kind in ("delay", "fifo"):
        refused = r["refused"][kind]
        assert refused is not None, f"a {kind} message was accepted"
        assert refused["took_s"] < 10, refused
    stored = lines(ok(txmq("read", topic, "-o", "jsonl", broker=b.address)))
    assert [m["body"] for m in stored] == ["normal-after"]


def test_python_sdk_simple_consumer_on_a_topic_nothing_was_sent_to_long_polls_instead_of_failing(sdk_python, broker, tmp_path):
    """RocketMQ's simple-consumer example receives in a loop; on a topic nothing was sent to, each receive waits its
    long polling time (1 s here) and comes back empty: a handful of calls in 5 s, none failed."""
    b, endpoint = broker
    create_topics(b, "PySdkNeverSent")
    r = python_scenario(sdk_python, "idle", tmp_path / "home", "--endpoint", endpoint, "--topic", "PySdkNeverSent",
                        "--group", "py-idle", "--await-duration", "1", "--seconds", "5")
    assert r["failed"] == 0, r["failures"]
    assert 1 <= r["calls"] <= 10, f"{r['calls']} receives in 5 s"
    assert r["received"] == []


def test_python_sdk_producer_of_a_topic_the_broker_does_not_know_fails_with_not_found_until_the_topic_is_created(
        sdk_python, broker, tmp_path):
    """As against RocketMQ 5: the route of an unknown topic is NotFound (40402), whatever --auto-create-topics says (on
    here, the default), so the producer's start logs its failed route and its sends fail, and so do a SimpleConsumer's
    receives; nothing is created. Once the operator creates the topic, the same producer code sends."""
    b, endpoint = broker
    topic = "PySdkNowhere"
    r = python_scenario(sdk_python, "unknown", tmp_path / "home", "--endpoint", endpoint, "--topic", topic,
                        "--group", "py-nowhere", "--await-duration", "1")
    for what in ("send", "receive"):
        assert r[what]["ok"] is False and topic in r[what]["error"], r
    log = r["_sdk_log"]
    assert f"40402, CODE: 17  DESC: No topic route info in name server for the topic: {topic}" in log, log[-3000:]
    assert f"update topic: {topic} route raise exception when client startup" in log, log[-3000:]
    assert topic not in [t["topic"] for t in lines(ok(txmq("topics", broker=b.address)))]
    # once the operator creates it, the same producer code sends
    ok(txmq("topics", "create", topic, "--queues", "2", broker=b.address))
    sent = python_scenario(sdk_python, "send", tmp_path / "home2", "--endpoint", endpoint, "--topic", topic, "--count", "1")
    assert [m["body"] for m in lines(ok(txmq("read", topic, broker=b.address)))] == [x["body"] for x in sent["sent"]]
    assert "40402" not in sent["_sdk_log"]


def test_python_sdk_sends_fifo_and_delay_to_a_topic_that_accepts_them_and_the_broker_takes_both(sdk_python, broker, tmp_path):
    """The route says the topic accepts FIFO and DELAY, so the SDK sends them: the FIFO one is readable at once, the
    delayed one is scheduled (due in 60 s, not readable yet); a normal message goes through after them."""
    b, endpoint = broker
    topic = "PySdkWide"
    ok(txmq("topics", "create", topic, "--message-types", "normal,fifo,delay", broker=b.address))
    r = python_scenario(sdk_python, "unsupported", tmp_path / "home", "--endpoint", endpoint, "--topic", topic)
    assert r["refused"] == {"delay": None, "fifo": None}
    assert sorted(m["body"] for m in lines(ok(txmq("read", topic, "-o", "jsonl", broker=b.address)))) == ["fifo", "normal-after"]
    assert len(lines(ok(txmq("inspect", "scheduled", "--topic", topic, "-o", "jsonl", broker=b.address)))) == 1


def test_python_sdk_delayed_messages_arrive_at_their_time_with_their_fields(sdk_python, broker, tmp_path):
    b, endpoint = broker
    topic = "PySdkDelay"
    ok(txmq("topics", "create", topic, "--message-types", "normal,delay", broker=b.address))
    r = python_scenario(sdk_python, "delay", tmp_path / "home", "--endpoint", endpoint, "--topic", topic, "--group", "py-delay",
                        "--count", "3", "--delay-ms", "3000", "--expect", "3", "--await-duration", "1", "--receive-wait", "20")
    sent = {x["message_id"]: x for x in r["sent"]}
    got = r["received"]
    assert sorted(m["message_id"] for m in got) == sorted(sent)
    for m in got:
        due = sent[m["message_id"]]["due_ms"]
        assert m["delivery_timestamp"] == due
        # visible no earlier than due (the broker's clock is this machine's), and soon after it: the broker's
        # precision (docs/scheduled.md) plus the consumer's long poll
        assert due - 50 <= m["received_ms"] <= due + 2500, (m["received_ms"] - due, m)
        assert m["tag"] == "timeout" and m["keys"] == [f"order-{m['body'].split('-')[1]}"]


def test_python_sdk_delayed_messages_due_while_the_broker_was_killed_arrive_after_the_start(sdk_python, tmp_path):
    b, endpoint = start_rocketmq_broker(tmp_path / "broker")
    try:
        topic = "PySdkDelayDown"
        ok(txmq("topics", "create", topic, "--message-types", "normal,delay", broker=b.address))
        r = python_scenario(sdk_python, "delay", tmp_path / "home", "--endpoint", endpoint, "--topic", topic,
                            "--count", "2", "--delay-ms", "1500", "--expect", "0")
        b.kill()
        import time

        time.sleep(2.0)
        b.start()
        got = python_scenario(sdk_python, "receive", tmp_path / "home2", "--endpoint", endpoint, "--topic", topic,
                              "--group", "py-delay-down", "--expect", "2", "--await-duration", "1", "--settle", "1")
        assert sorted(m["message_id"] for m in got["received"]) == sorted(x["message_id"] for x in r["sent"])
    finally:
        b.stop()


def test_python_sdk_delayed_message_is_listed_by_inspect_scheduled_and_cancelled_by_the_cli(sdk_python, broker, tmp_path):
    b, endpoint = broker
    topic = "PySdkDelayCancel"
    ok(txmq("topics", "create", topic, "--message-types", "normal,delay", broker=b.address))
    r = python_scenario(sdk_python, "delay", tmp_path / "home", "--endpoint", endpoint, "--topic", topic,
                        "--count", "0", "--keep-ms", "60000", "--expect", "0")
    (kept,) = r["sent"]
    listed = lines(ok(txmq("inspect", "scheduled", "--topic", topic, "-o", "jsonl", broker=b.address)))
    assert [(m["msg_id"], m["deliver_at"]) for m in listed] == [(kept["message_id"], kept["due_ms"])]
    ok(txmq("scheduled", "cancel", kept["message_id"], broker=b.address))
    assert lines(ok(txmq("inspect", "scheduled", "--topic", topic, "-o", "jsonl", broker=b.address))) == []
    again = txmq("scheduled", "cancel", kept["message_id"], broker=b.address)
    assert again.returncode == 5 and b"no scheduled message" in again.stderr
