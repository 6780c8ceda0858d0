"""A damaged entry in the middle of a consume queue is rebuilt from the commit log by the read that meets it.

A start checks only each queue's last entry (its cost must not grow with
the history), so an entry in the middle that bit rot or a careless hand
changed is found by a read: the records of the damaged stretch are looked
for in the log between the records of the good entries around it, written
back in place, and served, exactly once, to every reader (the store's
``get_messages``, the broker's pull and RocketMQ POP).
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest

from conftest import arun
from txmq.broker.testing import running_broker
from txmq.client import Client, Consumer, LocalTransactionState, Message as ClientMessage, TransactionListener, TransactionProducer
from txmq.store import Message, Store, StoreConfig, TxType, tag_hash
from txmq.store import queuerepair
from txmq.store.consumequeue import ENTRY

DEFAULT_STEP = queuerepair.STEP_RECORDS
PER_FILE = 150  # entries per consume-queue file: damage near a file boundary crosses it
CONFIG = StoreConfig(segment_size=32 << 10, cq_entries_per_file=PER_FILE)


def msg(i: int, topic: str = "T") -> Message:
    return Message(topic, 0, TxType.NORMAL, 1000, {"TAGS": f"t{i % 3}"}, b"m%04d" % i + b"." * 40)


def entry_file(d, index: int, topic: str = "T") -> tuple[str, int]:
    """The queue file holding entry index, and the entry's byte position in it."""
    qdir = d / "consumequeue" / topic / "0"
    start = max(int(n) for n in os.listdir(qdir) if int(n) <= index)
    return str(qdir / f"{start:020d}"), (index - start) * ENTRY.size


def flip_entry_byte(d, index: int, byte: int, topic: str = "T") -> None:
    path, pos = entry_file(d, index, topic)
    with open(path, "r+b") as f:
        f.seek(pos + byte)
        b = f.read(1)
        f.seek(pos + byte)
        f.write(bytes([b[0] ^ 0x5A]))


def three_flipped_bytes(d, first: int, topic: str = "T") -> None:
    """Three bytes flipped: in the offset and the size of one entry and in the offset of the next."""
    flip_entry_byte(d, first, 2, topic)
    flip_entry_byte(d, first, 9, topic)
    flip_entry_byte(d, first + 1, 3, topic)


def zero_entries(d, first: int, last: int) -> None:
    for i in range(first, last + 1):
        path, pos = entry_file(d, i)
        with open(path, "r+b") as f:
            f.seek(pos)
            f.write(bytes(ENTRY.size))


def read_queue(s: Store, start: int = 0, batch: int = 32, topic: str = "T") -> tuple[list, list]:
    """Every record from start, as a consumer reads them; and the results."""
    got, results = [], []
    q = start
    for _ in range(10_000):
        r = s.get_messages(topic, 0, q, batch)
        results.append(r)
        if r.status.name != "FOUND":
            return got, results
        got += r.records
        q = r.next_offset
    raise AssertionError("the reads never reached the end of the queue")


def entries_on_disk(d, topic: str = "T") -> bytes:
    qdir = d / "consumequeue" / topic / "0"
    return b"".join((qdir / n).read_bytes() for n in sorted(os.listdir(qdir)))


def expected_entries(results, tags) -> bytes:
    return b"".join(ENTRY.pack(r.commit_log_offset, r.size, tag_hash(t)) for r, t in zip(results, tags))


def rebuilt_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "event=consume_queue_entries_rebuilt" in r.getMessage()]


def test_damaged_queue_entry_is_read_around_from_the_commit_log(tmp_path, caplog):
    d = tmp_path / "d"
    with Store(d, CONFIG) as s:
        stored = s.append([msg(i) for i in range(400)])
    three_flipped_bytes(d, 200)
    caplog.set_level(logging.INFO, logger="txmq.store")
    with Store(d, CONFIG) as s:
        got, results = read_queue(s)
        assert [r.body[:5] for r in got] == [b"m%04d" % i for i in range(400)]  # all of them, once, in order
        assert not any(r.skipped for r in results) and s.damage.count == 0
    (line,) = rebuilt_lines(caplog)
    assert "topic=T queue_id=0 first=200 last=201 rewritten=2 lost=0" in line
    # written back (and fsynced by the checkpoint at close): the entries are what the log says
    assert entries_on_disk(d) == expected_entries(stored, [f"t{i % 3}" for i in range(400)])
    caplog.clear()
    with Store(d, CONFIG) as s:
        got, _ = read_queue(s)
        assert len(got) == 400
    assert rebuilt_lines(caplog) == []


def test_a_read_starting_inside_a_zeroed_stretch_of_entries_gets_every_record(tmp_path, caplog):
    d = tmp_path / "d"
    with Store(d, CONFIG) as s:
        stored = s.append([msg(i) for i in range(400)])
    zero_entries(d, 120, 259)  # a zeroed page, across a file boundary
    caplog.set_level(logging.INFO, logger="txmq.store")
    with Store(d, CONFIG) as s:
        got, _ = read_queue(s, start=170)  # a group whose committed offset is inside the stretch
        assert [r.queue_offset for r in got] == list(range(170, 400))
        got, results = read_queue(s, start=0)
        assert [r.queue_offset for r in got] == list(range(400))
        assert not any(r.skipped for r in results) and s.damage.count == 0
    (line,) = rebuilt_lines(caplog)  # out to good entries found 1, 2, 4, ... entries away
    first, last = (int(line.split(f"{k}=")[1].split()[0]) for k in ("first", "last"))
    assert first <= 120 and last >= 259 and "rewritten=140 lost=0" in line
    assert entries_on_disk(d) == expected_entries(stored, [f"t{i % 3}" for i in range(400)])


def test_an_entry_with_a_wrong_size_is_rewritten_from_the_record_it_points_at(tmp_path, caplog):
    d = tmp_path / "d"
    with Store(d, CONFIG) as s:
        stored = s.append([msg(i) for i in range(40)])
    flip_entry_byte(d, 7, 9)  # the size alone: the offset still leads to the record
    caplog.set_level(logging.INFO, logger="txmq.store")
    with Store(d, CONFIG) as s:
        got, _ = read_queue(s)
        assert [r.queue_offset for r in got] == list(range(40))
    (line,) = rebuilt_lines(caplog)
    assert "first=7 last=7 rewritten=1 lost=0" in line and "steps=0" in line  # no walk of the log
    assert entries_on_disk(d) == expected_entries(stored, [f"t{i % 3}" for i in range(40)])


def test_an_entry_whose_record_is_damaged_is_looked_for_once_then_skipped(tmp_path, caplog):
    d = tmp_path / "d"
    with Store(d, CONFIG) as s:
        stored = s.append([msg(i) for i in range(60)])
    victim = stored[30]
    seg = max(int(n) for n in os.listdir(d / "commitlog") if int(n) <= victim.commit_log_offset)
    with open(d / "commitlog" / f"{seg:020d}", "r+b") as f:  # the record's body rots; its entry is right
        f.seek(victim.commit_log_offset - seg + victim.size - 10)
        f.write(b"\xff")
    caplog.set_level(logging.INFO, logger="txmq.store")
    with Store(d, CONFIG) as s:
        for _ in range(3):
            got, results = read_queue(s)
            assert [r.queue_offset for r in got] == [q for q in range(60) if q != 30]
            assert [sk[0] for r in results for sk in r.skipped] == [30]
        assert s.damage.count == 1
    (line,) = rebuilt_lines(caplog)  # one walk, not one per read
    assert "first=30 last=30 rewritten=0 lost=1" in line


def test_a_sparse_queue_is_rebuilt_a_bounded_step_per_read(tmp_path, caplog, monkeypatch):
    d = tmp_path / "d"
    with Store(d, CONFIG) as s:
        for i in range(20):  # each of T's records 300 records of another topic away from the next
            s.append([msg(i)] + [msg(j, topic="noise") for j in range(300)])
    flip_entry_byte(d, 10, 3)
    monkeypatch.setattr(queuerepair, "STEP_RECORDS", 64)
    caplog.set_level(logging.INFO, logger="txmq.store")
    with Store(d, CONFIG) as s:
        first = s.get_messages("T", 0, 0, 32)
        assert [r.queue_offset for r in first.records] == list(range(10))  # up to the stretch being rebuilt
        assert first.repairing and first.next_offset == 10 and not first.skipped
        steps = 1
        while True:
            r = s.get_messages("T", 0, 10, 32)
            steps += 1
            if not r.repairing:
                break
            assert r.records == [] and r.next_offset == 10
        assert [x.queue_offset for x in r.records] == list(range(10, 20)) and not r.skipped
    (line,) = rebuilt_lines(caplog)
    assert "first=10 last=10 rewritten=1 lost=0" in line and f"steps={steps}" in line
    assert steps > 300 // 64  # the 300 records between T's 9th and 10th, 64 headers a read


def test_a_queue_left_half_repaired_by_a_crash_is_repaired_by_the_next_read(tmp_path, caplog):
    d = tmp_path / "d"
    with Store(d, CONFIG) as s:
        stored = s.append([msg(i) for i in range(400)])
    three_flipped_bytes(d, 50)
    three_flipped_bytes(d, 300)
    caplog.set_level(logging.INFO, logger="txmq.store")
    s = Store(d, CONFIG)
    s.open()
    first = s.get_messages("T", 0, 0, 100, 1 << 20)
    assert [r.queue_offset for r in first.records] == list(range(100))  # the first stretch rewritten, the second not met
    s._release()  # killed before a checkpoint fsynced the rewritten entries
    three_flipped_bytes(d, 50)  # and the rewrite never reached the disk
    with Store(d, CONFIG) as s:
        got, results = read_queue(s)
        assert [r.queue_offset for r in got] == list(range(400))
        assert not any(r.skipped for r in results)
    assert [line.split(" rewritten")[0].split("first=")[1] for line in rebuilt_lines(caplog)] == [
        "50 last=51", "50 last=51", "300 last=301"]
    assert entries_on_disk(d) == expected_entries(stored, [f"t{i % 3}" for i in range(400)])


def test_the_checkpoint_fsyncs_the_queue_files_a_read_rewrote(tmp_path, monkeypatch):
    from txmq.store import store as store_module

    d = tmp_path / "d"
    with Store(d, CONFIG) as s:
        s.append([msg(i) for i in range(400)])
    three_flipped_bytes(d, 200)
    synced: list[str] = []
    real = store_module.fsync_path
    monkeypatch.setattr(store_module, "fsync_path", lambda p: (synced.append(str(p)), real(p))[1])
    with Store(d, CONFIG) as s:
        read_queue(s)
        assert synced == []  # a read does not wait for a disk
        s.checkpoint()
        assert synced == [entry_file(d, 200)[0]]
        s.checkpoint()
        assert len(synced) == 1


# ---- the broker ----------------------------------------------------------------------------------


class Commit(TransactionListener):
    def execute_local_transaction(self, message, arg):
        return LocalTransactionState.COMMIT_MESSAGE

    def check_local_transaction(self, message):
        return LocalTransactionState.COMMIT_MESSAGE


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    """A data directory holding 400 committed transactional messages in topic pays, queue 0."""
    data = tmp_path_factory.mktemp("committed") / "data"

    async def main():
        async with running_broker(data) as b:
            async with Client(b.address) as admin:
                await admin.request("create_topic", {"topic": "pays", "queues": 1})
            async with TransactionProducer("pay", Commit(), b.address) as tp:
                for i in range(400):
                    await tp.send_in_transaction(ClientMessage("pays", b"p%03d" % i))
                assert await tp.flush() == 0

    arun(main())
    return data


@pytest.mark.parametrize("step_records", [DEFAULT_STEP, 2])
def test_committed_messages_behind_a_damaged_queue_entry_reach_a_native_consumer_exactly_once(
        committed, tmp_path, monkeypatch, caplog, step_records):
    data = tmp_path / "data"
    shutil.copytree(committed, data)
    three_flipped_bytes(data, 200, topic="pays")
    monkeypatch.setattr(queuerepair, "STEP_RECORDS", step_records)  # 2: a rebuild of several steps, pulls meeting it
    caplog.set_level(logging.INFO, logger="txmq.store")

    async def main():
        async with running_broker(data) as b:
            async with Consumer("readers", "pays", b.address, stop_when_caught_up=True, batch_size=32) as c:
                return [m.body async for m in c]

    bodies = arun(main())
    assert sorted(bodies) == [b"p%03d" % i for i in range(400)] and len(bodies) == 400
    (line,) = rebuilt_lines(caplog)
    assert "topic=pays queue_id=0 first=200 last=201 rewritten=2 lost=0" in line
    assert ("steps=1 " in line) == (step_records == DEFAULT_STEP)


def test_committed_messages_behind_a_damaged_queue_entry_reach_a_pop_consumer_exactly_once(committed, tmp_path, monkeypatch):
    data = tmp_path / "data"
    shutil.copytree(committed, data)
    three_flipped_bytes(data, 200, topic="pays")
    monkeypatch.setattr(queuerepair, "STEP_RECORDS", 2)

    async def main():
        async with running_broker(data) as b:
            pop = b.core.consumption_service()
            bodies = []
            while got := await pop.receive("sdk", "pays", -1, None, 32, 30, 0):
                bodies += [x.record.body for x in got]
                for x in got:
                    pop.ack("sdk", "pays", x.receipt_handle)
            await pop.close()
            return bodies

    bodies = arun(main())
    assert sorted(bodies) == [b"p%03d" % i for i in range(400)] and len(bodies) == 400
