"""Running out of file descriptors is logged once per change of state, and counted.

A broker subprocess checkpoints every 100 ms; its open-file limit is then
lowered from outside (prlimit(2)) below the descriptors it holds, so every
checkpoint fails with EMFILE when it opens a consume-queue file, and so
does every send that creates a topic (topics.json). Each kind is logged
once when it starts (`event=flush_failed`, `event=fds_exhausted`) and once
when it ends (`event=flush_recovered`, `event=fds_available`), never every
cycle or request; the counters `flush_errors` and `fd_exhausted_errors`
count every failure. Sends to a known topic are served throughout.
"""

from __future__ import annotations

import asyncio
import resource
import time

import pytest

from brokerproc import BrokerProcess
from conftest import arun
from txmq.wire import ErrorCode
from wireclient import RawClient

pytestmark = [pytest.mark.fault]


async def logged(b: BrokerProcess, event: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while f"event={event}" not in b.log.read_text():
        assert time.monotonic() < deadline, f"no event={event}: {b.log.read_text()[-2000:]}"
        await asyncio.sleep(0.05)


def test_failing_checkpoints_and_requests_without_descriptors_are_logged_once_per_spell_and_counted(tmp_path):
    b = BrokerProcess(tmp_path / "data", "--flush-interval", "100ms", "--check-interval", "1h")
    b.start()
    try:
        async def go() -> dict:
            c = await RawClient.open(b.address)
            await c.ok("hello", {})
            await c.ok("send", {"topic": "known", "body": b"before"})
            await c.ok("tx_pending")  # answered once the transaction index is loaded: its files are open
            soft, hard = resource.prlimit(b.pid, resource.RLIMIT_NOFILE)
            # Below every descriptor number in use: the ones open keep working, any new one is EMFILE.
            resource.prlimit(b.pid, resource.RLIMIT_NOFILE, (3, hard))
            refused = 0
            try:
                for i in range(3):
                    code, fields = await c.req("send", {"topic": f"new{i}", "body": b"x"})
                    assert code == ErrorCode.STORE_ERROR, (code, fields)
                    refused += 1
                # many checkpoint cycles, each with consume-queue entries to write
                for i in range(20):
                    await c.ok("send", {"topic": "known", "body": b"during %d" % i})
                    await asyncio.sleep(0.05)
                await logged(b, "flush_failed")
                await logged(b, "fds_exhausted")
            finally:
                resource.prlimit(b.pid, resource.RLIMIT_NOFILE, (soft, hard))
            await logged(b, "flush_recovered")
            await logged(b, "fds_available")
            await c.ok("send", {"topic": "new0", "body": b"after"})
            counters = (await c.ok("stats"))["counters"]
            await c.close()
            return {"refused": refused, **counters}

        figures = arun(go())
        assert b.stop() == 0
    finally:
        b.kill()
    assert figures["fd_exhausted_errors"] == figures["refused"] == 3
    assert figures["flush_errors"] >= 3  # one every 100 ms for about a second
    log = b.log.read_text()
    for event in ("flush_failed", "flush_recovered", "fds_exhausted", "fds_available"):
        assert log.count(f"event={event}") == 1, (event, log[-3000:])
    assert "Too many open files" in next(ln for ln in log.splitlines() if "event=flush_failed" in ln)
    assert "event=store_error" not in log and "Traceback" not in log, log[-3000:]
