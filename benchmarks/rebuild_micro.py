"""The transaction-index rebuild in one process: CPU per record read.

Builds a store with N transactions the way ``restart.py`` does (each a half
record, and for all but the pending ones a commit message and an op
record; 1% left pending), with no plain traffic in between, then runs
``txmq.broker.txindex.rebuild`` over it several times (no snapshot, no
check progress: every half and op record is read, as after a crash) and
prints the thread CPU time per record read (half + op + discard records)
for each run and the minimum.

The minimum over several runs of thread CPU time is the figure to compare
between two versions of the code: on this shared 2-core VM wall-clock
timings of the same code vary by 30% or more from minute to minute. The
log is built once and stays in the page cache, so the figure is the
rebuild's own CPU (``restart.py`` measures the whole broker start over a
5 GB log, cold cache included).

    .venv/bin/python benchmarks/rebuild_micro.py [--transactions 200000] [--runs 5] [--reader store|reader]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import data_disk_dir  # noqa: E402
from restart import TX_BODY, _transactions  # noqa: E402

from txmq.broker.txindex import rebuild  # noqa: E402
from txmq.constants import DISCARD_TOPIC, HALF_TOPIC, OP_TOPIC  # noqa: E402
from txmq.store import Store, StoreReader  # noqa: E402


def build(data_dir: Path, transactions: int, pending: int, chunk: int = 5000) -> tuple[int, int]:
    """Append the transactions in chunks (halves, then their ends); returns (records read by a rebuild, pending)."""
    pending_every = transactions // pending if pending else 0
    body = b"t" * TX_BODY
    left = 0
    with Store(data_dir) as store:
        for first in range(0, transactions, chunk):
            left += _transactions(store, first, min(chunk, transactions - first), pending_every, body)
        store.sync()
        records = sum(store.queue_max_offset(t, 0) for t in (HALF_TOPIC, OP_TOPIC, DISCARD_TOPIC))
    return records, left


def measure(data_dir: Path, records: int, runs: int, reader: str, rebuild_fn: Callable = rebuild) -> tuple[list[float], object]:
    """Thread CPU per record (us) of each of `runs` rebuilds, and the last index built."""
    per_record = []
    idx = None
    opener = Store if reader == "store" else StoreReader
    with opener(data_dir) as r:
        for _ in range(runs):
            idx = None
            gc.collect()
            t = time.thread_time()
            idx = rebuild_fn(r, 0, 0)
            per_record.append((time.thread_time() - t) / records * 1e6)
    return per_record, idx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transactions", type=int, default=200_000, help="transactions in the log (default 200,000)")
    ap.add_argument("--pending", type=int, default=None, help="of which left pending (default 1%%)")
    ap.add_argument("--runs", type=int, default=5, help="rebuilds to time (default 5)")
    ap.add_argument("--reader", choices=["store", "reader"], default="store",
                    help="rebuild through a Store (the broker) or a StoreReader (the offline CLI)")
    a = ap.parse_args()
    pending = a.transactions // 100 if a.pending is None else a.pending
    gc.set_threshold(50_000, 50, 100)  # as `txmq broker start` sets it
    tmp = Path(tempfile.mkdtemp(prefix="txmq-rebuildmicro-", dir=data_disk_dir()))
    try:
        records, left = build(tmp / "data", a.transactions, pending)
        per_record, idx = measure(tmp / "data", records, a.runs, a.reader)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"rebuild, {a.transactions:,} transactions ({left:,} pending), {records:,} records, via {a.reader}: "
          f"thread CPU per record: min {min(per_record):.2f} us (runs: {' '.join(f'{x:.2f}' for x in per_record)}); "
          f"index: {len(idx.pending):,} pending, {len(idx.decided):,} decided")  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
