"""The gRPC server of the RocketMQ front end: grpc.aio on the broker's own event loop (uvloop).

``RocketMQServer(messaging, config)`` is built by the broker's start-up
(broker/frontends.py) when ``--rocketmq-port`` is given: ``bind()`` before the store opens (a port in
use ends the start at once; from then on it listens, and requests wait),
``start()`` once the broker serves (requests go through), ``stop()`` first
thing at shutdown (``close()`` has nothing left to do). Nothing else of the
broker imports this package.

Requests arrive as bytes and are parsed here, so a malformed request is an
answer with RocketMQ's BAD_REQUEST in the response's ``status``, not a
transport error; any error while serving becomes the response's status
(status.py). Limits: the largest gRPC message is --max-body +
--max-properties + 4 KiB (``grpc.max_receive_message_length``); RPCs at
once are bounded (``MAX_CONCURRENT_RPCS``), and long polls and Telemetry
streams per client, per connection and in all, below it (limits.py): past
a bound a call is answered at once with TOO_MANY_REQUESTS; streams per
connection are bounded (``MAX_STREAMS_PER_CONNECTION``) and calls not yet
taken up wait in gRPC core up to the RPC bound (server_options); a Telemetry
stream's outbound queue is bounded (clients.py). Keepalive pings find dead
clients, whose Telemetry streams then leave the producer registry.

Every refused request (a bad signature, a malformed request, a bound) is
counted and logged, throttled, with its peer and reason
(``messaging.refusals``, broker/refusals.py: ``refused_rocketmq_<kind>``,
``event=refused frontend=rocketmq``).

Connections, before any authentication, are held by gRPC core itself:
at most --rocketmq-max-connections open (``grpc.max_allowed_incoming_connections``:
past it gRPC accepts and closes at once, so the descriptors the rest of
the broker needs stay free; server.connection_limits), the TLS handshake
and HTTP/2's preface and SETTINGS within --auth-timeout
(``grpc.server_handshake_timeout_ms``), and a connection with no RPC open
for IDLE_TIMEOUT_S gets a GOAWAY (``grpc.max_connection_idle_ms``; SDK
clients keep a Telemetry stream open and reconnect when they need to).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import time
from hashlib import sha1
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import grpc
from grpc import aio

from ..messaging import StoreError
from ..ports import hold_port
from txmq.wire import TxmqError

from .clients import TelemetryStream, write_command
from .limits import peer_of
from .pb import definition_pb2 as d
from .pb import service_pb2 as s
from .service import MessagingService, client_id_of, metadata
from .settings import FrontendSettings
from .status import Code, RmqError, of_error, status

if TYPE_CHECKING:
    from ..config import BrokerConfig
    from ..messaging import Messaging

log = logging.getLogger("txmq.rocketmq")

SERVICE = "apache.rocketmq.v2.MessagingService"
# RPCs open at once (Telemetry streams and long polls included): past it a request is answered at once with
# TOO_MANY_REQUESTS ("flow limit", as RocketMQ's proxy answers when its thread pools' queues are full), logged and
# counted. Long polls and Telemetry streams have bounds of their own, per client and per connection, well below it
# (limits.py), so that one client cannot fill it. gRPC's own bound (GRPC_MARGIN above it) is the last resort.
MAX_CONCURRENT_RPCS = 16384
GRPC_MARGIN = 1024
# Streams one connection may have open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS): a client's further calls
# wait on its own side, not in the broker. Room for a connection's long polls and Telemetry streams (limits.py) and more.
MAX_STREAMS_PER_CONNECTION = 4096
REFUSAL_READ_S = 1.0  # a refused Telemetry stream is answered after the client's first command, or this long
# A connection with no RPC open this long is closed (a GOAWAY): one that finished the handshake and never
# sends a request does not hold its descriptor and its place under the cap for good. SDK clients never
# get there (a Telemetry stream stays open, a heartbeat every 10 s); a client that does reconnects.
IDLE_TIMEOUT_S = 60.0
SHUTDOWN_GRACE_S = 2.0


class BindError(Exception):
    """The front end's port cannot be bound, or its TLS files cannot be read."""


class RocketMQServer:
    """RocketMQ 5's gRPC service on the broker's messaging service.

    ``relayed``: the port is served by front-end worker processes
    (broker/workers/, ``--frontend-processes``) that relay each RPC here;
    this process reserves the port (``reserve_port``) and answers the
    relayed calls with ``handler_table()``, the same handlers gRPC runs in a
    single process.
    """

    def __init__(self, messaging: Messaging, config: BrokerConfig, relayed: bool = False) -> None:
        self.messaging = messaging
        self.config = config
        self.relayed = relayed
        self.reservation: socket.socket | None = None  # relayed: holds the port the workers share
        self.settings = FrontendSettings.of(config, config.rocketmq_port or 0)
        self.service: MessagingService | None = None
        self.server: aio.Server | None = None
        self.port = 0
        self.tls = config.rocketmq_tls_cert is not None
        if config.rocketmq_max_connections is None:  # the Broker derives it (server.connection_limits)
            raise ValueError("build the RocketMQ front end on Broker.config")
        self.max_connections: int = config.rocketmq_max_connections
        self.ready = asyncio.Event()  # set once the broker serves: requests that come earlier wait for it
        self.stopping = False
        self.open_rpcs = 0  # RPCs being served (at most MAX_CONCURRENT_RPCS)
        self.open_unary = 0  # of them, unary ones

    def in_flight(self) -> int:
        """Unary RPCs being served (Telemetry streams and long polls wait on clients, not on the broker): the
        broker's test for a lone client (Broker._lone_client)."""
        return self.open_unary

    def gauges(self) -> dict[str, int]:
        """Nothing of its own: gRPC core holds the connections (its figures are the rmq_* counters)."""
        return {}

    async def bind(self) -> int:
        """Create the server and bind its port (0 picks a free one); returns the port."""
        cfg = self.config
        options = server_options(self.settings.max_receive_message, self.max_connections, cfg.auth_timeout_s)
        host = cfg.host
        address = f"[{host}]:{cfg.rocketmq_port}" if ":" in host else f"{host}:{cfg.rocketmq_port}"
        check_port_free(host, cfg.rocketmq_port or 0, address)
        if self.relayed:  # the workers read the TLS files; unreadable ones end the start here, as in one process
            if self.tls:
                _read(cfg.rocketmq_tls_key, "--rocketmq-tls-key"), _read(cfg.rocketmq_tls_cert, "--rocketmq-tls-cert")
            self.reservation, port = reserve_port(host, cfg.rocketmq_port or 0, address)
            self._serving(port)
            return port
        self.server = aio.server(options=options, maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS + GRPC_MARGIN)
        try:
            if self.tls:
                creds = grpc.ssl_server_credentials([(_read(cfg.rocketmq_tls_key, "--rocketmq-tls-key"),
                                                      _read(cfg.rocketmq_tls_cert, "--rocketmq-tls-cert"))])
                port = self.server.add_secure_port(address, creds)
            else:
                port = self.server.add_insecure_port(address)
        except BindError:
            raise
        except Exception as exc:  # grpc raises RuntimeError("Failed to bind ...; set GRPC_VERBOSITY=debug ...")
            # Taken since check_port_free (a race): gRPC's own reason is in its log line, not in the exception.
            why = str(exc).split(";", 1)[0] if "GRPC_VERBOSITY" in str(exc) else str(exc)
            raise BindError(f"cannot listen on {address} (--rocketmq-port): {why}") from None
        if not port:
            raise BindError(f"cannot listen on {address} (--rocketmq-port)")
        self._serving(port)
        self.server.add_generic_rpc_handlers((self._handlers(),))
        # Listening from now on, as the native port does once bound: requests wait until the broker serves (start()).
        await self.server.start()
        return port

    def _serving(self, port: int) -> None:
        self.port = port
        self.messaging.listening("rocketmq", self.config.host, port, tls=self.tls)
        self.settings.port = port
        self.service = MessagingService(self.messaging, self.settings)

    async def start(self) -> None:
        """The broker serves: let the requests through."""
        assert self.service is not None, "bind() first"
        self.ready.set()
        cfg = self.config
        polls = self.settings.long_polls
        log.info("event=rocketmq_listening host=%s port=%d tls=%s max_message=%d max_connections=%d handshake_timeout_s=%g idle_timeout_s=%g "
                 "max_rpcs=%d long_polls_per_client=%d long_polls_per_connection=%d long_polls=%d",
                 cfg.host, self.port, "on" if self.tls else "off", self.settings.max_receive_message, self.max_connections,
                 cfg.auth_timeout_s or 120, IDLE_TIMEOUT_S, MAX_CONCURRENT_RPCS, polls.per_client, polls.per_connection, polls.total)

    async def stop(self) -> None:
        """Stop serving (at shutdown, or when the start failed after bind); once."""
        service, server = self.service, self.server
        self.service = self.server = None
        self.stopping = True
        self.ready.set()  # requests still waiting for the start get the shutdown answer
        if service is not None:
            await service.close()  # Telemetry streams end: their producers leave the registry
        if server is not None:
            await server.stop(SHUTDOWN_GRACE_S)

    async def close(self) -> None:
        """gRPC closed its connections in stop(); relayed, the workers have gone (they stop first): the port is let go."""
        if self.reservation is not None:
            self.reservation.close()
            self.reservation = None

    # ---- the handler table -------------------------------------------------------------
    def handler_table(self) -> dict[str, tuple[str, Callable, Callable[[Any], bytes]]]:
        """Each RPC's kind ("unary", "stream": server streaming, "bidi"), its handler (it takes the request's bytes, or
        for "bidi" an async iterator of them, and a servicer context) and its response serializer."""
        svc = self.service
        desc = s.DESCRIPTOR.services_by_name["MessagingService"]
        table: dict[str, tuple[str, Callable, Callable[[Any], bytes]]] = {}
        for m in desc.methods:
            req_cls = getattr(s, m.input_type.name)
            resp_cls = getattr(s, m.output_type.name)
            if m.name == "Telemetry":
                table[m.name] = ("bidi", self._telemetry, s.TelemetryCommand.SerializeToString)
            elif m.server_streaming:
                table[m.name] = ("stream", self._server_stream(m.name, getattr(svc, m.name), req_cls, resp_cls), resp_cls.SerializeToString)
            else:
                table[m.name] = ("unary", self._unary(m.name, getattr(svc, m.name), req_cls, resp_cls), resp_cls.SerializeToString)
        return table

    def grpc_options(self, reuseport: bool, max_connections: int | None = None) -> list[tuple[str, int]]:
        """The gRPC server's channel arguments; ``reuseport``: for a worker sharing the port (``grpc.so_reuseport``),
        ``max_connections``: its share of --rocketmq-max-connections."""
        options = server_options(self.settings.max_receive_message, max_connections or self.max_connections, self.config.auth_timeout_s)
        return [(k, int(reuseport)) if k == "grpc.so_reuseport" else (k, v) for k, v in options]

    def _handlers(self) -> grpc.GenericRpcHandler:
        make = {"bidi": grpc.stream_stream_rpc_method_handler, "stream": grpc.unary_stream_rpc_method_handler,
                "unary": grpc.unary_unary_rpc_method_handler}
        handlers = {name: make[kind](fn, request_deserializer=None, response_serializer=ser)
                    for name, (kind, fn, ser) in self.handler_table().items()}
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    async def _refusal(self, context: Any) -> RmqError | None:
        """Why this request is not served (shutting down, a bad signature with --auth-token), or None.

        Waits first until the broker serves (its store open), within the request's deadline.
        """
        if not self.ready.is_set():
            await self.ready.wait()
        if self.stopping or self.messaging.draining:
            return RmqError(Code.INTERNAL_ERROR, "the broker is shutting down")
        md = metadata(context)
        token = self.settings.auth_token
        if token and not signed(md, token):
            why = ("the request is not signed with the broker's --auth-token "
                   "(RocketMQ credentials: any access key, the token as secret key)")
            self.refused("auth", context, why)
            return RmqError(Code.UNAUTHORIZED, why)
        cid = md.get("x-mq-client-id")
        if cid:
            self.settings.clients.seen(cid[:256], md.get("x-mq-language", ""))
        return None

    def refused(self, kind: str, context: Any, reason: str) -> None:
        """A request turned away: counted (refused_rocketmq_<kind>) and logged, one line per kind at most every 10 s."""
        self.messaging.refusals.note("rocketmq", kind, peer_of(context), reason)

    def _admit(self, context: Any) -> str | None:
        """Count one more RPC open, or say why not (MAX_CONCURRENT_RPCS open: the refusal is logged and counted)."""
        if self.open_rpcs >= MAX_CONCURRENT_RPCS:
            why = f"flow limit: {self.open_rpcs} requests open on the broker, its limit; try again later"
            self.refused("busy", context, why)
            return why
        self.open_rpcs += 1
        return None

    def _malformed(self, context: Any, what: str) -> d.Status:
        self.messaging.metrics.inc("rmq_malformed_requests")
        why = f"malformed request: not a valid {what}"
        self.refused("bad_request", context, why)
        return status(Code.BAD_REQUEST, why)

    def _internal(self, name: str, exc: BaseException) -> None:
        """An error nothing expected: counted, its traceback logged the first time, then throttled lines (refusals.py)."""
        self.messaging.metrics.inc("rmq_internal_errors")
        self.messaging.refusals.internal(f"rocketmq.{name}", exc)

    def _unary(self, name: str, impl: Callable, req_cls: Any, resp_cls: Any) -> Callable:
        metrics = self.messaging.metrics

        async def call(raw: bytes, context: Any) -> Any:
            metrics.inc("rmq_requests")
            busy = self._admit(context)
            if busy is not None:
                return resp_cls(status=status(Code.TOO_MANY_REQUESTS, busy))
            self.open_unary += 1
            if self.open_unary == 1:  # a lone client's request: keep a CPU awake through its fsync, as the native port does
                arm = self.messaging.busy_poll_arm
                if arm is not None:
                    arm()
            try:
                try:
                    req = req_cls.FromString(raw)
                except Exception:
                    return resp_cls(status=self._malformed(context, req_cls.DESCRIPTOR.full_name))
                refusal = await self._refusal(context)
                if refusal is not None:
                    return resp_cls(status=of_error(refusal))
                try:
                    return await impl(req, context)
                except (RmqError, TxmqError) as exc:
                    return resp_cls(status=of_error(exc))
                except (OSError, StoreError) as exc:  # as on the native port: a full disk or no descriptor left is logged once
                    return resp_cls(status=of_error(self.messaging.error_of(exc)))
                except Exception as exc:
                    self._internal(name, exc)
                    return resp_cls(status=of_error(exc))
            finally:
                self.open_rpcs -= 1
                self.open_unary -= 1

        call.__name__ = name
        return call

    def _server_stream(self, name: str, impl: Callable, req_cls: Any, resp_cls: Any) -> Callable:
        metrics = self.messaging.metrics

        async def call(raw: bytes, context: Any) -> AsyncIterator[Any]:
            metrics.inc("rmq_requests")
            busy = self._admit(context)
            if busy is not None:
                yield resp_cls(status=status(Code.TOO_MANY_REQUESTS, busy))
                return
            try:
                try:
                    req = req_cls.FromString(raw)
                except Exception:
                    yield resp_cls(status=self._malformed(context, req_cls.DESCRIPTOR.full_name))
                    return
                refusal = await self._refusal(context)
                if refusal is not None:
                    yield resp_cls(status=of_error(refusal))
                    return
                try:
                    async for resp in impl(req, context):
                        yield resp
                except (RmqError, TxmqError) as exc:
                    yield resp_cls(status=of_error(exc))
                except (OSError, StoreError) as exc:
                    yield resp_cls(status=of_error(self.messaging.error_of(exc)))
                except Exception as exc:
                    self._internal(name, exc)
                    yield resp_cls(status=of_error(exc))
            finally:
                self.open_rpcs -= 1

        call.__name__ = name
        return call

    async def _telemetry(self, requests: AsyncIterator[bytes], context: Any) -> None:
        """One Telemetry stream: read the client's commands (its settings), write the answers and check-backs.

        The stream is a check-back target from its settings on until it
        ends: the client closes it, it goes away (keepalive), the broker
        stops, or it does not read what is written (clients.py).
        """
        self.messaging.metrics.inc("rmq_requests")
        busy = self._admit(context)
        if busy is not None:
            await self._refuse_stream(requests, context, status(Code.TOO_MANY_REQUESTS, busy))
            return
        try:
            refusal = await self._refusal(context)
            cid = client_id_of(context)
            if refusal is None and not cid:
                refusal = RmqError(Code.CLIENT_ID_REQUIRED, "the x-mq-client-id header is missing")
                self.refused("bad_request", context, refusal.message)
            if refusal is not None:
                await self._refuse_stream(requests, context, of_error(refusal))
                return
            # Bounded per client, per connection and in all (limits.py): the excess is told to try later, and ends.
            peer = peer_of(context)
            streams = self.settings.telemetry_streams
            busy = streams.take(cid, peer)
            if busy is not None:
                self.refused("busy", context, busy)
                await self._refuse_stream(requests, context, status(Code.TOO_MANY_REQUESTS, f"{busy}; try again later"))
                return
            try:
                await self._serve_telemetry(requests, context, cid)
            finally:
                streams.give(cid, peer)
        finally:
            self.open_rpcs -= 1

    async def _refuse_stream(self, requests: AsyncIterator[bytes], context: Any, why: d.Status) -> None:
        """Answer a refused Telemetry stream with a status, then end it.

        The answer follows the client's first command (SDKs send their
        settings as soon as they open the stream; at most REFUSAL_READ_S is
        waited for it): a stream ended before the client's first write
        makes that write fail, and the client would see a transport error
        instead of the reason.
        """
        try:
            await asyncio.wait_for(requests.__aiter__().__anext__(), REFUSAL_READ_S)
        except Exception:  # nothing came in time, the client closed its side, or it went away: answer all the same
            pass
        await context.write(s.TelemetryCommand(status=why))

    async def _serve_telemetry(self, requests: AsyncIterator[bytes], context: Any, cid: str) -> None:
        svc = self.service
        metrics = self.messaging.metrics
        client = svc.clients.touch(cid)
        stream = TelemetryStream(self.messaging, client, context.peer() or "", self.settings.max_receive_message)
        metrics.inc("rmq_telemetry_streams")

        async def read() -> None:
            try:
                async for raw in requests:
                    client.last_seen = time.monotonic()
                    try:
                        cmd = s.TelemetryCommand.FromString(raw)
                    except Exception:
                        stream.offer(s.TelemetryCommand(status=self._malformed(context, "TelemetryCommand")))
                        continue
                    try:
                        await svc.on_telemetry_command(stream, cmd, client, stream.peer)
                    except (RmqError, TxmqError) as exc:
                        stream.offer(s.TelemetryCommand(status=of_error(exc)))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the client went away mid-stream
                log.debug("event=rmq_telemetry_read_ended client_id=%s error=%r", cid, exc)
            finally:
                stream.finish()  # what is queued (a settings answer) still goes out, then the stream ends

        reader = asyncio.ensure_future(read())
        try:
            while True:
                cmd = await stream.next_command()
                if cmd is None:
                    break
                writer = write_command(context, cmd, cid)  # its failure is retrieved even if this handler is cancelled
                closed = asyncio.ensure_future(stream.closed.wait())
                try:
                    await asyncio.wait((writer, closed), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    closed.cancel()
                if not writer.done():  # closed while the client does not read: give up on it
                    writer.cancel()
                    break
                writer.result()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("event=rmq_telemetry_write_ended client_id=%s error=%r", cid, exc)
        finally:
            stream.close("")
            reader.cancel()
        if stream.close_reason:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, stream.close_reason)


def server_options(max_receive: int, max_connections: int, handshake_timeout_s: float | None) -> list[tuple[str, int]]:
    """The gRPC server's channel arguments (also those of benchmarks/grpc_empty.py's server, the front end's bound)."""
    options = [
        ("grpc.max_receive_message_length", max_receive),
        ("grpc.max_send_message_length", max_receive + (1 << 20)),
        ("grpc.so_reuseport", 0),  # a port another process holds is an error, not shared
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.max_connection_idle_ms", int(IDLE_TIMEOUT_S * 1000)),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        # Calls gRPC core has accepted and the front end not yet taken up: past its default bounds (1,000, then
        # 3,000) gRPC cancels them, whoever sent them, and nobody is told why; a burst of one client's calls then
        # cancelled other clients' requests. Up to the RPC bound they wait their turn, and are answered.
        ("grpc.server.max_pending_requests", MAX_CONCURRENT_RPCS + GRPC_MARGIN),
        ("grpc.server.max_pending_requests_hard_limit", MAX_CONCURRENT_RPCS + GRPC_MARGIN),
    ]
    if handshake_timeout_s:  # else gRPC's own: 2 minutes
        options.append(("grpc.server_handshake_timeout_ms", max(1, int(handshake_timeout_s * 1000))))
    return options


def signed(md: dict[str, str], token: str) -> bool:
    """Whether the request carries RocketMQ's signature made with ``token`` as the secret key.

    RocketMQ's SDKs sign each request: ``authorization: MQv2-HMAC-SHA1
    Credential=<access key>, SignedHeaders=x-mq-date-time,
    Signature=<hex HMAC-SHA1 of the x-mq-date-time header>``. txmq takes
    any access key and --auth-token as the secret key.
    """
    auth = md.get("authorization", "")
    date_time = md.get("x-mq-date-time", "")
    if not auth.startswith("MQv2-HMAC-SHA1 ") or not date_time:
        return False
    parts = dict(p.strip().split("=", 1) for p in auth[len("MQv2-HMAC-SHA1 "):].split(",") if "=" in p)
    given = parts.get("Signature", "").lower()
    want = hmac.new(token.encode(), date_time.encode(), sha1).hexdigest()
    return hmac.compare_digest(given.encode(), want.encode())


def check_port_free(host: str, port: int, address: str) -> None:
    """Bind and listen on host:port as gRPC will, and let go: a port that cannot be is a BindError with the OS's reason.

    gRPC reports a failed bind with a line of its C core on stderr and an
    exception that only points at GRPC_VERBOSITY; binding first gives the
    one line the native port gives (``Address already in use``, ``Cannot
    assign requested address``, ``Permission denied``), and leaves gRPC's
    own logging as it is for everything else. As gRPC does, the address is
    usable when any of the addresses host resolves to is. Port 0 (any free
    port) always is.
    """
    if not port:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindError(f"cannot listen on {address} (--rocketmq-port): {exc.strerror or exc}") from None
    first: OSError | None = None
    for family, kind, proto, _name, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC sets it: TIME_WAIT is no obstacle
                s.bind(sockaddr)
                s.listen(1)
            return
        except OSError as exc:
            first = first or exc
    reason = (first.strerror or str(first)) if first is not None else "no address to bind"
    raise BindError(f"cannot listen on {address} (--rocketmq-port): {reason}")


def reserve_port(host: str, port: int, address: str) -> tuple[socket.socket, int]:
    """A socket bound (not listening) to host:port with SO_REUSEPORT, and the port (port 0: a free one).

    The front-end workers bind the same port with SO_REUSEPORT beside it and
    the kernel spreads connections among those listening; this one takes
    none, and keeps the port the broker's while workers are started again.
    """
    try:
        info = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise BindError(f"cannot listen on {address} (--rocketmq-port): {exc.strerror or exc}") from None
    sock = hold_port(info[0], info[4], lambda why: BindError(f"cannot listen on {address} (--rocketmq-port): {why}"))
    return sock, sock.getsockname()[1]


def _read(path: Path | None, option: str) -> bytes:
    try:
        return Path(path).read_bytes()  # type: ignore[arg-type]
    except OSError as exc:
        raise BindError(f"cannot read {option} {path}: {exc.strerror or exc}") from None
