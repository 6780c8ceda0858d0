"""Run `txmq broker start` as a subprocess (for crash and CLI tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                    return self
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"broker did not start: {self.log.read_text()[-2000:]}")

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
