"""The messaging service's rules, on a real store with the broker's services and no port open.

The send planner (a message's type and queue from its properties, per
protocol), the idempotent resend of a half message, the index gate, the
end of a transaction's typed outcome and the lookup of a transaction by id:
each decided once in broker/messaging/service.py for every front end.
"""

from __future__ import annotations

import asyncio

import pytest

from txmq.broker.clock import ManualClock
from txmq.broker.fifo import queue_of_group
from txmq.broker.messaging import NATIVE_RULES, ROCKETMQ4_RULES, EndStatus, Outgoing, TxRef
from txmq.broker.testing import running_services
from txmq.wire import ErrorCode, TxmqError

NOW = 1_700_000_000.0


def run(tmp_path, body, **overrides):
    async def go():
        clock = ManualClock(NOW)
        async with running_services(tmp_path / "data", clock, check_interval_s=3600, **overrides) as core:
            core.create_topic("orders", 8, ("normal", "transaction", "fifo", "delay"))
            core.create_topic("plain", 4, ("normal", "fifo"))  # no delay, no transaction
            core.create_topic("nofifo", 4, ("normal", "delay"))
            return await body(core, core.messaging, clock)

    return asyncio.run(go())


def out(body: bytes = b"x", born: int = int(NOW * 1000), **props: str) -> Outgoing:
    return Outgoing(body, dict(props), born)


def half(tx_id: str | None = None, group: str = "g") -> Outgoing:
    props = {"TRAN_MSG": "true", "PGROUP": group}
    if tx_id is not None:
        props["UNIQ_KEY"] = tx_id
    return Outgoing(b"h", props, int(NOW * 1000))


def test_a_fifo_message_goes_to_its_groups_queue_and_a_queue_given_with_it_must_be_that_one(tmp_path):
    async def body(core, m, clock):
        (r,) = await m.send("orders", [out(__SHARDINGKEY="cart-7")])
        assert r.queue_id == queue_of_group("cart-7", 8)
        other = (r.queue_id + 1) % 8
        with pytest.raises(TxmqError) as e:
            m.send("orders", [out(__SHARDINGKEY="cart-7")], other)
        assert e.value.code == ErrorCode.INVALID_FIELD and "the queue of message group" in e.value.message

    run(tmp_path, body)


def test_a_message_group_with_a_delivery_time_or_in_a_topic_without_fifo_is_refused(tmp_path):
    async def body(core, m, clock):
        with pytest.raises(TxmqError) as e:
            m.send("orders", [out(__SHARDINGKEY="g1", TIMER_DELAY_SEC="5")])
        assert e.value.code == ErrorCode.INVALID_FIELD
        with pytest.raises(TxmqError) as e:
            m.send("nofifo", [out(__SHARDINGKEY="g1")])
        assert e.value.code == ErrorCode.MESSAGE_TYPE_NOT_ACCEPTED
        with pytest.raises(TxmqError) as e:
            m.send("orders", [out(__SHARDINGKEY="g1", TRAN_MSG="true", PGROUP="p")])
        assert e.value.code == ErrorCode.INVALID_FIELD and "transactional" in e.value.message

    run(tmp_path, body)


def test_a_delayed_message_is_checked_against_the_topics_types_only_where_the_protocol_has_them(tmp_path):
    async def body(core, m, clock):
        with pytest.raises(TxmqError) as e:
            m.send("plain", [out(DELAY="3")], None, NATIVE_RULES)
        assert e.value.code == ErrorCode.MESSAGE_TYPE_NOT_ACCEPTED
        (r,) = await m.send("plain", [out(DELAY="3")], None, ROCKETMQ4_RULES)  # RocketMQ 4 has no topic types
        assert r.scheduled and r.queue_offset == -1 and r.deliver_at_ms == int(NOW * 1000) + 10_000  # level 3: 10 s
        # RocketMQ 4 has no message groups either: the property is kept, the client's queue is used
        (r,) = await m.send("plain", [out(__SHARDINGKEY="g1")], 3, ROCKETMQ4_RULES)
        assert r.queue_id == 3

    run(tmp_path, body)


def test_a_batch_gets_one_receipt_per_message_and_refuses_a_transactional_one(tmp_path):
    async def body(core, m, clock):
        rs = await m.send("orders", [out(b"a"), out(b"b")], 2)
        assert [r.queue_id for r in rs] == [2, 2] and rs[0].queue_offset + 1 == rs[1].queue_offset
        rs = await m.send("orders", [out(b"a"), out(b"b"), out(b"c", __SHARDINGKEY="k")])  # the plain ones share a queue
        assert rs[0].queue_id == rs[1].queue_id and rs[2].queue_id == queue_of_group("k", 8)
        assert not any(r.transactional or r.scheduled for r in rs)
        with pytest.raises(TxmqError) as e:
            m.send("orders", [out(b"a"), half()])
        assert e.value.code == ErrorCode.INVALID_FIELD

    run(tmp_path, body)


def test_a_half_sent_again_under_a_pending_id_gets_the_first_receipt_and_is_stored_once(tmp_path):
    async def body(core, m, clock):
        (first,) = await m.send("orders", [half("TX-1")])
        (again,) = await m.send("orders", [half("TX-1")])
        assert first.transactional and not first.resent
        assert again.resent and (again.commit_log_offset, again.half_offset) == (first.commit_log_offset, first.half_offset)
        assert len(core.tx.index.pending) == 1
        with pytest.raises(TxmqError) as e:  # the same id from another group is another transaction: refused
            await m.send("orders", [half("TX-1", group="other")])
        assert e.value.code == ErrorCode.INVALID_FIELD and "already in use" in e.value.message

    run(tmp_path, body)


def test_each_end_of_a_transaction_has_its_typed_outcome(tmp_path):
    async def body(core, m, clock):
        (h,) = await m.send("orders", [half("TX-2")])
        o = await m.end_transaction("g", "TX-2", h.commit_log_offset, h.half_offset, "unknown", "check")
        assert (o.status, o.outcome, o.committed) == (EndStatus.UNCHANGED, "pending", None)
        o = await m.end_transaction("g", "TX-2", h.commit_log_offset, h.half_offset, "commit")
        assert (o.status, o.outcome) == (EndStatus.DECIDED, "committed")
        assert o.committed is not None and o.committed.topic == "orders" and o.committed.queue_id == h.queue_id
        again = await m.end_transaction("g", "TX-2", h.commit_log_offset, h.half_offset, "commit")
        assert (again.status, again.decided_by) == (EndStatus.ALREADY, "producer")
        assert again.remark() == "transaction TX-2 was already committed (by producer)"
        with pytest.raises(TxmqError) as e:
            await m.end_transaction("g", "TX-2", h.commit_log_offset, h.half_offset, "rollback")
        assert e.value.code == ErrorCode.TX_CONFLICT
        with pytest.raises(TxmqError) as e:
            m.end_transaction("g", "TX-2", h.commit_log_offset, h.half_offset, "maybe")
        assert e.value.code == ErrorCode.INVALID_FIELD

    run(tmp_path, body)


def test_a_transaction_is_found_by_its_id_or_by_the_form_with_offsets(tmp_path):
    async def body(core, m, clock):
        (h,) = await m.send("orders", [half("TX-3")])
        assert await m.transaction_ref("TX-3") == TxRef("TX-3", h.commit_log_offset, h.half_offset)
        assert await m.transaction_ref(f"TX-3:{h.commit_log_offset}:{h.half_offset}") == TxRef("TX-3", h.commit_log_offset, h.half_offset)
        await m.end_transaction("g", "TX-3", h.commit_log_offset, h.half_offset, "rollback")
        assert await m.transaction_ref("TX-3") == TxRef("TX-3", h.commit_log_offset, h.half_offset)  # decided: its first copy
        assert await m.transaction_ref("no-such") is None

    run(tmp_path, body)


def test_transactional_requests_wait_at_the_index_gate_and_pass_in_arrival_order(tmp_path):
    async def body(core, m, clock):
        core.keeper.ready.clear()  # as right after a start, while the index is built
        sent = m.send("orders", [half("TX-4")])
        await asyncio.sleep(0.05)
        assert not sent.done() and not core.tx.index.pending
        plain = await m.send("orders", [out()])  # plain sends do not wait
        assert plain[0].queue_offset >= 0
        core.keeper.ready.set()
        (h,) = await asyncio.wait_for(sent, 30)
        assert h.msg_id == "TX-4" and "TX-4" in core.tx.index.pending

    run(tmp_path, body)


def test_a_failed_message_goes_back_through_the_retry_topic_then_to_the_dead_letter_topic(tmp_path):
    async def body(core, m, clock):
        (r,) = await m.send("orders", [out(b"job", KEYS="k1")])
        first = await m.send_back("workers", r.commit_log_offset, 0, 2, "ORIGIN-1")
        assert not first.dead_lettered and first.receipt.topic == "%RETRY%workers" and first.receipt.scheduled
        assert first.receipt.deliver_at_ms == int(NOW * 1000) + 10_000  # level 3: the first retry's delay
        copy = m.read_message(first.receipt.commit_log_offset, scheduled=True)
        assert copy.properties["RECONSUME_TIME"] == "1" and copy.properties["RETRY_TOPIC"] == "orders"
        assert copy.properties["ORIGIN_MESSAGE_ID"] == "ORIGIN-1" and copy.properties["KEYS"] == "k1" and copy.body == b"job"
        asked = await m.send_back("workers", r.commit_log_offset, 1, 2)  # level 1 asked: 1 s
        assert asked.receipt.deliver_at_ms == int(NOW * 1000) + 1_000
        # a delivered retry copy carries its RECONSUME_TIME: past max_times (2) it is given up
        (twice,) = await m.send("%RETRY%workers", [out(b"job", RECONSUME_TIME="2", RETRY_TOPIC="orders")])
        third = await m.send_back("workers", twice.commit_log_offset, 0, 2)
        assert third.dead_lettered and third.receipt.topic == "%DLQ%workers" and not third.receipt.scheduled
        dlq = m.read_message(third.receipt.commit_log_offset)
        assert dlq.properties["RECONSUME_TIME"] == "3" and dlq.properties["RETRY_TOPIC"] == "orders"
        assert core.topics.queues("%RETRY%workers") == 1 and core.topics.queues("%DLQ%workers") == 1
        assert (await m.send_back("workers", r.commit_log_offset, -1)).dead_lettered  # a negative level: at once
        with pytest.raises(TxmqError) as e:
            m.send_back("workers", 1 << 40)
        assert e.value.code == ErrorCode.NO_SUCH_MESSAGE

    run(tmp_path, body)
