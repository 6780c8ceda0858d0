"""txmq next to a peer (RabbitMQ) and next to the machine's limits, in one run.

Same body size (256 bytes) and the same concurrency everywhere:

1. the machine: fsync'd / fdatasync'd / buffered 256-byte appends per second
   on the data directory's disk, and a uvloop + msgpack loopback echo
   (limits.py);
2. txmq through ``txmq bench ... --embedded -o json`` subprocesses (a fresh
   broker on a fresh temporary data directory per measurement):
   transactions (half + commit) with sync and async flush at 1 client back
   to back, 32 concurrent clients and the best pipelined configuration;
   the client library (``txmq bench tx-client``: N TransactionProducers, each
   back to back with its pipelined end) at 1 and 32, sync and async, and
   one producer with the opt-in ``busy_poll`` (1 ms);
   plain sends unbatched and batched (64); the p99 of a whole transaction
   at half of the maximum rate;
3. RabbitMQ AMQP transactions at 1 and 32 clients (rabbit.py), skipped with
   a message when it is not installed.
4. with ``--rocketmq-sdk``: RocketMQ's official Python SDK producers through
   txmq's gRPC front end next to the client library at 1 and 32 producers
   (rocketmq_sdk.py; without the option the document keeps the last
   result of ``benchmarks/rocketmq_sdk.py --write``).

Prints the table (Markdown) and, with ``--write docs/benchmarks.md``,
writes it into that file between its generated-section markers together
with the check-pass and restart results found in benchmarks/results/.

    .venv/bin/python benchmarks/compare.py [--quick] [--no-peer] [--rocketmq-sdk] [--write docs/benchmarks.md] [-o json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import limits  # noqa: E402
import rabbit  # noqa: E402
import report  # noqa: E402
from benchlib import command_line, data_disk_dir, machine_info, save_result, txmq_bench  # noqa: E402

SIZE = 256
PEER_CLIENTS = (1, 32)


class Plan:
    """How long and how wide each measurement is, by mode."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.seconds = {"full": 5.0, "quick": 1.5, "smoke": 0.0}[mode]
        self.probe_s = {"full": 2.0, "quick": 0.6, "smoke": 0.15}[mode]
        self.peer_s = {"full": 5.0, "quick": 1.5, "smoke": 0.5}[mode]
        # candidates for the best pipelined configuration (connections, in flight each)
        self.best = [(4, 64), (32, 16)] if mode == "full" else [(4, 64)]
        self.echo = [(1, 1), (32, 1), *self.best]

    def amount(self, unit_messages: int = 320) -> list[str]:
        """Duration-bound runs, or in smoke mode a small message count (a multiple of the batch of 64, so completed can be checked)."""
        return ["-m", str(unit_messages)] if self.mode == "smoke" else ["-d", f"{self.seconds}s"]


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_txmq(plan: Plan) -> dict[str, dict[str, Any]]:
    runs: dict[str, dict[str, Any]] = {}

    def bench(name: str, args: list[str]) -> dict[str, Any]:
        say(f"  txmq {name}: txmq bench {' '.join(args)}")
        res = txmq_bench([*args, "--embedded", "--size", str(SIZE), *plan.amount()])
        res["args"] = args
        say(f"    -> {res['throughput']:,.0f} {res['unit']}" + (f"  errors {res['errors']}" if res["errors"] else ""))
        runs[name] = res
        return res

    for flush in ("sync", "async"):
        bench(f"tx_{flush}_1x1", ["tx", "--flush", flush, "-c", "1", "-n", "1"])
        bench(f"tx_{flush}_32x1", ["tx", "--flush", flush, "-c", "32", "-n", "1"])
        best = None
        for c, n in plan.best:
            r = bench(f"tx_{flush}_{c}x{n}", ["tx", "--flush", flush, "-c", str(c), "-n", str(n)])
            if best is None or r["throughput"] > best["throughput"]:
                best = r
        assert best is not None
        runs[f"tx_{flush}_best"] = best
    # The client library a user calls: N TransactionProducers, each back to back (pipelined end, its default),
    # and one producer waiting for each end's reply, for reference.
    for flush in ("sync", "async"):
        for c in PEER_CLIENTS:
            bench(f"client_{flush}_{c}", ["tx-client", "--flush", flush, "-c", str(c), "-n", "1"])
        bench(f"client_{flush}_1_wait", ["tx-client", "--flush", flush, "-c", "1", "-n", "1", "--end", "wait"])
        # the same producer with the client's opt-in busy polling (docs/client.md, "Busy polling")
        bench(f"client_{flush}_1_poll", ["tx-client", "--flush", flush, "-c", "1", "-n", "1", "--busy-poll", "1ms"])
    bench("send_4x64", ["send", "--flush", "async", "-c", "4", "-n", "64"])
    bench("send_batch64_4x16", ["send", "--flush", "async", "-c", "4", "-n", "16", "--batch", "64"])
    for flush in ("async", "sync"):
        # Half the best configuration's rate, offered by that same configuration: another one (fewer connections,
        # more in flight each) would be nearer its own saturation at that rate, and its tail would say so.
        best = runs[f"tx_{flush}_best"]
        rate = max(1.0, round(best["throughput"] * 0.5))
        args = best["args"]
        conns, inflight = args[args.index("-c") + 1], args[args.index("-n") + 1]
        bench(f"tx_{flush}_half_rate", ["tx", "--flush", flush, "-c", conns, "-n", inflight, "--rate", str(rate)])
    return runs


def run_peer(plan: Plan) -> dict[str, Any]:
    why = rabbit.available()
    if why:
        say(f"  skipping the peer: {why}")
        return {"skipped": why}
    with rabbit.RabbitNode() as node:
        say(f"  RabbitMQ {node.version} on 127.0.0.1:{node.port}")
        runs = {}
        for clients in PEER_CLIENTS:
            r = rabbit.tx_load(node, clients, plan.peer_s, SIZE)
            say(f"    {clients} client(s): {r['throughput']:,.0f} transactions/s" + (f"  errors {r['errors']}" if r["errors"] else ""))
            runs[str(clients)] = r
    return {"name": f"RabbitMQ {node.version}", "version": node.version, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs (about a minute in all)")
    ap.add_argument("--smoke", action="store_true", help="tiny runs by message count, to test the script itself (CI)")
    ap.add_argument("--no-peer", action="store_true", help="skip RabbitMQ")
    ap.add_argument("--rocketmq-sdk", action="store_true", help="also measure RocketMQ's Python SDK through the gRPC front end (rocketmq_sdk.py)")
    ap.add_argument("--write", type=Path, metavar="DOC", help="write the results into this Markdown file (docs/benchmarks.md)")
    ap.add_argument("-o", "--output", choices=["table", "json"], default="table")
    a = ap.parse_args()
    plan = Plan("smoke" if a.smoke else "quick" if a.quick else "full")

    load = os.getloadavg()[0]
    if load > 0.5 * (os.cpu_count() or 1):
        say(f"warning: load average {load:.2f} on {os.cpu_count()} cores: other work is running and will lower every figure")
    t0 = time.perf_counter()
    machine = machine_info(data_disk_dir())
    say("machine limits")
    probes = [limits.disk_appends(data_disk_dir(), plan.probe_s)]
    say("  appends/s per round: " + ", ".join(f"{k} {v}" for k, v in probes[0]["rounds"].items()))
    echo = limits.echo_rps(plan.echo, plan.probe_s, SIZE)
    say("  echo requests/s: " + ", ".join(f"{e['connections']}x{e['inflight']} {e['requests_per_s']:,.0f}" for e in echo))
    say("txmq")
    txmq = run_txmq(plan)
    say("peer")
    peer = {"skipped": "--no-peer given"} if a.no_peer else run_peer(plan)
    sdk = None
    if a.rocketmq_sdk:
        import rocketmq_sdk

        say("RocketMQ Python SDK through the gRPC front end, next to the client library")
        sdk = rocketmq_sdk.run(plan.mode)
    say("machine limits again (a limit is the best of both probes)")
    probes.append(limits.disk_appends(data_disk_dir(), plan.probe_s))
    say("  appends/s per round: " + ", ".join(f"{k} {v}" for k, v in probes[1]["rounds"].items()))
    disk = limits.disk_limits(probes)
    echo2 = limits.echo_rps(plan.echo, plan.probe_s, SIZE)
    say("  echo requests/s: " + ", ".join(f"{e['connections']}x{e['inflight']} {e['requests_per_s']:,.0f}" for e in echo2))
    echo = [max(a_, b_, key=lambda e: e["requests_per_s"]) | {"probes_rps": [a_["requests_per_s"], b_["requests_per_s"]]}
            for a_, b_ in zip(echo, echo2)]
    result = {
        "kind": "compare", "mode": plan.mode, "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(), "size": SIZE, "machine": machine,
        "limits": {"disk": disk, "echo": echo}, "txmq": txmq, "peer": peer,
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()], "took_s": round(time.perf_counter() - t0, 1),
    }
    if a.write:
        save_result("compare", result)
        if sdk:
            save_result("rocketmq_sdk", sdk)
        report.write_doc(a.write)
        say(f"wrote {a.write} (results in benchmarks/results/compare.json)")
    if a.output == "json":
        print(json.dumps({**result, "rocketmq_sdk": sdk} if sdk else result, indent=2))
    else:
        print(report.comparison_md(result) + ("\n" + report.rocketmq_sdk_md(sdk) if sdk else ""))


if __name__ == "__main__":
    main()
