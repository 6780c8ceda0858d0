"""Busy polling: the broker's lowest-priority spinner and the client's bounded wait for a reply.

Both live in the compiled module txmq._busypoll (core/_busypoll.pyx); the
broker's use of it is broker/busypoll.py, the client's is
client/connection.py (``Client(busy_poll=...)``).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from txmq.broker.busypoll import BusyPoll
from txmq.broker.testing import running_broker
from txmq.client import LocalTransactionState, Message, TransactionProducer
from txmq.client.connection import Client, Connection, ConnectionLost

try:
    from txmq import _busypoll
except ImportError:  # built without a C compiler: the broker and client then simply do not busy-poll
    _busypoll = None

native = pytest.mark.skipif(_busypoll is None, reason="txmq._busypoll not built on this machine")


def wait_for(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


@native
def test_the_spinner_runs_at_the_idle_priority_while_armed_and_sleeps_after_its_window():
    assert _busypoll.start() == 0
    assert _busypoll.start() == 0  # once per process
    _busypoll.arm(300_000_000)
    assert wait_for(lambda: _busypoll.status()[0] != 0 and _busypoll.status()[1] != -1)
    tid, policy_ok, _ = _busypoll.status()
    assert policy_ok == 1
    # SCHED_IDLE where the kernel allows it, else nice 19: never above an ordinary thread
    assert os.sched_getscheduler(tid) == os.SCHED_IDLE or os.getpriority(os.PRIO_PROCESS, tid) == 19
    with open(f"/proc/self/task/{tid}/comm") as f:
        assert f.read().strip() == "txmq-busypoll"
    # past the window it goes to sleep on its condition variable, and halt() ends a window at once
    assert wait_for(lambda: _busypoll.status()[2], timeout=10.0)
    _busypoll.arm(60_000_000_000)
    assert wait_for(lambda: not _busypoll.status()[2])
    _busypoll.halt()
    assert wait_for(lambda: _busypoll.status()[2])


@native
def test_poll_readable_returns_as_soon_as_data_arrives_and_gives_up_after_its_bound():
    a, b = socket.socketpair()
    try:
        t0 = time.perf_counter()
        assert _busypoll.poll_readable(a.fileno(), 20_000_000) is False
        assert time.perf_counter() - t0 >= 0.019
        threading.Timer(0.05, b.send, (b"x",)).start()
        t0 = time.perf_counter()
        assert _busypoll.poll_readable(a.fileno(), 60_000_000_000) is True
        assert time.perf_counter() - t0 < 30  # woken by the data, not at the 60 s bound
        b.close()  # a closed peer is "readable" too: the event loop reads the EOF
        a.recv(1)
        assert _busypoll.poll_readable(a.fileno(), 5_000_000_000) is True
    finally:
        a.close()
        b.close()


@native
def test_poll_readable_releases_the_gil_while_it_spins():
    a, b = socket.socketpair()
    ticks = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    t = threading.Thread(target=count)
    t.start()
    try:
        time.sleep(0.01)
        before = ticks
        _busypoll.poll_readable(a.fileno(), 200_000_000)
        during = ticks - before
    finally:
        stop.set()
        t.join()
        a.close()
        b.close()
    assert during > 1000  # the other thread ran all along


def test_busy_poll_off_or_unavailable_gives_no_arm_function(monkeypatch):
    off = BusyPoll(0)
    assert off.arm is None and off.state == "off"
    assert off.status() == {"busy_poll": "off", "busy_poll_window_us": 0}
    monkeypatch.setenv("TXMQ_PURE_PYTHON", "1")
    pure = BusyPoll(0.001)
    assert pure.arm is None and "TXMQ_PURE_PYTHON" in pure.state


@native
def test_busy_poll_on_arms_the_spinner(monkeypatch):
    monkeypatch.delenv("TXMQ_PURE_PYTHON", raising=False)
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: busy polling stays off")
    bp = BusyPoll(0.002)
    assert bp.state == "on" and bp.arm is not None
    bp.arm()
    assert wait_for(lambda: bp.status()["busy_poll"] == "on" and _busypoll.status()[1] == 1)
    assert bp.status()["busy_poll_window_us"] == 2000
    bp.stop()


def test_client_busy_poll_out_of_range_is_refused():
    with pytest.raises(ValueError, match="busy_poll"):
        Client("127.0.0.1:1", busy_poll=-0.001)
    with pytest.raises(ValueError, match="busy_poll"):
        Client("127.0.0.1:1", busy_poll=5.0)


class _Commit:
    def execute_local_transaction(self, message, arg):
        return LocalTransactionState.COMMIT_MESSAGE

    def check_local_transaction(self, message):
        return LocalTransactionState.COMMIT_MESSAGE


@native
def test_a_busy_polling_producer_sends_and_ends_transactions_and_gives_its_slot_back(data_dir):
    async def go():
        async with running_broker(data_dir, flush="sync") as b:
            assert b.core.busy_poll.state in ("on", "off (one CPU: nothing to keep awake for)")
            tp = await TransactionProducer("g", _Commit(), b.address, busy_poll=0.005).start()
            try:
                assert Connection._polling == 1
                results = [await tp.send_in_transaction(Message("t", b"x%d" % i)) for i in range(200)]
                await tp.flush()
                outcomes = [await r.end for r in results]
            finally:
                await tp.close()
            assert Connection._polling == 0
            return outcomes

    outcomes = asyncio.run(go())
    assert outcomes == ["committed"] * 200


@native
def test_two_busy_polling_connections_in_one_process_do_not_poll(data_dir):
    """Polling one socket would hold up the other's replies: with two such connections neither polls."""

    async def go():
        async with running_broker(data_dir) as b:
            c1 = await Client(b.address, busy_poll=0.005).start()
            c2 = await Client(b.address, busy_poll=0.005).start()
            polled = []
            orig = Connection._busy_wait

            def spy(self):
                polled.append(Connection._polling)
                orig(self)

            Connection._busy_wait = spy
            try:
                assert Connection._polling == 2
                await asyncio.gather(*(c.request("send", {"topic": "t", "body": b"x"}) for c in (c1, c2) for _ in range(20)))
                assert polled == []
                await c2.close()
                assert Connection._polling == 1
                await c1.request("send", {"topic": "t", "body": b"y"})
                assert polled and set(polled) == {1}
            finally:
                Connection._busy_wait = orig
                await c1.close()
                await c2.close()
            assert Connection._polling == 0

    asyncio.run(go())


@native
def test_a_busy_polling_client_sees_a_broker_that_goes_away(data_dir):
    async def go():
        async with running_broker(data_dir) as b:
            c = await Client(b.address, busy_poll=0.05, reconnect=False, request_timeout=10).start()
            fut = c.connection.send_request("broker_info", {})
            await fut
            c.connection._transport.abort()  # the socket goes: the request fails at once, no poll waits on it
            t0 = time.perf_counter()
            with pytest.raises(ConnectionLost):
                await c.request("broker_info", {})
            assert time.perf_counter() - t0 < 5
            await c.close()
            assert Connection._polling == 0

    asyncio.run(go())


def test_broker_start_refuses_a_busy_poll_window_out_of_range(tmp_path):
    p = subprocess.run([sys.executable, "-m", "txmq", "broker", "start", "--data-dir", str(tmp_path), "--port", "1",
                        "--busy-poll", "2s"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "--busy-poll must be between 0 (off) and 100ms" in p.stderr


def test_broker_info_says_whether_it_busy_polls(data_dir):
    async def go(window):
        async with running_broker(data_dir, busy_poll_s=window) as b:
            async with Client(b.address) as c:
                return await c.request("broker_info", {})

    off = asyncio.run(go(0.0))
    assert off["busy_poll"] == "off" and off["busy_poll_window_us"] == 0
    on = asyncio.run(go(0.001))
    assert on["busy_poll_window_us"] == 1000
    if _busypoll is not None and (os.cpu_count() or 1) >= 2 and not os.environ.get("TXMQ_PURE_PYTHON"):
        assert on["busy_poll"] == "on"
    else:
        assert on["busy_poll"] != "on"
    json.dumps(on)  # what `txmq broker status -o json` prints
