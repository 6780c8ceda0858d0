"""The transport-independent broker core.

The front ends (broker/native/, broker/rocketmq/, broker/remoting/) never
call it: they call the messaging service (broker/messaging/), which the core
builds and which makes these calls. Every method runs on the event
loop thread; blocking work (fsync) happens in the flusher's thread.

Appends from all connections that arrive in one loop iteration are written
with one store.append (one write syscall) by the Appender
(broker/appender.py), then wait for durability according to the flush
policy. The core builds the transaction subsystem (broker/transactions/) and
hands each service only what it uses; nothing there calls back into the core.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

from txmq import __version__
from txmq.constants import is_system_topic
from txmq.store import (
    AppendResult,
    ConsumerOffsets,
    GetResult,
    GetStatus,
    Message,
    RecordTooLargeError,
    RecoveryReport,
    Store,
    StoreConfig,
    StoreError,
    StoreFullError,
)
from txmq.store.errors import FULL_ERRNOS
from txmq.wire import ErrorCode, TxmqError

from .appender import Appender
from .busypoll import BusyPoll
from .clock import Clock
from .config import FRAME_OVERHEAD, BrokerConfig, CheckSettings
from .flush import DescriptorState, DiskState, Flusher
from .groupconfig import GROUPS_FILE, GroupConfigTable
from .longpoll import LongPolls
from .messaging import Messaging, Operations
from .messaging.consumption import ConsumptionService, PopConfig
from .metrics import Metrics
from .records import msg_id, record_to_map
from .refusals import Refusals
from .registry import ClientRegistry
from .scheduled.service import ScheduleService
from .scheduled.timing import asks_for_time
from .topics import TopicTable, no_such_topic
from .transactions.admin import TransactionAdmin
from .transactions.check import CheckProgress, CheckService
from .transactions.keeper import IndexKeeper
from .transactions.service import TransactionService

log = logging.getLogger("txmq.broker")

LISTENER_NAMES = ("native", "rocketmq", "remoting", "metrics")  # the ports broker_info lists, in this order
MAX_WAIT_MS = 30_000
# A pull that meets a long rebuild of damaged queue entries answers within this (or its wait), with no
# messages and its own offset as next_offset: the client pulls again and the rebuild goes on.
REPAIR_WAIT_S = 1.0


def speedups_in_use() -> str:
    """"native" when both compiled speed-ups are loaded (setup.py), else "python"."""
    from txmq.store import codec

    from .transactions import checkcopy

    return "native" if codec.speedups is not None and checkcopy.speedups is not None else "python"


class BrokerCore:
    """The broker without its network: the store, the appends, consuming, and the transaction subsystem.

    Every collaborator is declared here. Those that read the data directory
    are built by ``open`` once the store holds it (the store's open takes
    the directory's lock and runs recovery): the topic table, consumer
    offsets, the flusher and the Appender, and the transaction subsystem
    (broker/transactions/: ``tx``, ``check``, ``admin``, ``keeper``).
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
        self.refusals: Refusals = Refusals(self.metrics)  # refused requests and internal errors: counted, logged throttled
        self.registry: ClientRegistry = ClientRegistry()  # live producer connections by group (check-backs go to them)
        self.consumer_registry: ClientRegistry = ClientRegistry()  # live consumer connections by group (hello consumer_groups)
        self.broker_id: str = f"txmq-{os.getpid()}"
        self.started_at: float = time.time()
        self.recovery: RecoveryReport | None = None
        self.polls: LongPolls = LongPolls()  # the pulls and receives waiting for a message, woken by the appends
        self.busy_poll: BusyPoll = BusyPoll(0)  # the spinner, started in start()
        # The native front end's connections, as info, stats and Prometheus show them (native.server.ServerState.gauges).
        self.connection_gauges: Callable[[], dict[str, int]] = lambda: {"connections": 0, "partial_frame_bytes": 0}
        # The other front ends' own ({"remoting_connections": n, ...}), which connection_stats adds in.
        self.frontend_gauges: list[Callable[[], dict[str, int]]] = []
        self.worker_status: list[Callable[[], list[dict[str, Any]]]] = []  # front-end worker processes' rows (Broker.own)
        self.draining: bool = False  # refuse new requests; in-flight ones finish
        # Every port the broker listens on, by name (native, rocketmq, metrics): {host, port, ...}, as
        # ``broker_info`` shows them; each is entered by what binds it (``listening``).
        self.listeners: dict[str, dict[str, Any]] = {}
        self.shutting_down: bool = False  # refuse appends
        self.disk: DiskState = DiskState()  # a full disk, logged once per change of state
        self.fds: DescriptorState = DescriptorState()  # no descriptor left for a request, logged once per change of state
        # What the front ends call (broker/messaging/): every send, transaction and consuming rule, once; and the
        # operator's calls (txmq's commands, mqadmin). Built now, so that front ends can be built before open().
        self.messaging: Messaging = Messaging(self)
        self.operations: Operations = Operations(self)
        # Built by open() (they read the data directory):
        self.topics: TopicTable  # topics.json: queue counts and message types
        self.offsets: ConsumerOffsets  # offsets.json: consumer groups' offsets
        self.group_config: GroupConfigTable  # groups.json: consumer groups' settings (FIFO)
        self.flusher: Flusher  # fsyncs and group commit (its thread starts in start())
        self.appender: Appender  # every write to the log
        self.tx: TransactionService  # half messages, end transaction, decide, discard
        self.check: CheckService  # check-backs and discards, a pass every check interval
        self.admin: TransactionAdmin  # the operator's transaction operations
        self.keeper: IndexKeeper  # the index file, and the gate transactional requests wait at until it is built
        self.scheduled: ScheduleService  # delayed and timed messages: their index (timers.db) and their delivery
        self.consumption: ConsumptionService  # receives with invisible durations, acks, retries, dead letters (POP)

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
            self.topics = TopicTable(self.data_dir / "topics.json", self.config.default_queues, self.config.auto_create_topics)
            self.topics.merge_from_store(self.store.queues())
            log.info("event=topics_loaded topics=%d auto_create=%s", sum(1 for t in self.topics.all() if not is_system_topic(t)),
                     "on" if self.config.auto_create_topics else "off")
            self.offsets = ConsumerOffsets(self.data_dir / "offsets.json")
            self.group_config = GroupConfigTable(self.data_dir / GROUPS_FILE)  # groups.json: which groups are FIFO
        except BaseException:  # e.g. a damaged offsets.json: the start is refused, the directory released
            self.store.close()
            raise
        settings = self._settings(stored)
        self.store.config = replace(self.store.config, retention_s=settings.retention_s)
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
        self.appender = Appender(self.store, self.flusher, self.metrics, self.polls.notify, self.store_error)
        self.tx = TransactionService(self.appender, self.store, self.topics, self.flusher, self.metrics, self.clock)
        self.check = CheckService(self.tx, self.appender, self.store, self.flusher, self.metrics, self.clock, self.registry, self.disk,
                                  CheckProgress(self.data_dir / "txcheck.json", repair=True), self.data_dir / "config.json", settings,
                                  self.config.check_batch, stored={k: v for k, v in stored.items() if k in settings.to_dict()})
        self.admin = TransactionAdmin(self.tx, self.check, self.store, self.metrics, self.clock, self.registry)
        self.keeper = IndexKeeper(self.tx, self.check, self.store, self.flusher, self.disk, self.metrics, self.data_dir, self.recovery,
                                  self.config.max_body + self.config.max_properties + FRAME_OVERHEAD)
        self.scheduled = ScheduleService(self.appender, self.store, self.topics, self.flusher, self.disk, self.metrics, self.clock,
                                         self.data_dir, self.config.max_delay_s,
                                         self.config.message_delay_levels_ms)
        self.consumption = self.consumption_service()

    def consumption_service(self, config: PopConfig | None = None, **kw: Any) -> ConsumptionService:
        """A consumption service on this broker's queues, offsets, topics, appends and long polls (``open`` builds
        ``consumption``, the one the front ends use). ``kw``: ConsumptionService's (now, max_attempts, client_alive, fifo)."""
        kw.setdefault("fifo", self.group_config.fifo)
        return ConsumptionService(self.store, self.offsets, self.topics, self.appender, self.polls, config,
                                  draining=lambda: self.draining, shutting_down=lambda: self.shutting_down,
                                  persist=self.flusher.wait_persisted, flush_interval_s=self.config.flush_interval_s, **kw)

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
        self.appender.close()
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
        self.refusals.internal("request", exc)  # counted; a traceback only for the first of its type, then throttled lines
        return TxmqError(f"internal error: {type(exc).__name__}", ErrorCode.INTERNAL)

    # ---- sending -------------------------------------------------------
    def send(self, msgs: list[Message], single: bool, then: Callable[[Any], Any] | None = None) -> asyncio.Future:
        """Send plain messages, as every front end does: the future's result is each one's receipt (``single``: the only one's).

        A message whose properties ask for a later delivery (RocketMQ's
        ``DELAY`` level, ``TIMER_DELIVER_MS``, ``TIMER_DELAY_SEC``,
        ``TIMER_DELAY_MS``) is scheduled instead (broker/scheduled/): every
        front end gets it by passing the client's properties through.
        ``then``: a mapping of the receipts applied as the append completes
        (the messaging service's typed answers: no second future per send).
        """
        for m in msgs:
            if asks_for_time(m.properties):
                return self.scheduled.send(msgs, single, then)
        def shape(results: list[AppendResult]) -> dict[str, Any]:
            self.metrics.counters["messages_sent"] += len(results)
            rows = [
                {"msg_id": msg_id(m.properties, r.commit_log_offset), "topic": m.topic, "queue_id": m.queue_id,
                 "queue_offset": r.queue_offset, "commit_log_offset": r.commit_log_offset}
                for m, r in zip(msgs, results)
            ]
            reply = rows[0] if single else {"results": rows}
            return reply if then is None else then(reply)

        return self.appender.submit(msgs, shape)

    # ---- long polls ------------------------------------------------------
    def wake_all_pollers(self) -> None:
        """Answer every long poll now (shutdown)."""
        self.polls.wake_all()

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
            await self.polls.wait(topic, queue_id, remaining)
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

    def _messages(self, topic: str, n: int) -> int:
        return sum(self.store.queue_max_offset(topic, q) - self.store.queue_min_offset(topic, q) for q in range(n))

    def list_topics(self, system: bool) -> list[dict[str, Any]]:
        rows = []
        for name, n in sorted(self.topics.all().items()):
            sysflag = is_system_topic(name)
            if sysflag and not system:
                continue
            rows.append({"topic": name, "queues": n, "messages": self._messages(name, n), "system": sysflag,
                         "message_types": None if sysflag else list(self.topics.message_types(name))})
        return rows

    # ---- topics (the operator's: txmq topics create|update|delete|describe) ----
    def create_topic(self, topic: str, queues: int | None, message_types: tuple[str, ...] | None) -> dict[str, Any]:
        """Create a topic (whatever auto-creation says); an existing one is answered as it is, unchanged (created false)."""
        n, created = self.topics.ensure(topic, queues, message_types)
        return {"topic": topic, "queues": n, "created": created, "message_types": list(self.topics.message_types(topic))}

    def update_topic(self, topic: str, queues: int | None, message_types: tuple[str, ...] | None) -> dict[str, Any]:
        """More queues, other message types; the old and new values.

        Queues shrink only by queues that never held a message and that no
        pending transaction was sent to (TOPIC_IN_USE otherwise): a queue
        with messages would hide them, and its readers and writers would be
        refused mid-stream. The pending transactions are counted, when
        shrinking, in one pass on the event loop.
        """
        n = self._known_topic(topic)
        if queues is not None and queues < n:
            written = [q for q in range(queues, n) if self.store.queue_max_offset(topic, q) > 0]
            pending = sorted({p.queue_id for p in self.tx.index.pending.values() if p.topic == topic and p.queue_id >= queues})
            if written or pending:
                why = f"queue {written[0]} holds messages" if written else f"a pending transaction was sent to queue {pending[0]}"
                raise TxmqError(f"topic {topic} cannot shrink from {n} to {queues} queues: {why} (only queues that never "
                                "held a message can be removed)", ErrorCode.TOPIC_IN_USE, topic=topic)
        return {"topic": topic, **self.topics.update(topic, queues, message_types)}

    def _known_topic(self, topic: str) -> int:
        n = self.topics.queues(topic)
        if n is None or is_system_topic(topic):
            raise no_such_topic(topic)
        return n

    def delete_topic(self, topic: str, force: bool) -> dict[str, Any]:
        """Take a user topic out of the table: no route, no send, no receive; its stored records stay until retention.

        Refused (TOPIC_IN_USE) while transactions sent to it are pending,
        unless ``force``: they then stay pending, and one that commits
        creates the topic again. The count of pending transactions is one
        pass over them on the event loop (so that no half message slips in
        between the count and the delete).
        """
        n = self._known_topic(topic)
        pending = sum(1 for p in self.tx.index.pending.values() if p.topic == topic)
        if pending and not force:
            raise TxmqError(f"topic {topic} has {pending} pending transaction(s): resolve them first (txmq inspect half "
                            f"--topic {topic}), or force the delete (they stay pending, and a commit creates the topic again)",
                            ErrorCode.TOPIC_IN_USE, topic=topic, pending_transactions=pending)
        messages = self._messages(topic, n)
        self.topics.delete(topic)
        log.info("event=topic_deleted topic=%s queues=%d messages=%d pending=%d forced=%s", topic, n, messages, pending,
                 "yes" if force else "no")
        return {"topic": topic, "deleted": True, "queues": n, "messages": messages, "pending_transactions": pending}

    async def describe_topic(self, topic: str) -> dict[str, Any]:
        """Queues, message types, each queue's offsets and messages, and the pending transactions (counted in a worker thread)."""
        n = self._known_topic(topic)
        pending = await asyncio.get_running_loop().run_in_executor(None, _pending_by_queue, self.tx.index.pending, topic)
        n = self.topics.queues(topic)
        if n is None:  # deleted meanwhile
            raise no_such_topic(topic)
        rows = []
        for q in range(n):
            lo, hi = self.store.queue_min_offset(topic, q), self.store.queue_max_offset(topic, q)
            rows.append({"queue_id": q, "min_offset": lo, "max_offset": hi, "messages": hi - lo,
                         "pending_transactions": pending.get(q, 0)})
        return {"topic": topic, "queues": n, "message_types": list(self.topics.message_types(topic)),
                "messages": sum(r["messages"] for r in rows), "pending_transactions": sum(pending.values()),
                "per_queue": rows}

    def listening(self, name: str, host: str, port: int, **extra: Any) -> None:
        assert name in LISTENER_NAMES, name
        """A port the broker now listens on (the native port, --rocketmq-port, --remoting-port, --metrics-port)."""
        self.listeners[name] = {"host": host, "port": port, **extra}

    def connection_stats(self) -> dict[str, int]:
        """``connections`` (every front end's open client connections), ``partial_frame_bytes`` (the native port's), and
        each other front end's own (``remoting_connections``, ``remoting_partial_frame_bytes``)."""
        stats = dict(self.connection_gauges())
        for gauges in self.frontend_gauges:
            own = gauges()
            stats.update(own)
            stats["connections"] += sum(v for k, v in own.items() if k.endswith("_connections"))
        return stats

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
            "listeners": {n: dict(self.listeners[n]) for n in sorted(self.listeners, key=LISTENER_NAMES.index)},
            "max_offset": self.store.max_offset,
            "durable_offset": self.store.durable_offset,
            "min_offset": self.store.min_offset,
            **{k: v for k, v in self.connection_stats().items() if k.endswith("connections")},
            "topics": len([t for t in self.topics.all() if not is_system_topic(t)]),
            "auto_create_topics": self.topics.auto_create,
            "producer_groups": self.registry.groups(),
            "auth": bool(self.config.auth_token),
            "speedups": speedups_in_use(),
            "fsync_thread": self.flusher.fsync_thread,
            "log_sync_error": self.store.sync_error,
            **self.busy_poll.status(),
            "damaged_records": self.store.damage.count,
            "counters": self.metrics.snapshot(),
            "frontend_workers": [row for rows in self.worker_status for row in rows()],
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
                **self.connection_stats(),  # connections, partial_frame_bytes, remoting_connections, ...
                "max_offset": self.store.max_offset,
                "durable_offset": self.store.durable_offset,
                **self.scheduled.gauges(),  # scheduled, scheduled_lag_s, scheduled_index, lateness
                "check_passes": self.check.passes,
                "last_check_pass": self.check.last_pass,
                "recovery": recovery,
                # damaged records skipped since start (recovery, reads, the index): each reported once
                "damaged": self.store.damage.summary(),
            },
        }


def _pending_by_queue(pending: dict[str, Any], topic: str) -> dict[int, int]:
    """Pending transactions of topic per queue (their REAL_QID), over a copy: safe from a worker thread, as stats does."""
    out: dict[int, int] = {}
    for p in list(pending.values()):
        if p.topic == topic:
            out[p.queue_id] = out.get(p.queue_id, 0) + 1
    return out
