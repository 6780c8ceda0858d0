"""One check pass over many pending transactions: how long, how much memory, and do sends flow.

1. Starts ``txmq broker start --flush async --check-interval 1h
   --transaction-timeout 1h`` on a temporary data directory.
2. Creates N pending transactions (default 1,000,000) with raw pipelined
   half sends over txmq.wire and no end transaction.
3. Connects a producer of the group. By default it answers nothing
   (``--answer none``): every pending transaction is then checked in the
   pass, i.e. re-appended with its check count + 1 and pushed to the
   producer, which is the most work one pass can have. With
   ``--answer commit`` the producer commits each check-back, so the broker
   also runs N end transactions while the pass walks; that measures the
   producer as much as the check service.
4. Starts a plain-send load in a subprocess (``--send-rate``, default
   2,000/s, open loop) and, after a few seconds of baseline, triggers a pass
   with ``txmq config set transaction-timeout 0s`` and ``txmq config set
   check-interval 1s`` (an interval that is already overdue starts a pass at
   once), then ``check-interval 1h`` again so that no second pass follows.
5. Waits for the pass to finish (``tx_offsets`` half progress; then
   ``stats`` gauges.last_check_pass.took_s), sampling the broker's VmRSS.

Reports the pass duration, the broker's RSS before and at its peak, and
the latency of the plain sends issued during the pass (and before it).

    .venv/bin/python benchmarks/check_pass.py [--pending 1000000] [--answer none|commit] [-o json] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402
from benchlib import (  # noqa: E402
    TXMQ, BrokerProc, WireConn, command_line, cpu_seconds, cpu_times, data_disk_dir, install_uvloop, machine_info, percentiles_ms, proc_status, save_result,
)

from txmq import wire  # noqa: E402

GROUP, TOPIC, SIZE = "bench", "bench", 256
PRODUCER_WHY = {
    "none": ("The producer of the group is connected but answers no check-back, so the pass checks every pending transaction: "
             "it re-appends each half message with its check count + 1 and pushes a `check_transaction` for it. That is the most "
             "work one pass can be given, and it keeps the measurement about the check service (with `--answer commit` the broker "
             "would also run one end transaction per check-back while the pass walks)."),
    "commit": ("The producer of the group commits every check-back (`end_transaction` with `from_check`), so while the pass walks "
               "the broker also runs one end transaction per pending transaction."),
}


# ---- the plain-send load (a subprocess) ------------------------------------------------
async def _sender(address: str, rate: float) -> None:
    conn = await WireConn.open(address, {"client_id": "check-pass-sender"})
    body = b"s" * SIZE
    samples: list[tuple[float, float]] = []  # (sent at, latency s; -1 for an error)
    loop = asyncio.get_running_loop()
    stop = loop.run_in_executor(None, sys.stdin.read)  # the parent closes stdin to stop us
    tokens, last = 0.0, time.monotonic()

    def one() -> None:
        sent = time.monotonic()

        def cb(code: int, _f: dict[str, Any]) -> None:
            samples.append((sent, time.monotonic() - sent if code == 0 else -1.0))

        conn.send("send", {"topic": TOPIC, "body": body}, cb)

    while not stop.done():
        await asyncio.sleep(0.001)
        now = time.monotonic()
        tokens = min(tokens + (now - last) * rate, rate * 0.05)
        last = now
        while tokens >= 1:
            tokens -= 1
            one()
    await asyncio.sleep(0.5)  # let the last replies in
    json.dump(samples, sys.stdout)
    sys.stdout.flush()
    os._exit(0)  # the stdin reader thread is done; nothing else to wait for


# ---- filling and answering ------------------------------------------------------------------
async def fill(address: str, n: int, connections: int, inflight: int) -> dict[str, Any]:
    conns = [await WireConn.open(address, {"client_id": "check-pass-fill"}) for _ in range(connections)]
    body = b"h" * SIZE
    fields = {"topic": TOPIC, "body": body, "properties": {"TRAN_MSG": "true", "PGROUP": GROUP}}
    issued = done = 0
    errors: dict[str, int] = {}
    finished = asyncio.get_running_loop().create_future()

    def issue(c: WireConn) -> None:
        nonlocal issued
        if issued >= n:
            return
        issued += 1
        c.send("send", fields, lambda code, f: on_reply(c, code, f))

    def on_reply(c: WireConn, code: int, f: dict[str, Any]) -> None:
        nonlocal done
        done += 1
        if code != 0:
            errors[f.get("name", str(code))] = errors.get(f.get("name", str(code)), 0) + 1
        if done >= n and not finished.done():
            finished.set_result(None)
        issue(c)

    t0 = time.perf_counter()
    for c in conns:
        for _ in range(inflight):
            issue(c)
        c.flush()
    await finished
    took = time.perf_counter() - t0
    for c in conns:
        c.close()
    return {"fill_s": round(took, 2), "fill_rate": round(n / took), "fill_errors": errors}


class Producer(asyncio.Protocol):
    """A producer of the group: counts check-backs; with answer=commit, commits each."""

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.dec = wire.FrameDecoder(64 << 20)
        self.pushes = 0
        self.answered = 0
        self.next_id = 1
        self.ready = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        transport.write(wire.request(1, "hello", {"client_id": "check-pass-producer", "producer_groups": [GROUP]}))  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        out = []
        for payload in self.dec.feed(data):
            # Check-backs are pushes ([2, 0, ...]); only parse what we must.
            if self.answer == "none" and payload[1:2] == b"\x02":
                self.pushes += 1
                continue
            f = wire.parse_payload(payload)
            if f.kind == wire.PUSH:
                self.pushes += 1
                p = f.fields
                self.next_id += 1
                out.append(wire.request(self.next_id, "end_transaction", {
                    "group": p["group"], "tx_id": p["tx_id"], "commit_log_offset": p["commit_log_offset"],
                    "half_offset": p["half_offset"], "state": "commit", "from_check": True}))
            elif f.id == 1 and not self.ready.done():
                self.ready.set_result(None)
            else:
                self.answered += 1
        if out:
            self.transport.write(b"".join(out))  # type: ignore[attr-defined]


class RssSampler(threading.Thread):
    def __init__(self, pid: int, every: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.peak = 0.0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.peak = max(self.peak, proc_status(self.pid, "VmRSS"))
            self._halt.wait(self.every)

    def stop(self) -> float:
        self._halt.set()
        self.join()
        return self.peak


def config_set(address: str, key: str, value: str) -> None:
    subprocess.run([*TXMQ, "config", "set", key, value, "--broker", address, "-o", "json"], check=True, capture_output=True, timeout=60)


async def measure(b: BrokerProc, a: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    print(f"creating {a.pending:,} pending transactions ...", file=sys.stderr, flush=True)
    res: dict[str, Any] = await fill(b.address, a.pending, a.connections, a.inflight)
    print(f"  {res['fill_s']} s ({res['fill_rate']:,}/s); broker RSS {proc_status(b.pid, 'VmRSS'):.0f} MiB", file=sys.stderr, flush=True)
    admin = await WireConn.open(b.address, {"client_id": "check-pass-admin"})
    offs = await admin.call("tx_offsets", {})
    half_max = offs["half"]["max"]
    _, prod = await loop.create_connection(lambda: Producer(a.answer), "127.0.0.1", b.port)
    await prod.ready
    sender = subprocess.Popen([sys.executable, __file__, "_sender", b.address, str(a.send_rate)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    await asyncio.sleep(a.baseline)
    res["rss_before_mb"] = round(proc_status(b.pid, "VmRSS"), 1)
    sampler = RssSampler(b.pid)
    sampler.start()
    t_base = time.monotonic() - a.baseline
    print("triggering a check pass ...", file=sys.stderr, flush=True)
    await loop.run_in_executor(None, config_set, b.address, "transaction-timeout", "0s")
    t_trigger = time.monotonic()
    await loop.run_in_executor(None, config_set, b.address, "check-interval", "1s")
    t_started = time.monotonic()  # the broker answered: the pass starts right after its reply
    cpu0 = cpu_seconds(b.pid), cpu_times(b.pid, b.pid)  # the whole broker, and its event-loop (main) thread
    # The next pass is timed from this one's start: an interval of an hour
    # again keeps it to one pass.
    await loop.run_in_executor(None, config_set, b.address, "check-interval", "1h")
    deadline = t_started + a.timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        offs = await admin.call("tx_offsets", {})
        if offs["half"]["progress"] >= half_max or (a.answer == "none" and prod.pushes >= a.pending):
            break
    while time.monotonic() < deadline:  # the pass is over once the broker has counted it
        stats = await admin.call("stats", {})
        if stats["gauges"]["check_passes"] >= 1:
            break
        await asyncio.sleep(0.25)
    # Where the pass's time went: with the event loop's thread near 100% of
    # the pass the broker is CPU-bound; the rest of the process is the flush
    # threads (the commit log's, and the index file's in a worker thread).
    res["broker_cpu_s"] = round(cpu_seconds(b.pid) - cpu0[0], 2)
    user, system = cpu_times(b.pid, b.pid)
    res["broker_loop_thread_cpu_s"] = round(user + system - sum(cpu0[1]), 2)
    res["broker_loop_thread_system_s"] = round(system - cpu0[1][1], 2)
    res["rss_peak_mb"] = round(sampler.stop(), 1)
    res["pass"] = stats["gauges"]["last_check_pass"]
    res["check_passes"] = stats["gauges"]["check_passes"]
    took = float(res["pass"].get("took_s", time.monotonic() - t_started))
    await asyncio.sleep(1.0)
    sender.stdin.close()  # type: ignore[union-attr]
    samples = json.loads(sender.stdout.read() or b"[]")  # type: ignore[union-attr]
    sender.wait(30)
    res["pushes_received"] = prod.pushes
    res["answers_received"] = prod.answered
    during = [lat for t, lat in samples if t_started - 0.05 <= t <= t_started + took and lat >= 0]
    before = [lat for t, lat in samples if t_base <= t < t_trigger and lat >= 0]
    res["sends_during_pass"] = percentiles_ms(during)
    res["sends_before_pass"] = percentiles_ms(before)
    res["send_errors"] = sum(1 for _, lat in samples if lat < 0)
    res["sends_total"] = len(samples)
    admin.close()
    prod.transport.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if len(sys.argv) > 1 and sys.argv[1] == "_sender":
        install_uvloop()
        asyncio.run(_sender(sys.argv[2], float(sys.argv[3])))
        return
    ap.add_argument("--pending", type=int, default=1_000_000, help="pending transactions to create (default 1,000,000)")
    ap.add_argument("--answer", choices=["none", "commit"], default="none", help="what the connected producer answers to check-backs")
    ap.add_argument("--send-rate", type=float, default=2000, help="plain sends per second during the measurement")
    ap.add_argument("--baseline", type=float, default=3.0, help="seconds of sends before the pass is triggered")
    ap.add_argument("--connections", type=int, default=4, help="connections used to create the pending transactions")
    ap.add_argument("--inflight", type=int, default=256, help="half sends in flight per connection while filling")
    ap.add_argument("--timeout", type=float, default=600, help="give up waiting for the pass after this many seconds")
    ap.add_argument("--write", type=Path, metavar="DOC", help="save the result and write it into this Markdown file")
    ap.add_argument("-o", "--output", choices=["text", "json"], default="text")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="txmq-checkpass-", dir=data_disk_dir()))
    b = BrokerProc(tmp / "data", "--flush", "async", "--check-interval", "1h", "--transaction-timeout", "1h", "--log-level", "info",
                   log_path=tmp / "broker.log")
    try:
        b.start()
        install_uvloop()
        res = asyncio.run(measure(b, a))
    except BaseException:
        print(b.log_tail(), file=sys.stderr)
        raise
    finally:
        b.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    res = {"kind": "check_pass", "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "command": command_line(),
           "machine": machine_info(data_disk_dir()), "pending": a.pending, "producer": f"connected, answers {a.answer}",
           "producer_why": PRODUCER_WHY[a.answer], "send_rate": a.send_rate, **res}
    if a.write:
        save_result("check_pass", res)
        report.write_doc(a.write)
    s = res["sends_during_pass"]
    print(f"check pass over {a.pending:,} pending: {res['pass'].get('took_s')} s (walked {res['pass'].get('walked', 0):,}, "
          f"checked {res['pass'].get('checked', 0):,}); broker RSS {res['rss_before_mb']:.0f} -> peak {res['rss_peak_mb']:.0f} MiB; "
          f"{s.get('count', 0):,} sends during the pass, p50 {s.get('p50')} ms p99 {s.get('p99')} ms max {s.get('max')} ms; "
          f"send errors {res['send_errors']}; broker CPU {res['broker_cpu_s']} s, of which its event-loop thread "
          f"{res['broker_loop_thread_cpu_s']} s ({res['broker_loop_thread_system_s']} s in the kernel)",
          file=sys.stderr if a.output == "json" else sys.stdout)
    if a.output == "json":
        print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
