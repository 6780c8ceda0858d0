"""The POP acknowledgement path of the RocketMQ front end: AckMessage throughput and latency, and the broker's CPU per ack.

One broker (`txmq broker start --flush sync --rocketmq-port P`, a fresh data directory) is loaded with
--messages messages over its native port; then --consumers gRPC consumers of one group (txmq's generated
stubs, as RocketMQ's SDKs call the service) each loop: ReceiveMessage (batch 32), AckMessage in requests of
8 entries, the batch shuffled first (--order shuffled, the default: acknowledgements land past unacknowledged
messages, which is what acks.json keeps) or in order (--order inorder). Reported: acks/s over the run,
AckMessage latency percentiles, and the broker process's CPU seconds per 1,000 acks.

With --micro the same receive/ack loop calls the consumption service (broker/messaging/consumption.py) of an in-process broker
directly, without gRPC, and reports the event loop thread's CPU time per acknowledgement over the whole loop
(receives, acks, and what the loop does for them meanwhile: handing settled ranges to the consumer offsets):
the figure another process's load disturbs least.

    .venv/bin/python benchmarks/pop_ack.py [--messages 40000] [--consumers 4] [--order shuffled|inorder] [--micro [--skip 0.1]] [-o json]

To compare code versions, run it alternately against each (e.g. PYTHONPATH pointing at another tree's
`txmq` package) on a quiet machine; other work only ever slows a run down, so take the best of several.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib import BrokerProc, WireConn, cpu_seconds, free_port, install_uvloop, percentiles_ms, wait_port  # noqa: E402

TOPIC = "pop-bench"
GROUP = "pop-bench-consumers"
META = (("x-mq-client-id", "pop-bench@1"), ("x-mq-language", "PYTHON"))
HOLD_RECEIVES = 16  # --micro --skip: a held message is acknowledged this many receives later


async def load(address: str, n: int) -> None:
    c = await WireConn.open(address)
    try:
        for i in range(0, n, 256):
            await c.call("send_batch", {"topic": TOPIC, "messages": [{"body": b"x" * 256} for _ in range(min(256, n - i))]})
    finally:
        c.close()


async def consume(rocketmq: str, n: int, consumers: int, order: str) -> tuple[float, list[float], int]:
    import grpc

    from txmq.broker.rocketmq.pb import definition_pb2 as d
    from txmq.broker.rocketmq.pb import service_pb2 as s
    from txmq.broker.rocketmq.pb import service_pb2_grpc as sg

    lat: list[float] = []
    acked = 0
    rng = random.Random(1)

    async def one(stub) -> None:
        nonlocal acked
        req = s.ReceiveMessageRequest(batch_size=32)
        req.group.name, req.message_queue.topic.name, req.message_queue.id = GROUP, TOPIC, -1
        req.filter_expression.type, req.filter_expression.expression = d.TAG, "*"
        req.invisible_duration.FromSeconds(60)
        req.long_polling_timeout.FromMilliseconds(200)
        while acked < n:
            msgs = [r.message async for r in stub.ReceiveMessage(req, metadata=META, timeout=10) if r.HasField("message")]
            if not msgs:
                if acked >= n:
                    return
                continue
            if order == "shuffled":
                rng.shuffle(msgs)
            for i in range(0, len(msgs), 8):
                ack = s.AckMessageRequest()
                ack.group.name, ack.topic.name = GROUP, TOPIC
                for m in msgs[i : i + 8]:
                    ack.entries.add(receipt_handle=m.system_properties.receipt_handle, message_id=m.system_properties.message_id)
                t0 = time.perf_counter()
                r = await stub.AckMessage(ack, metadata=META, timeout=10)
                lat.append(time.perf_counter() - t0)
                assert r.status.code == d.Code.OK, r.status
                acked += len(r.entries)

    async with grpc.aio.insecure_channel(rocketmq) as ch:
        stub = sg.MessagingServiceStub(ch)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(stub) for _ in range(consumers)))
        return time.perf_counter() - t0, lat, acked


async def micro(data: Path, n: int, consumers: int, order: str, skip: float) -> tuple[float, float, int]:
    """(loop thread CPU seconds, wall seconds, acks) of receive/ack loops on the consumption service in-process."""
    from txmq.broker.testing import running_broker

    async with running_broker(data) as b:
        await load(b.address, n)
        pop = b.core.consumption
        rng = random.Random(1)
        acked = 0

        async def one() -> None:
            nonlocal acked
            held: deque[tuple[int, str]] = deque()  # (receive number, handle): acknowledged HOLD_RECEIVES receives later
            for i in itertools.count():
                if acked >= n:
                    return
                got = await pop.receive(GROUP, TOPIC, -1, None, 32, 60, 0.2)
                if order == "shuffled":
                    rng.shuffle(got)
                for dl in got:
                    if skip and rng.random() < skip:
                        held.append((i, dl.receipt_handle))
                        continue
                    pop.ack(GROUP, TOPIC, dl.receipt_handle)
                    acked += 1
                while held and (held[0][0] <= i - HOLD_RECEIVES or not got):
                    pop.ack(GROUP, TOPIC, held.popleft()[1])
                    acked += 1
                await asyncio.sleep(0)

        c0, t0 = time.thread_time(), time.perf_counter()
        await asyncio.gather(*(one() for _ in range(consumers)))
        c1, t1 = time.thread_time(), time.perf_counter()
        await pop.close()
        return c1 - c0, t1 - t0, acked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=40_000)
    ap.add_argument("--consumers", type=int, default=4)
    ap.add_argument("--order", choices=("shuffled", "inorder"), default="shuffled")
    ap.add_argument("--skip", type=float, default=0.0,
                    help=f"--micro: share of messages acknowledged only {HOLD_RECEIVES} receives later (holes below the acks)")
    ap.add_argument("--micro", action="store_true", help="the POP service in-process, without gRPC: loop CPU per ack")
    ap.add_argument("-o", "--output", choices=("text", "json"), default="text")
    a = ap.parse_args()
    install_uvloop()
    if a.micro:
        with tempfile.TemporaryDirectory(prefix="txmq-popack-") as tmp:
            cpu, wall, acked = asyncio.run(micro(Path(tmp) / "data", a.messages, a.consumers, a.order, a.skip))
        result = {"acks": acked, "order": a.order, "consumers": a.consumers, "loop_cpu_us_per_ack": round(1e6 * cpu / acked, 2),
                  "acks_per_s": round(acked / wall)}
        print(json.dumps(result) if a.output == "json" else
              f"{acked} acks ({a.order}, {a.skip:g} held back, in-process): loop CPU {result['loop_cpu_us_per_ack']} us per ack (receive included), "
              f"{result['acks_per_s']} acks/s")
        return
    with tempfile.TemporaryDirectory(prefix="txmq-popack-") as tmp:
        rport = free_port()
        broker = BrokerProc(Path(tmp) / "data", "--flush", "sync", "--rocketmq-port", str(rport)).start()
        try:
            wait_port(rport, 30, broker.proc)
            asyncio.run(load(broker.address, a.messages))
            cpu0 = cpu_seconds(broker.pid)
            took, lat, acked = asyncio.run(consume(f"127.0.0.1:{rport}", a.messages, a.consumers, a.order))
            cpu = cpu_seconds(broker.pid) - cpu0
        finally:
            broker.stop()
        acks_file = (Path(tmp) / "data" / "acks.json").exists()
    result = {"acks": acked, "order": a.order, "consumers": a.consumers, "acks_per_s": round(acked / took),
              "ack_rpc_ms": percentiles_ms(lat), "broker_cpu_s_per_1000_acks": round(1000 * cpu / acked, 4),
              "acks_json_written": acks_file}
    if a.output == "json":
        print(json.dumps(result))
    else:
        p = result["ack_rpc_ms"]
        print(f"{acked} acks ({a.order}, {a.consumers} consumers): {result['acks_per_s']} acks/s, AckMessage of 8 "
              f"p50 {p.get('p50')} ms p99 {p.get('p99')} ms, broker CPU {result['broker_cpu_s_per_1000_acks']} s per 1000 acks, "
              f"acks.json {'written' if acks_file else 'absent'}")


if __name__ == "__main__":
    main()
