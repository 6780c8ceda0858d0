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
