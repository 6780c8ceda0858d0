"""The receive side of the RocketMQ 5 gRPC front end, with a plain gRPC client (txmq's generated stubs) against a real broker.

ReceiveMessage, AckMessage, ChangeInvisibleDuration and
ForwardMessageToDeadLetterQueue as RocketMQ's SDKs call them (docs/rocketmq.md,
"Receiving"); the official SDKs themselves run in test_rocketmq_sdk_*.py.
"""

from __future__ import annotations

import asyncio
import time
import zlib

import pytest

grpc = pytest.importorskip("grpc")

from conftest import arun  # noqa: E402
from txmq.broker.rocketmq.pb import definition_pb2 as d  # noqa: E402
from txmq.broker.rocketmq.pb import service_pb2 as s  # noqa: E402
from txmq.broker.rocketmq.pb import service_pb2_grpc as sg  # noqa: E402
from txmq.broker.testing import running_broker  # noqa: E402
from wireclient import RawClient  # noqa: E402

G = "sdk-consumers"
T = "orders"
META = (("x-mq-client-id", "test-host@1@0@abc"), ("x-mq-language", "PYTHON"))


class Rmq:
    """A gRPC client of the broker's RocketMQ service, and a native one for sending."""

    def __init__(self, b) -> None:
        self.b = b
        self.channel = grpc.aio.insecure_channel(b.rocketmq_address)
        self.stub = sg.MessagingServiceStub(self.channel)

    @property
    def pop(self):
        fe = next(f for f in self.b.broker.frontends if hasattr(f, "service"))
        return fe.service.receive.pop

    async def receive(self, group: str = G, topic: str = T, queue_id: int = -1, batch: int = 32, invisible: float | None = 30,
                      poll: float | None = 0, expression: str = "*", ftype: int = d.TAG, timeout: float = 10,
                      auto_renew: bool = False, namespace: str = "") -> tuple[d.Status, list[d.Message], list[s.ReceiveMessageResponse]]:
        req = s.ReceiveMessageRequest(batch_size=batch, auto_renew=auto_renew)
        req.group.name = group
        req.group.resource_namespace = namespace
        req.message_queue.topic.name = topic
        req.message_queue.id = queue_id
        req.filter_expression.type = ftype
        req.filter_expression.expression = expression
        if invisible is not None:
            req.invisible_duration.FromMilliseconds(int(invisible * 1000))
        if poll is not None:
            req.long_polling_timeout.FromMilliseconds(int(poll * 1000))
        frames = [r async for r in self.stub.ReceiveMessage(req, timeout=timeout, metadata=META)]
        statuses = [r.status for r in frames if r.HasField("status")]
        assert len(statuses) == 1, frames
        assert frames[0].HasField("status")  # the status comes first
        msgs = [r.message for r in frames if r.HasField("message")]
        if msgs:
            assert frames[-1].HasField("delivery_timestamp")
        return statuses[0], msgs, frames

    async def ack(self, handles: list[str], group: str = G, topic: str = T) -> s.AckMessageResponse:
        req = s.AckMessageRequest()
        req.group.name = group
        req.topic.name = topic
        for h in handles:
            req.entries.add(receipt_handle=h, message_id="x")
        return await self.stub.AckMessage(req, timeout=5, metadata=META)

    async def change(self, handle: str, seconds: float, group: str = G, topic: str = T) -> s.ChangeInvisibleDurationResponse:
        req = s.ChangeInvisibleDurationRequest(receipt_handle=handle, message_id="x")
        req.group.name = group
        req.topic.name = topic
        req.invisible_duration.FromMilliseconds(int(seconds * 1000))
        return await self.stub.ChangeInvisibleDuration(req, timeout=5, metadata=META)

    async def forward(self, handle: str, group: str = G, topic: str = T) -> s.ForwardMessageToDeadLetterQueueResponse:
        req = s.ForwardMessageToDeadLetterQueueRequest(receipt_handle=handle, message_id="x", delivery_attempt=1,
                                                       max_delivery_attempts=16)
        req.group.name = group
        req.topic.name = topic
        return await self.stub.ForwardMessageToDeadLetterQueue(req, timeout=5, metadata=META)

    async def close(self) -> None:
        await self.channel.close()


def running(tmp_path, **kw):
    return running_broker(tmp_path / "d", rocketmq_port=0, **kw)


async def native_send(c: RawClient, n: int, topic: str = T, queue_id: int | None = 0, prefix: str = "m", **props) -> list[dict]:
    out = []
    for i in range(n):
        f = {"topic": topic, "body": f"{prefix}{i}".encode()}
        if queue_id is not None:
            f["queue_id"] = queue_id
        if props:
            f["properties"] = dict(props)
        out.append(await c.ok("send", f))
    return out


def handles(msgs: list[d.Message]) -> list[str]:
    return [m.system_properties.receipt_handle for m in msgs]


def test_native_producer_to_receive_and_ack_with_every_field(tmp_path):
    async def go():
        async with running(tmp_path) as b:
            c = await RawClient.open(b.address)
            sent = await native_send(c, 3, TAGS="red", KEYS="k1 k2", color="blue")
            r = Rmq(b)
            st, msgs, _ = await r.receive(batch=2)
            assert st.code == d.Code.OK
            assert [m.body for m in msgs] == [b"m0", b"m1"]
            m = msgs[0]
            sp = m.system_properties
            assert m.topic.name == T
            assert dict(m.user_properties) == {"color": "blue"}
            assert sp.tag == "red" and list(sp.keys) == ["k1", "k2"]
            assert sp.message_id == sent[0]["msg_id"]
            assert sp.delivery_attempt == 1
            assert sp.queue_id == 0 and sp.queue_offset == 0
            assert sp.invisible_duration.seconds == 30
            assert sp.store_timestamp.ToMilliseconds() > 0 and sp.born_timestamp.ToMilliseconds() > 0
            assert sp.body_encoding == d.IDENTITY
            assert sp.body_digest.type == d.CRC32 and int(sp.body_digest.checksum, 16) == zlib.crc32(m.body)
            assert sp.receipt_handle
            res = await r.ack(handles(msgs))
            assert res.status.code == d.Code.OK
            assert [e.status.code for e in res.entries] == [d.Code.OK, d.Code.OK]
            st, rest, _ = await r.receive()
            assert [m.body for m in rest] == [b"m2"]
            assert (await r.ack(handles(rest))).status.code == d.Code.OK
            assert b.core.offsets.get(G, T, 0) == 3  # txmq groups describe shows it
            # acknowledged twice: refused per entry
            res = await r.ack(handles(rest))
            assert res.status.code == d.Code.INVALID_RECEIPT_HANDLE
            assert res.entries[0].status.code == d.Code.INVALID_RECEIPT_HANDLE
            await r.close()
            await c.close()

    arun(go())


def test_sdk_send_is_received_by_a_native_consumer_and_by_receive(tmp_path):
    async def go():
        async with running(tmp_path) as b:
            b.core.create_topic(T, None, None)  # RocketMQ 5's clients send only to a topic the broker knows
            r = Rmq(b)
            req = s.SendMessageRequest()
            m = req.messages.add(body=b"from-sdk")
            m.topic.name = T
            m.system_properties.message_id = "01ABCDEF0123456789ABCDEF0000000001"
            m.system_properties.message_type = d.NORMAL
            m.system_properties.body_encoding = d.IDENTITY
            m.system_properties.tag = "t1"
            res = await r.stub.SendMessage(req, timeout=5, metadata=META)
            assert res.status.code == d.Code.OK, res
            c = await RawClient.open(b.address)
            native = []
            for q in range(b.core.topics.queues(T)):
                native += (await c.ok("pull", {"topic": T, "queue_id": q, "offset": 0, "max_count": 10}))["messages"]
            assert [x["body"] for x in native] == [b"from-sdk"]
            st, msgs, _ = await r.receive()
            assert [x.body for x in msgs] == [b"from-sdk"]
            assert msgs[0].system_properties.message_id == "01ABCDEF0123456789ABCDEF0000000001"
            assert msgs[0].system_properties.tag == "t1"
            await r.close()
            await c.close()

    arun(go())


def test_a_committed_sdk_transaction_is_received_with_its_transaction_id_property_and_a_normal_message_without(tmp_path):
    async def go():
        async with running(tmp_path) as b:
            b.core.create_topic(T, None, None)  # RocketMQ 5's clients send only to a topic the broker knows
            r = Rmq(b)

            async def send(body: bytes, message_id: str, kind: int) -> s.SendResultEntry:
                req = s.SendMessageRequest()
                m = req.messages.add(body=body)
                m.topic.name = T
                m.system_properties.message_id = message_id
                m.system_properties.message_type = kind
                m.system_properties.body_encoding = d.IDENTITY
                res = await r.stub.SendMessage(req, timeout=5, metadata=META)
                assert res.status.code == d.Code.OK, res
                return res.entries[0]

            tx = await send(b"committed", "01ABCDEF0123456789ABCDEF00000000A1", d.TRANSACTION)
            plain = await send(b"plain", "01ABCDEF0123456789ABCDEF00000000A2", d.NORMAL)
            end = s.EndTransactionRequest(message_id=tx.message_id, transaction_id=tx.transaction_id, resolution=d.COMMIT,
                                          source=d.SOURCE_CLIENT)
            end.topic.name = T
            assert (await r.stub.EndTransaction(end, timeout=5, metadata=META)).status.code == d.Code.OK
            st, msgs, _ = await r.receive(poll=1)
            got = {m.body: m for m in msgs}
            assert sorted(got) == [b"committed", b"plain"]
            # what RocketMQ's proxy delivers: the transaction id (the message id) in the __transactionId__ property
            assert got[b"committed"].user_properties["__transactionId__"] == tx.transaction_id == tx.message_id
            assert got[b"committed"].system_properties.message_id == tx.message_id
            assert "__transactionId__" not in got[b"plain"].user_properties
            assert plain.transaction_id == plain.message_id
            await r.close()

    arun(go())


def test_empty_receive_answers_message_not_found_within_the_long_poll(tmp_path):
    async def go():
        async with running(tmp_path) as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": T, "queues": 4})
            r = Rmq(b)
            t0 = time.monotonic()
            st, msgs, frames = await r.receive(poll=1.0)
            took = time.monotonic() - t0
            assert st.code == d.Code.MESSAGE_NOT_FOUND and msgs == [] and len(frames) == 1
            assert 0.9 <= took < 15, took
            # a long poll longer than the call's deadline still answers before it
            t0 = time.monotonic()
            st, msgs, _ = await r.receive(poll=30, timeout=2)
            assert st.code == d.Code.MESSAGE_NOT_FOUND  # an answer, not the call's DEADLINE_EXCEEDED
            # and a waiting receive wakes on a native send
            waiting = asyncio.ensure_future(r.receive(poll=60, timeout=90))
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            await native_send(c, 1, queue_id=2)
            st, msgs, _ = await asyncio.wait_for(waiting, 90)
            assert st.code == d.Code.OK and [m.body for m in msgs] == [b"m0"]
            assert time.monotonic() - t0 < 30  # woken, not answered at the 60 s poll's end
            await r.close()
            await c.close()

    arun(go())


def test_expired_invisibility_redelivers_with_attempt_two(tmp_path):
    async def go():
        async with running(tmp_path) as b:
            c = await RawClient.open(b.address)
            await native_send(c, 1)
            r = Rmq(b)
            _, (first,), _ = await r.receive(invisible=1)
            st, msgs, _ = await r.receive(invisible=1)
            assert st.code == d.Code.MESSAGE_NOT_FOUND  # invisible meanwhile
            t0 = time.monotonic()
            st, msgs, _ = await r.receive(invisible=5, poll=60, timeout=90)  # the long poll wakes when the duration ends
            assert time.monotonic() - t0 < 30  # at the end of the 1 s invisibility, not the 60 s poll's
            (again,) = msgs
            assert again.body == b"m0" and again.system_properties.delivery_attempt == 2
            assert again.system_properties.message_id == first.system_properties.message_id
            assert (await r.ack(handles([first]))).status.code == d.Code.INVALID_RECEIPT_HANDLE
            assert (await r.ack(handles([again]))).status.code == d.Code.OK
            await r.close()
            await c.close()

    arun(go())


def test_change_invisible_duration_returns_a_new_handle_and_the_old_is_refused(tmp_path):
    async def go():
        async with running(tmp_path) as b:
            c = await RawClient.open(b.address)
            await native_send(c, 1)
            r = Rmq(b)
            _, (m,), _ = await r.receive(invisible=1)
            old = m.system_properties.receipt_handle
            res = await r.change(old, 60)
            assert res.status.code == d.Code.OK and res.receipt_handle and res.receipt_handle != old
            await asyncio.sleep(1.2)  # past the first duration: still invisible
            st, _, _ = await r.receive()
            assert st.code == d.Code.MESSAGE_NOT_FOUND
            refused = await r.change(old, 10)
            assert refused.status.code == d.Code.INVALID_RECEIPT_HANDLE
            assert refused.receipt_handle == old  # what the SDKs store on a refusal
            assert (await r.ack([old])).status.code == d.Code.INVALID_RECEIPT_HANDLE
            bad = await r.change(res.receipt_handle, -5)
            assert bad.status.code == d.Code.ILLEGAL_INVISIBLE_TIME
            # a nack: visible again at once, attempt 2
            res2 = await r.change(res.receipt_handle, 0)
            assert res2.status.code == d.Code.OK
            st, (again,), _ = await r.receive()
            assert again.system_properties.delivery_attempt == 2
            assert (await r.ack(handles([again]))).status.code == d.Code.OK
            await r.close()
            await c.close()

    arun(go())


def test_max_delivery_attempts_moves_the_message_to_the_dead_letter_topic(tmp_path):
    async def go():
        async with running(tmp_path) as b:
            c = await RawClient.open(b.address)
            sent = await native_send(c, 1)
            r = Rmq(b)
            r.pop.attach(max_attempts=lambda group: 2)
            for attempt in (1, 2):
                _, (m,), _ = await r.receive()
                assert m.system_properties.delivery_attempt == attempt
                assert (await r.change(m.system_properties.receipt_handle, 0)).status.code == d.Code.OK
            st, msgs, _ = await r.receive(poll=0.5)
            assert st.code == d.Code.MESSAGE_NOT_FOUND  # not a third time
            dlq = "%DLQ%" + G
            for _ in range(100):
                if b.core.topics.queues(dlq) and b.core.store.queue_max_offset(dlq, 0):
                    break
                await asyncio.sleep(0.02)
            st, (dm,), _ = await r.receive(group="dlq-readers", topic=dlq)
            assert dm.body == b"m0"
            assert dm.system_properties.message_id == sent[0]["msg_id"]
            assert dm.user_properties["DLQ_ORIGIN_TOPIC"] == T
            assert b.core.offsets.get(G, T, 0) == 1
            await r.close()
            await c.close()

    arun(go())


def test_forward_to_dead_letter_queue_settles_the_message(tmp_path):
    async def go():
        async with running(tmp_path) as b:
            c = await RawClient.open(b.address)
            await native_send(c, 2)
            r = Rmq(b)
            _, (m, m2), _ = await r.receive()
            res = await r.forward(m.system_properties.receipt_handle)
            assert res.status.code == d.Code.OK
            assert (await r.forward(m.system_properties.receipt_handle)).status.code == d.Code.INVALID_RECEIPT_HANDLE
            assert (await r.forward("garbage")).status.code == d.Code.INVALID_RECEIPT_HANDLE
            assert (await r.ack(handles([m2]))).status.code == d.Code.OK
            assert b.core.offsets.get(G, T, 0) == 2
            got = await c.ok("pull", {"topic": "%DLQ%" + G, "queue_id": 0, "offset": 0, "max_count": 10})
            assert [x["body"] for x in got["messages"]] == [b"m0"]
            await r.close()
            await c.close()

    arun(go())


@pytest.mark.parametrize("handle", ["", "x", "A" * 5000, "ñ-not-base64-ñ", "AbXyrA8BAAAAAAAAAAAAAAAAAAAAAAAAAAEAdMrAD7A"])
def test_malformed_receipt_handles_get_invalid_receipt_handle_per_entry(tmp_path, handle):
    async def go():
        async with running(tmp_path) as b:
            c = await RawClient.open(b.address)
            await native_send(c, 1)
            r = Rmq(b)
            _, (m,), _ = await r.receive()
            res = await r.ack([handle, m.system_properties.receipt_handle])
            assert res.status.code == d.Code.MULTIPLE_RESULTS
            assert [e.status.code for e in res.entries] == [d.Code.INVALID_RECEIPT_HANDLE, d.Code.OK]
            assert (await r.change(handle, 5)).status.code == d.Code.INVALID_RECEIPT_HANDLE
            await r.close()
            await c.close()

    arun(go())


def test_two_consumers_of_one_group_never_hold_the_same_message(tmp_path):
    async def go():
        async with running(tmp_path) as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": T, "queues": 4})
            consumers = [Rmq(b), Rmq(b)]
            held: set[bytes] = set()
            seen: list[bytes] = []
            clash: list[bytes] = []
            N = 150

            async def run(r: Rmq) -> None:
                while len(seen) < N:
                    st, msgs, _ = await r.receive(batch=8, poll=0.5)
                    bodies = [m.body for m in msgs]
                    clash.extend(x for x in bodies if x in held)
                    held.update(bodies)
                    await asyncio.sleep(0.005)
                    held.difference_update(bodies)
                    seen.extend(bodies)
                    if msgs:
                        assert (await r.ack(handles(msgs))).status.code == d.Code.OK

            tasks = [asyncio.ensure_future(run(r)) for r in consumers]
            await native_send(c, N, queue_id=None)
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert not clash
            assert sorted(seen) == sorted(f"m{i}".encode() for i in range(N))
            for r in consumers:
                await r.close()
            await c.close()

    arun(go())


def test_half_messages_are_received_only_once_committed(tmp_path):
    async def go():
        async with running(tmp_path) as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": T, "queues": 2})
            r = Rmq(b)
            h = await c.ok("send", {"topic": T, "body": b"tx", "properties": {"TRAN_MSG": "true", "PGROUP": "shop"}})
            st, _, _ = await r.receive(poll=0.3)
            assert st.code == d.Code.MESSAGE_NOT_FOUND
            waiting = asyncio.ensure_future(r.receive(poll=10))
            await asyncio.sleep(0.2)
            await c.ok("end_transaction", {"group": "shop", "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                           "half_offset": h["half_offset"], "state": "commit", "from_check": False})
            st, (m,), _ = await asyncio.wait_for(waiting, 5)
            assert m.body == b"tx" and m.system_properties.message_type == d.TRANSACTION
            assert m.system_properties.message_id == h["tx_id"]
            assert m.user_properties["__transactionId__"] == h["tx_id"]  # a native transaction too, as RocketMQ delivers it
            st, _, _ = await r.receive(topic="RMQ_SYS_TRANS_HALF_TOPIC")
            assert st.code == d.Code.TOPIC_NOT_FOUND
            await r.close()
            await c.close()

    arun(go())


def test_tag_filter_and_sql_filter(tmp_path):
    async def go():
        async with running(tmp_path) as b:
            c = await RawClient.open(b.address)
            await native_send(c, 2, prefix="a", TAGS="a")
            await native_send(c, 2, prefix="b", TAGS="b")
            await native_send(c, 2, prefix="p", TAGS="p", size="7", region="eu")
            r = Rmq(b)
            st, msgs, _ = await r.receive(expression="b||c")
            assert [m.body for m in msgs] == [b"b0", b"b1"]
            # SQL92 over the properties, the tag as TAGS: a comparison with a missing property is not a match
            st, msgs, _ = await r.receive(group="sql", expression="TAGS = 'a' OR size > 5 AND region IN ('eu')", ftype=d.SQL)
            assert [m.body for m in msgs] == [b"a0", b"a1", b"p0", b"p1"]
            st, msgs, _ = await r.receive(group="sql-none", expression="size IS NULL AND TAGS <> 'a'", ftype=d.SQL)
            assert [m.body for m in msgs] == [b"b0", b"b1"]
            st, _, _ = await r.receive(group="bad-sql", expression="size BETWEEN 5 AND", ftype=d.SQL)
            assert st.code == d.Code.ILLEGAL_FILTER_EXPRESSION
            st, _, _ = await r.receive(group="bad-tags", expression="a||")
            assert st.code == d.Code.ILLEGAL_FILTER_EXPRESSION
            await r.close()
            await c.close()

    arun(go())


BAD = [
    (dict(group=""), d.Code.ILLEGAL_CONSUMER_GROUP),
    (dict(group="has space"), d.Code.ILLEGAL_CONSUMER_GROUP),
    (dict(topic="no-such-topic"), d.Code.TOPIC_NOT_FOUND),
    (dict(topic=""), d.Code.ILLEGAL_TOPIC),
    (dict(queue_id=99), d.Code.BAD_REQUEST),
    (dict(queue_id=-7), d.Code.BAD_REQUEST),
    (dict(batch=0), d.Code.BAD_REQUEST),
    (dict(batch=1 << 30), d.Code.BAD_REQUEST),
    (dict(invisible=-1), d.Code.ILLEGAL_INVISIBLE_TIME),
    (dict(invisible=100 * 3600), d.Code.ILLEGAL_INVISIBLE_TIME),
    (dict(poll=-1), d.Code.ILLEGAL_POLLING_TIME),
    (dict(namespace="ns"), d.Code.ILLEGAL_CONSUMER_GROUP),
]


@pytest.mark.parametrize("kw,code", BAD)
def test_bad_receive_requests_get_a_status_and_the_broker_keeps_serving(tmp_path, kw, code):
    async def go():
        async with running(tmp_path) as b:
            c = await RawClient.open(b.address)
            await native_send(c, 1)
            r = Rmq(b)
            st, msgs, frames = await r.receive(**kw)
            assert st.code == code, st
            assert msgs == [] and len(frames) == 1
            st, msgs, _ = await r.receive()
            assert st.code == d.Code.OK and [m.body for m in msgs] == [b"m0"]
            await r.close()
            await c.close()

    arun(go())


def test_bad_ack_requests_get_a_status(tmp_path):
    async def go():
        async with running(tmp_path) as b:
            r = Rmq(b)
            assert (await r.ack([])).status.code == d.Code.BAD_REQUEST
            assert (await r.ack(["x"] * 2000)).status.code == d.Code.BAD_REQUEST
            assert (await r.ack(["x"], group="bad group")).status.code == d.Code.ILLEGAL_CONSUMER_GROUP
            assert (await r.change("x", 5, group="")).status.code == d.Code.ILLEGAL_CONSUMER_GROUP
            assert (await r.forward("x", group="")).status.code == d.Code.ILLEGAL_CONSUMER_GROUP
            await r.close()

    arun(go())


def test_shutdown_answers_a_waiting_receive(tmp_path):
    async def go():
        r = None
        async with running(tmp_path) as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": T, "queues": 1})
            await c.close()
            r = Rmq(b)
            waiting = asyncio.ensure_future(r.receive(poll=20, timeout=25))
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
        try:
            st, msgs, _ = await asyncio.wait_for(waiting, 10)
            assert st.code == d.Code.MESSAGE_NOT_FOUND
        except grpc.aio.AioRpcError as exc:  # the server went away first: the call ends, it does not hang
            assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert time.monotonic() - t0 < 10
        await r.close()

    arun(go())


def test_a_cancelled_long_poll_leaves_no_waiter_behind(tmp_path):
    async def go():
        async with running(tmp_path) as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": T, "queues": 4})
            r = Rmq(b)
            for _ in range(20):
                task = asyncio.ensure_future(r.receive(poll=10))
                await asyncio.sleep(0.05)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            for _ in range(100):
                if not b.core.polls.waiting() and not any(sub.waiters for sub in r.pop.subs.values()):
                    break
                await asyncio.sleep(0.02)
            assert not b.core.polls.waiting()
            assert not any(sub.waiters for sub in r.pop.subs.values())
            # and the group still receives
            await native_send(c, 1)
            st, msgs, _ = await r.receive()
            assert [m.body for m in msgs] == [b"m0"]
            await r.close()
            await c.close()

    arun(go())


def test_after_a_restart_unacknowledged_messages_come_again_and_old_handles_are_refused(tmp_path):
    async def go():
        async with running(tmp_path) as b:
            c = await RawClient.open(b.address)
            await native_send(c, 3)
            r = Rmq(b)
            _, msgs, _ = await r.receive(invisible=3600)
            assert (await r.ack(handles(msgs[:1]))).status.code == d.Code.OK
            old = handles(msgs[1:2])
            await r.close()
            await c.close()
        async with running(tmp_path) as b:
            r = Rmq(b)
            assert (await r.ack(old)).status.code == d.Code.INVALID_RECEIPT_HANDLE
            st, msgs, _ = await r.receive()
            assert [(m.body, m.system_properties.delivery_attempt) for m in msgs] == [(b"m1", 1), (b"m2", 1)]
            assert (await r.ack(handles(msgs))).status.code == d.Code.OK
            assert b.core.offsets.get(G, T, 0) == 3
            await r.close()

    arun(go())


class _Context:
    """What ReceiveFrontend.receive reads of a gRPC servicer context."""

    def invocation_metadata(self):
        return META

    def time_remaining(self):
        return 10.0


def test_messages_a_receive_stream_ended_before_sending_are_ready_again_at_once(tmp_path):
    async def go():
        async with running(tmp_path) as b:
            c = await RawClient.open(b.address)
            await native_send(c, 3)
            r = Rmq(b)
            fe = next(f for f in b.broker.frontends if hasattr(f, "service")).service.receive
            req = s.ReceiveMessageRequest(batch_size=8, auto_renew=True)
            req.group.name, req.message_queue.topic.name, req.message_queue.id = G, T, -1
            req.filter_expression.type, req.filter_expression.expression = d.TAG, "*"
            req.invisible_duration.FromSeconds(30)
            req.long_polling_timeout.FromSeconds(0)
            stream = fe.receive(req, _Context())
            assert (await stream.__anext__()).status.code == d.Code.OK
            first = (await stream.__anext__()).message
            await stream.aclose()  # the client went away: the other two were never written
            st, msgs, _ = await r.receive(invisible=30)
            assert st.code == d.Code.OK and [m.body for m in msgs] == [b"m1", b"m2"], [m.body for m in msgs]
            assert [m.system_properties.delivery_attempt for m in msgs] == [1, 1]  # never seen: not an attempt
            assert first.body == b"m0" and r.pop.counters["released"] == 2
            await r.close()
            await c.close()

    arun(go())


def test_a_message_whose_born_time_no_protobuf_timestamp_holds_is_delivered_with_it_clamped(tmp_path):
    async def go():
        async with running(tmp_path) as b:
            c = await RawClient.open(b.address)
            await c.ok("send", {"topic": T, "body": b"micros", "queue_id": 0, "born_ts": int(time.time() * 1e6)})
            r = Rmq(b)
            st, msgs, _ = await r.receive()
            assert st.code == d.Code.OK and [m.body for m in msgs] == [b"micros"]
            assert msgs[0].system_properties.born_timestamp.ToDatetime().year == 9999
            await r.close()
            await c.close()

    arun(go())
