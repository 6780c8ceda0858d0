"""Message types shared by producers and consumers.

`Message` is what a producer sends. `ReceivedMessage` is built from the
broker's message map (docs/protocol.md, "Messages"): what a consumer yields
and what a transaction listener is handed (`MessageView` is the same type).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from txmq.constants import (
    HALF_TOPIC,
    PROP_CHECK_TIMES,
    PROP_KEYS,
    PROP_PREPARED_QUEUE_OFFSET,
    PROP_REAL_QID,
    PROP_REAL_TOPIC,
    PROP_SHARDING_KEY,
    PROP_TAGS,
    PROP_TIMER_DELAY_MS,
    PROP_TIMER_DELIVER_MS,
    PROP_UNIQ_KEY,
)

KEY_SEPARATOR = " "  # RocketMQ joins several keys with a space

TX_NORMAL, TX_HALF, TX_COMMIT, TX_ROLLBACK = 0, 1, 2, 3

Body = bytes | bytearray | memoryview | str
Keys = str | Iterable[str]
When = float | int | datetime  # epoch seconds, or an aware datetime (a naive one is local time)
Delay = float | int | timedelta  # seconds


MAX_TIME_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z: the latest time a broker (and a protobuf Timestamp) names


def schedule_properties(deliver_at: When | None = None, delay: Delay | None = None) -> dict[str, str] | None:
    """The properties that ask the broker to deliver a message later (docs/client.md, "Delayed messages").

    ``deliver_at`` becomes ``TIMER_DELIVER_MS`` (an absolute time, from
    1970 to 9999; one already past is delivered at once);
    ``delay`` becomes ``TIMER_DELAY_MS``, counted from the broker's clock
    when it stores the message. None when neither is given. ValueError for
    NaN, an infinity, a negative delay or a time outside 1970..9999;
    TypeError for a value of another type.
    """
    if deliver_at is not None and delay is not None:
        raise ValueError("give deliver_at or delay, not both")
    if deliver_at is not None:
        if isinstance(deliver_at, datetime):
            try:
                seconds = deliver_at.timestamp()
            except (OverflowError, OSError, ValueError):
                raise ValueError(f"deliver_at {deliver_at!r} is not a time from 1970 to 9999") from None
        elif isinstance(deliver_at, (int, float)) and not isinstance(deliver_at, bool):
            seconds = deliver_at
        else:
            raise TypeError(f"deliver_at must be epoch seconds or a datetime, not {type(deliver_at).__name__}")
        return {PROP_TIMER_DELIVER_MS: str(_ms(seconds, "deliver_at", "epoch seconds from 1970 to 9999 (or a "
                                                                      "datetime of those years)"))}
    if delay is not None:
        if isinstance(delay, timedelta):
            seconds = delay.total_seconds()
        elif isinstance(delay, (int, float)) and not isinstance(delay, bool):
            seconds = delay
        else:
            raise TypeError(f"delay must be seconds or a timedelta, not {type(delay).__name__}")
        return {PROP_TIMER_DELAY_MS: str(_ms(seconds, "delay", "0 or more seconds, finite and short of 8,000 years "
                                                            "(or a timedelta of those)"))}
    return None


def _ms(seconds: float, what: str, expected: str) -> int:
    """Whole milliseconds of a checked ``deliver_at`` or ``delay``: ValueError for NaN, infinities and negative values."""
    # math.isfinite would overflow on a huge int; the comparisons are False for NaN
    if not (0 <= seconds <= MAX_TIME_MS / 1000):
        raise ValueError(f"{what} must be {expected}, not {str(seconds)[:40]}")
    return int(seconds * 1000)


def to_bytes(body: Body) -> bytes:
    if type(body) is bytes:
        return body
    if isinstance(body, str):
        return body.encode()
    if isinstance(body, (bytearray, memoryview)):
        return bytes(body)
    raise TypeError(f"message body must be bytes or str, not {type(body).__name__}")


def build_properties(
    tags: str | None = None,
    keys: Keys | None = None,
    properties: Mapping[str, str] | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str] | None:
    """The wire `properties` map: user properties, then TAGS/KEYS, then `base` (None when empty)."""
    if tags is None and keys is None and not properties and not base:
        return None
    props: dict[str, str] = dict(properties) if properties else {}
    if tags is not None:
        props[PROP_TAGS] = tags
    if keys is not None:
        props[PROP_KEYS] = keys if isinstance(keys, str) else KEY_SEPARATOR.join(keys)
    if base:
        props.update(base)
    return props


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class Message:
    """A message to send. ``keys`` may be one string or several (joined with a space).

    ``message_group``: a FIFO message's group (stored as ``__SHARDINGKEY``):
    every message of a group goes to one queue, in the order the sends were
    acknowledged, and a FIFO consumer group receives them in that order
    (docs/client.md, "FIFO messages"). Not with a transactional send, nor
    with ``deliver_at`` or ``delay``.

    ``deliver_at`` (epoch seconds or a datetime) or ``delay`` (seconds or a
    timedelta): the broker keeps the message from every consumer until then
    (``schedule_properties``). NaN, an infinity, a negative delay or a time
    outside 1970..9999 raises ValueError when the Message is made.
    """

    topic: str
    body: Body
    tags: str | None = None
    keys: Keys | None = None
    properties: Mapping[str, str] | None = None
    message_group: str | None = None
    deliver_at: When | None = None
    delay: Delay | None = None

    def __post_init__(self) -> None:
        if self.deliver_at is not None or self.delay is not None:
            schedule_properties(self.deliver_at, self.delay)  # a bad time fails here, not at the send

    def wire_properties(self, base: Mapping[str, str] | None = None) -> dict[str, str] | None:
        when = schedule_properties(self.deliver_at, self.delay)
        if when is not None:
            if self.message_group is not None:
                raise ValueError("a message with a message_group cannot have deliver_at or delay: FIFO and delayed "
                                 "messages are two types (as in RocketMQ 5)")
            base = {**when, **base} if base else when
        return _with_group(build_properties(self.tags, self.keys, self.properties, base), self.message_group)

    def send_fields(self, base: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Fields of a `send` request for this message (without queue_id)."""
        fields: dict[str, Any] = {"topic": self.topic, "body": to_bytes(self.body), "born_ts": now_ms()}
        props = self.wire_properties(base)
        if props is not None:
            fields["properties"] = props
        return fields


def _with_group(props: dict[str, str] | None, group: str | None) -> dict[str, str] | None:
    if group is None:
        return props
    if not isinstance(group, str) or not group.strip():
        raise ValueError("message_group must be a non-blank string")
    return {**(props or {}), PROP_SHARDING_KEY: group}


@dataclass(frozen=True, slots=True)
class SendResult:
    msg_id: str
    topic: str
    queue_id: int
    queue_offset: int  # -1 for a scheduled message: it enters its queue when due
    commit_log_offset: int
    deliver_at_ms: int | None = None  # a scheduled message's due time (epoch ms); None for one delivered now

    @classmethod
    def from_reply(cls, r: Mapping[str, Any]) -> "SendResult":
        return cls(r["msg_id"], r["topic"], r["queue_id"], r["queue_offset"], r["commit_log_offset"], r.get("deliver_at_ms"))


@dataclass(frozen=True, slots=True)
class ReceivedMessage:
    """A stored message as the broker reports it.

    For a half record (``tx_type == 1``, e.g. in a check-back) ``topic`` and
    ``queue_id`` are the real ones from `REAL_TOPIC`/`REAL_QID`;
    ``stored_topic`` and ``queue_offset`` are where the record itself sits
    (the half topic and its half-queue offset). ``tx_id`` is the `UNIQ_KEY`
    of transactional messages and None for plain ones.
    """

    topic: str
    queue_id: int
    queue_offset: int
    commit_log_offset: int
    msg_id: str
    body: bytes
    properties: dict[str, str] = field(default_factory=dict)
    tx_id: str | None = None
    born_ts: int = 0
    store_ts: int = 0
    tx_type: int = TX_NORMAL
    prepared_offset: int = -1
    size: int = 0
    stored_topic: str = ""

    @property
    def tags(self) -> str | None:
        return self.properties.get(PROP_TAGS)

    @property
    def keys(self) -> str | None:
        return self.properties.get(PROP_KEYS)

    @property
    def message_group(self) -> str | None:
        """A FIFO message's group (``__SHARDINGKEY``), None for others."""
        return self.properties.get(PROP_SHARDING_KEY)

    @property
    def key_list(self) -> list[str]:
        keys = self.properties.get(PROP_KEYS)
        return keys.split(KEY_SEPARATOR) if keys else []

    @property
    def check_times(self) -> int:
        """How many check-backs this transaction has had (`TRANSACTION_CHECK_TIMES`)."""
        try:
            return int(self.properties.get(PROP_CHECK_TIMES, 0))
        except ValueError:
            return 0

    @property
    def half_offset(self) -> int | None:
        """For a half record, its half-queue offset."""
        return self.queue_offset if self.tx_type == TX_HALF else None

    @property
    def text(self) -> str:
        return self.body.decode()

    @classmethod
    def from_map(cls, m: Mapping[str, Any]) -> "ReceivedMessage":
        props: dict[str, str] = m.get("properties") or {}
        stored_topic = m["topic"]
        topic = stored_topic
        queue_id = m["queue_id"]
        tx_type = m.get("tx_type", TX_NORMAL)
        prepared = m.get("prepared_offset", -1)
        if prepared is None:
            prepared = -1
        real_topic = props.get(PROP_REAL_TOPIC)
        if real_topic is not None and (tx_type == TX_HALF or stored_topic == HALF_TOPIC):
            topic = real_topic
            try:
                queue_id = int(props.get(PROP_REAL_QID, queue_id))
            except ValueError:
                pass
        tx_id = None
        if tx_type in (TX_HALF, TX_COMMIT, TX_ROLLBACK) or prepared >= 0 or PROP_PREPARED_QUEUE_OFFSET in props:
            tx_id = props.get(PROP_UNIQ_KEY) or m.get("msg_id")
        return cls(
            topic=topic,
            queue_id=queue_id,
            queue_offset=m["queue_offset"],
            commit_log_offset=m["commit_log_offset"],
            msg_id=m.get("msg_id") or props.get(PROP_UNIQ_KEY, ""),
            body=m.get("body") or b"",
            properties=props,
            tx_id=tx_id,
            born_ts=m.get("born_ts", 0),
            store_ts=m.get("store_ts", 0),
            tx_type=tx_type,
            prepared_offset=prepared,
            size=m.get("size", 0),
            stored_topic=stored_topic,
        )


MessageView = ReceivedMessage
