"""After a failed fdatasync the log is written again before anything past it is called durable.

Linux reports a writeback error once and may mark the pages it could not
write clean; a later fdatasync of the same file then succeeds without
writing them ("fsyncgate"). So the store remembers the failure and the next
sync, whichever path runs it (group commit, the checkpoint, the inline
fsync, the C thread's fallback), checks the records past the durable offset
and writes their bytes again before its fdatasync. A record that no longer
reads back is reported by offset, and nothing past it is ever called durable.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os

import pytest

from conftest import arun
from txmq.broker.flush import Flusher
from txmq.store import Message, Store, TxType
from txmq.store.errors import CorruptRecordError
from txmq.wire import TxmqError


def open_store(tmp_path) -> Store:
    store = Store(tmp_path / "d")
    store.open()
    return store


def append(store: Store, n: int = 3):
    return store.append([Message("T", 0, TxType.NORMAL, 1, {}, bytes([65 + i]) * 200) for i in range(n)])


class FailingFdatasync:
    """os.fdatasync that fails with EIO the first `failures` times."""

    def __init__(self, real, failures: int = 1) -> None:
        self.real = real
        self.failures = failures

    def __call__(self, fd: int) -> None:
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EIO, "Input/output error")
        self.real(fd)


class PwriteSpy:
    def __init__(self, real) -> None:
        self.real = real
        self.calls: list[tuple[int, int]] = []  # (file position, bytes)

    def __call__(self, fd, data, pos):
        self.calls.append((pos, len(data)))
        return self.real(fd, data, pos)


def test_the_sync_after_a_failed_fsync_writes_the_unsynced_records_again_before_calling_them_durable(tmp_path, monkeypatch, caplog):
    store = open_store(tmp_path)
    try:
        append(store)
        durable = store.sync()
        results = append(store)
        end = results[-1].end_offset
        monkeypatch.setattr(os, "fdatasync", FailingFdatasync(os.fdatasync))
        with pytest.raises(OSError):
            store.sync()
        assert store.durable_offset == durable  # nothing claimed

        spy = PwriteSpy(os.pwrite)
        monkeypatch.setattr(os, "pwrite", spy)
        with caplog.at_level(logging.WARNING, logger="txmq.store"):
            assert store.sync() == end
        seg = store._open_log().segments[0]
        assert sum(n for _, n in spy.calls) == end - durable  # every byte past the old durable offset, once
        assert min(pos for pos, _ in spy.calls) == durable - seg.start
        assert f"event=log_rewritten_after_failed_fsync from={durable} to={end} bytes={end - durable}" in caplog.text

        spy.calls.clear()
        append(store)
        store.sync()
        assert spy.calls == [] or all(pos >= end - seg.start for pos, _ in spy.calls)  # a good sync ends the rewriting
        assert [r.body[:1] for r in store.read_many([r.commit_log_offset for r in results])] == [b"A", b"B", b"C"]
    finally:
        store.close()


def test_a_record_that_no_longer_reads_back_after_a_failed_fsync_is_named_and_never_called_durable(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    try:
        durable = store.sync()
        results = append(store)
        monkeypatch.setattr(os, "fdatasync", FailingFdatasync(os.fdatasync))
        with pytest.raises(OSError):
            store.sync()
        seg = store._open_log().segments[0]
        lost = results[1].commit_log_offset
        fd = os.open(seg.path, os.O_WRONLY)  # as if the kernel dropped the page and the disk holds other bytes
        try:
            os.pwrite(fd, b"\0" * 16, lost - seg.start + 40)
        finally:
            os.close(fd)
        for _ in range(2):  # and it stays so: no later sync gets past it
            with pytest.raises(CorruptRecordError, match=f"offset {lost} .*restart the broker"):
                store.sync()
            assert store.durable_offset == durable
    finally:
        with pytest.raises(CorruptRecordError):
            store.close()  # its last checkpoint cannot sync either; the files are closed all the same
    reopened = open_store(tmp_path)  # the restart: recovery keeps what reads back, up to the lost record
    try:
        assert reopened.max_offset == lost
        assert reopened.read(results[0].commit_log_offset).body[:1] == b"A"
    finally:
        reopened.close()


def test_a_checkpoint_after_a_failed_fsync_writes_the_unsynced_records_again(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    try:
        durable = store.sync()
        end = append(store)[-1].end_offset
        monkeypatch.setattr(os, "fdatasync", FailingFdatasync(os.fdatasync))
        with pytest.raises(OSError):
            store.checkpoint()
        spy = PwriteSpy(os.pwrite)
        monkeypatch.setattr(os, "pwrite", spy)
        store.checkpoint()
        assert store.durable_offset == end
        seg = store._open_log().segments[0]
        assert (durable - seg.start, end - durable) in spy.calls
    finally:
        store.close()


def test_group_commit_after_a_failed_fsync_fails_the_waiting_sends_then_writes_them_again(tmp_path, caplog):
    """In the C thread when it is built: the failure ends that job; the next one goes through Store.run_sync."""
    store = open_store(tmp_path)
    real_end = store.end_sync
    fail = [True]

    def end_sync(job, error):
        if fail[0]:
            fail[0] = False
            error = error or OSError(errno.EIO, "fdatasync failed")
        return real_end(job, error)

    store.end_sync = end_sync  # type: ignore[method-assign]

    async def go():
        flusher = Flusher(store, sync=True, interval_s=3600)
        flusher.lone_client = lambda: False  # group commit, not the inline fsync
        flusher.start()
        try:
            end = append(store)[-1].end_offset
            with pytest.raises(TxmqError, match="flush failed"):
                await asyncio.wait_for(flusher.wait_durable(end), 5)
            assert store.durable_offset < end
            end = append(store)[-1].end_offset
            with caplog.at_level(logging.WARNING, logger="txmq.store"):
                assert await asyncio.wait_for(flusher.wait_durable(end), 5) >= end
            assert "event=log_rewritten_after_failed_fsync" in caplog.text
            assert not store._open_log().sync_failed and not store._sync_lock.locked()
        finally:
            await flusher.stop()

    try:
        arun(go())
    finally:
        store.close()
