"""The check pass in one process: the broker's own CPU per check-back, without the network.

Starts a broker in-process (``txmq.broker.testing.running_broker``, async
flush, a manual clock), stores N pending transactions through
``TransactionService.send_half``, registers a producer connection that
drops what it is sent, and runs K check passes over all of them (each pass
re-appends every half message with its check count + 1 and builds its
``check_transaction`` push). Prints the event-loop thread's CPU time per
check-back for each pass and the minimum.

The minimum over several passes of thread CPU time is the figure to compare
between two versions of the code: on this shared 2-core VM wall-clock
timings of the same code vary by 30% or more from minute to minute, and
the whole-system benchmark (``check_pass.py``) adds the producer and the
send load competing for the second core.

    .venv/bin/python benchmarks/check_micro.py [--pending 50000] [--passes 8] [--batch 128]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import data_disk_dir, install_uvloop  # noqa: E402

from txmq.broker.clock import ManualClock  # noqa: E402
from txmq.broker.testing import running_broker  # noqa: E402


class DroppingProducer:
    """A producer connection of the group that takes every push and drops it."""

    conn_id = -1
    takes_frames = True  # as a native producer's connection: the check pass's spliced frames

    def __init__(self) -> None:
        self.frames = 0

    def writable(self) -> bool:
        return True

    def push(self, op: str, fields: dict) -> None:
        self.frames += 1

    def send_frame(self, frame: bytes) -> None:
        self.frames += 1


async def measure(a: argparse.Namespace) -> list[float]:
    clock = ManualClock()
    tmp = Path(tempfile.mkdtemp(prefix="txmq-checkmicro-", dir=data_disk_dir()))
    try:
        async with running_broker(tmp / "data", clock=clock, check_interval_s=3600, flush="async", check_batch=a.batch) as b:
            core = b.core
            body = b"x" * a.size
            for i in range(0, a.pending, 2000):
                n = min(2000, a.pending - i)
                await asyncio.gather(*[core.tx.send_half("bench", None, body, {"PGROUP": "bench"}, int(clock() * 1000)) for _ in range(n)])
            producer = DroppingProducer()
            core.registry.register("bench", producer)
            per_check = []
            for _ in range(a.passes):
                clock.advance(10)  # past the transaction timeout
                core.check.progress.half = 0  # every pass walks the whole half queue again
                t = time.thread_time()
                r = await core.check.run_pass()
                per_check.append((time.thread_time() - t) / a.pending * 1e6)
                if r["checked"] != a.pending:
                    raise SystemExit(f"a pass checked {r['checked']} of {a.pending}: {r}")
            return per_check
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pending", type=int, default=50_000, help="pending transactions (default 50,000)")
    ap.add_argument("--passes", type=int, default=8, help="passes to run (at most 14: max checks is 15)")
    ap.add_argument("--batch", type=int, default=128, help="check_batch (halves per pass batch)")
    ap.add_argument("--size", type=int, default=256, help="body bytes")
    a = ap.parse_args()
    if not 1 <= a.passes <= 14:
        ap.error("--passes must be between 1 and 14")
    gc.set_threshold(50_000, 50, 100)  # as `txmq broker start` sets it
    install_uvloop()
    per_check = asyncio.run(measure(a))
    print(f"check pass, {a.pending:,} pending, event-loop thread CPU per check-back: min {min(per_check):.2f} us "
          f"(passes: {' '.join(f'{x:.1f}' for x in per_check)})")


if __name__ == "__main__":
    main()
