"""A request the gRPC front end refuses leaves a trace on the broker: one throttled line with the peer and the reason
(event=refused frontend=rocketmq kind=...), and a count (refused_rocketmq_<kind> in `txmq stats`,
txmq_refused_total{frontend="rocketmq",kind=...} on /metrics), as on the other front ends.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from hashlib import sha1

import pytest

grpc = pytest.importorskip("grpc", reason="the rocketmq extra (grpcio) is not installed")

from conftest import arun  # noqa: E402

from txmq.broker.rocketmq import missing_dependency  # noqa: E402

if missing_dependency():
    pytest.skip(missing_dependency(), allow_module_level=True)

from txmq.broker.prom import BrokerCollector  # noqa: E402
from txmq.broker.refusals import Refusals  # noqa: E402
from txmq.broker.rocketmq.pb import definition_pb2 as d  # noqa: E402
from txmq.broker.rocketmq.pb import service_pb2 as s  # noqa: E402
from txmq.broker.rocketmq.pb import service_pb2_grpc as g  # noqa: E402
from txmq.broker.testing import running_broker  # noqa: E402

MD = (("x-mq-client-id", "refused@1@0@abc"), ("x-mq-language", "JAVA"))
TOKEN = "s3cret"
ROUTE = s.QueryRouteRequest(topic=d.Resource(name="orders"))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lines(caplog, kind: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if "event=refused frontend=rocketmq" in r.getMessage() and f" kind={kind} " in r.getMessage()]


def refused_total(core, kind: str) -> float:
    fam = next(f for f in BrokerCollector(core).collect() if f.name == "txmq_refused")
    return next(x.value for x in fam.samples if x.name == "txmq_refused_total" and x.labels == {"frontend": "rocketmq", "kind": kind})


def signed(md, token: str):
    when = "20261123T101010Z"
    sig = hmac.new(token.encode(), when.encode(), sha1).hexdigest()
    return md + (("x-mq-date-time", when),
                 ("authorization", f"MQv2-HMAC-SHA1 Credential=any, SignedHeaders=x-mq-date-time, Signature={sig}"))


def run(tmp_path, caplog, body, **overrides):
    async def go():
        async with running_broker(tmp_path / "data", rocketmq_port=0, **overrides) as b:
            b.core.create_topic("orders", None, None)  # ROUTE's topic: RocketMQ 5 routes only a topic the broker knows
            clock = Clock()
            b.core.refusals = Refusals(b.core.metrics, clock=clock)
            async with grpc.aio.insecure_channel(b.rocketmq_address) as ch:
                await body(b, g.MessagingServiceStub(ch), ch, clock)

    with caplog.at_level(logging.WARNING, logger="txmq.broker"):
        arun(go())


def test_unsigned_requests_with_an_auth_token_are_logged_once_per_ten_seconds_and_counted(tmp_path, caplog):
    async def body(b, stub, ch, clock):
        for _ in range(50):
            r = await stub.QueryRoute(ROUTE, metadata=MD)
            assert r.status.code == d.UNAUTHORIZED
        wrong = await stub.QueryRoute(ROUTE, metadata=signed(MD, "not-the-token"))
        assert wrong.status.code == d.UNAUTHORIZED
        # an unsigned Telemetry stream (what an SDK opens first) and an unsigned receive are refused the same way
        t = stub.Telemetry(iter([s.TelemetryCommand()]), metadata=MD)
        assert (await asyncio.wait_for(t.read(), 10)).status.code == d.UNAUTHORIZED
        req = s.ReceiveMessageRequest(batch_size=1)
        req.group.name, req.message_queue.topic.name = "g", "orders"
        frames = [f async for f in stub.ReceiveMessage(req, metadata=MD, timeout=10)]
        assert [f.status.code for f in frames] == [d.UNAUTHORIZED]
        got = lines(caplog, "auth")
        assert len(got) == 1, got  # 53 refusals, one line (the clock stands still)
        assert "peer=ipv4:127.0.0.1:" in got[0] and "refused=1 " in got[0]
        assert "reason=\"the request is not signed with the broker's --auth-token" in got[0]
        clock.now += 10.0  # a line is due again: it says how many since the last one
        assert (await stub.QueryRoute(ROUTE, metadata=MD)).status.code == d.UNAUTHORIZED
        got = lines(caplog, "auth")
        assert len(got) == 2 and "refused=53 " in got[1], got
        assert b.core.metrics.counters["refused_rocketmq_auth"] == 54
        assert refused_total(b.core, "auth") == 54
        # a signed request is served and counts nothing
        assert (await stub.QueryRoute(ROUTE, metadata=signed(MD, TOKEN))).status.code == d.OK
        assert b.core.metrics.counters["refused_rocketmq_auth"] == 54

    run(tmp_path, caplog, body, auth_token=TOKEN)


def test_malformed_requests_and_a_telemetry_stream_without_client_id_are_logged_and_counted(tmp_path, caplog):
    async def body(b, stub, ch, clock):
        for method in ("SendMessage", "QueryRoute", "AckMessage"):
            raw = ch.unary_unary(f"/apache.rocketmq.v2.MessagingService/{method}")
            reply = getattr(s, f"{method}Response").FromString(await raw(b"\xff\xff\xff\xff", metadata=MD))
            assert reply.status.code == d.BAD_REQUEST
        raw_stream = ch.unary_stream("/apache.rocketmq.v2.MessagingService/ReceiveMessage")
        frames = [s.ReceiveMessageResponse.FromString(f) async for f in raw_stream(b"\xff\xff", metadata=MD)]
        assert [f.status.code for f in frames] == [d.BAD_REQUEST]
        tele = ch.stream_stream("/apache.rocketmq.v2.MessagingService/Telemetry")(metadata=MD)
        await tele.write(b"\xff\xff\xff")
        assert s.TelemetryCommand.FromString(await asyncio.wait_for(tele.read(), 10)).status.code == d.BAD_REQUEST
        await tele.done_writing()
        no_id = stub.Telemetry(iter([s.TelemetryCommand()]))
        assert (await asyncio.wait_for(no_id.read(), 10)).status.code == d.CLIENT_ID_REQUIRED
        got = lines(caplog, "bad_request")
        assert len(got) == 1, got
        assert "peer=ipv4:127.0.0.1:" in got[0] and "reason='malformed request: not a valid apache.rocketmq.v2.SendMessageRequest'" in got[0]
        assert b.core.metrics.counters["refused_rocketmq_bad_request"] == 6
        assert b.core.metrics.counters["rmq_malformed_requests"] == 5
        assert refused_total(b.core, "bad_request") == 6
        assert (await stub.QueryRoute(ROUTE, metadata=MD)).status.code == d.OK  # and the broker serves on

    run(tmp_path, caplog, body)


def test_an_unexpected_error_is_one_line_with_a_count_not_a_traceback_per_request(tmp_path, caplog, monkeypatch):
    from txmq.broker.rocketmq import service

    async def broken(self, req, context):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(service.MessagingService, "QueryRoute", broken)

    async def body(b, stub, ch, clock):
        for _ in range(20):
            r = await stub.QueryRoute(ROUTE, metadata=MD)
            assert r.status.code == d.INTERNAL_ERROR and r.status.message == "internal error: ZeroDivisionError"
        errors = [r for r in caplog.records if "event=internal_error" in r.getMessage()]
        assert len(errors) == 1, [r.getMessage() for r in errors]
        assert "where=rocketmq.QueryRoute" in errors[0].getMessage() and errors[0].exc_info is not None
        assert b.core.metrics.counters["rmq_internal_errors"] == 20
        assert b.core.metrics.counters["internal_errors"] == 20

    run(tmp_path, caplog, body)
