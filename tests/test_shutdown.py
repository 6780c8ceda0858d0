"""Graceful shutdown (SIGTERM) under the mixed load loses nothing acknowledged, in both flush modes.

The broker stops accepting, answers what is in flight (new requests get the
retriable SHUTTING_DOWN), flushes, checkpoints and exits 0. Afterwards the
directory is opened as a Store (recovery must drop nothing) and compared
with everything acknowledged (tests/faultload.py).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from brokerproc import BrokerProcess
from conftest import arun
from faultload import Ledger, MixedLoad, Report, check_invariants, record

pytestmark = [pytest.mark.fault, pytest.mark.slow]


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_sigterm_under_load_loses_nothing_acknowledged_and_exits_0(tmp_path, flush):
    data = tmp_path / "data"
    ledger = Ledger()
    rep = Report()
    b = BrokerProcess(data, "--flush", flush, "--check-interval", "300ms", "--transaction-timeout", "500ms", "--max-checks", "3")
    for cycle in range(2):  # the second run starts from the first's directory
        b.start()

        async def go() -> int:
            load = MixedLoad(b.address, ledger, f"{flush}{cycle}", rng=random.Random(cycle))
            task = asyncio.create_task(load.run())
            await asyncio.sleep(1.5)
            code = await asyncio.get_running_loop().run_in_executor(None, b.stop)
            try:
                await asyncio.wait_for(task, 20)
            finally:
                await load.close()
            return code

        code = arun(go())
        log = b.log.read_text()
        assert code == 0, log[-2000:]
        assert "event=shutdown_done" in log
        assert "Traceback" not in log, log[-3000:]
        check_invariants(data, ledger, rep, max_checks=3, open_store=True)
    assert len(ledger.plain) > 200 and len(ledger.outcomes) > 20 and ledger.counts["offsets_committed"] > 0, ledger.counts
    record(f"sigterm-{flush}", runs=2, invariant_checks_passed=rep.checks, plain_acked=len(ledger.plain), outcomes_acked=len(ledger.outcomes))


def test_a_stop_during_the_index_start_closes_the_index_file_only_after_its_running_flush(tmp_path, monkeypatch):
    """A flush whose task is cancelled goes on in the index thread: its connection must not be closed under it."""
    import threading
    import time
    from pathlib import Path

    from txmq.broker.config import BrokerConfig
    from txmq.broker.main import bind
    from txmq.broker.server import Broker
    from txmq.broker.transactions.indexfile import TxDatabase

    events: list[str] = []
    in_flush, release = threading.Event(), threading.Event()
    real_flush, real_close = TxDatabase.flush, TxDatabase.close

    def slow_flush(self, *args, **kwargs):
        in_flush.set()
        release.wait(5)
        real_flush(self, *args, **kwargs)
        events.append("flush done")

    def close(self):
        events.append("close")
        real_close(self)

    monkeypatch.setattr(TxDatabase, "flush", slow_flush)
    monkeypatch.setattr(TxDatabase, "close", close)

    async def go() -> None:
        sock = bind("127.0.0.1", 0)
        broker = Broker(BrokerConfig(data_dir=Path(tmp_path / "d"), host="127.0.0.1", port=sock.getsockname()[1]))
        shutdown = asyncio.Event()
        task = asyncio.create_task(broker.serve(sock, shutdown))
        while not in_flush.is_set():  # the start's index flush is running in the index thread
            await asyncio.sleep(0.01)
        shutdown.set()
        await asyncio.sleep(0.2)  # the stop cancels the start and reaches the close meanwhile
        release.set()
        await task

    arun(go())
    time.sleep(0.1)
    assert events[0] == "flush done" and "close" in events, events
