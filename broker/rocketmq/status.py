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
    ErrorCode.NO_SUCH_TOPIC: Code.TOPIC_NOT_FOUND,
    ErrorCode.TOPIC_IN_USE: Code.PRECONDITION_FAILED,
    ErrorCode.MESSAGE_TYPE_NOT_ACCEPTED: Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE,
    ErrorCode.INVALID_DELIVERY_TIME: Code.ILLEGAL_DELIVERY_TIME,
    ErrorCode.INTERNAL: Code.INTERNAL_ERROR,
}


class RmqError(Exception):
    """Answer the RPC with this RocketMQ status code and message (in the response's ``status``)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# RocketMQ's answer for a topic without a route, as its proxy writes it: TopicRouteService throws
# MQClientException(ResponseCode.TOPIC_NOT_EXIST (17), "No topic route info in name server for the topic: " + topic),
# and ResponseBuilder.buildStatus answers TOPIC_NOT_FOUND with that exception's getMessage(), which MQClientException
# builds as "CODE: 17  DESC: " + the text + FAQUrl.attachDefaultURL's line (RocketMQ 5.3).
_TOPIC_NOT_EXIST = 17
_FAQ_URL = "https://rocketmq.apache.org/docs/bestPractice/06FAQ"


def topic_not_found(topic: str) -> RmqError:
    """TOPIC_NOT_FOUND (40402) with the message RocketMQ's proxy gives a QueryRoute, SendMessage or ReceiveMessage."""
    return RmqError(Code.TOPIC_NOT_FOUND, f"CODE: {_TOPIC_NOT_EXIST}  DESC: No topic route info in name server for the topic: "
                                          f"{topic}\nFor more information, please visit the url, {_FAQ_URL}")


# RocketMQ's names of message types, as its proxy's TopicMessageType writes them.
TYPE_NAMES = {"normal": "NORMAL", "fifo": "FIFO", "delay": "DELAY", "transaction": "TRANSACTION"}


def type_conflict(accepted: tuple[str, ...] | list[str], actual: str) -> RmqError:
    """MESSAGE_PROPERTY_CONFLICT_WITH_TYPE (40014) with the text of RocketMQ's DefaultTopicMessageTypeValidator.

    A RocketMQ topic has one type (or MIXED: all four); a txmq topic a set,
    named here by its one type, MIXED for all four, else the list.
    """
    names = [TYPE_NAMES.get(t, t.upper()) for t in accepted]
    expected = names[0] if len(names) == 1 else "MIXED" if len(names) == len(TYPE_NAMES) else "[" + ", ".join(names) + "]"
    return RmqError(Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE, f"TopicMessageType validate failed, the expected type is "
                                                              f"{expected}, but actual type is {TYPE_NAMES.get(actual, actual.upper())}")


_OK = Code.OK  # EnumTypeWrapper's attributes are looked up in Python: once, not per response


def ok(message: str = "OK") -> d.Status:
    return d.Status(code=_OK, message=message)


OK_STATUS = ok()  # to CopyFrom into responses (never modified)


def status(code: int, message: str) -> d.Status:
    return d.Status(code=code, message=message)


def of_error(exc: BaseException) -> d.Status:
    """The status for an exception raised while serving an RPC (RmqError, TxmqError, else INTERNAL_ERROR)."""
    if isinstance(exc, RmqError):
        return d.Status(code=exc.code, message=exc.message)
    if isinstance(exc, TxmqError):
        fields = exc.fields
        if exc.code == ErrorCode.NO_SUCH_TOPIC and isinstance(fields.get("topic"), str):
            return of_error(topic_not_found(fields["topic"]))
        if exc.code == ErrorCode.MESSAGE_TYPE_NOT_ACCEPTED and isinstance(fields.get("message_type"), str):
            return of_error(type_conflict(fields.get("message_types") or [], fields["message_type"]))
        return d.Status(code=_FROM_TXMQ.get(exc.code, Code.INTERNAL_ERROR), message=str(exc))
    return d.Status(code=Code.INTERNAL_ERROR, message=f"internal error: {type(exc).__name__}")


def unsupported(what: str) -> RmqError:
    return RmqError(Code.UNSUPPORTED, f"{what} is not supported by txmq (docs/rocketmq.md)")
