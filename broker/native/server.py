"""The native protocol's listener: connections accepted within their caps, overdue ones swept, all closed at shutdown.

``NativeFrontend(messaging, operations, sock)`` has the shape of every front end (server.Frontend,
as broker/rocketmq/server.py). ``ServerState`` is what the connections
share: who is open, per address, what is in flight, and their figures.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING

from .connection import BrokerConnection
from .operations import HANDLERS, Handler

if TYPE_CHECKING:
    from ..config import BrokerConfig
    from ..messaging import Messaging, Operations

log = logging.getLogger("txmq.broker")


class ServerState:
    """What the native front end's connections share: the operation table, the connections and their counts."""

    def __init__(self, handlers: dict[str, Handler] = HANDLERS) -> None:
        self.handlers = handlers  # op -> handler (operations.HANDLERS, which the handler modules fill)
        self.connections: set[BrokerConnection] = set()
        self.inflight: set[asyncio.Future] = set()
        self.by_ip: dict[str, int] = {}  # open connections per remote address
        self.working = 0  # requests in flight that wait on the broker (not pulls): connlimits.py
        self.partial_frame_bytes = 0  # held by all connections in frames not yet complete

    def gauges(self) -> dict[str, int]:
        """What `txmq broker status`, `txmq stats` and Prometheus show of the connections (BrokerCore.connection_gauges)."""
        return {"connections": len(self.connections), "partial_frame_bytes": self.partial_frame_bytes}


async def sweep_connections(state: ServerState, config: BrokerConfig) -> None:
    """Close connections whose first request (--auth-timeout) or current frame (--frame-timeout) is overdue."""
    timeouts = [t for t in (config.auth_timeout_s, config.frame_timeout_s) if t]
    if not timeouts:
        return
    every = min(1.0, max(0.02, min(timeouts) / 4))
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(every)
        now = loop.time()
        for conn in list(state.connections):
            conn.sweep(now)


class NativeFrontend:
    """txmq's own protocol on one listening socket, over the messaging service and the operator's calls.

    The broker builds it (broker/server.py) and reads its figures through
    ``gauges`` and ``in_flight``; it changes nothing of the broker's.
    """

    def __init__(self, messaging: Messaging, operations: Operations, sock: socket.socket) -> None:
        self.messaging = messaging
        self.operations = operations
        self.config = messaging.config
        self.sock = sock  # bound and listening
        self.state = ServerState()
        self.server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None
        self._stopped = False

    def gauges(self) -> dict[str, int]:
        """Open connections and the bytes of their incomplete frames (`txmq broker status`, `txmq stats`, Prometheus)."""
        return self.state.gauges()

    def in_flight(self) -> int:
        """Requests in flight that wait on the broker (the broker's test for a lone client: Broker._lone_client)."""
        return self.state.working

    async def start(self) -> None:
        state = self.state
        loop = asyncio.get_running_loop()
        # Connections over --max-connections are accepted and closed at once
        # (BrokerConnection.connection_made), so the backlog never fills with
        # them; when descriptors run out all the same, uvloop (libuv's spare
        # descriptor) and asyncio drain or retry the backlog and keep accepting.
        self.server = await loop.create_server(lambda: BrokerConnection(self, state), sock=self.sock, backlog=2048)
        self._sweeper = loop.create_task(sweep_connections(state, self.config), name="txmq-sweeper")

    async def stop(self) -> None:
        """Accept no more connections and let the requests in flight finish (within --shutdown-timeout); once."""
        if self._stopped:
            return
        self._stopped = True
        if self.server is not None:
            self.server.close()
        if self.state.inflight:
            await asyncio.wait(list(self.state.inflight), timeout=self.config.shutdown_timeout_s)
        if self._sweeper is not None:
            self._sweeper.cancel()

    async def close(self) -> None:
        """Close the connections still open (after the core stopped: the replies it owed are written first)."""
        for conn in list(self.state.connections):
            conn.close()
        if self.server is not None:
            try:
                await asyncio.wait_for(self.server.wait_closed(), 2.0)
            except (asyncio.TimeoutError, Exception):
                pass
