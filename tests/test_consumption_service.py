"""The consumption service (broker/messaging/consumption.py) on a real Store, built as BrokerCore.open builds it: no core, no server.

``consuming(data_dir)`` opens a Store in a temporary directory and hands
the service the collaborators the core hands it: the topic table, the
consumer offsets, the Appender (over a Flusher), the long polls. Its clock
is a ManualClock (broker/clock.py) a test moves by hand, so invisible
durations run out without waiting (a long poll's end is on that clock too:
a test whose receives wait for nothing runs on the monotonic clock). Messages are appended as the core's send
appends them. What needs a whole broker (a native client's sends, the
schedule, transactions, an operator's offset reset, a start on damaged
files) is in tests/test_pop_consumption.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from conftest import arun
from txmq.broker.appender import Appender
from txmq.broker.clock import ManualClock
from txmq.broker.flush import DiskState, Flusher
from txmq.broker.longpoll import LongPolls
from txmq.broker.messaging.consumption import (
    ConsumptionService,
    Handle,
    PopConfig,
    PopError,
    decode_handle,
    encode_handle,
    parse_tags,
)
from txmq.broker.messaging.naming import DLQ_PREFIX, MAX_GROUP, RETRY_PREFIX, dlq_topic, is_group_name, retry_topic
from txmq.broker.messaging.sqlfilter import compile_sql
from txmq.broker.metrics import Metrics
from txmq.broker.records import msg_id_of
from txmq.broker.topics import TopicTable
from txmq.constants import TOPIC_RE
from txmq.store import ConsumerOffsets, Message, Record, Store, StoreConfig, TxType
from txmq.wire import ErrorCode, TxmqError

G = "sdk-group"
T = "orders"
FLUSH_INTERVAL_S = 0.2


def _as_wire_error(exc: BaseException) -> TxmqError:
    return exc if isinstance(exc, TxmqError) else TxmqError(f"store error: {exc}", ErrorCode.STORE_ERROR)


@dataclass
class Consuming:
    store: Store
    topics: TopicTable
    offsets: ConsumerOffsets
    flusher: Flusher
    appender: Appender
    polls: LongPolls
    clock: ManualClock
    svc: ConsumptionService

    def service(self, config: PopConfig | None = None, **kw: Any) -> ConsumptionService:
        """Another consumption service on the same collaborators (other settings)."""
        kw.setdefault("now", self.clock)
        return ConsumptionService(self.store, self.offsets, self.topics, self.appender, self.polls, config,
                                  persist=self.flusher.wait_persisted, flush_interval_s=FLUSH_INTERVAL_S, **kw)

    async def send(self, n: int, topic: str = T, queue_id: int = 0, tag: str | None = None, prefix: str = "m") -> None:
        self.topics.ensure(topic, None)
        props = {"TAGS": tag} if tag else {}
        msgs = [Message(topic, queue_id, TxType.NORMAL, 0, dict(props), f"{prefix}{i}".encode()) for i in range(n)]
        await self.appender.submit(msgs)

    def queue(self, topic: str, queue_id: int = 0) -> list[Record]:
        return self.store.get_messages(topic, queue_id, 0, 1000).records


@contextlib.asynccontextmanager
async def consuming(data_dir: Path, config: PopConfig | None = None, queues: int = 1, **kw: Any) -> AsyncIterator[Consuming]:
    """The consumption service on a Store in data_dir (topic T with ``queues`` queues); on exit closed, and the store
    closed in BrokerCore.stop's order (the offsets persisted last)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(data_dir, StoreConfig())
    store.open()
    try:
        topics = TopicTable(data_dir / "topics.json", queues)
        topics.merge_from_store(store.queues())
        topics.ensure(T, queues)
        offsets = ConsumerOffsets(data_dir / "offsets.json")
        metrics = Metrics()
        flusher = Flusher(store, sync=False, interval_s=FLUSH_INTERVAL_S, on_persist=offsets.persist, observe=metrics.flush.observe,
                          observe_checkpoint=metrics.checkpoint.observe, disk=DiskState(), count_error=partial(metrics.inc, "flush_errors"))
        polls = LongPolls()
        appender = Appender(store, flusher, metrics, polls.notify, _as_wire_error)
        clock = ManualClock(1000.0)
        kw.setdefault("now", clock)
        svc = ConsumptionService(store, offsets, topics, appender, polls, config, persist=flusher.wait_persisted,
                                 flush_interval_s=FLUSH_INTERVAL_S, **kw)
    except BaseException:
        store.close()
        raise
    flusher.start()
    try:
        yield Consuming(store, topics, offsets, flusher, appender, polls, clock, svc)
    finally:
        await svc.close()
        appender.close()
        polls.wake_all()
        await flusher.stop()
        offsets.persist()
        store.close()


def codes(fn) -> str:
    with pytest.raises(PopError) as e:
        fn()
    return e.value.code


# ---- receiving and acknowledging ------------------------------------------------------------------------------


def test_receive_hands_out_in_offset_order_and_acks_move_the_committed_offset_to_the_lowest_unsettled(tmp_path):
    async def go():
        async with consuming(tmp_path / "d") as h:
            await h.send(5)
            pop = h.svc
            got = await pop.receive(G, T, -1, None, 3, 30, 0)
            assert [(d.record.body, d.attempt, d.record.queue_offset) for d in got] == [(b"m0", 1, 0), (b"m1", 1, 1), (b"m2", 1, 2)]
            pop.ack(G, T, got[1].receipt_handle)
            assert h.offsets.get(G, T, 0) == 0  # acknowledged out of order: the committed offset waits for the lowest
            pop.ack(G, T, got[0].receipt_handle)
            assert h.offsets.get(G, T, 0) == 2
            pop.ack(G, T, got[2].receipt_handle)
            assert h.offsets.get(G, T, 0) == 3
            rest = await pop.receive(G, T, 0, None, 32, 30, 0)
            assert [d.record.body for d in rest] == [b"m3", b"m4"]
            for d in rest:
                pop.ack(G, T, d.receipt_handle)
            assert h.offsets.get(G, T, 0) == 5
            assert await pop.receive(G, T, -1, None, 32, 30, 0) == []
            assert pop.counters["delivered"] == 5 and pop.counters["acked"] == 5

    arun(go())


def test_an_acknowledged_handle_is_refused_the_second_time(tmp_path):
    async def go():
        async with consuming(tmp_path / "d") as h:
            await h.send(1)
            (d,) = await h.svc.receive(G, T, -1, None, 1, 30, 0)
            h.svc.ack(G, T, d.receipt_handle)
            assert codes(lambda: h.svc.ack(G, T, d.receipt_handle)) == "INVALID_RECEIPT_HANDLE"

    arun(go())


def test_a_receive_waiting_on_a_topic_wakes_on_an_append_to_any_queue_and_leaves_no_long_poll_behind(tmp_path):
    async def go():
        async with consuming(tmp_path / "d", queues=4) as h:
            waiting = asyncio.ensure_future(h.svc.receive(G, T, 0, None, 4, 30, 60))
            while not h.polls.waiting():  # the receive is waiting (one future on each of the 4 queues)
                await asyncio.sleep(0)
            assert h.polls.waiting() == 4
            await h.send(1, queue_id=3)
            got = await asyncio.wait_for(waiting, 30)  # woken, not answered at the 60 s poll's end
            assert [d.record.body for d in got] == [b"m0"] and got[0].record.queue_id == 3
            assert h.polls.waiting() == 0
            # one whose poll ends takes its futures off too
            h.svc.ack(G, T, got[0].receipt_handle)
            timed = h.service(now=time.monotonic)
            assert await timed.receive(G, T, -1, None, 4, 30, 0.05) == []
            assert h.polls.waiting() == 0
            await timed.close()

    arun(go())


# ---- invisible durations ------------------------------------------------------------------------------------------


def test_expired_invisibility_delivers_again_with_the_next_attempt(tmp_path):
    async def go():
        async with consuming(tmp_path / "d") as h:
            await h.send(2)
            pop = h.svc
            first = await pop.receive(G, T, -1, None, 2, 10, 0)
            assert await pop.receive(G, T, -1, None, 2, 10, 0) == []  # invisible
            h.clock.advance(10.5)
            again = await pop.receive(G, T, -1, None, 2, 10, 0)
            assert [(d.record.body, d.attempt) for d in again] == [(b"m0", 2), (b"m1", 2)]
            assert codes(lambda: pop.ack(G, T, first[0].receipt_handle)) == "INVALID_RECEIPT_HANDLE"  # the first delivery's
            pop.ack(G, T, again[0].receipt_handle)
            pop.ack(G, T, again[1].receipt_handle)
            assert h.offsets.get(G, T, 0) == 2
            assert pop.counters["expired"] == 2 and pop.counters["redelivered"] == 2

    arun(go())


def test_an_expired_message_not_yet_received_again_can_still_be_acknowledged(tmp_path):
    async def go():
        async with consuming(tmp_path / "d") as h:
            await h.send(1)
            (d,) = await h.svc.receive(G, T, -1, None, 1, 5, 0)
            h.clock.advance(6)
            await h.svc.receive("other-group", T, -1, None, 1, 5, 0)  # another group's receive changes nothing here
            h.svc.ack(G, T, d.receipt_handle)
            assert await h.svc.receive(G, T, -1, None, 1, 5, 0) == []

    arun(go())


def test_change_invisible_duration_gives_a_new_handle_and_refuses_the_old(tmp_path):
    async def go():
        async with consuming(tmp_path / "d") as h:
            await h.send(1)
            pop = h.svc
            (d,) = await pop.receive(G, T, -1, None, 1, 5, 0)
            new = pop.change_invisible(G, T, d.receipt_handle, 60)
            assert new != d.receipt_handle
            assert codes(lambda: pop.ack(G, T, d.receipt_handle)) == "INVALID_RECEIPT_HANDLE"
            assert codes(lambda: pop.change_invisible(G, T, d.receipt_handle, 5)) == "INVALID_RECEIPT_HANDLE"
            h.clock.advance(30)  # past the first duration, within the new one
            assert await pop.receive(G, T, -1, None, 1, 5, 0) == []
            newer = pop.change_invisible(G, T, new, 0)  # a zero duration makes it receivable at once (a nack), attempt 2
            (again,) = await pop.receive(G, T, -1, None, 1, 5, 0)
            assert again.attempt == 2 and again.record.body == b"m0"
            assert codes(lambda: pop.ack(G, T, newer)) == "INVALID_RECEIPT_HANDLE"
            assert codes(lambda: pop.change_invisible(G, T, again.receipt_handle, -1)) == "ILLEGAL_INVISIBLE_TIME"
            pop.ack(G, T, again.receipt_handle)

    arun(go())


def test_auto_renew_keeps_a_message_invisible_while_its_client_lives(tmp_path):
    async def go():
        alive = {"c1": True}
        async with consuming(tmp_path / "d", PopConfig(max_renew_s=300), client_alive=lambda cid: alive.get(cid, False)) as h:
            await h.send(1)
            pop = h.svc
            (d,) = await pop.receive(G, T, -1, None, 1, None, 0, auto_renew=True, client_id="c1")
            assert d.invisible_s == 60.0  # the default duration, renewed at its end
            for _ in range(3):
                h.clock.advance(61)
                assert await pop.receive(G, T, -1, None, 1, 5, 0) == []
            pop.ack(G, T, d.receipt_handle)  # the handle stays valid across renewals
            # a client that is gone renews nothing: the message comes back after one duration
            await h.send(1, prefix="n")
            (d,) = await pop.receive(G, T, -1, None, 1, None, 0, auto_renew=True, client_id="c1")
            alive["c1"] = False
            h.clock.advance(61)
            (again,) = await pop.receive(G, T, -1, None, 1, 5, 0)
            assert again.record.body == b"n0" and again.attempt == 2
            # and renewal ends after max_renew_s even for a live client
            alive["c1"] = True
            pop.ack(G, T, again.receipt_handle)
            await h.send(1, prefix="r")
            (d,) = await pop.receive(G, T, -1, None, 1, 30, 0, auto_renew=True, client_id="c1")
            for _ in range(9):
                h.clock.advance(31)
                assert await pop.receive(G, T, -1, None, 1, 5, 0) == []
            h.clock.advance(31)  # 310 s after the receive: past max_renew_s
            (again,) = await pop.receive(G, T, -1, None, 1, 5, 0)
            assert again.record.body == b"r0" and again.attempt == 2

    arun(go())


def test_stale_heap_entries_are_compacted(tmp_path):
    async def go():
        async with consuming(tmp_path / "d") as h:
            await h.send(1)
            (d,) = await h.svc.receive(G, T, -1, None, 1, 30, 0)
            handle = d.receipt_handle
            for _ in range(5000):
                handle = h.svc.change_invisible(G, T, handle, 3600)
            sub = h.svc.subs[(G, T)]
            assert len(sub.heap) <= 2 * sub.live + 1025
            h.svc.ack(G, T, handle)

    arun(go())


# ---- the dead-letter topic -----------------------------------------------------------------------------------------


def test_a_message_past_max_attempts_goes_to_the_dead_letter_topic_with_where_it_came_from(tmp_path):
    async def go():
        async with consuming(tmp_path / "d", max_attempts=lambda g: 3 if g == G else None) as h:
            await h.send(2)
            original = h.queue(T)[0]
            pop = h.svc
            for attempt in (1, 2, 3):
                got = await pop.receive(G, T, -1, None, 1, 5, 0)
                assert [(d.record.body, d.attempt) for d in got] == [(b"m0", attempt)]
                h.clock.advance(6)
            # the fourth receive moves m0 to %DLQ%<group> and hands out m1
            got = await pop.receive(G, T, -1, None, 1, 5, 0)
            assert [d.record.body for d in got] == [b"m1"]
            while not pop.counters["dead_lettered"]:  # the write is under way in its own task
                await asyncio.sleep(0.01)
            pop.ack(G, T, got[0].receipt_handle)
            assert h.offsets.get(G, T, 0) == 2
            assert h.topics.queues("%DLQ%" + G) == 1  # created with one queue
            (m,) = h.queue("%DLQ%" + G)
            assert m.body == b"m0"
            assert {k: v for k, v in m.properties.items() if k.startswith(("DLQ_", "TXMQ_DLQ_"))} == {
                "DLQ_ORIGIN_TOPIC": T, "DLQ_ORIGIN_MESSAGE_ID": msg_id_of(original), "TXMQ_DLQ_ORIGIN_QUEUE": "0:0",
                "TXMQ_DLQ_ATTEMPTS": "3", "TXMQ_DLQ_REASON": "max-attempts"}
            assert m.properties["UNIQ_KEY"] == msg_id_of(original)
            # the dead-letter topic is an ordinary topic: the group's consumers may receive from it
            (dl,) = await pop.receive("dlq-reader", "%DLQ%" + G, -1, None, 1, 5, 0)
            assert dl.record.body == b"m0"

    arun(go())


def test_forward_to_dead_letter_queue_writes_the_message_and_settles_it(tmp_path):
    async def go():
        async with consuming(tmp_path / "d") as h:
            await h.send(1)
            pop = h.svc
            (d,) = await pop.receive(G, T, -1, None, 1, 30, 0)
            await pop.forward_to_dlq(G, T, d.receipt_handle)
            assert h.offsets.get(G, T, 0) == 1
            assert codes(lambda: pop.ack(G, T, d.receipt_handle)) == "INVALID_RECEIPT_HANDLE"
            with pytest.raises(PopError) as e:
                await pop.forward_to_dlq(G, T, d.receipt_handle)
            assert e.value.code == "INVALID_RECEIPT_HANDLE"
            assert [(m.body, m.properties["TXMQ_DLQ_REASON"], m.properties["TXMQ_DLQ_ATTEMPTS"]) for m in h.queue("%DLQ%" + G)] == [
                (b"m0", "consumer", "1")]

    arun(go())


# ---- FIFO groups ---------------------------------------------------------------------------------------------------


def test_a_fifo_group_holds_a_queue_until_its_batch_is_settled_and_receives_it_in_order(tmp_path):
    async def go():
        async with consuming(tmp_path / "d", queues=2, fifo=lambda group: group == G) as h:
            await h.send(3, queue_id=0, prefix="a")
            await h.send(2, queue_id=1, prefix="b")
            pop = h.svc
            first = await pop.receive(G, T, 0, None, 2, 10, 0)
            assert [d.record.body for d in first] == [b"a0", b"a1"]
            # queue 0 is held while its batch is in flight: the next receive takes queue 1 only
            other = await pop.receive(G, T, 0, None, 32, 10, 0)
            assert [d.record.body for d in other] == [b"b0", b"b1"]
            assert await pop.receive(G, T, -1, None, 32, 10, 0) == []
            assert pop.counters["fifo_blocked"] > 0
            pop.ack(G, T, first[0].receipt_handle)
            assert await pop.receive(G, T, 0, None, 32, 10, 0) == []  # a1 still holds it
            # a1 expires: ready again, it comes first, before the queue's new messages (attempt 2)
            h.clock.advance(11)
            for d in other:  # (queue 1's have expired too: acknowledged before they come again)
                pop.ack(G, T, d.receipt_handle)
            again = await pop.receive(G, T, 0, None, 32, 10, 0)
            assert [(d.record.body, d.attempt) for d in again] == [(b"a1", 2), (b"a2", 1)]
            # a plain group is not held
            plain = await pop.receive("plain", T, 0, None, 2, 10, 0)
            more = await pop.receive("plain", T, 0, None, 1, 10, 0)
            assert [d.record.body for d in plain + more] == [b"a0", b"a1", b"a2"]

    arun(go())


# ---- state on disk -------------------------------------------------------------------------------------------------


def test_acknowledgements_past_the_committed_offset_survive_a_reopen(tmp_path):
    async def go():
        async with consuming(tmp_path / "d") as h:
            await h.send(6)
            got = await h.svc.receive(G, T, -1, None, 6, 300, 0)
            for i in (0, 2, 4, 5):  # m2, m4 and m5 lie past the unacknowledged m1 and m3
                h.svc.ack(G, T, got[i].receipt_handle)
            handle = got[1].receipt_handle
        assert json.loads((tmp_path / "d" / "acks.json").read_text()) == {"format": 1, "acked": {G: {T: {"0": [1, 1, 1, 1, 2]}}}}
        async with consuming(tmp_path / "d") as h:
            pop = h.svc
            assert codes(lambda: pop.ack(G, T, handle)) == "INVALID_RECEIPT_HANDLE"  # a handle of the run before
            again = await pop.receive(G, T, -1, None, 10, 300, 0)
            assert [(d.record.body, d.attempt) for d in again] == [(b"m1", 1), (b"m3", 1)]
            assert pop.counters["restored_settled"] == 3
            pop.ack(G, T, again[1].receipt_handle)
            pop.ack(G, T, again[0].receipt_handle)
            assert h.offsets.get(G, T, 0) == 6
            assert await pop.receive(G, T, -1, None, 10, 300, 0) == []
        assert json.loads((tmp_path / "d" / "acks.json").read_text()) == {"format": 1, "acked": {}}  # the offset covers them

    arun(go())


def test_an_out_of_order_acknowledgement_is_handed_to_the_consumer_offsets_and_persisted_without_a_close(tmp_path):
    async def go():
        async with consuming(tmp_path / "d") as h:
            await h.send(3)
            got = await h.svc.receive(G, T, -1, None, 3, 300, 0)
            h.svc.ack(G, T, got[0].receipt_handle)  # in order: only the committed offset moves
            assert h.offsets.acked(G, T, 0) == []
            h.svc.ack(G, T, got[2].receipt_handle)
            acks = tmp_path / "d" / "acks.json"
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 50 * FLUSH_INTERVAL_S  # half an interval by design; an upper bound for a loaded machine
            while not (acks.exists() and json.loads(acks.read_text())["acked"]):
                assert loop.time() < deadline, "the acknowledgement is not on disk"
                await asyncio.sleep(0.01)
            assert h.offsets.acked(G, T, 0) == [2, 3]

    arun(go())


# ---- bounds and refusals -------------------------------------------------------------------------------------------


def test_the_window_of_unsettled_messages_is_bounded_per_queue_and_over_all_groups(tmp_path):
    async def go():
        async with consuming(tmp_path / "d", PopConfig(max_window=5)) as h:
            await h.send(20)
            pop = h.svc
            first = await pop.receive(G, T, -1, None, 32, 30, 0)
            assert len(first) == 5
            assert await pop.receive(G, T, -1, None, 32, 30, 0) == []  # full until the oldest is settled
            pop.ack(G, T, first[1].receipt_handle)
            assert await pop.receive(G, T, -1, None, 32, 30, 0) == []  # the oldest (offset 0) still holds it
            waiting = asyncio.ensure_future(pop.receive(G, T, -1, None, 32, 30, 30))
            while not pop.subs[(G, T)].waiters:
                await asyncio.sleep(0)
            pop.ack(G, T, first[0].receipt_handle)  # wakes the waiting receive
            more = await asyncio.wait_for(waiting, 20)
            assert [d.record.queue_offset for d in more] == [5, 6]
            assert pop.in_flight(G, T)[0]["unsettled"] == 5
            other = h.service(PopConfig(max_slots=3))
            assert len(await other.receive("g-a", T, -1, None, 32, 30, 0)) == 3
            assert await other.receive("g-b", T, -1, None, 32, 30, 0) == []
            await other.close()

    arun(go())


def test_tag_filters_skip_other_tags_and_move_the_offset_past_them(tmp_path):
    async def go():
        async with consuming(tmp_path / "d") as h:
            await h.send(3, tag="a", prefix="a")
            await h.send(3, tag="b", prefix="b")
            await h.send(2, prefix="none")
            got = await h.svc.receive(G, T, -1, parse_tags("b || c"), 32, 30, 0)
            assert [d.record.body for d in got] == [b"b0", b"b1", b"b2"]
            for d in got:
                h.svc.ack(G, T, d.receipt_handle)
            assert h.offsets.get(G, T, 0) == 8
            assert parse_tags("*") is None and parse_tags("") is None
            for bad in ("a||", "||", "a|| ||b"):
                assert codes(lambda bad=bad: parse_tags(bad)) == "ILLEGAL_FILTER_EXPRESSION"

    arun(go())


def test_sql92_filters_match_the_properties_and_move_the_offset_past_the_others(tmp_path):
    async def go():
        async with consuming(tmp_path / "d") as h:
            await h.send(3, tag="a", prefix="a")
            await h.send(3, tag="b", prefix="b")
            await h.send(2, prefix="none")
            got = await h.svc.receive(G, T, -1, compile_sql("TAGS = 'b' OR TAGS IS NULL"), 32, 30, 0)
            assert [d.record.body for d in got] == [b"b0", b"b1", b"b2", b"none0", b"none1"]
            for d in got:
                h.svc.ack(G, T, d.receipt_handle)
            assert h.offsets.get(G, T, 0) == 8
            assert await h.svc.receive("other", T, -1, compile_sql("TAGS > 1"), 32, 30, 0) == []  # no tag is a number

    arun(go())


@pytest.mark.parametrize("handle", [
    "", "x", "not base64 !!", "A" * 600, "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
    None, 12, "txmq1_" + "A" * 40,
])
def test_malformed_receipt_handles_are_refused_per_handle(tmp_path, handle):
    async def go():
        async with consuming(tmp_path / "d") as h:
            await h.send(1)
            (d,) = await h.svc.receive(G, T, -1, None, 1, 30, 0)
            assert codes(lambda: h.svc.ack(G, T, handle)) == "INVALID_RECEIPT_HANDLE"
            assert codes(lambda: h.svc.change_invisible(G, T, handle, 10)) == "INVALID_RECEIPT_HANDLE"
            h.svc.ack(G, T, d.receipt_handle)  # the real one still works

    arun(go())


def test_handles_of_another_group_topic_or_broker_run_are_refused(tmp_path):
    async def go():
        async with consuming(tmp_path / "d") as h:
            await h.send(1)
            await h.send(1, topic="other")
            pop = h.svc
            (d,) = await pop.receive(G, T, -1, None, 1, 30, 0)
            (o,) = await pop.receive("g2", T, -1, None, 1, 30, 0)
            assert codes(lambda: pop.ack("g2", T, d.receipt_handle)) == "INVALID_RECEIPT_HANDLE"
            assert codes(lambda: pop.ack(G, "other", d.receipt_handle)) == "INVALID_RECEIPT_HANDLE"
            hd = decode_handle(d.receipt_handle)
            forged = encode_handle(Handle(hd.epoch ^ 1, hd.version, hd.queue_id, hd.offset, hd.attempt, hd.topic))
            assert codes(lambda: pop.ack(G, T, forged)) == "INVALID_RECEIPT_HANDLE"
            forged = encode_handle(Handle(hd.epoch, hd.version + 1, hd.queue_id, hd.offset, hd.attempt, hd.topic))
            assert codes(lambda: pop.ack(G, T, forged)) == "INVALID_RECEIPT_HANDLE"
            tampered = d.receipt_handle[:-3] + ("A" if d.receipt_handle[-3] != "A" else "B") + d.receipt_handle[-2:]
            assert codes(lambda: pop.ack(G, T, tampered)) == "INVALID_RECEIPT_HANDLE"
            pop.ack(G, T, d.receipt_handle)
            pop.ack("g2", T, o.receipt_handle)

    arun(go())


def test_concurrent_receivers_of_one_group_never_hold_the_same_message(tmp_path):
    async def go():
        async with consuming(tmp_path / "d", queues=4, now=time.monotonic) as h:  # the receives' polls end
            pop = h.svc
            held: dict[bytes, int] = {}
            seen: list[bytes] = []
            clash = []

            async def consumer(k: int) -> None:
                while len(seen) < 200:
                    got = await pop.receive(G, T, -1, None, 7, 30, 0.2)
                    for d in got:
                        if d.record.body in held:
                            clash.append(d.record.body)
                        held[d.record.body] = k
                    await asyncio.sleep(0)
                    for d in got:
                        del held[d.record.body]
                        seen.append(d.record.body)
                        pop.ack(G, T, d.receipt_handle)

            tasks = [asyncio.ensure_future(consumer(k)) for k in range(4)]
            for i in range(200):
                await h.send(1, queue_id=i % 4, prefix=f"m{i}-")
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert not clash
            assert sorted(seen) == sorted(f"m{i}-0".encode() for i in range(200))
            assert sum(h.offsets.get(G, T, q) for q in range(4)) == 200

    arun(go())


def test_bad_receive_requests_are_refused_with_a_code(tmp_path):
    async def go():
        async with consuming(tmp_path / "d") as h:
            await h.send(1)
            pop = h.svc
            cases = [
                (("bad group!", T, -1, None, 1, 30, 0), "ILLEGAL_CONSUMER_GROUP"),
                (("", T, -1, None, 1, 30, 0), "ILLEGAL_CONSUMER_GROUP"),
                (("a|b", T, -1, None, 1, 30, 0), "ILLEGAL_CONSUMER_GROUP"),  # RocketMQ 5's gRPC names have no "|"
                ((G, "no-such-topic", -1, None, 1, 30, 0), "TOPIC_NOT_FOUND"),
                ((G, "RMQ_SYS_TRANS_HALF_TOPIC", -1, None, 1, 30, 0), "TOPIC_NOT_FOUND"),
                ((G, "bad/topic", -1, None, 1, 30, 0), "ILLEGAL_TOPIC"),
                ((G, T, 1, None, 1, 30, 0), "BAD_REQUEST"),
                ((G, T, -2, None, 1, 30, 0), "BAD_REQUEST"),
                ((G, T, -1, None, 0, 30, 0), "BAD_REQUEST"),
                ((G, T, -1, None, 10**9, 30, 0), "BAD_REQUEST"),
                ((G, T, -1, None, 1, -1, 0), "ILLEGAL_INVISIBLE_TIME"),
                ((G, T, -1, None, 1, 0.01, 0), "ILLEGAL_INVISIBLE_TIME"),
                ((G, T, -1, None, 1, 10**9, 0), "ILLEGAL_INVISIBLE_TIME"),
                ((G, T, -1, None, 1, 30, -1), "ILLEGAL_POLLING_TIME"),
                ((G, T, -1, None, 1, 30, 10**6), "ILLEGAL_POLLING_TIME"),
            ]
            for args, code in cases:
                with pytest.raises(PopError) as e:
                    await pop.receive(*args)
                assert e.value.code == code, (args, e.value)
            (d,) = await pop.receive(G, T, -1, None, 1, 30, 0)  # still serving
            assert d.record.body == b"m0"

    arun(go())


def test_a_group_name_is_refused_when_its_retry_topic_would_be_longer_than_a_topic_name(tmp_path):
    async def go():
        async with consuming(tmp_path / "d") as h:
            await h.send(1)
            with pytest.raises(PopError) as e:
                await h.svc.receive("g" * (MAX_GROUP + 1), T, -1, None, 1, 30, 0)
            assert e.value.code == "ILLEGAL_CONSUMER_GROUP" and "1 to 120 of the characters" in e.value.message
            longest = "g" * MAX_GROUP
            (d,) = await h.svc.receive(longest, T, -1, None, 1, 30, 0)
            await h.svc.forward_to_dlq(longest, T, d.receipt_handle)
            assert [m.body for m in h.queue(dlq_topic(longest))] == [b"m0"]

    arun(go())


def test_the_retry_and_dead_letter_names_are_rocketmqs():
    assert (RETRY_PREFIX, DLQ_PREFIX, MAX_GROUP) == ("%RETRY%", "%DLQ%", 120)
    assert retry_topic("g") == "%RETRY%g" and dlq_topic("g") == "%DLQ%g"
    longest = "g" * MAX_GROUP
    assert is_group_name(longest) and TOPIC_RE.match(retry_topic(longest)) and TOPIC_RE.match(dlq_topic(longest))
    for bad in ("", "g" * (MAX_GROUP + 1), "has space", "g\n", "é", None, 12):
        assert not is_group_name(bad) and not is_group_name(bad, bar=True), bad
    assert not is_group_name("a|b") and is_group_name("a|b", bar=True)  # RocketMQ 4's group characters include "|"
