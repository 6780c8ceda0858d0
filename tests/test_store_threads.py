"""sync()/checkpoint() in a worker thread while the owner thread appends and reads."""

from __future__ import annotations

import random
import threading

from txmq.store import Message, Store, StoreConfig, TxType

CFG = StoreConfig(segment_size=256 << 10, cq_entries_per_file=1000)


def test_sync_from_a_thread_while_appending(tmp_path):
    d = tmp_path / "d"
    s = Store(d, CFG)
    s.open()
    stop = threading.Event()
    errors: list[BaseException] = []
    durables: list[int] = []

    def flusher():
        try:
            n = 0
            while not stop.is_set():
                if n % 10 == 9:
                    s.checkpoint()
                else:
                    durables.append(s.sync())
                n += 1
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    t = threading.Thread(target=flusher)
    t.start()
    rnd = random.Random(5)
    total = 0
    last = None
    try:
        while total < 20_000:
            n = min(rnd.choice((1, 7, 64)), 20_000 - total)
            res = s.append([Message("T", i % 4, TxType.NORMAL, 1, {}, b"s" * 100) for i in range(n)])
            total += n
            last = res[-1]
            if total % 50 < n:  # read while the thread flushes
                g = s.get_messages("T", 0, max(0, s.queue_max_offset("T", 0) - 3))
                assert g.records
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    assert durables == sorted(durables)
    assert s.sync() == s.max_offset == last.end_offset
    expected = [s.queue_max_offset("T", q) for q in range(4)]
    assert sum(expected) == 20_000
    s.close()
    s = Store(d, CFG)
    report = s.open()
    try:
        assert (report.dropped_bytes, report.redispatched) == (0, 0)
        assert [s.queue_max_offset("T", q) for q in range(4)] == expected
        assert sum(1 for _ in s.scan()) == 20_000
        for q in range(4):
            g = s.get_messages("T", q, expected[q] - 1)
            assert g.records[0].queue_offset == expected[q] - 1
    finally:
        s.close()
