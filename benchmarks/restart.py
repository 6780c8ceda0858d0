"""Restart time of a broker over a large commit log (default 5 GB).

1. Builds a data directory with txmq.store.Store directly, fast: plain
   messages with large bodies (``--plain-body``, 64 KiB) in large batches,
   interleaved with transactions (``--transactions``, default 1,000,000)
   written as the broker writes them (broker/transactions/service.py): a half message in the
   half topic, then the committed message in its real topic and the op
   record in the op topic; ``--pending`` of them (1%) are left without an
   end, so the index keeps some pending. The store is closed cleanly
   (checkpoint written), as after a clean shutdown. No broker has run on
   it, so there is no transaction index file (``txindex.db``): the first
   start rebuilds the index from the log, reading every half and op record
   (the worst case).
2. Times ``txmq broker start`` from spawn until the port accepts, until a
   ``broker_info`` request is answered (plain traffic is served: the broker
   binds its port before it opens the store, so only a reply says it
   serves) and until a ``tx_offsets`` request is answered (transactional
   operations wait for the transaction index: the pending rows loaded from
   ``txindex.db`` and the transactional records written after its last
   flush read from the log, or, with no usable index file, the whole index
   rebuilt from the log). Three starts:

   - no index file (deleted first: ``txindex.db``, ``-wal``, ``-shm``), page
     cache warm from the build: rebuilt from the log;
   - after that broker's clean shutdown (its index file, flushed at the
     stop), after the data directory's pages were dropped (posix_fadvise
     DONTNEED on every file; needs no privilege), a cold start as after a
     reboot: the index file loaded, nothing read after it;
   - after a crash (``--after-flush`` transactions appended with the broker
     stopped, with the same builder, after the index file's last flush; the
     broker flushes it every second, so a crash leaves about a second of
     records behind it), page cache warm: the index file loaded, then the
     records appended after its last flush read from the log.

    .venv/bin/python benchmarks/restart.py [--gigabytes 5] [--transactions 1000000] [--after-flush 30000] [-o json] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402
from benchlib import BrokerProc, command_line, data_disk_dir, machine_info, proc_status, save_result  # noqa: E402

from txmq import wire  # noqa: E402
from txmq.broker.transactions.indexfile import DB_FILE, remove_db  # noqa: E402
from txmq.constants import (  # noqa: E402
    HALF_TOPIC, OP_TAG, OP_TOPIC, PROP_CHECK_TIMES, PROP_DECIDED_BY, PROP_HALF_CL_OFFSET, PROP_PGROUP, PROP_PREPARED_QUEUE_OFFSET,
    PROP_REAL_QID, PROP_REAL_TOPIC, PROP_TAGS, PROP_TRAN_MSG, PROP_UNIQ_KEY,
)
from txmq.store import Message, Store, TxType  # noqa: E402

GROUP, TOPIC, QUEUES, TX_BODY = "bench", "bench", 4, 256
PLAIN_BATCH_BYTES = 16 << 20


# ---- building the log ----------------------------------------------------------------------
def _transactions(store: Store, first: int, count: int, pending_every: int, body: bytes, group: str = GROUP,
                  born_ts: int | None = None) -> int:
    """Append `count` transactions of producer group `group`; every pending_every-th one is left pending.

    Keys (the transaction ids) are first .. first+count-1 in hex. born_ts is
    the producer's timestamp of the half messages (ms; default now). Returns
    how many were left pending.
    """
    now = int(time.time() * 1000)
    born = now if born_ts is None else born_ts
    halves = []
    for i in range(first, first + count):
        q = i % QUEUES
        halves.append(Message(HALF_TOPIC, 0, TxType.PREPARED, born, {
            PROP_UNIQ_KEY: f"{i:032X}", PROP_TRAN_MSG: "true", PROP_PGROUP: group, PROP_REAL_TOPIC: TOPIC, PROP_REAL_QID: str(q)}, body))
    results = store.append(halves)
    ends, left = [], 0
    for i, h, r in zip(range(first, first + count), halves, results):
        if pending_every and i % pending_every == 0:
            left += 1
            continue
        props = {k: v for k, v in h.properties.items() if k != PROP_TRAN_MSG}
        props[PROP_PREPARED_QUEUE_OFFSET] = str(r.queue_offset)
        ends.append(Message(TOPIC, i % QUEUES, TxType.COMMIT, now, props, body, prepared_offset=r.commit_log_offset))
        ends.append(Message(OP_TOPIC, 0, TxType.COMMIT, now, {
            PROP_TAGS: OP_TAG, PROP_UNIQ_KEY: h.properties[PROP_UNIQ_KEY], PROP_PGROUP: group, PROP_REAL_TOPIC: TOPIC,
            PROP_HALF_CL_OFFSET: str(r.commit_log_offset), PROP_DECIDED_BY: "producer", PROP_CHECK_TIMES: "0"},
            str(r.queue_offset).encode(), prepared_offset=r.commit_log_offset))
    if ends:
        store.append(ends)
    return left


def build(data_dir: Path, gigabytes: float, transactions: int, pending: int, plain_body: int) -> dict[str, Any]:
    target = int(gigabytes * 1e9)
    t0 = time.perf_counter()
    body = os.urandom(plain_body)
    tx_body = b"t" * TX_BODY
    per_batch = max(1, PLAIN_BATCH_BYTES // plain_body)
    # Spread the transactions evenly: one chunk after each plain batch.
    est_tx_bytes = transactions * 3 * 420
    chunks = max(1, int((target - est_tx_bytes) / (per_batch * plain_body)))
    chunk = max(1, -(-transactions // chunks))
    pending_every = transactions // pending if pending else 0
    plain = tx_done = left = 0
    last_report = t0
    with Store(data_dir) as store:
        now = int(time.time() * 1000)
        while store.max_offset < target or tx_done < transactions:
            if store.max_offset < target:
                store.append([Message(TOPIC, plain % QUEUES, TxType.NORMAL, now, {}, body) for _ in range(per_batch)])
                plain += per_batch
            if tx_done < transactions:
                k = min(chunk, transactions - tx_done)
                left += _transactions(store, tx_done, k, pending_every, tx_body)
                tx_done += k
            if time.perf_counter() - last_report > 5:
                last_report = time.perf_counter()
                print(f"  {store.max_offset / 1e9:.2f} GB, {tx_done:,} transactions", file=sys.stderr, flush=True)
            if store.max_offset > 4 * target + (1 << 30):
                break  # the transactions alone would overshoot absurdly: a tiny --gigabytes
        store.sync()
        size = store.max_offset
    segments = len(list((data_dir / "commitlog").iterdir()))
    return {"log_bytes": size, "log_gib": round(size / 2**30, 3), "segments": segments, "transactions": tx_done, "pending": left,
            "plain": plain, "plain_body": plain_body, "records": plain + tx_done * 3 - left * 2, "build_s": round(time.perf_counter() - t0, 1)}


# ---- restarting --------------------------------------------------------------------------------------
def drop_cache(root: Path) -> None:
    """Evict the data directory's pages from the page cache (clean pages only, hence the sync first)."""
    os.sync()
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _probe(port: int, deadline: float) -> tuple[float, float, float]:
    """Connect (retrying until accepted), ask broker_info and tx_offsets at once, wait for both replies.

    Returns when the port accepted, when broker_info was answered (plain
    traffic is served) and when tx_offsets was answered (the transaction
    index is rebuilt: transactional operations wait for it).
    """
    while True:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=1)
            break
        except OSError:
            if time.perf_counter() > deadline:
                raise TimeoutError("the broker's port never accepted") from None
            time.sleep(0.005)
    accepted = time.perf_counter()
    answered: dict[int, float] = {}
    with s:
        s.settimeout(max(1.0, deadline - time.perf_counter()))
        s.sendall(wire.request(1, "hello", {"client_id": "restart-bench"}) + wire.request(2, "broker_info", {})
                  + wire.request(3, "tx_offsets", {}))
        dec = wire.FrameDecoder(64 << 20)
        while len(answered) < 2:
            data = s.recv(1 << 16)
            if not data:
                raise ConnectionError("the broker closed the connection before answering")
            for payload in dec.feed(data):
                f = wire.parse_payload(payload)
                if f.id in (2, 3):
                    if f.op != 0:
                        raise RuntimeError(f"request {f.id} failed: {f.fields}")
                    answered[f.id] = time.perf_counter()
    return accepted, answered[2], answered[3]


def append_after_flush(data_dir: Path, first: int, count: int) -> int:
    """count more transactions (half + op records each) after the index file's last flush (a clean shutdown's); returns those records."""
    with Store(data_dir) as store:
        _transactions(store, first, count, 0, b"t" * TX_BODY)
        store.sync()
    return 2 * count


def restart(data_dir: Path, log_path: Path, cache: str, timeout: float, case: str = "") -> dict[str, Any]:
    if cache == "cold":
        drop_cache(data_dir)
    log_path.write_text("")
    index_file = (data_dir / DB_FILE).exists()  # left by the previous start's broker (flushed at its clean shutdown)
    b = BrokerProc(data_dir, "--flush", "async", "--log-level", "info", log_path=log_path)
    b.spawn()
    try:
        accepted, info, tx = _probe(b.port, b.started_at + timeout)
        res = {"cache": cache, "case": case, "index_file": index_file, "port_s": round(accepted - b.started_at, 3), "ready_s": round(info - b.started_at, 3),
               "tx_ready_s": round(tx - b.started_at, 3), "rss_mb": round(proc_status(b.pid, "VmRSS"), 1),
               "rss_peak_mb": round(proc_status(b.pid, "VmHWM"), 1)}
    finally:
        b.stop()
    text = log_path.read_text()
    m = re.search(r"event=store_opened .*?took_s=([\d.]+)", text)
    if m:
        res["store_open_s"] = float(m.group(1))
    m = re.search(r"event=txindex_rebuild reason=(\"(?:[^\"\\]|\\.)*\"|'[^']*'|\S+)", text)
    if m:
        res["rebuild_reason"] = m.group(1).strip("'\"")
    m = re.search(r"event=broker_ready pending=(\d+) index=(\w+) records_read=(\d+) took_s=([\d.]+)", text)
    if m:
        res.update(pending=int(m.group(1)), index=m.group(2), records_read=int(m.group(3)), broker_ready_s=float(m.group(4)))
        # A missing index file is created empty and then "loaded" (the broker
        # logs index=loaded): it is read from offset 0, i.e. rebuilt from the log.
        res["index_source"] = (f"loaded from {DB_FILE}, then {res['records_read']:,} records read from the log after its last flush"
                               if res["index"] == "loaded" and index_file else
                               f"built from the log, no index file ({res['records_read']:,} records read; broker log: index={res['index']})"
                               if not index_file else f"rebuilt from the log ({res['records_read']:,} records read)")
    else:
        res["index_source"] = "? (no event=broker_ready line with index= in the broker log)"
    return res


def _n(v: Any) -> str:
    return "?" if v is None else f"{v:,}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gigabytes", type=float, default=5.0, help="commit-log size to build, in GB (default 5)")
    ap.add_argument("--transactions", type=int, default=1_000_000, help="transactions in the log (default 1,000,000)")
    ap.add_argument("--pending", type=int, default=None, help="of which left pending (default 1%%)")
    ap.add_argument("--plain-body", type=int, default=64 << 10, help="body size of the plain messages that fill the rest")
    ap.add_argument("--dir", type=Path, default=None,
                    help="build here and keep it (a later run with the same --dir measures again without rebuilding) "
                         "instead of in a temporary directory that is removed")
    ap.add_argument("--after-flush", "--after-snapshot", dest="after_flush", type=int, default=30_000,
                    help="transactions appended after the index file's last flush for the crash case (default 30,000, i.e. "
                         "60,000 half and op records: about one second of transactions at ~27,000/s, the best async rate "
                         "compare.py measured, and the broker flushes the index file every second); 0 skips that case")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--write", type=Path, metavar="DOC", help="save the result and write it into this Markdown file")
    ap.add_argument("-o", "--output", choices=["text", "json"], default="text")
    a = ap.parse_args()
    pending = a.transactions // 100 if a.pending is None else a.pending
    need = a.gigabytes * 1e9 * 1.1 + a.transactions * 1500
    base = a.dir or data_disk_dir()
    base.mkdir(parents=True, exist_ok=True)
    if not (a.dir and (a.dir / "build.json").exists()) and shutil.disk_usage(base).free < need:
        sys.exit(f"not enough free disk under {base}: need about {need / 1e9:.1f} GB")
    tmp = a.dir or Path(tempfile.mkdtemp(prefix="txmq-restart-", dir=base))
    try:
        built = tmp / "build.json"
        if a.dir is not None and built.exists():  # built by an earlier run with the same --dir: measure again
            res: dict[str, Any] = json.loads(built.read_text())
            print(f"reusing the {res['log_gib']} GiB commit log in {tmp}", file=sys.stderr, flush=True)
        else:
            print(f"building a {a.gigabytes} GB commit log with {a.transactions:,} transactions in {tmp} ...", file=sys.stderr, flush=True)
            res = build(tmp / "data", a.gigabytes, a.transactions, pending, a.plain_body)
            built.write_text(json.dumps(res))
            print(f"  {res['log_gib']} GiB in {res['build_s']} s", file=sys.stderr, flush=True)
        data = tmp / "data"
        remove_db(data)  # a kept --dir: start from no index file again
        res["restarts"] = [
            restart(data, tmp / "broker-warm.log", "warm", a.timeout, "no index file: rebuilt from the log, every half and op record read"),
            restart(data, tmp / "broker-cold.log", "cold", a.timeout, "after a clean shutdown: index file loaded"),
        ]
        if a.after_flush:
            # As after a crash: the index file's last flush (here the clean
            # shutdown's) is that many records behind the end of the log.
            print(f"appending {a.after_flush:,} transactions after the index file's last flush ...", file=sys.stderr, flush=True)
            n = append_after_flush(data, res["transactions"], a.after_flush)
            res["restarts"].append(restart(data, tmp / "broker-crash.log", "warm", a.timeout,
                                           f"after a crash: index file loaded, {n:,} records appended after its last flush"))
            remove_db(data)
            if a.dir is not None:  # the next run with this --dir must find the log it built
                print("note: the kept --dir now holds the appended transactions too", file=sys.stderr)
    finally:
        if a.dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    res = {"kind": "restart", "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "command": command_line(),
           "machine": machine_info(data_disk_dir()), **res,
           "notes": ("Serving means the first `broker_info` request was answered (the port accepts connections earlier: the broker "
                     "binds it before it opens the store); transactions ready means a `tx_offsets` request, which like every "
                     "transactional operation waits for the transaction index, was answered. The store was closed cleanly (a "
                     "checkpoint), so recovery trusts the log up to it. With no index file (`txindex.db`) the broker rebuilds the "
                     "index from the log, reading every half and op record; with one it loads the pending rows and reads only the "
                     "transactional records written after the file's last flush (the broker flushes it every second and at a clean "
                     "shutdown; the crash case has the records appended after that flush with the broker stopped). A cold start had "
                     "the data directory's pages dropped from the page cache first.")}
    if a.write:
        save_result("restart", res)
        report.write_doc(a.write)
    line = "; ".join(f"{r['case']} ({r['cache']} cache): serving in {r['ready_s']} s, transactions in {r['tx_ready_s']} s (port after {r['port_s']} s, "
                     f"index {r.get('index', '?')}, {_n(r.get('records_read'))} records read, {_n(r.get('pending'))} pending, "
                     f"RSS {r['rss_mb']:.0f} MiB, peak {r.get('rss_peak_mb', 0):.0f})" for r in res["restarts"])
    print(f"restart over a {res['log_gib']} GiB commit log with {res['transactions']:,} transactions ({res['pending']:,} pending): {line}",
          file=sys.stderr if a.output == "json" else sys.stdout)
    if a.output == "json":
        print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
