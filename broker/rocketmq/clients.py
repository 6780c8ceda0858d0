"""SDK clients: their settings, and their Telemetry streams as check-back targets.

A RocketMQ 5 client opens one Telemetry stream per endpoint and sends its
``Settings`` first; the broker answers with its own view of them (RocketMQ's
proxy does the same: ClientActivity), and later pushes commands over the
stream. txmq pushes one: ``RecoverOrphanedTransactionCommand``, its
check-back.

The producer group: a RocketMQ 5 producer has none. RocketMQ's proxy uses
the topic as the producer group (ClientActivity.registerProducer,
SendMessageActivity), and so does txmq: a transactional message sent over
gRPC gets ``PGROUP`` = its topic, and a Telemetry stream whose settings
publish to topics T1..Tn is registered in the core's producer registry
(broker/registry.py) under T1..Tn, as a native producer connection is under
its groups. The check service then picks it as it picks a native producer,
and the "no producer online" rule counts it while its stream is open. A
consumer's stream is registered in the consumer registry under its group.

Memory per stream is bounded: commands waiting to be written are held to
``MAX_QUEUED`` commands and ``max_bytes`` bytes (``MAX_QUEUED_BYTES``, or
two of the largest messages if that is more); a stream is not offered
check-backs (``writable``) beyond half of that, as a native connection is
not past its write buffer's high-water mark, and one that still fills up
(the client does not read) is closed and logged (event=rmq_telemetry_closed).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..messaging import CheckBack

from . import convert
from .pb import definition_pb2 as d
from .pb import service_pb2 as s

if TYPE_CHECKING:
    from ..messaging import Messaging


log = logging.getLogger("txmq.rocketmq")

# Telemetry streams get conn_ids of their own range: they share the producer registry with native connections.
_ids = itertools.count(1 << 40)

MAX_QUEUED = 65536  # commands waiting to be written on one stream
MAX_QUEUED_BYTES = 8 << 20  # their bytes (at least two of the largest messages)
MAX_TOPICS = 128  # topics one producer's settings may name (each is a registry entry per stream)
MAX_CLIENTS = 100_000  # client entries kept (one per client id); idle ones are dropped beyond it
CLIENT_IDLE_S = 300.0  # a client with no open stream and no request for this long may be dropped

# The x-mq-language header's values: Language names, and the Node.js SDK's "HTTP".
LANGUAGE_HEADERS = {**{name: value for name, value in d.Language.items()}, "HTTP": d.NODE_JS, "NODEJS": d.NODE_JS, "GO": d.GOLANG}


@dataclass
class Client:
    """One SDK client (by its ``x-mq-client-id`` header) and what its settings said."""

    client_id: str
    language: int = d.LANGUAGE_UNSPECIFIED
    client_type: int = d.CLIENT_TYPE_UNSPECIFIED
    topics: tuple[str, ...] = ()
    group: str = ""
    streams: set = field(default_factory=set)
    last_seen: float = field(default_factory=time.monotonic)


class ClientTable:
    """Clients by id: their language (for body digests), type, topics or group, and open Telemetry streams."""

    def __init__(self) -> None:
        self.clients: dict[str, Client] = {}

    def get(self, client_id: str) -> Client | None:
        return self.clients.get(client_id)

    def touch(self, client_id: str) -> Client:
        c = self.clients.get(client_id)
        if c is None:
            if len(self.clients) >= MAX_CLIENTS:
                self._prune()
            c = self.clients[client_id] = Client(client_id)
        c.last_seen = time.monotonic()
        return c

    def language(self, client_id: str) -> int:
        c = self.clients.get(client_id)
        return c.language if c is not None else d.LANGUAGE_UNSPECIFIED

    def seen(self, client_id: str, language_header: str) -> Client:
        """A request of this client: it is alive, and until its settings say, its ``x-mq-language`` header names its language.

        A client may receive before its Telemetry settings arrive (the
        Python SDK's simple consumer does not wait for them); the header
        then gives the body digest's form. The Node.js SDK sends ``HTTP``.
        """
        c = self.touch(client_id)
        if c.language == d.LANGUAGE_UNSPECIFIED and language_header:
            c.language = LANGUAGE_HEADERS.get(language_header.upper(), d.LANGUAGE_UNSPECIFIED)
        return c

    def forget(self, client_id: str) -> Client | None:
        """The client said it terminates (NotifyClientTermination): no check-back goes to it any more; forget it.

        Its streams stay open (the client ends them right after; ending
        them here would be an error on its side) but leave the registries.
        """
        c = self.clients.pop(client_id, None)
        if c is not None:
            for stream in list(c.streams):
                stream.unregister()
        return c

    def _prune(self) -> None:
        cutoff = time.monotonic() - CLIENT_IDLE_S
        for cid in [cid for cid, c in self.clients.items() if not c.streams and c.last_seen < cutoff]:
            del self.clients[cid]
        if len(self.clients) >= MAX_CLIENTS:  # still full: the oldest idle ones go
            idle = sorted((c.last_seen, cid) for cid, c in self.clients.items() if not c.streams)
            for _, cid in idle[: max(1, len(idle) // 10)]:
                del self.clients[cid]

    def close_all(self, reason: str) -> None:
        for c in list(self.clients.values()):
            for stream in list(c.streams):
                stream.close(reason)


class TelemetryStream:
    """One open Telemetry stream: a PushTarget (broker/registry.py) for check-backs, with a bounded outbound queue.

    The check service hands a target either ``push(op, fields)`` or whole
    msgpack frames (``send_frame``: its batched ``check_transaction``
    pushes); both become ``RecoverOrphanedTransactionCommand``s for the
    client, with the transaction id that names the check copy.
    """

    def __init__(self, messaging: Messaging, client: Client, peer: str, max_message: int = 0) -> None:
        self.messaging = messaging
        self.max_bytes = max(MAX_QUEUED_BYTES, 2 * max_message)
        self.client = client
        self.peer = peer
        self.conn_id = next(_ids)
        self.client_id = client.client_id
        self._queue: asyncio.Queue = asyncio.Queue()
        self._queued_bytes = 0
        self.closed = asyncio.Event()
        self.finishing = False  # the client sent its last command: what is queued goes out, then the stream ends
        self.close_reason = ""  # why the broker ended the stream (an error for the client); "" when it just ended
        self.pushed = 0

    # ---- PushTarget ----------------------------------------------------------
    def writable(self) -> bool:
        return (not self.closed.is_set() and not self.finishing and self._queue.qsize() < MAX_QUEUED // 2
                and self._queued_bytes < self.max_bytes // 2)

    takes_frames = False  # check-backs come as CheckBack records

    def check_back(self, cb: CheckBack) -> None:
        """A RecoverOrphanedTransactionCommand for the check-back, queued for the client."""
        try:
            cmd = s.TelemetryCommand()
            rec = cmd.recover_orphaned_transaction_command
            rec.message.CopyFrom(convert.half_to_message(cb, language=self.client.language))
            rec.transaction_id = cb.tx_id  # RocketMQ's broker names the transaction by its UNIQ_KEY in a check-back too
        except (TypeError, ValueError) as exc:  # a property value protobuf cannot carry: logged, the pass goes on
            log.error("event=rmq_push_unreadable client_id=%s error=%r", self.client_id, exc)
            return
        self.offer(cmd)
        self.pushed += 1

    def send_frame(self, frame: bytes) -> None:  # pragma: no cover - takes_frames is False: never called
        raise TypeError("a Telemetry stream takes check-backs as records")

    # ---- outbound queue --------------------------------------------------------
    def offer(self, cmd: s.TelemetryCommand) -> bool:
        """Queue a command for the client; a stream over its bounds is closed (the client does not read)."""
        if self.closed.is_set() or self.finishing:
            return False
        size = cmd.ByteSize()
        if self._queue.qsize() >= MAX_QUEUED or self._queued_bytes + size > self.max_bytes:
            self.messaging.metrics.inc("rmq_telemetry_overflows")
            self.close(f"more than {MAX_QUEUED} commands or {self.max_bytes} bytes wait to be written: the client does not read")
            return False
        self._queued_bytes += size
        self._queue.put_nowait((cmd, size))
        return True

    async def next_command(self) -> s.TelemetryCommand | None:
        """The next command to write, or None once the stream is closed."""
        if self._queue.empty():
            getter = asyncio.ensure_future(self._queue.get())
            closer = asyncio.ensure_future(self.closed.wait())
            try:
                await asyncio.wait((getter, closer), return_when=asyncio.FIRST_COMPLETED)
            finally:
                closer.cancel()
                if not getter.done():
                    getter.cancel()
            if not getter.done() or getter.cancelled():
                return None
            cmd, size = getter.result()
        elif self.closed.is_set():
            return None
        else:
            cmd, size = self._queue.get_nowait()
        self._queued_bytes -= size
        if cmd is None:  # finish()'s mark: everything before it is written
            self.close("")
        return cmd

    def finish(self) -> None:
        """The client sent its last command (it half-closed): no more check-backs; what is queued is still written."""
        if self.closed.is_set() or self.finishing:
            return
        self.finishing = True
        self.unregister()
        self._queue.put_nowait((None, 0))

    def close(self, reason: str) -> None:
        if self.closed.is_set():
            return
        self.close_reason = reason
        self.closed.set()
        self.unregister()
        dropped = self._queue.qsize()
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queued_bytes = 0
        if reason:
            log.warning("event=rmq_telemetry_closed client_id=%s peer=%s dropped=%d reason=%r", self.client_id, self.peer, dropped, reason)

    # ---- registration ------------------------------------------------------------
    def register(self) -> None:
        """(Re-)enter this stream in the producer registry under its topics, or the consumer registry under its group."""
        self.unregister()
        if self.closed.is_set() or self.finishing:
            return
        c = self.client
        for topic in c.topics:
            self.messaging.register_producer(topic, self)
        if c.group:
            self.messaging.register_consumer(c.group, self)
        c.streams.add(self)

    def unregister(self) -> None:
        self.messaging.forget_client(self)
        self.client.streams.discard(self)


def write_command(context: Any, cmd: s.TelemetryCommand, client_id: str) -> asyncio.Task:
    """``context.write(cmd)`` as a task whose failure is always retrieved.

    The stream's handler may give up on the write (the stream was closed
    while the client did not read) or be cancelled before it ends (the
    client went away): the write then fails in gRPC (ExecuteBatchError on
    a dead stream) with nobody awaiting it, which asyncio would report as a
    multi-line "Task exception was never retrieved" on stderr.
    """
    task = asyncio.ensure_future(context.write(cmd))
    task.add_done_callback(lambda t: _write_done(t, client_id))
    return task


def _write_done(task: asyncio.Task, client_id: str) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.debug("event=rmq_telemetry_write_failed client_id=%s error=%r", client_id, exc)
