"""txmq's client library: producers, transactional producers and consumers.

Runnable against a broker on the default address (``txmq broker``)::

    import asyncio
    from txmq.client import (
        Consumer, LocalTransactionState, Message, Producer,
        TransactionListener, TransactionProducer,
    )

    class Listener(TransactionListener):
        def execute_local_transaction(self, message, arg):
            return LocalTransactionState.COMMIT_MESSAGE if arg == "ok" else LocalTransactionState.UNKNOW

        def check_local_transaction(self, message):
            return LocalTransactionState.COMMIT_MESSAGE

    async def main():
        async with Producer("127.0.0.1:10911") as p:
            r = await p.send("demo", b"plain", tags="t1", keys=["k1", "k2"])
            print("sent", r.msg_id, "queue", r.queue_id, "offset", r.queue_offset)

        async with TransactionProducer("demo-group", Listener()) as tp:
            r = await tp.send_in_transaction(Message("demo", b"paid"), arg="ok")
            print("transaction", r.tx_id, r.local_state.name, await r.end)  # the end's reply (pipelined)

        async with Consumer("demo-readers", "demo", stop_when_caught_up=True) as c:
            async for msg in c:
                print(msg.queue_id, msg.queue_offset, msg.tags, msg.tx_id, msg.body)

    asyncio.run(main())

Blocking scripts use `SyncProducer`, `SyncTransactionProducer` and
`SyncConsumer` the same way, as context managers. Every error is a
`txmq.wire.TxmqError` with a wire ``code`` and a ``retriable`` flag; a dropped
connection is `ConnectionLost` (retriable); an address where another service
answers is `NotATxmqBroker` (not retriable). See docs/protocol.md for the wire.
"""

from txmq.wire import ErrorCode, TxmqError

from .connection import (
    DEFAULT_ADDRESS,
    SAFE_TO_RETRY,
    Client,
    ClientClosed,
    Connection,
    ConnectionLost,
    NotATxmqBroker,
    connect,
    parse_address,
)
from .consumer import Consumer
from .message import Message, MessageView, ReceivedMessage, SendResult
from .producer import Producer
from .sync import SyncConsumer, SyncProducer, SyncTransactionProducer
from .transaction import (
    HalfResult,
    LocalTransactionState,
    SendStatus,
    TransactionListener,
    TransactionProducer,
    TransactionSendResult,
)

__all__ = [
    "DEFAULT_ADDRESS",
    "SAFE_TO_RETRY",
    "Client",
    "ClientClosed",
    "Connection",
    "ConnectionLost",
    "Consumer",
    "ErrorCode",
    "HalfResult",
    "LocalTransactionState",
    "Message",
    "MessageView",
    "NotATxmqBroker",
    "Producer",
    "ReceivedMessage",
    "SendResult",
    "SendStatus",
    "SyncConsumer",
    "SyncProducer",
    "SyncTransactionProducer",
    "TransactionListener",
    "TransactionProducer",
    "TransactionSendResult",
    "TxmqError",
    "connect",
    "parse_address",
]
