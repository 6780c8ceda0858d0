"""FIFO messages with Apache RocketMQ's official Python (5.1.2) and Node.js (1.0.8) SDKs against a txmq broker process.

A FIFO producer sends interleaved messages of three message groups; a FIFO group's SimpleConsumer (each SDK) and
PushConsumer (Python) process every group in order across an invisible duration that runs out, a consumer that
crashes holding messages, and a broker that is SIGKILLed and started again. FIFO messages sent natively
(`txmq send --message-group -`) are received in order by an SDK consumer. The SDKs run as in
tests/test_rocketmq_sdk_python.py and tests/test_rocketmq_sdk_node.py (tests/sdkenv.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from clihelpers import lines, ok, txmq
from sdkenv import node_scenario, node_sdk_dir, python_scenario, python_sdk_python, start_rocketmq_broker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

GROUPS, COUNT = 3, 6


def fifo_setup(b, topic: str, group: str, queues: int = 2) -> None:
    ok(txmq("topics", "create", topic, "--queues", str(queues), "--message-types", "normal,fifo", broker=b.address))
    ok(txmq("groups", "update", group, "--fifo", broker=b.address))


def index(body: str) -> tuple[str, int]:
    group, _, i = body.rpartition(":")
    return group[-2:], int(i)


def assert_in_order(events: list[dict], bodies: set[str]) -> None:
    """Each message group processed in order: a message only after every earlier one of its group was processed
    (again after a crash: at least once), and in the end every message processed."""
    processed: set[str] = set()
    for e in events:
        if e["event"] != "processed":
            continue
        group, i = index(e["body"])
        missing = [f"{group}:{j}" for j in range(i) if not any(p.endswith(f"{group}:{j}") for p in processed)]
        assert not missing, f"{e['body']} processed before {missing}: {[x['body'] + '/' + x['event'] for x in events]}"
        processed.add(e["body"])
    assert processed == bodies, sorted(bodies - processed)


def _simple_consumer_case(run, b, tmp_path, topic: str, group: str) -> None:
    endpoint = b.endpoint
    fifo_setup(b, topic, group)
    sent = run("fifo-send", tmp_path / "p", "--endpoint", endpoint, "--topic", topic, "--groups", str(GROUPS),
               "--count", str(COUNT))["sent"]
    assert [x["body"] for x in sent if x["group"] == "g1"] == [f"g1:{i}" for i in range(COUNT)]
    stored = lines(ok(txmq("read", topic, "-o", "jsonl", broker=b.address)))
    for g in ("g0", "g1", "g2"):  # one queue per group, in the order the sends were acknowledged
        mine = [m for m in stored if m["body"].startswith(g + ":")]
        assert len({m["queue_id"] for m in mine}) == 1
        assert [m["body"] for m in sorted(mine, key=lambda m: m["queue_offset"])] == [f"{g}:{i}" for i in range(COUNT)]
    bodies = {x["body"] for x in sent}
    # (1) a consumer processes five messages, receives more and crashes holding them
    first = run("fifo-receive", tmp_path / "c1", "--endpoint", endpoint, "--topic", topic, "--group", group,
                "--expect", str(len(bodies)), "--crash-after", "5", "--invisible", "2")
    assert first.get("crashed"), first
    # (2) the broker is SIGKILLed and started again: what was in flight comes again, in order
    b.kill()
    b.start()
    # (3) a new consumer, receiving five at a time, does not process one message the first time (one with a later
    # message of its group in the same batch): nothing after it of its group comes until its invisible duration runs out
    second = run("fifo-receive", tmp_path / "c2", "--endpoint", endpoint, "--topic", topic, "--group", group,
                 "--expect", str(len(bodies)), "--batch", "5",
                 "--already", ",".join(e["body"] for e in first["events"] if e["event"] == "processed"),
                 "--skip-first", "auto", "--invisible", "2", "--receive-wait", "60")
    events = first["events"] + second["events"]
    assert_in_order(events, bodies)
    (skipped,) = [e["body"] for e in second["events"] if e["event"] == "skipped"]
    again = [e for e in second["events"] if e["body"] == skipped]
    assert again[-1]["event"] == "processed" and again[-1]["attempt"] >= 2, again
    assert any(e["event"] == "held" for e in second["events"])


@pytest.fixture
def sdk_python():
    return python_sdk_python()


@pytest.fixture
def sdk_node():
    return node_sdk_dir()


class _Broker:
    def __init__(self, root) -> None:
        self.proc, self.endpoint = start_rocketmq_broker(root)
        self.address = self.proc.address

    def kill(self) -> None:
        self.proc.kill()

    def start(self) -> None:
        self.proc.start()
        time.sleep(0.5)  # the gRPC port comes up right after the native one

    def stop(self) -> None:
        self.proc.stop()


@pytest.fixture
def broker(tmp_path):
    b = _Broker(tmp_path / "broker")
    yield b
    b.stop()


def test_python_sdk_fifo_simple_consumer_keeps_each_groups_order_across_expiry_crash_and_broker_sigkill(sdk_python, broker, tmp_path):
    _simple_consumer_case(lambda *a: python_scenario(sdk_python, *a), broker, tmp_path, "PySdkFifo", "py-fifo")


def test_node_sdk_fifo_simple_consumer_keeps_each_groups_order_across_expiry_crash_and_broker_sigkill(sdk_node, broker, tmp_path):
    def run(scenario, home, *args):
        conv = [str(int(float(a) * 1000)) if prev in ("--invisible", "--receive-wait") else a for prev, a in zip(("",) + args, args)]
        return node_scenario(sdk_node, scenario, home, *conv)

    _simple_consumer_case(run, broker, tmp_path, "NodeSdkFifo", "node-fifo")


def consumed_in_order_across_a_sigkill(broker, bodies: set[str], consume: Callable[[], dict]) -> None:
    """Run ``consume`` (an SDK push consumer's scenario) in a thread, SIGKILL and restart the broker while it consumes,
    then check that every body was consumed, each message group in its order."""
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(consume()))
    t.start()
    time.sleep(3)  # part of it consumed
    broker.kill()
    broker.start()
    t.join(220)
    assert result.get("all_consumed"), result
    events = [{"body": d["body"], "event": "processed" if d["result"] == "SUCCESS" else "failed"} for d in result["deliveries"]]
    assert_in_order(events, bodies)


def test_python_sdk_fifo_push_consumer_receives_native_fifo_messages_in_order_across_a_broker_sigkill(sdk_python, broker, tmp_path):
    topic, group, count = "PySdkFifoPush", "py-fifo-push", 8
    fifo_setup(broker, topic, group)
    feed = "".join(f"g{k}\tg{k}:{i}\n" for i in range(count) for k in range(GROUPS))
    r = txmq("send", topic, "--message-group", "-", "-o", "jsonl", broker=broker.address, input=feed)
    assert r.returncode == 0, r.stderr
    assert len(lines(r)) == GROUPS * count
    bodies = {f"g{k}:{i}" for i in range(count) for k in range(GROUPS)}
    consumed_in_order_across_a_sigkill(broker, bodies, lambda: python_scenario(
        sdk_python, "push", tmp_path / "c", "--endpoint", broker.endpoint, "--topic", topic, "--group", group,
        "--expect", str(len(bodies)), "--slow", "0.15", "--receive-wait", "90", "--deadline", "150", timeout=200))


def test_node_sdk_fifo_producer_and_push_consumer_keep_each_groups_order_across_a_broker_sigkill(sdk_node, broker, tmp_path):
    topic, group = "NodeSdkFifoPush", "node-fifo-push"
    fifo_setup(broker, topic, group)
    sent = node_scenario(sdk_node, "fifo-send", tmp_path / "p", "--endpoint", broker.endpoint, "--topic", topic,
                         "--groups", str(GROUPS), "--count", "8")["sent"]
    bodies = {x["body"] for x in sent}
    consumed_in_order_across_a_sigkill(broker, bodies, lambda: node_scenario(
        sdk_node, "push", tmp_path / "c", "--endpoint", broker.endpoint, "--topic", topic, "--group", group,
        "--expect", str(len(bodies)), "--slow", "150", "--receive-wait", "90000", "--deadline", "150000", timeout=200))


def test_python_sdk_receives_fifo_messages_with_their_group_in_the_sharding_key_property_too(sdk_python, broker, tmp_path):
    """As RocketMQ 5 delivers a FIFO message: its group in system_properties.message_group and, since RocketMQ's proxy
    delivers every property not among its broker's system properties, in the user property __SHARDINGKEY."""
    topic, group = "PySdkFifoProps", "py-fifo-props"
    fifo_setup(broker, topic, group)
    sent = python_scenario(sdk_python, "fifo-send", tmp_path / "p", "--endpoint", broker.endpoint, "--topic", topic,
                           "--groups", "2", "--count", "2")["sent"]
    groups = {x["body"]: x["group"] for x in sent}
    got = python_scenario(sdk_python, "receive", tmp_path / "c", "--endpoint", broker.endpoint, "--topic", topic,
                          "--group", group, "--expect", str(len(sent)))["received"]
    assert sorted(m["body"] for m in got) == sorted(groups)
    assert [m["properties"] for m in got] == [{"__SHARDINGKEY": groups[m["body"]]} for m in got]


def test_python_sdk_lite_subscription_is_refused_by_the_broker_as_unsupported_not_by_a_zero_length_limit(sdk_python, broker, tmp_path):
    """Without the lite limits in the settings answer the SDK read them as 0 and refused every lite topic itself
    ("length exceeded max length 0"); with them it asks, and the broker answers UNSUPPORTED, saying lite topics are
    not supported. Lite-topic and priority messages are refused before sending: no route accepts those types."""
    ok(txmq("topics", "create", "PySdkLite", broker=broker.address))
    r = python_scenario(sdk_python, "lite", tmp_path / "home", "--endpoint", broker.endpoint, "--topic", "PySdkLite",
                        "--group", "py-lite")
    sub = r["subscribe_lite"]
    assert sub["ok"] is False and "max length" not in sub["error"], sub
    assert "lite topics" in sub["error"] and "not supported by txmq" in sub["error"], sub
    for kind in ("lite", "priority"):
        assert r["sends"][kind] is not None and "accept message types" in r["sends"][kind], r["sends"]
