"""Running a broker as a process: the start-up policy behind `txmq broker start`.

``run(config)`` is what the CLI calls once it has parsed the options and
built the BrokerConfig (as uvicorn.run does for a web server): it checks the
config, raises the descriptor limit, installs uvloop, tunes the garbage
collector, binds the socket (and RocketMQ's gRPC port with --rocketmq-port:
broker/rocketmq/; RocketMQ 4's remoting port with --remoting-port:
broker/remoting/), serves the metrics endpoint if asked, and runs
the broker until SIGINT or SIGTERM, then shuts it down cleanly
(``Broker.stop``). Logging is set up by the caller (``txmq.broker.logs.setup``).

A start that cannot go on raises a ``StartError`` whose message is the one
line to show; ``InvalidConfig`` (a subclass) is a bad combination of start
options. Tests that need a broker in-process use ``Broker.serve`` with a
socket they bound (broker/testing.py) instead.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import signal
import sys

from txmq.store import StoreLockedError
from txmq.store.errors import DataFileError

from .config import BrokerConfig
from .frontends import FrontendBindError, bind_frontends
from .logs import loop_exception_handler
from .server import Broker, bind, install_uvloop, raise_fd_limit

log = logging.getLogger("txmq.broker")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# Fewer, cheaper collections: the broker allocates a few objects per
# request, almost none of them in cycles (measured: -20% CPU per check-back).
GC_THRESHOLD = (50_000, 50, 100)
# The GIL's switch interval (Python's default 5 ms). The fsync, checkpoint and index threads each need
# the GIL back after every system call; while the event loop is busy they get it only when the
# interval forces a switch, so a checkpoint of ten files took 10-40 ms and the sends waiting behind it
# made the p99. At 1 ms the p99 of a whole transaction at half the maximum sync rate went from
# 10.5-26.5 ms to 8.4-11.0 ms (docs/architecture.md, "Threads").
SWITCH_INTERVAL_S = 0.001


class StartError(Exception):
    """The broker cannot start; the message says why (and often what to do)."""


class InvalidConfig(StartError):
    """The start options do not go together (BrokerConfig.validated), e.g. --max-frame below --max-body."""


class ListenError(StartError):
    """The address cannot be bound (in use, not this machine's, no permission)."""


class DataDirInUse(StartError):
    """Another broker holds the data directory's lock."""


class DataDirDamaged(StartError):
    """A file of the data directory cannot be used as it is; the message names it and what to do."""


class MissingDependency(StartError):
    """An option needs a package that is not installed (--rocketmq-port without the ``rocketmq`` extra)."""


def is_loopback(host: str) -> bool:
    """Whether host is only reachable from this machine (127.0.0.0/8, ::1, localhost)."""
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: it may resolve to any address
        return False


def run(config: BrokerConfig) -> None:
    """Run a broker in the foreground until SIGINT/SIGTERM, then stop it cleanly."""
    try:
        config.validated()
    except ValueError as e:
        raise InvalidConfig(str(e)) from None
    if not is_loopback(config.host) and not config.auth_token:
        # RocketMQ's own model without ACLs: the network is the boundary (README, docs/rocketmq.md).
        log.warning("event=insecure_listen host=%s port=%d rocketmq_port=%s msg=%s", config.host, config.port,
                    "-" if config.rocketmq_port is None else str(config.rocketmq_port),
                    "'no --auth-token: any client that reaches these ports can send to any topic, register as a producer of a topic "
                    "and receive its uncommitted half messages in check-backs (spending their checks), and through --rocketmq-port "
                    "commit or roll back a transaction knowing only its message id; give --auth-token or keep the ports on a trusted "
                    "network'")
    if config.rocketmq_port is not None:
        from .rocketmq import missing_dependency

        problem = missing_dependency()
        if problem is not None:
            raise MissingDependency(f"--rocketmq-port: {problem}")
    fds_before, fds = raise_fd_limit()
    if fds != fds_before:
        log.info("event=fd_limit_raised from=%d to=%d", fds_before, fds)
    loop_name = install_uvloop()
    gc.set_threshold(*GC_THRESHOLD)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        sock = bind(config.host, config.port)
    except OSError as e:
        raise ListenError(f"cannot listen on {_address(config.host, config.port)}: {e.strerror or e}") from None
    try:
        asyncio.run(_serve(config, sock, loop_name))
    except StoreLockedError as e:
        raise DataDirInUse(f"data directory {config.data_dir} is in use by another broker ({e})") from None
    except DataFileError as e:
        raise DataDirDamaged(f"cannot start: {e}") from None


async def _serve(config: BrokerConfig, sock, loop_name: str) -> None:
    asyncio.get_running_loop().set_exception_handler(loop_exception_handler)  # one log line, never asyncio's traceback
    shutdown = _stop_event()
    broker = Broker(config)
    log.info("event=starting loop=%s data_dir=%s", loop_name, config.data_dir)
    try:  # RocketMQ 5's gRPC service and RocketMQ 4's remoting protocol, if asked for: bound now, served once the broker is
        await bind_frontends(broker)
    except FrontendBindError as e:
        raise ListenError(str(e)) from None
    metrics = None
    if config.metrics_port is not None:  # Prometheus's /metrics (README, "Metrics"); empty until the store is open
        from .prom import METRICS_PATH, serve_metrics

        try:
            metrics = serve_metrics(broker.core, config.host, config.metrics_port)
        except OSError as e:
            for frontend in broker.frontends:  # the RocketMQ and remoting ports, bound already
                await frontend.stop()
            raise ListenError(f"cannot listen on {_address(config.host, config.metrics_port)} (--metrics-port): {e.strerror or e}") from None
        broker.core.listening("metrics", config.host, metrics.server_port, path=METRICS_PATH)
        log.info("event=metrics_listening host=%s port=%d path=%s", config.host, metrics.server_port, METRICS_PATH)
    try:
        await broker.serve(sock, shutdown)
    finally:
        if metrics is not None:
            metrics.shutdown()
        for frontend in broker.frontends:  # a start that failed never reached Broker.stop (stopping twice is nothing)
            await frontend.stop()


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _stop_event() -> asyncio.Event:
    """An event set on SIGINT or SIGTERM (where the loop can take signal handlers)."""
    ev = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, ev.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass
    return ev
