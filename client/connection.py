"""Connections to a txmq broker: one socket (`Connection`) and a reconnecting session (`Client`).

`Connection` is an `asyncio.Protocol`: requests are futures keyed by frame
id, so any number can be in flight and replies may come back in any order;
nothing in the request path creates a task. Frames issued in the same loop
iteration leave together: the first request awaited in an iteration goes
out at once, with whatever was queued before it (a pipelined end rides with
the next half), and the rest of the iteration's frames leave in one
`transport.write` at its end. Pushes (`[2, 0, op, fields]`) go to a handler
called on the loop.

`Client` owns at most one `Connection` at a time. When the broker goes away
it reconnects with backoff (50 ms doubling to 2 s) and sends `hello` again
with its groups, so a transactional producer is registered again and
check-backs find it after a broker restart. A request that is merely waiting
for a connection is sent once one is back; a request that was already on
the wire when the connection dropped is retried only when it is safe to
repeat (`SAFE_TO_RETRY`), never a `send`.

Errors: a broker error reply is rebuilt with `TxmqError.from_reply`. A lost
connection fails every request in flight with `ConnectionLost`, a
`TxmqError` with code `SHUTTING_DOWN` (so ``retriable`` is true): the
request may or may not have reached the broker. Using a closed `Client`
raises `ClientClosed` (same code, but not retriable). A peer whose first
bytes are not a txmq reply (another service's port: AMQP, gRPC/HTTP2, HTTP,
TLS) fails the connection with `NotATxmqBroker` (not retriable either).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from txmq import wire
from txmq.constants import DEFAULT_ADDRESS, DEFAULT_HOST, DEFAULT_PORT
from txmq.defaults import MAX_BUSY_POLL_S
from txmq.wire import ErrorCode, TxmqError

log = logging.getLogger("txmq.client")

PushHandler = Callable[[str, dict[str, Any]], None]

# Replies can hold a whole pull batch; the broker is trusted more than a peer.
CLIENT_MAX_FRAME = 64 << 20
# Requests queued in one loop iteration past this many bytes are written when the sender
# drains (send_many), not at the iteration's end: the transport's flow control then sees
# them, and a window of large messages is not all held in memory before the first write.
EARLY_WRITE_BYTES = 256 << 10
# How long close() lets the transport hand what is queued to a broker that reads nothing
# (stopped, a stuck disk) before it drops the connection.
CLOSE_GRACE_S = 5.0

# Operations that may be repeated after a connection drop without changing
# the outcome. `end_transaction` belongs here because the broker keeps one
# outcome per transaction and answers a repeat with status "already".
SAFE_TO_RETRY = frozenset(
    {
        "hello",
        "heartbeat",
        "broker_info",
        "pull",
        "fetch_offsets",
        "list_topics",
        "create_topic",
        "config_get",
        "stats",
        "tx_pending",
        "tx_offsets",
        "discard_list",
        "end_transaction",
    }
)


class ConnectionLost(TxmqError):
    """The connection dropped (or could not be made); retriable.

    A request that fails with this may or may not have been carried out.
    """

    code = ErrorCode.SHUTTING_DOWN


class ClientClosed(ConnectionLost):
    """The client was closed by its owner; retrying will not help."""

    @property
    def retriable(self) -> bool:
        return False


class NotATxmqBroker(TxmqError):
    """The peer is not a txmq broker: its first bytes are no txmq reply (another service's port).

    ``seen`` says briefly what answered instead (an AMQP server, HTTP/2 such
    as a gRPC server or a broker's own ``--rocketmq-port``, HTTP, TLS, or the
    bytes themselves). Not retriable: asking again reaches the same service.
    """

    code = ErrorCode.MALFORMED_FRAME

    def __init__(self, peer: str, seen: str) -> None:
        super().__init__(f"{peer} is not a txmq broker: {seen}")
        self.peer = peer
        self.seen = seen


# What the first reply of a txmq broker starts with: a u32 length of at least MIN_REPLY, then the
# msgpack array [kind, id, code, fields]: 0x94, and kind 1 (a reply) or 2 (a push).
MIN_REPLY = 5  # [1, 0, 0, {}]
_REPLY_START = 0x94
_REPLY_KINDS = (wire.REPLY, wire.PUSH)
_SHOWN_BYTES = 16  # of a foreign peer's first bytes, in its description


def first_bytes_problem(head: bytes, max_frame: int = CLIENT_MAX_FRAME) -> str | None:
    """Why the first bytes a peer sent cannot start a txmq reply ("" when they can; None while too few arrived).

    The first frame of a txmq broker has a length from MIN_REPLY to
    ``max_frame`` and a payload that starts as an array of four with kind
    reply or push. Anything else is another service: see `describe_foreign`.
    """
    if len(head) < 4:
        return None
    (length,) = wire.HEADER.unpack_from(head, 0)
    if length < MIN_REPLY or length > max_frame:
        return describe_foreign(head)
    if len(head) < 5:
        return None
    if head[4] != _REPLY_START:
        return describe_foreign(head)
    if len(head) < 6:
        return None
    return "" if head[5] in _REPLY_KINDS else describe_foreign(head)


def describe_foreign(head: bytes) -> str:
    """What a peer whose first bytes are `head` seems to be, briefly (the bytes themselves when not known)."""
    if head.startswith(b"AMQP"):
        version = "-".join(str(b) for b in head[5:8]) if len(head) >= 8 else ""
        return f"it greets like an AMQP {version} server".replace("  ", " ")
    if len(head) >= 9 and head[3] == 0x04 and head[4] in (0, 1) and head[5:9] == b"\0\0\0\0":  # a SETTINGS frame
        return "it speaks HTTP/2 (gRPC? a broker's --rocketmq-port?)"
    if head.startswith((b"HTTP/", b"SSH-")):
        first = head.split(b"\r")[0].split(b"\n")[0][: 2 * _SHOWN_BYTES].decode("ascii", "replace")
        return f"it speaks {'HTTP' if head.startswith(b'HTTP/') else 'SSH'} ({first!r})"
    if head[:1] in (b"\x15", b"\x16") and head[1:2] == b"\x03":
        return "it speaks TLS"
    if len(head) >= 9 and head[4] == 0 and head[8:9] == b"{" and int.from_bytes(head[5:8], "big") <= int.from_bytes(head[:4], "big") - 4:
        return REMOTING_SEEN  # a remoting frame with a JSON header: RocketMQ's reply to what it could not read
    return f"its first bytes are no txmq reply: {bytes(head[:_SHOWN_BYTES])!r}" + ("..." if len(head) > _SHOWN_BYTES else "")


# RocketMQ's remoting protocol (its 4.x clients, name servers and brokers: 10911 is a RocketMQ broker's default
# port as well as txmq's). Sent a txmq frame, RocketMQ closes the connection without a byte, so it is asked
# something it answers: GET_BROKER_CLUSTER_INFO, read-only everywhere (a name server answers it, a broker
# answers REQUEST_CODE_NOT_SUPPORTED, a txmq broker's --remoting-port answers it as a name server).
REMOTING_PROBE_CODE = 106
REMOTING_PROBE_OPAQUE = 0x7478  # "tx"
REMOTING_PROBE_TIMEOUT_S = 3.0
_REMOTING_MAX_FRAME = 16 << 20
_REMOTING_MAX_HEADER = 64 << 10  # a reply's header is a few hundred bytes: more is not RocketMQ
REMOTING_WHAT = "it speaks RocketMQ's remoting protocol (a RocketMQ name server or broker, or a txmq broker's --remoting-port)"
REMOTING_SEEN = REMOTING_WHAT + "; RocketMQ's brokers listen on 10911, txmq's default port too: point --broker at the txmq broker's port"


def remoting_probe_frame() -> bytes:
    """A RocketMQ remoting request (JSON header, no body): GET_BROKER_CLUSTER_INFO."""
    import json

    header = json.dumps({"code": REMOTING_PROBE_CODE, "language": "JAVA", "version": 0, "opaque": REMOTING_PROBE_OPAQUE,
                         "flag": 0, "extFields": {}}, separators=(",", ":")).encode()
    return (4 + len(header)).to_bytes(4, "big") + len(header).to_bytes(4, "big") + header


def is_remoting_reply(head: bytes) -> bool | None:
    """Whether `head` starts RocketMQ's reply to `remoting_probe_frame` (None while too few bytes arrived).

    A frame is a u32 length, a u32 whose high byte is the header's
    serialization (0 JSON, 1 RocketMQ's binary) and low 24 bits its length,
    then the header: a response (flag bit 0) to the probe's opaque.
    """
    if len(head) < 8:
        return None
    total = int.from_bytes(head[:4], "big")
    kind, header_len = head[4], int.from_bytes(head[5:8], "big")
    if not 4 <= total <= _REMOTING_MAX_FRAME or kind not in (0, 1) or header_len > min(total - 4, _REMOTING_MAX_HEADER):
        return False
    if len(head) < 8 + header_len:
        return None
    header = bytes(head[8:8 + header_len])
    if kind == 1:  # code u16, language u8, version u16, opaque i32, flag i32, ...
        if header_len < 13:
            return False
        opaque, flag = int.from_bytes(header[5:9], "big", signed=True), int.from_bytes(header[9:13], "big", signed=True)
    else:
        import json

        try:
            doc = json.loads(header)
        except ValueError:
            return False
        if not isinstance(doc, dict) or not isinstance(doc.get("code"), int):
            return False
        opaque, flag = doc.get("opaque"), doc.get("flag", 0)
    return opaque == REMOTING_PROBE_OPAQUE and isinstance(flag, int) and bool(flag & 1)


async def probe_remoting(host: str, port: int, timeout: float = REMOTING_PROBE_TIMEOUT_S) -> bool:
    """Whether the service at host:port answers RocketMQ's remoting protocol (one request on a new connection)."""
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(remoting_probe_frame())
            head = b""
            while (seen := is_remoting_reply(head)) is None:
                more = await reader.read(64 << 10)
                if not more:
                    return False
                head += more
            return seen
    except (OSError, TimeoutError, ValueError):
        return False
    finally:
        if writer is not None:
            writer.close()


_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.\-_]*[A-Za-z0-9])?")
_PORT = re.compile(r"[0-9]{1,5}")


def parse_address(address: str, default_port: int | None = DEFAULT_PORT) -> tuple[str, int]:
    """Split "HOST:PORT" or "[IPV6]:PORT" into (host, port); anything else is a ValueError.

    HOST is a name or an IPv4 address: ASCII letters, digits, '.', '-' and '_',
    a letter or digit at each end. An IPv6 address goes in brackets, with an
    optional zone ("[fe80::1%eth0]:10911"). PORT is 1 to 65535 in ASCII
    digits; a bare HOST or [IPV6] takes ``default_port`` (10911, RocketMQ's
    broker port) unless it is None, as for the CLI's --broker, which checks
    addresses with this function too.

    The client used to take more, each a way to connect somewhere other
    than meant: an empty port as 10911 ("host:"), an empty host as
    127.0.0.1 (":1234", ""), a
    bare IPv6 address ("::1", so "::1:10911" was a host and not a port),
    anything between brackets ("[nonsense]"), any host text ("bad host"),
    white space around the address, and any port int() reads ("+5", "1_0",
    non-ASCII digits).
    """
    text = given = address or ""
    if default_port is not None and (_HOST.fullmatch(text) or (text.startswith("[") and text.endswith("]"))):
        text = f"{text}:{default_port}"  # a bare name or [IPV6]: the default port (RocketMQ's 10911)
    host, sep, port = text.rpartition(":")
    ok = bool(sep) and _PORT.fullmatch(port) is not None and 0 < int(port) < 65536
    if ok and host.startswith("["):
        host = host[1:-1] if host.endswith("]") else ""
        try:
            ok = ipaddress.ip_address(host.partition("%")[0]).version == 6
        except ValueError:
            ok = False
    elif ok:
        ok = _HOST.fullmatch(host) is not None
    if not ok:
        hint = " (an IPv6 address goes in brackets: [::1]:10911)" if given.count(":") > 1 else ""
        raise ValueError(f"bad broker address {given!r}: expected HOST:PORT with a port from 1 to 65535{hint}")
    return host, int(port)


def default_client_id() -> str:
    return f"{socket.gethostname()}@{os.getpid()}@{os.urandom(3).hex()}"


def _poll_readable() -> Callable[[int, int], bool] | None:
    """The compiled busy-wait (core/_busypoll.pyx), or None where it was not built or TXMQ_PURE_PYTHON is set."""
    if os.environ.get("TXMQ_PURE_PYTHON"):
        return None
    try:
        from txmq._busypoll import poll_readable
    except ImportError:
        return None
    return poll_readable


class Connection(asyncio.Protocol):
    """One socket to a broker. Create with `connect()` / `Connection.connect()`."""

    # Open connections of this process that busy-poll: they poll only while they are the one such
    # connection, because nothing else on the event loop runs during a poll.
    _polling = 0
    _poll_fn: Callable[[int, int], bool] | None = None
    _poll_looked_up = False

    def __init__(
        self,
        push_handler: PushHandler | None = None,
        on_lost: Callable[["Connection", BaseException | None], None] | None = None,
        max_frame: int = CLIENT_MAX_FRAME,
        busy_poll: float = 0.0,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        # busy_poll (seconds): after writing requests, spin on the socket this long at most for the reply
        # (docs/client.md, "Busy polling"); 0, or without the compiled module, the loop just waits.
        self._poll_ns = 0
        self._poll_fd = -1
        self._poll_scheduled = False
        if busy_poll > 0:
            if not Connection._poll_looked_up:
                Connection._poll_fn, Connection._poll_looked_up = _poll_readable(), True
                if Connection._poll_fn is None:
                    log.info("busy_poll asked for, but the compiled module txmq._busypoll is not in use here: the client waits normally")
            if Connection._poll_fn is not None:
                self._poll_ns = int(busy_poll * 1e9)
        self._push_handler = push_handler
        self._on_lost = on_lost
        self._decoder = wire.FrameDecoder(max_frame)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        # Timeouts without a timer per request: deadlines of requests in flight,
        # swept by one timer set for the earliest of them.
        self._deadlines: dict[int, tuple[float, str, float]] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_at = 0.0
        self._next_id = 0
        self._transport: asyncio.Transport | None = None
        self._wbuf: list[bytes] = []
        self._wbuf_bytes = 0
        self._flush_handle: asyncio.Handle | None = None
        self._sent_early = False  # this iteration's first awaited request already went out (send_now)
        self._paused = False
        self._resumed: asyncio.Future[None] | None = None
        self._closed = False
        self._close_reason: TxmqError | None = None
        self.lost = self._loop.create_future()  # resolves once the socket is gone
        # The first bytes from the peer, until they look like the start of a txmq reply (then None):
        # another service on the port is told apart from a broker sending bad data.
        self._head: bytes | None = b""
        self._answered = False  # a first frame was parsed
        self._aborted = False  # bad data: what still arrives before the transport is gone is not read
        self.peer = "?"
        self.hello: dict[str, Any] = {}

    # ---- establishing -------------------------------------------------

    @classmethod
    async def connect(
        cls,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        *,
        token: str | None = None,
        client_id: str | None = None,
        producer_groups: Iterable[str] = (),
        consumer_groups: Iterable[str] = (),
        push_handler: PushHandler | None = None,
        on_lost: Callable[["Connection", BaseException | None], None] | None = None,
        timeout: float | None = 10.0,
        busy_poll: float = 0.0,
    ) -> "Connection":
        """Open a socket and send `hello` (with the token when given) before anything else."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(lambda: cls(push_handler, on_lost, busy_poll=busy_poll), host, port)
        except (OSError, TimeoutError) as exc:
            raise ConnectionLost(f"cannot connect to {host}:{port}: {exc or type(exc).__name__}") from exc
        hello: dict[str, Any] = {"client_id": client_id or default_client_id()}
        if token is not None:
            hello["token"] = token
        if groups := list(producer_groups):
            hello["producer_groups"] = groups
        if groups := list(consumer_groups):
            hello["consumer_groups"] = groups
        try:
            conn.hello = await conn.request("hello", hello, timeout)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, ConnectionLost) and not isinstance(exc, NotATxmqBroker) and conn._head == b"":
                # Closed without a byte: a txmq broker always answers hello, RocketMQ closes on a frame it cannot read.
                if await probe_remoting(host, port, min(timeout or REMOTING_PROBE_TIMEOUT_S, REMOTING_PROBE_TIMEOUT_S)):
                    raise NotATxmqBroker(conn.peer if conn.peer != "?" else f"{host}:{port}", REMOTING_SEEN) from exc
            raise
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None and self._poll_ns:
            self._poll_fd = sock.fileno()
            Connection._polling += 1
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            except OSError:
                pass
        peer = transport.get_extra_info("peername")
        if peer:
            self.peer = f"{peer[0]}:{peer[1]}"

    # ---- requests -----------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def send_request(self, op: str, fields: dict[str, Any], timeout: float | None = None) -> asyncio.Future[dict[str, Any]]:
        """Queue a request and return the future of its reply fields (no task, no await)."""
        if self._closed:
            raise self._lost_error()
        pending = self._pending
        i = self._next_id
        while True:
            i = i + 1 if i < 0xFFFFFFFF else 1
            if i not in pending:
                break
        self._next_id = i
        data = wire.request(i, op, fields)  # raises on a field msgpack cannot encode: then nothing is queued
        fut = self._loop.create_future()
        pending[i] = fut
        self._wbuf.append(data)
        self._wbuf_bytes += len(data)
        if self._flush_handle is None:
            self._flush_handle = self._loop.call_soon(self._flush)
        if timeout is not None:
            deadline = self._loop.time() + timeout
            self._deadlines[i] = (deadline, op, timeout)
            if self._sweep is None or deadline < self._sweep_at:
                self._schedule_sweep(deadline)
        return fut

    def send_now(self) -> None:
        """Write what is queued now, once per loop iteration: called for a request about to be awaited.

        The first request awaited in an iteration leaves at once instead of
        at the iteration's end, so the broker starts on it while this
        process is still busy with the iteration's other work (with many
        producers on one loop, their replies are handled one after another
        and each producer's next request is on the wire before the last one
        is handled). Later requests in the same iteration still leave
        together, in the write the iteration ends with, so a burst of
        requests costs two writes, not one each.
        """
        if self._flush_handle is not None and not self._sent_early and self._wbuf:
            self._sent_early = True
            self._write_out()

    async def request(self, op: str, fields: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Send one request; return its reply fields or raise the rebuilt `TxmqError`."""
        fut = self.send_request(op, {} if fields is None else fields, timeout)
        self.send_now()
        return await fut

    def _schedule_sweep(self, when: float) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
        self._sweep_at = when
        self._sweep = self._loop.call_at(when + 0.005, self._expire)

    def _expire(self) -> None:
        self._sweep = None
        now = self._loop.time()
        pending = self._pending
        expired = [i for i, (deadline, _, _) in self._deadlines.items() if deadline <= now]
        for i in expired:
            _, op, timeout = self._deadlines.pop(i)
            fut = pending.pop(i, None)
            if fut is not None and not fut.done():
                fut.set_exception(TimeoutError(f"{op} got no reply within {timeout:g} s"))
        if self._deadlines:
            self._schedule_sweep(min(d for d, _, _ in self._deadlines.values()))

    def _flush(self) -> None:
        self._flush_handle = None
        self._sent_early = False
        self._write_out()

    def _write_out(self) -> None:
        buf = self._wbuf
        if not buf or self._transport is None or self._closed:
            return
        self._wbuf = []
        self._wbuf_bytes = 0
        self._transport.write(buf[0] if len(buf) == 1 else b"".join(buf))
        if self._poll_fd >= 0:
            self._schedule_poll()

    def _schedule_poll(self) -> None:
        if not self._poll_scheduled and self._pending and Connection._polling == 1:
            self._poll_scheduled = True
            self._loop.call_soon(self._busy_wait)

    def _busy_wait(self) -> None:
        """Spin on the socket (GIL released, bounded) until the reply can be read: it is then read without a wake-up."""
        self._poll_scheduled = False
        if self._pending and self._poll_fd >= 0 and Connection._polling == 1 and not self._closed:
            Connection._poll_fn(self._poll_fd, self._poll_ns)  # type: ignore[misc]

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_result(None)
        self._resumed = None

    async def drain(self, timeout: float | None = None) -> None:
        """Wait while the transport's write buffer is over its high-water mark; TimeoutError after ``timeout`` s.

        Requests queued past EARLY_WRITE_BYTES are written first, so a
        sender that queues many without yielding is held up here too.
        """
        if self._wbuf_bytes >= EARLY_WRITE_BYTES:
            self._write_out()
        if self._paused and not self._closed:
            if self._resumed is None:
                self._resumed = self._loop.create_future()
            done, _ = await asyncio.wait([self._resumed, self.lost], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise TimeoutError(f"the broker at {self.peer} read nothing for {timeout:g} s: its connection stays full")

    # ---- incoming -----------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._aborted or (self._head is not None and not self._check_first_bytes(data)):
            return
        try:
            payloads = self._decoder.feed(data)
        except TxmqError as exc:
            self._abort(exc)
            return
        pending = self._pending
        deadlines = self._deadlines
        for payload in payloads:
            try:
                frame = wire.parse_payload(payload)
            except TxmqError as exc:
                if not self._answered:  # the first frame is not txmq: another service that happened to pass the first bytes
                    exc = NotATxmqBroker(self.peer, f"its first reply is not a txmq frame ({exc.message})")
                self._abort(exc)
                return
            self._answered = True
            if frame.kind == wire.REPLY:
                fut = pending.pop(frame.id, None)
                if deadlines:
                    deadlines.pop(frame.id, None)
                if fut is None:
                    if frame.id == 0 and frame.op:  # connection-level error; the broker will close
                        self._close_reason = TxmqError.from_reply(frame.op, frame.fields)  # type: ignore[arg-type]
                    continue
                if fut.done():
                    continue
                if frame.op == 0:
                    fut.set_result(frame.fields)
                else:
                    fut.set_exception(TxmqError.from_reply(frame.op, frame.fields))  # type: ignore[arg-type]
            elif frame.kind == wire.PUSH:
                if self._push_handler is None:
                    log.warning("push %r from %s ignored: no handler", frame.op, self.peer)
                    continue
                try:
                    self._push_handler(frame.op, frame.fields)  # type: ignore[arg-type]
                except Exception:
                    log.exception("push handler failed for %r", frame.op)
            # a request from the broker is not part of the protocol: ignored
        if self._poll_fd >= 0 and pending:
            self._schedule_poll()  # more replies are due (e.g. a half's after its end's)

    def _check_first_bytes(self, data: bytes) -> bool:
        """Whether the peer's first bytes (so far) may start a txmq reply; if not, the connection is dropped."""
        assert self._head is not None
        self._head += data[: 2 * _SHOWN_BYTES - len(self._head)]
        problem = first_bytes_problem(self._head, self._decoder.max_frame)
        if problem is None:  # too few bytes to tell
            return True
        if problem:
            self._head = None
            self._abort(NotATxmqBroker(self.peer, problem))
            return False
        self._head = None
        return True

    def _abort(self, exc: TxmqError) -> None:
        if isinstance(exc, NotATxmqBroker):  # the caller's error says it all (a CLI prints it as one line)
            log.debug("%s; closing", exc.message)
        else:
            log.error("bad data from %s: %s; closing", self.peer, exc)
        self._close_reason = exc
        self._aborted = True
        if self._transport is not None:
            self._transport.abort()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._transport = None
        if self._poll_fd >= 0:
            self._poll_fd = -1
            Connection._polling -= 1
        self._wbuf.clear()
        self._wbuf_bytes = 0
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        self._deadlines.clear()
        err = self._lost_error(exc)
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)
        if not self.lost.done():
            self.lost.set_result(None)
        self.resume_writing()
        if self._on_lost is not None:
            self._on_lost(self, exc)

    def _lost_error(self, exc: BaseException | None = None) -> TxmqError:
        """What requests in flight (and later ones) fail with: `ConnectionLost`, or `NotATxmqBroker` for another service."""
        if isinstance(self._close_reason, NotATxmqBroker):
            return NotATxmqBroker(self._close_reason.peer, self._close_reason.seen)
        reason = self._close_reason or exc
        detail = f": {reason}" if reason else ""
        return ConnectionLost(f"connection to {self.peer} lost{detail}")

    def close(self) -> None:
        """Flush what is queued and close; requests in flight fail with `ConnectionLost`."""
        if self._transport is not None and not self._closed:
            self._flush()
            self._transport.close()

    def abort(self) -> None:
        """Drop the connection now, without writing what is queued."""
        if self._transport is not None:
            self._transport.abort()

    async def wait_closed(self) -> None:
        await asyncio.shield(self.lost)


connect = Connection.connect


class Client:
    """A reconnecting session with one broker: what producers and consumers build on."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        token: str | None = None,
        client_id: str | None = None,
        producer_groups: Iterable[str] = (),
        consumer_groups: Iterable[str] = (),
        push_handler: PushHandler | None = None,
        request_timeout: float | None = 30.0,
        connect_timeout: float = 10.0,
        reconnect: bool = True,
        reconnect_wait: float = 30.0,
        max_retries: int = 5,
        backoff_initial: float = 0.05,
        backoff_max: float = 2.0,
        busy_poll: float = 0.0,
    ) -> None:
        if not (0.0 <= busy_poll <= MAX_BUSY_POLL_S):
            raise ValueError(f"busy_poll must be between 0 (off) and {MAX_BUSY_POLL_S} seconds, not {busy_poll!r}")
        self.busy_poll = busy_poll  # seconds to spin for a reply while this is the process's one busy-polling connection
        self.address = address
        self.token = token
        self.client_id = client_id or default_client_id()
        self.producer_groups = tuple(producer_groups)
        self.consumer_groups = tuple(consumer_groups)
        self.push_handler = push_handler
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.reconnect = reconnect
        self.reconnect_wait = reconnect_wait  # how long a request waits for the broker to come back
        self.max_retries = max_retries
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        # Reconnect pacing across connections: one that is lost soon after it was made (a proxy that
        # accepts and drops, a broker refusing it right after hello) does not restart the backoff.
        self._conn_since = 0.0
        self._next_delay = 0.0
        self.reconnects = 0
        self._conn: Connection | None = None
        self._ready: asyncio.Event | None = None
        self._reconnect_task: asyncio.Task[None] | None = None
        self._fatal: TxmqError | None = None
        self._closed = False
        self._started = False

    @property
    def host(self) -> str:
        return parse_address(self.address)[0]

    @property
    def port(self) -> int:
        return parse_address(self.address)[1]

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    @property
    def connection(self) -> Connection | None:
        return self._conn

    @property
    def hello(self) -> dict[str, Any]:
        """The last `hello` reply (version, broker_id, flush, ...)."""
        return self._conn.hello if self._conn is not None else {}

    async def start(self) -> "Client":
        """Connect once; raises `ConnectionLost` if the broker cannot be reached."""
        if self._closed:
            raise ClientClosed("client is closed")
        if self._started:
            return self
        self._ready = asyncio.Event()
        self._set_conn(await self._open())
        self._started = True
        return self

    async def __aenter__(self) -> "Client":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()
            try:
                await self._reconnect_task
            except asyncio.CancelledError:
                pass
            self._reconnect_task = None
        conn, self._conn = self._conn, None
        if self._ready is not None:
            self._ready.set()  # wake waiters so they see the client is closed
        if conn is not None:
            conn.close()
            try:
                await asyncio.wait_for(conn.wait_closed(), CLOSE_GRACE_S)
            except TimeoutError:  # the broker reads nothing: what is queued cannot leave
                log.warning("connection to %s did not close within %g s; dropped", self.address, CLOSE_GRACE_S)
                conn.abort()
                await conn.wait_closed()

    # ---- requests -----------------------------------------------------

    async def request(
        self,
        op: str,
        fields: dict[str, Any] | None = None,
        timeout: float | None = None,
        *,
        retry: bool | None = None,
    ) -> dict[str, Any]:
        """Send `op` and return the reply fields.

        ``timeout`` bounds the whole call, waiting for a reconnect and retries
        included; None means `request_timeout`. ``retry`` overrides whether
        the request is repeated (up to `max_retries` times) after a
        connection drop or a retriable refusal such as BUSY; the default is
        ``op in SAFE_TO_RETRY``.
        """
        if fields is None:
            fields = {}
        if timeout is None:
            timeout = self.request_timeout
        conn = self._conn
        if conn is not None and not conn.closed:
            # The fast path: one await, no task, no waiting for a connection.
            started = time.monotonic()
            try:
                fut = conn.send_request(op, fields, timeout)
                conn.send_now()
                return await fut
            except TxmqError as exc:
                if not self._may_retry(op, retry, exc):
                    raise
                deadline = None if timeout is None else started + timeout
                return await self._request_slow(op, fields, deadline, retry, exc)
        deadline = None if timeout is None else time.monotonic() + timeout
        return await self._request_slow(op, fields, deadline, retry, None)

    def _may_retry(self, op: str, retry: bool | None, exc: TxmqError) -> bool:
        if not (op in SAFE_TO_RETRY if retry is None else retry):
            return False
        if isinstance(exc, ConnectionLost):
            return self.reconnect and not isinstance(exc, ClientClosed)
        return exc.retriable  # BUSY and friends: the broker said no before doing anything

    async def _request_slow(
        self, op: str, fields: dict[str, Any], deadline: float | None, retry: bool | None, last: TxmqError | None
    ) -> dict[str, Any]:
        delay = self.backoff_initial
        attempts = 0 if last is None else 1
        while True:
            if last is not None:
                if attempts > self.max_retries:
                    raise last
                if not isinstance(last, ConnectionLost):
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.backoff_max)
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise last if last is not None else TimeoutError(f"{op} timed out")
            conn = await self.wait_connected(remaining)
            remaining = None if deadline is None else max(0.001, deadline - time.monotonic())
            attempts += 1
            try:
                return await conn.send_request(op, fields, remaining)
            except TxmqError as exc:
                if not self._may_retry(op, retry, exc):
                    raise
                last = exc

    def send_request(self, op: str, fields: dict[str, Any], timeout: float | None = None) -> asyncio.Future[dict[str, Any]]:
        """The future of one request on the current connection; raises `ConnectionLost` if there is none."""
        conn = self._conn
        if conn is None or conn.closed:
            raise self._unavailable()
        return conn.send_request(op, fields, self.request_timeout if timeout is None else timeout)

    async def wait_connected(self, timeout: float | None = None) -> Connection:
        """Return the live connection, waiting up to `timeout` (default `reconnect_wait`) for a reconnect."""
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        if self._closed or self._fatal is not None or not self._started or not self.reconnect:
            raise self._unavailable()
        wait = self.reconnect_wait if timeout is None else min(timeout, self.reconnect_wait)
        assert self._ready is not None
        try:
            async with asyncio.timeout(wait):
                while True:
                    await self._ready.wait()
                    conn = self._conn
                    if conn is not None and not conn.closed:
                        return conn
                    if self._closed or self._fatal is not None:
                        raise self._unavailable()
                    self._ready.clear()
        except TimeoutError:
            raise ConnectionLost(f"broker {self.address} unreachable for {wait:g} s") from None

    async def drain(self) -> None:
        """Wait while the connection's write buffer is full, at most ``request_timeout`` (then TimeoutError)."""
        conn = self._conn
        if conn is not None:
            await conn.drain(self.request_timeout)

    def _unavailable(self) -> TxmqError:
        if self._closed:
            return ClientClosed("client is closed")
        if self._fatal is not None:
            return self._fatal
        if not self._started:
            return ClientClosed("client not started: call start() or use 'async with'")
        return ConnectionLost(f"not connected to {self.address}")

    # ---- (re)connecting -----------------------------------------------

    async def _open(self) -> Connection:
        host, port = parse_address(self.address)
        return await Connection.connect(
            host,
            port,
            token=self.token,
            client_id=self.client_id,
            producer_groups=self.producer_groups,
            consumer_groups=self.consumer_groups,
            push_handler=self._on_push,
            on_lost=self._on_lost,
            timeout=self.connect_timeout,
            busy_poll=self.busy_poll,
        )

    def _set_conn(self, conn: Connection) -> None:
        self._conn = conn
        self._conn_since = asyncio.get_running_loop().time()
        assert self._ready is not None
        self._ready.set()

    def _on_push(self, op: str, fields: dict[str, Any]) -> None:
        if self.push_handler is not None:
            self.push_handler(op, fields)

    def _on_lost(self, conn: Connection, exc: BaseException | None) -> None:
        if conn is not self._conn:
            return
        self._conn = None
        if self._ready is not None:
            self._ready.clear()
        if self._closed or not self.reconnect:
            return
        log.warning("connection to %s lost (%s); reconnecting", self.address, exc or "closed by broker")
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect_loop(), name="txmq-reconnect")

    async def _reconnect_loop(self) -> None:
        # A connection that lasted at least backoff_max was a good one: start over at once. One lost
        # sooner continues the backoff of the attempts that made it, first waiting.
        lasted = asyncio.get_running_loop().time() - self._conn_since
        delay = self.backoff_initial
        if lasted < self.backoff_max and self._next_delay > 0:
            delay = self._next_delay
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.backoff_max)
        attempt = 0
        while not self._closed:
            attempt += 1
            try:
                conn = await self._open()
            except TxmqError as exc:
                if not exc.retriable:  # AUTH_FAILED and the like: retrying cannot help
                    log.error("reconnect to %s refused: %s", self.address, exc)
                    self._fatal = exc
                    assert self._ready is not None
                    self._ready.set()
                    return
                log.debug("reconnect attempt %d to %s failed: %s", attempt, self.address, exc)
            except TimeoutError as exc:
                log.debug("reconnect attempt %d to %s timed out: %s", attempt, self.address, exc)
            else:
                if self._closed:
                    conn.close()
                    return
                self.reconnects += 1
                log.info("reconnected to %s after %d attempt(s)", self.address, attempt)
                self._next_delay = delay
                self._set_conn(conn)
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.backoff_max)
