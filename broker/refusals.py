"""What every front end says about the requests it refuses and the errors it did not expect: one throttled line, and a count.

A refusal is a request (or a connection) the broker turns away on purpose:
a wrong or missing credential, a connection over a cap, a malformed frame
or body, a client over a limit. A flood of them must leave a trace without
flooding the log, so each front end reports each one here:

    core.refusals.note("remoting", "bad_request", conn.peer, "the body of HEART_BEAT nests deeper than 64 levels")

- ``note(frontend, kind, peer, reason)`` counts the refusal under the
  counter ``refused_<frontend>_<kind>`` (``txmq stats``; on /metrics
  ``txmq_refused_total{frontend="<frontend>",kind="<kind>"}``) and logs at
  most one line per (frontend, kind) every ``every_s`` (10 s): the peer and
  reason of the refusal that made the line due, and how many were refused
  since the last line (``refused=``), at WARNING::

      event=refused frontend=remoting kind=bad_request peer=127.0.0.1:50412 refused=300 reason='...'

  ``frontend`` is one word of lower-case letters and digits (``native``,
  ``remoting``, ``rocketmq``); ``kind`` lower-case letters, digits and
  underscores, one of KINDS. Both come from the code, never from a client
  (they are label values). ``peer`` and ``reason`` may be anything: they
  are cut to a bounded length and logged quoted, on one line.
- ``internal(where, exc)`` is for an exception nothing expected (a bug): it
  is counted (``internal_errors``; /metrics ``txmq_internal_errors``) and
  logged as ``event=internal_error``, with its traceback the first time an
  exception of its type is seen at ``where`` (ERROR), then at most one line
  per (where, type) every ``every_s``, with the count and no traceback.
  ``BrokerCore.store_error`` calls it; a front end whose handlers raise
  past it calls it too.

The broker holds one ``Refusals`` as ``core.refusals``; the calls run on
the event loop (not thread-safe). ``clock`` is injectable for tests.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

from .connlimits import LogThrottle

log = logging.getLogger("txmq.broker")

EVERY_S = 10.0
# The kinds of refusal. A front end may add one (a word of the code, never a client's value).
KINDS = (
    "auth",  # a missing or wrong credential (--auth-token)
    "connection_limit",  # a connection over --max-connections, --remoting-max-connections, ..., --max-connections-per-ip
    "busy",  # over a limit on what the broker holds for clients (--partial-frame-budget, long polls per client)
    "timeout",  # no first request within --auth-timeout, a frame not complete within --frame-timeout
    "bad_request",  # a malformed frame, header or body (nested too deeply, too large, not the encoding it must be)
)
COUNTER_PREFIX = "refused_"
INTERNAL_COUNTER = "internal_errors"
MAX_PEER = 100
MAX_REASON = 300
MAX_INTERNAL_KINDS = 256  # (where, exception type) pairs remembered; past them every internal error shares one throttle

_FRONTEND = re.compile(r"[a-z][a-z0-9]*\Z")
_KIND = re.compile(r"[a-z][a-z0-9_]*\Z")


class Refusals:
    """Counts and logs refusals and internal errors for every front end (see the module's docstring)."""

    def __init__(self, metrics: Any, every_s: float = EVERY_S, clock: Callable[[], float] | None = None) -> None:
        self.metrics = metrics  # broker/metrics.py's Metrics (``inc``)
        self.every_s = every_s
        self.clock = clock
        self._throttles: dict[tuple[str, str], LogThrottle] = {}
        self._internal: dict[tuple[str, str], LogThrottle] = {}

    def note(self, frontend: str, kind: str, peer: str, reason: str) -> None:
        """One refused request or connection: counted, and logged when a line for (frontend, kind) is due."""
        key = (frontend, kind)
        throttle = self._throttles.get(key)
        if throttle is None:
            if not _FRONTEND.match(frontend) or not _KIND.match(kind):
                raise ValueError(f"refusals are counted under a front end's name and a kind of lower-case words, not {frontend!r}, {kind!r}")
            throttle = self._throttles[key] = LogThrottle(self.every_s, self.clock)
        self.metrics.inc(f"{COUNTER_PREFIX}{frontend}_{kind}")
        refused = throttle.note()
        if refused:
            log.warning("event=refused frontend=%s kind=%s peer=%s refused=%d reason=%r", frontend, kind, _cut(str(peer), MAX_PEER), refused,
                        _cut(str(reason), MAX_REASON))

    def internal(self, where: str, exc: BaseException) -> None:
        """An exception nothing expected: counted; its first of a type logged with the traceback, then throttled lines."""
        self.metrics.inc(INTERNAL_COUNTER)
        key = (where, type(exc).__name__)
        throttle = self._internal.get(key)
        first = throttle is None
        if first:
            if len(self._internal) >= MAX_INTERNAL_KINDS:
                key = ("-", "-")
                throttle = self._internal.get(key)
                first = False
            if throttle is None:
                throttle = self._internal[key] = LogThrottle(self.every_s, self.clock)
        count = throttle.note()
        if first:
            log.error("event=internal_error where=%s error=%s count=%d msg=%s", where, _cut(repr(exc), MAX_REASON), count,
                      "'first of its kind: traceback follows; the next are counted in internal_errors, logged at most every 10s'",
                      exc_info=exc)
        elif count:
            log.error("event=internal_error where=%s error=%s count=%d", where, _cut(repr(exc), MAX_REASON), count)


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n] + "..."


__all__ = ["Refusals", "KINDS", "EVERY_S", "COUNTER_PREFIX", "INTERNAL_COUNTER"]
