"""Client behaviour against a small in-memory broker speaking txmq.wire over real sockets.

The fake implements just enough of docs/protocol.md (hello, send, send_batch,
end_transaction, pull with long poll, offsets, topics) and can push
check-backs, refuse sends, drop every connection, or stop listening, so the
producer, transactional producer, consumer, reconnect logic and the sync
facade can be tested without the real broker.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from typing import Any

import pytest
import uvloop

from txmq import wire
from txmq.client import (
    Client,
    ClientClosed,
    Consumer,
    ConnectionLost,
    LocalTransactionState,
    Message,
    Producer,
    SendStatus,
    SyncConsumer,
    SyncProducer,
    SyncTransactionProducer,
    TransactionListener,
    TransactionProducer,
)
from txmq.constants import HALF_TOPIC
from txmq.wire import ErrorCode, TxmqError

C, R, U = LocalTransactionState.COMMIT_MESSAGE, LocalTransactionState.ROLLBACK_MESSAGE, LocalTransactionState.UNKNOW


class FakeConn(asyncio.Protocol):
    def __init__(self, broker: "FakeBroker") -> None:
        self.b = broker
        self.dec = wire.FrameDecoder()
        self.t: asyncio.Transport | None = None
        self.authed = broker.token is None
        self.groups: list[str] = []

    def connection_made(self, t):
        self.t = t
        self.b.conns.add(self)

    def connection_lost(self, exc):
        self.b.conns.discard(self)

    def data_received(self, data):
        frames = [wire.parse_payload(p) for p in self.dec.feed(data)]
        self.b.reads.append(len(frames))
        replies: list[bytes] = []
        for f in frames:
            self.b.log.append((f.op, f.fields))
            if f.op in self.b.garble_ops:
                replies.append(wire.HEADER.pack(1) + b"\xc1")  # not msgpack
                continue
            if not self.authed and f.op != "hello":
                self.fatal(f.id, ErrorCode.AUTH_REQUIRED)
                return
            try:
                out = getattr(self.b, "op_" + f.op)(self, f.fields)
            except TxmqError as e:
                replies.append(wire.reply(f.id, e.to_fields(), int(e.code)))
                if e.code in wire.FATAL:
                    self.t.write(b"".join(replies))
                    self.t.close()
                    return
                continue
            if asyncio.iscoroutine(out) or asyncio.isfuture(out):
                task = asyncio.ensure_future(out)
                self.b.tasks.add(task)
                task.add_done_callback(lambda fut, id_=f.id: self._later(id_, fut))
            else:
                replies.append(wire.reply(f.id, out))
        if self.b.reverse_replies:
            replies.reverse()
        if replies:
            self.t.write(b"".join(replies))

    def _later(self, id_, fut):
        self.b.tasks.discard(fut)
        if fut.cancelled() or self.t is None or self.t.is_closing():
            return
        e = fut.exception()
        if e is None:
            self.t.write(wire.reply(id_, fut.result()))
        else:
            self.t.write(wire.reply(id_, e.to_fields(), int(e.code)))

    def fatal(self, id_, code):
        self.t.write(wire.reply(id_, TxmqError("refused", code).to_fields(), int(code)))
        self.t.close()

    def push(self, op, fields):
        self.t.write(wire.push(op, fields))


class FakeBroker:
    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self.conns: set[FakeConn] = set()
        self.tasks: set[asyncio.Task] = set()
        self.log: list[tuple[str, dict]] = []
        self.reads: list[int] = []
        self.hellos: list[dict] = []
        self.reverse_replies = False
        self.garble_ops: set[str] = set()
        self.fail_sends: list[ErrorCode] = []
        self.hold_sends = False  # never answer sends (simulates a broker dying mid-request)
        self.after_hello: str | None = None  # "stop_reading" | "drop"
        self.topics: dict[str, list[list[dict]]] = {}
        self.offsets: dict[tuple[str, str], dict[int, int]] = defaultdict(dict)
        self.halves: dict[int, dict] = {}  # commit-log offset -> half message map
        self.outcomes: dict[str, str] = {}
        self.ends: list[dict] = []
        self.cl = 0
        self.changed = asyncio.Event()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> "FakeBroker":
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: FakeConn(self), "127.0.0.1", self.port, reuse_address=True)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self.server.close()
        for c in list(self.conns):
            c.t.close()
        for t in list(self.tasks):
            t.cancel()
        await self.server.wait_closed()

    def drop_connections(self) -> None:
        for c in list(self.conns):
            c.t.abort()

    # ---- storage --------------------------------------------------------
    def queues(self, topic: str, n: int = 4) -> list[list[dict]]:
        return self.topics.setdefault(topic, [[] for _ in range(n)])

    def append(self, topic: str, qid: int, body: bytes, props: dict, tx_type: int = 0, prepared: int = -1) -> dict:
        q = self.queues(topic)[qid]
        self.cl += 100
        m = {"topic": topic, "queue_id": qid, "queue_offset": len(q), "commit_log_offset": self.cl, "size": 100,
             "msg_id": props.get("UNIQ_KEY", f"M{self.cl}"), "born_ts": 1, "store_ts": 2, "tx_type": tx_type,
             "prepared_offset": prepared, "properties": props, "body": body}
        q.append(m)
        self.changed.set()
        self.changed = asyncio.Event()
        return m

    def _rr(self, topic: str, qid: int | None) -> int:
        n = len(self.queues(topic))
        return (self.cl // 100) % n if qid is None or qid < 0 else qid

    # ---- operations -----------------------------------------------------
    def op_hello(self, conn, f):
        if self.token is not None and f.get("token") != self.token:
            raise TxmqError("wrong token", ErrorCode.AUTH_FAILED)
        conn.authed = True
        conn.groups = list(f.get("producer_groups") or [])
        self.hellos.append(f)
        if self.after_hello == "stop_reading":  # a stopped broker: the connection stays, nothing is read
            conn.t.pause_reading()
        elif self.after_hello == "drop":  # a proxy that lets the hello through and drops the connection
            asyncio.get_running_loop().call_soon(conn.t.close)
        return {"version": "fake", "protocol": 1, "broker_id": "fake", "flush": "sync"}

    def op_heartbeat(self, conn, f):
        return {"time_ms": 1}

    def op_send(self, conn, f):
        if self.fail_sends:
            raise TxmqError("injected", self.fail_sends.pop(0))
        if self.hold_sends:
            return asyncio.get_running_loop().create_future()
        props = dict(f.get("properties") or {})
        topic = f["topic"]
        qid = self._rr(topic, f.get("queue_id"))
        if props.get("TRAN_MSG") == "true":
            tx_id = props.setdefault("UNIQ_KEY", f"TX{self.cl + 100}")
            props.update(REAL_TOPIC=topic, REAL_QID=str(qid))
            m = self.append(HALF_TOPIC, 0, f["body"], props, tx_type=1)
            self.halves[m["commit_log_offset"]] = m
            return {"msg_id": tx_id, "tx_id": tx_id, "topic": topic, "queue_id": qid,
                    "half_offset": m["queue_offset"], "commit_log_offset": m["commit_log_offset"]}
        m = self.append(topic, qid, f["body"], props)
        return {k: m[k] for k in ("msg_id", "topic", "queue_id", "queue_offset", "commit_log_offset")}

    def op_send_batch(self, conn, f):
        qid = self._rr(f["topic"], f.get("queue_id"))
        out = []
        for item in f["messages"]:
            m = self.append(f["topic"], qid, item["body"], dict(item.get("properties") or {}))
            out.append({k: m[k] for k in ("msg_id", "topic", "queue_id", "queue_offset", "commit_log_offset")})
        return {"results": out}

    def op_end_transaction(self, conn, f):
        self.ends.append(f)
        half = self.halves.get(f["commit_log_offset"])
        if half is None:
            raise TxmqError("no half", ErrorCode.TX_NOT_FOUND)
        props = half["properties"]
        if props["PGROUP"] != f["group"]:
            raise TxmqError("group", ErrorCode.TX_GROUP_MISMATCH)
        if half["queue_offset"] != f["half_offset"]:
            raise TxmqError("offset", ErrorCode.TX_OFFSET_MISMATCH)
        tx_id = props["UNIQ_KEY"]
        if f["state"] == "unknown":
            return {"status": "noop", "outcome": self.outcomes.get(tx_id, "pending")}
        want = "committed" if f["state"] == "commit" else "rolled_back"
        if tx_id in self.outcomes:
            if self.outcomes[tx_id] != want:
                raise TxmqError("conflict", ErrorCode.TX_CONFLICT)
            return {"status": "already", "outcome": want}
        self.outcomes[tx_id] = want
        if want == "committed":
            p = {k: v for k, v in props.items() if k not in ("TRAN_MSG", "REAL_TOPIC", "REAL_QID")}
            p["TRAN_PREPARED_QUEUE_OFFSET"] = str(half["queue_offset"])
            self.append(props["REAL_TOPIC"], int(props["REAL_QID"]), half["body"], p, 2, half["commit_log_offset"])
        return {"status": "ok", "outcome": want}

    async def op_pull(self, conn, f):
        topic, qid, offset = f["topic"], f["queue_id"], f["offset"]
        deadline = time.monotonic() + f.get("wait_ms", 0) / 1000
        while True:
            if topic not in self.topics or qid >= len(self.topics[topic]):
                return {"status": "no_queue", "messages": [], "next_offset": offset, "min_offset": 0, "max_offset": 0}
            q = self.topics[topic][qid]
            if offset > len(q):
                return {"status": "offset_overflow", "messages": [], "next_offset": len(q), "min_offset": 0, "max_offset": len(q)}
            msgs = q[offset : offset + f.get("max_count", 32)]
            if msgs or time.monotonic() >= deadline:
                break
            try:
                await asyncio.wait_for(self.changed.wait(), deadline - time.monotonic())
            except TimeoutError:
                pass
        return {"status": "found" if msgs else "no_message", "messages": msgs, "next_offset": offset + len(msgs),
                "min_offset": 0, "max_offset": len(q)}

    def op_commit_offset(self, conn, f):
        self.offsets[(f["group"], f["topic"])][f["queue_id"]] = f["offset"]
        return {}

    def op_fetch_offsets(self, conn, f):
        # str keys: txmq.wire decodes with strict_map_key, so int keys would not survive
        return {"offsets": {str(q): o for q, o in self.offsets[(f["group"], f["topic"])].items()}}

    def op_list_topics(self, conn, f):
        return {"topics": [{"topic": t, "queues": len(qs), "messages": sum(map(len, qs)), "system": t == HALF_TOPIC}
                           for t, qs in self.topics.items() if f.get("system") or t != HALF_TOPIC]}

    def op_create_topic(self, conn, f):
        created = f["topic"] not in self.topics
        return {"topic": f["topic"], "queues": len(self.queues(f["topic"], f.get("queues", 4))), "created": created}

    def push_check(self, tx_id: str, group: str = "g") -> None:
        half = next(m for m in self.halves.values() if m["properties"]["UNIQ_KEY"] == tx_id)
        conn = next(c for c in self.conns if group in c.groups)
        half["properties"]["TRANSACTION_CHECK_TIMES"] = str(int(half["properties"].get("TRANSACTION_CHECK_TIMES", "0")) + 1)
        conn.push("check_transaction", {"group": group, "tx_id": tx_id, "commit_log_offset": half["commit_log_offset"],
                                        "half_offset": half["queue_offset"], "message": half})


def run(coro, timeout: float = 15):
    """Run on uvloop (what the broker and the sync facade use); the protocol tests cover plain asyncio."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(asyncio.wait_for(coro, timeout))


async def wait_until(pred, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


class Listener(TransactionListener):
    """Records every call; answers from `states` (by body) and `checks`."""

    def __init__(self, answer: Any = C, check: Any = C) -> None:
        self.answer = answer
        self.check = check
        self.executed: list[tuple[Any, Any]] = []
        self.checked: list[Any] = []
        self.check_threads: set[str] = set()

    def execute_local_transaction(self, message, arg):
        self.executed.append((message, arg))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def check_local_transaction(self, message):
        self.checked.append(message)
        self.check_threads.add(threading.current_thread().name)
        if isinstance(self.check, Exception):
            raise self.check
        return self.check


# ---- session ---------------------------------------------------------------------

def test_hello_goes_first_with_token_and_groups():
    async def main():
        b = await FakeBroker(token="s3cret").start()
        async with Client(b.address, token="s3cret", producer_groups=["g1"], consumer_groups=["c1"]) as c:
            assert c.hello["protocol"] == 1
            assert (await c.request("heartbeat")) == {"time_ms": 1}
        assert b.log[0][0] == "hello"
        assert b.log[0][1]["token"] == "s3cret"
        assert b.log[0][1]["producer_groups"] == ["g1"] and b.log[0][1]["consumer_groups"] == ["c1"]
        await b.stop()

    run(main())


def test_wrong_token_is_refused_and_not_retried():
    async def main():
        b = await FakeBroker(token="s3cret").start()
        with pytest.raises(TxmqError) as info:
            await Client(b.address, token="nope").start()
        assert info.value.code is ErrorCode.AUTH_FAILED
        await b.stop()

    run(main())


def test_unreachable_broker_is_a_connection_error():
    async def main():
        b = await FakeBroker().start()
        addr = b.address
        await b.stop()
        with pytest.raises(ConnectionLost, match="cannot connect"):
            await Client(addr, connect_timeout=1).start()

    run(main())


def test_closed_client_refuses_requests():
    async def main():
        b = await FakeBroker().start()
        c = await Client(b.address).start()
        await c.close()
        with pytest.raises(ClientClosed) as info:
            await c.request("heartbeat")
        assert not info.value.retriable
        await b.stop()

    run(main())


# ---- producer --------------------------------------------------------------------

def test_producer_send_and_batch():
    async def main():
        b = await FakeBroker().start()
        async with Producer(b.address) as p:
            r = await p.send("orders", "hello", tags="t", keys=["a", "b"], properties={"x": "1"}, queue_id=2)
            assert (r.topic, r.queue_id, r.queue_offset) == ("orders", 2, 0)
            sent = b.log[-1][1]
            assert sent["body"] == b"hello" and sent["queue_id"] == 2
            assert sent["properties"] == {"x": "1", "TAGS": "t", "KEYS": "a b"}
            rs = await p.send_batch("orders", [b"a", "b", Message("orders", b"c", tags="z")], queue_id=1)
            assert [x.queue_offset for x in rs] == [0, 1, 2]
            assert b.topics["orders"][1][2]["properties"] == {"TAGS": "z"}
            with pytest.raises(ValueError):
                await p.send_batch("orders", [Message("other", b"x")])
        await b.stop()

    run(main())


def test_pipelined_sends_share_writes_and_match_out_of_order_replies():
    async def main():
        b = await FakeBroker().start()
        b.reverse_replies = True
        async with Producer(b.address) as p:
            results = await asyncio.gather(*(p.send("t", b"%d" % i, queue_id=0) for i in range(500)))
            assert [r.queue_offset for r in results] == list(range(500))
            many = await p.send_many([Message("t", b"m%d" % i) for i in range(1000)], queue_id=1, window=300)
            assert [r.queue_offset for r in many] == list(range(1000))
        assert [m["body"] for m in b.topics["t"][1]] == [b"m%d" % i for i in range(1000)]
        # coalescing: far fewer socket reads than requests
        assert len(b.reads) < 100
        await b.stop()

    run(main())


def test_send_errors_are_raised_not_retried():
    async def main():
        b = await FakeBroker().start()
        async with Producer(b.address) as p:
            b.fail_sends = [ErrorCode.BUSY]
            with pytest.raises(TxmqError) as info:
                await p.send("t", b"x")
            assert info.value.code is ErrorCode.BUSY and info.value.retriable
            assert sum(1 for op, _ in b.log if op == "send") == 1
        await b.stop()

    run(main())


# ---- transactional producer ------------------------------------------------------

@pytest.mark.parametrize(
    "answer,state,outcome",
    [
        (C, C, "committed"),
        (R, R, "rolled_back"),
        (U, U, "pending"),
        (None, U, "pending"),
        (RuntimeError("db down"), U, "pending"),
        ("commit", C, "committed"),
    ],
)
def test_send_in_transaction_runs_listener_and_ends(answer, state, outcome):
    async def main():
        b = await FakeBroker().start()
        listener = Listener(answer)
        async with TransactionProducer("g", listener, b.address) as tp:
            r = await tp.send_in_transaction(Message("orders", b"pay", keys="order-1"), arg={"id": 1})
        assert r.send_status is SendStatus.SEND_OK and r.local_state is state and r.outcome == outcome
        assert (r.topic, r.tx_id) == ("orders", r.msg_id)
        (view, arg), = listener.executed
        assert arg == {"id": 1}
        assert view.tx_id == r.tx_id and view.body == b"pay" and view.keys == "order-1"
        assert view.properties["TRAN_MSG"] == "true" and view.properties["PGROUP"] == "g"
        send = next(f for op, f in b.log if op == "send")
        assert send["properties"] == {"KEYS": "order-1", "TRAN_MSG": "true", "PGROUP": "g"}
        (end,) = b.ends
        assert end == {"group": "g", "tx_id": r.tx_id, "commit_log_offset": r.commit_log_offset,
                       "half_offset": r.half_offset, "state": state.value, "from_check": False}
        committed = b.topics.get("orders", [[]] * 4)
        assert sum(map(len, committed)) == (1 if state is C else 0)
        await b.stop()

    run(main())


def test_async_listener_methods_are_awaited():
    class AsyncListener:
        def __init__(self):
            self.checked = []

        async def execute_local_transaction(self, message, arg):
            await asyncio.sleep(0)
            return R

        async def check_local_transaction(self, message):
            self.checked.append(threading.current_thread().name)
            return C

    async def main():
        b = await FakeBroker().start()
        listener = AsyncListener()
        async with TransactionProducer("g", listener, b.address) as tp:
            r = await tp.send_in_transaction(Message("t", b"x"))
            assert r.local_state is R
            r2 = await tp.send_in_transaction(Message("t", b"y"))  # rolled back too; check it anyway
            await r2.end
            b.outcomes.pop(r2.tx_id)
            b.push_check(r2.tx_id)
            await wait_until(lambda: tp.checks_answered == 1)
        assert listener.checked == [threading.current_thread().name]  # ran on the loop, not a thread
        await b.stop()

    run(main())


def test_store_error_on_half_rolls_back_without_local_transaction():
    async def main():
        b = await FakeBroker().start()
        listener = Listener(C)
        async with TransactionProducer("g", listener, b.address) as tp:
            b.fail_sends = [ErrorCode.STORE_ERROR]
            r = await tp.send_in_transaction(Message("t", b"x"))
            assert r.send_status is SendStatus.FLUSH_DISK_TIMEOUT
            assert r.local_state is R and r.commit_log_offset == -1
            b.fail_sends = [ErrorCode.INVALID_TOPIC]
            with pytest.raises(TxmqError) as info:
                await tp.send_in_transaction(Message("t", b"x"))
            assert info.value.code is ErrorCode.INVALID_TOPIC
        assert listener.executed == [] and b.ends == []
        await b.stop()

    run(main())


def test_check_back_is_answered_from_a_thread_with_push_offsets():
    async def main():
        b = await FakeBroker().start()
        listener = Listener(U, check=C)
        async with TransactionProducer("g", listener, b.address) as tp:
            r = await tp.send_in_transaction(Message("orders", b"x", tags="tg"))
            assert await r.end == "pending" and r.outcome == "pending"
            b.push_check(r.tx_id)
            await wait_until(lambda: tp.checks_answered == 1)
        (view,) = listener.checked
        assert (view.topic, view.tx_id, view.check_times, view.tags) == ("orders", r.tx_id, 1, "tg")
        assert view.queue_offset == r.half_offset and view.commit_log_offset == r.commit_log_offset
        assert threading.main_thread().name not in listener.check_threads
        end = b.ends[-1]
        assert end["from_check"] is True and end["state"] == "commit"
        assert (end["commit_log_offset"], end["half_offset"]) == (r.commit_log_offset, r.half_offset)
        assert b.outcomes[r.tx_id] == "committed"
        await b.stop()

    run(main())


def test_failing_check_answers_unknown():
    async def main():
        b = await FakeBroker().start()
        listener = Listener(U, check=ValueError("no idea"))
        async with TransactionProducer("g", listener, b.address) as tp:
            r = await tp.send_in_transaction(Message("t", b"x"))
            b.push_check(r.tx_id)
            await wait_until(lambda: tp.checks_answered == 1)
        assert b.ends[-1]["state"] == "unknown" and b.ends[-1]["from_check"]
        await b.stop()

    run(main())


def test_check_concurrency_is_bounded():
    class Slow(Listener):
        def __init__(self):
            super().__init__(U)
            self.active = 0
            self.peak = 0
            self.lock = threading.Lock()

        def check_local_transaction(self, message):
            with self.lock:
                self.active += 1
                self.peak = max(self.peak, self.active)
            time.sleep(0.05)
            with self.lock:
                self.active -= 1
            return C

    async def main():
        b = await FakeBroker().start()
        listener = Slow()
        async with TransactionProducer("g", listener, b.address, check_concurrency=3) as tp:
            rs = await asyncio.gather(*(tp.send_in_transaction(Message("t", b"%d" % i)) for i in range(12)))
            for r in rs:
                b.push_check(r.tx_id)
            await wait_until(lambda: tp.checks_answered == 12)
        assert listener.peak == 3
        assert sorted(b.outcomes.values()) == ["committed"] * 12
        await b.stop()

    run(main())


def test_an_end_still_waiting_for_a_reconnect_when_the_producer_closes_is_lost_not_refused():
    async def main():
        b = await FakeBroker().start()
        b.op_end_transaction = lambda conn, f: asyncio.get_running_loop().create_future()  # the broker dies first
        tp = await TransactionProducer("g", Listener(C), b.address, backoff_initial=0.01, request_timeout=0.3).start()
        r = await tp.send_in_transaction(Message("t", b"x"), timeout=30)  # the end may wait 30 s for the broker
        await wait_until(lambda: any(op == "end_transaction" for op, _ in b.log))
        await b.stop()
        await tp.close()  # flushes for the request timeout, then gives up on the end
        assert r.end.done() and await r.end is None
        assert r.end_error is None and tp.end_failures == {"lost": 1}

    run(main())


# ---- reconnect -------------------------------------------------------------------

def test_reconnect_resends_hello_and_check_backs_reach_the_producer():
    async def main():
        b = await FakeBroker().start()
        listener = Listener(U, check=R)
        async with TransactionProducer("g", listener, b.address, backoff_initial=0.01) as tp:
            r = await tp.send_in_transaction(Message("t", b"x"))
            await b.stop()  # broker "restarts": connections dropped, port closed for a while
            await asyncio.sleep(0.2)
            await b.start()  # same port
            await wait_until(lambda: tp.client.connected)
            assert [h["producer_groups"] for h in b.hellos] == [["g"], ["g"]]
            b.push_check(r.tx_id)
            await wait_until(lambda: tp.checks_answered == 1)
            assert b.outcomes[r.tx_id] == "rolled_back"
            assert tp.client.reconnects == 1
        await b.stop()

    run(main())


def test_in_flight_read_is_retried_but_send_is_not():
    async def main():
        b = await FakeBroker().start()
        async with Client(b.address, backoff_initial=0.01) as c:
            b.queues("t")
            pull = asyncio.ensure_future(c.request("pull", {"topic": "t", "queue_id": 0, "offset": 0, "wait_ms": 2000}))
            b.hold_sends = True
            send = asyncio.ensure_future(c.request("send", {"topic": "t", "body": b"x"}))
            await wait_until(lambda: len([op for op, _ in b.log if op in ("pull", "send")]) == 2)
            b.hold_sends = False
            b.drop_connections()
            with pytest.raises(ConnectionLost):
                await send
            await wait_until(lambda: c.connected)
            b.append("t", 0, b"late", {})
            r = await pull
            assert [m["body"] for m in r["messages"]] == [b"late"]
            assert sum(1 for op, _ in b.log if op == "pull") == 2
            assert sum(1 for op, _ in b.log if op == "send") == 1
        await b.stop()

    run(main())


def test_retries_of_a_read_that_breaks_the_connection_are_bounded():
    async def main():
        b = await FakeBroker().start()
        b.garble_ops.add("list_topics")
        async with Client(b.address, backoff_initial=0.01, max_retries=3) as c:
            with pytest.raises(ConnectionLost, match="MALFORMED_FRAME"):
                await c.request("list_topics", {})
            assert sum(1 for op, _ in b.log if op == "list_topics") == 4
            await wait_until(lambda: c.connected)
            assert (await c.request("heartbeat")) == {"time_ms": 1}
        await b.stop()

    run(main())


def test_request_while_disconnected_waits_for_the_reconnect():
    async def main():
        b = await FakeBroker().start()
        async with Producer(b.address, backoff_initial=0.01) as p:
            await b.stop()
            await asyncio.sleep(0.05)
            assert not p.client.connected
            send = asyncio.ensure_future(p.send("t", b"after"))
            await asyncio.sleep(0.1)
            await b.start()
            r = await send
            assert r.queue_offset == 0
        await b.stop()

    run(main())


def test_request_gives_up_when_broker_stays_away():
    async def main():
        b = await FakeBroker().start()
        async with Producer(b.address, backoff_initial=0.01, reconnect_wait=0.2) as p:
            await b.stop()
            await asyncio.sleep(0.02)
            with pytest.raises(ConnectionLost, match="unreachable"):
                await p.send("t", b"x")

    run(main())


# ---- consumer --------------------------------------------------------------------

def _fill(b: FakeBroker, topic: str, per_queue: int) -> None:
    for q in range(4):
        for i in range(per_queue):
            b.append(topic, q, b"%d-%d" % (q, i), {"TAGS": "x"})


def test_consumer_reads_every_queue_in_order_and_commits_next_offsets():
    async def main():
        b = await FakeBroker().start()
        _fill(b, "t", 50)
        seen: dict[int, list[int]] = defaultdict(list)
        async with Consumer("cg", "t", b.address, batch_size=16, stop_when_caught_up=True, wait_ms=50) as c:
            async for m in c:
                seen[m.queue_id].append(m.queue_offset)
                assert m.body == b"%d-%d" % (m.queue_id, m.queue_offset) and m.tags == "x"
            assert c.caught_up()
        assert {q: offs for q, offs in seen.items()} == {q: list(range(50)) for q in range(4)}
        assert b.offsets[("cg", "t")] == {0: 50, 1: 50, 2: 50, 3: 50}
        assert b.hellos[0]["consumer_groups"] == ["cg"]
        # a second consumer of the group starts where the first stopped
        b.append("t", 2, b"2-50", {})
        async with Consumer("cg", "t", b.address, stop_when_caught_up=True) as c:
            got = [(m.queue_id, m.queue_offset) async for m in c]
        assert got == [(2, 50)]
        await b.stop()

    run(main())


def test_consumer_poll_manual_commit_and_latest():
    async def main():
        b = await FakeBroker().start()
        _fill(b, "t", 3)
        async with Consumer("m", "t", b.address, auto_commit=False, queues=[1]) as c:
            got = []
            while len(got) < 3:
                got += await c.poll(1.0)
            assert [m.queue_offset for m in got] == [0, 1, 2] and {m.queue_id for m in got} == {1}
            await c.commit(got[0])
            assert b.offsets[("m", "t")] == {1: 1}
            await c.commit((1, 3))
            assert b.offsets[("m", "t")] == {1: 3}
            assert await c.poll(0.05) == []
        async with Consumer("late", "t", b.address, from_="latest", wait_ms=100) as c:
            assert await c.poll(0.2) == []
            b.append("t", 3, b"new", {})
            (m,) = await c.poll(2.0)
            assert m.body == b"new"
        assert b.offsets[("late", "t")] == {3: 4}
        await b.stop()

    run(main())


def test_consumer_waits_for_a_topic_that_does_not_exist_yet():
    async def main():
        b = await FakeBroker().start()
        async with Consumer("g", "fresh", b.address, discover_interval=0.05, wait_ms=100) as c:
            assert c.caught_up()
            assert await c.poll(0.1) == []
            b.append("fresh", 0, b"first", {})
            (m,) = await c.poll(2.0)
            assert m.body == b"first"
        async with Consumer("g", "made", b.address, create_topic=True, queues_if_created=2) as c:
            assert c.queue_ids == [0, 1]
        assert "made" in b.topics
        await b.stop()

    run(main())


def test_consumer_sees_committed_transactions_with_tx_id():
    async def main():
        b = await FakeBroker().start()
        async with TransactionProducer("g", Listener(C), b.address) as tp:
            r = await tp.send_in_transaction(Message("t", b"x"))
        async with Consumer("cg", "t", b.address, stop_when_caught_up=True) as c:
            (m,) = [m async for m in c]
        assert m.tx_id == r.tx_id and m.tx_type == 2 and m.prepared_offset == r.commit_log_offset
        await b.stop()

    run(main())


def test_consumer_survives_a_broker_restart():
    async def main():
        b = await FakeBroker().start()
        _fill(b, "t", 2)
        async with Consumer("cg", "t", b.address, wait_ms=100, backoff_initial=0.01) as c:
            first = []
            while len(first) < 8:
                first += await c.poll(1.0)
            await b.stop()
            await asyncio.sleep(0.1)
            await b.start()
            b.append("t", 0, b"after", {})
            (m,) = await c.poll(3.0)
            assert m.body == b"after"
        await b.stop()

    run(main())


def test_consumer_without_reconnect_reports_a_lost_broker():
    async def main():
        b = await FakeBroker().start()
        _fill(b, "t", 1)
        async with Consumer("cg", "t", b.address, reconnect=False, wait_ms=100) as c:
            got = []
            while len(got) < 4:
                got += await c.poll(1.0)
            await b.stop()
            with pytest.raises(ConnectionLost):
                for _ in range(50):
                    await c.poll(0.1)

    run(main())


# ---- sync facade -----------------------------------------------------------------

class _BrokerThread:
    """A fake broker on its own loop, for the blocking API."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.b: FakeBroker = self.call(self._make())

    async def _make(self) -> FakeBroker:
        return await FakeBroker().start()

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def stop(self) -> None:
        self.call(self.b.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def test_sync_facade_round_trip():
    bt = _BrokerThread()
    try:
        addr = bt.b.address
        with SyncProducer(addr) as p:
            r = p.send("s", b"one", queue_id=0)
            assert r.queue_offset == 0
            assert [x.queue_offset for x in p.send_many([Message("s", b"m%d" % i) for i in range(5)], queue_id=0)] == [1, 2, 3, 4, 5]
            assert p.request("heartbeat") == {"time_ms": 1}

        caller = threading.current_thread().name
        threads = []

        class L:
            def execute_local_transaction(self, message, arg):
                threads.append(threading.current_thread().name)
                return arg

            def check_local_transaction(self, message):
                return C

        with SyncTransactionProducer("g", L(), addr) as tp:
            r = tp.send_in_transaction(Message("s", b"tx"), arg=C)  # pipelined end
            assert tp.wait_end(r) == "committed" and r.outcome == "committed" and r.topic == "s"
            r = tp.send_in_transaction(Message("s", b"tx2"), arg=R, wait_end=True)
            assert r.outcome == "rolled_back"
            assert tp.flush() == 0 and tp.end_failures == {}
        assert threads == [caller, caller]

        with SyncConsumer("sg", "s", addr, stop_when_caught_up=True, poll_timeout=0.2) as c:
            bodies = [m.body for m in c]
            assert c.caught_up()
        assert sorted(bodies) == sorted([b"one", b"m0", b"m1", b"m2", b"m3", b"m4", b"tx"])
        assert bodies.index(b"m0") < bodies.index(b"m4")
        assert sum(bt.b.offsets[("sg", "s")].values()) == 7
    finally:
        bt.stop()


def test_send_many_and_close_return_when_the_broker_stops_reading(monkeypatch):
    from txmq.client import connection

    monkeypatch.setattr(connection, "CLOSE_GRACE_S", 0.5)

    async def main():
        b = await FakeBroker().start()
        b.after_hello = "stop_reading"
        p = await Producer(b.address, request_timeout=0.5, reconnect=False).start()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await p.send_many([Message("t", b"x" * (1 << 20)) for _ in range(256)], return_exceptions=True, window=16)
        assert time.monotonic() - t0 < 20  # not stuck behind the unread 256 MiB
        t0 = time.monotonic()
        await p.close()
        assert time.monotonic() - t0 < 15
        await b.stop()

    run(main())


def test_reconnects_to_a_peer_that_drops_every_connection_back_off():
    async def main():
        b = await FakeBroker().start()
        c = await Client(b.address, backoff_initial=0.01, backoff_max=0.4).start()
        b.after_hello = "drop"
        b.drop_connections()
        t0 = time.monotonic()
        while len(b.hellos) < 3:  # it does reconnect
            assert time.monotonic() - t0 < 30, len(b.hellos)
            await asyncio.sleep(0.05)
        before = len(b.hellos)
        await asyncio.sleep(1.5)
        # without a backoff carried across connections: thousands of connections a second; with it, one per
        # 0.4 s at most (a loaded machine only makes fewer)
        assert len(b.hellos) - before <= 8, len(b.hellos) - before
        await c.close()
        await b.stop()

    run(main())


def test_a_consumer_waiting_for_its_topic_survives_a_broker_outage():
    async def main():
        b = await FakeBroker().start()
        c = await Consumer("g", "later", b.address, create_topic=False, discover_interval=0.05,
                           reconnect_wait=0.2, backoff_initial=0.01, backoff_max=0.05).start()
        await asyncio.sleep(0.2)
        await b.stop()
        await asyncio.sleep(0.6)  # longer than reconnect_wait: requests fail with ConnectionLost meanwhile
        await b.start()
        b.queues("later", 1)
        b.append("later", 0, b"first", {})
        got = []
        t0 = time.monotonic()
        while not got and time.monotonic() - t0 < 5:
            got = await c.poll(0.5)
        assert [m.body for m in got] == [b"first"]
        await c.close()
        await b.stop()

    run(main())
