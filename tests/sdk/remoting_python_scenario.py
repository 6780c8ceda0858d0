"""Scenarios for PyPI's `rocketmq` (the Python binding of Apache's rocketmq-client-cpp, RocketMQ 4's remoting protocol).

Run with the interpreter of its own virtual environment (tests/sdkenv.py: remoting_python), never txmq's:
it installs a top-level `rocketmq` package. Prints one JSON line with what happened; "errors" lists what failed.

    python remoting_python_scenario.py SCENARIO --namesrv HOST:PORT --topic T --group G
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from rocketmq.client import Message, Producer, PullConsumer, PushConsumer

RESULT: dict = {"errors": []}


def fail(what: str) -> None:
    RESULT["errors"].append(what)


def producer(ns: str, group: str) -> Producer:
    p = Producer(group)
    p.set_namesrv_addr(ns)
    p.start()
    return p


def message(topic: str, body: str, tag: str = "t", keys: str = "", props: dict | None = None) -> Message:
    m = Message(topic)
    m.set_body(body)
    m.set_tags(tag)
    if keys:
        m.set_keys(keys)
    for k, v in (props or {}).items():
        m.set_property(k, v)
    return m


def text(v) -> str | None:
    return v.decode(errors="replace") if isinstance(v, bytes) else v


def received(msg) -> dict:
    return {"body": text(msg.body), "id": text(msg.id), "topic": text(msg.topic), "tags": text(msg.tags), "keys": text(msg.keys),
            "queue_id": msg.queue_id, "queue_offset": msg.queue_offset, "reconsume_times": msg.reconsume_times,
            "origin": text(msg.get_property("origin")), "at": time.time()}


class Collector:
    def __init__(self, fail_bodies: tuple[str, ...] = ()) -> None:
        self.lock = threading.Lock()
        self.items: list[dict] = []
        self.fail_bodies = fail_bodies

    def __call__(self, msg) -> None:
        item = received(msg)
        with self.lock:
            self.items.append(item)
        if item["body"] in self.fail_bodies:
            raise RuntimeError("consumer fails this message on purpose")  # the binding answers RECONSUME_LATER

    def bodies(self) -> list[str]:
        with self.lock:
            return [i["body"] for i in self.items]

    def wait(self, pred, timeout: float) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if pred(self):
                return True
            time.sleep(0.05)
        return pred(self)


def push_consumer(ns: str, group: str, topic: str, collector: Collector, orderly: bool = False, expression: str = "*") -> PushConsumer:
    c = PushConsumer(group, orderly=orderly)
    c.set_namesrv_addr(ns)
    c.subscribe(topic, collector, expression)
    c.start()
    return c


def pull_all(ns: str, group: str, topic: str) -> list[dict]:
    pc = PullConsumer(group)
    pc.set_namesrv_addr(ns)
    pc.start()
    try:
        return [received(m) for m in pc.pull(topic)]
    finally:
        pc.shutdown()


# ---- scenarios ---------------------------------------------------------------------------------
def send_modes(a) -> None:
    """Sync, async, oneway and batch sends, then a concurrent push consumer and a pull consumer get exactly them."""
    p = producer(a.namesrv, a.group + "-p")
    sent: dict[str, str] = {}
    try:
        for i in range(5):
            r = p.send_sync(message(a.topic, f"sync-{i}", keys=f"k-{i}", props={"origin": "remoting-python"}))
            if int(r.status) != 0:
                fail(f"sync send {i}: status {r.status}")
            sent[f"sync-{i}"] = r.msg_id
        done = threading.Semaphore(0)
        async_ids: dict[str, str] = {}

        def on_ok(body):
            def cb(r):
                async_ids[body] = r.msg_id
                done.release()
            return cb

        def on_err(e):
            fail(f"async send failed: {e}")
            done.release()

        for i in range(5):
            p.send_async(message(a.topic, f"async-{i}"), on_ok(f"async-{i}"), on_err)
        for _ in range(5):
            if not done.acquire(timeout=20):
                fail("an async send got no callback in 20s")
                break
        sent.update(async_ids)
        for i in range(5):
            p.send_oneway(message(a.topic, f"oneway-{i}"))
            sent[f"oneway-{i}"] = ""
        try:
            r = p.send_batch([message(a.topic, f"batch-{i}") for i in range(3)])
            RESULT["batch_status"] = int(r.status)
            for i in range(3):
                sent[f"batch-{i}"] = ""
        except Exception as e:  # the binding's batch support is the C++ client's
            fail(f"batch send: {e!r}")
    finally:
        p.shutdown()
    RESULT["sent"] = sent
    col = Collector()
    c = push_consumer(a.namesrv, a.group, a.topic, col)
    try:
        col.wait(lambda c: set(c.bodies()) >= set(sent), 40)
        time.sleep(1.0)  # anything delivered twice would show now
    finally:
        c.shutdown()
    RESULT["pushed"] = col.items
    RESULT["pulled"] = pull_all(a.namesrv, a.group + "-pull", a.topic)


def orderly(a) -> None:
    """Ordered sends (a queue chosen per order id) and an orderly push consumer: each order's messages in sequence, on one queue."""
    p = producer(a.namesrv, a.group + "-p")
    sent = []
    try:
        for i in range(12):
            order = "ABC"[i % 3]
            r = p.send_orderly(message(a.topic, f"{order}-{i // 3}"), i % 3)  # the binding's selector: queue = arg % queues
            if int(r.status) != 0:
                fail(f"orderly send {i}: status {r.status}")
            sent.append(f"{order}-{i // 3}")
    finally:
        p.shutdown()
    RESULT["sent"] = sent
    col = Collector()
    c = push_consumer(a.namesrv, a.group, a.topic, col, orderly=True)
    try:
        col.wait(lambda c: set(c.bodies()) >= set(sent), 40)
        time.sleep(0.5)
    finally:
        c.shutdown()
    RESULT["pushed"] = col.items


def delay(a) -> None:
    """A message with delay level 1 (1 s), sent while a consumer waits: when it arrives."""
    col = Collector()
    c = push_consumer(a.namesrv, a.group, a.topic, col)
    p = producer(a.namesrv, a.group + "-p")
    try:
        time.sleep(2.0)  # the consumer's queues are assigned and its long polls wait
        m = message(a.topic, "delayed")
        m.set_delay_time_level(1)
        RESULT["sent_at"] = time.time()
        r = p.send_sync(m)
        if int(r.status) != 0:
            fail(f"delayed send: status {r.status}")
        col.wait(lambda c: "delayed" in c.bodies(), 30)
    finally:
        p.shutdown()
        c.shutdown()
    RESULT["pushed"] = col.items


def retry_dlq(a) -> None:
    """A consumer that fails one message every time: it comes back through %RETRY%<group>, then lands in %DLQ%<group>."""
    p = producer(a.namesrv, a.group + "-p")
    try:
        for body in ("good", "bad"):
            r = p.send_sync(message(a.topic, body))
            if int(r.status) != 0:
                fail(f"send {body}: status {r.status}")
    finally:
        p.shutdown()
    col = Collector(fail_bodies=("bad",))
    c = push_consumer(a.namesrv, a.group, a.topic, col)
    try:
        col.wait(lambda c: c.bodies().count("bad") >= a.deliveries, a.wait)
        time.sleep(1.0)
    finally:
        c.shutdown()
    RESULT["pushed"] = col.items
    RESULT["dlq"] = pull_all(a.namesrv, a.group + "-dlq-reader", "%DLQ%" + a.group)


SCENARIOS = {"send_modes": send_modes, "orderly": orderly, "delay": delay, "retry_dlq": retry_dlq}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--namesrv", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--deliveries", type=int, default=17)
    ap.add_argument("--wait", type=float, default=120)
    a = ap.parse_args()
    try:
        SCENARIOS[a.scenario](a)
    except Exception as e:
        import traceback

        fail(f"{type(e).__name__}: {e} {traceback.format_exc()[-600:]}")
    print(json.dumps(RESULT))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
