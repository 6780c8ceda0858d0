"""Structured logs for the broker: one line per event, key=value or JSON."""

from __future__ import annotations

import json
import logging
import re
import sys
import time

_KV = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\S+)")


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        line = f"ts={ts} level={record.levelname.lower()} logger={record.name} {record.getMessage()}"
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        obj: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        pairs = _KV.findall(msg)
        if pairs:
            for k, v in pairs:
                obj[k] = v.strip("'\"")
        else:
            obj["msg"] = msg
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj)


def setup(fmt: str = "kv", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger("txmq")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
