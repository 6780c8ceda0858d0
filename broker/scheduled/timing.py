"""When a send asks to be delivered: RocketMQ's delay levels and timer properties, read once for every front end."""

from __future__ import annotations

import re
from typing import Mapping

from txmq.constants import (
    MESSAGE_DELAY_LEVEL,
    PROP_DELAY,
    PROP_SCHEDULE_CANCEL,
    PROP_SCHEDULED_FROM,
    PROP_TIMER_DELAY_MS,
    PROP_TIMER_DELAY_SEC,
    PROP_TIMER_DELIVER_MS,
    PROP_TIMER_DEQUEUE_MS,
    PROP_TIMER_ENQUEUE_MS,
    PROP_TIMER_OUT_MS,
)
from txmq.wire import ErrorCode, TxmqError

from ..config import parse_delay_levels

# The properties that ask for a later delivery, in RocketMQ's order of precedence: a delay level above 0 first (its
# broker then drops the timer properties: HookUtils.checkIfTimerMessage), then TIMER_DELAY_SEC, TIMER_DELAY_MS and
# TIMER_DELIVER_MS (HookUtils.transformTimerMessage).
TIMER_PROPERTIES = (PROP_TIMER_DELAY_SEC, PROP_TIMER_DELAY_MS, PROP_TIMER_DELIVER_MS)
# What a client may not set: the broker's own marks (a forged one would make a replay of the log drop a schedule).
RESERVED = (PROP_SCHEDULED_FROM, PROP_SCHEDULE_CANCEL)
# What asked for a delay and what a delivery added: a delivered message sent again by the broker (a 4.x consumer's
# retry, a dead letter) drops them all, or its old due time would deliver it at once and its mark name a schedule
# it is not part of.
SCHEDULE_PROPERTIES = frozenset({*RESERVED, *TIMER_PROPERTIES, PROP_DELAY, PROP_TIMER_ENQUEUE_MS, PROP_TIMER_DEQUEUE_MS,
                                 PROP_TIMER_OUT_MS})
DEFAULT_LEVELS_MS = parse_delay_levels(MESSAGE_DELAY_LEVEL)  # RocketMQ's 18 levels, 1s to 2h
MAX_MS = 253_402_300_799_999  # 9999-12-31, the largest time a protobuf Timestamp (and the CLI) can name


def asks_for_time(props: Mapping[str, str]) -> bool:
    """Whether the properties carry any of the scheduling properties (cheap: the send path asks it of every message)."""
    return (PROP_TIMER_DELIVER_MS in props or PROP_DELAY in props or PROP_TIMER_DELAY_SEC in props
            or PROP_TIMER_DELAY_MS in props or PROP_SCHEDULED_FROM in props or PROP_SCHEDULE_CANCEL in props)


def without_schedule(props: Mapping[str, str]) -> dict[str, str]:
    """A copy of a stored message's properties to send it again: nothing of its earlier delay or delivery."""
    return {k: v for k, v in props.items() if k not in SCHEDULE_PROPERTIES}


# Java's Long.parseLong, which RocketMQ reads these properties with: an optional single "+" or "-", then one or more
# ASCII digits, nothing else (no spaces, no "1_000", no "1e3"); leading zeros are allowed. Long.parseLong also takes
# other Unicode decimal digits ("\u0663"); txmq refuses them (docs/scheduled.md, "Timer properties").
_LONG_TEXT = re.compile(r"[+-]?[0-9]+")
_LONG = 1 << 63  # Long.parseLong refuses a value outside -2^63 .. 2^63-1: RocketMQ answers such a time as illegal
_INT = 1 << 31  # DELAY is read with Integer.parseInt: the same text, -2^31 .. 2^31-1


def parse_long(text: object, bits: int = 64) -> int:
    """The value of text as Java's Long.parseLong (``bits=32``: Integer.parseInt) reads it; ValueError if it refuses it."""
    if type(text) is not str or not _LONG_TEXT.fullmatch(text):
        raise ValueError("not a whole number")
    digits = text.lstrip("+-").lstrip("0")
    if len(digits) > 19:  # past 2^63 whatever the digits (and int() is never asked to read a huge string)
        raise OverflowError("out of range")
    value = int(text)
    limit = _LONG if bits == 64 else _INT
    if not -limit <= value < limit:
        raise OverflowError("out of range")
    return value


def _int(props: Mapping[str, str], key: str) -> int:
    text = props[key]
    try:
        return parse_long(text, 32 if key == PROP_DELAY else 64)
    except OverflowError:
        raise TxmqError(f"property {key}={str(text)[:40]} is out of range (a {32 if key == PROP_DELAY else 64}-bit number)",
                        ErrorCode.INVALID_DELIVERY_TIME, property=key) from None
    except ValueError:
        raise TxmqError(f"property {key}={str(text)[:40]!r} is not a whole number (an optional + or - and ASCII digits, as "
                        "Long.parseLong reads it: no spaces, fractions, NaN or infinities)", ErrorCode.INVALID_DELIVERY_TIME,
                        property=key) from None


def due_ms(props: Mapping[str, str], now_ms: int, max_delay_ms: int,
           levels_ms: tuple[int, ...] = DEFAULT_LEVELS_MS) -> int | None:
    """The time (epoch ms) the message is due, or None when it asks for no delay (no property, ``DELAY`` 0 or less).

    A due time at or before ``now_ms`` is returned as it is (the caller
    delivers it now). Raises INVALID_DELIVERY_TIME for a value that is not a
    whole number, or that is due more than ``max_delay_ms`` ahead. A delay
    level above the last (18 by default) is the longest level, as RocketMQ's broker takes it; ``levels_ms``
    is the level table (broker start --message-delay-level, RocketMQ's messageDelayLevel).
    """
    for key in RESERVED:
        if key in props:
            raise TxmqError(f"property {key} is the broker's own and cannot be sent", ErrorCode.INVALID_FIELD, property=key)
    if PROP_DELAY in props:
        level = _int(props, PROP_DELAY)
        if level > 0:
            return now_ms + levels_ms[min(level, len(levels_ms)) - 1]
    if PROP_TIMER_DELAY_SEC in props:
        due, key = now_ms + _int(props, PROP_TIMER_DELAY_SEC) * 1000, PROP_TIMER_DELAY_SEC
    elif PROP_TIMER_DELAY_MS in props:
        due, key = now_ms + _int(props, PROP_TIMER_DELAY_MS), PROP_TIMER_DELAY_MS
    elif PROP_TIMER_DELIVER_MS in props:
        due, key = _int(props, PROP_TIMER_DELIVER_MS), PROP_TIMER_DELIVER_MS
    else:
        return None  # no property, or a delay level of 0 or less alone
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
