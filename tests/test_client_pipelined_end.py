"""The pipelined end transaction: send_in_transaction returns before the end's reply, nothing is lost for it.

- An end refused after the call returned (an operator decided first) is on
  the result (``await result.end`` raises, ``end_error``) and in the
  producer's counters.
- Under SIGKILL of a sync-flush broker at random moments, with producers
  sending back to back: every transaction whose local decision was commit is
  delivered exactly once (directly or through a check-back), no rollback is
  ever delivered, and every end reply a result got agrees with the final
  outcome.
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
from txmq.broker.testing import running_broker
from txmq.client import LocalTransactionState, Message, TransactionProducer
from txmq.client.connection import Client
from txmq.store import StoreReader
from txmq.wire import ErrorCode, TxmqError

C, R = LocalTransactionState.COMMIT_MESSAGE, LocalTransactionState.ROLLBACK_MESSAGE


def test_an_end_refused_after_the_call_returned_is_on_the_result_and_counted(tmp_path):
    async def main():
        async with running_broker(tmp_path / "data") as b:
            operator = await Client(b.address).start()

            class RolledBackMeanwhile:
                async def execute_local_transaction(self, message, arg):
                    # an operator rolls the transaction back before the producer's commit arrives
                    await operator.request("tx_resolve", {"action": "rollback", "refs": [{"tx_id": message.tx_id}]})
                    return C

                def check_local_transaction(self, message):
                    return C

            async with TransactionProducer("shop", RolledBackMeanwhile(), b.address) as tp:
                r = await tp.send_in_transaction(Message("orders", b"x"))
                assert r.local_state is C and r.end is not None
                with pytest.raises(TxmqError) as e:
                    await r.end
                assert e.value.code is ErrorCode.TX_CONFLICT
                assert r.end_error is e.value and r.outcome is None
                assert tp.end_failures == Counter(conflict=1)
                assert (tp.ends_sent, tp.ends_confirmed, tp.ends_outstanding) == (1, 0, 0)
                # asked for per call, the same refusal is raised by send_in_transaction itself
                class Same(RolledBackMeanwhile):
                    pass

                tp.listener = Same()
                with pytest.raises(TxmqError) as e2:
                    await tp.send_in_transaction(Message("orders", b"y"), wait_end=True)
                assert e2.value.code is ErrorCode.TX_CONFLICT
            await operator.close()

    arun(main())


def test_a_closed_producer_has_waited_for_every_pipelined_end(tmp_path):
    async def main():
        async with running_broker(tmp_path / "data", flush="sync") as b:
            class Commit:
                def execute_local_transaction(self, message, arg):
                    return C

                def check_local_transaction(self, message):
                    return C

            tp = await TransactionProducer("shop", Commit(), b.address).start()
            results = [await tp.send_in_transaction(Message("orders", b"%d" % i)) for i in range(200)]
            await tp.close()
            assert all(r.end_done for r in results)
            assert [r.outcome for r in results] == ["committed"] * 200
            assert tp.ends_confirmed == 200

    arun(main())


CYCLES = int(os.environ.get("TXMQ_FAULT_CYCLES", "3"))


@pytest.mark.fault
def test_pipelined_ends_under_sigkill_deliver_each_commit_once_and_never_a_rollback(tmp_path):
    seed = int(os.environ.get("TXMQ_FAULT_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    data = tmp_path / "data"
    broker = BrokerProcess(data, "--flush", "sync", "--check-interval", "200ms", "--transaction-timeout", "1s")
    decided: dict[str, LocalTransactionState] = {}  # the producers' own database
    replies: dict[str, str | None] = {}  # what each result's end said

    class Shop:
        def execute_local_transaction(self, message, arg):
            state = C if rng.random() < 0.7 else R
            decided[message.tx_id] = state
            return state

        def check_local_transaction(self, message):
            return decided.get(message.tx_id, R)  # never ran: never committed locally

    async def run() -> None:
        producers = [await TransactionProducer("shop", Shop(), broker.address, backoff_initial=0.02, request_timeout=10).start()
                     for _ in range(4)]
        results = []
        stop = asyncio.Event()

        async def produce(tp: TransactionProducer, n: int) -> None:
            i = 0
            while not stop.is_set():
                try:
                    results.append(await tp.send_in_transaction(Message("orders", b"p%d-%d" % (n, i))))
                except (TxmqError, TimeoutError):
                    await asyncio.sleep(0.05)  # the broker is down: the half was not acknowledged
                i += 1

        tasks = [asyncio.create_task(produce(tp, n)) for n, tp in enumerate(producers)]
        loop = asyncio.get_running_loop()
        for _ in range(CYCLES):
            await asyncio.sleep(rng.uniform(0.8, 1.6))
            broker.kill()
            await asyncio.sleep(rng.uniform(0.05, 0.3))
            await loop.run_in_executor(None, broker.start)
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*tasks)
        for tp in producers:
            assert await tp.flush(15) == 0
        for r in results:
            try:
                replies[r.tx_id] = await r.end
            except TxmqError as exc:
                replies[r.tx_id] = f"refused: {exc.code.name}"
        # every pending transaction gets its check-back and is decided
        admin = await Client(broker.address).start()
        deadline = time.monotonic() + 30
        while (await admin.request("stats"))["gauges"]["pending"] and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert (await admin.request("stats"))["gauges"]["pending"] == 0
        await admin.close()
        for tp in producers:
            await tp.close()
        assert len(results) > 100, len(results)

    broker.start()
    try:
        arun(run())
    finally:
        code = broker.stop()
    assert code == 0
    delivered: Counter = Counter()
    with StoreReader(data) as reader:
        for rec in reader.scan():
            if rec.topic == "orders" and rec.tx_type == 2:
                delivered[rec.properties.get("UNIQ_KEY")] += 1
    twice = [t for t, n in delivered.items() if n > 1]
    assert not twice, f"seed {seed}: delivered twice: {twice[:3]}"
    rolled = [t for t in delivered if decided.get(t) is not C]
    assert not rolled, f"seed {seed}: delivered without a local commit: {rolled[:3]}"
    missing = [t for t, s in decided.items() if s is C and t in replies and not delivered[t]]
    assert not missing, f"seed {seed}: acknowledged commits never delivered: {missing[:3]}"
    disagree = [(t, rep) for t, rep in replies.items()
                if (rep == "committed" and not delivered[t]) or (rep == "rolled_back" and delivered[t]) or
                (rep is not None and rep.startswith("refused"))]
    assert not disagree, f"seed {seed}: end replies that disagree with the outcome: {disagree[:3]}"
