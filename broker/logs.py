"""Structured logs for the broker: one line per event, key=value or JSON (`txmq broker start --log-format`)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
from typing import Any

_KV = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\S+)")
_SPEC = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdifrxXeEgG]")
_TOKEN = re.compile("\x00(\\d+)\x00")
_PLAIN = re.compile(r"^[^\s'\"=]+$")


def _fields(record: logging.LogRecord, raw_repr: bool) -> tuple[str, list[str], list[str]] | None:
    """The message with each %-placeholder replaced by a token, and each argument formatted by its spec.

    Keys and literal text come from the format string (the code); values come
    from the arguments (often from clients: groups, transaction ids), so a
    value can never add a field or a line. None when the record does not
    have that shape (then the rendered message is used as it is).
    """
    msg, args = record.msg, record.args
    if not isinstance(msg, str) or not isinstance(args, tuple) or not args or "%%" in msg:
        return None
    found = list(_SPEC.finditer(msg))
    if len(found) != len(args) or any(msg[m.start() - 1 : m.start()] != "=" for m in found):
        return None  # a placeholder that is not a key's value (e.g. preformatted pairs): use the rendered message
    specs = [m.group() for m in found]
    try:
        values = [a if raw_repr and spec[-1] == "r" and isinstance(a, str) else spec % (a,) for spec, a in zip(specs, args)]
    except (TypeError, ValueError):
        return None
    n = iter(range(len(specs)))
    template = _SPEC.sub(lambda _m: f"\x00{next(n)}\x00", msg)
    return template, specs, values


def _kv_value(value: str, spec: str) -> str:
    if spec[-1] == "r" or _PLAIN.match(value):
        return value.replace("\n", "\\n").replace("\r", "\\r")
    return json.dumps(value)  # quoted, with newlines and the like escaped: one field, one line


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        parts = _fields(record, raw_repr=False)
        if parts is None:
            text = record.getMessage().replace("\n", "\\n").replace("\r", "\\r")
        else:
            template, specs, values = parts
            text = _TOKEN.sub(lambda m: _kv_value(values[int(m.group(1))], specs[int(m.group(1))]), template)
        line = f"ts={ts} level={record.levelname.lower()} logger={record.name} {text}"
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        parts = _fields(record, raw_repr=True)
        msg = record.getMessage()
        obj: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        pairs = _KV.findall(parts[0] if parts is not None else msg)
        if pairs and parts is not None:
            values = parts[2]
            for k, v in pairs:
                obj.setdefault(k, _TOKEN.sub(lambda m: values[int(m.group(1))], v))
        elif pairs:
            for k, v in pairs:
                obj.setdefault(k, v.strip("'\""))
        else:
            obj["msg"] = msg
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj)


# Libraries that log on the broker's stderr: through the same formatter, so their records are one line too.
FOREIGN_LOGGERS = ("asyncio", "grpc")


def setup(fmt: str = "kv", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger("txmq")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    for name in FOREIGN_LOGGERS:
        other = logging.getLogger(name)
        other.handlers[:] = [handler]
        other.propagate = False


_loop_log = logging.getLogger("txmq.broker")


def loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's handler (broker/main.py installs it): an error nobody handled is one line, not asyncio's traceback.

    asyncio calls it for a task or future whose exception was never
    retrieved, a callback that raised, and the like; its default handler
    writes a multi-line report. The traceback, if any, is the line's
    ``exc`` field (a JSON string).
    """
    exc = context.get("exception")
    source = context.get("task") or context.get("future") or context.get("handle")
    where = source.get_name() if isinstance(source, asyncio.Task) else type(source).__name__ if source is not None else "-"
    _loop_log.error("event=loop_exception msg=%r error=%r where=%r", context.get("message", ""), exc, where,
                    exc_info=(type(exc), exc, exc.__traceback__) if isinstance(exc, BaseException) else None)
