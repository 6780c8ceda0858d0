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
    try:
        if config.rocketmq_port is not None:  # RocketMQ 5's gRPC service (docs/rocketmq.md)
            from .rocketmq.server import BindError, RocketMQServer

            workers = config.frontend_processes
            grpc_frontend = RocketMQServer(core.messaging, config, relayed=workers > 0)  # the broker's config: its caps are derived
            try:
                await grpc_frontend.bind()
            except BindError as exc:
                raise FrontendBindError(str(exc)) from None
            broker.own(grpc_frontend)
            if workers:
                broker.own(await _worker_pool(broker, grpc_frontend, workers))
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


async def _worker_pool(broker: Broker, grpc_frontend: Any, workers: int) -> Any:
    """The worker processes that serve the gRPC port grpc_frontend reserved, relaying to its handlers (broker/workers/).

    Owned after the front end: started once it lets requests through, stopped once its Telemetry streams ended.
    Each worker holds its share of --rocketmq-max-connections (rounded up).
    """
    from .rocketmq.server import SERVICE
    from .workers.pool import GrpcService, Handler, WorkerPool

    config = broker.config
    share = -(-grpc_frontend.max_connections // workers)
    handlers = {name: Handler(kind, fn, ser) for name, (kind, fn, ser) in grpc_frontend.handler_table().items()}
    pool = WorkerPool(workers, broker.core.data_dir, busy_poll_s=config.busy_poll_s)
    pool.serve_grpc(GrpcService(SERVICE, handlers, config.host, grpc_frontend.port, grpc_frontend.grpc_options(True, share),
                                str(config.rocketmq_tls_cert) if config.rocketmq_tls_cert else None,
                                str(config.rocketmq_tls_key) if config.rocketmq_tls_key else None))
    await pool.bind()
    return pool
