"""Fuzz a live broker with random and mutated frames while a well-behaved client keeps working.

A corpus of valid requests (every operation, with real transaction ids and
offsets from a session) is mutated -- bit flips, byte edits, truncation,
length-prefix changes, msgpack type swaps inside the frame, splices of two
frames, pipelines of several -- and sent from several connections at once.
After each input a heartbeat sentinel shows whether the connection is still
usable; a closed connection is reopened. Meanwhile a good client sends,
batches, pulls and commits offsets and must never see an error.

Afterwards: the broker is still up and counted no internal error, exits 0
on SIGTERM, its directory opens without dropping a byte, every record
scans clean, and every message the good client was acknowledged is there.
Short run ~10,000 inputs; TXMQ_FAULT_LONG=1 (or TXMQ_FUZZ_INPUTS=N) for
200,000. The count of inputs tried is printed.
"""

from __future__ import annotations

import asyncio
import os
import random
import struct
import time
from collections import Counter
from typing import Any

import msgpack
import pytest

from brokerproc import BrokerProcess
from conftest import arun
from faultload import PipeClient, queue_records, record
from txmq import wire
from txmq.broker.transactions.index import rebuild
from txmq.store import Store, StoreReader

pytestmark = [pytest.mark.fault, pytest.mark.slow]

LONG = os.environ.get("TXMQ_FAULT_LONG") == "1"
INPUTS = int(os.environ.get("TXMQ_FUZZ_INPUTS", "200000" if LONG else "10000"))
WORKERS = 4
GOOD = "good-zz9"
SENTINEL = 0xFFFFFFF0


# ---- the corpus ----------------------------------------------------------------
async def build_corpus(address: str) -> list[tuple[str, dict[str, Any]]]:
    """Valid requests for every operation, with live ids and offsets."""
    c = await PipeClient.open(address)
    tx = {"TRAN_MSG": "true", "PGROUP": "fz"}
    hs = [await c.ok("send", {"topic": "fz-t", "body": f"h{i}".encode(), "properties": tx}) for i in range(4)]
    s = await c.ok("send", {"topic": "fz-t", "body": b"plain", "properties": {"TAGS": "a", "KEYS": "k1 k2"}})
    end = {"group": "fz", "tx_id": hs[0]["tx_id"], "commit_log_offset": hs[0]["commit_log_offset"], "half_offset": hs[0]["half_offset"]}
    await c.close()
    h1, h2 = hs[1], hs[2]
    return [
        ("hello", {"client_id": "fz", "producer_groups": ["fz"], "consumer_groups": ["c"]}),
        ("hello", {"token": "x"}),
        ("heartbeat", {}),
        ("broker_info", {}),
        ("send", {"topic": "fz-t", "body": b"x" * 40, "properties": {"TAGS": "t"}, "queue_id": 1, "born_ts": 1_700_000_000_000}),
        ("send", {"topic": "fz-t", "body": b"y", "properties": tx}),
        ("send", {"topic": "fz-t", "body": b"z" * 300}),
        ("send_batch", {"topic": "fz-t", "messages": [{"body": b"a"}, {"body": b"b", "properties": {"TAGS": "x"}}], "queue_id": 2}),
        ("end_transaction", {**end, "state": "commit"}),
        ("end_transaction", {**end, "state": "rollback", "from_check": True}),
        ("end_transaction", {"group": "fz", "tx_id": h1["tx_id"], "commit_log_offset": h1["commit_log_offset"],
                             "half_offset": h1["half_offset"], "state": "unknown"}),
        ("pull", {"topic": "fz-t", "queue_id": 0, "offset": 0, "max_count": 10, "max_bytes": 4096}),
        ("pull", {"topic": "RMQ_SYS_TRANS_HALF_TOPIC", "queue_id": 0, "offset": 0}),
        ("pull", {"topic": "fz-t", "queue_id": s["queue_id"], "offset": s["queue_offset"], "wait_ms": 1}),
        ("commit_offset", {"group": "fzc", "topic": "fz-t", "queue_id": 0, "offset": 1}),
        ("fetch_offsets", {"group": "fzc", "topic": "fz-t"}),
        ("create_topic", {"topic": "fz-new", "queues": 2}),
        ("list_topics", {"system": True}),
        ("tx_pending", {"group": "fz", "topic": "fz-t", "min_age_ms": 0, "limit": 10}),
        ("tx_offsets", {}),
        ("tx_resolve", {"action": "commit", "refs": [{"tx_id": h2["tx_id"]}], "dry_run": True}),
        ("tx_resolve", {"action": "rollback", "refs": [{"half_offset": h2["half_offset"]}, {"commit_log_offset": h2["commit_log_offset"]}]}),
        ("tx_check_now", {"tx_id": hs[3]["tx_id"]}),
        ("discard_list", {"limit": 5}),
        ("discard_replay", {"to": "half", "refs": [{"tx_id": h1["tx_id"]}], "dry_run": True}),
        ("discard_replay", {"to": "commit", "all": True, "dry_run": True}),
        ("config_get", {}),
        ("config_set", {"key": "max_checks", "value": 20}),
        ("config_set", {"key": "check_interval_s", "value": 0.2}),
        ("stats", {}),
    ]


# ---- mutations -----------------------------------------------------------------
SWAPS: list[Any] = [None, True, False, 0, -1, 1 << 40, (1 << 64) - 1, -(1 << 63), 1.5, float("nan"), "", "s", "x" * 300, b"", b"\x00\xff",
                    [], [1, "a"], {}, {"a": 1}, {"": None}, "RMQ_SYS_TRANS_HALF_TOPIC"]


def framed(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def type_swap(rng: random.Random, op: str, fields: dict[str, Any]) -> bytes:
    obj: list[Any] = [0, rng.randrange(1, 1 << 31), op, dict(fields)]
    where = rng.randrange(5)
    if where < 3:
        obj[where] = rng.choice(SWAPS)
    elif where == 3 or not fields:
        obj[3] = rng.choice(SWAPS)
    else:
        f = obj[3]
        key = rng.choice(list(f))
        if rng.random() < 0.2:
            del f[key]
        elif isinstance(f[key], list) and f[key] and rng.random() < 0.5:
            lst = list(f[key])
            lst[rng.randrange(len(lst))] = rng.choice(SWAPS)
            f[key] = lst
        elif isinstance(f[key], dict) and f[key] and rng.random() < 0.5:
            d = dict(f[key])
            d[rng.choice(list(d))] = rng.choice(SWAPS)
            f[key] = d
        else:
            f[key] = rng.choice(SWAPS)
    if rng.random() < 0.1:
        obj = obj[: rng.randrange(4)] if rng.random() < 0.5 else obj + [rng.choice(SWAPS)]
    return framed(msgpack.packb(obj, use_bin_type=True))


def mutate(rng: random.Random, corpus: list[tuple[str, dict]], frames: list[bytes]) -> tuple[str, bytes, bool]:
    """(kind, bytes, whether the broker may be left waiting for more bytes)."""
    base = bytearray(rng.choice(frames))
    kind = rng.choice(["bitflip", "bitflip", "bytes", "truncate", "length", "typeswap", "typeswap", "typeswap", "splice",
                       "pipeline", "garbage", "valid"])
    if kind == "bitflip":
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(base))
            base[i] ^= 1 << rng.randrange(8)
        return kind, bytes(base), True  # a flipped length prefix may ask for more
    if kind == "bytes":
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(4, len(base))
            r = rng.random()
            if r < 0.4:
                base[i] = rng.randrange(256)
            elif r < 0.7:
                base.insert(i, rng.randrange(256))
            elif len(base) > 5:
                del base[i]
        base[:4] = struct.pack(">I", len(base) - 4)
        return kind, bytes(base), False
    if kind == "truncate":
        return kind, bytes(base[: rng.randrange(1, len(base))]), True
    if kind == "length":
        n = len(base) - 4
        new = rng.choice([0, 1, n - 1, max(0, n - rng.randint(1, 10)), n + rng.randint(1, 10), 8 << 20, (8 << 20) + 1, (1 << 32) - 1,
                          rng.randrange(1 << 32)])
        return kind, struct.pack(">I", new) + bytes(base[4:]), new > n
    if kind == "typeswap":
        op, fields = rng.choice(corpus)
        return kind, type_swap(rng, op, fields), False
    if kind == "splice":
        other = rng.choice(frames)
        a, b = rng.randrange(4, len(base) + 1), rng.randrange(4, len(other) + 1)
        payload = bytes(base[4:a]) + other[b:]
        return kind, framed(payload), False
    if kind == "pipeline":
        parts = [mutate(rng, corpus, frames) for _ in range(rng.randint(2, 4))]
        return kind, b"".join(p[1] for p in parts), any(p[2] for p in parts)
    if kind == "garbage":
        return kind, framed(os.urandom(rng.randint(0, 64))), False
    return kind, bytes(base), False


# ---- the run -------------------------------------------------------------------
class Fuzzer:
    def __init__(self, address: str, corpus: list[tuple[str, dict]], n: int, seed: int) -> None:
        self.address = address
        self.corpus = corpus
        self.frames = [wire.request(i + 1, op, f) for i, (op, f) in enumerate(corpus)]
        self.left = n
        self.tried = 0
        self.kinds: Counter = Counter()
        self.outcomes: Counter = Counter()
        self.seed = seed

    async def worker(self, w: int) -> None:
        rng = random.Random(self.seed * 100 + w)
        host, port = self.address.rsplit(":", 1)
        sentinel = wire.request(SENTINEL, "heartbeat", {})
        r = w_ = None
        dec = None
        while self.left > 0:
            self.left -= 1
            if w_ is None:
                r, w_ = await asyncio.open_connection(host, int(port))
                dec = wire.FrameDecoder(64 << 20)
            kind, data, may_stall = mutate(rng, self.corpus, self.frames)
            self.kinds[kind] += 1
            self.tried += 1
            if may_stall and rng.random() < 0.95:
                w_.write(data)  # leave it hanging and hang up: the broker must drop the partial frame cleanly
                w_.close()
                r = w_ = None
                self.outcomes["hung_up"] += 1
                continue
            w_.write(data + sentinel)
            outcome = await self._await_sentinel(r, dec)
            self.outcomes[outcome] += 1
            if outcome != "answered":
                w_.close()
                r = w_ = None
        if w_ is not None:
            w_.close()

    async def _await_sentinel(self, r: asyncio.StreamReader, dec: wire.FrameDecoder) -> str:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 0.25
        while True:
            try:
                data = await asyncio.wait_for(r.read(1 << 16), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return "stalled"  # the sentinel went into a longer frame the input announced
            except ConnectionError:
                return "reset"
            if not data:
                return "closed"
            for p in dec.feed(data):
                f = wire.parse_payload(p)
                assert f.kind in (wire.REPLY, wire.PUSH), f
                if f.kind == wire.REPLY:
                    assert f.op in {int(c) for c in wire.ErrorCode}, f
                    assert f.op != wire.ErrorCode.INTERNAL, f.fields
                    if f.id == SENTINEL and f.op == 0:
                        return "answered"


class GoodClient:
    """Plain sends, batches, pulls from a committed position, offset commits: must never see an error."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.acked: dict[bytes, tuple[int, int]] = {}
        self.errors: list[Any] = []
        self.consumed = 0
        self.stop = asyncio.Event()

    async def run(self) -> None:
        c = await PipeClient.open(self.address)
        await c.ok("hello", {"client_id": "good"})
        await c.ok("create_topic", {"topic": GOOD, "queues": 2})
        pos = {0: 0, 1: 0}
        i = 0
        try:
            while not self.stop.is_set():
                i += 1
                reqs = []
                if i % 4 == 0:
                    bodies = [f"good-{i}-{k}".encode() for k in range(3)]
                    reqs.append(("send_batch", {"topic": GOOD, "messages": [{"body": b} for b in bodies]}, bodies))
                else:
                    reqs.append(("send", {"topic": GOOD, "body": f"good-{i}".encode(), "properties": {"TAGS": "g"}}, None))
                for op, fields, bodies in reqs:
                    code, r = await c.req(op, fields)
                    if code:
                        self.errors.append((op, r))
                        continue
                    for b, row in zip(bodies or [fields["body"]], r["results"] if bodies else [r]):
                        self.acked[b] = (row["queue_id"], row["queue_offset"])
                q = i % 2
                code, r = await c.req("pull", {"topic": GOOD, "queue_id": q, "offset": pos[q], "max_count": 32})
                if code:
                    self.errors.append(("pull", r))
                    continue
                self.consumed += len(r["messages"])
                for m in r["messages"]:
                    if self.acked.get(m["body"], (q, m["queue_offset"])) != (q, m["queue_offset"]):
                        self.errors.append(("pull", f"{m['body']!r} at {m['queue_offset']}"))
                pos[q] = r["next_offset"]
                if i % 10 == 0:
                    code, r = await c.req("commit_offset", {"group": "good-readers", "topic": GOOD, "queue_id": q, "offset": pos[q]})
                    if code:
                        self.errors.append(("commit_offset", r))
                    code, r = await c.req("fetch_offsets", {"group": "good-readers", "topic": GOOD})
                    if code or r["offsets"].get(str(q)) != pos[q]:
                        self.errors.append(("fetch_offsets", r))
                await asyncio.sleep(0.002)
        except (ConnectionError, asyncio.TimeoutError) as e:
            self.errors.append(("connection", repr(e)))
        finally:
            await c.close()


def test_fuzz_a_live_broker_while_a_good_client_works(tmp_path):
    seed = int(os.environ.get("TXMQ_FAULT_SEED", random.randrange(1 << 30)))
    data = tmp_path / "data"
    b = BrokerProcess(data, "--flush", "sync", "--check-interval", "200ms", "--transaction-timeout", "300ms")
    b.start()
    t0 = time.monotonic()
    try:
        corpus = arun(build_corpus(b.address))
        fz = Fuzzer(b.address, corpus, INPUTS, seed)
        good = GoodClient(b.address)

        async def go() -> dict:
            g = asyncio.create_task(good.run())
            await asyncio.gather(*[fz.worker(w) for w in range(WORKERS)])
            good.stop.set()
            await g
            c = await PipeClient.open(b.address)
            st = await c.ok("stats")
            for q in range(2):  # everything acknowledged is readable
                have, offset = {}, 0
                while True:  # in pages: a long run acknowledges more than one pull returns
                    r = await c.ok("pull", {"topic": GOOD, "queue_id": q, "offset": offset, "max_count": 10_000, "max_bytes": 64 << 20})
                    have.update({m["body"]: (q, m["queue_offset"]) for m in r["messages"]})
                    if not r["messages"]:
                        break
                    offset = r["next_offset"]
                missing = [k for k, v in good.acked.items() if v[0] == q and have.get(k) != v]
                assert not missing, missing[:3]
            await c.close()
            return st

        st = arun(go())
        assert b.proc.poll() is None, "the broker died"
        took = time.monotonic() - t0
        summary = record("fuzz", inputs_tried=fz.tried, seed=seed, took_s=round(took, 1), kinds=dict(fz.kinds), outcomes=dict(fz.outcomes),
                         good_acked=len(good.acked), good_consumed=good.consumed, good_errors=len(good.errors),
                         error_replies={k: v for k, v in st["counters"].items() if k.startswith("errors_")})
        assert fz.tried == INPUTS
        assert not good.errors, good.errors[:5]
        assert len(good.acked) > 50, summary
        counters = st["counters"]
        assert counters.get("errors_internal", 0) == 0, counters
        assert counters.get("errors_malformed_frame", 0) > 0 and counters.get("errors_invalid_field", 0) > 0, counters
        assert b.stop() == 0
    finally:
        b.kill()
    log = b.log.read_text()
    assert "Traceback" not in log and "event=internal_error" not in log, log[-3000:]
    # the store is intact: nothing to cut, every record valid, the transaction index rebuilds
    s = Store(data)
    report = s.open()
    s.close()
    assert report.dropped_bytes == 0 and report.reason is None, report
    reader = StoreReader(data)
    try:
        n = 0
        end = 0
        for rec in reader.scan():
            assert rec.commit_log_offset == end
            end += rec.size
            n += 1
        assert end == reader.max_offset and n > 0
        rebuild(reader)
        stored = {r.body: (q, r.queue_offset) for q in range(2) for r in queue_records(reader, GOOD, q)}
        assert all(stored.get(k) == v for k, v in good.acked.items())
    finally:
        reader.close()
