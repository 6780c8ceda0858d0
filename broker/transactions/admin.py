"""The operator's transaction operations: resolve, resolve-where, the discard topic, pending listings, history.

Every decision goes through ``TransactionService.decide`` and every record
through the service's appends, so the index is changed in one place
(broker/transactions/service.py); this module finds transactions and shapes
the operator's rows (docs/transactions.md, "Deciding" and "The discard topic and replay").
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from txmq.constants import HALF_TOPIC, OP_TOPIC, PROP_ORIGIN_CL_OFFSET, PROP_UNIQ_KEY
from txmq.store import CorruptRecordError, Record, Store, StoreError
from txmq.wire import ErrorCode, TxmqError

from .history import History, find_tx_id, held_by
from .ids import canonical
from .index import Decided, Outcome, PendingTx, TxIndex

if TYPE_CHECKING:
    from ..clock import Clock
    from ..metrics import Metrics
    from ..registry import ClientRegistry
    from .check import CheckService
    from .service import TransactionService

log = logging.getLogger("txmq.tx")


class TransactionAdmin:
    """What ``txmq resolve``, ``txmq discard``, ``txmq inspect pending`` and ``config get`` ask of the transactions."""

    def __init__(self, tx: TransactionService, check: CheckService, store: Store, metrics: Metrics, clock: Clock,
                 producers: ClientRegistry) -> None:
        self.tx = tx
        self.check = check
        self.store = store
        self.metrics = metrics
        self.clock = clock
        self.producers = producers  # how many are online, for what holds the progress back

    @property
    def index(self) -> TxIndex:
        """The service's index (the broker swaps in the file-backed one once it is built)."""
        return self.tx.index

    def outcomes_known_since(self) -> int | None:
        """When the oldest record still in the log was stored (ms): outcomes are on record for transactions since then.

        Retention deletes a transaction's records and its row in the index
        file together (never while it is pending).
        """
        store = self.store
        if store.min_offset >= store.max_offset:
            return None
        try:
            return store.read(store.min_offset).store_ts
        except (CorruptRecordError, StoreError, ValueError):
            return None

    # ---- operator: resolve -------------------------------------------------
    def find(self, ref: dict[str, Any]) -> Record:
        """The half record a REF names: tx_id, half_offset, or commit_log_offset."""
        idx = self.index
        if ref.get("tx_id") is not None:
            tx_id = canonical(idx, str(ref["tx_id"]))
            p = idx.pending.get(tx_id)
            if p is not None:
                return self.tx.read_half(p.cl_offset)
            d = idx.lookup(tx_id)
            if d is None:
                raise TxmqError(f"no transaction with id {tx_id} (never stored, or deleted by retention)", ErrorCode.TX_NOT_FOUND)
            if d.outcome is Outcome.DISCARDED:
                raise TxmqError(f"transaction {tx_id} was discarded; use `txmq discard replay`", ErrorCode.TX_CONFLICT, outcome=d.outcome.label)
            return self._decided_half(tx_id, d)
        if ref.get("commit_log_offset") is not None:
            return self.tx.read_half(int(ref["commit_log_offset"]))
        if ref.get("half_offset") is not None:
            ho = int(ref["half_offset"])
            entries = self.store.cq_entries(HALF_TOPIC, 0, ho, 1)
            if not entries:
                raise TxmqError(f"no half message at half offset {ho}", ErrorCode.TX_NOT_FOUND)
            return self.tx.read_half(entries[0][0])
        raise TxmqError("a ref needs tx_id, half_offset or commit_log_offset", ErrorCode.INVALID_FIELD)

    def _decided_half(self, tx_id: str, d: Decided) -> Record:
        entries = self.store.cq_entries(HALF_TOPIC, 0, d.half_offset, 1)
        if entries:
            try:
                rec = self.tx.read_half(entries[0][0])
                if rec.properties.get(PROP_UNIQ_KEY) == tx_id:
                    return rec
            except TxmqError:
                pass
        raise _AlreadyDecided(d)

    async def resolve(self, action: str, refs: list[dict[str, Any]], dry_run: bool) -> list[dict[str, Any]]:
        commit = action == "commit"
        out = []
        for i, ref in enumerate(refs):
            if i % 256 == 255:  # refs that need no write (not found, dry run, decided) never await: serve others
                await asyncio.sleep(0)
            row: dict[str, Any] = {"ref": ref, "tx_id": ref.get("tx_id")}
            try:
                rec = self.find(ref)
                row["tx_id"] = tx_id = rec.properties[PROP_UNIQ_KEY]
                d = None if tx_id in self.index.pending else self.index.lookup(tx_id)
                if dry_run:
                    row.update(self._dry(d, commit, tx_id))
                else:
                    r = await self.tx.decide(rec, commit, "operator")
                    row.update(status="ok" if r["status"] == "ok" else "already",
                               message=f"{'committed' if commit else 'rolled back'}" if r["status"] == "ok" else f"already {r['outcome'].replace('_', ' ')}")
            except _AlreadyDecided as e:
                same = e.d.outcome is (Outcome.COMMITTED if commit else Outcome.ROLLED_BACK)
                row.update(status="already" if same else "conflict", message=f"already {e.d.outcome.label.replace('_', ' ')}")
            except TxmqError as e:
                row.update(status={ErrorCode.TX_CONFLICT: "conflict", ErrorCode.TX_NOT_FOUND: "not_found"}.get(e.code, "error"), message=e.message)
            out.append(row)
        return out

    async def resolve_where(self, action: str, group: str, topic: str | None, min_age_ms: int, after: int, limit: int,
                            dry_run: bool) -> tuple[list[dict[str, Any]], int | None]:
        """Decide up to `limit` pending transactions of `group` (by half offset above `after`) as they are now.

        Returns their results (as ``resolve``'s, each ``ref`` its tx id) once
        every decision is durable, and the cursor for the next batch (None
        when this batch was the last). The decisions of one batch go to the
        log together (group commit), not one fsync each.
        """
        page = self.matching(group, topic, min_age_ms, after, limit)
        cursor = page[-1].half_offset if len(page) >= limit else None
        results = await asyncio.gather(*(self.resolve(action, [{"tx_id": p.tx_id}], dry_run) for p in page))
        return [dict(r[0], ref=r[0]["tx_id"]) for r in results], cursor

    @staticmethod
    def _dry(d: Decided | None, commit: bool, tx_id: str) -> dict[str, Any]:
        if d is None:
            return {"status": "ok", "message": f"would {'commit' if commit else 'roll back'} (dry run)"}
        same = d.outcome is (Outcome.COMMITTED if commit else Outcome.ROLLED_BACK)
        return {"status": "already" if same else "conflict", "message": f"already {d.outcome.label.replace('_', ' ')}"}

    # ---- operator: the discard topic ---------------------------------------
    def discarded(self, limit: int, after: int = -1) -> list[dict[str, Any]]:
        return [{"tx_id": tx_id, "topic": d.topic, "group": d.group, "checks": d.checks,
                 "discarded_at": d.decided_at, "discard_offset": d.discard_offset,
                 "reason": d.decided_by, "commit_log_offset": d.cl_offset}
                for tx_id, d in self.index.discarded_rows(limit, after)]

    async def replay(self, to: str, refs: list[dict[str, Any]] | None, all_: bool, dry_run: bool) -> list[dict[str, Any]]:
        if all_:
            refs = [{"tx_id": r["tx_id"]} for r in self.discarded(10**9)]
        out = []
        for ref in refs or []:
            row: dict[str, Any] = {"ref": ref, "tx_id": ref.get("tx_id")}
            try:
                tx_id, d = self._find_discarded(ref)
                row["tx_id"] = tx_id
                if d is None or d.outcome is not Outcome.DISCARDED:
                    state = self.index.outcome(tx_id)
                    row.update(status="conflict", message=f"not in the discard topic (it is {state.label if state is not None else 'unknown'})")
                elif dry_run:
                    row.update(status="ok", message=f"would replay to {to} (dry run)")
                else:
                    try:
                        rec = self.store.read(d.cl_offset)
                    except (CorruptRecordError, StoreError, ValueError):
                        raise TxmqError(f"the discard record of {tx_id} at {d.cl_offset} is gone (retention)", ErrorCode.TX_NOT_FOUND) from None
                    if to == "half":
                        await self.tx.replay_half(rec, d.cl_offset)
                    else:
                        await self.tx.replay_commit(rec, d.cl_offset, self._half_of_discard(rec))
                    self.metrics.inc("replayed")
                    log.info("event=discard_replay tx_id=%s to=%s", tx_id, to)
                    row.update(status="ok", message=f"replayed to {to}")
            except TxmqError as e:
                row.update(status={ErrorCode.TX_CONFLICT: "conflict", ErrorCode.TX_NOT_FOUND: "not_found"}.get(e.code, "error"), message=e.message)
            out.append(row)
        return out

    def _half_of_discard(self, rec: Record) -> Record:
        """The half record a discard record was copied from (so the op names a half offset)."""
        origin = rec.properties.get(PROP_ORIGIN_CL_OFFSET)
        if origin is not None:
            try:
                half = self.tx.read_half(int(origin))
                if half.properties.get(PROP_UNIQ_KEY) == rec.properties.get(PROP_UNIQ_KEY):
                    return half
            except (TxmqError, ValueError):
                pass  # deleted by retention: commit from the discard copy itself
        return rec

    def _find_discarded(self, ref: dict[str, Any]) -> tuple[str, Decided | None]:
        if ref.get("tx_id") is not None:
            tx_id = canonical(self.index, str(ref["tx_id"]))
            if tx_id in self.index.pending:
                return tx_id, None
            d = self.index.lookup(tx_id)
            if d is None:
                raise TxmqError(f"no transaction with id {tx_id}", ErrorCode.TX_NOT_FOUND)
            return tx_id, d
        if ref.get("discard_offset") is not None:
            off = int(ref["discard_offset"])
            found = self.index.discarded_at(off)
            if found is not None:
                return found
            raise TxmqError(f"no discarded transaction at discard offset {off}", ErrorCode.TX_NOT_FOUND)
        raise TxmqError("a ref needs tx_id or discard_offset", ErrorCode.INVALID_FIELD)

    # ---- inspection ----------------------------------------------------------
    def offsets(self) -> dict[str, Any]:
        """The check progress and the queues' ends (``txmq inspect offsets``), with what holds the half progress back."""
        progress, idx = self.check.progress, self.index
        half_max = self.store.queue_max_offset(HALF_TOPIC, 0)
        return {"half": {"progress": progress.half, "max": half_max},
                "op": {"progress": progress.op, "max": self.store.queue_max_offset(OP_TOPIC, 0)},
                "pending": len(idx.pending), "discarded": idx.discarded,
                "held_by": held_by(idx, progress.half, half_max, int(self.clock() * 1000), self.check.settings.transaction_timeout_s,
                                   self.producers.online)}

    def history(self, tx_id: str | None, half_offset: int | None, cl_offset: int | None, max_scan: int, summary: bool) -> History | None:
        """The history of the transaction one of the references names (``txmq tx history``), or None when none names one.

        Nothing is read yet: run its bounded scan with ``History.steps()``.
        """
        found = find_tx_id(self.store, None if tx_id is None else canonical(self.index, tx_id), half_offset, cl_offset)
        if found is None:
            return None
        return History(self.store, self.index, found, int(self.clock() * 1000), max_scan, self.check.next_check_at, summary)

    # ---- listing -----------------------------------------------------------
    def pending_rows(self, group: str | None, topic: str | None, min_age_ms: int, limit: int, next_check,
                     after: int = -1) -> tuple[list[dict[str, Any]], int, int | None]:
        """A page of pending transactions by half offset above ``after``: (rows, total matching, cursor or None at the end)."""
        now_ms = int(self.clock() * 1000)
        page = self.matching(group, topic, min_age_ms, after, limit + 1)
        rows = [p.as_dict(now_ms, next_check(p)) for p in page[:limit]]
        total = sum(1 for _ in self._matching_iter(group, topic, min_age_ms, -1, now_ms))
        return rows, total, (page[limit - 1].half_offset if len(page) > limit else None)

    def matching(self, group: str | None, topic: str | None, min_age_ms: int, after: int, limit: int) -> list[PendingTx]:
        """At most limit pending transactions matching, by half offset above ``after`` (the index keeps them in that order)."""
        now_ms = int(self.clock() * 1000)
        out: list[PendingTx] = []
        for p in self._matching_iter(group, topic, min_age_ms, after, now_ms):
            out.append(p)
            if len(out) >= limit:
                break
        return out

    def _matching_iter(self, group: str | None, topic: str | None, min_age_ms: int, after: int, now_ms: int):
        pending = self.index.pending
        for half_offset, tx_id in self.index.by_half.items():
            if half_offset <= after:
                continue
            p = pending.get(tx_id)
            if p is None:
                continue
            if group and p.group != group:
                continue
            if topic and p.topic != topic:
                continue
            if min_age_ms and p.age_ms(now_ms) < min_age_ms:  # the broker's store time, not the producer's clock
                continue
            yield p


class _AlreadyDecided(Exception):
    def __init__(self, d: Decided) -> None:
        self.d = d
