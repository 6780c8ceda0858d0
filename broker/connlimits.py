"""What the TCP front ends' connections share: connection limits, output batching and backpressure.

``LimitedConnection`` is the base of the native port's ``BrokerConnection``
(native/connection.py) and the remoting port's ``RemotingConnection``
(remoting/server.py); each front end keeps its framing, its dispatch and
how its replies are encoded. What lives here, the same on both ports:

- Admission: connections beyond the port's cap, or beyond
  --max-connections-per-ip from one address, are refused as soon as they
  are accepted (one reply saying why, then closed), counted and logged
  (``core.refusals``, broker/refusals.py: at most one line per 10 s).
- The bytes all connections hold in partly received frames stay under
  --partial-frame-budget; a connection must send its first request within
  --auth-timeout and finish each frame within --frame-timeout of its first
  byte (``sweep()``, run by the front end).
- Output: the replies produced in one loop iteration leave in one write at
  its end (at once when asked, or past WRITE_HIGH queued bytes).
- Backpressure: a full write buffer, too many requests in flight or pulls
  that may return more than PULL_BUDGET bytes stop reading until the
  connection drains; frames read meanwhile wait in a backlog.
- Closing after an error reply: the broker shuts its side down and reads
  and discards what the client still sends for up to LINGER_S, so that the
  client does not lose the reply to a reset.

The ``shared`` object a connection is built with (native's ServerState,
remoting's RemotingFrontend) holds ``connections``, ``by_ip``,
``partial_frame_bytes``, ``working`` and ``inflight``. ``working`` counts the
requests in flight that wait on the broker (every one but pulls, which may
wait on a long poll): the broker's test for a lone client
(``Broker._lone_client``) and the busy-poll arming read it. It counts
requests, not connections: a RocketMQ 4 Java client sends the requests of
all its threads over one connection.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable

WRITE_HIGH = 4 << 20
BLOB_MIN = 256 << 10  # a buffer this large (a raw pull's records) is handed to the transport as it is, not joined
# After an error reply that ends a connection, the broker shuts its side
# down and reads and discards what the client still sends for up to this
# long before closing: closing with unread input would reset the connection
# and the client could lose the reply.
LINGER_S = 1.0
PULL_BUDGET = 64 << 20  # reply bytes the pulls in flight on one connection may ask for


class LogThrottle:
    """Counts events and says when to log them: at most one line per ``every_s``, with the count since the last one.

    A flood of refused connections (or failed requests) must not flood the log.
    """

    def __init__(self, every_s: float, clock: Callable[[], float] | None = None) -> None:
        self.every_s = every_s
        self.clock = clock  # None: time.monotonic
        self._count = 0  # events not logged yet
        self._logged_at = float("-inf")

    def note(self) -> int:
        """Count one event; returns how many to log now (the count is then reset), 0 while a line is not due."""
        self._count += 1
        now = self.clock() if self.clock is not None else time.monotonic()
        if now - self._logged_at < self.every_s:
            return 0
        count, self._count, self._logged_at = self._count, 0, now
        return count


@dataclass(frozen=True)
class LimitCounters:
    """The names a front end counts its admissions and limit refusals under."""

    accepted: str
    refused: str
    refused_per_ip: str
    partial_frame_refusals: str
    auth_timeouts: str
    frame_timeouts: str


class LimitedConnection(asyncio.Protocol):
    """A connection held to the broker's connection limits; subclasses supply the wire.

    Hooks: ``_refusal(message)`` (the bytes that tell a client refused at
    accept time why), ``_close_for(counter, kind, message)`` (reply and
    close for a limit: kind is "busy", "auth_timeout" or "frame_timeout"),
    ``_drop_buffered()``, ``_forget()`` (a counted connection is gone) and
    ``_run(frames)`` (dispatch what the backlog held).
    """

    counters: LimitCounters
    frontend: str  # the front end's name in refusals (broker/refusals.py): "native", "remoting"
    first_request = "request"  # what --auth-timeout waits for when a token is configured

    def __init__(self, messaging: Any, shared: Any) -> None:
        self.messaging = messaging  # the messaging service (broker/messaging/): config, metrics, refusals, forget_client, busy_poll_arm
        self.shared = shared
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.ip = ""
        self._partial = 0  # bytes this connection adds to shared.partial_frame_bytes
        self._frame_started = 0.0  # loop time of the first byte of the frame being received; 0 when none
        self._first_by = 0.0  # loop time the first request is due by; 0 once it came
        self._counted = False  # accepted (not refused at once): counted in the connection figures
        self._closing = False
        self._read_paused = False
        self._write_paused = False
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._out_blob = False  # a buffer of BLOB_MIN bytes or more is queued: written with writelines
        self._flush_scheduled = False
        self.inflight = 0
        self._pull_bytes = 0
        self._backlog: list[bytes] = []  # read but not dispatched (reading paused)

    # ---- accepting ------------------------------------------------------------------------
    def _open(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._loop = asyncio.get_running_loop()  # cached for the per-reply call_soon
        self.transport.set_write_buffer_limits(high=WRITE_HIGH)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.ip = str(peer[0]) if isinstance(peer, tuple) else self.peer

    def _admit(self, cap: int | None, cap_flag: str) -> None:
        """Count the connection in, or refuse it at once when it is over ``cap`` or the per-address limit."""
        shared, cfg, names = self.shared, self.messaging.config, self.counters
        if cap is not None and len(shared.connections) >= cap:
            self._refuse_at_once(names.refused, f"too many connections: the broker's limit is {cap} ({cap_flag})")
            return
        per_ip = cfg.max_connections_per_ip
        if per_ip and shared.by_ip.get(self.ip, 0) >= per_ip:
            self._refuse_at_once(names.refused_per_ip,
                                 f"too many connections from {self.ip}: the broker's limit is {per_ip} per address (--max-connections-per-ip)")
            return
        self._counted = True
        shared.connections.add(self)
        shared.by_ip[self.ip] = shared.by_ip.get(self.ip, 0) + 1
        self.messaging.metrics.inc(names.accepted)
        if cfg.auth_timeout_s:
            self._first_by = self._loop.time() + cfg.auth_timeout_s

    def _refuse_at_once(self, counter: str, message: str) -> None:
        """Close a connection over a connection limit as soon as it is accepted: its descriptor is freed at once."""
        self._closing = True
        self.messaging.metrics.inc(counter)
        self.messaging.refusals.note(self.frontend, "connection_limit", self.peer, message)
        try:
            self.transport.write(self._refusal(message))  # one small frame: fits the socket buffer
        finally:
            self.transport.close()

    def _refusal(self, message: str) -> bytes:
        raise NotImplementedError

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._release_partial()
        if not self._counted:
            return
        self._counted = False
        shared = self.shared
        shared.connections.discard(self)
        n = shared.by_ip.get(self.ip, 0) - 1
        if n > 0:
            shared.by_ip[self.ip] = n
        else:
            shared.by_ip.pop(self.ip, None)
        self.messaging.forget_client(self)  # out of every producer and consumer group
        self._forget()

    def _forget(self) -> None:
        """What else a front end lets go of when a counted connection is lost."""

    # ---- frames being received ---------------------------------------------------------------
    def _hold(self, held: int, completed: bool) -> bool:
        """Account for the ``held`` bytes of a frame still being received; False if the connection was refused for them."""
        delta = held - self._partial
        if delta:
            shared, cfg = self.shared, self.messaging.config
            if delta > 0 and shared.partial_frame_bytes + delta > cfg.partial_frame_budget:
                self._close_for(self.counters.partial_frame_refusals, "busy",
                                f"the broker holds too many bytes of frames still being received (--partial-frame-budget "
                                f"{cfg.partial_frame_budget}); retry later")
                return False
            shared.partial_frame_bytes += delta
            self._partial = held
        if not held:
            self._frame_started = 0.0
        elif completed or not self._frame_started:
            self._frame_started = self._loop.time()  # a new frame began in this read
        return True

    def _release_partial(self) -> None:
        if self._partial:
            self.shared.partial_frame_bytes -= self._partial
            self._partial = 0
        self._frame_started = 0.0
        self._drop_buffered()

    def _drop_buffered(self) -> None:
        """Let go of the bytes of a frame that will never be read."""
        raise NotImplementedError

    def sweep(self, now: float) -> None:
        """Close the connection if its first request or its current frame is overdue (called by the front end)."""
        if self._closing:
            return
        cfg = self.messaging.config
        if self._first_by and now >= self._first_by:
            what = self.first_request if cfg.auth_token else "request"
            self._close_for(self.counters.auth_timeouts, "auth_timeout",
                            f"no {what} within {cfg.auth_timeout_s:g}s of connecting (--auth-timeout)")
        elif self._frame_started and cfg.frame_timeout_s and not self._read_paused and now - self._frame_started >= cfg.frame_timeout_s:
            self._close_for(self.counters.frame_timeouts, "frame_timeout",
                            f"frame not complete {cfg.frame_timeout_s:g}s after its first byte (--frame-timeout)")

    def _close_for(self, counter: str, kind: str, message: str) -> None:
        raise NotImplementedError

    # ---- requests in flight --------------------------------------------------------------------
    def _track(self, fut: asyncio.Future, cost: int = 0) -> None:
        """Count a request in flight (``cost``: the reply bytes a pull may return); reading pauses past the limits."""
        self.inflight += 1
        if not cost:
            self.shared.working += 1
        if self.inflight >= self.messaging.config.max_inflight_per_conn:
            self._pause_reading()
        self.shared.inflight.add(fut)
        if cost:
            self._pull_bytes += cost
            if self._pull_bytes > PULL_BUDGET:
                self._pause_reading()

    def _untrack(self, fut: asyncio.Future, cost: int) -> None:
        self.shared.inflight.discard(fut)
        self.inflight -= 1
        if not cost:
            self.shared.working -= 1
        self._pull_bytes -= cost

    # ---- output --------------------------------------------------------------------------------
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
            arm = self.messaging.busy_poll_arm
            if arm is not None and self.shared.working <= 1:
                arm()  # a lone client's next request: keep a CPU awake through its fsync (broker/busypoll.py)
        else:
            self._out.clear()

    def _end_after_reply(self) -> None:
        """Close once the error reply queued last is written: after it the byte stream is not read any more."""
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

    def writable(self) -> bool:
        return self.transport is not None and not self._closing and not self.transport.is_closing() and not self._write_paused

    def close(self) -> None:
        if self.transport is not None:
            self._flush()
            self.transport.close()

    # ---- backpressure --------------------------------------------------------------------------
    def pause_writing(self) -> None:
        self._write_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._maybe_resume_reading()

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
            and self.inflight < self.messaging.config.max_inflight_per_conn // 2
            and self._pull_bytes <= PULL_BUDGET // 2
            and self.transport is not None
            and not self.transport.is_closing()
        ):
            self._read_paused = False
            if self._backlog:
                backlog, self._backlog = self._backlog, []
                self._run(backlog)
                if self._read_paused or self._closing:
                    return
            self.transport.resume_reading()

    def _run(self, frames: list[bytes]) -> None:
        raise NotImplementedError
