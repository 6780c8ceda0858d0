"""Per-connection state: an asyncio.Protocol that frames, dispatches and replies.

- Two-phase decoding (txmq.wire.FrameDecoder): the length is checked before
  the payload is buffered, then the payload parsed.
- Requests are pipelined; replies go out in completion order, and all
  replies produced in one loop iteration leave in one write.
- Backpressure: when the transport's write buffer passes its high-water
  mark (a client that stops reading), or too many requests are in flight,
  or the pulls in flight may return more than PULL_BUDGET bytes, the
  connection stops reading until it drains; requests already read in the
  same burst wait in a backlog instead of being dispatched. Memory per
  connection is bounded by max_frame + the write buffer limit + the pull
  budget + in-flight requests.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import itertools
from functools import partial
import logging
from typing import Any

from txmq.wire import FATAL, ErrorCode, FrameDecoder, FrameError, TxmqError, parse_payload, push, reply
from txmq.wire import REQUEST

from .handlers import HANDLERS

log = logging.getLogger("txmq.conn")
_ids = itertools.count(1)

WRITE_HIGH = 4 << 20
PULL_BUDGET = 64 << 20  # reply bytes the pulls in flight on one connection may ask for


class BrokerConnection(asyncio.Protocol):
    def __init__(self, core, server_state) -> None:
        self.core = core
        self.state = server_state
        self.conn_id = next(_ids)
        self.client_id = ""
        self.transport: asyncio.Transport | None = None
        self.decoder = FrameDecoder(core.config.max_frame)
        self.authed = not core.config.auth_token
        self.inflight = 0
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._write_paused = False
        self._read_paused = False
        self._closing = False
        self._tasks: set[asyncio.Task] = set()
        self._backlog: collections.deque[bytes] = collections.deque()  # read but not dispatched (paused)
        self._out_bytes = 0
        self._pull_bytes = 0
        self.peer = ""

    # ---- asyncio.Protocol ---------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._loop = asyncio.get_running_loop()  # cached for the per-reply call_soon
        self.transport.set_write_buffer_limits(high=WRITE_HIGH)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.state.connections.add(self)
        self.core.connections += 1
        self.core.metrics.inc("connections_accepted")

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.state.connections.discard(self)
        self.core.connections -= 1
        self.core.registry.unregister_all(self)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._maybe_resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        try:
            payloads = self.decoder.feed(data)
        except TxmqError as err:
            self._fatal(0, err)
            return
        if self._backlog:
            self._backlog.extend(payloads)
            return
        self._run(payloads)

    def _run(self, payloads: list[bytes]) -> None:
        for i, payload in enumerate(payloads):
            if self._read_paused:  # a limit was hit: the rest waits until the connection drains
                self._backlog.extend(payloads[i:])
                return
            try:
                frame = parse_payload(payload)
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
        handler = HANDLERS.get(op)
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
            self._send(reply(id_, result))
            return
        self.inflight += 1
        if self.inflight == 1:
            self.core.busy_connections += 1
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
            self.core.busy_connections -= 1
        self._pull_bytes -= cost
        if not fut.cancelled() and fut.exception() is None:
            self._send(reply(id_, fut.result()))
            if self._read_paused:
                self._maybe_resume_reading()
            return
        if fut.cancelled():
            self._reply_error(id_, TxmqError("broker is shutting down", ErrorCode.SHUTTING_DOWN))
        else:
            exc = fut.exception()
            if exc is None:
                self._send(reply(id_, fut.result()))
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
        self.core.metrics.inc(f"errors_{err.code.name.lower()}")
        log.info("event=connection_refused peer=%s reason=%s", self.peer, err.code.name)
        self._send(reply(id_, err.to_fields(), int(err.code)))
        self._flush()
        self._closing = True
        if self.transport is not None:
            self.transport.close()

    def _send(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self._out.append(data)
        self._out_bytes += len(data)
        if self._out_bytes > WRITE_HIGH:
            self._flush()  # hand it to the transport now: it pauses us if the peer is not reading
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        self._out_bytes = 0
        if self._out and self.transport is not None and not self.transport.is_closing():
            out, self._out = self._out, []
            self.transport.write(b"".join(out) if len(out) > 1 else out[0])
        else:
            self._out.clear()

    def push(self, op: str, fields: dict[str, Any]) -> None:
        self._send(push(op, fields))

    def send_frame(self, frame: bytes) -> None:
        """Send one or more already encoded frames (length prefixes included), e.g. a batch of check-back pushes."""
        self._send(frame)

    def writable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and not self._write_paused

    def _pause_reading(self) -> None:
        if not self._read_paused and self.transport is not None and not self.transport.is_closing():
            self._read_paused = True
            self.transport.pause_reading()

    def _maybe_resume_reading(self) -> None:
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
