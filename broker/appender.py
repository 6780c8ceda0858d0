"""Every write to the commit log: what is submitted in one loop iteration goes out as one store.append.

The core and the transaction services write through one Appender, built
with what it uses, so a batch holds what every connection sent in that
iteration (one write syscall) and the index learns of it in log order.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

from txmq.store import AppendResult, Message, RawCopy, RecordTooLargeError, Store, StoreFullError
from txmq.wire import ErrorCode, TxmqError

from .flush import Flusher
from .metrics import Metrics


class Appender:
    """Batches appends submitted in one loop iteration into one store.append.

    ``submit`` returns a future and creates no task: ``shape`` turns the
    append results into the caller's value right after the write (index
    updates happen there, so they always match the log), and with
    ``durable`` the future resolves only once the flusher has fsynced past
    the batch (sync flush mode). A request on the hot path costs one future.
    """

    def __init__(self, store: Store, flusher: Flusher, metrics: Metrics, notify: Callable[[Sequence[Message | RawCopy]], None],
                 to_error: Callable[[BaseException], TxmqError]) -> None:
        self.store = store
        self.flusher = flusher
        self.metrics = metrics
        self.notify = notify  # wakes the long polls on the queues a batch went to
        self.to_error = to_error  # a failed write as the wire error its callers get
        self.closed = False  # the broker is shutting down: appends are refused
        self._batch: list[Message] = []
        self._subs: list[tuple[asyncio.Future, int, int, Callable[[list[AppendResult]], Any] | None, bool]] = []
        self._scheduled = False
        self.loop = asyncio.get_running_loop()

    def submit(self, msgs: Sequence[Message], shape: Callable[[list[AppendResult]], Any] | None = None, durable: bool = True) -> asyncio.Future:
        loop = self.loop
        fut = loop.create_future()
        if self.closed:
            fut.set_exception(TxmqError("broker is shutting down", ErrorCode.SHUTTING_DOWN))
            return fut
        self._subs.append((fut, len(self._batch), len(msgs), shape, durable))
        self._batch.extend(msgs)
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._drain)
        return fut

    def close(self) -> None:
        """Refuse every later append: the broker is shutting down."""
        self.closed = True

    def _drain(self) -> None:
        self._scheduled = False
        batch, subs = self._batch, self._subs
        self._batch, self._subs = [], []
        if not batch:
            return
        store = self.store
        before = store.max_offset
        try:
            results = store.append(batch)
        except Exception as exc:  # one bad batch must not kill the loop
            if len(subs) > 1 and isinstance(exc, (RecordTooLargeError, StoreFullError)):
                self._one_by_one(batch, subs, full_stops=isinstance(exc, StoreFullError))
                return
            err = self.to_error(exc)
            for sub in subs:
                if not sub[0].done():
                    sub[0].set_exception(err)
            return
        m = self.metrics.counters
        m["records_appended"] += len(results)
        m["bytes_appended"] += store.max_offset - before
        # Durable submissions of the batch wait for one fsync past its end
        # together: one waiter per batch, not one per request.
        wait: list[tuple[asyncio.Future, Any]] = []
        for sub in subs:
            self._settle_written(sub, results[sub[1] : sub[1] + sub[2]], wait)
        self.notify(batch)
        if wait:
            waiter = self.flusher.wait_durable(results[-1].end_offset)
            if waiter is None:
                for fut, value in wait:
                    if not fut.done():
                        fut.set_result(value)
            else:
                waiter.add_done_callback(lambda w: _settle_durable(wait, w))

    def _one_by_one(self, batch: list[Message], subs: list, full_stops: bool) -> None:
        """A batch refused whole, written again one submission at a time, in order.

        Too large a record fails only its own submission. A full disk: the
        batch may be far more than the space left (a pipe of large lines, a
        burst of producers), so the submissions that fit are written, in
        order, until the first that does not; it and every later one get the
        full disk's error (order kept: nothing after a refused one is stored).
        """
        store = self.store
        m = self.metrics.counters
        full: BaseException | None = None
        for sub in subs:
            fut, start, count = sub[0], sub[1], sub[2]
            if full is not None:
                if not fut.done():
                    fut.set_exception(self.to_error(full))
                continue
            part = batch[start : start + count]
            before = store.max_offset
            try:
                res = store.append(part)
            except Exception as exc:
                if full_stops and isinstance(exc, StoreFullError):
                    full = exc
                if not fut.done():
                    fut.set_exception(self.to_error(exc))
            else:
                m["records_appended"] += len(res)
                m["bytes_appended"] += store.max_offset - before
                self._settle_written(sub, res)
                self.notify(part)

    def _settle_written(self, sub, results: list[AppendResult], wait: list | None = None) -> None:
        """Shape the results; resolve the future now, or put it in wait (durable, sync flush)."""
        fut, _, _, shape, durable = sub
        # shape runs even if the caller gave up (cancelled): the records are
        # in the log, so the index must learn of them.
        try:
            value = shape(results) if shape is not None else results
        except Exception as exc:
            if not fut.done():
                fut.set_exception(self.to_error(exc))
            return
        if fut.done():
            return
        if durable and self.flusher.sync_mode:
            if wait is not None:
                wait.append((fut, value))
                return
            waiter = self.flusher.wait_durable(results[-1].end_offset)
            if waiter is not None:
                waiter.add_done_callback(lambda w: _settle_durable([(fut, value)], w))
                return
        fut.set_result(value)


def _settle_durable(wait: list[tuple[asyncio.Future, Any]], waiter: asyncio.Future) -> None:
    exc = waiter.exception()
    for fut, value in wait:
        if fut.done():
            continue
        if exc is None:
            fut.set_result(value)
        elif isinstance(exc, TxmqError) and isinstance(value, dict):
            # Written but not known durable: say which record, so a producer can end it.
            extra = {k: value[k] for k in ("tx_id", "commit_log_offset", "half_offset") if k in value}
            fut.set_exception(TxmqError(exc.message, exc.code, **extra))
        else:
            fut.set_exception(exc)
