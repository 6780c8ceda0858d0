"""The owning process's side of the front-end workers' channel (broker/workers/pool.py), against a scripted worker.

A test here is the worker: it connects to the pool's Unix socket and writes
relay frames (broker/workers/relay.py) as a worker process would; the
pool answers them with fake handlers. No gRPC, no broker, no process.
"""

from __future__ import annotations

import asyncio
import os
import stat

import msgpack
import pytest

from txmq.broker.workers.pool import BIDI, SERVER_STREAM, UNARY, GrpcService, Handler, WorkerPool
from txmq.broker.workers.relay import ABORT, CALL, CANCEL, DATA, END, HALF_CLOSE, HELLO, OPEN, REPLY, WRITE, WROTE, unpacker

pytestmark = pytest.mark.timeout(30)


class Script:
    """A fake worker's end of the channel: frames out, frames in (in order)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.unpacker = unpacker()
        self.got: list[list] = []

    def send(self, *frames: list) -> None:
        self.writer.write(b"".join(msgpack.packb(f, use_bin_type=True) for f in frames))

    async def next(self, timeout: float = 5.0) -> list:
        while not self.got:
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
            if not data:
                raise EOFError("the pool closed the channel")
            self.unpacker.feed(data)
            self.got.extend(self.unpacker)
        return self.got.pop(0)

    async def until(self, last: list) -> list[list]:
        """Every frame up to and including ``last``."""
        frames = []
        while True:
            frames.append(await self.next())
            if frames[-1] == last:
                return frames


def _identity(b: bytes) -> bytes:
    return b


class _Spawned:
    """What the pool takes for its worker's process: this process's pid, running (the hello must name it); the
    pool's stop() kills it as it would a worker that outlived its drain."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.returncode: int | None = None

    def send_signal(self, sig: int) -> None:
        self.returncode = -sig

    async def wait(self) -> int | None:
        return self.returncode


async def _pool(handlers: dict[str, Handler], hello: bool = True):
    pool = WorkerPool(1, data_dir=None)  # type: ignore[arg-type]
    pool.serve_grpc(GrpcService("test.Service", handlers, "127.0.0.1", 0, []))
    await pool.bind()
    pool.slots[0].process = _Spawned()  # type: ignore[assignment]
    reader, writer = await asyncio.open_unix_connection(pool.socket_path)
    script = Script(reader, writer)
    if hello:
        script.send([HELLO, 0, os.getpid(), pool.token])
    return pool, script


async def _close(pool: WorkerPool, script: Script) -> None:
    script.writer.close()
    pool.slots[0].process = None
    await pool.stop()
    await pool.close()


def test_unary_calls_are_answered_with_the_handlers_reply_and_see_the_relayed_headers_peer_and_deadline():
    seen = {}

    async def echo(request: bytes, ctx) -> bytes:
        seen[request] = (list(ctx.invocation_metadata()), ctx.peer(), ctx.time_remaining())
        return request[::-1]

    async def go():
        pool, w = await _pool({"Echo": Handler(UNARY, echo, _identity)})
        w.send([CALL, 1, "Echo", [["x-mq-client-id", "c1"]], "ipv4:127.0.0.1:5000", 9.5, b"abc"],
               [CALL, 2, "Echo", [], "", None, b"xyz"])
        replies = {tuple(await w.next()) for _ in range(2)}
        assert replies == {(REPLY, 1, b"cba"), (REPLY, 2, b"zyx")}
        assert pool.slots[0].link is next(iter(pool.links))  # the hello made this channel the slot's
        await _close(pool, w)
        return seen

    seen = asyncio.run(go())
    md, peer, left = seen[b"abc"]
    assert md == [["x-mq-client-id", "c1"]] and peer == "ipv4:127.0.0.1:5000" and 0 < left <= 9.5
    assert seen[b"xyz"] == ([], "", None)  # no deadline relayed: none


def test_a_server_stream_sends_each_response_then_its_end_and_an_unknown_method_is_unimplemented():
    async def items(request: bytes, ctx):
        for i in range(3):
            yield request + str(i).encode()

    async def go():
        pool, w = await _pool({"Items": Handler(SERVER_STREAM, items, _identity)})
        w.send([CALL, 7, "Items", [], "", None, b"m"], [CALL, 8, "Nope", [], "", None, b""])
        frames = [await w.next(), await w.next()]
        with pytest.raises(asyncio.TimeoutError):  # the next response waits until the worker handed this one to gRPC
            await w.next(timeout=0.3)
        for _ in range(2):
            w.send([WROTE, 7, True])
            frames.append(await w.next())
        frames.append(await w.next())  # the end follows the last response at once: nothing is left to hold back
        await _close(pool, w)
        return frames

    frames = asyncio.run(go())
    assert [f for f in frames if f[1] == 7] == [[WRITE, 7, b"m0"], [WRITE, 7, b"m1"], [WRITE, 7, b"m2"], [END, 7]]
    assert [f[:3] for f in frames if f[1] == 8] == [[ABORT, 8, 12]]  # UNIMPLEMENTED


def test_a_server_stream_whose_client_went_away_stops_and_runs_its_cleanup():
    closed = {}

    async def items(request: bytes, ctx):
        try:
            for i in range(100):
                yield str(i).encode()
        finally:
            closed["at"] = i

    async def go():
        pool, w = await _pool({"Items": Handler(SERVER_STREAM, items, _identity)})
        w.send([CALL, 1, "Items", [], "", None, b""])
        assert await w.next() == [WRITE, 1, b"0"]
        w.send([WROTE, 1, True])
        assert await w.next() == [WRITE, 1, b"1"]
        w.send([WROTE, 1, False])  # gRPC could not take it: the client is gone
        for _ in range(100):
            await asyncio.sleep(0.01)
            if "at" in closed:
                break
        await _close(pool, w)

    asyncio.run(go())
    assert closed["at"] == 2  # it stopped one response past the one gRPC refused: the one taken to see whether it went on


def test_an_abort_ends_the_call_with_its_code_and_a_handler_error_is_an_internal_error_not_a_dead_channel():
    async def refuse(request: bytes, ctx):
        await ctx.abort(8, "too much")  # RESOURCE_EXHAUSTED

    async def boom(request: bytes, ctx):
        raise RuntimeError("defect")

    async def echo(request: bytes, ctx):
        return request

    async def go():
        pool, w = await _pool({"Refuse": Handler(UNARY, refuse, _identity), "Boom": Handler(UNARY, boom, _identity),
                               "Echo": Handler(UNARY, echo, _identity)})
        w.send([CALL, 1, "Refuse", [], "", None, b""])
        a = await w.next()
        w.send([CALL, 2, "Boom", [], "", None, b""])
        b = await w.next()
        w.send([CALL, 3, "Echo", [], "", None, b"still here"])
        c = await w.next()
        await _close(pool, w)
        return a, b, c

    a, b, c = asyncio.run(go())
    assert a == [ABORT, 1, 8, "too much"]
    assert b[:3] == [ABORT, 2, 13] and "defect" in b[3]
    assert c == [REPLY, 3, b"still here"]


def test_a_stream_write_after_its_abort_raises_at_once_instead_of_waiting_for_the_worker():
    outcome = {}

    async def abort_then_write(requests, ctx):
        try:
            await ctx.abort(8, "done")
        except Exception:  # a handler that swallows gRPC's abort and writes on
            pass
        try:
            await asyncio.wait_for(ctx.write(b"late"), 5)
            outcome["write"] = "written"
        except asyncio.TimeoutError:
            outcome["write"] = "hung"
        except ConnectionError:
            outcome["write"] = "refused"

    async def go():
        pool, w = await _pool({"Chat": Handler(BIDI, abort_then_write, _identity)})
        w.send([OPEN, 1, "Chat", [], "", None])
        first = await w.next()
        await _close(pool, w)
        return first

    first = asyncio.run(go())
    assert first == [ABORT, 1, 8, "done"]
    assert outcome["write"] == "refused"


def test_a_cancel_from_the_worker_cancels_the_handler_and_a_lost_channel_cancels_every_open_call():
    events = {"cancelled": 0}

    async def hang(request: bytes, ctx):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            events["cancelled"] += 1
            raise

    async def go():
        pool, w = await _pool({"Hang": Handler(UNARY, hang, _identity)})
        w.send([CALL, 1, "Hang", [], "", None, b""], [CALL, 2, "Hang", [], "", None, b""], [CALL, 3, "Hang", [], "", None, b""])
        for _ in range(50):
            await asyncio.sleep(0.01)
            link = next(iter(pool.links), None)
            if link is not None and len(link.calls) == 3:
                break
        w.send([CANCEL, 1])
        for _ in range(50):
            await asyncio.sleep(0.01)
            if events["cancelled"] == 1:
                break
        assert events["cancelled"] == 1 and set(link.calls) == {2, 3}
        w.writer.close()  # the worker dies
        for _ in range(100):
            await asyncio.sleep(0.01)
            if events["cancelled"] == 3:
                break
        assert events["cancelled"] == 3 and not link.calls and link.lost
        await pool.stop()
        await pool.close()

    asyncio.run(go())


def test_a_bidirectional_stream_reads_the_clients_messages_and_each_write_waits_for_the_worker_to_deliver_it():
    async def chat(requests, ctx):
        async for raw in requests:
            await ctx.write(raw.upper())
        await ctx.write(b"bye")

    async def go():
        pool, w = await _pool({"Chat": Handler(BIDI, chat, _identity)})
        w.send([OPEN, 5, "Chat", [], "p", None], [DATA, 5, b"hello"])
        first = await w.next()
        # no second write until the first is delivered: back pressure as gRPC's own context.write
        w.send([DATA, 5, b"again"])
        with pytest.raises(asyncio.TimeoutError):
            await w.next(timeout=0.3)
        w.send([WROTE, 5, True])
        second = await w.next()
        w.send([WROTE, 5, True], [HALF_CLOSE, 5])
        third = await w.next()
        w.send([WROTE, 5, True])
        end = await w.next()
        await _close(pool, w)
        return first, second, third, end

    assert asyncio.run(go()) == ([WRITE, 5, b"HELLO"], [WRITE, 5, b"AGAIN"], [WRITE, 5, b"bye"], [END, 5])


def test_a_write_the_worker_could_not_deliver_fails_in_the_handler():
    outcome = {}

    async def chat(requests, ctx):
        try:
            await ctx.write(b"x")
        except ConnectionError as exc:
            outcome["error"] = str(exc)

    async def go():
        pool, w = await _pool({"Chat": Handler(BIDI, chat, _identity)})
        w.send([OPEN, 1, "Chat", [], "", None])
        assert await w.next() == [WRITE, 1, b"x"]
        w.send([WROTE, 1, False])
        assert await w.next() == [END, 1]
        await _close(pool, w)

    asyncio.run(go())
    assert "gone" in outcome["error"]


def test_the_channel_lives_in_a_directory_only_its_user_enters_and_a_hello_with_a_wrong_token_is_shut_out():
    async def go():
        pool, w = await _pool({}, hello=False)
        mode = stat.S_IMODE(os.stat(os.path.dirname(pool.socket_path)).st_mode)
        w.send([HELLO, 0, os.getpid(), "not-the-token"])
        with pytest.raises(EOFError):
            await w.next(timeout=5)
        path = pool.socket_path
        await pool.stop()
        await pool.close()
        return mode, os.path.exists(path)

    mode, left = asyncio.run(go())
    assert mode == 0o700
    assert not left  # close() removes the directory


def test_a_stream_whose_client_writes_faster_than_the_broker_reads_is_ended_not_buffered_without_bound():
    from txmq.broker.workers.pool import MAX_STREAM_BACKLOG

    async def stuck(requests, ctx):
        await asyncio.sleep(3600)  # never reads

    async def go():
        pool, w = await _pool({"Chat": Handler(BIDI, stuck, _identity)})
        w.send([OPEN, 3, "Chat", [], "", None], *([DATA, 3, b"x"] for _ in range(MAX_STREAM_BACKLOG + 5)))
        f = await w.next()
        link = next(iter(pool.links))
        for _ in range(100):
            if not link.calls:
                break
            await asyncio.sleep(0.01)
        await _close(pool, w)
        return f, link

    f, link = asyncio.run(go())
    assert f[:3] == [ABORT, 3, 8] and str(MAX_STREAM_BACKLOG) in f[3]  # RESOURCE_EXHAUSTED
    assert not link.streams


def test_a_call_cancelled_in_the_same_read_as_it_came_leaves_nothing_open():
    ran = []

    async def hang(request, ctx):
        ran.append(request)
        await asyncio.sleep(3600)

    async def chat(requests, ctx):
        ran.append(b"chat")
        await asyncio.sleep(3600)

    async def go():
        pool, w = await _pool({"Hang": Handler(UNARY, hang, _identity), "Items": Handler(SERVER_STREAM, hang, _identity),
                               "Chat": Handler(BIDI, chat, _identity)})
        # one write, so one read: the call's task is cancelled before its first step
        w.send([CALL, 1, "Hang", [], "", None, b"u"], [CALL, 2, "Items", [], "", None, b"s"], [OPEN, 3, "Chat", [], "", None],
               [DATA, 3, b"x"], [CANCEL, 1], [CANCEL, 2], [CANCEL, 3])
        w.send([CALL, 4, "Hang", [], "", None, b"later"])  # a call that runs: the three before it were taken in
        for _ in range(500):
            if ran:
                break
            await asyncio.sleep(0.01)
        link = next(iter(pool.links))
        for _ in range(500):
            if set(link.calls) == {4}:
                break
            await asyncio.sleep(0.01)
        open_calls, streams = set(link.calls), set(link.streams)
        await _close(pool, w)
        return open_calls, streams

    open_calls, streams = asyncio.run(go())
    assert open_calls == {4} and not streams
    assert ran == [b"later"]


def test_a_stream_cancelled_by_its_client_finishes_its_cleanup_when_the_worker_dies_during_it():
    state = {"cleanup": "not started"}

    async def go():
        release = asyncio.Event()

        async def items(request: bytes, ctx):
            try:
                yield b"0"
                await asyncio.sleep(3600)  # a long poll
                yield b"1"
            finally:
                state["cleanup"] = "started"
                await release.wait()  # gives back what it did not send: the store is slow
                state["cleanup"] = "done"

        pool, w = await _pool({"Items": Handler(SERVER_STREAM, items, _identity)})
        w.send([CALL, 1, "Items", [], "", None, b""])
        assert await w.next() == [WRITE, 1, b"0"]
        w.send([CANCEL, 1])  # the client went away
        for _ in range(500):
            if state["cleanup"] == "started":
                break
            await asyncio.sleep(0.01)
        link = next(iter(pool.links))
        w.writer.close()  # then its worker dies
        for _ in range(500):
            if link.lost:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        release.set()
        for _ in range(500):
            if not link.calls:
                break
            await asyncio.sleep(0.01)
        await pool.stop()
        await pool.close()

    asyncio.run(go())
    assert state["cleanup"] == "done"  # one cancellation, as gRPC gives: the second did not break into the cleanup


def test_stop_kills_a_worker_spawned_while_the_others_drained(monkeypatch):
    import signal

    class FakeProcess:
        def __init__(self, pid: int, dies_on_kill: bool) -> None:
            self.pid, self.returncode, self.dies_on_kill = pid, None, dies_on_kill
            self.signals: list[int] = []
            self.exited = asyncio.Event()

        def send_signal(self, sig: int) -> None:
            self.signals.append(sig)
            if self.dies_on_kill:
                self.exit(-sig)

        def exit(self, rc: int) -> None:
            self.returncode = rc
            self.exited.set()

        async def wait(self) -> int:
            await self.exited.wait()
            return self.returncode

    async def go():
        slow, spawning, gate = FakeProcess(100, dies_on_kill=False), asyncio.Event(), asyncio.Event()
        late = FakeProcess(101, dies_on_kill=True)

        async def spawn(*argv, **kw):
            if '"index":0' in argv[-1]:
                return slow  # worker 0: up, and slow to go when told
            spawning.set()
            await gate.wait()  # worker 1: its spawn returns while the pool stops
            return late

        monkeypatch.setattr(asyncio, "create_subprocess_exec", spawn)
        pool = WorkerPool(2, data_dir=None)  # type: ignore[arg-type]
        pool.serve_grpc(GrpcService("test.Service", {}, "127.0.0.1", 0, []))
        await pool.bind()
        starting = asyncio.ensure_future(pool.start())
        await asyncio.wait_for(spawning.wait(), 5)
        stopping = asyncio.ensure_future(pool.stop())
        for _ in range(500):
            if slow.signals:
                break
            await asyncio.sleep(0.01)
        gate.set()  # worker 1's process exists now
        for _ in range(500):
            if pool.slots[1].process is late:
                break
            await asyncio.sleep(0.01)
        slow.exit(-signal.SIGKILL)
        await asyncio.wait_for(stopping, 10)
        starting.cancel()
        await pool.close()
        return late

    late = asyncio.run(go())
    assert late.returncode is not None, "a worker outlived the pool's stop"


def test_stop_alone_removes_the_channels_directory_as_a_failed_start_calls_only_stop():
    async def go():
        pool = WorkerPool(1, data_dir=None)  # type: ignore[arg-type]
        pool.serve_grpc(GrpcService("test.Service", {}, "127.0.0.1", 0, []))
        await pool.bind()
        where = os.path.dirname(pool.socket_path)
        await pool.stop()  # bind_frontends and the start-up's error paths stop the front ends, and do not close them
        return where

    assert not os.path.exists(asyncio.run(go()))


def test_nothing_is_served_before_a_hello_nor_after_one_the_pool_refused():
    async def echo(request: bytes, ctx) -> bytes:
        served.append(request)
        return request

    served: list[bytes] = []

    async def go():
        pool, w = await _pool({"Echo": Handler(UNARY, echo, _identity)}, hello=False)
        w.send([CALL, 1, "Echo", [], "", None, b"before"])
        with pytest.raises(EOFError):
            await w.next(timeout=5)
        reader, writer = await asyncio.open_unix_connection(pool.socket_path)
        w2 = Script(reader, writer)
        w2.send([HELLO, 0, os.getpid() + 1, pool.token], [CALL, 2, "Echo", [], "", None, b"stale pid"])  # not the spawn's pid
        with pytest.raises(EOFError):
            await w2.next(timeout=5)
        await _close(pool, w)
        w2.writer.close()

    asyncio.run(go())
    assert served == []


def test_a_start_removes_the_channel_directories_of_killed_brokers_and_keeps_a_live_ones(tmp_path, monkeypatch):
    import subprocess
    import tempfile

    from txmq.broker.workers.pool import DIR_PREFIX

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = tmp_path / f"{DIR_PREFIX}{dead.pid}-abc"  # a broker killed with SIGKILL left it
    left.mkdir()
    (left / "relay.sock").write_text("")
    live = tmp_path / f"{DIR_PREFIX}{os.getpid()}-xyz"  # a broker that runs
    live.mkdir()
    other = tmp_path / "txmq-workers-notapid"
    other.mkdir()

    async def go():
        pool, w = await _pool({})
        path = pool.socket_path
        await _close(pool, w)
        return path

    path = asyncio.run(go())
    assert path.startswith(str(tmp_path / f"{DIR_PREFIX}{os.getpid()}-"))
    assert not left.exists() and live.exists() and other.exists()


class _GrpcContext:
    """The few methods of grpc.aio's servicer context a worker's relayed handler uses; gRPC's end of the RPC by hand."""

    def __init__(self) -> None:
        self.done_callbacks: list = []

    def invocation_metadata(self):
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"

    def time_remaining(self):
        return None

    def add_done_callback(self, fn) -> None:
        self.done_callbacks.append(fn)

    def end(self) -> None:
        for fn in self.done_callbacks:
            fn(self)


def test_a_worker_tells_the_broker_once_when_grpc_ends_a_stream_whose_generator_is_held():
    """A client that cancels while gRPC holds a response back ends the RPC outside the handler's generator: the
    worker's CANCEL must not wait for the generator to be collected."""
    from txmq.broker.workers.worker import Worker

    async def go():
        w = Worker({"index": 0}, "tok")
        sent: list[list] = []
        w.send = sent.append  # type: ignore[method-assign]
        ctx = _GrpcContext()
        gen = w.server_stream("Receive")(b"req", ctx)
        first = asyncio.ensure_future(gen.__anext__())  # the CALL goes out; it waits for the broker's first WRITE
        await asyncio.sleep(0)
        call_id = sent[0][1]
        ctx.end()  # gRPC ends the RPC (the client cancelled); the generator is still held, suspended
        after_end = list(sent)
        first.cancel()
        try:
            await first
        except asyncio.CancelledError:
            pass
        await gen.aclose()
        return call_id, after_end, sent, w.calls

    call_id, after_end, sent, calls = asyncio.run(go())
    assert after_end[0][0] == CALL and after_end[1:] == [[CANCEL, call_id]]
    assert sent == after_end  # the generator's own end later sends no second CANCEL
    assert not calls
