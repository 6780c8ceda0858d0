"""The RocketMQ front end's port against clients that would exhaust the broker's descriptors.

Connections to --rocketmq-port that never finish gRPC's handshake (half an
HTTP/2 preface) need no token: the gRPC port has its own connection cap
(--rocketmq-max-connections), and stalled connections are closed at the
handshake timeout (--auth-timeout). Both ports' default caps come from
RLIMIT_NOFILE with a reserve for the broker's own files, so a flood on
either port leaves the other port, the store (a new topic's files), the
checkpoints and the check service working.
"""

from __future__ import annotations

import asyncio
import resource
import socket
import threading
import time

import pytest

grpc = pytest.importorskip("grpc", reason="the rocketmq extra (grpcio) is not installed")

from conftest import arun  # noqa: E402

from txmq.broker.rocketmq import missing_dependency  # noqa: E402

if missing_dependency():
    pytest.skip(missing_dependency(), allow_module_level=True)

from brokerproc import BrokerProcess, free_port  # noqa: E402
from clihelpers import refused_start  # noqa: E402
from sdkenv import create_topics  # noqa: E402
from txmq.broker.prom import BrokerCollector  # noqa: E402
from txmq.broker.rocketmq.pb import definition_pb2 as d  # noqa: E402
from txmq.broker.rocketmq.pb import service_pb2 as s  # noqa: E402
from txmq.broker.rocketmq.pb import service_pb2_grpc as g  # noqa: E402
from txmq.broker.server import connection_limits  # noqa: E402
from txmq.broker.testing import running_broker  # noqa: E402
from wireclient import RawClient  # noqa: E402

HALF_PREFACE = b"PRI * HTTP/2.0\r\n"  # the first half of HTTP/2's client preface; the rest never comes
FULL_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # preface and an empty SETTINGS
OK = 20000


def _limit_fds(n: int):
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return preexec


def stalled(port: int, n: int, data: bytes = HALF_PREFACE) -> list[socket.socket]:
    """n connections to port that send data and then nothing."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(data)
        sock.setblocking(False)
        socks.append(sock)
    return socks


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        while True:
            if sock.recv(1 << 16) == b"":
                return True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def open_count(socks: list[socket.socket]) -> int:
    return sum(not closed_by_peer(sock) for sock in socks)


class CloseWatch(threading.Thread):
    """Counts, every 50 ms, the sockets still open; notes when every one was closed by the peer."""

    def __init__(self, socks: list[socket.socket], timeout: float) -> None:
        super().__init__(daemon=True)
        self.socks, self.timeout = socks, timeout
        self.counts: list[int] = []
        self.all_closed_at: float | None = None
        self.start()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            self.counts.append(open_count(self.socks))
            if self.counts[-1] == 0:
                self.all_closed_at = time.monotonic()
                return
            time.sleep(0.05)


def wait_until(cond, timeout: float) -> float:
    """Seconds until cond() held; raises after timeout."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout}s")
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_flood_of_stalled_grpc_connections_leaves_the_native_port_the_store_and_the_check_service_working(tmp_path):
    fds = 256
    handshake_s = 4.0  # the cap must be seen at work before the timeout closes the rest: seconds, for a loaded machine
    rport = free_port()
    args = ("--rocketmq-port", str(rport), "--auth-timeout", "4s", "--check-interval", "100ms", "--flush-interval", "100ms")
    with BrokerProcess(tmp_path / "data", *args, preexec=_limit_fds(fds)) as b:
        wait_until(lambda: "event=listening" in b.log.read_text(), 10.0)  # the port accepts a moment before the line
        line = next(ln for ln in b.log.read_text().splitlines() if "event=listening" in ln)
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        native_cap, grpc_cap = int(fields["max_connections"]), int(fields["rocketmq_max_connections"])
        assert (native_cap, grpc_cap) == connection_limits(fds, rocketmq=True)
        assert native_cap + grpc_cap <= fds - 128

        flood = 4 * fds  # far past the descriptors the broker has
        socks = stalled(rport, flood)
        watch = CloseWatch(socks, handshake_s + 10.0)
        try:
            # the connections past the cap are closed as soon as gRPC accepts them; the others stay until the timeout
            wait_until(lambda: watch.counts and watch.counts[-1] <= grpc_cap, handshake_s + 3.0)
            held = watch.counts[-1]  # checked after the native port's service: 0 would mean the timeout did it, not the cap

            async def go() -> None:
                c = await RawClient.open(b.address)
                await c.ok("hello", {"producer_groups": ["g"]})
                await c.ok("send", {"topic": "plain", "body": b"during the flood"})
                # a transactional send to a new topic: the store opens the topic's files, topics.json is written
                half = await c.ok("send", {"topic": "fresh-tx", "body": b"tx", "properties": {"TRAN_MSG": "true", "PGROUP": "g"}})
                await c.ok("end_transaction", {"group": "g", "tx_id": half["tx_id"], "commit_log_offset": half["commit_log_offset"],
                                               "half_offset": half["half_offset"], "state": "commit"})
                # checkpoints and check passes go on (one every 100 ms; given time on a loaded machine)
                before = (await c.ok("stats"))["counters"]
                deadline = time.monotonic() + 10
                while True:
                    after = (await c.ok("stats"))["counters"]
                    if all(after.get(k, 0) > before.get(k, 0) + 1 for k in ("check_passes", "checkpoints")):
                        break
                    assert time.monotonic() < deadline, (before, after)
                    await asyncio.sleep(0.1)
                await c.close()

            arun(go())
            assert 0 < held <= grpc_cap, (held, grpc_cap)
            # every stalled connection is closed at the handshake timeout
            watch.join()
            assert watch.all_closed_at is not None, watch.counts[-5:]  # by the timeout (the stalled connections never end)
        finally:
            for sock in socks:
                sock.close()
        assert b.stop() == 0
    log = b.log.read_text()
    for bad in ("Traceback", "event=flush_failed", "event=check_pass_failed", "event=store_error", "event=internal_error"):
        assert bad not in log, (bad, log[-3000:])


def test_a_flood_on_the_native_port_leaves_the_grpc_port_serving(tmp_path):
    fds = 256
    rport = free_port()
    with BrokerProcess(tmp_path / "data", "--rocketmq-port", str(rport), preexec=_limit_fds(fds)) as b:
        native_cap, _ = connection_limits(fds, rocketmq=True)
        create_topics(b, "orders")  # before the native port is flooded
        socks = stalled(b.port, 2 * fds, b"")
        try:
            wait_until(lambda: open_count(socks) <= native_cap, 30.0)  # the ones past the cap closed as they are accepted

            async def go() -> None:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{rport}") as ch:
                    req = s.QueryRouteRequest()
                    req.topic.name = "orders"
                    resp = await g.MessagingServiceStub(ch).QueryRoute(req, metadata=(("x-mq-client-id", "c1"),), timeout=5)
                    assert resp.status.code == OK, resp.status

            arun(go())
        finally:
            for sock in socks:
                sock.close()
        assert b.stop() == 0


def producer_settings(topic: str) -> s.TelemetryCommand:
    cmd = s.TelemetryCommand()
    cmd.settings.client_type = d.PRODUCER
    cmd.settings.user_agent.language = d.PYTHON
    cmd.settings.publishing.topics.add(name=topic)
    return cmd


def test_the_grpc_cap_refuses_connections_past_it_and_closes_stalled_and_idle_ones_but_not_a_telemetry_stream(tmp_path, monkeypatch):
    from txmq.broker.rocketmq import server as rmq_server

    monkeypatch.setattr(rmq_server, "IDLE_TIMEOUT_S", 3.0)  # timeouts of seconds: what is seen before one ends has time on a loaded machine
    cap = 20

    async def go():
        async with running_broker(tmp_path / "data", rocketmq_port=0, rocketmq_max_connections=cap, auth_timeout_s=4.0) as b:
            loop = asyncio.get_running_loop()
            async with grpc.aio.insecure_channel(b.rocketmq_address) as ch:
                stub = g.MessagingServiceStub(ch)
                outbox: asyncio.Queue = asyncio.Queue()

                async def commands():
                    while (cmd := await outbox.get()) is not None:
                        yield cmd

                telemetry = stub.Telemetry(commands(), metadata=(("x-mq-client-id", "p1"),))
                await outbox.put(producer_settings("orders"))
                assert (await asyncio.wait_for(telemetry.read(), 5)).status.code == OK
                assert b.core.registry.online("orders") == 1
                half = await loop.run_in_executor(None, stalled, b.rocketmq_port, 2 * cap)
                full: list[socket.socket] = []
                try:
                    # the client's own connection takes one place; the stalled ones are closed 4 s after they came
                    await loop.run_in_executor(None, wait_until, lambda: open_count(half) == cap - 1, 3.5)
                    took = await loop.run_in_executor(None, wait_until, lambda: open_count(half) == 0, 30.0)
                    assert took > 0.2
                    # a finished handshake and no RPC: closed once idle (3 s here), not before
                    full = await loop.run_in_executor(None, stalled, b.rocketmq_port, 5, FULL_PREFACE)
                    await asyncio.sleep(0.3)
                    assert await loop.run_in_executor(None, open_count, full) == 5
                    await loop.run_in_executor(None, wait_until, lambda: open_count(full) == 0, 30.0)
                finally:
                    for sock in half + full:
                        sock.close()
                # the producer's connection, with its Telemetry stream open, outlived the idle timeout
                assert b.core.registry.online("orders") == 1
                await outbox.put(producer_settings("orders"))
                assert (await asyncio.wait_for(telemetry.read(), 5)).status.code == OK
                await outbox.put(None)
                telemetry.cancel()
            families = {m.name: m for m in BrokerCollector(b.core).collect()}
            assert families["txmq_rocketmq_max_connections"].samples[0].value == cap

    arun(go())


@pytest.mark.parametrize("soft, rocketmq, native, rmq", [
    (1024, False, None, None),
    (1024, True, None, None),
    (65536, True, None, None),
    (1024, True, 100, None),
    (1024, True, None, 100),
    (256, True, None, None),
])
def test_both_ports_default_caps_leave_the_reserve_to_the_broker(soft, rocketmq, native, rmq):
    n, r = connection_limits(soft, rocketmq=rocketmq, max_connections=native, rocketmq_max_connections=rmq)
    reserve = min(512, soft // 2)
    if not rocketmq:
        assert r is None and n == soft - reserve
        return
    assert n >= 1 and r >= 1
    assert n + r == soft - reserve
    if native is not None:
        assert n == native
    if rmq is not None:
        assert r == rmq



@pytest.mark.parametrize("args, says", [
    (["--rocketmq-max-connections", "10"], "--rocketmq-max-connections needs --rocketmq-port"),
    (["--rocketmq-port", "18081", "--rocketmq-max-connections", "0"], "--rocketmq-max-connections"),
])
def test_a_grpc_connection_limit_the_broker_could_not_serve_with_exits_2(tmp_path, args, says):
    assert says in refused_start(tmp_path, "--port", str(free_port()), *args)
