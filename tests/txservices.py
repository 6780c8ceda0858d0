"""The transaction services on a real Store, built as BrokerCore.open builds them: no core, no server, no sockets.

``tx_services(data_dir, clock)`` opens a Store in data_dir and assembles
the topic table, the metrics, the Flusher, the Appender and the four
transaction services (TransactionService, CheckService, TransactionAdmin,
IndexKeeper) with the collaborators BrokerCore.open hands them
(broker/core.py). It starts the flusher and the keeper as Broker.start
does, waits until the index is built, and on the way out stops them in
Broker.stop's order: the keeper (the check service, then the last index
flush), the appender, the flusher, the store.

The check service's own loop runs with an hour's interval: a test runs a
pass itself (``svc.check.run_pass()``) after moving the clock, a
ManualClock that the store's record times read too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator

from txmq import wire
from txmq.broker.appender import Appender
from txmq.broker.clock import ManualClock
from txmq.broker.config import FRAME_OVERHEAD, BrokerConfig, CheckSettings
from txmq.broker.flush import DiskState, Flusher
from txmq.broker.metrics import Metrics
from txmq.broker.registry import ClientRegistry
from txmq.broker.topics import TopicTable
from txmq.broker.transactions.admin import TransactionAdmin
from txmq.broker.transactions.check import CheckProgress, CheckService
from txmq.broker.transactions.index import Decided, TxIndex, rebuild
from txmq.broker.transactions.keeper import IndexKeeper
from txmq.broker.transactions.service import TransactionService
from txmq.constants import PROP_PGROUP, PROP_TRAN_MSG
from txmq.store import Record, RecoveryReport, Store, StoreConfig, StoreFullError
from txmq.wire import ErrorCode, TxmqError

G = "shop"
T = "orders"


class FakeProducer:
    """A live producer connection as the check service sees one (``registry.PushTarget``): it keeps what is pushed to it."""

    _ids = itertools.count(1)

    def __init__(self, writable: bool = True) -> None:
        self.conn_id = next(self._ids)
        self.open = writable
        self.frames: list[wire.Frame] = []
        self._decoder = wire.FrameDecoder()

    takes_frames = True

    def writable(self) -> bool:
        return self.open

    def push(self, op: str, fields: dict) -> None:
        self.frames.append(wire.Frame(wire.PUSH, 0, op, fields))

    def send_frame(self, frame: bytes) -> None:
        self.frames += [wire.parse_payload(p) for p in self._decoder.feed(frame)]

    def check_backs(self) -> list[dict[str, Any]]:
        """The fields of every ``check_transaction`` pushed so far, taken off the connection."""
        out = [f.fields for f in self.frames if f.op == "check_transaction"]
        self.frames.clear()
        return out


@dataclass
class TxServices:
    data_dir: Path
    clock: ManualClock
    store: Store
    recovery: RecoveryReport
    topics: TopicTable
    metrics: Metrics
    disk: DiskState
    flusher: Flusher
    appender: Appender
    producers: ClientRegistry
    tx: TransactionService
    check: CheckService
    admin: TransactionAdmin
    keeper: IndexKeeper

    # ---- what a producer does, as the handlers call the services -------------------
    async def send_half(self, body: bytes = b"order-1", group: str = G, topic: str = T, **props: str) -> dict[str, Any]:
        return await self.tx.send_half(topic, None, body, {PROP_TRAN_MSG: "true", PROP_PGROUP: group, **props}, int(self.clock() * 1000))

    def end(self, h: dict[str, Any], state: str, source: str = "producer", group: str = G) -> asyncio.Future:
        """end_transaction naming the half copy of h (a send_half reply or a check-back's fields), submitted now.

        A future in every case (``unknown`` answers at once): await it for the reply.
        """
        r = self.tx.end_transaction(group, h["tx_id"], h["commit_log_offset"], h["half_offset"], state, source)
        if isinstance(r, asyncio.Future):
            return r
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(r)
        return fut

    # ---- what a consumer and an operator see ---------------------------------------------
    def visible(self, topic: str = T) -> list[Record]:
        """Every record in the topic's consume queues: what its consumers get."""
        out: list[Record] = []
        for q in range(self.topics.queues(topic) or 0):
            out += self.store.get_messages(topic, q, 0, 1000).records
        return out

    def queue(self, topic: str) -> list[Record]:
        """The records of a system topic's queue 0, in order."""
        return self.store.get_messages(topic, 0, 0, 1000).records

    def rebuilt(self) -> TxIndex:
        """The index as a start with no index file computes it: from the log alone."""
        return rebuild(self.store)

    def label(self, tx_id: str) -> str | None:
        out = self.tx.index.outcome(tx_id)
        return None if out is None else out.label


def _as_wire_error(exc: BaseException) -> TxmqError:
    """What BrokerCore.store_error makes of a failed write, without its logging and counters."""
    if isinstance(exc, TxmqError):
        return exc
    if isinstance(exc, StoreFullError):
        return TxmqError("store full", ErrorCode.STORE_FULL)
    return TxmqError(f"store error: {exc}", ErrorCode.STORE_ERROR)


def _no_long_polls(_msgs) -> None:
    """LongPolls.notify (broker/longpoll.py) wakes the long polls on the queues written: there are none here."""


@contextlib.asynccontextmanager
async def tx_services(data_dir: Path, clock: ManualClock, *, flush: str = "async", **check: float) -> AsyncIterator[TxServices]:
    """The transaction services on a Store in data_dir, ready (the index built); stopped cleanly on exit.

    ``check``: check settings (transaction_timeout_s, max_checks,
    retention_s, check_interval_s), as start options; the check interval is
    an hour unless given. The other values are BrokerConfig's defaults.
    """
    config = BrokerConfig(data_dir=Path(data_dir), flush=flush)
    settings = CheckSettings(check_interval_s=3600.0)
    for key, value in check.items():
        settings = settings.with_value(key, value)
    data_dir = config.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(
        data_dir,
        StoreConfig(segment_size=config.segment_size, cq_entries_per_file=config.cq_entries_per_file, retention_s=settings.retention_s),
        clock=clock,
    )
    recovery = store.open()
    try:
        topics = TopicTable(data_dir / "topics.json", config.default_queues)
        topics.merge_from_store(store.queues())
        metrics = Metrics()
        disk = DiskState()
        flusher = Flusher(
            store,
            sync=flush == "sync",
            interval_s=config.flush_interval_s,
            observe=metrics.flush.observe,
            observe_checkpoint=metrics.checkpoint.observe,
            disk=disk,
            count_error=partial(metrics.inc, "flush_errors"),
        )
        appender = Appender(store, flusher, metrics, _no_long_polls, _as_wire_error)
        producers = ClientRegistry()
        tx = TransactionService(appender, store, topics, flusher, metrics, clock)
        check_service = CheckService(
            tx,
            appender,
            store,
            flusher,
            metrics,
            clock,
            producers,
            disk,
            CheckProgress(data_dir / "txcheck.json", repair=True),
            data_dir / "config.json",
            settings,
            config.check_batch,
            stored={},
        )
        admin = TransactionAdmin(tx, check_service, store, metrics, clock, producers)
        keeper = IndexKeeper(
            tx, check_service, store, flusher, disk, metrics, data_dir, recovery, config.max_body + config.max_properties + FRAME_OVERHEAD
        )
    except BaseException:
        store.close()
        raise
    flusher.start()  # BrokerCore.start: the services' waits for durability need its loop
    keeper.start(time.perf_counter())
    try:
        await keeper.ready.wait()
        if keeper.error is not None:
            raise keeper.error
        yield TxServices(data_dir, clock, store, recovery, topics, metrics, disk, flusher, appender, producers, tx, check_service, admin, keeper)
    finally:
        await keeper.stop()
        appender.close()
        await flusher.stop()
        store.close()


async def agreed(svc: TxServices, tx_id: str) -> Decided:
    """tx_id's decision, once the index in memory, the index file and a rebuild from the log are seen to hold the same one."""
    live = svc.tx.index.lookup(tx_id)
    from_log = svc.rebuilt().lookup(tx_id)
    await svc.keeper.flush()  # the decision goes to txindex.db and leaves memory
    assert tx_id not in svc.tx.index.decided
    from_file = svc.tx.index.lookup(tx_id)
    assert live is not None and from_log is not None and from_file is not None, (live, from_log, from_file)
    seen = {(d.outcome, d.decided_by, d.cl_offset) for d in (live, from_log, from_file)}
    assert len(seen) == 1, f"memory {live}, log {from_log}, index file {from_file}"
    return live
