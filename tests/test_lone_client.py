"""The flusher fsyncs on the event loop only for a lone request; every front end's requests in flight count.

With sync flush, one request waiting for durability and an idle flusher
make the broker fsync on the loop (flush.py: two thread hand-offs cost as
much as the fsync). With many clients the fsync thread and group commit
serve them, and the loop keeps taking requests. Clients of the gRPC or
remoting port are clients too: 32 SDK producers must not each find the
native port idle and block the loop on their fsyncs.
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import arun
from remotingwire import RemotingClient
from txmq.broker.testing import running_broker

pytest.importorskip("grpc", reason="the rocketmq extra (grpcio) is not installed")


def test_requests_in_flight_on_the_grpc_and_remoting_ports_keep_fsyncs_off_the_loop(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d", rocketmq_port=0, remoting_port=0, flush="sync") as b:
            grpc_fe = next(f for f in b.broker.frontends if type(f).__name__ == "RocketMQServer")
            remoting = next(f for f in b.broker.frontends if type(f).__name__ == "RemotingFrontend")
            lone = b.core.flusher.lone_client
            assert lone()  # nothing in flight anywhere
            grpc_fe.open_unary = 1
            assert lone()  # one request: the inline fsync serves it soonest
            grpc_fe.open_unary = 2
            assert not lone()
            grpc_fe.open_unary = 0
            remoting.working = 2
            assert not lone()
            remoting.working = 1
            grpc_fe.open_unary = 1
            assert not lone()  # one on each port: two clients
            remoting.working = 0
            grpc_fe.open_unary = 0

    arun(go())


def test_requests_pipelined_on_one_remoting_connection_are_not_a_lone_client(tmp_path):
    """A RocketMQ 4 Java client sends the requests of all its threads over one connection: each counts."""

    async def go():
        async with running_broker(tmp_path / "d", remoting_port=0, flush="sync") as b:
            remoting = next(f for f in b.broker.frontends if type(f).__name__ == "RemotingFrontend")
            flusher = b.core.flusher
            asked, lone = [], flusher.lone_client

            def recording() -> bool:
                answer = lone()
                asked.append((answer, len(remoting.inflight)))
                return answer

            flusher.lone_client = recording
            c = await RemotingClient.connect(b.remoting_address)
            try:
                for _ in range(5):  # bursts of 16 sends, written together on the one connection
                    replies = await asyncio.gather(*(c.send("PipelinedT", b"x" * 64) for _ in range(16)))
                    assert all(r.code == 0 for r in replies)
            finally:
                await c.close()
            assert any(n > 1 for _, n in asked)  # the flusher did ask while several sends were in flight
            assert not [n for answer, n in asked if answer and n > 1]  # and never took them for a lone client

    arun(go())
