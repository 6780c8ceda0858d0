"""Every port `txmq broker start` listens on: one line each at start, listed by `broker status`, and a port in use is one line.

The native port, `--rocketmq-port` (gRPC) and `--metrics-port` (Prometheus):
each is logged at start with its address (`event=listening`,
`event=rocketmq_listening`, `event=metrics_listening`), `broker status`
shows them under `listeners`, and a port another process holds ends the
start with exit 1 and one `error:` line naming the address, the option,
the system's reason, the process holding the port and a free port to choose
instead, with nothing else but the structured log lines (no
line of gRPC's C core, no hint about GRPC_VERBOSITY, no traceback).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from brokerproc import BrokerProcess, free_port
from clihelpers import cli_env, one, ok, txmq


def _rocketmq_missing() -> str | None:
    try:
        from txmq.broker.rocketmq import missing_dependency
    except ImportError as exc:  # pragma: no cover - the extra's own imports
        return str(exc)
    return missing_dependency()


needs_rocketmq = pytest.mark.skipif(_rocketmq_missing() is not None, reason="the rocketmq extra is not installed")


def held_port() -> tuple[socket.socket, int]:
    """A port another listener holds (SO_REUSEADDR, as servers set it: still in use for a new listener)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s, s.getsockname()[1]


def start_to_the_end(tmp_path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "txmq", "broker", "start", "--data-dir", str(tmp_path / "data"), *args]
    return subprocess.run(cmd, capture_output=True, timeout=60, stdin=subprocess.DEVNULL, env=cli_env())


@pytest.mark.parametrize("option", ["--port", pytest.param("--rocketmq-port", marks=needs_rocketmq), "--remoting-port", "--metrics-port"])
def test_a_port_in_use_ends_the_start_with_one_line(tmp_path, option):
    holder, busy = held_port()
    try:
        args = ["--port", str(busy)] if option == "--port" else ["--port", str(free_port()), option, str(busy)]
        r = start_to_the_end(tmp_path, *args)
    finally:
        holder.close()
    stderr = r.stderr.decode()
    assert r.returncode == 1, stderr
    others = [ln for ln in stderr.splitlines() if not ln.startswith("ts=")]
    named = "" if option == "--port" else f" ({option})"
    assert len(others) == 1 and others[0].startswith(f"error: cannot listen on 127.0.0.1:{busy}{named}: Address already in use; "), stderr
    assert f"held by pid {os.getpid()}" in others[0] and f"choose another port with {option} " in others[0], stderr  # who, and what to do
    assert "GRPC_VERBOSITY" not in stderr and "Traceback" not in stderr


@needs_rocketmq
def test_every_port_is_logged_at_start_and_listed_by_broker_status(tmp_path):
    rport, mport, remport = free_port(), free_port(), free_port()
    with BrokerProcess(tmp_path / "data", "--rocketmq-port", str(rport), "--metrics-port", str(mport), "--remoting-port", str(remport)) as b:
        deadline = time.monotonic() + 20
        while "event=listening" not in b.log.read_text():
            assert time.monotonic() < deadline, b.log.read_text()
            time.sleep(0.05)
        log = b.log.read_text()
        status = one(txmq("broker", "status", "-o", "json", broker=b.address))
        table = ok(txmq("broker", "status", "-o", "table", broker=b.address)).stdout
        table = table.decode() if isinstance(table, bytes) else table
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
    starts = {ev: ln for ln in log.splitlines()
              for ev in ("event=listening ", "event=rocketmq_listening ", "event=metrics_listening ", "event=remoting_listening ")
              if ev in ln}
    assert f"host=127.0.0.1 port={b.port} " in starts["event=listening "]
    assert f"host=127.0.0.1 port={rport} " in starts["event=rocketmq_listening "]
    assert starts["event=metrics_listening "].endswith(f"host=127.0.0.1 port={mport} path=/metrics")
    assert f"host=127.0.0.1 port={remport} " in starts["event=remoting_listening "]
    assert status["listeners"] == {"native": {"host": "127.0.0.1", "port": b.port},
                                   "rocketmq": {"host": "127.0.0.1", "port": rport, "tls": False},
                                   "remoting": {"host": "127.0.0.1", "port": remport},
                                   "metrics": {"host": "127.0.0.1", "port": mport, "path": "/metrics"}}
    assert {"status", "address", "version", "uptime_s", "connections", "auth"} <= status.keys()  # the keys it always had
    assert (f"native 127.0.0.1:{b.port}, rocketmq 127.0.0.1:{rport}, remoting 127.0.0.1:{remport}, "
            f"metrics http://127.0.0.1:{mport}/metrics"
            in " ".join(table.split())), table
    assert "txmq_pending_transactions" in scrape


def test_a_broker_without_other_ports_lists_only_its_native_port(tmp_path):
    with BrokerProcess(tmp_path / "data") as b:
        status = json.loads(ok(txmq("broker", "status", "-o", "json", broker=b.address)).stdout)
    assert status["listeners"] == {"native": {"host": "127.0.0.1", "port": b.port}}


@pytest.mark.parametrize("args", [["--port", "19876", "--remoting-port", "19876"], ["--remoting-max-connections", "5"],
                                  ["--remoting-port", "19877", "--remoting-max-connections", "0"]])
def test_remoting_options_that_do_not_go_together_end_the_start_with_exit_2(tmp_path, args):
    from clihelpers import refused_start

    text = refused_start(tmp_path, *args)
    assert "--remoting" in text
