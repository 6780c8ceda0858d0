"""Broker configuration: start options and the live-tunable check settings."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable

from txmq import defaults
from txmq.constants import DEFAULT_HOST, DEFAULT_PORT, DEFAULT_QUEUES, MESSAGE_DELAY_LEVEL
from txmq.store import StoreError, read_json
from txmq.store.errors import DataFileError

log = logging.getLogger("txmq.broker")


def default_data_dir() -> Path:
    """The embedded default data directory (XDG data home)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "txmq"


@dataclass(frozen=True, slots=True)
class CheckSettings:
    """What `txmq config set` changes while the broker runs; persisted in config.json."""

    check_interval_s: float = defaults.CHECK_INTERVAL_S
    transaction_timeout_s: float = defaults.TRANSACTION_TIMEOUT_S
    max_checks: int = defaults.MAX_CHECKS
    retention_s: float = defaults.RETENTION_S

    def validated(self) -> "CheckSettings":
        if not (0.01 <= self.check_interval_s <= 86400 * 7):
            raise ValueError("check_interval_s must be between 0.01 and 604800")
        if not (0 <= self.transaction_timeout_s <= 86400 * 30):
            raise ValueError("transaction_timeout_s must be between 0 and 2592000")
        if not (1 <= int(self.max_checks) <= 1_000_000) or int(self.max_checks) != self.max_checks:
            raise ValueError("max_checks must be an integer between 1 and 1000000")
        if not (1 <= self.retention_s <= 86400 * 3650):
            raise ValueError("retention_s must be between 1 and 315360000")
        return self

    def with_value(self, key: str, value: Any) -> "CheckSettings":
        names = {f.name for f in fields(self)}
        if key not in names:
            raise KeyError(key)
        if key == "max_checks":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError("max_checks must be an integer")
            value = int(value)
        else:
            value = float(value)
        return replace(self, **{key: value}).validated()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, base: "CheckSettings | None" = None) -> "CheckSettings":
        s = base or cls()
        for k, v in (d or {}).items():
            try:
                s = s.with_value(k, v)
            except (KeyError, ValueError, TypeError):
                continue
        return s


def auto_frontend_processes(cores: int | None = None) -> int:
    """``--frontend-processes auto``: none below 4 cores, else one per core beyond two, at most 4.

    Measured on 2 cores (docs/benchmarks.md, "Through front-end worker
    processes"): the workers' relay hop costs a lone SDK client 10-40% of
    its rate, and 32 producers gain 20%, the machine's CPU being all taken;
    the broker process is the ceiling from about 3 workers on (its CPU per
    relayed transaction against theirs), so more than 4 add nothing to it.
    """
    cores = cores if cores is not None else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    return 0 if cores < 4 else min(4, cores - 2)


def read_settings_file(path: Path, overridden: Iterable[str] = ()) -> dict[str, Any]:
    """The check settings stored in config.json ({} when there is none), each value checked.

    A file that is not a JSON object, or holds a setting out of range,
    raises DataFileError: starting with the defaults instead could shorten
    the transaction timeout an operator set, and check-backs would reach
    transactions still running. A setting given as a start option
    (overridden) is replaced anyway and not checked; an unknown key is
    ignored with a warning.
    """
    what = "fix it, or move it away to start with the defaults and the start options"
    try:
        data = read_json(path, {})
    except (StoreError, OSError) as exc:
        why = str(exc.__cause__ or exc) if isinstance(exc, StoreError) else (exc.strerror or str(exc))
        raise DataFileError(f"{path} (the check settings of `txmq config set`) cannot be read: {why}; {what}") from None
    if not isinstance(data, dict):
        raise DataFileError(f"{path} (the check settings of `txmq config set`) is not a JSON object: "
                            f"it holds {type(data).__name__} {_short(data)}; {what}")
    names = {f.name for f in fields(CheckSettings)}
    skip = set(overridden)
    for key, value in data.items():
        if key not in names:
            log.warning("event=config_unknown_key file=%s key=%r msg=%s", path, key, "'ignored'")
            continue
        if key in skip:
            continue
        try:
            CheckSettings().with_value(key, value)
        except (ValueError, TypeError) as exc:
            raise DataFileError(f"{path} (the check settings of `txmq config set`): {key} = {_short(value)} is not valid ({exc}); {what}") from None
    return data


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


MAX_DELAY_LEVELS = 64
MAX_LEVEL_DELAY_MS = 3 * 86_400_000
_LEVEL_UNITS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_delay_levels(text: str) -> tuple[int, ...]:
    """RocketMQ's messageDelayLevel ("1s 5s 10s 30s 1m ... 2h"): each level's delay in ms; ValueError if it is not one."""
    out = []
    for part in text.split():
        num = part.rstrip("smhd")
        unit = part[len(num):]
        if unit not in _LEVEL_UNITS or not num.isascii() or not num.isdigit():
            raise ValueError(f"--message-delay-level: {part[:20]!r} is not a delay (a whole number with a unit: ms, s, m, h, d)")
        out.append(int(num) * _LEVEL_UNITS[unit])
    if not 1 <= len(out) <= MAX_DELAY_LEVELS or max(out) > MAX_LEVEL_DELAY_MS:
        raise ValueError(f"--message-delay-level must give 1 to {MAX_DELAY_LEVELS} delays separated by spaces, each at most 3d")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    data_dir: Path = field(default_factory=default_data_dir)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    # The defaults are in txmq.defaults (core/defaults.py), which `txmq broker start` reads too.
    flush: str = defaults.FLUSH  # "sync" | "async"
    flush_interval_s: float = defaults.FLUSH_INTERVAL_S
    max_frame: int = defaults.MAX_FRAME
    max_body: int = defaults.MAX_BODY
    max_inflight_per_conn: int = 1024
    default_queues: int = DEFAULT_QUEUES
    # A native or RocketMQ 4 (remoting) send or route naming an unknown topic creates it; False: refused
    # (NO_SUCH_TOPIC natively) until the topic is created (`txmq topics create`). The RocketMQ 5 gRPC front end
    # never creates a topic (TOPIC_NOT_FOUND, as RocketMQ 5 answers), whatever this says.
    auto_create_topics: bool = defaults.AUTO_CREATE_TOPICS
    # A delayed or timed message due further ahead than this is refused (docs/scheduled.md).
    max_delay_s: float = defaults.MAX_DELAY_S
    auth_token: str | None = None
    segment_size: int = defaults.SEGMENT_SIZE
    cq_entries_per_file: int = 300_000
    # Check settings given on the command line; config.json (set live) wins
    # over defaults but an explicit start option wins over config.json.
    check: CheckSettings = field(default_factory=CheckSettings)
    check_overrides: tuple[str, ...] = ()
    # Halves per check-pass batch; the loop serves other requests between
    # batches, so this bounds the delay a pass adds to them (~2 ms at 128).
    check_batch: int = 128
    metrics_port: int | None = None
    shutdown_timeout_s: float = 10.0
    # Limits against clients that would exhaust the broker (docs/protocol.md, "Limits").
    max_properties: int = defaults.MAX_PROPERTIES  # UTF-8 bytes of one message's property keys and values
    max_preauth_frame: int = defaults.MAX_PREAUTH_FRAME  # largest frame before a successful hello, with auth_token
    auth_timeout_s: float = defaults.AUTH_TIMEOUT_S  # connect -> first request (a successful hello with auth_token); 0 = none
    frame_timeout_s: float = defaults.FRAME_TIMEOUT_S  # first byte of a frame -> its last; 0 = none
    max_connections: int | None = None  # None: derived from RLIMIT_NOFILE (server.connection_limits)
    max_connections_per_ip: int = defaults.MAX_CONNECTIONS_PER_IP  # 0 = unlimited
    partial_frame_budget: int = defaults.PARTIAL_FRAME_BUDGET  # bytes all connections together may hold in partly received frames
    # RocketMQ 5's gRPC service on this port too (None: not served; docs/rocketmq.md), on the same host;
    # TLS with both files given, plain text otherwise.
    rocketmq_port: int | None = None
    rocketmq_tls_cert: Path | None = None
    rocketmq_tls_key: Path | None = None
    # Open connections to rocketmq_port at most (None: derived from RLIMIT_NOFILE, server.connection_limits).
    rocketmq_max_connections: int | None = None
    # RocketMQ 4's remoting protocol on this port too (None: not served; docs/remoting.md), on the same host: the
    # name server's requests and the broker's, so a 4.x client's namesrvAddr is host:remoting_port.
    remoting_port: int | None = None
    # Open connections to remoting_port at most (None: derived from RLIMIT_NOFILE, server.connection_limits).
    remoting_max_connections: int | None = None
    # Also serve remoting on remoting_port - 2: the "VIP channel" Java clients before 4.5.1 send to by default.
    remoting_vip_channel: bool = False
    # RocketMQ's messageDelayLevel: the delay (ms) of each delay level, 1 first (parse_delay_levels). A 4.x
    # consumer's retry (CONSUMER_SEND_MSG_BACK) waits level 3 + its reconsume times (messaging/naming.py, retry_delay_ms).
    message_delay_levels_ms: tuple[int, ...] = parse_delay_levels(MESSAGE_DELAY_LEVEL)
    # Seconds one CPU keeps spinning (lowest priority) after a lone client's request or reply; 0 = off
    # (broker/busypoll.py; docs/architecture.md, "Busy polling").
    busy_poll_s: float = defaults.BUSY_POLL_S
    # Worker processes that serve --rocketmq-port (each holds its share of the connections and relays their RPCs
    # to this process, which alone owns the store; broker/workers/, docs/architecture.md, "Front-end workers"); 0: this
    # process serves it itself.
    frontend_processes: int = 0

    def validated(self) -> "BrokerConfig":
        """Raise ValueError, naming the start option, for limits the broker could not serve with."""
        if self.max_properties < 1024:
            raise ValueError(f"--max-properties must be at least 1024 bytes (a transactional message carries a few properties), not {self.max_properties}")
        need = self.max_body + self.max_properties + FRAME_OVERHEAD
        if self.max_frame < need:
            raise ValueError(f"--max-frame {self.max_frame} is too small: a frame must carry the largest message, "
                             f"--max-body + --max-properties + {FRAME_OVERHEAD} = {need} bytes")
        hello = 1024 + len((self.auth_token or "").encode())
        if self.max_preauth_frame < hello:
            raise ValueError(f"--max-preauth-frame {self.max_preauth_frame} is too small to carry a hello (at least {hello} bytes)")
        if self.partial_frame_budget < self.max_frame:
            raise ValueError(f"--partial-frame-budget {self.partial_frame_budget} is smaller than --max-frame {self.max_frame}: "
                             "no frame of the largest size could ever be received")
        if not (0.001 <= self.flush_interval_s <= 3600):  # 0 would spin the flusher on a CPU
            raise ValueError(f"--flush-interval must be between 1ms and 1h, not {self.flush_interval_s:g}s")
        if not (0 <= self.auth_timeout_s <= 86400) or not (0 <= self.frame_timeout_s <= 86400):
            raise ValueError("--auth-timeout and --frame-timeout must be between 0 (none) and 1d")
        if not (0 <= self.busy_poll_s <= defaults.MAX_BUSY_POLL_S):
            raise ValueError(f"--busy-poll must be between 0 (off) and {defaults.MAX_BUSY_POLL_S * 1000:g}ms, not {self.busy_poll_s * 1000:g}ms")
        if not (1 <= self.max_delay_s <= 3650 * 86400):
            raise ValueError(f"--max-delay must be between 1s and 3650d, not {self.max_delay_s:g}s")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, not {self.max_connections}")
        if self.max_connections_per_ip < 0:
            raise ValueError(f"--max-connections-per-ip must be 0 (unlimited) or more, not {self.max_connections_per_ip}")
        if (self.rocketmq_tls_cert is None) != (self.rocketmq_tls_key is None):
            raise ValueError("--rocketmq-tls-cert and --rocketmq-tls-key go together: give both for TLS, or neither")
        if self.rocketmq_port is None and self.rocketmq_tls_cert is not None:
            raise ValueError("--rocketmq-tls-cert and --rocketmq-tls-key need --rocketmq-port")
        if self.rocketmq_max_connections is not None:
            if self.rocketmq_port is None:
                raise ValueError("--rocketmq-max-connections needs --rocketmq-port")
            if self.rocketmq_max_connections < 1:
                raise ValueError(f"--rocketmq-max-connections must be at least 1, not {self.rocketmq_max_connections}")
        if self.rocketmq_port is not None:
            if not (0 <= self.rocketmq_port <= 65535):
                raise ValueError(f"--rocketmq-port must be between 0 (a free port) and 65535, not {self.rocketmq_port}")
            if self.rocketmq_port and self.rocketmq_port in (self.port, self.metrics_port):
                raise ValueError(f"--rocketmq-port {self.rocketmq_port} is already the broker's --port or --metrics-port")
        if self.remoting_max_connections is not None:
            if self.remoting_port is None:
                raise ValueError("--remoting-max-connections needs --remoting-port")
            if self.remoting_max_connections < 1:
                raise ValueError(f"--remoting-max-connections must be at least 1, not {self.remoting_max_connections}")
        if self.remoting_vip_channel:
            if self.remoting_port is None:
                raise ValueError("--remoting-vip-channel needs --remoting-port")
            if self.remoting_port and self.remoting_port - 2 in (self.port, self.metrics_port, self.rocketmq_port):
                raise ValueError(f"--remoting-vip-channel listens on --remoting-port - 2 = {self.remoting_port - 2}, already the "
                                 "broker's --port, --metrics-port or --rocketmq-port")
            if self.remoting_port and self.remoting_port < 3:
                raise ValueError("--remoting-vip-channel listens on --remoting-port - 2: --remoting-port must be at least 3")
        if not 1 <= len(self.message_delay_levels_ms) <= MAX_DELAY_LEVELS or any(
                type(d) is not int or not 0 <= d <= MAX_LEVEL_DELAY_MS for d in self.message_delay_levels_ms):
            raise ValueError(f"--message-delay-level must give 1 to {MAX_DELAY_LEVELS} delays, each from 0 to 3 days")
        if self.remoting_port is not None:
            if not (0 <= self.remoting_port <= 65535):
                raise ValueError(f"--remoting-port must be between 0 (a free port) and 65535, not {self.remoting_port}")
            if self.remoting_port and self.remoting_port in (self.port, self.metrics_port, self.rocketmq_port):
                raise ValueError(f"--remoting-port {self.remoting_port} is already the broker's --port, --metrics-port or --rocketmq-port")
        return self


# Room in a frame besides the body and the properties: the array, the op,
# field names, topic, ids, and msgpack headers of up to 256 properties.
FRAME_OVERHEAD = 4096
