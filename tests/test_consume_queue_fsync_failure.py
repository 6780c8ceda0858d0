"""After a failed fsync of a consume-queue file its entries are written again before a checkpoint covers them.

As for the log (tests/test_fsync_failure.py): Linux may mark the pages a
failed fsync could not write clean, and the next fsync of the file then
succeeds without them. A checkpoint claims every consume-queue entry below
it is on disk (the next start does not rebuild them from the log), so the
entries of a failed cycle stay in memory, are served from there, and the
next checkpoint writes them again, at the same places, before it fsyncs the
file and writes the checkpoint file.
"""

from __future__ import annotations

import os

import pytest

from flushhelpers import FailsFirst, PwriteSpy, open_store
from txmq.store import Message, Store, StoreConfig, TxType
from txmq.store import consumequeue
from txmq.store.checkpoint import read_checkpoint


def append(store, n: int, first: int = 0):
    return store.append([Message("T", 0, TxType.NORMAL, 1, {}, b"m%d" % (first + i)) for i in range(n)])


FailingFsyncPath = FailsFirst  # consumequeue.fsync_path failing with EIO the first `failures` times


def bodies(store, n: int) -> list[bytes]:
    return [r.body for r in store.get_messages("T", 0, 0, max_count=n).records]


def test_entries_of_a_checkpoint_whose_queue_fsync_failed_are_written_again_by_the_next(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    try:
        append(store, 3)
        store.checkpoint()  # three entries on disk
        ckpt = read_checkpoint(store._checkpoint_path)
        append(store, 4, first=3)
        monkeypatch.setattr(consumequeue, "fsync_path", FailingFsyncPath(consumequeue.fsync_path))
        with pytest.raises(OSError):
            store.checkpoint()
        cq = store._queues[("T", 0)]
        assert cq.flushed == 3  # the four new entries are not called flushed ...
        assert read_checkpoint(store._checkpoint_path) == ckpt  # ... and no checkpoint covers them
        assert bodies(store, 10) == [b"m%d" % i for i in range(7)]  # still served, from memory
        spy = PwriteSpy(os.pwrite)
        monkeypatch.setattr(os, "pwrite", spy)
        store.checkpoint()
        entry = consumequeue.ENTRY_SIZE
        assert (3 * entry, 4 * entry) in spy.calls  # the same entries at the same place, again
        assert cq.flushed == 7 and not cq.pending
        assert read_checkpoint(store._checkpoint_path) != ckpt
    finally:
        store.close()
    reopened = open_store(tmp_path)
    try:
        assert bodies(reopened, 10) == [b"m%d" % i for i in range(7)]
    finally:
        reopened.close()


def test_a_close_whose_queue_fsync_fails_leaves_the_entries_to_be_rebuilt_from_the_log(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    append(store, 3)
    store.checkpoint()
    ckpt = read_checkpoint(store._checkpoint_path)
    append(store, 5, first=3)
    monkeypatch.setattr(consumequeue, "fsync_path", FailingFsyncPath(consumequeue.fsync_path, failures=10))
    with pytest.raises(OSError):
        store.close()  # the files are released all the same
    monkeypatch.undo()
    assert read_checkpoint(store._checkpoint_path) == ckpt  # nothing claims the five entries
    reopened = open_store(tmp_path)  # recovery reads the log past the checkpoint and puts them back
    try:
        assert bodies(reopened, 10) == [b"m%d" % i for i in range(8)]
        assert reopened.queue_max_offset("T", 0) == 8
    finally:
        reopened.close()


def test_a_queue_file_that_keeps_failing_holds_only_its_own_entries_and_appends_stop_past_the_limit(tmp_path, monkeypatch):
    from txmq.store import store as store_module
    from txmq.store.errors import StoreError

    monkeypatch.setattr(store_module, "CQ_HELD_LIMIT", 10 * consumequeue.ENTRY_SIZE)
    store = open_store(tmp_path)
    try:
        store.append([Message("bad", 0, TxType.NORMAL, 1, {}, b"x")])
        store.checkpoint()  # the queue's directory exists and is fsynced
        ckpt = read_checkpoint(store._checkpoint_path)
        real = consumequeue.fsync_path
        monkeypatch.setattr(consumequeue, "fsync_path", lambda path: real(path) if "/bad/" not in str(path) else FailingFsyncPath(real, 1)(path))
        store.append([Message("bad", 0, TxType.NORMAL, 1, {}, b"b%d" % i) for i in range(4)])
        append(store, 3)
        with pytest.raises(OSError):
            store.checkpoint()
        assert store._queues[("T", 0)].flushed == 3  # the good queue's entries are on disk and left memory
        assert store._queues[("bad", 0)].flushed == 1  # the failing one keeps its four
        assert read_checkpoint(store._checkpoint_path) == ckpt  # not every queue is on disk: the checkpoint stays
        store.append([Message("bad", 0, TxType.NORMAL, 1, {}, b"c%d" % i) for i in range(7)])  # 11 held after this
        with pytest.raises(OSError):
            store.checkpoint()
        with pytest.raises(StoreError, match="consume-queue files could not be written"):
            append(store, 1)  # past the limit: refused, nothing written
        monkeypatch.setattr(consumequeue, "fsync_path", real)  # the disk recovers
        store.checkpoint()
        assert store._queues[("bad", 0)].flushed == 12 and read_checkpoint(store._checkpoint_path) != ckpt
        append(store, 1, first=3)  # taken again
    finally:
        store.close()


def test_a_consume_queue_file_created_by_a_roll_over_has_its_directory_fsynced_before_the_checkpoint(tmp_path, monkeypatch):
    synced: list[str] = []
    real = consumequeue.fsync_dir
    monkeypatch.setattr(consumequeue, "fsync_dir", lambda p: (synced.append(os.path.abspath(p)), real(p)))
    store = Store(tmp_path / "d", StoreConfig(cq_entries_per_file=4))
    store.open()
    leaf = os.path.abspath(tmp_path / "d" / "consumequeue" / "T" / "0")
    append(store, 1)
    store.checkpoint()
    assert leaf in synced  # the queue's first file
    synced.clear()
    append(store, 8)  # two more files
    store.checkpoint()
    assert len(os.listdir(leaf)) == 3
    assert leaf in synced, "new files' names were not made durable"
    synced.clear()
    append(store, 1)  # into the last file: no new name
    store.checkpoint()
    assert leaf not in synced
    store.close()
