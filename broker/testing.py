"""Run a real broker in-process for tests: ``async with running_broker(dir) as b``."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from pathlib import Path
from typing import AsyncIterator

from .clock import Clock
from .config import BrokerConfig, CheckSettings
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


@contextlib.asynccontextmanager
async def running_broker(data_dir: str | Path, clock: Clock | None = None, **overrides) -> AsyncIterator[RunningBroker]:
    """Start a broker on a pre-bound 127.0.0.1 port; stop it cleanly on exit.

    Check settings (check_interval_s, transaction_timeout_s, max_checks,
    retention_s) may be passed directly as keyword arguments;
    ``rocketmq_port=0`` serves RocketMQ's gRPC service on a free port too
    (``RunningBroker.rocketmq_address``).
    """
    check_keys = [k for k in ("check_interval_s", "transaction_timeout_s", "max_checks", "retention_s") if k in overrides]
    check = CheckSettings()
    for k in check_keys:
        check = check.with_value(k, overrides.pop(k))
    config = BrokerConfig(data_dir=Path(data_dir), host="127.0.0.1", port=0, check=check, check_overrides=tuple(check_keys))
    config = replace(config, **overrides)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    config = replace(config, port=port)
    broker = Broker(config, clock)
    if config.rocketmq_port is not None:
        from .rocketmq.server import attach  # needs the rocketmq extra

        await attach(broker, config)
    if config.remoting_port is not None:
        from .remoting.server import attach as attach_remoting

        await attach_remoting(broker, config)
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
