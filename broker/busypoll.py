"""Busy polling: keep a CPU of the broker awake for a moment after a lone client's request or reply.

The spinner itself is compiled (core/_busypoll.pyx: a C thread at
``SCHED_IDLE`` that never takes the GIL); this module decides whether it
runs and hands the connections the function they call. There is no Python
fallback: a spinning Python thread would hold the GIL the event loop needs,
so without the compiled module (or with ``TXMQ_PURE_PYTHON`` set) the broker
simply does not busy-poll, and says so in ``txmq broker status``.
"""

from __future__ import annotations

import importlib
import os
from functools import partial
from typing import Callable


class BusyPoll:
    """What the broker's busy polling is doing: ``arm`` (None when off) and a description for status."""

    __slots__ = ("window_s", "arm", "state", "_mod")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.arm: Callable[[], None] | None = None
        self._mod = None
        if window_s <= 0:
            self.state = "off"
            return
        if (os.cpu_count() or 1) < 2:
            self.state = "off (one CPU: nothing to keep awake for)"
            return
        if os.environ.get("TXMQ_PURE_PYTHON"):
            self.state = "off (TXMQ_PURE_PYTHON)"
            return
        try:
            mod = importlib.import_module("txmq._busypoll")
        except ImportError:
            self.state = "unavailable (the compiled module was not built on this machine)"
            return
        err = mod.start()
        if err:
            self.state = f"unavailable (could not start its thread: {os.strerror(err)})"
            return
        self._mod = mod
        self.arm = partial(mod.arm, int(window_s * 1e9))
        self.state = "on"

    def status(self) -> dict[str, object]:
        """For `txmq broker status`: the window, and whether the spinner thread runs at the lowest priority."""
        state = self.state
        if self._mod is not None:
            tid, policy_ok, _ = self._mod.status()
            if policy_ok == 0:  # neither SCHED_IDLE nor nice 19 could be set: the thread never spins
                state = "unavailable (the spinner thread could not lower its priority)"
        return {"busy_poll": state, "busy_poll_window_us": round(self.window_s * 1e6)}

    def stop(self) -> None:
        if self._mod is not None:
            self._mod.halt()
