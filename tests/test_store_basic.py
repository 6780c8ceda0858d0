"""Store tests on temp dirs: appending, reading, queues, reopening, locking."""

from __future__ import annotations

import os

import pytest

from txmq.store import (
    CorruptRecordError,
    GetStatus,
    Message,
    RecordTooLargeError,
    Store,
    StoreConfig,
    StoreError,
    StoreLockedError,
    TxType,
    tag_hash,
)

SMALL = StoreConfig(segment_size=4096, cq_entries_per_file=7)


def msg(topic="T", qid=0, body=b"x" * 50, tags=None, tx=TxType.NORMAL, prepared=-1):
    return Message(topic, qid, tx, 1000, {"TAGS": tags} if tags else {}, body, prepared)


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "data", SMALL, clock=lambda: 1_700_000_000.0)
    s.open()
    yield s
    s.close()


def fill(store, n=300, queues=3, batch=10):
    """n messages round-robin over queues of topics A and B; returns the AppendResults in order."""
    out = []
    msgs = [msg(topic="AB"[i % 2], qid=i % queues, body=bytes([i % 256]) * (20 + i % 90), tags=f"t{i % 4}") for i in range(n)]
    for i in range(0, n, batch):
        out += store.append(msgs[i : i + batch])
    return msgs, out


def test_append_assigns_offsets_and_reads_back_across_segments(store):
    msgs, results = fill(store)
    assert len(store._log.segments) > 5
    assert results[0].commit_log_offset == 0
    for a, b in zip(results, results[1:]):
        assert b.commit_log_offset == a.end_offset  # contiguous: no padding between segments
    assert store.max_offset == results[-1].end_offset
    for m, r in zip(msgs, results):
        rec = store.read(r.commit_log_offset)
        assert (rec.topic, rec.queue_id, rec.body, rec.queue_offset) == (m.topic, m.queue_id, m.body, r.queue_offset)
        assert rec.store_ts == 1_700_000_000_000 == r.store_ts
        assert rec.tags == m.properties["TAGS"]


def test_segments_are_contiguous_and_never_exceed_segment_size(store):
    fill(store)
    segs = store._log.segments
    for a, b in zip(segs, segs[1:]):
        assert a.end == b.start
        assert a.length <= SMALL.segment_size
        assert os.path.basename(b.path) == f"{b.start:020d}"


def test_per_queue_order_and_offsets(store):
    msgs, results = fill(store)
    for topic in "AB":
        for qid in range(3):
            expected = [(m.body, r.commit_log_offset) for m, r in zip(msgs, results) if (m.topic, m.queue_id) == (topic, qid)]
            got = []
            off = 0
            while True:
                res = store.get_messages(topic, qid, off, max_count=4)
                if res.status is not GetStatus.FOUND:
                    assert res.status is GetStatus.NO_MESSAGE
                    break
                assert [r.queue_offset for r in res.records] == list(range(off, res.next_offset))
                got += [(r.body, r.commit_log_offset) for r in res.records]
                off = res.next_offset
            assert got == expected
            assert store.queue_max_offset(topic, qid) == len(expected)
            assert store.queue_min_offset(topic, qid) == 0


def test_get_messages_statuses(store):
    store.append([msg(), msg(), msg()])
    assert store.get_messages("T", 0, 3).status is GetStatus.NO_MESSAGE
    over = store.get_messages("T", 0, 9)
    assert (over.status, over.next_offset, over.max_offset) == (GetStatus.OFFSET_OVERFLOW, 3, 3)
    assert store.get_messages("T", 1, 0).status is GetStatus.NO_QUEUE
    assert store.get_messages("nope", 0, 0).status is GetStatus.NO_QUEUE
    res = store.get_messages("T", 0, 1, max_count=10)
    assert (res.status, len(res.records), res.next_offset) == (GetStatus.FOUND, 2, 3)


def test_get_messages_respects_max_bytes_but_returns_at_least_one(store):
    store.append([msg(body=b"y" * 500) for _ in range(5)])
    res = store.get_messages("T", 0, 0, max_count=10, max_bytes=1200)
    assert len(res.records) == 2
    res = store.get_messages("T", 0, 0, max_count=10, max_bytes=10)
    assert len(res.records) == 1


def test_cq_entries_without_reading_the_log(store):
    results = store.append([msg(tags="a"), msg(), msg(tags="b")])
    entries = store.cq_entries("T", 0, 0, 10)
    assert entries == [(r.commit_log_offset, r.size, h) for r, h in zip(results, [tag_hash("a"), 0, tag_hash("b")])]
    assert store.cq_entries("T", 0, 2, 10) == entries[2:]
    assert store.cq_entries("T", 0, 5, 10) == []


def test_read_many_returns_in_the_order_asked(store):
    _, results = fill(store, n=120)
    offsets = [r.commit_log_offset for r in results][::-3]
    recs = store.read_many(offsets)
    assert [r.commit_log_offset for r in recs] == offsets


def test_read_at_a_non_boundary_raises(store):
    results = store.append([msg(), msg()])
    with pytest.raises(CorruptRecordError):
        store.read(results[0].commit_log_offset + 1)
    with pytest.raises(CorruptRecordError):
        store.read(store.max_offset)


def test_scan_yields_everything_in_order(store):
    _, results = fill(store)
    assert [r.commit_log_offset for r in store.scan()] == [r.commit_log_offset for r in results]
    mid = results[100].commit_log_offset
    end = results[200].commit_log_offset
    assert [r.commit_log_offset for r in store.scan(mid, end)] == [r.commit_log_offset for r in results[100:200]]


def test_transaction_fields_round_trip(store):
    half = store.append([msg(topic="RMQ_SYS_TRANS_HALF_TOPIC", tx=TxType.PREPARED)])[0]
    commit = store.append([msg(tx=TxType.COMMIT, prepared=half.commit_log_offset)])[0]
    rec = store.read(commit.commit_log_offset)
    assert (rec.tx_type, rec.prepared_offset) == (TxType.COMMIT, half.commit_log_offset)
    assert store.read(half.commit_log_offset).prepared_offset == -1


def test_record_too_large_writes_nothing(store):
    store.append([msg()])
    end = store.max_offset
    with pytest.raises(RecordTooLargeError):
        store.append([msg(), msg(body=b"z" * 5000)])
    assert store.max_offset == end
    assert store.queue_max_offset("T", 0) == 1
    assert store.append([msg()])[0].queue_offset == 1


def test_reopen_keeps_everything(tmp_path):
    d = tmp_path / "data"
    with Store(d, SMALL) as s:
        msgs, results = fill(s)
        queues = s.queues()
        maxes = {(t, q): s.queue_max_offset(t, q) for t in queues for q in queues[t]}
    s = Store(d, SMALL)
    report = s.open()
    try:
        assert (report.dropped_bytes, report.reason, report.redispatched) == (0, None, 0)
        assert report.max_offset == results[-1].end_offset
        assert s.queues() == queues == {"A": [0, 1, 2], "B": [0, 1, 2]}
        assert {(t, q): s.queue_max_offset(t, q) for t in queues for q in queues[t]} == maxes
        assert [r.body for r in s.scan()] == [m.body for m in msgs]
        assert s.durable_offset == s.max_offset
        nxt = s.append([msg(topic="A", qid=0)])[0]
        assert nxt.queue_offset == maxes[("A", 0)]
        assert nxt.commit_log_offset == results[-1].end_offset
    finally:
        s.close()


def test_consume_queue_files_are_named_and_sized_per_the_format(tmp_path):
    d = tmp_path / "data"
    with Store(d, SMALL) as s:
        s.append([msg() for _ in range(17)])
    qdir = d / "consumequeue" / "T" / "0"
    assert sorted(os.listdir(qdir)) == [f"{i:020d}" for i in (0, 7, 14)]
    assert [os.path.getsize(qdir / f"{i:020d}") for i in (0, 7, 14)] == [140, 140, 60]
    assert (d / "checkpoint").stat().st_size == 20


def test_second_open_is_locked_out(tmp_path, store):
    other = Store(tmp_path / "data", SMALL)
    with pytest.raises(StoreLockedError):
        other.open()
    store.close()
    other.open()  # the lock went with close()
    other.close()


def test_close_is_idempotent_and_closed_store_refuses_work(tmp_path):
    s = Store(tmp_path / "d", SMALL)
    s.open()
    s.close()
    s.close()
    with pytest.raises(StoreError):
        s.append([msg()])


def test_invalid_topic_or_queue_is_rejected_before_writing(store):
    for bad in (msg(topic="../x"), msg(topic=""), msg(qid=-1)):
        with pytest.raises(ValueError):
            store.append([msg(), bad])
    assert store.max_offset == 0


def test_empty_append_is_a_no_op(store):
    assert store.append([]) == []
    assert store.max_offset == 0
