"""Helpers for the CLI tests: run the real `txmq` entry point against a real broker process.

No tests here; the test_cli_* modules import what they need. Each module
starts its own broker (a subprocess, short check settings) on a free port.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from brokerproc import BrokerProcess, port_taken

TXMQ = str(Path(sys.executable).with_name("txmq"))
if not os.path.exists(TXMQ):  # not in a venv with the console script: go through the module
    TXMQ = ""

# exit codes, as documented in docs/cli.md (cli/exitcodes.py)
OK, ERROR, USAGE, UNREACHABLE, REFUSED, NOT_FOUND, CONFLICT, PARTIAL = 0, 1, 2, 3, 4, 5, 6, 7

FAST_CHECKS = ("--check-interval", "1s", "--transaction-timeout", "0s")


def cli_argv(*args: str) -> list[str]:
    return [TXMQ, *args] if TXMQ else [sys.executable, "-m", "txmq", *args]


def cli_env(broker: str | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TXMQ_BROKER", "TXMQ_AUTH_TOKEN", "TXMQ_DEBUG", "TXMQ_DATA_DIR")}
    env.update(COLUMNS="200", NO_COLOR="1")
    if broker:
        env["TXMQ_BROKER"] = broker
    env.update(extra)
    return env


# Most calls run `txmq.cli.main.main()` (the console script's entry point) inside the test process:
# the same code path, without paying Python's start-up ~100 times. Calls with stdin input, and
# pipelines and signals (`shell`, `cli_argv`) run the installed `txmq` in a subprocess;
# TXMQ_TEST_SUBPROCESS=1 makes every call a subprocess.
ALWAYS_SUBPROCESS = os.environ.get("TXMQ_TEST_SUBPROCESS", "") not in ("", "0")


def txmq(*args: str, broker: str | None = None, input: str | bytes | None = None, timeout: float = 30,
         env: dict[str, str] | None = None, subprocess_: bool = False) -> subprocess.CompletedProcess:
    """Run `txmq ARGS` to completion (stdin closed unless `input`)."""
    if input is None and not subprocess_ and not ALWAYS_SUBPROCESS:
        return _in_process(list(args), {**cli_env(broker), **(env or {})})
    return subprocess.run(
        cli_argv(*args), input=input.encode() if isinstance(input, str) else input,
        stdin=None if input is not None else subprocess.DEVNULL, capture_output=True, timeout=timeout,
        env={**cli_env(broker), **(env or {})},
    )


class _Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def _in_process(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    from txmq.cli.main import main

    saved_env = dict(os.environ)
    saved = sys.argv, sys.stdin, sys.stdout, sys.stderr
    stdout, stderr = _Pipe(), _Pipe()
    code = 0
    os.environ.clear()
    os.environ.update(env)
    sys.argv, sys.stdin, sys.stdout, sys.stderr = ["txmq", *args], _Pipe(), stdout, stderr
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv, sys.stdin, sys.stdout, sys.stderr = saved
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["txmq", *args], code, stdout.getvalue().encode(), stderr.getvalue().encode())


def shell(cmd: str, broker: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run a shell pipeline with `txmq` on PATH (the venv's)."""
    path = os.path.dirname(TXMQ) if TXMQ else os.path.dirname(sys.executable)
    env = cli_env(broker, PATH=f"{path}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run(["/bin/sh", "-c", cmd], capture_output=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def out(r: subprocess.CompletedProcess) -> str:
    return r.stdout.decode()


def err(r: subprocess.CompletedProcess) -> str:
    return r.stderr.decode()


def lines(r: subprocess.CompletedProcess) -> list[dict[str, Any]]:
    """The JSON objects of a jsonl stdout."""
    return [json.loads(ln) for ln in out(r).splitlines() if ln.strip()]


def one(r: subprocess.CompletedProcess) -> Any:
    assert r.returncode == 0, err(r)
    return json.loads(out(r))


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"exit {r.returncode}: {err(r)}"
    return r


def start_broker(root: Path, *args: str, name: str = "broker") -> BrokerProcess:
    """A broker subprocess on a free port (retried if another process takes the port first)."""
    last: Exception | None = None
    for attempt in range(5):
        data = root / f"{name}-{attempt}" / "data"
        data.parent.mkdir(parents=True, exist_ok=True)
        b = BrokerProcess(data, *FAST_CHECKS, *args)
        try:
            b.start()
        except (RuntimeError, TimeoutError) as e:  # e.g. the port was taken between picking and binding
            last = e
            b.stop()
            if port_taken(str(e)) not in (None, "--port"):  # a port of args: the same args would find it taken again
                raise
            continue
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            token = [a for i, a in enumerate(args) if i and args[i - 1] == "--auth-token"]
            r = txmq("broker", "status", "-o", "json", broker=b.address, env={"TXMQ_AUTH_TOKEN": token[0]} if token else None)
            if r.returncode == 0:
                return b
            time.sleep(0.1)
        b.stop()
        last = RuntimeError(f"broker at {b.address} never answered: {err(r)}")
    raise RuntimeError(f"could not start a broker: {last}")


def refused_start(tmp_path: Path, *args: str) -> str:
    """`txmq broker start ARGS` on tmp_path/data exits 2, without a traceback, before it creates the
    data directory; its stderr."""
    data = tmp_path / "data"
    r = txmq("broker", "start", "--data-dir", str(data), *args, subprocess_=True)
    text = err(r)
    assert r.returncode == USAGE and "Traceback" not in text, f"exit {r.returncode}: {text}"
    assert not data.exists()
    return text


def wait_for(pred, timeout: float = 10.0, every: float = 0.2, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)


def has_jq() -> bool:
    return shutil.which("jq") is not None


needs_jq = pytest.mark.skipif(not has_jq(), reason="jq is not installed (apt-get install -y jq)")
