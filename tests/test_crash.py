"""SIGKILL a sync-flush broker under load: everything acknowledged survives, exactly once."""

from __future__ import annotations

import asyncio
import random

import pytest

from brokerproc import BrokerProcess
from conftest import arun
from txmq.broker.transactions.index import Outcome, rebuild
from txmq.store import StoreReader
from wireclient import RawClient

pytestmark = pytest.mark.fault


async def _load(address: str, seconds: float, acked: dict, tx_acked: dict, halves: dict) -> None:
    """Plain sends and transactions from several connections until the broker dies."""
    stop = asyncio.get_running_loop().time() + seconds

    async def plain(worker: int) -> None:
        c = await RawClient.open(address)
        i = 0
        try:
            while asyncio.get_running_loop().time() < stop:
                body = f"p-{worker}-{i}".encode()
                code, r = await c.req("send", {"topic": "crash", "body": body}, timeout=5)
                if code == 0:
                    acked[body] = r
                i += 1
        except (ConnectionError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            return

    async def tx(worker: int) -> None:
        c = await RawClient.open(address)
        i = 0
        try:
            while asyncio.get_running_loop().time() < stop:
                body = f"t-{worker}-{i}".encode()
                code, h = await c.req("send", {"topic": "crashtx", "body": body, "properties": {"TRAN_MSG": "true", "PGROUP": "g"}}, timeout=5)
                if code != 0:
                    continue
                halves[h["tx_id"]] = body
                state = random.choice(["commit", "commit", "rollback", "unknown"])
                code, r = await c.req("end_transaction", {"group": "g", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                                           "half_offset": h["half_offset"], "state": state}, timeout=5)
                if code == 0 and state != "unknown":
                    tx_acked[h["tx_id"]] = (state, body)
                i += 1
        except (ConnectionError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            return

    await asyncio.gather(*[plain(w) for w in range(4)], *[tx(w) for w in range(4)], return_exceptions=True)


def _bodies(reader: StoreReader, topic: str) -> list[bytes]:
    out = []
    for q in range(4):
        off = 0
        while True:
            res = reader.get_messages(topic, q, off, 1000)
            if not res.records:
                break
            out.extend(r.body for r in res.records)
            off = res.next_offset
    return out


@pytest.mark.parametrize("cycle", range(2))
def test_sigkill_under_sync_load_loses_nothing_acknowledged(tmp_path, cycle):
    data = tmp_path / "data"
    acked: dict = {}
    tx_acked: dict = {}
    halves: dict = {}
    b = BrokerProcess(data, "--flush", "sync").start()

    async def go():
        load = asyncio.create_task(_load(b.address, 10, acked, tx_acked, halves))
        await asyncio.sleep(1.0 + random.random())
        b.kill()
        await asyncio.wait_for(load, 15)

    arun(go())
    assert len(acked) > 50 and len(tx_acked) > 10, (len(acked), len(tx_acked))
    # restart: the store opens cleanly and serves
    with BrokerProcess(data, "--flush", "sync") as b2:
        async def ping():
            c = await RawClient.open(b2.address)
            await c.ok("heartbeat")
            await c.close()

        arun(ping())
    reader = StoreReader(data)
    plain = _bodies(reader, "crash")
    assert len(plain) == len(set(plain)), "a plain message was stored twice"
    missing = [b for b in acked if b not in set(plain)]
    assert not missing, f"{len(missing)} acknowledged messages lost"
    committed = _bodies(reader, "crashtx")
    assert len(committed) == len(set(committed)), "a committed message appears twice"
    idx = rebuild(reader)
    cset = set(committed)
    for tx_id, (state, body) in tx_acked.items():
        out = idx.outcome(tx_id)
        if state == "commit":
            assert out is Outcome.COMMITTED and body in cset
        else:
            assert out is Outcome.ROLLED_BACK and body not in cset
    for tx_id in halves:
        assert idx.outcome(tx_id) is not None, "an acknowledged half message was lost"
