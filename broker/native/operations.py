"""The native protocol's operation table, and what every handler shares: its type and the checks of its fields.

Each handler module enters its operations in ``HANDLERS`` (the package
imports them all) and imports from here, never from another handler module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

from txmq.constants import is_system_topic
from txmq.wire import ErrorCode, TxmqError

from ..topics import check_topic_name

if TYPE_CHECKING:
    from ..config import BrokerConfig
    from ..messaging import Messaging, Operations

    from .connection import BrokerConnection


class Front(Protocol):
    """What a handler is given of the front end (server.NativeFrontend): the broker's two doors and its settings."""

    messaging: Messaging
    operations: Operations
    config: BrokerConfig


Reply = dict[str, Any] | Awaitable[dict[str, Any]]
Handler = Callable[[Front, "BrokerConnection", dict[str, Any]], Reply]


# ---- field helpers ---------------------------------------------------------
def _bad(msg: str) -> TxmqError:
    return TxmqError(msg, ErrorCode.INVALID_FIELD)


def req_str(f: dict, key: str, max_len: int = 255) -> str:
    v = f.get(key)
    if not isinstance(v, str) or not v:
        raise _bad(f"field {key!r} must be a non-empty string")
    if len(v) > max_len:
        raise _bad(f"field {key!r} is longer than {max_len} characters")
    return v


def opt_str(f: dict, key: str, max_len: int = 255) -> str | None:
    return None if f.get(key) is None else req_str(f, key, max_len)


def req_int(f: dict, key: str, lo: int = 0, hi: int = 1 << 62) -> int:
    v = f.get(key)
    if type(v) is not int:
        raise _bad(f"field {key!r} must be an integer")
    if not (lo <= v <= hi):
        raise _bad(f"field {key!r} must be between {lo} and {hi}")
    return v


def opt_int(f: dict, key: str, default: int | None, lo: int = 0, hi: int = 1 << 62) -> int | None:
    return default if f.get(key) is None else req_int(f, key, lo, hi)


def opt_bool(f: dict, key: str) -> bool:
    v = f.get(key, False)
    if not isinstance(v, bool):
        raise _bad(f"field {key!r} must be a boolean")
    return v


def body_of(f: dict, max_body: int) -> bytes:
    v = f.get("body", b"")
    if isinstance(v, str):
        v = v.encode()
    if not isinstance(v, (bytes, bytearray)):
        raise _bad("field 'body' must be binary")
    if len(v) > max_body:
        raise TxmqError(f"body of {len(v)} bytes exceeds the {max_body}-byte limit", ErrorCode.BODY_TOO_LARGE)
    return bytes(v)


def props_of(f: dict, max_bytes: int) -> dict[str, str]:
    v = f.get("properties")
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
        raise _bad("field 'properties' must be a map of strings to strings")
    if len(v) > 256:
        raise _bad("at most 256 properties")
    chars = sum(map(len, v)) + sum(map(len, v.values()))
    if chars * 4 > max_bytes:  # a character is at most 4 UTF-8 bytes: count bytes only when it could matter
        size = sum(len(k.encode("utf-8", "surrogatepass")) + len(x.encode("utf-8", "surrogatepass")) for k, x in v.items())
        if size > max_bytes:
            raise TxmqError(f"properties of {size} bytes (keys and values, UTF-8) exceed the {max_bytes}-byte limit",
                            ErrorCode.BODY_TOO_LARGE)
    return v


def user_topic(f: dict) -> str:
    topic = check_topic_name(f.get("topic"))
    if is_system_topic(topic):
        raise TxmqError(f"topic {topic} is a system topic and cannot be sent to directly", ErrorCode.SYSTEM_TOPIC)
    return topic


def refs_of(f: dict, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    refs = f.get("refs")
    if not isinstance(refs, list) or len(refs) > 100_000:
        raise _bad("field 'refs' must be a list")
    out = []
    for r in refs:
        if not isinstance(r, dict) or not any(r.get(k) is not None for k in keys):
            raise _bad(f"each ref must be a map with one of {', '.join(keys)}")
        ref = {}
        for k in keys:
            if r.get(k) is not None:
                if k == "tx_id":
                    ref[k] = req_str(r, k)
                else:
                    ref[k] = req_int(r, k)
        out.append(ref)
    return out


# Every operation by name, filled by the handler modules.
HANDLERS: dict[str, Handler] = {}
