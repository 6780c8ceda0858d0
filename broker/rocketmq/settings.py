"""What the gRPC front end's parts share: where it listens, its limits, the clients, what it tells clients.

Built once by server.py (``FrontendSettings.of(config, port)``) and handed to
the RPCs (service.py) and to the receive side (``ReceiveFrontend(messaging,
settings)``, consumer.py); ``answer_settings`` words what a client is told.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import limits
from .clients import Client, ClientTable
from .pb import definition_pb2 as d
from .limits import Holds

if TYPE_CHECKING:
    from ..config import BrokerConfig

# Room in a gRPC message besides the body and the properties (topic, ids, keys, field headers).
MESSAGE_OVERHEAD = 4096


@dataclass
class FrontendSettings:
    host: str
    port: int  # where the front end listens; routes name it unless the client reached it by another address
    max_body: int  # --max-body: largest message body (also Settings.publishing.max_body_size)
    max_properties: int  # --max-properties: UTF-8 bytes of one message's property keys and values
    max_receive_message: int  # largest gRPC message accepted (grpc.max_receive_message_length)
    auth_token: str | None = None  # --auth-token: the secret RocketMQ's request signature must be made with
    clients: ClientTable = field(default_factory=ClientTable)
    # What clients hold open (limits.py): receives waiting for a message, and Telemetry streams.
    long_polls: Holds = field(default_factory=limits.default_long_polls)
    telemetry_streams: Holds = field(default_factory=limits.default_telemetry_streams)
    # What the settings answer tells clients (RocketMQ's proxy defaults; clients.py uses them).
    producer_max_attempts: int = 3
    producer_backoff_s: tuple[float, float, float] = (0.01, 1.0, 2.0)  # exponential: initial, max, multiplier
    consumer_max_attempts: int = 16  # deliveries of a message before the dead-letter queue
    consumer_backoff_s: tuple[float, float, float] = (1.0, 60.0, 2.0)
    receive_batch_size: int = 32
    long_polling_timeout_s: float = 20.0

    @classmethod
    def of(cls, config: BrokerConfig, port: int) -> "FrontendSettings":
        return cls(host=config.host, port=port, max_body=config.max_body, max_properties=config.max_properties,
                   max_receive_message=config.max_body + config.max_properties + MESSAGE_OVERHEAD, auth_token=config.auth_token)


def duration(seconds: float) -> Any:
    from google.protobuf import duration_pb2

    out = duration_pb2.Duration()
    out.FromMilliseconds(int(seconds * 1000))
    return out


def answer_settings(client: Client, got: d.Settings, settings: FrontendSettings, *, fifo: bool = False) -> d.Settings:
    """The settings the broker answers a client's Telemetry settings with (as RocketMQ's proxy merges them).

    The client's own, with the broker's retry policy (exponential backoff;
    for the Python SDK's consumers a customized one, the only kind it reads),
    for a producer ``publishing.max_body_size`` = --max-body, for a consumer
    ``fifo`` (the group is marked FIFO: RocketMQ's proxy answers its
    subscription group's consumeMessageOrderly), ``receive_batch_size``,
    ``long_polling_timeout`` and the lite-topic limits the SDKs check before
    asking (LITE_SUBSCRIPTION_QUOTA, MAX_LITE_TOPIC_SIZE: without them a
    LitePushConsumer refuses every lite topic as "length exceeded max
    length 0"; with them it asks, and the broker answers that lite topics
    are not supported); metrics off.
    """
    out = d.Settings()
    out.CopyFrom(got)
    out.metric.on = False  # txmq runs no metrics collector for clients
    out.metric.ClearField("endpoints")
    policy = out.backoff_policy
    policy.Clear()
    if got.WhichOneof("pub_sub") == "subscription":
        policy.max_attempts = settings.consumer_max_attempts
        initial, most, mult = settings.consumer_backoff_s
        sub = out.subscription
        sub.fifo = fifo
        sub.lite_subscription_quota = LITE_SUBSCRIPTION_QUOTA
        sub.max_lite_topic_size = MAX_LITE_TOPIC_SIZE
        sub.receive_batch_size = settings.receive_batch_size
        sub.long_polling_timeout.CopyFrom(duration(settings.long_polling_timeout_s))
        if got.user_agent.language == d.PYTHON:
            # The Python SDK's push consumer reads only a customized backoff (the other SDKs an exponential one).
            policy.customized_backoff.next.extend(duration(x) for x in CUSTOMIZED_BACKOFF_S)
            return _finish(out, got)
    else:
        policy.max_attempts = settings.producer_max_attempts
        initial, most, mult = settings.producer_backoff_s
        out.publishing.max_body_size = settings.max_body
        out.publishing.validate_message_type = True
    policy.exponential_backoff.initial.CopyFrom(duration(initial))
    policy.exponential_backoff.max.CopyFrom(duration(most))
    policy.exponential_backoff.multiplier = mult
    return _finish(out, got)


def _finish(out: d.Settings, got: d.Settings) -> d.Settings:
    if not got.HasField("request_timeout"):
        out.request_timeout.CopyFrom(duration(3))
    return out


# What a lite push consumer checks before it asks to subscribe to a lite topic (the SDKs' own defaults).
LITE_SUBSCRIPTION_QUOTA = 100
MAX_LITE_TOPIC_SIZE = 64

# A consumer's redelivery delays when the SDK takes a list (RocketMQ's message delay levels from 1 s).
CUSTOMIZED_BACKOFF_S = (1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600, 7200)
