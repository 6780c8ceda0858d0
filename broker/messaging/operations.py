"""The operator's side of the broker, as the front ends that serve operators call it (the native protocol's
``txmq`` commands, RocketMQ 4's ``mqadmin`` request codes).

Each call is the broker service's own (the transaction admin, the check
service, the schedule, broker/groups.py, the core's topics and
statistics): this is the one door to them for a front end, so that none
reaches into the core. The replies are the documented native replies
(docs/protocol.md); a front end for another protocol words them in its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from .. import groups
from ..transactions.history import DEFAULT_MAX_SCAN

if TYPE_CHECKING:
    from ..config import CheckSettings


class Operations:
    """What an operator may ask of the broker; built by the core beside ``Messaging``."""

    HISTORY_SCAN = DEFAULT_MAX_SCAN  # records a transaction's history reads at most, unless asked otherwise
    FIND_SCAN, FIND_MAX_SCAN = groups.DEFAULT_SCAN, groups.MAX_SCAN  # the same for a message search by key

    def __init__(self, core: Any) -> None:  # BrokerCore (not imported: it imports this module)
        self._core = core

    # ---- the index gate ------------------------------------------------------------------------------------------
    def after_index(self, call: Callable[[], Any]) -> Any:
        """Run ``call`` now, or, right after a start while the transaction index is built, once it is (in arrival
        order): what every operation on transactions waits for."""
        keeper = self._core.keeper
        return keeper.when_ready(call) if keeper.must_wait() else call()

    # ---- the broker -----------------------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        return self._core.info()

    def stats(self) -> Awaitable[dict[str, Any]]:
        return self._core.stats()

    @property
    def data_dir(self) -> Path:
        return self._core.data_dir

    def pending_transactions(self) -> int:
        return len(self._core.tx.index.pending)

    async def persist_offsets(self) -> None:
        """Wait until the consumer offsets committed so far are on disk."""
        await self._core.flusher.wait_persisted()

    # ---- topics --------------------------------------------------------------------------------------------------
    def list_topics(self, system: bool) -> list[dict[str, Any]]:
        return self._core.list_topics(system)

    def describe_topic(self, topic: str) -> Awaitable[dict[str, Any]]:
        return self._core.describe_topic(topic)

    def queue_offsets(self, names: list[str], time_ms: int | None) -> list[dict[str, Any]]:
        """Every queue's [min_offset, max_offset) of the named topics, and with ``time_ms`` each one's offset of the
        first message stored at or after it."""
        core = self._core
        table = core.topics.all()
        rows = []
        for name in names:
            queues = []
            for q in range(table.get(name, 0)):
                lo, hi = groups.queue_bounds(core, name, q)
                row = {"queue_id": q, "min_offset": lo, "max_offset": hi}
                if time_ms is not None:
                    row["time_offset"] = groups.offset_for_time(core, name, q, time_ms)
                queues.append(row)
            rows.append({"topic": name, "queues": queues})
        return rows

    def read_raw(self, topic: str, queue_id: int, offset: int, max_count: int, max_bytes: int) -> tuple[bytes, int] | None:
        """A queue's records as stored, back to back, each checked (CRC, offsets), and their count; None when anything is
        not plain (the usual pull then answers, and reports, repairs or skips it)."""
        return self._core.store.read_queue_raw(topic, queue_id, offset, max_count, max_bytes)

    def count_pulled(self, n: int) -> None:
        self._core.metrics.inc("messages_pulled", n)

    # ---- consumer groups (broker/groups.py) ---------------------------------------------------------------------
    def list_groups(self) -> dict[str, Any]:
        return groups.list_groups(self._core)

    def describe_group(self, group: str, topic: str | None) -> dict[str, Any]:
        return groups.describe_group(self._core, group, topic)

    def reset_offsets(self, group: str, topic: str, to: str, offset: int | None, time_ms: int | None, queue_ids: list[int] | None,
                      dry_run: bool, force: bool) -> Awaitable[dict[str, Any]]:
        return groups.reset_offsets(self._core, group, topic, to, offset, time_ms, queue_ids, dry_run, force)

    def update_group(self, group: str, fifo: bool | None) -> dict[str, Any]:
        return groups.update_group(self._core, group, fifo)

    def offsets_for_time(self, topic: str, time_ms: int, queue_ids: list[int] | None) -> dict[str, Any]:
        return groups.offsets_for_time(self._core, topic, time_ms, queue_ids)

    def get_message(self, msg_id: str | None, cl_offset: int | None) -> dict[str, Any]:
        return groups.get_message(self._core, msg_id, cl_offset)

    def find_messages(self, key: str, topic: str | None, since_ms: int, until_ms: int | None, limit: int,
                      scan: int) -> Awaitable[dict[str, Any]]:
        return groups.find_messages(self._core, key, topic, since_ms, until_ms, limit, scan)

    # ---- transactions (broker/transactions/admin.py, check.py) ---------------------------------------------------
    def pending_rows(self, *args: Any) -> Any:
        """The pending transactions' rows (``txmq inspect half``): TransactionAdmin.pending_rows' arguments."""
        return self._core.admin.pending_rows(*args)

    @property
    def next_check_at(self) -> Any:
        return self._core.check.next_check_at

    def tx_offsets(self) -> dict[str, Any]:
        return self._core.admin.offsets()

    def history(self, *args: Any) -> Any:
        return self._core.admin.history(*args)

    def resolve(self, action: str, refs: list, dry_run: bool) -> Awaitable[list]:
        return self._core.admin.resolve(action, refs, dry_run)

    def resolve_where(self, action: str, *args: Any) -> Awaitable[tuple[list, Any]]:
        return self._core.admin.resolve_where(action, *args)

    def check_now(self, tx_id: str) -> Any:
        return self._core.check.check_now(tx_id)

    def discarded(self, limit: int, after: int) -> list:
        return self._core.admin.discarded(limit, after)

    def replay(self, to: str | None, refs: list, all_: bool, dry_run: bool) -> Awaitable[list]:
        return self._core.admin.replay(to, refs, all_, dry_run)

    def outcomes_known_since(self) -> Any:
        return self._core.admin.outcomes_known_since()

    # ---- the check service's settings (`txmq config`) ------------------------------------------------------------
    @property
    def check_settings(self) -> CheckSettings:
        return self._core.check.settings

    def preview_setting(self, key: str, value: Any) -> Any:
        """What setting ``key`` to ``value`` would discard (``txmq config set --dry-run``)."""
        return self._core.check.preview(key, value)

    def set_setting(self, key: str, value: Any) -> tuple[Any, Any]:
        """Set a check setting live and store it in config.json: (old, new)."""
        return self._core.check.set(key, value)

    # ---- scheduled messages -----------------------------------------------------------------------------------------
    def cancel_scheduled(self, msg_id: str, topic: str | None) -> Awaitable[dict[str, Any]]:
        return self._core.scheduled.cancel(msg_id, topic)

    def list_scheduled(self, topic: str | None, after: tuple[int, int] | None, limit: int, bodies: bool) -> Any:
        return self._core.scheduled.listing(topic, after, limit, bodies)

    # ---- for the RocketMQ 4 front end ----
    def unflushed_bytes(self) -> int:
        """Bytes of the commit log written but not yet on disk (RocketMQ's remainHowManyDataToFlush)."""
        store = self._core.store
        return max(0, store.max_offset - store.durable_offset)
