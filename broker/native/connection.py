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
  Each refusal gets an error reply when one can be sent, and is counted.
  Authenticated connections may stay idle for as long as they like.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import itertools
from functools import partial
import logging
from typing import Any

from txmq.wire import FATAL, ErrorCode, FrameDecoder, FrameError, TxmqError, parse_payload, push, reply, reply_parts
from txmq.wire import REQUEST


log = logging.getLogger("txmq.conn")
_ids = itertools.count(1)

WRITE_HIGH = 4 << 20
BLOB_MIN = 256 << 10  # a reply value this large (raw pull records) is written as its own buffer, not copied into the frame
# After an error reply that ends a connection, the broker shuts its side
# down and reads and discards what the client still sends for up to this
# long before closing: closing with unread input would reset the connection
# and the client could lose the reply.
LINGER_S = 1.0
PULL_BUDGET = 64 << 20  # reply bytes the pulls in flight on one connection may ask for


class BrokerConnection(asyncio.Protocol):
    def __init__(self, core, server_state) -> None:
        self.core = core
        self.state = server_state
        self.conn_id = next(_ids)
        self.client_id = ""
        self.transport: asyncio.Transport | None = None
        cfg = core.config
        self.authed = not cfg.auth_token
        self.decoder = FrameDecoder(cfg.max_frame if self.authed else min(cfg.max_preauth_frame, cfg.max_frame))
        self._partial = 0  # bytes this connection adds to state.partial_frame_bytes
        self._frame_started = 0.0  # loop time of the first byte of the frame being received; 0 when none
        self._hello_by = 0.0  # loop time the first request (hello, with a token) is due by; 0 once it came
        self._counted = False  # accepted (not refused at once): counted in the connection figures
        self.ip = ""
        self.inflight = 0
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._write_paused = False
        self._read_paused = False
        self._closing = False
        self._tasks: set[asyncio.Task] = set()
        self._backlog: collections.deque[bytes] = collections.deque()  # read but not dispatched (paused)
        self._out_bytes = 0
        self._out_blob = False  # a buffer of BLOB_MIN bytes or more is queued: written with writelines
        self._pull_bytes = 0
        self.peer = ""

    # ---- asyncio.Protocol ---------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._loop = asyncio.get_running_loop()  # cached for the per-reply call_soon
        self.transport.set_write_buffer_limits(high=WRITE_HIGH)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.ip = str(peer[0]) if isinstance(peer, tuple) else self.peer
        state, cfg = self.state, self.core.config
        cap = cfg.max_connections
        if cap is not None and len(state.connections) >= cap:
            self._refuse_at_once("connections_refused", f"too many connections: the broker's limit is {cap} (--max-connections)")
            return
        per_ip = cfg.max_connections_per_ip
        if per_ip and state.by_ip.get(self.ip, 0) >= per_ip:
            self._refuse_at_once("connections_refused_per_ip",
                                 f"too many connections from {self.ip}: the broker's limit is {per_ip} per address (--max-connections-per-ip)")
            return
        self._counted = True
        state.connections.add(self)
        state.by_ip[self.ip] = state.by_ip.get(self.ip, 0) + 1
        self.core.metrics.inc("connections_accepted")
        if cfg.auth_timeout_s:
            self._hello_by = self._loop.time() + cfg.auth_timeout_s

    def _refuse_at_once(self, counter: str, message: str) -> None:
        """Close a connection over a connection limit as soon as it is accepted: its descriptor is freed at once."""
        self._closing = True
        metrics = self.core.metrics
        metrics.inc(counter)
        metrics.inc("errors_busy")
        self.state.note_refusal(counter, self.peer)
        err = TxmqError(message, ErrorCode.BUSY)
        try:
            self.transport.write(reply(0, err.to_fields(), int(err.code)))  # one small frame: fits the socket buffer
        finally:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._release_partial()
        if not self._counted:
            return
        self._counted = False
        state = self.state
        state.connections.discard(self)
        n = state.by_ip.get(self.ip, 0) - 1
        if n > 0:
            state.by_ip[self.ip] = n
        else:
            state.by_ip.pop(self.ip, None)
        self.core.registry.unregister_all(self)
        self.core.consumer_registry.unregister_all(self)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._maybe_resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        if not self.authed:
            self._received_before_hello(data)
            return
        arm = self.core.busy_poll.arm
        if arm is not None and self.state.busy <= 1:
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
                decoder.max_frame = self.core.config.max_frame
                if decoder.buffered:
                    self.data_received(b"")
                return

    def _held(self, completed: bool) -> bool:
        """Account for the bytes of a frame still being received; False if the connection was refused for them."""
        held = self.decoder.buffered
        delta = held - self._partial
        if delta:
            state, cfg = self.state, self.core.config
            if delta > 0 and state.partial_frame_bytes + delta > cfg.partial_frame_budget:
                self._close_with(TxmqError(
                    f"the broker holds too many bytes of frames still being received (--partial-frame-budget "
                    f"{cfg.partial_frame_budget}); retry later", ErrorCode.BUSY), "partial_frame_refusals")
                return False
            state.partial_frame_bytes += delta
            self._partial = held
        if not held:
            self._frame_started = 0.0
        elif completed or not self._frame_started:
            self._frame_started = self._loop.time()  # a new frame began in this read
        return True

    def _release_partial(self) -> None:
        if self._partial:
            self.state.partial_frame_bytes -= self._partial
            self._partial = 0
        self._frame_started = 0.0
        if self.decoder.buffered:
            self.decoder = FrameDecoder(0)  # what was buffered is never read: let it go now

    def sweep(self, now: float) -> None:
        """Close the connection if its first request or its current frame is overdue (called by the server)."""
        if self._closing:
            return
        cfg = self.core.config
        if self._hello_by and now >= self._hello_by:
            what = "hello with the broker's token" if cfg.auth_token else "request"
            self._close_with(TxmqError(f"no {what} within {cfg.auth_timeout_s:g}s of connecting (--auth-timeout)",
                                       ErrorCode.AUTH_REQUIRED), "auth_timeouts")
        elif self._frame_started and cfg.frame_timeout_s and not self._read_paused and now - self._frame_started >= cfg.frame_timeout_s:
            self._close_with(TxmqError(f"frame not complete {cfg.frame_timeout_s:g}s after its first byte (--frame-timeout)",
                                       ErrorCode.MALFORMED_FRAME), "frame_timeouts")

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
            expected = self.core.config.auth_token.encode()
            if not isinstance(token, str) or not hmac.compare_digest(token.encode(), expected):
                self.core.metrics.inc("auth_failures")
                log.warning("event=auth_failed peer=%s", self.peer)
                self._fatal(id_, TxmqError("authentication failed: wrong token", ErrorCode.AUTH_FAILED))
                return
            self.authed = True
        if self._hello_by:
            self._hello_by = 0.0
        handler = self.state.handlers.get(op)
        if handler is None:
            self._reply_error(id_, TxmqError(f"unknown operation {op[:64]!r}", ErrorCode.UNKNOWN_OPERATION))
            return
        if self.core.draining and op not in ("heartbeat", "broker_info"):
            self._reply_error(id_, TxmqError("broker is shutting down", ErrorCode.SHUTTING_DOWN))
            return
        try:
            result = handler(self.core, self, fields)
        except TxmqError as err:
            self._reply_error(id_, err)
            return
        except Exception as exc:  # a bug: answer, log, keep serving
            self._reply_error(id_, self.core.store_error(exc))
            return
        if isinstance(result, dict):
            self._send_reply(id_, result)
            return
        self.inflight += 1
        if self.inflight == 1:
            self.state.busy += 1
        if self.inflight >= self.core.config.max_inflight_per_conn:
            self._pause_reading()
        fut = result if isinstance(result, asyncio.Future) else asyncio.ensure_future(result)
        self.state.inflight.add(fut)
        if op == "pull":  # the one reply whose size the client picks
            mb = fields.get("max_bytes")
            cost = min(mb, 64 << 20) if type(mb) is int and mb > 0 else 1 << 20
            self._pull_bytes += cost
            if self._pull_bytes > PULL_BUDGET:
                self._pause_reading()
            fut.add_done_callback(partial(self._done, id_, cost=cost))
            return
        fut.add_done_callback(partial(self._done, id_))

    def _done(self, id_: int, fut: asyncio.Future, cost: int = 0) -> None:
        self.state.inflight.discard(fut)
        self.inflight -= 1
        if self.inflight == 0:
            self.state.busy -= 1
        self._pull_bytes -= cost
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
                self._reply_error(id_, self.core.store_error(exc))
        self._maybe_resume_reading()

    # ---- output ---------------------------------------------------------------
    def _reply_error(self, id_: int, err: TxmqError) -> None:
        self.core.metrics.inc(f"errors_{err.code.name.lower()}")
        self._send(reply(id_, err.to_fields(), int(err.code)))

    def _fatal(self, id_: int, err: TxmqError) -> None:
        assert err.code in FATAL or err.code == ErrorCode.MALFORMED_FRAME
        self._close_with(err, None, id_)

    def _close_with(self, err: TxmqError, counter: str | None, id_: int = 0) -> None:
        """Send one error reply, then close: after it the byte stream is not read any more."""
        metrics = self.core.metrics
        metrics.inc(f"errors_{err.code.name.lower()}")
        if counter is not None:
            metrics.inc(counter)
        log.info("event=connection_refused peer=%s reason=%s", self.peer, counter or err.code.name)
        self._send(reply(id_, err.to_fields(), int(err.code)))
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
        transport.write_eof()  # the reply, then end of stream
        if self._read_paused:
            self._read_paused = False
            transport.resume_reading()  # drain what the client still sends (data_received drops it)
        self._loop.call_later(LINGER_S, transport.close)

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
            self._reply_error(id_, self.core.store_error(exc))
            return
        self._send(data, now=now)

    def _send(self, data: bytes, now: bool = False) -> None:
        """Queue data for the write at the end of this loop iteration; ``now``: write what is queued at once."""
        if self._closing or self.transport is None or self.transport.is_closing():
            return
        self._out.append(data)
        self._out_bytes += len(data)
        if len(data) >= BLOB_MIN:
            self._out_blob = True
        if now or self._out_bytes > WRITE_HIGH:
            self._write_out()  # over the limit: hand it to the transport now, it pauses us if the peer is not reading
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        self._write_out()

    def _write_out(self) -> None:
        self._out_bytes = 0
        blob, self._out_blob = self._out_blob, False
        if self._out and self.transport is not None and not self.transport.is_closing():
            out, self._out = self._out, []
            if len(out) == 1:
                self.transport.write(out[0])
            elif blob:  # a large buffer among them: each handed over as it is (writev), not joined
                self.transport.writelines(out)
            else:
                self.transport.write(b"".join(out))
            arm = self.core.busy_poll.arm
            if arm is not None and self.state.busy <= 1:
                arm()  # and for the lone client's next request
        else:
            self._out.clear()

    def push(self, op: str, fields: dict[str, Any]) -> None:
        self._send(push(op, fields))

    def send_frame(self, frame: bytes) -> None:
        """Send one or more already encoded frames (length prefixes included), e.g. a batch of check-back pushes."""
        self._send(frame)

    def writable(self) -> bool:
        return self.transport is not None and not self._closing and not self.transport.is_closing() and not self._write_paused

    def _pause_reading(self) -> None:
        if not self._read_paused and self.transport is not None and not self.transport.is_closing():
            self._read_paused = True
            self.transport.pause_reading()

    def _maybe_resume_reading(self) -> None:
        if self._frame_started and self._read_paused:
            self._frame_started = self._loop.time()  # the frame's time runs only while it is being read
        if (
            self._read_paused
            and not self._write_paused
            and self.inflight < self.core.config.max_inflight_per_conn // 2
            and self._pull_bytes <= PULL_BUDGET // 2
            and self.transport is not None
            and not self.transport.is_closing()
        ):
            self._read_paused = False
            if self._backlog:
                backlog, self._backlog = list(self._backlog), collections.deque()
                self._run(backlog)
                if self._read_paused or self._closing:
                    return
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None:
            self._flush()
            self.transport.close()
