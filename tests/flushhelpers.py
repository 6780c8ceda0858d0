"""A store and a group-commit Flusher around it, for the fsync tests, and ways to make an fsync fail."""

from __future__ import annotations

import errno
from typing import Any, Awaitable, Callable

from conftest import arun
from txmq.broker.flush import Flusher
from txmq.store import Store


def open_store(tmp_path) -> Store:
    store = Store(tmp_path / "d")
    store.open()
    return store


def run_flusher(store: Store, body: Callable[[Flusher], Awaitable[None]], *, interval_s: float = 3600, **options: Any) -> None:
    """body(flusher) with a sync-mode Flusher started on a loop, then stop it and close the store.

    The default interval keeps checkpoint cycles out of the way, and every
    wait goes through group commit, as with several clients (not a lone
    client's inline fsync).
    """
    async def go():
        flusher = Flusher(store, sync=True, interval_s=interval_s, **options)
        flusher.lone_client = lambda: False
        flusher.start()
        try:
            await body(flusher)
        finally:
            await flusher.stop()

    try:
        arun(go())
    finally:
        store.close()


def fail_next_end_sync(store: Store) -> None:
    """The next fsync job ends as failed (EIO), whichever thread ran it: what the C thread reports on a bad disk."""
    real_end = store.end_sync
    fail = [True]

    def end_sync(job, error, *args):
        if fail[0]:
            fail[0] = False
            error = OSError(errno.EIO, "fdatasync failed")
        return real_end(job, error, *args)

    store.end_sync = end_sync  # type: ignore[method-assign]


class FailsFirst:
    """A stand-in for an fsync-like call (os.fdatasync, consumequeue.fsync_path) that fails with EIO the first `failures` times."""

    def __init__(self, real, failures: int = 1) -> None:
        self.real = real
        self.failures = failures

    def __call__(self, arg) -> None:
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EIO, "Input/output error")
        self.real(arg)


class PwriteSpy:
    """os.pwrite that records (file position, bytes) of every call."""

    def __init__(self, real) -> None:
        self.real = real
        self.calls: list[tuple[int, int]] = []

    def __call__(self, fd, data, pos):
        self.calls.append((pos, len(data)))
        return self.real(fd, data, pos)
