"""Per-connection state: an asyncio.Protocol that frames, dispatches and replies.

- Two-phase decoding (txmq.wire.FrameDecoder): the length is checked before
  the payload is buffered, then the payload parsed.
- Requests are pipelined; replies go out in completion order. The replies
  produced in one loop iteration leave in one write at its end, except that
  a connection left with nothing in flight is written to at once: with many
  clients answered by one group-commit fsync, the first client gets its
  replies (and starts on its next request) while the broker is still
  answering the others.
- Backpressure: when the transport's write buffer passes its high-water
  mark (a client that stops reading), or too many requests are in flight,
  or the pulls in flight may return more than PULL_BUDGET bytes, the
  connection stops reading until it drains; requests already read in the
  same burst wait in a backlog instead of being dispatched. Memory per
  connection is bounded by max_frame + the write buffer limit + the pull
  budget + in-flight requests.
- Limits against clients that would exhaust the broker: with a token, frames
  before a successful hello are held to max_preauth_frame; a connection must
  send its first request (the hello, with a token) within auth_timeout_s and
  finish each frame within frame_timeout_s of its first byte (sweep(), run
  by the server); the bytes all connections hold in partly received frames
  stay under partial_frame_budget; connections beyond max_connections (or
  max_connections_per_ip from one address) are closed as soon as accepted.
  Each refusal gets an error reply when one can be sent, and is counted and
  logged (broker/refusals.py: one line per kind at most every 10 s, with
  the peer and the reason).
  Authenticated connections may stay idle for as long as they like.

The limits, the output batching and the backpressure are the base class's,
LimitedConnection (broker/connlimits.py), which the remoting port's
connections share; this module frames, dispatches and encodes the replies.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
from functools import partial
import logging
from typing import Any

from ..connlimits import BLOB_MIN, LimitCounters, LimitedConnection
from txmq.wire import FATAL, ErrorCode, FrameDecoder, FrameError, TxmqError, parse_payload, push, reply, reply_parts
from txmq.wire import REQUEST


log = logging.getLogger("txmq.conn")
_ids = itertools.count(1)

_COUNTERS = LimitCounters(accepted="connections_accepted", refused="connections_refused",
                          refused_per_ip="connections_refused_per_ip", partial_frame_refusals="partial_frame_refusals",
                          auth_timeouts="auth_timeouts", frame_timeouts="frame_timeouts")
_LIMIT_CODES = {"busy": ErrorCode.BUSY, "auth_timeout": ErrorCode.AUTH_REQUIRED, "frame_timeout": ErrorCode.MALFORMED_FRAME}
_LIMIT_KINDS = {"busy": "busy", "auth_timeout": "timeout", "frame_timeout": "timeout"}  # refusal kinds (broker/refusals.py)
# msgpack's unpacker refuses frames nested past 1024 levels (MALFORMED_FRAME), deeper than Python's code can
# take a value apart: a field nested that deep that makes a handler recurse past the interpreter's limit is a
# request the broker cannot read (INVALID_FIELD, a refusal), not an internal error. No request nests past 5.
MAX_FIELD_DEPTH = 32


def nests_deeper(value: Any, limit: int = MAX_FIELD_DEPTH) -> bool:
    """Whether the map or array ``value`` nests more than ``limit`` levels, itself the first (iterative: a level at a time)."""
    level = [value]
    for _ in range(limit):
        level = [v for o in level for v in (o.values() if type(o) is dict else o) if type(v) is dict or type(v) is list]
        if not level:
            return False
    return True


class BrokerConnection(LimitedConnection):
    counters = _COUNTERS
    frontend = "native"
    first_request = "hello with the broker's token"

    def __init__(self, front, server_state) -> None:
        super().__init__(front.messaging, server_state)
        self.front = front  # NativeFrontend: what the handlers are given
        self.state = server_state
        self.conn_id = next(_ids)
        self.client_id = ""
        cfg = front.config
        self.authed = not cfg.auth_token
        self.decoder = FrameDecoder(cfg.max_frame if self.authed else min(cfg.max_preauth_frame, cfg.max_frame))
        self._tasks: set[asyncio.Task] = set()

    # ---- asyncio.Protocol ---------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._open(transport)
        self._admit(self.messaging.config.max_connections, "--max-connections")

    def _refusal(self, message: str) -> bytes:
        self.messaging.metrics.inc("errors_busy")
        err = TxmqError(message, ErrorCode.BUSY)
        return reply(0, err.to_fields(), int(err.code))

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        if not self.authed:
            self._received_before_hello(data)
            return
        arm = self.messaging.busy_poll_arm
        if arm is not None and self.state.working <= 1:
            arm()  # a lone client's request: keep a CPU awake through its fsync (broker/busypoll.py)
        try:
            payloads = self.decoder.feed(data)
        except TxmqError as err:
            self._fatal(0, err)
            return
        if (self._partial or self.decoder.buffered) and not self._held(bool(payloads)):
            return
        if self._backlog:
            self._backlog.extend(payloads)
            return
        self._run(payloads)

    def _received_before_hello(self, data: bytes) -> None:
        """Frames before a successful hello (a token is configured): one at a time, under the small limit.

        Once the hello succeeds the full limit applies to what follows,
        including frames pipelined behind the hello in the same read.
        """
        decoder = self.decoder
        while True:
            try:
                payload = decoder.feed_one(data)
            except TxmqError as err:
                self._fatal(0, err)
                return
            data = b""
            if not self._held(payload is not None):
                return
            if payload is None:
                return
            self._run([payload])
            if self._closing:
                return
            if self.authed:
                decoder.max_frame = self.messaging.config.max_frame
                if decoder.buffered:
                    self.data_received(b"")
                return

    def _held(self, completed: bool) -> bool:
        """Account for the bytes of a frame still being received; False if the connection was refused for them."""
        return self._hold(self.decoder.buffered, completed)

    def _drop_buffered(self) -> None:
        if self.decoder.buffered:
            self.decoder = FrameDecoder(0)  # what was buffered is never read: let it go now

    def _close_for(self, counter: str, kind: str, message: str) -> None:
        self._close_with(TxmqError(message, _LIMIT_CODES[kind]), counter, kind=_LIMIT_KINDS[kind])

    def _run(self, payloads: list[bytes]) -> None:
        for i, payload in enumerate(payloads):
            if self._read_paused:  # a limit was hit: the rest waits until the connection drains
                self._backlog.extend(payloads[i:])
                return
            try:
                frame = parse_payload(payload, bounded=True)
            except FrameError as err:
                self._fatal(0, err)
                return
            if frame.kind != REQUEST:
                continue  # clients answer pushes with requests; stray replies are ignored
            self._dispatch(frame.id, frame.op, frame.fields)  # type: ignore[arg-type]
            if self._closing:
                return

    # ---- dispatch -------------------------------------------------------------
    def _dispatch(self, id_: int, op: str, fields: dict[str, Any]) -> None:
        if not self.authed:
            if op != "hello":
                self._fatal(id_, TxmqError("authentication required: send hello with the broker's token first", ErrorCode.AUTH_REQUIRED))
                return
            token = fields.get("token")
            expected = self.messaging.config.auth_token.encode()
            if not isinstance(token, str) or not hmac.compare_digest(token.encode(), expected):
                self.messaging.metrics.inc("auth_failures")
                self._fatal(id_, TxmqError("authentication failed: wrong token", ErrorCode.AUTH_FAILED))
                return
            self.authed = True
        if self._first_by:
            self._first_by = 0.0
        handler = self.state.handlers.get(op)
        if handler is None:
            self._reply_error(id_, TxmqError(f"unknown operation {op[:64]!r}", ErrorCode.UNKNOWN_OPERATION))
            return
        if self.messaging.draining and op not in ("heartbeat", "broker_info"):
            self._reply_error(id_, TxmqError("broker is shutting down", ErrorCode.SHUTTING_DOWN))
            return
        try:
            result = handler(self.front, self, fields)
        except TxmqError as err:
            self._reply_error(id_, err)
            return
        except RecursionError as exc:
            self._reply_error(id_, self._too_deep(op, fields, exc))
            return
        except Exception as exc:  # a bug: answer, log (broker/refusals.py: throttled), keep serving
            self._reply_error(id_, self.messaging.error_of(exc))
            return
        if isinstance(result, dict):
            self._send_reply(id_, result)
            return
        fut = result if isinstance(result, asyncio.Future) else asyncio.ensure_future(result)
        if op == "pull":  # the one reply whose size the client picks
            mb = fields.get("max_bytes")
            cost = min(mb, 64 << 20) if type(mb) is int and mb > 0 else 1 << 20
            self._track(fut, cost)
            fut.add_done_callback(partial(self._done, id_, cost=cost))
            return
        self._track(fut)
        fut.add_done_callback(partial(self._done, id_))

    def _done(self, id_: int, fut: asyncio.Future, cost: int = 0) -> None:
        self._untrack(fut, cost)
        if not fut.cancelled() and fut.exception() is None:
            self._send_reply(id_, fut.result(), now=not self.inflight)
            if self._read_paused:
                self._maybe_resume_reading()
            return
        if fut.cancelled():
            self._reply_error(id_, TxmqError("broker is shutting down", ErrorCode.SHUTTING_DOWN))
        else:
            exc = fut.exception()
            if exc is None:
                self._send_reply(id_, fut.result())
            elif isinstance(exc, TxmqError):
                self._reply_error(id_, exc)
            else:
                self._reply_error(id_, self.messaging.error_of(exc))
        self._maybe_resume_reading()

    def _too_deep(self, op: str, fields: dict[str, Any], exc: RecursionError) -> TxmqError:
        """A handler recursed past the interpreter's limit: on fields nested too deeply (a refusal), else a bug."""
        if not nests_deeper(fields):
            return self.messaging.error_of(exc)
        err = TxmqError(f"the fields of {op[:64]!r} nest more than {MAX_FIELD_DEPTH} levels deep", ErrorCode.INVALID_FIELD)
        self.messaging.refusals.note("native", "bad_request", self.peer, str(err))
        return err

    # ---- output ---------------------------------------------------------------
    def _reply_error(self, id_: int, err: TxmqError) -> None:
        self.messaging.metrics.inc(f"errors_{err.code.name.lower()}")
        self._send(reply(id_, err.to_fields(), int(err.code)))

    def _fatal(self, id_: int, err: TxmqError) -> None:
        assert err.code in FATAL or err.code == ErrorCode.MALFORMED_FRAME
        auth = err.code in (ErrorCode.AUTH_REQUIRED, ErrorCode.AUTH_FAILED)
        self._close_with(err, None, id_, kind="auth" if auth else "bad_request")

    def _close_with(self, err: TxmqError, counter: str | None, id_: int = 0, kind: str = "bad_request") -> None:
        """Send one error reply, then close: after it the byte stream is not read any more.

        The refusal is counted (errors_<code>, ``counter``, refused_native_<kind>) and logged throttled (broker/refusals.py).
        """
        metrics = self.messaging.metrics
        metrics.inc(f"errors_{err.code.name.lower()}")
        if counter is not None:
            metrics.inc(counter)
        self.messaging.refusals.note("native", kind, self.peer, str(err))
        self._send(reply(id_, err.to_fields(), int(err.code)))
        self._end_after_reply()

    def _send_reply(self, id_: int, result: dict[str, Any], now: bool = False) -> None:
        try:
            records = result.get("records")
            if type(records) is bytes and len(records) >= BLOB_MIN:  # a raw pull: its records are written as they are
                head, blob = reply_parts(id_, result, "records")
                self._send(head)
                self._send(blob, now=now)
                return
            data = reply(id_, result)
        except Exception as exc:  # a value no frame can carry (a bug): an error reply, and the connection goes on
            self._reply_error(id_, self.messaging.error_of(exc))
            return
        self._send(data, now=now)

    def push(self, op: str, fields: dict[str, Any]) -> None:
        self._send(push(op, fields))

    takes_frames = True  # check-backs come as frames the check pass splices from the stored bytes (checkcopy.check_push)

    def check_back(self, cb: Any) -> None:  # pragma: no cover - takes_frames is True: never called
        raise TypeError("a native connection takes check-backs as frames (send_frame)")

    def send_frame(self, frame: bytes) -> None:
        """Send one or more already encoded frames (length prefixes included), e.g. a batch of check-back pushes."""
        self._send(frame)
