"""Damage inside a data directory heals instead of wedging: skipped, reported once, never deleted.

Each test damages a real store the way bit rot or a careless hand would
(a flipped byte, a missing file, a zeroed or truncated consume queue) and
checks that every other record is still served, that new records never
reuse a queue offset, and that bytes recovery will not use are kept in
``quarantine/``.
"""

from __future__ import annotations

import os

import pytest

from txmq.store import Message, Store, StoreConfig, StoreReader, TxType
from txmq.store.consumequeue import ENTRY
from txmq.store.errors import CorruptRecordError

SMALL = StoreConfig(segment_size=4096, cq_entries_per_file=50)


def msg(i: int, qid: int = 0, topic: str = "T") -> Message:
    return Message(topic, qid, TxType.NORMAL, 1000, {}, b"m%04d" % i + b"." * 150)


def flip(data_dir, offset: int) -> None:
    """Flip one bit of the byte at commit-log offset."""
    names = sorted(os.listdir(data_dir / "commitlog"))
    start = [int(n) for n in names if int(n) <= offset][-1]
    with open(data_dir / "commitlog" / f"{start:020d}", "r+b") as f:
        f.seek(offset - start)
        b = f.read(1)
        f.seek(offset - start)
        f.write(bytes([b[0] ^ 0x10]))


def all_bodies(store, topic="T", qid=0, start=0):
    res = store.get_messages(topic, qid, start, max_count=100_000, max_bytes=1 << 30)
    return [r.body[:5] for r in res.records], res


def test_a_damaged_record_is_skipped_and_every_other_record_of_its_queue_served(tmp_path):
    d = tmp_path / "d"
    with Store(d, StoreConfig()) as s:
        results = s.append([msg(i) for i in range(100)])
    victim = results[63]
    flip(d, victim.commit_log_offset + victim.size - 30)
    with Store(d, StoreConfig()) as s:
        s.append([msg(100)])
        got, res = all_bodies(s)
        assert got == [b"m%04d" % i for i in range(101) if i != 63]
        assert res.next_offset == 101
        assert res.skipped == [(63, victim.commit_log_offset, f"crc mismatch at {victim.commit_log_offset}")]
        # a batch that starts right at the damaged record moves past it as well
        part = s.get_messages("T", 0, 63, max_count=2)
        assert [r.queue_offset for r in part.records] == [64] and part.next_offset == 65
        assert s.damage.count == 1  # reported once however often it is read
    with StoreReader(d) as r:  # the read-only view skips it the same way
        got, _ = all_bodies(r)
        assert len(got) == 100 and b"m0063" not in got


def test_without_a_checkpoint_one_damaged_record_loses_only_itself(tmp_path):
    d = tmp_path / "d"
    with Store(d, SMALL) as s:
        results = s.append([msg(i) for i in range(400)])
    segs = sorted(os.listdir(d / "commitlog"))
    assert len(segs) >= 20
    os.unlink(d / "checkpoint")
    ninth = int(segs[8])
    victim = next(r for r in results if r.commit_log_offset >= ninth)
    flip(d, victim.commit_log_offset + 100)
    with Store(d, SMALL) as s:
        assert sorted(os.listdir(d / "commitlog")) == segs  # no segment deleted
        assert s.max_offset == results[-1].end_offset
        got, res = all_bodies(s)
        assert len(got) == 399 and res.next_offset == 400
        assert [dmg.offset for dmg in s.damage.places.values()] == [victim.commit_log_offset]


def test_a_queue_rebuilt_without_its_files_keeps_the_queue_offsets_past_damage(tmp_path):
    d = tmp_path / "d"
    with Store(d, SMALL) as s:
        results = s.append([msg(i) for i in range(60)])
    flip(d, results[10].commit_log_offset + 80)
    for name in os.listdir(d / "consumequeue" / "T" / "0"):
        os.unlink(d / "consumequeue" / "T" / "0" / name)
    os.unlink(d / "checkpoint")
    s = Store(d, SMALL)
    report = s.open()
    try:
        assert report.damaged == 1 and report.truncated_at is None
        got, res = all_bodies(s)
        assert got == [b"m%04d" % i for i in range(60) if i != 10]
        assert [q for q, _, _ in res.skipped] == [10]
        s.append([msg(60)])
        assert s.queue_max_offset("T", 0) == 61
    finally:
        s.close()


def test_a_removed_consume_queue_is_rebuilt_from_the_log(tmp_path):
    d = tmp_path / "d"
    with Store(d, SMALL) as s:
        s.append([msg(i, qid=i % 3) for i in range(90)])
    qdir = d / "consumequeue" / "T" / "2"
    for name in os.listdir(qdir):
        os.unlink(qdir / name)
    os.rmdir(qdir)
    s = Store(d, SMALL)
    report = s.open()
    try:
        assert report.queues_rebuilt == ["queue T/2 is missing (30 entries at the last close)"]
        got, _ = all_bodies(s, qid=2)
        assert got == [b"m%04d" % i for i in range(2, 90, 3)]
        res = s.append([msg(90, qid=2)])
        assert res[0].queue_offset == 30  # never a reused queue offset
    finally:
        s.close()


def test_a_zeroed_or_truncated_consume_queue_file_is_rebuilt_from_the_log(tmp_path):
    for how in ("zero", "truncate", "garbage"):
        d = tmp_path / how
        with Store(d, SMALL) as s:
            s.append([msg(i) for i in range(40)])
        f = d / "consumequeue" / "T" / "0" / f"{0:020d}"
        size = f.stat().st_size
        with open(f, "r+b") as fh:
            if how == "zero":
                fh.seek(size - 10 * ENTRY.size)
                fh.write(bytes(10 * ENTRY.size))
            elif how == "truncate":
                fh.truncate(size - 10 * ENTRY.size)
            else:
                fh.seek(size - ENTRY.size)
                fh.write(ENTRY.pack(8581873820936893689, 12345, 0))
        s = Store(d, SMALL)
        report = s.open()
        try:
            assert report.queues_rebuilt, how
            got, _ = all_bodies(s)
            assert got == [b"m%04d" % i for i in range(40)], how
            assert s.append([msg(40)])[0].queue_offset == 40
        finally:
            s.close()


def test_a_garbage_queue_entry_is_rebuilt_from_the_log_and_skipped_only_when_its_record_is_damaged(tmp_path):
    d = tmp_path / "d"
    with Store(d, SMALL) as s:
        results = s.append([msg(i) for i in range(10)])
        f = d / "consumequeue" / "T" / "0" / f"{0:020d}"
        s.checkpoint()
        good = f.read_bytes()
        for victim in (4, 6):  # both entries now point far outside the log
            with open(f, "r+b") as fh:
                fh.seek(victim * ENTRY.size)
                fh.write(ENTRY.pack(8581873820936893689, 0xFFFFFFF0, 0))
        flip(d, results[6].commit_log_offset + 100)  # and record 6 itself is damaged
        got, res = all_bodies(s)
        assert got == [b"m%04d" % i for i in range(10) if i != 6]
        assert [q for q, _, _ in res.skipped] == [6] and "outside the log" in res.skipped[0][2]
        s.checkpoint()
        assert f.read_bytes()[: 6 * ENTRY.size] == good[: 6 * ENTRY.size]  # entry 4 is its record's again


def test_a_torn_tail_is_moved_to_quarantine_not_deleted(tmp_path):
    d = tmp_path / "d"
    s = Store(d, SMALL)
    s.open()
    s.append([msg(i) for i in range(5)])
    s.checkpoint()
    end = s.max_offset
    s._release()  # a crash: no close
    seg = d / "commitlog" / sorted(os.listdir(d / "commitlog"))[-1]
    with open(seg, "r+b") as f:  # a torn write after the last record, into the preallocated zeros
        f.seek(end - int(seg.name))
        f.write(b"\x55" * 100)
    s = Store(d, SMALL)
    report = s.open()
    try:
        assert report.dropped_bytes == 100
        kept = list((d / "quarantine").iterdir())
        assert len(kept) == 1 and kept[0].read_bytes() == b"\x55" * 100
    finally:
        s.close()


def test_removing_the_first_segment_by_hand_is_reported(tmp_path):
    d = tmp_path / "d"
    with Store(d, SMALL) as s:
        s.append([msg(i) for i in range(60)])
    first = sorted(os.listdir(d / "commitlog"))[0]
    os.unlink(d / "commitlog" / first)
    s = Store(d, SMALL)
    report = s.open()
    try:
        assert report.damaged == 1
        (dmg,) = s.damage.places.values()
        assert dmg.offset == 0 and "first segment files were removed" in dmg.reason
    finally:
        s.close()


def test_damage_in_the_last_fsynced_records_is_skipped_never_cut_and_no_queue_offset_is_reused(tmp_path):
    d = tmp_path / "d"
    with Store(d, SMALL) as s:
        results = s.append([msg(i) for i in range(20)])
    last = results[-1]
    flip(d, last.commit_log_offset + 90)  # the last acknowledged, fsynced record rots
    s = Store(d, SMALL)
    report = s.open(rebuild=True)  # what `txmq store repair` does: the whole log re-read
    try:
        assert report.truncated_at is None and report.dropped_bytes == 0 and report.damaged == 1
        assert s.max_offset == last.end_offset  # the damaged record's bytes stay, skipped
        got, res = all_bodies(s)
        assert got == [b"m%04d" % i for i in range(19)] and res.next_offset == 20
        new = s.append([msg(20)])[0]
        assert new.queue_offset == 20 and new.commit_log_offset == last.end_offset
        got, _ = all_bodies(s)
        assert got[-1] == b"m0020"
    finally:
        s.close()


def test_scan_range_with_on_damage_skips_damaged_records_and_still_partitions_the_log(tmp_path):
    d = tmp_path / "d"
    with Store(d, SMALL) as s:  # small segments: the damage and the cuts fall in several of them
        results = s.append([msg(i) for i in range(120)])
    victims = [results[i] for i in (0, 41, 42, 119)]  # the first, two in a row, the last
    for v in victims:
        flip(d, v.commit_log_offset + v.size - 30)
    want = [r.commit_log_offset for i, r in enumerate(results) if i not in (0, 41, 42, 119)]
    with StoreReader(d) as r:
        end = r.max_offset
        for step in (997, 4096, end):  # range boundaries anywhere, inside records and damage too
            cuts = list(range(0, end, step)) + [end]
            damage: list[tuple[int, str, int]] = []
            got = [x.commit_log_offset for a, b in zip(cuts, cuts[1:])
                   for x in r.scan_range(a, b, on_damage=lambda *d_: damage.append(d_))]
            assert got == want, step
            # two damaged records in a row are one stretch of damage, reported at its start with both sizes
            seen = {o: n for o, _, n in damage}
            assert sorted(seen) == [victims[0].commit_log_offset, victims[1].commit_log_offset, victims[3].commit_log_offset], step
            if step == end:  # one range: the stretch is not cut by a range's end
                assert seen[victims[1].commit_log_offset] == victims[1].size + victims[2].size
            assert all(why.endswith(f"at {o}") for o, why, _ in damage)
        with pytest.raises(CorruptRecordError):  # without on_damage: the error, as before
            list(r.scan_range(0, end))
