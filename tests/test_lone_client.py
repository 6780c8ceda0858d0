"""The flusher fsyncs on the event loop only for a lone request; every front end's requests in flight count.

With sync flush, one request waiting for durability and an idle flusher
make the broker fsync on the loop (flush.py: two thread hand-offs cost as
much as the fsync). With many clients the fsync thread and group commit
serve them, and the loop keeps taking requests. Clients of the gRPC or
remoting port are clients too: 32 SDK producers must not each find the
native port idle and block the loop on their fsyncs.
"""

from __future__ import annotations

import pytest

from conftest import arun
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
            remoting.busy = 2
            assert not lone()
            remoting.busy = 1
            grpc_fe.open_unary = 1
            assert not lone()  # one on each port: two clients
            remoting.busy = 0
            grpc_fe.open_unary = 0

    arun(go())
