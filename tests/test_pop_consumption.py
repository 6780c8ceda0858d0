"""Consumption with invisible durations (broker/messaging/consumption.py) through a whole broker, no gRPC.

What needs the broker: its native clients' sends, groups describe, the
schedule, transactions, an operator's offset reset, retention, the flusher's
persist cycle and a start on a damaged acks file. The service's own rules
(receive, ack, invisible durations, dead letters, FIFO groups, bounds,
refusals) are tested on a store alone in tests/test_consumption_service.py.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import pytest

from conftest import arun
from txmq.broker import groups
from txmq.broker.messaging.consumption import PopError
from txmq.broker.testing import running_broker
from wireclient import RawClient

G = "sdk-group"
T = "orders"


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
            pop = b.core.consumption_service()
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


def test_empty_long_poll_answers_after_the_poll_time_and_an_append_wakes_it(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": T, "queues": 4})
            pop = b.core.consumption_service()
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
            assert not b.core.polls.waiting()
            await c.close()

    arun(go())


def test_a_delivered_delayed_message_forwarded_to_the_dead_letter_topic_is_counted_delivered_once(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await c.ok("send", {"topic": T, "queue_id": 0, "body": b"later", "properties": {"TIMER_DELAY_MS": "50"}})
            pop = b.core.consumption_service()
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


def test_half_messages_are_not_received_until_committed(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": T, "queues": 1})
            h = await c.ok("send", {"topic": T, "body": b"tx-body", "properties": {"TRAN_MSG": "true", "PGROUP": "shop"}})
            pop = b.core.consumption_service()
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


def test_acknowledgements_past_the_committed_offset_are_on_disk_within_a_flush_interval_without_a_shutdown(tmp_path):
    interval = 1.0

    async def go():
        async with running_broker(tmp_path / "d", flush_interval_s=interval) as b:
            c = await RawClient.open(b.address)
            await send(c, 4)
            pop = b.core.consumption_service()
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
            pop = b.core.consumption_service()
            again = await pop.receive(G, T, -1, None, 10, 300, 0)
            assert [d.record.body for d in again] == [b"m1", b"m3"]

    arun(go())


def test_an_offset_reset_forgets_the_acknowledgements_past_the_old_offset(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 4)
            pop = b.core.consumption_service()
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
            pop = b.core.consumption_service()
            again = await pop.receive(G, T, -1, None, 10, 300, 0)
            assert [d.record.body for d in again] == [b"m0", b"m1", b"m2", b"m3"]

    arun(go())


def test_an_operator_offset_reset_restarts_the_group_from_there(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await send(c, 5)
            pop = b.core.consumption_service()
            got = await pop.receive(G, T, 0, None, 2, 300, 0)
            await c.ok("reset_offsets", {"group": G, "topic": T, "to": "offset", "offset": 4, "queue_ids": [0]})
            assert codes(lambda: pop.ack(G, T, got[0].receipt_handle)) == "INVALID_RECEIPT_HANDLE"
            assert b.core.offsets.get(G, T, 0) == 4
            (d,) = await pop.receive(G, T, 0, None, 10, 300, 0)
            assert d.record.body == b"m4"
            await c.close()

    arun(go())


def test_messages_deleted_by_retention_are_skipped_and_their_handles_refused(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d", segment_size=4096, cq_entries_per_file=8) as b:
            c = await RawClient.open(b.address)
            await send(c, 100)
            pop = b.core.consumption_service()
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
            pop = b.core.consumption_service()
            got = await pop.receive(G, T, 0, None, 3, 300, 0)
            pop.ack(G, T, got[2].receipt_handle)
            await pop.close()
            await c.close()
        (tmp_path / "d" / "acks.json").write_bytes(b"\x00garbage")
        async with running_broker(tmp_path / "d") as b:
            pop = b.core.consumption_service()
            again = await pop.receive(G, T, -1, None, 10, 300, 0)
            assert [d.record.body for d in again] == [b"m0", b"m1", b"m2"]  # at-least-once without it

    with caplog.at_level("WARNING", logger="txmq"):
        arun(go())
    assert [r for r in caplog.records if "event=rmq_acks_unusable" in r.getMessage()]
