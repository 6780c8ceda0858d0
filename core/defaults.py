"""Default values of the broker's settings, in one light module (`txmq.defaults`).

``BrokerConfig`` and ``CheckSettings`` (broker/config.py) take their
defaults from here, and so do the options of `txmq broker start`
(cli/commands/broker.py): building the CLI must not import the broker or
the store (shell completion runs it on every Tab; tests/test_cli_completion.py),
so both read the values from this module instead of repeating them. The
listen address is in txmq.constants (DEFAULT_HOST, DEFAULT_PORT,
DEFAULT_ADDRESS), shared with the client.
"""

from __future__ import annotations

# Durability: "sync" acknowledges after the fsync; "async" fsyncs every FLUSH_INTERVAL_S.
FLUSH = "async"
FLUSH_INTERVAL_S = 0.5
SEGMENT_SIZE = 1 << 30  # commit-log segment file, bytes

# Limits against clients that would exhaust the broker (docs/protocol.md, "Limits").
MAX_FRAME = 8 << 20
MAX_BODY = 4 << 20
MAX_PROPERTIES = 64 << 10  # UTF-8 bytes of one message's property keys and values
MAX_PREAUTH_FRAME = 64 << 10  # largest frame before a successful hello, with an auth token
AUTH_TIMEOUT_S = 10.0  # connect -> first request (a successful hello with an auth token); 0 = none
FRAME_TIMEOUT_S = 60.0  # first byte of a frame -> its last; 0 = none
MAX_CONNECTIONS_PER_IP = 0  # 0 = unlimited
PARTIAL_FRAME_BUDGET = 256 << 20  # bytes all connections together may hold in partly received frames

# A send to a topic the broker does not know creates it (with the default queues and message types);
# False: such sends are refused until `txmq topics create` (docs/cli.md, "txmq topics").
AUTO_CREATE_TOPICS = True

# The longest a message may be scheduled ahead (RocketMQ's timerMaxDelaySec default: 3 days); further is refused.
MAX_DELAY_S = 3 * 86400.0

# The check settings (`txmq config set` changes them while the broker runs; docs/transactions.md).
CHECK_INTERVAL_S = 60.0
TRANSACTION_TIMEOUT_S = 6.0
MAX_CHECKS = 15
RETENTION_S = 72 * 3600.0

# After a request or reply of a lone client the broker keeps one CPU spinning at the lowest priority
# for this long, so the next request or the end of an fdatasync finds it awake (core/_busypoll.pyx;
# docs/architecture.md, "Busy polling"). 0 turns it off.
BUSY_POLL_S = 0.001
MAX_BUSY_POLL_S = 0.1
