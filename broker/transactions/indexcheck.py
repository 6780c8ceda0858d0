"""The index file checked against the commit log, row by row (``txmq store verify``).

A lookup checks the checksum of the row it reads, and a start, in a time
that does not grow with the history, the checksums of the pending rows, of
the newest and of a sample of the others (``TxDatabase.check_rows``), and
the last few thousand decisions of the log against their rows
(``check_decisions`` from a late op-queue offset). ``txmq store verify``
walks the whole file and the whole op queue:

- every row: its checksum, and the record it names as its latest copy
  (pending) or as deciding it (committed, rolled back, discarded) is that
  transaction's record of that kind, at the offsets the row says;
- every commit or rollback op record below ``applied_to``: its transaction's
  row holds that outcome (a row lost, or one whose state changed, would let
  the broker take the committed transaction's id as new).

Synchronous and read-only: a Store or StoreReader, and a TxDatabase.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator

from txmq.constants import (
    DISCARD_TOPIC,
    HALF_TOPIC,
    OP_TOPIC,
    PROP_DECIDED_BY,
    PROP_DISCARD_REASON,
    PROP_HALF_CL_OFFSET,
    PROP_ORIGIN_CL_OFFSET,
    PROP_PGROUP,
    PROP_REAL_TOPIC,
    PROP_UNIQ_KEY,
)
from txmq.store import Record, TxType, decode_record
from txmq.store.bulk import raw_queue_runs
from txmq.store.codec import H_OFFSET

from .index import Outcome, _int, _stored
from .indexfile import DamagedRow, TxDatabase

_KIND = {HALF_TOPIC: "half", OP_TOPIC: "op", DISCARD_TOPIC: "discard"}


def row_problem(store, row: tuple, rec: Record | None = None, low: int | None = None) -> str | None:
    """Why a row (``COLUMNS``) disagrees with the record it names; None when it agrees, or that record is gone with retention.

    ``rec``: that record, read already; ``low``: the log's first offset, known already.
    """
    origin, tx_id, state, decided_at, decided_by, half_offset, cl_offset, group, topic, _checks, _pending = row
    if not isinstance(cl_offset, int) or cl_offset < (store.min_offset if low is None else low):
        return None if isinstance(cl_offset, int) else f"offset {cl_offset!r} is not a number"
    rec = rec or _stored(store, cl_offset)
    if rec is None:
        return f"no stored record starts at its offset {cl_offset}"
    props = rec.properties
    kind = _KIND.get(rec.topic, rec.topic)
    if kind == "op":
        kind = f"op ({rec.tx_type.name.lower()})"
    what = f"the record at {cl_offset} is a{'n' if kind.startswith('op') else ''} {kind} record"
    if props.get(PROP_UNIQ_KEY) != tx_id:
        return f"{what} of transaction {props.get(PROP_UNIQ_KEY)!r}"
    if state == Outcome.PENDING:
        if rec.topic != HALF_TOPIC:
            return f"pending, and {what}"
        if rec.queue_offset != half_offset:
            return f"its half offset is {half_offset}, and {what} at half offset {rec.queue_offset}"
        first = _int(props.get(PROP_ORIGIN_CL_OFFSET), cl_offset)
        if first != origin:
            return f"its first copy is at {origin}, and {what} whose first copy is at {first}"
    elif state in (Outcome.COMMITTED, Outcome.ROLLED_BACK):
        label = Outcome(state).label.replace("_", " ")
        want = TxType.COMMIT if state == Outcome.COMMITTED else TxType.ROLLBACK
        if rec.topic != OP_TOPIC or rec.tx_type != want:
            return f"{label}, and {what}"
        named = _int(rec.body.decode("ascii", "replace") if rec.body else None, -1)
        if named != half_offset:
            return f"its half offset is {half_offset}, and {what} naming half offset {named}"
        if decided_by != props.get(PROP_DECIDED_BY, "producer"):
            return f"decided by {decided_by!r}, and {what} decided by {props.get(PROP_DECIDED_BY, 'producer')!r}"
    elif state == Outcome.DISCARDED:
        if rec.topic != DISCARD_TOPIC:
            return f"discarded, and {what}"
        if rec.queue_offset != half_offset:
            return f"its discard offset is {half_offset}, and {what} at discard offset {rec.queue_offset}"
        if decided_by != props.get(PROP_DISCARD_REASON, "max-checks"):
            return f"discarded for {decided_by!r}, and {what} for {props.get(PROP_DISCARD_REASON, 'max-checks')!r}"
    else:
        return f"state {state!r} is none of 0 (pending), 1, 2, 3"
    if state != Outcome.PENDING and decided_at != rec.store_ts:
        return f"decided at {decided_at}, and {what} stored at {rec.store_ts}"
    if group != props.get(PROP_PGROUP, "") or topic != props.get(PROP_REAL_TOPIC, ""):
        return f"group {group!r} and topic {topic!r}, and {what} of group {props.get(PROP_PGROUP, '')!r} and topic {props.get(PROP_REAL_TOPIC, '')!r}"
    return None


def check_rows(db: TxDatabase, store, skip: Callable[[int], bool] = lambda _offset: False,
               batch: int = 1024) -> Iterator[tuple[tuple, str]]:
    """(row, why) for each row that is damaged (checksum) or disagrees with its record.

    ``skip(offset)``: the log is known to be damaged there, so a row naming
    that offset cannot be checked (the log's damage is reported on its own).
    The records of rows whose checksum matches are read ``batch`` at a time
    (their offsets are the ones the broker took from stored records); the
    others one by one, each checked against its consume-queue entry (an
    offset that is not a record's start could hold one forged in a body).
    """
    rows = db.rows()
    while True:
        part = list(itertools.islice(rows, batch))
        if not part:
            return
        low = store.min_offset
        checked: list[tuple[tuple, str | None]] = []
        for stored in part:
            try:
                checked.append((db.checked(stored), None))
            except DamagedRow as exc:
                checked.append((exc.row, "checksum mismatch"))
        vouched = [r[6] for r, why in checked if why is None and db.checksums and isinstance(r[6], int) and r[6] >= low and not skip(r[6])]
        try:
            records = dict(zip(vouched, store.read_many(vouched))) if vouched else {}
        except Exception:  # noqa: BLE001 - one of them does not read back: each is read on its own below
            records = {}
        for row, why in checked:
            if isinstance(row[6], int) and skip(row[6]):
                if why is not None:
                    yield row, why
                continue
            disagrees = row_problem(store, row, records.get(row[6]) if why is None else None, low)
            if why is not None or disagrees is not None:
                yield row, why if disagrees is None else disagrees if why is None else f"{why}: {disagrees}"


def check_decisions(db: TxDatabase, store, applied_to: int, log_min: int, counts: dict[str, int] | None = None,
                    first: int = 0, damaged_rows: bool = False) -> Iterator[tuple[int, str, str]]:
    """(offset, tx_id, why) for each commit or rollback op record below applied_to whose transaction's row does not hold it.

    From the op queue's offset ``first`` on (a start checks the last few
    thousand decisions before ``applied_to``: those a producer's resend is
    likely to meet; ``txmq store verify`` every one).

    A commit or rollback is final (a later discard record does not change
    it), so the row must say so. Rows of transactions whose first copy was
    below ``log_min`` were deleted with retention; a row whose first copy is
    after the op record's half copy is a later transaction's with the same id.
    ``counts["decisions"]`` counts the op records checked. A damaged row
    met is passed over (``check_rows`` reports it), or with ``damaged_rows``
    reported here too.
    """
    counts = {} if counts is None else counts
    counts.setdefault("decisions", 0)
    queues = [(OP_TOPIC, 0, max(first, store.queue_min_offset(OP_TOPIC, 0)))]
    for buf, _mv, base, headers in raw_queue_runs(store, queues, on_damage=lambda _offset, _why: None):
        for h in headers:
            at = h[H_OFFSET]
            if at >= applied_to:
                return
            rec = decode_record(buf, at - base, at)
            if rec is None or rec.tx_type not in (TxType.COMMIT, TxType.ROLLBACK):
                continue
            tx_id = rec.properties.get(PROP_UNIQ_KEY)
            if not tx_id:
                continue
            counts["decisions"] += 1
            want = Outcome.COMMITTED if rec.tx_type == TxType.COMMIT else Outcome.ROLLED_BACK
            half = _int(rec.properties.get(PROP_HALF_CL_OFFSET), rec.prepared_offset)
            try:
                row = db.by_tx_id(tx_id)
            except DamagedRow as exc:
                if damaged_rows:
                    yield at, tx_id, str(exc)
                continue
            if row is None:
                copy = _stored(store, half)
                if copy is None or copy.properties.get(PROP_UNIQ_KEY) != tx_id:
                    continue  # its half copy is gone with retention (or damaged): whether its row was pruned is not known
                origin = _int(copy.properties.get(PROP_ORIGIN_CL_OFFSET), half)
                if origin >= log_min:
                    yield at, tx_id, f"its {want.label.replace('_', ' ')} op record is at {at}, and no row holds the transaction"
            elif row[0] <= half and row[2] != want:
                state = Outcome(row[2]).label.replace("_", " ") if row[2] in (0, 1, 2, 3) else f"state {row[2]!r}"
                yield at, tx_id, f"its {want.label.replace('_', ' ')} op record is at {at}, and its row says {state}"
