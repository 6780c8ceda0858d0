"""The check service survives passes that fail: too many open files.

A broker subprocess runs a check pass every 200 ms; its open-file limit is
then lowered from outside (prlimit(2)) below the descriptors it holds, so
every pass fails with EMFILE when it writes its progress file. The broker
must log that once (no traceback), keep serving the connection it has,
retry at each interval, say when a pass succeeds again, and stop with 0.
"""

from __future__ import annotations

import asyncio
import resource
import time

import pytest

from brokerproc import BrokerProcess
from conftest import arun
from faultload import PipeClient

pytestmark = [pytest.mark.fault]


def _wait_for(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def test_too_many_open_files_in_a_check_pass_is_logged_once_and_retried(tmp_path):
    b = BrokerProcess(tmp_path / "data", "--check-interval", "200ms")
    b.start()
    try:
        async def go() -> None:
            c = await PipeClient.open(b.address)
            await c.ok("send", {"topic": "fd", "body": b"before"})
            await c.ok("tx_pending")  # answered once the transaction index is loaded: its files are open
            soft, hard = resource.prlimit(b.pid, resource.RLIMIT_NOFILE)
            # Below every descriptor number in use: the ones open keep working, any new one is EMFILE.
            resource.prlimit(b.pid, resource.RLIMIT_NOFILE, (3, hard))
            try:
                assert await asyncio.get_running_loop().run_in_executor(
                    None, _wait_for, lambda: "event=check_pass_failed" in b.log.read_text())
                await asyncio.sleep(1.0)  # about five more passes fail the same way
                # the broker keeps serving the connection it has
                await c.ok("send", {"topic": "fd", "body": b"during"})
                r = await c.ok("pull", {"topic": "fd", "queue_id": 0, "offset": 0, "max_count": 10})
                assert r is not None
                await c.ok("tx_pending")
            finally:
                resource.prlimit(b.pid, resource.RLIMIT_NOFILE, (soft, hard))
            assert await asyncio.get_running_loop().run_in_executor(
                None, _wait_for, lambda: "event=check_pass_recovered" in b.log.read_text())
            await c.close()

        arun(go())
        assert b.stop() == 0
    finally:
        b.kill()
    log = b.log.read_text()
    failed = [ln for ln in log.splitlines() if "event=check_pass_failed" in ln]
    assert len(failed) == 1, failed
    assert "Too many open files" in failed[0] or "EMFILE" in failed[0] or "24" in failed[0], failed
    assert "Traceback" not in log, log[-3000:]
    assert log.count("event=check_pass_recovered") == 1
