"""The pull consumer: one fetch loop per queue over one connection.

``async with Consumer("billing", "orders") as c: async for msg in c: ...``

Start position per queue: the group's committed offset (`fetch_offsets`);
without one, ``from_="earliest"`` starts at the queue's first message and
``"latest"`` at its end. Offsets are "next offset to read" (RocketMQ).

A topic that does not exist yet is waited for: the consumer re-reads
`list_topics` every ``discover_interval`` seconds and starts once it
appears (and `caught_up()` is true meanwhile: there is nothing to read).
Pass ``create_topic=True`` to create it instead (with ``queues_if_created``).

Each queue's loop pulls ``batch_size`` messages at a time; its next pull
goes out as soon as a reply arrives (not when the messages are consumed),
up to ``max_buffered`` undelivered messages. A queue that is caught up
long-polls (``wait_ms``) so new messages arrive without busy polling.

Committing: with ``auto_commit`` (the default) the position of every
message handed out is committed every ``auto_commit_interval`` seconds and
on close; a message counts as processed once the next one is asked for
(the next ``__anext__``/``poll``) or the consumer is closed without an
exception. `commit()` commits explicitly.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from typing import Any

from txmq.wire import ErrorCode, TxmqError

from .connection import DEFAULT_ADDRESS, Client, ConnectionLost
from .message import ReceivedMessage

log = logging.getLogger("txmq.client")


def _retry(exc: TxmqError, client: Client) -> bool:
    """Whether a request that failed so is worth repeating later (a lost connection only if the client reconnects)."""
    if isinstance(exc, ConnectionLost) and not client.reconnect:
        return False  # nobody will bring the connection back
    return exc.retriable


class Consumer:
    def __init__(
        self,
        group: str,
        topic: str,
        address: str = DEFAULT_ADDRESS,
        token: str | None = None,
        from_: str = "earliest",
        queues: Iterable[int] | None = None,
        *,
        auto_commit: bool = True,
        auto_commit_interval: float = 1.0,
        batch_size: int = 64,
        max_bytes: int | None = None,
        wait_ms: int = 5000,
        max_buffered: int = 8192,
        create_topic: bool = False,
        queues_if_created: int | None = None,
        discover_interval: float = 1.0,
        stop_when_caught_up: bool = False,
        **client_options: Any,
    ) -> None:
        if from_ not in ("earliest", "latest"):
            raise ValueError("from_ must be 'earliest' or 'latest'")
        self.group = group
        self.topic = topic
        self.from_ = from_
        self.auto_commit = auto_commit
        self.auto_commit_interval = auto_commit_interval
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.wait_ms = wait_ms
        self.max_buffered = max_buffered
        self.create_topic = create_topic
        self.queues_if_created = queues_if_created
        self.discover_interval = discover_interval
        self.stop_when_caught_up = stop_when_caught_up
        self._wanted = None if queues is None else sorted(set(queues))
        self._client = Client(address, token=token, consumer_groups=(group,), **client_options)
        self.queue_ids: list[int] = []
        self._position: dict[int, int] = {}  # next offset each fetch loop will pull
        self._max: dict[int, int] = {}  # max_offset from each queue's last reply
        self._delivered: dict[int, int] = {}  # next offset after what was handed out and processed
        self._committed: dict[int, int] = {}
        self._buffer: deque[ReceivedMessage] = deque()
        self._outstanding: list[ReceivedMessage] = []  # handed out, not yet counted as processed
        self._wakeup = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self._tasks: list[asyncio.Task[None]] = []
        self._error: BaseException | None = None
        self._discovered = False
        self._started = False
        self._closed = False

    @property
    def client(self) -> Client:
        return self._client

    # ---- life cycle -----------------------------------------------------

    async def start(self) -> "Consumer":
        if self._started:
            return self
        self._started = True
        await self._client.start()
        if not await self._discover():
            self._spawn(self._discover_loop(), "discover")
        if self.auto_commit:
            self._spawn(self._auto_commit_loop(), "auto-commit")
        return self

    async def close(self, *, commit: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if commit and self.auto_commit and self._client.connected:
            self._mark_processed()
            try:
                await self._commit_delivered()
            except (TxmqError, TimeoutError) as exc:
                log.warning("final offset commit failed: %s", exc)
        await self._client.close()
        self._wakeup.set()

    async def __aenter__(self) -> "Consumer":
        return await self.start()

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self._outstanding.clear()  # the last message was not processed
        await self.close()

    def _spawn(self, coro: Any, name: str) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coro, name=f"txmq-consumer-{self.topic}-{name}"))

    # ---- discovery ------------------------------------------------------

    async def _discover(self) -> bool:
        topics = (await self._client.request("list_topics", {}))["topics"]
        info = next((t for t in topics if t["topic"] == self.topic), None)
        if info is None and self.create_topic:
            fields: dict[str, Any] = {"topic": self.topic}
            if self.queues_if_created is not None:
                fields["queues"] = self.queues_if_created
            info = await self._client.request("create_topic", fields)
        if info is None:
            return False
        all_queues = list(range(info["queues"]))
        if self._wanted is None:
            self.queue_ids = all_queues
        else:
            missing = [q for q in self._wanted if q not in all_queues]
            if missing:
                raise TxmqError(f"topic {self.topic!r} has no queue(s) {missing}", ErrorCode.NO_SUCH_QUEUE)
            self.queue_ids = list(self._wanted)
        reply = await self._client.request("fetch_offsets", {"group": self.group, "topic": self.topic})
        committed = {int(q): off for q, off in (reply.get("offsets") or {}).items()}
        for q in self.queue_ids:
            if q in committed:
                start = committed[q]
            elif self.from_ == "latest":
                start = await self._queue_end(q)
            else:
                start = 0  # the first pull moves it up to min_offset
            self._position[q] = start
            self._delivered[q] = start
            self._committed[q] = start  # nothing to commit until something is handed out
        self._discovered = True
        for q in self.queue_ids:
            self._spawn(self._fetch_loop(q), f"q{q}")
        return True

    async def _discover_loop(self) -> None:
        client = self._client
        try:
            while True:
                await asyncio.sleep(self.discover_interval)
                try:
                    if await self._discover():
                        return
                except TimeoutError:
                    continue
                except TxmqError as exc:  # an outage while waiting for the topic: wait on, as the fetch loops do
                    if not _retry(exc, client):
                        raise
                    log.debug("looking for topic %s failed (%s); trying again", self.topic, exc)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)

    async def _queue_end(self, q: int) -> int:
        r = await self._client.request("pull", {"topic": self.topic, "queue_id": q, "offset": 0, "max_count": 1})
        return r["max_offset"]

    # ---- fetching -------------------------------------------------------

    async def _fetch_loop(self, q: int) -> None:
        client = self._client
        delay = idle = 0.05
        req: dict[str, Any] = {"topic": self.topic, "queue_id": q, "offset": 0, "max_count": self.batch_size, "wait_ms": 0}
        if self.max_bytes is not None:
            req["max_bytes"] = self.max_bytes
        try:
            while True:
                while len(self._buffer) >= self.max_buffered:
                    self._space.clear()
                    await self._space.wait()
                offset = self._position[q]
                req["offset"] = offset
                req["wait_ms"] = self.wait_ms if self._max.get(q, -1) >= 0 and offset >= self._max[q] else 0
                try:
                    r = await client.request("pull", req, req["wait_ms"] / 1000 + (client.request_timeout or 30.0))
                except TimeoutError:
                    continue
                except TxmqError as exc:
                    if not (_retry(exc, client) or exc.code == ErrorCode.NO_SUCH_QUEUE):
                        raise
                    log.debug("pull %s/%d failed (%s); retrying in %.2fs", self.topic, q, exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                delay = 0.05
                status = r.get("status")
                if status == "found":
                    from_map = ReceivedMessage.from_map
                    batch = [from_map(m) for m in r.get("messages") or () if m["queue_offset"] >= offset]
                    self._buffer.extend(batch)
                    offset = r["next_offset"]
                elif status == "no_message":
                    offset = r.get("next_offset", offset)
                elif status == "offset_too_small":
                    offset = r["min_offset"]
                elif status == "offset_overflow":
                    offset = r["max_offset"]
                else:
                    # no_queue: nothing was ever stored in this queue (or the topic
                    # is gone). The broker cannot long-poll it, so poll gently.
                    self._max[q] = max(r.get("max_offset", 0), 0)
                    self._wakeup.set()
                    await asyncio.sleep(idle)
                    idle = min(idle * 2, 1.0)
                    continue
                idle = 0.05
                self._position[q] = offset
                self._max[q] = r["max_offset"]
                self._wakeup.set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        log.error("consumer of %s stopped: %s", self.topic, exc)
        self._error = exc
        self._wakeup.set()

    # ---- delivering -----------------------------------------------------

    def caught_up(self) -> bool:
        """True when every queue has been read to its end (as of its last pull) and all was handed out.

        A topic that does not exist yet counts as caught up.
        """
        if self._buffer:
            return False
        if not self._discovered:
            return True
        mx = self._max
        pos = self._position
        return all(q in mx and pos[q] >= mx[q] for q in self.queue_ids)

    def lag(self) -> dict[int, int]:
        """Per queue: messages stored but not yet handed out (as of the last pull)."""
        return {q: max(0, self._max.get(q, 0) - self._delivered.get(q, 0)) for q in self.queue_ids}

    def __aiter__(self) -> "Consumer":
        return self

    async def __anext__(self) -> ReceivedMessage:
        self._mark_processed()
        while True:
            if self._buffer:
                msg = self._buffer.popleft()
                self._outstanding.append(msg)
                if not self._space.is_set():
                    self._space.set()
                return msg
            if self._error is not None:
                raise self._error
            if self._closed or (self.stop_when_caught_up and self.caught_up()):
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()

    async def poll(self, timeout: float = 1.0, max_messages: int | None = None) -> list[ReceivedMessage]:
        """Up to `max_messages` messages, waiting at most `timeout` seconds for the first."""
        out = await self._take(timeout, max_messages)
        self._outstanding.extend(out)
        return out

    async def _take(self, timeout: float, max_messages: int | None = None) -> list[ReceivedMessage]:
        """poll's messages, not yet handed out: the caller adds each to ``_outstanding`` as it hands it out."""
        self._mark_processed()
        if not self._buffer and self._error is None and not self._closed:
            self._wakeup.clear()
            try:
                async with asyncio.timeout(timeout):
                    while not self._buffer and self._error is None and not self._closed:
                        await self._wakeup.wait()
                        self._wakeup.clear()
            except TimeoutError:
                pass
        if self._error is not None and not self._buffer:
            raise self._error
        n = len(self._buffer) if max_messages is None else min(max_messages, len(self._buffer))
        out = [self._buffer.popleft() for _ in range(n)]
        if out and not self._space.is_set():
            self._space.set()
        return out

    async def _give_back(self, msgs: list[ReceivedMessage]) -> None:
        """Messages taken and never handed out go back to the front of the buffer, in order."""
        self._buffer.extendleft(reversed(msgs))

    def _mark_processed(self) -> None:
        if self._outstanding:
            delivered = self._delivered
            for m in self._outstanding:
                delivered[m.queue_id] = m.queue_offset + 1
            self._outstanding.clear()

    # ---- committing -----------------------------------------------------

    async def commit(self, what: ReceivedMessage | tuple[int, int] | None = None) -> None:
        """Commit a position for the group.

        - a message: the next offset after it (it and everything before it on its queue are done);
        - ``(queue_id, offset)``: `offset` as the next offset to read;
        - nothing: every message handed out so far.
        """
        if what is None:
            self._mark_processed()
            await self._commit_delivered()
            return
        if isinstance(what, ReceivedMessage):
            q, offset = what.queue_id, what.queue_offset + 1
        else:
            q, offset = what
        await self._commit_one(q, offset)
        # an explicit position wins: auto-commit must not put back the older one it had for this queue
        self._delivered[q] = offset

    async def _commit_one(self, q: int, offset: int) -> None:
        await self._client.request("commit_offset", {"group": self.group, "topic": self.topic, "queue_id": q, "offset": offset})
        self._committed[q] = offset

    async def _commit_delivered(self) -> None:
        for q, offset in list(self._delivered.items()):
            if self._committed.get(q) != offset:
                await self._commit_one(q, offset)

    async def _auto_commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.auto_commit_interval)
            try:
                await self._commit_delivered()
            except (TxmqError, TimeoutError) as exc:
                log.warning("auto-commit failed: %s", exc)

    @property
    def committed(self) -> dict[int, int]:
        """Per queue: the last offset committed (or the start position when none was)."""
        return dict(self._committed)

    @property
    def positions(self) -> dict[int, int]:
        return dict(self._position)
