"""FIFO messages natively: message groups choose the queue, FIFO consumer groups receive each queue in order.

The receive side is the consumption service (broker/messaging/consumption.py) over a real broker core and store, without gRPC;
tests/test_rocketmq_fifo.py covers the gRPC front end, tests/test_rocketmq_sdk_*.py the official SDKs.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from conftest import arun
from txmq.broker.fifo import consistent_hash, group_problem, java_string_hash, queue_of_group
from txmq.broker.groupconfig import GroupConfigTable
from txmq.broker.messaging.consumption import ConsumptionService, PopError
from txmq.broker.testing import running_broker
from txmq.client import Message, Producer
from txmq.store.errors import DataFileError
from wireclient import RawClient

T = "orders"
G = "fifo-group"


class FakeTime:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fifo_pop(core, now=None, **kw) -> ConsumptionService:
    core.group_config.update(G, fifo=True)
    return core.consumption_service(now=now or FakeTime(), fifo=core.group_config.fifo, **kw)


async def send_groups(c: RawClient, items: list[tuple[str, str]], topic: str = T) -> list[dict]:
    out = []
    for group, body in items:
        out.append(await c.ok("send", {"topic": topic, "body": body.encode(), "properties": {"__SHARDINGKEY": group}}))
    return out


def bodies(got) -> list[str]:
    return [d.record.body.decode() for d in got]


# ---- the queue of a message group ---------------------------------------------------------
def test_java_string_hash_and_guava_consistent_hash_match_the_java_values():
    # String.hashCode ("hello" is the textbook value; a non-BMP character counts as two UTF-16 units)
    assert java_string_hash("hello") == 99162322
    assert java_string_hash("") == 0
    assert java_string_hash("\U0001F600") == 31 * 0xD83D + 0xDE00
    assert java_string_hash("polygenelubricants") == -(1 << 31)  # overflows as Java's int does: Integer.MIN_VALUE
    # Guava's golden values (HashingTest.testConsistentHash_linearCongruentialGeneratorCompatibility)
    assert [consistent_hash(i, 100) for i in range(20)] == [0, 55, 62, 8, 45, 59, 86, 97, 82, 59, 73, 37, 17, 56, 86,
                                                             21, 90, 37, 38, 83]
    assert (consistent_hash(10863919174838991, 11), consistent_hash(2016238256797177309, 11),
            consistent_hash(1673758223894951030, 11)) == (6, 3, 5)
    assert (consistent_hash(2, 100001), consistent_hash(2201, 100001), consistent_hash(2202, 100001)) == (80343, 22152, 15018)
    # one bucket is always 0; a key keeps its bucket or moves to the new one as buckets grow
    assert all(consistent_hash(k, 1) == 0 for k in range(-50, 50))
    for k in range(-200, 200, 7):
        prev = consistent_hash(k, 1)
        for n in range(2, 40):
            b = consistent_hash(k, n)
            assert 0 <= b < n and b in (prev, n - 1)
            prev = b
    spread = {queue_of_group(f"order-{i}", 8) for i in range(200)}
    assert spread == set(range(8))


@pytest.mark.parametrize("group, why", [("", "empty"), ("   ", "white space"), ("x" * 64, "shorter than 64"),
                                        ("a\nb", "control characters"), ("tab\tbed", "control characters")])
def test_bad_message_groups_are_named(group, why):
    assert why in group_problem(group)


def test_every_message_of_a_group_goes_to_its_queue_and_keeps_the_order_of_the_sends(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            items = [(f"order-{i % 5}", f"order-{i % 5}:{i // 5}") for i in range(50)]
            sent = await send_groups(c, items)
            n = b.core.topics.queues(T)
            assert "fifo" in b.core.topics.message_types(T)  # the first FIFO send created the topic accepting FIFO
            for (group, _), r in zip(items, sent):
                assert r["queue_id"] == queue_of_group(group, n)
            for i in range(5):
                qs = [r["queue_offset"] for (g, _), r in zip(items, sent) if g == f"order-{i}"]
                assert qs == sorted(qs)
            # a batch sends each message to its own group's queue; the client's Message carries the group
            async with Producer(b.address) as p:
                r = await p.send_message(Message(T, "via-client", message_group="order-3"))
                assert r.queue_id == queue_of_group("order-3", n)
                rows = await p.send_batch(T, [Message(T, "b1", message_group="order-1"),
                                              Message(T, "b2", message_group="order-2")])
                assert [x.queue_id for x in rows] == [queue_of_group("order-1", n), queue_of_group("order-2", n)]
            await c.close()

    arun(go())


def test_fifo_sends_are_refused_when_the_topic_does_not_accept_them_or_are_transactional(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": "plain"})
            code, f = await c.req("send", {"topic": "plain", "body": b"x", "properties": {"__SHARDINGKEY": "g1"}})
            assert f["name"] == "MESSAGE_TYPE_NOT_ACCEPTED" and "--message-types normal,fifo,transaction" in f["error"]
            code, f = await c.req("send", {"topic": T, "body": b"x",
                                           "properties": {"__SHARDINGKEY": "g1", "TRAN_MSG": "true", "PGROUP": "p"}})
            assert f["name"] == "INVALID_FIELD" and "transactional message cannot have a message group" in f["error"]
            code, f = await c.req("send", {"topic": T, "body": b"x", "properties": {"__SHARDINGKEY": " "}})
            assert f["name"] == "INVALID_FIELD" and "white space" in f["error"]
            n = b.core.topics.queues(T) or 4
            other = (queue_of_group("g1", n) + 1) % n
            code, f = await c.req("send", {"topic": T, "body": b"x", "queue_id": other, "properties": {"__SHARDINGKEY": "g1"}})
            assert f["name"] == "INVALID_FIELD" and "not the queue of message group" in f["error"]
            assert b.core.store.queue_max_offset("plain", 0) == 0
            await c.close()

    arun(go())


@pytest.mark.parametrize("timed", [{"TIMER_DELIVER_MS": "4102444800000"}, {"TIMER_DELAY_SEC": "30"},
                                   {"TIMER_DELAY_MS": "30000"}, {"DELAY": "3"}])
def test_a_message_with_a_group_and_a_delivery_time_is_refused_alone_and_in_a_batch_and_nothing_is_stored(tmp_path, timed):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": T, "message_types": ["normal", "fifo", "delay"]})
            both = {"__SHARDINGKEY": "g1", **timed}
            code, f = await c.req("send", {"topic": T, "body": b"x", "properties": both})
            key = next(iter(timed))
            assert f["name"] == "INVALID_FIELD" and f"cannot also have a delivery time ({key})" in f["error"], f
            code, f = await c.req("send_batch", {"topic": T, "messages": [{"body": b"ok", "properties": {"__SHARDINGKEY": "g2"}},
                                                                          {"body": b"x", "properties": both}]})
            assert f["name"] == "INVALID_FIELD" and "cannot also have a delivery time" in f["error"], f
            assert all(b.core.store.queue_max_offset(T, q) == 0 for q in range(b.core.topics.queues(T)))
            assert b.core.scheduled.gauges()["scheduled"] == 0
            # each alone goes through: the group to its queue, the delayed one scheduled
            r = await c.ok("send", {"topic": T, "body": b"g", "properties": {"__SHARDINGKEY": "g1"}})
            assert r["queue_id"] == queue_of_group("g1", b.core.topics.queues(T))
            r = await c.ok("send", {"topic": T, "body": b"d", "properties": {"TIMER_DELAY_SEC": "60"}})
            assert r["queue_offset"] == -1 and b.core.scheduled.gauges()["scheduled"] == 1
            await c.close()

    arun(go())


def test_the_clients_message_refuses_a_group_with_a_delay_before_sending():
    with pytest.raises(ValueError, match="message_group cannot have deliver_at or delay"):
        Message(T, "x", message_group="g1", delay=30).send_fields()
    with pytest.raises(ValueError, match="message_group cannot have deliver_at or delay"):
        Message(T, "x", message_group="g1", deliver_at=4102444800).wire_properties()
    assert Message(T, "x", delay=30).send_fields()["properties"] == {"TIMER_DELAY_MS": "30000"}


# ---- FIFO consumer groups ------------------------------------------------------------------
def test_a_fifo_group_gets_one_batch_per_queue_in_flight_and_the_next_only_after_the_acks(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send_groups(c, [("a", f"a{i}") for i in range(6)])
            q = queue_of_group("a", b.core.topics.queues(T))
            pop = fifo_pop(b.core)
            first = await pop.receive(G, T, -1, None, 2, 30, 0)
            assert bodies(first) == ["a0", "a1"]
            assert await pop.receive(G, T, -1, None, 2, 30, 0) == []  # the queue is blocked while a0, a1 are in flight
            pop.ack(G, T, first[0].receipt_handle)
            assert await pop.receive(G, T, q, None, 2, 30, 0) == []  # a1 still in flight
            pop.ack(G, T, first[1].receipt_handle)
            nxt = await pop.receive(G, T, -1, None, 2, 30, 0)
            assert bodies(nxt) == ["a2", "a3"]
            # a group that is not FIFO takes the rest at once
            other = await b.core.consumption_service().receive("plain-group", T, -1, None, 32, 30, 0)
            assert bodies(other) == [f"a{i}" for i in range(6)]
            await c.close()

    arun(go())


def test_queues_of_other_groups_are_not_blocked_and_a_long_poll_wakes_when_the_queue_frees(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            n = b.core.topics.ensure(T, 4, ("normal", "fifo", "transaction"))[0]
            ga = "a"
            gb = next(f"b{i}" for i in range(100) if queue_of_group(f"b{i}", n) != queue_of_group(ga, n))
            await send_groups(c, [(ga, "a0"), (ga, "a1"), (gb, "b0")])
            pop = fifo_pop(b.core)
            got = await pop.receive(G, T, -1, None, 1, 30, 0)
            more = await pop.receive(G, T, -1, None, 1, 30, 0)
            assert sorted(bodies(got + more)) == ["a0", "b0"]  # one from each queue
            a0 = next(d for d in got + more if d.record.body == b"a0")
            waiting = asyncio.ensure_future(pop.receive(G, T, -1, None, 1, 30, 60))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            pop.ack(G, T, a0.receipt_handle)
            assert bodies(await asyncio.wait_for(waiting, 30)) == ["a1"]  # woken by the ack, not the 60 s poll's end
            await c.close()

    arun(go())


def test_an_expired_batch_comes_again_in_order_before_anything_newer(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send_groups(c, [("a", f"a{i}") for i in range(5)])
            clock = FakeTime()
            pop = fifo_pop(b.core, now=clock)
            got = await pop.receive(G, T, -1, None, 3, 10, 0)
            assert bodies(got) == ["a0", "a1", "a2"]
            pop.ack(G, T, got[0].receipt_handle)
            # a2's duration is changed to be shorter than a1's: the queue still waits for both
            pop.change_invisible(G, T, got[2].receipt_handle, 2)
            clock.t += 3
            assert await pop.receive(G, T, -1, None, 3, 10, 0) == []
            clock.t += 10
            again = await pop.receive(G, T, -1, None, 3, 10, 0)
            assert bodies(again) == ["a1", "a2", "a3"]
            assert [d.attempt for d in again] == [2, 2, 1]

    arun(go())


def test_a_message_out_of_attempts_goes_to_the_dead_letter_topic_and_then_the_next_comes(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send_groups(c, [("a", "poison"), ("a", "next")])
            clock = FakeTime()
            pop = fifo_pop(b.core, now=clock, max_attempts=lambda g: 2)
            for attempt in (1, 2):
                got = await pop.receive(G, T, -1, None, 1, 10, 0)
                assert bodies(got) == ["poison"] and got[0].attempt == attempt
                clock.t += 11
            got = await pop.receive(G, T, -1, None, 1, 10, 0)  # expiry moves it (in the background): nothing yet
            for _ in range(100):
                if pop.counters["dead_lettered"]:
                    break
                await asyncio.sleep(0.01)
            got = got or await pop.receive(G, T, -1, None, 1, 10, 0)
            assert bodies(got) == ["next"]
            dlq = b.core.store.get_messages("%DLQ%" + G, 0, 0, 10, 1 << 20).records
            assert [r.body for r in dlq] == [b"poison"]

    arun(go())


def test_after_a_restart_a_fifo_group_gets_the_unacknowledged_messages_again_in_order(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send_groups(c, [("a", f"a{i}") for i in range(6)])
            pop = fifo_pop(b.core)
            got = await pop.receive(G, T, -1, None, 3, 30, 0)
            pop.ack(G, T, got[0].receipt_handle)
            pop.ack(G, T, got[2].receipt_handle)  # a2 acknowledged before a1
            await c.close()
            await pop.close()
        async with running_broker(tmp_path / "d") as b:
            assert b.core.group_config.fifo(G)  # kept in groups.json
            pop = b.core.consumption_service(fifo=b.core.group_config.fifo)
            again = await pop.receive(G, T, -1, None, 3, 30, 0)
            assert bodies(again) == ["a1", "a3", "a4"]  # a2 stays acknowledged
            assert await pop.receive(G, T, -1, None, 3, 30, 0) == []

    arun(go())


# ---- groups.json and txmq groups ---------------------------------------------------------
def test_groups_update_is_durable_shown_by_list_and_describe_and_an_older_data_dir_has_no_fifo_group(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            assert not (tmp_path / "d" / "groups.json").exists()
            c = await RawClient.open(b.address)
            r = await c.ok("update_group", {"group": G, "fifo": True})
            assert (r["fifo"], r["old"], r["changed"]) == (True, {"fifo": False}, True)
            assert (await c.ok("update_group", {"group": G, "fifo": True}))["changed"] is False
            rows = (await c.ok("list_groups", {}))["groups"]
            assert [(x["group"], x["fifo"]) for x in rows] == [(G, True)]
            assert (await c.ok("describe_group", {"group": G}))["fifo"] is True
            code, f = await c.req("update_group", {"group": G, "fifo": "yes"})
            assert f["name"] == "INVALID_FIELD"
            await c.close()
        doc = json.loads((tmp_path / "d" / "groups.json").read_text())
        assert doc == {"format": 1, "groups": {G: {"fifo": True}}}

    arun(go())


def test_a_damaged_groups_file_refuses_the_start_and_a_bad_entry_is_left_out(tmp_path):
    p = tmp_path / "groups.json"
    p.write_text("{not json")
    with pytest.raises(DataFileError, match="groups.json"):
        GroupConfigTable(p)
    p.write_text(json.dumps({"format": 1, "groups": {"ok": {"fifo": True, "later": 1}, "bad": {"fifo": "yes"}, "": {}}}))
    t = GroupConfigTable(p)
    assert t.fifo("ok") and not t.fifo("bad") and t.configured() == ["ok"]
    t.update("other", fifo=True)
    assert json.loads(p.read_text())["groups"]["ok"] == {"fifo": True, "later": 1}  # a newer broker's keys are kept


# ---- order on the less common paths --------------------------------------------------------
def two_groups_in_two_queues(n: int) -> tuple[str, str]:
    gb = next(f"b{i}" for i in range(100) if queue_of_group(f"b{i}", n) != queue_of_group("a", n))
    return "a", gb


def test_a_message_forwarded_to_the_dead_letter_topic_after_its_expiry_keeps_the_next_back_until_the_write_is_done(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            n = b.core.topics.ensure(T, 4, ("normal", "fifo", "transaction"))[0]
            ga, gb = two_groups_in_two_queues(n)
            await send_groups(c, [(ga, "a0"), (ga, "a1"), (ga, "a2"), (gb, "b0")])
            clock = FakeTime()
            pop = fifo_pop(b.core, now=clock)
            first = await pop.receive(G, T, queue_of_group(ga, n), None, 2, 10, 0)
            assert bodies(first) == ["a0", "a1"]
            clock.t += 11  # both expire; a receive served by the other queue makes them receivable again
            assert bodies(await pop.receive(G, T, queue_of_group(gb, n), None, 1, 10, 0)) == ["b0"]
            pop.ack(G, T, first[1].receipt_handle)  # a1 acknowledged late, a0 given up by the consumer:
            release, calls = asyncio.Event(), []

            async def failing_submit(msgs, *a, **kw):
                calls.append(msgs)
                await release.wait()
                raise OSError("disk full")

            b.core.appender.submit = failing_submit
            moving = asyncio.ensure_future(pop.forward_to_dlq(G, T, first[0].receipt_handle))
            await asyncio.sleep(0.05)
            assert calls  # the dead-letter write is under way: a2 must not overtake a0
            assert await pop.receive(G, T, -1, None, 4, 10, 0) == []
            release.set()
            with pytest.raises(Exception, match="dead-letter"):
                await moving
            again = await pop.receive(G, T, -1, None, 4, 10, 0)
            assert bodies(again) == ["a0", "a2"]  # the write failed: a0 comes again, before a2
            await c.close()

    arun(go())


def test_a_group_marked_fifo_while_messages_are_in_flight_waits_for_them(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send_groups(c, [("a", f"a{i}") for i in range(3)])
            clock = FakeTime()
            pop = b.core.consumption_service(now=clock, fifo=b.core.group_config.fifo)
            got = await pop.receive(G, T, -1, None, 1, 10, 0)  # received concurrently, before the group is FIFO
            assert bodies(got) == ["a0"]
            b.core.group_config.update(G, fifo=True)
            assert await pop.receive(G, T, -1, None, 2, 10, 0) == []  # a0 is in flight: its queue waits
            clock.t += 11
            assert bodies(await pop.receive(G, T, -1, None, 2, 10, 0)) == ["a0", "a1"]  # a0 again, before a1
            await c.close()

    arun(go())


def test_after_a_fifo_queue_is_received_again_the_old_handles_of_its_later_messages_are_refused(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send_groups(c, [("a", f"a{i}") for i in range(3)])
            clock = FakeTime()
            pop = fifo_pop(b.core, now=clock)
            slow = await pop.receive(G, T, -1, None, 2, 10, 0)  # a slow consumer's batch: a0, a1
            clock.t += 11
            other = await pop.receive(G, T, -1, None, 1, 10, 0)  # another consumer takes the queue again from a0
            assert bodies(other) == ["a0"] and other[0].attempt == 2
            # the slow consumer must neither keep a1 in flight beside a0 nor settle it before a0
            with pytest.raises(PopError, match="stale"):
                pop.change_invisible(G, T, slow[1].receipt_handle, 30)
            with pytest.raises(PopError, match="stale"):
                pop.ack(G, T, slow[1].receipt_handle)
            assert await pop.receive(G, T, -1, None, 2, 10, 0) == []  # a0 in flight: a1 waits
            pop.ack(G, T, other[0].receipt_handle)
            assert bodies(await pop.receive(G, T, -1, None, 2, 10, 0)) == ["a1", "a2"]
            await c.close()

    arun(go())
