"""Sends waiting on a checkpoint cycle are answered once the log is fsynced, not after the queues and checkpoint file."""

from __future__ import annotations

import asyncio
import threading

from conftest import arun
from flushhelpers import run_flusher
from txmq.broker.flush import Flusher
from txmq.store import Message, Store, TxType


def test_a_send_waiting_on_a_checkpoint_cycle_is_answered_once_the_log_is_fsynced(tmp_path):
    store = Store(tmp_path / "d")
    store.open()
    gate = threading.Event()  # holds the checkpoint after its log fsync (slow queue and checkpoint files)
    finished = threading.Event()
    real = store.checkpoint

    def slow_checkpoint(on_synced=None):
        def synced(durable):
            if on_synced is not None:
                on_synced(durable)
            gate.wait(10)

        real(synced)
        finished.set()

    store.checkpoint = slow_checkpoint  # type: ignore[method-assign]

    async def go():
        flusher = Flusher(store, sync=True, interval_s=0.0)  # every cycle is a checkpoint cycle
        flusher.lone_client = lambda: False  # through the fsync thread, as with several clients
        flusher.start()
        try:
            res = store.append([Message("T", 0, TxType.NORMAL, 1, {}, b"x")])
            waiter = flusher.wait_durable(res[-1].end_offset)
            assert waiter is not None
            durable = await asyncio.wait_for(waiter, 5)
            assert durable >= res[-1].end_offset and not finished.is_set()
            assert store.durable_offset >= res[-1].end_offset
        finally:
            gate.set()
            await flusher.stop()
        assert finished.is_set()

    try:
        arun(go())
    finally:
        gate.set()
        store.close()


def test_checkpoint_cycles_are_timed_apart_from_the_fsyncs_that_acknowledge_sends(tmp_path):
    from txmq.broker.metrics import Metrics

    store = Store(tmp_path / "d")
    store.open()
    metrics = Metrics()
    slow = threading.Event()
    real = store.checkpoint

    def slow_checkpoint(on_synced=None):
        real(on_synced)
        if not slow.is_set():
            slow.set()
            threading.Event().wait(1.0)  # the queue and checkpoint files of a big checkpoint (far longer than a small fsync)

    store.checkpoint = slow_checkpoint  # type: ignore[method-assign]

    async def body(flusher):
        while metrics.checkpoint.count == 0:
            await asyncio.sleep(0.01)
        for _ in range(20):
            res = store.append([Message("T", 0, TxType.NORMAL, 1, {}, b"x")])
            waiter = flusher.wait_durable(res[-1].end_offset)
            if waiter is not None:
                await asyncio.wait_for(waiter, 5)

    run_flusher(store, body, interval_s=0.05, observe=metrics.flush.observe, observe_checkpoint=metrics.checkpoint.observe)
    snap = metrics.snapshot()
    assert snap["checkpoints"] >= 2 and snap["checkpoint_seconds_max"] >= 1.0  # the slow one, and the last at stop
    assert snap["flushes"] >= 1 and snap["flush_seconds_max"] < 1.0  # the sends' fsyncs never counted it
