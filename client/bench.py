"""The load generator behind ``txmq bench`` (`txmq.client.bench`).

It sits with the client because it is one: it speaks the wire to a running
broker (or starts one as a subprocess, ``EmbeddedBroker``) and, like the
client, never imports the broker, the store or the CLI. Messages for the
user go through the ``warn`` and ``note`` callbacks (the CLI prints them).

Lean on purpose: one asyncio.Protocol per connection speaking txmq.wire
directly (no task per request, frames pre-encoded where possible, replies
parsed in batches), so on a small machine the generator costs less CPU than
the broker it measures. Latencies are recorded per operation in
``array('d')`` (8 bytes each) and summarised as percentiles at the end.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack

from txmq import wire

HELLO_ID = 0xFFFFFFFF
_packb = msgpack.Packer(use_bin_type=True).pack


def _unpackb(payload: bytes) -> list:
    return msgpack.unpackb(payload, raw=False)


def _stderr(prefix: str) -> Callable[[str], None]:
    def say(message: str) -> None:
        print(prefix + message, file=sys.stderr)

    return say


@dataclass
class BenchConfig:
    mode: str  # tx | send | consume
    address: str
    token: str | None = None
    connections: int = 4
    inflight: int = 64
    messages: int | None = 100_000
    duration: float | None = None
    size: int = 256
    batch: int = 1
    topic: str = "bench"
    group: str = "bench"
    mix: dict[str, float] = field(default_factory=lambda: {"commit": 1.0})
    rate: float | None = None  # transactions or requests per second, all connections together


class Stats:
    def __init__(self, ops: tuple[str, ...]) -> None:
        self.lat: dict[str, array] = {op: array("d") for op in ops}
        self.errors: dict[str, int] = {}
        self.outcomes: dict[str, int] = {}
        self.done = 0  # completed units (transactions / messages)
        self.issued = 0

    def error(self, name: str) -> None:
        self.errors[name] = self.errors.get(name, 0) + 1

    def results(self, elapsed: float, unit: str) -> dict[str, Any]:
        """The figures of a run, as every mode's summary ends: completed units, throughput, latency percentiles, errors, outcomes."""
        return {
            "completed": self.done, "elapsed_s": round(elapsed, 3),
            "throughput": round(self.done / elapsed, 1) if elapsed > 0 else 0.0, "unit": unit,
            "latency_ms": {op: percentiles(v) for op, v in self.lat.items()},
            "errors": self.errors, "outcomes": self.outcomes,
        }

    async def report_progress(self, progress: Callable[[int, int], None], total: int) -> None:
        """Call progress(completed units, total) every 0.2 s until cancelled (the CLI's progress bar)."""
        while True:
            await asyncio.sleep(0.2)
            progress(self.done, total)


def percentiles(values: array) -> dict[str, float | int]:
    if not values:
        return {"count": 0}
    s = sorted(values)
    n = len(s)

    def q(p: float) -> float:
        return round(s[min(n - 1, int(p * n))] * 1000, 3)

    return {"count": n, "p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "p999": q(0.999), "max": round(s[-1] * 1000, 3),
            "mean": round(sum(s) / n * 1000, 3)}


class _Gen(asyncio.Protocol):
    """One connection: keeps up to `inflight` units in flight."""

    def __init__(self, bench: "Bench") -> None:
        self.b = bench
        self.cfg = bench.cfg
        self.dec = wire.FrameDecoder(64 << 20)
        self.next_id = 0
        self.ctx: dict[int, tuple] = {}
        self.active = 0
        self.transport: asyncio.Transport | None = None
        self.ready = asyncio.get_running_loop().create_future()
        self.out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        hello: dict[str, Any] = {"client_id": f"bench-{os.getpid()}"}
        if self.cfg.token:
            hello["token"] = self.cfg.token
        self.transport.write(wire.request(HELLO_ID, "hello", hello))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(f"connection lost: {exc}"))
        self.b.lost(self)

    def fill(self) -> None:
        while self.active < self.cfg.inflight and self.b.may_issue():
            self.active += 1
            self.b.start_unit(self)
        self.flush()

    def request(self, op: str, fields: dict[str, Any], ctx: tuple) -> None:
        self.next_id = (self.next_id + 1) & 0x7FFFFFFF
        self.ctx[self.next_id] = ctx
        self.out.append(wire.request(self.next_id, op, fields))

    def request_template(self, tail: bytes, ctx: tuple) -> None:
        """A request whose op and fields never change: only the id is encoded (see Bench.template)."""
        self.next_id = i = (self.next_id + 1) & 0x7FFFFFFF
        self.ctx[i] = ctx
        head = b"\x94\x00" + _packb(i)
        self.out.append(wire.HEADER.pack(len(head) + len(tail)) + head + tail)

    def flush(self) -> None:
        if self.out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self.out))
        self.out = []

    def data_received(self, data: bytes) -> None:
        b = self.b
        for payload in self.dec.feed(data):
            _kind, id_, code, fields = _unpackb(payload)  # the broker is trusted here: no per-frame validation
            if id_ == HELLO_ID:
                if code != 0:
                    self.ready.set_exception(wire.TxmqError.from_reply(int(code), fields))
                else:
                    self.ready.set_result(None)
                continue
            ctx = self.ctx.pop(id_, None)
            if ctx is None:
                continue
            b.on_reply(self, ctx, code, fields)
        self.fill()


class Bench:
    def __init__(self, cfg: BenchConfig, progress: Callable[[int, int], None] | None = None, *,
                 warn: Callable[[str], None] | None = None, note: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.warn = warn or _stderr("warning: ")
        self.note = note or _stderr("")
        ops = {"tx": ("half", "end", "tx"), "send": ("send",), "consume": ("pull",)}[cfg.mode]
        self.stats = Stats(ops)
        self.body = os.urandom(cfg.size // 2).hex().encode()[: cfg.size].ljust(cfg.size, b"x")
        self.progress = progress
        self.gens: list[_Gen] = []
        self._deadline: float | None = None
        self._finished: asyncio.Future | None = None
        self._t0 = 0.0
        self._mix_states = list(cfg.mix)
        self._mix_weights = [cfg.mix[k] for k in self._mix_states]
        self._rng = random.Random(1)
        self._tokens = float("inf")
        self._queues: list[tuple[int, int]] = []  # consume: (queue id, next offset)
        self._qi = 0
        self._checker: Any = None
        self._unknown: list[tuple[str, int, int]] = []  # tx: (tx_id, commit_log_offset, half_offset) ended unknown
        self.rolled_back = 0

    # ---- unit accounting --------------------------------------------------
    def may_issue(self) -> bool:
        cfg = self.cfg
        if self._finished is None or self._finished.done():
            return False
        if cfg.messages is not None and self.stats.issued * max(1, cfg.batch if cfg.mode == "send" else 1) >= cfg.messages:
            return False
        if self._deadline is not None and time.perf_counter() >= self._deadline:
            return False
        if self._tokens < 1:
            return False
        self._tokens -= 1
        self.stats.issued += 1
        return True

    def _templates(self) -> None:
        cfg = self.cfg
        if cfg.mode == "send" and cfg.batch > 1:
            self._tail = _packb("send_batch") + _packb({"topic": cfg.topic, "messages": [{"body": self.body}] * cfg.batch})
        elif cfg.mode == "send":
            self._tail = _packb("send") + _packb({"topic": cfg.topic, "body": self.body})
        elif cfg.mode == "tx":
            self._tail = _packb("send") + _packb({"topic": cfg.topic, "body": self.body, "properties": {"TRAN_MSG": "true", "PGROUP": cfg.group}})

    def start_unit(self, g: _Gen) -> None:
        cfg = self.cfg
        now = time.perf_counter()
        if cfg.mode == "send":
            g.request_template(self._tail, ("send", now, now))
        elif cfg.mode == "tx":
            g.request_template(self._tail, ("half", now, now))
        else:
            i = self._qi % len(self._queues)
            self._qi += 1
            qid, off = self._queues[i]
            self._queues[i] = (qid, off + cfg.batch)  # optimistic: pulls in flight never overlap
            g.request("pull", {"topic": cfg.topic, "queue_id": qid, "offset": off, "max_count": cfg.batch}, ("pull", now, now, qid))

    def on_reply(self, g: _Gen, ctx: tuple, code: int, fields: dict[str, Any]) -> None:
        st = self.stats
        kind, t_unit, t_op = ctx[0], ctx[1], ctx[2]
        now = time.perf_counter()
        if code != 0:
            st.error(wire.ErrorCode(code).name if code in wire.ErrorCode._value2member_map_ else str(code))
            self._unit_done(g, count=0)
            return
        st.lat[kind].append(now - t_op)
        if kind == "half":
            state = self._rng.choices(self._mix_states, self._mix_weights)[0] if len(self._mix_states) > 1 else self._mix_states[0]
            g.request("end_transaction", {"group": self.cfg.group, "tx_id": fields["tx_id"], "commit_log_offset": fields["commit_log_offset"],
                                          "half_offset": fields["half_offset"], "state": state}, ("end", t_unit, now, state))
            if state == "unknown":  # left pending on purpose: rolled back at the end unless a check-back decided it
                self._unknown.append((fields["tx_id"], fields["commit_log_offset"], fields["half_offset"]))
            return
        if kind == "end":
            st.lat["tx"].append(now - t_unit)
            st.outcomes[ctx[3]] = st.outcomes.get(ctx[3], 0) + 1
            self._unit_done(g)
        elif kind == "pull":
            self._unit_done(g, count=len(fields.get("messages", ())))
        else:
            self._unit_done(g, count=self.cfg.batch)

    def _unit_done(self, g: _Gen, count: int = 1) -> None:
        g.active -= 1
        self.stats.done += count
        cfg = self.cfg
        fin = self._finished
        if fin is None or fin.done():
            return
        if cfg.mode == "consume" and cfg.messages is not None and self.stats.done >= cfg.messages:
            fin.set_result(None)
        elif not self.may_issue_any() and all(x.active == 0 for x in self.gens):
            fin.set_result(None)

    def may_issue_any(self) -> bool:
        cfg = self.cfg
        if cfg.messages is not None and cfg.mode != "consume" and self.stats.issued * max(1, cfg.batch if cfg.mode == "send" else 1) >= cfg.messages:
            return False
        if self._deadline is not None and time.perf_counter() >= self._deadline:
            return False
        return True

    def lost(self, g: _Gen) -> None:
        if self._finished is not None and not self._finished.done():
            self.stats.error("CONNECTION_LOST")
            self._finished.set_result(None)

    # ---- running ----------------------------------------------------------
    async def _connect(self) -> _Gen:
        host, port = self.cfg.address.rsplit(":", 1)
        _, g = await asyncio.get_running_loop().create_connection(lambda: _Gen(self), host.strip("[]"), int(port))
        await g.ready
        return g

    async def _prepare_consume(self) -> None:
        from .connection import Client

        async with Client(self.cfg.address, token=self.cfg.token, reconnect=False) as c:
            topics = {t["topic"]: t for t in (await c.request("list_topics", {}))["topics"]}
            need = self.cfg.messages or 100_000
            have = topics.get(self.cfg.topic, {}).get("messages", 0)
            if have < need:  # fill phase, not timed
                missing = need - have
                batch = [{"body": self.body}] * 100
                futs = [c.send_request("send_batch", {"topic": self.cfg.topic, "messages": batch}) for _ in range((missing + 99) // 100)]
                for i in range(0, len(futs), 256):
                    await asyncio.gather(*futs[i : i + 256])
            topics = {t["topic"]: t for t in (await c.request("list_topics", {}))["topics"]}
            self._queues = [(q, 0) for q in range(topics[self.cfg.topic]["queues"])]

    async def _start_checker(self) -> None:
        """A producer of the bench group that answers check-backs of unknowns with commit."""
        from .connection import Client

        holder: dict[str, Any] = {}

        def on_push(op: str, f: dict[str, Any]) -> None:
            if op == "check_transaction":
                holder["c"].send_request("end_transaction", {"group": f["group"], "tx_id": f["tx_id"], "commit_log_offset": f["commit_log_offset"],
                                                             "half_offset": f["half_offset"], "state": "commit", "from_check": True})

        c = Client(self.cfg.address, token=self.cfg.token, producer_groups=[self.cfg.group], push_handler=on_push, reconnect=False)
        holder["c"] = c
        await c.start()
        self._checker = c

    async def run(self) -> dict[str, Any]:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        if cfg.mode == "consume":
            cfg.batch = max(cfg.batch, 32)
            await self._prepare_consume()
        if cfg.mode == "tx" and cfg.mix.get("unknown"):
            await self._start_checker()
        self._templates()
        self.gens = [await self._connect() for _ in range(cfg.connections)]
        self._finished = loop.create_future()
        self._t0 = time.perf_counter()
        if cfg.duration:
            self._deadline = self._t0 + cfg.duration
        ticker = None
        if cfg.rate:
            self._tokens = 0.0
            ticker = loop.create_task(self._pace())
        reporter = loop.create_task(self.stats.report_progress(self.progress, cfg.messages or 0)) if self.progress else None
        for g in self.gens:
            g.fill()
        if cfg.duration:
            loop.call_later(cfg.duration + 0.01, self._check_done)
        await self._finished
        elapsed = time.perf_counter() - self._t0
        for t in (ticker, reporter):
            if t is not None:
                t.cancel()
        for g in self.gens:
            if g.transport is not None:
                g.transport.close()
        if self._checker is not None:
            await self._checker.close()
        if self._unknown:
            await self._roll_back_unknown()
        return self.summary(elapsed)

    async def _roll_back_unknown(self) -> None:
        """Transactions the mix ended `unknown` would stay pending on the broker: roll back those still pending."""
        from .connection import Client
        from txmq.wire import TxmqError

        async def one(c: Any, tx_id: str, clo: int, ho: int) -> bool:
            try:
                await c.request("end_transaction", {"group": self.cfg.group, "tx_id": tx_id, "commit_log_offset": clo,
                                                    "half_offset": ho, "state": "rollback"})
                return True
            except TxmqError:  # decided already (a check-back committed it), or a newer half copy: not pending from us
                return False

        try:
            async with Client(self.cfg.address, token=self.cfg.token, reconnect=False) as c:
                for i in range(0, len(self._unknown), 256):
                    done = await asyncio.gather(*(one(c, *u) for u in self._unknown[i : i + 256]))
                    self.rolled_back += sum(done)
        except (OSError, TxmqError, TimeoutError) as e:
            self.warn(f"{len(self._unknown) - self.rolled_back} transactions ended 'unknown' may still be pending on "
                 f"{self.cfg.address} (group {self.cfg.group}): {e}; `txmq checker --group {self.cfg.group} --answer rollback --now --idle-exit 5s` ends them")
            return
        if self.rolled_back:
            self.note(f"rolled back {self.rolled_back} transactions the mix left pending ('unknown' and not yet checked back), "
                 f"group {self.cfg.group}")

    def _check_done(self) -> None:
        """End the run once nothing more may be issued (deadline passed, count reached) and nothing is in flight.

        With --rate there are moments with nothing in flight between two
        paced requests: those are not the end of the run.
        """
        if (self._finished is not None and not self._finished.done() and not self.may_issue_any()
                and all(g.active == 0 for g in self.gens)):
            self._finished.set_result(None)

    async def _pace(self) -> None:
        rate = float(self.cfg.rate or 0)
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self._tokens = min(self._tokens + (now - last) * rate, max(1.0, rate * 0.01))
            last = now
            for g in self.gens:
                g.fill()
            self._check_done()

    def summary(self, elapsed: float) -> dict[str, Any]:
        cfg, st = self.cfg, self.stats
        return {
            "mode": cfg.mode, "address": cfg.address, "connections": cfg.connections, "inflight": cfg.inflight,
            "size": cfg.size, "batch": cfg.batch, "rate": cfg.rate, "mix": cfg.mix if cfg.mode == "tx" else None,
            **st.results(elapsed, {"tx": "transactions/s", "send": "messages/s", "consume": "messages/s"}[cfg.mode]),
            **({"unknown_rolled_back": self.rolled_back} if cfg.mode == "tx" and cfg.mix.get("unknown") else {}),
        }


# ---- an embedded broker in a subprocess ----------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedBroker:
    """`txmq broker start` on a temporary data directory, for --embedded."""

    def __init__(self, flush: str, extra: list[str] | None = None, data_dir: Path | None = None) -> None:
        self.flush = flush
        self.extra = extra or []
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="txmq-bench-")
        self.data_dir = data_dir or Path(self._tmp.name) / "data"  # type: ignore[union-attr]
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> "EmbeddedBroker":
        txmq = [sys.executable] if getattr(sys, "frozen", False) else [sys.executable, "-m", "txmq"]  # the single executable is txmq itself
        cmd = [*txmq, "broker", "start", "--data-dir", str(self.data_dir), "--port", str(self.port),
               "--flush", self.flush, "--log-level", "warning", *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"embedded broker exited: {self.proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("embedded broker did not start within 30 s")

    def cpu_seconds(self) -> float:
        assert self.proc is not None
        parts = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mb(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self._tmp is not None:
            self._tmp.cleanup()
