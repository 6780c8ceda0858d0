"""Recovery tests: damaged tails, crashes between log and index, bad checkpoints.

A "crash" is simulated by copying the data directory while the store is
open and has not checkpointed: the copy holds what the page cache held.
"""

from __future__ import annotations

import os
import shutil

import pytest

from txmq.store import GetStatus, Message, Store, StoreConfig, TxType
from txmq.store.consumequeue import ENTRY

SMALL = StoreConfig(segment_size=4096, cq_entries_per_file=7)


def msg(qid=0, body=b"x" * 50, topic="T"):
    return Message(topic, qid, TxType.NORMAL, 1000, {"TAGS": "a"}, body)


def crash_copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def last_segment(d):
    names = sorted(os.listdir(d / "commitlog"))
    return d / "commitlog" / names[-1]


def bodies(store, topic="T", qid=0):
    res = store.get_messages(topic, qid, 0, max_count=10_000, max_bytes=1 << 30)
    return [r.body for r in res.records]


@pytest.fixture
def crashed(tmp_path):
    """A directory with 20 checkpointed records and 3 more appended after the checkpoint, then 'killed'."""
    d = tmp_path / "live"
    s = Store(d, SMALL)
    s.open()
    s.append([msg(body=bytes([i]) * 40) for i in range(20)])
    s.checkpoint()
    tail = s.append([msg(body=b"a" * 30), msg(qid=1, body=b"b" * 31), msg(body=b"c" * 17)])
    copy = crash_copy(d, tmp_path / "copy")
    s.close()
    return copy, tail


def test_truncated_trailing_record_is_ignored(tmp_path, crashed):
    copy, tail = crashed
    last = tail[-1]
    seg = last_segment(copy)
    seg_start = int(seg.name)
    for cut in range(0, last.size):
        d = tmp_path / f"cut{cut}"
        shutil.copytree(copy, d)
        os.truncate(last_segment(d), last.commit_log_offset - seg_start + cut)
        s = Store(d, SMALL)
        report = s.open()
        try:
            assert s.max_offset == last.commit_log_offset
            if cut == 0:
                assert (report.dropped_bytes, report.reason, report.truncated_at) == (0, None, None)
            else:
                assert report.dropped_bytes == cut
                assert report.truncated_at == last.commit_log_offset
                assert report.reason.startswith("torn") and str(last.commit_log_offset) in report.reason
            assert bodies(s)[-1] == b"a" * 30 and len(bodies(s)) == 21
            assert s.queue_max_offset("T", 1) == 1
            if cut in (0, 7, 40):
                assert s.append([msg()])[0].queue_offset == 21  # the lost record's offset is reused
        finally:
            s.close()
        shutil.rmtree(d)


def test_repaired_directory_reopens_clean(crashed):
    copy, tail = crashed
    last = tail[-1]
    os.truncate(last_segment(copy), last.commit_log_offset - int(last_segment(copy).name) + 40)
    s = Store(copy, SMALL)
    assert s.open().dropped_bytes == 40
    s.close()
    s = Store(copy, SMALL)
    report = s.open()
    s.close()
    assert (report.dropped_bytes, report.reason, report.redispatched, report.cq_entries_dropped) == (0, None, 0, 0)


def test_torn_record_reason_text(tmp_path, crashed):
    copy, tail = crashed
    last = tail[-1]
    os.truncate(last_segment(copy), last.commit_log_offset - int(last_segment(copy).name) + 40)
    s = Store(copy, SMALL)
    r = s.open()
    s.close()
    assert r.reason == f"torn record: 40 of {last.size} bytes at {last.commit_log_offset}"


def test_flipped_byte_in_last_record_is_dropped_with_crc_reason(crashed):
    copy, tail = crashed
    last = tail[-1]
    seg = last_segment(copy)
    with open(seg, "r+b") as f:
        pos = last.commit_log_offset - int(seg.name) + last.size - 5
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))
    s = Store(copy, SMALL)
    report = s.open()
    try:
        assert report.reason == f"crc mismatch at {last.commit_log_offset}"
        assert report.dropped_bytes == last.size
        assert len(bodies(s)) == 21
    finally:
        s.close()


def test_crash_between_record_write_and_index_update_rebuilds_entries(crashed):
    copy, tail = crashed
    s = Store(copy, SMALL)
    report = s.open()
    try:
        assert (report.dropped_bytes, report.reason) == (0, None)
        assert report.redispatched == 3
        assert s.queue_max_offset("T", 0) == 22 and s.queue_max_offset("T", 1) == 1
        assert bodies(s)[-2:] == [b"a" * 30, b"c" * 17]
        res = s.get_messages("T", 0, 20, max_count=5)
        assert [(r.queue_offset, r.commit_log_offset) for r in res.records] == [
            (20, tail[0].commit_log_offset),
            (21, tail[2].commit_log_offset),
        ]
        assert s.get_messages("T", 1, 0).records[0].body == b"b" * 31
    finally:
        s.close()


def test_crash_with_nothing_ever_checkpointed(tmp_path):
    d = tmp_path / "live"
    s = Store(d, SMALL)
    s.open()
    results = [r for _ in range(10) for r in s.append([msg(qid=i % 3) for i in range(9)])]
    os.unlink(d / "checkpoint")  # as if the first checkpoint never happened
    copy = crash_copy(d, tmp_path / "copy")
    s.close()
    s = Store(copy, SMALL)
    report = s.open()
    try:
        assert report.redispatched == 90
        assert [s.queue_max_offset("T", q) for q in range(3)] == [30, 30, 30]
        assert s.max_offset == results[-1].end_offset
    finally:
        s.close()


@pytest.mark.parametrize("damage", ["missing", "corrupt", "short"])
def test_bad_checkpoint_means_a_full_rescan(tmp_path, damage):
    d = tmp_path / "d"
    with Store(d, SMALL) as s:
        s.append([msg(qid=i % 2) for i in range(50)])
    ck = d / "checkpoint"
    if damage == "missing":
        ck.unlink()
    elif damage == "corrupt":
        data = bytearray(ck.read_bytes())
        data[3] ^= 0xFF
        ck.write_bytes(bytes(data))
    else:
        ck.write_bytes(ck.read_bytes()[:10])
    s = Store(d, SMALL)
    report = s.open()
    try:
        assert (report.dropped_bytes, report.redispatched, report.cq_entries_dropped) == (0, 0, 0)
        assert [s.queue_max_offset("T", q) for q in range(2)] == [25, 25]
        assert len(bodies(s)) == 25
    finally:
        s.close()


def test_checkpoint_past_the_end_of_an_externally_truncated_log(tmp_path):
    d = tmp_path / "d"
    with Store(d, SMALL) as s:
        results = s.append([msg(qid=i % 2, body=bytes([i]) * 30) for i in range(60)])
    keep = results[-7]  # cut in the middle of this record, in the last segment
    seg = last_segment(d)
    assert keep.commit_log_offset >= int(seg.name)
    os.truncate(seg, keep.commit_log_offset - int(seg.name) + 10)
    s = Store(d, SMALL)
    report = s.open()
    try:
        assert report.truncated_at == keep.commit_log_offset and report.dropped_bytes == 10
        assert report.cq_entries_dropped == 7  # entries for the 7 lost records
        survivors = results[:-7]
        for q in range(2):
            assert s.queue_max_offset("T", q) == sum(1 for i in range(len(survivors)) if i % 2 == q)
        assert [r.commit_log_offset for r in s.scan()] == [r.commit_log_offset for r in survivors]
        assert s.append([msg(qid=1)])[0].commit_log_offset == keep.commit_log_offset
    finally:
        s.close()


def test_cq_files_longer_than_the_log_are_cut(tmp_path):
    d = tmp_path / "d"
    with Store(d, SMALL) as s:
        s.append([msg() for _ in range(5)])
        end = s.max_offset
    qfile = d / "consumequeue" / "T" / "0" / f"{0:020d}"
    with open(qfile, "ab") as f:
        f.write(ENTRY.pack(end, 100, 0) + ENTRY.pack(end + 100, 100, 0) + b"\x07" * 9)
    s = Store(d, SMALL)
    report = s.open()
    try:
        assert report.cq_entries_dropped == 2
        assert s.queue_max_offset("T", 0) == 5
        assert os.path.getsize(qfile) == 5 * 20
        assert s.get_messages("T", 0, 5).status is GetStatus.NO_MESSAGE
    finally:
        s.close()


def test_zeroed_cq_tail_is_cut(tmp_path):
    d = tmp_path / "d"
    with Store(d, SMALL) as s:
        s.append([msg() for _ in range(3)])
    qfile = d / "consumequeue" / "T" / "0" / f"{0:020d}"
    with open(qfile, "ab") as f:
        f.write(bytes(60))
    with Store(d, SMALL) as s:
        assert s.queue_max_offset("T", 0) == 3


def test_deleted_consume_queues_are_rebuilt_from_the_log(tmp_path):
    d = tmp_path / "d"
    with Store(d, SMALL) as s:
        s.append([msg(qid=i % 2) for i in range(40)])
        s.append([msg(topic="U")])
    shutil.rmtree(d / "consumequeue")
    s = Store(d, SMALL)
    report = s.open()
    try:
        assert report.redispatched == 41
        assert s.queues() == {"T": [0, 1], "U": [0]}
        assert [s.queue_max_offset("T", q) for q in range(2)] == [20, 20]
        assert len(bodies(s, qid=1)) == 20
    finally:
        s.close()


def test_lost_queue_found_by_a_later_record_triggers_a_full_rebuild(tmp_path):
    d = tmp_path / "live"
    s = Store(d, SMALL)
    s.open()
    s.append([msg(qid=i % 2) for i in range(40)])
    s.checkpoint()
    s.append([msg(qid=1)])
    copy = crash_copy(d, tmp_path / "copy")
    s.close()
    shutil.rmtree(copy / "consumequeue" / "T" / "1")
    s = Store(copy, SMALL)
    report = s.open()
    try:
        assert report.redispatched == 21
        assert [s.queue_max_offset("T", q) for q in range(2)] == [20, 21]
        assert [r.queue_offset for r in s.get_messages("T", 1, 0, max_count=100).records] == list(range(21))
    finally:
        s.close()


def test_empty_directory_opens_empty(tmp_path):
    s = Store(tmp_path / "new", SMALL)
    report = s.open()
    try:
        assert (report.max_offset, report.segments, report.dropped_bytes) == (0, 1, 0)
        assert s.queues() == {} and list(s.scan()) == []
        assert s.append([msg()])[0].commit_log_offset == 0
    finally:
        s.close()


def test_garbage_tail_never_raises(tmp_path):
    d = tmp_path / "d"
    with Store(d, SMALL) as s:
        end = s.append([msg() for _ in range(3)])[-1].end_offset
    with open(last_segment(d), "ab") as f:
        f.write(os.urandom(333))
    with open(d / "commitlog" / f"{end + 5000:020d}", "wb") as f:  # a later segment after a gap
        f.write(os.urandom(100))
    s = Store(d, SMALL)
    report = s.open()
    try:
        assert report.truncated_at == end and report.dropped_bytes == 433
        assert report.segments == 1 and s.max_offset == end
        assert len(bodies(s)) == 3
    finally:
        s.close()


def test_a_missing_middle_segment_is_skipped_and_the_later_segments_kept(tmp_path):
    d = tmp_path / "d"
    with Store(d, SMALL) as s:
        results = s.append([msg(body=b"q" * 200) for _ in range(40)])
    segs = sorted(os.listdir(d / "commitlog"))
    assert len(segs) >= 3
    victim = d / "commitlog" / segs[1]  # a middle segment goes missing
    victim.unlink()
    gap = (int(segs[1]), int(segs[2]))
    s = Store(d, SMALL)
    report = s.open()
    try:
        assert report.truncated_at is None and report.dropped_bytes == 0 and report.damaged == 1
        assert s.max_offset == results[-1].end_offset  # nothing after the gap was cut
        assert [dmg.reason for dmg in s.damage.places.values()] == [f"segment gap at {gap[0]}: next segment starts at {gap[1]}"]
        res = s.get_messages("T", 0, 0, max_count=100, max_bytes=1 << 30)
        kept = [r.commit_log_offset for r in results if not gap[0] <= r.commit_log_offset < gap[1]]
        assert [r.commit_log_offset for r in res.records] == kept
        assert res.next_offset == 40 and len(res.skipped) == 40 - len(kept)
        s.append([msg(body=b"after")])
        assert s.queue_max_offset("T", 0) == 41  # new records never reuse a queue offset
    finally:
        s.close()


def test_a_queue_whose_last_records_were_in_a_missing_middle_segment_is_not_re_read_at_every_start(tmp_path):
    d = tmp_path / "d"
    with Store(d, SMALL) as s:
        s.append([msg(body=b"a" * 200) for _ in range(20)])  # queue A ends inside the middle segments
        tail = s.append([msg(qid=1, body=b"b" * 200) for _ in range(20)])
    segs = sorted(os.listdir(d / "commitlog"))
    a_last = tail[0].commit_log_offset - 1  # the last byte of queue A's records
    victim = max(n for n in segs if int(n) <= a_last)
    assert victim != segs[0] and victim != segs[-1]
    (d / "commitlog" / victim).unlink()  # a middle segment holding queue A's last records goes missing
    for _ in range(3):  # the first start, and every one after it
        s = Store(d, SMALL)
        report = s.open()
        try:
            assert report.truncated_at is None and report.damaged == 1
            assert report.queues_rebuilt == [], report.queues_rebuilt  # nothing a re-read of the log could restore
            assert report.scanned_from == s.max_offset  # the checkpoint is at the end: nothing to read
            assert s.queue_max_offset("T", 0) == 20 and s.queue_max_offset("T", 1) == 20
        finally:
            s.close()


def test_recovery_spanning_a_segment_roll(tmp_path):
    d = tmp_path / "live"
    s = Store(d, SMALL)
    s.open()
    s.checkpoint()
    results = s.append([msg(body=b"r" * 300) for _ in range(40)])  # one batch over several segments
    copy = crash_copy(d, tmp_path / "copy")
    s.close()
    s = Store(copy, SMALL)
    report = s.open()
    try:
        assert report.redispatched == 40 and report.segments > 3
        assert [r.commit_log_offset for r in s.scan()] == [r.commit_log_offset for r in results]
    finally:
        s.close()


def test_entries_written_before_a_crash_mid_checkpoint_are_checked_and_kept(tmp_path):
    d = tmp_path / "d"
    s = Store(d, SMALL)
    s.open()
    s.append([msg(qid=i % 2) for i in range(10)])
    s.checkpoint()
    old_checkpoint = (d / "checkpoint").read_bytes()
    s.append([msg(qid=i % 2) for i in range(10)])
    s.checkpoint()  # queue files now hold 20 entries ...
    copy = crash_copy(d, tmp_path / "copy")
    s.close()
    (copy / "checkpoint").write_bytes(old_checkpoint)  # ... but the checkpoint file still says 10
    s = Store(copy, SMALL)
    report = s.open()
    try:
        assert (report.redispatched, report.cq_entries_dropped, report.dropped_bytes) == (0, 0, 0)
        assert [s.queue_max_offset("T", q) for q in range(2)] == [10, 10]
    finally:
        s.close()


def test_a_wrong_entry_is_replaced_from_the_log(tmp_path):
    d = tmp_path / "d"
    s = Store(d, SMALL)
    s.open()
    s.append([msg() for _ in range(4)])
    s.checkpoint()
    old_checkpoint = (d / "checkpoint").read_bytes()
    results = s.append([msg() for _ in range(2)])
    s.checkpoint()
    copy = crash_copy(d, tmp_path / "copy")
    s.close()
    (copy / "checkpoint").write_bytes(old_checkpoint)
    qfile = copy / "consumequeue" / "T" / "0" / f"{0:020d}"
    with open(qfile, "r+b") as f:  # entry 4 points at the wrong place
        f.seek(4 * 20)
        f.write(ENTRY.pack(results[1].commit_log_offset, results[1].size, 0))
    s = Store(copy, SMALL)
    report = s.open()
    try:
        assert report.redispatched == 2 and report.cq_entries_dropped == 2
        assert [e[0] for e in s.cq_entries("T", 0, 4, 10)] == [r.commit_log_offset for r in results]
    finally:
        s.close()


def test_damage_just_below_the_checkpoint_never_resyncs_into_a_torn_tail(tmp_path, crashed):
    """The last fsynced record is damaged and the first unsynced one torn: the later unsynced ones are cut too."""
    copy, tail = crashed
    synced_end = tail[0].commit_log_offset  # the checkpoint's log offset
    seg = last_segment(copy)
    start = int(seg.name)
    with open(seg, "r+b") as f:
        f.seek(synced_end - start - 10)  # a flipped byte in the last record below the checkpoint
        b = f.read(1)
        f.seek(synced_end - start - 10)
        f.write(bytes([b[0] ^ 0x10]))
        f.seek(synced_end - start)  # the first record after it never reached the disk
        f.write(bytes(tail[0].size))
    shutil.rmtree(copy / "consumequeue")  # the queues are rebuilt: the whole log is read
    s = Store(copy, SMALL)
    report = s.open()
    try:
        assert report.truncated_at is not None and report.truncated_at <= synced_end
        assert s.max_offset < tail[1].commit_log_offset
        assert [r.commit_log_offset for r in s.scan() if r.commit_log_offset >= synced_end] == []
    finally:
        s.close()


def test_names_that_only_look_numbered_and_a_manifest_no_number_fits_are_ignored_at_open(tmp_path):
    d = tmp_path / "d"
    with Store(d) as s:
        s.append([Message("A", 0, TxType.NORMAL, 1, {}, b"m%d" % i) for i in range(10)])
        end = s.max_offset
    (d / "commitlog" / ("0" * 19 + "\u0661")).write_bytes(b"")  # an Arabic-Indic digit: str.isdigit() says yes
    (d / "commitlog" / "00000000000099999999").mkdir()  # a directory with a segment's name
    (d / "consumequeue" / "A" / "\u00b2").mkdir()  # a superscript two
    (d / "cqmanifest.json").write_text('{"version": 1, "log_min": 0, "queues": [["A", 0, 1e400]]}')
    with Store(d) as s:
        assert s.max_offset == end
        assert len(s.get_messages("A", 0, 0, 100, 1 << 20).records) == 10


@pytest.mark.parametrize("stray", ["byte after a sealed segment", "empty file inside a segment"])
def test_a_stray_byte_or_file_between_segments_is_set_aside_and_every_record_kept(tmp_path, stray):
    d = tmp_path / "d"
    with Store(d, StoreConfig(segment_size=64 << 10)) as s:
        s.append([Message("A", i % 2, TxType.NORMAL, 1, {}, b"x" * 300) for i in range(800)])
        end = s.max_offset
    names = sorted(os.listdir(d / "commitlog"))
    assert len(names) >= 4
    if stray == "byte after a sealed segment":
        with open(d / "commitlog" / names[1], "ab") as f:
            f.write(b"\x01")
    else:
        (d / "commitlog" / f"{int(names[0]) + 100:020d}").write_bytes(b"")
    with Store(d, StoreConfig(segment_size=64 << 10)) as s:
        assert s.max_offset == end
        got = sum(len(s.get_messages("A", q, 0, 1000, 64 << 20).records) for q in (0, 1))
        assert got == 800
    assert sorted(os.listdir(d / "commitlog")) == names
