"""StoreReader tests: a read-only view that never returns a torn record."""

from __future__ import annotations

import os
import random
import shutil

import pytest

from txmq.store import (
    CorruptRecordError,
    GetStatus,
    Message,
    Store,
    StoreConfig,
    StoreReader,
    TxType,
    encode_record,
)
from txmq.store.consumequeue import ENTRY

SMALL = StoreConfig(segment_size=4096, cq_entries_per_file=7)


def msg(qid=0, body=b"x" * 50, topic="T"):
    return Message(topic, qid, TxType.NORMAL, 1000, {"TAGS": "a"}, body)


def last_segment(d):
    return d / "commitlog" / sorted(os.listdir(d / "commitlog"))[-1]


def tricky_bodies(n, seed=7):
    """Bodies that contain the magic, and even whole encoded records, to tempt a resync."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append(rnd.randbytes(rnd.randrange(0, 400)))
        elif kind == 1:
            out.append(b"TXM1" * rnd.randrange(1, 60))
        elif kind == 2:
            out.append(encode_record(msg(body=b"inner"), rnd.randrange(0, 1 << 20), 0, 1) * 2)
        else:
            out.append(b"\x00" * rnd.randrange(0, 200) + b"TXM1")
    return out


@pytest.fixture
def live(tmp_path):
    d = tmp_path / "live"
    s = Store(d, SMALL)
    s.open()
    yield d, s
    s.close()


def test_reader_sees_records_up_to_a_torn_tail(tmp_path, live):
    d, s = live
    results = s.append([msg(qid=i % 2, body=bytes([i]) * 60) for i in range(30)])
    s.checkpoint()
    results += s.append([msg(qid=i % 2, body=bytes([i]) * 60) for i in range(4)])
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)
    last = results[-1]
    os.truncate(last_segment(copy), last.commit_log_offset - int(last_segment(copy).name) + 70)
    with StoreReader(copy) as r:
        assert r.max_offset == last.commit_log_offset
        assert [x.commit_log_offset for x in r.scan()] == [x.commit_log_offset for x in results[:-1]]
        assert r.queue_max_offset("T", 1) == 16  # 17 records for queue 1, the last is torn
        assert r.queue_max_offset("T", 0) == 17
        res = r.get_messages("T", 1, 14, max_count=10)
        assert [x.queue_offset for x in res.records] == [14, 15]
        assert r.get_messages("T", 1, 16).status is GetStatus.NO_MESSAGE
        with pytest.raises(CorruptRecordError):
            r.read(last.commit_log_offset)
        assert r.read(results[-2].commit_log_offset).body == bytes([2]) * 60
        assert sum(length for _, _, length in r.segments()) == r.max_offset - r.min_offset


def test_reader_ignores_cq_entries_past_the_valid_end(tmp_path, live):
    d, s = live
    s.append([msg() for _ in range(5)])
    s.checkpoint()
    end = s.max_offset
    qfile = d / "consumequeue" / "T" / "0" / f"{0:020d}"
    with open(qfile, "ab") as f:  # index entries whose records never made it
        f.write(ENTRY.pack(end, 118, 0) + ENTRY.pack(end + 118, 118, 0))
    r = StoreReader(d)
    assert r.queue_max_offset("T", 0) == 5
    assert len(r.get_messages("T", 0, 0).records) == 5
    assert len(r.cq_entries("T", 0, 0, 100)) == 5
    r.close()


def test_reader_follows_a_live_writer_without_a_lock(live):
    d, s = live
    r = StoreReader(d)  # the writer holds the lock; the reader does not need it
    assert r.max_offset == 0 and r.queues() == {}
    results = s.append([msg(qid=i % 3, body=b"w" * 300) for i in range(40)])  # rolls segments, no checkpoint
    assert r.max_offset == s.max_offset
    assert r.queues() == {"T": [0, 1, 2]}
    assert [r.queue_max_offset("T", q) for q in range(3)] == [14, 13, 13]
    got = r.get_messages("T", 2, 0, max_count=100)
    assert [x.commit_log_offset for x in got.records] == [x.commit_log_offset for x in results[2::3]]
    s.checkpoint()
    more = s.append([msg(qid=2)])
    assert r.queue_max_offset("T", 2) == 14
    assert r.get_messages("T", 2, 13).records[0].commit_log_offset == more[0].commit_log_offset
    assert r.read_many([more[0].commit_log_offset, results[0].commit_log_offset])[1].queue_offset == 0
    assert r.queue_min_offset("T", 2) == 0
    r.close()


def test_scan_range_partitions_the_log_exactly(live):
    d, s = live
    bodies = tricky_bodies(120)
    for i in range(0, len(bodies), 7):
        s.append([msg(qid=j % 2, body=b) for j, b in enumerate(bodies[i : i + 7])])
    r = StoreReader(d)
    everything = [x.commit_log_offset for x in r.scan()]
    assert len(everything) == 120
    lo, hi = r.min_offset, r.max_offset
    rnd = random.Random(1)
    for trial in range(20):
        cuts = sorted({lo, hi, *(rnd.randrange(lo, hi) for _ in range(rnd.randrange(1, 40)))})
        got = [x.commit_log_offset for a, b in zip(cuts, cuts[1:]) for x in r.scan_range(a, b)]
        assert got == everything, trial
    # per segment, as a Spark planner would split them
    parts = [(start, start + length) for start, _, length in r.segments()]
    assert [x.commit_log_offset for a, b in parts for x in r.scan_range(a, b)] == everything
    r.close()


def test_scan_range_from_every_byte_position(live):
    d, s = live
    s.append([msg(body=b) for b in tricky_bodies(12, seed=3)])
    r = StoreReader(d)
    offsets = [x.commit_log_offset for x in r.scan()]
    for pos in range(r.max_offset + 1):
        got = [x.commit_log_offset for x in r.scan_range(pos, r.max_offset)]
        assert got == [o for o in offsets if o >= pos], pos
    single = [x.commit_log_offset for pos in range(r.max_offset) for x in r.scan_range(pos, pos + 1)]
    assert single == offsets
    r.close()


def test_scan_range_stops_silently_at_a_torn_tail(tmp_path, live):
    d, s = live
    results = s.append([msg(body=b"t" * 90) for _ in range(30)])
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)
    with open(last_segment(copy), "ab") as f:
        f.write(encode_record(msg(), s.max_offset, 30, 1)[:50])
    r = StoreReader(copy)
    assert [x.commit_log_offset for x in r.scan_range(0, 1 << 40)] == [x.commit_log_offset for x in results]
    r.close()


def test_reader_of_an_empty_or_missing_directory(tmp_path):
    r = StoreReader(tmp_path / "nothing")
    assert (r.max_offset, r.min_offset, r.segments(), r.queues(), list(r.scan())) == (0, 0, [], {}, [])
    assert r.get_messages("T", 0, 0).status is GetStatus.NO_QUEUE
    r.close()


def test_a_long_torn_tail_is_searched_once_not_on_every_call(tmp_path, monkeypatch):
    """A crashed directory whose last segment ends in a long range of garbage: each call costs the new bytes only."""
    from txmq.store import segments

    d = tmp_path / "d"
    with Store(d, StoreConfig()) as s:
        results = s.append([msg() for _ in range(10)])
    with open(last_segment(d), "ab") as f:
        f.write(b"\x55" * (3 << 20))  # no record starts in it (zeros would be preallocated space, not searched)
    searched = []
    real = segments.resync

    def counting(seg, pos, limit=None):
        searched.append(seg.end - pos)
        return real(seg, pos, limit)

    monkeypatch.setattr(segments, "resync", counting)
    with StoreReader(d) as r:
        assert r.max_offset == results[-1].end_offset
        first = sum(searched)
        assert first >= (3 << 20) - 1
        for _ in range(5):
            assert r.max_offset == results[-1].end_offset
            assert r.get_messages("T", 0, 0).records
        assert sum(searched) == first
        with open(last_segment(d), "ab") as f:  # the file grows: only then is it looked at again
            f.write(bytes(100))
        assert r.max_offset == results[-1].end_offset
        assert sum(searched) > first


def test_a_known_end_that_still_ends_a_record_spares_the_validation_and_a_stale_one_is_ignored(tmp_path, monkeypatch):
    d = tmp_path / "d"
    with Store(d, StoreConfig(segment_size=1 << 20)) as s:
        results = s.append([msg(body=b"k%02d" % i) for i in range(50)])
    os.unlink(d / "checkpoint")  # nothing says where the fsynced part ends: a reader validates from the first byte
    with StoreReader(d) as r:
        known = r.last_record
        assert known == (results[-1].commit_log_offset, results[-1].end_offset)
    reads: list[int] = []
    real = os.pread
    import txmq.store.segments as segments_module

    def counting(fd, n, pos):
        reads.append(pos)
        return real(fd, n, pos)

    monkeypatch.setattr(segments_module.os, "pread", counting)
    with StoreReader(d, known_end=known) as r:
        assert r.max_offset == known[1]
        assert min(reads) >= known[0]  # one read of the last record, nothing before it
    monkeypatch.undo()
    # the log cut back to 45 records and zeros after them, as a writer's preallocation leaves it
    seg = d / "commitlog" / sorted(os.listdir(d / "commitlog"))[-1]
    cut = results[45].commit_log_offset
    with open(seg, "r+b") as f:
        f.seek(cut)
        f.write(b"\0" * (known[1] - cut))
    with StoreReader(d, known_end=known) as r:  # the record is gone: validated from the start, as without it
        assert r.max_offset == cut
        assert [rec.body for rec in r.scan_range(0, known[1])] == [b"k%02d" % i for i in range(45)]
    with StoreReader(d, known_end=(known[0], known[1] + 7)) as r:  # not where that record ends: ignored too
        assert r.max_offset == cut
