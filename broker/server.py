"""Broker lifecycle: open the store, start the transaction index, serve through the front ends, shut down.

``Broker.serve(sock, shutdown)`` takes an already-bound socket for the
native protocol (broker/native/) and an awaitable shutdown signal, so tests
bind 127.0.0.1:0 and never race for a port. Shutdown order (the reverse of
start): the front ends stop accepting and let in-flight requests finish
(bounded by shutdown_timeout_s), the transaction subsystem stops
(broker/transactions/keeper.py: the check service, then the index file),
the store is flushed and closed, the front ends close their connections.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import replace
from typing import Callable, Protocol

from .clock import Clock
from .config import BrokerConfig, read_settings_file
from .core import BrokerCore, speedups_in_use
from .native.server import NativeFrontend
from .ports import listen

log = logging.getLogger("txmq.broker")

JANITOR_INTERVAL_S = 60.0

# Descriptors the default connection limits leave to the broker's own files, whatever clients do: at most
# half of RLIMIT_NOFILE. At start, with both ports and the metrics endpoint, the broker holds ~35 (Python,
# uvloop, gRPC's pollers and eventfds, the LOCK file, one commit-log segment, txindex.db with its WAL and
# shm); then one more per commit-log segment, per consume-queue file read, per file being replaced at that
# moment (the checkpoint, offsets.json, topics.json, txcheck.json, config.json: a temporary file, then the
# directory), per Prometheus scrape, and one for each connection past a limit while it is being closed.
FD_RESERVE = 512
FD_LIMIT_WANTED = 65536  # the soft RLIMIT_NOFILE `txmq broker start` raises itself to (within the hard limit)


def fd_soft_limit() -> int:
    """The soft RLIMIT_NOFILE (an unlimited one counts as 2**24)."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft > 1 << 24:
        soft = 1 << 24
    return soft


def fd_budget(fd_limit: int) -> int:
    """The descriptors both ports' connections may take together by default: fd_limit minus FD_RESERVE (at most half)."""
    return max(1, fd_limit - min(FD_RESERVE, fd_limit // 2))


def connection_limits(fd_limit: int, rocketmq: bool, max_connections: int | None = None,
                      rocketmq_max_connections: int | None = None) -> tuple[int, int | None]:
    """(native cap, RocketMQ front end's cap or None): the caps given, else shares of fd_budget(fd_limit).

    The native port alone gets the whole budget; with the RocketMQ front end
    each port gets half, and a cap that is given leaves the rest to the
    other port (at least 1). Connections past a cap are closed as soon as
    accepted, so with the default caps a flood on either port is refused
    before the other port, the store, the index, the checkpoints or the
    check service run out of descriptors.
    """
    native, rmq, _ = port_limits(fd_limit, rocketmq, False, max_connections, rocketmq_max_connections, None)
    return native, rmq


def port_limits(fd_limit: int, rocketmq: bool, remoting: bool, max_connections: int | None = None,
                rocketmq_max_connections: int | None = None,
                remoting_max_connections: int | None = None) -> tuple[int, int | None, int | None]:
    """(native cap, gRPC port's cap or None, remoting port's cap or None), as ``connection_limits`` for up to three ports.

    What the caps given leave of fd_budget(fd_limit) is shared equally by
    the ports without one (at least 1 each); the native port takes what
    the division leaves over.
    """
    budget = fd_budget(fd_limit)
    caps: dict[str, int | None] = {"native": max_connections}
    if rocketmq:
        caps["rocketmq"] = rocketmq_max_connections
    if remoting:
        caps["remoting"] = remoting_max_connections
    open_ = [k for k, v in caps.items() if v is None]
    if open_:
        rest = budget - sum(v for v in caps.values() if v is not None)
        share = max(1, rest // len(open_))
        for k in open_:
            caps[k] = share
        if "native" in open_:
            caps["native"] = max(1, rest - share * (len(open_) - 1))
    return caps["native"], caps.get("rocketmq"), caps.get("remoting")  # type: ignore[return-value]


def raise_fd_limit(wanted: int = FD_LIMIT_WANTED) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE towards wanted, within the hard limit (as the JVM does); returns (before, after)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return soft, target
        except (ValueError, OSError):
            pass
    return soft, soft


class Frontend(Protocol):
    """A protocol's front end (broker/native/, broker/rocketmq/): it translates requests into the services' calls."""

    async def start(self) -> None: ...  # the broker serves: requests go through
    async def stop(self) -> None: ...  # first at shutdown: no new requests, those in flight finish; once
    async def close(self) -> None: ...  # last, once the core stopped: what is still open is closed
    def gauges(self) -> dict[str, int]: ...  # its connections, as `txmq broker status`, `txmq stats` and Prometheus show them


class Broker:
    def __init__(self, config: BrokerConfig, clock: Clock | None = None) -> None:
        config = config.validated()
        self.fd_limit = fd_soft_limit()
        rocketmq = config.rocketmq_port is not None
        remoting = config.remoting_port is not None
        native, rmq, rem = port_limits(self.fd_limit, rocketmq, remoting, config.max_connections, config.rocketmq_max_connections,
                                       config.remoting_max_connections)
        config = replace(config, max_connections=native, rocketmq_max_connections=rmq, remoting_max_connections=rem)
        if native + (rmq or 0) + (rem or 0) > fd_budget(self.fd_limit):
            log.warning("event=fd_budget_exceeded max_connections=%d rocketmq_max_connections=%d remoting_max_connections=%d "
                        "fd_limit=%d fd_reserve=%d msg=%s",
                        native, rmq or 0, rem or 0, self.fd_limit, self.fd_limit - fd_budget(self.fd_limit),
                        "'connections may take the descriptors the store needs: its writes then fail with EMFILE'")
        self.config = config
        self.core = BrokerCore(config, clock)
        self.native: NativeFrontend | None = None  # built by serve() with its socket
        self.ready = asyncio.Event()
        self._janitor: asyncio.Task | None = None
        # The front ends this broker owns: RocketMQ's gRPC service and RocketMQ 4's remoting when the configuration asks
        # for them (broker/frontends.py builds and binds them before serve), then the native one (serve).
        self.frontends: list[Frontend] = []
        self._in_flight: list[Callable[[], int]] = []  # each front end's requests in flight (own, serve)

    def own(self, frontend: Frontend) -> None:
        """A front end built for this broker: started and stopped with it, its connections counted in its figures."""
        self.frontends.append(frontend)
        self.core.frontend_gauges.append(frontend.gauges)
        workers = getattr(frontend, "status", None)  # a pool of front-end worker processes (broker/workers/): one row each
        if workers is not None:
            self.core.worker_status.append(workers)
        in_flight = getattr(frontend, "in_flight", None)
        if in_flight is not None:
            self._in_flight.append(in_flight)

    def _lone_client(self) -> bool:
        """At most one request in flight over every front end: the flusher's test for an fsync on the loop (flush.py).

        The native port's connections alone are not the answer: 32 SDK producers on the gRPC port would each find
        the native port idle, and each fsync would then block the loop their other requests wait on.
        """
        busy = 0
        for in_flight in self._in_flight:
            busy += in_flight()
            if busy > 1:
                return False
        return True

    async def start(self) -> None:
        core = self.core
        t0 = time.perf_counter()
        # Read before the store is opened: a damaged config.json refuses the start with nothing locked.
        stored = read_settings_file(core.data_dir / "config.json", self.config.check_overrides)
        core.open(stored)  # the store, then every collaborator: topics, offsets, flusher, appender, tx, check, admin, keeper
        await core.start()
        core.keeper.start(t0)  # the transaction index, built while plain traffic is served
        core.scheduled.start()  # the schedule's index (timers.db), then the delivery of what is due
        self._janitor = asyncio.get_running_loop().create_task(self._janitor_loop(), name="txmq-janitor")
        log.info("event=store_ready took_s=%.3f", time.perf_counter() - t0)

    async def serve(self, sock: socket.socket, shutdown: asyncio.Event | None = None) -> None:
        """Start, accept on sock until shutdown is set, then stop."""
        await self.start()
        core = self.core
        self.native = NativeFrontend(core.messaging, core.operations, sock)
        core.connection_gauges = self.native.gauges  # the native port's own: its partial_frame_bytes too
        self._in_flight.insert(0, self.native.in_flight)  # the native port's first: most often the one that is busy
        core.flusher.lone_client = self._lone_client
        self.frontends.append(self.native)
        for frontend in self.frontends:
            await frontend.start()
        host, port = sock.getsockname()[:2]
        self.core.listening("native", host, port)
        cfg = self.config
        rmq = "" if cfg.rocketmq_max_connections is None else f" rocketmq_max_connections={cfg.rocketmq_max_connections}"
        if cfg.remoting_max_connections is not None:
            rmq += f" remoting_max_connections={cfg.remoting_max_connections}"
        log.info("event=listening host=%s port=%d flush=%s data_dir=%s speedups=%s max_connections=%d%s fd_limit=%d", host, port,
                 cfg.flush, self.core.data_dir, speedups_in_use(), cfg.max_connections, rmq, self.fd_limit)
        self.ready.set()
        try:
            await (shutdown or asyncio.Event()).wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        state = self.native.state if self.native is not None else None
        log.info("event=shutdown_begin connections=%d inflight=%d", len(state.connections) if state else 0, len(state.inflight) if state else 0)
        self.core.draining = True
        self.core.wake_all_pollers()  # long polls answer now
        for frontend in self.frontends:
            try:
                await frontend.stop()
            except Exception:
                log.exception("event=frontend_stop_failed")
        if self._janitor is not None and not self._janitor.done():
            self._janitor.cancel()
            try:
                await self._janitor
            except (asyncio.CancelledError, Exception):
                pass
        try:
            await self.core.scheduled.stop()  # no more deliveries, then the schedule's index file
        except Exception:
            log.exception("event=timers_stop_failed")
        await self.core.keeper.stop()  # the check service, then the index file
        await self.core.stop()  # refuses new work, flushes, closes the store
        for frontend in self.frontends:
            await frontend.close()
        log.info("event=shutdown_done")

    async def _janitor_loop(self) -> None:
        """Retention: delete expired segments, never one holding an undecided half message."""
        keeper = self.core.keeper
        await keeper.ready.wait()  # the protected offset comes from the index
        if keeper.error is not None:
            return
        while True:
            await asyncio.sleep(JANITOR_INTERVAL_S)
            core = self.core
            core.store.config = replace(core.store.config, retention_s=core.check.settings.retention_s)
            pend = core.tx.index.pending.values()
            protect = min(min((p.origin_cl_offset for p in pend), default=core.store.max_offset), core.scheduled.protect_from())
            try:
                deleted = await asyncio.get_running_loop().run_in_executor(None, core.store.delete_expired, core.clock(), protect)
            except Exception:
                log.exception("event=retention_failed")
                continue
            if deleted:
                log.info("event=retention_deleted files=%d", len(deleted))


def bind(host: str, port: int) -> socket.socket:
    """The native port's listening socket."""
    return listen(host, port)


def install_uvloop() -> str:
    """Use uvloop when it loads; fall back to asyncio's loop otherwise."""
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        return "uvloop"
    except Exception:  # not installed or not supported on this platform
        return "asyncio"
