"""Slow and stalled clients: backpressure keeps the broker's memory bounded; 1,000 connections are served.

A client that pipelines requests and never reads the replies must not make
the broker buffer without limit: the connection stops reading when its
write buffer passes the high-water mark, when too many requests are in
flight, or when the pulls in flight could return more than the pull budget
(broker/native/connection.py). The broker is a subprocess, so its memory is its
VmRSS in /proc.
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import time

import pytest

from brokerproc import BrokerProcess
from conftest import arun
from faultload import PipeClient, record
from txmq import wire
from txmq.broker.testing import running_broker

pytestmark = [pytest.mark.fault, pytest.mark.slow]

MB = 1 << 20
RSS_GROWTH_LIMIT = 192 * MB  # write buffer (4 MiB) + pull budget (64 MiB) + replies being encoded, with slack


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def stall_push(port: int, frames: bytes, limit: int, patience: float = 2.0, deadline: float = 60.0) -> int:
    """Write frames again and again without ever reading, until limit bytes or the socket accepts nothing for patience s."""
    s = socket.create_connection(("127.0.0.1", port))
    s.setblocking(False)
    sent = 0
    view = memoryview(frames)
    pos = 0
    last = t0 = time.monotonic()
    try:
        while sent < limit and time.monotonic() - t0 < deadline:
            try:
                n = s.send(view[pos:])
            except BlockingIOError:
                if time.monotonic() - last > patience:
                    break
                time.sleep(0.01)
                continue
            sent += n
            pos = (pos + n) % len(frames)
            last = time.monotonic()
    finally:
        stall_push.sock = s  # kept open (stalled) until the caller closes it
    return sent


async def _good_client_round(address: str, topic: str) -> None:
    c = await PipeClient.open(address)
    try:
        await c.ok("heartbeat", timeout=5)
        r = await c.ok("send", {"topic": topic, "body": b"still served"}, timeout=5)
        got = await c.ok("pull", {"topic": topic, "queue_id": r["queue_id"], "offset": r["queue_offset"]}, timeout=5)
        assert got["messages"][0]["body"] == b"still served"
    finally:
        await c.close()


def test_stalled_reader_of_big_pull_replies_does_not_grow_broker_memory(tmp_path):
    with BrokerProcess(tmp_path / "data") as b:
        async def fill() -> None:
            c = await PipeClient.open(b.address)
            await c.ok("create_topic", {"topic": "big", "queues": 1})
            for _ in range(100):
                await c.ok("send_batch", {"topic": "big", "queue_id": 0, "messages": [{"body": os.urandom(8192)} for _ in range(10)]})
            r = await c.ok("pull", {"topic": "big", "queue_id": 0, "offset": 0, "max_count": 1000, "max_bytes": 8 * MB})
            assert len(r["messages"]) == 1000  # one 8 MiB reply: the allocations of a normal big pull are in the baseline
            await c.close()

        arun(fill())
        before = rss(b.pid)
        # each pull asks for 8 MiB; without backpressure 200 MB of these would need terabytes of replies
        pulls = b"".join(wire.request(i + 1, "pull", {"topic": "big", "queue_id": 0, "offset": 0, "max_count": 1000, "max_bytes": 8 * MB})
                         for i in range(1000))
        sent = stall_push(b.port, pulls, 200 * MB)
        time.sleep(1.0)
        after = rss(b.pid)
        arun(_good_client_round(b.address, "other"))
        time.sleep(0.5)
        later = rss(b.pid)
        stall_push.sock.close()
        record("stalled-pulls", pushed_mib=round(sent / MB, 1), rss_before_mib=before // MB, rss_stalled_mib=after // MB, rss_later_mib=later // MB)
        assert after - before < RSS_GROWTH_LIMIT, (before, after)
        assert later - before < RSS_GROWTH_LIMIT, (before, later)
        arun(_good_client_round(b.address, "other"))
        assert b.stop() == 0


def test_stalled_reader_pushing_200mb_of_sends_keeps_broker_memory_flat(tmp_path):
    with BrokerProcess(tmp_path / "data") as b:
        arun(_good_client_round(b.address, "warm"))
        before = rss(b.pid)
        body = os.urandom(64 << 10)
        sends = b"".join(wire.request(i + 1, "send", {"topic": "flood", "body": body}) for i in range(64))
        sent = stall_push(b.port, sends, 200 * MB)
        after = rss(b.pid)
        arun(_good_client_round(b.address, "warm"))
        stall_push.sock.close()
        record("stalled-sends", pushed_mib=round(sent / MB, 1), rss_before_mib=before // MB, rss_after_mib=after // MB)
        assert sent >= 150 * MB  # sends are stored, so the broker keeps reading: the bytes go to disk, not memory
        assert after - before < RSS_GROWTH_LIMIT, (before, after)
        assert b.stop() == 0


def test_requests_held_back_by_backpressure_are_all_answered_in_the_end(tmp_path):
    """The backlog of a paused connection is dispatched when it drains: no request is dropped."""
    n = 20_000

    async def go() -> None:
        async with running_broker(tmp_path / "data") as b:
            c = await PipeClient.open(b.address)
            await c.ok("create_topic", {"topic": "small", "queues": 1})
            await c.ok("send", {"topic": "small", "queue_id": 0, "body": b"x" * 2000})
            await c.close()
            r, w = await asyncio.open_connection(b.host, b.port)
            w.write(b"".join(wire.request(i + 1, "pull", {"topic": "small", "queue_id": 0, "offset": 0}) for i in range(n)))
            await asyncio.sleep(1.0)  # not reading: ~40 MB of replies cannot all fit in the buffers
            conns = list(b.broker.native.state.connections)
            assert any(conn._read_paused for conn in conns), "the stalled connection was never paused"
            dec = wire.FrameDecoder(64 << 20)
            ids = set()
            while len(ids) < n:
                data = await asyncio.wait_for(r.read(1 << 20), 10)
                assert data, "connection closed"
                for p in dec.feed(data):
                    f = wire.parse_payload(p)
                    assert f.kind == wire.REPLY and f.op == 0, f
                    ids.add(f.id)
            assert ids == set(range(1, n + 1))
            w.close()

    arun(go())


def test_thousand_concurrent_connections_are_served(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))  # the broker subprocess inherits it
    if want < 2200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is too low for 1,000 connections on both ends")
    n = 1000
    with BrokerProcess(tmp_path / "data") as b:
        async def go() -> None:
            async def one(i: int) -> PipeClient:
                c = await PipeClient.open(b.address, timeout=30)
                await c.ok("hello", {"client_id": f"c{i}"}, timeout=30)
                r = await c.ok("send", {"topic": "many", "body": f"m{i}".encode()}, timeout=30)
                assert r["topic"] == "many"
                return c

            clients = await asyncio.gather(*[one(i) for i in range(n)])
            info = await clients[0].ok("broker_info")
            assert info["connections"] >= n
            # every connection still answers, all at once
            pongs = await asyncio.gather(*[c.ok("heartbeat", timeout=30) for c in clients])
            assert len(pongs) == n
            topics = {t["topic"]: t for t in (await clients[0].ok("list_topics"))["topics"]}
            assert topics["many"]["messages"] == n
            await asyncio.gather(*[c.close() for c in clients])

        arun(go())
        assert b.stop() == 0
