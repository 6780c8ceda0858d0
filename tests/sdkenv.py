"""Cached environments with Apache RocketMQ's official 5.x SDKs, for the end-to-end tests of the gRPC front end.

No tests here: tests/test_rocketmq_sdk_*.py and tests/test_rocketmq_mixed.py use these helpers.

- The Python SDK (`rocketmq-python-client`, pinned) goes into a virtual environment of its own, built with
  `python -m venv` + pip, never into txmq's .venv: it installs a top-level `rocketmq` package and protobuf
  modules for `apache.rocketmq.v2` that cannot share a process with txmq's generated ones. SDK code only
  ever runs in a subprocess (tests/sdk/python_scenario.py).
- The Node.js SDK (`rocketmq-client-nodejs`, pinned exactly) is `npm install`ed into a directory of its own;
  tests/sdk/node_scenario.js runs with `node`.

Both are cached under `.cache/sdk-venvs/` in the repository (gitignored; TXMQ_SDK_CACHE moves it), one
directory per pin, so only the first run pays for the download. A build that cannot download (offline, no
`npm`) makes the tests SKIP with the reason; an SDK that installed but then misbehaves makes them FAIL.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = Path(__file__).resolve().parent / "sdk"
CACHE = Path(os.environ.get("TXMQ_SDK_CACHE") or REPO / ".cache" / "sdk-venvs")

PYTHON_SDK = ("rocketmq-python-client", "5.1.2")
NODE_SDK = ("rocketmq-client-nodejs", "1.0.8")
# RocketMQ 4's remoting protocol (--remoting-port): PyPI's `rocketmq` is the Python binding of Apache's
# rocketmq-client-cpp; its manylinux wheel bundles librocketmq.so (and its zlib). npm's `ali-ons` is a pure
# JavaScript remoting client.
REMOTING_PYTHON_CLIENT = ("rocketmq", "0.4.4")
REMOTING_NODE_CLIENT = ("ali-ons", "3.12.0")
# RocketMQ 4's TransactionMQProducer from Python: PyPI's `rocketmq-client-python` (the binding, no library) with the
# librocketmq.so that PyPI's `rocketmq-python-cvs` ships in its source archive, copied next to the binding's ffi.py.
# (Installing both packages would put two versions of the same `rocketmq` modules in one directory.)
REMOTING_TX_PYTHON_CLIENT = ("rocketmq-client-python", "2.0.0")
REMOTING_TX_PYTHON_LIBRARY = ("rocketmq-python-cvs", "2.1.0.3")
_MARKER = ".complete"


class SdkUnavailable(Exception):
    """The SDK cannot be installed here (no network and nothing cached, no node/npm): a reason to skip."""


@contextmanager
def _locked(name: str):
    """One builder at a time per environment (parallel pytest workers, two checkouts sharing the cache)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_UNAVAILABLE: dict[str, str] = {}  # a failed install is tried once per test process, not once per test module


def _errors(text: bytes) -> str:
    """The error lines of pip's or npm's output (not npm's warnings), shortened."""
    lines = [ln for ln in text.decode(errors="replace").splitlines() if ln.strip() and not ln.startswith("npm warn")]
    return " | ".join(lines[:6])[:800]


def _tail(text: str | bytes, n: int = 1500) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text[-n:]


def _skip_unless_built(key: str, build: Callable[[], Path]) -> Path:
    """``build()``; skips the calling test (and, without trying again, every later one asking for ``key``) when it
    raises SdkUnavailable."""
    if key in _UNAVAILABLE:
        pytest.skip(_UNAVAILABLE[key])
    try:
        return build()
    except SdkUnavailable as e:
        _UNAVAILABLE[key] = str(e)
        pytest.skip(str(e))


def _python_env(name: str, version: str, pip_options: tuple[str, ...], probe: str, cannot_install: str, broken: str) -> Path:
    """Build (once) a virtual environment holding ``name==version`` and return its interpreter; SdkUnavailable if it
    cannot be installed. Installed, it must run ``probe`` (a failure is the environment being broken: the test fails)."""
    pyver = f"py{sys.version_info.major}{sys.version_info.minor}"
    env_dir = CACHE / f"python-{name}-{version}-{pyver}"
    python = env_dir / "bin" / "python"
    with _locked(env_dir.name):
        if not (env_dir / _MARKER).exists():
            shutil.rmtree(env_dir, ignore_errors=True)
            r = subprocess.run([sys.executable, "-m", "venv", str(env_dir)], capture_output=True, timeout=300)
            if r.returncode != 0:
                shutil.rmtree(env_dir, ignore_errors=True)
                raise SdkUnavailable(f"cannot create a virtual environment for {name}: {_errors(r.stderr)}")
            pip_env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
            pip_env.pop("PYTHONPATH", None)
            r = subprocess.run([str(python), "-m", "pip", "install", "-q", *pip_options, f"{name}=={version}"],
                               capture_output=True, timeout=900, env=pip_env)
            if r.returncode != 0:
                shutil.rmtree(env_dir, ignore_errors=True)
                raise SdkUnavailable(f"cannot install {name}=={version} ({cannot_install}): {_errors(r.stderr)}")
            # Installed: from here on a failure is the SDK's environment being broken, which must be seen.
            r = subprocess.run([str(python), "-c", probe], capture_output=True, timeout=120)
            assert r.returncode == 0, f"{name}=={version} installed but {broken}: {_tail(r.stderr)}"
            (env_dir / _MARKER).write_text(f"{name}=={version}\n")
    return python


def _npm_env(name: str, version: str, package: str, npm: str, node: str | None) -> Path:
    """Install (once) ``name@version`` into a directory of its own and return it; SdkUnavailable if it cannot be
    installed. With ``node``, the package must then load."""
    env_dir = CACHE / f"node-{name}-{version}"
    with _locked(env_dir.name):
        if not (env_dir / _MARKER).exists():
            shutil.rmtree(env_dir, ignore_errors=True)
            env_dir.mkdir(parents=True)
            (env_dir / "package.json").write_text(json.dumps({"name": package, "private": True, "version": "0.0.0"}))
            r = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--save-exact", f"{name}@{version}"],
                               cwd=env_dir, capture_output=True, timeout=900)
            if r.returncode != 0:
                shutil.rmtree(env_dir, ignore_errors=True)
                raise SdkUnavailable(f"cannot install {name}@{version} (offline?): {_errors(r.stderr)}")
            if node is not None:
                r = subprocess.run([node, "-e", f"require('{name}')"], cwd=env_dir, capture_output=True, timeout=120)
                assert r.returncode == 0, f"{name}@{version} installed but does not load: {_tail(r.stderr)}"
            (env_dir / _MARKER).write_text(f"{name}@{version}\n")
    return env_dir


def python_sdk_python() -> Path:
    """The interpreter of a virtual environment holding the pinned Python SDK (built on first use).

    Skips the calling test when the SDK cannot be installed (no network and no cached build)."""
    return _skip_unless_built("python", build_python_sdk)


def build_python_sdk() -> Path:
    """Build (once) the Python SDK's virtual environment and return its interpreter; SdkUnavailable if it cannot be
    installed. Used by the tests and by benchmarks/rocketmq_sdk.py."""
    name, version = PYTHON_SDK
    return _python_env(name, version, (), "import rocketmq, rocketmq.grpc_protocol", "offline?", "does not import")


def remoting_python() -> Path:
    """The interpreter of a virtual environment holding PyPI's `rocketmq` (RocketMQ 4's C++ client), built on first use.

    Skips the calling test when it cannot be installed (no network and no cached build)."""
    return _skip_unless_built("remoting-python", build_remoting_python)


def build_remoting_python() -> Path:
    name, version = REMOTING_PYTHON_CLIENT
    return _python_env(name, version, ("--only-binary", ":all:"), "import rocketmq.client",
                       "offline, or no wheel for this platform?", "does not load librocketmq")


def remoting_tx_python() -> Path:
    """The interpreter of a virtual environment holding rocketmq-client-python 2.0.0 with rocketmq-python-cvs's
    librocketmq.so (RocketMQ 4's TransactionMQProducer), built on first use; skips when it cannot be installed."""
    return _skip_unless_built("remoting-tx-python", build_remoting_tx_python)


def build_remoting_tx_python() -> Path:
    name, version = REMOTING_TX_PYTHON_CLIENT
    lib_name, lib_version = REMOTING_TX_PYTHON_LIBRARY
    python = _python_env(name, version, (), "import importlib.util; assert importlib.util.find_spec('rocketmq.ffi')",
                         "offline?", "is not the binding")
    env_dir = python.parent.parent
    with _locked(env_dir.name):
        lib_marker = env_dir / f".{lib_name}-{lib_version}"
        if not lib_marker.exists():
            import tarfile
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                pip_env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
                pip_env.pop("PYTHONPATH", None)
                r = subprocess.run([str(python), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", tmp,
                                    f"{lib_name}=={lib_version}"], capture_output=True, timeout=900, env=pip_env)
                if r.returncode != 0:
                    raise SdkUnavailable(f"cannot download {lib_name}=={lib_version} (offline?): {_errors(r.stderr)}")
                [archive] = Path(tmp).glob("*.tar.gz")
                member = f"{archive.name[:-len('.tar.gz')]}/rocketmq/librocketmq.so"
                r = subprocess.run([str(python), "-c", "import importlib.util, os; "
                                    "print(os.path.dirname(importlib.util.find_spec('rocketmq').origin))"],
                                   capture_output=True, timeout=60, check=True)
                target = Path(r.stdout.decode().strip()) / "librocketmq.so"
                with tarfile.open(archive) as tar:
                    src = tar.extractfile(member)
                    assert src is not None, f"{archive.name} holds no {member}"
                    with src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst)
            r = subprocess.run([str(python), "-c", "from rocketmq.client import TransactionMQProducer"], capture_output=True, timeout=120)
            assert r.returncode == 0, f"{name}=={version} with {lib_name}'s library does not load: {_tail(r.stderr)}"
            lib_marker.write_text(f"{lib_name}=={lib_version}\n")
    return python


def remoting_python_scenario(python: Path, scenario: str, home: Path, *args: str, timeout: float = 150) -> dict:
    return run_scenario([str(python), str(SCENARIOS / "remoting_python_scenario.py"), scenario, *args], home, timeout)


def remoting_node_dir() -> Path:
    """A directory whose node_modules holds npm's ali-ons (installed on first use); skips without node/npm or the package."""
    return _skip_unless_built("remoting-node", build_remoting_node)


def build_remoting_node() -> Path:
    name, version = REMOTING_NODE_CLIENT
    npm = shutil.which("npm")
    if not shutil.which("node") or not npm:
        raise SdkUnavailable("node and npm are needed for ali-ons")
    return _npm_env(name, version, "txmq-remoting-tests", npm, None)


def remoting_node_scenario(sdk_dir: Path, scenario: str, home: Path, *args: str, timeout: float = 150) -> dict:
    env_node = shutil.which("node") or "node"
    return run_scenario([env_node, str(SCENARIOS / "remoting_node_scenario.js"), scenario, "--sdk", str(sdk_dir), *args], home, timeout)


def start_remoting_broker(root: Path, *args: str, name: str = "broker"):
    """A txmq broker subprocess that also serves RocketMQ 4's remoting protocol; returns (BrokerProcess, "127.0.0.1:PORT"),
    the address 4.x clients take as their namesrvAddr."""
    broker, port = start_broker_with_port(root, "--remoting-port", args, name)
    return broker, f"127.0.0.1:{port}"


def start_broker_with_port(root: Path, option: str, args: tuple[str, ...], name: str):
    """A broker subprocess (tests/clihelpers.py) serving ``option`` (--remoting-port, --rocketmq-port) on a free port,
    and that port: picked again when another process bound it between its picking and the broker's start."""
    from brokerproc import free_port, port_taken
    from clihelpers import start_broker

    for attempt in range(3):
        port = free_port()
        try:
            broker = start_broker(root, option, str(port), *args, name=name if attempt == 0 else f"{name}-again-{attempt}")
        except RuntimeError as exc:
            if port_taken(str(exc)) != option or attempt == 2:
                raise
            continue
        try:
            wait_for_port(port)
        except TimeoutError:
            broker.stop()
            raise
        return broker, port
    raise AssertionError("unreachable")


def node_sdk_dir() -> Path:
    """A directory whose node_modules holds the pinned Node.js SDK (installed on first use).

    Skips the calling test when `node`/`npm` are missing or the package cannot be installed."""
    return _skip_unless_built("node", build_node_sdk)


def build_node_sdk() -> Path:
    """Install (once) the Node.js SDK and return its directory; SdkUnavailable if it cannot be installed."""
    name, version = NODE_SDK
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        raise SdkUnavailable("node and npm are needed for the Node.js SDK")
    r = subprocess.run([node, "-e", "process.stdout.write(process.versions.node)"], capture_output=True, timeout=60)
    major = int((r.stdout.decode() or "0").split(".")[0] or 0)
    if major < 18:
        raise SdkUnavailable(f"{name} needs Node.js 18 or newer (found {r.stdout.decode() or 'none'})")
    return _npm_env(name, version, "txmq-sdk-tests", npm, node)


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on 127.0.0.1:{port}") from None
            time.sleep(0.05)


def _sdk_logs(home: Path) -> str:
    out = []
    for log in sorted(home.glob("logs/**/*.log")):
        out.append(f"--- {log.relative_to(home)} (last lines)\n{_tail(log.read_text(errors='replace'), 4000)}")
    return "\n".join(out)


def run_scenario(argv: list[str], home: Path, timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None,
                 allow_errors: bool = False) -> dict:
    """Run one scenario process (HOME is a temporary directory: both SDKs write their logs under ~/logs) and
    return its JSON result. A scenario that reports errors, dies or prints no JSON fails the test, with the
    SDK's own log attached (with allow_errors, a scenario that failed but reported is returned: its "errors")."""
    home.mkdir(parents=True, exist_ok=True)
    penv = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "NODE_"))}
    penv.update(HOME=str(home), PYTHONUNBUFFERED="1", **(env or {}))
    try:
        r = subprocess.run(argv, capture_output=True, timeout=timeout, env=penv, cwd=cwd or home)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"scenario {argv[1:3]} did not finish in {timeout}s\nstdout: {_tail(e.stdout or b'')}\n"
                    f"stderr: {_tail(e.stderr or b'')}\n{_sdk_logs(home)}")
    stdout = r.stdout.decode(errors="replace")
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    result = None
    if lines:
        try:
            result = json.loads(lines[-1])
        except ValueError:
            result = None
    if result is not None and allow_errors:
        result["_sdk_log"] = _sdk_logs(home)
        return result
    if r.returncode != 0 or result is None or result.get("errors"):
        pytest.fail(f"scenario {argv[1:3]} failed (exit {r.returncode}): "
                    f"{json.dumps(result, indent=1) if result else _tail(stdout)}\n"
                    f"stderr: {_tail(r.stderr, 3000)}\n{_sdk_logs(home)}")
    result["_sdk_log"] = _sdk_logs(home)
    return result


def python_scenario(python: Path, scenario: str, home: Path, *args: str, timeout: float = 150, env: dict[str, str] | None = None,
                    allow_errors: bool = False) -> dict:
    return run_scenario([str(python), str(SCENARIOS / "python_scenario.py"), scenario, *args], home, timeout, env=env,
                        allow_errors=allow_errors)


def node_scenario(sdk_dir: Path, scenario: str, home: Path, *args: str, timeout: float = 150, env: dict[str, str] | None = None,
                  allow_errors: bool = False) -> dict:
    env_node = shutil.which("node") or "node"
    return run_scenario([env_node, str(SCENARIOS / "node_scenario.js"), scenario, "--sdk", str(sdk_dir), *args], home, timeout,
                        env=env, allow_errors=allow_errors)


def start_rocketmq_broker(root: Path, *args: str, name: str = "broker"):
    """A txmq broker subprocess (short check settings, tests/clihelpers.py) that also serves the RocketMQ gRPC front
    end; returns (BrokerProcess, "127.0.0.1:GRPC_PORT"). Skips when txmq's `rocketmq` extra is not installed."""
    import importlib.util

    missing = [m for m in ("grpc", "google.protobuf") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"txmq's rocketmq extra is not installed (no {', '.join(missing)}): pip install -e '.[rocketmq]'")
    workers = os.environ.get("TXMQ_TEST_FRONTEND_PROCESSES")  # run a suite through front-end workers (make test-workers)
    if workers and "--frontend-processes" not in args:
        args = ("--frontend-processes", workers, *args)
    broker, grpc_port = start_broker_with_port(root, "--rocketmq-port", args, name)
    return broker, f"127.0.0.1:{grpc_port}"


def create_topics(broker, *topics: str, message_types: str | None = None) -> None:
    """Create topics on a broker process (`txmq topics create`), as an operator does before RocketMQ 5's clients use
    them: like RocketMQ 5, txmq answers a route, assignment or send of a topic it does not know TOPIC_NOT_FOUND."""
    from clihelpers import ok, txmq

    for t in topics:
        ok(txmq("topics", "create", t, *(("--message-types", message_types) if message_types else ()), broker=broker.address))


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (openssl), for --rocketmq-tls-cert/--rocketmq-tls-key; the SDKs
    trust it through GRPC_DEFAULT_SSL_ROOTS_FILE_PATH (Python) or NODE_EXTRA_CA_CERTS (Node.js)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return cert, key
