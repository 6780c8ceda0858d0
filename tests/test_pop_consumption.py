"""Consumption with invisible durations (broker/rocketmq/pop.py) over a real broker core and store, no gRPC."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import pytest

from conftest import arun
from txmq.broker import groups
from txmq.broker.rocketmq.pop import (
    Handle,
    PopConfig,
    PopError,
    PopService,
    decode_handle,
    encode_handle,
    parse_tags,
)
from txmq.broker.testing import running_broker
from wireclient import RawClient

G = "sdk-group"
T = "orders"


class FakeTime:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def send(c: RawClient, n: int, topic: str = T, queue_id: int | None = 0, tag: str | None = None, prefix: str = "m") -> list[dict]:
    out = []
    for i in range(n):
        f = {"topic": topic, "body": f"{prefix}{i}".encode()}
        if queue_id is not None:
            f["queue_id"] = queue_id
        if tag:
            f["properties"] = {"TAGS": tag}
        out.append(await c.ok("send", f))
    return out


def codes(fn) -> str:
    with pytest.raises(PopError) as e:
        fn()
    return e.value.code


def test_receive_ack_moves_the_committed_offset_and_groups_describe_shows_it(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 5)
            pop = PopService(b.core)
            got = await pop.receive(G, T, -1, None, 3, 30, 0)
            assert [d.record.body for d in got] == [b"m0", b"m1", b"m2"]
            assert [d.attempt for d in got] == [1, 1, 1]
            assert [d.record.queue_offset for d in got] == [0, 1, 2]
            # acknowledged out of order: the committed offset waits for the lowest
            pop.ack(G, T, got[1].receipt_handle)
            assert b.core.offsets.get(G, T, 0) == 0
            pop.ack(G, T, got[0].receipt_handle)
            assert b.core.offsets.get(G, T, 0) == 2
            pop.ack(G, T, got[2].receipt_handle)
            assert b.core.offsets.get(G, T, 0) == 3
            rest = await pop.receive(G, T, 0, None, 32, 30, 0)
            assert [d.record.body for d in rest] == [b"m3", b"m4"]
            for d in rest:
                pop.ack(G, T, d.receipt_handle)
            desc = groups.describe_group(b.core, G, T)
            q0 = [r for r in desc["queues"] if r["queue_id"] == 0][0]
            assert q0["committed"] == 5 and q0["lag"] == 0
            assert await pop.receive(G, T, -1, None, 32, 30, 0) == []
            await c.close()
            await pop.close()

    arun(go())


def test_an_acknowledged_handle_is_refused_the_second_time(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 1)
            pop = PopService(b.core)
            (d,) = await pop.receive(G, T, -1, None, 1, 30, 0)
            pop.ack(G, T, d.receipt_handle)
            assert codes(lambda: pop.ack(G, T, d.receipt_handle)) == "INVALID_RECEIPT_HANDLE"
            await c.close()

    arun(go())


def test_empty_long_poll_answers_after_the_poll_time_and_an_append_wakes_it(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": T, "queues": 4})
            pop = PopService(b.core)
            t0 = time.monotonic()
            assert await pop.receive(G, T, -1, None, 4, 30, 0.3) == []
            took = time.monotonic() - t0
            assert 0.25 <= took < 15, took
            # a receive waiting on the topic wakes on an append to any queue
            waiting = asyncio.ensure_future(pop.receive(G, T, 0, None, 4, 30, 60))
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            await send(c, 1, queue_id=3)
            got = await asyncio.wait_for(waiting, 90)
            assert [d.record.body for d in got] == [b"m0"] and got[0].record.queue_id == 3
            assert time.monotonic() - t0 < 30  # woken, not answered at the 60 s poll's end
            # no waiter left behind in the core's long-poll table
            assert not any(b.core._pollers.values())
            await c.close()

    arun(go())


def test_expired_invisibility_delivers_again_with_the_next_attempt(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 2)
            clock = FakeTime()
            pop = PopService(b.core, now=clock)
            first = await pop.receive(G, T, -1, None, 2, 10, 0)
            assert await pop.receive(G, T, -1, None, 2, 10, 0) == []  # invisible
            clock.t += 10.5
            again = await pop.receive(G, T, -1, None, 2, 10, 0)
            assert [(d.record.body, d.attempt) for d in again] == [(b"m0", 2), (b"m1", 2)]
            # the first delivery's handles are stale now
            assert codes(lambda: pop.ack(G, T, first[0].receipt_handle)) == "INVALID_RECEIPT_HANDLE"
            pop.ack(G, T, again[0].receipt_handle)
            pop.ack(G, T, again[1].receipt_handle)
            assert b.core.offsets.get(G, T, 0) == 2
            await c.close()

    arun(go())


def test_an_expired_message_not_yet_received_again_can_still_be_acknowledged(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 1)
            clock = FakeTime()
            pop = PopService(b.core, now=clock)
            (d,) = await pop.receive(G, T, -1, None, 1, 5, 0)
            clock.t += 6
            await pop.receive("other-group", T, -1, None, 1, 5, 0)  # another group's receive changes nothing here
            pop.ack(G, T, d.receipt_handle)
            assert await pop.receive(G, T, -1, None, 1, 5, 0) == []
            await c.close()

    arun(go())


def test_change_invisible_duration_gives_a_new_handle_and_refuses_the_old(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 1)
            clock = FakeTime()
            pop = PopService(b.core, now=clock)
            (d,) = await pop.receive(G, T, -1, None, 1, 5, 0)
            new = pop.change_invisible(G, T, d.receipt_handle, 60)
            assert new != d.receipt_handle
            assert codes(lambda: pop.ack(G, T, d.receipt_handle)) == "INVALID_RECEIPT_HANDLE"
            assert codes(lambda: pop.change_invisible(G, T, d.receipt_handle, 5)) == "INVALID_RECEIPT_HANDLE"
            clock.t += 30  # past the first duration, within the new one
            assert await pop.receive(G, T, -1, None, 1, 5, 0) == []
            # a zero duration makes it receivable at once (a nack), attempt 2
            newer = pop.change_invisible(G, T, new, 0)
            (again,) = await pop.receive(G, T, -1, None, 1, 5, 0)
            assert again.attempt == 2 and again.record.body == b"m0"
            assert codes(lambda: pop.ack(G, T, newer)) == "INVALID_RECEIPT_HANDLE"
            assert codes(lambda: pop.change_invisible(G, T, again.receipt_handle, -1)) == "ILLEGAL_INVISIBLE_TIME"
            pop.ack(G, T, again.receipt_handle)
            await c.close()

    arun(go())


def test_a_message_past_max_attempts_goes_to_the_dead_letter_topic(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            sent = await send(c, 2)
            clock = FakeTime()
            pop = PopService(b.core, now=clock, max_attempts=lambda g: 3 if g == G else None)
            for attempt in (1, 2, 3):
                got = await pop.receive(G, T, -1, None, 1, 5, 0)
                assert [(d.record.body, d.attempt) for d in got] == [(b"m0", attempt)]
                clock.t += 6
            # the fourth receive moves m0 to %DLQ%<group> and hands out m1
            got = await pop.receive(G, T, -1, None, 1, 5, 0)
            assert [d.record.body for d in got] == [b"m1"]
            for _ in range(100):
                if pop.counters["dead_lettered"]:
                    break
                await asyncio.sleep(0.01)
            pop.ack(G, T, got[0].receipt_handle)
            assert b.core.offsets.get(G, T, 0) == 2
            r = await c.ok("pull", {"topic": "%DLQ%" + G, "queue_id": 0, "offset": 0, "max_count": 10})
            (m,) = r["messages"]
            assert m["body"] == b"m0"
            assert m["properties"]["DLQ_ORIGIN_TOPIC"] == T
            assert m["properties"]["DLQ_ORIGIN_MESSAGE_ID"] == sent[0]["msg_id"]
            assert m["properties"]["TXMQ_DLQ_ATTEMPTS"] == "3"
            assert m["properties"]["TXMQ_DLQ_REASON"] == "max-attempts"
            # the dead-letter topic is an ordinary topic: the group's consumers may receive from it
            (dl,) = await pop.receive("dlq-reader", "%DLQ%" + G, -1, None, 1, 5, 0)
            assert dl.record.body == b"m0"
            await c.close()

    arun(go())


def test_forward_to_dead_letter_queue_writes_the_message_and_settles_it(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 1)
            pop = PopService(b.core)
            (d,) = await pop.receive(G, T, -1, None, 1, 30, 0)
            await pop.forward_to_dlq(G, T, d.receipt_handle)
            assert b.core.offsets.get(G, T, 0) == 1
            assert codes(lambda: pop.ack(G, T, d.receipt_handle)) == "INVALID_RECEIPT_HANDLE"
            with pytest.raises(PopError) as e:
                await pop.forward_to_dlq(G, T, d.receipt_handle)
            assert e.value.code == "INVALID_RECEIPT_HANDLE"
            r = await c.ok("pull", {"topic": "%DLQ%" + G, "queue_id": 0, "offset": 0, "max_count": 10})
            assert [m["properties"]["TXMQ_DLQ_REASON"] for m in r["messages"]] == ["consumer"]
            await c.close()

    arun(go())


def test_a_delivered_delayed_message_forwarded_to_the_dead_letter_topic_is_counted_delivered_once(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await c.ok("send", {"topic": T, "queue_id": 0, "body": b"later", "properties": {"TIMER_DELAY_MS": "50"}})
            pop = PopService(b.core)
            (d,) = await pop.receive(G, T, -1, None, 1, 30, 5)  # long-polls until the delivery
            assert "TXMQ_SCHEDULED_FROM" in d.record.properties
            await pop.forward_to_dlq(G, T, d.receipt_handle)
            r = await c.ok("pull", {"topic": "%DLQ%" + G, "queue_id": 0, "offset": 0, "max_count": 10})
            (m,) = r["messages"]
            assert m["body"] == b"later" and "TXMQ_SCHEDULED_FROM" not in m["properties"]
            assert m["properties"]["TIMER_DELIVER_MS"]  # when it was due stays readable
            await c.close()
        for f in (tmp_path / "d").glob("timers.db*"):  # the next start replays the whole log
            f.unlink()
        async with running_broker(tmp_path / "d") as b:
            await asyncio.wait_for(b.core.scheduled.ready.wait(), 10)
            assert b.core.scheduled.count == 0

    arun(go())


@pytest.mark.parametrize("handle", [
    "", "x", "not base64 !!", "A" * 600, "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
    None, 12, "txmq1_" + "A" * 40,
])
def test_malformed_receipt_handles_are_refused_per_handle(tmp_path, handle):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 1)
            pop = PopService(b.core)
            (d,) = await pop.receive(G, T, -1, None, 1, 30, 0)
            assert codes(lambda: pop.ack(G, T, handle)) == "INVALID_RECEIPT_HANDLE"
            assert codes(lambda: pop.change_invisible(G, T, handle, 10)) == "INVALID_RECEIPT_HANDLE"
            pop.ack(G, T, d.receipt_handle)  # the real one still works
            await c.close()

    arun(go())


def test_handles_of_another_group_topic_or_broker_run_are_refused(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 1)
            await send(c, 1, topic="other")
            pop = PopService(b.core)
            (d,) = await pop.receive(G, T, -1, None, 1, 30, 0)
            (o,) = await pop.receive("g2", T, -1, None, 1, 30, 0)
            assert codes(lambda: pop.ack("g2", T, d.receipt_handle)) == "INVALID_RECEIPT_HANDLE"
            assert codes(lambda: pop.ack(G, "other", d.receipt_handle)) == "INVALID_RECEIPT_HANDLE"
            h = decode_handle(d.receipt_handle)
            forged = encode_handle(Handle(h.epoch ^ 1, h.version, h.queue_id, h.offset, h.attempt, h.topic))
            assert codes(lambda: pop.ack(G, T, forged)) == "INVALID_RECEIPT_HANDLE"
            forged = encode_handle(Handle(h.epoch, h.version + 1, h.queue_id, h.offset, h.attempt, h.topic))
            assert codes(lambda: pop.ack(G, T, forged)) == "INVALID_RECEIPT_HANDLE"
            tampered = d.receipt_handle[:-3] + ("A" if d.receipt_handle[-3] != "A" else "B") + d.receipt_handle[-2:]
            assert codes(lambda: pop.ack(G, T, tampered)) == "INVALID_RECEIPT_HANDLE"
            pop.ack(G, T, d.receipt_handle)
            pop.ack("g2", T, o.receipt_handle)
            await c.close()

    arun(go())


def test_concurrent_receivers_of_one_group_never_hold_the_same_message(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": T, "queues": 4})
            pop = PopService(b.core)
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
            await send(c, 200, queue_id=None)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert not clash
            assert sorted(seen) == sorted(f"m{i}".encode() for i in range(200))
            assert sum(b.core.offsets.get(G, T, q) for q in range(4)) == 200
            await c.close()

    arun(go())


def test_half_messages_are_not_received_until_committed(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": T, "queues": 1})
            h = await c.ok("send", {"topic": T, "body": b"tx-body", "properties": {"TRAN_MSG": "true", "PGROUP": "shop"}})
            pop = PopService(b.core)
            assert await pop.receive(G, T, -1, None, 10, 30, 0.2) == []
            waiting = asyncio.ensure_future(pop.receive(G, T, -1, None, 10, 30, 10))
            await asyncio.sleep(0.05)
            await c.ok("end_transaction", {"group": "shop", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                           "half_offset": h["half_offset"], "state": "commit", "from_check": False})
            (d,) = await asyncio.wait_for(waiting, 5)
            assert d.record.body == b"tx-body"
            # a rolled-back one never comes
            h = await c.ok("send", {"topic": T, "body": b"rolled", "properties": {"TRAN_MSG": "true", "PGROUP": "shop"}})
            await c.ok("end_transaction", {"group": "shop", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                           "half_offset": h["half_offset"], "state": "rollback", "from_check": False})
            assert await pop.receive(G, T, -1, None, 10, 30, 0.2) == []
            # nor can the half topic be received from
            for topic in ("RMQ_SYS_TRANS_HALF_TOPIC", "RMQ_SYS_TRANS_OP_HALF_TOPIC"):
                with pytest.raises(PopError) as e:
                    await pop.receive(G, topic, -1, None, 1, 30, 0)
                assert e.value.code == "TOPIC_NOT_FOUND"
            await c.close()

    arun(go())


def test_tag_filters_skip_other_tags_and_move_the_offset_past_them(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 3, tag="a", prefix="a")
            await send(c, 3, tag="b", prefix="b")
            await send(c, 2, prefix="none")
            pop = PopService(b.core)
            got = await pop.receive(G, T, -1, parse_tags("b || c"), 32, 30, 0)
            assert [d.record.body for d in got] == [b"b0", b"b1", b"b2"]
            for d in got:
                pop.ack(G, T, d.receipt_handle)
            assert b.core.offsets.get(G, T, 0) == 8
            assert parse_tags("*") is None and parse_tags("") is None
            for bad in ("a||", "||", "a|| ||b"):
                assert codes(lambda bad=bad: parse_tags(bad)) == "ILLEGAL_FILTER_EXPRESSION"
            await c.close()

    arun(go())


def test_the_window_of_unsettled_messages_is_bounded_per_queue(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 20)
            pop = PopService(b.core, PopConfig(max_window=5))
            first = await pop.receive(G, T, -1, None, 32, 30, 0)
            assert len(first) == 5
            assert await pop.receive(G, T, -1, None, 32, 30, 0.1) == []  # full until the oldest is settled
            pop.ack(G, T, first[1].receipt_handle)
            assert await pop.receive(G, T, -1, None, 32, 30, 0) == []  # the oldest (offset 0) still holds it
            # a waiting receive wakes when the oldest is acknowledged
            waiting = asyncio.ensure_future(pop.receive(G, T, -1, None, 32, 30, 5))
            await asyncio.sleep(0.05)
            pop.ack(G, T, first[0].receipt_handle)
            more = await asyncio.wait_for(waiting, 2)
            assert [d.record.queue_offset for d in more] == [5, 6]
            assert pop.in_flight(G, T)[0]["unsettled"] == 5
            # and over all groups
            pop2 = PopService(b.core, PopConfig(max_slots=3))
            assert len(await pop2.receive("g-a", T, -1, None, 32, 30, 0)) == 3
            assert await pop2.receive("g-b", T, -1, None, 32, 30, 0) == []
            await c.close()

    arun(go())


def test_after_a_restart_only_unacknowledged_messages_are_delivered_again(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 6)
            pop = PopService(b.core)
            got = await pop.receive(G, T, -1, None, 6, 300, 0)
            for i in (0, 2, 4, 5):  # m2, m4 and m5 lie past the unacknowledged m1 and m3
                pop.ack(G, T, got[i].receipt_handle)
            handle = got[1].receipt_handle
            await pop.close()
            await c.close()
        assert json.loads((tmp_path / "d" / "acks.json").read_text()) == {"format": 1, "acked": {G: {T: {"0": [1, 1, 1, 1, 2]}}}}
        async with running_broker(tmp_path / "d") as b:
            pop = PopService(b.core)
            assert codes(lambda: pop.ack(G, T, handle)) == "INVALID_RECEIPT_HANDLE"
            again = await pop.receive(G, T, -1, None, 10, 300, 0)
            assert [(d.record.body, d.attempt) for d in again] == [(b"m1", 1), (b"m3", 1)]
            assert pop.counters["restored_settled"] == 3
            pop.ack(G, T, again[1].receipt_handle)
            pop.ack(G, T, again[0].receipt_handle)
            assert b.core.offsets.get(G, T, 0) == 6
            assert await pop.receive(G, T, -1, None, 10, 300, 0) == []
            await pop.close()
        assert json.loads((tmp_path / "d" / "acks.json").read_text()) == {"format": 1, "acked": {}}  # the offset covers them

    arun(go())


def test_acknowledgements_past_the_committed_offset_are_on_disk_within_a_flush_interval_without_a_shutdown(tmp_path):
    interval = 1.0

    async def go():
        async with running_broker(tmp_path / "d", flush_interval_s=interval) as b:
            c = await RawClient.open(b.address)
            await send(c, 4)
            pop = PopService(b.core)
            got = await pop.receive(G, T, 0, None, 4, 300, 0)
            pop.ack(G, T, got[0].receipt_handle)  # in order: only the committed offset moves
            await asyncio.sleep(interval * 0.75)  # past the half interval an out-of-order ack is handed over in
            assert not (tmp_path / "d" / "acks.json").exists()
            t0 = time.monotonic()
            pop.ack(G, T, got[2].receipt_handle)
            acks = tmp_path / "d" / "acks.json"
            while not (acks.exists() and json.loads(acks.read_text())["acked"]):
                # a flush interval by design; ten as the test's bound, so a loaded machine does not fail it
                assert time.monotonic() - t0 < 10 * interval, "the acknowledgement is not on disk after ten flush intervals"
                await asyncio.sleep(0.01)
            # What a SIGKILL now would leave: the files as they are.
            shutil.copytree(tmp_path / "d", tmp_path / "crashed", ignore=shutil.ignore_patterns("LOCK"))
            await c.close()
        async with running_broker(tmp_path / "crashed") as b:
            pop = PopService(b.core)
            again = await pop.receive(G, T, -1, None, 10, 300, 0)
            assert [d.record.body for d in again] == [b"m1", b"m3"]

    arun(go())


def test_an_offset_reset_forgets_the_acknowledgements_past_the_old_offset(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 4)
            pop = PopService(b.core)
            got = await pop.receive(G, T, 0, None, 4, 300, 0)
            pop.ack(G, T, got[0].receipt_handle)
            pop.ack(G, T, got[2].receipt_handle)
            pop.capture_settled()
            await b.core.flusher.wait_persisted()
            assert b.core.offsets.acked(G, T, 0) == [2, 3]
            # back to the first message: everything from there comes again, m2 too
            await c.ok("reset_offsets", {"group": G, "topic": T, "to": "offset", "offset": 0, "queue_ids": [0]})
            assert b.core.offsets.acked(G, T, 0) == []
            await c.close()
        assert json.loads((tmp_path / "d" / "acks.json").read_text())["acked"] == {}
        async with running_broker(tmp_path / "d") as b:
            pop = PopService(b.core)
            again = await pop.receive(G, T, -1, None, 10, 300, 0)
            assert [d.record.body for d in again] == [b"m0", b"m1", b"m2", b"m3"]

    arun(go())


def test_an_operator_offset_reset_restarts_the_group_from_there(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 5)
            pop = PopService(b.core)
            got = await pop.receive(G, T, 0, None, 2, 300, 0)
            await c.ok("reset_offsets", {"group": G, "topic": T, "to": "offset", "offset": 4, "queue_ids": [0]})
            assert codes(lambda: pop.ack(G, T, got[0].receipt_handle)) == "INVALID_RECEIPT_HANDLE"
            assert b.core.offsets.get(G, T, 0) == 4
            (d,) = await pop.receive(G, T, 0, None, 10, 300, 0)
            assert d.record.body == b"m4"
            await c.close()

    arun(go())


def test_bad_receive_requests_are_refused_with_a_code(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 1)
            pop = PopService(b.core)
            cases = [
                (("bad group!", T, -1, None, 1, 30, 0), "ILLEGAL_CONSUMER_GROUP"),
                (("", T, -1, None, 1, 30, 0), "ILLEGAL_CONSUMER_GROUP"),
                (("g" * 123, T, -1, None, 1, 30, 0), "ILLEGAL_CONSUMER_GROUP"),  # %DLQ%<group> would be too long
                ((G, "no-such-topic", -1, None, 1, 30, 0), "TOPIC_NOT_FOUND"),
                ((G, "bad/topic", -1, None, 1, 30, 0), "ILLEGAL_TOPIC"),
                ((G, T, 4, None, 1, 30, 0), "BAD_REQUEST"),
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
            (d,) = await pop.receive("g" * 122, T, -1, None, 1, 30, 0)
            await pop.forward_to_dlq("g" * 122, T, d.receipt_handle)
            await c.close()

    arun(go())


def test_stale_heap_entries_are_compacted(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 1)
            pop = PopService(b.core)
            (d,) = await pop.receive(G, T, -1, None, 1, 30, 0)
            h = d.receipt_handle
            for _ in range(5000):
                h = pop.change_invisible(G, T, h, 3600)
            sub = pop.subs[(G, T)]
            assert len(sub.heap) <= 2 * sub.live + 1025
            pop.ack(G, T, h)
            await c.close()

    arun(go())


def test_auto_renew_keeps_a_message_invisible_while_its_client_lives(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 1)
            clock = FakeTime()
            alive = {"c1": True}
            pop = PopService(b.core, PopConfig(max_renew_s=300), now=clock, client_alive=lambda cid: alive.get(cid, False))
            (d,) = await pop.receive(G, T, -1, None, 1, None, 0, auto_renew=True, client_id="c1")
            assert d.invisible_s == 60.0  # the default duration, renewed at its end
            for _ in range(3):
                clock.t += 61
                assert await pop.receive(G, T, -1, None, 1, 5, 0) == []
            pop.ack(G, T, d.receipt_handle)  # the handle stays valid across renewals
            # a client that is gone renews nothing: the message comes back after one duration
            await send(c, 1, prefix="n")
            (d,) = await pop.receive(G, T, -1, None, 1, None, 0, auto_renew=True, client_id="c1")
            alive["c1"] = False
            clock.t += 61
            (again,) = await pop.receive(G, T, -1, None, 1, 5, 0)
            assert again.record.body == b"n0" and again.attempt == 2
            # and renewal ends after max_renew_s even for a live client
            alive["c1"] = True
            pop.ack(G, T, again.receipt_handle)
            await send(c, 1, prefix="r")
            (d,) = await pop.receive(G, T, -1, None, 1, 30, 0, auto_renew=True, client_id="c1")
            for _ in range(9):
                clock.t += 31
                assert await pop.receive(G, T, -1, None, 1, 5, 0) == []
            clock.t += 31  # 310 s after the receive: past max_renew_s
            (again,) = await pop.receive(G, T, -1, None, 1, 5, 0)
            assert again.record.body == b"r0" and again.attempt == 2
            await c.close()

    arun(go())


def test_messages_deleted_by_retention_are_skipped_and_their_handles_refused(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d", segment_size=4096, cq_entries_per_file=8) as b:
            c = await RawClient.open(b.address)
            await send(c, 100)
            pop = PopService(b.core)
            held = await pop.receive(G, T, 0, None, 3, 300, 0)
            assert [d.record.queue_offset for d in held] == [0, 1, 2]
            await b.core.flusher.wait_persisted()
            b.core.store.checkpoint()
            deleted = b.core.store.delete_expired(time.time() + 10**7, b.core.store.max_offset)
            assert deleted
            lo = b.core.store.queue_min_offset(T, 0)
            assert lo > 3
            got = await pop.receive(G, T, 0, None, 2, 300, 0)
            assert [d.record.queue_offset for d in got] == [lo, lo + 1]
            assert codes(lambda: pop.ack(G, T, held[0].receipt_handle)) == "INVALID_RECEIPT_HANDLE"
            for d in got:
                pop.ack(G, T, d.receipt_handle)
            assert b.core.offsets.get(G, T, 0) == lo + 2
            await c.close()

    arun(go())


def test_a_damaged_acks_file_starts_the_broker_and_delivers_from_the_committed_offset(tmp_path, caplog):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 3)
            pop = PopService(b.core)
            got = await pop.receive(G, T, 0, None, 3, 300, 0)
            pop.ack(G, T, got[2].receipt_handle)
            await pop.close()
            await c.close()
        (tmp_path / "d" / "acks.json").write_bytes(b"\x00garbage")
        async with running_broker(tmp_path / "d") as b:
            pop = PopService(b.core)
            again = await pop.receive(G, T, -1, None, 10, 300, 0)
            assert [d.record.body for d in again] == [b"m0", b"m1", b"m2"]  # at-least-once without it

    with caplog.at_level("WARNING", logger="txmq"):
        arun(go())
    assert [r for r in caplog.records if "event=rmq_acks_unusable" in r.getMessage()]
