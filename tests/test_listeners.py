"""Every port `txmq broker start` listens on: a port in use is one line.

The native port, `--rocketmq-port` (gRPC) and `--metrics-port`
(Prometheus): a port another process holds ends the start with exit 1 and
one `error:` line naming the address, the option and the system's reason,
with nothing else but the structured log lines (no line of gRPC's C core,
no hint about GRPC_VERBOSITY, no traceback).
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from brokerproc import free_port
from clihelpers import cli_env


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


@pytest.mark.parametrize("option", ["--port", pytest.param("--rocketmq-port", marks=needs_rocketmq), "--metrics-port"])
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
    assert others == [f"error: cannot listen on 127.0.0.1:{busy}{named}: Address already in use"], stderr
    assert "GRPC_VERBOSITY" not in stderr and "Traceback" not in stderr
