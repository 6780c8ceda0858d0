"""The table of request handlers, what a handler is given, and what every handler shares: header fields, responses.

A handler takes (front end, connection, command) and returns the response
command, a ``Then`` (a future of the services' and what words its result),
an awaitable of the response, or None (nothing to answer). It registers
itself with ``@handles(code, ...)``: the broker's requests in handlers.py,
the operator's (mqadmin's) in admin.py. It sees the front end as ``Front``
and the connection as ``context.Connection``: it reaches the broker only
through ``front.messaging`` and ``front.operations``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

from txmq.constants import canonical_topic, is_system_topic
from txmq.wire import ErrorCode, TxmqError

from ..topics import check_topic_name

from . import protocol as p
from .context import Connection, Endpoint

if TYPE_CHECKING:
    import asyncio

    from ..messaging import Operations

    from .clients import ClientTable


class Front(Endpoint, Protocol):
    """The front end (server.RemotingFrontend) as a handler uses it."""

    operations: Operations
    clients: ClientTable
    cluster_name: str
    connections: set[Any]  # the open connections
    inflight: set[asyncio.Future]  # the requests in flight, over all connections
    stopping: bool


class Then:
    """A future of the services' and what turns its result into the response: no task per request (the hot paths)."""

    __slots__ = ("fut", "fn")

    def __init__(self, fut: Any, fn: Callable[[Any], p.Command]) -> None:
        self.fut = fut
        self.fn = fn


Result = p.Command | None | Then | Awaitable[p.Command | None]
Handler = Callable[[Front, Connection, p.Command], Result]
HANDLERS: dict[int, Handler] = {}


def served_codes() -> list[int]:
    return sorted(HANDLERS)


def handles(*codes: int) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        for c in codes:
            HANDLERS[c] = fn
        return fn
    return deco


# ---- header fields --------------------------------------------------------------------------
def _bad(msg: str) -> TxmqError:
    return TxmqError(msg, ErrorCode.INVALID_FIELD)


def req_str(ext: dict[str, str], key: str, max_len: int = 255) -> str:
    v = ext.get(key)
    if not v:
        raise _bad(f"header field {key!r} is missing")
    if len(v) > max_len:
        raise _bad(f"header field {key!r} is longer than {max_len} characters")
    return v


def req_int(ext: dict[str, str], key: str, lo: int = -(1 << 63), hi: int = (1 << 63) - 1) -> int:
    v = ext.get(key)
    if v is None or v == "":
        raise _bad(f"header field {key!r} is missing")
    return _int(key, v, lo, hi)


def opt_int(ext: dict[str, str], key: str, default: int, lo: int = -(1 << 63), hi: int = (1 << 63) - 1) -> int:
    v = ext.get(key)
    return default if v is None or v == "" else _int(key, v, lo, hi)


def _int(key: str, v: str, lo: int, hi: int) -> int:
    try:
        n = int(v)
    except ValueError:
        raise _bad(f"header field {key!r} is not an integer: {v[:40]!r}") from None
    if not lo <= n <= hi:
        raise _bad(f"header field {key!r} must be between {lo} and {hi}, not {n}")
    return n


def opt_bool(ext: dict[str, str], key: str) -> bool:
    return ext.get(key, "").lower() in ("true", "1")


def topic_of(ext: dict[str, str], key: str = "topic", system_ok: bool = False) -> str:
    topic = canonical_topic(check_topic_name(ext.get(key) or ""))
    if not system_ok and is_system_topic(topic):
        raise TxmqError(f"topic {topic} is a system topic and cannot be used by clients", ErrorCode.SYSTEM_TOPIC)
    return topic


# ---- responses ------------------------------------------------------------------------------
def ok(cmd: p.Command, ext: dict[str, str] | None = None, body: bytes = b"", remark: str = "") -> p.Command:
    return p.response(cmd, p.SUCCESS, ext, body, remark)


def json_body(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def parse_json_body(cmd: p.Command, what: str) -> dict:
    """The request's JSON object; p.BodyError (INVALID_PARAMETER, a refusal) when the body is none, or past the limits."""
    return p.load_json_object(cmd.body, what)


__all__ = ["Front", "Then", "Result", "Handler", "HANDLERS", "served_codes", "handles", "req_str", "req_int", "opt_int", "opt_bool",
           "topic_of", "ok", "json_body", "parse_json_body"]
