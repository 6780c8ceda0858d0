"""Client protocol tests on a fake transport: framing, pipelining, pushes, loss, timeouts.

No sockets: a `Connection` is wired to a transport that records writes, and
broker frames are fed to `data_received` by hand.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from txmq import wire
from txmq.client import (
    ConnectionLost,
    LocalTransactionState,
    Message,
    ReceivedMessage,
    parse_address,
)
from txmq.client.connection import Connection
from txmq.client.message import build_properties, schedule_properties
from txmq.constants import HALF_TOPIC
from txmq.wire import ErrorCode, TxmqError


class FakeTransport(asyncio.Transport):
    def __init__(self, conn: Connection) -> None:
        super().__init__()
        self.conn = conn
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.writes.append(bytes(data))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self.conn.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("10.0.0.1", 10911) if name == "peername" else default

    def sent_frames(self) -> list[wire.Frame]:
        dec = wire.FrameDecoder()
        return [wire.parse_payload(p) for chunk in self.writes for p in dec.feed(chunk)]


def make_conn(pushes: list | None = None) -> tuple[Connection, FakeTransport]:
    conn = Connection(push_handler=(lambda op, f: pushes.append((op, f))) if pushes is not None else None)
    t = FakeTransport(conn)
    conn.connection_made(t)
    return conn, t


async def next_iteration() -> None:
    await asyncio.sleep(0)
    await asyncio.sleep(0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


# ---- addresses -----------------------------------------------------------------

@pytest.mark.parametrize(
    "text,expected",
    [
        ("127.0.0.1:10911", ("127.0.0.1", 10911)),
        ("broker.example:9000", ("broker.example", 9000)),
        ("broker_1:1", ("broker_1", 1)),
        ("[::1]:10912", ("::1", 10912)),
        ("[fe80::1%eth0]:65535", ("fe80::1%eth0", 65535)),
    ],
)
def test_parse_address_accepts_host_port_forms(text, expected):
    assert parse_address(text) == expected


def test_a_bare_host_takes_the_default_port_unless_the_port_is_required():
    assert parse_address("localhost") == ("localhost", 10911)
    assert parse_address("[::1]") == ("::1", 10911)
    for text in ("localhost", "[::1]"):
        with pytest.raises(ValueError, match="bad broker address"):
            parse_address(text, default_port=None)


# The host is required, and an IPv6 address goes in brackets (the CLI's rules).
@pytest.mark.parametrize("text", ["host:port", "host:0", "host:70000", "host:+5", "host:1_0", "host:\u0661\u0662", "host:",
                                  ":1234", "", " host:1", "bad host:1", "-host:1",
                                  "[::1", "[::1]x", "::1", "::1:10911", "[nonsense]:1", "[127.0.0.1]:1", "[]:1", "[]"])
def test_parse_address_rejects_anything_else(text):
    with pytest.raises(ValueError, match="bad broker address"):
        parse_address(text)


# ---- framing and pipelining ----------------------------------------------------

def test_requests_in_one_iteration_leave_in_one_write():
    async def main():
        conn, t = make_conn()
        futs = [conn.send_request("send", {"topic": "t", "body": b"x%d" % i}) for i in range(100)]
        assert t.writes == []  # nothing until the loop turns
        await next_iteration()
        assert len(t.writes) == 1
        frames = t.sent_frames()
        assert [f.kind for f in frames] == [wire.REQUEST] * 100
        assert len({f.id for f in frames}) == 100
        assert frames[7].fields["body"] == b"x7"
        for f in frames:
            conn.data_received(wire.reply(f.id, {"n": f.fields["body"]}))
        assert [fut.result()["n"] for fut in futs] == [b"x%d" % i for i in range(100)]

    run(main())


def test_an_awaited_request_leaves_at_once_with_what_was_queued_before_it():
    async def main():
        conn, t = make_conn()
        ends = []

        async def producer():  # a pipelined end, then the next half, in one step of one task
            ends.append(conn.send_request("end_transaction", {"tx_id": "a"}))
            assert t.writes == []
            return await conn.request("send", {"topic": "t", "body": b"next"})

        half = asyncio.ensure_future(producer())
        await asyncio.sleep(0)  # the task ran up to its await; the iteration's deferred writes have not run
        assert len(t.writes) == 1
        assert [f.op for f in t.sent_frames()] == ["end_transaction", "send"]
        for f in t.sent_frames():
            conn.data_received(wire.reply(f.id, {}))
        await half
        assert ends[0].result() == {}

    run(main())


def test_many_requests_awaited_in_one_iteration_cost_two_writes():
    async def main():
        conn, t = make_conn()
        tasks = [asyncio.ensure_future(conn.request("send", {"topic": "t", "body": b"x%d" % i})) for i in range(50)]
        await next_iteration()
        assert len(t.writes) == 2  # the first at once, the other 49 together at the iteration's end
        frames = t.sent_frames()
        assert [f.fields["body"] for f in frames] == [b"x%d" % i for i in range(50)]
        for f in frames:
            conn.data_received(wire.reply(f.id, {"n": f.fields["body"]}))
        assert [(await task)["n"] for task in tasks] == [b"x%d" % i for i in range(50)]
        # the next iteration's first awaited request leaves at once again
        nxt = asyncio.ensure_future(conn.request("send", {"topic": "t", "body": b"later"}))
        await asyncio.sleep(0)
        assert len(t.writes) == 3
        conn.data_received(wire.reply(t.sent_frames()[-1].id, {}))
        await nxt

    run(main())


def test_replies_out_of_order_and_split_anywhere_reach_their_requests():
    async def main():
        conn, t = make_conn()
        futs = [conn.send_request("pull", {"i": i}) for i in range(20)]
        await next_iteration()
        frames = t.sent_frames()
        stream = b"".join(wire.reply(f.id, {"i": f.fields["i"]}) for f in reversed(frames))
        for i in range(0, len(stream), 7):  # arbitrary TCP segmentation
            conn.data_received(stream[i : i + 7])
        assert [f.result()["i"] for f in futs] == list(range(20))

    run(main())


def test_error_reply_is_rebuilt_as_txmq_error():
    async def main():
        conn, t = make_conn()
        fut = conn.send_request("end_transaction", {})
        await next_iteration()
        (f,) = t.sent_frames()
        err = TxmqError("already rolled back", ErrorCode.TX_CONFLICT, outcome="rolled_back")
        conn.data_received(wire.reply(f.id, err.to_fields(), int(err.code)))
        with pytest.raises(TxmqError) as info:
            await fut
        assert info.value.code is ErrorCode.TX_CONFLICT
        assert not info.value.retriable
        assert info.value.fields == {"outcome": "rolled_back"}

    run(main())


def test_push_goes_to_handler_and_does_not_disturb_requests():
    async def main():
        pushes: list = []
        conn, t = make_conn(pushes)
        fut = conn.send_request("heartbeat", {})
        await next_iteration()
        (f,) = t.sent_frames()
        conn.data_received(wire.push("check_transaction", {"tx_id": "abc"}) + wire.reply(f.id, {"time_ms": 1}))
        assert pushes == [("check_transaction", {"tx_id": "abc"})]
        assert (await fut) == {"time_ms": 1}

    run(main())


def test_failing_push_handler_is_contained():
    async def main():
        def boom(op, fields):
            raise RuntimeError("bad handler")

        conn = Connection(push_handler=boom)
        t = FakeTransport(conn)
        conn.connection_made(t)
        fut = conn.send_request("heartbeat", {})
        await next_iteration()
        (f,) = t.sent_frames()
        conn.data_received(wire.push("check_transaction", {}) + wire.reply(f.id, {"ok": True}))
        assert (await fut) == {"ok": True}
        assert not conn.closed

    run(main())


def test_connection_loss_fails_every_request_in_flight_with_retriable_error():
    async def main():
        conn, t = make_conn()
        futs = [conn.send_request("send", {"i": i}) for i in range(5)]
        await next_iteration()
        conn.connection_lost(ConnectionResetError("reset by peer"))
        for fut in futs:
            with pytest.raises(ConnectionLost) as info:
                await fut
            assert info.value.retriable
            assert info.value.code is ErrorCode.SHUTTING_DOWN
            assert "reset by peer" in str(info.value)
        with pytest.raises(ConnectionLost):
            conn.send_request("send", {})
        assert conn.lost.done()

    run(main())


def test_timeout_fails_the_request_and_a_late_reply_is_ignored():
    async def main():
        conn, t = make_conn()
        fut = conn.send_request("pull", {}, timeout=0.01)
        other = conn.send_request("pull", {})
        await next_iteration()
        f1, f2 = t.sent_frames()
        with pytest.raises(TimeoutError):
            await fut
        conn.data_received(wire.reply(f1.id, {"late": True}) + wire.reply(f2.id, {"ok": True}))
        assert (await other) == {"ok": True}
        assert conn.in_flight == 0

    run(main())


def test_ids_wrap_and_skip_ids_still_in_flight():
    async def main():
        conn, t = make_conn()
        conn._next_id = 0xFFFFFFFE
        a = conn.send_request("x", {})  # 0xFFFFFFFF
        b = conn.send_request("x", {})  # wraps to 1
        conn._next_id = 0  # 1 is taken: next must be 2
        c = conn.send_request("x", {})
        await next_iteration()
        assert [f.id for f in t.sent_frames()] == [0xFFFFFFFF, 1, 2]
        for fut in (a, b, c):
            fut.cancel()

    run(main())


def test_garbage_from_the_broker_closes_the_connection():
    async def main():
        conn, t = make_conn()
        first = conn.send_request("x", {})
        fut = conn.send_request("x", {})
        await next_iteration()
        conn.data_received(wire.reply(t.sent_frames()[0].id, {}))  # it spoke txmq: what follows is a broker's bad data
        assert (await first) == {}
        conn.data_received(wire.HEADER.pack(3) + b"\xc1\xc1\xc1")
        with pytest.raises(ConnectionLost) as info:
            await fut
        assert "MALFORMED_FRAME" in str(info.value)
        assert t.closed

    run(main())


@pytest.mark.parametrize("first", [
    b"AMQP\x00\x00\x09\x01",  # a length far past any reply
    wire.HEADER.pack(2) + b"\x94\x01",  # a length shorter than any reply
    wire.HEADER.pack(6) + b"\x00\x04",  # no array of four
    wire.HEADER.pack(6) + b"\x94\x00\x01\xa1x\x80",  # a request, not a reply
    wire.HEADER.pack(6) + b"\x94\x01\xc1\xc1\xc1\xc1",  # a reply's start, then no msgpack
])
def test_a_first_reply_that_is_no_txmq_frame_is_not_a_txmq_broker(first):
    from txmq.client.connection import NotATxmqBroker

    async def main():
        conn, t = make_conn()
        fut = conn.send_request("hello", {})
        await next_iteration()
        for i in range(len(first)):  # byte by byte: decided as soon as the bytes tell
            conn.data_received(first[i:i + 1])
        with pytest.raises(NotATxmqBroker) as info:
            await fut
        assert not info.value.retriable and t.closed
        with pytest.raises(NotATxmqBroker):
            conn.send_request("x", {})

    run(main())


def test_connection_level_error_reply_is_reported_on_close():
    async def main():
        conn, t = make_conn()
        fut = conn.send_request("x", {})
        await next_iteration()
        err = TxmqError("not a frame", ErrorCode.MALFORMED_FRAME)
        conn.data_received(wire.reply(0, err.to_fields(), int(err.code)))
        t.close()
        with pytest.raises(ConnectionLost, match="MALFORMED_FRAME"):
            await fut

    run(main())


# ---- message mapping -------------------------------------------------------------

def _map(**over: Any) -> dict[str, Any]:
    m = {
        "topic": "orders", "queue_id": 2, "queue_offset": 5, "commit_log_offset": 900, "size": 120,
        "msg_id": "ID1", "born_ts": 1, "store_ts": 2, "tx_type": 0, "prepared_offset": -1,
        "properties": {"TAGS": "tagA", "KEYS": "k1 k2", "UNIQ_KEY": "ID1"}, "body": b"hi",
    }
    m.update(over)
    return m


def test_plain_message_map_has_no_tx_id():
    r = ReceivedMessage.from_map(_map())
    assert (r.topic, r.queue_id, r.queue_offset, r.commit_log_offset) == ("orders", 2, 5, 900)
    assert r.tags == "tagA" and r.keys == "k1 k2" and r.key_list == ["k1", "k2"]
    assert r.tx_id is None and r.msg_id == "ID1" and r.text == "hi"


def test_committed_message_map_carries_tx_id():
    r = ReceivedMessage.from_map(_map(tx_type=2, prepared_offset=100))
    assert r.tx_id == "ID1"
    props = {"UNIQ_KEY": "T9", "TRAN_PREPARED_QUEUE_OFFSET": "3"}
    assert ReceivedMessage.from_map(_map(properties=props)).tx_id == "T9"


def test_half_record_is_shown_under_its_real_topic():
    props = {"REAL_TOPIC": "orders", "REAL_QID": "3", "UNIQ_KEY": "T1", "TRAN_MSG": "true",
             "PGROUP": "g", "TRANSACTION_CHECK_TIMES": "4"}
    r = ReceivedMessage.from_map(_map(topic=HALF_TOPIC, queue_id=0, queue_offset=17, tx_type=1, properties=props))
    assert (r.topic, r.queue_id, r.stored_topic) == ("orders", 3, HALF_TOPIC)
    assert r.tx_id == "T1" and r.check_times == 4 and r.half_offset == 17


def test_message_fields_merge_tags_keys_and_properties():
    m = Message("t", "héllo", tags="a", keys=["k1", "k2"], properties={"x": "1"})
    f = m.send_fields({"TRAN_MSG": "true"})
    assert f["body"] == "héllo".encode()
    assert f["properties"] == {"x": "1", "TAGS": "a", "KEYS": "k1 k2", "TRAN_MSG": "true"}
    assert "properties" not in Message("t", b"x").send_fields()
    assert build_properties() is None


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("when", [
    {"delay": NAN}, {"delay": INF}, {"delay": -INF}, {"delay": -1}, {"delay": -0.0001}, {"delay": timedelta(seconds=-1)},
    {"delay": 1e300}, {"deliver_at": NAN}, {"deliver_at": INF}, {"deliver_at": -INF}, {"deliver_at": -5},
    {"deliver_at": 1e300}, {"deliver_at": 10**400}, {"deliver_at": datetime(1969, 12, 31, tzinfo=timezone.utc)},
    {"deliver_at": datetime(1, 1, 1)},
])
def test_nan_infinite_negative_or_out_of_range_delivery_times_are_a_value_error_when_the_message_is_made(when):
    with pytest.raises(ValueError, match="delay|deliver_at"):
        Message("t", b"x", **when)
    with pytest.raises(ValueError, match="delay|deliver_at"):  # Producer.send(..., delay=...) builds them here
        schedule_properties(**when)


def test_delivery_times_in_range_become_whole_millisecond_properties():
    assert Message("t", b"x", delay=0).send_fields()["properties"] == {"TIMER_DELAY_MS": "0"}
    assert Message("t", b"x", delay=timedelta(minutes=30)).send_fields()["properties"] == {"TIMER_DELAY_MS": "1800000"}
    assert schedule_properties(deliver_at=1_800_000_000.5) == {"TIMER_DELIVER_MS": "1800000000500"}
    end = datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=timezone.utc)
    assert schedule_properties(deliver_at=end) == {"TIMER_DELIVER_MS": "253402300799999"}
    with pytest.raises(TypeError):
        Message("t", b"x", delay="30s")


@pytest.mark.parametrize(
    "value,state",
    [
        (LocalTransactionState.COMMIT_MESSAGE, LocalTransactionState.COMMIT_MESSAGE),
        ("commit", LocalTransactionState.COMMIT_MESSAGE),
        ("ROLLBACK_MESSAGE", LocalTransactionState.ROLLBACK_MESSAGE),
        ("rollback", LocalTransactionState.ROLLBACK_MESSAGE),
        ("UNKNOW", LocalTransactionState.UNKNOW),
        (None, LocalTransactionState.UNKNOW),
        (42, LocalTransactionState.UNKNOW),
    ],
)
def test_listener_answers_are_coerced_to_states(value, state):
    assert LocalTransactionState.coerce(value) is state


def test_state_values_are_the_wire_states():
    assert [s.value for s in LocalTransactionState] == ["commit", "rollback", "unknown"]
