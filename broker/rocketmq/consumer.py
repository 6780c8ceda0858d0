"""The receive side of the RocketMQ 5 front end: ReceiveMessage, AckMessage, ChangeInvisibleDuration, ForwardMessageToDeadLetterQueue.

The RPCs are thin: they read the request, call the broker's consumption
service (``core.consumption``, broker/messaging/consumption.py,
transport-independent) and answer with RocketMQ's status codes; the
messages are built by ``convert.record_to_message``.
ReceiveMessage answers as RocketMQ's proxy does: a ``status`` frame, one
frame per message, then a ``delivery_timestamp`` frame; with no message
after the long poll, only the status MESSAGE_NOT_FOUND (40401), which the
SDKs take as an empty receive. docs/rocketmq.md, "Receiving".
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from ..messaging.consumption import ConsumptionService, Delivery, PopError, check_group, parse_tags
from ..messaging.sqlfilter import SqlFilterError, compile_sql

from . import convert, limits, routes
from .limits import Holds, peer_of
from .pb import definition_pb2 as d
from .pb import service_pb2 as s
from .status import Code, RmqError, of_error

if TYPE_CHECKING:
    from ..messaging import Messaging

log = logging.getLogger("txmq.rocketmq")

CLIENT_ID_HEADER = "x-mq-client-id"
DEADLINE_MARGIN_S = 0.5  # a receive answers this long before the client's deadline
DEFAULT_POLL_S = 20.0  # a receive that names no long polling timeout
MAX_ACK_ENTRIES = 1024
CLIENT_ALIVE_S = 45.0  # a client with no open stream and no request for this long no longer renews (heartbeats: every 10 s)


def _code(name: str) -> int:
    return Code.Value(name) if name in Code.keys() else Code.INTERNAL_ERROR


def _seconds(duration: Any) -> float:
    return duration.seconds + duration.nanos / 1e9


def _group(resource: Any) -> str:
    if resource.resource_namespace:
        raise PopError("ILLEGAL_CONSUMER_GROUP", "namespaces (resource_namespace) are not supported by txmq: leave it empty")
    return check_group(resource.name)


def _topic(resource: Any) -> str:
    if resource.resource_namespace:
        raise PopError("ILLEGAL_TOPIC", "namespaces (resource_namespace) are not supported by txmq: leave it empty")
    return resource.name


def _client_id(context: Any) -> str:
    try:
        for key, value in context.invocation_metadata() or ():
            if key == CLIENT_ID_HEADER:
                return value if isinstance(value, str) else value.decode("utf-8", "replace")
    except Exception:  # a context without metadata (tests)
        pass
    return ""


class ReceiveFrontend:
    """The consumer RPCs of apache.rocketmq.v2.MessagingService, over the broker's consumption service.

    ``clients``: the front end's client table (broker/rocketmq/clients.py),
    for a client's language (the body digest's form) and whether a client
    that asked for auto-renewal still lives, or the front end's settings
    (settings.py: its ``clients`` and ``consumer_max_attempts``); None works
    too (Java's digest form, no renewal). ``max_attempts(group)``: a group's
    deliveries before the dead-letter topic (None: the settings', else 16).
    ``long_polls``: the receives waiting, bounded per client, per connection
    and in all (limits.py; the settings', else the default bounds).
    """

    def __init__(self, messaging: Messaging, clients: Any = None, *,
                 max_attempts: Callable[[str], int | None] | None = None, long_polls: Holds | None = None) -> None:
        self.messaging = messaging
        settings = None
        if clients is not None and hasattr(clients, "clients") and hasattr(clients, "consumer_max_attempts"):
            settings, clients = clients, clients.clients
            if max_attempts is None:
                def max_attempts(group: str) -> int:
                    return settings.consumer_max_attempts
        self.clients = clients
        # Receives waiting for a message, bounded per client, per connection and in all (limits.py).
        if long_polls is None:
            long_polls = settings.long_polls if settings is not None else limits.default_long_polls()
        self.long_polls: Holds = long_polls
        self._max_attempts = max_attempts
        self._attached: ConsumptionService | None = None

    @property
    def pop(self) -> ConsumptionService:
        """The broker's consumption service, the one the core built when the store opened (after this front end bound its
        port); told on first use what this front end knows: whether its clients live, its groups' attempts."""
        pop = self.messaging.consumption
        if pop is not self._attached:
            pop.attach(max_attempts=self._max_attempts, client_alive=self._alive if self.clients is not None else None)
            self._attached = pop
        return pop

    def _alive(self, client_id: str) -> bool:
        c = self.clients.get(client_id)
        return c is not None and (bool(c.streams) or time.monotonic() - c.last_seen < CLIENT_ALIVE_S)

    def _language(self, client_id: str) -> int:
        if self.clients is None or not client_id:
            return d.LANGUAGE_UNSPECIFIED
        try:
            return self.clients.language(client_id)
        except Exception:
            return d.LANGUAGE_UNSPECIFIED

    # ---- ReceiveMessage --------------------------------------------------
    async def receive(self, request: s.ReceiveMessageRequest, context: Any) -> AsyncIterator[s.ReceiveMessageResponse]:
        """Stream: status, the messages, delivery_timestamp; or only a status (MESSAGE_NOT_FOUND or the refusal)."""
        client_id = _client_id(context)
        peer = ""
        held = False  # counted in long_polls: given back when the stream ends
        try:
            try:
                group, topic, queue_id, tags, batch, invisible, poll = self._receive_args(request, context)
                routes.check_receive(self.messaging, topic)  # an unknown topic: TOPIC_NOT_FOUND, as RocketMQ's proxy answers it
                busy = None
                if poll > 0:
                    peer = peer_of(context)
                    busy = self.long_polls.take(client_id, peer)
                    if busy is None:
                        held = True
                    else:  # as RocketMQ's broker: what is there is taken at once; only a receive that would wait is refused
                        poll = 0.0
                got = await self.pop.receive(group, topic, queue_id, tags, batch, invisible, poll,
                                             auto_renew=request.auto_renew, client_id=client_id or None)
            except PopError as exc:
                yield s.ReceiveMessageResponse(status=d.Status(code=_code(exc.code), message=exc.message))
                return
            except RmqError as exc:
                yield s.ReceiveMessageResponse(status=d.Status(code=exc.code, message=exc.message))
                return
            except Exception as exc:  # never a broken stream for the SDK: a status it can read
                self.messaging.refusals.internal("rocketmq.ReceiveMessage", exc)
                yield s.ReceiveMessageResponse(status=of_error(exc))
                return
            if not got and busy is not None:
                # RocketMQ's answer when the broker holds too many waiting receives: the SDKs receive again later.
                reason = f"polling full: {busy}"
                self.messaging.refusals.note("rocketmq", "busy", peer, reason)
                yield s.ReceiveMessageResponse(status=d.Status(code=Code.TOO_MANY_REQUESTS, message=reason))
                return
            if not got:
                yield s.ReceiveMessageResponse(status=d.Status(code=Code.MESSAGE_NOT_FOUND, message="no new message"))
                return
            self.messaging.metrics.inc("rmq_messages_received", len(got))
            sent = 0
            # FIFO: the queues with a message that could not be sent; the rest of each in this batch is held back (ready again)
            stopped: set[int] = set()
            held_back: list[Delivery] = []
            try:
                yield s.ReceiveMessageResponse(status=d.Status(code=Code.OK, message="OK"))
                language = self._language(client_id)
                for m in got:
                    if stopped and m.record.queue_id in stopped:
                        held_back.append(m)
                        sent += 1
                        continue
                    try:
                        msg = convert.record_to_message(m.record, language=language, delivery_attempt=m.attempt,
                                                        receipt_handle=m.receipt_handle,
                                                        invisible_duration_ms=int(m.invisible_s * 1000))
                    except Exception as exc:  # in flight, not renewed: received again later, after max attempts dead-lettered
                        log.error("event=rmq_message_unconvertible topic=%s queue_id=%d queue_offset=%d error=%r",
                                  m.record.topic, m.record.queue_id, m.record.queue_offset, exc)
                        self.pop.release(group, topic, [m], unsent=False)
                        if self.pop.fifo(group):  # the later messages of its queue must not go out ahead of it
                            stopped.add(m.record.queue_id)
                        sent += 1
                        continue
                    sent += 1  # handed out once taken from the generator, even if the stream ends at this yield
                    yield s.ReceiveMessageResponse(message=msg)
            finally:
                unsent = held_back + got[sent:]  # in the batch's order (release puts each queue's back in front, in order)
                if unsent:  # the stream ended first (cancelled, deadline, connection lost), or held back: ready again
                    self.pop.release(group, topic, unsent, unsent=True)
            ts = s.ReceiveMessageResponse()
            ts.delivery_timestamp.FromMilliseconds(int(time.time() * 1000))
            yield ts
        finally:
            if held:  # the receive's place among the long polls, until its stream ends (a client that does not read holds it)
                self.long_polls.give(client_id, peer)

    def _receive_args(self, request: s.ReceiveMessageRequest, context: Any):
        group = _group(request.group)
        mq = request.message_queue
        topic = _topic(mq.topic)
        fe = request.filter_expression
        if fe.type == d.SQL:
            try:
                tags = compile_sql(fe.expression)  # over each message's properties (the tag as TAGS)
            except SqlFilterError as e:
                raise PopError("ILLEGAL_FILTER_EXPRESSION", f"SQL92 expression {fe.expression[:80]!r} does not compile: {e}") from None
        elif fe.type not in (d.FILTER_TYPE_UNSPECIFIED, d.TAG):
            raise PopError("ILLEGAL_FILTER_EXPRESSION", f"filter type {fe.type} is not TAG or SQL")
        else:
            tags = parse_tags(fe.expression)
        invisible = None
        if request.HasField("invisible_duration"):
            invisible = _seconds(request.invisible_duration)
        cfg = self.pop.config
        if request.HasField("long_polling_timeout"):
            poll = _seconds(request.long_polling_timeout)
            if poll < 0:
                raise PopError("ILLEGAL_POLLING_TIME", f"long polling timeout {poll:g} s is negative")
        else:
            poll = DEFAULT_POLL_S
        poll = min(poll, cfg.max_poll_s)
        remaining = None
        try:
            remaining = context.time_remaining()
        except Exception:
            pass
        if remaining is not None:  # answer before the client's deadline (long polling + its request timeout)
            poll = max(0.0, min(poll, remaining - DEADLINE_MARGIN_S))
        return group, topic, mq.id, tags, request.batch_size, invisible, poll

    # ---- AckMessage ------------------------------------------------------
    async def ack(self, request: s.AckMessageRequest, context: Any) -> s.AckMessageResponse:
        """Per-entry status; the top-level one is the entries' code when they all have the same (OK when all are), else
        MULTIPLE_RESULTS, as RocketMQ's proxy answers (AckMessageActivity)."""
        out = s.AckMessageResponse()
        try:
            group = _group(request.group)
            topic = _topic(request.topic)
            if not request.entries:
                raise PopError("BAD_REQUEST", "no entries to acknowledge")
            if len(request.entries) > MAX_ACK_ENTRIES:
                raise PopError("BAD_REQUEST", f"{len(request.entries)} entries: at most {MAX_ACK_ENTRIES} per request")
        except PopError as exc:
            out.status.code, out.status.message = _code(exc.code), exc.message
            return out
        failed = 0
        for entry in request.entries:
            r = out.entries.add(message_id=entry.message_id, receipt_handle=entry.receipt_handle)
            try:
                self.pop.ack(group, topic, entry.receipt_handle)
                r.status.code, r.status.message = Code.OK, "OK"
            except PopError as exc:
                failed += 1
                r.status.code, r.status.message = _code(exc.code), exc.message
        self.messaging.metrics.inc("rmq_messages_acked", len(request.entries) - failed)
        if not failed:
            out.status.code, out.status.message = Code.OK, "OK"
        elif len({e.status.code for e in out.entries}) == 1:  # one entry, or every entry refused alike
            out.status.CopyFrom(out.entries[0].status)
        else:
            out.status.code = Code.MULTIPLE_RESULTS
            out.status.message = f"{failed} of {len(out.entries)} entries failed: see each entry's status"
        return out

    # ---- ChangeInvisibleDuration ----------------------------------------
    async def change_invisible_duration(self, request: s.ChangeInvisibleDurationRequest, context: Any) -> s.ChangeInvisibleDurationResponse:
        """The new receipt handle; on a refusal the request's handle comes back (the SDKs store whatever is returned)."""
        out = s.ChangeInvisibleDurationResponse(receipt_handle=request.receipt_handle)
        try:
            group, topic = _group(request.group), _topic(request.topic)
            # the duration first (0 s to the service's maximum), then the handle, as RocketMQ's proxy checks them
            seconds = self.pop.check_invisible(_seconds(request.invisible_duration), receive=False)
            out.receipt_handle = self.pop.change_invisible(group, topic, request.receipt_handle, seconds)
        except PopError as exc:
            out.status.code, out.status.message = _code(exc.code), exc.message
            return out
        out.status.code, out.status.message = Code.OK, "OK"
        return out

    # ---- ForwardMessageToDeadLetterQueue --------------------------------
    async def forward_to_dlq(self, request: s.ForwardMessageToDeadLetterQueueRequest, context: Any) -> s.ForwardMessageToDeadLetterQueueResponse:
        out = s.ForwardMessageToDeadLetterQueueResponse()
        try:
            group, topic = _group(request.group), _topic(request.topic)
            await self.pop.forward_to_dlq(group, topic, request.receipt_handle)
        except PopError as exc:
            out.status.code, out.status.message = _code(exc.code), exc.message
            return out
        out.status.code, out.status.message = Code.OK, "OK"
        return out

    async def close(self) -> None:
        if getattr(self.messaging, "consumption", None) is not None:  # not built when the broker stops before its store opened
            await self.pop.close()
