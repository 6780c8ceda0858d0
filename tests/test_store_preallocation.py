"""Preallocated log segments: zeros after the active segment's data are the end of the log, never damage.

The writer keeps ``StoreConfig.preallocate`` bytes of zeros allocated after
the data of the last segment (docs/store-format.md, "Preallocated space"),
so most fdatasyncs do not change the file's size. A close cuts them; a
crash leaves them, and recovery cuts them without reporting a torn tail.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from txmq.cli.commands.store import verify_dir
from txmq.store import Message, Store, StoreConfig, StoreFullError, StoreReader, TxType, commitlog, segments

PRE = 64 << 10
CFG = StoreConfig(segment_size=1 << 20, cq_entries_per_file=50, preallocate=PRE)
SMALL = StoreConfig(segment_size=4096, cq_entries_per_file=7, preallocate=PRE)
OLD = StoreConfig(segment_size=4096, cq_entries_per_file=7, preallocate=0)


def msg(i=0, qid=0, body=None):
    return Message("T", qid, TxType.NORMAL, 1000, {"TAGS": "a", "N": str(i)}, body if body is not None else b"x" * 60)


def seg_files(d):
    cl = d / "commitlog"
    return {int(n): os.path.getsize(cl / n) for n in sorted(os.listdir(cl))}


def numbers(store_or_reader, qid=0):
    res = store_or_reader.get_messages("T", qid, 0, max_count=100_000, max_bytes=1 << 30)
    return [int(r.properties["N"]) for r in res.records]


def crash(s: Store) -> None:
    s._release()  # the files as a killed process leaves them: no close, no cut


def test_the_active_segment_is_preallocated_and_a_close_cuts_it_back(tmp_path):
    d = tmp_path / "d"
    with Store(d, CFG) as s:
        res = s.append([msg(i) for i in range(10)])
        end = res[-1].end_offset
        assert seg_files(d) == {0: end + PRE}  # zeros reserved past the data
        more = s.append([msg(10)])[0]
        assert seg_files(d) == {0: end + PRE}  # written into them: the file's size does not change
        end = more.end_offset
        s.sync()
        assert s.max_offset == end
    assert seg_files(d) == {0: end}  # a closed log ends where its data ends
    with Store(d, CFG) as s:
        assert numbers(s) == list(range(11))


def test_a_closed_directory_is_the_same_as_without_preallocation(tmp_path):
    """What an older txmq opens: a cleanly closed directory has the same files, byte for byte."""
    clock = lambda: 1_700_000_000.0  # noqa: E731
    dirs = []
    for cfg in (SMALL, OLD):
        d = tmp_path / f"pre{cfg.preallocate}"
        with Store(d, cfg, clock=clock) as s:
            for i in range(0, 60, 6):
                s.append([msg(j, qid=j % 2) for j in range(i, i + 6)])
                s.sync()
        dirs.append(d)
    a, b = (seg_files(d) for d in dirs)
    assert a == b and len(a) > 1
    for start in a:
        name = f"{start:020d}"
        assert (dirs[0] / "commitlog" / name).read_bytes() == (dirs[1] / "commitlog" / name).read_bytes()


def test_an_older_directory_opens_unchanged_and_is_preallocated_from_the_next_write(tmp_path):
    d = tmp_path / "d"
    with Store(d, OLD) as s:
        s.append([msg(i) for i in range(30)])
    before = seg_files(d)
    assert all(size <= 4096 for size in before.values())
    s = Store(d, SMALL)
    report = s.open()
    try:
        assert (report.dropped_bytes, report.reason, report.preallocated, report.damaged) == (0, None, 0, 0)
        assert seg_files(d) == before
        assert numbers(s) == list(range(30))
        s.append([msg(30)])
        last = max(seg_files(d))
        assert seg_files(d)[last] == 4096  # reserved up to the segment size
    finally:
        s.close()
    assert seg_files(d)[last] < 4096


def test_a_crash_in_a_preallocated_segment_keeps_every_record_and_cuts_the_zeros(tmp_path):
    d = tmp_path / "d"
    s = Store(d, CFG)
    s.open()
    s.append([msg(i) for i in range(20)])
    s.checkpoint()
    res = s.append([msg(i) for i in range(20, 25)])
    s.sync()
    end = res[-1].end_offset
    size = seg_files(d)[0]
    crash(s)
    assert end < size <= end + PRE
    s = Store(d, CFG)
    report = s.open()
    try:
        assert (report.dropped_bytes, report.reason, report.truncated_at) == (0, None, None)
        assert report.preallocated == size - end and report.max_offset == end
        assert not (d / "quarantine").exists()
        assert seg_files(d) == {0: end}
        assert numbers(s) == list(range(25))
        nxt = s.append([msg(25)])[0]
        assert (nxt.commit_log_offset, nxt.queue_offset) == (end, 25)
        assert seg_files(d) == {0: nxt.end_offset + PRE}
    finally:
        s.close()


def test_a_torn_write_into_preallocated_space_is_quarantined_without_the_zeros(tmp_path):
    d = tmp_path / "d"
    s = Store(d, CFG)
    s.open()
    s.append([msg(i) for i in range(5)])
    s.checkpoint()
    end = s.max_offset
    torn = s.append([msg(5)])[0]
    size = seg_files(d)[0]
    crash(s)
    path = d / "commitlog" / f"{0:020d}"
    with open(path, "r+b") as f:  # only the first 40 bytes of the last record reached the disk
        f.seek(end + 40)
        f.write(bytes(torn.size - 40))
    s = Store(d, CFG)
    report = s.open()
    try:
        assert report.reason.startswith("torn record") or report.reason.startswith("crc mismatch")
        assert (report.truncated_at, report.dropped_bytes) == (end, torn.size)  # the record's size, as its header says
        assert report.preallocated == size - end - torn.size
        (kept,) = (d / "quarantine").iterdir()
        assert kept.stat().st_size == torn.size
        assert numbers(s) == list(range(5))
    finally:
        s.close()


def test_a_sealed_segment_is_cut_back_before_the_next_one_exists(tmp_path):
    d = tmp_path / "d"
    with Store(d, SMALL) as s:
        for i in range(100):
            s.append([msg(i)])
            files = seg_files(d)
            starts = sorted(files)
            for a, b in zip(starts, starts[1:]):
                assert a + files[a] == b  # contiguous: sealed segments hold no zeros
            assert files[starts[-1]] == 4096
        assert len(starts) > 2


def test_zeros_a_crash_left_in_a_sealed_segment_are_cut_not_an_overlap(tmp_path):
    """A crash between cutting a sealed segment and that reaching the disk: the next open cuts the zeros."""
    d = tmp_path / "d"
    with Store(d, SMALL) as s:
        s.append([msg(i) for i in range(60)])
    files = seg_files(d)
    first = d / "commitlog" / f"{min(files):020d}"
    with open(first, "ab") as f:
        f.write(bytes(4096 - files[min(files)]))
    doc = verify_dir(d)
    assert doc["ok"], doc["problems"]
    with StoreReader(d) as r:
        assert numbers(r) == list(range(60)) and not r.damage.count
    s = Store(d, SMALL)
    report = s.open()
    try:
        assert (report.dropped_bytes, report.reason, report.damaged) == (0, None, 0)
        assert seg_files(d) == files
        assert numbers(s) == list(range(60))
    finally:
        s.close()


def test_a_reader_on_a_live_preallocated_segment_ends_at_the_data_without_searching_the_zeros(tmp_path, monkeypatch):
    searched = []
    real = segments.resync

    def counting(seg, pos, limit=None):
        searched.append(pos)
        return real(seg, pos, limit)

    monkeypatch.setattr(segments, "resync", counting)
    d = tmp_path / "d"
    with Store(d, CFG) as s:
        s.append([msg(i) for i in range(10)])
        s.checkpoint()
        with StoreReader(d) as r:
            for i in range(10, 40):
                res = s.append([msg(i)])  # past the checkpoint, not yet fsynced: the reader still sees it
                assert r.max_offset == res[0].end_offset == s.max_offset
                assert r.files_end == s.max_offset and r.preallocated > 0
                assert numbers(r)[-1] == i
                if i % 10 == 0:
                    s.checkpoint()
            assert not searched and not r.damage.count
            assert [rec.queue_offset for rec in r.scan()] == list(range(40))
            assert sum(n for _, _, n in r.segments()) == s.max_offset


def test_a_reader_follows_the_writer_across_a_roll(tmp_path):
    d = tmp_path / "d"
    with Store(d, SMALL) as s:
        s.append([msg(0)])
        with StoreReader(d) as r:
            for i in range(1, 80):
                s.append([msg(i)])
                assert r.max_offset == s.max_offset
            assert numbers(r) == list(range(80)) and not r.damage.count


def test_damage_below_the_checkpoint_in_a_preallocated_segment_is_skipped_by_a_reader(tmp_path):
    d = tmp_path / "d"
    with Store(d, CFG) as s:
        res = s.append([msg(i) for i in range(10)])
        s.checkpoint()  # fsynced past the damage: zeros there are damage, not the end
        path = d / "commitlog" / f"{0:020d}"
        with open(path, "r+b") as f:
            f.seek(res[4].commit_log_offset)
            f.write(bytes(res[4].size))
        with StoreReader(d) as r:
            assert r.max_offset == s.max_offset
            assert numbers(r) == [0, 1, 2, 3, 5, 6, 7, 8, 9]
            assert list(r.damage.places) == [res[4].commit_log_offset]


def test_verify_is_clean_on_a_live_and_on_a_crashed_preallocated_directory(tmp_path):
    d = tmp_path / "d"
    s = Store(d, CFG)
    s.open()
    s.append([msg(i, qid=i % 3) for i in range(50)])
    s.checkpoint()
    s.append([msg(i) for i in range(50, 55)])
    doc = verify_dir(d)
    assert doc["ok"], doc["problems"]
    assert doc["log"]["end"] == doc["log"]["valid_end"] == s.max_offset and doc["log"]["preallocated"] > 0
    s.sync()
    crash(s)
    doc = verify_dir(d)
    assert doc["ok"], doc["problems"]
    assert doc["log"]["preallocated"] > 0 and not doc["quarantine"]


def test_verify_reports_a_torn_write_into_preallocated_space_without_the_zeros(tmp_path):
    d = tmp_path / "d"
    s = Store(d, CFG)
    s.open()
    s.append([msg(i) for i in range(5)])
    s.checkpoint()
    end = s.max_offset
    crash(s)
    with open(d / "commitlog" / f"{0:020d}", "r+b") as f:
        f.seek(end)
        f.write(b"\x55" * 30)
    doc = verify_dir(d)
    (torn,) = [p for p in doc["problems"] if p["kind"] == "torn_tail"]
    assert (torn["offset"], torn["length"]) == (end, 30)


def test_a_failed_preallocation_is_not_an_error_and_is_tried_again_later(tmp_path, monkeypatch):
    calls = []

    def full(fd, off, length):
        calls.append(off)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    d = tmp_path / "d"
    with Store(d, CFG) as s:
        monkeypatch.setattr(commitlog.os, "posix_fallocate", full)
        first = s.append([msg(0)])[0]
        assert seg_files(d) == {0: first.end_offset} and len(calls) == 1
        for i in range(1, 20):
            s.append([msg(i)])
        assert len(calls) == 1  # not again before another preallocate's worth of data
        big = s.append([msg(99, body=b"y" * PRE)])[0]
        assert len(calls) == 2 and seg_files(d) == {0: big.end_offset}
        monkeypatch.undo()  # space again
        last = s.append([msg(100)])[0]
        assert seg_files(d) == {0: last.end_offset}
        last = s.append([msg(101, body=b"y" * PRE)])[0]
        assert seg_files(d) == {0: last.end_offset + PRE}
        assert numbers(s) == [*range(20), 99, 100, 101]


def test_a_full_disk_while_writing_into_preallocated_space_rolls_back_and_keeps_the_zeros(tmp_path, monkeypatch):
    d = tmp_path / "d"
    with Store(d, CFG) as s:
        s.append([msg(i) for i in range(5)])
        before = (s.max_offset, seg_files(d))

        real, calls = os.pwrite, []

        def fills(fd, data, pos):  # a short write, then the disk is full
            calls.append(pos)
            if len(calls) == 1:
                return real(fd, memoryview(data)[:10], pos)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(commitlog.os, "pwrite", fills)
        with pytest.raises(StoreFullError):
            s.append([msg(5)])
        monkeypatch.undo()
        assert (s.max_offset, seg_files(d)) == before
        path = d / "commitlog" / f"{0:020d}"
        with open(path, "rb") as f:  # the 10 bytes written are zeros again
            f.seek(before[0])
            assert f.read(64) == bytes(64)
        s.append([msg(5)])
        assert numbers(s) == list(range(6))


_WRITER = """
import sys
from txmq.store import Message, Store, StoreConfig, TxType
s = Store(sys.argv[1], StoreConfig(segment_size=256 << 10, cq_entries_per_file=1000, preallocate=64 << 10))
s.open()
i = 0
while True:
    s.append([Message("T", 0, TxType.NORMAL, 1, {"N": str(j)}, b"z" * (i % 300)) for j in range(i, i + 3)])
    i += 3
    s.sync()
    print(i, flush=True)
    if i % 300 == 0:
        s.checkpoint()
"""


@pytest.mark.parametrize("after", [50, 400])
def test_a_killed_writer_loses_no_fsynced_record_and_leaves_no_torn_tail(tmp_path, after):
    d = tmp_path / "d"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(d)], stdout=subprocess.PIPE, text=True)
    synced = 0
    deadline = time.monotonic() + 60
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            synced = int(line)
            if synced >= after * 3 or time.monotonic() > deadline:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert synced >= after * 3
    doc = verify_dir(d)
    assert [p for p in doc["problems"] if p["kind"] not in ("queue_short", "queue_missing")] == [], json.dumps(doc["problems"])
    with StoreReader(d) as r:
        got = [int(rec.properties["N"]) for rec in r.scan()]
    assert got[:synced] == list(range(synced))
    s = Store(d, CFG)
    report = s.open()
    try:
        assert report.dropped_bytes == 0 and report.reason is None and report.damaged == 0
        assert [int(rec.properties["N"]) for rec in s.scan()] == got
        files = seg_files(d)
        starts = sorted(files)
        for a, b in zip(starts, starts[1:]):
            assert a + files[a] == b
        assert starts[-1] + files[starts[-1]] == s.max_offset
    finally:
        s.close()


def test_a_live_and_a_killed_sync_broker_leave_a_clean_directory(tmp_path):
    """verify and readers on a running broker's preallocated log; SIGKILL; the restart reports no torn tail."""
    from brokerproc import BrokerProcess

    from txmq.client import SyncProducer

    data = tmp_path / "data"
    broker = BrokerProcess(data, "--flush", "sync").start()
    try:
        with SyncProducer(broker.address) as p:
            for i in range(40):
                p.send("T", str(i).encode(), queue_id=0)
        doc = verify_dir(data)
        assert doc["ok"], doc["problems"]
        assert doc["log"]["preallocated"] > 0 and doc["log"]["end"] == doc["log"]["valid_end"]
        with StoreReader(data) as r:
            assert [rec.body for rec in r.get_messages("T", 0, 0, max_count=100).records] == [str(i).encode() for i in range(40)]
        broker.kill()
        doc = verify_dir(data)
        assert doc["ok"], doc["problems"]
        mark = broker.log.stat().st_size
        broker.start()
        with SyncProducer(broker.address) as p:
            p.send("T", b"40", queue_id=0)
        log = broker.log.read_text()[mark:]
        assert "recovery_truncated" not in log and "record_damaged" not in log, log
        deadline = time.monotonic() + 20  # started: the index is built before the clean stop checked below
        while "event=broker_ready" not in broker.log.read_text()[mark:] and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        rc = broker.stop()
    assert rc == 0, broker.log.read_text()[-4000:]
    files = seg_files(data)
    with StoreReader(data) as r:
        assert r.preallocated == 0 and max(files) + files[max(files)] == r.max_offset
        assert len(r.get_messages("T", 0, 0, max_count=100).records) == 41
    assert not (data / "quarantine").exists()
