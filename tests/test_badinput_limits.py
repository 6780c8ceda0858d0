"""Clients that would exhaust the broker: memory, descriptors, time.

Each attack is replayed at small scale against a real broker, with short
limits configured, and the defence is read from the broker's own figures
(counters, the `partial_frame_bytes` gauge), never from its RSS:

- frames left unfinished before hello: refused over the small pre-hello
  frame limit, closed at --auth-timeout, their bytes released;
- a frame left unfinished after hello: closed at --frame-timeout, while an
  idle authenticated connection and a long poll are left alone;
- many partial frames at once: the broker-wide --partial-frame-budget holds,
  the connection that would pass it gets BUSY and is closed;
- connections over --max-connections / --max-connections-per-ip: accepted,
  answered BUSY and closed at once, counted;
- the default connection limit leaves descriptors to the broker's own files,
  and running out of descriptors does not stop the broker accepting;
- properties over --max-properties: BODY_TOO_LARGE;
- limits the broker could not serve with: `broker start` exits 2.

A legitimate client is served throughout.
"""

from __future__ import annotations

import asyncio
import resource
import socket
import time

import pytest

from brokerproc import BrokerProcess, free_port
from conftest import arun
from clihelpers import refused_start
from txmq import wire
from txmq.broker.prom import BrokerCollector
from txmq.broker.testing import running_broker
from txmq.wire import ErrorCode
from wireclient import RawClient

TOKEN = "limits-token"
SHORT = 0.3  # the timeouts under test; every wait below is generous against it


async def until(cond, timeout: float = 4.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def refusal(c: RawClient, timeout: float = 4.0) -> wire.Frame:
    """The one error reply a refused connection gets, then the close."""
    f = await c.read_frame(timeout)
    assert f is not None and f.kind == wire.REPLY and f.op != 0, f
    assert await c.read_frame(timeout) is None, "the connection stayed open"
    await c.close()
    return f


def partial(length: int, sent: int) -> bytes:
    """The header of a frame of `length` bytes and the first `sent` bytes of it."""
    return wire.HEADER.pack(length) + b"\x00" * sent


def test_unfinished_frames_before_hello_are_closed_at_the_auth_timeout_and_released(tmp_path):
    async def go():
        async with running_broker(tmp_path / "data", auth_token=TOKEN, auth_timeout_s=SHORT, check_interval_s=3600) as b:
            core = b.core
            state = b.broker.native.state
            good = await RawClient.open(b.address)
            await good.ok("hello", {"token": TOKEN})
            # an 8 MiB frame announced before hello: over the pre-hello limit, refused on its header
            big = await RawClient.open(b.address)
            big.send_raw(partial(8 << 20, 1 << 20))
            f = await refusal(big)
            assert f.op == ErrorCode.FRAME_TOO_LARGE and str(core.config.max_preauth_frame) in f.fields["error"]
            # frames under the pre-hello limit, never finished: held until the auth timeout, then let go
            n, sent = 20, 50_000
            attackers = [await RawClient.open(b.address) for _ in range(n)]
            for c in attackers:
                c.send_raw(partial(60_000, sent))
            await until(lambda: state.partial_frame_bytes >= n * sent or core.metrics.counters["auth_timeouts"], what="partial frames held")
            assert state.partial_frame_bytes <= n * core.config.max_preauth_frame
            for c in attackers:
                f = await refusal(c)
                assert f.op == ErrorCode.AUTH_REQUIRED and "--auth-timeout" in f.fields["error"]
            await until(lambda: state.partial_frame_bytes == 0, what="partial frames released")
            counters = (await good.ok("stats"))["counters"]
            assert counters["auth_timeouts"] == n
            assert counters["errors_frame_too_large"] == 1
            # the authenticated connection sat idle for longer than the auth timeout and was not disturbed
            await asyncio.sleep(SHORT * 2)
            await good.ok("send", {"topic": "t", "body": b"after"})
            await until(lambda: len(state.connections) == 1, what="the refused connections to be gone")
            await good.close()

    arun(go())


def test_a_silent_connection_without_token_is_closed_at_the_auth_timeout(tmp_path):
    async def go():
        async with running_broker(tmp_path / "data", auth_timeout_s=SHORT, check_interval_s=3600) as b:
            silent = await RawClient.open(b.address)
            talker = await RawClient.open(b.address)
            await talker.ok("heartbeat")  # any first request will do without a token, hello is not required
            f = await refusal(silent)
            assert f.op == ErrorCode.AUTH_REQUIRED and "no request within" in f.fields["error"]
            await asyncio.sleep(SHORT * 2)
            await talker.ok("heartbeat")
            assert b.core.metrics.counters["auth_timeouts"] == 1
            await talker.close()

    arun(go())


def test_hello_and_a_large_frame_pipelined_in_one_write_are_both_served(tmp_path):
    async def go():
        async with running_broker(tmp_path / "data", auth_token=TOKEN, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            body = b"x" * (1 << 20)  # far over the pre-hello frame limit, fine once hello has succeeded
            c.send_raw(wire.request(1, "hello", {"token": TOKEN}) + wire.request(2, "send", {"topic": "t", "body": body}))
            replies = [await c.read_frame(), await c.read_frame()]
            assert [(f.id, f.op) for f in replies] == [(1, 0), (2, 0)], replies
            assert b.broker.native.state.partial_frame_bytes == 0
            await c.close()

    arun(go())


def test_an_unfinished_frame_is_closed_at_the_frame_timeout_and_idle_clients_are_not(tmp_path):
    async def go():
        async with running_broker(tmp_path / "data", auth_token=TOKEN, frame_timeout_s=SHORT, auth_timeout_s=SHORT,
                                  check_interval_s=3600) as b:
            core = b.core
            state = b.broker.native.state
            idle = await RawClient.open(b.address)
            await idle.ok("hello", {"token": TOKEN})
            poller = await RawClient.open(b.address)
            await poller.ok("hello", {"token": TOKEN})
            await poller.ok("create_topic", {"topic": "t"})
            slow = await RawClient.open(b.address)
            await slow.ok("hello", {"token": TOKEN})
            slow.send_raw(partial(1 << 20, 100_000))
            await until(lambda: state.partial_frame_bytes >= 100_000 or core.metrics.counters["frame_timeouts"], what="partial frame held")
            f = await refusal(slow)
            assert f.op == ErrorCode.MALFORMED_FRAME and "--frame-timeout" in f.fields["error"]
            await until(lambda: state.partial_frame_bytes == 0, what="partial frame released")
            # a long poll outlasting both timeouts, and a connection idle all along, are served
            t0 = time.monotonic()
            r = await poller.ok("pull", {"topic": "t", "queue_id": 0, "offset": 0, "wait_ms": int(SHORT * 3000)})
            assert r["messages"] == [] and time.monotonic() - t0 >= SHORT * 2
            await idle.ok("heartbeat")
            assert core.metrics.counters["frame_timeouts"] == 1 and core.metrics.counters["auth_timeouts"] == 0
            await until(lambda: len(state.connections) == 2, what="the refused connection to be gone")
            await idle.close()
            await poller.close()

    arun(go())


def test_partial_frames_beyond_the_budget_are_refused_and_memory_stays_bounded(tmp_path):
    budget = 2 << 20
    async def go():
        async with running_broker(tmp_path / "data", max_frame=1 << 20, max_body=512 << 10, partial_frame_budget=budget,
                                  check_interval_s=3600) as b:
            core = b.core
            state = b.broker.native.state
            good = await RawClient.open(b.address)
            await good.ok("hello", {})
            sent, refused, held = 400_000, [], []
            for _ in range(8):
                c = await RawClient.open(b.address)
                await c.ok("heartbeat")
                before = core.metrics.counters["partial_frame_refusals"]
                c.send_raw(partial(1_000_000, sent))
                await until(lambda: state.partial_frame_bytes >= (len(held) + 1) * sent
                            or core.metrics.counters["partial_frame_refusals"] > before, what="frame held or refused")
                assert state.partial_frame_bytes <= budget
                if core.metrics.counters["partial_frame_refusals"] > before:
                    f = await refusal(c)
                    assert f.op == ErrorCode.BUSY and f.fields["retriable"] is True and "--partial-frame-budget" in f.fields["error"]
                    refused.append(c)
                else:
                    held.append(c)
            assert len(held) == budget // sent and len(refused) == 8 - len(held)
            st = await good.ok("stats")
            assert st["gauges"]["partial_frame_bytes"] == len(held) * (4 + sent) <= budget
            assert st["counters"]["partial_frame_refusals"] == len(refused)
            await good.ok("send", {"topic": "t", "body": b"small"})  # complete frames need no budget
            for c in held:
                await c.close()
            await until(lambda: state.partial_frame_bytes == 0, what="partial frames released")
            await good.ok("send", {"topic": "t", "body": b"y" * (500 << 10)})
            await good.close()

    arun(go())


def test_connections_over_the_limits_are_answered_busy_closed_and_counted(tmp_path):
    async def go():
        async with running_broker(tmp_path / "data", max_connections=4, check_interval_s=3600) as b:
            state = b.broker.native.state
            good = await RawClient.open(b.address)
            await good.ok("hello", {})
            others = [await RawClient.open(b.address) for _ in range(3)]
            for c in others:
                await c.ok("heartbeat")
            for _ in range(2):
                c = await RawClient.open(b.address)
                f = await refusal(c)
                assert f.op == ErrorCode.BUSY and f.fields["retriable"] is True and "--max-connections" in f.fields["error"]
            assert len(state.connections) == 4
            await others.pop().close()
            await until(lambda: len(state.connections) == 3, what="a connection to close")
            again = await RawClient.open(b.address)
            await again.ok("heartbeat")
            counters = (await good.ok("stats"))["counters"]
            assert counters["connections_refused"] == 2 and counters["errors_busy"] == 2
            for c in [good, again, *others]:
                await c.close()

        async with running_broker(tmp_path / "data2", max_connections_per_ip=2, check_interval_s=3600) as b:
            a, c2 = await RawClient.open(b.address), await RawClient.open(b.address)
            f = await refusal(await RawClient.open(b.address))
            assert f.op == ErrorCode.BUSY and "--max-connections-per-ip" in f.fields["error"]
            await a.ok("heartbeat")
            assert (await c2.ok("stats"))["counters"]["connections_refused_per_ip"] == 1
            assert b.broker.native.state.by_ip == {"127.0.0.1": 2}
            await a.close()
            await c2.close()
            await until(lambda: not b.broker.native.state.by_ip, what="the per-address count to drop")

    arun(go())


def test_the_limits_are_exposed_to_prometheus(tmp_path):
    async def go():
        async with running_broker(tmp_path / "data", max_connections=1, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            await c.ok("heartbeat")
            await refusal(await RawClient.open(b.address))
            families = {m.name: m for m in BrokerCollector(b.core).collect()}
            await c.close()
        value = lambda name: families[name].samples[0].value  # noqa: E731
        assert value("txmq_connections_refused") == 1
        for name in ("txmq_connections_refused_per_ip", "txmq_auth_timeouts", "txmq_frame_timeouts", "txmq_partial_frame_refusals",
                     "txmq_partial_frame_bytes"):
            assert value(name) == 0, name
        assert value("txmq_max_connections") == 1

    arun(go())


def _limit_fds(n: int):
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return preexec


def test_the_default_connection_limit_leaves_descriptors_to_the_broker(tmp_path):
    fds = 256
    cap = fds - fds // 2  # RLIMIT_NOFILE minus its reserve, at most half of it
    with BrokerProcess(tmp_path / "data", preexec=_limit_fds(fds)) as b:
        async def go():
            good = await RawClient.open(b.address)
            await good.ok("hello", {})
            for _ in range(100):  # the start-up probe's connection is gone
                if (await good.ok("broker_info"))["connections"] == 1:
                    break
                await asyncio.sleep(0.02)
            extra = 30
            clients = [await RawClient.open(b.address) for _ in range(cap - 1 + extra)]

            async def first_frame(c: RawClient):
                try:
                    return await c.read_frame(1.0)  # a refused connection is answered at once, unasked
                except asyncio.TimeoutError:
                    return None

            firsts = await asyncio.gather(*[first_frame(c) for c in clients])
            refused = [f for f in firsts if f is not None]
            assert len(refused) == extra and all((f.id, f.op) == (0, ErrorCode.BUSY) for f in refused)
            served = [c for c, f in zip(clients, firsts) if f is None]
            assert len(served) == cap - 1
            for c in served:
                await c.ok("heartbeat")
            # at the limit, the broker still opens its own files: a new topic gets new consume-queue files
            for i in range(20):
                await good.ok("send", {"topic": f"fresh{i}", "body": b"x"})
            await good.ok("pull", {"topic": "fresh0", "queue_id": 0, "offset": 0})
            assert (await good.ok("stats"))["counters"]["connections_refused"] == extra
            for c in clients:
                await c.close()
            await good.close()

        arun(go())
        assert b.stop() == 0
    assert "Traceback" not in b.log.read_text()


def test_the_broker_keeps_accepting_after_running_out_of_descriptors(tmp_path):
    # a connection limit set above what the descriptors allow: accepts fail with EMFILE
    with BrokerProcess(tmp_path / "data", "--max-connections", "5000", preexec=_limit_fds(64)) as b:
        socks = []
        for _ in range(120):
            socks.append(socket.create_connection(("127.0.0.1", b.port), timeout=5))
        time.sleep(0.5)
        dropped = 0  # connections the broker could not keep: no descriptor left
        for s in socks:
            s.setblocking(False)
            try:
                dropped += s.recv(1) == b""
            except BlockingIOError:
                pass
            except ConnectionResetError:
                dropped += 1
        assert dropped > 0, "the descriptors never ran out"
        for s in socks:
            s.close()

        async def go():
            # until the broker has seen the hang-ups its descriptors are still taken and a new
            # connection is accepted and dropped (libuv's spare descriptor); then it is served
            deadline = time.monotonic() + 10
            while True:
                try:
                    c = await RawClient.open(b.address)
                    await c.ok("hello", {})
                    break
                except (ConnectionError, asyncio.TimeoutError):
                    assert time.monotonic() < deadline, "the broker stopped accepting"
                    await asyncio.sleep(0.05)
            await c.ok("send", {"topic": "t", "body": b"after"})
            assert (await c.ok("heartbeat"))["time_ms"] > 0
            await c.close()

        arun(go())
        assert b.stop() == 0


def test_properties_over_the_limit_get_body_too_large(tmp_path):
    async def go():
        async with running_broker(tmp_path / "data", max_properties=2048, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": ["g"]})
            big = {"k": "v" * 8192}
            for op, fields in (
                ("send", {"topic": "t", "body": b"x", "properties": big}),
                ("send", {"topic": "t", "body": b"x", "properties": {"TRAN_MSG": "true", "PGROUP": "g", **big}}),
                ("send_batch", {"topic": "t", "messages": [{"body": b"ok"}, {"body": b"x", "properties": big}]}),
                ("send", {"topic": "t", "body": b"x", "properties": {"k": "\u00e9" * 1100}}),  # 2201 bytes in UTF-8
                ("send", {"topic": "t", "body": b"x", "properties": {f"key{i}": "v" * 8 for i in range(200)}}),
            ):
                code, f = await c.req(op, fields)
                assert code == ErrorCode.BODY_TOO_LARGE and "properties of" in f["error"], (op, f)
            await c.ok("send", {"topic": "t", "body": b"x", "properties": {"k": "\u00e9" * 1000}})  # 2001 bytes: fits
            stored = [m for q in range(4) for m in (await c.ok("pull", {"topic": "t", "queue_id": q, "offset": 0}))["messages"]]
            assert [m["properties"].get("k") for m in stored] == ["\u00e9" * 1000]  # nothing of the refused requests
            await c.close()

        async with running_broker(tmp_path / "data2", max_body=4096, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            code, f = await c.req("send", {"topic": "t", "body": b"x", "properties": {"k": "v" * (100 << 10)}})
            assert code == ErrorCode.BODY_TOO_LARGE, f  # the default limit, 64 KiB
            await c.ok("heartbeat")
            await c.close()

    arun(go())


@pytest.mark.parametrize("args, says", [
    (["--max-frame", "0"], "--max-frame"),
    (["--max-frame", "1048576"], "--max-frame 1048576 is too small"),
    (["--max-body", "1024", "--max-properties", "100"], "--max-properties"),
    (["--auth-token", "t", "--max-preauth-frame", "100"], "--max-preauth-frame 100 is too small to carry a hello"),
    (["--partial-frame-budget", "1000"], "--partial-frame-budget 1000"),
    (["--max-connections", "0"], "--max-connections"),
    (["--flush", "async", "--flush-interval", "0"], "--flush-interval must be between 1ms and 1h"),
])
def test_limits_the_broker_could_not_serve_with_exit_2(tmp_path, args, says):
    assert says in refused_start(tmp_path, "--port", str(free_port()), *args)


def test_connection_refusals_are_logged_at_most_once_per_ten_seconds_with_the_count_since_the_last_line(caplog):
    import logging

    from txmq.broker.metrics import Metrics
    from txmq.broker.refusals import Refusals

    now = [1000.0]
    refusals = Refusals(Metrics(), clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="txmq.broker"):
        for _ in range(3):
            refusals.note("native", "connection_limit", "127.0.0.1:1", "too many connections: the broker's limit is 4 (--max-connections)")
        now[0] += 9.9
        refusals.note("native", "connection_limit", "127.0.0.1:2", "too many connections from 127.0.0.1 (--max-connections-per-ip)")
        now[0] += 0.1
        refusals.note("native", "connection_limit", "127.0.0.1:3", "too many connections from 127.0.0.1 (--max-connections-per-ip)")
    lines = [r.getMessage() for r in caplog.records if "event=refused" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "kind=connection_limit peer=127.0.0.1:1 refused=1 reason='too many connections: the broker's limit is 4" in lines[0].replace('"', "'")
    assert "kind=connection_limit peer=127.0.0.1:3 refused=4 reason='too many connections from 127.0.0.1 (--max-connections-per-ip)'" in lines[1]
    assert refusals.metrics.counters["refused_native_connection_limit"] == 5
