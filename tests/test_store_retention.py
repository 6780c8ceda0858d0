"""delete_expired: whole leading segments, by age and below the protected offset."""

from __future__ import annotations

import os

from txmq.store import GetStatus, Message, Store, StoreConfig, StoreReader, TxType

CFG = StoreConfig(segment_size=2048, cq_entries_per_file=5, retention_s=3600)
T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def msg(qid=0):
    return Message("T", qid, TxType.NORMAL, 1, {}, b"r" * 300)


def build(tmp_path):
    """Six hours of traffic: one batch of 6 records (about one segment) per hour."""
    clock = Clock()
    s = Store(tmp_path / "d", CFG, clock=clock)
    s.open()
    hours = []
    for h in range(6):
        clock.now = T0 + h * 3600
        hours.append(s.append([msg(qid=i % 2) for i in range(6)]))
    s.checkpoint()  # consume-queue files on disk
    return s, clock, hours


def test_delete_expired_respects_retention(tmp_path):
    s, clock, hours = build(tmp_path)
    try:
        n_segs = len(s._log.segments)
        now = T0 + 5 * 3600 + 1800  # records from hours 0..4 are older than an hour
        deleted = s.delete_expired(now, protect_from=s.max_offset)
        assert deleted and all(p.startswith("commitlog/") or p.startswith("consumequeue/") for p in deleted)
        first = s._log.segments[0]
        cutoff_ms = (now - CFG.retention_s) * 1000
        # every remaining segment but the first holds something young enough, or the first itself does
        assert s._log.last_store_ts(first) >= cutoff_ms or first is s._log.segments[-1]
        assert len(s._log.segments) < n_segs
        for name in deleted:
            assert not (tmp_path / "d" / name).exists()
        assert s.min_offset == first.start
        assert s.delete_expired(now, protect_from=s.max_offset) == []  # idempotent
    finally:
        s.close()


def test_delete_expired_respects_protect_from(tmp_path):
    s, clock, hours = build(tmp_path)
    try:
        protect = hours[1][0].commit_log_offset  # an undecided half message written in hour 1
        s.delete_expired(T0 + 100 * 3600, protect_from=protect)
        assert 0 < s.min_offset <= protect  # the segments wholly before it went, its own stayed
        assert s.read(protect).body == b"r" * 300
        # with nothing protected, everything but the current segment goes
        s.delete_expired(T0 + 100 * 3600, protect_from=s.max_offset)
        assert len(s._log.segments) == 1
    finally:
        s.close()


def test_never_deletes_the_current_segment_or_the_young(tmp_path):
    s, clock, hours = build(tmp_path)
    try:
        assert s.delete_expired(T0, protect_from=s.max_offset) == []  # nothing is old yet
        segs_before = len(s._log.segments)
        s.delete_expired(T0 + 10**6, protect_from=s.max_offset)
        assert len(s._log.segments) == 1 < segs_before
        assert s.read(hours[-1][-1].commit_log_offset).queue_offset == 17
    finally:
        s.close()


def test_queues_after_retention(tmp_path):
    s, clock, hours = build(tmp_path)
    s.delete_expired(T0 + 3 * 3600 + 1, protect_from=s.max_offset)  # hours 0-2 are expired
    lo = s.queue_min_offset("T", 0)
    assert 0 < lo < 18 and s.queue_max_offset("T", 0) == 18
    too_small = s.get_messages("T", 0, 0)
    assert (too_small.status, too_small.next_offset) == (GetStatus.OFFSET_TOO_SMALL, lo)
    assert s.get_messages("T", 0, lo).records[0].commit_log_offset >= s.min_offset
    qdir = tmp_path / "d" / "consumequeue" / "T" / "0"
    files = sorted(os.listdir(qdir))
    assert files[0] != f"{0:020d}" and int(files[0]) <= lo
    s.close()
    # reopen: the same picture, and offsets continue
    s = Store(tmp_path / "d", CFG, clock=clock)
    report = s.open()
    try:
        assert report.dropped_bytes == 0
        assert (s.queue_min_offset("T", 0), s.queue_max_offset("T", 0)) == (lo, 18)
        assert s.append([msg()])[0].queue_offset == 18
        r = StoreReader(tmp_path / "d")
        assert r.queue_min_offset("T", 0) == lo and r.min_offset == s.min_offset
        r.close()
    finally:
        s.close()


def test_age_of_segments_found_from_files_after_reopen(tmp_path):
    s, clock, hours = build(tmp_path)
    s.close()
    s = Store(tmp_path / "d", CFG, clock=clock)
    s.open()
    try:
        deleted = s.delete_expired(T0 + 2 * 3600 + 1, protect_from=s.max_offset)
        # hour 0 and hour 1 records are over an hour old; hour 2's are not
        assert s._log.last_store_ts(s._log.segments[0]) >= (T0 + 3600 + 1) * 1000
        assert any(p.startswith("commitlog/") for p in deleted)
        assert s.read(hours[2][0].commit_log_offset).store_ts == (T0 + 2 * 3600) * 1000
    finally:
        s.close()
