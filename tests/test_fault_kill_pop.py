"""Repeated SIGKILL of a broker while RocketMQ POP consumers acknowledge out of order.

A sync-flush broker subprocess with --rocketmq-port takes native sends to a
topic of four queues; consumers of one group receive them over gRPC
(ReceiveMessage, txmq's generated stubs) and acknowledge them in shuffled
batches (AckMessage), leaving one in ten unacknowledged, so acknowledgements
pile up past each queue's committed offset. After a random 1.2-2.5 s the
broker is SIGKILLed and restarted, and the consumers go on.

What must hold: a message whose acknowledgement was answered more than one
flush interval before the kill is not delivered again (acks.json,
docs/reliability.md); one answered later may be (at-least-once); a message
is never delivered again in the run that acknowledged it; every sent
message is delivered at least once. After the last cycle the group is
drained, the broker stopped with SIGTERM and started again: nothing
acknowledged comes back. Short run: 3 cycles; TXMQ_FAULT_LONG=1: 15.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
from dataclasses import dataclass, field

import pytest

grpc = pytest.importorskip("grpc", reason="the rocketmq extra (grpcio) is not installed")

from brokerproc import BrokerProcess, free_port  # noqa: E402
from conftest import arun  # noqa: E402
from faultload import DEAD, PipeClient, record  # noqa: E402

from txmq.broker.rocketmq import missing_dependency  # noqa: E402

if missing_dependency():
    pytest.skip(missing_dependency(), allow_module_level=True)

from txmq.broker.rocketmq.pb import definition_pb2 as d  # noqa: E402
from txmq.broker.rocketmq.pb import service_pb2 as s  # noqa: E402
from txmq.broker.rocketmq.pb import service_pb2_grpc as sg  # noqa: E402

pytestmark = [pytest.mark.fault, pytest.mark.slow]

LONG = os.environ.get("TXMQ_FAULT_LONG") == "1"
CYCLES = int(os.environ.get("TXMQ_FAULT_CYCLES", "15" if LONG else "3"))
FLUSH_INTERVAL_S = 0.5
TOPIC = "pop-kill"
GROUP = "pop-kill-consumers"
INVISIBLE_S = 3.0
SKIP_ACK = 0.1  # share of received messages left unacknowledged (received again after INVISIBLE_S)
META = (("x-mq-client-id", "pop-kill@1"), ("x-mq-language", "PYTHON"))
STOPPED = DEAD + (grpc.aio.AioRpcError,)


@dataclass
class PopLedger:
    sent: set[bytes] = field(default_factory=set)  # sends the broker acknowledged
    delivered: set[bytes] = field(default_factory=set)
    acked: dict[bytes, tuple[int, float]] = field(default_factory=dict)  # body -> (broker run, monotonic time the ack was answered)
    kills: dict[int, float] = field(default_factory=dict)  # broker run -> monotonic time just before its SIGKILL
    acked_total: int = 0  # acknowledgements answered OK
    acked_bodies: set[bytes] = field(default_factory=set)  # messages acknowledged at least once
    redelivered_after_ack: int = 0  # acknowledged, then delivered by a later run
    redelivered_late_ack: int = 0  # of those: answered within one flush interval of the kill (allowed)
    oldest_redelivered_s: float = 0.0  # the longest an acknowledgement delivered again was answered before its kill
    lost_acks: list[str] = field(default_factory=list)  # answered earlier than that, delivered again: the failures
    same_run: list[str] = field(default_factory=list)  # delivered again by the run that acknowledged it: never allowed

    def on_delivery(self, body: bytes, run: int) -> None:
        self.delivered.add(body)
        prev = self.acked.pop(body, None)
        if prev is None:
            return
        ack_run, t_ack = prev
        if ack_run == run:
            self.same_run.append(body.decode())
            return
        self.redelivered_after_ack += 1
        age = self.kills.get(ack_run, float("inf")) - t_ack
        self.oldest_redelivered_s = max(self.oldest_redelivered_s, age)
        if age > FLUSH_INTERVAL_S:
            self.lost_acks.append(f"{body.decode()} (ack answered {age:.3f} s before the kill of run {ack_run})")
        else:
            self.redelivered_late_ack += 1


def receive_request(batch: int, poll_s: float) -> s.ReceiveMessageRequest:
    req = s.ReceiveMessageRequest(batch_size=batch)
    req.group.name = GROUP
    req.message_queue.topic.name = TOPIC
    req.message_queue.id = -1
    req.filter_expression.type = d.TAG
    req.filter_expression.expression = "*"
    req.invisible_duration.FromMilliseconds(int(INVISIBLE_S * 1000))
    req.long_polling_timeout.FromMilliseconds(int(poll_s * 1000))
    return req


async def receive(stub: sg.MessagingServiceStub, batch: int = 32, poll_s: float = 0.5) -> list[d.Message]:
    frames = [r async for r in stub.ReceiveMessage(receive_request(batch, poll_s), timeout=poll_s + 5, metadata=META)]
    return [r.message for r in frames if r.HasField("message")]


async def receive_while_alive(stub: sg.MessagingServiceStub, broker: BrokerProcess, batch: int = 32, poll_s: float = 0.5) -> list[d.Message]:
    """A receive; while the broker process lives, a refused connection (its gRPC port is bound just after the native one) is retried."""
    while True:
        try:
            return await receive(stub, batch, poll_s)
        except grpc.aio.AioRpcError:
            if broker.proc is None or broker.proc.poll() is not None:
                raise
            await asyncio.sleep(0.05)


async def ack(stub: sg.MessagingServiceStub, msgs: list[d.Message]) -> list[bytes]:
    """The bodies whose acknowledgement the broker answered OK."""
    req = s.AckMessageRequest()
    req.group.name = GROUP
    req.topic.name = TOPIC
    for m in msgs:
        req.entries.add(receipt_handle=m.system_properties.receipt_handle, message_id=m.system_properties.message_id)
    r = await stub.AckMessage(req, timeout=5, metadata=META)
    return [m.body for m, e in zip(msgs, r.entries) if e.status.code == d.Code.OK]


class PopLoad:
    """One broker run: a native producer and consumers acknowledging out of order, until the broker goes away."""

    def __init__(self, broker: BrokerProcess, rocketmq: str, ledger: PopLedger, run: int, rng: random.Random) -> None:
        self.broker = broker
        self.rocketmq = rocketmq
        self.L = ledger
        self.run = run
        self.rng = rng

    async def go(self) -> None:
        results = await asyncio.gather(self._produce(), *(self._consume(w) for w in range(3)), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, STOPPED):
                raise r

    async def _produce(self) -> None:
        c = await PipeClient.open(self.broker.address)
        try:
            for i in itertools.count():
                bodies = [f"r{self.run}-{i}-{k}".encode() for k in range(16)]
                code, _ = await c.req("send_batch", {"topic": TOPIC, "messages": [{"body": b} for b in bodies]})
                if code == 0:
                    self.L.sent.update(bodies)
                await asyncio.sleep(0.01)
        finally:
            await c.close()

    async def _consume(self, w: int) -> None:
        async with grpc.aio.insecure_channel(self.rocketmq) as ch:
            stub = sg.MessagingServiceStub(ch)
            while True:
                msgs = await receive_while_alive(stub, self.broker)
                for m in msgs:
                    self.L.on_delivery(m.body, self.run)
                keep = [m for m in msgs if self.rng.random() >= SKIP_ACK]
                self.rng.shuffle(keep)
                for i in range(0, len(keep), 8):
                    done = await ack(stub, keep[i : i + 8])
                    t = time.monotonic()
                    for body in done:
                        self.L.acked[body] = (self.run, t)
                    self.L.acked_bodies.update(done)
                    self.L.acked_total += len(done)


async def drain(broker: BrokerProcess, rocketmq: str, ledger: PopLedger, run: int, quiet_s: float = 2.0) -> int:
    """Receive and acknowledge everything left, until nothing came for quiet_s; how many were received."""
    n = 0
    async with grpc.aio.insecure_channel(rocketmq) as ch:
        stub = sg.MessagingServiceStub(ch)
        last = time.monotonic()
        while time.monotonic() - last < quiet_s:
            msgs = await receive_while_alive(stub, broker, batch=256, poll_s=0.5)
            if not msgs:
                continue
            last = time.monotonic()
            n += len(msgs)
            for m in msgs:
                ledger.on_delivery(m.body, run)
            done = await ack(stub, msgs)
            t = time.monotonic()
            for body in done:
                ledger.acked[body] = (run, t)
    return n


def test_acknowledged_pop_messages_are_not_delivered_again_after_sigkill(tmp_path):
    seed = int(os.environ.get("TXMQ_FAULT_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    rport = free_port()
    rocketmq = f"127.0.0.1:{rport}"
    broker = BrokerProcess(tmp_path / "data", "--flush", "sync", "--flush-interval", f"{int(FLUSH_INTERVAL_S * 1000)}ms",
                           "--rocketmq-port", str(rport)).start()
    L = PopLedger()
    t0 = time.monotonic()
    try:
        for run in range(CYCLES):
            async def one_cycle() -> None:
                task = asyncio.create_task(PopLoad(broker, rocketmq, L, run, rng).go())
                await asyncio.sleep(rng.uniform(1.2, 2.5))
                L.kills[run] = time.monotonic()
                broker.kill()
                await asyncio.wait_for(task, 20)

            arun(one_cycle())
            broker.start()
        last = CYCLES
        drained = arun(drain(broker, rocketmq, L, last))
        assert broker.stop() == 0
        broker.start()
        after_stop = arun(drain(broker, rocketmq, L, last + 1, quiet_s=1.5))
        assert broker.stop() == 0
    finally:
        broker.kill()
    summary = record(
        "pop_sigkill", cycles=CYCLES, seed=seed, took_s=round(time.monotonic() - t0, 1), sent=len(L.sent),
        acks_answered=L.acked_total, messages_acked=len(L.acked_bodies), redelivered_after_ack=L.redelivered_after_ack,
        redelivered_ack_within_flush_interval=L.redelivered_late_ack, redelivered_ack_older_than_flush_interval=len(L.lost_acks),
        oldest_redelivered_ack_s=round(L.oldest_redelivered_s, 3),
        drained=drained, delivered_after_sigterm=after_stop)
    assert L.acked_total > 200 * CYCLES, summary  # the load did acknowledge, out of order
    assert not L.same_run, f"delivered again by the run that acknowledged them: {L.same_run[:5]}"
    assert not L.lost_acks, f"{len(L.lost_acks)} acknowledged messages delivered again after a kill, e.g. {L.lost_acks[:5]}; {summary}"
    missing = L.sent - L.delivered
    assert not missing, f"{len(missing)} sent messages never delivered, e.g. {sorted(missing)[:5]}"
    assert after_stop == 0, f"{after_stop} messages delivered again after a clean stop and start"
