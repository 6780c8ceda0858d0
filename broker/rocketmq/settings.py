"""What the gRPC front end's parts share: where it listens, its limits, the clients, what it tells clients.

Built once by server.py (``FrontendSettings.of(config, port)``) and handed to
the RPCs (service.py) and to the receive side (``ReceiveFrontend(core,
settings)``, consumer.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import limits
from .clients import ClientTable
from .limits import Holds

if TYPE_CHECKING:
    from txmq.broker.config import BrokerConfig

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
