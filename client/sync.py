"""Blocking wrappers for scripts: each object runs its own event loop in a daemon thread.

    with SyncProducer("127.0.0.1:10911") as p:
        p.send("orders", b"hello")

The objects connect when created and are safe to share between threads
(every call is handed to the loop with `asyncio.run_coroutine_threadsafe`).
`SyncTransactionProducer` runs a plain `execute_local_transaction` in the
calling thread, as RocketMQ does, so thread-bound resources (a database
connection) work; check-backs run in the loop's executor threads.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from txmq.wire import TxmqError

from .connection import DEFAULT_ADDRESS
from .consumer import Consumer
from .message import Body, Keys, Message, ReceivedMessage, SendResult
from .producer import Producer
from .transaction import LocalTransactionState, TransactionProducer, TransactionSendResult

T = TypeVar("T")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class _LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = _new_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("a sync txmq object cannot be used from its own loop (a listener callback?)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()


async def _build(factory: Callable[[], T]) -> T:
    return factory()  # asyncio objects are made on the loop that will use them


class _SyncBase:
    _async: Any

    def __init__(self, name: str, factory: Callable[[], Any]) -> None:
        self._lt = _LoopThread(name)
        try:
            self._async = self._lt.call(_build(factory))
            self._lt.call(self._async.start())
        except BaseException:
            self._lt.stop()
            raise
        self._closed = False

    def _call(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        return self._lt.call(coro, timeout)

    def close(self) -> None:
        self._shutdown(self._async.close())

    def _shutdown(self, closing: Awaitable[Any]) -> None:
        if self._closed:
            closing.close()  # type: ignore[attr-defined]
            return
        self._closed = True
        try:
            self._lt.call(closing)
        finally:
            self._lt.stop()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._shutdown(self._async.__aexit__(*exc))

    def request(self, op: str, fields: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Any protocol operation on this object's connection (admin ops, broker_info...)."""
        return self._call(self._async.client.request(op, fields, timeout))


class SyncProducer(_SyncBase):
    def __init__(self, address: str = DEFAULT_ADDRESS, token: str | None = None, **client_options: Any) -> None:
        super().__init__("txmq-sync-producer", lambda: Producer(address, token, **client_options))

    def send(
        self,
        topic: str | Message,
        body: Body | None = None,
        *,
        tags: str | None = None,
        keys: Keys | None = None,
        properties: Mapping[str, str] | None = None,
        queue_id: int | None = None,
        timeout: float | None = None,
        deliver_at: Any = None,
        delay: Any = None,
    ) -> SendResult:
        """As `Producer.send`: ``send(Message(...))``, as ``send_in_transaction`` takes it, or ``send(topic, body, ...)``."""
        return self._call(
            self._async.send(topic, body, tags=tags, keys=keys, properties=properties, queue_id=queue_id, timeout=timeout,
                             deliver_at=deliver_at, delay=delay)
        )

    def cancel_scheduled(self, msg_id: str, topic: str | None = None) -> dict:
        return self._call(self._async.cancel_scheduled(msg_id, topic))

    def send_message(self, message: Message, *, queue_id: int | None = None) -> SendResult:
        return self._call(self._async.send_message(message, queue_id=queue_id))

    def send_batch(self, topic: str, messages: Iterable[Message | Body], queue_id: int | None = None) -> list[SendResult]:
        return self._call(self._async.send_batch(topic, list(messages), queue_id))

    def send_many(self, messages: Iterable[Message], *, queue_id: int | None = None, return_exceptions: bool = False) -> list[Any]:
        """Pipelined sends (many in flight), results in order; see `Producer.send_many`."""
        return self._call(self._async.send_many(list(messages), queue_id=queue_id, return_exceptions=return_exceptions))


class SyncTransactionProducer(_SyncBase):
    _async: TransactionProducer

    def __init__(
        self,
        group: str,
        listener: Any,
        address: str = DEFAULT_ADDRESS,
        token: str | None = None,
        check_concurrency: int = 16,
        **client_options: Any,
    ) -> None:
        self.listener = listener
        super().__init__(
            "txmq-sync-tx-producer",
            lambda: TransactionProducer(group, listener, address, token, check_concurrency, **client_options),
        )

    @property
    def group(self) -> str:
        return self._async.group

    def send_in_transaction(
        self, message: Message, arg: Any = None, *, timeout: float | None = None, wait_end: bool | None = None
    ) -> TransactionSendResult:
        """As `TransactionProducer.send_in_transaction`: the end is pipelined unless ``wait_end``.

        The result's ``end`` future belongs to the producer's loop thread:
        wait for it with `wait_end(result)`, or for every end with `flush()`.
        """
        tp = self._async
        fields = message.send_fields(tp._tx_props)
        try:
            half = self._call(tp._send_half(fields, timeout))
        except TxmqError as exc:
            return self._call(tp._not_durable(message, exc))
        view = tp._view(fields, half)
        fn = self.listener.execute_local_transaction
        if inspect.iscoroutinefunction(fn):
            state = self._call(tp._run_execute(view, arg))
        else:
            state = self._execute_here(fn, view, arg)
        if wait_end if wait_end is not None else tp.wait_end:
            return self._call(tp._finish(half, state, timeout))
        return self._call(_value(lambda: tp._finish_pipelined(half, state, timeout)))

    def wait_end(self, result: TransactionSendResult, timeout: float | None = None) -> str | None:
        """The end's outcome (None if it could not be delivered); raises its refusal (CONFLICT, TX_NOT_FOUND)."""
        if result.end is None:
            return result.outcome
        return self._call(_awaited(result.end), timeout)

    def flush(self, timeout: float | None = None) -> int:
        """Wait for every pipelined end; returns how many are still outstanding (0: all answered)."""
        return self._call(self._async.flush(timeout))

    @property
    def end_failures(self) -> dict[str, int]:
        return dict(self._async.end_failures)

    def _execute_here(self, fn: Callable[..., Any], view: ReceivedMessage, arg: Any) -> LocalTransactionState:
        try:
            result = fn(view, arg)
            if inspect.isawaitable(result):
                result = self._call(_awaited(result))
        except Exception:
            import logging

            logging.getLogger("txmq.client").exception("execute_local_transaction failed for %s; state UNKNOW", view.tx_id)
            return LocalTransactionState.UNKNOW
        return LocalTransactionState.coerce(result)


async def _awaited(aw: Awaitable[T]) -> T:
    return await aw


class SyncConsumer(_SyncBase):
    """Blocking consumer; iterate it, or `poll()`. See `Consumer` for the options."""

    _async: Consumer

    def __init__(self, group: str, topic: str, address: str = DEFAULT_ADDRESS, token: str | None = None, **options: Any) -> None:
        self.poll_timeout = options.pop("poll_timeout", 1.0)
        super().__init__("txmq-sync-consumer", lambda: Consumer(group, topic, address, token, **options))

    def poll(self, timeout: float = 1.0, max_messages: int | None = None) -> list[ReceivedMessage]:
        return self._call(self._async.poll(timeout, max_messages))

    def commit(self, what: ReceivedMessage | tuple[int, int] | None = None) -> None:
        self._call(self._async.commit(what))

    def caught_up(self) -> bool:
        return self._call(_value(self._async.caught_up))

    def lag(self) -> dict[int, int]:
        return self._call(_value(self._async.lag))

    def __iter__(self) -> Iterator[ReceivedMessage]:
        """Messages one at a time, each counted as processed once the next is asked for (as ``async for``).

        A batch is taken from the buffer at once, but a message is handed
        out (and later committed) only when yielded: after a ``break`` or an
        exception the rest of the batch goes back to the buffer, and a
        ``commit()`` in the loop commits what was yielded, never beyond.
        """
        stop = self._async.stop_when_caught_up
        outstanding = self._async._outstanding  # only touched while this thread waits in _call, or here
        while not self._closed:
            batch = self._call(self._async._take(self.poll_timeout))
            handed = 0
            try:
                for msg in batch:
                    handed += 1
                    outstanding.append(msg)
                    yield msg
            finally:
                if handed < len(batch) and not self._closed:
                    self._call(self._async._give_back(batch[handed:]))
            if not batch and stop and self.caught_up():
                return


async def _value(fn: Callable[[], T]) -> T:
    return fn()
