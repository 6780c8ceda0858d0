"""Delayed and timed messages (docs/scheduled.md): memory, restart, burst delivery and steady lateness.

Each part runs a `txmq broker start` subprocess (async flush) on a fresh data directory and sends with the
native protocol (`send_batch` of --batch messages, each with its own TIMER_DELIVER_MS):

- ``memory``: --n messages scheduled over the next 24 hours. Broker RSS idle (before) and after (and its
  growth), then the time from spawning a broker on that directory to its first answered transaction (a half
  message and its commit), after a clean stop and after SIGKILL.
- ``burst``: --n messages all due in the same second (far enough ahead for the sends to finish). Delivery
  rate (messages / (last delivery - due time)) and lateness percentiles (store time of the delivered copy
  minus TIMER_DELIVER_MS), read back from the topic once the schedule is empty.
- ``steady``: --rate messages/s for --seconds, each due --ahead seconds after its send; lateness percentiles.

    .venv/bin/python benchmarks/scheduled.py [--parts memory,burst,steady] [--n 1000000] [--rate 5000] [--seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import BrokerProc, command_line, cpu_seconds, machine_info, percentiles_ms, proc_status, save_result  # noqa: E402

from txmq.client.connection import Client  # noqa: E402

TOPIC = "sched"


async def _send_scheduled(address: str, n: int, due_of, batch: int, window: int = 8) -> float:
    """Send n messages (due_of(i) -> epoch ms), window send_batch requests in flight; returns seconds taken."""
    t0 = time.perf_counter()
    async with Client(address, request_timeout=600) as c:
        await c.request("create_topic", {"topic": TOPIC, "queues": 8, "message_types": ["normal", "delay", "transaction"]})
        pending: set[asyncio.Future] = set()
        for start in range(0, n, batch):
            msgs = [{"body": b"x" * 64, "properties": {"TIMER_DELIVER_MS": str(due_of(i))}} for i in range(start, min(n, start + batch))]
            pending.add(asyncio.ensure_future(c.request("send_batch", {"topic": TOPIC, "messages": msgs})))
            if len(pending) >= window:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for d in done:
                    d.result()
        for d in pending:
            await d
    return time.perf_counter() - t0


async def _stats(address: str) -> dict[str, Any]:
    async with Client(address) as c:
        return await c.request("stats", {})


async def _first_transaction(address: str, deadline: float) -> float:
    """Seconds until a half message and its commit are answered (from now), retrying while the broker starts."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < deadline:
        try:
            async with Client(address, request_timeout=30, connect_timeout=1) as c:
                h = await c.request("send", {"topic": TOPIC, "body": b"tx", "properties": {"TRAN_MSG": "true", "PGROUP": "bench"}})
                await c.request("end_transaction", {"group": "bench", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                                    "half_offset": h["half_offset"], "state": "commit"})
                return time.perf_counter() - t0
        except Exception:  # noqa: BLE001 - not up yet
            await asyncio.sleep(0.02)
    raise TimeoutError("no transaction answered")


async def _lateness(address: str) -> list[float]:
    """(store_ts - TIMER_DELIVER_MS) in seconds of every delivered message of TOPIC, and the last store_ts."""
    late: list[float] = []
    last = 0
    async with Client(address, request_timeout=120) as c:
        for q in range(8):
            off = 0
            while True:
                r = await c.request("pull", {"topic": TOPIC, "queue_id": q, "offset": off, "max_count": 10_000, "max_bytes": 64 << 20})
                msgs = r["messages"]
                if not msgs:
                    break
                for m in msgs:
                    due = m["properties"].get("TIMER_DELIVER_MS")
                    if due is not None:
                        late.append((m["store_ts"] - int(due)) / 1000)
                        last = max(last, m["store_ts"])
                off = r["next_offset"]
    return late, last


def _wait_empty(address: str, timeout: float) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        g = asyncio.run(_stats(address))["gauges"]
        if g.get("scheduled") == 0:
            return g
        time.sleep(0.2)
    raise TimeoutError("the schedule did not empty")


def part_memory(root: Path, n: int, batch: int) -> dict[str, Any]:
    data = root / "memory"
    b = BrokerProc(data, "--flush", "async").start()
    try:
        time.sleep(2)
        idle = proc_status(b.pid, "VmRSS")
        now = int(time.time() * 1000)
        took = asyncio.run(_send_scheduled(b.address, n, lambda i: now + 60_000 + (i * 86_400_000) // n, batch))
        time.sleep(3)  # the index flushed, the window loaded
        after = proc_status(b.pid, "VmRSS")
        hwm = proc_status(b.pid, "VmHWM")
        g = asyncio.run(_stats(b.address))["gauges"]
    finally:
        b.stop()
    out: dict[str, Any] = {"n": n, "send_s": round(took, 2), "send_rate": round(n / took), "rss_idle_mib": round(idle, 1),
                           "rss_after_mib": round(after, 1), "rss_growth_mib": round(after - idle, 1), "rss_peak_mib": round(hwm, 1),
                           "scheduled": g.get("scheduled"), "timers_db_mib": round(os.path.getsize(data / "timers.db") / 2**20, 1)}
    for how in ("clean", "sigkill"):
        b = BrokerProc(data, "--flush", "async")
        b.spawn()
        out[f"restart_{how}_tx_s"] = round(asyncio.run(_first_transaction(b.address, 120)), 3)
        if how == "clean":
            b.stop()
        else:
            time.sleep(0.5)
            b.proc.send_signal(signal.SIGKILL)
            b.proc.wait()
            b.spawn()
            out["restart_after_sigkill_tx_s"] = round(asyncio.run(_first_transaction(b.address, 120)), 3)
            b.stop()
    out.pop("restart_sigkill_tx_s", None)
    return out


def part_burst(root: Path, n: int, batch: int, ahead_s: float) -> dict[str, Any]:
    data = root / "burst"
    b = BrokerProc(data, "--flush", "async").start()
    try:
        due = int((time.time() + ahead_s) * 1000)
        took = asyncio.run(_send_scheduled(b.address, n, lambda i: due, batch))
        if time.time() * 1000 > due:
            raise RuntimeError(f"sending took {took:.1f}s, past the due time: raise --burst-ahead")
        rss_before = proc_status(b.pid, "VmRSS")
        while time.time() * 1000 < due:
            time.sleep(0.01)
        cpu0 = cpu_seconds(b.pid)
        _wait_empty(b.address, 600)
        cpu = cpu_seconds(b.pid) - cpu0
        rss_peak = proc_status(b.pid, "VmHWM")
        late, last = asyncio.run(_lateness(b.address))
    finally:
        b.stop()
    span = max(0.001, (last - due) / 1000)
    return {"n": n, "delivered": len(late), "send_s": round(took, 2), "delivery_rate": round(len(late) / span),
            "last_delivery_after_due_s": round(span, 3), "lateness_ms": percentiles_ms(late),
            # the broker's CPU seconds from the due time until the schedule was empty (the machine may be shared):
            # the rate one CPU of its own would give
            "broker_cpu_s": round(cpu, 2), "delivery_rate_per_cpu_s": round(len(late) / max(cpu, 0.001)),
            "rss_before_mib": round(rss_before, 1), "rss_peak_mib": round(rss_peak, 1)}


def part_steady(root: Path, rate: int, seconds: float, ahead_s: float) -> dict[str, Any]:
    data = root / "steady"
    b = BrokerProc(data, "--flush", "async").start()
    try:
        async def run() -> int:
            sent = 0
            async with Client(b.address, request_timeout=60) as c:
                await c.request("create_topic", {"topic": TOPIC, "queues": 8, "message_types": ["normal", "delay"]})
                t0 = time.perf_counter()
                tick = 0.01
                while time.perf_counter() - t0 < seconds:
                    want = int((time.perf_counter() - t0) * rate)
                    k = want - sent
                    if k > 0:
                        now = int(time.time() * 1000)
                        msgs = [{"body": b"x" * 64, "properties": {"TIMER_DELIVER_MS": str(now + int(ahead_s * 1000))}} for _ in range(k)]
                        await c.request("send_batch", {"topic": TOPIC, "messages": msgs})
                        sent += k
                    await asyncio.sleep(tick)
            return sent

        sent = asyncio.run(run())
        _wait_empty(b.address, 120)
        late, _ = asyncio.run(_lateness(b.address))
    finally:
        b.stop()
    return {"rate": rate, "seconds": seconds, "sent": sent, "delivered": len(late), "lateness_ms": percentiles_ms(late)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="memory,burst,steady")
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--burst-ahead", type=float, default=60.0, help="burst: seconds ahead the messages are due")
    ap.add_argument("--rate", type=int, default=5000)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--steady-ahead", type=float, default=2.0)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="txmq-sched-", dir=args.dir))
    result: dict[str, Any] = {"command": command_line(), "machine": machine_info(root)}
    try:
        for part in args.parts.split(","):
            t0 = time.perf_counter()
            if part == "memory":
                result[part] = part_memory(root, args.n, args.batch)
            elif part == "burst":
                result[part] = part_burst(root, args.n, args.batch, args.burst_ahead)
            elif part == "steady":
                result[part] = part_steady(root, args.rate, args.seconds, args.steady_ahead)
            else:
                raise SystemExit(f"unknown part {part}")
            result[part]["took_s"] = round(time.perf_counter() - t0, 1)
            print(json.dumps({part: result[part]}), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"saved {save_result('scheduled', result)}")


if __name__ == "__main__":
    main()
