"""`txmq bench tx-client` (`txmq.client.bench_client`): transactions through the client library a user calls, not the wire-level generator.

N `TransactionProducer`s (one connection each, ``--connections``), each
running ``--inflight`` loops of ``await send_in_transaction(...)`` back to
back, with a listener that answers at once (by ``--mix``; unknowns are
answered commit by the check-back). ``--end pipelined`` (the default, as
the library does) returns once the end request is queued; ``--end wait``
waits for the end's reply in each call.

Latencies per transaction: ``call`` is what the caller waits for
(`send_in_transaction` from call to return), ``tx`` is from the call to the
end's reply (the whole transaction, what the broker has decided by then).
Throughput counts transactions whose end was answered, and the clock
stops after the last reply (the producers' ``flush``).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Callable

from .bench import BenchConfig, Stats


class ClientBench:
    def __init__(self, cfg: BenchConfig, end: str = "pipelined", progress: Callable[[int, int], None] | None = None,
                 busy_poll: float = 0.0) -> None:
        if end not in ("pipelined", "wait"):
            raise ValueError("end must be pipelined or wait")
        self.cfg = cfg
        self.end = end
        self.busy_poll = busy_poll  # the producers' Client(busy_poll=...)
        self.progress = progress
        self.stats = Stats(("call", "tx"))
        self._states = list(cfg.mix)
        self._weights = [cfg.mix[s] for s in self._states]

    async def run(self) -> dict[str, Any]:
        from . import LocalTransactionState, Message, TransactionProducer

        cfg, st = self.cfg, self.stats
        states = {"commit": LocalTransactionState.COMMIT_MESSAGE, "rollback": LocalTransactionState.ROLLBACK_MESSAGE,
                  "unknown": LocalTransactionState.UNKNOW}
        rng = random.Random(1)
        pick = (lambda: states[self._states[0]]) if len(self._states) == 1 else \
            (lambda: states[rng.choices(self._states, self._weights)[0]])

        class Listener:
            def execute_local_transaction(self, message: Any, arg: Any) -> Any:
                return pick()

            def check_local_transaction(self, message: Any) -> Any:
                return LocalTransactionState.COMMIT_MESSAGE

        producers = [await TransactionProducer(cfg.group, Listener(), cfg.address, token=cfg.token, busy_poll=self.busy_poll).start()
                     for _ in range(cfg.connections)]
        body = b"x" * cfg.size
        wait_end = self.end == "wait"
        loop = asyncio.get_running_loop()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        deadline = t0 + cfg.duration if cfg.duration else None
        budget = [cfg.messages or 0]
        call_lat, tx_lat = st.lat["call"], st.lat["tx"]
        perf = time.perf_counter

        def ended(started: float, fut: asyncio.Future) -> None:
            if fut.cancelled() or fut.exception() is not None:
                st.error(type(fut.exception()).__name__ if not fut.cancelled() else "cancelled")
                return
            tx_lat.append(perf() - started)
            st.done += 1
            outcome = fut.result() or "not_delivered"
            st.outcomes[outcome] = st.outcomes.get(outcome, 0) + 1

        async def worker(tp: Any) -> None:
            msg = Message(cfg.topic, body)
            while True:
                if deadline is not None:
                    if perf() >= deadline:
                        return
                else:
                    if budget[0] <= 0:
                        return
                    budget[0] -= 1
                st.issued += 1
                started = perf()
                try:
                    r = await tp.send_in_transaction(msg, wait_end=wait_end)
                except Exception as exc:  # a refused half: counted, the run goes on
                    st.error(type(exc).__name__)
                    continue
                call_lat.append(perf() - started)
                if r.end is not None:
                    r.end.add_done_callback(lambda f, s=started: ended(s, f))

        reporter = loop.create_task(st.report_progress(self.progress, cfg.messages or 0)) if self.progress else None
        await asyncio.gather(*(worker(tp) for tp in producers for _ in range(cfg.inflight)))
        for tp in producers:
            await tp.flush()
        elapsed = time.perf_counter() - t0
        client_cpu = time.process_time() - cpu0
        if reporter is not None:
            reporter.cancel()
        for tp in producers:
            await tp.close()
        return {
            "mode": "tx-client", "end": self.end, "address": cfg.address, "connections": cfg.connections,
            "inflight": cfg.inflight, "size": cfg.size, "batch": 1, "rate": None, "mix": cfg.mix,
            **st.results(elapsed, "transactions/s"),
            "client_cpu_s": round(client_cpu, 3),  # this process: the producers, listener and event loop
        }


__all__ = ["ClientBench"]
