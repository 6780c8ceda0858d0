"""Bad input on the wire: every bad frame gets an error; other connections carry on."""

from __future__ import annotations

import asyncio
import struct

import msgpack
import pytest

from conftest import arun
from txmq import wire
from txmq.broker.testing import running_broker
from txmq.wire import ErrorCode
from wireclient import RawClient


def frame(obj) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(payload)) + payload


async def reply_then_close(c: RawClient) -> wire.Frame:
    f = await c.read_frame()
    assert f is not None and f.kind == wire.REPLY
    assert await c.read_frame() is None  # connection closed by the broker
    return f


BAD_FATAL = [
    (b"\x00\x00\x00\x05garba", ErrorCode.MALFORMED_FRAME),
    (b"\x00\x00\x00\x01\xc1", ErrorCode.MALFORMED_FRAME),  # 0xc1 is never valid msgpack
    (frame({"not": "an array"}), ErrorCode.MALFORMED_FRAME),
    (frame([0, 1, "send"]), ErrorCode.MALFORMED_FRAME),
    (frame([9, 1, "send", {}]), ErrorCode.MALFORMED_FRAME),
    (frame([0, -1, "send", {}]), ErrorCode.MALFORMED_FRAME),
    (frame([0, 1, 42, {}]), ErrorCode.MALFORMED_FRAME),
    (frame([0, 1, "send", [1, 2]]), ErrorCode.MALFORMED_FRAME),
    (b"\xff\xff\xff\xff", ErrorCode.FRAME_TOO_LARGE),
    # a few MB of one-byte empty maps would decode to hundreds of MB of Python objects
    (frame([0, 1, "commit_offset", {"group": "g", "topic": "t", "queue_id": 0, "offset": 1, "x": [[{}] * 100_000] * 30}]),
     ErrorCode.MALFORMED_FRAME),
    (frame([0, 1, "commit_offset", {"x": [0] * 200_000}]), ErrorCode.MALFORMED_FRAME),  # one array too long
]


@pytest.mark.parametrize("data,code", BAD_FATAL)
def test_malformed_frame_gets_error_and_close_without_disturbing_others(tmp_path, data, code):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            good = await RawClient.open(b.address)
            await good.ok("send", {"topic": "t", "body": b"before"})
            bad = await RawClient.open(b.address)
            bad.send_raw(data)
            f = await reply_then_close(bad)
            assert f.op == code and f.fields["error"]
            r = await good.ok("send", {"topic": "t", "body": b"after"})
            assert r["topic"] == "t"
            await good.close()

    arun(go())


NON_FATAL = [
    ("nope", {}, ErrorCode.UNKNOWN_OPERATION),
    ("send", {"topic": 5, "body": b"x"}, ErrorCode.INVALID_TOPIC),
    ("send", {"topic": "bad topic!", "body": b"x"}, ErrorCode.INVALID_TOPIC),
    ("send", {"topic": "nl\n", "body": b"x"}, ErrorCode.INVALID_TOPIC),
    ("send", {"topic": "t", "body": 12}, ErrorCode.INVALID_FIELD),
    ("send", {"topic": "t", "body": b"x", "properties": {"a": 1}}, ErrorCode.INVALID_FIELD),
    ("send", {"topic": "t", "body": b"x", "queue_id": 99}, ErrorCode.NO_SUCH_QUEUE),
    ("send", {"topic": "t", "body": b"x", "queue_id": "0"}, ErrorCode.INVALID_FIELD),
    ("send", {"topic": "t", "body": b"x", "properties": {"TRAN_MSG": "true"}}, ErrorCode.INVALID_FIELD),
    ("send_batch", {"topic": "t", "messages": []}, ErrorCode.INVALID_FIELD),
    ("send_batch", {"topic": "t", "messages": [{"body": b"x", "properties": {"TRAN_MSG": "true", "PGROUP": "g"}}]}, ErrorCode.INVALID_FIELD),
    ("pull", {"topic": "t", "queue_id": -1, "offset": 0}, ErrorCode.INVALID_FIELD),
    ("pull", {"topic": "t", "queue_id": 0}, ErrorCode.INVALID_FIELD),
    ("end_transaction", {"group": "g"}, ErrorCode.INVALID_FIELD),
    ("commit_offset", {"group": "g", "topic": "t", "queue_id": 0, "offset": -5}, ErrorCode.INVALID_FIELD),
    ("tx_resolve", {"action": "commit", "refs": [{}]}, ErrorCode.INVALID_FIELD),
    ("config_set", {"key": "max_checks", "value": "x"}, ErrorCode.INVALID_CONFIG),
]


@pytest.mark.parametrize("op,fields,code", NON_FATAL)
def test_bad_fields_get_error_reply_and_connection_stays(tmp_path, op, fields, code):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            got, f = await c.req(op, fields)
            assert got == code, f
            assert f["name"] == ErrorCode(code).name and f["retriable"] is False
            assert (await c.ok("heartbeat"))["time_ms"] > 0  # same connection still works
            await c.close()

    arun(go())


def test_body_too_large(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d", max_body=1024) as b:
            c = await RawClient.open(b.address)
            code, f = await c.req("send", {"topic": "t", "body": b"x" * 1025})
            assert code == ErrorCode.BODY_TOO_LARGE
            await c.close()

    arun(go())


def test_pipelined_requests_are_matched_by_id(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            n = 500
            c.send_raw(b"".join(wire.request(i + 1, "send", {"topic": "p", "body": str(i).encode(), "queue_id": 0}) for i in range(n)))
            got = {}
            while len(got) < n:
                f = await c.read_frame()
                got[f.id] = f.fields
            offsets = [got[i + 1]["queue_offset"] for i in range(n)]
            assert offsets == list(range(n))  # written in arrival order
            await c.close()

    arun(go())


def test_auth_token_required(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d", auth_token="s3cret") as b:
            c = await RawClient.open(b.address)
            c.send_raw(wire.request(1, "send", {"topic": "t", "body": b"x"}))
            f = await reply_then_close(c)
            assert f.op == ErrorCode.AUTH_REQUIRED
            c = await RawClient.open(b.address)
            c.send_raw(wire.request(1, "hello", {"token": "wrong"}))
            f = await reply_then_close(c)
            assert f.op == ErrorCode.AUTH_FAILED
            c = await RawClient.open(b.address)
            await c.ok("hello", {"token": "s3cret"})
            await c.ok("send", {"topic": "t", "body": b"x"})
            info = await c.ok("broker_info")
            assert info["auth"] is True
            assert (await c.ok("list_topics"))["topics"][0]["messages"] == 1  # only the authenticated send landed
            await c.close()

    arun(go())


def test_long_poll_wakes_on_new_message(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": "lp", "queues": 1})
            p = await RawClient.open(b.address)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            poll = asyncio.create_task(p.req("pull", {"topic": "lp", "queue_id": 0, "offset": 0, "wait_ms": 60_000}))
            await asyncio.sleep(0.1)
            await c.ok("send", {"topic": "lp", "body": b"wake"})
            code, r = await poll
            assert code == 0 and r["status"] == "found" and r["messages"][0]["body"] == b"wake"
            assert loop.time() - t0 < 30  # woken by the send, not answered at the 60 s deadline
            await c.close()
            await p.close()

    arun(go())


def test_long_poll_is_woken_by_a_send_written_with_check_copies(tmp_path):
    """A send appended in the same batch as a check copy (a RawCopy, which has no .topic) still wakes its long poll."""
    from txmq.store import Message, TxType

    class Dropping:
        conn_id = -1

        takes_frames = True

        def writable(self):
            return True

        def send_frame(self, frame):
            pass

    async def go():
        async with running_broker(tmp_path / "d") as b:
            core = b.core
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": "lp", "queues": 1})
            half = await core.tx.send_half("t", None, b"x", {"PGROUP": "g"}, 1)
            core.registry.register("g", Dropping())
            poll = asyncio.create_task(c.req("pull", {"topic": "lp", "queue_id": 0, "offset": 0, "wait_ms": 60_000}))
            await asyncio.sleep(0.1)
            t0 = asyncio.get_running_loop().time()
            check = asyncio.ensure_future(core.check.check_now(half["tx_id"]))
            await asyncio.sleep(0)  # check_now has submitted its copy; the batch is not written yet
            sent = core.appender.submit([Message("lp", 0, TxType.NORMAL, 1, {}, b"hello")])
            await check
            await sent
            code, r = await poll
            assert code == 0 and r["status"] == "found" and [m["body"] for m in r["messages"]] == [b"hello"]
            assert asyncio.get_running_loop().time() - t0 < 30  # woken, not answered at the 60 s deadline
            await c.close()

    arun(go())


def test_long_poll_is_not_woken_by_other_queues(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": "lp", "queues": 1})
            p = await RawClient.open(b.address)
            woken = []
            get = b.core.store.get_messages  # count the poll's store reads

            def spy(topic, *a, **k):
                if topic == "lp":
                    woken.append(topic)
                return get(topic, *a, **k)

            b.core.store.get_messages = spy
            poll = asyncio.create_task(p.req("pull", {"topic": "lp", "queue_id": 0, "offset": 0, "wait_ms": 400}))
            await asyncio.sleep(0.05)
            for _ in range(20):
                await c.ok("send", {"topic": "other", "body": b"x"})
            code, r = await poll
            assert code == 0 and r["status"] == "no_message"
            assert len(woken) <= 2  # the first read and the one at the deadline: sends elsewhere wake nothing
            await c.close()
            await p.close()

    arun(go())


def test_a_reply_no_frame_can_carry_is_answered_with_an_internal_error_and_the_connection_goes_on(tmp_path, monkeypatch):
    from txmq.broker.native import operations

    async def later(core, conn, f):
        return {"n": 2 ** 70}

    monkeypatch.setitem(operations.HANDLERS, "heartbeat", lambda core, conn, f: {"n": 2 ** 70})  # answered at once
    monkeypatch.setitem(operations.HANDLERS, "list_topics", later)  # answered by a task

    async def go() -> None:
        async with running_broker(tmp_path / "data") as b:
            c = await RawClient.open(b.address)
            for op in ("heartbeat", "list_topics"):
                code, fields = await c.req(op, {})
                assert code == ErrorCode.INTERNAL, (op, code, fields)
            assert "max_offset" in await c.ok("broker_info", {})
            await c.close()

    arun(go())


def test_long_polls_that_time_out_leave_no_waiter_behind(tmp_path):
    async def go() -> None:
        async with running_broker(tmp_path / "data") as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": "idle", "queues": 1})
            for _ in range(50):
                r = await c.ok("pull", {"topic": "idle", "queue_id": 0, "offset": 0, "wait_ms": 2})
                assert r["status"] == "no_message"
            assert b.core.polls.waiting() == 0
            await c.close()

    arun(go())


def test_hellos_register_a_bounded_number_of_groups_per_connection(tmp_path):
    from txmq.broker.registry import MAX_GROUPS_PER_CONN

    async def go() -> None:
        async with running_broker(tmp_path / "data") as b:
            c = await RawClient.open(b.address)
            code, _ = await c.req("hello", {"producer_groups": ["g" * 256]})
            assert code == ErrorCode.INVALID_FIELD
            n = 0
            while True:
                code, e = await c.req("hello", {"producer_groups": [f"p{n + i}" for i in range(64)]})
                if code:
                    break
                n += 64
            assert code == ErrorCode.INVALID_FIELD and "at most" in e["error"], e
            assert n == MAX_GROUPS_PER_CONN and len(b.core.registry.groups()) == MAX_GROUPS_PER_CONN
            other = await RawClient.open(b.address)
            await other.ok("hello", {"producer_groups": ["p0", "mine"]})  # another connection is not held back
            await c.close()
            for _ in range(100):
                if len(b.core.registry.groups()) == 2:
                    break
                await asyncio.sleep(0.02)
            assert b.core.registry.groups() == {"p0": 1, "mine": 1}
            await other.close()

    arun(go())


def test_offsets_of_queues_that_do_not_exist_are_refused(tmp_path):
    async def go() -> None:
        async with running_broker(tmp_path / "data") as b:
            c = await RawClient.open(b.address)
            await c.ok("create_topic", {"topic": "two", "queues": 2})
            for topic, q in (("no-such-topic", 0), ("two", 2), ("two", 1023)):
                code, _ = await c.req("commit_offset", {"group": "g", "topic": topic, "queue_id": q, "offset": 1})
                assert code == ErrorCode.NO_SUCH_QUEUE, (topic, q, code)
            await c.ok("commit_offset", {"group": "g", "topic": "two", "queue_id": 1, "offset": 1})
            assert [r["queue_id"] for r in (await c.ok("describe_group", {"group": "g"}))["queues"]] == [0, 1]
            await c.close()

    arun(go())


def test_a_long_frame_of_legitimate_size_still_decodes(tmp_path):
    async def go():
        async with running_broker(tmp_path / "d") as b:
            c = await RawClient.open(b.address)
            refs = [{"tx_id": f"missing-{i}"} for i in range(100_000)]  # the most tx_resolve takes: ~400,000 values
            r = await c.ok("tx_resolve", {"action": "rollback", "refs": refs, "dry_run": True})
            assert len(r["results"]) == 100_000
            await c.close()

    arun(go())
