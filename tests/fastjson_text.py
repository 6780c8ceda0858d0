"""Read the bodies RocketMQ 4's broker and name server write with fastjson: JSON, except that a map's keys may be
numbers (``{0:"host:port"}``) or objects (a MessageQueue: ``{{"brokerName":"b","queueId":0,"topic":"T"}:{...}}``).

``loads`` gives dicts whose object keys are ``Key`` tuples of the key's sorted items (hashable), number keys as ints.
"""

from __future__ import annotations

import json
import re
from typing import Any

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_WS = re.compile(r"\s*")
_scanstring = json.decoder.scanstring  # type: ignore[attr-defined]


class Key(tuple):
    """An object used as a map key: its items, sorted."""

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self).get(name, default)


def loads(text: str | bytes) -> Any:
    if isinstance(text, bytes):
        text = text.decode()
    value, pos = _value(text, _ws(text, 0))
    if _ws(text, pos) != len(text):
        raise ValueError(f"extra data at {pos}")
    return value


def mq(broker: str, topic: str, queue_id: int) -> Key:
    """The key of a message queue, as ``loads`` gives it."""
    return Key(sorted({"brokerName": broker, "queueId": queue_id, "topic": topic}.items()))


def _ws(s: str, pos: int) -> int:
    return _WS.match(s, pos).end()


def _value(s: str, pos: int) -> tuple[Any, int]:
    ch = s[pos]
    if ch == "{":
        out: dict = {}
        pos = _ws(s, pos + 1)
        if s[pos] == "}":
            return out, pos + 1
        while True:
            key, pos = _value(s, pos)
            if isinstance(key, dict):
                key = Key(sorted((k, v) for k, v in key.items()))
            pos = _ws(s, pos)
            if s[pos] != ":":
                raise ValueError(f"expected ':' at {pos}")
            value, pos = _value(s, _ws(s, pos + 1))
            out[key] = value
            pos = _ws(s, pos)
            if s[pos] == "}":
                return out, pos + 1
            if s[pos] != ",":
                raise ValueError(f"expected ',' at {pos}")
            pos = _ws(s, pos + 1)
    if ch == "[":
        items = []
        pos = _ws(s, pos + 1)
        if s[pos] == "]":
            return items, pos + 1
        while True:
            value, pos = _value(s, pos)
            items.append(value)
            pos = _ws(s, pos)
            if s[pos] == "]":
                return items, pos + 1
            if s[pos] != ",":
                raise ValueError(f"expected ',' at {pos}")
            pos = _ws(s, pos + 1)
    if ch == '"':
        return _scanstring(s, pos + 1)
    for word, value in (("true", True), ("false", False), ("null", None)):
        if s.startswith(word, pos):
            return value, pos + len(word)
    m = _NUMBER.match(s, pos)
    if not m:
        raise ValueError(f"unexpected {s[pos:pos + 20]!r} at {pos}")
    text = m.group()
    return (float(text) if any(c in text for c in ".eE") else int(text)), m.end()
