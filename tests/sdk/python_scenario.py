"""Scenarios run with Apache RocketMQ's official Python SDK (rocketmq-python-client) against txmq's gRPC front end.

This script runs in the SDK's own virtual environment (tests/sdkenv.py builds it), never in txmq's:
the SDK installs a top-level `rocketmq` package and its own protobuf modules for `apache.rocketmq.v2`,
which cannot share a process with txmq's. It prints one JSON object on its last stdout line; the
tests assert on it. Every scenario has a deadline and exits (os._exit) even if an SDK thread hangs.

    python python_scenario.py transactions --endpoint 127.0.0.1:PORT --topic T --group G
    python python_scenario.py half --endpoint ... --topic T [--wait-checks N] [--crash]
    python python_scenario.py checker --endpoint ... --topic T --body BODY
    python python_scenario.py send --endpoint ... --topic T --count N
    python python_scenario.py receive --endpoint ... --topic T --group G --expect N [--settle S]
    python python_scenario.py push --endpoint ... --topic T --group G --expect N [--fail-first BODY]
    python python_scenario.py invisible --endpoint ... --topic T --group G
    python python_scenario.py idle --endpoint ... --topic T --group G --seconds S
    python python_scenario.py unknown --endpoint ... --topic T --group G
    python python_scenario.py fifo-send --endpoint ... --topic T --groups N --count M [--body PREFIX]
    python python_scenario.py fifo-receive --endpoint ... --topic T --group G --expect N [--invisible S]
        [--skip-first BODY] [--crash-after N] [--already BODY,...]
    python python_scenario.py lite --endpoint ... --topic T --group G
    python python_scenario.py flood --endpoint ... --topic T --group G --count N --expect-refused K [--until-file F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback

from rocketmq import (ClientConfiguration, ConsumeResult, Credentials, FilterExpression, LitePushConsumer, Message, MessageListener,
                      Producer, PushConsumer, SimpleConsumer, TransactionChecker, TransactionResolution)

RESULT: dict = {"errors": []}


def finish(code: int = 0) -> None:
    print(json.dumps(RESULT, sort_keys=True), flush=True)
    sys.stderr.flush()
    os._exit(code)  # SDK threads (schedulers, executors) must not keep the process alive


def watchdog(seconds: float) -> None:
    def fire() -> None:
        RESULT["errors"].append(f"scenario deadline of {seconds}s passed")
        RESULT["timed_out"] = True
        finish(3)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


def config(args) -> ClientConfiguration:
    return ClientConfiguration(args.endpoint, Credentials(args.access_key, args.secret_key), request_timeout=args.request_timeout)


def message(topic: str, body: str, tag: str | None = None, keys: list[str] | None = None,
            props: dict[str, str] | None = None) -> Message:
    m = Message()
    m.topic = topic
    m.body = body.encode()
    if tag:
        m.tag = tag
    for k in keys or ():
        m.keys = k  # the SDK's setter takes one key per assignment
    for k, v in (props or {}).items():
        m.add_property(k, v)
    return m


def receipt(r) -> dict:
    return {"message_id": r.message_id, "transaction_id": r.transaction_id, "offset": r.offset}


def view(m) -> dict:
    return {
        "topic": m.topic, "body": m.body.decode(errors="replace"), "message_id": m.message_id, "tag": m.tag,
        "keys": sorted(m.keys or []), "properties": dict(m.properties or {}), "delivery_attempt": m.delivery_attempt,
        "corrupted": m.corrupted, "born_timestamp": m.born_timestamp, "has_receipt_handle": bool(m.receipt_handle),
    }


class RecordingChecker(TransactionChecker):
    """Answers a check-back from the local state of each transaction (keyed by body), as an application would."""

    def __init__(self, decisions: dict[str, int]) -> None:
        self.decisions = decisions
        self.checks: list[dict] = []
        self.lock = threading.Lock()

    def check(self, m) -> int:
        body = m.body.decode(errors="replace")
        answer = self.decisions.get(body, TransactionResolution.TRANSACTION_RESOLUTION_UNSPECIFIED)
        with self.lock:
            self.checks.append({"body": body, "message_id": m.message_id, "topic": m.topic,
                                "properties": dict(m.properties or {}), "answer": TransactionResolution.Name(answer)})
        return answer

    def count(self, body: str) -> int:
        with self.lock:
            return sum(1 for c in self.checks if c["body"] == body)


def wait_until(pred, seconds: float, step: float = 0.1) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


def receive_bodies(consumer: SimpleConsumer, want: set[str], seconds: float, settle: float) -> list:
    """Receive (and ack) until every body in `want` arrived or `seconds` pass, then keep receiving for
    `settle` seconds more to catch anything that should not be there."""
    got: list = []
    end = time.monotonic() + seconds
    settle_end = None
    while True:
        now = time.monotonic()
        if settle_end is None and (want <= {m.body.decode(errors="replace") for m in got} or now >= end):
            settle_end = now + settle
        if settle_end is not None and now >= settle_end:
            return got
        for m in consumer.receive(16, 15):
            got.append(m)
            consumer.ack(m)


def scenario_transactions(args) -> None:
    """(1) committed, (2) rolled back, (3) orphaned (left UNKNOWN: no end sent) and resolved by the checker through
    a check-back, (4) a SimpleConsumer receives and acks exactly the committed ones."""
    t = args.topic
    commit_body, rollback_body, orphan_body = f"commit-{t}", f"rollback-{t}", f"orphan-{t}"
    checker = RecordingChecker({commit_body: TransactionResolution.COMMIT, rollback_body: TransactionResolution.ROLLBACK,
                                orphan_body: TransactionResolution.COMMIT})
    producer = Producer(config(args), (t,), checker, tls_enable=args.tls)
    producer.startup()
    RESULT["producer_started"] = True
    sent = {}
    tx = producer.begin_transaction()
    r = producer.send(message(t, commit_body, tag="sdk", keys=["k-commit"], props={"origin": "python-sdk"}), tx)
    tx.commit()
    sent["commit"] = receipt(r)
    tx = producer.begin_transaction()
    r = producer.send(message(t, rollback_body, tag="sdk"), tx)
    tx.rollback()
    sent["rollback"] = receipt(r)
    tx = producer.begin_transaction()
    r = producer.send(message(t, orphan_body, tag="sdk"), tx)  # no commit, no rollback: UNKNOWN
    sent["orphan"] = receipt(r)
    RESULT["sent"] = sent
    RESULT["orphan_checked"] = wait_until(lambda: checker.count(orphan_body) > 0, args.check_wait)
    time.sleep(0.5)  # let the checker's EndTransaction(source=SOURCE_SERVER_CHECK) reach the broker

    consumer = SimpleConsumer(config(args), args.group, {t: FilterExpression()}, await_duration=args.await_duration, tls_enable=args.tls)
    consumer.startup()
    RESULT["consumer_started"] = True
    got = receive_bodies(consumer, {commit_body, orphan_body}, args.receive_wait, args.settle)
    RESULT["received"] = [view(m) for m in got]
    RESULT["checks"] = list(checker.checks)
    consumer.shutdown()
    producer.shutdown()
    RESULT["shutdown"] = True


def scenario_half(args) -> None:
    """Send one transactional half message and never end it. With --wait-checks N, stay online (the checker answers
    UNKNOWN) until the broker asked N times; then shut the producer down."""
    t = args.topic
    body = args.body or f"half-{t}"
    checker = RecordingChecker({})  # every answer UNKNOWN (TRANSACTION_RESOLUTION_UNSPECIFIED)
    producer = Producer(config(args), (t,), checker, tls_enable=args.tls)
    producer.startup()
    tx = producer.begin_transaction()
    r = producer.send(message(t, body, tag="sdk-half", keys=["k-half"], props={"origin": "python-sdk"}), tx)
    RESULT["sent"] = receipt(r)
    RESULT["body"] = body
    if args.wait_checks:
        RESULT["checked_enough"] = wait_until(lambda: checker.count(body) >= args.wait_checks, args.check_wait)
    RESULT["checks"] = list(checker.checks)
    if args.crash:
        finish(0)  # no shutdown, no NotifyClientTermination: the process just ends and its connections drop
    producer.shutdown()
    RESULT["shutdown"] = True


def scenario_checker(args) -> None:
    """A producer of --topic that sends nothing: its checker commits --body when the broker asks about it."""
    checker = RecordingChecker({args.body: TransactionResolution.COMMIT})
    producer = Producer(config(args), (args.topic,), checker, tls_enable=args.tls)
    producer.startup()
    RESULT["checked"] = wait_until(lambda: checker.count(args.body) > 0, args.check_wait)
    time.sleep(0.5)  # let the EndTransaction(source=SOURCE_SERVER_CHECK) reach the broker
    RESULT["checks"] = list(checker.checks)
    producer.shutdown()
    RESULT["shutdown"] = True


def scenario_send(args) -> None:
    t = args.topic
    producer = Producer(config(args), (t,), tls_enable=args.tls)
    producer.startup()
    sent = []
    for i in range(args.count):
        body = f"{args.body or 'sdk-normal'}-{i}"
        r = producer.send(message(t, body, tag="sdk-tag", keys=[f"key-{i}"], props={"origin": "python-sdk", "n": str(i)}))
        sent.append({**receipt(r), "body": body})
    RESULT["sent"] = sent
    producer.shutdown()
    RESULT["shutdown"] = True


def scenario_tx_load(args) -> None:
    """Transactions one after the other for --seconds, each committed; an error is recorded and the next one goes on.
    "committed": the bodies whose commit the SDK reported done; "commit_failed": sent, commit raised; "send_failed": the
    send raised. The checker commits whatever it is asked about: the application meant to commit every one."""
    t = args.topic
    intent: dict[str, int] = {}
    checker = RecordingChecker(intent)
    producer = Producer(config(args), (t,), checker, tls_enable=args.tls)
    producer.startup()
    committed, commit_failed, send_failed, errors = [], [], [], {}
    end = time.monotonic() + args.seconds
    i = 0
    while time.monotonic() < end:
        body = f"load-{t}-{i}"
        i += 1
        intent[body] = TransactionResolution.COMMIT
        try:
            tx = producer.begin_transaction()
            producer.send(message(t, body, tag="load"), tx)
        except Exception as e:  # noqa: BLE001
            send_failed.append(body)
            errors[type(e).__name__] = str(e)[:300]
            time.sleep(0.05)
            continue
        try:
            tx.commit()
            committed.append(body)
        except Exception as e:  # noqa: BLE001
            commit_failed.append(body)
            errors[type(e).__name__] = str(e)[:300]
    RESULT.update(committed=committed, commit_failed=commit_failed, send_failed=send_failed, load_errors=errors)
    time.sleep(args.settle)  # stay online for check-backs of what was left pending
    RESULT["checks"] = len(checker.checks)
    producer.shutdown()
    RESULT["shutdown"] = True


def scenario_unsupported(args) -> None:
    """A delay (delivery_timestamp, due in 60 s) and a FIFO (message_group) message: for each, the error the
    application sees if the broker refuses it (None when sent); a normal message is sent right after."""
    t = args.topic
    producer = Producer(config(args), (t,), tls_enable=args.tls)
    producer.startup()
    refused = {}
    delay = message(t, "delayed")
    delay.delivery_timestamp = int(time.time() * 1000) + 60_000
    fifo = message(t, "fifo")
    fifo.message_group = "g1"
    for name, m in (("delay", delay), ("fifo", fifo)):
        t0 = time.monotonic()
        try:
            producer.send(m)
            refused[name] = None
        except Exception as e:  # noqa: BLE001 - what the application gets is the result
            refused[name] = {"error": f"{type(e).__name__}: {e}", "took_s": round(time.monotonic() - t0, 2)}
    RESULT["refused"] = refused
    RESULT["sent"] = [{**receipt(producer.send(message(t, "normal-after"))), "body": "normal-after"}]
    producer.shutdown()
    RESULT["shutdown"] = True


def scenario_delay(args) -> None:
    """--count DELAY messages due --delay-ms after the send (a message with --keep-ms is due later and not awaited),
    then a SimpleConsumer receives until --expect arrived: each with when it arrived and its delivery_timestamp."""
    t = args.topic
    producer = Producer(config(args), (t,), tls_enable=args.tls)
    producer.startup()
    sent = []
    for i in range(args.count):
        m = message(t, f"delayed-{i}", tag="timeout", keys=[f"order-{i}"])
        m.delivery_timestamp = int(time.time() * 1000) + args.delay_ms
        sent.append({**receipt(producer.send(m)), "body": f"delayed-{i}", "due_ms": m.delivery_timestamp})
    if args.keep_ms:
        m = message(t, "kept")
        m.delivery_timestamp = int(time.time() * 1000) + args.keep_ms
        sent.append({**receipt(producer.send(m)), "body": "kept", "due_ms": m.delivery_timestamp})
    RESULT["sent"] = sent
    producer.shutdown()
    if args.expect <= 0:
        RESULT["shutdown"] = True
        return
    consumer = SimpleConsumer(config(args), args.group, {t: FilterExpression()}, await_duration=args.await_duration, tls_enable=args.tls)
    consumer.startup()
    got: list = []
    end = time.monotonic() + args.receive_wait
    while len(got) < args.expect and time.monotonic() < end:
        for m in consumer.receive(16, 15):
            got.append({**view(m), "received_ms": int(time.time() * 1000), "delivery_timestamp": m.delivery_timestamp})
            consumer.ack(m)
    RESULT["received"] = got
    consumer.shutdown()
    RESULT["shutdown"] = True


def scenario_receive(args) -> None:
    t = args.topic
    consumer = SimpleConsumer(config(args), args.group, {t: FilterExpression()}, await_duration=args.await_duration, tls_enable=args.tls)
    consumer.startup()
    got: list = []
    end = time.monotonic() + args.receive_wait
    while len(got) < args.expect and time.monotonic() < end:
        for m in consumer.receive(16, 15):
            got.append(m)
            consumer.ack(m)
    end = time.monotonic() + args.settle
    while time.monotonic() < end:
        for m in consumer.receive(16, 15):
            got.append(m)
            consumer.ack(m)
    RESULT["received"] = [view(m) for m in got]
    consumer.shutdown()
    RESULT["shutdown"] = True


def scenario_flood(args) -> None:
    """Apache's Java SDK example AsyncSimpleConsumerExample, with this SDK: receive_async --count times without
    waiting for any (long polls of --await-duration), then wait until --expect-refused of them have ended (or
    --seconds pass) and say how each ended: the exception's type, "received", or "pending". The process then stays,
    its long polls open, until --until-file exists (or --seconds pass again)."""
    t = args.topic
    consumer = SimpleConsumer(config(args), args.group, {t: FilterExpression()}, await_duration=args.await_duration, tls_enable=args.tls)
    consumer.startup()
    t0 = time.monotonic()
    futures = [consumer.receive_async(16, 15) for _ in range(args.count)]
    RESULT["issued_s"] = round(time.monotonic() - t0, 2)
    wait_until(lambda: sum(f.done() for f in futures) >= args.expect_refused, args.seconds)
    RESULT["answered_s"] = round(time.monotonic() - t0, 2)
    outcomes: dict[str, int] = {}
    examples: dict[str, str] = {}
    for f in futures:
        if not f.done():
            key = "pending"
        elif f.exception() is not None:
            key = type(f.exception()).__name__
            examples.setdefault(key, str(f.exception())[:400])
        else:
            key = "received"
        outcomes[key] = outcomes.get(key, 0) + 1
    RESULT["outcomes"] = outcomes
    RESULT["examples"] = examples
    if args.until_file:
        wait_until(lambda: os.path.exists(args.until_file), args.seconds)
    RESULT["pending_at_end"] = sum(not f.done() for f in futures)


class RecordingListener(MessageListener):
    """A PushConsumer listener that fails the first delivery of --fail-first and succeeds everything else."""

    def __init__(self, fail_first: str | None) -> None:
        self.fail_first = fail_first
        self.deliveries: list[dict] = []
        self.lock = threading.Lock()

    slow = 0.0  # seconds each consume takes (push --slow)

    def consume(self, m) -> ConsumeResult:
        if self.slow:
            time.sleep(self.slow)
        v = view(m)
        with self.lock:
            first = not any(d["body"] == v["body"] for d in self.deliveries)
            v["result"] = "FAILURE" if v["body"] == self.fail_first and first else "SUCCESS"
            self.deliveries.append(v)
        return ConsumeResult.FAILURE if v["result"] == "FAILURE" else ConsumeResult.SUCCESS

    def succeeded(self) -> int:
        """How many different messages the listener consumed successfully."""
        with self.lock:
            return len({d["body"] for d in self.deliveries if d["result"] == "SUCCESS"})


def scenario_push(args) -> None:
    """A PushConsumer (QueryAssignment, long-polling receives, ack; a FAILURE is a ChangeInvisibleDuration) receives
    --expect messages; the first delivery of --fail-first fails, so it must come again with delivery_attempt 2."""
    listener = RecordingListener(args.fail_first)
    listener.slow = args.slow
    consumer = PushConsumer(config(args), args.group, listener, {args.topic: FilterExpression()}, tls_enable=args.tls)
    consumer.startup()
    RESULT["consumer_started"] = True
    RESULT["all_consumed"] = wait_until(lambda: listener.succeeded() >= args.expect, args.receive_wait)
    time.sleep(args.settle)
    with listener.lock:
        RESULT["deliveries"] = list(listener.deliveries)
    consumer.shutdown()
    RESULT["shutdown"] = True


def scenario_invisible(args) -> None:
    """SimpleConsumer: receive one message (invisible for 30 s), make it visible again in 1 s with
    ChangeInvisibleDuration (a new receipt handle), receive it again (delivery attempt 2), ack it with the new
    handle; then nothing is left."""
    consumer = SimpleConsumer(config(args), args.group, {args.topic: FilterExpression()}, await_duration=args.await_duration, tls_enable=args.tls)
    consumer.startup()
    first: list = []
    end = time.monotonic() + args.receive_wait
    while not first and time.monotonic() < end:
        first = consumer.receive(1, 30)
    RESULT["first"] = [view(m) for m in first]
    if not first:
        raise RuntimeError("nothing to receive")
    m = first[0]
    old_handle = m.receipt_handle
    consumer.change_invisible_duration(m, 1)
    RESULT["handle_changed"] = bool(m.receipt_handle) and m.receipt_handle != old_handle
    t0 = time.monotonic()
    again: list = []
    while not again and time.monotonic() - t0 < args.receive_wait:
        again = consumer.receive(1, 30)
    RESULT["again_after_s"] = round(time.monotonic() - t0, 2)
    RESULT["again"] = [view(x) for x in again]
    for x in again:
        consumer.ack(x)
    rest: list = []
    end = time.monotonic() + args.settle
    while time.monotonic() < end:
        rest += consumer.receive(16, 30)
    RESULT["rest"] = [view(x) for x in rest]
    consumer.shutdown()
    RESULT["shutdown"] = True


def scenario_idle(args) -> None:
    """A SimpleConsumer receiving from a topic nothing was sent to, as RocketMQ's simple-consumer example does: a loop of
    receive() for --seconds, counting the calls and the failed ones (each should long-poll --await-duration)."""
    consumer = SimpleConsumer(config(args), args.group, {args.topic: FilterExpression()}, await_duration=args.await_duration,
                              tls_enable=args.tls)
    consumer.startup()
    RESULT["consumer_started"] = True
    calls, failures, got = 0, [], []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        calls += 1
        try:
            got += consumer.receive(16, 15)
        except Exception as e:  # noqa: BLE001 - counted: the example's loop goes on after a failed receive
            failures.append(f"{type(e).__name__}: {e}")
    RESULT["calls"], RESULT["failures"], RESULT["failed"] = calls, failures[:3], len(failures)
    RESULT["received"] = [view(m) for m in got]
    consumer.shutdown()
    RESULT["shutdown"] = True


def _attempt(what: str, fn) -> None:
    t0 = time.monotonic()
    try:
        fn()
        RESULT[what] = {"ok": True}
    except Exception as e:  # noqa: BLE001 - what the application gets is the result
        RESULT[what] = {"ok": False, "error": f"{type(e).__name__}: {e}", "took_s": round(time.monotonic() - t0, 2)}


def scenario_unknown(args) -> None:
    """A producer and a SimpleConsumer of a topic the broker does not have (RocketMQ 5 answers its route NotFound): what
    each sees."""
    t = args.topic
    producer = Producer(config(args), (t,), tls_enable=args.tls)
    _attempt("producer_startup", producer.startup)
    _attempt("send", lambda: producer.send(message(t, "to-nowhere")))
    consumer = SimpleConsumer(config(args), args.group, {t: FilterExpression()}, await_duration=args.await_duration,
                              tls_enable=args.tls)
    _attempt("consumer_startup", consumer.startup)
    _attempt("receive", lambda: consumer.receive(16, 15))
    for c in (producer, consumer):
        try:
            c.shutdown()
        except Exception:  # noqa: BLE001 - a client that never started
            pass
    RESULT["shutdown"] = True


def scenario_fifo_send(args) -> None:
    """A producer sends --count messages to each of --groups message groups, one at a time (each send waits for its
    receipt), interleaved: BODYg0:0, BODYg1:0, ..., BODYg0:1, ... Each carries its group, so it is a FIFO message."""
    t = args.topic
    producer = Producer(config(args), (t,), tls_enable=args.tls)
    producer.startup()
    sent = []
    for i in range(args.count):
        for k in range(args.groups):
            group, body = f"g{k}", f"{args.body or ''}g{k}:{i}"
            m = message(t, body)
            m.message_group = group
            sent.append({**receipt(producer.send(m)), "body": body, "group": group})
    RESULT["sent"] = sent
    producer.shutdown()
    RESULT["shutdown"] = True


def scenario_fifo_receive(args) -> None:
    """A SimpleConsumer of a FIFO group that processes each message group in order, as an application must: it acks
    each message it processes; when it does not process one (--skip-first BODY, or auto: the first received that has
    a later message of its group in the same batch), it holds back the rest of that group in the batch (no ack: they
    come again once the invisible duration, --invisible, runs out). --crash-after N: after processing N messages, end
    the process holding the rest of the batch (no ack, no shutdown). Receives take up to --batch messages.
    Events, in order: processed | skipped | held | crash-held, with the delivery attempt."""
    consumer = SimpleConsumer(config(args), args.group, {args.topic: FilterExpression()}, await_duration=args.await_duration,
                              tls_enable=args.tls)
    consumer.startup()
    RESULT["consumer_started"] = True
    events: list = []
    RESULT["events"] = events
    done: set = set(filter(None, (args.already or "").split(",")))  # processed by an earlier consumer
    skipped = False
    end = time.monotonic() + args.receive_wait
    while len(done) < args.expect and time.monotonic() < end:
        stopped: set = set()
        batch = consumer.receive(args.batch, args.invisible)
        for n, m in enumerate(batch):
            body, group = m.body.decode(), m.message_group
            e = {"body": body, "attempt": m.delivery_attempt, "group": group}
            events.append(e)
            if args.crash_after and sum(1 for x in events if x.get("event") == "processed") >= args.crash_after:
                e["event"] = "crash-held"
                continue
            later = any(x.message_group == group for x in batch[n + 1:])
            if group in stopped:
                e["event"] = "held"
            elif not skipped and (body == args.skip_first or (args.skip_first == "auto" and later and body not in done)):
                skipped = True
                stopped.add(group)
                e["event"] = "skipped"
            else:
                consumer.ack(m)
                done.add(body)
                e["event"] = "processed"
        if args.crash_after and any(x["event"] == "crash-held" for x in events):
            RESULT["crashed"] = True
            finish(0)
    consumer.shutdown()
    RESULT["shutdown"] = True


def scenario_lite(args) -> None:
    """What an application sees of lite topics and priorities, which txmq does not have: a LitePushConsumer's
    subscribe_lite, and a producer's lite-topic and priority messages (each error, or None when it went through)."""
    t = args.topic
    out: dict = {}
    consumer = LitePushConsumer(config(args), args.group, t, RecordingListener(None), tls_enable=args.tls)
    consumer.startup()
    _attempt("subscribe_lite", lambda: consumer.subscribe_lite("lt-1"))
    producer = Producer(config(args), (t,), tls_enable=args.tls)
    producer.startup()
    lite = message(t, "lite")
    lite.lite_topic = "lt-1"
    prio = message(t, "priority")
    prio.priority = 3
    for name, m in (("lite", lite), ("priority", prio)):
        try:
            producer.send(m)
            out[name] = None
        except Exception as e:  # noqa: BLE001 - what the application gets is the result
            out[name] = f"{type(e).__name__}: {e}"
    RESULT["sends"] = out
    for c in (producer, consumer):
        c.shutdown()
    RESULT["shutdown"] = True


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["transactions", "half", "checker", "send", "unsupported", "receive", "push", "invisible",
                                        "idle", "unknown", "delay", "fifo-send", "fifo-receive", "lite", "flood", "tx-load"])
    p.add_argument("--endpoint", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--group", default="sdk-consumers")
    p.add_argument("--body")
    p.add_argument("--count", type=int, default=3)
    p.add_argument("--expect", type=int, default=1)
    p.add_argument("--wait-checks", type=int, default=0)
    p.add_argument("--access-key", default="")
    p.add_argument("--secret-key", default="", help="the broker's --auth-token")
    p.add_argument("--tls", action="store_true", help="TLS to the broker (roots: GRPC_DEFAULT_SSL_ROOTS_FILE_PATH)")
    p.add_argument("--crash", action="store_true", help="half: end the process without shutting the producer down")
    p.add_argument("--fail-first", help="push: the body whose first delivery the listener fails")
    p.add_argument("--await-duration", type=int, default=3, help="SimpleConsumer long polling, seconds")
    p.add_argument("--request-timeout", type=int, default=5, help="SDK request timeout, seconds")
    p.add_argument("--check-wait", type=float, default=30.0, help="seconds to wait for check-backs")
    p.add_argument("--receive-wait", type=float, default=30.0, help="seconds to wait for the expected messages")
    p.add_argument("--settle", type=float, default=2.0, help="seconds to keep receiving after that")
    p.add_argument("--seconds", type=float, default=5.0, help="idle: how long to keep receiving")
    p.add_argument("--delay-ms", type=int, default=3000, help="delay: how long after the send a message is due")
    p.add_argument("--keep-ms", type=int, default=0, help="delay: one more message due this long after the send, not awaited")
    p.add_argument("--deadline", type=float, default=120.0)
    p.add_argument("--groups", type=int, default=3, help="fifo-send: message groups")
    p.add_argument("--invisible", type=int, default=2, help="fifo-receive: invisible duration, seconds")
    p.add_argument("--skip-first", help="fifo-receive: the body whose first delivery is not processed (nor acked)")
    p.add_argument("--crash-after", type=int, default=0, help="fifo-receive: end the process after processing N messages")
    p.add_argument("--already", help="fifo-receive: bodies an earlier consumer processed, comma-separated")
    p.add_argument("--batch", type=int, default=16, help="fifo-receive: messages per receive")
    p.add_argument("--slow", type=float, default=0.0, help="push: seconds each consume takes")
    p.add_argument("--expect-refused", type=int, default=1, help="flood: how many receives must end before it reports")
    p.add_argument("--until-file", help="flood: keep the long polls open until this file exists")
    args = p.parse_args()
    RESULT["scenario"] = args.scenario
    watchdog(args.deadline)
    try:
        {"transactions": scenario_transactions, "half": scenario_half, "checker": scenario_checker, "send": scenario_send,
         "unsupported": scenario_unsupported,
         "receive": scenario_receive, "push": scenario_push, "invisible": scenario_invisible, "idle": scenario_idle,
         "unknown": scenario_unknown, "delay": scenario_delay, "fifo-send": scenario_fifo_send,
         "fifo-receive": scenario_fifo_receive, "lite": scenario_lite, "flood": scenario_flood,
         "tx-load": scenario_tx_load}[args.scenario](args)
    except BaseException as e:  # noqa: BLE001 - reported to the test, which fails on it
        RESULT["errors"].append(f"{type(e).__name__}: {e}")
        RESULT["traceback"] = traceback.format_exc()
        finish(1)
    finish(0)


if __name__ == "__main__":
    main()
