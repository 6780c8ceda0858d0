"""When a send asks to be delivered: RocketMQ's delay levels and timer properties, read once for every front end."""

from __future__ import annotations

from typing import Mapping

from txmq.constants import (
    DELAY_LEVELS_S,
    PROP_DELAY,
    PROP_SCHEDULE_CANCEL,
    PROP_SCHEDULED_FROM,
    PROP_TIMER_DELAY_MS,
    PROP_TIMER_DELAY_SEC,
    PROP_TIMER_DELIVER_MS,
)
from txmq.wire import ErrorCode, TxmqError

# The properties that ask for a later delivery, in RocketMQ's order of precedence (HookUtils.transformTimerMessage:
# TIMER_DELAY_SEC, then TIMER_DELAY_MS, then TIMER_DELIVER_MS; a delay level only without any of them).
TIMER_PROPERTIES = (PROP_TIMER_DELAY_SEC, PROP_TIMER_DELAY_MS, PROP_TIMER_DELIVER_MS)
# What a client may not set: the broker's own marks (a forged one would make a replay of the log drop a schedule).
RESERVED = (PROP_SCHEDULED_FROM, PROP_SCHEDULE_CANCEL)
MAX_MS = 253_402_300_799_999  # 9999-12-31, the largest time a protobuf Timestamp (and the CLI) can name


def asks_for_time(props: Mapping[str, str]) -> bool:
    """Whether the properties carry any of the scheduling properties (cheap: the send path asks it of every message)."""
    return (PROP_TIMER_DELIVER_MS in props or PROP_DELAY in props or PROP_TIMER_DELAY_SEC in props
            or PROP_TIMER_DELAY_MS in props or PROP_SCHEDULED_FROM in props or PROP_SCHEDULE_CANCEL in props)


def _int(props: Mapping[str, str], key: str) -> int:
    text = props[key]
    try:
        value = int(text.strip())
    except (ValueError, AttributeError):
        raise TxmqError(f"property {key}={text[:40]!r} is not a whole number", ErrorCode.INVALID_DELIVERY_TIME, property=key) from None
    return value


def due_ms(props: Mapping[str, str], now_ms: int, max_delay_ms: int) -> int | None:
    """The time (epoch ms) the message is due, or None when it asks for no delay (no property, ``DELAY`` 0 or less).

    A due time at or before ``now_ms`` is returned as it is (the caller
    delivers it now). Raises INVALID_DELIVERY_TIME for a value that is not a
    whole number, or that is due more than ``max_delay_ms`` ahead. A delay
    level above 18 is the longest level, as RocketMQ's broker takes it.
    """
    for key in RESERVED:
        if key in props:
            raise TxmqError(f"property {key} is the broker's own and cannot be sent", ErrorCode.INVALID_FIELD, property=key)
    if PROP_TIMER_DELAY_SEC in props:
        due, key = now_ms + _int(props, PROP_TIMER_DELAY_SEC) * 1000, PROP_TIMER_DELAY_SEC
    elif PROP_TIMER_DELAY_MS in props:
        due, key = now_ms + _int(props, PROP_TIMER_DELAY_MS), PROP_TIMER_DELAY_MS
    elif PROP_TIMER_DELIVER_MS in props:
        due, key = _int(props, PROP_TIMER_DELIVER_MS), PROP_TIMER_DELIVER_MS
    elif PROP_DELAY in props:
        level = _int(props, PROP_DELAY)
        if level <= 0:
            return None
        return now_ms + DELAY_LEVELS_S[min(level, len(DELAY_LEVELS_S)) - 1] * 1000
    else:
        return None
    if due - now_ms > max_delay_ms:
        raise TxmqError(f"{key}={props[key][:40]} asks for a delivery {fmt_delay(due - now_ms)} ahead: this broker schedules "
                        f"at most {fmt_delay(max_delay_ms)} ahead (broker start --max-delay)", ErrorCode.INVALID_DELIVERY_TIME,
                        property=key, max_delay_ms=max_delay_ms)
    return max(0, min(due, MAX_MS))


def fmt_delay(ms: int) -> str:
    """A delay for people: 90061000 -> '1d1h1m1s'."""
    if ms < 1000:
        return f"{ms}ms"
    s = ms // 1000
    out = ""
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if s >= n:
            out += f"{s // n}{unit}"
            s %= n
    return out
