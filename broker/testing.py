"""Run a real broker in-process for tests: ``async with running_broker(dir) as b``."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from pathlib import Path
from typing import AsyncIterator

from .clock import Clock
from .config import BrokerConfig, CheckSettings
from .core import BrokerCore
from .frontends import bind_frontends
from .server import Broker, bind


class RunningBroker:
    def __init__(self, broker: Broker, host: str, port: int) -> None:
        self.broker = broker
        self.core = broker.core
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"
        # With rocketmq_port=... (0: a free one): where RocketMQ's gRPC service listens (broker/rocketmq/).
        fe = next((f for f in broker.frontends if type(f).__name__ == "RocketMQServer"), None)
        self.rocketmq_port: int | None = fe.port if fe is not None else None
        self.rocketmq_address = f"{host}:{self.rocketmq_port}" if fe is not None else None
        # With remoting_port=... (0: a free one): where RocketMQ 4's remoting protocol listens (broker/remoting/).
        rem = next((f for f in broker.frontends if type(f).__name__ == "RemotingFrontend"), None)
        self.remoting = rem
        self.remoting_port: int | None = rem.port if rem is not None else None
        self.remoting_address = f"{host}:{self.remoting_port}" if rem is not None else None


def config_for_tests(data_dir: str | Path, **overrides) -> BrokerConfig:
    """A broker's configuration on ``data_dir`` (127.0.0.1), with check settings passed as keyword arguments too."""
    check_keys = [k for k in ("check_interval_s", "transaction_timeout_s", "max_checks", "retention_s") if k in overrides]
    check = CheckSettings()
    for k in check_keys:
        check = check.with_value(k, overrides.pop(k))
    config = BrokerConfig(data_dir=Path(data_dir), host="127.0.0.1", port=0, check=check, check_overrides=tuple(check_keys))
    return replace(config, **overrides)


@contextlib.asynccontextmanager
async def running_services(data_dir: str | Path, clock: Clock | None = None, **overrides) -> AsyncIterator[BrokerCore]:
    """The broker's services on a real store, started and stopped as a broker does it, with no port open.

    For tests of the messaging service and the subsystems under it: the
    core (``core.messaging``, ``core.operations``, ``core.tx``, ...) is
    yielded once the transaction and schedule indexes are ready.
    """
    broker = Broker(config_for_tests(data_dir, **overrides), clock)
    await broker.start()
    try:
        await broker.core.keeper.ready.wait()
        await broker.core.scheduled.ready.wait()
        yield broker.core
    finally:
        await broker.stop()


@contextlib.asynccontextmanager
async def running_broker(data_dir: str | Path, clock: Clock | None = None, **overrides) -> AsyncIterator[RunningBroker]:
    """Start a broker on a pre-bound 127.0.0.1 port; stop it cleanly on exit.

    Check settings (check_interval_s, transaction_timeout_s, max_checks,
    retention_s) may be passed directly as keyword arguments;
    ``rocketmq_port=0`` serves RocketMQ's gRPC service on a free port too
    (``RunningBroker.rocketmq_address``).
    """
    config = config_for_tests(data_dir, **overrides)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    config = replace(config, port=port)
    broker = Broker(config, clock)
    await bind_frontends(broker)  # the RocketMQ ports asked for (rocketmq_port=0, remoting_port=0: free ones)
    shutdown = asyncio.Event()
    task = asyncio.create_task(broker.serve(sock, shutdown))
    ready = asyncio.create_task(broker.ready.wait())
    done, _ = await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        ready.cancel()
        for frontend in broker.frontends:
            await frontend.stop()
        task.result()  # raises the start-up error
    await broker.core.keeper.ready.wait()  # tests start from a fully ready broker
    await broker.core.scheduled.ready.wait()
    try:
        yield RunningBroker(broker, "127.0.0.1", port)
    finally:
        shutdown.set()
        await task
