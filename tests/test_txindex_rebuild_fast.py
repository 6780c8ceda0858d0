"""rebuild_steps (raw records, merged consume-queue entries, stashed pending transactions) builds
exactly the index the record-by-record algorithm it replaced builds.

The reference below is the old algorithm: every record of the op, discard
and half queues decoded by get_messages, merged in commit-log order with
heapq.merge and applied with TxIndex.apply (the live path's code). Logs are
random sequences of what the broker writes: first halves, check copies,
commit and rollback ops, discards, replayed copies, copies after the
decision, records without a transaction id, odd property values; with
random check progress, segment sizes, read sizes and stash limits.
"""

from __future__ import annotations

import heapq
import itertools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO
from txmq.broker import txindex
from txmq.broker.txindex import TxIndex, rebuild, rebuild_steps
from txmq.constants import (
    DISCARD_TOPIC, HALF_TOPIC, OP_TAG, OP_TOPIC, PROP_CHECK_IMMUNITY, PROP_CHECK_TIMES, PROP_DECIDED_BY, PROP_DISCARD_REASON,
    PROP_HALF_CL_OFFSET, PROP_ORIGIN_CL_OFFSET, PROP_PGROUP, PROP_REAL_QID, PROP_REAL_TOPIC, PROP_REPLAYED, PROP_TAGS,
    PROP_TRAN_MSG, PROP_UNIQ_KEY,
)
from txmq.store import CorruptRecordError, Message, RawCopy, Store, StoreConfig, StoreReader, TxType, bulk, encode_record


# ---- the reference: the algorithm rebuild_steps had before ---------------------------------------
def reference_rebuild(reader, half_progress: int, op_progress: int, batch: int = 7) -> TxIndex:
    idx = TxIndex()
    streams = [
        _queue_records(reader, OP_TOPIC, reader.queue_min_offset(OP_TOPIC, 0), batch),
        _queue_records(reader, DISCARD_TOPIC, reader.queue_min_offset(DISCARD_TOPIC, 0), batch),
        _queue_records(reader, HALF_TOPIC, max(half_progress, reader.queue_min_offset(HALF_TOPIC, 0)), batch),
    ]
    for rec in heapq.merge(*streams, key=lambda r: r.commit_log_offset):
        idx.apply(rec, op_progress)
    return idx


def _queue_records(reader, topic, start, batch):
    off = start
    while True:
        res = reader.get_messages(topic, 0, off, batch, 64 << 20)
        if not res.records:
            if res.status.name == "OFFSET_TOO_SMALL" and res.next_offset > off:
                off = res.next_offset
                continue
            return
        yield from res.records
        off = res.next_offset


def view(idx: TxIndex):
    """Everything in the index, order of pending included (the snapshot keeps it)."""
    return (
        [(tx_id, p.to_row()) for tx_id, p in idx.pending.items()],
        dict(idx.by_half),
        {tx_id: (d.outcome, d.decided_at, d.decided_by, d.half_offset, d.cl_offset, d.group, d.topic, d.checks)
         for tx_id, d in idx.decided.items()},
        list(idx.ops_since_progress),
    )


# ---- writing logs like the broker does ---------------------------------------------------------------
TX = st.sampled_from(["A", "B", "C", ""])  # "": a record without UNIQ_KEY; few ids, so events meet
ODD_INT = st.sampled_from([None, "0", "1", "3", "x", "", " 7", "12"])

EVENTS = st.one_of(
    st.tuples(st.just("half"), TX, st.sampled_from([None, "g", "g2", ""]), st.sampled_from([None, "t", "t2"]), ODD_INT,
              st.sampled_from([None, "", "30", "1.5", "abc"])),
    st.tuples(st.just("copy"), TX, ODD_INT),
    st.tuples(st.just("op"), TX, st.booleans(), st.sampled_from([None, "producer", "check", "operator"]),
              st.sampled_from([None, b"", b"0", b"5", b" 7", b"x1", b"1_0", "\u0661".encode()]), st.booleans(), ODD_INT),
    st.tuples(st.just("discard"), TX, st.sampled_from([None, "max-checks", "retention"]), st.booleans()),
    st.tuples(st.just("replay"), TX),
    st.tuples(st.just("batch")),  # ends the current append batch
)


class Writer:
    """Appends half, op and discard records as the broker builds them (broker/tx.py), in batches."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.latest: dict[str, tuple[int, int, dict]] = {}  # tx -> (cl offset, half queue offset, props) of its latest half
        self.batch: list[tuple[Message, str | None]] = []
        self.halves = self.ops = 0

    def flush(self) -> None:
        if not self.batch:
            return
        results = self.store.append([m for m, _ in self.batch])
        for (m, tx), r in zip(self.batch, results):
            if m.topic == HALF_TOPIC and tx is not None:
                self.latest[tx] = (r.commit_log_offset, r.queue_offset, m.properties)
        self.batch = []

    def _add(self, msg: Message, half_of: str | None = None) -> None:
        self.batch.append((msg, half_of))
        if msg.topic == HALF_TOPIC:
            self.halves += 1
        elif msg.topic == OP_TOPIC:
            self.ops += 1

    def _base(self, tx: str) -> tuple[int, int, dict]:
        if tx not in self.latest:  # no half written yet: as if it were below the log's start
            props = {PROP_TRAN_MSG: "true", PROP_PGROUP: "g", PROP_REAL_TOPIC: "t", PROP_REAL_QID: "1"}
            if tx:
                props[PROP_UNIQ_KEY] = tx
            return 999_999, 99, props
        return self.latest[tx]

    def event(self, ev: tuple) -> None:
        kind = ev[0]
        if kind == "batch":
            self.flush()
        elif kind == "half":
            _, tx, group, topic, qid, imm = ev
            props = {"user": "v", PROP_TRAN_MSG: "true"}
            for k, v in ((PROP_UNIQ_KEY, tx or None), (PROP_PGROUP, group), (PROP_REAL_TOPIC, topic), (PROP_REAL_QID, qid),
                         (PROP_CHECK_IMMUNITY, imm)):
                if v is not None:
                    props[k] = v
            self._add(Message(HALF_TOPIC, 0, TxType.PREPARED, 1000 + len(self.batch), props, b"body"), tx)
        elif kind in ("copy", "replay"):
            tx = ev[1]
            cl, _, props = self._base(tx)
            p = dict(props)  # half_copy()
            p.setdefault(PROP_ORIGIN_CL_OFFSET, str(cl))
            p.pop(PROP_DISCARD_REASON, None)
            p.pop(PROP_REPLAYED, None)
            if kind == "copy":
                if ev[2] is not None:
                    p[PROP_CHECK_TIMES] = ev[2]
            else:
                p.update({PROP_CHECK_TIMES: "0", PROP_REPLAYED: "1"})
            self._add(Message(HALF_TOPIC, 0, TxType.PREPARED, 2000, p, b"body"), tx)
        elif kind == "op":
            _, tx, commit, by, body, bare, checks = ev
            cl, qoff, props = self._base(tx)
            p = {PROP_TAGS: OP_TAG, PROP_HALF_CL_OFFSET: str(cl)}
            if props.get(PROP_UNIQ_KEY):
                p[PROP_UNIQ_KEY] = props[PROP_UNIQ_KEY]
            if not bare:  # else: no group, topic or check count (the pending entry's are used)
                p[PROP_PGROUP] = props.get(PROP_PGROUP, "")
                p[PROP_REAL_TOPIC] = props.get(PROP_REAL_TOPIC, "")
                if checks is not None:
                    p[PROP_CHECK_TIMES] = checks
            if by is not None:
                p[PROP_DECIDED_BY] = by
            body = str(qoff).encode() if body is None else body
            self._add(Message(OP_TOPIC, 0, TxType.COMMIT if commit else TxType.ROLLBACK, 3000, p, body, prepared_offset=cl))
        elif kind == "discard":
            _, tx, reason, bare = ev
            cl, _, props = self._base(tx)
            p = dict(props)  # discard_message()
            p.setdefault(PROP_ORIGIN_CL_OFFSET, str(cl))
            if reason is not None:
                p[PROP_DISCARD_REASON] = reason
            if bare:
                p.pop(PROP_PGROUP, None)
                p.pop(PROP_REAL_TOPIC, None)
            self._add(Message(DISCARD_TOPIC, 0, TxType.PREPARED, 4000, p, b"body"))


def _clock():
    ticks = itertools.count(1_700_000_000_000)
    return lambda: next(ticks) / 1000.0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    events=st.lists(EVENTS, max_size=60),
    half_progress=st.integers(0, 40),
    op_progress=st.integers(0, 40),
    segment_size=st.sampled_from([1 << 30, 2048]),
    entries_per_read=st.sampled_from([4096, 1, 3]),
    span=st.sampled_from([bulk.SPAN, 300]),
    stash_max=st.sampled_from([txindex._STASH_MAX, 1, 2]),
    batch=st.sampled_from([2048, 1, 5]),
)
def test_rebuild_equals_the_record_by_record_reference(events, half_progress, op_progress, segment_size, entries_per_read,
                                                        span, stash_max, batch):
    saved = bulk.ENTRIES_PER_READ, bulk.SPAN, txindex._STASH_MAX
    bulk.ENTRIES_PER_READ, bulk.SPAN, txindex._STASH_MAX = entries_per_read, span, stash_max
    try:
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "data"
            with Store(data, StoreConfig(segment_size=segment_size), clock=_clock()) as store:
                w = Writer(store)
                for ev in events:
                    w.event(ev)
                w.flush()
                want = view(reference_rebuild(store, half_progress, op_progress))
                idx = TxIndex()
                steps = list(rebuild_steps(store, half_progress, op_progress, idx, batch))
                assert view(idx) == want
                assert steps[-1] == sum(1 for _ in _all_records(store, half_progress))
                # the reader sees the tail (no checkpoint since the appends) through its in-memory index
                with StoreReader(data) as reader:
                    assert view(rebuild(reader, half_progress, op_progress)) == want
            with StoreReader(data) as reader:  # after a clean close: from the consume-queue files
                assert view(rebuild(reader, half_progress, op_progress)) == want
    finally:
        bulk.ENTRIES_PER_READ, bulk.SPAN, txindex._STASH_MAX = saved


SCRIPTED = [
    # checks of the latest copy; the decision without group or topic takes the pending entry's
    ("half", "A", "g", "t", "1", None), ("batch",), ("copy", "A", "3"), ("batch",), ("op", "A", True, "check", None, True, None),
    # a stale copy after the decision; a second decision overwrites; a discard after it changes nothing
    ("batch",), ("copy", "A", "4"), ("op", "A", False, "operator", None, False, "9"), ("discard", "A", None, False),
    # discarded, stale copy ignored, replayed (re-opened), checked again, decided
    ("half", "B", "g2", None, "x", "30"), ("batch",), ("copy", "B", "1"), ("discard", "B", "max-checks", True), ("batch",),
    ("copy", "B", "2"), ("replay", "B"), ("batch",), ("copy", "B", "5"), ("batch",), ("op", "B", True, None, b" 7", True, None),
    # pending at the end with several copies; one never decided with odd fields
    ("half", "C", None, "t", "", "abc"), ("batch",), ("copy", "C", "1"), ("batch",), ("copy", "C", "12"),
    ("half", "", "g", "t", "1", None), ("op", "", True, None, b"x1", False, "0"), ("discard", "", None, False),
]


@pytest.mark.parametrize("half_progress", [0, 1, 3])
@pytest.mark.parametrize("stash_max", [txindex._STASH_MAX, 1])
def test_scripted_history(tmp_path, half_progress, stash_max):
    saved = txindex._STASH_MAX
    txindex._STASH_MAX = stash_max
    try:
        with Store(tmp_path / "data", clock=_clock()) as store:
            w = Writer(store)
            for ev in SCRIPTED:
                w.event(ev)
            w.flush()
            want = view(reference_rebuild(store, half_progress, 2))
            assert view(rebuild(store, half_progress, 2)) == want
            if half_progress == 0:
                pending, _, decided, _ = want
                assert [tx for tx, _ in pending] == ["C"]
                assert decided["A"][0] is txindex.Outcome.ROLLED_BACK and decided["B"][0] is txindex.Outcome.COMMITTED
    finally:
        txindex._STASH_MAX = saved


def _all_records(store, half_progress):
    for topic, start in ((OP_TOPIC, 0), (DISCARD_TOPIC, 0), (HALF_TOPIC, half_progress)):
        yield from _queue_records(store, topic, max(start, store.queue_min_offset(topic, 0)), 100)


def test_a_long_history_with_many_pending_moves_the_stash_over_in_order(tmp_path):
    """More pending transactions than the stash holds: the oldest are built early, the order stays the log's."""
    saved = txindex._STASH_MAX
    txindex._STASH_MAX = 16
    try:
        with Store(tmp_path / "data", clock=_clock()) as store:
            w = Writer(store)
            for i in range(300):
                tx = f"T{i}"
                w.event(("half", tx, "g", "t", "1", None))
                if i % 3 == 0:
                    w.event(("batch",))
                    w.event(("op", tx, True, "producer", None, False, "0"))
                if i % 7 == 0 and i > 20:
                    w.event(("batch",))
                    w.event(("copy", f"T{i - 20}", "1"))
            w.flush()
            want = view(reference_rebuild(store, 0, 0))
            assert view(rebuild(store, 0, 0)) == want
            assert len(want[0]) == 200
    finally:
        txindex._STASH_MAX = saved


def test_a_damaged_record_fails_the_rebuild_with_the_same_error(tmp_path):
    data = tmp_path / "data"
    with Store(data, clock=_clock()) as store:
        w = Writer(store)
        for tx in "ABC":
            w.event(("half", tx, "g", "t", "1", None))
        w.flush()
        w.event(("op", "B", True, "producer", None, False, "0"))
        w.flush()
    with StoreReader(data) as reader:
        op = [r for r in reader.scan() if r.topic == OP_TOPIC][0]
        seg_start, path, _ = reader.segments()[-1]
    with open(path, "r+b") as f:  # one flipped bit in the op's body
        pos = op.commit_log_offset - seg_start + op.size - 1
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 1]))
    with StoreReader(data) as reader:
        with pytest.raises(CorruptRecordError) as want:
            reference_rebuild(reader, 0, 0)
        with pytest.raises(CorruptRecordError) as got:
            rebuild(reader, 0, 0)
    assert str(got.value) == str(want.value) == f"crc mismatch at {op.commit_log_offset}"


def test_properties_that_are_not_msgpack_fail_the_rebuild_as_decoding_did(tmp_path):
    """A record whose CRC is right but whose properties do not decode (only a RawCopy can write one)."""
    with Store(tmp_path / "data", clock=_clock()) as store:
        Writer(store).event(("half", "A", "g", "t", "1", None))
        src = encode_record(Message(HALF_TOPIC, 0, TxType.PREPARED, 1, {PROP_UNIQ_KEY: "B"}, b"x"), 0, 0, 0)
        store.append([Message(HALF_TOPIC, 0, TxType.PREPARED, 1, {PROP_UNIQ_KEY: "A"}, b"x"),
                      RawCopy(source=memoryview(src), props=b"\xc1")])
        with pytest.raises(CorruptRecordError) as want:
            reference_rebuild(store, 0, 0)
        with pytest.raises(CorruptRecordError) as got:
            rebuild(store, 0, 0)
        assert str(got.value) == str(want.value)
        assert "bad properties" in str(got.value)


def test_rebuild_micro_benchmark_runs():
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "rebuild_micro.py"), "--transactions", "300", "--runs", "2"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr
    assert "thread CPU per record: min" in p.stdout and "3 pending, 297 decided" in p.stdout
