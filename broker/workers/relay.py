"""The channel between a front-end worker process and the broker process that owns the store.

A worker (worker.py) holds the clients' connections: it terminates TCP,
TLS and HTTP/2 in its own gRPC core and relays each RPC, still as the
protobuf bytes the client sent, to the owning process (pool.py), which
parses it and answers it with the same handlers the single process runs
(broker/rocketmq/server.py). Nothing about a request is decided in a
worker: every broker rule, limit and refusal stays in one place, and a
worker never opens the data directory.

One Unix stream socket per worker, in a directory only the broker's user
can enter (the owner also checks the peer's uid). Both directions carry a
stream of msgpack arrays, no length prefix (msgpack's streaming unpacker
finds the boundaries); what one side writes in one event-loop turn goes
out in one ``write`` (``Sender``): a worker's 32 concurrent SendMessage
calls cost the owner one read, not 32.

Worker to owner::

    [HELLO, index, pid, token]                 once, first
    [CALL, id, method, metadata, peer, timeout_s, request]   a unary or server-streaming RPC
    [OPEN, id, method, metadata, peer, timeout_s]            a bidirectional stream (Telemetry)
    [DATA, id, message]                        a message the client wrote on an open stream
    [HALF_CLOSE, id]                           the client wrote its last message
    [CANCEL, id]                               the client went away, or its deadline passed
    [WROTE, id, ok]                            a WRITE was handed to gRPC (ok) or could not be

Owner to worker::

    [REPLY, id, response]                      a unary RPC's answer; the call ends
    [WRITE, id, response]                      one response of a stream: the next waits for its WROTE (back pressure)
    [END, id]                                  the stream ends, status OK
    [ABORT, id, code, details]                 the call ends with this gRPC status code
    [DRAIN]                                    stop accepting; finish what is open, then exit

``metadata`` is a list of ``[key, value]`` text pairs (binary headers are
not relayed: no handler reads one); ``timeout_s`` is what was left of the
client's deadline when the worker relayed the call, or None.

A TCP port (RocketMQ 4's remoting port and its VIP channel) is relayed as
byte streams: the worker accepts the connection and moves its bytes; the
owner runs the front end's own protocol object on a transport of the
channel (pool.RelayedTransport), so framing, limits, authentication,
backpressure and every answer stay the single process's code. Worker to
owner::

    [ACCEPTED, conn, listener, peer, local]    a connection on listener (its index in the spec); addresses as [host, port]
    [BYTES, conn, data]                        what the client sent
    [CLOSED, conn, reason]                     the connection ended (reason: None, or why)
    [WRITTEN, conn, n]                         n more bytes of what the owner sent were taken by the client's socket
                                               (its buffer is under its limit; acknowledged once per loop turn)

Owner to worker::

    [SEND, conn, data]                         write to the client
    [SHUT, conn]                               close once what was sent is written
    [SHUT_WRITE, conn]                         half-close (write_eof): no more bytes to the client
    [RESET, conn]                              close at once (abort)
    [HOLD, conn] / [READ, conn]                pause / resume reading from the client
    [LIMITS, conn, high, low]                  the write buffer's limits (set_write_buffer_limits)

A connection id is the worker's and never reused; a frame for an id that
is gone is dropped on either side (the other end learns of the end from
CLOSED, or from the channel's). The owner counts what it sent a
connection and WRITTEN did not yet acknowledge as that transport's write
buffer: past its high mark the protocol is paused at once, as an asyncio
transport pauses it inside ``write``, so a client that does not read (or a
worker that stalls) holds the owner to the buffer's limit, not to what its
requests could make it write.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import msgpack

HELLO, CALL, OPEN, DATA, HALF_CLOSE, CANCEL, WROTE = 1, 2, 3, 4, 5, 6, 7
REPLY, WRITE, END, ABORT, DRAIN = 10, 12, 13, 14, 15
ACCEPTED, BYTES, CLOSED, WRITTEN = 20, 21, 22, 23
SEND, SHUT, SHUT_WRITE, RESET, HOLD, READ, LIMITS = 30, 31, 32, 33, 34, 35, 36

# The largest msgpack object either side takes: a request or response is bounded by the front end's
# --max-frame-derived message limit (a few MiB); this leaves room and stops a runaway buffer.
MAX_BUFFER = 256 << 20

WORKER_ENV = "TXMQ_FRONTEND_WORKER"  # the hello token reaches a worker in its environment, never in its argv (ps shows argv)


def unpacker() -> msgpack.Unpacker:
    return msgpack.Unpacker(raw=False, use_list=True, max_buffer_size=MAX_BUFFER)


class Sender:
    """Frames for one transport, gathered while the loop runs and written together once per turn."""

    __slots__ = ("_transport", "_pending", "_loop", "_pack")

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()
        self._pack = msgpack.Packer(use_bin_type=True).pack

    def send(self, frame: list[Any]) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(self._pack(frame))

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if not self._transport.is_closing():
            self._transport.write(b"".join(pending) if len(pending) > 1 else pending[0])


class FrameProtocol(asyncio.Protocol):
    """An asyncio protocol that hands each whole frame to ``on_frame`` and tells ``on_lost`` when the socket ends."""

    def __init__(self, on_frame: Callable[[list[Any]], None], on_lost: Callable[[BaseException | None], None],
                 on_pressure: Callable[[bool], None] | None = None) -> None:
        self._unpacker = unpacker()
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._on_pressure = on_pressure  # told True when the channel's write buffer is full, False once it drained
        self.transport: asyncio.Transport | None = None
        self.sender: Sender | None = None

    def pause_writing(self) -> None:
        if self._on_pressure is not None:
            self._on_pressure(True)

    def resume_writing(self) -> None:
        if self._on_pressure is not None:
            self._on_pressure(False)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.sender = Sender(transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        self._unpacker.feed(data)
        try:
            for frame in self._unpacker:
                if self.transport is not None and self.transport.is_closing():  # ended by an earlier frame of this read
                    return
                self._on_frame(frame)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, msgpack.BufferFull) as exc:
            # Only txmq's own processes speak here: a frame that does not decode ends the channel, loudly.
            if self.transport is not None:
                self.transport.abort()
            self._on_lost(exc)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._on_lost(exc)
