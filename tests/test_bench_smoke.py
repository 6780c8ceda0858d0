"""The benchmark tools still work: tiny runs, checked for shape only.

These assert no throughput or latency figure (the numbers belong in
docs/benchmarks.md, measured on a quiet machine); only that the JSON
parses, every unit asked for completed, and nothing failed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

TXMQ = [sys.executable, "-m", "txmq"]


def _json(cmd: list[str], timeout: float = 120) -> dict:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


def test_bench_tx_embedded_completes_every_transaction():
    res = _json([*TXMQ, "bench", "tx", "--embedded", "-m", "500", "-o", "json"])
    assert res["mode"] == "tx" and res["completed"] == 500
    assert res["errors"] == {}
    assert res["outcomes"] == {"commit": 500}
    assert res["latency_ms"]["tx"]["count"] == 500
    assert res["flush"] == "async" and "broker_cpu_s" in res


@pytest.mark.parametrize("end", ["pipelined", "wait"])
def test_bench_tx_client_runs_the_client_library_and_counts_answered_ends(end):
    res = _json([*TXMQ, "bench", "tx-client", "--embedded", "--flush", "sync", "-c", "2", "-n", "1", "-m", "300",
                 "--end", end, "-o", "json"])
    assert (res["mode"], res["end"], res["completed"]) == ("tx-client", end, 300)
    assert res["errors"] == {} and res["outcomes"] == {"committed": 300}
    assert res["latency_ms"]["call"]["count"] == res["latency_ms"]["tx"]["count"] == 300


def test_bench_send_batched_counts_messages_not_requests():
    res = _json([*TXMQ, "bench", "send", "--embedded", "-m", "500", "--batch", "10", "-o", "json"])
    assert res["completed"] == 500 and res["batch"] == 10
    assert res["errors"] == {}
    assert res["latency_ms"]["send"]["count"] == 50


@pytest.mark.slow  # ~15 s: ten embedded brokers
@pytest.mark.timeout(1500)
def test_compare_script_txmq_part_runs():
    res = _json([sys.executable, str(REPO / "benchmarks" / "compare.py"), "--smoke", "--no-peer", "-o", "json"], timeout=1200)  # an upper bound: 240 s was not enough at load 10
    assert res["kind"] == "compare" and res["peer"] == {"skipped": "--no-peer given"}
    disk = res["limits"]["disk"]
    assert {"fsync_appends_per_s", "fdatasync_appends_per_s", "buffered_appends_per_s"} <= disk.keys()
    assert all(e["completed"] > 0 for e in res["limits"]["echo"])
    for name, run in res["txmq"].items():
        assert run["completed"] == 320, name
        assert run["errors"] == {}, name
    assert {"tx_sync_1x1", "tx_async_32x1", "send_batch64_4x16", "tx_sync_half_rate"} <= res["txmq"].keys()

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import report

        text = report.comparison_md(res) + report.targets_md(res, None, None)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert "transactions/s, sync flush, 1 client back to back" in text and "peer skipped" in text


def test_check_micro_runs_its_passes():
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "check_micro.py"), "--pending", "300", "--passes", "2"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("check pass, 300 pending") and "min " in p.stdout


def test_bench_with_rate_runs_until_the_deadline():
    """A paced run has moments with nothing in flight; the run still ends on --duration, not at the first such moment."""
    res = _json([*TXMQ, "bench", "send", "--embedded", "--rate", "20", "--duration", "1500ms", "-o", "json"])
    assert res["elapsed_s"] >= 1.45, res
    assert 20 <= res["completed"] <= 32 and res["errors"] == {}


def test_bench_tx_rolls_back_what_the_mix_left_unknown(tmp_path):
    from clihelpers import lines, ok, start_broker, txmq

    b = start_broker(tmp_path, "--check-interval", "60s", "--transaction-timeout", "60s")
    try:
        p = subprocess.run([*TXMQ, "bench", "tx", "-b", b.address, "-m", "200", "--mix", "commit=1,unknown=1", "-o", "json"],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
        assert p.returncode == 0, p.stderr[-2000:]
        res = json.loads(p.stdout)
        assert res["outcomes"]["unknown"] == res["unknown_rolled_back"] > 0
        assert "rolled back" in p.stderr
        assert lines(ok(txmq("inspect", "half", "--group", "bench", broker=b.address))) == []
    finally:
        b.stop()


@pytest.mark.slow  # ~20 s: one broker, the RocketMQ Python SDK in its own environment (built once, tests/sdkenv.py)
@pytest.mark.timeout(900)
def test_rocketmq_sdk_benchmark_runs_the_sdk_and_the_client_library_on_one_broker_and_through_workers():
    import importlib.util

    from sdkenv import python_sdk_python

    python_sdk_python()  # skips when the SDK cannot be installed
    if importlib.util.find_spec("grpc") is None:
        pytest.skip("txmq's rocketmq extra is not installed")
    res = _json([sys.executable, str(REPO / "benchmarks" / "rocketmq_sdk.py"), "--smoke", "-o", "json"], timeout=600)
    assert res["kind"] == "rocketmq_sdk" and res["flush"] == "sync"
    # beside the SDK and the client library: grpc.aio's empty-call bound and the SDK against a front end that does nothing
    # and through front-end worker processes, with the native path held to that rate beside it
    names = ("native_1", "sdk_1", "native_32", "sdk_32", "sdkw_1", "sdkw_32", "native_rate_1", "native_rate_32")
    assert set(names) <= set(res["runs"]), sorted(res["runs"])
    for name in names:
        run = res["runs"][name]
        assert run["completed"] > 0 and run["errors"] == {}, (name, run)
        assert run["broker_us_per_tx"] > 0, name
    for name in ("sdkw_1", "sdkw_32"):
        assert res["runs"][name]["frontend_processes"] == 2 and res["runs"][name]["workers_us_per_tx"] > 0, res["runs"][name]


@pytest.mark.rocketmq_peer
@pytest.mark.slow  # ~2 min: RocketMQ's two JVMs, a txmq broker and one with two front-end workers boot, fifteen TxBench runs
@pytest.mark.timeout(1200)
def test_rocketmq_peer_benchmark_runs_every_row_against_rocketmq_txmq_and_txmq_with_workers(tmp_path):
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "rocketmq_peer.py"), "--quick", "--servers", "rocketmq,txmq,txmq-workers",
                        "--workers", "2", "-o", "json"], capture_output=True, text=True, timeout=1100, cwd=REPO)  # an upper bound for a loaded machine
    if p.returncode == 77:  # no peer, Java or jars here (what the rocketmq_peer fixture skips on)
        pytest.skip(p.stderr.strip()[-500:])
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert res["kind"] == "rocketmq_peer" and res["java"]
    (sit,) = res["sittings"]
    assert sit["flush"] == "sync"
    for name in ("rocketmq", "txmq"):
        s = sit["servers"][name]
        assert s["ready_s"] > 0 and s["rss_after_load"]["broker_VmRSS"] > 0, (name, s)
    assert sit["servers"]["rocketmq"]["rss_after_load"]["namesrv_VmRSS"] > 0
    w = sit["servers"]["txmq-workers"]
    assert w["workers"] == 2 and w["ready_s"] > 0 and w["rss_after_load"]["workers_VmRSS"] > 0, w
    rows = {(r["server"], r["row"]): r for r in sit["runs"]}
    assert set(rows) == {(s, row) for s in ("rocketmq", "txmq", "txmq-workers") for row in ("tx_1", "tx_32", "sync_1", "sync_32", "consume")}
    for key, r in rows.items():
        assert r["rate"] > 0 and r["broker_us_per_op"] >= 0, (key, r)  # CPU is counted in 10 ms ticks: a quick consume may show none
    assert "namesrv_us_per_op" in rows[("rocketmq", "tx_1")] and "namesrv_us_per_op" not in rows[("txmq-workers", "tx_1")]
    for row in ("tx_1", "tx_32", "sync_1", "sync_32"):  # the broker process and its workers, each counted once
        r = rows[("txmq-workers", row)]
        assert r["owner_us_per_op"] > 0 and r["workers_us_per_op"] >= 0, r
        assert abs(r["broker_us_per_op"] - r["owner_us_per_op"] - r["workers_us_per_op"]) <= 0.2, r
    for s in ("txmq", "txmq-workers"):
        assert rows[(s, "consume")]["distinct"] == res["n"] + res["warmup"]
    assert set(sit["summary"]["rows"]["tx_32"]) >= {"rate_ratio", "workers_rate_ratio", "owner_us_per_op"}
    assert {t["flush"] for t in res["targets"]} == {"sync"} and len(res["targets"]) == 14
    assert [t["met"] for t in res["targets"] if "workers" in t["target"]][1] is None  # the broker process's CPU: for information
    saved = tmp_path / "rocketmq_peer.json"
    saved.write_text(p.stdout)
    for fmt, title in (("md", "txmq with workers /s"), ("table", "txmq-workers/s")):
        out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "rocketmq_peer.py"), "--from-json", str(saved), "-o", fmt],
                             capture_output=True, text=True, timeout=120, cwd=REPO)
        assert out.returncode == 0 and title in out.stdout, out.stderr[-2000:]
