"""Long polls: the reads waiting for a message on a queue, woken when one is appended there.

One table per broker, keyed by (topic, queue id): the core's pull waits on
one queue (``wait``); the consumption service (broker/messaging/consumption.py)
puts one future on every queue of a topic for all the receives waiting on it
(``watch``). The Appender calls ``notify`` with each batch it wrote, which
wakes the futures of the queues written and takes them off the table; at
shutdown ``wake_all`` answers every poll at once. A future that timed out or
was cancelled takes itself off (``unwatch``), so a queue nobody sends to
keeps nothing behind.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Sequence

from txmq.store import HEADER_SIZE, Message, RawCopy
from txmq.store.codec import H_QUEUE_ID, H_TOPIC_LEN, HEADER


class LongPolls:
    """The futures waiting per (topic, queue id). Runs on the event loop."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, int], list[asyncio.Future]] = defaultdict(list)

    def waiting(self) -> int:
        """The futures on the table (a future watching n queues counts n times)."""
        return sum(len(w) for w in self._waiting.values())

    def notify(self, msgs: Sequence[Message | RawCopy]) -> None:
        """Wake the long polls waiting on the queues these messages went to.

        A batch can hold check copies (RawCopy: the queue is its source
        record's), written together with sends to the queues being polled.
        """
        waiting = self._waiting
        if not waiting:
            return
        keys = set()
        for m in msgs:
            if type(m) is RawCopy:
                h = m.header or HEADER.unpack_from(m.source)
                keys.add((str(m.source[HEADER_SIZE : HEADER_SIZE + h[H_TOPIC_LEN]], "utf-8"), h[H_QUEUE_ID]))
            else:
                keys.add((m.topic, m.queue_id))
        for key in keys:
            for fut in waiting.pop(key, ()):
                if not fut.done():
                    fut.set_result(None)

    def wake_all(self) -> None:
        """Answer every long poll now (shutdown)."""
        waiting, self._waiting = self._waiting, defaultdict(list)
        for futs in waiting.values():
            for fut in futs:
                if not fut.done():
                    fut.set_result(None)

    def watch(self, topic: str, queues: int, fut: asyncio.Future) -> None:
        """fut is woken (its result set) by the next append to any of the topic's queues 0 to queues - 1."""
        waiting = self._waiting
        for q in range(queues):
            waiting[(topic, q)].append(fut)

    def unwatch(self, topic: str, queues: int, fut: asyncio.Future) -> None:
        """Take fut off the queues ``watch`` put it on (those woken took it off already)."""
        for q in range(queues):
            self._drop((topic, q), fut)

    async def wait(self, topic: str, queue_id: int, timeout: float) -> None:
        """Until a message is appended to the queue, ``wake_all``, or timeout seconds."""
        fut = asyncio.get_running_loop().create_future()
        key = (topic, queue_id)
        self._waiting[key].append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            pass
        finally:  # a poll that timed out (or was cancelled) leaves nothing behind on a queue nobody sends to
            self._drop(key, fut)

    def _drop(self, key: tuple[str, int], fut: asyncio.Future) -> None:
        futs = self._waiting.get(key)
        if futs:
            try:
                futs.remove(fut)
            except ValueError:  # woken: the list it was on is gone already
                pass
            if not futs:
                del self._waiting[key]
