"""The txmq wire protocol: length-prefixed msgpack frames.

Byte layout of one frame::

    0  4  length   u32 big-endian, size of the payload that follows
    4  ..  payload msgpack array, one of:
           [0, id, op, fields]      request   (id: u32 > 0, op: str, fields: map)
           [1, id, code, fields]    reply     (code 0 = ok, else an ErrorCode)
           [2, 0, op, fields]       one-way push (broker -> client: check_transaction)

Requests and replies are matched by ``id``; a connection may have many
requests in flight and replies may come back in any order. Error replies
carry ``{"error": str, "name": str, "retriable": bool}``.

This module does no I/O, so the broker, the client and the tests share it.
See docs/protocol.md for every operation and its fields.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgpack

REQUEST = 0
REPLY = 1
PUSH = 2

HEADER = struct.Struct(">I")  # payload length
DEFAULT_MAX_FRAME = 8 << 20
PROTOCOL_VERSION = 1


class ErrorCode(IntEnum):
    OK = 0
    MALFORMED_FRAME = 1
    UNKNOWN_OPERATION = 2
    INVALID_FIELD = 3
    FRAME_TOO_LARGE = 4
    BODY_TOO_LARGE = 5
    INVALID_TOPIC = 6
    SYSTEM_TOPIC = 7
    NO_SUCH_QUEUE = 8
    AUTH_REQUIRED = 9
    AUTH_FAILED = 10
    STORE_FULL = 11
    STORE_ERROR = 12
    SHUTTING_DOWN = 13
    BUSY = 14
    TX_NOT_FOUND = 20
    TX_NOT_HALF = 21
    TX_GROUP_MISMATCH = 22
    TX_OFFSET_MISMATCH = 23
    TX_CONFLICT = 24
    TX_ID_MISMATCH = 25
    NO_PRODUCER = 26
    INVALID_CONFIG = 30
    GROUP_ACTIVE = 40
    NO_SUCH_GROUP = 41
    NO_SUCH_MESSAGE = 42
    NO_SUCH_TOPIC = 43
    TOPIC_IN_USE = 44
    MESSAGE_TYPE_NOT_ACCEPTED = 45
    INVALID_DELIVERY_TIME = 46  # a delayed or timed message's time cannot be read, or is beyond the broker's --max-delay
    INTERNAL = 99


RETRIABLE = frozenset({ErrorCode.STORE_FULL, ErrorCode.STORE_ERROR, ErrorCode.SHUTTING_DOWN, ErrorCode.BUSY})
# After these the broker closes the connection: the byte stream cannot be trusted.
FATAL = frozenset({ErrorCode.MALFORMED_FRAME, ErrorCode.FRAME_TOO_LARGE, ErrorCode.AUTH_REQUIRED, ErrorCode.AUTH_FAILED})


class TxmqError(Exception):
    """An error with a wire code; raised by the broker core, rebuilt by the client."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None, **fields: Any) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.fields = fields

    @property
    def retriable(self) -> bool:
        return self.code in RETRIABLE

    def to_fields(self) -> dict[str, Any]:
        return {"error": self.message, "name": self.code.name, "retriable": self.retriable, **self.fields}

    @classmethod
    def from_reply(cls, code: int, fields: dict[str, Any]) -> "TxmqError":
        try:
            ec = ErrorCode(code)
        except ValueError:
            ec = ErrorCode.INTERNAL
        extra = {k: v for k, v in fields.items() if k not in ("error", "name", "retriable")}
        return cls(str(fields.get("error", ec.name)), ec, **extra)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class FrameError(TxmqError):
    code = ErrorCode.MALFORMED_FRAME


@dataclass(slots=True)  # not frozen: a frozen init costs 5x, on the hot path (treat as read-only)
class Frame:
    kind: int
    id: int
    op: str | int  # op name for requests/pushes, error code for replies
    fields: dict[str, Any]


_packer = msgpack.Packer(use_bin_type=True)


def encode(kind: int, id_: int, op: str | int, fields: dict[str, Any]) -> bytes:
    payload = _packer.pack([kind, id_, op, fields])
    return HEADER.pack(len(payload)) + payload


def request(id_: int, op: str, fields: dict[str, Any]) -> bytes:
    return encode(REQUEST, id_, op, fields)


def reply(id_: int, fields: dict[str, Any], code: int = 0) -> bytes:
    return encode(REPLY, id_, code, fields)


def reply_parts(id_: int, fields: dict[str, Any], key: str) -> tuple[bytes, bytes]:
    """``reply(id_, fields)`` with fields[key] (bytes) packed last, as (everything before its bytes, its bytes): a large
    value (a raw pull's records) goes to the socket as it is, with no copy into the frame."""
    blob = fields[key]
    rest = {k: v for k, v in fields.items() if k != key}
    rest[key] = b""
    packed = _packer.pack([REPLY, id_, 0, rest])  # ends with the empty value's bin 8 header, c4 00
    n = len(blob)
    bin_head = b"\xc4" + n.to_bytes(1, "big") if n < 1 << 8 else b"\xc5" + n.to_bytes(2, "big") if n < 1 << 16 \
        else b"\xc6" + n.to_bytes(4, "big")
    head = packed[:-2] + bin_head
    return HEADER.pack(len(head) + n) + head, blob


def push(op: str, fields: dict[str, Any]) -> bytes:
    return encode(PUSH, 0, op, fields)


# What one frame from an untrusted peer may decode to. msgpack spends one byte on an empty map or
# string that costs Python 50-100 bytes, so an 8 MiB frame of them decoded to ~600 MB. Frames up to
# BOUNDED_FROM bytes decode as they are (at most a few MB of objects); longer ones count what they
# hold (every map and array its entries) and are refused past MAX_OBJECTS, with no array or map
# longer than MAX_CONTAINER (checked before it is built). 100,000 refs of a tx_resolve are ~400,000.
BOUNDED_FROM = 64 << 10
MAX_OBJECTS = 1 << 20
MAX_CONTAINER = 1 << 17


class _TooManyObjects(Exception):
    pass


def _unpack_bounded(payload: bytes | memoryview) -> Any:
    count = 0

    def on_list(v: list) -> list:
        nonlocal count
        count += len(v) + 1
        if count > MAX_OBJECTS:
            raise _TooManyObjects
        return v

    def on_map(v: dict) -> dict:
        nonlocal count
        count += 2 * len(v) + 1
        if count > MAX_OBJECTS:
            raise _TooManyObjects
        return v

    return msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True, list_hook=on_list, object_hook=on_map,
                           max_array_len=MAX_CONTAINER, max_map_len=MAX_CONTAINER)


def parse_payload(payload: bytes | memoryview, bounded: bool = False) -> Frame:
    """Parse one frame's payload; raises FrameError on anything malformed.

    ``bounded`` (a peer that is not trusted, i.e. the broker reading
    requests): a long frame may hold at most MAX_OBJECTS values.
    """
    try:
        if bounded and len(payload) > BOUNDED_FROM:
            obj = _unpack_bounded(payload)
        else:
            obj = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except _TooManyObjects:
        raise FrameError(f"payload holds more than {MAX_OBJECTS} values") from None
    except Exception as exc:  # msgpack raises several unrelated types
        raise FrameError(f"payload is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(obj, list) or len(obj) != 4:
        raise FrameError("payload must be an array [kind, id, op, fields]")
    kind, id_, op, fields = obj
    if kind not in (REQUEST, REPLY, PUSH):
        raise FrameError(f"unknown frame kind {kind!r}")
    if type(id_) is not int or not (0 <= id_ < 1 << 32):
        raise FrameError("frame id must be an unsigned 32-bit integer")
    if kind == REPLY:
        if type(op) is not int:
            raise FrameError("reply code must be an integer")
    elif not isinstance(op, str):
        raise FrameError("operation must be a string")
    if fields is None:
        fields = {}
    if not isinstance(fields, dict):
        raise FrameError("fields must be a map")
    return Frame(kind, id_, op, fields)


class FrameDecoder:
    """Incremental splitter: feed bytes, get complete payloads.

    Two-phase, like mini-redis: the length prefix is checked against the
    limit before any payload is buffered, so a huge length is refused at
    once instead of being waited for.
    """

    __slots__ = ("_buf", "max_frame")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._buf = bytearray()
        self.max_frame = max_frame

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        out: list[bytes] = []
        pos = 0
        n = len(buf)
        while n - pos >= 4:
            (length,) = HEADER.unpack_from(buf, pos)
            if length > self.max_frame:
                del buf[:pos]
                raise TxmqError(f"frame of {length} bytes exceeds the {self.max_frame}-byte limit", ErrorCode.FRAME_TOO_LARGE)
            if n - pos - 4 < length:
                break
            out.append(bytes(buf[pos + 4 : pos + 4 + length]))
            pos += 4 + length
        if pos:
            del buf[:pos]
        return out

    def feed_one(self, data: bytes = b"") -> bytes | None:
        """Like feed, but take at most one payload off the buffer (None while it is incomplete).

        The bytes after it stay buffered, so the caller may change
        ``max_frame`` before reading on (the broker's limit goes up once a
        connection has authenticated).
        """
        buf = self._buf
        buf += data
        if len(buf) < 4:
            return None
        (length,) = HEADER.unpack_from(buf, 0)
        if length > self.max_frame:
            raise TxmqError(f"frame of {length} bytes exceeds the {self.max_frame}-byte limit", ErrorCode.FRAME_TOO_LARGE)
        if len(buf) - 4 < length:
            return None
        payload = bytes(buf[4 : 4 + length])
        del buf[: 4 + length]
        return payload

    @property
    def buffered(self) -> int:
        return len(self._buf)
