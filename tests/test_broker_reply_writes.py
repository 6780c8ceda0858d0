"""When the broker writes replies: at once for a connection left with nothing in flight, else at the iteration's end.

No sockets: a `BrokerConnection` on a transport that records writes, with a
stand-in core whose one operation returns a future the test completes, as a
group-commit fsync completes the sends waiting for it.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from txmq import wire
from txmq.broker.config import BrokerConfig
from txmq.broker.native import operations
from txmq.broker.native.connection import BrokerConnection
from txmq.broker.native.server import ServerState


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.writes.append(bytes(data))

    def writelines(self, list_of_data) -> None:  # type: ignore[override]
        bufs = list(list_of_data)
        self.buffers = getattr(self, "buffers", []) + bufs
        self.writes.append(b"".join(bufs))

    def is_closing(self) -> bool:
        return False

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def reply_ids(self) -> list[int]:
        dec = wire.FrameDecoder()
        return [wire.parse_payload(p).id for chunk in self.writes for p in dec.feed(chunk)]


@pytest.fixture
def waiting_op(monkeypatch):
    """An operation `wait` whose reply comes when the test resolves the future it returns."""
    futures: list[asyncio.Future] = []

    def handler(core, conn, fields):
        fut = asyncio.get_running_loop().create_future()
        futures.append(fut)
        return fut

    monkeypatch.setitem(operations.HANDLERS, "wait", handler)
    return futures


def make_connection() -> tuple[BrokerConnection, RecordingTransport]:
    messaging = SimpleNamespace(
        config=BrokerConfig(), draining=False,
        metrics=SimpleNamespace(inc=lambda *a, **k: None), busy_poll_arm=None,
    )
    conn = BrokerConnection(SimpleNamespace(messaging=messaging, config=messaging.config), ServerState())
    t = RecordingTransport()
    conn.connection_made(t)
    return conn, t


def requests(*ids: int) -> bytes:
    return b"".join(wire.request(i, "wait", {}) for i in ids)


def test_a_connection_left_with_nothing_in_flight_gets_its_replies_at_once_in_one_write(waiting_op):
    async def main():
        conn, t = make_connection()
        conn.data_received(requests(1, 2))  # a pipelined end and the next half, in one read
        for fut in waiting_op:
            fut.set_result({})  # one fsync answers both
        await asyncio.sleep(0)  # the done callbacks ran; the iteration's deferred writes have not
        assert len(t.writes) == 1
        assert t.reply_ids() == [1, 2]

    asyncio.run(main())


def test_replies_of_a_connection_with_requests_still_in_flight_leave_together_at_the_iteration_end(waiting_op):
    async def main():
        conn, t = make_connection()
        conn.data_received(requests(1, 2, 3))
        waiting_op[0].set_result({})
        waiting_op[1].set_result({})
        await asyncio.sleep(0)
        assert t.writes == []  # request 3 is still in flight: wait for the iteration's other replies
        await asyncio.sleep(0)
        assert len(t.writes) == 1 and t.reply_ids() == [1, 2]
        waiting_op[2].set_result({})
        await asyncio.sleep(0)
        assert len(t.writes) == 2 and t.reply_ids() == [1, 2, 3]

    asyncio.run(main())


def test_a_raw_pulls_records_go_to_the_socket_as_they_are_in_a_frame_that_decodes_the_same(waiting_op):
    async def main():
        conn, t = make_connection()
        conn.data_received(requests(1, 2))
        records = bytes(range(256)) * 4096  # 1 MiB
        waiting_op[0].set_result({"status": "found", "records": records, "count": 7, "next_offset": 7})
        waiting_op[1].set_result({"ok": True})
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert any(b is records for b in t.buffers)  # the very object: not copied into the frame
        dec = wire.FrameDecoder()
        dec.max_frame = 4 << 20
        frames = [wire.parse_payload(p) for chunk in t.writes for p in dec.feed(chunk)]
        assert [f.id for f in frames] == [1, 2]
        assert frames[0].fields == {"status": "found", "records": records, "count": 7, "next_offset": 7}
        assert frames[1].fields == {"ok": True}

    asyncio.run(main())


@pytest.mark.parametrize("n", [0, 1, 255, 256, 65535, 65536, 1 << 20])
def test_reply_parts_are_the_reply_with_the_value_packed_last(n):
    fields = {"records": b"r" * n, "status": "found", "count": 1}
    head, blob = wire.reply_parts(9, fields, "records")
    assert blob is fields["records"]
    assert head + blob == wire.reply(9, {"status": "found", "count": 1, "records": b"r" * n})
