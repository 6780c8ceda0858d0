"""A real Apache RocketMQ 4.9.8 beside the tests: the name server and broker, its Java client, and Apache's mqadmin.

The peer is ``../shared/peers/rocketmq-4.9.8`` next to the repository (``TXMQ_ROCKETMQ_PEER`` elsewhere): its
``setup.sh`` lays out a runnable copy (Debian's Java jars, installed by apt-get as root; `.ci/run` runs it) and
its ``run.sh`` starts and stops the two JVMs on loopback ports. Tests marked ``rocketmq_peer`` use the
session's one instance (``rocketmq_peer`` fixture, conftest.py): started once, with small heaps, and stopped
at the end of the session. Where the folder, Java or the jars are missing, they are skipped, saying which.

``RocketMQPeer.mqadmin(namesrv, ...)`` runs Apache's mqadmin against any name server (the peer's, or a txmq
broker's --remoting-port); ``RocketMQPeer.driver(namesrv, scenario, ...)`` runs one scenario of
tests/java/RmqDriver.java through Apache's Java client and returns its outcome.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
def _peer_dir() -> Path:
    """TXMQ_ROCKETMQ_PEER, else ../shared/peers/rocketmq-4.9.8 beside the repository, else the workplace's /work/shared copy."""
    if os.environ.get("TXMQ_ROCKETMQ_PEER"):
        return Path(os.environ["TXMQ_ROCKETMQ_PEER"])
    beside = REPO.parent / "shared" / "peers" / "rocketmq-4.9.8"
    fixed = Path("/work/shared/peers/rocketmq-4.9.8")
    return beside if beside.is_dir() or not fixed.is_dir() else fixed


PEER_DIR = _peer_dir()
DRIVER = Path(__file__).resolve().parent / "java" / "RmqDriver.java"
ADMIN_SHELL = Path(__file__).resolve().parent / "java" / "AdminShell.java"
# The peer's broker: checks of transactions every 2 s for halves older than 1 s (RocketMQ's defaults: 60 s, 6 s), and
# delay levels of 1 s but the last, 1 h (a consumer's retries wait levels 3, 4, ...), so that check-back and retry
# scenarios end in seconds; the JVMs small, on two shared cores. A txmq compared with it runs with the same. SQL92
# subscriptions served (enablePropertyFilter), as txmq serves them.
DELAY_LEVELS = " ".join(["1s"] * 17 + ["1h"])
BROKER_SETTINGS = ("transactionCheckInterval=2000", "transactionTimeOut=1000", f"messageDelayLevel={DELAY_LEVELS}",
                   "enablePropertyFilter=true")
HEAP = "256m"


class PeerUnavailable(Exception):
    """Why the peer cannot run here (the tests that need it are skipped with this reason)."""


class RocketMQPeer:
    def __init__(self, build_dir: Path, peer_dir: Path = PEER_DIR, run_dir: Path | None = None) -> None:
        self.peer_dir = peer_dir
        self.build_dir = Path(build_dir)
        self.env = {**os.environ, "RMQ_BUILD_DIR": str(self.build_dir)}
        if run_dir is not None:  # a second instance from the same build (run.sh: one instance per run dir)
            self.env["RMQ_RUN_DIR"] = str(run_dir)
        self.namesrv = ""
        self.broker = ""
        self.broker_pid = 0
        self.started = False
        self._shell: subprocess.Popen | None = None  # AdminShell: mqadmin's commands in one JVM, started at first use
        self._shell_lock = threading.Lock()

    # ---- set-up ------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Lay out the peer (setup.sh) and compile the scenario driver; PeerUnavailable when it cannot run here."""
        if not (self.peer_dir / "run.sh").is_file():
            raise PeerUnavailable(f"no RocketMQ 4.9.8 peer at {self.peer_dir} (set TXMQ_ROCKETMQ_PEER to its folder)")
        for tool in ("java", "javac"):
            if shutil.which(tool) is None:
                raise PeerUnavailable(f"{tool} not found: the RocketMQ 4.9.8 peer needs a JDK")
        r = self._run([str(self.peer_dir / "setup.sh"), str(self.build_dir)], timeout=600)
        if r.returncode != 0:
            raise PeerUnavailable(f"the RocketMQ 4.9.8 peer's setup.sh failed: {_tail(r)}")
        bench = self.build_dir / "bench"
        r = self._run(["javac", "-nowarn", "-cp", f"{self.build_dir}/dist/lib/*", "-d", str(bench), str(DRIVER), str(ADMIN_SHELL)],
                      timeout=300)
        if r.returncode != 0:
            raise PeerUnavailable(f"tests/java/{{RmqDriver,AdminShell}}.java do not compile against the peer's jars: {_tail(r)}")

    def start(self, *settings: str, clean: bool = True) -> None:
        """Boots the name server and broker with BROKER_SETTINGS and then ``settings`` (broker.conf lines; the last wins).
        clean: on an empty store (else on the one the last stop left: a restart)."""
        args = [str(self.peer_dir / "run.sh"), "start", "-n", "auto", "-b", "auto", "-H", HEAP, *(["--clean"] if clean else [])]
        for kv in (*BROKER_SETTINGS, *settings):
            args += ["-c", kv]
        for attempt in range(3):
            r = self._run(args, timeout=300)
            text = r.stdout.decode(errors="replace")
            m = re.search(r"NAMESRV=(\S+)", text)
            b = re.search(r"BROKER=(\S+) .*broker_pid=(\d+)", text)
            if r.returncode == 0 and m and b:
                break
            self.stop()
            # "auto" ports are free when run.sh picks them, but another test's process may bind one before the JVM
            # does (the suite runs on several workers): picked again; anything else is why the peer cannot run here
            if "bind" not in _tail(r).lower() or attempt == 2:
                raise PeerUnavailable(f"the RocketMQ 4.9.8 peer did not start: {_tail(r)}")
        self.namesrv, self.broker, self.broker_pid = m.group(1), b.group(1), int(b.group(2))
        self.started = True

    def stop(self) -> None:
        self._close_shell()
        self._run([str(self.peer_dir / "run.sh"), "stop"], timeout=120)
        self.started = False

    # ---- clients -----------------------------------------------------------------------------------
    def mqadmin(self, namesrv: str, sub: str, *args: str, timeout: float = 180) -> str:
        """Apache's ``mqadmin SUB -n NAMESRV ARGS``: what it prints (stdout and stderr).

        The commands run one after the other in one JVM (tests/java/AdminShell.java), as mqadmin's own main runs
        each: a JVM per command spent 2-4 s starting for a command of a few hundred milliseconds."""
        line = "\t".join((sub, "-n", namesrv, *args))
        if "\n" in line:
            raise ValueError(f"an mqadmin argument holds a line break: {line!r}")
        with self._shell_lock:
            shell = self._shell if self._shell is not None and self._shell.poll() is None else self._open_shell()
            try:
                shell.stdin.write(line.encode() + b"\n")
                shell.stdin.flush()
                return self._reply(shell, time.monotonic() + timeout, line).decode(errors="replace")
            except BaseException:
                self._close_shell()  # a command that did not answer: the next one gets a new JVM
                raise

    def _open_shell(self) -> subprocess.Popen:
        self._close_shell()
        env = {**self.env, "JDK_JAVA_OPTIONS": "-Djava.security.manager=allow"}  # AdminShell turns System.exit into an exception
        log = open(self.build_dir / "admin-shell.log", "ab")  # the JVM's own warnings
        try:
            self._shell = subprocess.Popen([str(self.peer_dir / "run.sh"), "java", "AdminShell"], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=log, env=env)
        finally:
            log.close()
        self._pending = bytearray()
        return self._shell

    def _reply(self, shell: subprocess.Popen, deadline: float, line: str) -> bytes:
        """One command's ``LEN <bytes> <status>`` line and the bytes it announces."""
        fd = shell.stdout.fileno()
        need: int | None = None
        while True:
            if need is None and b"\n" in self._pending:
                head, _, rest = bytes(self._pending).partition(b"\n")
                m = re.fullmatch(rb"LEN (\d+) (-?\d+)", head)
                if not m:
                    raise RuntimeError(f"AdminShell answered {head[:200]!r} to {line!r}")
                need = int(m.group(1))
                self._pending = bytearray(rest)
            if need is not None and len(self._pending) >= need:
                out, self._pending = bytes(self._pending[:need]), self._pending[need:]
                return out
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(["mqadmin", *line.split("\t")], 0)
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    log = (self.build_dir / "admin-shell.log").read_bytes()[-2000:].decode(errors="replace")
                    raise RuntimeError(f"AdminShell ended during {line!r}: {log}")
                self._pending += chunk

    def _close_shell(self) -> None:
        shell, self._shell = getattr(self, "_shell", None), None
        if shell is None:
            return
        try:
            shell.stdin.close()
            shell.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            shell.kill()
            shell.wait()
        shell.stdout.close()

    def java_command(self, namesrv: str, scenario: str, **props: object) -> list[str]:
        defs = [f"-D{k}={v}" for k, v in {"namesrv": namesrv, **props}.items()]
        return [str(self.peer_dir / "run.sh"), "java", *defs, "RmqDriver", scenario]

    def driver(self, namesrv: str, scenario: str, timeout: float = 300, **props: object) -> dict:
        """One scenario of RmqDriver through Apache's Java client: its RESULT."""
        r = self._run(self.java_command(namesrv, scenario, **props), timeout=timeout, NAMESRV=namesrv)
        return result_of(r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace"))

    def popen(self, namesrv: str, scenario: str, **props: object) -> subprocess.Popen:
        """A scenario that runs until its standard input closes (``hold``): the caller closes it and waits."""
        return subprocess.Popen(self.java_command(namesrv, scenario, **props), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={**self.env, "NAMESRV": namesrv})

    def _run(self, args: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(args, capture_output=True, timeout=timeout, env={**self.env, **env}, stdin=subprocess.DEVNULL)


def result_of(stdout: str, stderr: str = "") -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"the driver printed no RESULT:\n{stdout[-3000:]}\n{stderr[-3000:]}")


def _tail(r: subprocess.CompletedProcess) -> str:
    text = (r.stdout + r.stderr).decode(errors="replace").strip()
    return text[-600:] or f"exit {r.returncode}"


_session: dict[str, object] = {}


@pytest.fixture(scope="session")
def rocketmq_peer():
    """The session's RocketMQ 4.9.8 (name server + broker), started at its first use and stopped at the end."""
    if "skip" in _session:
        pytest.skip(str(_session["skip"]))
    build = Path(tempfile.mkdtemp(prefix="txmq-rocketmq-peer-"))
    peer = RocketMQPeer(build)
    try:
        peer.prepare()
        peer.start()
    except (PeerUnavailable, subprocess.TimeoutExpired) as exc:
        _session["skip"] = exc
        shutil.rmtree(build, ignore_errors=True)
        pytest.skip(str(exc))
    try:
        yield peer
    finally:
        peer.stop()
        shutil.rmtree(build, ignore_errors=True)


class TxmqRemoting:
    """A txmq broker (a `txmq broker start` process) serving RocketMQ 4's protocol on --remoting-port: the name
    server address the same Java clients are pointed at."""

    def __init__(self, data_dir: Path, *args: str) -> None:
        self.data_dir, self.args = data_dir, args
        self._pick_ports()
        self.address = ""  # the native port, for `txmq` commands

    def _pick_ports(self) -> None:
        from brokerproc import BrokerProcess, free_port

        self.remoting_port = free_port()
        self.proc = BrokerProcess(self.data_dir, "--remoting-port", str(self.remoting_port), *self.args)
        self.namesrv = f"127.0.0.1:{self.remoting_port}"

    def __enter__(self) -> "TxmqRemoting":
        from brokerproc import port_taken

        for attempt in range(3):
            try:
                self.proc.start()
                break
            except RuntimeError as exc:
                self.proc.stop()
                # free when picked, bound by another process before the broker: both ports picked again
                if attempt == 2 or port_taken(str(exc)) is None:
                    raise
                self._pick_ports()
        self.address = self.proc.address
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.stop()
