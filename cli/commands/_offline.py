"""Reading a data directory directly (`--data-dir`), read-only, so inspect works while the broker is down.

The transaction index is read as the broker reads it at start: the pending
rows of the index file (``txindex.db``, opened read-only) plus the
transactional records written after its last flush; decided transactions
are looked up in the file. With no usable index file, every transactional
record is read into memory instead (txmq.broker.transactions.index.rebuild).
What only a running broker knows (when the last check was sent and what it
got back, when the next pass runs) is null here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .. import exitcodes
from ..common import CliError


class DataDir:
    def __init__(self, path: Path) -> None:
        if not (path / "commitlog").is_dir():
            raise CliError(f"{path} is not a txmq data directory (no commitlog/ in it)", exitcodes.NOT_FOUND)
        from txmq.broker.transactions.check import CheckProgress
        from txmq.store import StoreReader

        self.path = path
        try:
            self.reader = StoreReader(path)
        except OSError as e:
            raise CliError(f"cannot read {path}: {e.strerror or e}", exitcodes.ERROR) from None
        self._check_log()
        self.progress = CheckProgress(path / "txcheck.json")
        self._index: Any = None

    def _check_log(self) -> None:
        """Say so when the log holds bytes that are not valid records; refuse when it holds nothing else."""
        from ..console import warn

        first, last, valid_end = self.reader.min_offset, self.reader.files_end, self.reader.max_offset
        if valid_end <= first < last:
            raise CliError(f"{self.path}: the commit log holds {last - first} bytes and not one valid record "
                           f"(damaged, or not a txmq log); `txmq store verify --data-dir {self.path}` says more",
                           exitcodes.DATA_PROBLEM)
        if valid_end < last:
            warn(f"{last - valid_end} bytes after the last valid record at {valid_end} are not read "
                 f"(a torn tail the next broker start cuts, or damage): `txmq store verify --data-dir {self.path}`")

    def __enter__(self) -> "DataDir":
        return self

    def __exit__(self, *exc: object) -> None:
        damage = getattr(self.reader, "damage", None)
        if damage is not None and damage.count:
            from ..console import warn

            warn(f"{damage.count} damaged record(s) skipped while reading, first at "
                 f"{min(damage.places) if damage.places else '?'}: `txmq store verify --data-dir {self.path}`")
        close = getattr(self.reader, "close", None)
        if close is not None:
            close()

    @property
    def index(self) -> Any:
        if self._index is None:
            self._index = load_index(self.path, self.reader)
        return self._index

    def pending(self, group: str | None, topic: str | None, min_age_ms: int, limit: int) -> tuple[list[dict[str, Any]], int]:
        now_ms = int(time.time() * 1000)
        rows = [p for p in self.index.pending.values()
                if (not group or p.group == group) and (not topic or p.topic == topic) and p.age_ms(now_ms) >= min_age_ms]
        rows.sort(key=lambda p: p.half_offset)
        return [p.as_dict(now_ms, None) for p in rows[:limit]], len(rows)

    def offsets(self) -> dict[str, Any]:
        from txmq.broker.transactions.history import held_by
        from txmq.constants import HALF_TOPIC, OP_TOPIC

        idx = self.index
        return {
            "half": {"progress": self.progress.half, "max": self.reader.queue_max_offset(HALF_TOPIC, 0)},
            "op": {"progress": self.progress.op, "max": self.reader.queue_max_offset(OP_TOPIC, 0)},
            "pending": len(idx.pending),
            "discarded": idx.discarded,
            "held_by": held_by(idx, self.progress.half, self.reader.queue_max_offset(HALF_TOPIC, 0), int(time.time() * 1000),
                               self._timeout_s()),
        }

    def _timeout_s(self) -> float:
        """The transaction timeout the broker last stored (config.json), else the default."""
        import json

        from txmq.broker.config import CheckSettings

        try:
            v = json.loads((self.path / "config.json").read_text()).get("transaction_timeout_s")
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
        except (OSError, ValueError, AttributeError):
            pass
        return CheckSettings().transaction_timeout_s

    def history(self, ref: dict[str, Any]) -> dict[str, Any] | None:
        """One transaction's history (txmq.broker.transactions.history), or None when the reference names none."""
        from txmq.broker.transactions.history import find_tx_id, history
        from txmq.broker.transactions.ids import canonical

        named = ref.get("tx_id")
        tx_id = find_tx_id(self.reader, None if named is None else canonical(self.index, named), ref.get("half_offset"),
                           ref.get("commit_log_offset"))
        return None if tx_id is None else history(self.reader, self.index, tx_id, int(time.time() * 1000))

    def queue_bounds(self, topic: str, queue_id: int) -> tuple[int, int]:
        return self.reader.queue_min_offset(topic, queue_id), self.reader.queue_max_offset(topic, queue_id)

    def read(self, topic: str, queue_id: int, offset: int, count: int) -> tuple[list[dict[str, Any]], int]:
        """Up to `count` records from `offset`, as wire message maps, and the next offset."""
        from txmq.broker.core import record_to_map

        res = self.reader.get_messages(topic, queue_id, offset, count, 16 << 20)
        return [record_to_map(r) for r in res.records], res.next_offset


def load_index(path: Path, reader: Any) -> Any:
    """The transaction index of a data directory, from its index file when that fits the log, else from the log alone."""
    from txmq.broker.transactions.indexfile import DB_FILE, IndexFileError, TxDatabase
    from txmq.broker.transactions.index import TxIndex, agrees, rebuild, replay_steps
    from txmq.store.damage import Damage

    def on_damage(offset: int, why: str) -> None:  # skipped, as the broker does; listed when the command ends
        reader.damage.report(Damage(offset, "transaction index", why))

    if (path / DB_FILE).exists():
        try:
            db = TxDatabase(path / DB_FILE, readonly=True)
        except IndexFileError:
            db = None
        if db is not None:
            try:
                db.snapshot()  # rows and meta of one flush, while a broker may be writing
                if agrees(reader, db.meta) is None:
                    idx = TxIndex(db, track=False, store=reader)  # a damaged row's decision is read back from the log
                    idx.load_pending(db.pending_rows())
                    idx.discarded = db.count_discarded()
                    db.end_snapshot()
                    for _ in replay_steps(reader, idx, db.meta["queues"], on_damage=on_damage):
                        pass
                    return idx
                db.end_snapshot()
            except Exception:  # damaged: the log alone answers
                pass
            db.close()
    return rebuild(reader, on_damage=on_damage)
