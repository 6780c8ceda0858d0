"""Scale-out: Spark executors in processes of their own read batch and stream through the broker.

The master is ``local-cluster[2,1,1024]``: a standalone master and two
workers, each executor a separate JVM with its own Python workers, started
from pyspark's own SPARK_HOME (the pip package carries the jars and
scripts). The broker runs in a mount namespace of its own with its data
directory on a private tmpfs (``unshare``): from the executors, that path is
an empty directory, so the rows can only have come over the wire.

The Spark part runs in a child process (one SparkContext per process; the
other Spark tests keep a local one). If local-cluster cannot start here,
the test says why and skips.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from brokerproc import free_port

pytestmark = pytest.mark.spark

CHILD = r"""
import json, os, sys, time
from txmq.spark import session as sess
from txmq.spark.source import TxmqDataSource

address, data_dir, out, ckpt = sys.argv[1:5]
try:
    s = sess.start("local-cluster[2,1,1024]", {"spark.executor.memory": "512m", "spark.sql.shuffle.partitions": "2"})
except Exception as e:
    print(json.dumps({"cannot_start": f"{type(e).__name__}: {getattr(e, 'message', e)}"}))
    sys.exit(0)
spark = s.spark
spark.dataSource.register(TxmqDataSource)
sc = spark.sparkContext

def where(_):
    yield (os.getpid(), os.getcwd(), os.path.isdir(data_dir) and sorted(os.listdir(data_dir)))

seen = sc.parallelize(range(4), 4).mapPartitions(where).collect()
df = spark.read.format("txmq").option("broker", address).option("minPartitions", "4").load()
rows = df.groupBy("topic").count().collect()
q = (spark.readStream.format("txmq").option("broker", address).option("startingOffsets", "earliest")
     .option("topics", "wide").load()
     .writeStream.format("parquet").option("path", out).option("checkpointLocation", ckpt)
     .trigger(availableNow=True).start())
q.awaitTermination(300)
q.stop()
streamed = sorted((r.queue_id, r.queue_offset) for r in spark.read.parquet(out).select("queue_id", "queue_offset").collect())
print(json.dumps({"driver_pid": os.getpid(), "executors": seen, "counts": {r["topic"]: r["count"] for r in rows},
                  "streamed": streamed}))
s.stop()
"""


def _spark_home() -> str | None:
    try:
        import pyspark
    except ImportError:
        return None
    home = os.path.dirname(pyspark.__file__)
    return home if os.path.exists(os.path.join(home, "bin", "spark-class")) else None


def test_executors_in_other_processes_read_batch_and_stream_through_the_broker(tmp_path):
    from txmq.spark.session import missing_dependency, missing_java

    problem = missing_dependency() or missing_java()
    if problem:
        pytest.skip(problem)
    home = _spark_home()
    if home is None:
        pytest.skip("pyspark's package has no bin/spark-class to start local-cluster workers with")
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is needed to hide the data directory from the executors")
    data = tmp_path / "hidden-data"
    data.mkdir()
    port = free_port()
    log = open(tmp_path / "broker.log", "wb")
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           f'mount -t tmpfs none "{data}" && exec "{sys.executable}" -m txmq broker start --data-dir "{data}" --port {port}']
    broker = subprocess.Popen(cmd, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        from txmq.client import SyncProducer

        while True:
            try:
                with SyncProducer(f"127.0.0.1:{port}") as p:
                    for q in range(4):
                        p.send_batch("wide", [b"m" * 64] * 250, queue_id=q)
                    p.send_batch("narrow", [b"n"] * 10, queue_id=0)
                break
            except Exception:
                if broker.poll() is not None or time.monotonic() > deadline:
                    pytest.skip(f"the broker could not start in a mount namespace of its own: {(tmp_path / 'broker.log').read_text()[-500:]}")
                time.sleep(0.2)
        assert os.listdir(data) == []  # this side of the namespace sees none of the broker's files
        env = {**os.environ, "SPARK_HOME": home, "PYSPARK_PYTHON": sys.executable}
        r = subprocess.run([sys.executable, "-c", CHILD, f"127.0.0.1:{port}", str(data), str(tmp_path / "out"),
                            str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        doc = json.loads(r.stdout.strip().splitlines()[-1])
        if "cannot_start" in doc:
            pytest.skip(f"local-cluster could not start here: {doc['cannot_start']}")
        pids = {e[0] for e in doc["executors"]}
        assert doc["driver_pid"] not in pids and len(pids) >= 2  # two executor processes, neither the driver
        assert all(e[1] != str(tmp_path) for e in doc["executors"])  # their own working directories
        assert all(e[2] in (False, []) for e in doc["executors"])  # the data directory is empty to them
        assert doc["counts"] == {"wide": 1000, "narrow": 10}
        assert doc["streamed"] == [[q, o] for q in range(4) for o in range(250)]
    finally:
        broker.terminate()
        try:
            broker.wait(20)
        except subprocess.TimeoutExpired:
            broker.kill()
        log.close()
