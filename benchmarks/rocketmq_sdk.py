"""Transactions/s of Apache RocketMQ's official Python SDK through txmq's gRPC front end, next to txmq's own client library.

One broker (`txmq broker start --flush sync --rocketmq-port P --busy-poll 0` on a fresh data directory in the temp dir, as
`txmq bench --embedded` uses) serves both, one run after the other, at the same concurrency (1 and 32
producers), the same 256-byte body and the same durability (sync flush: a half message and an end are
acknowledged after fdatasync):

- native: `txmq bench tx-client --broker ... -c N -n 1` (N TransactionProducers of txmq's client library,
  each back to back with its pipelined end, the library's default);
- SDK through workers: the same SDK load against a second broker started with `--frontend-processes W`
  (`--workers`, default 2), whose worker processes hold the gRPC connections and relay each RPC to the
  broker process: the broker process's CPU per transaction and the workers' (summed) beside each other;
- SDK: N `rocketmq.Producer`s of rocketmq-python-client (pinned in tests/sdkenv.py, installed in a cached
  virtual environment of its own), each back to back: begin_transaction, send the half message, commit
  (the local transaction commits at once) -- benchmarks/rocketmq_sdk_load.py, in min(N, --procs)
  processes with one thread per producer.

Besides throughput and latency it reports the broker's CPU per transaction in each run: the gRPC front
end's translation cost, which the SDK's own (client-side) cost does not blur. Beside it, the bound of the
stack the front end runs on: N callers of an empty unary call on a grpc.aio server on uvloop with the
front end's channel arguments (benchmarks/grpc_empty.py), the server's CPU per call; an SDK transaction
cannot cost the broker less than two such calls and the native path's cost of the same transaction. And
the same SDK load against a no-op front end (`grpc_empty.py serve --rocketmq`: RocketMQ's service parsed
and answered at once, nothing stored or fsynced): the stack and protobuf under the SDK's own calls. In full mode every
measurement runs twice, interleaved (native, SDK, empty calls, native, ...), and the better run counts: other work on a
shared machine only ever slows a run down.

    .venv/bin/python benchmarks/rocketmq_sdk.py [--quick | --smoke] [--write docs/benchmarks.md] [-o json]

With --write the result goes to benchmarks/results/rocketmq_sdk.json and its section into the document
(benchmarks/report.py; `benchmarks/compare.py --write` keeps including the last result).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import report  # noqa: E402
from benchlib import TXMQ, BrokerProc, command_line, cpu_seconds, data_disk_dir, free_port, machine_info, percentiles_ms, save_result, txmq_bench, wait_port  # noqa: E402

SIZE = 256
CONCURRENCY = (1, 32)
LOADER = HERE / "rocketmq_sdk_load.py"
EMPTY = HERE / "grpc_empty.py"  # the empty-call bound: its server (serve) and callers (load)
LOAD = "load"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sdk_python() -> tuple[Path, str]:
    """The SDK's interpreter (built once by tests/sdkenv.py) and its pin."""
    import sdkenv

    name, version = sdkenv.PYTHON_SDK
    return sdkenv.build_python_sdk(), f"{name}=={version}"


class Plan:
    def __init__(self, mode: str, procs: int, workers: int = 2) -> None:
        self.mode = mode
        self.workers = workers
        self.seconds = {"full": 5.0, "quick": 2.0, "smoke": 0.5}[mode]
        self.rounds = 2 if mode == "full" else 1
        self.procs = procs


def native_run(broker: BrokerProc, clients: int, seconds: float, topic: str, rate: float | None = None) -> dict[str, Any]:
    cpu0 = cpu_seconds(broker.pid)
    # at a rate: `bench tx` (the same protocol's transactions, half then end; tx-client sends back to back only)
    res = txmq_bench(["tx" if rate else "tx-client", "--broker", broker.address, "-c", str(clients), "-n", "1", "--size", str(SIZE),
                      "-d", f"{seconds}s", "--topic", topic, *(["--rate", f"{rate:g}"] if rate else [])])
    res["broker_cpu_s"] = round(cpu_seconds(broker.pid) - cpu0, 3)
    res["broker_us_per_tx"] = round(res["broker_cpu_s"] / res["completed"] * 1e6, 1) if res["completed"] else None
    return res


def sdk_run(python: Path, broker: BrokerProc, endpoint: str, clients: int, seconds: float, topic: str, procs: int,
            home: Path, loader: Path = LOADER, workers: list[int] | None = None) -> dict[str, Any]:
    """N producers of loader (rocketmq_sdk_load.py; grpc_empty.py's callers) in min(N, procs) processes; the server's CPU,
    and with ``workers`` (the front-end worker processes' pids) theirs too."""
    nproc = max(1, min(clients, procs))
    split = [clients // nproc + (1 if i < clients % nproc else 0) for i in range(nproc)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["HOME"] = str(home)  # the SDK logs under ~/logs
    log = open(home / f"loader-{topic}.log", "ab")
    args = [] if loader == LOADER else [LOAD]
    loaders = [subprocess.Popen([str(python), str(loader), *args, "--endpoint", endpoint, "--topic", topic, "--producers", str(n),
                                 "--size", str(SIZE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                text=True, cwd=home) for n in split]
    try:
        for p in loaders:
            line = p.stdout.readline()  # {"ready": true}: producers started and warmed up
            if not line.startswith("{"):
                raise RuntimeError(f"SDK loader did not start (exit {p.poll()}); see {log.name}")
        start = time.time() + 0.3
        end = start + seconds
        for p in loaders:
            p.stdin.write(json.dumps({"start": start, "end": end}) + "\n")
            p.stdin.flush()
        time.sleep(max(0.0, start - time.time()))
        cpu0 = cpu_seconds(broker.pid)
        wcpu0 = sum(cpu_seconds(p) for p in workers or ())
        time.sleep(max(0.0, end - time.time()))
        cpu1 = cpu_seconds(broker.pid)
        wcpu1 = sum(cpu_seconds(p) for p in workers or ())
        outs = []
        for p in loaders:
            line = p.stdout.readline()
            if not line.startswith("{"):
                raise RuntimeError(f"SDK loader gave no result (exit {p.poll()}); see {log.name}")
            outs.append(json.loads(line))
    finally:
        for p in loaders:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
    completed = sum(o["completed"] for o in outs)
    errors: dict[str, int] = {}
    for o in outs:
        for k, v in o["errors"].items():
            errors[k] = errors.get(k, 0) + v
    lat = [x / 1000.0 for o in outs for x in o["latency_ms"]]
    broker_cpu = round(cpu1 - cpu0, 3)
    more: dict[str, Any] = {}
    if workers:
        wcpu = round(wcpu1 - wcpu0, 3)
        more = {"frontend_processes": len(workers), "workers_cpu_s": wcpu,
                "workers_us_per_tx": round(wcpu / completed * 1e6, 1) if completed else None}
    return {**more,
        "mode": "rocketmq-sdk", "sdk_processes": nproc, "producers": clients, "size": SIZE, "completed": completed,
        "elapsed_s": seconds, "throughput": round(completed / seconds, 1), "unit": "transactions/s",
        "latency_ms": {"tx": percentiles_ms(lat) if lat else {}}, "errors": errors,
        "client_cpu_s": round(sum(o["cpu_s"] for o in outs), 3), "broker_cpu_s": broker_cpu,
        "broker_us_per_tx": round(broker_cpu / completed * 1e6, 1) if completed else None,
    }


def worker_pids(broker: BrokerProc) -> list[int]:
    """The broker's front-end worker processes (`txmq broker status -o json`: frontend_workers)."""
    out = subprocess.run([*TXMQ, "broker", "status", "-o", "json", "--broker", broker.address], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    return [r["pid"] for r in json.loads(out)["frontend_workers"] if r["alive"]]


class EmptyServer:
    """grpc_empty.py's server in a subprocess (txmq's interpreter): ``pid``, ``endpoint``; with rocketmq, the no-op front end."""

    def __init__(self, log_path: Path, rocketmq: bool = False) -> None:
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, str(EMPTY), "serve", *(["--rocketmq"] if rocketmq else [])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("{"):
            raise RuntimeError(f"the empty-call server did not start (exit {self.proc.poll()}); see {log_path}")
        self.port = json.loads(line)["port"]
        self.pid = self.proc.pid
        self.endpoint = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def empty_run(python: Path, server: EmptyServer, clients: int, seconds: float, tag: str, procs: int, home: Path) -> dict[str, Any]:
    """N callers of empty unary calls, back to back: the server's CPU per call (the gRPC stack's own cost)."""
    r = sdk_run(python, server, server.endpoint, clients, seconds, tag, procs, home, loader=EMPTY)  # type: ignore[arg-type]
    r["mode"] = "grpc-empty-call"
    r["unit"] = "calls/s"
    r["server_us_per_call"] = r.pop("broker_us_per_tx")
    r["server_cpu_s"] = r.pop("broker_cpu_s")
    r["latency_ms"] = {"call": r["latency_ms"]["tx"]}
    return r


def run(mode: str = "quick", procs: int | None = None, workers: int = 2) -> dict[str, Any]:
    """Measure and return the result (also used by compare.py --rocketmq-sdk)."""
    plan = Plan(mode, procs or max(2, os.cpu_count() or 2), workers)
    python, pin = sdk_python()
    t0 = time.perf_counter()
    machine = machine_info(data_disk_dir())
    tmp = Path(tempfile.mkdtemp(prefix="txmq-rmq-sdk-bench-", dir=data_disk_dir()))
    gport = free_port()
    # --busy-poll 0: its spin after a lone client's request (idle priority) would count as broker CPU, and the native
    # runs held to a rate are all lone requests
    broker = BrokerProc(tmp / "data", "--flush", "sync", "--rocketmq-port", str(gport), "--busy-poll", "0", log_path=tmp / "broker.log")
    broker.start()
    wport = free_port()
    wbroker = BrokerProc(tmp / "data-workers", "--flush", "sync", "--rocketmq-port", str(wport), "--frontend-processes",
                         str(plan.workers), "--busy-poll", "0", log_path=tmp / "broker-workers.log")
    wbroker.start()
    runs: dict[str, dict[str, Any]] = {}
    empty: EmptyServer | None = None
    noop: EmptyServer | None = None
    try:
        wait_port(gport, 30, broker.proc)
        endpoint = f"127.0.0.1:{gport}"
        home = tmp / "home"
        home.mkdir()
        empty = EmptyServer(tmp / "empty-server.log")
        noop = EmptyServer(tmp / "noop-server.log", rocketmq=True)
        wait_port(wport, 30, wbroker.proc)
        wendpoint = f"127.0.0.1:{wport}"
        for rnd in range(plan.rounds):
            for c in CONCURRENCY:
                say(f"  native client library, {c} producer(s), round {rnd + 1}")
                r = native_run(broker, c, plan.seconds, f"bench_native_{c}_{rnd}")
                say(f"    -> {r['throughput']:,.0f} tx/s, broker {r['broker_us_per_tx']} us/tx" + (f"  errors {r['errors']}" if r["errors"] else ""))
                if f"native_{c}" not in runs or r["throughput"] > runs[f"native_{c}"]["throughput"]:
                    runs[f"native_{c}"] = r
                say(f"  Python SDK over gRPC, {c} producer(s), round {rnd + 1}")
                # RocketMQ 5's clients need the topic to exist (the gRPC front end never creates one)
                subprocess.run([*TXMQ, "topics", "create", f"bench_sdk_{c}_{rnd}", "--broker", broker.address], check=True,
                               capture_output=True, timeout=60)
                r = sdk_run(python, broker, endpoint, c, plan.seconds, f"bench_sdk_{c}_{rnd}", plan.procs, home)
                say(f"    -> {r['throughput']:,.0f} tx/s, broker {r['broker_us_per_tx']} us/tx, SDK CPU {r['client_cpu_s']} s"
                    + (f"  errors {r['errors']}" if r["errors"] else ""))
                if f"sdk_{c}" not in runs or r["throughput"] > runs[f"sdk_{c}"]["throughput"]:
                    runs[f"sdk_{c}"] = r
                say(f"  Python SDK over gRPC through {plan.workers} front-end worker processes, {c} producer(s), round {rnd + 1}")
                topic = f"bench_sdkw_{c}_{rnd}"
                subprocess.run([*TXMQ, "topics", "create", topic, "--broker", wbroker.address], check=True, capture_output=True, timeout=60)
                r = sdk_run(python, wbroker, wendpoint, c, plan.seconds, topic, plan.procs, home, workers=worker_pids(wbroker))
                say(f"    -> {r['throughput']:,.0f} tx/s, broker {r['broker_us_per_tx']} us/tx, workers {r['workers_us_per_tx']} us/tx, "
                    f"SDK CPU {r['client_cpu_s']} s" + (f"  errors {r['errors']}" if r["errors"] else ""))
                if f"sdkw_{c}" not in runs or r["throughput"] > runs[f"sdkw_{c}"]["throughput"]:
                    runs[f"sdkw_{c}"] = r
                    # the native path's CPU per transaction at the same rate: fsyncs and wake-ups are shared by fewer
                    # transactions at a few hundred a second than at the native path's own thousands
                    say(f"  native client library at that rate ({r['throughput']:,.0f}/s), {c} producer(s), round {rnd + 1}")
                    nr = native_run(wbroker, c, plan.seconds, f"bench_native_rate_{c}_{rnd}", rate=r["throughput"])
                    say(f"    -> {nr['throughput']:,.0f} tx/s, broker {nr['broker_us_per_tx']} us/tx")
                    runs[f"native_rate_{c}"] = nr
                say(f"  empty unary calls on grpc.aio + uvloop, {c} caller(s), round {rnd + 1}")
                r = empty_run(python, empty, c, plan.seconds, f"empty_{c}_{rnd}", plan.procs, home)
                say(f"    -> {r['throughput']:,.0f} calls/s, server {r['server_us_per_call']} us/call"
                    + (f"  errors {r['errors']}" if r["errors"] else ""))
                if f"empty_{c}" not in runs or r["throughput"] > runs[f"empty_{c}"]["throughput"]:
                    runs[f"empty_{c}"] = r
                say(f"  Python SDK against the no-op front end (grpc_empty.py serve --rocketmq), {c} producer(s), round {rnd + 1}")
                r = sdk_run(python, noop, noop.endpoint, c, plan.seconds, f"noop_{c}_{rnd}", plan.procs, home)  # type: ignore[arg-type]
                r["mode"] = "rocketmq-sdk-noop-frontend"
                say(f"    -> {r['throughput']:,.0f} tx/s, server {r['broker_us_per_tx']} us/tx" + (f"  errors {r['errors']}" if r["errors"] else ""))
                if f"noop_{c}" not in runs or r["throughput"] > runs[f"noop_{c}"]["throughput"]:
                    runs[f"noop_{c}"] = r
    except Exception:
        say(f"broker log tail:\n{broker.log_tail()}")
        raise
    finally:
        broker.stop()
        wbroker.stop()
        for server in (empty, noop):
            if server is not None:
                server.stop()
    return {
        "kind": "rocketmq_sdk", "mode": mode, "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(), "size": SIZE, "flush": "sync", "sdk": pin, "machine": machine, "runs": runs,
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()], "took_s": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one round of 2 s runs")
    ap.add_argument("--smoke", action="store_true", help="0.5 s runs, to test the script itself")
    ap.add_argument("--procs", type=int, help="most SDK load processes (default: max(2, cores))")
    ap.add_argument("--workers", type=int, default=2, help="the second broker's --frontend-processes (default: 2)")
    ap.add_argument("--write", type=Path, metavar="DOC", help="save the result and write the document's generated section")
    ap.add_argument("-o", "--output", choices=["table", "json"], default="table")
    a = ap.parse_args()
    load = os.getloadavg()[0]
    if load > 0.5 * (os.cpu_count() or 1):
        say(f"warning: load average {load:.2f} on {os.cpu_count()} cores: other work is running and will lower every figure")
    result = run("smoke" if a.smoke else "quick" if a.quick else "full", a.procs, a.workers)
    if a.write:
        save_result("rocketmq_sdk", result)
        report.write_doc(a.write)
        say(f"wrote {a.write} (results in benchmarks/results/rocketmq_sdk.json)")
    if a.output == "json":
        print(json.dumps(result, indent=2))
    else:
        print(report.rocketmq_sdk_md(result))


if __name__ == "__main__":
    main()
