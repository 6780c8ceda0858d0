"""The transaction index: pending half messages and decided outcomes.

Rebuilt from the log at start (see :func:`rebuild`) and kept in step with
every append the transaction service makes. It is what gives txmq "one
outcome per transaction": a decided transaction id answers every later end
transaction with its first outcome.

This module is synchronous and reads the store only through its read API,
so the CLI uses it on a data directory offline (``txmq inspect --data-dir``).

Events, in commit-log order, and their effect:

- half record (a first copy, a check copy, or a replayed copy): if the
  transaction is decided, ignore it (a stale copy), except that a copy whose
  ``TXMQ_REPLAYED`` names the transaction's discard record re-opens it
  (``reopens``); otherwise it becomes the transaction's latest copy.
- op record (tag ``d``; tx_type commit or rollback): the outcome.
- discard record: outcome ``discarded``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
import os
from itertools import islice
from sys import intern
from typing import Iterator

from txmq.constants import (
    DISCARD_TOPIC,
    HALF_TOPIC,
    OP_TOPIC,
    PROP_CHECK_IMMUNITY,
    PROP_CHECK_TIMES,
    PROP_DECIDED_BY,
    PROP_DISCARD_REASON,
    PROP_ORIGIN_CL_OFFSET,
    PROP_PGROUP,
    PROP_REAL_QID,
    PROP_REAL_TOPIC,
    PROP_REPLAYED,
    PROP_UNIQ_KEY,
)
import msgpack

from txmq.store import HEADER_SIZE, CorruptRecordError, Record, TxType, decode_record, record_problem
from txmq.store.bulk import raw_queue_runs


class Outcome(IntEnum):
    PENDING = 0
    COMMITTED = 1
    ROLLED_BACK = 2
    DISCARDED = 3

    @property
    def label(self) -> str:
        return {0: "pending", 1: "committed", 2: "rolled_back", 3: "discarded"}[int(self)]


class PendingTx:
    """A transaction waiting for its outcome; fields of its latest half copy."""

    __slots__ = (
        "tx_id", "group", "topic", "queue_id", "half_offset", "cl_offset", "origin_cl_offset",
        "born_ts", "stored_ts", "first_stored_ts", "checks", "immunity_s",
        "last_check_at", "last_check_result",
    )

    def __init__(self, rec: Record) -> None:
        p = rec.properties
        self.tx_id: str = p.get(PROP_UNIQ_KEY, "")
        # Interned: millions of entries share a handful of group and topic names.
        self.group: str = intern(p.get(PROP_PGROUP, ""))
        self.topic: str = intern(p.get(PROP_REAL_TOPIC, ""))
        self.queue_id: int = _int(p.get(PROP_REAL_QID), 0)
        self.born_ts: int = rec.born_ts
        self.first_stored_ts: int = rec.store_ts
        self.origin_cl_offset: int = _int(p.get(PROP_ORIGIN_CL_OFFSET), rec.commit_log_offset)
        self.last_check_at: int | None = None
        self.last_check_result: str | None = None
        self.update(rec)

    def update(self, rec: Record) -> None:
        p = rec.properties
        self.half_offset = rec.queue_offset
        self.cl_offset = rec.commit_log_offset
        self.stored_ts = rec.store_ts
        self.checks = _int(p.get(PROP_CHECK_TIMES), 0)
        imm = p.get(PROP_CHECK_IMMUNITY)
        self.immunity_s = _float(imm) if imm else None

    def to_row(self) -> list:
        return [getattr(self, k) for k in self.__slots__]

    @classmethod
    def from_row(cls, row: list) -> "PendingTx":
        p = cls.__new__(cls)
        for k, v in zip(cls.__slots__, row):
            setattr(p, k, v)
        p.group, p.topic = intern(p.group), intern(p.topic)
        return p

    def as_dict(self, now_ms: int, next_check_at: int | None = None) -> dict:
        return {
            "tx_id": self.tx_id,
            "half_offset": self.half_offset,
            "commit_log_offset": self.cl_offset,
            "topic": self.topic,
            "queue_id": self.queue_id,
            "group": self.group,
            "born_at": self.born_ts,
            "stored_at": self.first_stored_ts,
            "age_s": round(max(0, now_ms - self.born_ts) / 1000.0, 3),
            "checks": self.checks,
            "last_check_at": self.last_check_at,
            "last_check_result": self.last_check_result,
            "next_check_at": next_check_at,
        }


@dataclass(slots=True)
class Decided:
    outcome: Outcome
    decided_at: int  # ms
    decided_by: str  # producer | check | operator | max-checks | retention
    half_offset: int
    cl_offset: int  # of the op / discard record
    group: str
    topic: str
    checks: int = 0


def reopens(d: Decided, mark: str | None) -> bool:
    """Does a half copy carrying this replay mark re-open the transaction decided as d?

    Only a discard, and only the one the replay undid: the mark is that
    discard record's offset (copies inherit it; see ``tx.copy_properties``).
    "1" is the mark logs written before session 3 put on a replay's own copy.
    """
    return d.outcome is Outcome.DISCARDED and mark is not None and (mark == str(d.cl_offset) or mark == "1")


_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


def _int(v: str | None, default: int) -> int:
    """A producer-set numeric property, or default when absent, not a number, or outside int64.

    Offsets and counts are int64 everywhere else (the record header, the
    snapshot, the compiled check path): a value a client wrote that cannot
    be one is treated as absent, never carried into them.
    """
    try:
        n = int(v) if v is not None else default
    except ValueError:
        return default
    return n if _I64_MIN <= n <= _I64_MAX else default


def _float(v: str) -> float | None:
    try:
        return float(v)
    except ValueError:
        return None


class TxIndex:
    def __init__(self) -> None:
        self.pending: dict[str, PendingTx] = {}
        # half-queue offset of each pending transaction's latest copy -> tx id
        self.by_half: dict[int, str] = {}
        self.decided: dict[str, Decided] = {}
        # op records not yet passed by the op progress: (op queue offset, half offset)
        self.ops_since_progress: list[tuple[int, int]] = []

    # ---- applying records ------------------------------------------------
    def apply_half(self, rec: Record) -> PendingTx | None:
        tx_id = rec.properties.get(PROP_UNIQ_KEY)
        if not tx_id:
            return None
        d = self.decided.get(tx_id)
        if d is not None:
            if reopens(d, rec.properties.get(PROP_REPLAYED)):
                del self.decided[tx_id]
            else:
                return None
        p = self.pending.get(tx_id)
        if p is None:
            p = self.pending[tx_id] = PendingTx(rec)
        else:
            self.by_half.pop(p.half_offset, None)
            p.update(rec)
        self.by_half[p.half_offset] = tx_id
        return p

    def move_to_copy(self, p: PendingTx, half_offset: int, cl_offset: int, stored_ts: int, checks: int) -> bool:
        """A check copy of p was written: p's latest copy is now that one.

        What ``apply_half`` does for a copy whose only new property is the
        check count, without decoding its properties again. False (and no
        change) when p is no longer pending: the copy is stale.
        """
        if self.pending.get(p.tx_id) is not p:
            return False
        by_half = self.by_half
        by_half.pop(p.half_offset, None)
        p.half_offset, p.cl_offset, p.stored_ts, p.checks = half_offset, cl_offset, stored_ts, checks
        by_half[half_offset] = p.tx_id
        return True

    def apply_op(self, rec: Record, op_progress: int = 0) -> None:
        props = rec.properties
        tx_id = props.get(PROP_UNIQ_KEY)
        half_offset = _int(rec.body.decode("ascii", "replace") if rec.body else None, -1)
        if rec.queue_offset >= op_progress:
            self.ops_since_progress.append((rec.queue_offset, half_offset))
        if not tx_id:
            return
        outcome = Outcome.COMMITTED if rec.tx_type == TxType.COMMIT else Outcome.ROLLED_BACK
        self._decide(tx_id, outcome, rec, props.get(PROP_DECIDED_BY, "producer"), half_offset)

    def apply_discard(self, rec: Record) -> None:
        tx_id = rec.properties.get(PROP_UNIQ_KEY)
        d = self.decided.get(tx_id) if tx_id else None
        if d is not None and d.outcome in (Outcome.COMMITTED, Outcome.ROLLED_BACK):
            return  # first outcome wins: a discard written after the decision (same batch) changes nothing
        if tx_id:
            self._decide(tx_id, Outcome.DISCARDED, rec, rec.properties.get(PROP_DISCARD_REASON, "max-checks"), rec.queue_offset)

    def _decide(self, tx_id: str, outcome: Outcome, rec: Record, by: str, half_offset: int) -> None:
        self._decide_fields(tx_id, outcome, rec.properties, rec.store_ts, rec.commit_log_offset, by, half_offset)

    def _decide_fields(self, tx_id: str, outcome: Outcome, props: dict, store_ts: int, cl_offset: int, by: str,
                       half_offset: int) -> None:
        """_decide from the deciding record's fields (the rebuild has no Record)."""
        p = self.pending.pop(tx_id, None)
        checks = _int(props.get(PROP_CHECK_TIMES), 0)
        if p is not None:
            self.by_half.pop(p.half_offset, None)
            checks = p.checks
        self.decided[tx_id] = Decided(
            outcome, store_ts, intern(by), half_offset, cl_offset,
            intern(props.get(PROP_PGROUP, p.group if p else "")),
            intern(props.get(PROP_REAL_TOPIC, p.topic if p else "")),
            checks,
        )

    def apply(self, rec: Record, op_progress: int = 0) -> None:
        if rec.topic == HALF_TOPIC:
            self.apply_half(rec)
        elif rec.topic == OP_TOPIC:
            self.apply_op(rec, op_progress)
        elif rec.topic == DISCARD_TOPIC:
            self.apply_discard(rec)

    def pending_by_topic(self) -> dict[str, int]:
        """Pending transactions per real topic (safe from another thread: it iterates a copy)."""
        out: dict[str, int] = {}
        for p in list(self.pending.values()):
            out[p.topic] = out.get(p.topic, 0) + 1
        return out

    def outcome(self, tx_id: str) -> Outcome | None:
        if tx_id in self.pending:
            return Outcome.PENDING
        d = self.decided.get(tx_id)
        return d.outcome if d else None

    def first_undecided_half(self) -> int | None:
        """Smallest half offset of a pending transaction's latest copy."""
        return min(self.by_half) if self.by_half else None


SNAPSHOT_FILE = "txindex.snap"
SNAPSHOT_VERSION = 3
_TX_QUEUES = (("op", OP_TOPIC), ("discard", DISCARD_TOPIC), ("half", HALF_TOPIC))


def snapshot_header(store, idx: TxIndex, half_progress: int, op_progress: int) -> dict:
    """What a snapshot of idx taken now must say about the log it reflects.

    ``log_end``: every record before it is in idx, none after it.
    ``queues``: the op, discard and half queues' ends, where a start that
    loads the snapshot resumes reading (``rebuild_steps(starts=...)``).
    ``boundary``: (commit-log offset, CRC) of the last transactional record
    before log_end, which the loader reads back: a log that was cut below
    log_end and written again does not end in that record.
    Call it on the loop thread, between appends (the index matches the log).
    """
    queues = {name: store.queue_max_offset(topic, 0) for name, topic in _TX_QUEUES}
    boundary = None
    for name, topic in _TX_QUEUES:
        n = queues[name]
        for cl, _size, _tag in store.cq_entries(topic, 0, n - 1, 1) if n > 0 else ():
            if boundary is None or cl > boundary[0]:
                boundary = [cl, 0]
    if boundary is not None:
        _raw, head = store.read_many([boundary[0]], raw=True)[0]
        boundary[1] = head[2]  # its CRC
    return {"version": SNAPSHOT_VERSION, "log_end": store.max_offset, "half_progress": half_progress,
            "op_progress": op_progress, "queues": queues, "boundary": boundary,
            "pending": len(idx.pending), "decided": len(idx.decided)}


def save_snapshot(path, idx: TxIndex, header: dict, tmp: str | None = None) -> None:
    """Write the index with its header (``snapshot_header``) to path, atomically.

    Written at a clean shutdown after the last append, and in the
    background while the broker runs (``fork_snapshot``). A start loads it
    and reads only the transactional records written after it
    (``load_snapshot``), instead of every op and half record. The file is a
    stream of msgpack objects (the header, then one row per entry) so that
    loading it never holds more than one row besides the index.
    """
    path = os.fspath(path)
    tmp = tmp or path + ".tmp"
    pack = msgpack.Packer(use_bin_type=True).pack
    with open(tmp, "wb", buffering=1 << 20) as f:
        f.write(pack(header))
        for p in idx.pending.values():
            f.write(pack(p.to_row()))
        for tx_id, d in idx.decided.items():
            f.write(pack([tx_id, int(d.outcome), d.decided_at, d.decided_by, d.half_offset, d.cl_offset, d.group, d.topic, d.checks]))
        f.write(pack(idx.ops_since_progress))
        f.flush()
        os.fsync(f.fileno())
    if tmp != path:
        os.replace(tmp, path)


def fork_snapshot(tmp, idx: TxIndex, header: dict) -> int:
    """Write the index to tmp from a forked child: the caller goes on at once.

    The child sees the index as it is at the fork (copy-on-write: no copy,
    no pause beyond the fork itself, ~10 ms for a 350 MB process) and
    writes it while the broker keeps changing its own. It touches nothing
    but the index and the file (no logging: another thread may hold a lock
    the child would inherit taken) and leaves with os._exit: 0 when written.
    Returns the child's pid; wait for it with os.waitpid.
    """
    import signal

    # Signals wait until the child has dropped the parent's handlers: one
    # delivered in between would wake the parent's loop through the wakeup fd.
    stop = {signal.SIGINT, signal.SIGTERM}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    try:
        pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        raise
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        return pid
    code = 1
    try:
        # The child must not hold what the broker holds: the listening socket,
        # client connections, the data directory's LOCK (a restart after the
        # broker dies must not wait for this child), segment files.
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        signal.set_wakeup_fd(-1)
        for sig in stop:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        save_snapshot(tmp, idx, header, tmp=os.fspath(tmp))
        code = 0
    except BaseException as exc:
        try:
            os.write(2, f"txmq: index snapshot child failed: {exc!r}\n".encode())
        except OSError:
            pass
    finally:
        os._exit(code)


def load_snapshot(path, log_end: int, op_progress: int) -> tuple[TxIndex, dict] | None:
    """(index, header) from a snapshot of a log that now ends at log_end or later, else None.

    The caller still checks the header's boundary record against the log
    (``boundary_ok``) and then reads what was written after the snapshot
    (``rebuild_steps(..., starts=header["queues"])``). Op records below the
    current op progress are dropped from the index's list, as a rebuild
    that starts at that progress would not have them.
    """
    try:
        with open(path, "rb") as f:
            unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False, max_buffer_size=64 << 20)
            head = unpacker.unpack()
            if head.get("version") != SNAPSHOT_VERSION or not 0 <= head["log_end"] <= log_end:
                return None
            idx = TxIndex()
            for _ in range(head["pending"]):
                p = PendingTx.from_row(unpacker.unpack())
                idx.pending[p.tx_id] = p
                idx.by_half[p.half_offset] = p.tx_id
            outcomes = list(Outcome)
            decided = idx.decided
            for _ in range(head["decided"]):
                tx_id, o, at, by, ho, cl, g, t, checks = unpacker.unpack()
                decided[tx_id] = Decided(outcomes[o], at, intern(by), ho, cl, intern(g), intern(t), checks)
            idx.ops_since_progress = [tuple(x) for x in unpacker.unpack() if x[0] >= op_progress]
            if set(head["queues"]) != {name for name, _ in _TX_QUEUES}:
                return None
            return idx, head
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, msgpack.UnpackException, msgpack.OutOfData):
        return None


def boundary_ok(store, header: dict) -> bool:
    """Does the log still hold the snapshot's last transactional record (``snapshot_header``)?"""
    boundary = header.get("boundary")
    if boundary is None:
        return all(store.queue_max_offset(topic, 0) >= header["queues"][name] == 0 for name, topic in _TX_QUEUES)
    try:
        _raw, head = store.read_many([boundary[0]], raw=True)[0]
    except Exception:  # cut away, or no record starts there any more
        return False
    return head[2] == boundary[1] and head[3] + head[0] <= header["log_end"]


def rebuild(reader, half_progress: int, op_progress: int, batch: int = 2048) -> TxIndex:
    """Rebuild the index from a store (or StoreReader) in one go."""
    idx = TxIndex()
    for _ in rebuild_steps(reader, half_progress, op_progress, idx, batch):
        pass
    return idx


def rebuild_steps(reader, half_progress: int, op_progress: int, idx: TxIndex, batch: int = 2048,
                  starts: dict[str, int] | None = None) -> Iterator[int]:
    """Fill idx from the log, yielding the records applied so far every `batch` records.

    With starts (a loaded snapshot's ``queues``), idx holds the snapshot and
    only the op, discard and half records from those queue offsets on are read.

    Reads the whole op and discard queues and the half queue from the check
    progress on (everything before it is decided or superseded by a later
    copy), merged in commit-log order. The broker drives this between other
    work, so it serves plain traffic while the index is being rebuilt.

    The result is what ``idx.apply`` of each record in that order gives
    (tests/test_txindex_rebuild_fast.py holds the two equal, against the
    old record-by-record code), but nothing is decoded into a ``Record``:
    ``raw_queue_runs`` hands over validated headers, and only the
    properties (one msgpack unpack) and an op record's body are read from
    the bytes. A transaction found pending gets its PendingTx only if it is
    still pending at the end (most are decided a few records later; see
    ``stash``); such transactions reach ``idx.pending`` in batches (at the
    end, or when the stash is full), not one by one. A record that does not
    decode raises CorruptRecordError as before. After a crash this reads two
    records per transaction ever written (docs/benchmarks.md, restart); per
    record it costs about three quarters of the CPU the Record path did
    (benchmarks/rebuild_micro.py), most of the rest being the msgpack unpack
    and the CRC check.
    """
    st = starts or {}
    queues = [
        (OP_TOPIC, 0, max(st.get("op", 0), reader.queue_min_offset(OP_TOPIC, 0))),
        (DISCARD_TOPIC, 0, max(st.get("discard", 0), reader.queue_min_offset(DISCARD_TOPIC, 0))),
        (HALF_TOPIC, 0, max(st.get("half", 0), half_progress, reader.queue_min_offset(HALF_TOPIC, 0))),
    ]
    pending, by_half, decided, ops = idx.pending, idx.by_half, idx.decided, idx.ops_since_progress
    # Transactions this rebuild found pending whose PendingTx is not built yet:
    # tx id -> (first copy's properties, its header[, latest copy's properties,
    # its header]). Most are decided a few records later, and building a
    # PendingTx only to drop it cost as much as the rest of the half's work.
    # Every entry of `pending` is older than every entry here (both are in
    # creation order), so moving the oldest over (_materialize) keeps
    # pending's order. Properties are strings (the broker takes no others),
    # so deferring the int/float/intern of a copy's fields changes nothing.
    stash: dict[str, tuple] = {}
    unpackb = msgpack.unpackb
    committed, rolled_back, discarded, first_outcomes = Outcome.COMMITTED, Outcome.ROLLED_BACK, Outcome.DISCARDED, _FIRST_OUTCOMES
    half_b, op_b, discard_b = _HALF_B, _OP_B, _DISCARD_B
    commit_type = int(TxType.COMMIT)  # a plain int: an enum member lookup per record costs
    n = 0
    next_yield = batch
    for buf, mv, first, headers in raw_queue_runs(reader, queues):
        for h in headers:
            # h: total, magic, crc, cl offset, tx_type, flags, topic_len, queue id, queue offset,
            #    born_ts, store_ts, prepared_offset, props_len, body_len (codec.HEADER)
            p = h[3] - first + HEADER_SIZE  # the topic
            tlen = h[6]
            q = p + tlen  # the properties
            try:
                props = unpackb(mv[q : q + h[12]], raw=False)
            except Exception:  # msgpack raises several unrelated types on bad input
                props = None
            if type(props) is not dict:
                _apply_decoded(idx, buf, h, first, op_progress)  # raises, as decoding the record would
            elif tlen == _HALF_LEN and buf.startswith(half_b, p):  # TxIndex.apply_half
                tx_id = props.get(PROP_UNIQ_KEY)
                if tx_id:
                    d = decided.get(tx_id)
                    if d is not None:
                        if reopens(d, props.get(PROP_REPLAYED)):
                            del decided[tx_id]
                        else:
                            continue  # a stale copy
                    st = stash.get(tx_id)
                    if st is not None:
                        stash[tx_id] = (st[0], st[1], props, h)  # keeps its place (creation order)
                    else:
                        pt = pending.get(tx_id)
                        if pt is None:
                            stash[tx_id] = (props, h)
                            if len(stash) > _STASH_MAX:
                                _materialize(stash, pending, by_half, len(stash) // 2)
                        else:
                            by_half.pop(pt.half_offset, None)
                            _update_pending(pt, props, h)
                            by_half[pt.half_offset] = tx_id
            elif tlen == _OP_LEN and buf.startswith(op_b, p):  # TxIndex.apply_op
                q += h[12]
                body = buf[q : q + h[13]]
                if body.isdigit():  # ASCII digits: int() of the bytes is int() of their text
                    half_offset = int(body)
                else:
                    half_offset = _int(body.decode("ascii", "replace") if body else None, -1)
                if h[8] >= op_progress:
                    ops.append((h[8], half_offset))
                tx_id = props.get(PROP_UNIQ_KEY)
                if tx_id:
                    outcome = committed if h[4] == commit_type else rolled_back
                    by = props.get(PROP_DECIDED_BY, "producer")
                    st = stash.pop(tx_id, None)
                    if st is None:
                        idx._decide_fields(tx_id, outcome, props, h[10], h[3], by, half_offset)
                    else:
                        decided[tx_id] = _decided_stashed(st, outcome, props, h, by, half_offset)
            elif tlen == _DISCARD_LEN and buf.startswith(discard_b, p):  # TxIndex.apply_discard
                tx_id = props.get(PROP_UNIQ_KEY)
                d = decided.get(tx_id) if tx_id else None
                if (d is None or d.outcome not in first_outcomes) and tx_id:
                    by = props.get(PROP_DISCARD_REASON, "max-checks")
                    st = stash.pop(tx_id, None)
                    if st is None:
                        idx._decide_fields(tx_id, discarded, props, h[10], h[3], by, h[8])
                    else:
                        decided[tx_id] = _decided_stashed(st, discarded, props, h, by, h[8])
            else:  # another topic: apply ignores it, once decoded (which may fail)
                _apply_decoded(idx, buf, h, first, op_progress)
        n += len(headers)
        if n >= next_yield:
            yield n
            next_yield = n + batch
    while stash:
        _materialize(stash, pending, by_half, batch)
        yield n
    yield n


def _apply_decoded(idx: TxIndex, buf: bytes, h: tuple, first: int, op_progress: int) -> None:
    """The record decoded and applied as get_messages and apply would: CorruptRecordError if it does not decode."""
    rec = decode_record(buf, h[3] - first, h[3])
    if rec is None:
        raise CorruptRecordError(record_problem(buf, h[3] - first, h[3]) or f"invalid record at {h[3]}")
    idx.apply(rec, op_progress)


_HALF_B, _OP_B, _DISCARD_B = HALF_TOPIC.encode(), OP_TOPIC.encode(), DISCARD_TOPIC.encode()
_HALF_LEN, _OP_LEN, _DISCARD_LEN = len(_HALF_B), len(_OP_B), len(_DISCARD_B)
assert len({_HALF_LEN, _OP_LEN, _DISCARD_LEN}) == 3  # told apart by length first
_FIRST_OUTCOMES = (Outcome.COMMITTED, Outcome.ROLLED_BACK)
# Pending transactions a rebuild keeps unbuilt at most (then builds the older
# half): bounds the properties dicts it holds when most of the log is pending.
_STASH_MAX = 1 << 16


def _materialize(stash: dict, pending: dict, by_half: dict, count: int) -> None:
    """Build the PendingTx of the `count` oldest stashed transactions and move them to the index."""
    for tx_id in list(islice(stash, count)):
        st = stash.pop(tx_id)
        p = pending[tx_id] = _new_pending(st[0], st[1])
        if len(st) == 4:
            _update_pending(p, st[2], st[3])
        by_half[p.half_offset] = tx_id


def _decided_stashed(st: tuple, outcome: Outcome, props: dict, h: tuple, by: str, half_offset: int) -> Decided:
    """``TxIndex._decide`` for a stashed transaction: what it gives with the PendingTx the stash stands for.

    The deciding record is ``props``/``h``; ``st`` holds the first and latest
    copies (the PendingTx's group and topic come from the first, its check
    count from the latest).
    """
    group = props.get(PROP_PGROUP)
    if group is None and PROP_PGROUP not in props:
        group = st[0].get(PROP_PGROUP, "")
    topic = props.get(PROP_REAL_TOPIC)
    if topic is None and PROP_REAL_TOPIC not in props:
        topic = st[0].get(PROP_REAL_TOPIC, "")
    return Decided(outcome, h[10], intern(by), half_offset, h[3], intern(group), intern(topic),
                   _int(st[-2].get(PROP_CHECK_TIMES), 0))


def _new_pending(props: dict, h: tuple) -> PendingTx:
    """``PendingTx(rec)`` from the record's properties and header fields (the rebuild has no Record).

    Same assignments in the same order as ``PendingTx.__init__`` and
    ``update``; tests/test_txindex_rebuild_fast.py holds the two equal.
    """
    p = PendingTx.__new__(PendingTx)
    p.tx_id = props.get(PROP_UNIQ_KEY, "")
    p.group = intern(props.get(PROP_PGROUP, ""))
    p.topic = intern(props.get(PROP_REAL_TOPIC, ""))
    p.queue_id = _int(props.get(PROP_REAL_QID), 0)
    p.born_ts = h[9]
    p.first_stored_ts = h[10]
    p.origin_cl_offset = _int(props.get(PROP_ORIGIN_CL_OFFSET), h[3])
    p.last_check_at = None
    p.last_check_result = None
    _update_pending(p, props, h)
    return p


def _update_pending(p: PendingTx, props: dict, h: tuple) -> None:
    """``p.update(rec)`` from the record's properties and header fields."""
    p.half_offset = h[8]
    p.cl_offset = h[3]
    p.stored_ts = h[10]
    p.checks = _int(props.get(PROP_CHECK_TIMES), 0)
    imm = props.get(PROP_CHECK_IMMUNITY)
    p.immunity_s = _float(imm) if imm else None
