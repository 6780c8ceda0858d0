"""Shared pieces of the fault suite: a pipelined raw client, a mixed load, and the invariants.

The load (``MixedLoad``) runs against a broker at an address until its
connections die (the broker was killed) or it is told to stop:

- plain senders (``send`` and ``send_batch``) to ``fl-plain``;
- transactional producers: every transaction's *intended* local outcome
  (commit, rollback, or unknown forever) is drawn before its half message
  is sent, keyed by body, the way a real producer's database would know it;
  the producer then ends it with that state, or says ``unknown``, or never
  ends it (it "crashed");
- a check-back answerer: a connection registered for the group that answers
  every ``check_transaction`` push with the intended outcome (``unknown``
  for the unknown-forever ones, which the check service finally discards);
- an operator: rolls back old pending transactions whose outcome is unknown,
  and commits a few intended-commit ones itself;
- a consumer group that pulls ``fl-plain`` and ``fl-tx`` from its committed
  offsets and commits offsets as it goes.

Everything the broker acknowledged is written in a ``Ledger``, which
``check_invariants`` compares with the data directory after the broker is
gone (SIGKILL or SIGTERM).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from txmq import wire
from txmq.broker.transactions.index import Outcome, rebuild
from txmq.constants import DISCARD_TOPIC, HALF_TOPIC, OP_TOPIC
from txmq.store import ConsumerOffsets, Store, StoreReader

GROUP = "fl-group"
CGROUP = "fl-consumers"
PLAIN = "fl-plain"
TXT = "fl-tx"
QUEUES = 4



class BrokerGone(ConnectionError):
    """The broker answered SHUTTING_DOWN: as good as a dead connection for a load."""


DEAD = (ConnectionError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, EOFError)


# ---- a pipelined raw client --------------------------------------------------
class PipeClient:
    """Many requests in flight on one connection; pushes go to a callback.

    When the connection dies every outstanding request raises ConnectionError.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, on_push: Callable[[wire.Frame], None] | None) -> None:
        self.reader = reader
        self.writer = writer
        self.on_push = on_push
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Future] = {}
        self.closed = False
        self.decoder = wire.FrameDecoder(256 << 20)
        self._task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, address: str, on_push: Callable[[wire.Frame], None] | None = None, timeout: float = 5.0) -> "PipeClient":
        host, port = address.rsplit(":", 1)
        r, w = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
        return cls(r, w, on_push)

    async def _read(self) -> None:
        try:
            while True:
                data = await self.reader.read(1 << 16)
                if not data:
                    break
                for payload in self.decoder.feed(data):
                    f = wire.parse_payload(payload)
                    if f.kind == wire.PUSH:
                        if self.on_push is not None:
                            self.on_push(f)
                        continue
                    fut = self.waiting.pop(f.id, None)
                    if fut is not None and not fut.done():
                        fut.set_result((int(f.op), f.fields))
        except (OSError, ConnectionError, wire.TxmqError):
            pass
        finally:
            self.closed = True
            for fut in self.waiting.values():
                if not fut.done():
                    fut.set_exception(ConnectionError("connection lost"))
            self.waiting.clear()

    async def req(self, op: str, fields: dict[str, Any] | None = None, timeout: float = 10.0) -> tuple[int, dict[str, Any]]:
        if self.closed:
            raise ConnectionError("connection lost")
        rid = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.waiting[rid] = fut
        self.writer.write(wire.request(rid, op, fields or {}))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.waiting.pop(rid, None)

    async def ok(self, op: str, fields: dict[str, Any] | None = None, timeout: float = 10.0) -> dict[str, Any]:
        code, f = await self.req(op, fields, timeout)
        if code == wire.ErrorCode.SHUTTING_DOWN:
            raise BrokerGone(f"{op}: broker is shutting down")
        assert code == 0, (op, code, f)
        return f

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except Exception:
            pass
        self._task.cancel()
        try:
            await self._task
        except BaseException:
            pass


# ---- what the broker acknowledged ------------------------------------------------
@dataclass
class Ledger:
    plain: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # body -> (queue_id, queue_offset)
    intended: dict[bytes, str] = field(default_factory=dict)  # tx body -> commit | rollback | unknown
    halves: dict[str, bytes] = field(default_factory=dict)  # tx_id -> body, half acknowledged
    outcomes: dict[str, tuple[str, str]] = field(default_factory=dict)  # tx_id -> (outcome label, source), acknowledged
    # consumer group state
    seen: dict[tuple[str, int, int], bytes] = field(default_factory=dict)  # (topic, q, offset) -> body delivered
    committed: dict[tuple[str, int], int] = field(default_factory=dict)  # acknowledged commit_offset
    committed_bodies: set[bytes] = field(default_factory=set)  # processed and covered by an acknowledged commit
    redelivered: int = 0  # delivered again after a crash, allowed: processed but not committed
    violations: list[str] = field(default_factory=list)  # seen by the load itself (the consumer)
    counts: Counter = field(default_factory=Counter)  # requests and answers, for the report

    def record_outcome(self, tx_id: str, outcome: str, source: str) -> None:
        prev = self.outcomes.get(tx_id)
        if prev is not None and prev[0] != outcome:
            self.violations.append(f"tx {tx_id}: acknowledged as {prev} and then as {outcome} ({source})")
        self.outcomes.setdefault(tx_id, (outcome, source))


# ---- the load ------------------------------------------------------------------
class MixedLoad:
    def __init__(self, address: str, ledger: Ledger, tag: str, *, plain_workers: int = 3, tx_workers: int = 3,
                 operator: bool = True, consumer: bool = True, rng: random.Random | None = None) -> None:
        self.address = address
        self.ledger = ledger
        self.tag = tag
        self.plain_workers = plain_workers
        self.tx_workers = tx_workers
        self.operator = operator
        self.consumer = consumer
        self.rng = rng or random.Random()
        self.stop = asyncio.Event()
        self.clients: list[PipeClient] = []

    async def _client(self, on_push=None) -> PipeClient:
        c = await PipeClient.open(self.address, on_push)
        self.clients.append(c)
        return c

    async def run(self) -> None:
        """Run until stop is set or every connection is dead."""
        jobs = [self._plain(w) for w in range(self.plain_workers)] + [self._tx(w) for w in range(self.tx_workers)]
        jobs.append(self._checker())
        if self.operator:
            jobs.append(self._operator())
        if self.consumer:
            jobs.append(self._consume())
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, DEAD):
                raise r

    async def close(self) -> None:
        self.stop.set()
        for c in self.clients:
            await c.close()

    # -- plain sends
    async def _plain(self, w: int) -> None:
        c = await self._client()
        L = self.ledger
        for i in itertools.count():
            if self.stop.is_set():
                return
            base = f"p-{self.tag}-{w}-{i}"
            if i % 5 == 4:
                bodies = [f"{base}-{k}".encode() for k in range(4)]
                code, r = await c.req("send_batch", {"topic": PLAIN, "messages": [{"body": b} for b in bodies]}, timeout=10)
                if code == 0:
                    for b, row in zip(bodies, r["results"]):
                        L.plain[b] = (row["queue_id"], row["queue_offset"])
                    L.counts["plain_acked"] += len(bodies)
            else:
                body = base.encode()
                code, r = await c.req("send", {"topic": PLAIN, "body": body, "properties": {"TAGS": "p"}}, timeout=10)
                if code == 0:
                    L.plain[body] = (r["queue_id"], r["queue_offset"])
                    L.counts["plain_acked"] += 1
            if code != 0:
                L.counts[f"plain_error_{r.get('name')}"] += 1

    # -- transactions
    async def _tx(self, w: int) -> None:
        c = await self._client()
        L, rng = self.ledger, self.rng
        for i in itertools.count():
            if self.stop.is_set():
                return
            body = f"t-{self.tag}-{w}-{i}".encode()
            intended = rng.choices(["commit", "rollback", "unknown"], [4, 3, 3])[0]
            L.intended[body] = intended
            code, h = await c.req("send", {"topic": TXT, "body": body, "properties": {"TRAN_MSG": "true", "PGROUP": GROUP}}, timeout=10)
            if code != 0:
                L.counts[f"half_error_{h.get('name')}"] += 1
                continue
            L.halves[h["tx_id"]] = body
            L.counts["half_acked"] += 1
            if rng.random() < 0.3:
                continue  # the producer "crashed" before ending it: the check-back will
            state = intended if rng.random() < 0.8 else "unknown"
            code, r = await c.req("end_transaction", {"group": GROUP, "tx_id": h["tx_id"], "commit_log_offset": h["commit_log_offset"],
                                                       "half_offset": h["half_offset"], "state": state}, timeout=10)
            if code == 0 and r["outcome"] != "pending":
                L.record_outcome(h["tx_id"], r["outcome"], "producer")
                L.counts[f"end_{state}_acked"] += 1
            elif code != 0:
                L.counts[f"end_error_{r.get('name')}"] += 1

    # -- check-backs
    async def _checker(self) -> None:
        L = self.ledger
        answers: set[asyncio.Task] = set()
        pushes: asyncio.Queue = asyncio.Queue()
        c = await self._client(on_push=pushes.put_nowait)
        await c.ok("hello", {"producer_groups": [GROUP], "client_id": f"checker-{self.tag}"})

        async def answer(f: wire.Frame) -> None:
            pf = f.fields
            body = pf["message"]["body"]
            state = L.intended.get(body, "rollback")  # a body we never sent would be a bug; roll it back
            if body not in L.intended:
                L.violations.append(f"check-back for a body the load never sent: {body!r}")
            code, r = await c.req("end_transaction", {"group": GROUP, "tx_id": pf["tx_id"], "commit_log_offset": pf["commit_log_offset"],
                                                       "half_offset": pf["half_offset"], "state": state, "from_check": True}, timeout=10)
            L.counts["checks_received"] += 1
            if code == 0 and r["outcome"] != "pending":
                L.record_outcome(pf["tx_id"], r["outcome"], "check")
                L.counts[f"check_{state}_acked"] += 1

        while not self.stop.is_set() and not c.closed:
            try:
                f = await asyncio.wait_for(pushes.get(), 0.2)
            except asyncio.TimeoutError:
                continue
            t = asyncio.get_running_loop().create_task(answer(f))
            answers.add(t)
            t.add_done_callback(answers.discard)
        if answers:
            await asyncio.gather(*answers, return_exceptions=True)
        if c.closed:
            raise ConnectionError("checker connection lost")

    # -- the operator
    async def _operator(self) -> None:
        c = await self._client()
        L, rng = self.ledger, self.rng
        while not self.stop.is_set():
            await asyncio.sleep(0.25)
            r = await c.ok("tx_pending", {"group": GROUP, "min_age_ms": 700, "limit": 50})
            for row in r["transactions"][:4]:
                body = L.halves.get(row["tx_id"])
                if body is None:
                    continue  # its half was stored but never acknowledged to us
                want = L.intended[body]
                if want == "rollback" or (want == "commit" and rng.random() < 0.5):
                    continue  # leave these to the check-back
                action = "commit" if want == "commit" else "rollback"
                res = await c.ok("tx_resolve", {"action": action, "refs": [{"tx_id": row["tx_id"]}]})
                row_r = res["results"][0]
                L.counts[f"operator_{action}_{row_r['status']}"] += 1
                if row_r["status"] == "ok":
                    L.record_outcome(row["tx_id"], "committed" if action == "commit" else "rolled_back", "operator")

    # -- a consumer group
    async def _consume(self) -> None:
        c = await self._client()
        L = self.ledger
        pos: dict[tuple[str, int], int] = {}
        for topic in (PLAIN, TXT):
            fetched = (await c.ok("fetch_offsets", {"group": CGROUP, "topic": topic}))["offsets"]
            for q in range(QUEUES):
                got = fetched.get(str(q), 0)
                acked = L.committed.get((topic, q), 0)
                if got < acked:
                    L.violations.append(f"consumer offset of {topic}/{q} went back: acknowledged {acked}, broker has {got}")
                pos[(topic, q)] = got
        processed: dict[tuple[str, int], list[bytes]] = {k: [] for k in pos}
        pulls = 0
        while not self.stop.is_set():
            idle = True
            for key in list(pos):
                topic, q = key
                r = await c.ok("pull", {"topic": topic, "queue_id": q, "offset": pos[key], "max_count": 64})
                for m in r["messages"]:
                    idle = False
                    body, off = m["body"], m["queue_offset"]
                    if body in L.committed_bodies:
                        L.violations.append(f"{body!r} delivered again to {CGROUP} after its offset was committed ({topic}/{q}@{off})")
                    prev = L.seen.get((topic, q, off))
                    if prev is not None:
                        L.redelivered += 1
                        if prev != body:
                            L.violations.append(f"{topic}/{q}@{off} held {prev!r} and now {body!r}")
                    L.seen[(topic, q, off)] = body
                    processed[key].append(body)
                    L.counts["consumed"] += 1
                if r["messages"]:
                    pos[key] = r["next_offset"]
                pulls += 1
                if processed[key] and pulls % 3 == 0:
                    await c.ok("commit_offset", {"group": CGROUP, "topic": topic, "queue_id": q, "offset": pos[key]})
                    L.committed[key] = pos[key]
                    L.committed_bodies.update(processed[key])
                    processed[key] = []
                    L.counts["offsets_committed"] += 1
            if idle:
                await asyncio.sleep(0.02)


# ---- invariants ----------------------------------------------------------------
@dataclass
class Report:
    checks: int = 0  # invariant checks passed
    recovery: list[dict] = field(default_factory=list)

    def ok(self, cond: bool, msg: str) -> None:
        assert cond, msg
        self.checks += 1


def queue_records(reader: StoreReader, topic: str, queue_id: int):
    off = reader.queue_min_offset(topic, queue_id)
    while True:
        res = reader.get_messages(topic, queue_id, off, 2000, 64 << 20)
        if not res.records:
            return
        yield from res.records
        off = res.next_offset


def open_store_report(data: Path) -> dict:
    """Open the directory as the broker would (recovery), close it; what recovery reported."""
    s = Store(data)
    r = s.open()
    s.close()
    return {"dropped_bytes": r.dropped_bytes, "reason": r.reason, "truncated_at": r.truncated_at, "max_offset": r.max_offset}


def check_invariants(data: Path, L: Ledger, rep: Report, max_checks: int | None = None, open_store: bool = False) -> dict:
    """Compare a stopped broker's data directory with what it acknowledged. Returns figures.

    Reads through StoreReader (read-only), so the next broker start does the
    recovery itself; with open_store the directory is also opened (and
    recovered) as a Store, which must drop nothing.
    """
    rep.ok(not L.violations, "violations seen by the load: " + "; ".join(L.violations[:5]))
    if open_store:
        recovery = open_store_report(data)
        rep.recovery.append(recovery)
        # After SIGKILL or SIGTERM the kernel has every byte written; nothing may be dropped.
        rep.ok(recovery["dropped_bytes"] == 0, f"recovery dropped bytes: {recovery}")
    reader = StoreReader(data)
    try:
        # 1. plain messages: every acknowledged one at its acknowledged position, none twice
        stored: dict[bytes, tuple[int, int]] = {}
        dups = 0
        for q in range(QUEUES):
            for r in queue_records(reader, PLAIN, q):
                if r.body in stored:
                    dups += 1
                stored[r.body] = (q, r.queue_offset)
        rep.ok(dups == 0, f"{dups} plain messages stored twice")
        lost = [b for b, where in L.plain.items() if stored.get(b) != where]
        rep.ok(not lost, f"{len(lost)} acknowledged plain messages lost or moved, e.g. {lost[:3]}")

        # 2. transactions: the outcome index from the whole log
        idx = rebuild(reader)
        no_half = [t for t in L.halves if idx.outcome(t) is None]
        rep.ok(not no_half, f"{len(no_half)} acknowledged half messages lost, e.g. {no_half[:3]}")
        label = {Outcome.COMMITTED: "committed", Outcome.ROLLED_BACK: "rolled_back", Outcome.DISCARDED: "discarded", Outcome.PENDING: "pending"}
        wrong = [(t, o, label.get(idx.outcome(t))) for t, (o, _src) in L.outcomes.items() if label.get(idx.outcome(t)) != o]
        rep.ok(not wrong, f"{len(wrong)} acknowledged outcomes lost or changed, e.g. {wrong[:3]}")

        # 3. at most one outcome per transaction, and a commit record iff a commit op
        decisions: Counter = Counter()
        commit_ops: set[str] = set()
        for r in queue_records(reader, OP_TOPIC, 0):
            tx = r.properties.get("UNIQ_KEY")
            decisions[tx] += 1
            if r.tx_type == 2:
                commit_ops.add(tx)
        for r in queue_records(reader, DISCARD_TOPIC, 0):
            decisions[r.properties.get("UNIQ_KEY")] += 1
        twice = [t for t, n in decisions.items() if n > 1]
        rep.ok(not twice, f"{len(twice)} transactions with more than one outcome, e.g. {twice[:3]}")
        delivered: Counter = Counter()
        delivered_bodies: dict[str, bytes] = {}
        delivered_end: dict[str, int] = {}
        for q in range(QUEUES):
            for r in queue_records(reader, TXT, q):
                tx = r.properties.get("UNIQ_KEY")
                delivered[tx] += 1
                delivered_bodies[tx] = r.body
                delivered_end[tx] = r.commit_log_offset + r.size
        rep.ok(all(n == 1 for n in delivered.values()), "a committed transaction was delivered twice")
        rep.ok(commit_ops <= set(delivered), "a commit op without its committed message")
        # A kill can cut a write between pages (the kernel checks for fatal signals per page), so a commit
        # whose op record was torn away may end the log; the broker repairs it at its next start.
        torn_commits = set(delivered) - commit_ops
        rep.ok(all(delivered_end[t] == reader.max_offset for t in torn_commits),
               f"committed messages without a commit op inside the log: {sorted(torn_commits)[:3]}")
        # outcomes agree with what the producer's "database" says
        bad = []
        for tx, body in L.halves.items():
            out = idx.outcome(tx)
            want = L.intended[body]
            if out is Outcome.COMMITTED and (want != "commit" or delivered_bodies.get(tx) != body):
                bad.append((tx, want, "committed"))
            if out is Outcome.ROLLED_BACK and want == "commit":
                bad.append((tx, want, "rolled_back"))
        rep.ok(not bad, f"{len(bad)} transactions decided against their local outcome, e.g. {bad[:3]}")
        if max_checks is not None:
            early = [t for t, d in idx.decided.items() if d.outcome is Outcome.DISCARDED and d.checks < max_checks]
            rep.ok(not early, f"discarded before max checks: {early[:3]}")

        # 4. the check progress never passed an undecided transaction
        prog = json.loads((data / "txcheck.json").read_text()) if (data / "txcheck.json").exists() else {}
        half_p, op_p = int(prog.get("half_progress", 0)), int(prog.get("op_progress", 0))
        first = idx.first_undecided_half()
        rep.ok(first is None or half_p <= first, f"half progress {half_p} is past the pending half offset {first}")
        rep.ok(half_p <= reader.queue_max_offset(HALF_TOPIC, 0), "half progress past the half queue")
        past = [r.queue_offset for r in queue_records(reader, OP_TOPIC, 0)
                if r.queue_offset < op_p and int(r.body or b"-1") >= half_p]
        rep.ok(not past, f"op progress {op_p} passed op records of half offsets >= {half_p}: {past[:3]}")

        # 5. consumer offsets: every acknowledged commit is on disk
        offs = ConsumerOffsets(data / "offsets.json")
        back = [(k, v, offs.get(CGROUP, *k)) for k, v in L.committed.items() if (offs.get(CGROUP, *k) or 0) < v]
        rep.ok(not back, f"acknowledged consumer offsets lost: {back[:3]}")
        return {
            "pending": len(idx.pending), "half_progress": half_p, "op_progress": op_p,
            "discarded": sum(1 for d in idx.decided.values() if d.outcome is Outcome.DISCARDED),
            "torn_commits": len(torn_commits),
            "decided": Counter(label[d.outcome] for d in idx.decided.values()),
            "decided_by": Counter(d.decided_by for d in idx.decided.values()),
        }
    finally:
        reader.close()


def new_log_lines(path: Path, since: int) -> list[str]:
    with open(path, "rb") as f:
        f.seek(since)
        return f.read().decode(errors="replace").splitlines()


def check_restart_log(lines: list[str], rep: Report) -> int:
    """The restarted broker recovered without an error; returns how many torn tails it cut.

    A torn tail is possible: SIGKILL can stop a multi-page write between
    pages. What it held was never acknowledged (check_invariants proves that
    nothing acknowledged is missing), so it is counted, not failed.
    """
    rep.ok(any("event=store_opened" in ln for ln in lines), "no store_opened event in the broker log")
    bad = [ln for ln in lines if "Traceback" in ln or "level=error" in ln]
    rep.ok(not bad, f"the restart logged: {bad[:3]}")
    return sum("event=recovery_truncated" in ln for ln in lines)


async def check_live(address: str, offline: dict, rep: Report) -> None:
    """After a restart: the broker serves, and agrees with the offline view of its directory.

    No producer is connected yet, so the only change a check pass can have
    made since the restart is to discard transactions.
    """
    c = await PipeClient.open(address)
    try:
        await c.ok("heartbeat")
        off = await c.ok("tx_offsets")
        moved = off["discarded"] - offline["discarded"] + offline["torn_commits"]  # discarded, or repaired at start
        rep.ok(off["pending"] + moved == offline["pending"],
               f"broker says {off['pending']} pending (+{moved} discarded since), the log {offline['pending']}")
        rep.ok(off["half"]["progress"] >= offline["half_progress"], "half progress went back across a restart")
    finally:
        await c.close()


def record(suite: str, **figures: Any) -> str:
    """Print a suite's figures; with TXMQ_FAULT_REPORT=path also append them there as a JSON line."""
    import os
    import time

    line = f"{suite}: " + " ".join(f"{k}={v}" for k, v in figures.items())
    print("\n" + line)
    path = os.environ.get("TXMQ_FAULT_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"suite": suite, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **figures}, default=str) + "\n")
    return line
