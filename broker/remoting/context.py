"""What the remoting front end's parts need of a connection and of the front end, as types (no import of server.py).

The request handlers (handlers.py, admin.py) and the client table
(clients.py) are given a connection and the front end; they see them
through these protocols, so that they import neither server.py nor one
another in a cycle, and a test drives them with stand-ins. The front end's
only way to the broker is the messaging service and the operator's calls
(``txmq.broker.messaging``: ``Messaging``, ``Operations``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..messaging import Messaging

    from . import protocol as p


class Connection(Protocol):
    """One client connection (server.RemotingConnection) as a handler or the client table uses it."""

    conn_id: int
    peer: str  # the client's address, host:port
    local_host: str  # the address the client connected to: the routes name this broker there
    store_addr: bytes  # that address as 4 or 16 bytes: the store host of the offset message ids
    client_ids: set[str]  # the client ids that sent heartbeats over this connection
    client_language: str
    client_version: int

    def writable(self) -> bool:
        """Open, not closing, and taking writes (not paused by backpressure)."""
        ...

    def request(self, cmd: p.Command) -> None:
        """Send a request of the broker's own (oneway) to this client."""
        ...


class Endpoint(Protocol):
    """What the client table needs of its front end: the messaging service, and how the broker names itself."""

    messaging: Messaging
    port: int
    broker_name: str

    def next_opaque(self) -> int:
        """The opaque (request id) of the broker's next request to a client."""
        ...


__all__ = ["Connection", "Endpoint"]
