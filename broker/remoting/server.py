"""The remoting front end's listener and connections: RocketMQ 4's TCP protocol on --remoting-port.

``RemotingFrontend(core, config)`` has the shape of every front end
(server.Frontend): ``bind()`` before the store opens (a port in use ends
the start at once; requests that arrive before the broker serves wait),
``start()`` once the broker serves, ``stop()`` first at shutdown (no new
connections; requests in flight finish), ``close()`` last.

One port answers both the name server's requests (the routes name this
broker at this port) and the broker's, so a client's ``namesrvAddr`` is
this port (docs/remoting.md).

Each connection (``RemotingConnection``, an asyncio.Protocol) frames
(protocol.py), dispatches to the handler of the request's code
(handlers.py), and writes the responses of one loop iteration in one
write. Limits, as on the native port: a frame's length is checked before
it is buffered (--max-frame; before the first correctly signed request,
with --auth-token, --max-preauth-frame); the bytes all connections hold
in partly received frames stay under --partial-frame-budget; a connection
must send its first request within --auth-timeout and finish each frame
within --frame-timeout of its first byte; connections past
--remoting-max-connections (derived from RLIMIT_NOFILE like the other
ports' caps: server.connection_limits) or --max-connections-per-ip are
closed as soon as accepted. A frame that cannot be a command closes its
connection, and only it. Backpressure: a client that does not read its
responses, or has too many requests or pulled bytes in flight, is not read
from until it drains.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import itertools
import logging
import socket
import struct
import time
from functools import partial
from hashlib import sha1
from typing import TYPE_CHECKING, Any

from txmq.wire import PUSH, ErrorCode, FrameDecoder, TxmqError, parse_payload

from . import protocol as p
from .clients import ClientTable
from .handlers import HANDLERS, Then, error_response, served_codes
from .messages import address_bytes

if TYPE_CHECKING:
    from txmq.broker.config import BrokerConfig
    from txmq.broker.core import BrokerCore

log = logging.getLogger("txmq.remoting")

_ids = itertools.count(1 << 41)  # conn_ids of their own range: they share the registries with the other front ends
WRITE_HIGH = 4 << 20
PULL_BUDGET = 64 << 20
LINGER_S = 1.0
REFUSAL_LOG_EVERY_S = 10.0
_LEN = struct.Struct(">i")


class BindError(Exception):
    """The remoting port cannot be bound."""


class RemotingFrontend:
    def __init__(self, core: BrokerCore, config: BrokerConfig) -> None:
        if config.remoting_max_connections is None:  # the Broker derives it (server.connection_limits)
            raise ValueError("build the remoting front end on Broker.config")
        self.core = core
        self.config = config
        self.max_connections: int = config.remoting_max_connections
        self.sock: socket.socket | None = None
        self.server: asyncio.AbstractServer | None = None
        self.port = 0
        self.connections: set[RemotingConnection] = set()
        self.by_ip: dict[str, int] = {}
        self.inflight: set[asyncio.Future] = set()
        self.busy = 0  # connections with requests in flight (busy polling only for a lone client, as on the native port)
        self.partial_frame_bytes = 0
        self.clients = ClientTable(core, self)
        self.ready = asyncio.Event()
        self.stopping = False
        self.broker_name = "txmq"
        self.cluster_name = "txmq"
        self._sweeper: asyncio.Task | None = None
        self._refusals = 0
        self._refusal_logged_at = float("-inf")
        self._opaque = itertools.count(1)
        self._oneway_failures = 0  # failed oneway requests not logged yet
        self._oneway_logged_at = float("-inf")

    # ---- lifecycle --------------------------------------------------------------------------
    async def bind(self) -> int:
        cfg = self.config
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((cfg.host, cfg.remoting_port or 0))
            sock.listen(2048)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            address = f"[{cfg.host}]:{cfg.remoting_port}" if ":" in cfg.host else f"{cfg.host}:{cfg.remoting_port}"
            raise BindError(f"cannot listen on {address} (--remoting-port): {exc.strerror or exc}") from None
        self.sock = sock
        self.port = sock.getsockname()[1]
        self.core.listening("remoting", cfg.host, self.port)
        loop = asyncio.get_running_loop()
        # Listening from now on: connections are accepted, their requests wait until the broker serves.
        self.server = await loop.create_server(lambda: RemotingConnection(self), sock=sock, backlog=2048)
        return self.port

    async def start(self) -> None:
        self.ready.set()
        cfg = self.config
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="txmq-remoting-sweeper")
        log.info("event=remoting_listening host=%s port=%d max_connections=%d codes=%d", cfg.host, self.port, self.max_connections,
                 len(served_codes()))

    async def stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.ready.set()
        if self.server is not None:
            self.server.close()
        if self.inflight:
            await asyncio.wait(list(self.inflight), timeout=self.config.shutdown_timeout_s)
        if self._sweeper is not None:
            self._sweeper.cancel()

    async def close(self) -> None:
        for conn in list(self.connections):
            conn.close()
        if self.server is not None:
            try:
                await asyncio.wait_for(self.server.wait_closed(), 2.0)
            except (asyncio.TimeoutError, Exception):
                pass

    async def _sweep(self) -> None:
        cfg = self.config
        timeouts = [t for t in (cfg.auth_timeout_s, cfg.frame_timeout_s) if t]
        every = min(1.0, max(0.02, min(timeouts) / 4)) if timeouts else 1.0
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(every)
            now = loop.time()
            for conn in list(self.connections):
                conn.sweep(now)
            self.clients.expire_locks()

    # ---- what the connections share ----------------------------------------------------------
    def note_refusal(self, reason: str, peer: str) -> None:
        self._refusals += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= REFUSAL_LOG_EVERY_S:
            log.warning("event=remoting_connections_refused reason=%s peer=%s refused=%d msg=%s", reason, peer, self._refusals,
                        "'over a connection limit; counted in remoting_connections_refused*, logged at most every 10s'")
            self._refusals = 0
            self._refusal_logged_at = now

    def note_oneway_failure(self, peer: str, cmd: p.Command, resp: p.Command) -> None:
        """Log a failed oneway request (a lost END_TRANSACTION, say): at most one line per REFUSAL_LOG_EVERY_S, with the count."""
        self._oneway_failures += 1
        now = time.monotonic()
        if now - self._oneway_logged_at >= REFUSAL_LOG_EVERY_S:
            log.warning("event=remoting_oneway_failed peer=%s code=%d response=%d failures=%d remark=%r", peer, cmd.code, resp.code,
                        self._oneway_failures, resp.remark[:200])
            self._oneway_failures = 0
            self._oneway_logged_at = now

    def next_opaque(self) -> int:
        return next(self._opaque) & 0x7FFFFFFF


class RemotingConnection(asyncio.Protocol):
    """One client connection: a PushTarget (broker/registry.py) for check-backs when it registered a producer group."""

    def __init__(self, front: RemotingFrontend) -> None:
        self.front = front
        self.core = front.core
        self.conn_id = next(_ids)
        cfg = self.core.config
        self.authed = not cfg.auth_token
        self.max_frame = cfg.max_frame if self.authed else min(cfg.max_preauth_frame, cfg.max_frame)
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.ip = ""
        self.local_host = cfg.host
        self.store_addr = b"\x7f\x00\x00\x01"
        self._buf = bytearray()
        self._partial = 0
        self._frame_started = 0.0
        self._first_by = 0.0
        self._counted = False
        self._closing = False
        self._read_paused = False
        self._write_paused = False
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._flush_scheduled = False
        self.inflight = 0
        self.pull_bytes = 0
        self._backlog: list[bytes] = []
        self.client_ids: set[str] = set()  # the client ids that sent heartbeats over this connection
        self.json_requests = True  # the serialize type of the requests it sends: the broker's requests follow it

    # ---- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._loop = asyncio.get_running_loop()
        self.transport.set_write_buffer_limits(high=WRITE_HIGH)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.ip = str(peer[0]) if isinstance(peer, tuple) else self.peer
        local = transport.get_extra_info("sockname")
        if isinstance(local, tuple):
            self.local_host = str(local[0])
            self.store_addr = address_bytes(self.local_host)
        front, cfg = self.front, self.core.config
        if front.stopping:
            transport.close()
            return
        if len(front.connections) >= front.max_connections:
            self._refuse_at_once("remoting_connections_refused",
                                 f"too many connections: the broker's limit is {front.max_connections} (--remoting-max-connections)")
            return
        per_ip = cfg.max_connections_per_ip
        if per_ip and front.by_ip.get(self.ip, 0) >= per_ip:
            self._refuse_at_once("remoting_connections_refused_per_ip",
                                 f"too many connections from {self.ip}: the broker's limit is {per_ip} per address (--max-connections-per-ip)")
            return
        self._counted = True
        front.connections.add(self)
        front.by_ip[self.ip] = front.by_ip.get(self.ip, 0) + 1
        self.core.metrics.inc("remoting_connections_accepted")
        if cfg.auth_timeout_s:
            self._first_by = self._loop.time() + cfg.auth_timeout_s

    def _refuse_at_once(self, counter: str, message: str) -> None:
        self._closing = True
        self.core.metrics.inc(counter)
        self.front.note_refusal(counter, self.peer)
        try:  # a response no request asked for: clients log it; the connection is closed at once
            self.transport.write(p.encode(p.Command(code=p.SYSTEM_BUSY, flag=p.RESPONSE_FLAG, remark=message)))
        finally:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._release_partial()
        if not self._counted:
            return
        self._counted = False
        front = self.front
        front.connections.discard(self)
        n = front.by_ip.get(self.ip, 0) - 1
        if n > 0:
            front.by_ip[self.ip] = n
        else:
            front.by_ip.pop(self.ip, None)
        self.core.registry.unregister_all(self)
        self.core.consumer_registry.unregister_all(self)
        front.clients.connection_closed(self)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._maybe_resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        arm = self.core.busy_poll.arm
        if arm is not None and self.front.busy <= 1:
            arm()  # a lone client's request: keep a CPU awake through its fsync (broker/busypoll.py), as the native port does
        self._buf += data
        while True:
            was_authed = self.authed
            frames = self._frames()
            if frames is None or not self._account(bool(frames)):
                return
            if self._backlog or self._read_paused:
                self._backlog.extend(frames)
                return
            self._run(frames)
            # Until a request is signed frames are taken one at a time: what follows the first signed one
            # is read again under the full limit.
            if was_authed or not self.authed or self._closing or len(self._buf) < 4:
                return

    def _frames(self) -> list[bytes] | None:
        """The complete frames buffered (one, before a signed request with --auth-token); None if the connection was closed."""
        buf = self._buf
        frames: list[bytes] = []
        pos, n = 0, len(buf)
        while n - pos >= 4:
            (length,) = _LEN.unpack_from(buf, pos)
            if length < 4 or length > self.max_frame:
                what = "--max-preauth-frame, before a correctly signed request" if not self.authed else "--max-frame"
                self._close_with(f"frame of {length} bytes: a frame holds 4 to {self.max_frame} bytes ({what})", "remoting_malformed_frames")
                return None
            if n - pos - 4 < length:
                break
            frames.append(bytes(buf[pos + 4 : pos + 4 + length]))
            pos += 4 + length
            if not self.authed:
                break
        if pos:
            del buf[:pos]
        return frames

    def _account(self, completed: bool) -> bool:
        held = len(self._buf)
        delta = held - self._partial
        if delta:
            front, cfg = self.front, self.core.config
            if delta > 0 and front.partial_frame_bytes + delta > cfg.partial_frame_budget:
                self._close_with(f"the broker holds too many bytes of frames still being received (--partial-frame-budget "
                                 f"{cfg.partial_frame_budget}); retry later", "remoting_partial_frame_refusals", code=p.SYSTEM_BUSY)
                return False
            front.partial_frame_bytes += delta
            self._partial = held
        if not held:
            self._frame_started = 0.0
        elif completed or not self._frame_started:
            self._frame_started = self._loop.time()
        return True

    def _release_partial(self) -> None:
        if self._partial:
            self.front.partial_frame_bytes -= self._partial
            self._partial = 0
        self._frame_started = 0.0
        self._buf = bytearray()

    def sweep(self, now: float) -> None:
        if self._closing:
            return
        cfg = self.core.config
        if self._first_by and now >= self._first_by:
            what = "correctly signed request" if cfg.auth_token else "request"
            self._close_with(f"no {what} within {cfg.auth_timeout_s:g}s of connecting (--auth-timeout)", "remoting_auth_timeouts")
        elif (self._frame_started and cfg.frame_timeout_s and not self._read_paused
              and now - self._frame_started >= cfg.frame_timeout_s):
            self._close_with(f"frame not complete {cfg.frame_timeout_s:g}s after its first byte (--frame-timeout)", "remoting_frame_timeouts")

    # ---- dispatch ---------------------------------------------------------------------------
    def _run(self, frames: list[bytes]) -> None:
        for i, frame in enumerate(frames):
            if self._read_paused:
                self._backlog.extend(frames[i:])
                return
            try:
                cmd = p.decode(frame)
            except p.FrameError as exc:
                self._close_with(f"malformed frame: {exc}", "remoting_malformed_frames")
                return
            if cmd.is_response:
                continue  # a client's answer to a broker request (all of txmq's are oneway): nothing waits for it
            self._dispatch(cmd)
            if self._closing:
                return

    def _dispatch(self, cmd: p.Command) -> None:
        core = self.core
        core.metrics.inc("remoting_requests")
        self.json_requests = cmd.serialize == p.JSON_TYPE
        token = core.config.auth_token
        if token:
            if not signed(cmd, token):
                core.metrics.inc("remoting_auth_failures")
                log.warning("event=remoting_auth_failed peer=%s code=%d", self.peer, cmd.code)
                self._close_with("the request is not signed with the broker's --auth-token (RocketMQ ACL: any AccessKey, "
                                 "the token as SecretKey)", None, cmd, code=p.NO_PERMISSION)
                return
            if not self.authed:
                self.authed = True
                self.max_frame = core.config.max_frame
        self._first_by = 0.0
        if not self.front.ready.is_set():  # the broker is not serving yet (its store opens): the request waits
            fut = asyncio.ensure_future(self._after_ready(cmd))
            self._track(cmd, fut)
            return
        if self.front.stopping or core.draining:
            self._respond(cmd, p.response(cmd, p.SYSTEM_BUSY, remark="the broker is shutting down"))
            return
        handler = HANDLERS.get(cmd.code)
        if handler is None:
            core.metrics.inc("remoting_unsupported_requests")
            self._respond(cmd, p.response(cmd, p.REQUEST_CODE_NOT_SUPPORTED,
                                          remark=f"request code {cmd.code} is not supported by txmq's remoting front end (docs/remoting.md)"))
            return
        try:
            result = handler(self.front, self, cmd)
        except Exception as exc:
            self._respond(cmd, error_response(self.core, cmd, exc))
            return
        if result is None or type(result) is p.Command:
            self._respond(cmd, result)
            return
        if type(result) is Then:
            self._track(cmd, result.fut, result.fn)
            return
        self._track(cmd, asyncio.ensure_future(result))

    async def _after_ready(self, cmd: p.Command) -> p.Command | None:
        await self.front.ready.wait()
        if self.front.stopping or self.core.draining:
            return p.response(cmd, p.SYSTEM_BUSY, remark="the broker is shutting down")
        handler = HANDLERS.get(cmd.code)
        if handler is None:
            return p.response(cmd, p.REQUEST_CODE_NOT_SUPPORTED,
                              remark=f"request code {cmd.code} is not supported by txmq's remoting front end (docs/remoting.md)")
        result = handler(self.front, self, cmd)
        if result is None or isinstance(result, p.Command):
            return result
        if type(result) is Then:
            return result.fn(await result.fut)
        return await result

    def _track(self, cmd: p.Command, fut: asyncio.Future, then: Any = None) -> None:
        self.inflight += 1
        if self.inflight == 1:
            self.front.busy += 1
        if self.inflight >= self.core.config.max_inflight_per_conn:
            self._pause_reading()
        self.front.inflight.add(fut)
        cost = 0
        if cmd.code == p.PULL_MESSAGE:
            cost = pull_cost(cmd)
            self.pull_bytes += cost
            if self.pull_bytes > PULL_BUDGET:
                self._pause_reading()
        fut.add_done_callback(partial(self._done, cmd, cost, then))

    def _done(self, cmd: p.Command, cost: int, then: Any, fut: asyncio.Future) -> None:
        self.front.inflight.discard(fut)
        self.inflight -= 1
        if self.inflight == 0:
            self.front.busy -= 1
        self.pull_bytes -= cost
        if fut.cancelled():
            self._respond(cmd, p.response(cmd, p.SYSTEM_BUSY, remark="the broker is shutting down"))
        elif fut.exception() is not None:
            self._respond(cmd, error_response(self.core, cmd, fut.exception()))
        else:
            result = fut.result()
            if then is not None:
                try:
                    result = then(result)
                except Exception as exc:
                    result = error_response(self.core, cmd, exc)
            self._respond(cmd, result, now=not self.inflight)
        if self._read_paused:
            self._maybe_resume_reading()

    # ---- output ----------------------------------------------------------------------------
    def _respond(self, cmd: p.Command, resp: p.Command | None, now: bool = False) -> None:
        if resp is None:
            return
        if cmd.oneway:  # nothing is sent back for a oneway request; a failure is counted and logged
            if resp.code != p.SUCCESS:
                self.core.metrics.inc("remoting_oneway_failures")
                self.front.note_oneway_failure(self.peer, cmd, resp)
            return
        try:
            data = p.encode(resp)
        except Exception as exc:  # a value no frame can carry (a bug): an error response, the connection goes on
            data = p.encode(error_response(self.core, cmd, exc))
        self._send(data, now)

    def _send(self, data: bytes, now: bool = False) -> None:
        if self._closing or self.transport is None or self.transport.is_closing():
            return
        self._out.append(data)
        self._out_bytes += len(data)
        if now or self._out_bytes > WRITE_HIGH:
            self._write_out()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        self._write_out()

    def _write_out(self) -> None:
        self._out_bytes = 0
        if self._out and self.transport is not None and not self.transport.is_closing():
            out, self._out = self._out, []
            self.transport.write(b"".join(out) if len(out) > 1 else out[0])
            arm = self.core.busy_poll.arm
            if arm is not None and self.front.busy <= 1:
                arm()
        else:
            self._out.clear()

    def _close_with(self, reason: str, counter: str | None, cmd: p.Command | None = None, code: int = p.SYSTEM_ERROR) -> None:
        """One response saying why (to cmd, or unsolicited), then close this connection; the others go on."""
        metrics = self.core.metrics
        if counter is not None:
            metrics.inc(counter)
        log.info("event=remoting_connection_closed peer=%s reason=%s msg=%r", self.peer, counter or "refused", reason[:200])
        if cmd is not None:
            resp = p.response(cmd, code, remark=reason)
        else:
            resp = p.Command(code=code, flag=p.RESPONSE_FLAG, remark=reason)
        self._send(p.encode(resp))
        self._flush()
        self._closing = True
        self._release_partial()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        try:
            linger = transport.can_write_eof()
        except NotImplementedError:
            linger = False
        if not linger:
            transport.close()
            return
        transport.write_eof()
        if self._read_paused:
            self._read_paused = False
            transport.resume_reading()
        self._loop.call_later(LINGER_S, transport.close)

    def _pause_reading(self) -> None:
        if not self._read_paused and self.transport is not None and not self.transport.is_closing():
            self._read_paused = True
            self.transport.pause_reading()

    def _maybe_resume_reading(self) -> None:
        if self._frame_started and self._read_paused:
            self._frame_started = self._loop.time()
        if (self._read_paused and not self._write_paused and self.inflight < self.core.config.max_inflight_per_conn // 2
                and self.pull_bytes <= PULL_BUDGET // 2 and self.transport is not None and not self.transport.is_closing()):
            self._read_paused = False
            if self._backlog:
                backlog, self._backlog = self._backlog, []
                self._run(backlog)
                if self._read_paused or self._closing:
                    return
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None:
            self._flush()
            self.transport.close()

    # ---- PushTarget: check-backs --------------------------------------------------------------
    def writable(self) -> bool:
        return self.transport is not None and not self._closing and not self.transport.is_closing() and not self._write_paused

    def push(self, op: str, fields: dict) -> None:
        if op == "check_transaction":
            self.front.clients.check_back(self, fields)

    def send_frame(self, frame: bytes) -> None:
        """The check service's msgpack push frames (check_transaction), each turned into a CHECK_TRANSACTION_STATE request."""
        try:
            for payload in FrameDecoder(max(len(frame), 1)).feed(frame):
                f = parse_payload(payload)
                if f.kind == PUSH:
                    self.push(str(f.op), f.fields)
        except (TxmqError, KeyError, TypeError, ValueError) as exc:
            log.error("event=remoting_push_unreadable peer=%s error=%r", self.peer, exc)

    def request(self, cmd: p.Command) -> None:
        """Send a request of the broker's own (oneway) to this client."""
        if not self.json_requests:
            cmd.serialize = p.ROCKETMQ_TYPE
        self._send(p.encode(cmd))


def pull_cost(cmd: p.Command) -> int:
    try:
        mb = int(cmd.ext.get("maxMsgBytes") or 0)
    except ValueError:
        mb = 0
    return min(mb, 64 << 20) if mb > 0 else 4 << 20


def signed(cmd: p.Command, token: str) -> bool:
    """Whether the request carries RocketMQ 4's ACL signature made with ``token`` as the SecretKey.

    The clients (AclClientRPCHook, the C++ ClientRPCHook) sign the values
    of the request's extFields sorted by name (``Signature`` excluded),
    then the body: ``Signature`` = base64(HMAC-SHA1(secret, that)); any
    AccessKey is taken.
    """
    given = cmd.ext.get("Signature")
    if not given:
        return False
    content = "".join(v for k, v in sorted(cmd.ext.items()) if k != "Signature" and k != "_UNIQUE_KEY_QUERY").encode() + cmd.body
    want = base64.b64encode(hmac.new(token.encode(), content, sha1).digest()).decode()
    return hmac.compare_digest(given.encode(), want.encode())


async def attach(broker: Any, config: BrokerConfig) -> RemotingFrontend:
    """Bind the front end for ``config.remoting_port`` and hand it to the broker, which starts and stops it.

    ``broker`` is a ``txmq.broker.server.Broker`` not yet serving; the front
    end takes ``broker.config``, where the connection caps are derived.
    Raises BindError when the port cannot be bound.
    """
    frontend = RemotingFrontend(broker.core, broker.config)
    await frontend.bind()
    broker.frontends.append(frontend)
    return frontend


__all__ = ["RemotingFrontend", "RemotingConnection", "BindError", "attach", "signed", "ErrorCode"]
