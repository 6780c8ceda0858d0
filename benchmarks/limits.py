"""The machine's limits, measured the way txmq uses the machine.

- Disk: 256-byte appends to a growing file (os.write, O_APPEND) on the
  filesystem of the broker's data directory, each followed by os.fsync, by
  os.fdatasync (what txmq's group commit calls), or by nothing (buffered).
  The three kinds run in interleaved rounds so a burst of I/O from
  elsewhere hurts them alike; the limit is the best round (disk_limits).
- Network + codec: a uvloop asyncio.Protocol server in a subprocess that
  splits txmq.wire frames, parses each payload and answers a small reply
  (what every txmq operation costs before the broker does any work), driven
  by a pipelined client with a given number of connections x requests in
  flight.

Run alone: ``.venv/bin/python benchmarks/limits.py [--seconds 2]`` prints JSON.
``limits.py echo-server PORT`` is the server half (used by echo_rps).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import WireConn, free_port, install_uvloop, percentiles_ms, wait_port  # noqa: E402

from txmq import wire  # noqa: E402

RECORD = 256
SYNCS = {"fsync": os.fsync, "fdatasync": os.fdatasync, "buffered": None}


# ---- disk ------------------------------------------------------------------
def disk_appends(directory: Path, seconds: float = 2.0, rounds: int = 3) -> dict[str, Any]:
    """Appends per second of each kind: median of `rounds` interleaved rounds of seconds/rounds each."""
    tmp = tempfile.mkdtemp(prefix="txmq-limits-", dir=directory)
    per_round = seconds / rounds
    rates: dict[str, list[float]] = {k: [] for k in SYNCS}
    buf = os.urandom(RECORD)
    try:
        for r in range(rounds):
            for kind, sync in SYNCS.items():
                path = os.path.join(tmp, f"{kind}-{r}")
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    n, t0 = 0, time.perf_counter()
                    end = t0 + per_round
                    write = os.write
                    while True:
                        write(fd, buf)
                        if sync is not None:
                            sync(fd)
                        n += 1
                        if (n & 15) == 0 and time.perf_counter() >= end:
                            break
                    rates[kind].append(n / (time.perf_counter() - t0))
                finally:
                    os.close(fd)
                    os.unlink(path)
    finally:
        os.rmdir(tmp)
    return {"rounds": {k: [round(x) for x in v] for k, v in rates.items()}, "record_bytes": RECORD, "directory": str(directory)}


def disk_limits(probes: list[dict[str, Any]]) -> dict[str, Any]:
    """The limit of each kind: its best round over every probe.

    Other processes' I/O can only slow a round down, never speed it up,
    so the best round is the closest to what the disk itself allows (and
    the strictest bound to hold txmq to); the median is kept for reference.
    """
    out: dict[str, Any] = {"record_bytes": RECORD, "directory": probes[0]["directory"], "rounds": {}}
    for k in SYNCS:
        rounds = [x for p in probes for x in p["rounds"][k]]
        out["rounds"][k] = rounds
        out[f"{k}_appends_per_s"] = max(rounds)
        out[f"{k}_median_per_s"] = round(statistics.median(rounds))
    return out


# ---- echo ------------------------------------------------------------------
class _EchoServer(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.dec = wire.FrameDecoder()

    def data_received(self, data: bytes) -> None:
        out = []
        for payload in self.dec.feed(data):
            f = wire.parse_payload(payload)
            out.append(wire.reply(f.id, {"ok": True, "n": f.id}))
        if out:
            self.transport.write(b"".join(out))  # type: ignore[attr-defined]


async def _serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_EchoServer, "127.0.0.1", port, backlog=1024)
    print("ready", flush=True)
    async with server:
        await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes stdin


async def _drive(port: int, connections: int, inflight: int, seconds: float, size: int) -> dict[str, Any]:
    body = os.urandom(size)
    conns = [await WireConn.open(f"127.0.0.1:{port}", {"client_id": "echo"}) for _ in range(connections)]
    lat: list[float] = []
    done = 0
    loop = asyncio.get_running_loop()
    finished = loop.create_future()
    t0 = time.perf_counter()
    deadline = t0 + seconds
    active = [0]

    def issue(c: WireConn) -> None:
        sent = time.perf_counter()

        def cb(code: int, fields: dict[str, Any]) -> None:
            nonlocal done
            now = time.perf_counter()
            lat.append(now - sent)
            done += 1
            if now < deadline:
                issue(c)
            else:
                active[0] -= 1
                if active[0] == 0 and not finished.done():
                    finished.set_result(None)

        c.send("echo", {"topic": "bench", "body": body}, cb)

    for c in conns:
        for _ in range(inflight):
            active[0] += 1
            issue(c)
    await finished
    elapsed = time.perf_counter() - t0
    for c in conns:
        c.close()
    return {"connections": connections, "inflight": inflight, "completed": done, "elapsed_s": round(elapsed, 3),
            "requests_per_s": round(done / elapsed, 1), "latency_ms": percentiles_ms(lat)}


def echo_rps(configs: list[tuple[int, int]], seconds: float = 2.0, size: int = RECORD) -> list[dict[str, Any]]:
    """Requests/s of the echo server at each (connections, in flight per connection)."""
    port = free_port()
    srv = subprocess.Popen([sys.executable, __file__, "echo-server", str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        wait_port(port, 20, srv)
        install_uvloop()
        return [asyncio.run(_drive(port, c, n, seconds, size)) for c, n in configs]
    finally:
        srv.stdin.close()  # type: ignore[union-attr]
        try:
            srv.wait(10)
        except subprocess.TimeoutExpired:
            srv.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="all", choices=["all", "echo-server"])
    ap.add_argument("port", nargs="?", type=int)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    a = ap.parse_args()
    if a.what == "echo-server":
        install_uvloop()
        asyncio.run(_serve(a.port))
        return
    res = {"disk": disk_limits([disk_appends(a.dir, a.seconds)]), "echo": echo_rps([(1, 1), (32, 1), (4, 64)], a.seconds)}
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
