"""Load generator for benchmarks/rocketmq_sdk.py: transactional producers of Apache RocketMQ's official Python SDK.

Runs in the SDK's own virtual environment (tests/sdkenv.py builds it), never in txmq's: the SDK's
`rocketmq` package and txmq's generated protobuf modules cannot share a process. One process runs
--producers SDK Producers, one thread each, every thread back to back: begin a transaction, send the
half message (--size bytes), commit (the local transaction commits at once), repeat.

Protocol with the driver (stdin/stdout, one JSON object per line):
  -> {"ready": true, ...}                    all producers started and warmed up
  <- {"start": EPOCH_S, "end": EPOCH_S}      the measurement window (wall clock, shared by every process)
  -> {"completed": N, "latency_ms": [...], "errors": {...}, "cpu_s": ...}
Transactions that begin inside the window count; the process exits after reporting.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter

from rocketmq import ClientConfiguration, Credentials, Message, Producer, TransactionChecker, TransactionResolution


class CommitChecker(TransactionChecker):
    def check(self, message) -> int:  # every local transaction committed
        return TransactionResolution.COMMIT


def one_transaction(producer: Producer, topic: str, body: bytes) -> None:
    m = Message()
    m.topic = topic
    m.body = body
    tx = producer.begin_transaction()
    producer.send(m, tx)
    tx.commit()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=5, help="transactions per producer before ready")
    ap.add_argument("--max-latencies", type=int, default=200_000)
    a = ap.parse_args()

    body = (b"x" * a.size) or b"x"
    cfg = ClientConfiguration(a.endpoint, Credentials(), request_timeout=10)
    producers = []
    for _ in range(a.producers):
        p = Producer(cfg, (a.topic,), CommitChecker())
        p.startup()
        producers.append(p)
    for p in producers:
        for _ in range(a.warmup):
            one_transaction(p, a.topic, body)
    print(json.dumps({"ready": True, "producers": a.producers, "pid": os.getpid()}), flush=True)
    window = json.loads(sys.stdin.readline())
    start, end = float(window["start"]), float(window["end"])

    lock = threading.Lock()
    latencies: list[float] = []
    errors: Counter = Counter()
    completed = [0]

    def run(p: Producer) -> None:
        local: list[float] = []
        done = 0
        while time.time() < start:
            time.sleep(min(0.005, max(0.0, start - time.time())))
        while True:
            t0 = time.time()
            if t0 >= end:
                break
            try:
                one_transaction(p, a.topic, body)
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    errors[type(e).__name__] += 1
                continue
            local.append((time.time() - t0) * 1000.0)
            done += 1
        with lock:
            completed[0] += done
            latencies.extend(local[: max(0, a.max_latencies - len(latencies))])

    threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in producers]
    cpu0 = time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(5.0, end - time.time() + 60))
    cpu = time.process_time() - cpu0
    out = {"completed": completed[0], "latency_ms": [round(x, 3) for x in latencies], "errors": dict(errors),
           "cpu_s": round(cpu, 3), "producers": a.producers}
    print(json.dumps(out), flush=True)
    for p in producers:
        try:
            p.shutdown()
        except Exception:  # noqa: BLE001 - the result is out already
            pass
    os._exit(0)


if __name__ == "__main__":
    main()
