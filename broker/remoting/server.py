"""The remoting front end's listener and connections: RocketMQ 4's TCP protocol on --remoting-port.

``RemotingFrontend(messaging, operations, config)`` has the shape of
every front end (server.Frontend): ``bind()`` before the store opens (a
port in use ends the start at once; requests that arrive before the
broker serves wait), ``start()`` once the broker serves, ``stop()`` first
at shutdown (no new connections; requests in flight finish), ``close()``
last. It reaches the broker only through the messaging service and the
operator's calls (``txmq.broker.messaging``); the broker's start-up
builds it on the broker's (broker/frontends.py).

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
connection, and only it; a JSON body that cannot be read (nested too
deeply, too large: protocol.load_json_object) is answered
INVALID_PARAMETER and the connection goes on. Every refusal is counted and
logged, at most one line per kind every 10 s (broker/refusals.py). Backpressure: a client that does not read its
responses, or has too many requests or pulled bytes in flight, is not read
from until it drains. The limits, the batching and the backpressure are
LimitedConnection's (broker/connlimits.py), shared with the native port.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import itertools
import logging
import socket
import struct
from functools import partial
from hashlib import sha1
from typing import TYPE_CHECKING, Any

from ..connlimits import LimitCounters, LimitedConnection, LogThrottle
from ..ports import hold_port, listen
from txmq.wire import ErrorCode

from ..messaging import CheckBack

from . import protocol as p
from .admin import not_supported_remark
from .clients import ClientTable
from .handlers import HANDLERS, Then, error_response, served_codes
from .messages import MessageFormatError, address_bytes

if TYPE_CHECKING:
    from ..config import BrokerConfig
    from ..messaging import Messaging, Operations

log = logging.getLogger("txmq.remoting")

_ids = itertools.count(1 << 41)  # conn_ids of their own range: they share the registries with the other front ends
REFUSAL_LOG_EVERY_S = 10.0
_LEN = struct.Struct(">i")
_COUNTERS = LimitCounters(accepted="remoting_connections_accepted", refused="remoting_connections_refused",
                          refused_per_ip="remoting_connections_refused_per_ip", partial_frame_refusals="remoting_partial_frame_refusals",
                          auth_timeouts="remoting_auth_timeouts", frame_timeouts="remoting_frame_timeouts")


class BindError(Exception):
    """The remoting port cannot be bound."""


class RemotingFrontend:
    """The remoting port: its listeners, connections and client table, on the broker's messaging service and operations.

    Built and bound by the broker's start-up (broker/frontends.py) before
    the store opens; requests that come before ``start()`` wait for it.
    """

    def __init__(self, messaging: Messaging, operations: Operations, config: BrokerConfig, relayed: bool = False) -> None:
        if config.remoting_max_connections is None:  # the Broker derives it (server.connection_limits)
            raise ValueError("build the remoting front end on Broker.config")
        # relayed: front-end worker processes (broker/workers/) accept the connections and relay their bytes; this
        # process keeps the ports reserved and runs a RemotingConnection per connection on the worker's transport.
        self.relayed = relayed
        self.reservations: list[socket.socket] = []
        self.messaging = messaging
        self.operations = operations
        self.config = config
        self.max_connections: int = config.remoting_max_connections
        self.sock: socket.socket | None = None
        self.server: asyncio.AbstractServer | None = None
        self.vip_server: asyncio.AbstractServer | None = None
        self.port = 0
        self.vip_port: int | None = None
        self.connections: set[RemotingConnection] = set()
        self.by_ip: dict[str, int] = {}
        self.inflight: set[asyncio.Future] = set()
        self.working = 0  # requests in flight that wait on the broker, not pulls (connlimits.py): a lone client's test
        self.partial_frame_bytes = 0
        self.clients = ClientTable(self)
        self.ready = asyncio.Event()
        self.stopping = False
        self.broker_name = "txmq"
        self.cluster_name = "txmq"
        self._sweeper: asyncio.Task | None = None
        self._opaque = itertools.count(1)
        self._oneway_failures = LogThrottle(REFUSAL_LOG_EVERY_S)  # failed oneway requests

    # ---- lifecycle --------------------------------------------------------------------------
    async def bind(self) -> int:
        cfg = self.config
        sock = _listen(cfg.host, cfg.remoting_port or 0, "--remoting-port")
        self.sock = sock
        self.port = sock.getsockname()[1]
        vip = None
        if cfg.remoting_vip_channel:  # the same service on port - 2 (docs/remoting.md, "The VIP channel")
            try:
                vip = _listen(cfg.host, self.port - 2, "--remoting-vip-channel, --remoting-port - 2")
            except BindError:
                sock.close()
                raise
            self.vip_port = self.port - 2
        if self.relayed:  # the ports were free: from now on held for the workers, which listen beside these
            socks = [s for s in (sock, vip) if s is not None]
            try:
                for s in socks:
                    self.reservations.append(_reserve(cfg.host, s))
            except BindError:
                for r in self.reservations:
                    r.close()
                self.reservations = []
                raise
            finally:
                for s in socks:
                    s.close()
            self.sock = None
        self.messaging.listening("remoting", cfg.host, self.port, **({"vip_port": self.vip_port} if vip is not None else {}))
        if self.relayed:
            return self.port
        loop = asyncio.get_running_loop()
        # Listening from now on: connections are accepted, their requests wait until the broker serves.
        self.server = await loop.create_server(lambda: RemotingConnection(self), sock=sock, backlog=2048)
        if vip is not None:
            self.vip_server = await loop.create_server(lambda: RemotingConnection(self), sock=vip, backlog=2048)
        return self.port

    def listeners(self) -> list[tuple[str, int]]:
        """The ports a relayed front end's workers serve, named: the remoting port, and its VIP channel if any."""
        return [("remoting", self.port)] + ([("remoting-vip", self.vip_port)] if self.vip_port is not None else [])

    def connection(self) -> RemotingConnection:
        """The protocol object of one more connection (a worker's, relayed)."""
        return RemotingConnection(self)

    def in_flight(self) -> int:
        """Requests in flight that wait on the broker (the broker's test for a lone client: Broker._lone_client)."""
        return self.working

    def gauges(self) -> dict[str, int]:
        """The remoting port's share of `txmq broker status`, `txmq stats` and Prometheus (BrokerCore.connection_stats)."""
        return {"remoting_connections": len(self.connections), "remoting_partial_frame_bytes": self.partial_frame_bytes}

    async def start(self) -> None:
        self.ready.set()
        cfg = self.config
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="txmq-remoting-sweeper")
        log.info("event=remoting_listening host=%s port=%d vip_port=%s max_connections=%d codes=%d", cfg.host, self.port,
                 self.vip_port if self.vip_port is not None else "-", self.max_connections, len(served_codes()))

    async def stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.ready.set()
        for server in (self.server, self.vip_server):
            if server is not None:
                server.close()
        if self.inflight:
            await asyncio.wait(list(self.inflight), timeout=self.config.shutdown_timeout_s)
        if self._sweeper is not None:
            self._sweeper.cancel()

    async def close(self) -> None:
        for conn in list(self.connections):
            conn.close()
        for r in self.reservations:
            r.close()
        self.reservations = []
        for server in (self.server, self.vip_server):
            if server is not None:
                try:
                    await asyncio.wait_for(server.wait_closed(), 2.0)
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
    def note_oneway_failure(self, peer: str, cmd: p.Command, resp: p.Command) -> None:
        """Log a failed oneway request (a lost END_TRANSACTION, say): at most one line per REFUSAL_LOG_EVERY_S, with the count."""
        failures = self._oneway_failures.note()
        if failures:
            log.warning("event=remoting_oneway_failed peer=%s code=%d response=%d failures=%d remark=%r", peer, cmd.code, resp.code,
                        failures, resp.remark[:200])

    def next_opaque(self) -> int:
        return next(self._opaque) & 0x7FFFFFFF


class RemotingConnection(LimitedConnection):
    """One client connection: a PushTarget (broker/registry.py) for check-backs when it registered a producer group."""

    counters = _COUNTERS
    frontend = "remoting"
    first_request = "correctly signed request"

    def __init__(self, front: RemotingFrontend) -> None:
        super().__init__(front.messaging, front)
        self.front = front
        self.messaging = front.messaging  # the object LimitedConnection holds as ``core``
        self.conn_id = next(_ids)
        cfg = self.messaging.config
        self.authed = not cfg.auth_token
        self.max_frame = cfg.max_frame if self.authed else min(cfg.max_preauth_frame, cfg.max_frame)
        self.local_host = cfg.host
        self.store_addr = b"\x7f\x00\x00\x01"
        self._buf = bytearray()
        self._pulls: set[asyncio.Future] = set()  # its pulls in flight (suspended ones too): cancelled when it closes
        self.client_ids: set[str] = set()  # the client ids that sent heartbeats over this connection
        self.json_requests = True  # the serialize type of the requests it sends: the broker's requests follow it
        self.client_language, self.client_version = "OTHER", 0  # of its last HEART_BEAT (LanguageCode, MQVersion)

    # ---- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._open(transport)
        local = transport.get_extra_info("sockname")
        if isinstance(local, tuple):
            self.local_host = str(local[0])
            self.store_addr = address_bytes(self.local_host)
        if self.front.stopping:
            transport.close()
            return
        self._admit(self.front.max_connections, "--remoting-max-connections")

    def _refusal(self, message: str) -> bytes:
        # a response no request asked for: clients log it; the connection is closed at once
        return p.encode(p.Command(code=p.SYSTEM_BUSY, flag=p.RESPONSE_FLAG, remark=message))

    def _forget(self) -> None:
        self.front.clients.connection_closed(self)
        # A suspended pull waits up to 30 s for a message no one will read: it ends now, and its waiter with it.
        for fut in list(self._pulls):
            fut.cancel()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        arm = self.messaging.busy_poll_arm
        if arm is not None and self.front.working <= 1:
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
                self._close_with(f"frame of {length} bytes: a frame holds 4 to {self.max_frame} bytes ({what})", "remoting_malformed_frames",
                                 kind="bad_request")
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
        return self._hold(len(self._buf), completed)

    def _drop_buffered(self) -> None:
        self._buf = bytearray()

    def _close_for(self, counter: str, kind: str, message: str) -> None:
        if kind == "busy":
            self._close_with(message, counter, kind="busy", code=p.SYSTEM_BUSY)
        else:
            self._close_with(message, counter, kind="timeout")

    # ---- dispatch ---------------------------------------------------------------------------
    def _run(self, frames: list[bytes]) -> None:
        for i, frame in enumerate(frames):
            if self._read_paused:
                self._backlog.extend(frames[i:])
                return
            try:
                cmd = p.decode(frame)
            except p.FrameError as exc:
                self._close_with(f"malformed frame: {exc}", "remoting_malformed_frames", kind="bad_request")
                return
            if cmd.is_response:
                continue  # a client's answer to a broker request (all of txmq's are oneway): nothing waits for it
            self._dispatch(cmd)
            if self._closing:
                return

    def _dispatch(self, cmd: p.Command) -> None:
        messaging = self.messaging
        messaging.metrics.inc("remoting_requests")
        self.json_requests = cmd.serialize == p.JSON_TYPE
        token = messaging.config.auth_token
        if token:
            if not signed(cmd, token):
                messaging.metrics.inc("remoting_auth_failures")
                self._close_with("the request is not signed with the broker's --auth-token (RocketMQ ACL: any AccessKey, "
                                 "the token as SecretKey)", None, cmd, kind="auth", code=p.NO_PERMISSION)
                return
            if not self.authed:
                self.authed = True
                self.max_frame = messaging.config.max_frame
        self._first_by = 0.0
        if not self.front.ready.is_set():  # the broker is not serving yet (its store opens): the request waits
            fut = asyncio.ensure_future(self._after_ready(cmd))
            self._track_request(cmd, fut)
            return
        if self.front.stopping or messaging.draining:
            self._respond(cmd, p.response(cmd, p.SYSTEM_BUSY, remark="the broker is shutting down"))
            return
        handler = HANDLERS.get(cmd.code)
        if handler is None:
            messaging.metrics.inc("remoting_unsupported_requests")
            self._respond(cmd, p.response(cmd, p.REQUEST_CODE_NOT_SUPPORTED,
                                          remark=not_supported_remark(cmd.code)))
            return
        try:
            result = handler(self.front, self, cmd)
        except Exception as exc:
            self._respond(cmd, self._error(cmd, exc))
            return
        if result is None or type(result) is p.Command:
            self._respond(cmd, result)
            return
        if type(result) is Then:
            self._track_request(cmd, result.fut, result.fn)
            return
        self._track_request(cmd, asyncio.ensure_future(result))

    async def _after_ready(self, cmd: p.Command) -> p.Command | None:
        await self.front.ready.wait()
        if self.front.stopping or self.messaging.draining:
            return p.response(cmd, p.SYSTEM_BUSY, remark="the broker is shutting down")
        handler = HANDLERS.get(cmd.code)
        if handler is None:
            return p.response(cmd, p.REQUEST_CODE_NOT_SUPPORTED,
                              remark=not_supported_remark(cmd.code))
        result = handler(self.front, self, cmd)
        if result is None or isinstance(result, p.Command):
            return result
        if type(result) is Then:
            return result.fn(await result.fut)
        return await result

    def _track_request(self, cmd: p.Command, fut: asyncio.Future, then: Any = None) -> None:
        cost = 0
        if cmd.code == p.PULL_MESSAGE:
            self._pulls.add(fut)
            cost = pull_cost(cmd)
        self._track(fut, cost)
        fut.add_done_callback(partial(self._done, cmd, cost, then))

    def _done(self, cmd: p.Command, cost: int, then: Any, fut: asyncio.Future) -> None:
        self._pulls.discard(fut)
        self._untrack(fut, cost)
        if fut.cancelled():
            self._respond(cmd, p.response(cmd, p.SYSTEM_BUSY, remark="the broker is shutting down"))
        elif fut.exception() is not None:
            self._respond(cmd, self._error(cmd, fut.exception()))
        else:
            result = fut.result()
            if then is not None:
                try:
                    result = then(result)
                except Exception as exc:
                    result = self._error(cmd, exc)
            self._respond(cmd, result, now=not self.inflight)
        if self._read_paused:
            self._maybe_resume_reading()

    def _error(self, cmd: p.Command, exc: BaseException) -> p.Command:
        """The response to a request that failed; a body that cannot be read is a refusal (counted, logged throttled)."""
        if isinstance(exc, (p.BodyError, MessageFormatError)):
            self.messaging.refusals.note("remoting", "bad_request", self.peer, f"request code {cmd.code}: {exc}")
        return error_response(self.messaging, cmd, exc)

    # ---- output ----------------------------------------------------------------------------
    def _respond(self, cmd: p.Command, resp: p.Command | None, now: bool = False) -> None:
        if resp is None:
            return
        if cmd.oneway:  # nothing is sent back for a oneway request; a failure is counted and logged
            if resp.code != p.SUCCESS:
                self.messaging.metrics.inc("remoting_oneway_failures")
                self.front.note_oneway_failure(self.peer, cmd, resp)
            return
        try:
            data = p.encode(resp)
        except Exception as exc:  # a value no frame can carry (a bug): an error response, the connection goes on
            data = p.encode(error_response(self.messaging, cmd, exc))
        self._send(data, now)

    def _close_with(self, reason: str, counter: str | None, cmd: p.Command | None = None, kind: str = "bad_request",
                    code: int = p.SYSTEM_ERROR) -> None:
        """One response saying why (to cmd, or unsolicited), then close this connection; the others go on.

        The refusal is counted (``counter``, and refused_remoting_<kind>) and logged throttled (broker/refusals.py).
        """
        if counter is not None:
            self.messaging.metrics.inc(counter)
        self.messaging.refusals.note("remoting", kind, self.peer, reason)
        if cmd is not None:
            resp = p.response(cmd, code, remark=reason)
        else:
            resp = p.Command(code=code, flag=p.RESPONSE_FLAG, remark=reason)
        self._send(p.encode(resp))
        self._end_after_reply()

    # ---- PushTarget: check-backs --------------------------------------------------------------
    takes_frames = False  # check-backs come as CheckBack records

    def check_back(self, cb: CheckBack) -> None:
        self.front.clients.check_back(self, cb)

    def send_frame(self, frame: bytes) -> None:  # pragma: no cover - takes_frames is False: never called
        raise TypeError("a remoting connection takes check-backs as records")

    def request(self, cmd: p.Command) -> None:
        """Send a request of the broker's own (oneway) to this client."""
        if not self.json_requests:
            cmd.serialize = p.ROCKETMQ_TYPE
        self._send(p.encode(cmd))


def _listen(host: str, port: int, what: str) -> socket.socket:
    try:
        return listen(host, port)
    except (OSError, OverflowError) as exc:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise BindError(f"cannot listen on {address} ({what}): {getattr(exc, 'strerror', None) or exc}") from None


def _reserve(host: str, listening: socket.socket) -> socket.socket:
    """A socket bound (not listening) with SO_REUSEPORT to the port ``listening`` holds, which it then lets go.

    The workers listen on the port beside it (SO_REUSEPORT); it takes no
    connection, and keeps the port the broker's while a worker is started
    again. A process that binds without SO_REUSEPORT (another broker) is
    refused the port, as it would be by a listener.
    """
    addr = listening.getsockname()
    listening.close()  # the port was free a moment ago; this takes it back at once
    return hold_port(listening.family, addr if listening.family != socket.AF_INET else addr[:2],
                     lambda why: BindError(f"cannot hold {host}:{addr[1]} for the front-end workers: {why}"))


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


__all__ = ["RemotingFrontend", "RemotingConnection", "BindError", "signed", "ErrorCode"]
