"""StoreFullError: a failed write is rolled back completely and appends resume."""

from __future__ import annotations

import errno
import os

import pytest

from txmq.store import Message, Store, StoreConfig, StoreFullError, TxType
from txmq.store import commitlog

SMALL = StoreConfig(segment_size=4096, cq_entries_per_file=7)


def msg(qid=0, body=b"f" * 100):
    return Message("T", qid, TxType.NORMAL, 1, {"TAGS": "x"}, body)


class DiskFills:
    """os.pwrite that writes part of what it is given once, then fails with ENOSPC."""

    def __init__(self, real, after_calls=0, err=errno.ENOSPC):
        self.real, self.after, self.err, self.calls = real, after_calls, err, 0

    def __call__(self, fd, data, pos):
        self.calls += 1
        if self.calls <= self.after:
            return self.real(fd, data, pos)
        if self.calls == self.after + 1 and len(data) > 1:
            return self.real(fd, memoryview(data)[: len(data) // 2], pos)  # a short write first
        raise OSError(self.err, os.strerror(self.err))


def snapshot(s, d):
    files = {n: os.path.getsize(d / "commitlog" / n) for n in os.listdir(d / "commitlog")}
    return s.max_offset, s.queue_max_offset("T", 0), s.queue_max_offset("T", 1), files


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_store_full_rolls_back_and_appends_resume(tmp_path, monkeypatch, err):
    d = tmp_path / "d"
    s = Store(d, SMALL)
    s.open()
    try:
        s.append([msg(qid=i % 2) for i in range(10)])
        before = snapshot(s, d)
        monkeypatch.setattr(commitlog.os, "pwrite", DiskFills(os.pwrite, err=err))
        with pytest.raises(StoreFullError):
            s.append([msg(qid=i % 2) for i in range(5)])
        assert snapshot(s, d) == before
        monkeypatch.undo()
        res = s.append([msg(qid=1)])
        assert res[0].queue_offset == 5 and res[0].commit_log_offset == before[0]
        assert [r.queue_offset for r in s.get_messages("T", 1, 0, max_count=100).records] == list(range(6))
    finally:
        s.close()
    s = Store(d, SMALL)
    report = s.open()
    s.close()
    assert (report.dropped_bytes, report.redispatched) == (0, 0)


def test_store_full_in_a_new_segment_removes_it(tmp_path, monkeypatch):
    d = tmp_path / "d"
    s = Store(d, SMALL)
    s.open()
    try:
        s.append([msg() for _ in range(20)])
        before = snapshot(s, d)
        # the batch spans three segments: the first write succeeds, the second fails
        monkeypatch.setattr(commitlog.os, "pwrite", DiskFills(os.pwrite, after_calls=1))
        with pytest.raises(StoreFullError):
            s.append([msg(body=b"g" * 1000) for _ in range(10)])
        assert snapshot(s, d) == before
        monkeypatch.undo()
        big = s.append([msg(body=b"g" * 1000) for _ in range(10)])
        assert big[0].queue_offset == 20 and big[0].commit_log_offset == before[0]
        assert [r.body for r in s.scan(before[0])] == [b"g" * 1000] * 10
    finally:
        s.close()


def test_other_write_errors_roll_back_and_propagate(tmp_path, monkeypatch):
    d = tmp_path / "d"
    s = Store(d, SMALL)
    s.open()
    try:
        s.append([msg()])
        before = snapshot(s, d)
        monkeypatch.setattr(commitlog.os, "pwrite", DiskFills(os.pwrite, err=errno.EIO))
        with pytest.raises(OSError) as info:
            s.append([msg(), msg()])
        assert not isinstance(info.value, StoreFullError) and info.value.errno == errno.EIO
        assert snapshot(s, d) == before
    finally:
        monkeypatch.undo()
        s.close()


def killed_after_20_sends(d) -> None:
    """A store killed with 20 records past its checkpoint: their consume-queue entries were never written."""
    s = Store(d, SMALL)
    s.open()
    s.append([msg(body=b"m%02d" % i) for i in range(20)])
    s.sync()
    s._release()


def no_queue_space(monkeypatch) -> None:
    """Consume-queue writes fail as on a full disk (the log's are not tried: recovery writes no record)."""
    from txmq.store import consumequeue

    def no_space(self, *args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(consumequeue.ConsumeQueue, "write", no_space)


def test_a_store_opened_on_a_full_disk_holds_the_recovered_queue_entries_until_a_checkpoint_can_write_them(tmp_path, monkeypatch, caplog):
    """A broker killed on a full disk starts again: recovery keeps the entries it cannot write in memory."""
    from txmq.store import consumequeue

    d = tmp_path / "d"
    killed_after_20_sends(d)
    real_write = consumequeue.ConsumeQueue.write
    no_queue_space(monkeypatch)
    s = Store(d, SMALL)
    with caplog.at_level("INFO", logger="txmq.store"):
        report = s.open()  # opens all the same
        assert report.redispatched == 20
        assert "event=consume_queue_entries_held entries=20" in caplog.text
        assert [r.body for r in s.get_messages("T", 0, 0, max_count=50).records] == [b"m%02d" % i for i in range(20)]
        with pytest.raises(OSError):
            s.checkpoint()  # still full
        monkeypatch.setattr(consumequeue.ConsumeQueue, "write", real_write)  # space is back
        s.checkpoint()
        assert "event=consume_queue_entries_written entries=20" in caplog.text
    s._release()  # killed again: this time nothing is left to index
    s = Store(d, SMALL)
    try:
        assert s.open().redispatched == 0
        assert [r.body for r in s.get_messages("T", 0, 0, max_count=50).records] == [b"m%02d" % i for i in range(20)]
    finally:
        s.close()


def test_a_start_on_a_full_disk_that_would_hold_too_many_queue_entries_fails_as_it_must_without_space(tmp_path, monkeypatch):
    from txmq.store import consumequeue, recovery

    d = tmp_path / "d"
    killed_after_20_sends(d)
    no_queue_space(monkeypatch)
    monkeypatch.setattr(recovery, "HELD_ON_FULL_DISK", 10 * consumequeue.ENTRY_SIZE)
    with pytest.raises(OSError) as err:
        Store(d, SMALL).open()
    assert err.value.errno == errno.ENOSPC
    monkeypatch.undo()
    s = Store(d, SMALL)  # the failed start released the directory; with space it starts and indexes them
    try:
        assert s.open().redispatched == 20
    finally:
        s.close()


def test_a_start_whose_queue_fsync_finds_no_space_holds_the_entries_instead_of_calling_them_flushed(tmp_path, monkeypatch, caplog):
    """Space for the write but not for the fsync (delayed allocation, a network file system): the same as a full write."""
    from txmq.store import consumequeue

    d = tmp_path / "d"
    killed_after_20_sends(d)
    real_fsync = consumequeue.fsync_path

    def no_space(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(consumequeue, "fsync_path", no_space)
    s = Store(d, SMALL)
    with caplog.at_level("INFO", logger="txmq.store"):
        assert s.open().redispatched == 20
        assert "event=consume_queue_entries_held entries=20" in caplog.text
        assert s._queues[("T", 0)].flushed == 0  # written, not fsynced: not called flushed
        monkeypatch.setattr(consumequeue, "fsync_path", real_fsync)
        s.checkpoint()
        assert "event=consume_queue_entries_written entries=20" in caplog.text
    s._release()
    s = Store(d, SMALL)
    try:
        assert s.open().redispatched == 0
    finally:
        s.close()


class Disk:
    """A disk of `capacity` bytes for the commit log's writes: os.pwrite past it writes what fits, then ENOSPC."""

    def __init__(self, real, capacity):
        self.real, self.capacity = real, capacity

    def __call__(self, fd, data, pos):
        room = self.capacity - pos
        if room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.real(fd, memoryview(data)[:room] if len(data) > room else data, pos)


def test_a_failed_preallocation_gives_back_the_space_it_took(tmp_path, monkeypatch):
    """ext4 keeps the blocks a failed fallocate found, and grows the file over them: on a nearly full disk, every
    free block. They are given back, so the rest of the directory has room and the log grows by its writes only."""
    real = os.posix_fallocate

    def ext4_like(fd, off, length):  # allocates half of it, then runs out
        real(fd, off, length // 2)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    d = tmp_path / "d"
    with Store(d, StoreConfig(segment_size=1 << 20, preallocate=256 << 10)) as s:
        monkeypatch.setattr(commitlog.os, "posix_fallocate", ext4_like)
        r = s.append([msg(body=b"a" * 1000)])[0]
        assert os.path.getsize(d / "commitlog" / f"{0:020d}") == r.end_offset  # no zero tail kept
        r = s.append([msg(body=b"b" * 1000)])[0]
        assert os.path.getsize(d / "commitlog" / f"{0:020d}") == r.end_offset
        assert [m.body for m in s.get_messages("T", 0, 0, max_count=10).records] == [b"a" * 1000, b"b" * 1000]


def appender_on(store):
    """The broker's Appender on a store, with a flusher that acknowledges at once (async flush)."""
    import asyncio

    from txmq.broker.appender import Appender
    from txmq.broker.metrics import Metrics
    from txmq.wire import ErrorCode, TxmqError

    class Flusher:
        sync_mode = False

        def wait_durable(self, offset):
            return None

    def to_error(exc):
        full = isinstance(exc, StoreFullError)
        return TxmqError("store full" if full else str(exc), ErrorCode.STORE_FULL if full else ErrorCode.STORE_ERROR)

    metrics = Metrics()
    return Appender(store, Flusher(), metrics, lambda msgs: None, to_error), metrics, asyncio


def test_sends_batched_past_the_space_left_are_stored_until_the_disk_is_really_full(tmp_path, monkeypatch):
    """Sends that arrive together go out as one write; on a nearly full disk that write may need far more than is
    left (sixty 80 KB lines piped through `txmq send -` with 2.8 MB free). The sends that fit are stored, in
    order, and only those that do not are refused."""
    from conftest import arun

    d = tmp_path / "d"
    body = b"z" * 80_000
    with Store(d, StoreConfig(segment_size=64 << 20, preallocate=8 << 20)) as s:
        s.append([msg()])
        monkeypatch.setattr(commitlog.os, "posix_fallocate", lambda fd, off, n: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
        monkeypatch.setattr(commitlog.os, "pwrite", Disk(os.pwrite, s.max_offset + 2_800_000))

        async def go():
            appender, metrics, asyncio = appender_on(s)
            futs = [appender.submit([msg(body=body + b"%02d" % i)]) for i in range(60)]
            results = await asyncio.gather(*futs, return_exceptions=True)
            return results, metrics

        results, metrics = arun(go())
        stored = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, BaseException)]
        fits = 2_800_000 // (len(body) + 200)
        assert stored == list(range(len(stored))) and len(stored) >= fits - 1, (len(stored), fits)  # a prefix: in order
        assert refused and all(e.code.name == "STORE_FULL" for e in refused)
        assert metrics.counters["records_appended"] == len(stored)
        assert [m.body[-2:] for m in s.get_messages("T", 0, 1, max_count=100, max_bytes=1 << 30).records] == \
            [b"%02d" % i for i in stored]
