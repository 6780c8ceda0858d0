"""Sends/s and transactions/s through the remoting front end (RocketMQ 4's protocol) next to txmq's native protocol.

One broker (`txmq broker start --flush F --remoting-port P`, fresh data directory in the temp dir) serves
both loads, one after the other, with the same shape: C connections, N requests in flight on each, a
256-byte body:

- native: `txmq bench send` / `txmq bench tx` (wire level, pipelined, half + end);
- remoting: the same at the frame level (tests/remotingwire.py, RocketMQ's documented frames):
  SEND_MESSAGE_V2 requests pipelined by opaque; a transaction is a half message (SEND_MESSAGE_V2 with
  TRAN_MSG) answered, then a oneway END_TRANSACTION commit, as the Java client's TransactionMQProducer
  sends them.

It reports throughput and the broker's CPU seconds per message or transaction (its /proc/PID/stat
before and after each run): the front end's translation cost, which the load generator's cost does not
blur (busy polling is off: its spinning would count as the broker's CPU). The broker's CPU per message falls as more messages arrive per turn of its loop, so the native
load also runs paced (`--rate`) to the rate the remoting load reached (this generator, plain Python
with JSON headers, is slower than `txmq bench`): the ratio compares the two at one rate. Each
measurement runs twice, interleaved, and the better run counts.

    .venv/bin/python benchmarks/remoting.py [--quick] [--flush sync|async] [-o json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import struct
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from benchlib import BrokerProc, command_line, cpu_seconds, free_port, machine_info, save_result, txmq_bench, wait_port  # noqa: E402

SIZE = 256


class _Load(asyncio.Protocol):
    """One connection keeping `inflight` requests in flight: sends, or transactions (half, then a oneway commit)."""

    def __init__(self, mode: str, inflight: int, left: list[int], done: asyncio.Future, n: int) -> None:
        self.mode, self.inflight, self.left, self.done, self.n = mode, inflight, left, done, n
        self.buf = bytearray()
        self.ids = itertools.count(1)
        self.body = b"x" * SIZE
        self.halves: dict[int, str] = {}
        self.run = time.time_ns()  # transaction ids are unique across runs on one broker

    def connection_made(self, transport) -> None:
        self.t = transport
        self.t.write(b"".join(self._next() for _ in range(self.inflight)))

    def _frame(self, code: int, opaque: int, ext: dict, body: bytes, flag: int = 0) -> bytes:
        h = json.dumps({"code": code, "language": "JAVA", "version": 0, "opaque": opaque, "flag": flag, "extFields": ext}).encode()
        return struct.pack(">ii", 4 + len(h) + len(body), len(h)) + h + body

    def _next(self) -> bytes:
        if self.left[0] <= 0:
            return b""
        self.left[0] -= 1
        o = next(self.ids)
        if self.mode == "send":
            return self._frame(310, o, {"a": "bench-pg", "b": "RemBench", "c": "TBW102", "d": "4", "e": "-1", "f": "0", "g": "0",
                                        "h": "0", "i": ""}, self.body)
        tx = f"B{self.run}-{self.n}-{o}"
        self.halves[o] = tx
        return self._frame(310, o, {"a": "bench-pg", "b": "RemBenchTx", "c": "TBW102", "d": "4", "e": "-1", "f": "4", "g": "0",
                                    "h": "0", "i": f"TRAN_MSG\x01true\x02PGROUP\x01bench-pg\x02UNIQ_KEY\x01{tx}\x02"}, self.body)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        out = []
        pos = 0
        while len(buf) - pos >= 4:
            (n,) = struct.unpack_from(">i", buf, pos)
            if len(buf) - pos - 4 < n:
                break
            (hl,) = struct.unpack_from(">i", buf, pos + 4)
            head = json.loads(bytes(buf[pos + 8 : pos + 8 + (hl & 0xFFFFFF)]))
            pos += 4 + n
            if head["code"] != 0:
                if not self.done.done():
                    self.done.set_exception(RuntimeError(head.get("remark")))
                return
            if self.mode == "tx":
                ext = head["extFields"]
                tx = self.halves.pop(head["opaque"])
                cl = struct.unpack(">q", bytes.fromhex(ext["msgId"])[-8:])[0]
                out.append(self._frame(37, next(self.ids), {"producerGroup": "bench-pg", "tranStateTableOffset": ext["queueOffset"],
                                                            "commitLogOffset": str(cl), "commitOrRollback": "8",
                                                            "fromTransactionCheck": "false", "msgId": tx, "transactionId": tx}, b"", 2))
            self.count += 1
            out.append(self._next())
        del buf[:pos]
        if out:
            self.t.write(b"".join(out))
        if self.left[0] <= 0 and self.count >= self.target and not self.done.done():
            self.done.set_result(None)

    count = 0
    target = 0


async def remoting_load(address: str, mode: str, connections: int, inflight: int, total: int) -> float:
    """Run `total` sends or transactions over `connections` connections; returns the seconds it took."""
    loop = asyncio.get_running_loop()
    host, port = address.rsplit(":", 1)
    left = [total]
    per = [total // connections + (1 if i < total % connections else 0) for i in range(connections)]
    t0 = time.perf_counter()
    waits = []
    for i in range(connections):
        done = loop.create_future()
        shared = [per[i]]
        _t, proto = await loop.create_connection(lambda s=shared, d=done, n=i: _Load(mode, inflight, s, d, n), host, int(port))
        proto.target = per[i]
        waits.append(done)
    await asyncio.gather(*waits)
    del left
    return time.perf_counter() - t0


def measure(broker: BrokerProc, run) -> dict:
    before = cpu_seconds(broker.pid)
    count, took = run()
    cpu = cpu_seconds(broker.pid) - before
    return {"per_s": round(count / took), "seconds": round(took, 3), "count": count,
            "broker_cpu_us_per_op": round(cpu / count * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--flush", default="async", choices=("sync", "async"))
    ap.add_argument("-c", "--connections", type=int, default=4)
    ap.add_argument("-n", "--inflight", type=int, default=64)
    ap.add_argument("-o", "--output", default="table", choices=("table", "json"))
    a = ap.parse_args()
    total = 20_000 if a.quick else 100_000
    rounds = 1 if a.quick else 2
    data = Path(tempfile.mkdtemp(prefix="txmq-remoting-bench-")) / "data"
    rport = free_port()
    broker = BrokerProc(data, "--flush", a.flush, "--remoting-port", str(rport), "--transaction-timeout", "60s", "--busy-poll", "0").start()
    wait_port(rport, 60, broker.proc)
    address = f"127.0.0.1:{rport}"
    shape = ["-c", str(a.connections), "-n", str(a.inflight), "-m", str(total), "--size", str(SIZE)]
    results: dict[str, dict] = {}
    try:
        for mode in ("send", "tx"):
            for _ in range(rounds):
                def native(mode=mode, rate=None):
                    s = txmq_bench([mode, "--broker", broker.address, *shape, *(["--rate", str(rate)] if rate else [])])
                    return s["completed"], s["elapsed_s"]

                def remoting(mode=mode):
                    return total, asyncio.run(remoting_load(address, mode, a.connections, a.inflight, total))

                rem = measure(broker, remoting)
                # the native protocol at its own best, and paced to the rate the remoting load reached: the broker's
                # CPU per message depends on how many arrive per turn of its loop, so the fair comparison is at one rate
                for key, fn in ((f"{mode}/remoting", remoting), (f"{mode}/native", native),
                                (f"{mode}/native_at_remoting_rate", lambda mode=mode, r=rem: native(mode, r["per_s"]))):
                    r = rem if fn is remoting else measure(broker, fn)
                    if key not in results or r["per_s"] > results[key]["per_s"]:
                        results[key] = r
    finally:
        broker.stop()
    doc = {"benchmark": "remoting", "command": command_line(), "flush": a.flush, "connections": a.connections, "inflight": a.inflight,
           "size": SIZE, "machine": machine_info(), "results": results,
           "cpu_ratio_same_rate": {m: round(results[f"{m}/remoting"]["broker_cpu_us_per_op"]
                                            / results[f"{m}/native_at_remoting_rate"]["broker_cpu_us_per_op"], 2) for m in ("send", "tx")},
           "cpu_ratio_each_at_best": {m: round(results[f"{m}/remoting"]["broker_cpu_us_per_op"]
                                               / results[f"{m}/native"]["broker_cpu_us_per_op"], 2) for m in ("send", "tx")}}
    if not a.quick:
        save_result("remoting", doc)
    if a.output == "json":
        print(json.dumps(doc, indent=2))
        return
    print(f"flush={a.flush} connections={a.connections} inflight={a.inflight} size={SIZE}")
    for key, r in results.items():
        print(f"{key:16} {r['per_s']:>8}/s  broker CPU {r['broker_cpu_us_per_op']:>6} us/op")
    print("remoting/native broker CPU per op, at the same rate:", doc["cpu_ratio_same_rate"], "each at its best:",
          doc["cpu_ratio_each_at_best"])


if __name__ == "__main__":
    main()
