"""The `txmq` source's option values that both of its modes read: sizes and times.

Nothing here imports pyspark: the CLI parses ``--partition-bytes`` with it,
and the broker mode's planning (``txmq.spark.broker``) its times.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes from 67108864, '64m', '64MiB', '1g' (binary units)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"bad size {text!r}: use bytes or e.g. 64MiB")
    return int(m.group(1)) << (10 * " kmgt".index((m.group(2) or " ").lower()))


def parse_time_ms(text: str | int | None) -> int | None:
    """ms since the epoch from an integer (ms) or an ISO 8601 date/time (naive means UTC)."""
    if text is None or text == "":
        return None
    if isinstance(text, int) or str(text).strip().lstrip("-").isdigit():
        return int(text)
    s = str(text).strip()
    if s.endswith(("Z", "z")):
        s = s[:-1] + "+00:00"
    dt = datetime.fromisoformat(s)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)
