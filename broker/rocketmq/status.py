"""RocketMQ status codes for txmq's errors, and the error an RPC handler raises to answer with one.

Codes are RocketMQ's ``apache.rocketmq.v2.Code`` (definition.proto); the
message says what txmq found, as the native protocol's error replies do.
"""

from __future__ import annotations

from txmq.wire import ErrorCode, TxmqError

from .pb import definition_pb2 as d

Code = d.Code

# txmq's error codes (core/wire.py) -> RocketMQ's.
_FROM_TXMQ = {
    ErrorCode.INVALID_FIELD: Code.BAD_REQUEST,
    ErrorCode.MALFORMED_FRAME: Code.BAD_REQUEST,
    ErrorCode.UNKNOWN_OPERATION: Code.UNSUPPORTED,
    ErrorCode.FRAME_TOO_LARGE: Code.PAYLOAD_TOO_LARGE,
    ErrorCode.BODY_TOO_LARGE: Code.MESSAGE_BODY_TOO_LARGE,
    ErrorCode.INVALID_TOPIC: Code.ILLEGAL_TOPIC,
    ErrorCode.SYSTEM_TOPIC: Code.ILLEGAL_TOPIC,
    ErrorCode.NO_SUCH_QUEUE: Code.BAD_REQUEST,
    ErrorCode.AUTH_REQUIRED: Code.UNAUTHORIZED,
    ErrorCode.AUTH_FAILED: Code.UNAUTHORIZED,
    ErrorCode.STORE_FULL: Code.INTERNAL_ERROR,
    ErrorCode.STORE_ERROR: Code.INTERNAL_ERROR,
    ErrorCode.SHUTTING_DOWN: Code.INTERNAL_ERROR,
    ErrorCode.BUSY: Code.TOO_MANY_REQUESTS,
    ErrorCode.TX_NOT_FOUND: Code.INVALID_TRANSACTION_ID,
    ErrorCode.TX_NOT_HALF: Code.INVALID_TRANSACTION_ID,
    ErrorCode.TX_GROUP_MISMATCH: Code.INVALID_TRANSACTION_ID,
    ErrorCode.TX_OFFSET_MISMATCH: Code.INVALID_TRANSACTION_ID,
    ErrorCode.TX_ID_MISMATCH: Code.INVALID_TRANSACTION_ID,
    ErrorCode.TX_CONFLICT: Code.PRECONDITION_FAILED,
    ErrorCode.NO_PRODUCER: Code.NOT_FOUND,
    ErrorCode.INVALID_CONFIG: Code.BAD_REQUEST,
    ErrorCode.NO_SUCH_GROUP: Code.CONSUMER_GROUP_NOT_FOUND,
    ErrorCode.NO_SUCH_MESSAGE: Code.MESSAGE_NOT_FOUND,
    ErrorCode.INTERNAL: Code.INTERNAL_ERROR,
}


class RmqError(Exception):
    """Answer the RPC with this RocketMQ status code and message (in the response's ``status``)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def ok(message: str = "OK") -> d.Status:
    return d.Status(code=Code.OK, message=message)


def status(code: int, message: str) -> d.Status:
    return d.Status(code=code, message=message)


def of_error(exc: BaseException) -> d.Status:
    """The status for an exception raised while serving an RPC (RmqError, TxmqError, else INTERNAL_ERROR)."""
    if isinstance(exc, RmqError):
        return d.Status(code=exc.code, message=exc.message)
    if isinstance(exc, TxmqError):
        return d.Status(code=_FROM_TXMQ.get(exc.code, Code.INTERNAL_ERROR), message=str(exc))
    return d.Status(code=Code.INTERNAL_ERROR, message=f"internal error: {type(exc).__name__}")


def unsupported(what: str) -> RmqError:
    return RmqError(Code.UNSUPPORTED, f"{what} is not supported by txmq (docs/rocketmq.md)")
