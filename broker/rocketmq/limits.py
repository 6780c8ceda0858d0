"""What one client may hold open on the gRPC port: long polls and Telemetry streams, per client, per connection and in all.

A long poll (a ``ReceiveMessage`` with a long polling timeout) and a
Telemetry stream are RPCs that stay open; gRPC's own bound on open RPCs is
server-wide, so without these a client that opens them without end (Apache's
Java SDK example ``AsyncSimpleConsumerExample`` calls ``receiveAsync`` in a
loop) would fill it and every other client's requests would be refused.

RocketMQ's rule, followed here: a receive first takes what is there; only a
receive that found nothing waits, and the receives waiting are bounded
(the broker's ``PopLongPollingService``: ``popPollingSize`` = 1,024 per
topic, group and queue, ``maxPopPollingSize`` = 100,000 in all). Past the
bound a receive that found nothing is answered at once with
``TOO_MANY_REQUESTS`` and "polling full" (the proxy's
``ReceiveMessageResponseStreamWriter``), which the SDKs take as "try again
later" (the Java SDK's push consumer receives again after 20 ms; a simple
consumer's ``receive`` raises ``TooManyRequestsException``). The proxy
answers ``TOO_MANY_REQUESTS`` "flow limit" too when a thread pool's queue
is full. txmq bounds the waiting receives per client (its
``x-mq-client-id``), per connection (a client that changes its id on every
request) and in all, well below gRPC's bound; ``Holds`` counts them.
"""

from __future__ import annotations

# Long polls (ReceiveMessage waiting for a message). Per client: RocketMQ's popPollingSize, and one per queue of a
# FIFO push consumer's topic of MAX_QUEUES (1,024) queues. Per connection: twice that (SDKs in one Node.js process
# share a connection). In all: half of the front end's open RPCs (server.MAX_CONCURRENT_RPCS, 16,384), a quarter
# going to Telemetry streams, the rest to every other request.
LONG_POLLS_PER_CLIENT = 1024
LONG_POLLS_PER_CONNECTION = 2048
LONG_POLLS = 8192
# Telemetry streams: an SDK client keeps one per endpoint (and opens a new one as an old one ends).
TELEMETRY_PER_CLIENT = 16
TELEMETRY_PER_CONNECTION = 1024
TELEMETRY_STREAMS = 4096


class Holds:
    """Open calls of one kind, counted per client id, per connection and in all, each count with its bound.

    ``take(client_id, peer)`` counts one call in and returns None, or
    returns why it cannot (and counts nothing); ``give`` counts one out.
    Memory: one dict entry per client and per connection with a call open,
    so at most ``total`` of each.
    """

    def __init__(self, what: str, per_client: int, per_connection: int, total: int) -> None:
        self.what = what
        self.per_client = per_client
        self.per_connection = per_connection
        self.total = total
        self.open = 0
        self.by_client: dict[str, int] = {}
        self.by_connection: dict[str, int] = {}

    def take(self, client_id: str, peer: str) -> str | None:
        if self.open >= self.total:
            return f"{self.open} {self.what} open on the broker, its limit"
        if client_id and self.by_client.get(client_id, 0) >= self.per_client:
            return f"{self.per_client} {self.what} open for client {client_id}, the limit per client"
        if peer and self.by_connection.get(peer, 0) >= self.per_connection:
            return f"{self.per_connection} {self.what} open on this connection, the limit per connection"
        self.open += 1
        if client_id:
            self.by_client[client_id] = self.by_client.get(client_id, 0) + 1
        if peer:
            self.by_connection[peer] = self.by_connection.get(peer, 0) + 1
        return None

    def give(self, client_id: str, peer: str) -> None:
        self.open -= 1
        if client_id:
            _down(self.by_client, client_id)
        if peer:
            _down(self.by_connection, peer)


def _down(counts: dict[str, int], key: str) -> None:
    n = counts.get(key, 0) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


def default_long_polls() -> Holds:
    """The long polls' counts with the bounds above (read when called: tests lower them)."""
    return Holds("long polls", LONG_POLLS_PER_CLIENT, LONG_POLLS_PER_CONNECTION, LONG_POLLS)


def default_telemetry_streams() -> Holds:
    return Holds("Telemetry streams", TELEMETRY_PER_CLIENT, TELEMETRY_PER_CONNECTION, TELEMETRY_STREAMS)


def peer_of(context: object) -> str:
    """The connection an RPC came on (gRPC's ``context.peer()``: ``ipv4:127.0.0.1:50412``), or "" when unknown."""
    try:
        return str(context.peer() or "")[:200]  # type: ignore[attr-defined]
    except Exception:  # a context without a peer (tests calling methods directly)
        return ""
