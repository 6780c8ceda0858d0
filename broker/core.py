"""The transport-independent broker core.

The front ends (broker/native/, broker/rocketmq/) validate their requests
and translate them into these same calls. Every method runs on the event
loop thread; blocking work (fsync) happens in the flusher's thread.

Appends from all connections that arrive in one loop iteration are written
with one store.append (one write syscall) by the Appender, then wait for
durability according to the flush policy.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import defaultdict
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

from txmq import __version__
from txmq.constants import PROP_UNIQ_KEY, is_system_topic
from txmq.store import (
    HEADER_SIZE,
    AppendResult,
    ConsumerOffsets,
    GetResult,
    GetStatus,
    Message,
    RawCopy,
    Record,
    RecordTooLargeError,
    RecoveryReport,
    Store,
    StoreConfig,
    StoreError,
    StoreFullError,
)
from txmq.store.codec import H_QUEUE_ID, H_TOPIC_LEN, HEADER
from txmq.store.errors import FULL_ERRNOS
from txmq.wire import ErrorCode, TxmqError

from .busypoll import BusyPoll
from .clock import Clock
from .config import BrokerConfig, CheckSettings
from .flush import DescriptorState, DiskState, Flusher
from .metrics import Metrics
from .registry import ProducerRegistry
from .topics import TopicTable
from .transactions.admin import TransactionAdmin
from .transactions.check import CheckProgress, CheckService
from .transactions.index import TxIndex
from .transactions.service import TransactionService

log = logging.getLogger("txmq.broker")

MAX_WAIT_MS = 30_000
# A pull that meets a long rebuild of damaged queue entries answers within this (or its wait), with no
# messages and its own offset as next_offset: the client pulls again and the rebuild goes on.
REPAIR_WAIT_S = 1.0


def msg_id(properties: dict[str, str], commit_log_offset: int) -> str:
    """The UNIQ_KEY property, or the commit-log offset in 16 hex digits (docs/protocol.md)."""
    return properties.get(PROP_UNIQ_KEY) or f"{commit_log_offset:016X}"


def msg_id_of(rec: Record) -> str:
    return msg_id(rec.properties, rec.commit_log_offset)


def record_to_map(rec: Record) -> dict[str, Any]:
    return {
        "topic": rec.topic,
        "queue_id": rec.queue_id,
        "queue_offset": rec.queue_offset,
        "commit_log_offset": rec.commit_log_offset,
        "size": rec.size,
        "msg_id": msg_id_of(rec),
        "born_ts": rec.born_ts,
        "store_ts": rec.store_ts,
        "tx_type": int(rec.tx_type),
        "prepared_offset": rec.prepared_offset,
        "properties": rec.properties,
        "body": rec.body,
    }


def speedups_in_use() -> str:
    """"native" when both compiled speed-ups are loaded (setup.py), else "python"."""
    from txmq.store import codec

    from .transactions import checkcopy

    return "native" if codec.speedups is not None and checkcopy.speedups is not None else "python"


class Appender:
    """Batches appends submitted in one loop iteration into one store.append.

    ``submit`` returns a future and creates no task: ``shape`` turns the
    append results into the caller's value right after the write (index
    updates happen there, so they always match the log), and with
    ``durable`` the future resolves only once the flusher has fsynced past
    the batch (sync flush mode). A request on the hot path costs one future.
    """

    def __init__(self, core: "BrokerCore") -> None:
        self.core = core
        self._batch: list[Message] = []
        self._subs: list[tuple[asyncio.Future, int, int, Callable[[list[AppendResult]], Any] | None, bool]] = []
        self._scheduled = False
        self._loop = asyncio.get_running_loop()

    def submit(self, msgs: Sequence[Message], shape: Callable[[list[AppendResult]], Any] | None = None, durable: bool = True) -> asyncio.Future:
        loop = self._loop
        fut = loop.create_future()
        if self.core.shutting_down:
            fut.set_exception(TxmqError("broker is shutting down", ErrorCode.SHUTTING_DOWN))
            return fut
        self._subs.append((fut, len(self._batch), len(msgs), shape, durable))
        self._batch.extend(msgs)
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._drain)
        return fut

    def _drain(self) -> None:
        self._scheduled = False
        batch, subs = self._batch, self._subs
        self._batch, self._subs = [], []
        if not batch:
            return
        store = self.core.store
        before = store.max_offset
        try:
            results = store.append(batch)
        except Exception as exc:  # one bad batch must not kill the loop
            if len(subs) > 1 and isinstance(exc, RecordTooLargeError):
                # Retry each submission alone so only the offender fails.
                for sub in subs:
                    fut, start, count = sub[0], sub[1], sub[2]
                    try:
                        res = store.append(batch[start : start + count])
                    except Exception as exc2:
                        fut.set_exception(self.core.store_error(exc2))
                    else:
                        self._settle_written(sub, res)
                        self.core.notify_appended(batch[start : start + count])
                return
            err = self.core.store_error(exc)
            for sub in subs:
                if not sub[0].done():
                    sub[0].set_exception(err)
            return
        m = self.core.metrics.counters
        m["records_appended"] += len(results)
        m["bytes_appended"] += store.max_offset - before
        # Durable submissions of the batch wait for one fsync past its end
        # together: one waiter per batch, not one per request.
        wait: list[tuple[asyncio.Future, Any]] = []
        for sub in subs:
            self._settle_written(sub, results[sub[1] : sub[1] + sub[2]], wait)
        self.core.notify_appended(batch)
        if wait:
            waiter = self.core.flusher.wait_durable(results[-1].end_offset)
            if waiter is None:
                for fut, value in wait:
                    if not fut.done():
                        fut.set_result(value)
            else:
                waiter.add_done_callback(lambda w: _settle_durable(wait, w))

    def _settle_written(self, sub, results: list[AppendResult], wait: list | None = None) -> None:
        """Shape the results; resolve the future now, or put it in wait (durable, sync flush)."""
        fut, _, _, shape, durable = sub
        # shape runs even if the caller gave up (cancelled): the records are
        # in the log, so the index must learn of them.
        try:
            value = shape(results) if shape is not None else results
        except Exception as exc:
            if not fut.done():
                fut.set_exception(self.core.store_error(exc))
            return
        if fut.done():
            return
        if durable and self.core.flusher.sync_mode:
            if wait is not None:
                wait.append((fut, value))
                return
            waiter = self.core.flusher.wait_durable(results[-1].end_offset)
            if waiter is not None:
                waiter.add_done_callback(lambda w: _settle_durable([(fut, value)], w))
                return
        fut.set_result(value)


def _settle_durable(wait: list[tuple[asyncio.Future, Any]], waiter: asyncio.Future) -> None:
    exc = waiter.exception()
    for fut, value in wait:
        if fut.done():
            continue
        if exc is None:
            fut.set_result(value)
        elif isinstance(exc, TxmqError) and isinstance(value, dict):
            # Written but not known durable: say which record, so a producer can end it.
            extra = {k: value[k] for k in ("tx_id", "commit_log_offset", "half_offset") if k in value}
            fut.set_exception(TxmqError(exc.message, exc.code, **extra))
        else:
            fut.set_exception(exc)


class BrokerCore:
    """The broker without its network: the store, the appends, consuming, and the transaction subsystem.

    Every collaborator is declared here. Those that read the data directory
    are built by ``open`` once the store holds it (the store's open takes
    the directory's lock and runs recovery): the topic table, consumer
    offsets, the flusher and the Appender, and the transaction subsystem
    (broker/transactions/: ``tx``, ``check``, ``admin``).
    """

    def __init__(self, config: BrokerConfig, clock: Clock | None = None) -> None:
        self.config: BrokerConfig = config
        self.clock: Clock = clock or Clock()
        self.data_dir: Path = Path(config.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.store: Store = Store(
            self.data_dir,
            StoreConfig(
                segment_size=config.segment_size,
                cq_entries_per_file=config.cq_entries_per_file,
                retention_s=config.check.retention_s,
            ),
            clock=self.clock,
        )
        self.metrics: Metrics = Metrics()
        self.registry: ProducerRegistry = ProducerRegistry()  # live producer connections by group (check-backs go to them)
        self.consumer_registry: ProducerRegistry = ProducerRegistry()  # live consumer connections by group (hello consumer_groups)
        self.broker_id: str = f"txmq-{os.getpid()}"
        self.started_at: float = time.time()
        self.recovery: RecoveryReport | None = None
        self._rr = itertools.count()
        self._pollers: dict[tuple[str, int], list[asyncio.Future]] = defaultdict(list)
        self.busy_poll: BusyPoll = BusyPoll(0)  # the spinner, started in start()
        # The native front end's connections, as info, stats and Prometheus show them (native.server.ServerState.gauges).
        self.connection_gauges: Callable[[], dict[str, int]] = lambda: {"connections": 0, "partial_frame_bytes": 0}
        self.tx_ready: asyncio.Event = asyncio.Event()  # set once the transaction index is rebuilt (or failed to be)
        self.tx_error: TxmqError | None = None  # why it failed
        # Transactional requests queued behind tx_ready and not yet run: while
        # any are, later ones queue too, so a connection's requests keep their
        # order across the moment the index becomes ready.
        self.tx_queued: int = 0
        self.draining: bool = False  # refuse new requests; in-flight ones finish
        self.shutting_down: bool = False  # refuse appends
        self.disk: DiskState = DiskState()  # a full disk, logged once per change of state
        self.fds: DescriptorState = DescriptorState()  # no descriptor left for a request, logged once per change of state
        # Built by open() (they read the data directory):
        self.topics: TopicTable  # topics.json: queue counts
        self.offsets: ConsumerOffsets  # offsets.json: consumer groups' offsets
        self.flusher: Flusher  # fsyncs and group commit (its thread starts in start())
        self.appender: Appender  # every write to the log
        self.tx: TransactionService  # half messages, end transaction, decide, discard
        self.check: CheckService  # check-backs and discards, a pass every check interval
        self.admin: TransactionAdmin  # the operator's transaction operations

    # ---- lifecycle -------------------------------------------------------
    def open(self, stored: dict[str, Any] | None = None) -> None:
        """Open the store (recovery), then build every collaborator on it. Synchronous: call on the loop before serving.

        ``stored``: the check settings config.json holds (``txmq config
        set``), read before the store is opened so that a damaged file
        refuses the start with nothing locked.
        """
        stored = {} if stored is None else stored
        self.recovery = self.store.open()
        r = self.recovery
        if r.dropped_bytes:
            log.warning("event=recovery_truncated dropped_bytes=%d reason=%r at=%s", r.dropped_bytes, r.reason, r.truncated_at)
        log.info("event=store_opened max_offset=%d segments=%d redispatched=%d took_s=%.3f", r.max_offset, r.segments, r.redispatched, r.duration_s)
        try:
            self.topics = TopicTable(self.data_dir / "topics.json", self.config.default_queues)
            self.topics.merge_from_store(self.store.queues())
            self.offsets = ConsumerOffsets(self.data_dir / "offsets.json")
        except BaseException:  # e.g. a damaged offsets.json: the start is refused, the directory released
            self.store.close()
            raise
        settings = self._settings(stored)
        self.tx = TransactionService(self, TxIndex())  # the index file's index replaces it once built (Broker._build_index)
        self.check = CheckService(self, self.tx, CheckProgress(self.data_dir / "txcheck.json", repair=True), self.data_dir / "config.json",
                                  settings, stored={k: v for k, v in stored.items() if k in settings.to_dict()})
        self.admin = TransactionAdmin(self, self.tx, self.check)
        self.store.config = replace(self.store.config, retention_s=settings.retention_s)
        self.appender = Appender(self)
        self.flusher = Flusher(
            self.store,
            sync=self.config.flush == "sync",
            interval_s=self.config.flush_interval_s,
            on_persist=self.offsets.persist,
            observe=self.metrics.flush.observe,
            observe_checkpoint=self.metrics.checkpoint.observe,
            disk=self.disk,
            count_error=partial(self.metrics.inc, "flush_errors"),
        )

    def _settings(self, stored: dict) -> CheckSettings:
        """Defaults < config.json (what `txmq config set` stored) < explicit start options.

        A start option applies to this run only: config.json is not written
        at start, so a later plain `broker start` runs on what `config set`
        stored (or the defaults), never on an earlier start's options. The
        settings in effect, and which came from options, are logged
        (event=check_settings) and shown by `txmq broker status`.
        """
        settings = CheckSettings.from_dict(stored)
        for key in self.config.check_overrides:
            settings = settings.with_value(key, getattr(self.config.check, key))
        log.info("event=check_settings check_interval_s=%s transaction_timeout_s=%s max_checks=%s retention_s=%s "
                 "from_options=%s stored=%s", settings.check_interval_s, settings.transaction_timeout_s, settings.max_checks,
                 settings.retention_s, ",".join(self.config.check_overrides) or "-",
                 ",".join(k for k in stored if k in settings.to_dict()) or "-")
        return settings

    async def start(self) -> None:
        """Start the flusher's thread and the busy-poll spinner (after open)."""
        self.flusher.start()
        self.busy_poll = BusyPoll(self.config.busy_poll_s)
        log.info("event=busy_poll state=%r window_us=%d", self.busy_poll.state, round(self.config.busy_poll_s * 1e6))

    async def stop(self) -> None:
        self.shutting_down = True
        self.wake_all_pollers()
        await self.flusher.stop()
        self.busy_poll.stop()
        self.fds.close()
        try:
            self.offsets.persist()
        except OSError as exc:  # e.g. the disk is still full: offsets since the last persist are lost, nothing else
            log.error("event=offsets_persist_failed error=%r", exc)
        try:
            self.store.close()
        except (StoreError, OSError) as exc:
            # The directory is released all the same. What could not be written
            # (consume-queue entries, the checkpoint) is rebuilt from the log by
            # the next start; the log itself holds every acknowledged record.
            log.error("event=store_close_failed error=%r msg=%s", exc, "'the next start recovers from the log'")

    # ---- errors ----------------------------------------------------------
    def store_error(self, exc: BaseException) -> TxmqError:
        if isinstance(exc, TxmqError):
            return exc
        if isinstance(exc, StoreFullError) or (isinstance(exc, OSError) and exc.errno in FULL_ERRNOS):
            self.metrics.inc("store_full_errors")
            return TxmqError("store full: the data directory's disk has no space left; nothing was written", ErrorCode.STORE_FULL)
        if isinstance(exc, RecordTooLargeError):
            return TxmqError(str(exc), ErrorCode.BODY_TOO_LARGE)
        if self.fds.failed("request", exc):
            self.metrics.inc("fd_exhausted_errors")
            return TxmqError(f"store error: {exc}", ErrorCode.STORE_ERROR)
        if isinstance(exc, (StoreError, OSError)):
            log.error("event=store_error error=%r", exc)
            return TxmqError(f"store error: {exc}", ErrorCode.STORE_ERROR)
        log.exception("event=internal_error", exc_info=exc)
        return TxmqError(f"internal error: {type(exc).__name__}", ErrorCode.INTERNAL)

    # ---- appending -------------------------------------------------------
    def append(self, msgs: Sequence[Message], shape: Callable[[list[AppendResult]], Any] | None = None) -> asyncio.Future:
        """Write msgs (one batch); the future resolves once durable per the flush policy."""
        return self.appender.submit(msgs, shape, durable=True)

    def append_written(self, msgs: Sequence[Message], shape: Callable[[list[AppendResult]], Any] | None = None) -> asyncio.Future:
        """Write msgs; the future resolves once written (not necessarily durable)."""
        return self.appender.submit(msgs, shape, durable=False)

    def pick_queue(self, topic: str, queue_id: int | None) -> int:
        n, _ = self.topics.ensure(topic)
        if queue_id is None or queue_id < 0:
            return next(self._rr) % n
        if queue_id >= n:
            raise TxmqError(f"queue {queue_id} does not exist: topic {topic} has {n} queues", ErrorCode.NO_SUCH_QUEUE)
        return queue_id

    def send(self, msgs: list[Message], single: bool) -> asyncio.Future:
        """Send plain messages, as every front end does: the future's result is each one's receipt (``single``: the only one's)."""
        def shape(results: list[AppendResult]) -> dict[str, Any]:
            self.metrics.counters["messages_sent"] += len(results)
            rows = [
                {"msg_id": msg_id(m.properties, r.commit_log_offset), "topic": m.topic, "queue_id": m.queue_id,
                 "queue_offset": r.queue_offset, "commit_log_offset": r.commit_log_offset}
                for m, r in zip(msgs, results)
            ]
            return rows[0] if single else {"results": rows}

        return self.append(msgs, shape)

    def notify_appended(self, msgs: Sequence[Message | RawCopy]) -> None:
        """Wake the long polls waiting on the queues these messages went to.

        A batch can hold check copies (RawCopy: the queue is its source
        record's), written together with sends to the queues being polled.
        """
        pollers = self._pollers
        if not pollers:
            return
        keys = set()
        for m in msgs:
            if type(m) is RawCopy:
                h = m.header or HEADER.unpack_from(m.source)
                keys.add((str(m.source[HEADER_SIZE : HEADER_SIZE + h[H_TOPIC_LEN]], "utf-8"), h[H_QUEUE_ID]))
            else:
                keys.add((m.topic, m.queue_id))
        for key in keys:
            for fut in pollers.pop(key, ()):
                if not fut.done():
                    fut.set_result(None)

    def wake_all_pollers(self) -> None:
        """Answer every long poll now (shutdown)."""
        pollers, self._pollers = self._pollers, defaultdict(list)
        for waiters in pollers.values():
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    # ---- consuming -------------------------------------------------------
    async def pull(self, topic: str, queue_id: int, offset: int, max_count: int, max_bytes: int, wait_ms: int) -> dict[str, Any]:
        n = self.topics.queues(topic)
        if n is None or not (0 <= queue_id < n):
            return {"status": "no_queue", "messages": [], "next_offset": offset, "min_offset": 0, "max_offset": 0}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait_ms, MAX_WAIT_MS) / 1000.0
        repair_until = loop.time() + REPAIR_WAIT_S
        while True:
            res = self.store.get_messages(topic, queue_id, offset, max_count, max_bytes)
            if res.repairing and not res.records and not self.draining and loop.time() < max(deadline, repair_until):
                # damaged entries rebuilt from the log, a bounded step per read: the next step after other work
                await asyncio.sleep(0)
                continue
            if res.status is GetStatus.NO_QUEUE:  # a known topic whose queue has no entry yet
                res = GetResult(GetStatus.NO_MESSAGE if offset == 0 else GetStatus.OFFSET_OVERFLOW, [], offset, 0, 0)
            if res.status is not GetStatus.NO_MESSAGE or wait_ms <= 0 or self.draining:
                break
            remaining = deadline - loop.time()
            # uvloop's clock and timers have millisecond resolution: a wait of
            # less than that fires at once with the clock unchanged, and the
            # loop would spin (re-reading the queue) until the clock ticks.
            if remaining < 0.001:
                break
            fut = loop.create_future()
            key = (topic, queue_id)
            self._pollers[key].append(fut)
            try:
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                pass
            finally:  # a poll that timed out (or was cancelled) leaves nothing behind on a queue nobody sends to
                waiters = self._pollers.get(key)
                if waiters:
                    try:
                        waiters.remove(fut)
                    except ValueError:  # woken: the list it was on is gone already
                        pass
                    if not waiters:
                        del self._pollers[key]
        self.metrics.inc("messages_pulled", len(res.records))
        return {
            "status": res.status.name.lower(),
            "messages": [record_to_map(r) for r in res.records],
            "next_offset": res.next_offset,
            "min_offset": res.min_offset,
            "max_offset": res.max_offset,
        }

    async def commit_offset(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        self.offsets.commit(group, topic, queue_id, offset)
        await self.flusher.wait_persisted()

    def fetch_offsets(self, group: str, topic: str) -> dict[int, int]:
        n = self.topics.queues(topic) or 0
        out = {}
        for q in range(n):
            off = self.offsets.get(group, topic, q)
            if off is not None:
                out[q] = off
        return out

    def list_topics(self, system: bool) -> list[dict[str, Any]]:
        rows = []
        for name, n in sorted(self.topics.all().items()):
            sysflag = is_system_topic(name)
            if sysflag and not system:
                continue
            msgs = sum(self.store.queue_max_offset(name, q) - self.store.queue_min_offset(name, q) for q in range(n))
            rows.append({"topic": name, "queues": n, "messages": msgs, "system": sysflag})
        return rows

    def info(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "broker_id": self.broker_id,
            "started_at_ms": int(self.started_at * 1000),
            "uptime_s": round(time.time() - self.started_at, 3),
            "data_dir": str(self.data_dir),
            "flush": self.config.flush,
            "host": self.config.host,
            "port": self.config.port,
            "max_offset": self.store.max_offset,
            "durable_offset": self.store.durable_offset,
            "min_offset": self.store.min_offset,
            "connections": self.connection_gauges()["connections"],
            "topics": len([t for t in self.topics.all() if not is_system_topic(t)]),
            "producer_groups": self.registry.groups(),
            "auth": bool(self.config.auth_token),
            "speedups": speedups_in_use(),
            "fsync_thread": self.flusher.fsync_thread,
            "log_sync_error": self.store.sync_error,
            **self.busy_poll.status(),
            "damaged_records": self.store.damage.count,
            "counters": self.metrics.snapshot(),
        }

    async def stats(self) -> dict[str, Any]:
        """Counters and gauges; the pass over the pending transactions runs in a worker thread, not on the loop."""
        by_topic, oldest_ts = await asyncio.get_running_loop().run_in_executor(None, self.tx.index.pending_summary)
        r = self.recovery
        recovery = {} if r is None else {
            "dropped_bytes": r.dropped_bytes, "reason": r.reason, "truncated_at": r.truncated_at,
            "redispatched": r.redispatched, "cq_entries_dropped": r.cq_entries_dropped,
            "damaged": r.damaged, "queues_rebuilt": r.queues_rebuilt,
        }
        now_ms = int(self.clock() * 1000)
        oldest = {g: round(max(0, now_ms - ts) / 1000.0, 3) for g, ts in sorted(oldest_ts.items())}
        return {
            "counters": self.metrics.snapshot(),
            "gauges": {
                "pending": sum(by_topic.values()),
                "pending_by_topic": by_topic,
                # age (s, broker store time) of each group's oldest pending transaction: what to alert on
                "oldest_pending_age_s": oldest,
                **self.connection_gauges(),  # connections, partial_frame_bytes
                "max_offset": self.store.max_offset,
                "durable_offset": self.store.durable_offset,
                "check_passes": self.check.passes,
                "last_check_pass": self.check.last_pass,
                "recovery": recovery,
                # damaged records skipped since start (recovery, reads, the index): each reported once
                "damaged": self.store.damage.summary(),
            },
        }
