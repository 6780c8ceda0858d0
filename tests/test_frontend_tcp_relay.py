"""TCP byte streams relayed between a front-end worker and the broker process (broker/workers/relay.py).

The owner's side (pool.py: ``TcpService``, ``RelayedTransport``) is driven
by a scripted worker over the pool's Unix socket, as in
test_frontend_relay.py; the worker's side (worker.py: ``TcpRelay``,
``Worker._tcp_frame``, ``Worker.on_pressure``) by fake client transports
inside a running loop. No gRPC, no broker, no process.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, Callable

import msgpack
import pytest

from txmq.broker.workers.pool import TcpService, WorkerPool
from txmq.broker.workers.relay import (ABORT, ACCEPTED, BYTES, CALL, CLOSED, HELLO, HOLD, LIMITS, READ, RESET, SEND,
                                       SHUT, SHUT_WRITE, WRITTEN, FrameProtocol)
from txmq.broker.workers.worker import TcpRelay, Worker

from test_frontend_relay import Script, _close, _Spawned

pytestmark = pytest.mark.timeout(30)


# ---- the owner's side ----------------------------------------------------------------------------------


class Recorder(asyncio.Protocol):
    """A front end's protocol object: what its transport tells it, in order."""

    def __init__(self, on_data: Callable[[Recorder, bytes], None] | None = None,
                 on_lost: Callable[[Recorder], None] | None = None) -> None:
        self.transport: Any = None
        self.events: list[tuple] = []
        self.on_data = on_data
        self.on_lost = on_lost

    @property
    def data(self) -> list[bytes]:
        return [e[1] for e in self.events if e[0] == "data"]

    @property
    def lost(self) -> list[BaseException | None]:
        return [e[1] for e in self.events if e[0] == "lost"]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.events.append(("made",))

    def data_received(self, data: bytes) -> None:
        self.events.append(("data", data))
        if self.on_data is not None:
            self.on_data(self, data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.events.append(("lost", exc))
        if self.on_lost is not None:
            self.on_lost(self)

    def pause_writing(self) -> None:
        self.events.append(("pause_writing",))

    def resume_writing(self) -> None:
        self.events.append(("resume_writing",))


def _factory(made: list[Recorder], **kw: Any) -> Callable[[], Recorder]:
    def make() -> Recorder:
        made.append(Recorder(**kw))
        return made[-1]

    return make


async def _tcp_pool(*factories: Callable[[], asyncio.Protocol]) -> tuple[WorkerPool, Script]:
    """A pool that serves TCP ports only (no gRPC service), and its worker, greeted."""
    pool = WorkerPool(1, data_dir=None)  # type: ignore[arg-type]
    for i, factory in enumerate(factories):
        pool.serve_tcp(TcpService("remoting" if i == 0 else f"remoting-{i}", "127.0.0.1", 0, factory))
    await pool.bind()
    pool.slots[0].process = _Spawned()  # type: ignore[assignment]
    reader, writer = await asyncio.open_unix_connection(pool.socket_path)
    script = Script(reader, writer)
    script.send([HELLO, 0, os.getpid(), pool.token])
    await _until(lambda: pool.slots[0].link is not None, "the hello")
    return pool, script


async def _until(cond: Callable[[], Any], what: str, timeout: float = 20.0) -> None:
    """Wait until cond() holds; timeout is an upper bound for a loaded machine, never a margin."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


PEER, LOCAL = ["10.1.2.3", 50000], ["127.0.0.1", 10911]


def test_an_accepted_connection_gets_one_protocol_whose_transport_names_the_relayed_addresses_and_its_bytes_in_order():
    async def go():
        made: list[Recorder] = []
        pool, w = await _tcp_pool(_factory(made))
        w.send([ACCEPTED, 1, 0, PEER, LOCAL], [BYTES, 1, b"ab"], [BYTES, 1, b"cd"], [BYTES, 1, b"ef"])
        await _until(lambda: made and len(made[0].data) == 3, "the bytes")
        link = pool.slots[0].link
        await _close(pool, w)
        return made, link

    made, link = asyncio.run(go())
    assert len(made) == 1
    p = made[0]
    assert p.events[0] == ("made",) and p.data == [b"ab", b"cd", b"ef"]
    assert p.transport.get_extra_info("peername") == ("10.1.2.3", 50000)
    assert p.transport.get_extra_info("sockname") == ("127.0.0.1", 10911)
    assert p.transport.get_protocol() is p and p.transport.can_write_eof()


def test_what_the_protocol_asks_of_its_transport_goes_to_the_worker_as_frames_once_per_change():
    async def go():
        made: list[Recorder] = []
        pool, w = await _tcp_pool(_factory(made))
        w.send([ACCEPTED, 1, 0, PEER, LOCAL], [ACCEPTED, 2, 0, PEER, LOCAL])
        await _until(lambda: len(made) == 2, "two connections")
        t, other = made[0].transport, made[1].transport
        t.write(b"a")
        t.write(bytearray(b"b"))
        t.write(b"")  # nothing to send: no frame
        t.writelines([b"c", memoryview(b"d"), b"e"])
        t.pause_reading()
        t.pause_reading()
        reading_when_held = t.is_reading()
        t.resume_reading()
        t.resume_reading()
        t.pause_reading()
        t.write_eof()
        t.write_eof()  # once
        with pytest.raises(RuntimeError):  # as asyncio's transports refuse it
            t.write(b"after eof")
        with pytest.raises(ValueError):  # limits asyncio would refuse raise in the protocol, and reach no worker
            t.set_write_buffer_limits(high=16, low=65536)
        t.set_write_buffer_limits(high=65536, low=16384)
        t.close()
        closing = t.is_closing()
        t.close()
        t.resume_reading()
        t.write_eof()
        other.write(b"late")  # after close: nothing more reaches the client
        other.close()
        other.write(b"later")
        w.send([ACCEPTED, 3, 0, PEER, LOCAL])
        await _until(lambda: len(made) == 3, "a third connection")
        made[2].transport.write(b"sentinel")
        frames = await w.until([SEND, 3, b"sentinel"])
        await _close(pool, w)
        return frames, reading_when_held, closing, t.is_reading()

    frames, reading_when_held, closing, reading_after_close = asyncio.run(go())
    assert frames == [[SEND, 1, b"a"], [SEND, 1, b"b"], [SEND, 1, b"c"], [SEND, 1, b"d"], [SEND, 1, b"e"], [HOLD, 1], [READ, 1], [HOLD, 1], [SHUT_WRITE, 1],
                      [LIMITS, 1, 65536, 16384], [SHUT, 1], [SEND, 2, b"late"], [SHUT, 2], [SEND, 3, b"sentinel"]]
    assert not reading_when_held and closing and not reading_after_close


def test_bytes_after_close_are_not_delivered_and_closed_ends_the_connection_once():
    async def go():
        made: list[Recorder] = []
        pool, w = await _tcp_pool(_factory(made))
        w.send([ACCEPTED, 1, 0, PEER, LOCAL], [ACCEPTED, 2, 0, PEER, LOCAL], [BYTES, 1, b"before"])
        await _until(lambda: len(made) == 2 and made[0].data, "the first bytes")
        made[0].transport.close()
        w.send([BYTES, 1, b"after"], [BYTES, 2, b"mark"])  # the worker had read these before it saw SHUT
        await _until(lambda: made[1].data, "the mark")
        w.send([CLOSED, 1, None], [CLOSED, 1, None], [BYTES, 1, b"gone"], [WRITTEN, 1, 5], [BYTES, 2, b"mark2"])
        await _until(lambda: len(made[1].data) == 2, "the second mark")
        link = pool.slots[0].link
        conns = set(link.conns)
        await _close(pool, w)
        return made, conns

    made, conns = asyncio.run(go())
    assert made[0].events == [("made",), ("data", b"before"), ("lost", None)]
    assert conns == {2}


def test_a_protocol_that_closes_in_data_received_gets_no_more_bytes_from_the_same_read():
    def quit_on(r: Recorder, data: bytes) -> None:
        if data == b"quit":
            r.transport.close()

    async def go():
        made: list[Recorder] = []
        pool, w = await _tcp_pool(_factory(made, on_data=quit_on))
        w.send([ACCEPTED, 1, 0, PEER, LOCAL], [BYTES, 1, b"quit"], [BYTES, 1, b"more"], [CLOSED, 1, None])
        shut = await w.next()
        await _until(lambda: made and made[0].lost, "the end")
        await _close(pool, w)
        return shut, made[0].events

    shut, events = asyncio.run(go())
    assert shut == [SHUT, 1]
    assert events == [("made",), ("data", b"quit"), ("lost", None)]


def test_closed_with_a_reason_is_a_connection_reset_that_carries_it():
    async def go():
        made: list[Recorder] = []
        pool, w = await _tcp_pool(_factory(made))
        w.send([ACCEPTED, 1, 0, PEER, LOCAL], [CLOSED, 1, "[Errno 104] Connection reset by peer"])
        await _until(lambda: made and made[0].lost, "the end")
        await _close(pool, w)
        return made[0]

    p = asyncio.run(go())
    assert len(p.lost) == 1
    exc = p.lost[0]
    assert isinstance(exc, ConnectionResetError) and "Connection reset by peer" in str(exc)
    assert p.transport.is_closing()
    p.transport.write(b"x")  # after the end: a no-op, not an error


def test_writes_past_the_high_mark_pause_the_protocol_at_once_and_the_workers_acknowledgements_resume_it():
    """What the owner sent and the worker has not acknowledged is the transport's write buffer: a client that never reads
    (or a stalled worker) stops its protocol at the high mark, inside write, as an asyncio transport would."""

    async def go():
        made: list[Recorder] = []
        pool, w = await _tcp_pool(_factory(made))
        w.send([ACCEPTED, 1, 0, PEER, LOCAL])
        await _until(lambda: made, "the connection")
        p, t = made[0], made[0].transport
        t.set_write_buffer_limits(high=100, low=40)
        t.write(b"x" * 60)
        after_60 = list(p.events), t.get_write_buffer_size()
        t.writelines([b"y" * 30, b"z" * 30])  # 120 > 100: paused inside the call, before it returns
        after_120 = list(p.events), t.get_write_buffer_size()
        w.send([WRITTEN, 1, 60], [WRITTEN, 77, 500], [BYTES, 1, b"mark"])  # 60 left: over the low mark, still paused
        await _until(lambda: p.data, "the mark")
        still = list(p.events)
        w.send([WRITTEN, 1, 20], [BYTES, 1, b"mark2"])  # 40: resumed
        await _until(lambda: len(p.data) == 2, "the second mark")
        frames = await w.until([SEND, 1, b"z" * 30])
        await _close(pool, w)
        return after_60, after_120, still, p.events, t.get_write_buffer_size(), frames

    after_60, after_120, still, events, left, frames = asyncio.run(go())
    assert after_60 == ([("made",)], 60)
    assert after_120 == ([("made",), ("pause_writing",)], 120)
    assert still == [("made",), ("pause_writing",), ("data", b"mark")]  # an acknowledgement for an id not open is dropped
    assert events[3:5] == [("resume_writing",), ("data", b"mark2")] and left == 40
    assert [SEND, 1, b"y" * 30] in frames  # writelines: each buffer its own frame, none joined


def test_a_worker_acknowledges_what_the_clients_socket_took_once_per_turn_and_nothing_while_it_is_full():
    async def go():
        w, sent = _worker()
        a, t = _connect(w)
        sent.clear()
        w._tcp_frame(SEND, [SEND, a.conn, b"abc"])
        w._tcp_frame(SEND, [SEND, a.conn, b"de"])
        await asyncio.sleep(0)
        one_turn = list(sent)
        sent.clear()
        a.pause_writing()  # the client does not read: its socket buffer is over the limit
        w._tcp_frame(SEND, [SEND, a.conn, b"fgh"])
        await asyncio.sleep(0)
        while_full = list(sent)
        a.resume_writing()
        await asyncio.sleep(0)
        return one_turn, while_full, list(sent)

    one_turn, while_full, drained = asyncio.run(go())
    assert one_turn == [[WRITTEN, 1, 5]]
    assert while_full == []
    assert drained == [[WRITTEN, 1, 3]]


def test_the_workers_channel_closing_ends_every_open_connection_once_with_a_connection_reset():
    async def go():
        made: list[Recorder] = []

        def boom(r: Recorder) -> None:
            raise RuntimeError("a defect in one protocol's connection_lost")

        factories = iter([_factory(made), _factory(made), _factory(made, on_lost=boom), _factory(made)])
        pool, w = await _tcp_pool(lambda: next(factories)())
        w.send([ACCEPTED, 1, 0, PEER, LOCAL], [ACCEPTED, 2, 0, PEER, LOCAL], [ACCEPTED, 3, 0, PEER, LOCAL],
               [ACCEPTED, 4, 0, PEER, LOCAL], [CLOSED, 1, None])
        await _until(lambda: len(made) == 4 and made[0].lost, "four connections, the first ended")
        made[1].transport.close()  # closed here, its CLOSED not yet come: it ends with the channel too
        link = pool.slots[0].link
        w.writer.close()  # the worker dies
        await _until(lambda: link.lost, "the channel's end")
        await pool.stop()
        await pool.close()
        return made, link

    made, link = asyncio.run(go())
    assert made[0].lost == [None]
    for p in made[1:]:
        assert len(p.lost) == 1 and isinstance(p.lost[0], ConnectionResetError), p.events
    assert not link.conns


def test_a_bad_accepted_is_reset_and_makes_no_protocol():
    async def go():
        made: list[Recorder] = []
        pool, w = await _tcp_pool(_factory(made))
        w.send([ACCEPTED, 1, 0, PEER, LOCAL], [ACCEPTED, 2, 1, PEER, LOCAL], [ACCEPTED, 3, -1, PEER, LOCAL],
               [ACCEPTED, 1, 0, PEER, LOCAL], [ACCEPTED, "4", 0, PEER, LOCAL], [ACCEPTED, 5, True, PEER, LOCAL], [BYTES, 1, b"still"])
        frames = [await w.next() for _ in range(5)]
        await _until(lambda: made and made[0].data, "the first connection's bytes")
        made[0].transport.write(b"mark")
        frames.append(await w.next())
        conns, events = set(pool.slots[0].link.conns), list(made[0].events)
        await _close(pool, w)
        return made, frames, conns, events

    made, frames, conns, events = asyncio.run(go())
    assert frames == [[RESET, 2], [RESET, 3], [RESET, 1], [RESET, "4"], [RESET, 5], [SEND, 1, b"mark"]]
    # the open connection 1 a second ACCEPTED named is left as it was
    assert len(made) == 1 and events == [("made",), ("data", b"still")] and conns == {1}


def test_a_protocol_that_raises_ends_only_its_own_connection():
    def explode(r: Recorder, data: bytes) -> None:
        if data == b"boom":
            raise ValueError("a defect in one protocol's data_received")

    async def go():
        made: list[Recorder] = []
        pool, w = await _tcp_pool(_factory(made, on_data=explode))
        w.send(*([ACCEPTED, c, 0, PEER, LOCAL] for c in (1, 2, 3)), [BYTES, 2, b"boom"], [BYTES, 2, b"after"], [BYTES, 1, b"one"],
               [BYTES, 3, b"three"])
        reset = await w.next()
        await _until(lambda: len(made) == 3 and made[0].data and made[2].data, "the others' bytes")
        w.send([CLOSED, 2, None], [BYTES, 1, b"more"])  # the worker's answer to the RESET
        await _until(lambda: len(made[0].data) == 2, "more bytes")
        made[2].transport.write(b"alive")
        after = await w.next()
        link = pool.slots[0].link
        state = set(link.conns), link.lost
        await _close(pool, w)
        return made, reset, after, state

    made, reset, after, (conns, lost) = asyncio.run(go())
    assert reset == [RESET, 2] and after == [SEND, 3, b"alive"]
    assert made[1].events[:2] == [("made",), ("data", b"boom")] and len(made[1].events) == 3
    assert made[1].events[2][0] == "lost" and isinstance(made[1].events[2][1], ValueError)  # as asyncio ends it: with the error
    assert made[1].transport.is_closing()
    assert made[0].data == [b"one", b"more"] and made[2].data == [b"three"]
    assert conns == {1, 3} and not lost


def test_a_pool_serving_only_tcp_ports_tells_its_workers_so_and_refuses_a_relayed_rpc():
    async def go():
        made: list[Recorder] = []
        pool, w = await _tcp_pool(_factory(made), _factory(made))
        spec = json.loads(pool._command(0)[-1])
        w.send([CALL, 9, "apache.rocketmq.v2.MessagingService/SendMessage", [], "", None, b""], [ACCEPTED, 1, 1, PEER, LOCAL])
        refused = await w.next()
        await _until(lambda: made, "the connection on the second port")
        await _close(pool, w)
        return spec, refused, made

    spec, refused, made = asyncio.run(go())
    assert spec["grpc"] is None
    assert spec["tcp"] == [{"name": "remoting", "host": "127.0.0.1", "port": 0}, {"name": "remoting-1", "host": "127.0.0.1", "port": 0}]
    assert refused[:3] == [ABORT, 9, 12]  # UNIMPLEMENTED
    assert len(made) == 1


# ---- the worker's side ---------------------------------------------------------------------------------


class FakeTransport:
    """A client's socket in the worker: records what the relay does with it."""

    def __init__(self, peer: Any = ("10.0.0.7", 40001), local: Any = ("127.0.0.1", 10911)) -> None:
        self.calls: list[Any] = []
        self.closing = False
        self.extra = {"peername": peer, "sockname": local}

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.extra.get(name, default)

    def is_closing(self) -> bool:
        return self.closing

    def can_write_eof(self) -> bool:
        return True

    def pause_reading(self) -> None:
        self.calls.append("pause_reading")

    def resume_reading(self) -> None:
        self.calls.append("resume_reading")

    def write(self, data: bytes) -> None:
        self.calls.append(("write", data))

    def write_eof(self) -> None:
        self.calls.append("write_eof")

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.calls.append(("limits", high, low))

    def close(self) -> None:
        self.closing = True
        self.calls.append("close")

    def abort(self) -> None:
        self.closing = True
        self.calls.append("abort")


def _worker() -> tuple[Worker, list[list]]:
    """A worker with no channel: what it would send is recorded. Call inside a running loop."""
    w = Worker({"index": 0}, "tok")
    sent: list[list] = []
    w.send = sent.append  # type: ignore[method-assign]
    return w, sent


def _connect(w: Worker, listener: int = 0, **kw: Any) -> tuple[TcpRelay, FakeTransport]:
    relay, t = TcpRelay(w, listener), FakeTransport(**kw)
    relay.connection_made(t)
    return relay, t


def test_a_client_connection_is_announced_with_its_addresses_and_its_bytes_and_its_end_are_relayed():
    async def go():
        w, sent = _worker()
        a, _ = _connect(w, 1)
        b, _ = _connect(w, 0, peer=("::1", 40002, 0, 0), local=("::1", 10911, 0, 0))
        a.data_received(b"hello")
        a.data_received(b"again")
        a.connection_lost(None)
        a.connection_lost(None)  # once only
        a.data_received(b"late")  # ended: nothing relayed
        b.connection_lost(ConnectionResetError("[Errno 104] Connection reset by peer"))
        return sent, w.conns

    sent, conns = asyncio.run(go())
    assert sent == [[ACCEPTED, 1, 1, ["10.0.0.7", 40001], ["127.0.0.1", 10911]], [ACCEPTED, 2, 0, ["::1", 40002], ["::1", 10911]],
                    [BYTES, 1, b"hello"], [BYTES, 1, b"again"], [CLOSED, 1, None],
                    [CLOSED, 2, "[Errno 104] Connection reset by peer"]]
    assert not conns


def test_the_brokers_frames_act_on_the_clients_socket():
    async def go():
        w, _ = _worker()
        a, ta = _connect(w)
        b, tb = _connect(w)
        for f in ([SEND, 1, b"x"], [LIMITS, 1, 65536, 16384], [SHUT_WRITE, 1], [HOLD, 1], [HOLD, 1], [READ, 1], [READ, 1],
                  [SHUT, 1], [RESET, 2]):
            w.on_frame(f)
        return ta.calls, tb.calls

    a, b = asyncio.run(go())
    assert a == [("write", b"x"), ("limits", 65536, 16384), "write_eof", "pause_reading", "resume_reading", "close"]
    assert b == ["abort"]


def test_a_full_channel_stops_reading_every_connection_and_its_drain_resumes_only_those_the_broker_does_not_hold():
    async def go():
        w, _ = _worker()
        (a, ta), (b, tb), (c, tc) = _connect(w), _connect(w), _connect(w)
        w.on_frame([HOLD, 2])  # the broker holds b
        w.on_pressure(True)
        w.on_pressure(True)
        paused = (a.paused, b.paused, c.paused)
        w.on_pressure(False)
        return paused, (a.paused, b.paused, c.paused), ta.calls, tb.calls, tc.calls

    paused, after, a, b, c = asyncio.run(go())
    assert paused == (True, True, True) and after == (False, True, False)
    assert a == c == ["pause_reading", "resume_reading"]
    assert b == ["pause_reading"]  # paused once, and left paused: the broker held it


def test_a_held_connection_stays_paused_through_the_pressure_and_reads_again_once_both_are_over():
    async def go():
        w, _ = _worker()
        a, t = _connect(w)
        w.on_pressure(True)
        w.on_frame([HOLD, 1])
        w.on_pressure(False)
        held = a.paused
        w.on_pressure(True)
        w.on_frame([READ, 1])  # the broker reads again, the channel is still full
        still = a.paused
        w.on_pressure(False)
        return held, still, a.paused, t.calls

    held, still, end, calls = asyncio.run(go())
    assert held and still and not end
    assert calls == ["pause_reading", "resume_reading"]


def test_a_connection_made_while_the_channel_is_full_starts_paused():
    async def go():
        w, sent = _worker()
        w.on_pressure(True)
        a, t = _connect(w)
        w.on_pressure(False)
        return sent, t.calls

    sent, calls = asyncio.run(go())
    assert sent[0][0] == ACCEPTED
    assert calls == ["pause_reading", "resume_reading"]


def test_a_frame_for_an_unknown_or_ended_connection_is_ignored():
    async def go():
        w, sent = _worker()
        a, t = _connect(w)
        a.connection_lost(None)
        for conn in (1, 99):
            for f in ([SEND, conn, b"x"], [SHUT, conn], [SHUT_WRITE, conn], [RESET, conn], [HOLD, conn], [READ, conn],
                      [LIMITS, conn, 1, 0]):
                w.on_frame(f)
        return sent, t.calls

    sent, calls = asyncio.run(go())
    assert calls == [] and [f[0] for f in sent] == [ACCEPTED, CLOSED]


def test_a_connection_made_while_the_worker_drains_is_aborted_and_never_announced():
    async def go():
        w, sent = _worker()
        w.draining = True
        a, t = _connect(w)
        a.data_received(b"x")
        a.connection_lost(None)
        return sent, t.calls, w.conns

    sent, calls, conns = asyncio.run(go())
    assert sent == [] and calls == ["abort"] and not conns


def test_the_worker_losing_its_channel_aborts_every_client_connection():
    async def go():
        w, _ = _worker()
        (_, ta), (_, tb) = _connect(w), _connect(w)
        w.on_lost(ConnectionResetError("the broker is gone"))
        return ta.calls, tb.calls, w.done.is_set()

    a, b, done = asyncio.run(go())
    assert a == b == ["abort"] and done


async def _real_connection(w: Worker) -> tuple[asyncio.AbstractServer, asyncio.StreamWriter]:
    """A client connected over loopback to a TcpRelay of ``w``, on asyncio's own transport."""
    server = await asyncio.get_running_loop().create_server(lambda: TcpRelay(w, 0), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    await _until(lambda: w.conns, "the accepted connection")
    return server, writer


def _channel(w: Worker) -> tuple[FrameProtocol, FakeTransport]:
    """The worker's channel protocol on a fake socket: frames are fed to it as the broker's bytes."""
    proto = FrameProtocol(w.on_frame, w.on_lost, w.on_pressure)
    channel = FakeTransport()
    proto.connection_made(channel)  # type: ignore[arg-type]
    w.protocol = proto
    return proto, channel


def test_write_buffer_limits_a_socket_refuses_end_that_connection_not_the_workers_channel():
    async def go():
        w, _ = _worker()
        server, client = await _real_connection(w)
        proto, channel = _channel(w)
        proto.data_received(msgpack.packb([LIMITS, 1, 16, 65536], use_bin_type=True))
        result = channel.calls, w.done.is_set()
        client.close()
        server.close()
        return result

    calls, done = asyncio.run(go())
    assert "abort" not in calls and not done


def test_a_send_after_shut_write_does_not_end_the_workers_channel():
    async def go():
        w, _ = _worker()
        server, client = await _real_connection(w)
        proto, channel = _channel(w)
        frames = b"".join(msgpack.packb(f, use_bin_type=True) for f in ([SHUT_WRITE, 1], [SEND, 1, b"late"]))
        try:
            proto.data_received(frames)
            raised = None
        except Exception as exc:  # on a real channel the loop's transport takes this as fatal: the channel closes
            raised = exc
        client.close()
        server.close()
        return raised, channel.calls

    raised, calls = asyncio.run(go())
    assert raised is None and "abort" not in calls


def test_busy_polling_is_armed_for_a_lone_relayed_connection_only():
    async def go():
        w, sent = _worker()
        armed: list[int] = []
        w.arm = lambda: armed.append(len(w.conns))  # type: ignore[method-assign]
        a, _ = _connect(w)
        a.data_received(b"request")
        w._tcp_frame(SEND, [SEND, a.conn, b"answer"])
        lone = len(armed)
        b, _ = _connect(w)
        a.data_received(b"request")
        w._tcp_frame(SEND, [SEND, b.conn, b"answer"])
        return lone, armed

    lone, armed = asyncio.run(go())
    assert lone == 2 and armed == [1, 1]  # the request and the answer of the lone client; nothing once there are two


def test_a_port_held_for_the_workers_lets_in_their_listeners_and_refuses_any_other_even_with_so_reuseaddr():
    import socket

    from txmq.broker.ports import hold_port

    held = hold_port(socket.AF_INET, ("127.0.0.1", 0), OSError)
    port = held.getsockname()[1]
    try:
        other = socket.socket()
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a second broker's listener binds
        with other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
            other.listen(1)
        worker = socket.socket()
        worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        with worker:
            worker.bind(("127.0.0.1", port))
            worker.listen(1)
    finally:
        held.close()
