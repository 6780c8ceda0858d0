"""Measure spark-export on a synthetic log: ``python -m txmq.spark.bench [--records N] [--dir D]``.

Writes N records with txmq.store.Store (256-byte bodies; 1% of them in
committed transactions: half, commit and op records), then reports:

- the pure-Python scan (StoreReader.scan_range) and the source's reader
  (decode + Arrow batches) in this one process, in rows/s;
- Spark start-up, and ``spark.read.format("txmq").load(D).count()`` rows/s;
- ``txmq spark-export`` end to end (a subprocess, as a user runs it);
- through a broker (a subprocess on the same log): one process pulling every
  queue into Arrow batches, and a Spark count with ``option("broker", ...)``,
  each with the broker's CPU seconds per row (from /proc).

Prints one JSON document. Numbers depend on the machine's cores and load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def write_log(data_dir: str, records: int, body_size: int = 256) -> float:
    from txmq.constants import HALF_TOPIC, OP_TOPIC
    from txmq.store import Message, Store, TxType

    body = os.urandom(body_size)
    t0 = time.perf_counter()
    with Store(data_dir) as store:
        batch: list[Message] = []
        n = i = 0
        while n < records:
            now = int(time.time() * 1000)
            if i % 100 == 99 and records - n >= 3:  # a committed transaction: half, commit, op
                tx = f"TX{i:012d}"
                props = {"TRAN_MSG": "true", "PGROUP": "bench", "UNIQ_KEY": tx, "REAL_TOPIC": "orders", "REAL_QID": "0"}
                (h,) = store.append([Message(HALF_TOPIC, 0, TxType.PREPARED, now, props, body)])
                cprops = {k: v for k, v in props.items() if k != "TRAN_MSG"}
                store.append([
                    Message("orders", 0, TxType.COMMIT, now, cprops, body, prepared_offset=h.commit_log_offset),
                    Message(OP_TOPIC, 0, TxType.COMMIT, now, {"TAGS": "d", "UNIQ_KEY": tx, "PGROUP": "bench",
                            "TXMQ_DECIDED_BY": "producer"}, str(h.queue_offset).encode(), prepared_offset=h.commit_log_offset),
                ])  # fmt: skip
                n += 3
            else:
                batch.append(Message(f"topic{i % 8}", i % 4, TxType.NORMAL, now, {"TAGS": f"t{i % 10}", "KEYS": f"k{i}"}, body))
                n += 1
                if len(batch) >= 1000:
                    store.append(batch)
                    batch = []
            i += 1
        if batch:
            store.append(batch)
    return time.perf_counter() - t0


def python_scan(data_dir: str) -> dict:
    from .schema import messages_schema
    from .source import ReadOptions, TxmqReader
    from txmq.store import StoreReader

    t0 = time.perf_counter()
    with StoreReader(data_dir) as r:
        n = sum(1 for _ in r.scan_range(0, r.max_offset))
    scan_s = time.perf_counter() - t0
    reader = TxmqReader(ReadOptions(data_dir), messages_schema())
    t0 = time.perf_counter()
    m = sum(b.num_rows for p in reader.partitions() for b in reader.read(p))
    read_s = time.perf_counter() - t0
    return {
        "scan_range_rows": n, "scan_range_s": round(scan_s, 2), "scan_range_rows_per_s": round(n / scan_s),
        "reader_batches_rows": m, "reader_batches_s": round(read_s, 2), "reader_batches_rows_per_s": round(m / read_s),
    }  # fmt: skip


def spark_count(data_dir: str, master: str, repeat: int) -> dict:
    from . import session as sess
    from .source import TxmqDataSource

    s = sess.start(master)
    try:
        spark = s.spark
        spark.dataSource.register(TxmqDataSource)
        runs = []
        n = 0
        for _ in range(repeat):
            t0 = time.perf_counter()
            n = spark.read.format("txmq").load(data_dir).count()
            runs.append(time.perf_counter() - t0)
        best = min(runs)
        return {"spark_startup_s": round(s.startup_s, 2), "count": n, "count_s": [round(x, 2) for x in runs],
                "count_rows_per_s_best": round(n / best)}
    finally:
        s.stop()
        sess.cleanup(s)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_broker(data_dir: str) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "txmq", "broker", "start", "--data-dir", data_dir, "--port", str(port),
                             "--check-interval", "1d"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.1)
    from .broker import BrokerOptions, WireClient, plan_batch

    while time.monotonic() < deadline:  # the index is built: offsets answer
        try:
            WireClient(f"127.0.0.1:{port}").close()
            plan_batch(BrokerOptions.from_options({"broker": f"127.0.0.1:{port}"}))
            break
        except Exception:
            time.sleep(0.2)
    return proc, f"127.0.0.1:{port}"


def broker_read(address: str, pid: int) -> dict:
    """One process reading every queue through the broker into Arrow batches (raw pulls, then message maps), with the
    broker's CPU per row."""
    from .broker import BrokerOptions, plan_batch
    from .brokersource import QueuePartition, read_partition
    from .schema import messages_schema

    out = {}
    for mode, raw in (("raw", "true"), ("maps", "false")):
        opts = BrokerOptions.from_options({"broker": address, "rawPull": raw})
        ranges, _ = plan_batch(opts)
        cpu0, t0 = _cpu_s(pid), time.perf_counter()
        n = sum(b.num_rows for r in ranges for b in read_partition(opts, QueuePartition(r, None), messages_schema()))
        wall, cpu = time.perf_counter() - t0, _cpu_s(pid) - cpu0
        out[mode] = {"rows": n, "s": round(wall, 2), "rows_per_s": round(n / wall),
                     "broker_cpu_us_per_row": round(cpu / n * 1e6, 2)}
    return out


def broker_spark_count(address: str, pid: int, master: str, repeat: int, partitions: int = 8) -> dict:
    from . import session as sess
    from .source import TxmqDataSource

    s = sess.start(master)
    try:
        spark = s.spark
        spark.dataSource.register(TxmqDataSource)
        runs, cpus, n = [], [], 0
        for _ in range(repeat):
            cpu0, t0 = _cpu_s(pid), time.perf_counter()
            n = spark.read.format("txmq").option("broker", address).option("minPartitions", partitions).load().count()
            runs.append(time.perf_counter() - t0)
            cpus.append(_cpu_s(pid) - cpu0)
        best = min(runs)
        return {"count": n, "count_s": [round(x, 2) for x in runs], "count_rows_per_s_best": round(n / best),
                "broker_cpu_us_per_row": round(min(cpus) / max(n, 1) * 1e6, 2)}
    finally:
        s.stop()
        sess.cleanup(s)


def stream_latency(address: str, master: str, seconds: float = 20.0, rate: int = 500) -> dict:
    """Store time to row written by a parquet sink, at trigger(processingTime="1 second"), while a producer sends
    `rate` messages/s: p50 and p99 over every row (ms)."""
    import threading

    from txmq.client import SyncProducer
    from . import session as sess
    from .source import TxmqDataSource

    s = sess.start(master)
    out = tempfile.mkdtemp(prefix="txmq-latency-")
    lat: list[float] = []
    try:
        spark = s.spark
        spark.dataSource.register(TxmqDataSource)
        df = (spark.readStream.format("txmq").option("broker", address).option("topics", "latency")
              .option("startingOffsets", "latest").load())

        def sink(batch, batch_id):
            batch.write.mode("append").parquet(out)
            done = time.time() * 1000
            lat.extend(done - r[0].timestamp() * 1000 for r in batch.select("stored_at").collect())

        with SyncProducer(address) as p:
            p.send("latency", b"warm-up")  # the topic exists before the stream plans
            q = df.writeStream.foreachBatch(sink).trigger(processingTime="1 second") \
                .option("checkpointLocation", out + "-ckpt").start()
            time.sleep(8)  # the first micro-batches warm the Python workers up
            lat.clear()
            stop = threading.Event()
            sent = [0]

            def produce():
                t0 = time.monotonic()
                while not stop.is_set():
                    p.send("latency", b"x" * 256)
                    sent[0] += 1
                    ahead = sent[0] / rate - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)

            th = threading.Thread(target=produce)
            th.start()
            time.sleep(seconds)
            stop.set()
            th.join()
            time.sleep(4)
            q.stop()
        lat.sort()
        if not lat:
            return {"rows": 0}
        return {"rows": len(lat), "sent": sent[0], "p50_ms": round(lat[len(lat) // 2]), "p99_ms": round(lat[int(len(lat) * 0.99)]),
                "max_ms": round(lat[-1]), "trigger": "processingTime=1 second", "sink": "parquet (foreachBatch)"}
    finally:
        s.stop()
        sess.cleanup(s)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(out + "-ckpt", ignore_errors=True)


def cli_export(data_dir: str | None, out: str, master: str, extra: list[str]) -> dict:
    """`txmq spark-export` in its own process (data_dir None: extra names the source, e.g. --broker)."""
    shutil.rmtree(out, ignore_errors=True)
    source = ["--data-dir", data_dir] if data_dir else []
    cmd = [sys.executable, "-m", "txmq", "spark-export", *source, "--out", out, "--master", master, "-o", "json", *extra]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"spark-export failed ({r.returncode}): {r.stderr}")
    summary = json.loads(r.stdout)
    return {"command": " ".join(cmd[2:]), "wall_s": round(wall, 2), "summary": summary}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--dir", help="work directory (kept; the log is reused when present)")
    ap.add_argument("--master", default="local[*]")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma-separated: python,count,cli,broker,latency")
    args = ap.parse_args(argv)
    work = args.dir or tempfile.mkdtemp(prefix="txmq-bench-")
    data_dir = os.path.join(work, "data")
    skip = set(filter(None, args.skip.split(",")))
    result: dict = {"records": args.records, "cpus": os.cpu_count(), "data_dir": data_dir, "master": args.master}
    if not os.path.isdir(os.path.join(data_dir, "commitlog")):
        result["write_s"] = round(write_log(data_dir, args.records), 2)
    result["log_bytes"] = sum(e.stat().st_size for e in os.scandir(os.path.join(data_dir, "commitlog")))
    if "python" not in skip:
        result["python"] = python_scan(data_dir)
    if "count" not in skip:
        result["spark_count"] = spark_count(data_dir, args.master, args.repeat)
    if "cli" not in skip:
        out = os.path.join(work, "out")
        result["export_all_parquet"] = cli_export(data_dir, out, args.master, [])
        result["export_messages_parquet"] = cli_export(data_dir, out, args.master, ["--table", "messages"])
    if "broker" not in skip:
        proc, address = start_broker(data_dir)
        try:
            result["broker"] = {"python": broker_read(address, proc.pid),
                                "spark_count": broker_spark_count(address, proc.pid, args.master, args.repeat)}
            if "cli" not in skip:
                cpu0 = _cpu_s(proc.pid)
                exp = cli_export(None, os.path.join(work, "out-broker"), args.master, ["--broker", address])
                exp["broker_cpu_s"] = round(_cpu_s(proc.pid) - cpu0, 2)
                result["broker"]["export_all_parquet"] = exp
            if "latency" not in skip:
                result["broker"]["stream_latency"] = stream_latency(address, args.master)
        finally:
            proc.terminate()
            proc.wait(60)
    print(json.dumps(result, indent=2))
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
