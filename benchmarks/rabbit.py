"""The peer: RabbitMQ AMQP transactions, on a node this script starts and stops.

Each client is one AMQP connection with one channel in transaction mode
(``tx.select``); one unit of work is a persistent publish (delivery_mode 2)
of a 256-byte body to a durable queue followed by ``tx.commit``, which
RabbitMQ answers once the message is on disk (fsynced). Clients publish to
4 durable queues (client i to queue i mod 4), like txmq's 4 queues per topic.

The node: Debian's ``rabbitmq-server`` (``apt-get install -y rabbitmq-server``),
run as the current user on 127.0.0.1 with a temporary RABBITMQ_MNESIA_BASE
and RABBITMQ_LOG_BASE, free ports, a unique node name and no plugins; epmd
(which the node starts if none runs) listens on 127.0.0.1 only and is
stopped again afterwards when this script started it. Nothing is installed
here: when the server or the Python client (``pip install aio-pika``) is
missing, ``available()`` says why and the comparison skips the peer.

Run alone: ``.venv/bin/python benchmarks/rabbit.py [--seconds 5] [--clients 1 32]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import cpu_seconds, free_port, install_uvloop, percentiles_ms, proc_status, tree_cpu_seconds, wait_port  # noqa: E402

# Debian installs wrappers in /usr/sbin that re-run the real scripts as the
# `rabbitmq` user with its own HOME and data directory; the scripts under
# /usr/lib/rabbitmq/bin honour our environment and run as us.
LIB_BIN = Path("/usr/lib/rabbitmq/bin")
INSTALL_HINT = "apt-get install -y rabbitmq-server"


def _tool(name: str) -> str | None:
    direct = LIB_BIN / name
    if direct.exists():
        return str(direct)
    return shutil.which(name) or (f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists() else None)


def available() -> str | None:
    """None when the peer can run; else a sentence saying why not and how to fix it."""
    if _tool("rabbitmq-server") is None or _tool("rabbitmqctl") is None:
        return f"RabbitMQ is not installed (rabbitmq-server / rabbitmqctl not found); install it with: {INSTALL_HINT}"
    try:
        import aiormq  # noqa: F401  (comes with aio-pika)
    except ImportError:
        return "the Python AMQP client is missing; install it with: .venv/bin/pip install aio-pika"
    return None


def _epmd_running() -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", 4369), timeout=0.2).close()
        return True
    except OSError:
        return False


class RabbitNode:
    """A throwaway RabbitMQ node on 127.0.0.1; a context manager."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="txmq-rabbit-"))
        self.port = free_port()
        self.dist_port = free_port()
        self.name = f"txmqbench{os.getpid()}@localhost"
        self.proc: subprocess.Popen | None = None
        self._started_epmd = False
        self.version = "?"
        (self.tmp / "home").mkdir()
        (self.tmp / "enabled_plugins").write_text("[].\n")
        (self.tmp / "rabbitmq.conf").write_text("")
        (self.tmp / "rabbitmq-env.conf").write_text("")
        self.env = {
            **os.environ,
            "HOME": str(self.tmp / "home"),  # the Erlang cookie lives here
            "RABBITMQ_MNESIA_BASE": str(self.tmp / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.tmp / "log"),
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.tmp / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.tmp / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.tmp / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(self.tmp / "rabbitmq-env.conf"),
            "RABBITMQ_PID_FILE": str(self.tmp / "rabbit.pid"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([_tool("rabbitmqctl"), "-n", self.name, *args], env=self.env, capture_output=True, text=True, timeout=timeout)  # type: ignore[list-item]

    def __enter__(self) -> "RabbitNode":
        self._started_epmd = not _epmd_running()
        log = open(self.tmp / "server.out", "wb")
        self.proc = subprocess.Popen([_tool("rabbitmq-server")], env=self.env, stdout=log, stderr=subprocess.STDOUT,  # type: ignore[list-item]
                                     start_new_session=True)
        try:
            wait_port(self.port, 120, self.proc)
            r = self.ctl("await_startup", "--timeout", "60")
            if r.returncode != 0:
                raise RuntimeError(f"rabbitmqctl await_startup failed: {r.stderr.strip()[-500:]}")
            v = self.ctl("version")
            self.version = v.stdout.strip() or "?"
        except BaseException:
            self.__exit__()
            raise
        return self

    def beam_pid(self) -> int:
        try:
            return int((self.tmp / "rabbit.pid").read_text().strip())
        except (OSError, ValueError):
            return self.proc.pid if self.proc else 0

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.ctl("stop", timeout=60)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._started_epmd and shutil.which("epmd"):
            # Refuses (and is harmless) while another node still uses it.
            subprocess.run(["epmd", "-kill"], env=self.env, capture_output=True, timeout=10)
        shutil.rmtree(self.tmp, ignore_errors=True)


async def _tx_load(url: str, clients: int, seconds: float, size: int, queues: int = 4) -> dict[str, Any]:
    # aiormq is aio-pika's protocol layer: the same AMQP frames for a third
    # less client CPU per transaction, so the client flatters the peer, not txmq.
    import aiormq

    body = os.urandom(size // 2).hex().encode()[:size].ljust(size, b"x")
    props = aiormq.spec.Basic.Properties(delivery_mode=2)  # persistent
    conns = [await aiormq.connect(url) for _ in range(clients)]
    chans = [await c.channel(publisher_confirms=False) for c in conns]
    names = [f"bench-{i}" for i in range(queues)]
    for n in names:
        await chans[0].queue_declare(n, durable=True)
        await chans[0].queue_purge(n)
    for ch in chans:
        await ch.tx_select()
    lat: list[float] = []
    errors: dict[str, int] = {}
    t0 = time.perf_counter()
    deadline = t0 + seconds

    async def client(i: int) -> int:
        ch, rk, n = chans[i], names[i % queues], 0
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            try:
                await ch.basic_publish(body, routing_key=rk, properties=props)
                await ch.tx_commit()
            except Exception as e:  # count it, like txmq bench; a closed channel ends this client
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                if ch.is_closed:
                    break
                continue
            lat.append(time.perf_counter() - start)
            n += 1
        return n

    done = sum(await asyncio.gather(*(client(i) for i in range(clients))))
    elapsed = time.perf_counter() - t0
    for c in conns:
        await c.close()
    return {"clients": clients, "completed": done, "elapsed_s": round(elapsed, 3), "throughput": round(done / elapsed, 1),
            "unit": "transactions/s", "latency_ms": {"tx": percentiles_ms(lat)}, "errors": errors}


def tx_load(node: RabbitNode, clients: int, seconds: float, size: int = 256) -> dict[str, Any]:
    """One measurement: `clients` connections doing publish + tx.commit back to back."""
    install_uvloop()
    beam = node.beam_pid()
    root = node.proc.pid if node.proc else beam
    c0, me0 = tree_cpu_seconds(root), cpu_seconds(os.getpid())
    res = asyncio.run(_tx_load(node.url, clients, seconds, size))
    res["broker_cpu_s"] = round(tree_cpu_seconds(root) - c0, 3)
    res["client_cpu_s"] = round(cpu_seconds(os.getpid()) - me0, 3)
    res["broker_rss_mb"] = round(proc_status(beam, "VmRSS"), 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--size", type=int, default=256)
    a = ap.parse_args()
    why = available()
    if why:
        print(f"skipping RabbitMQ: {why}", file=sys.stderr)
        sys.exit(0)
    with RabbitNode() as node:
        out = {"version": node.version, "runs": [tx_load(node, c, a.seconds, a.size) for c in a.clients]}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
