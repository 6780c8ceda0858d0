"""txmq beside the real Apache RocketMQ 4.9.8, in one sitting, with the same Java client.

The peer is ``../shared/peers/rocketmq-4.9.8`` (``TXMQ_ROCKETMQ_PEER`` elsewhere; tests/rocketmq_peer.py finds
it and lays it out with its ``setup.sh`` into a temporary build directory). For each flush mode (``--flush
sync,async``: RocketMQ's ``flushDiskType=SYNC_FLUSH`` / ``ASYNC_FLUSH`` against txmq's ``--flush sync`` /
``--flush async``) it boots, one after the other on fresh stores:

- RocketMQ: ``run.sh start`` (name server, then broker, G1, broker heap ``--heap``), on ports picked here;
- txmq: ``txmq broker start --remoting-port R`` (the name server and the broker in one process), with
  ``--busy-poll 0`` (its spinning at idle priority would count as broker CPU), and RocketMQ's check timing
  of run.sh (``--check-interval 10s --transaction-timeout 6s``);
- txmq-workers, when ``--servers`` names it: txmq started exactly so, plus ``--frontend-processes N``
  (``--workers``, default 2): the remoting port is served by N worker processes (children of the broker
  process, ``txmq __frontend-worker``) that relay the connections' bytes to the broker process, which alone
  works on the store (docs/architecture.md, "Front-end workers").

Time to ready runs from the spawn of the process(es) to the first answered route query
(GET_ROUTEINFO_BY_TOPIC for TBW102 on the name server port, polled every 20 ms); for RocketMQ also the sum
of the two JVMs' own "boot success" times that run.sh prints (name server, then broker). RSS is VmRSS from
/proc: at ready, after ``--idle`` idle seconds (where the idle CPU is sampled too) and after the load, with
VmHWM; for RocketMQ the broker alone and with the name server, for txmq-workers the broker process and the sum
over its workers (``workers_*``).

Then ``--rounds`` rounds, each row alternating RocketMQ, txmq (then txmq-workers): TxBench (the peer's
TxBench.java, through Apache's Java client, ``run.sh bench``) ``tx`` with 1 and 32 threads, ``sync`` with 1 and 32 threads, and a
push consumer (``consume``) reading the backlog the sync 32-thread run left in its own topic: its rate is
the messages received between the first and the last one, over that time (the script reads TxBench's
per-message lines as they come and stops the consumer once all arrived). Broker CPU per operation is
TxBench's (``/proc/PID/stat`` of the broker around the timed part, plus its 2 s settle); for RocketMQ the
name server's CPU over the same run is added (``namesrv_us_per_op``); for txmq-workers ``broker_us_per_op`` is
the broker process's (``owner_us_per_op``) plus its workers' (``workers_us_per_op``: their CPU over the whole
TxBench run, warm-up included, over the n + warm-up operations they relayed; the workers are looked up again
at each reading, so a restarted one is counted); for consume it is the broker's (and the name server's, or
the workers') CPU from the first message to the last. The client JVM's CPU per operation (TxBench's) is kept
beside it: on two cores it competes with the broker. Every run records the 1-minute load average it started with.

    .venv/bin/python benchmarks/rocketmq_peer.py [--quick] [--flush sync,async] [--rounds 2] [-n 3000] [-o json]
        [--servers rocketmq,txmq,txmq-workers] [--workers 2] [--profile tx_32]

With txmq-workers the summary adds, per row, ``workers_rate_ratio`` (txmq-workers' best rate over txmq's)
and the broker process's CPU per op, and the targets a "with N workers ≥ 2× txmq's one process" line for
tx_32 and, for information, the broker process's CPU per op beside the single process's.

Full runs of RocketMQ and txmq (with or without txmq-workers) save benchmarks/results/rocketmq_peer.json;
docs/benchmarks.md has the figures and their reading.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from benchlib import BrokerProc, child_pids, command_line, cpu_seconds, data_disk_dir, free_port, machine_info, proc_status, save_result  # noqa: E402
from brokerproc import port_taken  # noqa: E402
from rocketmq_peer import PeerUnavailable, RocketMQPeer  # noqa: E402

ROWS = ("tx_1", "tx_32", "sync_1", "sync_32", "consume")
LABELS = {"tx_1": "transactions/s, 1 thread", "tx_32": "transactions/s, 32 threads", "sync_1": "sync sends/s, 1 thread",
          "sync_32": "sync sends/s, 32 threads", "consume": "consumed/s, push consumer"}
SERVERS = ("rocketmq", "txmq", "txmq-workers")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load1() -> float:
    return round(os.getloadavg()[0], 2)


# ---- RocketMQ 4 remoting: the one request readiness needs ---------------------------------------------
def route_answered(port: int, broker_port: int, topic: str = "TBW102") -> bool:
    """True once the name server on port answers GET_ROUTEINFO_BY_TOPIC for topic with SUCCESS and the broker on
    broker_port: a server that took the port first (another server of the sitting, a JVM's outgoing connection) and
    answers does not count."""
    head = json.dumps({"code": 105, "language": "JAVA", "version": 0, "opaque": 1, "flag": 0, "extFields": {"topic": topic}}).encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.settimeout(2)
            s.sendall(struct.pack(">ii", 4 + len(head), len(head)) + head)
            buf = b""
            while len(buf) < 4 or len(buf) < 4 + struct.unpack_from(">i", buf)[0]:
                chunk = s.recv(65536)
                if not chunk:
                    return False
                buf += chunk
    except OSError:
        return False
    hlen = struct.unpack_from(">i", buf, 4)[0] & 0xFFFFFF
    body = buf[8 + hlen :]
    return json.loads(buf[8 : 8 + hlen]).get("code") == 0 and b"brokerAddrs" in body and f':{broker_port}"'.encode() in body


def wait_route(port: int, broker_port: int, t0: float, timeout: float, alive) -> float:
    """Seconds from t0 (perf_counter) to the first route query answered with the broker on broker_port; polled every 20 ms."""
    deadline = t0 + timeout
    while time.perf_counter() < deadline:
        if route_answered(port, broker_port):
            return time.perf_counter() - t0
        if not alive():
            raise RuntimeError(f"the server on port {port} exited before answering a route query")
        time.sleep(0.02)
    raise TimeoutError(f"no route answer on port {port} within {timeout} s")


def rss(pids: dict[str, int | list[int]]) -> dict[str, float]:
    """VmRSS, RssAnon, RssFile and VmHWM (MiB) of each pid; of a list of pids, their sums."""
    return {f"{name}_{key}": round(sum(proc_status(p, key) for p in (pid if isinstance(pid, list) else [pid])), 1)
            for name, pid in pids.items() for key in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}


def java_version() -> str:
    p = subprocess.run(["java", "-version"], capture_output=True, text=True)
    return (p.stderr or p.stdout).splitlines()[0] if (p.stderr or p.stdout) else "?"


# ---- the two servers --------------------------------------------------------------------------------
class PortTaken(Exception):
    """run.sh could not bind a port picked here."""


def picking_ports_again(start, tries: int = 3) -> None:
    """start(), which picks its ports: again while one was free when picked and bound by another process before the
    server (PortTaken), up to tries times."""
    for attempt in range(tries):
        try:
            return start()
        except PortTaken:
            if attempt == tries - 1:
                raise


def broker_ports() -> tuple[int, int]:
    """A name server port and a broker port whose VIP (-2) and HA (+1) neighbours are free too."""
    def free(p: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                return True
            except OSError:
                return False

    ns = free_port()
    while True:
        b = free_port()
        if b > 1026 and b + 1 < 65536 and abs(b - ns) > 2 and free(b - 2) and free(b + 1):
            return ns, b


class RocketMQ:
    name = "rocketmq"
    other = "namesrv"  # what other_cpu() counts

    def __init__(self, peer: RocketMQPeer, flush: str, heap: str) -> None:
        self.peer, self.flush, self.heap = peer, flush, heap
        self.ns_pid = self.broker_pid = 0
        self.namesrv = ""
        self.boot: dict[str, float] = {}

    def start(self) -> None:
        picking_ports_again(self._start)

    def _start(self) -> None:
        ns, bp = broker_ports()
        args = [str(self.peer.peer_dir / "run.sh"), "start", "-n", str(ns), "-b", str(bp), "-H", self.heap, "--clean",
                "-f", "SYNC_FLUSH" if self.flush == "sync" else "ASYNC_FLUSH"]
        t0 = time.perf_counter()
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=self.peer.env)
        ready = None
        try:
            ready = wait_route(ns, bp, t0, 300, lambda: p.poll() is None or p.returncode == 0)
        except (RuntimeError, TimeoutError):
            pass  # why is in run.sh's output
        finally:
            out, err = p.communicate(timeout=300)
        text = out.decode(errors="replace")
        m = re.search(r"NAMESRV=(\S+) namesrv_pid=(\d+) namesrv_boot_s=([\d.]+)", text)
        b = re.search(r"broker_pid=(\d+) broker_boot_s=([\d.]+)", text)
        if p.returncode != 0 or not m or not b or ready is None:
            self.peer.stop()
            why = (text + err.decode(errors="replace"))[-800:]
            if "bind" in why.lower() or "busy" in why.lower():
                raise PortTaken(why)
            raise RuntimeError(f"the RocketMQ 4.9.8 peer did not start: {why}")
        self.namesrv, self.ns_pid, self.broker_pid = m.group(1), int(m.group(2)), int(b.group(1))
        self.boot = {"ready_s": round(ready, 3), "boot_s": round(float(m.group(3)) + float(b.group(2)), 2),
                     "namesrv_boot_s": float(m.group(3)), "broker_boot_s": float(b.group(2)), "run_sh_s": round(time.perf_counter() - t0, 3)}

    @property
    def pids(self) -> dict[str, int]:
        return {"broker": self.broker_pid, "namesrv": self.ns_pid}

    def other_cpu(self) -> float:
        """CPU seconds of the process(es) besides the broker: the name server."""
        return cpu_seconds(self.ns_pid)

    def stop(self) -> None:
        self.peer.stop()


class Txmq:
    name = "txmq"
    other = ""  # one process: other_cpu() counts nothing

    def __init__(self, home: Path, flush: str, *extra: str) -> None:
        self.home, self.flush, self.extra = home, flush, extra
        self.proc: BrokerProc | None = None
        self.rport = 0
        self.namesrv = ""
        self.boot: dict[str, float] = {}

    def start(self) -> None:
        picking_ports_again(self._start)

    def _start(self) -> None:
        # Picked now, not when the sitting was laid out: the servers started before this one bind ports of their own
        # (RocketMQ's broker also binds its port - 2 and + 1), and a port picked earlier may be one of them by now.
        self.rport = free_port()
        self.proc = BrokerProc(self.home / f"{self.name}-{self.flush}" / "data", "--flush", self.flush, "--remoting-port", str(self.rport),
                               "--busy-poll", "0", "--check-interval", "10s", "--transaction-timeout", "6s", *self.extra,
                               log_path=self.home / f"{self.name}-{self.flush}.log")
        self.namesrv = f"127.0.0.1:{self.rport}"
        self.proc.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self.proc.spawn()
        proc = self.proc.proc
        assert proc is not None
        try:
            ready = wait_route(self.rport, self.rport, self.proc.started_at, 120, lambda: proc.poll() is None)
        except (RuntimeError, TimeoutError) as exc:
            self.proc.stop()
            why = self.proc.log_tail(800)
            if port_taken(why):
                raise PortTaken(why) from None
            raise RuntimeError(f"{self.name} did not start ({exc}): {why}") from None
        self.boot = {"ready_s": round(ready, 3)}

    @property
    def broker_pid(self) -> int:
        return self.proc.pid

    @property
    def pids(self) -> dict[str, int]:
        return {"broker": self.proc.pid}

    def other_cpu(self) -> float:
        return 0.0

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


class TxmqWorkers(Txmq):
    """txmq as Txmq starts it, with ``--frontend-processes N``: the remoting port is served by N worker processes."""

    name = "txmq-workers"
    other = "workers"

    def __init__(self, home: Path, flush: str, workers: int) -> None:
        super().__init__(home, flush, "--frontend-processes", str(workers))
        self.workers = workers

    def start(self) -> None:
        super().start()
        self.boot["workers"] = self.workers
        deadline = time.monotonic() + 60
        while len(self.worker_pids()) < self.workers:  # they serve the port that answered: up, unless some died at once
            if time.monotonic() > deadline or self.proc.proc.poll() is not None:
                raise RuntimeError(f"txmq-workers: {len(self.worker_pids())} of {self.workers} front-end workers running, broker "
                                   f"{'running' if self.proc.proc.poll() is None else 'exited'}: {self.proc.log_tail(800)}")
            time.sleep(0.05)

    def worker_pids(self) -> list[int]:
        """The broker process's children running ``txmq __frontend-worker``, looked up afresh (a restarted worker has a new pid)."""
        out = []
        for pid in child_pids(self.proc.pid):
            try:
                if b"__frontend-worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    out.append(pid)
            except OSError:
                continue
        return out

    @property
    def pids(self) -> dict[str, int | list[int]]:  # type: ignore[override]
        return {"broker": self.proc.pid, "workers": self.worker_pids()}

    def other_cpu(self) -> float:
        """CPU seconds of the front-end workers running now."""
        return sum(cpu_seconds(pid) for pid in self.worker_pids())


# ---- TxBench runs -----------------------------------------------------------------------------------
def parse_result(text: str) -> dict[str, Any]:
    for line in reversed(text.splitlines()):
        if line.startswith("RESULT "):
            out: dict[str, Any] = {}
            for kv in line[len("RESULT "):].split():
                k, _, v = kv.partition("=")
                try:
                    out[k] = int(v) if re.fullmatch(r"-?\d+", v) else float(v)
                except ValueError:
                    out[k] = v
            return out
    raise RuntimeError(f"TxBench printed no RESULT:\n{text[-2000:]}")


def bench(peer: RocketMQPeer, server, mode: str, threads: int, n: int, warmup: int, topic: str | None = None) -> dict[str, Any]:
    """One TxBench tx|sync run against server: its RESULT, with the name server's CPU added for RocketMQ, the workers' for txmq-workers."""
    props = [f"-Dn={n}", f"-Dthreads={threads}", f"-Dwarmup={warmup}"] + ([f"-Dtopic={topic}"] if topic else [])
    env = {**peer.env, "NAMESRV": server.namesrv, "BROKER_PID": str(server.broker_pid)}
    start_load, other0 = load1(), server.other_cpu()
    p = subprocess.run([str(peer.peer_dir / "run.sh"), "bench", mode, *props], capture_output=True, text=True, env=env,
                       stdin=subprocess.DEVNULL, timeout=120 + n / 20)
    other = server.other_cpu() - other0
    r = parse_result(p.stdout + "\n" + p.stderr[-2000:])
    if r.get("failed") or not r.get("ok"):
        raise RuntimeError(f"TxBench {mode} against {server.name} failed: {r}\n{p.stderr[-1500:]}")
    # the name server serves routes, not operations: over n as ever; the workers relay every operation, the warm-up's too
    other_us = other / (n + warmup if server.other == "workers" else n) * 1e6
    out = {"rate": r["rate"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"], "broker_us_per_op": round(r["broker_us_per_op"] + other_us, 1)}
    if server.other == "workers":
        out.update(owner_us_per_op=r["broker_us_per_op"], workers_us_per_op=round(other_us, 1))
    elif server.other:
        out[f"{server.other}_us_per_op"] = round(other_us, 1)
    return {**out, "client_us_per_op": r["client_us_per_op"], "n": n, "threads": threads, "secs": r["secs"], "load1": start_load}


def consume(peer: RocketMQPeer, server, topic: str, expected: int, timeout: float) -> dict[str, Any]:
    """A push consumer (TxBench consume) on topic's backlog: messages/s and broker CPU per message, first to last message."""
    env = {**peer.env, "NAMESRV": server.namesrv}
    start_load = load1()
    p = subprocess.Popen([str(peer.peer_dir / "run.sh"), "bench", "consume", f"-Dtopic={topic}", f"-Dseconds={int(timeout)}"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env)
    got, keys = 0, set()
    t_first = t_last = 0.0
    cpu_first = cpu_last = 0.0
    other_first = other_last = 0.0
    killer = threading.Timer(timeout + 30, p.kill)
    killer.start()
    try:
        assert p.stdout is not None
        for raw in p.stdout:
            if not raw.startswith(b"received key="):
                continue
            now = time.perf_counter()
            got += 1
            keys.add(raw.split(b" ", 2)[1])
            if got == 1:
                t_first, cpu_first, other_first = now, cpu_seconds(server.broker_pid), server.other_cpu()
            t_last = now
            if len(keys) >= expected:
                cpu_last, other_last = cpu_seconds(server.broker_pid), server.other_cpu()
                break
    finally:
        killer.cancel()
        if p.poll() is None:
            p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if len(keys) < expected:
        raise RuntimeError(f"consume from {server.name}: {len(keys)} of {expected} messages within {timeout} s")
    took = t_last - t_first
    per = got - 1
    out = {"rate": round(per / took, 1) if took > 0 else None, "received": got, "distinct": len(keys), "secs": round(took, 3),
           "broker_us_per_op": round(((cpu_last - cpu_first) + (other_last - other_first)) / per * 1e6, 1) if per else None,
           "load1": start_load}
    if server.other == "workers" and per:
        out.update(owner_us_per_op=round((cpu_last - cpu_first) / per * 1e6, 1), workers_us_per_op=round((other_last - other_first) / per * 1e6, 1))
    return out


def idle_cpu(server, seconds: float) -> float:
    """CPU seconds per second of the server's process(es) while nothing is sent."""
    c0 = cpu_seconds(server.broker_pid) + server.other_cpu()
    time.sleep(seconds)
    return round((cpu_seconds(server.broker_pid) + server.other_cpu() - c0) / seconds, 4)


def _profile_module():
    """benchmarks/profile.py (by path: the standard library has a module named profile)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("txmq_benchmarks_profile", HERE / "profile.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


class Spy:
    """py-spy record (raw collapsed stacks; non-blocking unless native) on a pid until stopped; ``summary()`` is benchmarks/profile.py's."""

    def __init__(self, pid: int, out: Path, rate: int = 250, native: bool = False) -> None:
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not Path(spy).exists():
            sys.exit("py-spy not found: .venv/bin/pip install py-spy")
        self.out = out
        self.proc = subprocess.Popen([spy, "record", *(["--native"] if native else ["--nonblocking"]), "-p", str(pid), "-r", str(rate), "-f", "raw", "-o", str(out)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)

    def summary(self, top: int = 25) -> str:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return _profile_module().summarise(self.out, top) if self.out.exists() else f"no samples: {self.proc.stderr.read().decode()[-500:]}"  # type: ignore[union-attr]


# ---- a sitting --------------------------------------------------------------------------------------
def sitting(peer: RocketMQPeer, home: Path, flush: str, a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"flush": flush, "servers": {}, "runs": []}
    servers = [s for s in (RocketMQ(peer, flush, a.heap), Txmq(home, flush), TxmqWorkers(home, flush, a.workers)) if s.name in a.servers]
    started = []
    try:
        for s in servers:  # one at a time: each boots with the machine to itself
            say(f"[{flush}] starting {s.name}")
            s.start()
            started.append(s)
            info = {**s.boot, "load1_at_start": load1(), "rss_at_ready": rss(s.pids)}
            info["idle_cpu_per_s"] = idle_cpu(s, a.idle) if a.idle > 0 else None
            info["rss_idle"] = rss(s.pids)
            out["servers"][s.name] = info
            say(f"[{flush}] {s.name} ready in {s.boot['ready_s']} s, broker VmRSS {info['rss_idle']['broker_VmRSS']} MiB"
                + (f", {s.workers} workers {info['rss_idle']['workers_VmRSS']} MiB" if isinstance(s, TxmqWorkers) else ""))
        for rnd in range(1, a.rounds + 1):
            for row in ROWS:
                for s in servers:
                    mode, _, thr = row.partition("_")
                    topic = f"Backlog{s.name.title().replace('-', '')}{flush.capitalize()}R{rnd}"
                    profiled = isinstance(s, Txmq) and row in a.profile and s.name in a.profile_servers  # the broker process
                    spy = Spy(s.broker_pid, home / f"stacks-{s.name}-{flush}-{row}-{rnd}.txt", native=a.native) if profiled else None
                    if row == "consume":
                        r = consume(peer, s, topic, a.n + a.warmup, a.consume_timeout)
                    else:
                        r = bench(peer, s, mode, int(thr), a.n, a.warmup, topic if row == "sync_32" else None)
                    if spy is not None:
                        r["profiled"] = True
                        key = f"{row}/round {rnd}" + ("" if s.name == "txmq" else f" ({s.name})")
                        out.setdefault("profiles", {})[key] = text = spy.summary()
                        say(text)
                    r.update(round=rnd, server=s.name, row=row)
                    out["runs"].append(r)
                    owner = f" (owner {r.get('owner_us_per_op')}, workers {r.get('workers_us_per_op')})" if s.other == "workers" else ""
                    say(f"[{flush}] round {rnd} {row:8} {s.name:12} {r['rate']:>9,.0f}/s  broker {r['broker_us_per_op']:>7} us/op{owner}  "
                        f"client {r.get('client_us_per_op', '-')} us/op  load {r['load1']}")
        for s in servers:
            out["servers"][s.name]["rss_after_load"] = rss(s.pids)
    finally:
        for s in reversed(started):
            s.stop()
        if servers and servers[0].name == "rocketmq" and servers[0] not in started:
            servers[0].stop()  # a start that failed half-way: run.sh stop kills only what this run dir started
    out["summary"] = summarise(out)
    return out


def best(runs: list[dict[str, Any]], server: str, row: str) -> dict[str, Any] | None:
    """The run of server on row with the highest rate (other work on a shared machine only ever slows a run down)."""
    mine = [r for r in runs if r["server"] == server and r["row"] == row and r.get("rate")]
    return max(mine, key=lambda r: r["rate"]) if mine else None


def summarise(sit: dict[str, Any]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for row in ROWS:
        r, t, w = (best(sit["runs"], name, row) for name in SERVERS)
        if r and t:
            rows[row] = {"rocketmq": r["rate"], "txmq": t["rate"], "rate_ratio": round(t["rate"] / r["rate"], 2),
                         "rocketmq_us_per_op": r["broker_us_per_op"], "txmq_us_per_op": t["broker_us_per_op"],
                         "cpu_ratio": round(t["broker_us_per_op"] / r["broker_us_per_op"], 2) if r["broker_us_per_op"] else None}
        if t and w:  # txmq-workers beside the one process
            rows.setdefault(row, {"txmq": t["rate"], "txmq_us_per_op": t["broker_us_per_op"]}).update(
                txmq_workers=w["rate"], workers_rate_ratio=round(w["rate"] / t["rate"], 2), txmq_workers_us_per_op=w["broker_us_per_op"],
                owner_us_per_op=w.get("owner_us_per_op"), workers_us_per_op=w.get("workers_us_per_op"))
    srv = sit["servers"]
    rq, tq = srv.get("rocketmq", {}), srv.get("txmq", {})
    out: dict[str, Any] = {"rows": rows}
    if srv.get("txmq-workers"):
        out["workers"] = srv["txmq-workers"].get("workers")
    if rq.get("rss_after_load") and tq.get("rss_after_load"):
        both = rq["rss_after_load"]["broker_VmRSS"] + rq["rss_after_load"]["namesrv_VmRSS"]
        out["rss_after_load_mib"] = {"rocketmq": round(both, 1), "rocketmq_broker": rq["rss_after_load"]["broker_VmRSS"],
                                     "txmq": tq["rss_after_load"]["broker_VmRSS"],
                                     "ratio": round(tq["rss_after_load"]["broker_VmRSS"] / both, 3)}
    if rq.get("ready_s") and tq.get("ready_s"):
        out["ready_s"] = {"rocketmq": rq["ready_s"], "rocketmq_boot_s": rq["boot_s"], "txmq": tq["ready_s"],
                          "times_sooner": round(min(rq["ready_s"], rq["boot_s"]) / tq["ready_s"], 1)}
    return out


def targets(sittings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target against each flush mode's summary: met or missed, and by how much."""
    out = []
    for sit in sittings:
        s, f = sit["summary"], sit["flush"]
        for row, v in s["rows"].items():
            if "rate_ratio" not in v:  # txmq-workers and txmq only
                continue
            out.append({"flush": f, "target": f"{LABELS[row]}: txmq ≥ RocketMQ", "measured": f"{v['txmq']:,.0f} vs {v['rocketmq']:,.0f} = {v['rate_ratio']}×",
                        "met": v["rate_ratio"] >= 1})
            if v["cpu_ratio"] is not None:
                out.append({"flush": f, "target": f"{LABELS[row]}: broker CPU/op ≤ ½ RocketMQ's",
                            "measured": f"{num(v['txmq_us_per_op'])} vs {num(v['rocketmq_us_per_op'])} µs = {v['cpu_ratio']}×", "met": v["cpu_ratio"] <= 0.5})
        if "rss_after_load_mib" in s:
            m = s["rss_after_load_mib"]
            out.append({"flush": f, "target": "RSS ≤ ¼ RocketMQ's (name server + broker)", "measured": f"{m['txmq']} vs {m['rocketmq']} MiB = {m['ratio']}×",
                        "met": m["ratio"] <= 0.25})
        if "ready_s" in s:
            m = s["ready_s"]
            out.append({"flush": f, "target": "ready ≥ 4× sooner", "measured": f"{m['txmq']} s vs {min(m['rocketmq'], m['rocketmq_boot_s'])} s = {m['times_sooner']}× sooner",
                        "met": m["times_sooner"] >= 4})
        v = s["rows"].get("tx_32", {})
        if "workers_rate_ratio" in v:  # met is None: a figure for information
            out.append({"flush": f, "target": f"{LABELS['tx_32']}: with {s.get('workers')} workers ≥ 2× txmq's one process",
                        "measured": f"{v['txmq_workers']:,.0f} vs {v['txmq']:,.0f} = {v['workers_rate_ratio']}×", "met": v["workers_rate_ratio"] >= 2})
            out.append({"flush": f, "target": f"{LABELS['tx_32']}: broker process CPU/op with {s.get('workers')} workers",
                        "measured": f"{num(v['owner_us_per_op'])} µs (+ workers {num(v['workers_us_per_op'])} µs) vs txmq's one process "
                                    f"{num(v['txmq_us_per_op'])} µs", "met": None})
    return out


def verdict(met: bool | None, md: bool = False) -> str:
    """A target's column: met, missed, or a figure for information."""
    return "info" if met is None else "met" if met else "**missed**" if md else "MISSED"


# ---- output -----------------------------------------------------------------------------------------
def num(x: Any) -> str:
    return "-" if x is None else f"{x:,.0f}" if isinstance(x, (int, float)) and abs(x) >= 100 else str(x)


# text table: each server's column group (header cells, then one run's cells)
COLUMNS = {"rocketmq": (("RocketMQ/s", 10, "rate"), ("µs/op", 7, "broker_us_per_op"), ("client", 7, "client_us_per_op"), ("load", 5, "load1")),
           "txmq": (("txmq/s", 9, "rate"), ("µs/op", 7, "broker_us_per_op"), ("client", 7, "client_us_per_op"), ("load", 5, "load1")),
           "txmq-workers": (("txmq-workers/s", 14, "rate"), ("µs/op", 7, "broker_us_per_op"), ("owner", 7, "owner_us_per_op"),
                            ("client", 7, "client_us_per_op"), ("load", 5, "load1"))}
# Markdown: each server's title and column group
MD_TITLES = {"rocketmq": "RocketMQ 4.9.8", "txmq": "txmq", "txmq-workers": "txmq with workers"}
MD_COLUMNS = {"rocketmq": (("RocketMQ /s", "rate"), ("broker µs/op", "broker_us_per_op"), ("client µs/op", "client_us_per_op"), ("load", "load1")),
              "txmq": (("txmq /s", "rate"), ("broker µs/op", "broker_us_per_op"), ("client µs/op", "client_us_per_op"), ("load", "load1")),
              "txmq-workers": (("txmq with workers /s", "rate"), ("broker + workers µs/op", "broker_us_per_op"), ("broker process µs/op", "owner_us_per_op"),
                               ("client µs/op", "client_us_per_op"), ("load", "load1"))}


def cell(run: dict[str, Any], key: str) -> str:
    return str(run.get(key, "-")) if key == "load1" else num(run.get(key))


def table(doc: dict[str, Any]) -> str:
    lines = [f"{doc['java']}; n={doc['n']} per run (+{doc['warmup']} warm-up), {doc['rounds']} round(s); broker heap {doc['heap']}",
             f"load average at start {doc['machine']['load_avg_at_start']}, at the end {doc['load_avg_at_end']}"]
    for sit in doc["sittings"]:
        f = sit["flush"]
        lines.append(f"\n== flush {f} ==")
        for name, s in sit["servers"].items():
            extra = f" (run.sh: name server {s['namesrv_boot_s']} s + broker {s['broker_boot_s']} s)" if name == "rocketmq" else ""
            rl, ra = s["rss_idle"], s.get("rss_after_load", {})
            rss_line = f"broker VmRSS {rl['broker_VmRSS']} MiB idle, {ra.get('broker_VmRSS', '-')} after load (HWM {ra.get('broker_VmHWM', '-')})"
            if name == "rocketmq":
                rss_line += f"; name server {rl['namesrv_VmRSS']} / {ra.get('namesrv_VmRSS', '-')} MiB"
            if "workers_VmRSS" in rl:
                rss_line += f"; {s.get('workers', '?')} workers {rl['workers_VmRSS']} / {ra.get('workers_VmRSS', '-')} MiB (HWM {ra.get('workers_VmHWM', '-')})"
            lines.append(f"{name:9} ready {s['ready_s']} s{extra}; {rss_line}; idle CPU {s['idle_cpu_per_s']} s/s; load {s['load1_at_start']}")
        names = [n for n in SERVERS if n in sit["servers"]]
        lines.append(f"{'row':10} {'round':>5} | " + " | ".join(" ".join(f"{h:>{w}}" for h, w, _ in COLUMNS[n]) for n in names))
        for rnd in range(1, doc["rounds"] + 1):
            for row in ROWS:
                runs = [next((x for x in sit["runs"] if x["round"] == rnd and x["row"] == row and x["server"] == n), None) for n in names]
                if not any(runs):
                    continue
                lines.append(f"{row:10} {rnd:>5} | " + " | ".join(" ".join(f"{cell(r or {}, k):>{w}}" for _, w, k in COLUMNS[n]) for n, r in zip(names, runs)))
    lines.append("\ntargets (best round of each):")
    for t in doc["targets"]:
        lines.append(f"  [{t['flush']:5}] {verdict(t['met']):6} {t['target']}: {t['measured']}")
    return "\n".join(lines)


def md_row(label: str, cells: list[str]) -> str:
    return f"| {label} | " + " | ".join(cells) + " |"


def rss_cell(name: str, r: dict[str, float], field: str) -> str:
    """A server's memory in the conditions table: RocketMQ's name server + broker, txmq-workers' broker + workers; VmRSS with the broker alone."""
    other = "namesrv" if name == "rocketmq" else "workers" if f"workers_{field}" in r else ""
    if not other:
        return str(r["broker_" + field])
    return f"{r[f'{other}_{field}'] + r['broker_' + field]:.1f}" + (f" ({r['broker_' + field]})" if field == "VmRSS" else "")


def markdown(doc: dict[str, Any]) -> str:
    """The figures as the Markdown tables of docs/benchmarks.md's section (conditions, each round, the targets)."""
    m = doc["machine"]
    nice = f"nice -n {doc['nice']} " if doc.get("nice") else ""
    out = [f"Run on {doc['started']} with `{nice}{doc['command']}` ({doc['took_s']} s in all). {m['cores']} cores ({m['cpu_model']}), "
           f"{m['memory_gib']} GiB memory, stores in {Path(m['data_dir']).parent} on {m['disk']['device']} ({m['disk']['fs']}), Linux {m['kernel']}, "
           f"Python {m['python']}; {doc['java']}; load average at start {m['load_avg_at_start']}, at the end {doc['load_avg_at_end']}. "
           f"TxBench: n = {doc['n']:,} per run after {doc['warmup']} warm-up, 128-byte bodies; rounds: {doc['rounds']}; RocketMQ broker heap {doc['heap']}.", ""]
    for sit in doc["sittings"]:
        f = sit["flush"]
        names = [n for n in SERVERS if n in sit["servers"]] if "txmq-workers" in sit["servers"] else ["rocketmq", "txmq"]
        out += [f"**{f} flush**", "", "| | " + " | ".join(MD_TITLES[n] for n in names) + " |", "| --- |" + " ---: |" * len(names)]
        srv = {n: sit["servers"][n] for n in names if n in sit["servers"]}
        if len(srv) == len(names) and len(names) > 1:
            also = "txmq-workers" in srv  # the labels name what each server's cell sums
            rss_label = "; ".join([*(["name server + broker (broker alone)"] if "rocketmq" in srv else []),
                                   *(["with workers: broker + workers (broker alone)"] if also else [])])
            hwm_label = "; ".join([*(["name server + broker"] if "rocketmq" in srv else []), *(["with workers: broker + workers"] if also else [])])
            out.append(md_row("time to ready, s (spawn → route answered; RocketMQ's own boot times)",
                              [f"{s['ready_s']} ({s['namesrv_boot_s']} + {s['broker_boot_s']})" if n == "rocketmq" else str(s["ready_s"]) for n, s in srv.items()]))
            for when, key in (("at ready", "rss_at_ready"), (f"after {doc['idle_s']:g} s idle", "rss_idle"), ("after the load", "rss_after_load")):
                out.append(md_row(f"RSS MiB {when}: {rss_label}",
                                  [rss_cell(n, s[key], "VmRSS") for n, s in srv.items()]))
            out.append(md_row("… of it RssAnon / RssFile, broker, after the load",
                              [f"{s['rss_after_load']['broker_RssAnon']} / {s['rss_after_load']['broker_RssFile']}" for s in srv.values()]))
            out.append(md_row(f"peak (VmHWM) MiB: {hwm_label}",
                              [rss_cell(n, s["rss_after_load"], "VmHWM") for n, s in srv.items()]))
            out.append(md_row("idle CPU, s per s" + ("; with workers: broker + workers" if also else ""), [str(s["idle_cpu_per_s"]) for s in srv.values()]))
            out.append(md_row("load average (1 min) at boot", [str(s["load1_at_start"]) for s in srv.values()]))
        names = [n for n in SERVERS if n in sit["servers"]] or ["rocketmq", "txmq"]
        cols = [c for n in names for c in MD_COLUMNS[n]]
        out += ["", "| row | round | " + " | ".join(h for h, _ in cols) + " |", "| --- |" + " ---: |" * (len(cols) + 1)]
        for row_ in ROWS:
            for rnd in range(1, doc["rounds"] + 1):
                cells = []
                for name in names:
                    r = next((x for x in sit["runs"] if x["round"] == rnd and x["row"] == row_ and x["server"] == name), {})
                    cells += [cell(r, k) for _, k in MD_COLUMNS[name]]
                out.append(f"| {LABELS[row_]} | {rnd} | " + " | ".join(cells) + " |")
        out.append("")
    out += ["| flush | target | measured (best round of each) | |", "| --- | --- | --- | --- |"]
    out += [f"| {t['flush']} | {t['target']} | {t['measured']} | {verdict(t['met'], md=True)} |" for t in doc["targets"]]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one round, sync flush, n=200: checks the script runs (about a minute)")
    ap.add_argument("--flush", default=None, help="flush modes, in order (default sync,async; --quick: sync)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 2; --quick: 1)")
    ap.add_argument("-n", type=int, default=None, help="operations per TxBench run (default 3000; --quick: 200)")
    ap.add_argument("--warmup", type=int, default=None, help="TxBench warm-up operations per run (default 500; --quick: 50)")
    ap.add_argument("--heap", default="512m", help="RocketMQ broker heap (run.sh -H; the name server has 256m)")
    ap.add_argument("--idle", type=float, default=None, help="idle seconds after each boot, CPU sampled (default 10; --quick: 1)")
    ap.add_argument("--consume-timeout", type=float, default=120)
    ap.add_argument("--servers", default="rocketmq,txmq",
                    help="which to run, of rocketmq, txmq, txmq-workers (default rocketmq,txmq; one alone: no comparison)")
    ap.add_argument("--workers", type=int, default=2, help="txmq-workers: its --frontend-processes (default 2)")
    ap.add_argument("--profile", default="", help="rows (e.g. tx_32,sync_1) whose txmq runs py-spy samples (the broker process, also that of "
                                                   "txmq-workers when run; --profile-server picks one); their figures carry its cost")
    ap.add_argument("--profile-server", default="txmq,txmq-workers", help="with --profile: the txmq server(s) profiled (default both that run)")
    ap.add_argument("--native", action="store_true", help="with --profile: py-spy --native (C frames: uvloop, the store's extension; it pauses the broker per sample)")
    ap.add_argument("-o", "--output", default="table", choices=("table", "json", "md"))
    ap.add_argument("--from-json", type=Path, default=None, help="print a saved result (benchmarks/results/rocketmq_peer.json) as -o says; runs nothing")
    a = ap.parse_args()
    if a.from_json:
        doc = json.loads(a.from_json.read_text())
        print(json.dumps(doc, indent=2) if a.output == "json" else markdown(doc) if a.output == "md" else table(doc))
        return
    a.servers = a.servers.split(",")
    a.profile = [r for r in a.profile.split(",") if r]
    a.profile_servers = [r for r in a.profile_server.split(",") if r]
    if not a.servers or not set(a.servers) <= set(SERVERS) or not set(a.profile) <= set(ROWS) or not set(a.profile_servers) <= {"txmq", "txmq-workers"}:
        ap.error(f"--servers: {', '.join(SERVERS)}; --profile: {', '.join(ROWS)}; --profile-server: txmq, txmq-workers")
    if a.workers < 1:
        ap.error("--workers: at least 1")
    a.flush = (a.flush or ("sync" if a.quick else "sync,async")).split(",")
    if not set(a.flush) <= {"sync", "async"}:
        ap.error("--flush: sync, async or both")
    a.rounds = a.rounds or (1 if a.quick else 2)
    a.n = a.n or (200 if a.quick else 3000)
    a.warmup = a.warmup if a.warmup is not None else (50 if a.quick else 500)
    a.idle = a.idle if a.idle is not None else (1.0 if a.quick else 10.0)
    t0 = time.perf_counter()
    if os.getloadavg()[0] > (os.cpu_count() or 1) / 2:
        say(f"warning: load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores: figures will be low and noisy")
    home = Path(tempfile.mkdtemp(prefix="txmq-rocketmq-peer-bench-", dir=data_disk_dir()))
    peer = RocketMQPeer(home / "rocketmq")
    doc: dict[str, Any] = {"kind": "rocketmq_peer", "command": command_line(), "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                           "machine": machine_info(home), "n": a.n, "warmup": a.warmup, "rounds": a.rounds, "heap": a.heap,
                           "idle_s": a.idle, "quick": a.quick, "nice": os.nice(0), **({"workers": a.workers} if "txmq-workers" in a.servers else {})}
    try:
        say("laying out the peer (setup.sh)")
        peer.prepare()
        doc["java"] = java_version()
        doc["sittings"] = [sitting(peer, home, f, a) for f in a.flush]
    except PeerUnavailable as exc:  # no peer, Java or jars here: exit 77, "skipped" (the smoke test skips on it)
        print(f"RocketMQ 4.9.8 peer unavailable: {exc}", file=sys.stderr)
        sys.exit(77)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    doc["targets"] = targets(doc["sittings"])
    doc["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["took_s"] = round(time.perf_counter() - t0, 1)
    if not a.quick and not a.profile and {"rocketmq", "txmq"} <= set(a.servers):
        say(f"saved {save_result('rocketmq_peer', doc)}")
    print(json.dumps(doc, indent=2) if a.output == "json" else markdown(doc) if a.output == "md" else table(doc))


if __name__ == "__main__":
    main()
