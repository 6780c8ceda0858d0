"""Talking to a broker from a command: one place maps failures to exit codes."""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

from txmq.wire import ErrorCode, TxmqError

from . import exitcodes
from .common import CliError, parse_address, run

_CODE_EXIT = {
    ErrorCode.AUTH_REQUIRED: exitcodes.REFUSED,
    ErrorCode.AUTH_FAILED: exitcodes.REFUSED,
    ErrorCode.TX_NOT_FOUND: exitcodes.NOT_FOUND,
    ErrorCode.TX_NOT_HALF: exitcodes.NOT_FOUND,
    ErrorCode.NO_SUCH_QUEUE: exitcodes.NOT_FOUND,
    ErrorCode.NO_PRODUCER: exitcodes.NOT_FOUND,
    ErrorCode.TX_CONFLICT: exitcodes.CONFLICT,
    ErrorCode.STORE_FULL: exitcodes.STORE_FULL,
    ErrorCode.SHUTTING_DOWN: exitcodes.UNREACHABLE,  # the broker is going away: as a lost connection
    ErrorCode.INVALID_FIELD: exitcodes.USAGE,
    ErrorCode.INVALID_TOPIC: exitcodes.USAGE,
    ErrorCode.SYSTEM_TOPIC: exitcodes.USAGE,
    ErrorCode.INVALID_CONFIG: exitcodes.USAGE,
    ErrorCode.BODY_TOO_LARGE: exitcodes.USAGE,
    ErrorCode.GROUP_ACTIVE: exitcodes.CONFLICT,
    ErrorCode.NO_SUCH_GROUP: exitcodes.NOT_FOUND,
    ErrorCode.NO_SUCH_MESSAGE: exitcodes.NOT_FOUND,
    ErrorCode.NO_SUCH_TOPIC: exitcodes.NOT_FOUND,
    ErrorCode.TOPIC_IN_USE: exitcodes.CONFLICT,
    ErrorCode.MESSAGE_TYPE_NOT_ACCEPTED: exitcodes.CONFLICT,
    ErrorCode.INVALID_DELIVERY_TIME: exitcodes.USAGE,
}


def exit_code_of(exc: BaseException) -> int:
    from txmq.client.connection import ConnectionLost, NotATxmqBroker

    if isinstance(exc, NotATxmqBroker):
        return exitcodes.NOT_TXMQ
    if isinstance(exc, ConnectionLost) or isinstance(exc, TimeoutError):
        return exitcodes.UNREACHABLE
    if isinstance(exc, TxmqError):
        return _CODE_EXIT.get(exc.code, exitcodes.ERROR)
    return exitcodes.ERROR


def cli_error(exc: BaseException, address: str, token_given: bool | None = None) -> CliError:
    from txmq.client.connection import ConnectionLost, NotATxmqBroker

    if isinstance(exc, NotATxmqBroker):  # another service's port: a wrong -b, not a broker that is down
        return CliError(f"not a txmq broker at {address}: {exc.seen}", exitcodes.NOT_TXMQ)

    if isinstance(exc, TxmqError) and exc.code in (ErrorCode.AUTH_REQUIRED, ErrorCode.AUTH_FAILED) and token_given is not None:
        if token_given:
            return CliError(f"broker at {address} refused the auth token ({exc.message}): check --token or TXMQ_AUTH_TOKEN", exitcodes.REFUSED)
        return CliError(f"broker at {address} requires an auth token ({exc.message}): set --token or TXMQ_AUTH_TOKEN", exitcodes.REFUSED)
    if isinstance(exc, ConnectionLost):
        return CliError(f"broker unreachable at {address}: {exc.message}", exitcodes.UNREACHABLE)
    if isinstance(exc, TimeoutError):
        return CliError(f"broker at {address} did not answer: {exc}", exitcodes.UNREACHABLE)
    assert isinstance(exc, TxmqError)
    if exc.code is ErrorCode.UNKNOWN_OPERATION:
        # an older broker: the request this command needs came in a later version
        return CliError(f"broker at {address} does not support this command ({exc.message}): it runs an older txmq; "
                        "upgrade the broker", exitcodes.ERROR)
    if exc.code in (ErrorCode.AUTH_REQUIRED, ErrorCode.AUTH_FAILED):
        return CliError(f"broker at {address} refused the connection: {exc.message} (set --token or TXMQ_AUTH_TOKEN)", exitcodes.REFUSED)
    return CliError(exc.message, _CODE_EXIT.get(exc.code, exitcodes.ERROR))


@contextlib.asynccontextmanager
async def connect(address: str, token: str | None, producer_groups: tuple[str, ...] = (), reconnect: bool = False,
                  push_handler: Any = None, request_timeout: float | None = 30.0) -> AsyncIterator[Any]:
    """A started txmq.client.Client, failing fast (no reconnect) unless asked.

    Broker errors and timeouts raised inside the block become CliError with
    the documented exit code.
    """
    from txmq.client.connection import Client

    parse_address(address)
    client = Client(address, token=token or None, producer_groups=producer_groups, reconnect=reconnect,
                    connect_timeout=5.0, push_handler=push_handler, request_timeout=request_timeout)
    try:
        await client.start()
    except (TxmqError, TimeoutError) as e:
        raise cli_error(e, address, bool(token)) from None
    try:
        yield client
    except (TxmqError, TimeoutError) as e:
        raise cli_error(e, address, bool(token)) from None
    finally:
        await client.close()


def call(address: str, token: str | None, op: str, fields: dict[str, Any]) -> dict[str, Any]:
    """One request, one reply."""

    async def go() -> dict[str, Any]:
        async with connect(address, token) as c:
            return await c.request(op, fields)

    return run(go())
