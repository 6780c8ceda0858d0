"""A raw pull's read (Store.read_queue_raw): a queue's records as stored, each checked, or None for the usual read."""

from __future__ import annotations

import os

import pytest

from txmq.store import Message, Store, TxType, codec
from txmq.store.consumequeue import ENTRY


@pytest.fixture(params=["compiled", "python"])
def impl(request, monkeypatch):
    if request.param == "compiled":
        if getattr(codec.speedups, "read_queue_raw", None) is None:
            pytest.skip("txmq.store._speedups not built on this machine")
    else:
        monkeypatch.setattr(codec, "speedups", None)
    return request.param


def _fill(store: Store, n: int = 300) -> list:
    """Records of three queues interleaved, bodies of 0 to ~3 KB."""
    return store.append([Message("t", i % 3, TxType.NORMAL, i, {"KEYS": str(i)}, os.urandom((i * 331) % 3000))
                         for i in range(n)])


def _stored(store: Store, r) -> bytes:
    seg = store._log._seg_at(r.commit_log_offset)
    return os.pread(seg.fd, r.size, r.commit_log_offset - seg.start)


def test_raw_read_gives_the_queues_records_as_stored_up_to_max_count_and_max_bytes(tmp_path, impl):
    with Store(tmp_path / "d") as s:
        res = _fill(s)
        mine = [r for i, r in enumerate(res) if i % 3 == 1]
        data, count = s.read_queue_raw("t", 1, 5, 10, 1 << 20)
        assert count == 10 and data == b"".join(_stored(s, r) for r in mine[5:15])
        data, count = s.read_queue_raw("t", 1, 0, 1000, 20_000)
        assert 1 < count < len(mine) and len(data) <= 20_000
        assert data == b"".join(_stored(s, r) for r in mine[:count])
        assert len(data) + mine[count].size > 20_000  # as many as fit
        big = max(range(len(mine)), key=lambda q: mine[q].size)
        data, count = s.read_queue_raw("t", 1, big, 10, 100)  # one record larger than max_bytes: that one alone
        assert count == 1 and data == _stored(s, mine[big])
        assert s.read_queue_raw("t", 1, len(mine), 10, 1 << 20) is None  # past the end: the usual reply says so
        assert s.read_queue_raw("t", 7, 0, 10, 1 << 20) is None
        assert s.read_queue_raw("nope", 0, 0, 10, 1 << 20) is None


def test_raw_read_declines_a_damaged_record_which_the_usual_read_skips_and_reports(tmp_path, impl):
    with Store(tmp_path / "d") as s:
        res = _fill(s)
        mine = [r for i, r in enumerate(res) if i % 3 == 0]
        victim = mine[40]
        seg = s._log._seg_at(victim.commit_log_offset)
        os.pwrite(seg.fd, b"\xff", victim.commit_log_offset + victim.size - 1 - seg.start)
        assert s.read_queue_raw("t", 0, 30, 20, 1 << 20) is None
        assert s.read_queue_raw("t", 0, 30, 10, 1 << 20)[1] == 10  # the records before it read as ever
        assert s.read_queue_raw("t", 0, 41, 10, 1 << 20)[1] == 10  # and those after it
        got = s.get_messages("t", 0, 30, 20)
        assert [r.queue_offset for r in got.records] == [q for q in range(30, 50) if q != 40]
        assert [b[0] for b in got.skipped] == [40]


@pytest.mark.parametrize("edit", ["another queue's record", "wrong size", "outside the log", "inside a record", "huge size"])
def test_raw_read_declines_an_entry_that_does_not_lead_to_its_record(tmp_path, impl, edit):
    with Store(tmp_path / "d") as s:
        res = _fill(s)
        log = s._log
        cq = s._queues[("t", 0)]
        entries = bytearray(cq.read_raw(0, 20))
        off, size, tags = ENTRY.unpack_from(entries, 20 * 5)
        other = res[5 * 3 + 1]  # queue 1's record next to it
        new = {"another queue's record": (other.commit_log_offset, other.size), "wrong size": (off, size + 1),
               "outside the log": (log.end + 100, size), "inside a record": (off + 8, size - 8),
               "huge size": (off, (1 << 31) - 1)}[edit]
        ENTRY.pack_into(entries, 20 * 5, *new, tags)
        assert log.read_queue_raw(bytes(entries[:100]), 1 << 20, 1 << 20, b"t", 0, 0)[1] == 5  # the entries before it: fine
        if edit == "huge size":  # more than any record may be: never allocated for, the read stops before it
            assert log.read_queue_raw(bytes(entries), 1 << 20, 1 << 20, b"t", 0, 0)[1] == 5
            assert log.read_queue_raw(bytes(entries[100:]), 1 << 20, 1 << 20, b"t", 0, 5) is None
            return
        assert log.read_queue_raw(bytes(entries), 1 << 20, 1 << 20, b"t", 0, 0) is None
        assert log.read_queue_raw(bytes(entries), 1 << 20, 1 << 20, b"t", 0, 1) is None  # queue offsets must match too
