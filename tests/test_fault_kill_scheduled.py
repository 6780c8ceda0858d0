"""Scheduled messages across SIGKILL and clean stops of a `txmq broker start` process: none lost, none delivered twice."""

from __future__ import annotations

import time

import pytest
from brokerproc import BrokerProcess
from conftest import arun

from txmq.client import Producer
from txmq.client.connection import Client

pytestmark = pytest.mark.fault


async def _bodies(address: str, topic: str) -> list[bytes]:
    async with Client(address) as c:
        out = []
        for q in range(4):
            r = await c.request("pull", {"topic": topic, "queue_id": q, "offset": 0, "max_count": 10_000})
            out += [m["body"] for m in r["messages"]]
        return out


async def _send(address: str, topic: str, n: int, delay_s: float, prefix: str) -> list[str]:
    async with Producer(address) as p:
        return [(await p.send(topic, f"{prefix}{i}".encode(), delay=delay_s + i * 0.01)).msg_id for i in range(n)]


def _wait_for(address: str, topic: str, n: int, timeout: float = 20.0) -> list[bytes]:
    deadline = time.monotonic() + timeout
    got: list[bytes] = []
    while time.monotonic() < deadline:
        got = arun(_bodies(address, topic))
        if len(got) >= n:
            return got
        time.sleep(0.2)
    return got


def test_messages_due_while_the_broker_was_killed_are_delivered_once_after_the_start(tmp_path):
    data = tmp_path / "data"
    with BrokerProcess(data, "--flush", "sync") as b:  # started
        t_sent = time.monotonic()
        arun(_send(b.address, "orders", 50, 3.0, "a"))
        early = arun(_bodies(b.address, "orders"))
        if time.monotonic() - t_sent < 3.0:  # read before the first was due (a loaded machine may be later)
            assert early == []
        pid = b.pid
        b.kill()
        assert b.proc.returncode == -9 and b.pid == pid
        time.sleep(max(0.0, t_sent + 3.0 + 50 * 0.01 + 0.5 - time.monotonic()))  # all came due while it was down
        b.start()
        t0 = time.monotonic()
        got = _wait_for(b.address, "orders", 50)
        assert time.monotonic() - t0 < 30  # at the start, not a window load (30 s) later
        assert sorted(got) == sorted(f"a{i}".encode() for i in range(50))
        time.sleep(1)
        assert len(arun(_bodies(b.address, "orders"))) == 50


def test_kill_during_deliveries_neither_loses_nor_repeats_a_message(tmp_path):
    data = tmp_path / "data"
    n = 400
    with BrokerProcess(data, "--flush", "sync") as b:  # started
        arun(_send(b.address, "orders", n, 1.0, "k"))  # due over 4 s, from 1 s on
        time.sleep(2.5)  # part delivered, part due later
        b.kill()
        b.start()
        time.sleep(1.0)
        b.kill()  # a second crash, right after a start's replay
        b.start()
        got = _wait_for(b.address, "orders", n)
        time.sleep(1.0)
        got = arun(_bodies(b.address, "orders"))
        assert len(got) == n and sorted(got) == sorted(f"k{i}".encode() for i in range(n))
        b.stop()
        b.start()  # a clean restart after it all: still once each
        time.sleep(1.0)
        assert len(arun(_bodies(b.address, "orders"))) == n


def test_cancel_and_schedule_survive_a_kill(tmp_path):
    data = tmp_path / "data"
    with BrokerProcess(data, "--flush", "sync") as b:  # started
        ids = arun(_send(b.address, "orders", 3, 2.0, "c"))

        async def cancel() -> None:
            async with Producer(b.address) as p:
                await p.cancel_scheduled(ids[1])

        arun(cancel())
        b.kill()
        time.sleep(2.5)
        b.start()
        assert len(_wait_for(b.address, "orders", 2)) == 2
        time.sleep(1.0)
        assert sorted(arun(_bodies(b.address, "orders"))) == [b"c0", b"c2"]
