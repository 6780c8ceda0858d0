"""A front-end worker process: it holds clients' gRPC connections and relays their RPCs to the broker process.

Started by the broker (pool.py) as ``txmq __frontend-worker SPEC`` (SPEC
is JSON: the channel's socket, this worker's index, the parent's pid, the
gRPC service to serve, if any: its name, its methods and their kinds,
host, port, channel arguments, TLS files; and the TCP ports whose byte
streams it relays: RocketMQ 4's remoting port and its VIP channel). The
hello token comes in the environment. The worker:

1. asks the kernel to kill it when its parent dies, and leaves at once if
   the parent is already gone;
2. connects to the broker's channel, binds the ports with SO_REUSEPORT
   beside its siblings (the broker holds them reserved), starts serving,
   then says hello;
3. relays every RPC (relay.py), answers what the broker answers, and
   turns the client's cancellation into CANCEL; relays each TCP
   connection's bytes both ways, and does with the socket what the
   broker's protocol object asks (close, pause reading, ...). When the
   channel to the broker is full it stops reading every client until it
   drained: a worker buffers no more than a flooding client's socket would;
4. on DRAIN stops accepting, lets open calls finish (gRPC's grace), closes
   its TCP connections once what the broker sent them is written, and
   exits; when the channel closes (the broker died) it exits at once.
   SIGINT and SIGTERM are ignored: a Ctrl-C on a terminal or a SIGTERM to
   the process group reaches the workers too, and the broker drains them
   itself (SIGKILL is what a worker that hangs gets).

It imports no part of the broker that touches the store: nothing here can
write it.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import json
import logging
import os
import signal
import sys
from typing import Any, AsyncIterator

from ..ports import listen
from .relay import (ABORT, ACCEPTED, BYTES, CALL, CANCEL, CLOSED, DATA, DRAIN, END, HALF_CLOSE, HELLO, HOLD, LIMITS, OPEN, READ,
                    REPLY, RESET, SEND, SHUT, SHUT_WRITE, WORKER_ENV, WRITE, WRITTEN, WROTE, FrameProtocol)

log = logging.getLogger("txmq.worker")

GRACE_S = 2.0  # open calls finish within this after DRAIN (the single process's SHUTDOWN_GRACE_S)
PR_SET_PDEATHSIG = 1


class Aborted(Exception):
    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


_END = object()


class _Stream:
    """A stream's messages from the broker (WRITE), up to its END or ABORT."""

    __slots__ = ("q", "ended")

    def __init__(self) -> None:
        self.q: asyncio.Queue = asyncio.Queue()
        self.ended = False

    async def next(self, context: Any) -> bytes | None:
        """The next message to write; None at the stream's end; the broker's ABORT ends the call as gRPC's abort does."""
        item = await self.q.get()
        if item is _END:
            self.ended = True
            return None
        if isinstance(item, Aborted):
            self.ended = True
            await context.abort(_status(item.code), item.details)
        return item


def _status(code: int) -> Any:
    import grpc

    for c in grpc.StatusCode:
        if c.value[0] == code:
            return c
    return grpc.StatusCode.UNKNOWN


class TcpRelay(asyncio.Protocol):
    """One client's TCP connection on a relayed port: its bytes go to the broker, the broker's come back (relay.py)."""

    __slots__ = ("worker", "listener", "conn", "transport", "held", "paused", "unacked", "write_paused")

    def __init__(self, worker: Worker, listener: int) -> None:
        self.worker = worker
        self.listener = listener
        self.conn = 0
        self.transport: asyncio.Transport | None = None
        self.held = False  # the broker asked to stop reading (HOLD)
        self.paused = False  # reading is paused (held, or the channel is full)
        self.unacked = 0  # bytes the broker sent that WRITTEN has not acknowledged
        self.write_paused = False  # the client's socket buffer is over its limit: no acknowledgement until it drains

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        w = self.worker
        self.transport = transport  # type: ignore[assignment]
        if w.draining or w.done.is_set():
            transport.abort()
            return
        self.conn = next(w.conn_ids)
        w.conns[self.conn] = self
        w.send([ACCEPTED, self.conn, self.listener, _address(transport.get_extra_info("peername")),
                _address(transport.get_extra_info("sockname"))])
        if w.channel_full:
            self.set_paused()

    def data_received(self, data: bytes) -> None:
        w = self.worker
        if self.conn in w.conns:
            w.send([BYTES, self.conn, data])
            if w.arm is not None and len(w.conns) == 1:  # a lone client's request: its answer finds a CPU awake
                w.arm()

    def eof_received(self) -> bool:
        return False  # the client's half-close ends the connection, as it does in the broker's own transports

    def connection_lost(self, exc: BaseException | None) -> None:
        w = self.worker
        if w.conns.pop(self.conn, None) is not None:
            w.send([CLOSED, self.conn, None if exc is None else (str(exc) or type(exc).__name__)[:200]])
            if not w.conns and w.draining:
                w.tcp_idle.set()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self.worker.ack(self)

    def set_paused(self) -> None:
        """Read or not, as the broker (HOLD/READ) and the channel's fill say."""
        want = self.held or self.worker.channel_full
        t = self.transport
        if want != self.paused and t is not None and not t.is_closing():
            self.paused = want
            if want:
                t.pause_reading()
            else:
                t.resume_reading()


def _address(a: Any) -> list:
    return [str(a[0]), int(a[1])] if isinstance(a, tuple) and len(a) >= 2 else [str(a or ""), 0]


class Worker:
    def __init__(self, spec: dict[str, Any], token: str) -> None:
        self.spec = spec
        self.token = token
        self.index = int(spec["index"])
        self.calls: dict[int, Any] = {}  # id -> a future (unary) or a queue (streams)
        self.ids = itertools.count(1)
        self.conns: dict[int, TcpRelay] = {}  # the relayed TCP connections, by id
        self.acks: set[TcpRelay] = set()  # connections with bytes to acknowledge at the end of this loop turn
        self.conn_ids = itertools.count(1)
        self.channel_full = False
        self.tcp_servers: list[asyncio.AbstractServer] = []
        self.tcp_idle = asyncio.Event()
        self.protocol: FrameProtocol | None = None
        self.server: Any = None
        self.done = asyncio.Event()
        self.draining = False
        self.busy_poll: Any = None
        self.draining_task: asyncio.Future | None = None
        self.arm: Any = None  # busy polling (broker/busypoll.py) while a lone call waits for the broker, and after its answer

    # ---- the channel ----------------------------------------------------------------------
    def send(self, frame: list) -> None:
        if self.protocol is not None and self.protocol.sender is not None:
            self.protocol.sender.send(frame)

    def on_frame(self, f: list) -> None:
        kind = f[0]
        if kind >= SEND:
            self._tcp_frame(kind, f)
        elif kind == REPLY:
            fut = self.calls.get(f[1])
            if fut is not None and not fut.done():
                fut.set_result(f[2])
                if self.arm is not None and len(self.calls) == 1:  # a lone client's answer: its next request comes soon
                    self.arm()
        elif kind == WRITE:
            q = self.calls.get(f[1])
            if q is not None:
                q.put_nowait(f[2])
        elif kind == END:
            q = self.calls.get(f[1])
            if q is not None and isinstance(q, asyncio.Queue):
                q.put_nowait(_END)
        elif kind == ABORT:
            target = self.calls.get(f[1])
            err = Aborted(int(f[2]), str(f[3]))
            if isinstance(target, asyncio.Queue):
                target.put_nowait(err)
            elif target is not None and not target.done():
                target.set_exception(err)
        elif kind == DRAIN:
            self.draining_task = asyncio.ensure_future(self.drain())
        else:
            log.error("event=worker_frame_unknown kind=%r", kind)

    def _tcp_frame(self, kind: int, f: list) -> None:
        relay = self.conns.get(f[1])
        if relay is None or relay.transport is None:
            return  # ended here already: the broker learns it from CLOSED
        t = relay.transport
        try:
            if kind == SEND:
                t.write(f[2])
                relay.unacked += len(f[2])
                if not relay.write_paused:
                    self.ack(relay)
                if self.arm is not None and len(self.conns) == 1:  # a lone client's answer: its next request comes soon
                    self.arm()
            elif kind == SHUT:
                t.close()
            elif kind == HOLD or kind == READ:
                relay.held = kind == HOLD
                relay.set_paused()
            elif kind == SHUT_WRITE:
                if t.can_write_eof():
                    t.write_eof()
            elif kind == RESET:
                t.abort()
            elif kind == LIMITS:
                t.set_write_buffer_limits(high=f[2], low=f[3])
            else:
                log.error("event=worker_frame_unknown kind=%r", kind)
        except Exception as exc:  # what the socket refuses (a write after its end, limits out of order) ends it alone
            log.error("event=worker_connection_refused_frame worker=%d kind=%d error=%r", self.index, kind, exc)
            t.abort()

    def ack(self, relay: TcpRelay) -> None:
        """Acknowledge what the client's socket took, at the end of this loop turn (one WRITTEN per connection)."""
        if not self.acks:
            asyncio.get_running_loop().call_soon(self._send_acks)
        self.acks.add(relay)

    def _send_acks(self) -> None:
        acks, self.acks = self.acks, set()
        for relay in acks:
            if relay.unacked and not relay.write_paused and self.conns.get(relay.conn) is relay:
                self.send([WRITTEN, relay.conn, relay.unacked])
                relay.unacked = 0

    def on_pressure(self, full: bool) -> None:
        """The channel to the broker is full (or drained): every relayed client stops (or starts again) being read."""
        self.channel_full = full
        for relay in list(self.conns.values()):
            relay.set_paused()

    def on_lost(self, exc: BaseException | None) -> None:
        if self.done.is_set():
            return
        if not self.draining:
            log.warning("event=worker_channel_lost worker=%d error=%r", self.index, exc)
        gone = Aborted(14, "the broker is gone")  # UNAVAILABLE: the clients connect again, to the broker started again
        for target in list(self.calls.values()):
            if isinstance(target, asyncio.Queue):
                target.put_nowait(gone)
            elif not target.done():
                target.set_exception(gone)
        for relay in list(self.conns.values()):  # nothing can answer them now: they connect again, to the broker started again
            if relay.transport is not None:
                relay.transport.abort()
        self.done.set()

    # ---- the relayed RPCs --------------------------------------------------------------------
    def unary(self, method: str):
        async def call(request: bytes, context: Any) -> bytes:
            cid = next(self.ids)
            fut = asyncio.get_running_loop().create_future()
            self.calls[cid] = fut
            self.send([CALL, cid, method, _metadata(context), context.peer() or "", context.time_remaining(), request])
            if self.arm is not None and len(self.calls) == 1:  # a lone call: its answer finds a CPU awake
                self.arm()
            try:
                return await fut
            except Aborted as a:
                await context.abort(_status(a.code), a.details)
                raise
            except asyncio.CancelledError:
                self.send([CANCEL, cid])
                raise
            finally:
                self.calls.pop(cid, None)

        return call

    def server_stream(self, method: str):
        async def call(request: bytes, context: Any) -> AsyncIterator[bytes]:
            cid = next(self.ids)
            stream = _Stream()
            self.calls[cid] = stream.q
            self._on_done(context, cid, stream)
            self.send([CALL, cid, method, _metadata(context), context.peer() or "", context.time_remaining(), request])
            try:
                while (item := await stream.next(context)) is not None:
                    yield item
                    self.send([WROTE, cid, True])  # gRPC took it: the broker sends the next
            finally:
                self._end(cid, stream)

        return call

    def bidi(self, method: str):
        async def call(requests: AsyncIterator[bytes], context: Any) -> None:
            cid = next(self.ids)
            stream = _Stream()
            self.calls[cid] = stream.q
            self._on_done(context, cid, stream)
            self.send([OPEN, cid, method, _metadata(context), context.peer() or "", context.time_remaining()])

            async def pump() -> None:
                try:
                    async for raw in requests:
                        self.send([DATA, cid, raw])
                except Exception:  # the client went away: gRPC cancels this call too
                    pass
                self.send([HALF_CLOSE, cid])

            reader = asyncio.ensure_future(pump())
            try:
                while (item := await stream.next(context)) is not None:
                    ok = True
                    try:
                        await context.write(item)
                    except Exception:
                        ok = False
                    self.send([WROTE, cid, ok])
            finally:
                reader.cancel()
                self._end(cid, stream)

        return call

    def _end(self, cid: int, stream: _Stream) -> None:
        """A stream's call is over: the broker is told if it did not end it itself (the client went away). Once."""
        if self.calls.pop(cid, None) is None:
            return
        if not stream.ended:
            self.send([CANCEL, cid])

    def _on_done(self, context: Any, cid: int, stream: _Stream) -> None:
        """End the stream's call when gRPC ends the RPC, too: a client that cancels while gRPC holds a response back
        (its flow-control window is full) cancels the handler's task outside the generator, whose ``finally`` then
        runs only when the generator is collected (later, if a traceback's reference cycle holds it)."""
        try:
            context.add_done_callback(lambda _ctx: self._end(cid, stream))
        except (AttributeError, NotImplementedError):  # a context without it: the generator's finally is the only end
            pass

    # ---- life ------------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.protocol = FrameProtocol(self.on_frame, self.on_lost, self.on_pressure)
        try:
            await loop.create_unix_connection(lambda: self.protocol, self.spec["relay"])
        except OSError as exc:
            log.error("event=worker_channel_unreachable worker=%d error=%r", self.index, exc)
            return 1
        if self.spec.get("grpc") and not await self._serve_grpc(self.spec["grpc"]):
            return 1
        for i, listener in enumerate(self.spec.get("tcp") or ()):
            try:
                sock = listen(listener["host"], int(listener["port"]), reuseport=True)  # beside the broker's hold and the others
                self.tcp_servers.append(await loop.create_server(lambda i=i: TcpRelay(self, i), sock=sock, backlog=2048))
            except OSError as exc:
                log.error("event=worker_bind_failed worker=%d port=%s error=%s", self.index, listener.get("port"), exc)
                return 1
        if self.spec.get("busy_poll_s"):
            from ..busypoll import BusyPoll

            self.busy_poll = BusyPoll(float(self.spec["busy_poll_s"]))
            self.arm = self.busy_poll.arm
        # The broker decides a worker's life (DRAIN, or its own death): Ctrl-C on a terminal or a SIGTERM to the whole
        # process group reaches the workers too, and a worker that left on its own would only be started again.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: None)
        self.send([HELLO, self.index, os.getpid(), self.token])
        await self.done.wait()
        if not self.draining and self.server is not None:  # the broker died: what is open cannot be answered
            await self.server.stop(0)
        if self.busy_poll is not None:
            self.busy_poll.stop()
        return 0

    async def _serve_grpc(self, g: dict[str, Any]) -> bool:
        import grpc
        from grpc import aio

        handlers = {}
        for name, kind in g["methods"].items():
            if kind == "unary":
                handlers[name] = grpc.unary_unary_rpc_method_handler(self.unary(name))
            elif kind == "stream":
                handlers[name] = grpc.unary_stream_rpc_method_handler(self.server_stream(name))
            else:
                handlers[name] = grpc.stream_stream_rpc_method_handler(self.bidi(name))
        options = [tuple(o) for o in g["options"]]
        self.server = aio.server(options=options)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(g["service"], handlers),))
        host, port = g["host"], int(g["port"])
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if g.get("tls_cert"):
                with open(g["tls_key"], "rb") as k, open(g["tls_cert"], "rb") as c:
                    creds = grpc.ssl_server_credentials([(k.read(), c.read())])
                bound = self.server.add_secure_port(address, creds)
            else:
                bound = self.server.add_insecure_port(address)
        except Exception as exc:
            log.error("event=worker_bind_failed worker=%d address=%s error=%s", self.index, address, exc)
            return False
        if bound != port:
            log.error("event=worker_bind_failed worker=%d address=%s bound=%d", self.index, address, bound)
            return False
        await self.server.start()
        return True

    async def drain(self) -> None:
        if self.draining:
            return
        self.draining = True
        log.info("event=worker_draining worker=%d open_calls=%d connections=%d", self.index, len(self.calls), len(self.conns))
        for server in self.tcp_servers:
            server.close()
        if self.server is not None:
            await self.server.stop(GRACE_S)
        # The broker answered what its clients asked before it drained us: each connection closes once that is written.
        for relay in list(self.conns.values()):
            if relay.transport is not None:
                relay.transport.close()
        if self.conns:
            try:
                await asyncio.wait_for(self.tcp_idle.wait(), GRACE_S)
            except asyncio.TimeoutError:
                for relay in list(self.conns.values()):
                    if relay.transport is not None:
                        relay.transport.abort()
        self.done.set()


def _metadata(context: Any) -> list[list[str]]:
    return [[m[0], m[1]] for m in (context.invocation_metadata() or ()) if isinstance(m[1], str)]


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the broker died before the request took effect
        os._exit(0)


def main(argv: list[str]) -> None:
    """``txmq __frontend-worker SPEC``: run one worker until DRAIN, SIGTERM or the broker's end."""
    spec = json.loads(argv[0])
    _die_with_parent(int(spec["parent"]))
    token = os.environ.pop(WORKER_ENV, "")
    from ..logs import setup

    setup(spec.get("log_format", "kv"), spec.get("log_level", "info"))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    sys.exit(asyncio.run(Worker(spec, token).run()))
