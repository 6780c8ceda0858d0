"""Clocks cannot fool the check service or the pending listing.

Ages run on the broker's clock from when it stored a transaction's first
half copy: a producer clock running ahead does not hide a transaction from
`txmq inspect half` (and the rollback recipe), one running behind does not
cut the transaction timeout short, and a half stored "after now" (the
broker's clock stepped back) does not hold up the check-backs behind it.
The broker's clock is a ManualClock; the check interval is an hour, so
only the passes a test runs happen.
"""

from __future__ import annotations

import asyncio

from conftest import arun
from clihelpers import lines, needs_jq, ok, shell, txmq
from txhelpers import G, half_fields
from txmq.broker.clock import ManualClock
from txmq.broker.testing import running_broker
from txmq.broker.transactions.index import Outcome
from wireclient import RawClient

HOUR_MS = 3600_000


def _now_ms(clock: ManualClock) -> int:
    return int(clock() * 1000)


async def _pushed_tx_ids(c: RawClient, wait: float = 0.3) -> list[str]:
    """tx ids of the check-backs pushed to c within wait seconds."""
    ids = [f.fields["tx_id"] for f in c.pushes]
    c.pushes.clear()
    while True:
        try:
            f = await c.wait_push(timeout=wait)
        except asyncio.TimeoutError:
            return ids
        ids.append(f.fields["tx_id"])


@needs_jq
def test_half_born_in_the_future_is_listed_by_its_store_age_and_rolled_back_by_the_recipe(tmp_path):
    clock = ManualClock()
    data = tmp_path / "data"

    async def go():
        async with running_broker(data, clock=clock, check_interval_s=3600) as b:
            c = await RawClient.open(b.address)
            future = await c.ok("send", {**half_fields(b"ahead"), "born_ts": _now_ms(clock) + HOUR_MS})
            plain = await c.ok("send", half_fields(b"plain"))
            listed = await c.ok("tx_pending", {})
            assert {t["tx_id"] for t in listed["transactions"]} == {future["tx_id"], plain["tx_id"]}, listed
            row = next(t for t in listed["transactions"] if t["tx_id"] == future["tx_id"])
            assert row["age_s"] == 0 and row["born_at"] > row["stored_at"], row

            clock.advance(61)
            old = await c.ok("tx_pending", {"min_age_ms": 60_000})
            assert {t["tx_id"] for t in old["transactions"]} == {future["tx_id"], plain["tx_id"]}, old
            assert all(60 <= t["age_s"] <= 62 for t in old["transactions"]), old

            # The README recipe, against this broker (the CLI runs in a shell; the loop keeps serving).
            loop = asyncio.get_running_loop()
            r = await loop.run_in_executor(None, shell, "txmq inspect half --older-than 1m -o jsonl | jq -r .tx_id "
                                                        "| txmq resolve --rollback - --yes", b.address)
            assert r.returncode == 0, r.stderr.decode()
            assert b.core.tx.index.outcome(future["tx_id"]) is Outcome.ROLLED_BACK
            assert b.core.tx.index.outcome(plain["tx_id"]) is Outcome.ROLLED_BACK
            await c.ok("send", {**half_fields(b"ahead-2"), "born_ts": _now_ms(clock) + HOUR_MS})
            await c.close()

    arun(go())
    # Read from the files, the broker down: the same ages (by the store time).
    rows = lines(ok(txmq("inspect", "half", "--data-dir", str(data), "-o", "jsonl")))
    assert len(rows) == 1 and rows[0]["born_at"] > rows[0]["stored_at"], rows


def test_producer_clock_behind_gets_no_check_back_before_the_timeout_from_store_time(tmp_path):
    clock = ManualClock()

    async def go():
        async with running_broker(tmp_path / "data", clock=clock, check_interval_s=3600, transaction_timeout_s=20) as b:
            check = b.core.check
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": [G]})
            behind = _now_ms(clock) - HOUR_MS
            h = await c.ok("send", {**half_fields(b"behind"), "born_ts": behind})
            own = await c.ok("send", {**half_fields(b"own-immunity", CHECK_IMMUNITY_TIME_IN_SECONDS="60"), "born_ts": behind})
            stored = _now_ms(clock)

            clock.advance(0.4)
            r = await check.run_pass()
            assert r["checked"] == 0 and await _pushed_tx_ids(c) == [], r
            row = {t["tx_id"]: t for t in (await c.ok("tx_pending", {}))["transactions"]}
            assert row[h["tx_id"]]["next_check_at"] >= stored + 20_000, row
            assert row[h["tx_id"]]["age_s"] < 1, row

            clock.advance(19)  # 19.4 s after it was stored: still inside the 20 s timeout
            r = await check.run_pass()
            assert r["checked"] == 0 and await _pushed_tx_ids(c) == [], r

            clock.advance(1)  # 20.4 s
            r = await check.run_pass()
            assert r["checked"] == 1 and await _pushed_tx_ids(c) == [h["tx_id"]], r

            clock.advance(40)  # 60.4 s: the message's own immunity is over too
            r = await check.run_pass()
            assert own["tx_id"] in await _pushed_tx_ids(c), r
            await c.close()

    arun(go())


def test_half_stored_ahead_of_the_clock_does_not_stall_later_check_backs(tmp_path):
    clock = ManualClock()

    async def go():
        async with running_broker(tmp_path / "data", clock=clock, check_interval_s=3600, transaction_timeout_s=6) as b:
            check = b.core.check
            c = await RawClient.open(b.address)
            await c.ok("hello", {"producer_groups": [G]})
            ahead = await c.ok("send", half_fields(b"before-the-step"))
            clock.advance(-3600)  # the broker's clock is stepped back an hour
            later = [await c.ok("send", half_fields(f"after-{i}".encode())) for i in range(3)]

            clock.advance(7)
            r = await check.run_pass()
            assert sorted(await _pushed_tx_ids(c)) == sorted(h["tx_id"] for h in later), r
            # The one stored "in the future" counts as stored when the pass first saw it.
            row = {t["tx_id"]: t for t in (await c.ok("tx_pending", {}))["transactions"]}
            assert row[ahead["tx_id"]]["stored_at"] == _now_ms(clock), row[ahead["tx_id"]]

            clock.advance(7)
            await check.run_pass()
            assert ahead["tx_id"] in await _pushed_tx_ids(c)
            await c.close()

    arun(go())
