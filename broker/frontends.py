"""The RocketMQ front ends a broker's configuration asks for, built and bound before the broker serves.

``bind_frontends(broker)`` builds RocketMQ 5's gRPC service
(``--rocketmq-port``, broker/rocketmq/) and RocketMQ 4's remoting protocol
(``--remoting-port``, broker/remoting/) on the broker's messaging service
and operations, binds their ports (a port in use fails the start before the
data directory is touched), and hands each to the broker, which owns it
from then on: ``Broker.own`` lists it among the front ends it starts and
stops and whose connection figures it reports. The native front end is
built by ``Broker.serve`` on the socket it is given. A front end never
registers itself or changes the broker.

Only the start-up imports this module (broker/main.py, broker/testing.py):
the gRPC front end needs the ``rocketmq`` extra, and the broker's server
must not (the import contracts in pyproject.toml).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .server import Broker


class FrontendBindError(Exception):
    """A front end's port cannot be bound, or its TLS files cannot be read: the message says which and why."""


async def bind_frontends(broker: Broker) -> None:
    """Build and bind the RocketMQ front ends ``broker.config`` asks for; on a failure, those bound are stopped."""
    config, core = broker.config, broker.core
    try:
        if config.rocketmq_port is not None:  # RocketMQ 5's gRPC service (docs/rocketmq.md)
            from .rocketmq.server import BindError, RocketMQServer

            grpc_frontend = RocketMQServer(core.messaging, config)  # the broker's config: its connection caps are derived
            try:
                await grpc_frontend.bind()
            except BindError as exc:
                raise FrontendBindError(str(exc)) from None
            broker.own(grpc_frontend)
        if config.remoting_port is not None:  # RocketMQ 4's remoting protocol (docs/remoting.md)
            from .remoting.server import BindError as RemotingBindError
            from .remoting.server import RemotingFrontend

            remoting = RemotingFrontend(core.messaging, core.operations, config)
            try:
                await remoting.bind()
            except RemotingBindError as exc:
                raise FrontendBindError(str(exc)) from None
            broker.own(remoting)
    except BaseException:
        for frontend in broker.frontends:
            await frontend.stop()
        raise
