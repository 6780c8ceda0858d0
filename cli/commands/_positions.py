"""Where to start reading or reset to: earliest | latest | OFFSET | TIME (shared by `read` and `groups reset`)."""

from __future__ import annotations

import re
import time
from typing import NamedTuple

from .. import exitcodes
from ..common import OFFSET_DIGITS, WIRE_INT_MAX, CliError, parse_duration

_DIGITS = re.compile(r"\+?[0-9]+")
_HAS_UNIT = re.compile(r".*[0-9](ms|s|m|h|d)")


class Position(NamedTuple):
    kind: str  # earliest | latest | offset | time
    offset: int | None = None
    time_ms: int | None = None


def parse_position(text: str, now: float | None = None) -> Position:
    """earliest, latest, an offset (ASCII digits), a duration ago (10m, 1h30m) or an ISO-8601 time (local time without a zone)."""
    t = (text or "").strip()
    if t in ("earliest", "latest"):
        return Position(t)
    if _DIGITS.fullmatch(t):
        if len(t.lstrip("+")) > OFFSET_DIGITS:  # no offset is that long (and int() of thousands of digits refuses)
            raise CliError(f"offset {t[:40]}{'...' if len(t) > 40 else ''} is out of range: 0 to 2^62", exitcodes.USAGE)
        n = int(t)
        if n > WIRE_INT_MAX:
            raise CliError(f"offset {t} is out of range: 0 to 2^62", exitcodes.USAGE)
        return Position("offset", offset=n)
    now = time.time() if now is None else now
    if _HAS_UNIT.fullmatch(t):
        return Position("time", time_ms=max(0, int((now - parse_duration(t)) * 1000)))  # before 1970: from the start
    from datetime import datetime

    try:
        dt = datetime.fromisoformat(t.replace("Z", "+00:00") if t.endswith("Z") else t)
    except ValueError:
        raise CliError(f"bad position {t!r}: use earliest, latest, an offset (e.g. 42), a duration ago (e.g. 10m, 2h) "
                       "or an ISO-8601 time (e.g. 2026-01-31T12:00:00Z)", exitcodes.USAGE) from None
    if dt.tzinfo is None:  # local time, as --deliver-at and spark-export --since read one (TZ=UTC for UTC)
        dt = dt.astimezone()
    ms = int(dt.timestamp() * 1000)
    if ms < 0:
        raise CliError(f"time {t!r} is before 1970", exitcodes.USAGE)
    return Position("time", time_ms=ms)
