"""Delayed and timed messages: scheduling by properties, delivery when due (injected clock), cancel, restart, rebuild."""

from __future__ import annotations

import asyncio

import pytest
from conftest import arun

from txmq.broker.clock import ManualClock
from txmq.broker.scheduled import keeper as sched_keeper
from txmq.broker.scheduled import service as sched_service
from txmq.broker.scheduled.indexfile import DB_FILE
from txmq.broker.scheduled.timing import MAX_MS, due_ms, parse_long
from txmq.broker.testing import running_broker
from txmq.client import Producer
from txmq.wire import ErrorCode, TxmqError

T0 = 1_800_000_000.0  # the injected clock's start (s)


async def _all(core, topic: str) -> list[dict]:
    out = []
    for q in range(core.topics.queues(topic) or 0):
        out += (await core.pull(topic, q, 0, 1000, 64 << 20, 0))["messages"]
    return out


async def _tick(core, clock: ManualClock, seconds: float) -> None:
    """Move the injected clock and let the delivery task look at the window."""
    clock.advance(seconds)
    core.scheduled.poke()
    for _ in range(20):
        await asyncio.sleep(0.01)


# ---- when a send is due ----------------------------------------------------------------
def test_delay_levels_and_timer_properties_give_rocketmqs_due_times():
    now, max_ms = 1_000_000, 3 * 86_400_000
    assert due_ms({"DELAY": "1"}, now, max_ms) == now + 1000
    assert due_ms({"DELAY": "16"}, now, max_ms) == now + 30 * 60_000
    assert due_ms({"DELAY": "18"}, now, max_ms) == now + 2 * 3600_000
    assert due_ms({"DELAY": "40"}, now, max_ms) == now + 2 * 3600_000  # above the last level: the last level
    assert due_ms({"DELAY": "0"}, now, max_ms) is None
    assert due_ms({"TIMER_DELAY_SEC": "7"}, now, max_ms) == now + 7000
    assert due_ms({"TIMER_DELAY_MS": "250"}, now, max_ms) == now + 250
    assert due_ms({"TIMER_DELIVER_MS": "5000000"}, now, max_ms) == 5_000_000
    # RocketMQ's precedence: a delay level above 0 (the broker then drops the timer properties), then
    # TIMER_DELAY_SEC, TIMER_DELAY_MS, TIMER_DELIVER_MS
    assert due_ms({"TIMER_DELAY_SEC": "1", "TIMER_DELIVER_MS": "9", "DELAY": "3"}, now, max_ms) == now + 10_000
    assert due_ms({"TIMER_DELAY_SEC": "1", "TIMER_DELIVER_MS": "9", "DELAY": "0"}, now, max_ms) == now + 1000
    assert due_ms({"TIMER_DELAY_MS": "20", "TIMER_DELIVER_MS": "9"}, now, max_ms) == now + 20
    assert due_ms({"DELAY": "-1", "TIMER_DELIVER_MS": "5000000"}, now, max_ms) == 5_000_000
    assert due_ms({"TIMER_DELIVER_MS": "10"}, now, max_ms) == 10  # past: the caller delivers it now


@pytest.mark.parametrize("props,code", [
    ({"TIMER_DELAY_SEC": "soon"}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"DELAY": "1.5"}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TIMER_DELAY_MS": str(3 * 86_400_000 + 1)}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TXMQ_SCHEDULED_FROM": "0"}, ErrorCode.INVALID_FIELD),
    ({"TXMQ_SCHEDULE_CANCEL": "12"}, ErrorCode.INVALID_FIELD),
    ({"TIMER_DELAY_SEC": "1_0"}, ErrorCode.INVALID_DELIVERY_TIME),  # Python's int() reads it; RocketMQ does not
    ({"TIMER_DELAY_MS": "\u0663\u0660"}, ErrorCode.INVALID_DELIVERY_TIME),  # non-ASCII digits
    ({"TIMER_DELIVER_MS": "9" * 4000}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TIMER_DELAY_MS": "nan"}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TIMER_DELAY_SEC": "inf"}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TIMER_DELIVER_MS": "-Infinity"}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TIMER_DELAY_MS": "1e3"}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TIMER_DELAY_MS": ""}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"DELAY": "nan"}, ErrorCode.INVALID_DELIVERY_TIME),
    # outside Java's long, which RocketMQ's Long.parseLong refuses: before, a huge negative time was delivered at once
    ({"TIMER_DELIVER_MS": "-" + "9" * 19}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TIMER_DELAY_SEC": "-" + "9" * 25}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"DELAY": str(1 << 63)}, ErrorCode.INVALID_DELIVERY_TIME),
    # Long.parseLong's text: an optional sign, then ASCII digits, nothing else
    ({"TIMER_DELAY_MS": " 100 "}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TIMER_DELAY_MS": " 100"}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TIMER_DELAY_SEC": "100\n"}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TIMER_DELIVER_MS": "\t5"}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TIMER_DELAY_MS": "+-1"}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TIMER_DELAY_MS": "++1"}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TIMER_DELAY_MS": "+"}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TIMER_DELAY_MS": "-"}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TIMER_DELAY_MS": "0x10"}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TIMER_DELAY_MS": "10L"}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"TIMER_DELAY_MS": "\uff11\uff12"}, ErrorCode.INVALID_DELIVERY_TIME),  # fullwidth digits: Long.parseLong takes them, txmq not
    ({"TIMER_DELIVER_MS": str(1 << 63)}, ErrorCode.INVALID_DELIVERY_TIME),  # Long.MAX_VALUE + 1
    ({"TIMER_DELIVER_MS": "0" * 50 + str(1 << 63)}, ErrorCode.INVALID_DELIVERY_TIME),
    ({"DELAY": str(1 << 31)}, ErrorCode.INVALID_DELIVERY_TIME),  # DELAY is Integer.parseInt's
    ({"DELAY": " 1"}, ErrorCode.INVALID_DELIVERY_TIME),
])
def test_unreadable_or_too_far_delivery_times_are_refused(props, code):
    with pytest.raises(TxmqError) as e:
        due_ms(props, 0, 3 * 86_400_000)
    assert e.value.code == code


def test_timer_properties_are_read_as_long_parse_long_reads_them():
    now, max_ms = 1_000_000, 3 * 86_400_000
    assert due_ms({"TIMER_DELAY_MS": "+100"}, now, max_ms) == now + 100
    assert due_ms({"TIMER_DELAY_SEC": "+7"}, now, max_ms) == now + 7000
    assert due_ms({"TIMER_DELIVER_MS": "+5000000"}, now, max_ms) == 5_000_000
    assert due_ms({"TIMER_DELAY_MS": "007"}, now, max_ms) == now + 7
    assert due_ms({"TIMER_DELAY_MS": "0" * 60 + "250"}, now, max_ms) == now + 250  # any number of leading zeros
    assert due_ms({"TIMER_DELAY_MS": "-0"}, now, max_ms) == now  # due now: delivered at once
    assert due_ms({"TIMER_DELIVER_MS": str((1 << 63) - 1)}, now, 1 << 70) == MAX_MS  # Long.MAX_VALUE, the latest time kept
    assert due_ms({"DELAY": "+2"}, now, max_ms) == now + 5000
    assert due_ms({"DELAY": str((1 << 31) - 1)}, now, max_ms) == now + 2 * 3600_000  # Integer.MAX_VALUE: the last level
    assert due_ms({"DELAY": str(-(1 << 31))}, now, max_ms) is None
    for text, value in (("+100", 100), ("-9223372036854775808", -(1 << 63)), ("00", 0), ("+0", 0)):
        assert parse_long(text) == value
    for text in (" 100 ", "", "+", "1 0", "١", "1.0", None, 100):
        with pytest.raises(ValueError):
            parse_long(text)


def test_a_negative_delay_on_the_wire_is_due_now_as_rocketmq_takes_it():
    now, max_ms = 1_000_000, 3 * 86_400_000
    assert due_ms({"TIMER_DELAY_MS": "-5000"}, now, max_ms) == now - 5000  # at or before now: delivered at once
    assert due_ms({"TIMER_DELAY_SEC": "-1"}, now, max_ms) == now - 1000
    assert due_ms({"TIMER_DELIVER_MS": str(-(1 << 63))}, now, max_ms) == 0  # Long.MIN_VALUE: in range, long past


def test_bad_delivery_times_on_the_wire_get_error_replies_and_nothing_is_stored(data_dir):
    from wireclient import RawClient

    async def main():
        async with running_broker(data_dir) as b:
            c = await RawClient.open(b.address)
            for props in ({"TIMER_DELAY_MS": "nan"}, {"TIMER_DELIVER_MS": "inf"}, {"TIMER_DELAY_SEC": "-" + "9" * 20},
                          {"DELAY": "1.5"}):
                code, f = await c.req("send", {"topic": "t", "body": b"x", "properties": props})
                assert code == ErrorCode.INVALID_DELIVERY_TIME and f["property"] in props, f
                code, f = await c.req("send_batch", {"topic": "t", "messages": [{"body": b"ok"}, {"body": b"x",
                                                                                   "properties": props}]})
                assert code == ErrorCode.INVALID_DELIVERY_TIME, f
            assert (await c.ok("heartbeat"))["time_ms"] > 0  # the broker goes on
            await c.close()
            assert b.core.scheduled.gauges()["scheduled"] == 0
            assert await _all(b.core, "t") == []

    arun(main())


def test_timer_values_on_the_wire_follow_long_parse_long_spaces_refused_a_plus_sign_taken(data_dir):
    """Through the native front end and RocketMQ 4's remoting front end: the broker reads the text as Long.parseLong does."""
    from remotingwire import RemotingClient
    from wireclient import RawClient

    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock, remoting_port=0) as b:
            c = await RawClient.open(b.address)
            code, f = await c.req("send", {"topic": "t", "body": b"spaces", "properties": {"TIMER_DELAY_MS": " 100 "}})
            assert code == ErrorCode.INVALID_DELIVERY_TIME and f["property"] == "TIMER_DELAY_MS", f
            sent = await c.ok("send", {"topic": "t", "body": b"plus", "properties": {"TIMER_DELAY_MS": "+100"}})
            assert sent["deliver_at_ms"] == int(T0 * 1000) + 100
            await c.close()
            r = await RemotingClient.connect(b.remoting_address)
            refused = await r.send("t", b"spaces", props={"TIMER_DELIVER_MS": f" {int(T0 * 1000) + 5000} "})
            assert refused.code != 0 and "not a whole number" in refused.remark, refused
            taken = await r.send("t", b"plus4", props={"TIMER_DELIVER_MS": f"+{int(T0 * 1000) + 5000}"})
            assert taken.code == 0, taken
            await r.close()
            assert b.core.scheduled.gauges()["scheduled"] == 2
            await _tick(b.core, clock, 10)
            assert sorted(m["body"] for m in await _all(b.core, "t")) == [b"plus", b"plus4"]

    arun(main())


# ---- a live broker with an injected clock -----------------------------------------------
def test_delayed_message_is_invisible_until_due_then_delivered_once_with_its_fields(data_dir):
    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock) as b:
            async with Producer(b.address) as p:
                r = await p.send("orders", b"cancel-if-unpaid", tags="timeout", keys=["order-7"], properties={"shop": "eu"},
                                 delay=30)
                assert r.queue_offset == -1 and r.deliver_at_ms == int(T0 * 1000) + 30_000
                assert b.core.scheduled.gauges()["scheduled"] == 1
                await _tick(b.core, clock, 29.9)
                assert await _all(b.core, "orders") == []
                await _tick(b.core, clock, 0.2)
                got = await _all(b.core, "orders")
                assert len(got) == 1
                m = got[0]
                assert m["msg_id"] == r.msg_id and m["body"] == b"cancel-if-unpaid" and m["queue_id"] == r.queue_id
                props = m["properties"]
                assert props["TAGS"] == "timeout" and props["KEYS"] == "order-7" and props["shop"] == "eu"
                assert props["TIMER_DELIVER_MS"] == str(r.deliver_at_ms)
                assert props["TIMER_ENQUEUE_MS"] == str(int(T0 * 1000))
                assert "REAL_TOPIC" not in props and "TIMER_DELAY_MS" not in props
                await _tick(b.core, clock, 60)
                assert len(await _all(b.core, "orders")) == 1  # once
                assert b.core.scheduled.gauges()["scheduled"] == 0
                assert b.core.metrics.counters["scheduled_delivered"] == 1

    arun(main())


def test_due_time_in_the_past_is_delivered_at_once_and_levels_are_honoured(data_dir):
    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock) as b:
            async with Producer(b.address) as p:
                past = await p.send("t", b"past", deliver_at=T0 - 5)
                assert past.queue_offset == 0 and past.deliver_at_ms is None
                await p.send("t", b"level2", properties={"DELAY": "2"})  # 5 s
                await _tick(b.core, clock, 4)
                assert [m["body"] for m in await _all(b.core, "t")] == [b"past"]
                await _tick(b.core, clock, 1.5)
                assert sorted(m["body"] for m in await _all(b.core, "t")) == [b"level2", b"past"]

    arun(main())


def test_delay_beyond_max_delay_and_delayed_transactions_are_refused(data_dir):
    async def main():
        async with running_broker(data_dir, max_delay_s=60) as b:
            async with Producer(b.address) as p:
                with pytest.raises(TxmqError) as e:
                    await p.send("t", b"x", delay=61)
                assert e.value.code == ErrorCode.INVALID_DELIVERY_TIME and "at most 1m" in e.value.message
                with pytest.raises(TxmqError) as e:
                    await p.send("t", b"x", properties={"TRAN_MSG": "true", "PGROUP": "g", "TIMER_DELAY_SEC": "3"})
                assert e.value.code == ErrorCode.INVALID_FIELD and "transactional" in e.value.message
                # a delay level on a half message is dropped, as RocketMQ 4's client drops it: the half stays pending
                h = await p.client.request("send", {"topic": "t", "body": b"x",
                                                    "properties": {"TRAN_MSG": "true", "PGROUP": "g", "DELAY": "3"}})
                assert h["half_offset"] >= 0 and h["tx_id"] in b.core.tx.index.pending
            assert b.core.scheduled.gauges()["scheduled"] == 0

    arun(main())


def test_delay_level_longer_than_max_delay_is_scheduled_at_its_level_and_a_level_past_the_table_is_clamped(data_dir, caplog):
    """RocketMQ bounds only timer times by timerMaxDelaySec: its delay levels are the broker's own table."""
    async def main():
        clock = ManualClock(T0)
        levels = (1000, 120_000)  # level 2 (2m) is longer than --max-delay 1m
        with caplog.at_level("WARNING", logger="txmq.scheduled"):
            async with running_broker(data_dir, clock=clock, max_delay_s=60, message_delay_levels_ms=levels) as b:
                async with Producer(b.address) as p:
                    r2 = await p.send("t", b"level2", properties={"DELAY": "2"})
                    assert r2.deliver_at_ms == int(T0 * 1000) + 120_000
                    r9 = await p.send("t", b"level9", properties={"DELAY": "9"})  # past the table: its last level
                    assert r9.deliver_at_ms == int(T0 * 1000) + 120_000
                    with pytest.raises(TxmqError) as e:  # a time the client chooses stays within --max-delay
                        await p.send("t", b"x", properties={"TIMER_DELAY_SEC": "120"})
                    assert e.value.code == ErrorCode.INVALID_DELIVERY_TIME
                    await _tick(b.core, clock, 119)
                    assert await _all(b.core, "t") == []
                    await _tick(b.core, clock, 1.5)
                    assert sorted(m["body"] for m in await _all(b.core, "t")) == [b"level2", b"level9"]
        warned = [r.getMessage() for r in caplog.records if "event=delay_levels_beyond_max_delay" in r.getMessage()]
        assert len(warned) == 1 and "levels=2 " in warned[0] and "longest=2m" in warned[0] and "max_delay=1m" in warned[0]

    arun(main())


def test_default_levels_within_the_default_max_delay_log_no_warning(data_dir, caplog):
    async def main():
        with caplog.at_level("WARNING", logger="txmq.scheduled"):
            async with running_broker(data_dir):
                pass
        assert not [r for r in caplog.records if "delay_levels_beyond_max_delay" in r.getMessage()]

    arun(main())


def test_topic_that_does_not_accept_delay_refuses_a_delayed_send(data_dir):
    async def main():
        async with running_broker(data_dir) as b:
            b.core.create_topic("plain", 2, ("normal",))
            async with Producer(b.address) as p:
                with pytest.raises(TxmqError) as e:
                    await p.send("plain", b"x", delay=5)
                assert e.value.code == ErrorCode.MESSAGE_TYPE_NOT_ACCEPTED
                await p.send("fresh", b"x", delay=5)  # a topic this send creates accepts delayed messages
            assert "delay" in b.core.topics.message_types("fresh")

    arun(main())


def test_a_topic_a_plain_send_created_takes_delayed_messages_natively_but_not_fifo(data_dir):
    async def main():
        async with running_broker(data_dir) as b:
            async with Producer(b.address) as p:
                await p.send("orders", b"hello")  # creates the topic with the default types
                r = await p.send("orders", b"cancel order 3 if unpaid", delay=10)
                assert r.queue_offset == -1 and b.core.scheduled.gauges()["scheduled"] == 1
                with pytest.raises(TxmqError) as e:
                    await p.send("orders", b"step", properties={"__SHARDINGKEY": "order-4"})
                assert e.value.code == ErrorCode.MESSAGE_TYPE_NOT_ACCEPTED
            assert b.core.topics.message_types("orders") == ("normal", "transaction")

    arun(main())


def test_cancelled_message_is_never_delivered_even_after_a_restart(data_dir):
    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock) as b:
            async with Producer(b.address) as p:
                keep = await p.send("orders", b"keep", delay=10)
                drop = await p.send("orders", b"drop", delay=10)
                done = await p.cancel_scheduled(drop.msg_id)
                assert [c["deliver_at_ms"] for c in done["cancelled"]] == [drop.deliver_at_ms]
                with pytest.raises(TxmqError) as e:
                    await p.cancel_scheduled(drop.msg_id)
                assert e.value.code == ErrorCode.NO_SUCH_MESSAGE
                listing = await b.core.scheduled.listing(None, None, 10)
                assert [m["msg_id"] for m in listing["messages"]] == [keep.msg_id] and listing["total"] == 1
        clock.advance(60)  # both came due while the broker was stopped
        async with running_broker(data_dir, clock=clock) as b:
            await _tick(b.core, clock, 0)
            assert [m["body"] for m in await _all(b.core, "orders")] == [b"keep"]

    arun(main())


def test_restart_keeps_the_schedule_and_never_delivers_twice(data_dir):
    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock) as b:
            async with Producer(b.address) as p:
                for i in range(5):
                    await p.send("orders", f"m{i}".encode(), delay=10 * (i + 1))
            await _tick(b.core, clock, 25)  # m0, m1 delivered
            assert len(await _all(b.core, "orders")) == 2
        async with running_broker(data_dir, clock=clock) as b:
            assert b.core.scheduled.gauges()["scheduled"] == 3
            await _tick(b.core, clock, 100)
            assert sorted(m["body"] for m in await _all(b.core, "orders")) == [b"m0", b"m1", b"m2", b"m3", b"m4"]

    arun(main())


def test_lost_index_file_is_rebuilt_from_the_log_without_redelivering(data_dir):
    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock) as b:
            async with Producer(b.address) as p:
                for i in range(4):
                    await p.send("orders", f"m{i}".encode(), delay=10 * (i + 1))
                cancelled = await p.send("orders", b"cancelled", delay=15)
                await p.cancel_scheduled(cancelled.msg_id)
            await _tick(b.core, clock, 25)
        (data_dir / DB_FILE).unlink()
        (data_dir / (DB_FILE + "-wal")).unlink(missing_ok=True)
        async with running_broker(data_dir, clock=clock) as b:
            assert b.core.scheduled.gauges()["scheduled"] == 2
            await _tick(b.core, clock, 100)
            assert sorted(m["body"] for m in await _all(b.core, "orders")) == [b"m0", b"m1", b"m2", b"m3"]

    arun(main())


def test_a_burst_larger_than_the_window_is_delivered_in_due_order(data_dir, monkeypatch):
    monkeypatch.setattr(sched_keeper, "WINDOW_ROWS", 50)
    monkeypatch.setattr(sched_service, "DELIVER_BATCH", 16)

    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock, default_queues=1) as b:
            async with Producer(b.address) as p:
                # sent in reverse: due order is the opposite of the log's
                for i in reversed(range(300)):  # due past the window: into the file, not memory
                    await p.send("burst", str(i).encode(), deliver_at=T0 + 600 + i / 1000)
            assert b.core.scheduled.gauges()["scheduled"] == 300
            assert len(b.core.scheduled.keeper.heap) == 0
            clock.advance(700)
            for _ in range(200):
                b.core.scheduled.poke()
                await asyncio.sleep(0.02)
                if b.core.scheduled.gauges()["scheduled"] == 0:
                    break
            assert b.core.scheduled.gauges()["scheduled"] == 0
            got = [int(m["body"]) for m in await _all(b.core, "burst")]
            assert got == list(range(300))

    arun(main())


# ---- races, bounds and metrics ----------------------------------------------------------
def test_cancel_that_meets_the_delivery_of_its_message_is_refused_not_reported_done(data_dir, monkeypatch):
    """A cancel whose lookup in timers.db is slow while its message is delivered meanwhile says NO_SUCH_MESSAGE."""
    import threading

    monkeypatch.setattr(sched_keeper, "FLUSH_S", 1000.0)  # the row stays in memory (written since the last flush)

    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock) as b:
            svc = b.core.scheduled
            await svc.ready.wait()
            async with Producer(b.address) as p:
                r = await p.send("orders", b"x", delay=10)
                assert r.commit_log_offset in svc.keeper.added
                entered, release = threading.Event(), threading.Event()
                real = svc.keeper.db.by_msg_id

                def slow(msg_id):
                    entered.set()
                    release.wait(5)
                    return real(msg_id)

                monkeypatch.setattr(svc.keeper.db, "by_msg_id", slow)
                cancel = asyncio.ensure_future(svc.cancel(r.msg_id))
                while not entered.is_set():
                    await asyncio.sleep(0.005)
                await _tick(b.core, clock, 10.5)  # delivered while the cancel looks in the file
                assert len(await _all(b.core, "orders")) == 1
                release.set()
                with pytest.raises(TxmqError) as e:
                    await cancel
                assert e.value.code == ErrorCode.NO_SUCH_MESSAGE
            assert svc.gauges()["scheduled"] == 0
            assert b.core.metrics.counters["scheduled_cancelled"] == 0

    arun(main())


def test_a_delivery_batch_of_large_messages_is_written_in_parts_of_bounded_size(data_dir):
    """Messages of 1 MiB due together are not read and appended 4096 at a time: each append stays near DELIVER_BYTES."""
    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock, default_queues=1) as b:
            svc = b.core.scheduled
            async with Producer(b.address) as p:
                for i in range(40):
                    await p.send("big", bytes([i]) * (1 << 20), delay=5)
            sizes: list[int] = []
            submit = b.core.appender.submit

            def spy(msgs, shape=None, durable=True):
                if msgs and msgs[0].topic == "big":
                    sizes.append(sum(len(m.body) for m in msgs))
                return submit(msgs, shape, durable)

            b.core.appender.submit = spy
            await _tick(b.core, clock, 6)
            for _ in range(100):
                if svc.gauges()["scheduled"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert len(await _all(b.core, "big")) == 40
            assert sum(sizes) == 40 << 20 and len(sizes) > 1
            assert max(sizes) <= sched_service.DELIVER_BYTES + (1 << 20)

    arun(main())


def test_lateness_is_measured_on_the_brokers_clock(data_dir):
    async def main():
        clock = ManualClock(T0 - 400 * 86400)  # a clock well behind the machine's
        async with running_broker(data_dir, clock=clock) as b:
            async with Producer(b.address) as p:
                await p.send("t", b"x", delay=5)
            await _tick(b.core, clock, 7)  # delivered 2 s after its due time, by the broker's clock
            assert len(await _all(b.core, "t")) == 1
            g = b.core.scheduled.gauges()
            assert 1.9 <= g["scheduled_lateness_seconds_max"] <= 3.0

    arun(main())


def test_listing_a_page_of_large_scheduled_messages_does_not_hold_them_all(data_dir):
    import tracemalloc

    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock) as b:
            async with Producer(b.address) as p:
                for i in range(48):
                    await p.send("big", bytes([i]) * (1 << 20), delay=50)
            svc = b.core.scheduled
            tracemalloc.start()
            try:
                page = await svc.listing(None, None, 1000)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert page["total"] == 48 and len(page["messages"]) == 48
            assert all(m["size"] > 1 << 20 for m in page["messages"])
            assert peak < 32 << 20  # records read a few at a time, not 48 MiB at once

    arun(main())


def test_sends_due_within_the_window_do_not_grow_it_past_its_rows(data_dir, monkeypatch):
    monkeypatch.setattr(sched_keeper, "WINDOW_ROWS", 50)
    monkeypatch.setattr(sched_service, "DELIVER_BATCH", 16)

    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock, default_queues=1) as b:
            svc = b.core.scheduled
            await svc.ready.wait()
            await asyncio.sleep(0.05)  # the first window is loaded: rows due within 60 s go to memory
            biggest = 0
            async with Producer(b.address) as p:
                ids = []
                for i in reversed(range(300)):  # due within the window, in the reverse of the log's order
                    ids.append((await p.send("burst", str(i).encode(), deliver_at=T0 + 5 + i / 1000)).msg_id)
                    biggest = max(biggest, len(svc.keeper.heap))
                for i in (0, 120, 299):  # cancels of rows in memory and of rows left to the file
                    await p.cancel_scheduled(ids[299 - i])
            assert biggest <= 50
            assert svc.gauges()["scheduled"] == 297
            clock.advance(10)
            for _ in range(300):
                svc.poke()
                await asyncio.sleep(0.02)
                biggest = max(biggest, len(svc.keeper.heap))
                if svc.gauges()["scheduled"] == 0:
                    break
            assert biggest <= 50
            got = [int(m["body"]) for m in await _all(b.core, "burst")]
            assert got == [i for i in range(300) if i not in (0, 120, 299)]

    arun(main())


def test_window_filled_by_sends_while_it_loads_loses_no_row(data_dir, monkeypatch):
    import threading

    monkeypatch.setattr(sched_keeper, "WINDOW_ROWS", 50)

    async def main():
        clock = ManualClock(T0)
        async with running_broker(data_dir, clock=clock, default_queues=1) as b:
            svc = b.core.scheduled
            await svc.ready.wait()
            async with Producer(b.address) as p:
                for i in range(10):  # in the file, due later than the sends below
                    await p.send("w", f"late{i}".encode(), deliver_at=T0 + 30 + i)
                await svc.keeper.flush()
                entered, release = threading.Event(), threading.Event()
                real = svc.keeper.db.due_rows

                def slow(*args):
                    entered.set()
                    release.wait(5)
                    return real(*args)

                monkeypatch.setattr(svc.keeper.db, "due_rows", slow)
                svc.keeper.refill.set()  # a load of the window, held in the file's thread
                while not entered.is_set():
                    await asyncio.sleep(0.005)
                for i in range(120):  # due within the window: they fill it while it loads
                    await p.send("w", f"soon{i}".encode(), deliver_at=T0 + 5 + i / 1000)
                release.set()
                monkeypatch.setattr(svc.keeper.db, "due_rows", real)
            clock.advance(100)
            for _ in range(300):
                svc.poke()
                await asyncio.sleep(0.02)
                if svc.gauges()["scheduled"] == 0 and len(await _all(b.core, "w")) == 130:
                    break
            got = sorted(m["body"] for m in await _all(b.core, "w"))
            assert got == sorted([f"late{i}".encode() for i in range(10)] + [f"soon{i}".encode() for i in range(120)])

    arun(main())
