"""The owning process's side of the front-end workers: it starts them, answers what they relay, and restarts them.

``WorkerPool`` is a front end to the broker (``Broker.own``): started after
the front ends whose requests it relays, stopped after them. For each
worker it runs a supervisor that spawns the process (``txmq
__frontend-worker``, see worker.py), waits for its hello, and, when the
process ends while the broker serves, spawns it again at once (a worker
that keeps dying within a second of its start is spawned again after a
growing pause, at most ``MAX_BACKOFF_S``). The broker's own death takes
the workers with it: each asks the kernel for SIGKILL when its parent dies,
and leaves when its channel closes.

A relayed call runs the front end's own handler (``Handlers``: the
callables broker/rocketmq/server.py registers with gRPC in a single
process) on a ``RelayedContext``, the few methods of a gRPC servicer
context the handlers use. So an RPC is answered by the same code, with
the same limits, refusals and counters, whichever process holds its
connection.

A relayed TCP connection (the remoting port) is the front end's own
protocol object (``TcpService.factory``: what a single process hands to
``loop.create_server``) on a ``RelayedTransport``, an asyncio transport
whose socket is in a worker: the same framing, limits, authentication,
backpressure and answers, and the broker's own requests to the client
(check-backs) go out the same way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

from .relay import (ABORT, ACCEPTED, BYTES, CALL, CANCEL, CLOSED, DATA, DRAIN, END, HALF_CLOSE, HELLO, HOLD, LIMITS, OPEN, READ, REPLY,
                    RESET, SEND, SHUT, SHUT_WRITE, WORKER_ENV, WRITE, WRITTEN, WROTE, FrameProtocol)

log = logging.getLogger("txmq.workers")

UNARY, SERVER_STREAM, BIDI = "unary", "stream", "bidi"
GRPC_INTERNAL, GRPC_UNIMPLEMENTED, GRPC_UNAVAILABLE, GRPC_RESOURCE_EXHAUSTED = 13, 12, 14, 8  # grpc.StatusCode values
# A client's messages on one stream the broker has not read yet (a Telemetry stream carries a few: settings, now and
# then): past it the stream ends, RESOURCE_EXHAUSTED. In one process gRPC's flow control holds the client back instead.
MAX_STREAM_BACKLOG = 256
HELLO_TIMEOUT_S = 30.0  # a worker that has not bound its port and said hello by then is killed and spawned again
DRAIN_GRACE_S = 5.0  # after DRAIN, a worker that has not exited by then is killed
MAX_BACKOFF_S = 2.0


@dataclass(frozen=True, slots=True)
class Handler:
    kind: str  # UNARY, SERVER_STREAM or BIDI
    call: Callable[..., Any]  # (request bytes, context) -> response; an async generator for SERVER_STREAM; (requests, context) for BIDI
    serialize: Callable[[Any], bytes]


@dataclass(slots=True)
class GrpcService:
    """What a worker serves on a gRPC port, and what answers it here."""

    name: str  # the full service name, apache.rocketmq.v2.MessagingService
    handlers: dict[str, Handler]
    host: str
    port: int
    options: list[tuple[str, Any]]  # the gRPC server's channel arguments (with grpc.so_reuseport = 1)
    tls_cert: str | None = None
    tls_key: str | None = None


@dataclass(slots=True)
class TcpService:
    """A TCP port whose connections the workers accept and relay as byte streams, and what serves them here."""

    name: str  # what the logs call it: "remoting", "remoting-vip"
    host: str
    port: int
    factory: Callable[[], asyncio.Protocol]  # one protocol object per connection, as loop.create_server takes


class RelayedTransport(asyncio.Transport):
    """The transport of a client connection a worker holds: what the protocol asks of it goes to the worker as frames.

    ``connection_lost`` comes when the worker says the socket ended (CLOSED),
    or when the worker or its channel is gone; after ``close`` or ``abort``
    no more ``data_received`` reaches the protocol, as with asyncio's own.
    Its write buffer is what was sent and the worker did not yet acknowledge
    (WRITTEN: taken by the client's socket): past the high mark the protocol
    is paused inside ``write``, and resumed once the buffer is down to the
    low mark, as an asyncio transport does.
    """

    __slots__ = ("_link", "_conn", "_protocol", "_closing", "_reading", "_eof", "_buffered", "_high", "_low", "_write_paused")

    def __init__(self, link: WorkerLink, conn: int, protocol: asyncio.Protocol, peer: tuple, local: tuple) -> None:
        super().__init__({"peername": peer, "sockname": local})
        self._link = link
        self._conn = conn
        self._protocol = protocol
        self._closing = False
        self._reading = True
        self._eof = False
        self._buffered = 0
        self._high, self._low = 64 * 1024, 16 * 1024  # asyncio's defaults
        self._write_paused = False

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def is_closing(self) -> bool:
        return self._closing

    def write(self, data: Any) -> None:
        if self._eof:
            raise RuntimeError("Cannot call write() after write_eof()")  # as asyncio's transports say
        if not self._closing and data:
            self._link.sender_send([SEND, self._conn, data if type(data) is bytes else bytes(data)])
            self._buffered += len(data)
            if not self._write_paused and self._buffered > self._high:
                self._write_paused = True
                self._link.pressure(self, "pause_writing")

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:  # each its own frame: a large buffer (a pull's records) is not joined
            self.write(data)

    def _written(self, n: int) -> None:
        self._buffered = max(0, self._buffered - n)
        if self._write_paused and self._buffered <= self._low and not self._closing:
            self._write_paused = False
            self._link.pressure(self, "resume_writing")

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        if not self._closing and not self._eof:
            self._eof = True
            self._link.sender_send([SHUT_WRITE, self._conn])

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            self._link.sender_send([SHUT, self._conn])

    def abort(self) -> None:
        self._closing = True
        self._link.sender_send([RESET, self._conn])

    def is_reading(self) -> bool:
        return self._reading and not self._closing

    def pause_reading(self) -> None:
        if self._reading and not self._closing:
            self._reading = False
            self._link.sender_send([HOLD, self._conn])

    def resume_reading(self) -> None:
        if not self._reading and not self._closing:
            self._reading = True
            self._link.sender_send([READ, self._conn])

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        # asyncio's defaults and checks, here: limits a socket would refuse raise in the protocol, not in the worker
        if high is None:
            high = 64 * 1024 if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low
        self._link.sender_send([LIMITS, self._conn, high, low])  # the client socket's own buffer, in the worker, alike

    def get_write_buffer_size(self) -> int:
        return self._buffered

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol  # type: ignore[assignment]


class RelayAborted(Exception):
    """Raised by ``RelayedContext.abort``, as gRPC's own abort raises: the handler ends there."""


class ClientGone(ConnectionError):
    """A stream's message could not be handed to its client (it went away, or its worker did)."""


class RelayedContext:
    """The handler's view of an RPC a worker relayed: its headers, peer and deadline, and its stream's writes."""

    __slots__ = ("_link", "_id", "_md", "_peer", "_deadline", "_aborted")

    def __init__(self, link: WorkerLink, call_id: int, md: list, peer: str, timeout_s: float | None) -> None:
        self._aborted = False
        self._link = link
        self._id = call_id
        self._md = md
        self._peer = peer
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def invocation_metadata(self) -> list:
        return self._md

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def write(self, message: Any) -> None:
        if self._aborted:  # the worker ended the call: no WROTE would ever come for it
            raise ClientGone("the call was aborted")
        await self._link.write(self._id, message)

    async def abort(self, code: Any, details: str = "") -> None:
        self._aborted = True
        value = code.value[0] if hasattr(code, "value") else int(code)
        self._link.sender_send([ABORT, self._id, value, details])
        raise RelayAborted(details)


class WorkerLink:
    """One worker's channel: the calls it relayed that are open here, by id."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.index = -1
        self.pid = 0
        self.protocol = FrameProtocol(self._on_frame, self._on_lost)
        self.calls: dict[int, asyncio.Task] = {}
        self.streams: dict[int, asyncio.Queue] = {}  # BIDI calls: the client's messages (None: it wrote its last)
        self.writes: dict[int, deque[asyncio.Future]] = {}
        self.conns: dict[int, RelayedTransport] = {}  # the relayed TCP connections the worker holds, by its id
        self.relayed = 0
        self.lost = False
        self.greeted = False
        self.hello = asyncio.get_running_loop().create_future()

    def sender_send(self, frame: list) -> None:
        if not self.lost and self.protocol.sender is not None:
            self.protocol.sender.send(frame)

    # ---- frames from the worker -----------------------------------------------------------
    def _on_frame(self, f: list) -> None:
        kind = f[0]
        if not self.greeted:  # nothing but a hello the pool admits is served (the token, the spawn's pid)
            if kind == HELLO:
                self._hello(f)
            else:
                log.error("event=worker_frame_before_hello kind=%r", kind)
                self._abort()
            return
        if kind == BYTES:
            t = self.conns.get(f[1])
            if t is not None and not t._closing:
                self._protocol_call(t, "data_received", f[2])
        elif kind == CALL:
            self._call(f[1], f[2], f[3], f[4], f[5], f[6])
        elif kind == DATA:
            q = self.streams.get(f[1])
            if q is not None:
                if q.qsize() >= MAX_STREAM_BACKLOG:  # the handler does not keep up with what its client writes: end it
                    self._overrun(f[1])
                else:
                    q.put_nowait(f[2])
        elif kind == WROTE:
            waiting = self.writes.get(f[1])
            if waiting:
                fut = waiting.popleft()
                if not fut.done():
                    fut.set_result(bool(f[2]))
        elif kind == OPEN:
            self._open(f[1], f[2], f[3], f[4], f[5])
        elif kind == HALF_CLOSE:
            q = self.streams.get(f[1])
            if q is not None:
                q.put_nowait(None)
        elif kind == CANCEL:
            task = self.calls.get(f[1])
            if task is not None:
                _cancel(task)
        elif kind == ACCEPTED:
            self._accepted(f[1], f[2], f[3], f[4])
        elif kind == CLOSED:
            t = self.conns.pop(f[1], None)
            if t is not None:
                t._closing = True
                self._protocol_call(t, "connection_lost", None if f[2] is None else ConnectionResetError(f[2]))
        elif kind == WRITTEN:
            t = self.conns.get(f[1])
            if t is not None and type(f[2]) is int:
                t._written(f[2])
        else:
            log.error("event=worker_frame_unknown worker=%d kind=%r", self.index, kind)

    # ---- relayed TCP connections ---------------------------------------------------------------
    def _accepted(self, conn: int, listener: int, peer: list, local: list) -> None:
        services = self.pool.tcp
        if not (type(conn) is int and type(listener) is int and 0 <= listener < len(services)) or conn in self.conns:
            log.error("event=worker_frame_bad worker=%d kind=accepted conn=%r listener=%r", self.index, conn, listener)
            self.sender_send([RESET, conn])
            return
        protocol = services[listener].factory()
        t = RelayedTransport(self, conn, protocol, tuple(peer), tuple(local))
        self.conns[conn] = t
        self._protocol_call(t, "connection_made", t)

    def pressure(self, t: RelayedTransport, method: str) -> None:
        """pause_writing or resume_writing on a connection's protocol; what it raises is logged (asyncio's way: a
        transport's own write must not fail for it)."""
        try:
            getattr(t._protocol, method)()
        except Exception:
            log.exception("event=relayed_connection_failed worker=%d callback=%s", self.index, method)

    def _protocol_call(self, t: RelayedTransport, method: str, *args: Any) -> None:
        """One call into a connection's protocol; what it raises ends that connection alone (asyncio's transports do the same)."""
        try:
            getattr(t._protocol, method)(*args)
        except Exception as exc:
            log.exception("event=relayed_connection_failed worker=%d callback=%s", self.index, method)
            if method != "connection_lost" and self.conns.pop(t._conn, None) is not None:
                t.abort()
                try:
                    t._protocol.connection_lost(exc)  # as asyncio's transports end a connection whose protocol raised
                except Exception:
                    log.exception("event=relayed_connection_failed worker=%d callback=connection_lost", self.index)

    def _overrun(self, call_id: int) -> None:
        task = self.calls.get(call_id)
        self.streams.pop(call_id, None)
        if task is not None:
            _cancel(task)
        log.warning("event=relayed_stream_overrun worker=%d backlog=%d", self.index, MAX_STREAM_BACKLOG)
        self.sender_send([ABORT, call_id, GRPC_RESOURCE_EXHAUSTED,
                          f"more than {MAX_STREAM_BACKLOG} messages written on the stream and not yet read by the broker"])

    def _hello(self, f: list) -> None:
        _, index, pid, token = (f + [None] * 4)[:4]
        if token != self.pool.token or not isinstance(index, int) or not isinstance(pid, int) or not self.pool.admit(self, index, pid):
            log.error("event=worker_hello_refused worker=%r pid=%r", index, pid)
            self._abort()
            return
        self.greeted = True
        self.hello.set_result(self)

    def _abort(self) -> None:
        if self.protocol.transport is not None:
            self.protocol.transport.abort()

    def _on_lost(self, exc: BaseException | None) -> None:
        if self.lost:
            return
        self.lost = True
        for task in list(self.calls.values()):
            _cancel(task)
        for waiting in self.writes.values():
            for fut in waiting:
                if not fut.done():
                    fut.set_result(False)
        self.writes.clear()
        conns, self.conns = self.conns, {}
        gone = ConnectionResetError("its front-end worker process is gone")
        for t in conns.values():  # the worker held their sockets: they are closed, and their clients connect again
            t._closing = True
            self._protocol_call(t, "connection_lost", gone)
        if not self.hello.done():
            self.hello.set_exception(ConnectionError("the worker's channel closed before its hello"))
            self.hello.exception()  # retrieved: a worker that died early is the supervisor's to report
        self.pool.lost(self, exc)

    # ---- calls -------------------------------------------------------------------------------
    def _handler(self, call_id: int, method: str, bidi: bool) -> Handler | None:
        """The handler of a relayed call, or None (answered UNIMPLEMENTED): CALL names a unary or server-streaming
        method, OPEN a bidirectional one."""
        handler = self.pool.service.handlers.get(method) if self.pool.service is not None else None
        if handler is None or (handler.kind == BIDI) != bidi:
            self.sender_send([ABORT, call_id, GRPC_UNIMPLEMENTED, f"method {method} is not served"])
            return None
        self.relayed += 1
        return handler

    def _call(self, call_id: int, method: str, md: list, peer: str, timeout_s: float | None, request: bytes) -> None:
        handler = self._handler(call_id, method, bidi=False)
        if handler is not None:
            run = self._unary if handler.kind == UNARY else self._stream
            self._track(call_id, run, handler, request, RelayedContext(self, call_id, md, peer, timeout_s))

    def _open(self, call_id: int, method: str, md: list, peer: str, timeout_s: float | None) -> None:
        handler = self._handler(call_id, method, bidi=True)
        if handler is not None:
            q: asyncio.Queue = asyncio.Queue()
            self.streams[call_id] = q
            self._track(call_id, self._bidi, handler, _requests(q), RelayedContext(self, call_id, md, peer, timeout_s))

    def _track(self, call_id: int, run: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run one call. Whatever ends it, its state here goes (``_ended``): a task cancelled before its first step
        (its CANCEL came in the same read as its CALL) never runs a finally clause, and a cleanup may itself raise."""
        task = asyncio.ensure_future(self._guarded(call_id, run, *args))
        self.calls[call_id] = task
        task.add_done_callback(lambda t, cid=call_id: self._ended(cid, t))

    async def _guarded(self, call_id: int, run: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            await run(call_id, *args)
        except (RelayAborted, ClientGone):  # ended by the handler's abort, or the stream's client is gone
            pass
        except Exception as exc:  # the handlers answer every error in the response: this is a defect
            log.exception("event=relayed_call_failed worker=%d", self.index)
            self.sender_send([ABORT, call_id, GRPC_INTERNAL, f"internal error: {exc!r}"[:500]])

    def _ended(self, call_id: int, task: asyncio.Future) -> None:
        if self.calls.get(call_id) is task:
            del self.calls[call_id]
            self.streams.pop(call_id, None)
            for fut in self.writes.pop(call_id, ()):
                if not fut.done():
                    fut.set_result(False)

    async def _unary(self, call_id: int, handler: Handler, request: bytes, ctx: RelayedContext) -> None:
        resp = await handler.call(request, ctx)
        self.sender_send([REPLY, call_id, handler.serialize(resp)])

    async def _stream(self, call_id: int, handler: Handler, request: bytes, ctx: RelayedContext) -> None:
        # A response goes out once the worker handed the one before it to gRPC, as the generator waits on gRPC in one
        # process: a ReceiveMessage whose client went away mid-stream stops there and gives back what it did not
        # send. The generator is asked for its next response first, so a stream of one response (a refusal, "no new
        # message") ends without waiting for the worker, and holds its place among the open RPCs no longer than that.
        responses = handler.call(request, ctx)
        try:
            last: asyncio.Future | None = None
            async for resp in responses:
                if last is not None and not await last:
                    raise ClientGone("the stream's client is gone")
                last = self._write(call_id, handler.serialize(resp))
            self.sender_send([END, call_id])
        finally:
            await responses.aclose()

    async def _bidi(self, call_id: int, handler: Handler, requests: AsyncIterator[bytes], ctx: RelayedContext) -> None:
        await handler.call(requests, ctx)
        self.sender_send([END, call_id])

    async def write(self, call_id: int, message: Any) -> None:
        """Write one message on a stream and wait until the worker handed it to gRPC (gRPC's back pressure)."""
        if not await self._write(call_id, message if isinstance(message, bytes) else message.SerializeToString()):
            raise ClientGone("the stream's client is gone")

    def _write(self, call_id: int, data: bytes) -> asyncio.Future:
        """Send one WRITE; the future is True once the worker handed it to gRPC, False if it could not."""
        fut = asyncio.get_running_loop().create_future()
        if self.lost:
            fut.set_result(False)
            return fut
        self.writes.setdefault(call_id, deque()).append(fut)
        self.sender_send([WRITE, call_id, data])
        return fut


async def _requests(q: asyncio.Queue) -> AsyncIterator[bytes]:
    while True:
        item = await q.get()
        if item is None:
            return
        yield item


@dataclass(slots=True)
class Slot:
    """One worker's place in the pool: its process now, and what it did."""

    index: int
    process: asyncio.subprocess.Process | None = None
    link: WorkerLink | None = None
    started_at: float = 0.0
    restarts: int = 0
    quick_deaths: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class WorkerPool:
    """N worker processes serving the relayed front ends' ports; a front end of the broker (server.Frontend)."""

    def __init__(self, count: int, data_dir: Path, busy_poll_s: float = 0.0) -> None:
        if count < 1:
            raise ValueError("a worker pool has at least one worker")
        self.count = count
        self.busy_poll_s = busy_poll_s  # each worker's --busy-poll window (worker.py)
        self.data_dir = data_dir
        self.service: GrpcService | None = None
        self.tcp: list[TcpService] = []
        self.token = os.urandom(16).hex()
        self.slots = [Slot(i) for i in range(count)]
        self.links: set[WorkerLink] = set()
        self._pending_links: list[WorkerLink] = []
        self._dir: str | None = None
        self._server: asyncio.AbstractServer | None = None
        self._supervisors: list[asyncio.Task] = []
        self._stopping = False
        self._lost_calls = 0

    @property
    def socket_path(self) -> str:
        assert self._dir is not None
        return os.path.join(self._dir, "relay.sock")

    def serve_grpc(self, service: GrpcService) -> None:
        self.service = service

    def serve_tcp(self, service: TcpService) -> None:
        self.tcp.append(service)

    async def bind(self) -> None:
        """The channel's socket, in a directory of this user's only (mode 0700): the workers connect to it.

        Named after this process (txmq-workers-<pid>-*): a broker killed with SIGKILL leaves its directory behind, and
        the next start of a broker by the same user removes those of processes no longer running.
        """
        _sweep_dead_dirs(tempfile.gettempdir())
        self._dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._accept, self.socket_path, backlog=max(16, self.count * 2))
        os.chmod(self.socket_path, 0o600)

    def _accept(self) -> asyncio.Protocol:
        link = WorkerLink(self)
        self.links.add(link)
        return _PeerChecked(link)

    def admit(self, link: WorkerLink, index: int, pid: int) -> bool:
        """A hello with the token: the worker of slot ``index`` if that slot's process is ``pid`` (not a worker of an
        earlier spawn, still on its way out) and the slot has no channel yet."""
        if not 0 <= index < self.count:
            return False
        slot = self.slots[index]
        if slot.process is None or slot.process.pid != pid or slot.link is not None:
            return False
        link.index, link.pid = index, pid
        slot.link = link
        slot.ready.set()
        return True

    def lost(self, link: WorkerLink, exc: BaseException | None) -> None:
        self.links.discard(link)
        open_calls = len(link.calls)
        self._lost_calls += open_calls
        if link.index >= 0:
            slot = self.slots[link.index]
            if slot.link is link:
                slot.link = None
                slot.ready.clear()
                if not self._stopping:
                    log.warning("event=frontend_worker_channel_lost worker=%d pid=%d open_calls=%d error=%r", link.index, link.pid,
                                open_calls, exc)

    async def start(self) -> None:
        assert self.service is not None or self.tcp, "serve_grpc() or serve_tcp() first"
        loop = asyncio.get_running_loop()
        self._supervisors = [loop.create_task(self._supervise(slot), name=f"txmq-worker-{slot.index}") for slot in self.slots]
        waits = [asyncio.ensure_future(slot.ready.wait()) for slot in self.slots]
        done, pending = await asyncio.wait(waits, timeout=HELLO_TIMEOUT_S)
        for w in pending:
            w.cancel()
        if pending:
            log.error("event=frontend_workers_slow ready=%d of=%d", len(done), self.count)
        log.info("event=frontend_workers_started workers=%d pids=%s", self.count,
                 ",".join(str(s.process.pid) for s in self.slots if s.process is not None))

    def _command(self, index: int) -> list[str]:
        spec = {"relay": self.socket_path, "index": index, "parent": os.getpid(),
                "grpc": _grpc_spec(self.service) if self.service is not None else None,
                "tcp": [{"name": t.name, "host": t.host, "port": t.port} for t in self.tcp],
                "busy_poll_s": self.busy_poll_s, "log_format": _log_format(), "log_level": logging.getLevelName(logging.getLogger("txmq").getEffectiveLevel()).lower()}
        prefix = [sys.executable] if getattr(sys, "frozen", False) else [sys.executable, "-m", "txmq.cli.launch"]
        return [*prefix, "__frontend-worker", json.dumps(spec, separators=(",", ":"))]

    async def _supervise(self, slot: Slot) -> None:
        backoff = 0.0
        while not self._stopping:
            if backoff:
                await asyncio.sleep(backoff)
                if self._stopping:
                    return
            env = {**os.environ, WORKER_ENV: self.token}
            if not getattr(sys, "frozen", False):
                # the modules this process imports, wherever they come from (a venv, an editable checkout, a shiv
                # zipapp unpacked at start): the worker is `python -m txmq.cli.launch` and must find the same ones
                paths = [p for p in sys.path if p and os.path.isdir(p)]
                env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
            try:
                slot.process = await asyncio.create_subprocess_exec(*self._command(slot.index), env=env, stdin=asyncio.subprocess.DEVNULL)
            except Exception as exc:  # noqa: BLE001 - whatever it is, the slot keeps trying, and says why
                log.error("event=frontend_worker_spawn_failed worker=%d error=%r", slot.index, exc)
                backoff = min(MAX_BACKOFF_S, max(0.1, backoff * 2))
                continue
            slot.started_at = time.monotonic()
            proc = slot.process
            try:
                await asyncio.wait_for(_first(slot.ready.wait(), proc.wait()), HELLO_TIMEOUT_S)
            except asyncio.TimeoutError:
                log.error("event=frontend_worker_no_hello worker=%d pid=%d waited_s=%g", slot.index, proc.pid, HELLO_TIMEOUT_S)
                _kill(proc)
            rc = await proc.wait()
            slot.ready.clear()
            if self._stopping:
                return
            lived = time.monotonic() - slot.started_at
            slot.restarts += 1
            slot.quick_deaths = slot.quick_deaths + 1 if lived < 1.0 else 0
            backoff = 0.0 if slot.quick_deaths < 2 else min(MAX_BACKOFF_S, 0.1 * 2 ** (slot.quick_deaths - 2))
            log.warning("event=frontend_worker_exited worker=%d pid=%d returncode=%s lived_s=%.3f restart_in_s=%g", slot.index, proc.pid,
                        rc, lived, backoff)

    async def stop(self) -> None:
        """Stop the workers: each stops accepting, finishes what is open (its calls here end first), and exits."""
        self._stopping = True
        for slot in self.slots:
            if slot.link is not None:
                slot.link.sender_send([DRAIN])
            elif slot.process is not None and slot.process.returncode is None:
                _kill(slot.process)
        procs = [s.process for s in self.slots if s.process is not None and s.process.returncode is None]
        if procs:
            _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=DRAIN_GRACE_S)
            for p in procs:
                if p.returncode is None:
                    _kill(p)
            for p in procs:
                await p.wait()
        for task in self._supervisors:
            task.cancel()
        for task in self._supervisors:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        for slot in self.slots:  # spawned while the others drained: its supervisor ended before it could see it end
            if slot.process is not None and slot.process.returncode is None:
                _kill(slot.process)
                await slot.process.wait()
        if self._server is not None:
            self._server.close()
            self._server = None
        self._remove_dir()  # nothing connects from now on; and a start that failed calls stop() alone, not close()

    async def close(self) -> None:
        for link in list(self.links):
            if link.protocol.transport is not None:
                link.protocol.transport.abort()
        self._remove_dir()

    def _remove_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def gauges(self) -> dict[str, int]:
        return {"frontend_workers": sum(1 for s in self.slots if s.link is not None),
                "frontend_worker_restarts": sum(s.restarts for s in self.slots)}

    def status(self) -> list[dict[str, Any]]:
        """One row per worker, as ``txmq broker status`` lists them."""
        now = time.monotonic()
        rows = []
        for s in self.slots:
            alive = s.link is not None
            pid = s.process.pid if s.process is not None else None
            rows.append({"worker": s.index, "pid": pid, "alive": alive, "up_s": round(now - s.started_at, 1) if alive else 0.0,
                         "restarts": s.restarts, "relayed": s.link.relayed if s.link is not None else 0,
                         "open_calls": len(s.link.calls) if s.link is not None else 0,
                         "connections": len(s.link.conns) if s.link is not None else 0, "cpu_s": _cpu_seconds(pid) if alive else None})
        return rows


class _PeerChecked(asyncio.Protocol):
    """The link's protocol, behind a check that the peer runs as this user (the directory's mode is the first guard)."""

    def __init__(self, link: WorkerLink) -> None:
        self._link = link

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            uid = int.from_bytes(creds[4:8], sys.byteorder)
        except (OSError, AttributeError):
            uid = -1
        if uid != os.getuid():
            log.error("event=worker_peer_refused uid=%d", uid)
            transport.abort()
        self._link.protocol.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._link.protocol.data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._link.protocol.connection_lost(exc)


def _grpc_spec(service: GrpcService) -> dict[str, Any]:
    return {"service": service.name, "methods": {name: h.kind for name, h in service.handlers.items()}, "host": service.host,
            "port": service.port, "options": service.options, "tls_cert": service.tls_cert, "tls_key": service.tls_key}


DIR_PREFIX = "txmq-workers-"


def _sweep_dead_dirs(parent: str) -> None:
    """Remove the channel directories this user's brokers left when they were killed (their pid no longer runs)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(DIR_PREFIX):
            continue
        pid = name[len(DIR_PREFIX):].split("-", 1)[0]
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not pid.isdigit() or st.st_uid != os.getuid() or not os.path.isdir(path) or os.path.islink(path):
            continue
        try:
            os.kill(int(pid), 0)
            continue  # still running (or another user's pid we may not signal: left alone)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            continue


async def _first(*aws: Awaitable[Any]) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def _cancel(task: asyncio.Task) -> None:
    """Cancel a relayed call once, as gRPC cancels a handler once: a second cancellation (its CANCEL, then the
    worker's death) would break into the cleanup the first one started (a ReceiveMessage giving back what it did not send)."""
    if not task.cancelling():
        task.cancel()


def _kill(proc: asyncio.subprocess.Process) -> None:
    try:
        proc.send_signal(signal.SIGKILL)
    except ProcessLookupError:
        pass


def _cpu_seconds(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, IndexError, ValueError):
        return None


def _log_format() -> str:
    """The broker's log format (broker/logs.py), for its workers' lines to read alike."""
    from ..logs import JsonFormatter

    return "json" if any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger("txmq").handlers) else "kv"
