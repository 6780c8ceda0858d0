"""Repeated SIGKILL of a sync-flush broker under a mixed load; the invariants after every restart.

The load (tests/faultload.py) sends plain messages and batches, runs
transactions with every outcome (producer commit/rollback/unknown, producers
that never end them, check-back answers, operator resolves, discards after
max checks), and runs a consumer group that commits offsets. After each
kill the data directory is compared with everything the broker
acknowledged (faultload.check_invariants), the broker is restarted and must
agree with that offline view. Short run: 3 cycles; TXMQ_FAULT_LONG=1: 30.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter

import pytest

from brokerproc import BrokerProcess
from conftest import arun
from faultload import Ledger, MixedLoad, Report, check_invariants, check_live, check_restart_log, new_log_lines, record

pytestmark = [pytest.mark.fault, pytest.mark.slow]

LONG = os.environ.get("TXMQ_FAULT_LONG") == "1"
CYCLES = int(os.environ.get("TXMQ_FAULT_CYCLES", "30" if LONG else "3"))
MAX_CHECKS = 3
ARGS = ("--flush", "sync", "--check-interval", "300ms", "--transaction-timeout", "500ms", "--max-checks", str(MAX_CHECKS))


def test_repeated_sigkill_under_mixed_load_keeps_every_invariant(tmp_path):
    data = tmp_path / "data"
    seed = int(os.environ.get("TXMQ_FAULT_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    ledger = Ledger()
    rep = Report()
    figures: list[dict] = []
    torn = 0
    broker = BrokerProcess(data, *ARGS).start()
    t0 = time.monotonic()
    try:
        for cycle in range(CYCLES):
            async def one_cycle() -> None:
                load = MixedLoad(broker.address, ledger, f"c{cycle}", rng=rng)
                task = asyncio.create_task(load.run())
                await asyncio.sleep(rng.uniform(1.2, 2.5))
                broker.kill()
                try:
                    await asyncio.wait_for(task, 20)
                finally:
                    await load.close()

            arun(one_cycle())
            fig = check_invariants(data, ledger, rep, max_checks=MAX_CHECKS)
            figures.append(fig)
            mark = broker.log.stat().st_size
            broker.start()
            arun(check_live(broker.address, fig, rep))
            torn += check_restart_log(new_log_lines(broker.log, mark), rep)
        assert broker.stop() == 0
        fig = check_invariants(data, ledger, rep, max_checks=MAX_CHECKS, open_store=True)
    finally:
        broker.kill()
    c = ledger.counts
    decided: Counter = Counter()
    for f in figures[-1:]:
        decided.update(f["decided_by"])
    summary = record(
        "sigkill", cycles=CYCLES, seed=seed, invariant_checks_passed=rep.checks, took_s=round(time.monotonic() - t0, 1),
        torn_tails_cut=torn, plain_acked=len(ledger.plain), halves_acked=len(ledger.halves), outcomes_acked=len(ledger.outcomes),
        consumed=c["consumed"], redelivered_uncommitted=ledger.redelivered, offsets_committed=c["offsets_committed"],
        checks_answered=c["checks_received"], decided_by=dict(decided), pending_at_end=fig["pending"])
    # the load exercised every path it is meant to
    assert len(ledger.plain) > 100 * CYCLES and len(ledger.halves) > 20 * CYCLES, summary
    assert c["checks_received"] > 0 and c["offsets_committed"] > 0, summary
    if CYCLES >= 3:
        assert {"producer", "check", "operator"} <= set(decided), summary
