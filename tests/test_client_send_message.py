"""Both producers take a Message: `send(Message(...))` as `send_in_transaction(Message(...))`, and the old
`send(topic, body, ...)` form keeps working."""

from __future__ import annotations

import asyncio

import pytest

from conftest import arun

from txmq.broker.testing import running_broker
from txmq.client import Consumer, Message, Producer, SyncProducer


async def received(address: str, topic: str) -> list:
    async with Consumer("readers", topic, address, stop_when_caught_up=True) as c:
        return [m async for m in c]


def test_send_takes_a_message_in_both_producers_and_the_topic_and_body_form_still_works(data_dir):
    async def main():
        async with running_broker(data_dir) as b:
            async with Producer(b.address) as p:
                r1 = await p.send(Message("orders", b"async", keys="order-1", tags="t"), queue_id=0)
                r2 = await p.send("orders", b"old form", keys=["order-2"], queue_id=0)

            def blocking():
                with SyncProducer(b.address) as sp:
                    r3 = sp.send(Message("orders", b"hello", keys="order-3", properties={"region": "eu"}), queue_id=0)
                    r4 = sp.send("orders", b"old sync form", tags="u", queue_id=0)
                    r5 = sp.send(Message("orders", b"later", delay=3600))
                    return r3, r4, r5

            r3, r4, r5 = await asyncio.to_thread(blocking)
            assert [r.queue_offset for r in (r1, r2, r3, r4)] == [0, 1, 2, 3]
            assert r5.deliver_at_ms is not None and r5.queue_offset == -1  # the Message's delay went with it
            got = [(m.body, m.keys, m.tags, m.properties.get("region")) for m in await received(b.address, "orders")]
            assert got == [(b"async", "order-1", "t", None), (b"old form", "order-2", None, None),
                           (b"hello", "order-3", None, "eu"), (b"old sync form", None, "u", None)]

    arun(main())


def test_a_message_with_fields_beside_it_or_a_topic_without_a_body_is_refused_before_anything_is_sent(data_dir):
    async def main():
        async with running_broker(data_dir) as b:
            async with Producer(b.address) as p:
                with pytest.raises(TypeError, match="keys in the Message"):
                    await p.send(Message("orders", b"x"), keys="k")
                with pytest.raises(TypeError, match="body"):
                    await p.send(Message("orders", b"x"), b"y")
                with pytest.raises(TypeError, match="needs a body"):
                    await p.send("orders")

            def blocking():
                with SyncProducer(b.address) as sp:
                    with pytest.raises(TypeError, match="delay in the Message"):
                        sp.send(Message("orders", b"x"), delay=5)

            await asyncio.to_thread(blocking)
            assert await received(b.address, "orders") == []

    arun(main())
