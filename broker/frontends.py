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

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .server import Broker


class FrontendBindError(Exception):
    """A front end's port cannot be bound, or its TLS files cannot be read: the message says which and why."""


async def bind_frontends(broker: Broker) -> None:
    """Build and bind the RocketMQ front ends ``broker.config`` asks for; on a failure, those bound are stopped."""
    config, core = broker.config, broker.core
    workers = config.frontend_processes
    grpc_frontend = remoting = None
    try:
        if config.rocketmq_port is not None:  # RocketMQ 5's gRPC service (docs/rocketmq.md)
            from .rocketmq.server import BindError, RocketMQServer

            grpc_frontend = RocketMQServer(core.messaging, config, relayed=workers > 0)  # the broker's config: its caps are derived
            try:
                await grpc_frontend.bind()
            except BindError as exc:
                raise FrontendBindError(str(exc)) from None
            broker.own(grpc_frontend)
        if config.remoting_port is not None:  # RocketMQ 4's remoting protocol (docs/remoting.md)
            from .remoting.server import BindError as RemotingBindError
            from .remoting.server import RemotingFrontend

            remoting = RemotingFrontend(core.messaging, core.operations, config, relayed=workers > 0)
            try:
                await remoting.bind()
            except RemotingBindError as exc:
                raise FrontendBindError(str(exc)) from None
            broker.own(remoting)
        if workers and (grpc_frontend is not None or remoting is not None):
            broker.own(await _worker_pool(broker, grpc_frontend, remoting, workers))
    except BaseException:
        for frontend in broker.frontends:  # none of them started: each lets go of what it bound or reserved
            await frontend.stop()
            await frontend.close()
        raise


async def _worker_pool(broker: Broker, grpc_frontend: Any, remoting: Any, workers: int) -> Any:
    """The worker processes that serve the ports the RocketMQ front ends reserved, relaying to them (broker/workers/).

    Owned after the front ends: started once they let requests through, stopped once they finished what was in
    flight (and the gRPC port's Telemetry streams ended). Each worker holds its share of
    --rocketmq-max-connections (rounded up); the remoting port's connections are counted here, against
    --remoting-max-connections in total, as in one process.
    """
    from .workers.pool import GrpcService, Handler, TcpService, WorkerPool

    config = broker.config
    pool = WorkerPool(workers, broker.core.data_dir, busy_poll_s=config.busy_poll_s)
    if grpc_frontend is not None:
        from .rocketmq.server import SERVICE

        share = -(-grpc_frontend.max_connections // workers)
        handlers = {name: Handler(kind, fn, ser) for name, (kind, fn, ser) in grpc_frontend.handler_table().items()}
        pool.serve_grpc(GrpcService(SERVICE, handlers, config.host, grpc_frontend.port, grpc_frontend.grpc_options(True, share),
                                    str(config.rocketmq_tls_cert) if config.rocketmq_tls_cert else None,
                                    str(config.rocketmq_tls_key) if config.rocketmq_tls_key else None))
    if remoting is not None:
        for name, port in remoting.listeners():
            pool.serve_tcp(TcpService(name, config.host, port, remoting.connection))
    await pool.bind()
    return pool
