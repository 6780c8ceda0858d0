"""Messages/s that `txmq migrate` moves onto a RocketMQ 4 cluster (batch sends of 256-byte messages), and the
target's own batch-send rate from the same client beside it.

A txmq broker (fresh data directory, async flush) is filled with N messages of 256 bytes on a topic of Q
queues, one consumer group at the start of each queue; then the backlog is moved with the migration's mover
(the same code as `txmq migrate`, state file fsynced per round) and timed. The target's own rate is the
same client's SEND_BATCH_MESSAGE loop (512 messages a batch, one batch in flight per queue) without txmq
in between: what the target takes from one Python process.

    .venv/bin/python benchmarks/migrate.py --to 127.0.0.1:9876 [-n 200000] [-q 8] [--batch 512]

The target is any RocketMQ 4 name server (../shared/peers/rocketmq-4.9.8: `run.sh start -n auto -b auto`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib import BrokerProc, command_line, machine_info, save_result  # noqa: E402


async def fill(address: str, topic: str, n: int, queues: int) -> None:
    from txmq.client import Client

    async with Client(address) as c:
        await c.request("create_topic", {"topic": topic, "queues": queues})
        body = b"x" * 256
        per = 256
        sent = 0
        pending = []
        while sent < n:
            k = min(per, n - sent)
            msgs = [{"body": body, "properties": {"KEYS": f"k{sent + i}", "UNIQ_KEY": f"BENCH{sent + i:027d}"}} for i in range(k)]
            pending.append(c.request("send_batch", {"topic": topic, "messages": msgs, "queue_id": (sent // per) % queues}))
            sent += k
            if len(pending) >= 32:
                await asyncio.gather(*pending)
                pending = []
        await asyncio.gather(*pending)
        for q in range(queues):
            await c.request("commit_offset", {"group": "bench-group", "topic": topic, "queue_id": q, "offset": 0})


async def migrate(address: str, to: str, state_path: Path, batch: int) -> tuple[int, float]:
    from txmq.client import Client
    from txmq.client.migrate import plan as planner
    from txmq.client.migrate.mover import Mover
    from txmq.client.migrate.state import State
    from txmq.client.rocketmq4 import RocketMQ4

    target = RocketMQ4(to)
    async with Client(address) as source:
        src = await planner.read_source(source)
        tgt = await planner.read_target(target, sorted(src["topics"]), None)
        plan = planner.build(src, tgt, to, address, False)
        st = State.new(state_path, {"broker_id": "bench"}, to, plan)
        st.save()
        mover = Mover(source, target, st, batch_count=batch)
        await mover.create_topics()
        t0 = time.perf_counter()
        await mover.copy()
        took = time.perf_counter() - t0
        await mover.commit_offsets()
        moved = sum(mover.c.moved.values())
    await target.close()
    return moved, took


async def target_rate(to: str, topic: str, n: int, queues: int, batch: int) -> float:
    from txmq.client.rocketmq4 import RocketMQ4

    target = RocketMQ4(to)
    brokers = await target.cluster()
    addr = next(b.master for b in brokers.values() if b.master)
    await target.create_topic(addr, topic, queues)
    body = b"x" * 256
    msgs = [(body, {"KEYS": f"k{i}", "UNIQ_KEY": f"RATE{i:028d}"}, 0) for i in range(batch)]
    per_queue = n // queues // batch

    async def one(q: int) -> None:
        for _ in range(per_queue):
            await target.send_batch(addr, topic, q, msgs)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(q) for q in range(queues)))
    took = time.perf_counter() - t0
    await target.close()
    return per_queue * queues * batch / took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--to", required=True, help="the target's name server HOST:PORT")
    ap.add_argument("-n", type=int, default=200_000)
    ap.add_argument("-q", type=int, default=8)
    ap.add_argument("--batch", type=int, default=512)
    a = ap.parse_args()
    stamp = int(time.time())
    with tempfile.TemporaryDirectory(prefix="txmq-bench-migrate-") as tmp:
        broker = BrokerProc(Path(tmp) / "data", "--flush", "async").start()
        try:
            topic = f"BenchMigrate{stamp}"
            asyncio.run(fill(broker.address, topic, a.n, a.q))
            moved, took = asyncio.run(migrate(broker.address, a.to, Path(tmp) / "state.json", a.batch))
        finally:
            broker.stop()
    own = asyncio.run(target_rate(a.to, f"BenchTarget{stamp}", a.n, a.q, a.batch))
    result = {"messages": moved, "seconds": round(took, 3), "migrate_msgs_per_s": round(moved / took),
              "target_batch_sends_per_s": round(own), "queues": a.q, "batch": a.batch, "body_bytes": 256,
              "command": command_line(), "machine": machine_info()}
    print(f"migrate: {moved} messages in {took:.2f} s = {moved / took:,.0f}/s; the target's own batch-send rate from one "
          f"client: {own:,.0f}/s ({a.q} queues, batches of {a.batch}, 256 B)")
    save_result("migrate", result)


if __name__ == "__main__":
    main()
