"""The container image (Dockerfile, docs/container.md): built, run, used by RocketMQ's Python SDK, stopped, restarted.

Needs a reachable Docker daemon; skipped with the reason where there is none. No registry image is pulled: the
base is TXMQ_IMAGE_BASE if that image is present, otherwise it is built by scripts/image-base.sh, the recipe of
`make image-base` (a Debian bookworm minbase root file system with python3 and python3-venv from debootstrap,
TXMQ_DEBIAN_MIRROR, trimmed and `docker import`ed), as txmq-test-base (kept, so the next run reuses it). The
image itself is built the documented way, `make image`, whose output must hold no warning. The container runs
with host networking on free ports bound to 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from datetime import datetime

import pytest

from brokerproc import free_port
from clihelpers import lines, ok, txmq
from sdkenv import REPO, python_scenario, python_sdk_python, wait_for_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a first run builds the base, the wheels and the image

BASE = os.environ.get("TXMQ_IMAGE_BASE") or "txmq-test-base"
IMAGE = "txmq-test:latest"
MIRROR = os.environ.get("TXMQ_DEBIAN_MIRROR") or "http://deb.debian.org/debian"
FAST_CHECKS = ["--check-interval", "1s", "--transaction-timeout", "0s"]


def docker(*args: str, timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check:
        assert r.returncode == 0, f"docker {' '.join(args)}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def _require_docker() -> None:
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI on PATH: the container image test needs a Docker daemon")
    try:
        r = docker("info", "--format", "{{.ServerVersion}}", timeout=30, check=False)
    except subprocess.TimeoutExpired:
        pytest.skip("the Docker daemon did not answer `docker info` in 30 s")
    if r.returncode != 0 or not r.stdout.strip():
        pytest.skip(f"no Docker daemon reachable: {r.stderr.strip()[:300]}")


def _image_exists(name: str) -> bool:
    return docker("image", "inspect", name, check=False).returncode == 0


def _build_base() -> None:
    """A Debian bookworm base with Python 3.11 (the wheel's cp311), built as `make image-base` builds it, as BASE."""
    if _image_exists(BASE):
        return
    if BASE != "txmq-test-base":
        pytest.skip(f"TXMQ_IMAGE_BASE={BASE} is not a local image (this test pulls nothing)")
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        pytest.skip("no base image txmq-test-base and no way to build one here (debootstrap, as root)")
    r = subprocess.run([str(REPO / "scripts" / "image-base.sh"), BASE], capture_output=True, text=True, timeout=1200,
                       env={**os.environ, "TXMQ_DEBIAN_MIRROR": MIRROR})
    if r.returncode != 0 and "debootstrap from" in r.stderr:
        pytest.skip(r.stderr.strip()[-500:])
    assert r.returncode == 0, f"scripts/image-base.sh failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    print("\n" + r.stdout.strip())


@pytest.fixture(scope="module")
def image():
    _require_docker()
    _build_base()
    r = subprocess.run(["make", "image", f"BASE={BASE}", f"IMAGE={IMAGE}"], cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, f"make image failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    # The Dockerfile's steps print no warning (their output, the RUN commands' stderr too, is on stdout after the
    # `docker build` line; the docker CLI's own notices on stderr, such as its legacy builder's deprecation where
    # the buildx plugin is not installed, are about the Docker installation).
    steps = r.stdout[r.stdout.index("docker build "):]
    warnings = [line for line in steps.splitlines() if re.search(r"warn|deprecat", line, re.I)]
    assert not warnings, "the image build printed warnings:\n" + "\n".join(warnings)
    size = int(docker("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    base = int(docker("image", "inspect", "--format", "{{.Size}}", BASE).stdout)
    print(f"\nimage {IMAGE}: {size / 1e6:.0f} MB (base {BASE}: {base / 1e6:.0f} MB)")
    return IMAGE


def _wait_healthy(name: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while True:
        state = json.loads(docker("inspect", "--format", "{{json .State}}", name).stdout)
        health = (state.get("Health") or {}).get("Status")
        if health == "healthy":
            return health
        assert state["Running"], f"the container exited ({state.get('ExitCode')}): {docker('logs', name, check=False).stderr[-3000:]}"
        assert time.monotonic() < deadline, f"not healthy after {timeout}s: {state.get('Health')}"
        time.sleep(0.2)


def _timestamp(text: str) -> datetime:
    """An RFC 3339 time as Docker (nanoseconds) or the broker's log (milliseconds) writes it."""
    text = re.sub(r"(\.\d{6})\d*", r"\1", text.strip().replace("Z", "+00:00"))
    return datetime.fromisoformat(text)


def _in_container_start_up(name: str) -> float:
    """Seconds from the container's start (Docker's StartedAt) to the broker's broker_ready log line."""
    started = _timestamp(docker("inspect", "--format", "{{.State.StartedAt}}", name).stdout)
    logs = docker("logs", name)
    ready = re.search(r"^ts=(\S+) .*event=broker_ready", logs.stdout + logs.stderr, re.M)
    assert ready, logs.stderr[-3000:]
    return (_timestamp(ready.group(1)) - started).total_seconds()


def _stop(name: str) -> tuple[int, float]:
    """`docker stop` (SIGTERM, then SIGKILL after 30 s): the exit code and the seconds it took."""
    t0 = time.monotonic()
    docker("stop", "-t", "30", name, timeout=60)
    took = time.monotonic() - t0
    return int(docker("inspect", "--format", "{{.State.ExitCode}}", name).stdout), took


def test_image_serves_the_sdk_transactions_stops_on_sigterm_and_keeps_the_log_on_its_volume(image, tmp_path):
    sdk_python = python_sdk_python()
    suffix = uuid.uuid4().hex[:8]
    name, volume = f"txmq-test-{suffix}", f"txmq-test-data-{suffix}"
    native, grpc = free_port(), free_port()
    broker = f"127.0.0.1:{native}"
    try:
        t0 = time.monotonic()
        docker("run", "-d", "--name", name, "--network", "host", "-v", f"{volume}:/var/lib/txmq", "-e", f"TXMQ_BROKER={broker}",
               image, "--host", "127.0.0.1", "--port", str(native), "--rocketmq-port", str(grpc), *FAST_CHECKS)
        wait_for_port(native, timeout=60)
        wait_for_port(grpc, timeout=60)
        started = time.monotonic() - t0
        _wait_healthy(name)
        healthy = time.monotonic() - t0
        print(f"\nstart-up: ports accept {started:.2f}s after `docker run`, healthy after {healthy:.2f}s; "
              f"in the container, from its start to the broker's broker_ready: {_in_container_start_up(name):.2f}s")
        # PID 1 is the broker itself (exec form), so SIGTERM reaches its own handler
        assert "txmq" in docker("exec", name, "cat", "/proc/1/cmdline").stdout

        topic, group = "ContainerTx", "container-consumers"
        ok(txmq("topics", "create", topic, broker=broker))  # RocketMQ 5's clients need the topic to exist
        r = python_scenario(sdk_python, "transactions", tmp_path / "home", "--endpoint", f"127.0.0.1:{grpc}", "--topic", topic,
                            "--group", group)
        print("SDK scenario:", json.dumps({k: v for k, v in r.items() if k != "_sdk_log"}, sort_keys=True))
        committed = sorted([f"commit-{topic}", f"orphan-{topic}"])  # the orphan is committed by the check-back
        assert r["orphan_checked"], r["checks"]
        assert sorted(m["body"] for m in r["received"]) == committed, r["received"]
        assert sorted(m["body"] for m in lines(ok(txmq("read", topic, "-o", "jsonl", broker=broker)))) == committed

        code, took = _stop(name)
        print(f"docker stop: exit {code} after {took:.2f}s")
        assert code == 0, docker("logs", name).stderr[-3000:]
        assert took < 10, f"SIGTERM took {took:.1f}s to stop the broker"
        listing = docker("run", "--rm", "-v", f"{volume}:/var/lib/txmq", "--entrypoint", "find", image, "/var/lib/txmq", "-type", "f").stdout
        assert listing.strip(), "the data volume is empty after the broker stopped"

        docker("start", name)
        wait_for_port(native, timeout=60)
        assert sorted(m["body"] for m in lines(ok(txmq("read", topic, "-o", "jsonl", broker=broker)))) == committed
        code, _ = _stop(name)
        assert code == 0
    finally:
        docker("rm", "-f", name, check=False)
        docker("volume", "rm", "-f", volume, check=False)
