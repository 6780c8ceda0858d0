"""The plain producer.

Sends are never retried by the client (a repeat could store the message
twice); a send issued while the client is reconnecting waits for the
connection and then goes out once. Many sends may be in flight on the one
connection: ``await asyncio.gather(*(p.send(...) ...))`` or, without a task
per message, `send_many`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from txmq.wire import TxmqError

from .connection import DEFAULT_ADDRESS, Client
from .message import Body, Delay, Keys, Message, SendResult, When, build_properties, now_ms, schedule_properties, to_bytes


def message_only(message: Message, body: Any, **given: Any) -> None:
    """A `Message` given to ``send`` carries everything but the queue and the timeout: anything else beside it is refused."""
    extra = (["body"] if body is not None else []) + [k for k, v in given.items() if v is not None]
    if extra:
        raise TypeError(f"send(Message(...)) takes {', '.join(extra)} in the Message, not beside it "
                        "(only queue_id and timeout go beside it)")


class Producer:
    """``async with Producer("127.0.0.1:10911") as p: await p.send("orders", b"...")``."""

    def __init__(self, address: str = DEFAULT_ADDRESS, token: str | None = None, **client_options: Any) -> None:
        self._client = Client(address, token=token, **client_options)

    @property
    def client(self) -> Client:
        return self._client

    async def start(self) -> "Producer":
        await self._client.start()
        return self

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> "Producer":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def send(
        self,
        topic: str | Message,
        body: Body | None = None,
        *,
        tags: str | None = None,
        keys: Keys | None = None,
        properties: Mapping[str, str] | None = None,
        queue_id: int | None = None,
        timeout: float | None = None,
        deliver_at: When | None = None,
        delay: Delay | None = None,
    ) -> SendResult:
        """Send one message: ``send(Message(...))``, as ``send_in_transaction`` takes it, or ``send(topic, body, ...)``.

        With ``deliver_at`` or ``delay`` the broker delivers it then (``SendResult.deliver_at_ms``).
        A `Message` carries its own tags, keys, properties and times; only
        ``queue_id`` and ``timeout`` go beside it.
        """
        if isinstance(topic, Message):
            message_only(topic, body, tags=tags, keys=keys, properties=properties, deliver_at=deliver_at, delay=delay)
            return await self.send_message(topic, queue_id=queue_id, timeout=timeout)
        if body is None:
            raise TypeError("send() needs a body after the topic, or a Message: send(Message(topic, body, ...))")
        fields: dict[str, Any] = {"topic": topic, "body": to_bytes(body), "born_ts": now_ms()}
        props = build_properties(tags, keys, properties, schedule_properties(deliver_at, delay))
        if props is not None:
            fields["properties"] = props
        if queue_id is not None:
            fields["queue_id"] = queue_id
        return SendResult.from_reply(await self._client.request("send", fields, timeout))

    async def cancel_scheduled(self, msg_id: str, topic: str | None = None, *, timeout: float | None = None) -> dict[str, Any]:
        """Cancel a delayed or timed message not yet delivered, by its id: ``{"msg_id", "cancelled": [...]}``.

        Raises TxmqError NO_SUCH_MESSAGE when none with this id waits
        (delivered already, cancelled, or never scheduled).
        """
        fields: dict[str, Any] = {"msg_id": msg_id}
        if topic is not None:
            fields["topic"] = topic
        return await self._client.request("cancel_scheduled", fields, timeout)

    async def send_message(self, message: Message, *, queue_id: int | None = None, timeout: float | None = None) -> SendResult:
        fields = message.send_fields()
        if queue_id is not None:
            fields["queue_id"] = queue_id
        return SendResult.from_reply(await self._client.request("send", fields, timeout))

    async def send_batch(
        self, topic: str, messages: Iterable[Message | Body], queue_id: int | None = None, *, timeout: float | None = None
    ) -> list[SendResult]:
        """Send several messages to one queue in one request (one write, one fsync on the broker)."""
        items: list[dict[str, Any]] = []
        born = now_ms()
        for m in messages:
            if isinstance(m, Message):
                if m.topic != topic:
                    raise ValueError(f"batch for topic {topic!r} holds a message for {m.topic!r}")
                item: dict[str, Any] = {"body": to_bytes(m.body), "born_ts": born}
                props = m.wire_properties()
                if props is not None:
                    item["properties"] = props
            else:
                item = {"body": to_bytes(m), "born_ts": born}
            items.append(item)
        if not items:
            return []
        fields: dict[str, Any] = {"topic": topic, "messages": items}
        if queue_id is not None:
            fields["queue_id"] = queue_id
        reply = await self._client.request("send_batch", fields, timeout)
        return [SendResult.from_reply(r) for r in reply["results"]]

    async def send_many(
        self,
        messages: Iterable[Message],
        *,
        queue_id: int | None = None,
        return_exceptions: bool = False,
        window: int = 4096,
    ) -> list[Any]:
        """Send each message with its own request, up to `window` in flight, without a task per message.

        Results come back in order. With ``return_exceptions`` a failed send
        yields its exception in place of a `SendResult`; otherwise the first
        failure is raised once every request has been answered (the others
        may have been stored). A broker that reads nothing for
        ``request_timeout`` (its connection stays full) raises TimeoutError,
        whatever ``return_exceptions``: the messages after those in flight
        were not sent.
        """
        client = self._client
        out: list[Any] = []
        in_flight: deque[asyncio.Future[dict[str, Any]]] = deque()

        async def settle_one() -> None:
            try:
                out.append(SendResult.from_reply(await in_flight.popleft()))
            except (TxmqError, TimeoutError) as exc:
                out.append(exc)

        for m in messages:
            fields = m.send_fields()
            if queue_id is not None:
                fields["queue_id"] = queue_id
            if len(in_flight) >= window:
                await settle_one()
            try:
                await client.drain()
            except TimeoutError:  # the broker reads nothing: the rest is not sent, what is in flight times out
                while in_flight:
                    await settle_one()
                raise
            await client.wait_connected()
            in_flight.append(client.send_request("send", fields))
        while in_flight:
            await settle_one()
        if not return_exceptions:
            for r in out:
                if isinstance(r, BaseException):
                    raise r
        return out
