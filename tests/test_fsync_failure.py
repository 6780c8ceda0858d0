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
import logging
import os

import pytest

from conftest import arun
from flushhelpers import FailsFirst, PwriteSpy, fail_next_end_sync, open_store, run_flusher
import threading

from txmq.store import Message, Store, TxType
from txmq.store import store as store_module
from txmq.store.commitlog import AFTER_FAILED_FSYNC, CommitLog
from txmq.store.errors import CorruptRecordError
from txmq.wire import TxmqError


def fail_a_sync(store: Store, monkeypatch) -> None:
    """One store.sync() whose fdatasync fails with EIO; later ones succeed."""
    monkeypatch.setattr(os, "fdatasync", FailingFdatasync(os.fdatasync))
    with pytest.raises(OSError):
        store.sync()


def append(store: Store, n: int = 3):
    return store.append([Message("T", 0, TxType.NORMAL, 1, {}, bytes([65 + i]) * 200) for i in range(n)])


FailingFdatasync = FailsFirst  # os.fdatasync failing with EIO the first `failures` times


def test_the_sync_after_a_failed_fsync_writes_the_unsynced_records_again_before_calling_them_durable(tmp_path, monkeypatch, caplog):
    store = open_store(tmp_path)
    try:
        append(store)
        durable = store.sync()
        results = append(store)
        end = results[-1].end_offset
        fail_a_sync(store, monkeypatch)
        assert store.durable_offset == durable  # nothing claimed
        assert "Input/output error" in store.sync_error  # broker_info's log_sync_error, txmq_log_sync_failing

        spy = PwriteSpy(os.pwrite)
        monkeypatch.setattr(os, "pwrite", spy)
        with caplog.at_level(logging.WARNING, logger="txmq.store"):
            assert store.sync() == end
        seg = store._open_log().segments[0]
        assert sum(n for _, n in spy.calls) == end - durable  # every byte past the old durable offset, once
        assert min(pos for pos, _ in spy.calls) == durable - seg.start
        assert f"event=log_rewritten reason='after a failed fsync' from={durable} to={end} bytes={end - durable}" in caplog.text

        append(store)
        spy.calls.clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="txmq.store"):
            store.sync()
        assert spy.calls == [] and "log_rewritten" not in caplog.text  # a good sync ends the rewriting
        assert store._open_log().rewrite_before_sync is None and store.sync_error is None
        assert [r.body[:1] for r in store.read_many([r.commit_log_offset for r in results])] == [b"A", b"B", b"C"]
    finally:
        store.close()


def test_a_record_that_no_longer_reads_back_after_a_failed_fsync_is_named_and_never_called_durable(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    try:
        durable = store.sync()
        results = append(store)
        fail_a_sync(store, monkeypatch)
        seg = store._open_log().segments[0]
        lost = results[1].commit_log_offset
        fd = os.open(seg.path, os.O_WRONLY)  # as if the kernel dropped the page and the disk holds other bytes
        try:
            os.pwrite(fd, b"\0" * 16, lost - seg.start + 40)
        finally:
            os.close(fd)
        for _ in range(2):  # and it stays so: no later sync gets past it
            with pytest.raises(CorruptRecordError, match=f"offset {lost} does not read back .*after a failed fsync.*restart the broker"):
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
    fail_next_end_sync(store)

    async def body(flusher):
        end = append(store)[-1].end_offset
        with pytest.raises(TxmqError, match="flush failed"):
            await asyncio.wait_for(flusher.wait_durable(end), 5)
        assert store.durable_offset < end
        end = append(store)[-1].end_offset
        with caplog.at_level(logging.WARNING, logger="txmq.store"):
            assert await asyncio.wait_for(flusher.wait_durable(end), 5) >= end
        assert "event=log_rewritten reason='after a failed fsync'" in caplog.text
        assert not store.rewrite_pending and not store._sync_lock.locked()

    run_flusher(store, body)


def test_the_bytes_written_again_are_the_bytes_checked(tmp_path, monkeypatch):
    """A page evicted between a check and a copy would bring stale bytes back from the disk: one read serves both."""
    store = open_store(tmp_path)
    try:
        store.sync()
        results = append(store)
        fail_a_sync(store, monkeypatch)
        real_pread, seen = os.pread, set()

        def pread_then_evicted(fd, n, pos):  # the second read of a position finds other bytes
            data = real_pread(fd, n, pos)
            if (fd, pos) in seen:
                return b"\0" * len(data)
            seen.add((fd, pos))
            return data

        monkeypatch.setattr(os, "pread", pread_then_evicted)
        store.sync()
        monkeypatch.setattr(os, "pread", real_pread)
        assert [r.body[:1] for r in store.read_many([r.commit_log_offset for r in results])] == [b"A", b"B", b"C"]
    finally:
        store.close()


def test_a_lone_clients_inline_fsync_leaves_the_rewrite_to_the_flusher_thread(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    threads = []
    real_rewrite = CommitLog.rewrite_unsynced

    def rewrite(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real_rewrite(*args, **kwargs)

    monkeypatch.setattr(CommitLog, "rewrite_unsynced", staticmethod(rewrite))

    async def body(flusher):
        flusher.lone_client = lambda: True  # one client, one request: the fsync would run inline on the loop
        store._open_log().rewrite_before_sync = AFTER_FAILED_FSYNC
        end = append(store)[-1].end_offset
        assert await asyncio.wait_for(flusher.wait_durable(end), 5) >= end

    run_flusher(store, body)
    assert threads and threading.main_thread().name not in threads


def test_a_start_after_an_unclean_stop_writes_the_log_past_its_checkpoint_again_once(tmp_path, caplog):
    store = open_store(tmp_path)
    store.checkpoint()
    end = append(store)[-1].end_offset
    store.sync()
    checkpointed = store._last_ckpt.log_offset
    store._release()  # as a killed process leaves it: no checkpoint at close
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        again = open_store(tmp_path)
    try:
        assert f"event=log_rewritten reason='at start' from={checkpointed} to={end}" in caplog.text
        assert again.durable_offset == end and not again.rewrite_pending
    finally:
        again.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        open_store(tmp_path).close()  # after a clean close: nothing past the checkpoint
    assert "log_rewritten" not in caplog.text


def test_appends_are_refused_while_too_much_waits_behind_a_failed_fsync_and_resume_after_a_good_one(tmp_path, monkeypatch):
    """Every retry reads and writes all that waits again: it stays bounded, the senders are told why."""
    monkeypatch.setattr(store_module, "UNSYNCED_AFTER_FAILURE_LIMIT", 1000)
    store = open_store(tmp_path)
    try:
        store.sync()
        append(store)
        monkeypatch.setattr(os, "fdatasync", FailingFdatasync(os.fdatasync, failures=1))
        with pytest.raises(OSError):
            store.sync()
        append(store)  # 810 bytes wait: still taken (1,620 now)
        before = store.max_offset
        with pytest.raises(store_module.StoreError, match="fsync of the log failed.*nothing was written"):
            append(store)
        assert store.max_offset == before
        store.sync()  # the disk works again
        append(store)
        assert store.max_offset > before
    finally:
        store.close()


def test_broker_info_says_the_log_cannot_be_fsynced_until_a_sync_succeeds(tmp_path, monkeypatch):
    from txmq.broker.testing import running_broker
    from txmq.wire import ErrorCode
    from wireclient import RawClient

    async def go():
        async with running_broker(tmp_path / "b", flush="sync", flush_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            try:
                assert (await c.ok("broker_info"))["log_sync_error"] is None
                # the lone client's inline fsync fails, then the flusher's retry (written again first) too
                monkeypatch.setattr(os, "fdatasync", FailingFdatasync(os.fdatasync, failures=2))
                code, r = await c.req("send", {"topic": "T", "body": b"x"})
                assert code == ErrorCode.STORE_ERROR and "flush failed" in r["error"], r
                assert "Input/output error" in (await c.ok("broker_info"))["log_sync_error"]
                await c.ok("send", {"topic": "T", "body": b"y"})  # the disk works again
                info = await c.ok("broker_info")
                assert info["log_sync_error"] is None and info["durable_offset"] == info["max_offset"]
            finally:
                await c.close()

    arun(go())
