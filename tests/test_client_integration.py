"""The client against a real broker run in-process (txmq.broker.testing.running_broker).

A broker restart gets a new port from running_broker, so the tests that
restart one put a small TCP proxy in front of it: the client keeps one
address, as it would in production, and has to reconnect through it.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from conftest import arun

from txmq.broker.testing import running_broker
from txmq.client import (
    Client,
    Consumer,
    LocalTransactionState,
    Message,
    Producer,
    TransactionListener,
    TransactionProducer,
)
from txmq.wire import ErrorCode, TxmqError

C, R, U = LocalTransactionState.COMMIT_MESSAGE, LocalTransactionState.ROLLBACK_MESSAGE, LocalTransactionState.UNKNOW


def run(coro, timeout: float = 20):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return arun(bounded())


async def wait_until(pred, timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.02)


async def consume_all(address: str, group: str, topic: str, **kw) -> list:
    async with Consumer(group, topic, address, stop_when_caught_up=True, **kw) as c:
        return [m async for m in c]


class Proxy:
    """A fixed address in front of a broker whose port changes across restarts."""

    def __init__(self) -> None:
        self.target: tuple[str, int] | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.tasks: set[asyncio.Task] = set()

    async def start(self) -> "Proxy":
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _accept(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if self.target is None:
            w.close()
            return
        try:
            ur, uw = await asyncio.open_connection(*self.target)
        except OSError:
            w.close()
            return
        self.writers |= {w, uw}
        for src, dst in ((r, uw), (ur, w)):
            task = asyncio.ensure_future(self._pump(src, dst, w, uw))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _pump(self, src, dst, *ends) -> None:
        try:
            while data := await src.read(1 << 16):
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            for end in ends:
                end.close()
                self.writers.discard(end)

    async def stop(self) -> None:
        self.server.close()
        for w in list(self.writers):
            w.close()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class Listener(TransactionListener):
    """Local transactions decided by the message body: b"commit", b"rollback", else unknown."""

    def __init__(self, check: LocalTransactionState = C) -> None:
        self.check = check
        self.checked: list = []

    def execute_local_transaction(self, message, arg):
        return {b"commit": C, b"rollback": R}.get(message.body, U)

    def check_local_transaction(self, message):
        self.checked.append(message)
        return self.check


def test_ten_thousand_pipelined_messages_come_back_in_queue_order_once(data_dir):
    n = 10_000

    async def main():
        async with running_broker(data_dir) as b:
            async with Client(b.address) as admin:
                await admin.request("create_topic", {"topic": "bulk", "queues": 4})
            async with Producer(b.address) as p:
                msgs = [Message("bulk", str(i).encode(), keys=f"k{i}") for i in range(n)]
                half = n // 2
                results = await p.send_many(msgs[:half])  # round robin
                results += await asyncio.gather(*(p.send("bulk", m.body, keys=m.keys) for m in msgs[half:]))
            sent: dict[int, list[bytes]] = defaultdict(list)
            for m, r in zip(msgs, results):
                sent[r.queue_id].append(m.body)
            assert set(sent) == {0, 1, 2, 3}
            got = await consume_all(b.address, "bulk-readers", "bulk", batch_size=256)
            received: dict[int, list[bytes]] = defaultdict(list)
            for m in got:
                received[m.queue_id].append(m.body)
                assert m.keys == "k" + m.body.decode() and m.tx_id is None
            assert len(got) == n
            assert received == sent
            for msgs_q in defaultdict(list, {q: [m.queue_offset for m in got if m.queue_id == q] for q in range(4)}).values():
                assert msgs_q == list(range(len(msgs_q)))

    run(main())


def test_consumer_offsets_survive_a_broker_restart(data_dir):
    async def main():
        async with running_broker(data_dir) as b:
            async with Producer(b.address) as p:
                await p.send_many([Message("orders", b"%d" % i) for i in range(100)])
            async with Consumer("billing", "orders", b.address, auto_commit=False) as c:
                first = []
                while len(first) < 60:
                    first += await c.poll(2.0, max_messages=60 - len(first))
                for m in first:
                    await c.commit(m)
        async with running_broker(data_dir) as b:
            async with Client(b.address) as admin:
                offsets = (await admin.request("fetch_offsets", {"group": "billing", "topic": "orders"}))["offsets"]
            rest = await consume_all(b.address, "billing", "orders")
        assert sum(int(v) for v in offsets.values()) == 60
        seen = {m.body for m in first} | {m.body for m in rest}
        assert len(first) + len(rest) == 100 and seen == {b"%d" % i for i in range(100)}

    run(main())


def test_transactions_commit_once_rollback_never_and_unknown_is_checked(data_dir):
    async def main():
        async with running_broker(data_dir, check_interval_s=0.05, transaction_timeout_s=0) as b:
            listener = Listener(check=C)
            async with TransactionProducer("pay", listener, b.address) as tp:
                committed = await tp.send_in_transaction(Message("pays", b"commit"))
                rolled = await tp.send_in_transaction(Message("pays", b"rollback"))
                unknown = await tp.send_in_transaction(Message("pays", b"later", tags="u"))
                assert committed.outcome is None or committed.end_done  # pipelined: the end's reply comes later
                assert await tp.flush() == 0 and tp.ends_outstanding == 0
                assert [await r.end for r in (committed, rolled, unknown)] == ["committed", "rolled_back", "pending"]
                assert (tp.ends_sent, tp.ends_confirmed, sum(tp.end_failures.values())) == (3, 3, 0)
                assert (committed.local_state, committed.outcome) == (C, "committed")
                assert (rolled.local_state, rolled.outcome) == (R, "rolled_back")
                assert (unknown.local_state, unknown.outcome) == (U, "pending")
                await wait_until(lambda: tp.checks_answered >= 1, what="check-back")
                # a late repeat of the producer's own commit changes nothing
                half = tp.client
                again = await half.request("end_transaction", {
                    "group": "pay", "tx_id": committed.tx_id, "commit_log_offset": committed.commit_log_offset,
                    "half_offset": committed.half_offset, "state": "commit"})
                assert again["status"] == "already"
                try:
                    await half.request("end_transaction", {
                        "group": "pay", "tx_id": rolled.tx_id, "commit_log_offset": rolled.commit_log_offset,
                        "half_offset": rolled.half_offset, "state": "commit"})
                    raise AssertionError("commit after rollback was accepted")
                except TxmqError as exc:
                    assert exc.code is ErrorCode.TX_CONFLICT
            view = listener.checked[0]
            assert (view.tx_id, view.topic, view.tags, view.body) == (unknown.tx_id, "pays", "u", b"later")
            assert view.check_times >= 1
            got = await consume_all(b.address, "readers", "pays")
        by_tx = sorted((m.tx_id, m.body) for m in got)
        assert by_tx == sorted([(committed.tx_id, b"commit"), (unknown.tx_id, b"later")])
        for m in got:
            assert m.tx_type == 2 and m.prepared_offset >= 0

    run(main())


def test_producer_reregisters_after_a_broker_restart_and_gets_its_check_back(data_dir):
    async def main():
        proxy = await Proxy().start()
        listener = Listener(check=C)
        try:
            async with running_broker(data_dir) as b:
                proxy.target = (b.host, b.port)
                tp = await TransactionProducer("shop", listener, proxy.address, backoff_initial=0.02).start()
                pending = await tp.send_in_transaction(Message("carts", b"maybe"), wait_end=True)
                assert pending.outcome == "pending"
            proxy.target = None  # broker down: connections through the proxy are refused
            await wait_until(lambda: not tp.client.connected, what="disconnect")
            async with running_broker(data_dir, check_interval_s=0.05, transaction_timeout_s=0) as b:
                proxy.target = (b.host, b.port)
                await wait_until(lambda: tp.client.connected, what="reconnect")
                assert tp.client.reconnects == 1
                await wait_until(lambda: tp.checks_answered >= 1, what="check-back after restart")
                assert listener.checked[0].tx_id == pending.tx_id
                got = await consume_all(b.address, "readers", "carts")
                assert [(m.tx_id, m.body) for m in got] == [(pending.tx_id, b"maybe")]
                await tp.close()
        finally:
            await proxy.stop()

    run(main())


def test_an_explicit_commit_is_not_put_back_by_auto_commit(data_dir):
    async def main():
        async with running_broker(data_dir) as b:
            async with Producer(b.address) as p:
                await p.send_many([Message("t", b"%d" % i) for i in range(10)], queue_id=0)
            c = await Consumer("g", "t", b.address, queues=[0], auto_commit_interval=0.05).start()
            got = []
            while len(got) < 10:
                got += await c.poll(2.0)
            await c.commit((0, 0))  # a poll after it would count the batch processed; before one, the position is 0
            for m in got:
                await c.commit(m)
            await asyncio.sleep(0.3)  # several auto-commit ticks, no poll
            async with Client(b.address) as admin:
                offsets = (await admin.request("fetch_offsets", {"group": "g", "topic": "t"}))["offsets"]
            assert offsets == {"0": 10}, offsets
            await c.close()

    run(main())


def test_a_sync_consumer_left_by_break_or_committing_in_the_loop_commits_only_what_it_yielded(data_dir):
    from txmq.client import SyncConsumer

    async def main():
        async with running_broker(data_dir) as b:
            async with Producer(b.address) as p:
                await p.send_many([Message("t", b"%d" % i) for i in range(20)], queue_id=0)

            def user() -> tuple[list[bytes], dict, list[bytes], list[bytes]]:
                seen = []
                with SyncConsumer("g", "t", b.address, queues=[0]) as c:
                    for msg in c:
                        seen.append(msg.body)
                        c.commit()  # everything yielded so far: never the rest of the batch
                        if len(seen) == 3:
                            break
                    committed = c.request("fetch_offsets", {"group": "g", "topic": "t"})["offsets"]
                    again = [m.body for m in c.poll(2.0)]  # the rest of the batch is still there
                with SyncConsumer("g", "t", b.address, queues=[0], stop_when_caught_up=True) as c:
                    rest = [m.body for m in c]
                return seen, committed, again, rest

            seen, committed, again, rest = await asyncio.to_thread(user)
            assert seen == [b"0", b"1", b"2"] and committed == {"0": 3}, (seen, committed)
            assert again[0] == b"3", again
            assert rest == [], rest  # `again` was handed out by poll and committed at close

    run(main())


def test_a_slow_check_holds_one_task_per_pending_transaction_however_many_passes_ask(data_dir):
    release = asyncio.Event()

    class SlowCheck(TransactionListener):
        def execute_local_transaction(self, msg, arg):
            return U

        async def check_local_transaction(self, msg):
            await release.wait()  # the database is unreachable
            return C

    async def main():
        async with running_broker(data_dir, check_interval_s=0.05, transaction_timeout_s=0, max_checks=100000) as b:
            tp = await TransactionProducer("g", SlowCheck(), b.address, check_concurrency=2).start()
            sent = [await tp.send_in_transaction(Message("t", b"x" * 1000)) for _ in range(5)]
            await wait_until(lambda: len(tp._check_tasks) == 5, what="a check per transaction")
            await wait_until(lambda: len(tp._checks_queued) == 3, what="the waiting transactions pushed again")
            await asyncio.sleep(0.6)  # a dozen more check passes push every transaction again
            assert len(tp._check_tasks) == 5 and len(tp._checks_queued) == 3, (len(tp._check_tasks), len(tp._checks_queued))
            release.set()
            await wait_until(lambda: len(b.core.tx.index.pending) == 0, what="every transaction decided")
            assert all(b.core.tx.index.outcome(s.tx_id) is not None for s in sent)
            await tp.close()

    run(main())
