"""apache.rocketmq.v2.MessagingService: one method per RPC, named as in service.proto.

Each method takes the parsed request and the grpc.aio context and returns
the response (server.py parses, catches errors and turns them into the
response's ``status``). Every RPC txmq does not serve answers RocketMQ's
UNSUPPORTED code in the status, never a transport error.

The receive side (ReceiveMessage, AckMessage, ChangeInvisibleDuration,
ForwardMessageToDeadLetterQueue) lives in consumer.py (``ReceiveFrontend``);
until that module is there, they answer UNSUPPORTED too.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, AsyncIterator

from txmq.wire import TxmqError

from . import producer, routes
from .clients import MAX_TOPICS, Client, TelemetryStream
from .pb import definition_pb2 as d
from .pb import service_pb2 as s
from .settings import FrontendSettings, answer_settings
from .status import Code, RmqError, of_error, ok, unsupported

if TYPE_CHECKING:
    from ..messaging import Messaging

log = logging.getLogger("txmq.rocketmq")

BROKER_NAME = "txmq"  # the one broker of every route (RocketMQ's routes name brokers; txmq is one)
MAX_GROUP_LEN = 255


# The request headers of the RPC this task serves, parsed once (server.py checks them first; the
# service methods read the client id again): (its context, the headers). One RPC is one task in grpc.aio.
_REQUEST_HEADERS: ContextVar[tuple[Any, dict[str, str]] | None] = ContextVar("txmq_rmq_request_headers", default=None)


def metadata(context: Any) -> dict[str, str]:
    """The request's text headers (binary ones left out), parsed once per RPC."""
    seen = _REQUEST_HEADERS.get()
    if seen is not None and seen[0] is context:
        return seen[1]
    try:
        md = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    except Exception:  # a context without metadata (tests calling methods directly)
        md = {}
    _REQUEST_HEADERS.set((context, md))
    return md


def client_id_of(context: Any) -> str:
    return metadata(context).get("x-mq-client-id", "")[:256]


class MessagingService:
    """The RPCs, on the broker's messaging service; ``settings`` (settings.py) holds the front end's address, limits and clients."""

    def __init__(self, messaging: Messaging, settings: FrontendSettings) -> None:
        self.messaging = messaging
        self.settings = settings
        self.host = settings.host
        self.port = settings.port
        self.clients = settings.clients
        self.receive: Any = None  # consumer.ReceiveFrontend when that module is there
        try:
            from .consumer import ReceiveFrontend  # the receive side (its own module)
        except ImportError as exc:
            if exc.name != f"{__package__}.consumer":
                raise
            ReceiveFrontend = None  # noqa: N806
        if ReceiveFrontend is not None:
            self.receive = ReceiveFrontend(messaging, settings.clients, long_polls=settings.long_polls)

    async def close(self) -> None:
        self.clients.close_all("")
        if self.receive is not None:
            await self.receive.close()

    # ---- routes and clients --------------------------------------------------------
    def endpoints(self, asked: d.Endpoints | None = None) -> d.Endpoints:
        """The endpoints of routes: the ones the client reached us by, else where we listen."""
        if asked is not None and len(asked.addresses) > 0:
            out = d.Endpoints()
            out.CopyFrom(asked)
            return out
        host = self.host
        scheme = d.IPv6 if ":" in host else d.IPv4 if host.replace(".", "").isdigit() else d.DOMAIN_NAME
        return d.Endpoints(scheme=scheme, addresses=[d.Address(host=host, port=self.port)])

    def queue(self, topic: str, qid: int, endpoints: d.Endpoints) -> d.MessageQueue:
        mq = d.MessageQueue(id=qid, permission=d.READ_WRITE, accept_message_types=routes.accept_types(self.messaging, topic))
        mq.topic.name = topic
        mq.broker.name = BROKER_NAME
        mq.broker.id = 0
        mq.broker.endpoints.CopyFrom(endpoints)
        return mq

    async def QueryRoute(self, req: s.QueryRouteRequest, context: Any) -> s.QueryRouteResponse:  # noqa: N802
        topic = producer.topic_of(req.topic)
        n = routes.route_queues(self.messaging, topic)  # an unknown topic: TOPIC_NOT_FOUND, as RocketMQ 5 answers it
        eps = self.endpoints(req.endpoints)
        return s.QueryRouteResponse(status=ok(), message_queues=[self.queue(topic, q, eps) for q in range(n)])

    async def QueryAssignment(self, req: s.QueryAssignmentRequest, context: Any) -> s.QueryAssignmentResponse:  # noqa: N802
        topic = producer.topic_of(req.topic)
        group = group_of(req.group)
        n = routes.route_queues(self.messaging, topic)
        eps = self.endpoints(req.endpoints)
        if self.messaging.is_fifo_group(group):
            # A FIFO group, as RocketMQ's proxy answers it (RouteActivity.queryAssignment): one assignment per queue.
            return s.QueryAssignmentResponse(status=ok(), assignments=[d.Assignment(message_queue=self.queue(topic, q, eps))
                                                                      for q in range(n)])
        # POP-style, as RocketMQ's proxy answers it: one queue with id -1 per broker, the broker picks the queues.
        mq = self.queue(topic, -1, eps)
        return s.QueryAssignmentResponse(status=ok(), assignments=[d.Assignment(message_queue=mq)])

    async def Heartbeat(self, req: s.HeartbeatRequest, context: Any) -> s.HeartbeatResponse:  # noqa: N802
        cid = client_id_of(context)
        if cid:
            c = self.clients.touch(cid)
            if req.client_type:
                c.client_type = req.client_type
        return s.HeartbeatResponse(status=ok())

    async def NotifyClientTermination(self, req: s.NotifyClientTerminationRequest, context: Any) -> s.NotifyClientTerminationResponse:  # noqa: N802
        cid = client_id_of(context)
        if cid:
            self.clients.forget(cid)
            log.info("event=rmq_client_terminated client_id=%s", cid)
        return s.NotifyClientTerminationResponse(status=ok())

    # ---- producer --------------------------------------------------------------------
    async def SendMessage(self, req: s.SendMessageRequest, context: Any) -> s.SendMessageResponse:  # noqa: N802
        try:
            resp = await producer.send_message(self.messaging, req)
        except (RmqError, TxmqError) as exc:
            return producer.send_failed(req, exc)
        self.messaging.metrics.inc("rmq_messages_sent", len(resp.entries))
        if req.messages[0].system_properties.message_type == d.TRANSACTION:
            self._publishes(client_id_of(context), req.messages[0].topic.name)
        return resp

    def _publishes(self, client_id: str, topic: str) -> None:
        """A client sent a half message to topic: its Telemetry streams take that topic's check-backs from now on.

        SDKs list their topics in their settings, but may send to another
        before they send their settings again; the check-backs of what they
        sent must still reach them.
        """
        c = self.clients.get(client_id) if client_id else None
        if c is None or not c.streams or topic in c.topics or len(c.topics) >= MAX_TOPICS:
            return
        c.topics = (*c.topics, topic)
        for stream in list(c.streams):
            stream.register()

    async def EndTransaction(self, req: s.EndTransactionRequest, context: Any) -> s.EndTransactionResponse:  # noqa: N802
        return await producer.end_transaction(self.messaging, req)

    async def RecallMessage(self, req: s.RecallMessageRequest, context: Any) -> s.RecallMessageResponse:  # noqa: N802
        return await producer.recall_message(self.messaging, req)

    # ---- Telemetry (server.py drives the stream) -----------------------------------------------
    async def on_telemetry_command(self, stream: TelemetryStream, cmd: s.TelemetryCommand, client: Client, peer: str) -> None:
        """One command from the client on its Telemetry stream: its settings are answered, and make the stream a target."""
        kind = cmd.WhichOneof("command")
        if kind != "settings":
            # thread_stack_trace / verify_message_result answer commands txmq never sends; ignored.
            return
        got = cmd.settings
        if not got.HasField("client_type") or got.client_type == d.CLIENT_TYPE_UNSPECIFIED:
            raise RmqError(Code.UNRECOGNIZED_CLIENT_TYPE, "settings must name the client_type")
        if got.client_type not in d.ClientType.values():  # a number protobuf keeps but no SDK sends
            raise RmqError(Code.UNRECOGNIZED_CLIENT_TYPE, f"unknown client_type {got.client_type}")
        client.client_type = got.client_type
        if got.user_agent.language:
            client.language = got.user_agent.language
        if got.WhichOneof("pub_sub") == "subscription":
            client.group = group_of(got.subscription.group)
            client.topics = ()
        else:
            topics = []
            for r in got.publishing.topics[: 1 + MAX_TOPICS]:
                topics.append(producer.topic_of(r, "publishing topic"))
            if len(topics) > MAX_TOPICS:
                raise RmqError(Code.BAD_REQUEST, f"a producer may publish to at most {MAX_TOPICS} topics")
            client.topics = tuple(dict.fromkeys(topics))
            client.group = ""
        fifo = bool(client.group) and self.messaging.is_fifo_group(client.group)
        answer = answer_settings(client, got, self.settings, fifo=fifo)  # not kept: a copy of what the client sent, of any size
        stream.register()
        reply = s.TelemetryCommand(status=ok(), settings=answer)
        stream.offer(reply)
        log.info("event=rmq_client_settings client_id=%s type=%s language=%s topics=%s group=%s peer=%s", client.client_id,
                 d.ClientType.Name(client.client_type), _language(client.language), ",".join(client.topics) or "-",
                 client.group or "-", peer)

    # ---- the receive side (consumer.py) -----------------------------------------------------
    async def ReceiveMessage(self, req: s.ReceiveMessageRequest, context: Any) -> AsyncIterator[s.ReceiveMessageResponse]:  # noqa: N802
        if self.receive is None:
            yield s.ReceiveMessageResponse(status=of_error(unsupported("ReceiveMessage")))
            return
        async for resp in self.receive.receive(req, context):
            yield resp

    async def AckMessage(self, req: s.AckMessageRequest, context: Any) -> s.AckMessageResponse:  # noqa: N802
        if self.receive is None:
            raise unsupported("AckMessage")
        return await self.receive.ack(req, context)

    async def ChangeInvisibleDuration(self, req: s.ChangeInvisibleDurationRequest, context: Any) -> s.ChangeInvisibleDurationResponse:  # noqa: N802
        if self.receive is None:
            raise unsupported("ChangeInvisibleDuration")
        return await self.receive.change_invisible_duration(req, context)

    async def ForwardMessageToDeadLetterQueue(self, req: s.ForwardMessageToDeadLetterQueueRequest,  # noqa: N802
                                              context: Any) -> s.ForwardMessageToDeadLetterQueueResponse:
        if self.receive is None:
            raise unsupported("ForwardMessageToDeadLetterQueue")
        return await self.receive.forward_to_dlq(req, context)

    # ---- not served -----------------------------------------------------------------------
    async def PullMessage(self, req: s.PullMessageRequest, context: Any) -> AsyncIterator[s.PullMessageResponse]:  # noqa: N802
        yield s.PullMessageResponse(status=of_error(unsupported("PullMessage (the pull consumer)")))

    async def UpdateOffset(self, req: s.UpdateOffsetRequest, context: Any) -> s.UpdateOffsetResponse:  # noqa: N802
        raise unsupported("UpdateOffset (the pull consumer)")

    async def GetOffset(self, req: s.GetOffsetRequest, context: Any) -> s.GetOffsetResponse:  # noqa: N802
        raise unsupported("GetOffset (the pull consumer)")

    async def QueryOffset(self, req: s.QueryOffsetRequest, context: Any) -> s.QueryOffsetResponse:  # noqa: N802
        raise unsupported("QueryOffset (the pull consumer)")


    async def SyncLiteSubscription(self, req: s.SyncLiteSubscriptionRequest, context: Any) -> s.SyncLiteSubscriptionResponse:  # noqa: N802
        raise unsupported("SyncLiteSubscription (lite topics)")



def group_of(resource: d.Resource) -> str:
    name = resource.name
    if resource.resource_namespace:
        raise RmqError(Code.ILLEGAL_CONSUMER_GROUP, "namespaces (resource_namespace) are not supported by txmq: leave it empty")
    if not name or len(name) > MAX_GROUP_LEN or any(c.isspace() or c == "\0" for c in name):
        raise RmqError(Code.ILLEGAL_CONSUMER_GROUP, f"consumer group {name!r} must be 1 to {MAX_GROUP_LEN} characters without white space")
    return name


def _language(lang: int) -> str:
    try:
        return d.Language.Name(lang)
    except ValueError:
        return str(lang)

