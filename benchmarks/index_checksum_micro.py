"""What the index file's row checksums cost, in one process: per row flushed, per pending row loaded, per start, per lookup.

Writes ``--rows`` rows (``--pending`` of them pending, the rest committed)
into a new ``txindex.db`` with ``TxDatabase.flush`` in batches of 15,000
(about a second of decisions at 15,000 tx/s), then times, as thread CPU
(``time.thread_time``; the minimum of ``--repeat`` runs, since wall-clock
timings on a shared 2-core VM vary by 30% from minute to minute):

- the checksum alone per row (msgpack + CRC-32, what a flush adds), next to
  the whole flush per row;
- loading the pending rows a start loads (``load_pending`` over
  ``pending_rows``, checked), next to the same rows read unchecked;
- a start's check of the other rows (``check_rows`` with the broker's
  ``START_CHECK_NEWEST`` and ``START_CHECK_SAMPLED``);
- a start's check of the log's last ``START_CHECK_DECISIONS`` decisions
  against their rows (``check_decisions``), on a store of ``--decisions``
  committed transactions written as ``restart.py`` writes them;
- a lookup by id (``by_tx_id``, checked), next to the same query unchecked.

    .venv/bin/python benchmarks/index_checksum_micro.py [--rows 1000000] [--pending 100000] [--decisions 20000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import itertools
import random
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import msgpack  # noqa: E402
from benchlib import data_disk_dir  # noqa: E402

from restart import _transactions  # noqa: E402

from txmq.broker.transactions.keeper import START_CHECK_DECISIONS, START_CHECK_NEWEST, START_CHECK_SAMPLED  # noqa: E402
from txmq.broker.transactions.index import TxIndex, log_position, rebuild  # noqa: E402
from txmq.broker.transactions.indexcheck import check_decisions  # noqa: E402
from txmq.broker.transactions.indexfile import COLUMNS, DB_FILE, TxDatabase  # noqa: E402
from txmq.store import Store  # noqa: E402

BATCH = 15_000
_pack = msgpack.Packer(use_bin_type=True).pack


def rows(n: int, pending: int) -> list[tuple]:
    out = []
    blob = _pack([0, 1_712_345_678_901, 1_712_345_678_950, 1_712_345_678_950, None])
    for i in range(n):
        origin = 1000 + i * 600
        tx_id = f"{0x7F3A9B2C1D4E5F60:016X}{i:016X}"
        if i % (n // pending if pending else n + 1) == 0 and pending:
            out.append((origin, tx_id, 0, None, None, i, origin, "shop", "orders", 0, blob))
        else:
            out.append((origin, tx_id, 1, 1_712_345_679_000 + i, "producer", i, origin + 400, "shop", "orders", 0, None))
    return out


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return min(times)


def decisions_check(tmp: Path, n: int, repeat: int) -> float:
    """Thread CPU of a start's check of the last START_CHECK_DECISIONS op records against their rows."""
    data = tmp / "store"
    store = Store(data)
    store.open()
    try:
        for first in range(0, n, 5000):
            _transactions(store, first, min(5000, n - first), 0, b"t" * 200)
        idx = rebuild(store)
        db = TxDatabase(data / DB_FILE)
        meta = log_position(store)
        db.flush([d.db_row(t) for t, d in idx.decided.items()], meta)
        first = meta["queues"]["op"] - START_CHECK_DECISIONS

        def check() -> None:
            assert not list(check_decisions(db, store, meta["applied_to"], 0, first=first, damaged_rows=True))

        took = best(check, repeat)
        db.close()
        return took
    finally:
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--pending", type=int, default=100_000)
    ap.add_argument("--decisions", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="txmq-indexcrc-", dir=data_disk_dir()))
    try:
        data = rows(a.rows, a.pending)
        db = TxDatabase(tmp / DB_FILE)
        meta = {"applied_to": 1, "queues": {"op": 0, "discard": 0, "half": 0}, "boundary": None}
        t0 = time.thread_time()
        for i in range(0, len(data), BATCH):
            db.flush(data[i:i + BATCH], meta)
        flush_s = time.thread_time() - t0
        sample = data[:BATCH]
        crc_s = best(lambda: [(*r, zlib.crc32(_pack(r))) for r in sample], a.repeat)
        plain_s = best(lambda: [(*r, 0) for r in sample], a.repeat)
        n_pending = sum(1 for r in data if r[2] == 0)

        def load() -> None:
            TxIndex().load_pending(db.pending_rows())

        def load_unchecked() -> None:
            cur = db.conn.execute(f"SELECT {', '.join(COLUMNS)} FROM tx WHERE state = 0 ORDER BY half_offset")
            TxIndex().load_pending(itertools.chain.from_iterable(iter(lambda: cur.fetchmany(4096), [])))

        load_s = best(load, a.repeat)
        load_plain_s = best(load_unchecked, a.repeat)
        check_s = best(lambda: db.check_rows(START_CHECK_NEWEST, START_CHECK_SAMPLED), a.repeat)
        ids = [r[1] for r in random.sample(data, 10_000)]
        lookup_s = best(lambda: [db.by_tx_id(t) for t in ids], a.repeat)
        q = f"SELECT {', '.join(COLUMNS)} FROM tx WHERE tx_id = ? ORDER BY origin DESC LIMIT 1"
        lookup_plain_s = best(lambda: [db.conn.execute(q, (t,)).fetchone() for t in ids], a.repeat)
        decisions_s = decisions_check(tmp, a.decisions, a.repeat)
        size = (tmp / DB_FILE).stat().st_size + sum(p.stat().st_size for p in tmp.glob(f"{DB_FILE}-*"))
        db.close()
        us = 1e6
        print(f"rows {a.rows:,} ({n_pending:,} pending), file {size / a.rows:.0f} bytes/row")
        print(f"flush                {flush_s / a.rows * us:6.2f} us/row (thread CPU, batches of {BATCH:,})")
        print(f"  checksum           {(crc_s - plain_s) / len(sample) * us:6.2f} us/row of it")
        print(f"start: load pending  {load_s / n_pending * us:6.2f} us/row checked, {load_plain_s / n_pending * us:6.2f} unchecked "
              f"({(load_s - load_plain_s) * 1000:.0f} ms for {n_pending:,})")
        print(f"start: check_rows    {check_s * 1000:6.1f} ms ({START_CHECK_NEWEST:,} newest + {START_CHECK_SAMPLED:,} sampled)")
        print(f"start: decisions     {decisions_s * 1000:6.1f} ms (the last {START_CHECK_DECISIONS:,} of {a.decisions:,})")
        print(f"lookup by id         {lookup_s / len(ids) * us:6.2f} us checked, {lookup_plain_s / len(ids) * us:6.2f} unchecked")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
