"""The broker process's CPU per relayed call on the front-end workers' channel (broker/workers/), nothing else.

A scripted worker in a process of its own writes CALL frames as a worker does (an SDK's headers, a 300-byte
request), keeping WINDOW calls in flight, to a WorkerPool whose one handler returns the request at once; the
broker side's CPU time over the run, divided by the calls, is what the relay costs it per call (msgpack, the
task per call, the batched writes), before any RocketMQ handler runs.

    .venv/bin/python benchmarks/relay_channel.py [--calls 100000] [--window 32]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack  # noqa: E402

from txmq.broker.workers.pool import UNARY, GrpcService, Handler, WorkerPool  # noqa: E402
from txmq.broker.workers.relay import CALL, HELLO, unpacker  # noqa: E402

HEADERS = [["x-mq-client-id", "c1"], ["x-mq-language", "PYTHON"], ["authorization", "x" * 100], ["x-mq-date-time", "20261129T000000Z"]]


def worker(path: str, token: str, go_ahead, calls: int, window: int, out) -> None:
    import os

    async def go() -> None:
        go_ahead.wait()  # the pool knows this process's pid: its hello is admitted
        r, w = await asyncio.open_unix_connection(path)
        up, pack = unpacker(), msgpack.Packer(use_bin_type=True).pack
        body = b"x" * 300
        w.write(pack([HELLO, 0, os.getpid(), token]))
        w.write(b"".join(pack([CALL, i, "Echo", HEADERS, "ipv4:127.0.0.1:1234", 5.0, body]) for i in range(window)))
        sent, got = window, 0
        t0 = time.perf_counter()
        while got < calls:
            data = await r.read(65536)
            if not data:
                raise SystemExit("the pool closed the channel")
            up.feed(data)
            n = sum(1 for _ in up)
            got += n
            more = min(n, calls - sent)
            if more > 0:
                w.write(b"".join(pack([CALL, sent + j, "Echo", HEADERS, "ipv4:127.0.0.1:1234", 5.0, body]) for j in range(more)))
                sent += more
        out.put(time.perf_counter() - t0)

    asyncio.run(go())


class _Spawned:
    """The pool's idea of its worker's process: the scripted one's pid, so its hello is admitted."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def send_signal(self, sig: int) -> None:
        self.returncode = -sig

    async def wait(self) -> int | None:
        return self.returncode


async def main(calls: int, window: int) -> None:
    async def echo(request: bytes, ctx) -> bytes:
        return request

    pool = WorkerPool(1, None)  # type: ignore[arg-type]
    pool.serve_grpc(GrpcService("bench.Echo", {"Echo": Handler(UNARY, echo, bytes)}, "127.0.0.1", 0, []))
    await pool.bind()
    ctx = multiprocessing.get_context("spawn")
    out, go_ahead = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=worker, args=(pool.socket_path, pool.token, go_ahead, calls, window, out))
    proc.start()
    pool.slots[0].process = _Spawned(proc.pid)  # type: ignore[assignment]
    go_ahead.set()
    c0 = time.process_time()
    while out.empty():
        await asyncio.sleep(0.05)
    c1 = time.process_time()
    elapsed = out.get()
    proc.join()
    pool.slots[0].process = None
    await pool.stop()
    await pool.close()
    print(f"{calls:,} calls, {window} in flight: {calls / elapsed:,.0f} calls/s; broker side {(c1 - c0) / calls * 1e6:.1f} µs CPU per call")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--window", type=int, default=32)
    a = ap.parse_args()
    import logging

    logging.getLogger("txmq.workers").setLevel(logging.ERROR)  # the scripted worker leaves when done: not a lost worker
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(a.calls, a.window))
