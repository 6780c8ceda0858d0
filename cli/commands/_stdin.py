"""Lines of stdin as they arrive, for commands that act on each while more are on their way (`send -`, `resolve -`)."""

from __future__ import annotations

import os
import sys
from typing import Any, AsyncIterator

# Batches of stdin lines the reader thread may hold ahead of the command.
READ_AHEAD = 16


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


TIMEOUT = _Marker("TIMEOUT")  # next_batch: nothing arrived in time
TOO_LONG = _Marker("TOO_LONG")  # next_batch: the next line is longer than max_line (nothing after it is read)


class StdinReader:
    """Lines of stdin (bytes, without the newline or a CR before it) read by a thread, in batches as they arrive.

    The thread never waits on the event loop: it hands each batch over with
    call_soon_threadsafe and waits only for room (a semaphore the consumer
    releases, and releases once more when it stops), so a loop that stopped
    or closed cannot strand it, nor leave a coroutine of it unawaited. It is
    a daemon blocked in read(), left behind at exit, and it blocks SIGINT so
    Ctrl-C always lands on the main thread, where the loop's handler runs.

    With ``max_line``, a line longer than that many bytes is not read on:
    the batches before it are handed over, then TOO_LONG.
    """

    def __init__(self, max_line: int | None = None, read_ahead: int = READ_AHEAD) -> None:
        import collections
        import threading

        self.max_line = max_line
        self._batches: collections.deque[Any] = collections.deque()
        self._room = threading.Semaphore(read_ahead)
        self._stop = threading.Event()
        self._arrived: Any = None
        self._loop: Any = None
        self._ended = False

    def start(self) -> "StdinReader":
        """Start the reader thread (on the running event loop)."""
        import asyncio
        import signal
        import threading

        self._loop = asyncio.get_running_loop()
        self._arrived = asyncio.Event()
        thread = threading.Thread(target=self._read, args=(sys.stdin.fileno(),), name="txmq-stdin", daemon=True)
        if hasattr(signal, "pthread_sigmask"):  # the thread starts with SIGINT blocked (a thread inherits the mask)
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                thread.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        else:
            thread.start()
        return self

    def _hand(self, batch: Any) -> bool:
        self._batches.append(batch)
        try:
            self._loop.call_soon_threadsafe(self._arrived.set)
        except RuntimeError:  # the loop is closed: the command ended
            return False
        return True

    def _hand_lines(self, lines: list[bytes]) -> bool:
        if not lines:
            return True
        self._room.acquire()
        return not self._stop.is_set() and self._hand([ln[:-1] if ln.endswith(b"\r") else ln for ln in lines])

    def _read(self, fd: int) -> None:
        buf = b""
        limit = self.max_line
        try:
            while not self._stop.is_set():
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                buf += chunk
                *lines, buf = buf.split(b"\n")
                if limit is not None:
                    long = next((i for i, ln in enumerate(lines) if len(ln) > limit), None)
                    if long is not None or len(buf) > limit:
                        if self._hand_lines(lines[:long]):
                            self._hand(TOO_LONG)
                        return
                if not self._hand_lines(lines):
                    return
            if buf and not self._stop.is_set():
                self._hand_lines([buf])
        except OSError:
            pass
        finally:
            self._hand(None)

    async def next_batch(self, timeout: float | None = None) -> Any:
        """The next batch of lines; None once stdin has ended; TIMEOUT if none came within ``timeout`` seconds;
        TOO_LONG if the next line is over ``max_line``."""
        import asyncio

        if self._ended:
            return None
        while not self._batches:
            self._arrived.clear()
            if self._batches:
                break
            if timeout is None:
                await self._arrived.wait()
                continue
            try:
                async with asyncio.timeout(max(0.0, timeout)):
                    await self._arrived.wait()
            except TimeoutError:
                if not self._batches:
                    return TIMEOUT
        batch = self._batches.popleft()
        if batch is None or batch is TOO_LONG:
            self._ended = True
            return batch
        self._room.release()
        return batch

    def close(self) -> None:
        """No more reading: a reader waiting for room sees the stop."""
        self._stop.set()
        self._room.release()


async def stdin_lines(max_line: int | None = None) -> AsyncIterator[bytes]:
    """Each line of stdin as it arrives (see StdinReader); use with contextlib.aclosing."""
    reader = StdinReader(max_line).start()
    try:
        while True:
            batch = await reader.next_batch()
            if batch is None or batch is TOO_LONG:
                return
            for line in batch:
                yield line
    finally:
        reader.close()
