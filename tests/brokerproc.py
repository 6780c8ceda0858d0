"""Run `txmq broker start` as a subprocess (for crash and CLI tests)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


_handed_out: dict[int, None] = {}  # the ports free_port() gave, oldest first (the last 4096)


def free_port() -> int:
    """A loopback port nothing listens on now, never one this process was given before: the kernel may hand the port
    it just gave out (closed again at once) to the next bind to port 0, and a test that picks the native and the
    remoting port one after the other would then start a broker that cannot bind its second port."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out[port] = None
            if len(_handed_out) > 4096:
                del _handed_out[next(iter(_handed_out))]
            return port


# the options whose port the broker binds before it serves (and exits when it cannot)
PORT_OPTIONS = ("--remoting-port", "--rocketmq-port", "--metrics-port")


def _family(pid: int) -> list[int]:
    """pid and its descendants (a broker's front-end workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    family, todo = [], [pid]
    while todo:
        p = todo.pop()
        family.append(p)
        todo.extend(children.get(p, ()))
    return family


def listens_on(pid: int, ports: list[int]) -> bool:
    """Whether each of ports is listened on by process pid or one of its descendants (a broker's front-end workers
    listen on its RocketMQ and remoting ports): a port picked free can be taken by another process before the broker
    binds it, and a connection to it would then reach that process. Found as `broker start` names a port's holder."""
    from txmq.cli.commands._ports import holder

    family = set(_family(pid))
    return all((h := holder(port)) is not None and h.pid in family for port in ports)


def port_taken(error: str) -> str | None:
    """The option (--port, --remoting-port, --rocketmq-port, --metrics-port) whose port a broker that did not start
    found taken, as its error names it; None for any other reason."""
    m = re.search(r"cannot listen on \S+?(?: \((--[a-z-]*port)(?:,[^)]*)?\))?: [^;]*(?:in use|held by)", error)
    return (m.group(1) or "--port") if m else None  # the native port's error names no option


class BrokerProcess:
    def __init__(self, data_dir: Path, *args: str, port: int | None = None, env: dict | None = None, preexec=None) -> None:
        self.data_dir = Path(data_dir)
        self.args = list(args)
        self.port = port or free_port()
        self.env = env
        self.preexec = preexec  # e.g. set a resource limit in the child
        self.proc: subprocess.Popen | None = None
        self.log = self.data_dir.parent / f"broker-{self.port}.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> "BrokerProcess":
        cmd = [sys.executable, "-m", "txmq", "broker", "start", "--data-dir", str(self.data_dir), "--port", str(self.port), *self.args]
        # a fatal signal dumps every thread's stack into the log (stop() sends SIGABRT to a broker that hangs)
        env = {**os.environ, "PYTHONFAULTHANDLER": "1", **(self.env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"), env=env,
                                     preexec_fn=self.preexec)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    pass
            except OSError:
                time.sleep(0.05)
                continue
            # the native port answers once bound, before the RocketMQ, remoting and metrics ports are: each of them
            # served by this broker (or its front-end workers), not by a process that took it first (the broker exits
            # when it cannot bind one)
            if listens_on(self.proc.pid, [self.port, *self._option_ports()]):
                return self
            time.sleep(0.05)
        raise TimeoutError(f"broker did not start: {self.log.read_text()[-2000:]}")

    def _option_ports(self) -> list[int]:
        ports = []
        for i, arg in enumerate(self.args):
            name, eq, value = arg.partition("=")
            if name in PORT_OPTIONS:
                value = value if eq else (self.args[i + 1] if i + 1 < len(self.args) else "")
                if value.isdigit() and int(value):
                    ports.append(int(value))
        return ports

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; a broker still running after timeout gets SIGABRT (its threads' stacks go to the log), then SIGKILL."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGABRT)
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
                self.kill()
                return -9
        return self.proc.returncode if self.proc else 0

    def __enter__(self) -> "BrokerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
