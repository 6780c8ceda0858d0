"""The persisted transaction index (txindex.db) always agrees with a rebuild from the log alone.

Random runs of a real broker: half messages, ends (commit, rollback,
unknown, duplicates and conflicts), check passes that send check-backs and
discard after max checks, replays of discards, index flushes at random
points, and restarts, clean or as after SIGKILL (no flush after the last
one). After every start, and at the end, what the running broker's index
says of every transaction (pending fields, or outcome and who decided it)
equals what a rebuild from the commit log alone says.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from conftest import arun
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tx_recovery import _full_view, _index_view, crash_on_exit
from txmq.broker.clock import ManualClock
from txmq.broker.testing import running_broker
from wireclient import RawClient

TX = {"TRAN_MSG": "true", "PGROUP": "g"}

op = st.one_of(
    st.tuples(st.just("half")),
    st.tuples(st.just("half")),
    st.tuples(st.just("pass")),
    st.tuples(st.just("end"), st.integers(0, 20), st.sampled_from(["commit", "rollback", "unknown"])),
    st.tuples(st.just("pass")),
    st.tuples(st.just("replay"), st.integers(0, 20), st.sampled_from(["half", "commit"])),
    st.tuples(st.just("flush")),
    st.tuples(st.just("restart"), st.booleans()),
)


async def _run(data: Path, ops: list[tuple]) -> list[str]:
    clock = ManualClock()
    halves: list[dict] = []
    problems: list[str] = []

    async def start():
        ctx = running_broker(data, clock=clock, check_interval_s=3600, max_checks=2)
        b = await ctx.__aenter__()
        c = await RawClient.open(b.address)
        await c.ok("hello", {"producer_groups": ["g"]})  # check-backs go to this connection, never answered
        return ctx, b, c

    def check(b, when: str) -> None:
        full = _full_view(data)
        live = _index_view(b.core.tx.index, full[0].keys())
        if live != full:
            problems.append(f"{when}: live {live} != rebuilt {full}")

    ctx, b, c = await start()
    try:
        for o in ops:
            if o[0] == "half":
                halves.append(await c.ok("send", {"topic": "t", "body": b"m", "properties": TX}))
            elif o[0] == "end" and halves:
                h = halves[o[1] % len(halves)]
                await c.req("end_transaction", {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                                "half_offset": h["half_offset"], "state": o[2]})
            elif o[0] == "pass":
                clock.advance(10)
                await b.core.check.run_pass()
            elif o[0] == "replay" and halves:
                h = halves[o[1] % len(halves)]
                await c.req("discard_replay", {"to": o[2], "refs": [{"tx_id": h["tx_id"]}]})
            elif o[0] == "flush":
                await b.broker._flush_index()
            elif o[0] == "restart":
                if o[1]:
                    crash_on_exit(b)
                await c.close()
                await ctx.__aexit__(None, None, None)
                ctx, b, c = await start()
                check(b, f"after a {'crash' if o[1] else 'clean stop'}")
        check(b, "at the end")
    finally:
        await c.close()
        await ctx.__aexit__(None, None, None)
    return problems


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=4, max_size=40))
def test_the_persisted_index_agrees_with_a_rebuild_from_the_log(ops):
    tmp = Path(tempfile.mkdtemp(prefix="txmq-idx-"))
    try:
        assert arun(_run(tmp / "data", ops)) == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_flush_of_thousands_of_decisions_writes_every_row_and_empties_memory(tmp_path):
    """More rows than one multi-row INSERT and more decisions than one slice of the loop's clean-up."""
    from txmq.broker.server import FLUSHED_SLICE
    from txmq.broker.transactions.indexfile import ROWS_PER_INSERT

    n = max(FLUSHED_SLICE, ROWS_PER_INSERT) * 2 + 7
    data = tmp_path / "d"

    async def go():
        async with running_broker(data, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            for i in range(n):
                h = await c.ok("send", {"topic": "t", "body": b"m", "properties": TX})
                await c.ok("end_transaction", {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                               "half_offset": h["half_offset"], "state": "commit" if i % 3 else "rollback"})
            await b.broker._flush_index()
            assert not b.core.tx.index.decided  # every decision on disk, none left in memory
            live = _index_view(b.core.tx.index, _full_view(data)[0].keys())
            await c.close()
            return live

    live = arun(go())
    full = _full_view(data)
    assert live == full
    assert len(full[0]) == n
