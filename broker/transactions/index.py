"""The transaction index: pending half messages in memory, decided outcomes on disk.

It is what gives txmq "one outcome per transaction": a decided transaction
answers every later end transaction, check answer or operator decision
with its first outcome. Memory holds only what is pending (what the check
service walks) plus the decisions of the last second or so; every decision
is persisted in ``txindex.db`` (``broker/transactions/indexfile.py``) by periodic flushes, and
looked up there by transaction id when a late request asks. A start loads
the pending rows and reads only the transactional records written after
the last flush (``replay_steps``); with no usable index file it reads them
all (the commit log is the only source of truth).

This module is synchronous and reads the store only through its read API,
so the CLI uses it on a data directory offline (``txmq inspect --data-dir``).

Events, in commit-log order, and their effect:

- half record (a first copy, a check copy, or a replayed copy): if the
  transaction is decided, ignore it (a stale copy), except that a copy whose
  ``TXMQ_REPLAYED`` names the transaction's discard record re-opens it
  (``reopens``); otherwise it becomes the transaction's latest copy.
- op record (tag ``d``; tx_type commit or rollback): the outcome.
- discard record: outcome ``discarded``, unless already committed or
  rolled back (the first outcome wins).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from enum import IntEnum
from sys import intern
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from txmq.constants import (
    DISCARD_TOPIC,
    HALF_TOPIC,
    OP_TOPIC,
    PROP_CHECK_IMMUNITY,
    PROP_CHECK_TIMES,
    PROP_DECIDED_BY,
    PROP_DISCARD_REASON,
    PROP_HALF_CL_OFFSET,
    PROP_ORIGIN_CL_OFFSET,
    PROP_PGROUP,
    PROP_REAL_QID,
    PROP_REAL_TOPIC,
    PROP_REPLAYED,
    PROP_UNIQ_KEY,
)
import msgpack

from txmq.store import CorruptRecordError, Record, TxType, decode_record, record_problem
from txmq.store.bulk import raw_queue_runs
from txmq.store.consumequeue import first_entry_from
from txmq.store.codec import H_CRC, H_OFFSET, H_SIZE
from txmq.wire import ErrorCode, TxmqError

from .indexfile import DamagedRow

if TYPE_CHECKING:
    from .indexfile import TxDatabase

log = logging.getLogger("txmq.txdb")


class IndexRowDamaged(TxmqError):
    """A transaction's row in the index file is damaged and the records it names do not give its outcome back."""

    def __init__(self, tx_id: str, why: str) -> None:
        super().__init__(f"the index row of transaction {tx_id} is damaged ({why}); its outcome is known again once a restart "
                         "has rebuilt the index from the log", ErrorCode.STORE_ERROR)


class Outcome(IntEnum):
    PENDING = 0
    COMMITTED = 1
    ROLLED_BACK = 2
    DISCARDED = 3

    @property
    def label(self) -> str:
        return _OUTCOME_LABELS[self._value_]  # once per decision's reply: a tuple, not a dict built per call


_OUTCOME_LABELS = ("pending", "committed", "rolled_back", "discarded")


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

    def db_row(self) -> tuple:
        """This transaction's row of ``txindex.db`` (``indexfile.COLUMNS``)."""
        return (self.origin_cl_offset, self.tx_id, 0, None, None, self.half_offset, self.cl_offset, self.group, self.topic,
                self.checks, _pack([self.queue_id, self.born_ts, self.first_stored_ts, self.stored_ts, self.immunity_s]))

    @classmethod
    def from_db_row(cls, row: tuple) -> "PendingTx":
        p = cls.__new__(cls)
        (p.origin_cl_offset, p.tx_id, _state, _at, _by, p.half_offset, p.cl_offset, group, topic, p.checks, extra) = row
        p.queue_id, p.born_ts, p.first_stored_ts, p.stored_ts, p.immunity_s = msgpack.unpackb(extra)
        p.group, p.topic = intern(group), intern(topic)
        p.last_check_at = None
        p.last_check_result = None
        return p

    def age_ms(self, now_ms: int) -> int:
        """Since the broker stored the first copy, by the broker's clock (the producer's born_ts plays no part); >= 0."""
        return max(0, now_ms - self.first_stored_ts)

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
            "age_s": round(self.age_ms(now_ms) / 1000.0, 3),
            "checks": self.checks,
            "last_check_at": self.last_check_at,
            "last_check_result": self.last_check_result,
            "next_check_at": next_check_at,
        }


@dataclass(slots=True)
class Decided:
    outcome: Outcome
    decided_at: int  # ms
    decided_by: str  # producer | check | operator | recovery | max-checks | retention
    queue_offset: int  # the index file's half_offset column: see half_offset and discard_offset
    cl_offset: int  # of the op / discard record
    group: str
    topic: str
    checks: int = 0
    origin: int = -1  # commit-log offset of the transaction's first half copy (its row's key)

    @property
    def half_offset(self) -> int:
        """The half offset of the copy that was committed or rolled back (the op record's body); -1 for a discard."""
        return -1 if self.outcome is Outcome.DISCARDED else self.queue_offset

    @property
    def discard_offset(self) -> int:
        """A discarded transaction's discard record's offset in the discard queue (``txmq discard list``); -1 otherwise."""
        return self.queue_offset if self.outcome is Outcome.DISCARDED else -1

    def db_row(self, tx_id: str) -> tuple:
        return (self.origin, tx_id, int(self.outcome), self.decided_at, self.decided_by, self.queue_offset, self.cl_offset,
                self.group, self.topic, self.checks, None)

    @classmethod
    def from_db_row(cls, row: tuple) -> "Decided":
        return cls(_OUTCOMES[row[2]], row[3], intern(row[4] or ""), row[5], row[6], intern(row[7]), intern(row[8]), row[9], row[0])


def reopens(d: Decided, mark: str | None) -> bool:
    """Does a half copy carrying this replay mark re-open the transaction decided as d?

    Only a discard, and only the one the replay undid: the mark is that
    discard record's offset (copies inherit it; see ``service.copy_properties``).
    "1" is the mark older versions of txmq put on a replay's own copy.
    """
    return d.outcome is Outcome.DISCARDED and mark is not None and (mark == str(d.cl_offset) or mark == "1")


_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


def _int(v: str | None, default: int) -> int:
    """A producer-set numeric property, or default when absent, not a number, or outside int64.

    Offsets and counts are int64 everywhere else (the record header, the
    index file, the compiled check path): a value a client wrote that cannot
    be one is treated as absent, never carried into them.
    """
    try:
        n = int(v) if v is not None else default
    except ValueError:
        return default
    return n if _I64_MIN <= n <= _I64_MAX else default


MAX_IMMUNITY_S = 86400 * 3650  # the longest retention: a transaction immune for longer is discarded by retention first


def _float(v: str) -> float | None:
    """A producer-set number of seconds (CHECK_IMMUNITY_TIME_IN_SECONDS), or None when absent, not a number or not finite.

    Clamped to MAX_IMMUNITY_S: 1e20 seconds turns into a check time no
    reply can carry (msgpack's integers stop at 2^64).
    """
    try:
        f = float(v)
    except ValueError:
        return None
    return min(f, MAX_IMMUNITY_S) if math.isfinite(f) else None


_OUTCOMES = list(Outcome)
_pack = msgpack.Packer(use_bin_type=True).pack


class TxIndex:
    """Pending transactions and recent decisions in memory; with ``db``, older decisions on disk.

    Without a database (``rebuild`` for offline use and tests) every decision
    stays in ``decided``. With one, each change is also noted in ``dirty``
    and written by the broker's periodic flush (``capture`` / ``flushed``);
    a decision leaves memory once it is on disk.
    """

    def __init__(self, db: TxDatabase | None = None, track: bool | None = None, store: Any = None) -> None:
        self.pending: dict[str, PendingTx] = {}
        # half-queue offset of each pending transaction's latest copy -> tx id.
        # Filled in increasing half offset (copies are applied in log order,
        # and a start loads the pending rows sorted by it), so iterating it
        # walks the half queue's pending entries in order (the check pass).
        self.by_half: dict[int, str] = {}
        # decided transactions not yet flushed to db (with no db: all of them)
        self.decided: dict[str, Decided] = {}
        self.db = db
        # tx id -> its PendingTx or Decided, changed since the last capture (None: not tracked)
        self.dirty: dict[str, PendingTx | Decided] | None = {} if (db is not None if track is None else track) else None
        self.discarded = 0  # transactions whose outcome is "discarded" now
        self.replay_end = 0  # a replay in progress (replay_steps) has applied every record before this log offset
        # The log (a Store or StoreReader) a damaged row's decision is read back from (decision_from_log).
        self.store = store
        # The first damaged row a lookup met: the broker's next flush records it, and the next start rebuilds the file.
        self.damaged: str | None = None

    # ---- looking up --------------------------------------------------------
    def lookup(self, tx_id: str) -> Decided | None:
        """The outcome of a decided transaction (from memory, else from disk); None if pending or unknown.

        Costs a dict lookup, and for a transaction decided before the last
        flush one indexed SQLite query (~8 us). A damaged row's decision is
        read back from the record it names; IndexRowDamaged when it cannot be.
        """
        d = self.decided.get(tx_id)
        if d is not None or self.db is None or tx_id in self.pending:
            return d
        try:
            row = self.db.by_tx_id(tx_id)
        except DamagedRow as exc:
            return self._from_damaged_row(tx_id, exc)
        return Decided.from_db_row(row) if row is not None and row[2] != 0 else None

    def _from_damaged_row(self, tx_id: str, exc: DamagedRow) -> Decided:
        d = decision_from_log(self.store, tx_id, exc.row) if self.store is not None else None
        self.damaged = self.damaged or str(exc)
        log.warning("event=txindex_row_damaged tx_id=%s origin=%s reason=%r outcome=%s msg=%s", tx_id, exc.row[0], str(exc),
                    d.outcome.label if d is not None else "unknown",
                    "'read back from the log; the next start rebuilds the index file'" if d is not None
                    else "'its deciding record is not where the row says; the next start rebuilds the index file from the log'")
        if d is None:
            raise IndexRowDamaged(tx_id, str(exc))
        self.decided[tx_id] = d  # answers from memory until the rebuild
        return d

    def outcome(self, tx_id: str) -> Outcome | None:
        if tx_id in self.pending:
            return Outcome.PENDING
        d = self.lookup(tx_id)
        return d.outcome if d else None

    def first_undecided_half(self) -> int | None:
        """Smallest half offset of a pending transaction's latest copy (what holds the half progress back)."""
        return next(iter(self.by_half), None)

    def pending_summary(self) -> tuple[dict[str, int], dict[str, int]]:
        """Pending transactions per real topic, and per producer group the first_stored_ts (ms, broker store
        time) of its oldest pending transaction.

        One pass over a copy of the pending transactions, so it is safe from
        another thread: ``stats`` and the Prometheus scrape run it there, as
        it takes ~100 ms at a million pending.
        """
        by_topic: dict[str, int] = {}
        oldest: dict[str, int] = {}
        for p in list(self.pending.values()):
            by_topic[p.topic] = by_topic.get(p.topic, 0) + 1
            t = oldest.get(p.group)
            if t is None or p.first_stored_ts < t:
                oldest[p.group] = p.first_stored_ts
        return by_topic, oldest

    def discarded_rows(self, limit: int, after: int = -1) -> list[tuple[str, Decided]]:
        """Discarded transactions (tx id, Decided), by discard-queue offset above ``after``, at most limit.

        Those decided since the last flush come from memory, the rest from
        the index file's partial index of discarded rows: the cost is that of
        the rows returned, whatever the history.
        """
        mem = [(t, d) for t, d in self.decided.items() if d.outcome is Outcome.DISCARDED and d.discard_offset > after]
        out = list(mem)
        if self.db is not None:
            shadow = self.decided.keys() | self.pending.keys()  # changed since the last flush: memory wins
            while len(out) < limit + len(mem):
                rows = self._listed(self.db.discarded, after, limit)
                if not rows:
                    break
                out += [(r[1], Decided.from_db_row(r)) for r in rows if r[1] not in shadow]
                after = rows[-1][5]
        out.sort(key=lambda x: x[1].discard_offset)
        return out[:limit]

    def discarded_at(self, discard_offset: int) -> tuple[str, Decided] | None:
        for t, d in self.decided.items():
            if d.outcome is Outcome.DISCARDED and d.discard_offset == discard_offset:
                return t, d
        if self.db is not None:
            row = self._listed(self.db.discarded_at, discard_offset)
            if row is not None and row[1] not in self.decided and row[1] not in self.pending:
                return row[1], Decided.from_db_row(row)
        return None

    def _listed(self, read: Callable[..., Any], *args: Any) -> Any:
        """Rows read by something else than an id (the discard listing): a damaged one is an error of the listing."""
        try:
            return read(*args)
        except DamagedRow as exc:
            self.damaged = self.damaged or str(exc)
            log.warning("event=txindex_row_damaged tx_id=%s origin=%s reason=%r msg=%s", exc.row[1], exc.row[0], str(exc),
                        "'in a listing of discarded transactions; the next start rebuilds the index file from the log'")
            raise IndexRowDamaged(str(exc.row[1]), str(exc)) from None

    # ---- applying records ------------------------------------------------
    def apply_half(self, rec: Record) -> PendingTx | None:
        props = rec.properties
        tx_id = props.get(PROP_UNIQ_KEY)
        if not tx_id:
            return None
        p = self.pending.get(tx_id)
        if p is not None:
            self.by_half.pop(p.half_offset, None)
            p.update(rec)
        else:
            d = self.decided.get(tx_id)
            if d is None and self.db is not None and PROP_ORIGIN_CL_OFFSET in props:
                try:
                    d = self.lookup(tx_id)  # a copy of a transaction decided before the last flush
                except IndexRowDamaged:
                    return None  # decided, how is not known: a copy never re-opens it
            if d is not None:
                if not reopens(d, props.get(PROP_REPLAYED)):
                    return None  # a stale copy
                self.decided.pop(tx_id, None)
                self.discarded -= 1
            p = self.pending[tx_id] = PendingTx(rec)
        self.by_half[p.half_offset] = tx_id
        if self.dirty is not None:
            self.dirty[tx_id] = p
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
        if self.dirty is not None:
            self.dirty[p.tx_id] = p
        return True

    def apply_op(self, rec: Record) -> None:
        props = rec.properties
        tx_id = props.get(PROP_UNIQ_KEY)
        if not tx_id:
            return
        half_offset = _int(rec.body.decode("ascii", "replace") if rec.body else None, -1)
        outcome = Outcome.COMMITTED if rec.tx_type == TxType.COMMIT else Outcome.ROLLED_BACK
        self._decide(tx_id, outcome, rec, props.get(PROP_DECIDED_BY, "producer"), half_offset)

    def apply_discard(self, rec: Record) -> None:
        tx_id = rec.properties.get(PROP_UNIQ_KEY)
        if not tx_id:
            return
        if tx_id not in self.pending:
            try:
                d = self.lookup(tx_id)
            except IndexRowDamaged:
                return  # decided before, how is not known: the first outcome wins all the same
            if d is not None and d.outcome is not Outcome.DISCARDED:
                return  # first outcome wins: a discard written after the decision (same batch) changes nothing
        self._decide(tx_id, Outcome.DISCARDED, rec, rec.properties.get(PROP_DISCARD_REASON, "max-checks"), rec.queue_offset)

    def _decide(self, tx_id: str, outcome: Outcome, rec: Record, by: str, queue_offset: int) -> None:
        """Enter the outcome; queue_offset is the decided copy's half offset, or for a discard the discard record's queue offset."""
        props = rec.properties
        p = self.pending.pop(tx_id, None)
        if p is not None:
            self.by_half.pop(p.half_offset, None)
            checks, group, topic, origin = p.checks, p.group, p.topic, p.origin_cl_offset
        else:
            # Decided before (a commit of a discarded transaction, or a record
            # read again): keep its row's key.
            try:
                prev = self.lookup(tx_id)
            except IndexRowDamaged:
                prev = None
            if prev is not None:
                if prev.outcome is Outcome.DISCARDED:
                    self.discarded -= 1
                origin = prev.origin
            else:
                origin = _int(props.get(PROP_ORIGIN_CL_OFFSET) or props.get(PROP_HALF_CL_OFFSET), rec.prepared_offset)
            checks = _int(props.get(PROP_CHECK_TIMES), 0)
            group, topic = props.get(PROP_PGROUP, ""), props.get(PROP_REAL_TOPIC, "")
        if outcome is Outcome.DISCARDED:
            self.discarded += 1
        d = self.decided[tx_id] = Decided(
            outcome, rec.store_ts, intern(by), queue_offset, rec.commit_log_offset,
            intern(props.get(PROP_PGROUP, group)), intern(props.get(PROP_REAL_TOPIC, topic)), checks, origin,
        )
        if self.dirty is not None:
            self.dirty[tx_id] = d

    def apply(self, rec: Record) -> None:
        if rec.topic == HALF_TOPIC:
            self.apply_half(rec)
        elif rec.topic == OP_TOPIC:
            self.apply_op(rec)
        elif rec.topic == DISCARD_TOPIC:
            self.apply_discard(rec)

    # ---- persisting (the broker's periodic flush) ----------------------------
    def load_pending(self, rows) -> None:
        """Fill pending from the index file's pending rows (sorted by latest half offset)."""
        pending, by_half = self.pending, self.by_half
        for row in rows:
            p = PendingTx.from_db_row(row)
            pending[p.tx_id] = p
            by_half[p.half_offset] = p.tx_id

    def capture(self) -> dict[str, Any]:
        """Every change since the last capture (tx id -> PendingTx or Decided); starts a new set.

        Call between appends (the index matches the log), together with the
        log position every change before it is in. A Decided never changes,
        so its row is made later, off the event loop (``decided_rows``). A
        pending transaction changes in place, so its row is taken on the
        loop (``pending_rows``), a slice at a time; a row taken after more
        records were applied may be ahead of the captured position, which a
        start's replay from that position applies again to the same effect
        (docs/store-format.md, "The transaction index file"). Pass the
        changes to ``flushed`` once the rows are on disk (or ``flush_failed``).
        """
        changed = self.dirty or {}
        self.dirty = {}
        return changed

    @staticmethod
    def pending_rows(items: Iterable[tuple[str, Any]]) -> list[tuple]:
        """The rows of the pending transactions among (tx id, change) items, as they are now."""
        return [obj.db_row() for _, obj in items if type(obj) is PendingTx]

    @staticmethod
    def decided_rows(changed: dict[str, Any]) -> Iterator[tuple]:
        """The rows of the decisions among a capture's changes (safe in another thread: they never change)."""
        for tx_id, obj in changed.items():
            if type(obj) is Decided:
                yield obj.db_row(tx_id)

    def flushed(self, changed: dict[str, Any]) -> None:
        """Those rows are on disk: decisions among them leave memory (unless changed again since)."""
        decided = self.decided
        for tx_id, obj in changed.items():
            if type(obj) is Decided and decided.get(tx_id) is obj:
                del decided[tx_id]

    def flush_failed(self, changed: dict[str, Any]) -> None:
        """Those rows did not reach the disk: the next flush writes them (as they are then)."""
        dirty = self.dirty
        assert dirty is not None
        for tx_id in changed:
            if tx_id not in dirty:
                cur = self.pending.get(tx_id) or self.decided.get(tx_id)
                if cur is not None:
                    dirty[tx_id] = cur


def decision_from_log(store, tx_id: str, row: tuple) -> Decided | None:
    """The decision a damaged index row held, read from the record the row names as deciding it (``cl_offset``).

    What the replay enters for that op or discard record (``_decide``), the
    origin from the record's copy. None when no op or discard record of
    tx_id is there (the offset itself is damaged, or the record is).
    """
    rec = _stored(store, row[6])
    if rec is None or rec.properties.get(PROP_UNIQ_KEY) != tx_id:
        return None
    props = rec.properties
    if rec.topic == OP_TOPIC and rec.tx_type in (TxType.COMMIT, TxType.ROLLBACK):
        outcome = Outcome.COMMITTED if rec.tx_type == TxType.COMMIT else Outcome.ROLLED_BACK
        by = props.get(PROP_DECIDED_BY, "producer")
        queue_offset = _int(rec.body.decode("ascii", "replace") if rec.body else None, -1)
        half = _stored(store, _int(props.get(PROP_HALF_CL_OFFSET), rec.prepared_offset))
        if half is not None and half.topic == HALF_TOPIC and half.properties.get(PROP_UNIQ_KEY) == tx_id:
            origin = _int(half.properties.get(PROP_ORIGIN_CL_OFFSET), half.commit_log_offset)
        else:
            origin = row[0]
    elif rec.topic == DISCARD_TOPIC:
        outcome, by, queue_offset = Outcome.DISCARDED, props.get(PROP_DISCARD_REASON, "max-checks"), rec.queue_offset
        origin = _int(props.get(PROP_ORIGIN_CL_OFFSET), row[0])
    else:
        return None
    return Decided(outcome, rec.store_ts, intern(by), queue_offset, rec.commit_log_offset, intern(props.get(PROP_PGROUP, "")),
                   intern(props.get(PROP_REAL_TOPIC, "")), _int(props.get(PROP_CHECK_TIMES), 0), origin)


def _stored(store, offset: int) -> Record | None:
    """The stored record at offset, or None (damaged, deleted by retention, none starts there)."""
    if not isinstance(offset, int) or offset < 0:
        return None
    try:
        return store.read_record(offset)
    except Exception:  # noqa: BLE001 - any reason a record is not there
        return None


_TX_QUEUES = (("op", OP_TOPIC), ("discard", DISCARD_TOPIC), ("half", HALF_TOPIC))


def log_position(store, upto: int | None = None) -> dict[str, Any]:
    """Where the log is now, as the index file's meta records it (``applied_to``, ``queues``, ``boundary``).

    ``applied_to``: every record before it is in the index.
    ``queues``: the op, discard and half queues' ends, where a start resumes
    reading (``replay_steps(starts=...)``). ``boundary``: (commit-log
    offset, CRC) of the last transactional record before applied_to, which
    a start reads back: a log that was cut below applied_to and written
    again does not end in that record. Call it on the loop thread, between
    appends (the index matches the log). ``upto``: the index has applied the
    log only up to there (a start's replay in progress, ``replay_end``):
    the position there, each queue at its first record from ``upto`` on.
    """
    if upto is None:
        queues = {name: store.queue_max_offset(topic, 0) for name, topic in _TX_QUEUES}
    else:
        queues = {name: first_entry_from(store, topic, 0, upto) for name, topic in _TX_QUEUES}
    boundary = None
    for name, topic in _TX_QUEUES:
        found = _last_valid_record(store, topic, queues[name])
        if found is not None and (boundary is None or found[0] > boundary[0]):
            boundary = list(found)
    return {"applied_to": store.max_offset if upto is None else upto, "queues": queues, "boundary": boundary}


def _last_valid_record(store, topic: str, end: int) -> tuple[int, int] | None:
    """(commit-log offset, CRC) of the last record of topic's queue 0 below queue offset end that reads back valid.

    A damaged record (skipped by the replay, reported by the store) cannot be
    a boundary: reading it back would fail every flush and every start. The
    walk back goes past damaged records only, so it costs one read unless
    the tail of the queue is damaged.
    """
    low = store.queue_min_offset(topic, 0)
    for q in range(end - 1, low - 1, -1):
        entry = store.cq_entries(topic, 0, q, 1)
        if not entry:
            continue
        try:
            _raw, head = store.read_many([entry[0][0]], raw=True)[0]
        except Exception:  # damaged, or a hole in the log: an earlier record bounds the index as well
            continue
        return entry[0][0], head[H_CRC]
    return None


def agrees(store, meta: dict[str, Any]) -> str | None:
    """None if the index file's meta fits this log, else why not (then it is rebuilt from the log)."""
    try:
        if meta.get("damaged"):
            return f"a broker found a damaged row in it ({meta['damaged']})"
        queues = meta["queues"]
        if set(queues) != {name for name, _ in _TX_QUEUES}:
            return "no queue positions"
        if not 0 <= meta["applied_to"] <= store.max_offset:
            return f"it reflects the log up to {meta['applied_to']}, and the log ends at {store.max_offset}"
        for name, topic in _TX_QUEUES:
            if queues[name] > store.queue_max_offset(topic, 0):
                return f"the {name} queue ends before its position {queues[name]}"
        boundary = meta.get("boundary")
        if boundary is None:
            # none written when no transactional record below the positions reads back valid (all damaged)
            if all(_last_valid_record(store, topic, queues[name]) is None for name, topic in _TX_QUEUES):
                return None
            return "no boundary record"
        try:
            _raw, head = store.read_many([boundary[0]], raw=True)[0]
        except Exception:  # cut away, or no record starts there any more
            return f"no record at its boundary offset {boundary[0]}"
        if head[H_CRC] != boundary[1] or head[H_OFFSET] + head[H_SIZE] > meta["applied_to"]:
            return f"the record at its boundary offset {boundary[0]} is another one"
        return None
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        return f"unreadable meta ({exc!r})"


def rebuild(reader, *, batch: int = 2048, on_damage: Callable[[int, str], None] | None = None) -> TxIndex:
    """The whole index rebuilt from a store (or StoreReader) in memory, every decision kept (offline use, tests).

    Every transactional record is read. ``on_damage``: as for ``replay_steps``
    (without it a damaged record raises).
    """
    idx = TxIndex()
    for _ in replay_steps(reader, idx, None, batch, on_damage=on_damage):
        pass
    return idx


def replay_steps(reader, idx: TxIndex, starts: dict[str, int] | None = None, batch: int = 2048,
                 on_damage: Callable[[int, str], None] | None = None) -> Iterator[int]:
    """Apply the op, discard and half records from ``starts`` (queue offsets; None: the queues' starts) to idx.

    Records are applied in commit-log order, exactly as the live path
    applies them, yielding the count so far every ``batch`` records: the
    broker drives this between other work (plain traffic is served
    meanwhile) and flushes the index between steps when it rebuilds the
    whole file. A record that does not decode raises CorruptRecordError;
    with ``on_damage`` it is reported there as (offset, reason) and skipped,
    and the index is built around it.
    """
    st = starts or {}
    queues = [(topic, 0, max(st.get(name, 0), reader.queue_min_offset(topic, 0))) for name, topic in _TX_QUEUES]
    apply = idx.apply
    n = 0
    next_yield = batch
    for buf, _mv, first, headers in raw_queue_runs(reader, queues, on_damage=on_damage):
        for h in headers:
            at = h[H_OFFSET]
            rec = decode_record(buf, at - first, at)
            if rec is None:
                why = record_problem(buf, at - first, at) or f"invalid record at {at}"
                if on_damage is None:
                    raise CorruptRecordError(why)
                on_damage(at, why)
                continue
            apply(rec)
        n += len(headers)
        if headers:  # every record before the last one's end is applied (they come in commit-log order)
            idx.replay_end = headers[-1][H_OFFSET] + headers[-1][H_SIZE]
        if n >= next_yield:
            yield n
            next_yield = n + batch
    yield n
