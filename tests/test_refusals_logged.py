"""Every refusal leaves a trace: one throttled log line naming the peer and the reason, and a count in stats and /metrics.

For the native and the remoting front ends, each kind of refusal
(broker/refusals.py): a wrong credential (auth), a connection over a cap
(connection_limit), a malformed request (bad_request), a first request
that never came (timeout), the partial-frame budget (busy). Each is logged
as ``event=refused frontend=<f> kind=<k> peer=<address> refused=<n>
reason='...'`` and counted as ``refused_<f>_<k>`` (``txmq stats``) and
``txmq_refused_total{frontend, kind}`` (/metrics).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time

import pytest

from conftest import arun
from remotingwire import GET_ROUTEINFO_BY_TOPIC, HEART_BEAT, RemotingClient, decode
from txmq import wire
from txmq.broker.metrics import Metrics
from txmq.broker.prom import BrokerCollector
from txmq.broker.refusals import Refusals
from txmq.broker.testing import running_broker
from txmq.wire import ErrorCode
from wireclient import RawClient

TOKEN = "refusal-token"


def peer_of(writer: asyncio.StreamWriter) -> str:
    host, port = writer.get_extra_info("sockname")[:2]
    return f"{host}:{port}"


async def until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def native_refused(c: RawClient) -> wire.Frame:
    """The one error reply a refused native connection gets, then the close."""
    f = await c.read_frame(10)
    assert f is not None and f.kind == wire.REPLY and f.op != 0, f
    assert await c.read_frame(10) is None, "the connection stayed open"
    await c.close()
    return f


async def remoting_refused(reader: asyncio.StreamReader):
    """The one response a refused remoting connection gets, then the close."""
    data = await asyncio.wait_for(reader.read(), 10)
    (n,) = struct.unpack_from(">i", data)
    return decode(data[4 : 4 + n])


async def check(b, caplog, frontend: str, kind: str, peer: str, says: str) -> None:
    """One log line for the refusal, with its peer and reason; one count in stats and in /metrics."""
    lines = [r.getMessage() for r in caplog.records if f"event=refused frontend={frontend} kind={kind} " in r.getMessage()]
    assert len(lines) == 1, lines
    assert f" peer={peer} refused=1 reason=" in lines[0], lines[0]
    assert says in lines[0], lines[0]
    assert (await b.core.stats())["counters"][f"refused_{frontend}_{kind}"] == 1
    families = {m.name: m for m in BrokerCollector(b.core).collect()}
    samples = {(s.labels["frontend"], s.labels["kind"]): s.value for s in families["txmq_refused"].samples}
    assert samples[(frontend, kind)] == 1, samples


def run(tmp_path, caplog, test, **config) -> None:
    async def main():
        async with running_broker(tmp_path / "data", remoting_port=0, check_interval_s=3600, **config) as b:
            with caplog.at_level(logging.WARNING, logger="txmq"):
                await test(b)
    arun(main())


# ---- auth --------------------------------------------------------------------------------------------
def test_a_wrong_token_is_logged_with_the_peer_and_counted_on_both_front_ends(tmp_path, caplog):
    async def test(b):
        c = await RawClient.open(b.address)
        c.writer.write(wire.request(1, "hello", {"token": "not-it"}))
        f = await native_refused(c)
        assert f.op == ErrorCode.AUTH_FAILED
        await check(b, caplog, "native", "auth", peer_of(c.writer), "authentication failed: wrong token")

        r = await RemotingClient.connect(b.remoting_address)
        resp = await r.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "Unsigned"})
        assert resp.code == 16
        await check(b, caplog, "remoting", "auth", peer_of(r.writer), "not signed with the broker's --auth-token")
        await r.close()

    run(tmp_path, caplog, test, auth_token=TOKEN)


# ---- connection caps ------------------------------------------------------------------------------------
def test_a_connection_over_the_cap_is_logged_with_the_peer_and_counted_on_both_front_ends(tmp_path, caplog):
    async def test(b):
        held = await RawClient.open(b.address)
        await held.ok("heartbeat")
        c = await RawClient.open(b.address)
        f = await native_refused(c)
        assert f.op == ErrorCode.BUSY
        await check(b, caplog, "native", "connection_limit", peer_of(c.writer), "--max-connections")

        rheld = await RemotingClient.connect(b.remoting_address)
        assert (await rheld.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "Held"})).code == 0
        reader, writer = await asyncio.open_connection("127.0.0.1", b.remoting_port)
        resp = await remoting_refused(reader)
        assert resp.code == 2
        await check(b, caplog, "remoting", "connection_limit", peer_of(writer), "--remoting-max-connections")
        writer.close()
        await held.close()
        await rheld.close()

    run(tmp_path, caplog, test, max_connections=1, remoting_max_connections=1)


# ---- malformed requests --------------------------------------------------------------------------------
def test_a_malformed_request_is_logged_with_the_peer_and_counted_on_both_front_ends(tmp_path, caplog):
    async def test(b):
        c = await RawClient.open(b.address)
        c.send_raw(wire.HEADER.pack(1) + b"\xc1")  # a byte msgpack never uses
        f = await native_refused(c)
        assert f.op == ErrorCode.MALFORMED_FRAME
        await check(b, caplog, "native", "bad_request", peer_of(c.writer), "payload is not valid msgpack")

        r = await RemotingClient.connect(b.remoting_address)
        resp = await r.request(HEART_BEAT, {}, b"[" * 1000 + b"]" * 1000)
        assert resp.code == 29
        await check(b, caplog, "remoting", "bad_request", peer_of(r.writer), "nested deeper than 32 levels")
        assert (await r.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "After"})).code == 0  # the connection goes on
        await r.close()

    run(tmp_path, caplog, test)


# ---- timeouts --------------------------------------------------------------------------------------------
def test_a_connection_without_a_first_request_in_time_is_logged_with_the_peer_and_counted_on_both_front_ends(tmp_path, caplog):
    async def test(b):
        c = await RawClient.open(b.address)
        f = await native_refused(c)
        assert f.op == ErrorCode.AUTH_REQUIRED
        await check(b, caplog, "native", "timeout", peer_of(c.writer), "--auth-timeout")

        reader, writer = await asyncio.open_connection("127.0.0.1", b.remoting_port)
        resp = await remoting_refused(reader)
        assert resp.code == 1
        await check(b, caplog, "remoting", "timeout", peer_of(writer), "--auth-timeout")
        writer.close()

    run(tmp_path, caplog, test, auth_timeout_s=0.2)


# ---- the partial-frame budget -----------------------------------------------------------------------------
def test_a_frame_over_the_partial_frame_budget_is_logged_with_the_peer_and_counted_on_both_front_ends(tmp_path, caplog):
    async def test(b):
        native_state, front = b.broker.native.state, b.broker.frontends[0]
        held = await RawClient.open(b.address)
        await held.ok("heartbeat")
        held.send_raw(wire.HEADER.pack(1_000_000) + b"\x00" * 600_000)
        await until(lambda: native_state.partial_frame_bytes >= 600_000, what="the first partial frame held")
        c = await RawClient.open(b.address)
        await c.ok("heartbeat")
        c.send_raw(wire.HEADER.pack(1_000_000) + b"\x00" * 600_000)
        f = await native_refused(c)
        assert f.op == ErrorCode.BUSY
        await check(b, caplog, "native", "busy", peer_of(c.writer), "--partial-frame-budget")

        r = await RemotingClient.connect(b.remoting_address)
        assert (await r.request(GET_ROUTEINFO_BY_TOPIC, {"topic": "Held"})).code == 0
        r.writer.write(struct.pack(">i", 1_000_000) + b"\x00" * 600_000)
        await until(lambda: front.partial_frame_bytes >= 600_000, what="the remoting partial frame held")
        reader, writer = await asyncio.open_connection("127.0.0.1", b.remoting_port)
        writer.write(struct.pack(">i", 1_000_000) + b"\x00" * 600_000)
        resp = await remoting_refused(reader)
        assert resp.code == 2
        await check(b, caplog, "remoting", "busy", peer_of(writer), "--partial-frame-budget")
        writer.close()
        await held.close()
        await r.close()

    run(tmp_path, caplog, test, max_frame=1 << 20, max_body=512 << 10, partial_frame_budget=1 << 20)


# ---- the facility ---------------------------------------------------------------------------------------
def test_refusals_are_throttled_per_front_end_and_kind_and_each_line_says_how_many_since_the_last(caplog):
    now = [0.0]
    refusals = Refusals(Metrics(), clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="txmq"):
        for i in range(300):
            refusals.note("remoting", "bad_request", f"10.0.0.1:{i}", "the body of HEART_BEAT is not JSON")
            refusals.note("native", "bad_request", f"10.0.0.2:{i}", "payload is not valid msgpack")
        now[0] += 10.0
        refusals.note("remoting", "bad_request", "10.0.0.1:9999", "the body of LOCK_BATCH_MQ is not JSON")
        refusals.note("remoting", "auth", "10.0.0.3:1", "wrong\nsignature")  # a reason of several lines stays one line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines
    assert "frontend=remoting kind=bad_request peer=10.0.0.1:0 refused=1 reason='the body of HEART_BEAT is not JSON'" in lines[0]
    assert "frontend=native kind=bad_request peer=10.0.0.2:0 refused=1 " in lines[1]
    assert "frontend=remoting kind=bad_request peer=10.0.0.1:9999 refused=300 reason='the body of LOCK_BATCH_MQ is not JSON'" in lines[2]
    assert "\n" not in lines[3] and "reason='wrong\\nsignature'" in lines[3]
    c = refusals.metrics.counters
    assert (c["refused_remoting_bad_request"], c["refused_native_bad_request"], c["refused_remoting_auth"]) == (301, 300, 1)


@pytest.mark.parametrize("frontend, kind", [("", "auth"), ("rocket_mq", "auth"), ("native", ""), ("native", "Auth"), ("native", "a b")])
def test_a_refusal_is_counted_only_under_names_of_the_code(frontend, kind):
    with pytest.raises(ValueError):
        Refusals(Metrics()).note(frontend, kind, "peer", "reason")
