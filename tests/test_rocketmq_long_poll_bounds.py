"""What one client may hold open on the gRPC port: long polls and Telemetry streams are bounded per client, per
connection and in all, and the excess is answered at once with TOO_MANY_REQUESTS ("try again later" for the SDKs),
logged (one throttled line with the peer and the reason) and counted, while other clients are served.

Apache's Java SDK example AsyncSimpleConsumerExample calls receiveAsync in a loop with no bound: thousands of
30-second long polls from one client. These tests do the same with raw gRPC calls carrying the x-mq-client-id
header the SDKs send (tests/test_rocketmq_sdk_python.py does it with the official Python SDK); the bounds are
lowered (limits.py, server.MAX_CONCURRENT_RPCS) so that a flood of a few hundred calls shows what tens of
thousands would.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

grpc = pytest.importorskip("grpc", reason="the rocketmq extra (grpcio) is not installed")

from conftest import arun  # noqa: E402

from txmq.broker.rocketmq import missing_dependency  # noqa: E402

if missing_dependency():
    pytest.skip(missing_dependency(), allow_module_level=True)

from txmq.broker.prom import BrokerCollector  # noqa: E402
from txmq.broker.refusals import Refusals  # noqa: E402
from txmq.broker.rocketmq import limits  # noqa: E402
from txmq.broker.rocketmq import server as rmq_server  # noqa: E402
from txmq.broker.rocketmq.pb import definition_pb2 as d  # noqa: E402
from txmq.broker.rocketmq.pb import service_pb2 as s  # noqa: E402
from txmq.broker.rocketmq.pb import service_pb2_grpc as g  # noqa: E402
from txmq.broker.testing import running_broker  # noqa: E402
from wireclient import RawClient  # noqa: E402

T = "orders"
OK, NOT_FOUND, TOO_MANY = d.Code.OK, d.Code.MESSAGE_NOT_FOUND, d.Code.TOO_MANY_REQUESTS
PER_CLIENT, PER_CONNECTION, IN_ALL = 20, 40, 100  # the long polls' bounds in these tests
RPC_CAP = 200  # server.MAX_CONCURRENT_RPCS in these tests


@pytest.fixture(autouse=True)
def small_bounds(monkeypatch):
    monkeypatch.setattr(limits, "LONG_POLLS_PER_CLIENT", PER_CLIENT)
    monkeypatch.setattr(limits, "LONG_POLLS_PER_CONNECTION", PER_CONNECTION)
    monkeypatch.setattr(limits, "LONG_POLLS", IN_ALL)
    monkeypatch.setattr(limits, "TELEMETRY_PER_CLIENT", 3)
    monkeypatch.setattr(rmq_server, "MAX_CONCURRENT_RPCS", RPC_CAP)


class Client:
    """An SDK-like client: its own connection (no subchannel shared with another Client), its x-mq-client-id."""

    def __init__(self, b, client_id: str) -> None:
        self.client_id = client_id
        self.channel = grpc.aio.insecure_channel(b.rocketmq_address, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = g.MessagingServiceStub(self.channel)

    def md(self, client_id: str | None = None):
        return (("x-mq-client-id", client_id or self.client_id), ("x-mq-language", "JAVA"))

    async def receive(self, group: str = "flood", poll: float = 20.0, client_id: str | None = None,
                      timeout: float = 60.0) -> tuple[d.Status, list[d.Message]]:
        req = s.ReceiveMessageRequest(batch_size=16, auto_renew=False)
        req.group.name = group
        req.message_queue.topic.name = T
        req.message_queue.id = -1
        req.filter_expression.type = d.TAG
        req.filter_expression.expression = "*"
        req.invisible_duration.FromSeconds(15)
        req.long_polling_timeout.FromMilliseconds(int(poll * 1000))
        frames = [r async for r in self.stub.ReceiveMessage(req, timeout=timeout, metadata=self.md(client_id))]
        statuses = [r.status for r in frames if r.HasField("status")]
        assert len(statuses) == 1, frames
        return statuses[0], [r.message for r in frames if r.HasField("message")]

    async def route(self) -> s.QueryRouteResponse:
        return await self.stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name=T)), timeout=10, metadata=self.md())

    async def close(self) -> None:
        await self.channel.close()


def frontend(b):
    return next(f for f in b.broker.frontends if hasattr(f, "service"))


async def until(pred, what: str, seconds: float = 60.0) -> None:
    """Wait for a condition (the upper bound only says when to give up on a broken broker)."""
    end = time.monotonic() + seconds
    while not pred():
        assert time.monotonic() < end, f"still not: {what}"
        await asyncio.sleep(0.02)


async def flood(client: Client, n: int, **kw) -> list[asyncio.Task]:
    return [asyncio.ensure_future(client.receive(**kw)) for _ in range(n)]


async def refused_at_once(tasks: list[asyncio.Task], want: int) -> list[d.Status]:
    """Wait until `want` of the flood's calls have been answered (the others still wait), and return their statuses."""
    await until(lambda: sum(t.done() for t in tasks) >= want, f"{want} calls answered")
    done = [t.result()[0] for t in tasks if t.done()]
    return done


async def end(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def frozen_refusals(b) -> Refusals:
    """The broker's refusal log with a clock that stands still: one line per kind, whatever the machine's speed."""
    b.core.refusals = Refusals(b.core.metrics, clock=lambda: 1000.0)
    return b.core.refusals


def refusal_lines(caplog, kind: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if "event=refused" in r.getMessage() and "frontend=rocketmq" in r.getMessage() and f"kind={kind} " in r.getMessage()]


def test_one_client_flooding_long_polls_gets_too_many_requests_while_another_client_is_served(tmp_path, caplog):
    async def go():
        async with running_broker(tmp_path / "d", rocketmq_port=0) as b:
            frozen_refusals(b)
            native = await RawClient.open(b.address)
            await native.ok("create_topic", {"topic": T, "queues": 4})
            flooder, other = Client(b, "flooder@1@0@aaa"), Client(b, "other@2@0@bbb")
            fe = frontend(b)
            t0 = time.monotonic()
            tasks = await flood(flooder, 300)  # 3/2 of the RPC cap: without a bound per client, the port is full
            done = await refused_at_once(tasks, 300 - PER_CLIENT)
            # the excess: answered at once (the long poll is 20 s) with RocketMQ's "polling full", not a transport error
            assert time.monotonic() - t0 < 20
            assert len(done) == 300 - PER_CLIENT
            assert {st.code for st in done} == {TOO_MANY}
            assert all(st.message.startswith("polling full: ") and "per client" in st.message for st in done), {st.message for st in done}
            assert fe.settings.long_polls.by_client == {"flooder@1@0@aaa": PER_CLIENT}
            # another client meanwhile: its route, and a long poll that gets the message sent while it waits
            assert (await other.route()).status.code == OK
            waiting = asyncio.ensure_future(other.receive(group="others"))
            await until(lambda: fe.settings.long_polls.by_client.get("other@2@0@bbb") == 1, "the other client's long poll waits")
            await native.ok("send", {"topic": T, "body": b"for-others"})
            st, msgs = await waiting
            assert st.code == OK and [m.body for m in msgs] == [b"for-others"]
            # logged once (the clock stands still: one line per kind), with the peer and the reason; counted
            lines = refusal_lines(caplog, "busy")
            assert len(lines) == 1, lines
            assert "peer=ipv4:127.0.0.1:" in lines[0] and "reason='polling full: 20 long polls open for client flooder@1@0@aaa" in lines[0]
            assert b.core.metrics.counters["refused_rocketmq_busy"] == 300 - PER_CLIENT
            families = {f.name: f for f in BrokerCollector(b.core).collect()}
            samples = {tuple(sorted(x.labels.items())): x.value for x in families["txmq_refused"].samples if x.name == "txmq_refused_total"}
            assert samples[(("frontend", "rocketmq"), ("kind", "busy"))] == 300 - PER_CLIENT
            # the waiting ones hold their places until they end; then the client may long-poll again
            await end(tasks)
            await until(lambda: not fe.settings.long_polls.by_client and fe.settings.long_polls.open == 0, "every place given back")
            await until(lambda: fe.open_rpcs == 0, "no RPC open")
            again = asyncio.ensure_future(flooder.receive(poll=0.2))
            st, _ = await again
            assert st.code == NOT_FOUND
            await flooder.close()
            await other.close()
            await native.close()

    with caplog.at_level(logging.WARNING, logger="txmq.broker"):
        arun(go())


def test_a_refused_long_poll_still_takes_the_messages_that_are_there(tmp_path):
    """RocketMQ's rule: a receive first takes what is there; only one that would wait is refused."""
    async def go():
        async with running_broker(tmp_path / "d", rocketmq_port=0) as b:
            native = await RawClient.open(b.address)
            await native.ok("create_topic", {"topic": T, "queues": 1})
            c = Client(b, "greedy@1")
            tasks = await flood(c, PER_CLIENT)
            await until(lambda: frontend(b).settings.long_polls.open == PER_CLIENT, "the client's long polls wait")
            st, msgs = await c.receive(group="another-group")  # over the bound: no wait, but no message yet
            assert st.code == TOO_MANY
            await native.ok("send", {"topic": T, "body": b"m1"})
            st, msgs = await c.receive(group="another-group")  # over the bound, a message there: it is received
            assert st.code == OK and [m.body for m in msgs] == [b"m1"]
            await end(tasks)
            await c.close()
            await native.close()

    arun(go())


def test_a_client_that_changes_its_id_on_every_call_is_bounded_by_its_connection(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d", rocketmq_port=0) as b:
            native = await RawClient.open(b.address)
            await native.ok("create_topic", {"topic": T, "queues": 1})
            c, other = Client(b, "x"), Client(b, "other@1")
            tasks = [asyncio.ensure_future(c.receive(client_id=f"rotating-{i}")) for i in range(90)]
            done = await refused_at_once(tasks, 90 - PER_CONNECTION)
            assert {st.code for st in done} == {TOO_MANY}
            assert all("on this connection, the limit per connection" in st.message for st in done), done[0]
            assert sum(frontend(b).settings.long_polls.by_connection.values()) == PER_CONNECTION
            # another connection long-polls
            waiting = asyncio.ensure_future(other.receive(group="others"))
            await until(lambda: frontend(b).settings.long_polls.open == PER_CONNECTION + 1, "the other connection's poll waits")
            await native.ok("send", {"topic": T, "body": b"x1"})
            st, msgs = await waiting
            assert st.code == OK and [m.body for m in msgs] == [b"x1"]
            await end(tasks)
            await c.close()
            await other.close()
            await native.close()

    arun(go())


def test_long_polls_in_all_are_bounded_below_the_rpc_cap_and_other_requests_still_go_through(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d", rocketmq_port=0) as b:
            native = await RawClient.open(b.address)
            await native.ok("create_topic", {"topic": T, "queues": 1})
            clients = [Client(b, f"many@{i}") for i in range(8)]
            tasks = []
            for c in clients:  # 8 connections x 2 clients x 10 polls: 160 calls, 100 may wait
                for k in range(2):
                    tasks += [asyncio.ensure_future(c.receive(client_id=f"{c.client_id}-{k}")) for _ in range(10)]
            done = await refused_at_once(tasks, 160 - IN_ALL)
            assert {st.code for st in done} == {TOO_MANY}
            assert all("open on the broker, its limit" in st.message for st in done), done[0]
            fe = frontend(b)
            assert fe.settings.long_polls.open == IN_ALL
            other = Client(b, "other@1")
            assert (await other.route()).status.code == OK  # the rest of the RPC cap is left to other requests
            r = await other.stub.SendMessage(s.SendMessageRequest(messages=[_message(b"sent-meanwhile")]), timeout=10,
                                             metadata=other.md())
            assert r.status.code == OK
            await end(tasks)
            for c in (*clients, other):
                await c.close()
            await native.close()

    arun(go())


def _message(body: bytes) -> d.Message:
    m = d.Message(body=body)
    m.topic.name = T
    m.system_properties.message_id = "M-" + body.decode()
    m.system_properties.message_type = d.NORMAL
    m.system_properties.body_encoding = d.IDENTITY
    m.system_properties.born_timestamp.FromMilliseconds(1_700_000_000_000)
    return m


def test_requests_past_the_rpc_cap_are_answered_too_many_requests_and_logged(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(rmq_server, "MAX_CONCURRENT_RPCS", 30)

    async def go():
        async with running_broker(tmp_path / "d", rocketmq_port=0) as b:
            frozen_refusals(b)
            native = await RawClient.open(b.address)
            await native.ok("create_topic", {"topic": T, "queues": 1})
            clients = [Client(b, f"c@{i}") for i in range(3)]
            tasks = [asyncio.ensure_future(c.receive()) for c in clients for _ in range(12)]  # 36 calls, 30 may be open
            done = await refused_at_once(tasks, 6)
            assert {st.code for st in done} == {TOO_MANY}
            assert all(st.message.startswith("flow limit: 30 requests open on the broker") for st in done), done[0]
            r = await clients[0].route()  # answered with a status the SDKs read, not a transport error
            assert r.status.code == TOO_MANY and r.status.message.startswith("flow limit")
            lines = refusal_lines(caplog, "busy")
            assert len(lines) == 1 and "flow limit" in lines[0] and "peer=ipv4:127.0.0.1:" in lines[0], lines
            assert b.core.metrics.counters["refused_rocketmq_busy"] == 7
            await end(tasks)
            await until(lambda: frontend(b).open_rpcs == 0, "no RPC open")
            assert (await clients[0].route()).status.code == OK
            for c in clients:
                await c.close()
            await native.close()

    with caplog.at_level(logging.WARNING, logger="txmq.broker"):
        arun(go())


def _consumer_settings() -> s.TelemetryCommand:
    cmd = s.TelemetryCommand()
    cmd.settings.client_type = d.SIMPLE_CONSUMER
    cmd.settings.user_agent.language = d.JAVA
    cmd.settings.subscription.group.name = "tele"
    return cmd


def test_telemetry_streams_are_bounded_per_client(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(rmq_server, "REFUSAL_READ_S", 60.0)  # however slow the client's first write

    async def go():
        async with running_broker(tmp_path / "d", rocketmq_port=0) as b:
            frozen_refusals(b)
            c = Client(b, "tele@1")
            calls = []
            answers = []
            for _ in range(5):
                call = c.stub.Telemetry(metadata=c.md())
                await call.write(_consumer_settings())  # a refused stream is answered after it
                answers.append((await asyncio.wait_for(call.read(), 10)).status)
                calls.append(call)
            assert [a.code for a in answers] == [OK, OK, OK, TOO_MANY, TOO_MANY]
            assert "3 Telemetry streams open for client tele@1, the limit per client" in answers[3].message
            streams = frontend(b).settings.telemetry_streams
            assert streams.by_client == {"tele@1": 3}
            lines = refusal_lines(caplog, "busy")
            assert len(lines) == 1 and "Telemetry streams open for client tele@1" in lines[0], lines
            calls[0].cancel()  # one ends: its place is given back
            await until(lambda: streams.by_client == {"tele@1": 2}, "a place given back")
            call = c.stub.Telemetry(metadata=c.md())
            await call.write(_consumer_settings())
            assert (await asyncio.wait_for(call.read(), 10)).status.code == OK
            for x in (*calls, call):
                x.cancel()
            await until(lambda: streams.open == 0, "every stream ended")
            await c.close()

    with caplog.at_level(logging.WARNING, logger="txmq.broker"):
        arun(go())


def test_a_burst_of_calls_from_one_client_is_answered_and_cancels_no_other_clients_request(tmp_path, monkeypatch):
    """Thousands of calls at once on one connection: gRPC core holds those the front end has not taken up yet; past
    its default bounds it cancelled them, another client's included, and nobody was told why. Every call gets an
    answer with a status, and the other client's route queries during the burst are answered OK."""
    monkeypatch.setattr(rmq_server, "MAX_CONCURRENT_RPCS", 16384)

    async def go():
        async with running_broker(tmp_path / "d", rocketmq_port=0) as b:
            native = await RawClient.open(b.address)
            await native.ok("create_topic", {"topic": T, "queues": 1})
            await native.close()
            flooder, other = Client(b, "burst@1"), Client(b, "other@2")
            tasks: list[asyncio.Task] = []
            routes: list[asyncio.Task] = []

            async def safe_route() -> str:
                try:
                    return d.Code.Name((await other.route()).status.code)
                except grpc.aio.AioRpcError as exc:
                    return exc.code().name

            for _ in range(4):
                tasks += await flood(flooder, 1000)
                routes += [asyncio.ensure_future(safe_route()) for _ in range(5)]
                await asyncio.sleep(0)
            await refused_at_once(tasks, 4000 - PER_CLIENT)  # raises the AioRpcError of a call gRPC cancelled
            assert [await r for r in routes] == ["OK"] * 20
            await end(tasks)
            await flooder.close()
            await other.close()

    arun(go())
